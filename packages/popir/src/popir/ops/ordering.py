"""Order-dependent primitives: cumulative sums and sorting (with topk/argsort as composites)."""

import numpy as np

from popir.dtypes import DType
from popir.errors import IRError
from popir.graph import TensorType
from popir.ops._infer import norm_axes
from popir.ops.base import zeros_like
from popir.ops.movement import scatter_add, slice_
from popir.registry import defop


def _axis(x, axis):
    (a,) = norm_axes((axis,), len(x.shape))
    return a


def _cumsum_infer(x, axis, reverse=False):
    if not x.shape:
        raise IRError("cumsum needs a tensor of rank >= 1")
    _axis(x, axis)
    return x


def _cumsum_ref(x, axis, reverse=False):
    acc = np.float32 if x.dtype == np.float16 else x.dtype
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis=axis, dtype=acc), axis).astype(x.dtype)
    return np.cumsum(x, axis=axis, dtype=acc).astype(x.dtype)


cumsum = defop(
    "cumsum",
    infer=_cumsum_infer,
    ref=_cumsum_ref,
    vjp=lambda ins, outs, cts, axis, reverse=False: (cumsum(cts[0], axis=axis, reverse=not reverse),),
    doc="Inclusive running sum along ``axis`` (from the end when ``reverse``).",
)


def _sort_infer(x, axis, descending):
    if not x.shape:
        raise IRError("sort needs a tensor of rank >= 1")
    _axis(x, axis)
    return x, TensorType(x.shape, DType.int32)


def _sort_ref(x, axis, descending):
    keys = -x if descending and x.dtype != np.bool_ else x
    order = np.argsort(~keys if descending and x.dtype == np.bool_ else keys, axis=axis, kind="stable")
    return np.take_along_axis(x, order, axis=axis), order.astype(np.int32)


def _sort_vjp(ins, outs, cts, axis, descending):
    x = ins[0]
    return (scatter_add(zeros_like(x), outs[1], cts[0], axis=axis),)


sort = defop(
    "sort",
    infer=_sort_infer,
    ref=_sort_ref,
    vjp=_sort_vjp,
    doc="Stable sort along ``axis``: (values, int32 indices), like torch.sort(stable=True).",
)


def topk(x, k, axis=-1, largest=True):
    """torch.topk (sorted): the k largest (or smallest) values and their int32 indices along ``axis``."""
    values, indices = sort(x, axis=axis, descending=bool(largest))
    a = _axis(x.type, axis)
    stops = tuple(k if i == a else d for i, d in enumerate(x.shape))
    starts = (0,) * x.ndim
    return slice_(values, starts=starts, stops=stops), slice_(indices, starts=starts, stops=stops)


def argsort(x, axis=-1, descending=False):
    """torch.argsort (stable): int32 indices that sort ``x`` along ``axis``."""
    return sort(x, axis=axis, descending=descending)[1]

"""Reductions beyond ``reduce_sum``: max, min and the index of the max/min along an axis."""

import numpy as np

from popir.dtypes import DType
from popir.errors import IRError
from popir.graph import TensorType
from popir.ops._infer import norm_axes, reduce_infer
from popir.ops.base import broadcast_to, reduce_sum, reshape
from popir.ops.elementwise import cast, eq, ne, where
from popir.registry import defop


def _kept_shape(x, axes):
    axes = norm_axes(axes, x.ndim)
    return tuple(1 if i in axes else d for i, d in enumerate(x.shape))


def _extremum_vjp(ins, outs, cts, axes, keepdims):
    # torch's amax/amin gradient: shared evenly among the elements that attain the extremum.
    x = ins[0]
    kept = _kept_shape(x, axes)
    hit = cast(eq(x, broadcast_to(reshape(outs[0], shape=kept), shape=x.shape)), dtype=x.dtype)
    count = reduce_sum(hit, axes=axes, keepdims=True)
    share = reshape(cts[0], shape=kept) / count
    return (hit * broadcast_to(share, shape=x.shape),)


def _extremum_infer(x, axes, keepdims):
    if x.size == 0:
        raise IRError(f"cannot reduce an empty tensor {list(x.shape)}")
    return reduce_infer(x, axes, keepdims)


reduce_max = defop(
    "reduce_max",
    infer=_extremum_infer,
    ref=lambda x, axes, keepdims: np.max(x, axis=norm_axes(axes, x.ndim), keepdims=keepdims),
    vjp=_extremum_vjp,
    doc="Max over ``axes`` (None: all); ties share the gradient evenly, like torch.amax.",
)
reduce_min = defop(
    "reduce_min",
    infer=_extremum_infer,
    ref=lambda x, axes, keepdims: np.min(x, axis=norm_axes(axes, x.ndim), keepdims=keepdims),
    vjp=_extremum_vjp,
    doc="Min over ``axes`` (None: all); ties share the gradient evenly, like torch.amin.",
)


def _arg_infer(x, axis, keepdims):
    if axis is None:
        shape = (1,) * len(x.shape) if keepdims else ()
    else:
        (a,) = norm_axes((axis,), len(x.shape))
        shape = tuple(1 if i == a else d for i, d in enumerate(x.shape) if keepdims or i != a)
    if x.size == 0:
        raise IRError(f"cannot take the arg-extremum of an empty tensor {list(x.shape)}")
    return TensorType(shape, DType.int32)


def _arg_ref(fn):
    def ref(x, axis, keepdims):
        if axis is None:
            index = fn(x.reshape(-1)).reshape((1,) * x.ndim if keepdims else ())
        else:
            index = fn(x, axis=norm_axes((axis,), x.ndim)[0], keepdims=keepdims)
        return np.asarray(index, np.int32)

    return ref


argmax = defop(
    "argmax",
    infer=_arg_infer,
    ref=_arg_ref(np.argmax),
    differentiable=False,
    doc="Index (int32) of the first maximum along ``axis`` (None: of the flattened tensor).",
)
argmin = defop(
    "argmin",
    infer=_arg_infer,
    ref=_arg_ref(np.argmin),
    differentiable=False,
    doc="Index (int32) of the first minimum along ``axis`` (None: of the flattened tensor).",
)


def _prod_vjp(ins, outs, cts, axes, keepdims):
    # d prod / d x_i = prod / x_i; at exact zeros this form gives 0 (torch gives the product of the others).
    x = ins[0]
    kept = _kept_shape(x, axes)
    zero = broadcast_to(x.graph.constant(np.zeros((), x.dtype.numpy)), shape=x.shape)
    nonzero = ne(x, zero)
    safe = where(nonzero, x, broadcast_to(x.graph.constant(np.ones((), x.dtype.numpy)), shape=x.shape))
    share = broadcast_to(reshape(cts[0] * outs[0], shape=kept), shape=x.shape) / safe
    return (where(nonzero, share, zero),)


reduce_prod = defop(
    "reduce_prod",
    infer=reduce_infer,
    ref=lambda x, axes, keepdims: np.prod(
        x, axis=norm_axes(axes, x.ndim), keepdims=keepdims, dtype=np.float32 if x.dtype == np.float16 else None
    ).astype(x.dtype),
    vjp=_prod_vjp,
    doc="Product over ``axes`` (None: all). Its gradient is 0 at exact zeros (torch: product of the others).",
)

"""Data movement primitives: transpose, slice, concat, pad, gather/scatter and take_along_axis."""

import numpy as np

from popir.dtypes import DType
from popir.errors import IRError
from popir.graph import TensorType
from popir.ops._infer import norm_axes, same_dtype
from popir.ops.base import broadcast_to, full, reshape, zeros_like
from popir.registry import defop


# -- transpose ------------------------------------------------------------------------------------
def _transpose_infer(x, perm):
    if sorted(perm) != list(range(len(x.shape))):
        raise IRError(f"perm {tuple(perm)} is not a permutation of the {len(x.shape)} axes of {list(x.shape)}")
    return TensorType(tuple(x.shape[p] for p in perm), x.dtype)


transpose = defop(
    "transpose",
    infer=_transpose_infer,
    ref=lambda x, perm: np.transpose(x, perm),
    vjp=lambda ins, outs, cts, perm: (transpose(cts[0], perm=tuple(np.argsort(perm))),),
    doc="Permute axes: output axis i is input axis perm[i].",
)


# -- slice ----------------------------------------------------------------------------------------
def slice_bounds(shape, starts, stops, steps):
    """Per axis (start, stop, step, length) after Python-style clamping; steps must be positive."""
    steps = (1,) * len(shape) if steps is None else tuple(steps)
    if not (len(starts) == len(stops) == len(steps) == len(shape)):
        raise IRError(f"slice needs one start/stop/step per axis of {list(shape)}")
    bounds = []
    for d, a, b, s in zip(shape, starts, stops, steps):
        if s < 1:
            raise IRError(f"slice steps must be positive, got {s}")
        a, b, s = slice(a, b, s).indices(d)
        bounds.append((a, b, s, len(range(a, b, s))))
    return bounds


def _slice_infer(x, starts, stops, steps=None):
    return TensorType(tuple(n for *_, n in slice_bounds(x.shape, starts, stops, steps)), x.dtype)


def _slice_ref(x, starts, stops, steps=None):
    return x[tuple(slice(a, b, s) for a, b, s, _ in slice_bounds(x.shape, starts, stops, steps))]


def _slice_vjp(ins, outs, cts, starts, stops, steps=None):
    x = ins[0]
    ct = cts[0]
    for axis, (a, _, s, n) in enumerate(slice_bounds(x.shape, starts, stops, steps)):
        if s > 1 and n > 0:
            # Interleave s-1 zeros after each element: stack with zeros on a new axis, then merge.
            shape = ct.shape
            ct = reshape(ct, shape=shape[: axis + 1] + (1,) + shape[axis + 1 :])
            gap = full(x.graph, shape[: axis + 1] + (s - 1,) + shape[axis + 1 :], 0, ct.dtype)
            ct = concat(ct, gap, axis=axis + 1)
            ct = reshape(ct, shape=shape[:axis] + (n * s,) + shape[axis + 1 :])
            ct = slice_(
                ct,
                starts=(0,) * ct.ndim,
                stops=tuple(n * s - s + 1 if i == axis else d for i, d in enumerate(ct.shape)),
            )
        pads = tuple((a, x.shape[axis] - a - ct.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim))
        if any(lo or hi for lo, hi in pads):
            ct = pad(ct, pads=pads, value=0.0)
    return (ct,)


slice_ = defop(
    "slice",
    infer=_slice_infer,
    ref=_slice_ref,
    vjp=_slice_vjp,
    doc="x[starts:stops:steps] per axis (Python clamping, positive steps; steps=None means 1).",
)


def _slice_update_infer(x, update, starts, stops, steps=None):
    region = _slice_infer(x, starts, stops, steps)
    if update.shape != region.shape or update.dtype != x.dtype:
        raise IRError(f"slice_update needs an update of {region}, got {update}")
    return x


def _slice_update_ref(x, update, starts, stops, steps=None):
    out = x.copy()
    out[tuple(slice(a, b, s) for a, b, s, _ in slice_bounds(x.shape, starts, stops, steps))] = update
    return out


slice_update = defop(
    "slice_update",
    infer=_slice_update_infer,
    ref=_slice_update_ref,
    vjp=lambda ins, outs, cts, starts, stops, steps=None: (
        slice_update(cts[0], zeros_like(ins[1]), starts=starts, stops=stops, steps=steps),
        slice_(cts[0], starts=starts, stops=stops, steps=steps),
    ),
    doc="A copy of x with its slice x[starts:stops:steps] (as ``slice``) replaced by ``update``.",
)


# -- concat ---------------------------------------------------------------------------------------
def _concat_infer(*xs, axis):
    if not xs:
        raise IRError("concat needs at least one input")
    dtype = same_dtype(*xs)
    ndim = len(xs[0].shape)
    (a,) = norm_axes((axis,), ndim)
    for t in xs:
        if len(t.shape) != ndim or any(d != e for i, (d, e) in enumerate(zip(t.shape, xs[0].shape)) if i != a):
            raise IRError(f"shapes {' and '.join(str(list(t.shape)) for t in xs)} do not concatenate on axis {axis}")
    shape = list(xs[0].shape)
    shape[a] = sum(t.shape[a] for t in xs)
    return TensorType(tuple(shape), dtype)


def _concat_vjp(ins, outs, cts, axis):
    (a,) = norm_axes((axis,), ins[0].ndim)
    grads, offset = [], 0
    for x in ins:
        starts = tuple(offset if i == a else 0 for i in range(x.ndim))
        stops = tuple(offset + d if i == a else d for i, d in enumerate(x.shape))
        grads.append(slice_(cts[0], starts=starts, stops=stops))
        offset += x.shape[a]
    return tuple(grads)


concat = defop(
    "concat",
    infer=_concat_infer,
    ref=lambda *xs, axis: np.concatenate(xs, axis=axis),
    vjp=_concat_vjp,
    doc="Join inputs along ``axis``.",
)


# -- pad ------------------------------------------------------------------------------------------
def _pad_infer(x, pads, value=0.0):
    if len(pads) != len(x.shape) or any(len(p) != 2 or min(p) < 0 for p in pads):
        raise IRError(f"pads {pads} must hold one non-negative (lo, hi) pair per axis of {list(x.shape)}")
    return TensorType(tuple(d + lo + hi for d, (lo, hi) in zip(x.shape, pads)), x.dtype)


def _pad_vjp(ins, outs, cts, pads, value=0.0):
    x = ins[0]
    starts = tuple(lo for lo, _ in pads)
    stops = tuple(lo + d for (lo, _), d in zip(pads, x.shape))
    return (slice_(cts[0], starts=starts, stops=stops),)


pad = defop(
    "pad",
    infer=_pad_infer,
    ref=lambda x, pads, value=0.0: np.pad(x, pads, constant_values=np.array(value).astype(x.dtype)),
    vjp=_pad_vjp,
    doc="Constant padding: ``pads`` is one (lo, hi) pair per axis.",
)


# -- gather / scatter_add / take_along_axis --------------------------------------------------------
def _index_dtype(t):
    if t.dtype != DType.int32:
        raise IRError(f"indices must be int32, got {t.dtype}")


def _gather_infer(x, indices, axis):
    _index_dtype(indices)
    (a,) = norm_axes((axis,), len(x.shape))
    return TensorType(x.shape[:a] + indices.shape + x.shape[a + 1 :], x.dtype)


def _gather_ref(x, indices, axis):
    _check_range(indices, x.shape[axis])
    return np.take(x, indices, axis=axis)


def _check_range(indices, size):
    if indices.size and (indices.min() < -size or indices.max() >= size):
        raise IRError(f"index out of range for an axis of size {size}: [{indices.min()}, {indices.max()}]")


def _gather_vjp(ins, outs, cts, axis):
    x, indices = ins
    (a,) = norm_axes((axis,), x.ndim)
    n = indices.type.size
    flat_shape = x.shape[:a] + (n,) + x.shape[a + 1 :]
    ct = reshape(cts[0], shape=flat_shape)
    idx = reshape(indices, shape=tuple(n if i == a else 1 for i in range(x.ndim)))
    idx = broadcast_to(idx, shape=flat_shape)
    return scatter_add(zeros_like(x), idx, ct, axis=a), None


gather = defop(
    "gather",
    infer=_gather_infer,
    ref=_gather_ref,
    vjp=_gather_vjp,
    doc="np.take / torch.index_select: x.shape[:axis] + indices.shape + x.shape[axis+1:] (embedding lookup).",
)


def _along_check(x, indices, axis, what):
    _index_dtype(indices)
    if len(indices.shape) != len(x.shape):
        raise IRError(f"{what} indices {list(indices.shape)} must have the rank of {list(x.shape)}")
    (a,) = norm_axes((axis,), len(x.shape))
    for i, (d, e) in enumerate(zip(indices.shape, x.shape)):
        if i != a and d != e:
            raise IRError(f"{what} indices {list(indices.shape)} must match {list(x.shape)} except on axis {axis}")
    return a


def _take_along_infer(x, indices, axis):
    _along_check(x, indices, axis, "take_along_axis")
    return TensorType(indices.shape, x.dtype)


def _take_along_ref(x, indices, axis):
    _check_range(indices, x.shape[axis])
    return np.take_along_axis(x, indices, axis=axis)


take_along_axis = defop(
    "take_along_axis",
    infer=_take_along_infer,
    ref=_take_along_ref,
    vjp=lambda ins, outs, cts, axis: (
        scatter_add(zeros_like(ins[0]), ins[1], cts[0], axis=axis),
        None,
    ),
    doc="torch.gather: out[..., j, ...] = x[..., indices[..., j, ...], ...] along ``axis``.",
)


def _scatter_add_infer(x, indices, updates, axis):
    _along_check(x, indices, axis, "scatter_add")
    if updates.shape != indices.shape or updates.dtype != x.dtype:
        raise IRError(f"scatter_add updates {updates} must have the shape of indices {list(indices.shape)}")
    return x


def _scatter_add_ref(x, indices, updates, axis):
    _check_range(indices, x.shape[axis])
    out = x.copy()
    index = list(np.indices(indices.shape, sparse=True))
    index[axis] = indices
    np.add.at(out, tuple(index), updates)
    return out


scatter_add = defop(
    "scatter_add",
    infer=_scatter_add_infer,
    ref=_scatter_add_ref,
    vjp=lambda ins, outs, cts, axis: (cts[0], None, take_along_axis(cts[0], ins[1], axis=axis)),
    doc="torch.scatter_add: a copy of x with updates[..., j, ...] added at x[..., indices[..., j, ...], ...].",
)


# -- flip -----------------------------------------------------------------------------------------
def _flip_infer(x, axes):
    norm_axes(axes, len(x.shape))
    return x


flip = defop(
    "flip",
    infer=_flip_infer,
    ref=lambda x, axes: np.flip(x, norm_axes(axes, x.ndim)).copy(),
    vjp=lambda ins, outs, cts, axes: (flip(cts[0], axes=axes),),
    doc="Reverse the order of elements along ``axes`` (torch.flip).",
)

"""Movement composites: stack, split, roll, expand, squeeze/unsqueeze, index_select, scatter and padding modes."""

from popir.errors import IRError
from popir.ops._infer import norm_axes
from popir.ops.base import broadcast_to, div, reshape, zeros_like
from popir.ops.elementwise import gt, maximum, where
from popir.ops.movement import concat, flip, gather, pad, scatter_add, slice_


def _axis(x, axis, extra=0):
    (a,) = norm_axes((axis,), x.ndim + extra)
    return a


def unsqueeze(x, axis):
    """Insert an axis of size 1 at ``axis``."""
    a = _axis(x, axis, extra=1)
    return reshape(x, shape=x.shape[:a] + (1,) + x.shape[a:])


def squeeze(x, axes=None):
    """Drop size-1 axes (all of them, or those in ``axes``)."""
    axes = tuple(i for i, d in enumerate(x.shape) if d == 1) if axes is None else norm_axes(axes, x.ndim)
    return reshape(x, shape=tuple(d for i, d in enumerate(x.shape) if i not in axes or d != 1))


def expand(x, shape):
    """torch.Tensor.expand: -1 keeps a size; new leading axes are allowed."""
    lead = len(shape) - x.ndim
    full_shape = tuple(x.shape[i - lead] if d == -1 else d for i, d in enumerate(shape))
    return broadcast_to(x, shape=full_shape)


def stack(xs, axis=0):
    """torch.stack: join along a new axis."""
    return concat(*[unsqueeze(x, axis) for x in xs], axis=_axis(xs[0], axis, extra=1))


def narrow(x, axis, start, length):
    """torch.narrow: ``length`` elements from ``start`` along ``axis``."""
    a = _axis(x, axis)
    starts = tuple(start if i == a else 0 for i in range(x.ndim))
    stops = tuple(start + length if i == a else d for i, d in enumerate(x.shape))
    return slice_(x, starts=starts, stops=stops)


def split(x, split_size_or_sections, axis=0):
    """torch.split: pieces of ``split_size`` (the last may be shorter) or of the given section sizes."""
    a = _axis(x, axis)
    n = x.shape[a]
    if isinstance(split_size_or_sections, int):
        sizes = [min(split_size_or_sections, n - s) for s in range(0, n, split_size_or_sections)]
    else:
        sizes = list(split_size_or_sections)
        if sum(sizes) != n:
            raise IRError(f"split sections {sizes} do not add up to {n} (axis {axis} of {list(x.shape)})")
    pieces, start = [], 0
    for size in sizes:
        pieces.append(narrow(x, a, start, size))
        start += size
    return tuple(pieces)


def chunk(x, chunks, axis=0):
    """torch.chunk: ``chunks`` pieces of ceil(n / chunks)."""
    n = x.shape[_axis(x, axis)]
    return split(x, max(-(-n // chunks), 1), axis)


def roll(x, shifts, axes):
    """torch.roll along each of ``axes`` by the matching shift."""
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    for shift, axis in zip(shifts, axes):
        a = _axis(x, axis)
        n = x.shape[a]
        shift %= max(n, 1)
        if shift:
            x = concat(narrow(x, a, n - shift, shift), narrow(x, a, 0, n - shift), axis=a)
    return x


def index_select(x, axis, indices):
    """torch.index_select with 1-D int32 ``indices``."""
    return gather(x, indices, axis=_axis(x, axis))


def scatter(x, axis, indices, src):
    """torch.scatter (no reduce): src values written at indices along ``axis``. Duplicate indices (torch
    leaves them unspecified) get the mean of their values, so a value written twice is written once."""
    a = _axis(x, axis)
    one = x.graph.constant(1.0, x.dtype)
    hits = scatter_add(zeros_like(x), indices, broadcast_to(one, shape=src.shape), axis=a)
    sums = scatter_add(zeros_like(x), indices, src, axis=a)
    return where(gt(hits, zeros_like(hits)), div(sums, maximum(hits, broadcast_to(one, shape=x.shape))), x)


def pad_mode(x, pads, mode="constant", value=0.0):
    """torch.nn.functional.pad with ``pads`` as (lo, hi) pairs per axis and mode constant / reflect /
    replicate / circular."""
    if mode == "constant":
        return pad(x, pads=pads, value=value)
    if mode not in ("reflect", "replicate", "circular"):
        raise IRError(f"pad mode must be constant, reflect, replicate or circular, got {mode!r}")
    for a, (lo, hi) in enumerate(pads):
        n = x.shape[a]
        if mode == "reflect" and (lo >= n or hi >= n):
            raise IRError(f"reflect padding ({lo}, {hi}) must be smaller than axis {a} of {list(x.shape)}")
        parts = [_edge(x, a, lo, mode, low=True), x, _edge(x, a, hi, mode, low=False)]
        parts = [p for p in parts if p is not None]
        if len(parts) > 1:
            x = concat(*parts, axis=a)
    return x


def _edge(x, a, width, mode, low):
    if width == 0:
        return None
    n = x.shape[a]
    if mode == "reflect":
        piece = narrow(x, a, 1, width) if low else narrow(x, a, n - 1 - width, width)
        return flip(piece, axes=(a,))
    if mode == "replicate":
        edge = narrow(x, a, 0 if low else n - 1, 1)
        return broadcast_to(edge, shape=tuple(width if i == a else d for i, d in enumerate(x.shape)))
    if width > n:
        raise IRError(f"circular padding {width} is larger than axis {a} of {list(x.shape)}")
    return narrow(x, a, n - width, width) if low else narrow(x, a, 0, width)

"""Resampling composites: torch's ``F.interpolate`` modes as separable per-axis maps.

Each spatial axis is resampled on its own, as torch does: nearest modes gather source positions (a constant
index), linear and cubic modes multiply by a constant (out, in) weight matrix, so the matmul planner spreads
the work over tiles and the gradient is the transposed map. Coordinates follow ATen's
``area_pixel_compute_source_index`` (``align_corners`` both ways, explicit ``scales`` or sizes).
"""

import math

import numpy as np

from popir.errors import IRError
from popir.ops.base import reshape
from popir.ops.linalg import matmul
from popir.ops.movement import gather, transpose

# Keys' cubic convolution parameter used by torch's bicubic mode.
_CUBIC_A = -0.75
NEAREST_MODES = ("nearest", "nearest-exact")
WEIGHTED_MODES = ("linear", "bilinear", "trilinear", "bicubic")


def _scale(in_size, out_size, align_corners, scale):
    """Source step per output step (ATen's area_pixel_compute_scale)."""
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else in_size / out_size


def nearest_source(in_size, out_size, scale=None, exact=False):
    """Source index of each output position for "nearest" (floor) or "nearest-exact" (round half up)."""
    step = _scale(in_size, out_size, False, scale)
    # ATen computes these positions in float32; so do we, to pick the same source at exact halves.
    dst, step = np.arange(out_size, dtype=np.float32), np.float32(step)
    src = np.floor((dst + np.float32(0.5)) * step) if exact else np.floor(dst * step)
    return np.minimum(src.astype(np.int64), in_size - 1).astype(np.int32)


def _cubic_weights(t):
    """Keys' cubic weights of the four taps at offsets -1, 0, 1, 2 for fractional positions ``t``."""
    a = _CUBIC_A

    def near(s):  # |s| <= 1
        return ((a + 2) * s - (a + 3)) * s * s + 1

    def far(s):  # 1 < |s| < 2
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def weight_matrix(in_size, out_size, mode, align_corners=False, scale=None):
    """The (out_size, in_size) float64 map one axis of ``mode`` applies (borders clamped as in ATen)."""
    step = _scale(in_size, out_size, align_corners, scale)
    dst = np.arange(out_size, dtype=np.float64)
    src = dst * step if align_corners else (dst + 0.5) * step - 0.5
    rows = np.arange(out_size)
    w = np.zeros((out_size, in_size))
    if mode == "bicubic":
        base = np.floor(src)
        for offset, weight in zip(range(-1, 3), _cubic_weights(src - base)):
            np.add.at(w, (rows, np.clip(base.astype(np.int64) + offset, 0, in_size - 1)), weight)
        return w
    src = np.maximum(src, 0.0)
    low = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    high = np.minimum(low + 1, in_size - 1)
    frac = src - low
    np.add.at(w, (rows, low), 1.0 - frac)
    np.add.at(w, (rows, high), frac)
    return w


def _along(x, axis, fn):
    """``fn`` applied to ``x`` with ``axis`` moved last (and moved back after)."""
    last = x.ndim - 1
    if axis == last:
        return fn(x)
    perm = tuple(a for a in range(x.ndim) if a != axis) + (axis,)
    y = fn(transpose(x, perm=perm))
    return transpose(y, perm=tuple(int(i) for i in np.argsort(perm)))


def _apply_matrix(x, w):
    """``x`` times the constant map ``w`` (out, in) over its last axis."""
    lead = x.shape[:-1]
    flat = reshape(x, shape=(math.prod(lead), x.shape[-1]))
    out = matmul(flat, x.graph.constant(np.ascontiguousarray(w.T).astype(x.dtype.numpy)))
    return reshape(out, shape=lead + (w.shape[0],))


def apply_along(x, axis, w):
    """The constant (out, in) map ``w`` applied to ``axis`` of ``x`` (a matmul, planned over tiles)."""
    return _along(x, axis, lambda v: _apply_matrix(v, w))


def interpolate(x, size, mode="nearest", align_corners=False, scales=None):
    """torch.nn.functional.interpolate of the trailing ``len(size)`` axes of ``x`` to ``size``.

    ``scales`` (one per resized axis, or None) are the user's scale factors when given: torch derives source
    coordinates from them rather than from the sizes. ``align_corners`` applies to the weighted modes only.
    """
    if mode not in NEAREST_MODES + WEIGHTED_MODES:
        raise IRError(f"interpolate mode must be one of {NEAREST_MODES + WEIGHTED_MODES}, got {mode!r}")
    size = tuple(int(s) for s in size)
    scales = tuple(scales) if scales is not None else (None,) * len(size)
    if len(size) > x.ndim or len(scales) != len(size):
        raise IRError(f"interpolate: {len(size)} sizes / {len(scales)} scales for an input of shape {list(x.shape)}")
    for i, (out_size, scale) in enumerate(zip(size, scales)):
        axis = x.ndim - len(size) + i
        in_size = x.shape[axis]
        if out_size == in_size and (scale is None or scale == 1.0):
            continue
        if mode in NEAREST_MODES:
            index = x.graph.constant(nearest_source(in_size, out_size, scale, mode == "nearest-exact"))
            x = gather(x, index, axis=axis)
        else:
            w = weight_matrix(in_size, out_size, mode, align_corners, scale)
            x = apply_along(x, axis, w)
    return x

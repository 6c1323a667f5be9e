"""Index maps of sliding windows (convolution and pooling), NCHW, as flat element indices (-1: padding)."""

import numpy as np


def out_size(size, k, s, d, lo, hi, ceil_mode=False):
    """Output length along one axis (torch's rule, including ceil_mode)."""
    span = size + lo + hi - d * (k - 1) - 1
    n = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (n - 1) * s >= size + lo:
        n -= 1
    return n


def _axis_positions(size, k, s, d, lo, out):
    """Input position read by output o at kernel tap i: (out, k) array, -1 where it is padding."""
    pos = np.arange(out)[:, None] * s - lo + np.arange(k)[None, :] * d
    return np.where((pos >= 0) & (pos < size), pos, -1)


def windows(x_shape, kernel, stride, padding, dilation, ceil_mode=False):
    """(N, C, OH, OW, KH, KW) flat indices into an NCHW tensor of ``x_shape``; -1 marks padding."""
    n, c, h, w = x_shape
    oh, ow = (
        out_size(sz, k, s, d, lo, hi, ceil_mode)
        for sz, k, s, d, (lo, hi) in zip((h, w), kernel, stride, dilation, padding)
    )
    ph = _axis_positions(h, kernel[0], stride[0], dilation[0], padding[0][0], oh)
    pw = _axis_positions(w, kernel[1], stride[1], dilation[1], padding[1][0], ow)
    plane = (np.arange(n * c) * h * w).reshape(n, c, 1, 1, 1, 1)
    hh = ph[:, None, :, None]
    ww = pw[None, :, None, :]
    idx = plane + hh * w + ww
    return np.where((hh >= 0) & (ww >= 0), idx, -1)


def _axis_sources(size, k, s, d, lo, out):
    """For input position p and tap i, the output position o with o * s - lo + i * d == p, else -1."""
    num = np.arange(size)[:, None] + lo - np.arange(k)[None, :] * d
    o = num // s
    return np.where((num % s == 0) & (o >= 0) & (o < out), o, -1)


def transposed_windows(x_shape, gy_shape, kernel, stride, padding, dilation):
    """(N, H, W, O, KH, KW) flat indices into gy (N, O, OH, OW) feeding input position (h, w) at tap (i, j)."""
    n, _, h, w = x_shape
    _, o, oh, ow = gy_shape
    sh = _axis_sources(h, kernel[0], stride[0], dilation[0], padding[0][0], oh)  # (H, KH)
    sw = _axis_sources(w, kernel[1], stride[1], dilation[1], padding[1][0], ow)  # (W, KW)
    a = sh[None, :, None, None, :, None]
    b = sw[None, None, :, None, None, :]
    plane = (np.arange(n)[:, None] * o + np.arange(o)[None, :]).reshape(n, 1, 1, o, 1, 1) * oh * ow
    return np.where((a >= 0) & (b >= 0), plane + a * ow + b, -1)


def inverse(index, size):
    """For each of ``size`` source elements, the flat positions in ``index`` that read it: (size, max count), -1 pad."""
    flat = index.reshape(-1)
    pos = np.flatnonzero(flat >= 0)
    src = flat[pos]
    counts = np.bincount(src, minlength=size)
    width = max(int(counts.max(initial=0)), 1)
    order = np.argsort(src, kind="stable")
    ranked = src[order]
    rank = np.arange(ranked.size) - (np.cumsum(counts) - counts)[ranked]
    out = np.full((size, width), -1, np.int64)
    out[ranked, rank] = pos[order]
    return out

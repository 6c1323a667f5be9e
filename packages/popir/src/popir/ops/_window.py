"""NumPy kernels for sliding-window ops (convolution and max-pooling), for any number of spatial axes.

Every kernel loops over the kernel positions and does one strided slice plus one batched matmul (or
max) per position, so the references are fast enough for the interpreter to run real models.
"""

import itertools

import numpy as np

from popir.errors import IRError


def out_size(size, k, s, d, lo, hi, ceil_mode=False):
    """Output length of a window op along one axis (torch's rule, including ceil_mode)."""
    span = size + lo + hi - d * (k - 1) - 1
    if span < 0:
        raise IRError(f"window of {k} (dilation {d}) does not fit an axis of {size} padded by ({lo}, {hi})")
    n = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (n - 1) * s >= size + lo:
        n -= 1  # the last window must start inside the input or the low padding
    return n


def window_shape(spatial, kernel, stride, padding, dilation, ceil_mode=False):
    return tuple(
        out_size(n, k, s, d, lo, hi, ceil_mode)
        for n, k, s, d, (lo, hi) in zip(spatial, kernel, stride, dilation, padding)
    )


def _taps(kernel, stride, dilation, out):
    """(kernel position, strided slices of the padded input it reads) for each kernel position."""
    for pos in itertools.product(*(range(k) for k in kernel)):
        yield pos, tuple(slice(p * d, p * d + (o - 1) * s + 1, s) for p, d, o, s in zip(pos, dilation, out, stride))


def _padded(x, padding, out, kernel, stride, dilation, fill):
    """x padded by ``padding`` and, where ceil_mode windows run past it, by extra high padding."""
    pads = []
    for n, (lo, hi), o, k, s, d in zip(x.shape[2:], padding, out, kernel, stride, dilation):
        need = (o - 1) * s + d * (k - 1) + 1
        pads.append((lo, max(hi, need - n - lo)))
    return np.pad(x, ((0, 0), (0, 0), *pads), constant_values=fill), pads


def _acc_dtype(dtype):
    return np.float32 if dtype == np.float16 else dtype


def _grouped_rows(t, groups):
    """(N, G*Cg, *sp) -> (G, N*prod(sp), Cg): rows are (sample, position) pairs per group."""
    n, c = t.shape[:2]
    sp = t.shape[2:]
    t = t.reshape(n, groups, c // groups, -1)
    return np.ascontiguousarray(t.transpose(1, 0, 3, 2)).reshape(groups, n * int(np.prod(sp, dtype=np.int64)), -1)


def _ungroup_rows(rows, n, spatial):
    """Inverse of ``_grouped_rows``: (G, N*prod(sp), Cg) -> (N, G*Cg, *sp)."""
    g, _, cg = rows.shape
    t = rows.reshape(g, n, -1, cg).transpose(1, 0, 3, 2)
    return t.reshape(n, g * cg, *spatial)


def _grouped_weight(w, groups, pos):
    """Weight taps at kernel position ``pos`` as (G, Cg, Og)."""
    o, cg = w.shape[:2]
    tap = w[(slice(None), slice(None), *pos)]
    return tap.reshape(groups, o // groups, cg).transpose(0, 2, 1)


def conv(x, w, stride, padding, dilation, groups):
    kernel = w.shape[2:]
    out = window_shape(x.shape[2:], kernel, stride, padding, dilation)
    acc = _acc_dtype(x.dtype)
    xp, _ = _padded(x.astype(acc), padding, out, kernel, stride, dilation, 0)
    w = w.astype(acc)
    total = np.zeros((groups, x.shape[0] * int(np.prod(out, dtype=np.int64)), w.shape[0] // groups), acc)
    for pos, window in _taps(kernel, stride, dilation, out):
        total += _grouped_rows(xp[(slice(None), slice(None), *window)], groups) @ _grouped_weight(w, groups, pos)
    return _ungroup_rows(total, x.shape[0], out).astype(x.dtype)


def conv_grad_input(gy, w, input_shape, stride, padding, dilation, groups):
    kernel = w.shape[2:]
    out = gy.shape[2:]
    acc = _acc_dtype(gy.dtype)
    zeros = np.zeros(input_shape, acc)
    gxp, pads = _padded(zeros, padding, out, kernel, stride, dilation, 0)
    rows = _grouped_rows(gy.astype(acc), groups)
    w = w.astype(acc)
    for pos, window in _taps(kernel, stride, dilation, out):
        tap = _grouped_weight(w, groups, pos).transpose(0, 2, 1)
        gxp[(slice(None), slice(None), *window)] += _ungroup_rows(rows @ tap, gy.shape[0], out)
    crop = tuple(slice(lo, lo + n) for (lo, _), n in zip(pads, input_shape[2:]))
    return gxp[(slice(None), slice(None), *crop)].astype(gy.dtype)


def conv_grad_weight(x, gy, weight_shape, stride, padding, dilation, groups):
    kernel = weight_shape[2:]
    out = gy.shape[2:]
    acc = _acc_dtype(x.dtype)
    xp, _ = _padded(x.astype(acc), padding, out, kernel, stride, dilation, 0)
    rows = _grouped_rows(gy.astype(acc), groups).transpose(0, 2, 1)
    o, cg = weight_shape[:2]
    gw = np.zeros(weight_shape, acc)
    for pos, window in _taps(kernel, stride, dilation, out):
        tap = rows @ _grouped_rows(xp[(slice(None), slice(None), *window)], groups)
        gw[(slice(None), slice(None), *pos)] = tap.reshape(o, cg)
    return gw.astype(x.dtype)


def pool_argmax(x, kernel, stride, padding, dilation, ceil_mode):
    """Max over each window and the flat index (into the padded input) of its first maximum."""
    out = window_shape(x.shape[2:], kernel, stride, padding, dilation, ceil_mode)
    fill = -np.inf if np.issubdtype(x.dtype, np.floating) else np.iinfo(x.dtype).min
    xp, pads = _padded(x, padding, out, kernel, stride, dilation, fill)
    flat = np.arange(int(np.prod(xp.shape[2:], dtype=np.int64))).reshape(xp.shape[2:])
    best = best_at = None
    for _, window in _taps(kernel, stride, dilation, out):
        value = xp[(slice(None), slice(None), *window)]
        at = np.broadcast_to(flat[window], value.shape)
        if best is None:
            best, best_at = value.copy(), at.copy()
        else:
            better = value > best
            best = np.where(better, value, best)
            best_at = np.where(better, at, best_at)
    return best, best_at, xp.shape, pads


def pool_grad(x, gy, kernel, stride, padding, dilation, ceil_mode):
    """Scatter ``gy`` onto the first maximum of each window of ``x``."""
    _, at, padded_shape, pads = pool_argmax(x, kernel, stride, padding, dilation, ceil_mode)
    n, c = x.shape[:2]
    acc = _acc_dtype(gy.dtype)
    gxp = np.zeros((n * c, int(np.prod(padded_shape[2:], dtype=np.int64))), acc)
    rows = np.arange(n * c)[:, None]
    np.add.at(gxp, (rows, at.reshape(n * c, -1)), gy.reshape(n * c, -1).astype(acc))
    gxp = gxp.reshape(padded_shape)
    crop = tuple(slice(lo, lo + size) for (lo, _), size in zip(pads, x.shape[2:]))
    return gxp[(slice(None), slice(None), *crop)].astype(gy.dtype)


def pool_select(x, c, kernel, stride, padding, dilation, ceil_mode):
    """For each window of ``x``, the value of ``c`` at the window's first maximum (adjoint of pool_grad)."""
    _, at, padded_shape, _ = pool_argmax(x, kernel, stride, padding, dilation, ceil_mode)
    cp, _ = _padded(c, padding, at.shape[2:], kernel, stride, dilation, 0)
    n, ch = x.shape[:2]
    picked = np.take_along_axis(cp.reshape(n * ch, -1), at.reshape(n * ch, -1), axis=1)
    return picked.reshape(at.shape)

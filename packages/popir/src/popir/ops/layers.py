"""Layer composites: linear, bilinear, embedding, pooling (1-3 d), transposed convolution (1-3 d), masking."""

import numpy as np

from popir.ops import _window
from popir.ops.base import full, reduce_sum, reshape
from popir.ops.conv import conv2d, conv2d_grad_input, max_pool2d, padding_pairs, pair
from popir.ops.elementwise import where
from popir.ops.linalg import matmul
from popir.ops.movement import concat, gather, pad, slice_, transpose
from popir.ops.reduction import reduce_max
from popir.ops.resize import apply_along
from popir.ops.stats import mean


def linear(x, weight, bias=None):
    """torch.nn.functional.linear: x @ weight.T + bias."""
    y = matmul(x, transpose(weight, perm=(1, 0)) if weight.ndim == 2 else weight)
    return y if bias is None else y + bias


def embedding(weight, indices):
    """torch.nn.functional.embedding: rows of ``weight`` picked by int32 ``indices``."""
    return gather(weight, indices, axis=0)


def masked_fill(x, mask, value):
    """torch.Tensor.masked_fill: ``value`` where the bool ``mask`` is set."""
    return where(mask, full(x.graph, (), value, x.dtype), x)


def _avg_divisors(spatial, kernel, stride, padding, out, count_include_pad):
    """Per output position, the element count torch divides each window sum by."""
    per_axis = []
    for n, k, s, p, o in zip(spatial, kernel, stride, padding, out):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, n + p)
        if not count_include_pad:
            start, end = np.maximum(start, 0), np.minimum(end, n)
        per_axis.append(end - start)
    return np.multiply.outer(*per_axis)


def avg_pool2d(x, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    """torch.nn.functional.avg_pool2d as a depthwise convolution with a ones kernel and torch's divisors."""
    kernel = pair(kernel, "kernel")
    stride = kernel if stride is None else pair(stride, "stride")
    pad = pair(padding, "padding")
    out = _window.window_shape(x.shape[2:], kernel, stride, tuple((p, p) for p in pad), (1, 1), ceil_mode)
    # ceil_mode windows may run past the padding: pad the high side far enough for the last window.
    pairs = tuple((p, max(p, (o - 1) * s + k - n - p)) for n, k, s, p, o in zip(x.shape[2:], kernel, stride, pad, out))
    channels = x.shape[1]
    ones = full(x.graph, (channels, 1) + kernel, 1, x.dtype)
    total = conv2d(x, ones, stride=stride, padding=pairs, groups=channels)
    if divisor_override:
        return total * (1.0 / divisor_override)
    divisors = _avg_divisors(x.shape[2:], kernel, stride, pad, out, count_include_pad)
    return total * x.graph.constant((1.0 / divisors).astype(x.dtype.numpy))


def conv_transpose2d(x, weight, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose2d without bias: the input-gradient of a conv2d.

    ``weight`` is (C_in, C_out / groups, kH, kW) as in torch.
    """
    stride, dilation, out_pad = pair(stride, "stride"), pair(dilation, "dilation"), pair(output_padding, "pad")
    pads = padding_pairs(padding)
    # The unpadded transposed convolution, cropped by ``padding``; output_padding extends the high end,
    # reading further into the full result and past it (zeros) where it is shorter.
    full = tuple((n - 1) * s + d * (k - 1) + 1 for n, s, d, k in zip(x.shape[2:], stride, dilation, weight.shape[2:]))
    window = {"stride": stride, "padding": ((0, 0), (0, 0)), "dilation": dilation, "groups": groups}
    y = conv2d_grad_input(x, weight, input_shape=(x.shape[0], weight.shape[1] * groups) + full, **window)
    sizes = tuple(f - lo - hi + op for f, (lo, hi), op in zip(full, pads, out_pad))
    starts = (0, 0) + tuple(lo for lo, _ in pads)
    stops = y.shape[:2] + tuple(min(lo + n, f) for (lo, _), n, f in zip(pads, sizes, full))
    y = slice_(y, starts=starts, stops=stops)
    extra = tuple(n - d for n, d in zip(sizes, y.shape[2:]))
    return pad(y, pads=((0, 0), (0, 0)) + tuple((0, e) for e in extra), value=0.0) if any(extra) else y


def flatten(x, start=1, end=-1):
    """torch.flatten: merge axes start..end."""
    end = end % x.ndim if x.ndim else 0
    start = start % x.ndim if x.ndim else 0
    merged = int(np.prod(x.shape[start : end + 1], dtype=np.int64))
    return reshape(x, shape=x.shape[:start] + (merged,) + x.shape[end + 1 :])


def _with_unit_height(x):
    return reshape(x, shape=x.shape[:2] + (1,) + x.shape[2:])


def _drop_height(y):
    return reshape(y, shape=y.shape[:2] + y.shape[3:])


def _single(value):
    return value if isinstance(value, int) else value[0]


def conv1d(x, weight, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv1d without bias, through conv2d with a unit height."""
    y = conv2d(
        _with_unit_height(x),
        _with_unit_height(weight),
        stride=(1, _single(stride)),
        padding=(0, _single(padding)),
        dilation=(1, _single(dilation)),
        groups=groups,
    )
    return _drop_height(y)


def conv_transpose1d(x, weight, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose1d without bias, through conv_transpose2d with a unit height."""
    y = conv_transpose2d(
        _with_unit_height(x),
        _with_unit_height(weight),
        stride=(1, _single(stride)),
        padding=(0, _single(padding)),
        output_padding=(0, _single(output_padding)),
        groups=groups,
        dilation=(1, _single(dilation)),
    )
    return _drop_height(y)


def conv3d(x, weight, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv3d without bias: one conv2d per kernel depth over depth-strided slices."""
    triple = lambda v: (v,) * 3 if isinstance(v, int) else tuple(v)  # noqa: E731
    (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = triple(stride), triple(padding), triple(dilation)
    n, c, depth = x.shape[:3]
    kd = weight.shape[2]
    out_depth = (depth + 2 * pd - dd * (kd - 1) - 1) // sd + 1
    if pd:
        x = pad(x, pads=((0, 0), (0, 0), (pd, pd), (0, 0), (0, 0)), value=0.0)
    total = None
    for k in range(kd):
        start = k * dd
        planes = slice_(
            x,
            starts=(0, 0, start, 0, 0),
            stops=(n, c, start + (out_depth - 1) * sd + 1) + x.shape[3:],
            steps=(1, 1, sd, 1, 1),
        )
        planes = reshape(transpose(planes, perm=(0, 2, 1, 3, 4)), shape=(n * out_depth, c) + x.shape[3:])
        w = reshape(
            slice_(weight, starts=(0, 0, k, 0, 0), stops=weight.shape[:2] + (k + 1,) + weight.shape[3:]),
            shape=weight.shape[:2] + weight.shape[3:],
        )
        y = conv2d(planes, w, stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw), groups=groups)
        total = y if total is None else total + y
    y = reshape(total, shape=(n, out_depth) + total.shape[1:])
    return transpose(y, perm=(0, 2, 1, 3, 4))


def avg_pool1d(x, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    """torch.nn.functional.avg_pool1d through avg_pool2d with a unit height."""
    y = avg_pool2d(
        _with_unit_height(x),
        (1, _single(kernel)),
        None if stride is None else (1, _single(stride)),
        (0, _single(padding)),
        ceil_mode,
        count_include_pad,
    )
    return _drop_height(y)


def max_pool1d(x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    """torch.nn.functional.max_pool1d through max_pool2d with a unit height."""
    stride = _single(kernel) if stride is None else _single(stride)
    y = max_pool2d(
        _with_unit_height(x),
        (1, _single(kernel)),
        (1, stride),
        (0, _single(padding)),
        (1, _single(dilation)),
        ceil_mode,
    )
    return _drop_height(y)


def _adaptive_bins(x, output_size, reduce):
    """torch's adaptive pooling: bin i of n covers [floor(i*n_in/n), ceil((i+1)*n_in/n)) on each spatial axis."""
    out = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    out = tuple(n if o is None else o for o, n in zip(out, x.shape[2:]))
    for axis, (n, o) in enumerate(zip(x.shape[2:], out), start=2):
        bins = []
        for i in range(o):
            start, stop = (i * n) // o, -(-((i + 1) * n) // o)
            starts = tuple(start if a == axis else 0 for a in range(x.ndim))
            stops = tuple(stop if a == axis else d for a, d in enumerate(x.shape))
            bins.append(reduce(slice_(x, starts=starts, stops=stops), axes=(axis,), keepdims=True))
        x = concat(*bins, axis=axis)
    return x


def adaptive_avg_pool2d(x, output_size):
    """torch.nn.functional.adaptive_avg_pool2d (one avg_pool2d when the sizes divide evenly)."""
    out = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    out = tuple(n if o is None else o for o, n in zip(out, x.shape[2:]))
    if all(n % o == 0 for n, o in zip(x.shape[2:], out)):
        kernel = tuple(n // o for n, o in zip(x.shape[2:], out))
        return avg_pool2d(x, kernel, kernel)
    return _adaptive_bins(x, out, mean)


def adaptive_max_pool2d(x, output_size):
    """torch.nn.functional.adaptive_max_pool2d (values only); ties share the gradient like amax."""
    return _adaptive_bins(x, output_size, reduce_max)


def bilinear(a, b, weight, bias=None):
    """torch.nn.functional.bilinear: out[..., o] = a[..., i] weight[o, i, j] b[..., j] + bias[o]."""
    out_f, in_a, in_b = weight.shape
    lead = a.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    w = reshape(transpose(weight, perm=(1, 0, 2)), shape=(in_a, out_f * in_b))
    t = reshape(matmul(reshape(a, shape=(rows, in_a)), w), shape=(rows, out_f, in_b))
    y = reduce_sum(t * reshape(b, shape=(rows, 1, in_b)), axes=(2,), keepdims=False)
    y = reshape(y, shape=lead + (out_f,))
    return y if bias is None else y + bias


def _triple(v):
    return (v,) * 3 if isinstance(v, int) else tuple(v)


def _depth_as_height(y, n, c):
    """(n*c, D, H', W') -> (n*c, 1, D, H'*W'): depth becomes the height of a single-channel 2-D map."""
    return reshape(y, shape=(n * c, 1, y.shape[1], y.shape[2] * y.shape[3]))


def _back_to_3d(z, n, c, hw):
    return reshape(z, shape=(n, c, z.shape[2]) + hw)


def avg_pool3d(x, kernel, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    """torch.nn.functional.avg_pool3d, separably: a 2-D average over (H, W), then one over depth. Window
    counts (with padding and ceil_mode) are per-axis products, so the two stages divide exactly as torch."""
    kernel = _triple(kernel)
    stride = kernel if stride is None or stride == () else _triple(stride)
    padding = _triple(padding)
    n, c = x.shape[:2]
    planes = reshape(x, shape=(n * c,) + x.shape[2:])
    y = avg_pool2d(planes, kernel[1:], stride[1:], padding[1:], ceil_mode, count_include_pad)
    z = avg_pool2d(
        _depth_as_height(y, n, c), (kernel[0], 1), (stride[0], 1), (padding[0], 0), ceil_mode, count_include_pad
    )
    return _back_to_3d(z, n, c, y.shape[2:])


def max_pool3d(x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    """torch.nn.functional.max_pool3d (values), separably: a 2-D max over (H, W), then one over depth."""
    kernel = _triple(kernel)
    stride = kernel if stride is None or stride == () else _triple(stride)
    padding, dilation = _triple(padding), _triple(dilation)
    n, c = x.shape[:2]
    planes = reshape(x, shape=(n * c,) + x.shape[2:])
    y = max_pool2d(planes, kernel[1:], stride[1:], padding[1:], dilation[1:], ceil_mode)
    z = max_pool2d(
        _depth_as_height(y, n, c), (kernel[0], 1), (stride[0], 1), (padding[0], 0), (dilation[0], 1), ceil_mode
    )
    return _back_to_3d(z, n, c, y.shape[2:])


def adaptive_avg_pool3d(x, output_size):
    """torch.nn.functional.adaptive_avg_pool3d: adaptive bins are per-axis, so (H, W) then depth."""
    out = _triple(output_size)
    out = tuple(d if o is None else o for o, d in zip(out, x.shape[2:]))
    n, c = x.shape[:2]
    y = adaptive_avg_pool2d(reshape(x, shape=(n * c,) + x.shape[2:]), out[1:])
    z = adaptive_avg_pool2d(_depth_as_height(y, n, c), (out[0], y.shape[2] * y.shape[3]))
    return _back_to_3d(z, n, c, y.shape[2:])


def conv_transpose3d(x, weight, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose3d without bias: a conv_transpose2d per kernel depth over the input
    planes, each placed on the output's depth axis by a constant selection map (then cropped by padding)."""
    (sd, sh, sw), (pd, ph, pw), (od, oh, ow), (dd, dh, dw) = map(_triple, (stride, padding, output_padding, dilation))
    n, _, depth = x.shape[:3]
    kd = weight.shape[2]
    planes = reshape(transpose(x, perm=(0, 2, 1, 3, 4)), shape=(n * depth,) + x.shape[1:2] + x.shape[3:])
    full_depth = (depth - 1) * sd + dd * (kd - 1) + 1
    out_depth = full_depth - 2 * pd + od
    total = None
    for k in range(kd):
        w = reshape(
            slice_(weight, starts=(0, 0, k, 0, 0), stops=weight.shape[:2] + (k + 1,) + weight.shape[3:]),
            shape=weight.shape[:2] + weight.shape[3:],
        )
        y = conv_transpose2d(planes, w, (sh, sw), (ph, pw), (oh, ow), groups, (dh, dw))
        y = reshape(y, shape=(n, depth) + y.shape[1:])  # (n, D, C_out, H', W')
        # Input plane i lands at output depth i*sd + k*dd - pd (rows outside [0, out_depth) fall away).
        place = np.zeros((out_depth, depth))
        for i in range(depth):
            z = i * sd + k * dd - pd
            if 0 <= z < out_depth:
                place[z, i] = 1.0
        y = apply_along(y, 1, place)
        total = y if total is None else total + y
    return transpose(total, perm=(0, 2, 1, 3, 4))

"""Layer composites: linear, embedding, average pooling, transposed convolution, masking."""

import numpy as np

from popir.ops import _window
from popir.ops.base import full, reshape
from popir.ops.conv import _pair, conv2d, conv2d_grad_input, padding_pairs
from popir.ops.elementwise import where
from popir.ops.linalg import matmul
from popir.ops.movement import gather, pad, transpose


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
    kernel = _pair(kernel, "kernel")
    stride = kernel if stride is None else _pair(stride, "stride")
    pad = _pair(padding, "padding")
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
    stride, dilation, out_pad = _pair(stride, "stride"), _pair(dilation, "dilation"), _pair(output_padding, "pad")
    pads = padding_pairs(padding)
    # output_padding below the stride lies inside the conv2d whose input gradient this is; torch also allows
    # it up to the dilation, and those extra trailing positions receive nothing: they are zero padding.
    inner = tuple(min(op, s - 1) for op, s in zip(out_pad, stride))
    spatial = tuple(
        (n - 1) * s - lo - hi + d * (k - 1) + op + 1
        for n, s, (lo, hi), d, k, op in zip(x.shape[2:], stride, pads, dilation, weight.shape[2:], inner)
    )
    shape = (x.shape[0], weight.shape[1] * groups) + spatial
    window = {"stride": stride, "padding": pads, "dilation": dilation, "groups": groups}
    y = conv2d_grad_input(x, weight, input_shape=shape, **window)
    extra = tuple(op - i for op, i in zip(out_pad, inner))
    return pad(y, pads=((0, 0), (0, 0)) + tuple((0, e) for e in extra), value=0.0) if any(extra) else y


def flatten(x, start=1, end=-1):
    """torch.flatten: merge axes start..end."""
    end = end % x.ndim if x.ndim else 0
    start = start % x.ndim if x.ndim else 0
    merged = int(np.prod(x.shape[start : end + 1], dtype=np.int64))
    return reshape(x, shape=x.shape[:start] + (merged,) + x.shape[end + 1 :])

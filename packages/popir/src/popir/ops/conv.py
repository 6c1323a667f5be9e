"""Convolution and max-pooling primitives (NCHW activations, OIHW weights).

Attributes are stored complete and normalised: ``stride``/``dilation``/``kernel`` are pairs and ``padding``
is ((top, bottom), (left, right)). The public helpers ``conv2d``/``max_pool2d`` accept torch's int forms.
The gradients are primitives of their own, and each is linear in its cotangent, so every VJP closes over
this family: double backward works.
"""

import numpy as np

from popir.errors import IRError
from popir.graph import TensorType
from popir.ops import _window
from popir.ops._infer import require_float, same_dtype
from popir.registry import defop

SPATIAL = 2


def pair(value, what):
    """An int or a sequence as a tuple of SPATIAL ints (``what`` names the attribute in errors)."""
    values = (value,) * SPATIAL if isinstance(value, (int, np.integer)) else tuple(value)
    if len(values) != SPATIAL:
        raise IRError(f"{what} must be an int or {SPATIAL} ints, got {value!r}")
    return tuple(int(v) for v in values)


def padding_pairs(padding):
    """torch-style padding (int, (ph, pw) or ((top, bottom), (left, right))) as (lo, hi) pairs."""
    if isinstance(padding, (int, np.integer)):
        return ((int(padding),) * 2,) * SPATIAL
    padding = tuple(padding)
    if len(padding) == SPATIAL and all(isinstance(p, (int, np.integer)) for p in padding):
        return tuple((int(p), int(p)) for p in padding)
    if len(padding) == SPATIAL and all(len(p) == 2 for p in padding):
        return tuple((int(lo), int(hi)) for lo, hi in padding)
    raise IRError(f"padding must be an int, {SPATIAL} ints or {SPATIAL} (lo, hi) pairs, got {padding!r}")


def _check_window(stride, padding, dilation, kernel=None):
    if len(stride) != SPATIAL or min(stride) < 1:
        raise IRError(f"stride must be {SPATIAL} positive ints, got {stride}")
    if len(dilation) != SPATIAL or min(dilation) < 1:
        raise IRError(f"dilation must be {SPATIAL} positive ints, got {dilation}")
    if len(padding) != SPATIAL or any(len(p) != 2 or min(p) < 0 for p in padding):
        raise IRError(f"padding must be {SPATIAL} non-negative (lo, hi) pairs, got {padding}")
    if kernel is not None and (len(kernel) != SPATIAL or min(kernel) < 1):
        raise IRError(f"kernel must be {SPATIAL} positive ints, got {kernel}")


def _conv_shape(x_shape, w_shape, stride, padding, dilation, groups):
    _check_window(stride, padding, dilation)
    if len(x_shape) != SPATIAL + 2 or len(w_shape) != SPATIAL + 2:
        raise IRError(f"conv2d needs NCHW input and OIHW weight, got {list(x_shape)} and {list(w_shape)}")
    n, c = x_shape[:2]
    o, cg = w_shape[:2]
    if groups < 1 or c % groups or o % groups or cg * groups != c:
        raise IRError(f"input {list(x_shape)} and weight {list(w_shape)} do not fit groups={groups}")
    out = _window.window_shape(x_shape[2:], w_shape[2:], stride, padding, dilation)
    if min(out, default=1) < 1:
        raise IRError(f"kernel {list(w_shape[2:])} is larger than the padded input {list(x_shape[2:])}")
    return (n, o) + out


def _conv2d_infer(x, w, stride, padding, dilation, groups):
    require_float(x)
    dtype = same_dtype(x, w)
    return TensorType(_conv_shape(x.shape, w.shape, stride, padding, dilation, groups), dtype)


def _conv2d_grad_input_infer(gy, w, input_shape, stride, padding, dilation, groups):
    dtype = same_dtype(gy, w)
    expected = _conv_shape(tuple(input_shape), w.shape, stride, padding, dilation, groups)
    if gy.shape != expected:
        raise IRError(f"gradient {list(gy.shape)} is not the conv2d output {list(expected)} of {list(input_shape)}")
    return TensorType(tuple(input_shape), dtype)


def _conv2d_grad_weight_infer(x, gy, weight_shape, stride, padding, dilation, groups):
    dtype = same_dtype(x, gy)
    expected = _conv_shape(x.shape, tuple(weight_shape), stride, padding, dilation, groups)
    if gy.shape != expected:
        raise IRError(f"gradient {list(gy.shape)} is not the conv2d output {list(expected)} of {list(x.shape)}")
    return TensorType(tuple(weight_shape), dtype)


def _conv_vjp(ins, outs, cts, stride, padding, dilation, groups):
    x, w = ins
    window = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    return (
        conv2d_grad_input(cts[0], w, input_shape=x.shape, **window),
        conv2d_grad_weight(x, cts[0], weight_shape=w.shape, **window),
    )


def _conv_grad_input_vjp(ins, outs, cts, input_shape, **window):
    gy, w = ins
    return _conv2d(cts[0], w, **window), conv2d_grad_weight(cts[0], gy, weight_shape=w.shape, **window)


def _conv_grad_weight_vjp(ins, outs, cts, weight_shape, **window):
    x, gy = ins
    return conv2d_grad_input(gy, cts[0], input_shape=x.shape, **window), _conv2d(x, cts[0], **window)


_conv2d = defop(
    "conv2d",
    infer=_conv2d_infer,
    ref=_window.conv,
    vjp=_conv_vjp,
    doc="2-D cross-correlation (torch.nn.functional.conv2d) with grouping; fp16 accumulates in fp32.",
)
conv2d_grad_input = defop(
    "conv2d_grad_input",
    infer=_conv2d_grad_input_infer,
    ref=_window.conv_grad_input,
    vjp=_conv_grad_input_vjp,
    doc="Gradient of conv2d w.r.t. its input (also the transposed convolution).",
)
conv2d_grad_weight = defop(
    "conv2d_grad_weight",
    infer=_conv2d_grad_weight_infer,
    ref=_window.conv_grad_weight,
    vjp=_conv_grad_weight_vjp,
    doc="Gradient of conv2d w.r.t. its weight.",
)


def conv2d(x, w, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d without bias: ints or pairs for stride/dilation, padding as in ``padding_pairs``."""
    return _conv2d(
        x,
        w,
        stride=pair(stride, "stride"),
        padding=padding_pairs(padding),
        dilation=pair(dilation, "dilation"),
        groups=int(groups),
    )


def _pool_infer(x, kernel, stride, padding, dilation, ceil_mode):
    _check_window(stride, padding, dilation, kernel)
    if len(x.shape) != SPATIAL + 2:
        raise IRError(f"max_pool2d needs an NCHW input, got {list(x.shape)}")
    if any(2 * lo > k or 2 * hi > k for (lo, hi), k in zip(padding, kernel)):
        raise IRError(f"padding {padding} must be at most half the kernel {kernel}")
    out = _window.window_shape(x.shape[2:], kernel, stride, padding, dilation, ceil_mode)
    return TensorType(tuple(x.shape[:2]) + out, x.dtype)


def _pool_grad_infer(x, gy, kernel, stride, padding, dilation, ceil_mode):
    expected = _pool_infer(x, kernel, stride, padding, dilation, ceil_mode)
    if gy.shape != expected.shape or gy.dtype != x.dtype:
        raise IRError(f"gradient {gy} is not the max_pool2d output {expected} of {list(x.shape)}")
    return x


def _pool_select_infer(x, c, kernel, stride, padding, dilation, ceil_mode):
    if c.shape != x.shape or c.dtype != x.dtype:
        raise IRError(f"max_pool2d_select needs two tensors of one type, got {x} and {c}")
    return _pool_infer(x, kernel, stride, padding, dilation, ceil_mode)


_max_pool2d = defop(
    "max_pool2d",
    infer=_pool_infer,
    ref=lambda x, **window: _window.pool_argmax(x, **window)[0],
    vjp=lambda ins, outs, cts, **window: (max_pool2d_grad(ins[0], cts[0], **window),),
    doc="torch max_pool2d; padding counts as -inf.",
)
max_pool2d_grad = defop(
    "max_pool2d_grad",
    infer=_pool_grad_infer,
    ref=_window.pool_grad,
    vjp=lambda ins, outs, cts, **window: (None, max_pool2d_select(ins[0], cts[0], **window)),
    doc="Gradient of max_pool2d: each window's cotangent goes to its first maximum (as in torch).",
)
max_pool2d_select = defop(
    "max_pool2d_select",
    infer=_pool_select_infer,
    ref=_window.pool_select,
    vjp=lambda ins, outs, cts, **window: (None, max_pool2d_grad(ins[0], cts[0], **window)),
    doc="Per window of x, c at the window's first maximum: the adjoint of max_pool2d_grad.",
)


def max_pool2d(x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    """torch.nn.functional.max_pool2d (stride defaults to the kernel)."""
    kernel = pair(kernel, "kernel")
    return _max_pool2d(
        x,
        kernel=kernel,
        stride=kernel if stride is None else pair(stride, "stride"),
        padding=padding_pairs(padding),
        dilation=pair(dilation, "dilation"),
        ceil_mode=bool(ceil_mode),
    )

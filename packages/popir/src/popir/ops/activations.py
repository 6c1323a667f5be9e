"""Activation composites: softmax, log_softmax, GELU, SiLU, ELU family, hard/soft variants, GLU, PReLU, dropout."""

import math

from popir.ops.base import exp, full, reduce_sum, reshape, zeros_like
from popir.ops.elementwise import abs_, erf, ge, gt, log, maximum, minimum, sigmoid, tanh, where
from popir.ops.math_ops import expm1, log1p
from popir.ops.random import random_uniform
from popir.ops.rearrange import chunk
from popir.ops.reduction import reduce_max


def softmax(x, axis=-1):
    """torch.softmax along ``axis`` (max-subtracted)."""
    e = exp(x - reduce_max(x, axes=(axis,), keepdims=True))
    return e / reduce_sum(e, axes=(axis,), keepdims=True)


def log_softmax(x, axis=-1):
    """torch.log_softmax along ``axis``: (x - max) - log(sum(exp(x - max)))."""
    z = x - reduce_max(x, axes=(axis,), keepdims=True)
    return z - log(reduce_sum(exp(z), axes=(axis,), keepdims=True))


def gelu(x, approximate="none"):
    """torch GELU: the exact erf form, or the tanh approximation with approximate="tanh"."""
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
        return x * 0.5 * (tanh(inner) + 1.0)
    return x * 0.5 * (erf(x * (1.0 / math.sqrt(2.0))) + 1.0)


def silu(x):
    """x * sigmoid(x)."""
    return x * sigmoid(x)


def leaky_relu(x, negative_slope=0.01):
    """x where x > 0, else negative_slope * x."""
    zero = zeros_like(x)
    return maximum(x, zero) + minimum(x, zero) * negative_slope


def hardtanh(x, min_val=-1.0, max_val=1.0):
    """Clamp to [min_val, max_val]."""
    return clamp(x, min_val, max_val)


def clamp(x, lo=None, hi=None):
    """torch.clamp via maximum/minimum (either bound may be None)."""
    if lo is not None:
        x = maximum(x, full(x.graph, (), lo, x.dtype))
    if hi is not None:
        x = minimum(x, full(x.graph, (), hi, x.dtype))
    return x


def dropout(x, p, seed, training=True):
    """Inverted dropout: zero each element with probability ``p`` (drawn from ``seed``), scale the rest."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    keep = ge(random_uniform(seed, shape=x.shape, dtype=x.dtype), full(x.graph, (), p, x.dtype))
    return where(keep, x * (1.0 / (1.0 - p)), zeros_like(x))


def softplus(x, beta=1.0, threshold=20.0):
    """torch.nn.functional.softplus: log(1 + exp(beta x)) / beta, linear above ``threshold``."""
    z = x * beta
    # max(z, 0) + log1p(exp(-|z|)) never overflows.
    stable = (maximum(z, zeros_like(z)) + log1p(exp(-abs_(z)))) * (1.0 / beta)
    return where(gt(z, full(z.graph, (), threshold, z.dtype)), x, stable)


def elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    """torch ELU (and the general form behind SELU/CELU): scale * (x if x > 0 else alpha * expm1(x * input_scale))."""
    negative = expm1(minimum(x, zeros_like(x)) * input_scale) * alpha
    return where(gt(x, zeros_like(x)), x, negative) * scale


def selu(x):
    """torch SELU with its fixed alpha and scale."""
    return elu(x, alpha=1.6732632423543772, scale=1.0507009873554805)


def celu(x, alpha=1.0):
    """torch CELU: ELU with the exponent scaled by 1/alpha."""
    return elu(x, alpha=alpha, input_scale=1.0 / alpha)


def relu6(x):
    """min(max(x, 0), 6)."""
    return clamp(x, 0.0, 6.0)


def hardsigmoid(x):
    """relu6(x + 3) / 6."""
    return relu6(x + 3.0) * (1.0 / 6.0)


def hardswish(x):
    """x * relu6(x + 3) / 6."""
    return x * hardsigmoid(x)


def mish(x):
    """x * tanh(softplus(x))."""
    return x * tanh(softplus(x))


def softsign(x):
    """x / (1 + |x|)."""
    return x / (abs_(x) + 1.0)


def logsigmoid(x):
    """log(sigmoid(x)) = -softplus(-x), stable for large |x|."""
    return -softplus(-x)


def glu(x, axis=-1):
    """torch GLU: first half * sigmoid(second half) along ``axis``."""
    a, b = chunk(x, 2, axis)
    return a * sigmoid(b)


def prelu(x, weight):
    """torch PReLU: x where x > 0, else weight * x (``weight`` has 1 or C entries, C on axis 1)."""
    if weight.shape[0] == 1:
        weight = reshape(weight, shape=())
    elif x.ndim > 1:
        weight = reshape(weight, shape=(weight.shape[0],) + (1,) * (x.ndim - 2))
    return where(gt(x, zeros_like(x)), x, x * weight)


def rrelu(x, lower=1.0 / 8.0, upper=1.0 / 3.0, seed=None):
    """torch.nn.functional.rrelu: x where x >= 0, else x times a slope drawn uniformly from [lower, upper)
    per element (training, ``seed`` given), or times the mean slope (evaluation, ``seed`` None)."""
    if seed is None:
        slope = full(x.graph, (), (lower + upper) / 2.0, x.dtype)
    else:
        slope = random_uniform(seed, shape=x.shape, dtype=x.dtype) * (upper - lower) + lower
    return where(ge(x, zeros_like(x)), x, x * slope)

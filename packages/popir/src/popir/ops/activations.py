"""Activation composites: softmax, log_softmax, GELU, SiLU, dropout and friends."""

import math

from popir.ops.base import exp, full, reduce_sum, zeros_like
from popir.ops.elementwise import erf, ge, log, maximum, minimum, sigmoid, tanh, where
from popir.ops.random import random_uniform
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

"""Statistics composites over primitives: mean, var, std, logsumexp."""

import math

from popir.ops._infer import norm_axes
from popir.ops.base import exp, reduce_sum, reshape
from popir.ops.elementwise import log, sqrt
from popir.ops.reduction import reduce_max


def count(x, axes):
    """How many elements of ``x`` each reduction over ``axes`` combines."""
    return math.prod(x.shape[a] for a in norm_axes(axes, x.ndim))


def mean(x, axes=None, keepdims=False):
    """torch.mean over ``axes`` (None: all)."""
    return reduce_sum(x, axes=axes, keepdims=keepdims) * (1.0 / max(count(x, axes), 1))


def var(x, axes=None, keepdims=False, correction=1):
    """torch.var: squared deviations summed over (count - correction); correction=0 is the biased form.

    With no degrees of freedom left the result is NaN/inf, as in torch.
    """
    centred = x - mean(x, axes, keepdims=True)
    dof = count(x, axes) - correction
    return reduce_sum(centred * centred, axes=axes, keepdims=keepdims) * (1.0 / dof if dof > 0 else math.inf)


def std(x, axes=None, keepdims=False, correction=1):
    """torch.std: the square root of ``var``."""
    return sqrt(var(x, axes, keepdims, correction))


def logsumexp(x, axes=None, keepdims=False):
    """torch.logsumexp, stabilised by subtracting the max."""
    top = reduce_max(x, axes=axes, keepdims=True)
    total = log(reduce_sum(exp(x - top), axes=axes, keepdims=True)) + top
    if keepdims:
        return total
    kept = norm_axes(axes, x.ndim)
    return reshape(total, shape=tuple(d for i, d in enumerate(x.shape) if i not in kept))

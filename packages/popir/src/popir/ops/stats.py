"""Statistics composites over primitives: mean, var, std, logsumexp."""

import math

from popir.ops._infer import norm_axes
from popir.ops.base import exp, reduce_sum, reshape
from popir.ops.elementwise import abs_, cast, log, ne, pow_, sqrt
from popir.ops.reduction import reduce_max, reduce_min


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


def norm(x, p=2.0, axes=None, keepdims=False):
    """torch.linalg.vector_norm: p = 2, 1, inf, -inf, 0 or any other positive order."""
    a = abs_(x)
    if p == math.inf:
        return reduce_max(a, axes=axes, keepdims=keepdims)
    if p == -math.inf:
        return reduce_min(a, axes=axes, keepdims=keepdims)
    if p == 0:
        return reduce_sum(cast(ne(x, x.graph.constant(0.0, x.dtype)), dtype=x.dtype), axes=axes, keepdims=keepdims)
    if p == 1:
        return reduce_sum(a, axes=axes, keepdims=keepdims)
    if p == 2:
        return sqrt(reduce_sum(x * x, axes=axes, keepdims=keepdims))
    total = reduce_sum(pow_(a, x.graph.constant(float(p), x.dtype)), axes=axes, keepdims=keepdims)
    return pow_(total, total.graph.constant(1.0 / p, x.dtype))

"""Statistics composites over primitives: mean, var, std, logsumexp, norms and distances, median, cumprod."""

import math

from popir.ops._infer import norm_axes
from popir.ops.base import exp, full, reduce_sum, reshape, zeros_like
from popir.ops.elementwise import abs_, cast, gt, log, ne, pow_, sqrt, where
from popir.ops.movement import pad, slice_
from popir.ops.ordering import sort
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


def doubling_scan(x, axis, combine, identity):
    """Inclusive running ``combine`` (an associative binary function) along ``axis``: after the step with
    shift s, out[i] combines the 2s entries ending at i (the ``identity`` pads before the start). log2(n)
    elementwise steps, so memory stays linear in x, unlike an n x n masked reduction."""
    axis = axis % x.ndim
    n = x.shape[axis]
    shift = 1
    while shift < n:
        stops = tuple(n - shift if a == axis else d for a, d in enumerate(x.shape))
        earlier = slice_(x, starts=(0,) * x.ndim, stops=stops)
        pads = tuple((shift, 0) if a == axis else (0, 0) for a in range(x.ndim))
        x = combine(x, pad(earlier, pads=pads, value=identity))
        shift *= 2
    return x


def cumprod(x, axis):
    """torch.cumprod along ``axis``: out[i] is the product of x[j] for j <= i (a doubling scan, so zeros need
    no division)."""
    return doubling_scan(x, axis, lambda a, b: a * b, 1.0)


def median(x, axis=None, keepdims=False):
    """torch.median: the lower median (sorted position (n - 1) // 2) and its int32 index along ``axis``
    (None: of the flattened tensor, value only)."""
    if axis is None:
        flat = reshape(x, shape=(x.type.size,))
        return median(flat, 0)[0]
    axis = axis % x.ndim
    values, order = sort(x, axis=axis, descending=False)
    k = (x.shape[axis] - 1) // 2
    starts = tuple(k if a == axis else 0 for a in range(x.ndim))
    stops = tuple(k + 1 if a == axis else d for a, d in enumerate(x.shape))
    shape = x.shape[:axis] + ((1,) if keepdims else ()) + x.shape[axis + 1 :]
    return reshape(slice_(values, starts=starts, stops=stops), shape=shape), reshape(
        slice_(order, starts=starts, stops=stops), shape=shape
    )


def cdist(a, b, p=2.0):
    """torch.cdist of row sets a (..., P, M) and b (..., R, M): (..., P, R) p-norm distances. At zero
    distance the 2-norm's gradient is 0, as in torch (not the 0/0 of sqrt's)."""
    diff = reshape(a, shape=a.shape[:-1] + (1, a.shape[-1])) - reshape(b, shape=b.shape[:-2] + (1,) + b.shape[-2:])
    if p != 2.0:
        return norm(diff, p=p, axes=(-1,), keepdims=False)
    squared = reduce_sum(diff * diff, axes=(-1,), keepdims=False)
    zero = zeros_like(squared)
    positive = gt(squared, zero)
    safe = where(positive, squared, full(squared.graph, (), 1.0, squared.dtype))
    return where(positive, sqrt(safe), zero)

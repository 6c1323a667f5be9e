"""Index-driven composites: bucketize, index_fill, index_reduce, scatter_reduce, bincount, embedding_bag.

Each builds a one-hot membership mask from int32 indices (``eq`` against a constant position ramp) and
reduces through it, so every op is plain elementwise work and reductions that the planners spread over
tiles, and gradients come from the primitives' VJPs. The masks cost positions x indices elements: these
ops suit the small index counts models use them with.
"""

import numpy as np

from popir.dtypes import DType
from popir.errors import IRError
from popir.ops.base import full, reduce_sum, reshape, zeros_like
from popir.ops.elementwise import cast, eq, le, logical_not, lt, maximum, minimum, where
from popir.ops.linalg import matmul
from popir.ops.movement import gather
from popir.ops.reduction import reduce_max, reduce_min, reduce_prod

REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def _ramp(graph, n, shape):
    """Positions 0..n-1 (int32) reshaped to ``shape`` (which holds n once and 1 elsewhere)."""
    return graph.constant(np.arange(n, dtype=np.int32).reshape(shape))


def bucketize(x, boundaries, right=False):
    """torch.bucketize: per element, how many (sorted) ``boundaries`` lie below it (right: at or below)."""
    edges = reshape(boundaries, shape=(1,) * x.ndim + boundaries.shape)
    values = reshape(x, shape=x.shape + (1,))
    below = le(edges, values) if right else lt(edges, values)
    return reduce_sum(cast(below, dtype=DType.int32), axes=(x.ndim,), keepdims=False)


def _axis_mask(x, axis, index):
    """bool (n, k) mask viewed on ``axis``: position i of x's axis is named by index[j]."""
    n, k = x.shape[axis], index.shape[0]
    return eq(reshape(index, shape=(1, k)), _ramp(x.graph, n, (n, 1)))


def index_fill(x, axis, index, value):
    """torch.Tensor.index_fill: ``value`` (a number or a 0-d Value) at the positions ``index`` names along
    ``axis``."""
    hit = reduce_max(cast(_axis_mask(x, axis, index), dtype=DType.int32), axes=(1,), keepdims=False)
    shape = tuple(x.shape[axis] if a == axis else 1 for a in range(x.ndim))
    hit = eq(reshape(hit, shape=shape), full(x.graph, (), 1, DType.int32))
    return where(hit, value if hasattr(value, "graph") else full(x.graph, (), value, x.dtype), x)


def _combine(x, contributions, present, reduce, include_self, counts):
    """Fold reduced ``contributions`` (and their ``counts`` per target) into ``x`` as torch's reduce modes do."""
    if reduce == "mean":
        total = contributions + x if include_self else contributions
        n = counts + 1.0 if include_self else maximum(counts, full(x.graph, (), 1.0, x.dtype))
        return where(present, total / n, x)
    if not include_self:
        return where(present, contributions, x)
    merge = {"sum": lambda a, b: a + b, "prod": lambda a, b: a * b, "amax": maximum, "amin": minimum}[reduce]
    return where(present, merge(x, contributions), x)


_IDENTITY = {"sum": 0.0, "mean": 0.0, "prod": 1.0, "amax": -np.inf, "amin": np.inf}
_REDUCE = {"sum": reduce_sum, "mean": reduce_sum, "prod": reduce_prod, "amax": reduce_max, "amin": reduce_min}


def _check_reduce(reduce):
    if reduce not in REDUCTIONS:
        raise IRError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")


def _reduce_over(mask, source, reduce, axis):
    """Reduce ``source`` (with a new axis ``axis`` of targets broadcast in) over its contributions."""
    picked = where(mask, source, full(source.graph, (), _IDENTITY[reduce], source.dtype))
    return _REDUCE[reduce](picked, axes=(axis + 1,), keepdims=False)


def index_reduce(x, axis, index, source, reduce, include_self=True):
    """torch.Tensor.index_reduce: source slice j folds into x's slice index[j] along ``axis``."""
    _check_reduce(reduce)
    n, k = x.shape[axis], index.shape[0]
    mask = _axis_mask(x, axis, index)  # (n, k)
    view = tuple(1 for _ in range(axis)) + (n, k) + tuple(1 for _ in range(axis + 1, x.ndim))
    mask = reshape(mask, shape=view)
    spread = reshape(source, shape=source.shape[:axis] + (1,) + source.shape[axis:])
    contributions = _reduce_over(mask, spread, reduce, axis)
    counts = reduce_sum(cast(mask, dtype=x.dtype), axes=(axis + 1,), keepdims=False)
    present = lt(full(x.graph, (), 0.0, x.dtype), counts)
    if x.shape != contributions.shape:
        raise IRError(f"index_reduce: source {list(source.shape)} does not fit x {list(x.shape)} on axis {axis}")
    return _combine(x, contributions, present, reduce, include_self, counts)


def scatter_reduce(x, axis, index, src, reduce, include_self=True):
    """torch.Tensor.scatter_reduce: src[..., j, ...] folds into x[..., index[..., j, ...], ...] along ``axis``."""
    _check_reduce(reduce)
    n = x.shape[axis]
    if index.shape != src.shape or any(i != d for a, (i, d) in enumerate(zip(index.shape, x.shape)) if a != axis):
        raise IRError(f"scatter_reduce needs index and src shaped alike and like x off axis {axis}")
    # mask[..., i, j, ...]: target position i of x's axis receives src position j.
    ramp = _ramp(x.graph, n, tuple(n if a == axis else 1 for a in range(x.ndim + 1)))
    mask = eq(reshape(index, shape=index.shape[:axis] + (1,) + index.shape[axis:]), ramp)
    spread = reshape(src, shape=src.shape[:axis] + (1,) + src.shape[axis:])
    contributions = _reduce_over(mask, spread, reduce, axis)
    counts = reduce_sum(cast(mask, dtype=x.dtype), axes=(axis + 1,), keepdims=False)
    present = lt(full(x.graph, (), 0.0, x.dtype), counts)
    return _combine(x, contributions, present, reduce, include_self, counts)


def bincount(x, length, weights=None):
    """torch.bincount with a static output ``length`` (>= max(x) + 1): counts, or summed ``weights``."""
    mask = eq(reshape(x, shape=(1, x.shape[0])), _ramp(x.graph, length, (length, 1)))
    if weights is None:
        return reduce_sum(cast(mask, dtype=DType.int32), axes=(1,), keepdims=False)
    spread = where(mask, reshape(weights, shape=(1, x.shape[0])), full(x.graph, (), 0.0, weights.dtype))
    return reduce_sum(spread, axes=(1,), keepdims=False)


def embedding_bag(weight, indices, offsets, mode="mean", per_sample_weights=None, include_last_offset=False):
    """torch.nn.functional.embedding_bag of 1-D ``indices`` split into bags at ``offsets``.

    Empty bags give zeros, as in torch. ``mode`` is "sum", "mean" or "max".
    """
    if mode not in ("sum", "mean", "max"):
        raise IRError(f"embedding_bag mode must be sum, mean or max, got {mode!r}")
    rows = gather(weight, indices, axis=0)  # (L, D)
    if per_sample_weights is not None:
        rows = rows * reshape(per_sample_weights, shape=(indices.shape[0], 1))
    length = indices.shape[0]
    bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    position = _ramp(weight.graph, length, (1, length))
    starts = reshape(offsets, shape=(offsets.shape[0], 1))
    # Position p belongs to the last bag whose offset is <= p: the count of such offsets, minus one.
    bag_of = reduce_sum(cast(le(starts, position), dtype=DType.int32), axes=(0,), keepdims=False)
    member = eq(reshape(bag_of, shape=(1, length)), _ramp(weight.graph, bags, (bags, 1)) + 1)  # (B, L)
    counts = reduce_sum(cast(member, dtype=weight.dtype), axes=(1,), keepdims=True)
    if mode == "max":
        lowest = full(weight.graph, (), -np.inf, weight.dtype)
        picked = where(reshape(member, shape=(bags, length, 1)), reshape(rows, shape=(1,) + rows.shape), lowest)
        best = reduce_max(picked, axes=(1,), keepdims=False)
        return where(lt(full(weight.graph, (), 0.0, weight.dtype), counts), best, zeros_like(best))
    total = matmul(cast(member, dtype=weight.dtype), rows)
    if mode == "sum":
        return total
    return total / maximum(counts, full(weight.graph, (), 1.0, weight.dtype))


def isnan(x):
    """torch.isnan: NaN is the one value unequal to itself."""
    return logical_not(eq(x, x))

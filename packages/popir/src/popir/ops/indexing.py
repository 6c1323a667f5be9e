"""Index-driven composites: bucketize, index_fill, index_reduce, scatter_reduce, bincount, embedding_bag.

Sums, means, counts and fills go through ``scatter_add``, so they cost memory linear in the positions and
indices, an index outside its axis is caught by the device like any gather/scatter index (even one
computed on the device), and gradients come from the primitives' VJPs. prod / amax / amin have no scatter
primitive: they reduce through a one-hot membership mask (positions x indices elements, so they suit the
small index counts models use them with); their counts still go through ``scatter_add`` for the range check.
"""

import numpy as np

from popir.dtypes import DType
from popir.errors import IRError
from popir.ops.base import broadcast_to, full, reduce_sum, reshape, zeros_like
from popir.ops.elementwise import cast, eq, le, logical_not, lt, maximum, minimum, where
from popir.ops.movement import gather, scatter_add, slice_
from popir.ops.reduction import reduce_max, reduce_min, reduce_prod
from popir.ops.stats import doubling_scan

REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def bucketize(x, boundaries, right=False):
    """torch.bucketize: per element, how many (sorted) ``boundaries`` lie below it (right: at or below)."""
    edges = reshape(boundaries, shape=(1,) * x.ndim + boundaries.shape)
    values = reshape(x, shape=x.shape + (1,))
    below = le(edges, values) if right else lt(edges, values)
    return reduce_sum(cast(below, dtype=DType.int32), axes=(x.ndim,), keepdims=False)


def _ones_f32(graph, shape):
    return full(graph, shape, 1.0, DType.float32)


def _counts(x, index, axis):
    """How many entries of ``index`` (shaped like x off ``axis``) name each position of x, in x's dtype."""
    return scatter_add(zeros_like(x), index, full(x.graph, index.shape, 1, x.dtype), axis=axis)


def _along(index, axis, shape):
    """1-D ``index`` viewed on ``axis`` and broadcast to ``shape`` (a source laid out like x)."""
    view = tuple(index.shape[0] if a == axis else 1 for a in range(len(shape)))
    return broadcast_to(reshape(index, shape=view), shape=shape)


def index_fill(x, axis, index, value):
    """torch.Tensor.index_fill: ``value`` (a number or a 0-d Value) at the positions ``index`` names along
    ``axis``."""
    n = x.shape[axis]
    hits = scatter_add(full(x.graph, (n,), 0.0, DType.float32), index, _ones_f32(x.graph, index.shape), axis=0)
    shape = tuple(n if a == axis else 1 for a in range(x.ndim))
    hit = lt(full(x.graph, (), 0.0, DType.float32), reshape(hits, shape=shape))
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


_IDENTITY = {"prod": 1.0, "amax": -np.inf, "amin": np.inf}
_REDUCE = {"prod": reduce_prod, "amax": reduce_max, "amin": reduce_min}


def _check_reduce(reduce):
    if reduce not in REDUCTIONS:
        raise IRError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")


def _masked_reduce(x, axis, index, source, reduce):
    """prod / amax / amin of ``source`` (laid out like x, ``index`` shaped alike) per target position of x's
    ``axis``, through a one-hot mask[..., i, j, ...] (target i receives source position j)."""
    n = x.shape[axis]
    ramp = x.graph.constant(
        np.arange(n, dtype=np.int32).reshape(tuple(n if a == axis else 1 for a in range(x.ndim + 1)))
    )
    mask = eq(reshape(index, shape=index.shape[:axis] + (1,) + index.shape[axis:]), ramp)
    spread = reshape(source, shape=source.shape[:axis] + (1,) + source.shape[axis:])
    picked = where(mask, spread, full(source.graph, (), _IDENTITY[reduce], source.dtype))
    return _REDUCE[reduce](picked, axes=(axis + 1,), keepdims=False)


def _scatter_reduce_along(x, axis, index, source, reduce, include_self):
    """Fold ``source`` into x at ``index`` (both laid out like x off ``axis``) with torch's reduce modes."""
    counts = _counts(x, index, axis)
    present = lt(full(x.graph, (), 0.0, x.dtype), counts)
    if reduce in ("sum", "mean"):
        contributions = scatter_add(zeros_like(x), index, source, axis=axis)
    else:
        contributions = _masked_reduce(x, axis, index, source, reduce)
    return _combine(x, contributions, present, reduce, include_self, counts)


def index_reduce(x, axis, index, source, reduce, include_self=True):
    """torch.Tensor.index_reduce: source slice j folds into x's slice index[j] along ``axis``."""
    _check_reduce(reduce)
    expected = x.shape[:axis] + index.shape + x.shape[axis + 1 :]
    if source.shape != expected:
        raise IRError(f"index_reduce: source {list(source.shape)} does not fit x {list(x.shape)} on axis {axis}")
    return _scatter_reduce_along(x, axis, _along(index, axis, source.shape), source, reduce, include_self)


def scatter_reduce(x, axis, index, src, reduce, include_self=True):
    """torch.Tensor.scatter_reduce: src[..., j, ...] folds into x[..., index[..., j, ...], ...] along ``axis``."""
    _check_reduce(reduce)
    if index.shape != src.shape or any(i != d for a, (i, d) in enumerate(zip(index.shape, x.shape)) if a != axis):
        raise IRError(f"scatter_reduce needs index and src shaped alike and like x off axis {axis}")
    return _scatter_reduce_along(x, axis, index, src, reduce, include_self)


def bincount(x, length, weights=None):
    """torch.bincount with a static output ``length`` (>= max(x) + 1): counts (int32), or summed ``weights``.
    A value of x at or beyond ``length`` is an out-of-range index on the device."""
    updates = _ones_f32(x.graph, x.shape) if weights is None else weights
    counts = scatter_add(full(x.graph, (length,), 0.0, updates.dtype), x, updates, axis=0)
    return cast(counts, dtype=DType.int32) if weights is None else counts


def _bag_of_positions(indices, offsets):
    """int32 bag number of each position of ``indices``: the count of offsets at or before it, minus one.
    Offsets mark bag starts (one may equal the length: an empty last bag)."""
    length = indices.shape[0]
    graph = indices.graph
    starts = scatter_add(
        full(graph, (length + 1,), 0.0, DType.float32), offsets, _ones_f32(graph, offsets.shape), axis=0
    )
    # A doubling scan, not cumsum: popsim lowers cumsum through a length x length index table.
    begun = doubling_scan(slice_(starts, starts=(0,), stops=(length,)), 0, lambda a, b: a + b, 0.0)
    return cast(begun - 1.0, dtype=DType.int32)


def embedding_bag(weight, indices, offsets, mode="mean", per_sample_weights=None, include_last_offset=False):
    """torch.nn.functional.embedding_bag of 1-D ``indices`` split into bags at ``offsets``.

    Empty bags give zeros, as in torch. ``mode`` is "sum", "mean" or "max". Positions at or after the last
    offset when ``include_last_offset`` belong to no bag.
    """
    if mode not in ("sum", "mean", "max"):
        raise IRError(f"embedding_bag mode must be sum, mean or max, got {mode!r}")
    rows = gather(weight, indices, axis=0)  # (L, D)
    if per_sample_weights is not None:
        rows = rows * reshape(per_sample_weights, shape=(indices.shape[0], 1))
    length, dim = rows.shape
    bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    bag_of = _bag_of_positions(indices, offsets)
    # One spare bag row receives the positions past the last bag; it is cut off below.
    spare = full(weight.graph, (bags + 1, dim), 0.0, weight.dtype)
    counts = _counts(full(weight.graph, (bags + 1,), 0.0, weight.dtype), bag_of, 0)
    counts = reshape(slice_(counts, starts=(0,), stops=(bags,)), shape=(bags, 1))
    index = broadcast_to(reshape(bag_of, shape=(length, 1)), shape=(length, dim))
    if mode == "max":
        best = slice_(_masked_reduce(spare, 0, index, rows, "amax"), starts=(0, 0), stops=(bags, dim))
        return where(lt(full(weight.graph, (), 0.0, weight.dtype), counts), best, zeros_like(best))
    total = slice_(scatter_add(spare, index, rows, axis=0), starts=(0, 0), stops=(bags, dim))
    if mode == "sum":
        return total
    return total / maximum(counts, full(weight.graph, (), 1.0, weight.dtype))


def isnan(x):
    """torch.isnan: NaN is the one value unequal to itself."""
    return logical_not(eq(x, x))

"""A reduction's (row, tile) pairs and parts (``planner.Lowerer._local_pairs``) come from one pass over its
elements (``_reduce_plan.row_tile_pairs``) and equal, array for array, the sort-based statement of them: pairs
numbered as ``np.unique`` of ``tile * rows + row`` numbers them, each element's rank among its pair's in index
order, and parts as ``np.unique`` of (pair, share number)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from popsim import _reduce_plan, planner


def _reference(tile, rows, group, grain, workers):
    """The pairs and parts by sorting: (tile, part of each element, each part's tile, row and count), or None
    when no tile holds two elements of one row."""
    keys, pair_of, counts = np.unique(tile * rows + np.repeat(np.arange(rows), group), return_inverse=True,
                                      return_counts=True)  # fmt: skip
    if keys.size == tile.size:
        return None
    pair_of = pair_of.reshape(-1)
    by_pair = np.argsort(pair_of, kind="stable")
    rank = np.empty(tile.size, np.int64)
    rank[by_pair] = np.arange(tile.size) - np.repeat(np.cumsum(counts) - counts, counts)
    share = np.maximum(grain, -(-counts // workers))
    parts, part_of, part_counts = np.unique(pair_of * group + rank // share[pair_of], return_inverse=True,
                                            return_counts=True)  # fmt: skip
    return tile, part_of.reshape(-1), keys[parts // group] // rows, keys[parts // group] % rows, part_counts


class _Stub:
    """What ``_local_pairs`` reads of a Lowerer, a source and its mapping."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _local_pairs(tile, rows, group, grain, workers):
    """``Lowerer._local_pairs`` of a one-source reduction whose element i lies on ``tile[i]``, whatever the
    cost estimate says."""
    lw = _Stub(target=_Stub(workers=workers), _local_pays=lambda *args: True)
    size = tile.size
    mapping = _Stub(tiles=tile, starts=np.arange(size), stops=np.arange(1, size + 1))
    index = np.arange(size).reshape(rows, group)
    return planner.Lowerer._local_pairs(lw, [_Stub(mapping=mapping)], index, None, grain, 1)


@given(
    rows=st.integers(1, 12),
    group=st.integers(1, 40),
    num_tiles=st.integers(1, 6),
    grain=st.integers(1, 8),
    workers=st.integers(1, 6),
    seed=st.integers(0, 2**31),
)
def test_pairs_and_parts_equal_the_sorting_statement(rows, group, num_tiles, grain, workers, seed):
    rng = np.random.default_rng(seed)
    tile = rng.integers(0, num_tiles, rows * group) * 3 + 1  # tiles numbered sparsely, not from 0
    want = _reference(tile, rows, group, grain, workers)
    got = _local_pairs(tile, rows, group, grain, workers)
    assert (got is None) == (want is None)
    for g, w in zip(got or (), want or ()):
        assert g.dtype == w.dtype and np.array_equal(g, w)


@given(rows=st.integers(1, 30), group=st.integers(1, 30), num_tiles=st.integers(1, 2000), seed=st.integers(0, 2**31))
def test_each_elements_pair_and_rank_match_unique(rows, group, num_tiles, seed):
    tile = np.random.default_rng(seed).integers(0, num_tiles, rows * group)
    got = _reduce_plan.row_tile_pairs(tile, group)
    keys, pair_of, counts = np.unique(tile * rows + np.arange(tile.size) // group, return_inverse=True,
                                      return_counts=True)  # fmt: skip
    if keys.size == tile.size:
        assert got is None
        return
    got_pair, rank, pair_tile, pair_row, got_counts = got
    assert np.array_equal(got_pair, pair_of) and np.array_equal(got_counts, counts)
    assert np.array_equal(pair_tile, keys // rows) and np.array_equal(pair_row, keys % rows)
    # An element's rank counts the earlier elements of its pair.
    assert all(rank[i] == np.sum(pair_of[:i] == pair_of[i]) for i in range(tile.size))


@pytest.mark.parametrize("tile, group", [(np.array([0, 1, 2]), 2), (np.array([0, -1]), 2), (np.array([0]), 0)])
def test_malformed_reductions_are_refused(tile, group):
    with pytest.raises(ValueError):
        _reduce_plan.row_tile_pairs(tile, group)

"""A Copy's exchange rows and per-tile load come from one pass over its index map (``_exchange.copy_plan``);
they equal a NumPy reference working element by element: the coalesced rows of the per-element addresses,
bytes received and copied locally per tile, a broadcast source element sent once from its tile, and each
element crossing to another IPU once per IPU it reaches. The coalesced rows equal a plain Python statement
of the greedy rule on structured random copies."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from popsim import _exchange
from popsim import _opcodes as oc

TILES_PER_IPU = 4


def _reference(index, elements, src_addr, src_tile, dst_addr, dst_tile, num_ipus):
    num_tiles = TILES_PER_IPU * num_ipus
    st = src_tile[index]
    cross = st != dst_tile
    sent = np.zeros(num_tiles, np.int64)
    unique_elements, first = np.unique(elements[cross], return_index=True)
    np.add.at(sent, st[cross][first], 1)
    hops = np.stack([elements, st // TILES_PER_IPU, dst_tile // TILES_PER_IPU])[:, cross]
    _, src_ipu, dst_ipu = np.unique(hops[:, hops[1] != hops[2]], axis=1)
    link = np.maximum(np.bincount(src_ipu, minlength=num_ipus), np.bincount(dst_ipu, minlength=num_ipus))
    return (
        _exchange.copy_runs(src_addr[index], dst_addr, 4),
        np.bincount(dst_tile[cross], minlength=num_tiles),
        sent,
        np.bincount(dst_tile[~cross], minlength=num_tiles),
        link,
    )


def _random_copy(rng, num_ipus):
    """Sources of ``total`` elements at random addresses and tiles; a destination of random blocks; a random
    index map reading the sources (some entries repeated: a broadcast), with element numbers that merge the
    second half of the sources into the first (an alias)."""
    num_tiles = TILES_PER_IPU * num_ipus
    total = int(rng.integers(2, 40))
    src_addr = rng.permutation(total).astype(np.int64) * 4 + 4096
    src_tile = rng.integers(0, num_tiles, total)
    sizes = rng.integers(1, 6, int(rng.integers(1, 8)))
    dst_base = np.cumsum(np.r_[0, sizes[:-1]]) * 4
    dst_tile = rng.integers(0, num_tiles, sizes.size)
    index = rng.integers(0, total, int(sizes.sum()))
    half = total // 2
    elements = np.where(index >= half, index - half, index) if rng.random() < 0.5 else index
    src_tile[half : 2 * half] = src_tile[:half]  # an alias lives where what it aliases lives
    dst_addr = np.concatenate([b + 4 * np.arange(s) for b, s in zip(dst_base, sizes)])
    args = (index, elements, src_addr, src_tile, dst_base, dst_tile, sizes)
    return args, (index, elements, src_addr, src_tile, dst_addr, np.repeat(dst_tile, sizes), num_ipus)


@pytest.mark.parametrize("num_ipus", [1, 2, 3])
def test_copy_plan_matches_the_element_by_element_reference(num_ipus):
    rng = np.random.default_rng(num_ipus)
    for _ in range(200):
        args, ref_args = _random_copy(rng, num_ipus)
        got = _exchange.copy_plan(*args, 4, TILES_PER_IPU * num_ipus, TILES_PER_IPU, num_ipus)
        for g, want in zip(got, _reference(*ref_args)):
            np.testing.assert_array_equal(g, want)


_SLICE = st.tuples(st.integers(0, 60), st.integers(1, 12), st.integers(-1, 1))


@given(
    st.lists(st.tuples(st.integers(1, 9), st.integers(0, 11), st.integers(0, 2)), min_size=1, max_size=8),
    st.lists(_SLICE, min_size=1, max_size=8),
    st.lists(st.integers(1, 9), min_size=1, max_size=8),
    st.integers(1, 3),
    st.booleans(),
)
def test_copy_plan_on_contiguous_spans_matches_the_element_by_element_reference(
    blocks, slices, dst_sizes, num_ipus, alias
):
    """copy_plan takes a run of consecutive source elements at consecutive addresses of one tile at once;
    the rows and loads equal the per-element reference where such runs start and stop anywhere: at the ends
    of source blocks (next block on another tile, or after an address gap), of destination blocks, of
    slices of the index map, and where an alias or a broadcast repeats elements."""
    num_tiles = TILES_PER_IPU * num_ipus
    sizes = np.array([b[0] for b in blocks])
    gaps = np.array([b[2] for b in blocks]) * 4  # 0: the next block's addresses follow on
    starts = 4096 + np.cumsum(np.r_[0, sizes[:-1] * 4 + gaps[:-1]])
    src_addr = np.concatenate([a + 4 * np.arange(n) for a, n in zip(starts, sizes)])
    src_tile = np.repeat([b[1] % num_tiles for b in blocks], sizes)
    total = src_addr.size
    # Slices of the sources (step 1, or -1 read backwards, or 0 a broadcast of one element).
    index = np.concatenate([(a + d * np.arange(n)) % total for a, n, d in slices])
    dst = np.array(dst_sizes)
    dst = np.r_[dst[np.cumsum(dst) < index.size], 0]
    dst[-1] = index.size - dst[:-1].sum()
    dst_base = 65536 + np.cumsum(np.r_[0, dst[:-1]]) * 4
    dst_tile = np.arange(dst.size) * 5 % num_tiles
    half = total // 2
    elements = np.where(index >= half, index - half, index) if alias else index
    if alias:
        src_tile[half : 2 * half] = src_tile[:half]
    dst_addr = np.concatenate([b + 4 * np.arange(s) for b, s in zip(dst_base, dst)])
    got = _exchange.copy_plan(
        index, elements, src_addr, src_tile, dst_base, dst_tile, dst, 4, num_tiles, TILES_PER_IPU, num_ipus
    )
    want = _reference(index, elements, src_addr, src_tile, dst_addr, np.repeat(dst_tile, dst), num_ipus)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_copy_plan_refuses_an_index_outside_its_sources():
    index = np.array([0, 5], np.int64)
    src = np.array([0, 4], np.int64)
    with pytest.raises(IndexError, match="reads element 5 of sources holding 2"):
        _exchange.copy_plan(index, index, src, src, src[:1], src[:1], np.array([2]), 4, 4, 4, 1)


def _greedy_rows(src, dst, isz):
    """copy_runs' rule element by element: a run grows while its destination stays contiguous and its source
    keeps its first step; a run of the last row's shape whose source is that row's next step on is one
    more repetition of it. Rows are (src, dst, count, stride, itemsize, reps, outer)."""
    rows, i, n = [], 0, len(src)
    while i < n:
        j, stride = i + 1, isz
        if j < n and dst[j] == dst[i] + isz:
            stride = src[j] - src[i]
            while j < n and dst[j] == dst[j - 1] + isz and src[j] - src[j - 1] == stride:
                j += 1
        count, last = j - i, rows[-1] if rows else None
        if last and last[2:4] == [count, stride] and dst[i] == last[1] + last[5] * count * isz:
            outer = src[i] - last[0]
            if last[5] == 1 or outer == last[5] * last[6]:
                last[5], last[6] = last[5] + 1, outer if last[5] == 1 else last[6]
                i = j
                continue
        rows.append([src[i], dst[i], count, stride, isz, 1, 0])
        i = j
    return rows


_SEGMENT = st.tuples(
    st.integers(0, 50), st.sampled_from([0, 1, -1, 2, 7]), st.integers(1, 6), st.integers(1, 4), st.integers(-9, 9)
)


@given(st.lists(_SEGMENT, max_size=10), st.sampled_from([1, 2, 4]), st.booleans())
def test_copy_runs_and_copy_plan_rows_follow_the_greedy_rule(segments, isz, gaps):
    # Segments of repeated strided runs (windows, transposes, broadcasts) with destinations that are
    # sometimes contiguous from one segment to the next: every merge the rule allows, and the near misses.
    src, dst, at = [], [], 0
    for start, step, count, reps, outer in segments:
        for k in range(reps):
            src += [(1000 + start + k * outer + step * j) * isz for j in range(count)]
            dst += [(at + j) * isz for j in range(count)]
            at += count
        at += gaps and start % 2
    want = _greedy_rows(src, dst, isz)
    src, dst = np.array(src, np.int64), np.array(dst, np.int64)
    assert _exchange.copy_runs(src, dst, isz).tolist() == want
    # copy_plan over one source block that holds every element once, read in this order.
    order = np.argsort(src, kind="stable")
    index = np.empty(len(src), np.int64)
    index[order] = np.arange(len(src))
    tiles, sizes = np.zeros(len(dst), np.int64), np.ones(len(dst), np.int64)
    rows = _exchange.copy_plan(index, index, src[order], tiles, dst, tiles, sizes, isz, 1, 1, 1)[0]
    assert rows.tolist() == want


@given(st.lists(st.tuples(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=7, max_size=7), st.integers(1, 3))))
def test_split_rows_equals_a_mask_of_the_rows_of_one_repetition(rows):
    """split_rows (one pass in C) equals its NumPy statement: the rows of several repetitions in order, and
    the columns src, dst, count, stride of the others in order."""
    at = oc.COPY_COLUMNS.index("reps")
    table = np.array([r[:at] + [reps] + r[at + 1 :] for r, reps in rows], np.int32).reshape(-1, len(oc.COPY_COLUMNS))
    single = table[:, at] == 1
    general, runs = _exchange.split_rows(table)
    assert general.dtype == runs.dtype == np.int32
    np.testing.assert_array_equal(general, table[~single])
    np.testing.assert_array_equal(runs, table[single][:, : len(oc.RUN_COLUMNS)])

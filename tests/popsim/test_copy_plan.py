"""A Copy's exchange rows and per-tile load come from one pass over its index map (``_exchange.copy_plan``);
they equal a NumPy reference working element by element: the coalesced rows of the per-element addresses,
bytes received and copied locally per tile, a broadcast source element sent once from its tile, and each
element crossing to another IPU once per IPU it reaches."""

import numpy as np
import pytest

from popsim import _exchange

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


def test_copy_plan_refuses_an_index_outside_its_sources():
    index = np.array([0, 5], np.int64)
    src = np.array([0, 4], np.int64)
    with pytest.raises(IndexError, match="reads element 5 of sources holding 2"):
        _exchange.copy_plan(index, index, src, src, src[:1], src[:1], np.array([2]), 4, 4, 4, 1)

"""The tile allocator's first-fit placement, which keeps each tile's live blocks sorted incrementally."""

import numpy as np

from popir import DType
from popsim.allocate import ALIGN, TileAllocator


def _reference_first_fit(live, nbytes):
    """First fit over the live (start, end) blocks, scanned in address order."""
    offset = 0
    for start, end in sorted(live):
        if start - offset >= nbytes:
            break
        offset = max(offset, end)
    return offset


def test_first_fit_matches_a_sorted_scan_per_tile_with_frees_and_out_of_order_placements():
    """One placement spans several tiles, each with its own live blocks: every tile's offset is the
    first fit of a scan of that tile's blocks alone."""
    rng = np.random.default_rng(0)
    num_tiles = 4
    alloc = TileAllocator([1 << 30] * num_tiles)
    live = {t: [] for t in range(num_tiles)}  # tile -> [(start, end, last)]
    peak = [0] * num_tiles
    for step in range(200):
        tiles = np.flatnonzero(rng.random(num_tiles) < 0.6)
        nbytes = rng.integers(1, 64, tiles.size) * ALIGN - rng.integers(0, ALIGN, tiles.size)
        last = step + int(rng.integers(0, 20))
        got = alloc.place(f"s{step}", tiles, nbytes, step, last)
        for tile, size in zip(tiles.tolist(), nbytes.tolist()):
            live[tile] = [b for b in live[tile] if b[2] >= step]
            aligned = -(-size // ALIGN) * ALIGN
            assert got[tile] == _reference_first_fit([(s, e) for s, e, _ in live[tile]], aligned)
            live[tile].append((int(got[tile]), int(got[tile]) + aligned, last))
        for tile in tiles.tolist():
            assert [b[:3] for b in alloc._tile_blocks(tile)] == sorted(live[tile])
            peak[tile] = max(peak[tile], live[tile][-1][1])
    assert alloc.peak.tolist() == peak


def test_first_fit_matches_the_scan_with_resident_blocks_unsorted_tiles_and_steps_out_of_order():
    """Blocks live to the end (variables), tiles given in any order, first steps that go back and more live
    blocks on a tile than the allocator starts with: every offset is still the per-tile scan's first fit, and
    a tile over budget reports its blocks in address order."""
    rng = np.random.default_rng(1)
    num_tiles = 9
    alloc = TileAllocator([4096] * num_tiles)
    live = {t: [] for t in range(num_tiles)}
    for step in range(300):
        tiles = rng.permutation(num_tiles)[: int(rng.integers(1, num_tiles + 1))]
        nbytes = rng.integers(1, 40, tiles.size) * ALIGN
        first = step // 2 - int(rng.integers(0, 3))
        last = np.inf if rng.random() < 0.1 else first + int(rng.integers(0, 60))
        got = alloc.place(f"s{step}", tiles, nbytes, first, last)
        for tile, size in zip(tiles.tolist(), nbytes.tolist()):
            live[tile] = [b for b in live[tile] if b[2] >= first]
            assert got[tile] == _reference_first_fit([(s, e) for s, e, _ in live[tile]], size)
            live[tile].append((int(got[tile]), int(got[tile]) + size, last))
        for tile in tiles.tolist():
            assert [b[:3] for b in alloc._tile_blocks(tile)] == sorted(live[tile])
    over = sorted(alloc.overflow)
    assert over, "the budget is small enough for some tile to overflow"
    end, blocks = alloc.overflow[over[0]]
    assert [b[:2] for b in blocks] == sorted(b[:2] for b in blocks) and blocks[-1][1] == end


def test_dtype_numpy_and_itemsize_agree_with_numpy():
    for d in DType:
        assert d.numpy == np.dtype(d.value)
        assert d.itemsize == np.dtype(d.value).itemsize
        assert str(d) == d.value == f"{d}"

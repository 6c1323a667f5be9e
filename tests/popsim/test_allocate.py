"""The tile allocator: first-fit placement of resident blocks, which keeps each tile's live blocks sorted
incrementally, and a program's blocks placed together, largest first on each tile."""

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


def _reference_by_size(resident, blocks):
    """Greedy by size on one tile: ``blocks`` (index, need, first, last) largest first (then by index), each
    at the lowest offset clear of the resident (start, end) blocks and of those placed whose steps overlap."""
    placed, offsets = [], {}
    for index, need, first, last in sorted(blocks, key=lambda b: (-b[1], b[0])):
        busy = list(resident) + [(s, e) for s, e, f, until in placed if f <= last and first <= until]
        offsets[index] = _reference_first_fit(busy, need)
        placed.append((offsets[index], offsets[index] + need, first, last))
    return offsets


def test_placing_a_program_together_puts_the_largest_block_first_on_each_tile():
    """Each tile's offsets are the greedy-by-size reference's, also where many tiles hold the same blocks (the
    kernel runs once for them) and where tiles differ only in their resident blocks or one block's size."""
    rng = np.random.default_rng(2)
    num_tiles = 12
    alloc = TileAllocator([1 << 30] * num_tiles)
    alloc.place("resident", np.arange(6), np.full(6, 40), -1, np.inf)
    alloc.place("other", np.array([3]), np.array([16]), -1, np.inf)
    patterns = [np.arange(num_tiles), np.arange(6), np.arange(6, num_tiles), np.arange(0, num_tiles, 2)]
    placements = []
    for step in range(80):
        tiles = patterns[rng.integers(len(patterns))] if rng.random() < 0.8 else np.flatnonzero(rng.random(12) < 0.5)
        nbytes = np.full(tiles.size, int(rng.integers(1, 64)) * ALIGN)
        nbytes[tiles == 7] += ALIGN  # one tile differs in one block's size only
        last = np.inf if rng.random() < 0.05 else step + int(rng.integers(0, 15))
        placements.append((f"s{step}", tiles, nbytes, step - int(rng.integers(0, 3)), last))
    offsets = alloc.place_all(placements)
    for tile in range(num_tiles):
        resident = [(s, e) for s, e, _, _ in alloc._tile_blocks(tile)]
        blocks = [
            (i, int(nbytes[tiles == tile][0]), first, last)
            for i, (_, tiles, nbytes, first, last) in enumerate(placements)
            if tile in tiles
        ]
        want = _reference_by_size(resident, blocks)
        assert {i: int(offsets[i][tile]) for i, *_ in blocks} == want, tile
        ends = [want[i] + need for i, need, _, _ in blocks] + [e for _, e in resident]
        assert alloc.peak[tile] == max(ends)


def test_placing_together_reuses_the_hole_a_short_lived_block_leaves():
    """In program order, a block freed early leaves a hole that the next, larger block does not fit, and the
    peak grows; placed largest first, the larger blocks go low and the short-lived one fits beside them."""
    steps = [("x", 2048, -1, 0), ("a", 4096, 0, 2), ("b", 2304, 1, 2), ("c", 4096, 2, 3)]
    in_order = TileAllocator([1 << 20])
    for name, nbytes, first, last in steps:
        in_order.place(name, [0], [nbytes], first, last)
    together = TileAllocator([1 << 20])
    together.place_all([(name, [0], [nbytes], first, last) for name, nbytes, first, last in steps])
    live = max(sum(n for _, n, f, until in steps if f <= step <= until) for step in range(-1, 4))
    assert in_order.peak[0] > live == together.peak[0]


def test_an_over_budget_program_names_the_blocks_live_with_the_furthest_one():
    alloc = TileAllocator([1024, 1024])
    alloc.place("weights", [0, 1], [256, 256], -1, np.inf)
    placements = [("early", [0], [512], 0, 1), ("big", [0], [900], 2, 3), ("with big", [0], [128], 3, 4)]
    alloc.place_all(placements)
    end, blocks = alloc.overflow[0]
    assert list(alloc.overflow) == [0] and end == 256 + 904 + 128  # "with big" above "big"; "early" is gone
    assert [b[3] for b in blocks] == ["weights", "big", "with big"]

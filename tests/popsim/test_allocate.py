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


def test_first_fit_matches_a_sorted_scan_with_frees_and_out_of_order_placements():
    rng = np.random.default_rng(0)
    alloc = TileAllocator({0: 1 << 30})
    live = []  # (start, end, last)
    for step in range(200):
        nbytes = int(rng.integers(1, 64)) * ALIGN
        last = step + int(rng.integers(0, 20))
        live = [b for b in live if b[2] >= step]
        want = _reference_first_fit([(s, e) for s, e, _ in live], nbytes)
        got = alloc.place(f"s{step}", {0: nbytes}, step, last)[0]
        assert got == want
        live.append((got, got + nbytes, last))
        assert [b[:3] for b in alloc.live[0]] == sorted(live)


def test_dtype_numpy_and_itemsize_agree_with_numpy():
    for d in DType:
        assert d.numpy == np.dtype(d.value)
        assert d.itemsize == np.dtype(d.value).itemsize
        assert str(d) == d.value == f"{d}"

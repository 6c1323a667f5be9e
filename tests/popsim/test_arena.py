"""The tile arena and its Cython exchange-copy kernel."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from popsim import TileArena


def test_copy_moves_bytes_between_tiles_and_leaves_others_untouched():
    arena = TileArena(4, 1024)
    arena.view(0, 0, 8)[:] = np.arange(8, dtype=np.uint8)
    arena.copy(np.array([0], np.int64), np.array([3 * 1024 + 16], np.int64), np.array([8], np.int64))
    assert arena.view(3, 16, 8).tolist() == list(range(8))
    assert not arena.view(1, 0, 1024).any() and not arena.view(2, 0, 1024).any()


@given(st.data())
def test_random_copy_lists_match_numpy(data):
    tiles, size = 3, 256
    arena = TileArena(tiles, size)
    flat = arena.buffer
    flat[:] = np.arange(flat.size, dtype=np.uint64).astype(np.uint8)
    expected = flat.copy()
    count = data.draw(st.integers(0, 6))
    src, dst, nbytes = [], [], []
    for _ in range(count):
        n = data.draw(st.integers(0, 32))
        s = data.draw(st.integers(0, flat.size - n))
        d = data.draw(st.integers(0, flat.size - n))
        src.append(s), dst.append(d), nbytes.append(n)
        expected[d : d + n] = expected[s : s + n].copy()
    arena.copy(np.array(src, np.int64), np.array(dst, np.int64), np.array(nbytes, np.int64))
    assert np.array_equal(flat, expected)


def test_views_are_bounds_checked():
    arena = TileArena(2, 128)
    with pytest.raises(IndexError, match="tile 2"):
        arena.view(2, 0, 4)
    with pytest.raises(IndexError, match="outside tile 1"):
        arena.view(1, 120, 16)

"""The tile arena and its Cython exchange-copy kernel."""

import os
import pathlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from popsim import TileArena
from popsim._arena import HUGE_PAGE

_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def _thp_eligible(address):
    """The THPeligible flag of the mapping holding ``address`` (None where the kernel does not report it)."""
    try:
        lines = pathlib.Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return int(line.split()[1])
    return None


def test_an_arena_of_a_few_mib_asks_for_huge_pages_and_a_large_one_refuses_them():
    # A step reads every tile: on 4 KiB pages a densely packed arena of a few MiB misses the TLB at most rows.
    small = TileArena(1472, 4992)
    assert small.buffer.ctypes.data % HUGE_PAGE == 0 and small.buffer.size == 1472 * 4992
    large = TileArena(1472, 65536)  # beyond HUGE_PAGE_ARENA_BYTES: pages untouched stay free
    eligible = _thp_eligible(small.buffer.ctypes.data)
    setting = pathlib.Path(_THP_SETTING)
    if eligible is None or not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("this kernel reports no transparent huge pages")
    assert eligible == 1
    assert _thp_eligible(large.buffer.ctypes.data) == 0


def test_a_forked_process_writes_its_own_copy_of_the_arena():
    arena = TileArena(4, 1024)
    pid = os.fork()
    if pid == 0:  # the child: scribble over every tile, then leave without running anything else
        arena.buffer[:] = 7
        os._exit(0)
    os.waitpid(pid, 0)
    assert not arena.buffer.any()

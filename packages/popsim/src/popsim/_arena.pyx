"""Tile memory arena and the exchange copy kernel.

The arena is one private anonymous zero-filled mapping seen as a NumPy buffer; the OS maps its pages lazily,
so a full 1,472-tile Mk2 (~919 MB) costs only the pages that tensors actually touch. An arena of at most
HUGE_PAGE_ARENA_BYTES (the executable packs tiles' data densely, so most models' arenas are this small) asks for transparent huge pages: a step's exchange rows and vertices read every tile,
and with 4 KiB pages the engine spent about half its time on TLB misses; such an arena is small enough for a
whole 2 MB page to be resident even where only a few bytes of it are used. Larger arenas refuse them, so a
few bytes used in each of three neighbouring tiles never cost a whole 2 MB page.
"""

import mmap

cimport numpy as cnp
from libc.string cimport memcpy

import numpy as np

from popsim._types cimport byte_t, offset_t, tile_t

cnp.import_array()

HUGE_PAGE = 2 << 20
# Arenas from one huge page up to this size use transparent huge pages (the most they can add to resident
# memory); a smaller one stays on 4 KiB pages rather than cost a whole huge page.
HUGE_PAGE_ARENA_BYTES = 64 << 20


cdef class TileArena:
    def __cinit__(self, tile_t num_tiles, offset_t tile_bytes):
        if num_tiles <= 0 or tile_bytes <= 0:
            raise ValueError(f"an arena needs tiles and bytes, got {num_tiles} x {tile_bytes}")
        self.num_tiles = num_tiles
        self.tile_bytes = tile_bytes
        size = num_tiles * tile_bytes
        huge = HUGE_PAGE <= size <= HUGE_PAGE_ARENA_BYTES and hasattr(mmap, "MADV_HUGEPAGE")
        # Private, so a forked process writes its own copy; one huge page more, to start on a huge page.
        self._pages = mmap.mmap(-1, size + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            self._pages.madvise(mmap.MADV_HUGEPAGE)
        elif hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._pages.madvise(mmap.MADV_NOHUGEPAGE)
        whole = np.frombuffer(self._pages, dtype=np.uint8)
        skip = -whole.ctypes.data % HUGE_PAGE if huge else 0
        self.buffer = whole[skip:skip + size]
        self.base = <byte_t*> cnp.PyArray_DATA(self.buffer)

    cdef byte_t* tile_ptr(self, tile_t tile, offset_t offset) noexcept nogil:
        return self.base + tile * self.tile_bytes + offset

    def view(self, tile_t tile, offset_t offset, offset_t nbytes):
        """A writable uint8 view of ``nbytes`` at ``offset`` in ``tile``'s memory (bounds-checked)."""
        if not 0 <= tile < self.num_tiles:
            raise IndexError(f"tile {tile} is not in 0..{self.num_tiles - 1}")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.tile_bytes:
            raise IndexError(
                f"bytes [{offset}, {offset + nbytes}) are outside tile {tile}'s {self.tile_bytes} bytes"
            )
        start = tile * self.tile_bytes + offset
        return self.buffer[start:start + nbytes]

    def copy(self, const offset_t[::1] src, const offset_t[::1] dst, const offset_t[::1] nbytes):
        """Perform a precomputed exchange: byte copies ``src[i] -> dst[i]`` of ``nbytes[i]``.

        Offsets are absolute within the arena; they were checked when the copy list was planned.
        """
        if not (src.shape[0] == dst.shape[0] == nbytes.shape[0]):
            raise ValueError("copy lists must have equal lengths")
        if src.shape[0] == 0:
            return
        with nogil:
            copy_regions(self.base, &src[0], &dst[0], &nbytes[0], src.shape[0])


cdef void copy_regions(byte_t* base, const offset_t* src, const offset_t* dst,
                       const offset_t* nbytes, Py_ssize_t count) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(count):
        memcpy(base + dst[i], base + src[i], nbytes[i])

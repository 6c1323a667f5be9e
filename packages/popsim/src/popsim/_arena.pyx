"""Tile memory arena and the exchange copy kernel.

The arena is one anonymous zero-filled mapping seen as a NumPy buffer; the OS maps its pages lazily, so a
full 1,472-tile Mk2 (~919 MB) costs only the pages that tensors actually touch. Transparent huge pages are
refused: a 2 MB page would make a few bytes used in each of three neighbouring tiles cost the whole page.
"""

import mmap

cimport numpy as cnp
from libc.string cimport memcpy

import numpy as np

from popsim._types cimport byte_t, offset_t, tile_t

cnp.import_array()


cdef class TileArena:
    def __cinit__(self, tile_t num_tiles, offset_t tile_bytes):
        if num_tiles <= 0 or tile_bytes <= 0:
            raise ValueError(f"an arena needs tiles and bytes, got {num_tiles} x {tile_bytes}")
        self.num_tiles = num_tiles
        self.tile_bytes = tile_bytes
        self._pages = mmap.mmap(-1, num_tiles * tile_bytes)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._pages.madvise(mmap.MADV_NOHUGEPAGE)
        self.buffer = np.frombuffer(self._pages, dtype=np.uint8)
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

from popsim._types cimport byte_t, offset_t, tile_t


cdef class TileArena:
    """One IPU's memory: ``num_tiles`` contiguous byte ranges of ``tile_bytes`` each."""
    cdef readonly tile_t num_tiles
    cdef readonly offset_t tile_bytes
    cdef readonly object buffer
    cdef object _pages
    cdef byte_t* base

    cdef byte_t* tile_ptr(self, tile_t tile, offset_t offset) noexcept nogil


cdef void copy_regions(byte_t* base, const offset_t* src, const offset_t* dst,
                       const offset_t* nbytes, Py_ssize_t count) noexcept nogil

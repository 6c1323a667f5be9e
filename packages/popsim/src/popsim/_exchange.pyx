"""Exchange and host transfers: coalescing an index map into byte-run copy rows, one StreamCopy slice, and
the host's reads and writes of tile memory. copy_run, the per-row copy the engine calls, is in _exchange.pxd."""

import numpy as np

from libc.string cimport memcpy

from popsim._arena cimport TileArena
from popsim._types cimport byte_t, copy_t, offset_t

include "_opcodes_report.pxi"


cdef bint stream_copy(byte_t* base, byte_t* host, offset_t* stream, const offset_t* rows,
                      Py_ssize_t start, Py_ssize_t stop) noexcept nogil:
    """One StreamCopy. ``stream`` is (to_device, host byte offset, capacity, cursor, slice bytes); rows
    (offset in the slice, arena offset, bytes) place the slice's blocks. The cursor advances one slice;
    False (nothing moved) when the stream holds no further slice."""
    cdef offset_t at = stream[ST_HOST] + stream[ST_CURSOR]
    cdef const offset_t* r
    cdef Py_ssize_t i
    if stream[ST_CURSOR] + stream[ST_SLICE] > stream[ST_CAPACITY]:
        return False
    for i in range(start, stop):
        r = rows + SR_COLS * i
        if stream[ST_TO_DEVICE]:
            memcpy(base + r[SR_ARENA], host + at + r[SR_OFFSET], r[SR_NBYTES])
        else:
            memcpy(host + at + r[SR_OFFSET], base + r[SR_ARENA], r[SR_NBYTES])
    stream[ST_CURSOR] += stream[ST_SLICE]
    return True


def copy_runs(const offset_t[::1] src, const offset_t[::1] dst, offset_t itemsize):
    """Coalesce element copies ``src[i] -> dst[i]`` (byte offsets) into copy_run rows, greedily.

    A run grows while its destination stays contiguous and its source keeps the stride of its first step;
    consecutive runs of one shape whose sources advance by one fixed step become the repetitions of a
    two-dimensional row (a block of a matrix, a window of an image), so one row moves a whole block.
    """
    cdef Py_ssize_t n = src.shape[0], i = 0, j, count = 0, c
    cdef offset_t stride, outer
    if n and max(np.max(src), np.max(dst)) > np.iinfo(np.int32).max:
        raise OverflowError("exchange offsets beyond 2 GiB do not fit an exchange row")
    rows = np.empty((n, COPY_COLS), np.int32)
    cdef copy_t[:, ::1] r = rows
    with nogil:
        while i < n:
            j = i + 1
            stride = itemsize
            if j < n and dst[j] == dst[i] + itemsize:
                stride = src[j] - src[i]
                while j < n and dst[j] == dst[j - 1] + itemsize and src[j] - src[j - 1] == stride:
                    j += 1
            c = j - i
            if count > 0 and r[count - 1, CP_COUNT] == c and r[count - 1, CP_STRIDE] == stride \
                    and dst[i] == r[count - 1, CP_DST] + r[count - 1, CP_REPS] * c * itemsize:
                outer = src[i] - r[count - 1, CP_SRC]
                if r[count - 1, CP_REPS] == 1:
                    r[count - 1, CP_OUTER] = outer
                    r[count - 1, CP_REPS] = 2
                    i = j
                    continue
                if outer == <offset_t> r[count - 1, CP_REPS] * r[count - 1, CP_OUTER]:
                    r[count - 1, CP_REPS] += 1
                    i = j
                    continue
            r[count, CP_SRC] = src[i]
            r[count, CP_DST] = dst[i]
            r[count, CP_COUNT] = c
            r[count, CP_STRIDE] = stride
            r[count, CP_ITEMSIZE] = itemsize
            r[count, CP_REPS] = 1
            r[count, CP_OUTER] = 0
            count += 1
            i = j
    return rows[:count].copy()


def host_write(TileArena arena, const byte_t[::1] host, const offset_t[::1] host_offsets,
               const offset_t[::1] arena_offsets, const offset_t[::1] nbytes):
    """Host -> tiles: copy block i of ``host`` bytes to its place in the arena (a StreamCopy to the device)."""
    cdef Py_ssize_t i
    if host.shape[0] == 0:
        return
    with nogil:
        for i in range(nbytes.shape[0]):
            memcpy(arena.base + arena_offsets[i], &host[0] + host_offsets[i], nbytes[i])


def host_read(TileArena arena, byte_t[::1] host, const offset_t[::1] host_offsets,
              const offset_t[::1] arena_offsets, const offset_t[::1] nbytes):
    """Tiles -> host: gather the blocks of a tensor into ``host`` (a StreamCopy from the device)."""
    cdef Py_ssize_t i
    if host.shape[0] == 0:
        return
    with nogil:
        for i in range(nbytes.shape[0]):
            memcpy(&host[0] + host_offsets[i], arena.base + arena_offsets[i], nbytes[i])

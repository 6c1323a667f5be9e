# Exchange and host transfers: byte-run copies between tiles and slices of host streams (see _exchange.pyx).
# The per-row copy is inline here so the engine loop runs it without a call through a module boundary.
from libc.string cimport memcpy, memset

from popsim._types cimport byte_t, copy_t, int32_t, offset_t

from popsim._opcodes_enums cimport *


cdef extern from *:
    """
    #define ps_prefetch_read(p) __builtin_prefetch((p), 0)
    #define ps_prefetch_write(p) __builtin_prefetch((p), 1)
    """
    void ps_prefetch_read(const void* p) noexcept nogil
    void ps_prefetch_write(void* p) noexcept nogil


cdef inline void prefetch_run(byte_t* base, const copy_t* row) noexcept nogil:
    """Ask for the first source and destination lines of an exchange row the engine runs soon (a hint only)."""
    ps_prefetch_read(base + row[CP_SRC])
    ps_prefetch_write(base + row[CP_DST])


cdef inline void small_copy(byte_t* d, const byte_t* s, offset_t n) noexcept nogil:
    """memcpy for the few-byte runs most exchange rows move: fixed-size moves (two of them, overlapping
    when ``n`` is not a power of two) instead of a library call."""
    if n >= 32:
        memcpy(d, s, n)
    elif n >= 16:
        memcpy(d, s, 16)
        memcpy(d + n - 16, s + n - 16, 16)
    elif n >= 8:
        memcpy(d, s, 8)
        memcpy(d + n - 8, s + n - 8, 8)
    elif n >= 4:
        memcpy(d, s, 4)
        memcpy(d + n - 4, s + n - 4, 4)
    elif n >= 2:
        memcpy(d, s, 2)
        memcpy(d + n - 2, s + n - 2, 2)
    elif n == 1:
        d[0] = s[0]


cdef inline void broadcast(byte_t* d, const byte_t* s, offset_t count, offset_t isz) noexcept nogil:
    """``count`` copies of the element of ``isz`` bytes at ``s`` to contiguous ``d``: the element is read once,
    so the stores fill whole vectors (re-reading it through a pointer that may alias ``d`` kept the loop
    scalar). Like small_copy's memcpy, this takes it that no destination of an exchange is also its source."""
    cdef int32_t word
    cdef unsigned short half
    cdef offset_t j
    if isz == 4:
        word = (<const int32_t*> s)[0]
        for j in range(count):
            (<int32_t*> d)[j] = word
    elif isz == 2:
        half = (<const unsigned short*> s)[0]
        for j in range(count):
            (<unsigned short*> d)[j] = half
    elif isz == 1:
        memset(d, s[0], count)
    else:
        for j in range(count):
            memcpy(d + j * isz, s, isz)


cdef inline void copy_once(byte_t* d, const byte_t* s, offset_t count, offset_t stride, offset_t isz) noexcept nogil:
    """``count`` elements of ``isz`` bytes from ``s`` (advancing by ``stride`` bytes, 0 for a broadcast element)
    to contiguous ``d``."""
    cdef offset_t j
    if stride == isz:
        small_copy(d, s, count * isz)
    elif stride == 0:
        broadcast(d, s, count, isz)
    elif isz == 4:
        for j in range(count):
            (<int32_t*> d)[j] = (<const int32_t*> (s + j * stride))[0]
    elif isz == 2:
        for j in range(count):
            (<unsigned short*> d)[j] = (<const unsigned short*> (s + j * stride))[0]
    else:
        for j in range(count):
            memcpy(d + j * isz, s + j * stride, isz)


cdef inline void copy_run(byte_t* base, const copy_t* row) noexcept nogil:
    """One exchange row: ``reps`` repetitions, the source advancing by ``outer`` bytes each, of ``count``
    elements of ``itemsize`` bytes from src (advancing by ``stride`` bytes) to contiguous dst (the columns
    _opcodes.COPY_COLUMNS names)."""
    cdef offset_t count = row[CP_COUNT], stride = row[CP_STRIDE], isz = row[CP_ITEMSIZE], outer = row[CP_OUTER]
    cdef offset_t nbytes = count * isz, k
    cdef byte_t* d = base + row[CP_DST]
    cdef const byte_t* s = base + row[CP_SRC]
    for k in range(row[CP_REPS]):
        copy_once(d + k * nbytes, s + k * outer, count, stride, isz)


cdef inline void copy_single(byte_t* base, const copy_t* run, offset_t isz) noexcept nogil:
    """One compact exchange row (the columns _opcodes.RUN_COLUMNS names): a copy row of one repetition
    whose element size, ``isz``, its RUNS phase holds."""
    copy_once(base + run[RN_DST], base + run[RN_SRC], run[RN_COUNT], run[RN_STRIDE], isz)


cdef inline void prefetch_single(byte_t* base, const copy_t* run) noexcept nogil:
    """prefetch_run for a compact row."""
    ps_prefetch_read(base + run[RN_SRC])
    ps_prefetch_write(base + run[RN_DST])


cdef bint stream_copy(byte_t* base, byte_t* host, offset_t* stream, const offset_t* rows,
                      Py_ssize_t start, Py_ssize_t stop) noexcept nogil

# Shared C typedefs of the engine: every .pyx of popsim uses these names, so a width changes in one place.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t

ctypedef int64_t offset_t   # byte offset inside an IPU's tile arena
# A column of an exchange row: narrow, because exchange rows outnumber everything else and an IPU's memory
# (at most 1,472 x 624 KiB) is addressable in 31 bits.
ctypedef int32_t copy_t
ctypedef int32_t tile_t     # tile index inside one IPU
ctypedef uint8_t byte_t
ctypedef uint32_t u32

from popsim._types cimport byte_t, offset_t

# Columns of one instruction row (see _kernels.pyx and popsim/_opcodes.py).
cdef enum:
    C_OP = 0
    C_SUB = 1
    C_N = 2
    C_A = 3
    C_B = 4
    C_C = 5
    C_OUT = 6
    C_DTA = 7
    C_DTB = 8
    C_DTOUT = 9
    C_P0 = 10
    C_P1 = 11
    NCOLS = 12
    COPY_COLS = 7  # columns of one exchange row: src, dst, count, stride, itemsize, reps, outer

cdef Py_ssize_t run_instruction(byte_t* base, const offset_t* row, double fparam,
                                const offset_t* table) noexcept nogil

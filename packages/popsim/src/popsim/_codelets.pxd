# Codelets: one instruction row (a vertex) run on its tile's memory (see _codelets.pyx).
from popsim._types cimport byte_t, offset_t

cdef enum:
    TRAPPED = -1  # run_instruction's result for a kind or sub-op the engine does not know

cdef Py_ssize_t run_instruction(byte_t* base, const offset_t* row, double fparam,
                                const offset_t* table) noexcept nogil

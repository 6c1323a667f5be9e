"""Codelets and the BSP engine: one call walks a program's phases and instruction rows with the GIL released.

Every operand is an absolute byte offset into the arena, planned so that all operands of one row lie in
the memory of that row's tile. Elementwise codelets load blocks of up to BLOCK elements into doubles,
compute, and store back converting to the field's element type, so each kernel is written once for every
dtype while the inner loops stay free of type switches.
"""

cimport numpy as cnp

import numpy as np
from libc.math cimport (INFINITY, acos, acosh, asin, asinh, atan, atan2, atanh, ceil, cos, cosh, erf, exp, expm1, fabs,
                        fabsf, floor, fmod, isnan, log, log1p, nearbyint, pow, sin, sinh, sqrt, tan, tanh)
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove, memset
from cython.parallel cimport parallel, threadid
from scipy.linalg.cython_blas cimport sgemm

from popsim._arena cimport TileArena, copy_regions
from popsim._types cimport byte_t, copy_t, int32_t, offset_t, u32

cnp.import_array()

COPY_ROW_COLUMNS = COPY_COLS

cdef extern from *:
    """
    #include <string.h>
    static inline double ps_h2d(unsigned short h) { _Float16 f; memcpy(&f, &h, 2); return (double)f; }
    static inline unsigned short ps_d2h(double d) {
        _Float16 f = (_Float16)(float)d; unsigned short h; memcpy(&h, &f, 2); return h; }
    """
    double ps_h2d(unsigned short h) noexcept nogil
    unsigned short ps_d2h(double d) noexcept nogil


cdef extern from *:
    """
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
    #define PS_CLONES __attribute__((target_clones("avx2", "default")))
    #else
    #define PS_CLONES
    #endif
    /* out (m, n) = a (m, k) @ b (k, n) for the tiny per-tile blocks most plans produce, where a BLAS call
       costs more than the work. Outputs are computed in strips of up to 4 rows by 8, 4 or 1-3 columns whose
       accumulators stay in registers over the whole of k (GCC vector types). On x86-64 GCC also builds an
       AVX2 clone, picked at load time; without FMA contraction both clones round alike. */
    typedef float ps_v8 __attribute__((vector_size(32)));
    typedef float ps_v4 __attribute__((vector_size(16)));

    /* R rows of out, columns j..j+W-1 as one vector of W; every element sums its products in ascending k
       from zero, whichever strip computes it. */
    #define PS_STRIP(R, W, T)                                                                         \
        static inline void ps_strip_##R##_##W(const float* a, const float* b, float* out, int k, int n, int j) { \
            T c[R];                                                                                    \
            int r, kk;                                                                                 \
            for (r = 0; r < R; r++) c[r] = (T){0};                                                     \
            for (kk = 0; kk < k; kk++) {                                                               \
                T v;                                                                                   \
                memcpy(&v, b + (long)kk * n + j, sizeof v);                                            \
                for (r = 0; r < R; r++) c[r] += a[(long)r * k + kk] * v;                               \
            }                                                                                          \
            for (r = 0; r < R; r++) memcpy(out + (long)r * n + j, &c[r], sizeof c[r]);                \
        }
    /* The last 1-3 columns: R x W scalar accumulators, again held in registers over k. */
    #define PS_SCALARS(R, W)                                                                           \
        static inline void ps_strip_##R##_s##W(const float* a, const float* b, float* out, int k, int n, int j) { \
            float c[R][W];                                                                             \
            int r, w, kk;                                                                              \
            for (r = 0; r < R; r++) for (w = 0; w < W; w++) c[r][w] = 0.0f;                            \
            for (kk = 0; kk < k; kk++) {                                                               \
                const float* row = b + (long)kk * n + j;                                               \
                for (r = 0; r < R; r++) for (w = 0; w < W; w++) c[r][w] += a[(long)r * k + kk] * row[w]; \
            }                                                                                          \
            for (r = 0; r < R; r++) for (w = 0; w < W; w++) out[(long)r * n + j + w] = c[r][w];        \
        }
    #define PS_KERNELS(R) PS_STRIP(R, 8, ps_v8) PS_STRIP(R, 4, ps_v4) PS_SCALARS(R, 1) PS_SCALARS(R, 2) PS_SCALARS(R, 3)
    PS_KERNELS(1)
    PS_KERNELS(2)
    PS_KERNELS(3)
    PS_KERNELS(4)

    #define PS_ROWS(R)                                                                                 \
        for (j = 0; j + 8 <= n; j += 8) ps_strip_##R##_8(ai, b, oi, k, n, j);                          \
        if (j + 4 <= n) { ps_strip_##R##_4(ai, b, oi, k, n, j); j += 4; }                              \
        if (n - j == 3) ps_strip_##R##_s3(ai, b, oi, k, n, j);                                         \
        else if (n - j == 2) ps_strip_##R##_s2(ai, b, oi, k, n, j);                                    \
        else if (n - j == 1) ps_strip_##R##_s1(ai, b, oi, k, n, j);

    PS_CLONES static void ps_small_gemm(const float* a, const float* b, float* out, int m, int k, int n) {
        int i = 0, j;
        const float* ai;
        float* oi;
        for (; i + 4 <= m; i += 4) {
            ai = a + (long)i * k;
            oi = out + (long)i * n;
            PS_ROWS(4)
        }
        ai = a + (long)i * k;
        oi = out + (long)i * n;
        switch (m - i) {
        case 3: { PS_ROWS(3) } break;
        case 2: { PS_ROWS(2) } break;
        case 1: { PS_ROWS(1) } break;
        }
    }
    """
    void ps_small_gemm(const float* a, const float* b, float* out, int m, int k, int n) noexcept nogil

DEF BLOCK = 256
# Below this many multiply-adds a plain loop beats the overhead of a BLAS call.
DEF SMALL_GEMM_MACS = 32768

cdef enum:
    UNARY = 1
    BINARY = 2
    WHERE = 3
    REDUCE = 4
    MATMUL = 5
    RNG = 6
    COPY = 7
    GATHER = 8
    SCATTER_ADD = 9
    FILL = 10
    EXPR = 11


cdef inline void load(const byte_t* p, int dt, Py_ssize_t start, Py_ssize_t n, double* buf) noexcept nogil:
    cdef Py_ssize_t i
    if dt == 0:
        for i in range(n):
            buf[i] = (<const float*> p)[start + i]
    elif dt == 1:
        for i in range(n):
            buf[i] = ps_h2d((<const unsigned short*> p)[start + i])
    elif dt == 2:
        for i in range(n):
            buf[i] = (<const int32_t*> p)[start + i]
    else:
        for i in range(n):
            buf[i] = (<const byte_t*> p)[start + i] != 0


cdef inline double scalar(const byte_t* p, int dt) noexcept nogil:
    """The one element of a scalar operand, as a double."""
    cdef double v
    load(p, dt, 0, 1, &v)
    return v


cdef inline void fetch(const byte_t* p, int dt, Py_ssize_t start, Py_ssize_t n, double* buf, bint is_scalar,
                       double value) noexcept nogil:
    """Elements start..start+n-1 of an operand into ``buf``; a scalar operand (one element the vertex
    broadcasts, see _opcodes.py) gives ``value`` in every slot."""
    cdef Py_ssize_t i
    if is_scalar:
        for i in range(n):
            buf[i] = value
    else:
        load(p, dt, start, n, buf)


cdef inline int32_t to_int32(double v) noexcept nogil:
    """float -> int truncates toward zero; NaN and out-of-range values become INT_MIN, like x86."""
    if isnan(v) or v >= 2147483648.0 or v < -2147483648.0:
        return -2147483648
    return <int32_t> v


cdef inline void store(byte_t* p, int dt, Py_ssize_t start, Py_ssize_t n, const double* buf) noexcept nogil:
    cdef Py_ssize_t i
    if dt == 0:
        for i in range(n):
            (<float*> p)[start + i] = <float> buf[i]
    elif dt == 1:
        for i in range(n):
            (<unsigned short*> p)[start + i] = ps_d2h(buf[i])
    elif dt == 2:
        for i in range(n):
            (<int32_t*> p)[start + i] = to_int32(buf[i])
    else:
        for i in range(n):
            (<byte_t*> p)[start + i] = buf[i] != 0


cdef inline void unary(int op, double* x, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef double e
    if op == 1:
        for i in range(n):
            x[i] = -x[i]
    elif op == 2:
        for i in range(n):
            x[i] = exp(x[i])
    elif op == 3:
        for i in range(n):
            x[i] = log(x[i])
    elif op == 4:
        for i in range(n):
            x[i] = sqrt(x[i])
    elif op == 5:
        for i in range(n):
            x[i] = 1.0 / sqrt(x[i])
    elif op == 6:
        for i in range(n):
            x[i] = tanh(x[i])
    elif op == 7:
        for i in range(n):
            e = exp(-fabs(x[i]))
            x[i] = 1.0 / (1.0 + e) if x[i] >= 0 else e / (1.0 + e)
    elif op == 8:
        for i in range(n):
            x[i] = erf(x[i])
    elif op == 9:
        for i in range(n):
            x[i] = fabs(x[i])
    elif op == 10:
        for i in range(n):
            x[i] = sin(x[i])
    elif op == 11:
        for i in range(n):
            x[i] = cos(x[i])
    elif op == 12:
        for i in range(n):
            x[i] = x[i] if x[i] > 0 else (x[i] if isnan(x[i]) else 0.0)
    elif op == 13:
        for i in range(n):
            x[i] = (x[i] > 0) - (x[i] < 0) if not isnan(x[i]) else x[i]
    elif op == 14:
        for i in range(n):
            x[i] = x[i] == 0
    elif op >= 16:
        unary_more(op, x, n)


cdef inline void unary_more(int op, double* x, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if op == 16:
            x[i] = acos(x[i])
        elif op == 17:
            x[i] = acosh(x[i])
        elif op == 18:
            x[i] = asin(x[i])
        elif op == 19:
            x[i] = asinh(x[i])
        elif op == 20:
            x[i] = atan(x[i])
        elif op == 21:
            x[i] = atanh(x[i])
        elif op == 22:
            x[i] = cosh(x[i])
        elif op == 23:
            x[i] = sinh(x[i])
        elif op == 24:
            x[i] = tan(x[i])
        elif op == 25:
            x[i] = ceil(x[i])
        elif op == 26:
            x[i] = floor(x[i])
        elif op == 27:
            x[i] = nearbyint(x[i])  # round half to even, like np.round
        elif op == 28:
            x[i] = expm1(x[i])
        elif op == 29:
            x[i] = log1p(x[i])
        elif op == 30:
            x[i] = -x[i] - 1.0  # two's complement ~x of an int32


cdef inline void binary(int op, double* a, const double* b, Py_ssize_t n, bint integer) noexcept nogil:
    cdef Py_ssize_t i
    if op == 0:
        for i in range(n):
            a[i] = a[i] + b[i]
    elif op == 1:
        for i in range(n):
            a[i] = a[i] - b[i]
    elif op == 2:
        for i in range(n):
            a[i] = a[i] * b[i]
    elif op == 3:
        if integer:
            for i in range(n):
                a[i] = floor(a[i] / b[i]) if b[i] != 0 else 0.0
        else:
            for i in range(n):
                a[i] = a[i] / b[i]
    elif op == 4:
        for i in range(n):
            a[i] = pow(a[i], b[i])
    elif op == 5:
        for i in range(n):
            a[i] = a[i] if (a[i] >= b[i] or isnan(a[i])) else b[i]
    elif op == 6:
        for i in range(n):
            a[i] = a[i] if (a[i] <= b[i] or isnan(a[i])) else b[i]
    elif op == 7:
        for i in range(n):
            a[i] = a[i] == b[i]
    elif op == 8:
        for i in range(n):
            a[i] = a[i] != b[i]
    elif op == 9:
        for i in range(n):
            a[i] = a[i] < b[i]
    elif op == 10:
        for i in range(n):
            a[i] = a[i] <= b[i]
    elif op == 11:
        for i in range(n):
            a[i] = a[i] > b[i]
    elif op == 12:
        for i in range(n):
            a[i] = a[i] >= b[i]
    elif op == 13:
        for i in range(n):
            a[i] = (a[i] != 0) and (b[i] != 0)
    elif op == 14:
        for i in range(n):
            a[i] = (a[i] != 0) or (b[i] != 0)
    elif op == 15:
        for i in range(n):
            a[i] = atan2(a[i], b[i])
    elif op == 16:
        for i in range(n):
            a[i] = remainder(a[i], b[i], integer)
    elif op == 17:
        for i in range(n):
            a[i] = <int32_t> a[i] & <int32_t> b[i]
    elif op == 18:
        for i in range(n):
            a[i] = <int32_t> a[i] | <int32_t> b[i]
    elif op == 19:
        for i in range(n):
            a[i] = <int32_t> a[i] ^ <int32_t> b[i]


# Binary ops 0..BINARY_FLOAT32_LAST (add, sub, mul, div) have a float32 path of their own.
DEF BINARY_FLOAT32_LAST = 3


cdef inline void binary_float32(int op, const float* a, const float* b, float* out, Py_ssize_t n) noexcept nogil:
    """add, sub, mul and div of float32 without the trip through doubles (which rounds to the same float)."""
    cdef Py_ssize_t i
    if op == 0:
        for i in range(n):
            out[i] = a[i] + b[i]
    elif op == 1:
        for i in range(n):
            out[i] = a[i] - b[i]
    elif op == 2:
        for i in range(n):
            out[i] = a[i] * b[i]
    else:
        for i in range(n):
            out[i] = a[i] / b[i]


cdef inline bint unary_float32(int op, const float* x, float* out, Py_ssize_t n) noexcept nogil:
    """copy, neg, abs and relu of float32 directly (exact, so the same as the double path). Returns False
    for ops left to the general path."""
    cdef Py_ssize_t i
    cdef float v
    if op == 0:
        memmove(out, x, n * sizeof(float))
    elif op == 1:
        for i in range(n):
            out[i] = -x[i]
    elif op == 9:
        for i in range(n):
            out[i] = fabsf(x[i])
    elif op == 12:
        for i in range(n):
            v = x[i]
            out[i] = v if v > 0 else (v if v != v else 0.0)
    else:
        return False
    return True


cdef inline void where32(const byte_t* cond, const int32_t* a, const int32_t* b, int32_t* out,
                         Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = a[i] if cond[i] != 0 else b[i]


cdef inline double remainder(double a, double b, bint integer) noexcept nogil:
    """np.remainder: the result takes the divisor's sign (0 for an integer division by zero)."""
    cdef double r
    if integer and b == 0:
        return 0.0
    r = fmod(a, b)
    if r != 0 and ((r < 0) != (b < 0)):
        r += b
    return r


cdef inline double reduce_step(int op, double acc, double v) noexcept nogil:
    """One element into a running sum (0), max (1), min (2) or product (3); NaN propagates for max and min."""
    if op == 0:
        return acc + v
    if op == 3:
        return acc * v
    if not isnan(acc) and (isnan(v) or (v > acc if op == 1 else v < acc)):
        return v
    return acc


cdef inline void reduce_rows(int op, const byte_t* src, int dt_in, byte_t* dst, int dt_out,
                             Py_ssize_t rows, Py_ssize_t group) noexcept nogil:
    """dst[r] = reduce(src[r * group : (r + 1) * group]) in double, in index order (NaN propagates for max/min).
    float32 rows are read in place; other dtypes go through a staging buffer of doubles."""
    cdef double buf[BLOCK]
    cdef double acc
    cdef Py_ssize_t r, s, n, i
    cdef const float* f
    for r in range(rows):
        acc = 0.0 if op == 0 else (-INFINITY if op == 1 else (INFINITY if op == 2 else 1.0))
        if dt_in == 0:
            f = <const float*> src + r * group
            for i in range(group):
                acc = reduce_step(op, acc, f[i])
        else:
            s = 0
            while s < group:
                n = min(BLOCK, group - s)
                load(src, dt_in, r * group + s, n, buf)
                for i in range(n):
                    acc = reduce_step(op, acc, buf[i])
                s += n
        store(dst, dt_out, r, 1, &acc)


cdef inline void widen(const byte_t* src, int dt, float* dst, Py_ssize_t count) noexcept nogil:
    cdef double buf[BLOCK]
    cdef Py_ssize_t s = 0, i, n
    while s < count:
        n = min(BLOCK, count - s)
        load(src, dt, s, n, buf)
        for i in range(n):
            dst[s + i] = <float> buf[i]
        s += n


cdef inline void gemm(const float* a, const float* b, float* out, int m, int k, int n) noexcept nogil:
    cdef float one = 1.0, zero = 0.0
    if n <= BLOCK and <long> m * k * n <= SMALL_GEMM_MACS:
        ps_small_gemm(a, b, out, m, k, n)
    else:
        sgemm("N", "N", &n, &m, &k, &one, <float*> b, &n, <float*> a, &k, &zero, out, &n)


cdef void matmul_partial(const byte_t* a, const byte_t* b, int dt, float* out,
                         int m, int k, int n) noexcept nogil:
    """out (m, n, float32) = a (m, k) @ b (k, n); float16 operands are widened to float32 partials first."""
    cdef float* fa
    cdef float* fb
    if m == 0 or n == 0:
        return
    if k == 0:
        memset(out, 0, m * n * sizeof(float))
        return
    if dt == 0:
        gemm(<const float*> a, <const float*> b, out, m, k, n)
        return
    fa = <float*> malloc(m * k * sizeof(float))
    fb = <float*> malloc(k * n * sizeof(float))
    widen(a, dt, fa, m * k)
    widen(b, dt, fb, k * n)
    gemm(fa, fb, out, m, k, n)
    free(fa)
    free(fb)


cdef inline void random_uniform(const int32_t* seed, byte_t* out, int dt, Py_ssize_t first,
                                Py_ssize_t n) noexcept nogil:
    """The counter-based recipe of popir's random_uniform, bit for bit, for flat indices first..first+n-1."""
    cdef u32 s0 = <u32> seed[0]
    cdef u32 s1 = <u32> seed[1]
    cdef u32 h
    cdef double buf[BLOCK]
    cdef float u
    cdef Py_ssize_t s = 0, i, cnt
    while s < n:
        cnt = min(BLOCK, n - s)
        for i in range(cnt):
            h = (<u32> (first + s + i) * <u32> 0x9E3779B9u + s0) ^ (s1 * <u32> 0x85EBCA6Bu)
            h ^= h >> 16
            h *= <u32> 0x85EBCA6Bu
            h ^= h >> 13
            h *= <u32> 0xC2B2AE35u
            h ^= h >> 16
            u = <float> (h >> 8) * <float> 5.9604644775390625e-08
            buf[i] = u
        store(out, dt, s, cnt, buf)
        s += cnt


cdef inline void settle(int dt, double* buf, Py_ssize_t n) noexcept nogil:
    """Round ``buf`` to what storing it as ``dt`` and loading it back gives (see store and load), so a fused
    expression's intermediates are exactly those of the separate vertices it replaces."""
    cdef Py_ssize_t i
    if dt == 0:
        for i in range(n):
            buf[i] = <float> buf[i]
    elif dt == 1:
        for i in range(n):
            buf[i] = ps_h2d(ps_d2h(buf[i]))
    elif dt == 2:
        for i in range(n):
            buf[i] = to_int32(buf[i])
    else:
        for i in range(n):
            buf[i] = buf[i] != 0


DEF EXPR_BLOCK = 64
DEF EXPR_REGS = 16

# Columns of an EXPR program's header row and of its op rows (the layout _opcodes.py describes).
cdef enum:
    X_LEAVES = 0
    X_OPS = 1
    X_RESULT = 2
    X_OUT_DT = 3
    X_LEAF_DT = 4
    X_SCALARS = 10
    X_FLOAT32 = 11
    O_KIND = 0
    O_SUB = 1
    O_DST = 2
    O_SRC = 3
    O_DT = 6
    O_INTEGER = 7


cdef inline offset_t leaf_address(const offset_t* row, int leaf) noexcept nogil:
    """Arena address of a fused expression's leaf: fields a, b, c, d, e, f sit in these columns."""
    if leaf < 3:
        return row[C_A + leaf]
    return row[C_DTA + leaf - 3]


cdef void run_expression_float32(byte_t* base, const offset_t* row, const offset_t* prog) noexcept nogil:
    """run_expression for float32 add/sub/mul/div only: the float32 loops round each op as the double path
    does, leaves are read in place, and the last op writes the output itself."""
    cdef float regs[EXPR_REGS * EXPR_BLOCK]
    cdef const float* src[EXPR_REGS]
    cdef Py_ssize_t n = row[C_N], s = 0, cnt, i
    cdef int leaves = <int> prog[X_LEAVES], ops = <int> prog[X_OPS], leaf, j
    cdef int scalars = <int> prog[X_SCALARS]
    cdef float* out = <float*> (base + row[C_OUT])
    cdef float* d
    cdef const offset_t* o
    for leaf in range(leaves):
        if scalars & (1 << leaf):
            for i in range(EXPR_BLOCK):
                regs[leaf * EXPR_BLOCK + i] = (<const float*> (base + leaf_address(row, leaf)))[0]
            src[leaf] = regs + leaf * EXPR_BLOCK
    while s < n:
        cnt = min(EXPR_BLOCK, n - s)
        for leaf in range(leaves):
            if not scalars & (1 << leaf):
                src[leaf] = (<const float*> (base + leaf_address(row, leaf))) + s
        for j in range(ops):
            o = prog + (1 + j) * NCOLS
            d = out + s if j == ops - 1 else regs + o[O_DST] * EXPR_BLOCK
            binary_float32(<int> o[O_SUB], src[o[O_SRC]], src[o[O_SRC + 1]], d, cnt)
            src[o[O_DST]] = d
        s += cnt


cdef void run_expression(byte_t* base, const offset_t* row, const offset_t* prog) noexcept nogil:
    """A fused elementwise vertex (popops' map expressions): ``prog`` (rows of the instruction table, laid
    out as _opcodes.py's EXPR comment says) holds a header row, then one row per op. Leaves load into
    registers 0.., each op writes its own register and is rounded to its dtype, block by block. An all-float32
    add/sub/mul/div program (X_FLOAT32) runs on floats directly."""
    cdef double regs[EXPR_REGS * EXPR_BLOCK]
    cdef double values[6]
    cdef Py_ssize_t n = row[C_N], s = 0, cnt, i
    cdef int leaves = <int> prog[X_LEAVES], ops = <int> prog[X_OPS], leaf, j
    cdef int scalars = <int> prog[X_SCALARS]
    cdef const offset_t* o
    cdef double* d
    cdef double* a
    cdef double* b
    cdef double* c
    if prog[X_FLOAT32]:
        run_expression_float32(base, row, prog)
        return
    for leaf in range(leaves):
        if scalars & (1 << leaf):
            values[leaf] = scalar(base + leaf_address(row, leaf), <int> prog[X_LEAF_DT + leaf])
    while s < n:
        cnt = min(EXPR_BLOCK, n - s)
        for leaf in range(leaves):
            fetch(base + leaf_address(row, leaf), <int> prog[X_LEAF_DT + leaf], s, cnt, regs + leaf * EXPR_BLOCK,
                  scalars & (1 << leaf), values[leaf])
        for j in range(ops):
            o = prog + (1 + j) * NCOLS
            d = regs + o[O_DST] * EXPR_BLOCK
            a = regs + o[O_SRC] * EXPR_BLOCK
            b = regs + o[O_SRC + 1] * EXPR_BLOCK
            c = regs + o[O_SRC + 2] * EXPR_BLOCK
            if o[O_KIND] == WHERE:
                for i in range(cnt):
                    d[i] = b[i] if a[i] != 0 else c[i]
            else:
                memcpy(d, a, cnt * sizeof(double))
                if o[O_KIND] == UNARY:
                    unary(<int> o[O_SUB], d, cnt)
                else:
                    binary(<int> o[O_SUB], d, b, cnt, <bint> o[O_INTEGER])
            settle(<int> o[O_DT], d, cnt)
        store(base + row[C_OUT], <int> prog[X_OUT_DT], s, cnt, regs + prog[X_RESULT] * EXPR_BLOCK)
        s += cnt


cdef Py_ssize_t run_instruction(byte_t* base, const offset_t* row, double fparam,
                                const offset_t* table) noexcept nogil:
    """Run one vertex (``table``: the instruction table, where EXPR programs sit); returns how many of its
    dynamic indices were out of range (those rows are skipped)."""
    cdef int op = <int> row[C_OP]
    cdef int sub = <int> row[C_SUB]
    cdef Py_ssize_t n = row[C_N]
    cdef Py_ssize_t s = 0, cnt, i, j, idx, rows, inner, size
    cdef double bufa[BLOCK]
    cdef double bufb[BLOCK]
    cdef double bufc[BLOCK]
    cdef int dta = <int> row[C_DTA], dtb = <int> row[C_DTB], dto = <int> row[C_DTOUT]
    cdef int itemsize
    cdef float* partial
    cdef Py_ssize_t bad = 0
    # Elementwise vertices: bit i of P0 marks operand i (a, b, c) as a scalar the vertex broadcasts.
    cdef int scalars = <int> row[C_P0] if op == UNARY or op == BINARY or op == WHERE else 0
    cdef double va, vb, vc
    cdef float splat[BLOCK]
    cdef const float* fa
    cdef const float* fb
    cdef const float* fs
    if op == UNARY:
        if scalars == 0 and dta == 0 and dto == 0 and unary_float32(
            sub, <const float*> (base + row[C_A]), <float*> (base + row[C_OUT]), n
        ):
            return 0
        va = scalar(base + row[C_A], dta) if scalars & 1 else 0.0
        while s < n:
            cnt = min(BLOCK, n - s)
            fetch(base + row[C_A], dta, s, cnt, bufa, scalars & 1, va)
            unary(sub, bufa, cnt)
            store(base + row[C_OUT], dto, s, cnt, bufa)
            s += cnt
    elif op == BINARY:
        if dta == 0 and dtb == 0 and dto == 0 and sub <= BINARY_FLOAT32_LAST and scalars != 3:
            fa = <const float*> (base + row[C_A])
            fb = <const float*> (base + row[C_B])
            if scalars == 0:
                binary_float32(sub, fa, fb, <float*> (base + row[C_OUT]), n)
                return 0
            # One scalar operand: repeat it over a block of floats and run the same loops block by block.
            for i in range(BLOCK):
                splat[i] = fa[0] if scalars & 1 else fb[0]
            fs = splat
            while s < n:
                cnt = min(BLOCK, n - s)
                binary_float32(sub, fs if scalars & 1 else fa + s, fs if scalars & 2 else fb + s,
                               <float*> (base + row[C_OUT]) + s, cnt)
                s += cnt
            return 0
        va = scalar(base + row[C_A], dta) if scalars & 1 else 0.0
        vb = scalar(base + row[C_B], dtb) if scalars & 2 else 0.0
        while s < n:
            cnt = min(BLOCK, n - s)
            fetch(base + row[C_A], dta, s, cnt, bufa, scalars & 1, va)
            fetch(base + row[C_B], dtb, s, cnt, bufb, scalars & 2, vb)
            binary(sub, bufa, bufb, cnt, dta == 2)
            store(base + row[C_OUT], dto, s, cnt, bufa)
            s += cnt
    elif op == WHERE:
        if scalars == 0 and dtb == dto and dto in (0, 2):
            # 4-byte results are bit copies of one of the two operands.
            where32(base + row[C_A], <const int32_t*> (base + row[C_B]), <const int32_t*> (base + row[C_C]),
                    <int32_t*> (base + row[C_OUT]), n)
            return 0
        vc = scalar(base + row[C_A], 3) if scalars & 1 else 0.0
        va = scalar(base + row[C_B], dtb) if scalars & 2 else 0.0
        vb = scalar(base + row[C_C], dtb) if scalars & 4 else 0.0
        while s < n:
            cnt = min(BLOCK, n - s)
            fetch(base + row[C_A], 3, s, cnt, bufc, scalars & 1, vc)
            fetch(base + row[C_B], dtb, s, cnt, bufa, scalars & 2, va)
            fetch(base + row[C_C], dtb, s, cnt, bufb, scalars & 4, vb)
            for i in range(cnt):
                if bufc[i] == 0:
                    bufa[i] = bufb[i]
            store(base + row[C_OUT], dto, s, cnt, bufa)
            s += cnt
    elif op == EXPR:
        run_expression(base, row, table + row[C_P0] * NCOLS)
    elif op == REDUCE:
        reduce_rows(sub, base + row[C_A], dta, base + row[C_OUT], dto, row[C_P0], row[C_P1])
    elif op == MATMUL:
        if dto == 0:
            matmul_partial(base + row[C_A], base + row[C_B], dta, <float*> (base + row[C_OUT]),
                           <int> row[C_P0], <int> row[C_P1], <int> n)
        else:
            # float16 partials: accumulate in float32, then round once into the tile's partials.
            size = row[C_P0] * n
            partial = <float*> malloc(max(size, 1) * sizeof(float))
            matmul_partial(base + row[C_A], base + row[C_B], dta, partial, <int> row[C_P0], <int> row[C_P1], <int> n)
            for i in range(size):
                bufa[0] = partial[i]
                store(base + row[C_OUT], dto, i, 1, bufa)
            free(partial)
    elif op == RNG:
        random_uniform(<const int32_t*> (base + row[C_A]), base + row[C_OUT], dto, row[C_P0], n)
    elif op == COPY:
        memcpy(base + row[C_OUT], base + row[C_A], n)
    elif op == FILL:
        for i in range(min(n, BLOCK)):
            bufa[i] = fparam
        while s < n:
            cnt = min(BLOCK, n - s)
            store(base + row[C_OUT], dto, s, cnt, bufa)
            s += cnt
    elif op == GATHER or op == SCATTER_ADD:
        # x viewed as (outer, size, inner) with C_A; int32 indices at C_B, n of them; rows/inner in P0/P1.
        # GATHER: out (outer, n, inner) = x[:, idx, :].  SCATTER_ADD: out (outer, size, inner) += upd at idx.
        rows = row[C_P0]
        inner = row[C_P1]
        size = <Py_ssize_t> fparam
        itemsize = 4 if dta == 0 or dta == 2 else (2 if dta == 1 else 1)
        if op == GATHER:
            for j in range(rows):
                for i in range(n):
                    idx = (<const int32_t*> (base + row[C_B]))[i]
                    if idx < 0:
                        idx += size
                    if idx < 0 or idx >= size:
                        # Never read outside the tile: the slice becomes zeros and the run reports an error
                        # (sub 1: a check vertex beside this one counts the user's own indices instead).
                        bad += sub == 0
                        memset(base + row[C_OUT] + ((j * n + i) * inner) * itemsize, 0, inner * itemsize)
                        continue
                    memcpy(base + row[C_OUT] + ((j * n + i) * inner) * itemsize,
                           base + row[C_A] + ((j * size + idx) * inner) * itemsize, inner * itemsize)
        else:
            for j in range(rows):
                for i in range(n):
                    idx = (<const int32_t*> (base + row[C_B]))[i]
                    if idx < 0:
                        idx += size
                    if idx < 0 or idx >= size:
                        bad += sub == 0
                        continue
                    load(base + row[C_C], dta, (j * n + i) * inner, inner, bufb)
                    load(base + row[C_OUT], dta, (j * size + idx) * inner, inner, bufa)
                    for s in range(inner):
                        bufa[s] += bufb[s]
                    store(base + row[C_OUT], dta, (j * size + idx) * inner, inner, bufa)
    return bad


cdef extern from *:
    """
    /* The engine's team: thread 0 walks the program and publishes each compute or exchange phase; helper
       threads claim chunks of its rows while they are running. Nobody waits for a helper that claimed
       nothing, so a helper thread the OS has descheduled (a busy machine) costs no barrier; thread 0 then
       simply does the rows itself. A claim is a compare-and-swap on (generation << 32 | next row offset),
       so a late helper can never take rows of a later phase for an earlier one. */
    typedef struct {
        long long ticket, done, gen, helper_bad;
        long long kind, start, stop, chunk;
        int quit;
    } ps_team;
    static inline long long ps_load(long long* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline void ps_store(long long* p, long long v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    static inline void ps_add(long long* p, long long v) { __atomic_add_fetch(p, v, __ATOMIC_ACQ_REL); }
    static inline int ps_quitting(ps_team* t) { return __atomic_load_n(&t->quit, __ATOMIC_ACQUIRE); }
    static inline void ps_quit(ps_team* t) { __atomic_store_n(&t->quit, 1, __ATOMIC_RELEASE); }
    /* Close the ticket to claims before a new phase's fields are written: a helper still holding the old
       generation then fails its compare-and-swap instead of claiming rows of the new phase. */
    static inline void ps_close(ps_team* t, long long gen) {
        __atomic_exchange_n(&t->ticket, (gen << 32) | 0xffffffffLL, __ATOMIC_ACQ_REL);
    }
    static inline long long ps_claim(ps_team* t, long long gen, long long* first) {
        long long total = t->stop - t->start, ticket = __atomic_load_n(&t->ticket, __ATOMIC_ACQUIRE);
        for (;;) {
            long long off = ticket & 0xffffffffLL, next;
            if ((ticket >> 32) != gen || off >= total) return 0;
            next = off + t->chunk < total ? off + t->chunk : total;
            if (__atomic_compare_exchange_n(&t->ticket, &ticket, (gen << 32) | next, 1, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                *first = t->start + off;
                return next - off;
            }
        }
    }
    static inline void ps_pause(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #endif
    }
    """
    ctypedef struct ps_team:
        long long ticket, done, gen, helper_bad, kind, start, stop, chunk
        int quit
    long long ps_load(long long* p) noexcept nogil
    void ps_store(long long* p, long long v) noexcept nogil
    void ps_add(long long* p, long long v) noexcept nogil
    int ps_quitting(ps_team* t) noexcept nogil
    void ps_quit(ps_team* t) noexcept nogil
    void ps_close(ps_team* t, long long gen) noexcept nogil
    long long ps_claim(ps_team* t, long long gen, long long* first) noexcept nogil
    void ps_pause() noexcept nogil


# One run's arrays as raw pointers, shared by the team's threads. Rows are NCOLS wide (instructions),
# COPY_COLS (copies), 4 (phases), 3 (stream rows) and 5 (streams).
cdef struct Engine:
    byte_t* base
    byte_t* host
    const offset_t* phases
    Py_ssize_t num_phases
    const offset_t* phase_cycles
    const offset_t* instructions
    const double* fparams
    const copy_t* copies
    offset_t* counters
    const offset_t* stream_rows
    offset_t* streams


# Rows claimed at a time. Claims of a few rows made the threads fight over the ticket's cache line (the CNN
# step ran 15-20% slower with 4 vertices / 64 exchange rows per claim); these still split a phase of a few
# hundred vertices or a few thousand rows between two threads.
DEF COMPUTE_CHUNK = 16
DEF EXCHANGE_CHUNK = 256


cdef inline Py_ssize_t run_rows(Engine* e, Py_ssize_t kind, Py_ssize_t start, Py_ssize_t stop) noexcept nogil:
    cdef Py_ssize_t i, bad = 0
    if kind == 0:
        for i in range(start, stop):
            bad += run_instruction(e.base, e.instructions + i * NCOLS, e.fparams[i], e.instructions)
    else:
        for i in range(start, stop):
            copy_run(e.base, e.copies + i * COPY_COLS)
    return bad


cdef Py_ssize_t work_on(Engine* e, ps_team* team, long long gen) noexcept nogil:
    """Claim and run chunks of the published phase ``gen`` until none is left."""
    cdef long long first, n
    cdef Py_ssize_t bad = 0
    while True:
        n = ps_claim(team, gen, &first)
        if n == 0:
            return bad
        bad += run_rows(e, team.kind, first, first + n)
        ps_add(&team.done, n)


cdef void helper_loop(Engine* e, ps_team* team) noexcept nogil:
    """A helper thread: work on each newly published phase until thread 0 says the program is done."""
    cdef long long seen = 0, gen
    cdef Py_ssize_t bad = 0
    while True:
        gen = ps_load(&team.gen)
        if gen != seen:
            seen = gen
            bad += work_on(e, team, gen)
        elif ps_quitting(team):
            break
        else:
            ps_pause()
    ps_add(&team.helper_bad, bad)


cdef void run_phases(Engine* e, ps_team* team, bint shared, offset_t* result) noexcept nogil:
    """Thread 0: walk the phases (control flow included); with ``shared``, publish each compute or exchange
    phase to the helpers, work on it too, and wait only for the rows claimed. result: bad, cycles, dry."""
    cdef Py_ssize_t p = 0, i, start, stop, kind, bad = 0, dry = -1
    cdef offset_t cycles = 0
    cdef long long gen = 0
    cdef const offset_t* ph
    cdef bint zero
    while p < e.num_phases:
        ph = e.phases + 4 * p
        kind, start, stop = ph[0], ph[1], ph[2]
        cycles += e.phase_cycles[p]
        p += 1
        if kind == 2:
            zero = True
            for i in range(stop):
                if e.base[start + i] != 0:
                    zero = False
            if zero:
                p = ph[3]
        elif kind == 3:
            p = start
        elif kind == 4:
            e.counters[start] = stop
        elif kind == 5:
            e.counters[start] -= 1
            if e.counters[start] > 0:
                p = stop
        elif kind == 6:
            pass
        elif kind == 7:
            if not stream_copy(e.base, e.host, e.streams + 5 * start, e.stream_rows, stop, ph[3]):
                dry = start
                break
        elif shared and stop - start > 1:
            gen += 1
            ps_close(team, gen)
            team.kind, team.start, team.stop = kind, start, stop
            team.chunk = COMPUTE_CHUNK if kind == 0 else EXCHANGE_CHUNK
            team.done = 0
            ps_store(&team.ticket, gen << 32)
            ps_store(&team.gen, gen)
            bad += work_on(e, team, gen)
            while ps_load(&team.done) < stop - start:
                ps_pause()
        else:
            bad += run_rows(e, kind, start, stop)
    if shared:
        ps_quit(team)
    result[0], result[1], result[2] = bad, cycles, dry


def run_program(TileArena arena, const offset_t[:, ::1] phases, const offset_t[::1] phase_cycles,
                const offset_t[:, ::1] instructions, const double[::1] fparams, const copy_t[:, ::1] copies,
                offset_t[::1] counters, const offset_t[:, ::1] stream_rows, offset_t[:, ::1] streams,
                byte_t[::1] host, int num_threads=1):
    """Run a program's phases (see popsim/program.py for the row kinds): kind 0 runs instruction rows
    start..stop-1 (one compute set), kind 1 performs copy rows start..stop-1 (one exchange, see copy_run),
    kinds 2-6 are control flow (branch on a tile-memory condition, jump, loop counters in ``counters``, sync)
    and kind 7 moves one slice of a host stream (see stream_copy).

    The rows of one compute or exchange phase are independent (BSP), so ``num_threads - 1`` helper threads
    claim chunks of them while thread 0 works too (see ps_team); phases run one after another. Returns how
    many dynamic gather/scatter indices were out of range, the sum of ``phase_cycles`` of the phases run, and
    the slot of a host stream that ran dry (the run stops there), else -1.
    """
    cdef Engine e
    cdef ps_team team
    cdef offset_t result[3]
    memset(&team, 0, sizeof(team))
    e.base = arena.base
    e.host = &host[0] if host.shape[0] else NULL
    e.phases = &phases[0, 0] if phases.shape[0] else NULL
    e.num_phases = phases.shape[0]
    e.phase_cycles = &phase_cycles[0] if phase_cycles.shape[0] else NULL
    e.instructions = &instructions[0, 0] if instructions.shape[0] else NULL
    e.fparams = &fparams[0] if fparams.shape[0] else NULL
    e.copies = &copies[0, 0] if copies.shape[0] else NULL
    e.counters = &counters[0] if counters.shape[0] else NULL
    e.stream_rows = &stream_rows[0, 0] if stream_rows.shape[0] else NULL
    e.streams = &streams[0, 0] if streams.shape[0] else NULL
    if num_threads > 1:
        with nogil, parallel(num_threads=num_threads):
            if threadid() == 0:
                run_phases(&e, &team, True, result)
            else:
                helper_loop(&e, &team)
    else:
        with nogil:
            run_phases(&e, &team, False, result)
    return result[0] + team.helper_bad, result[1], result[2]


cdef bint stream_copy(byte_t* base, byte_t* host, offset_t* stream, const offset_t* rows,
                      Py_ssize_t start, Py_ssize_t stop) noexcept nogil:
    """One StreamCopy. ``stream`` is (to_device, host byte offset, capacity, cursor, slice bytes); rows
    (offset in the slice, arena offset, bytes) place the slice's blocks. The cursor advances one slice;
    False (nothing moved) when the stream holds no further slice."""
    cdef offset_t at = stream[1] + stream[3]
    cdef Py_ssize_t i
    if stream[3] + stream[4] > stream[2]:
        return False
    for i in range(start, stop):
        if stream[0]:
            memcpy(base + rows[3 * i + 1], host + at + rows[3 * i], rows[3 * i + 2])
        else:
            memcpy(host + at + rows[3 * i], base + rows[3 * i + 1], rows[3 * i + 2])
    stream[3] += stream[4]
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
            if count > 0 and r[count - 1, 2] == c and r[count - 1, 3] == stride \
                    and dst[i] == r[count - 1, 1] + r[count - 1, 5] * c * itemsize:
                outer = src[i] - r[count - 1, 0]
                if r[count - 1, 5] == 1:
                    r[count - 1, 6] = outer
                    r[count - 1, 5] = 2
                    i = j
                    continue
                if outer == <offset_t> r[count - 1, 5] * r[count - 1, 6]:
                    r[count - 1, 5] += 1
                    i = j
                    continue
            r[count, 0] = src[i]
            r[count, 1] = dst[i]
            r[count, 2] = c
            r[count, 3] = stride
            r[count, 4] = itemsize
            r[count, 5] = 1
            r[count, 6] = 0
            count += 1
            i = j
    return rows[:count].copy()


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


cdef inline void copy_run(byte_t* base, const copy_t* row) noexcept nogil:
    """One exchange row: ``reps`` repetitions, the source advancing by ``outer`` bytes each, of ``count``
    elements of ``itemsize`` bytes from src (advancing by ``stride`` bytes, 0 for a broadcast element) to
    contiguous dst. Row: (src, dst, count, stride, itemsize, reps, outer)."""
    cdef offset_t src = row[0], dst = row[1], count = row[2], stride = row[3], isz = row[4], j, k
    cdef offset_t reps = row[5], outer = row[6], nbytes = count * isz
    cdef byte_t* d = base + dst
    cdef const byte_t* s = base + src
    if stride == isz:
        for k in range(reps):
            small_copy(d + k * nbytes, s + k * outer, nbytes)
        return
    for k in range(reps):
        if isz == 4:
            for j in range(count):
                (<int32_t*> d)[j] = (<const int32_t*> (s + j * stride))[0]
        elif isz == 2:
            for j in range(count):
                (<unsigned short*> d)[j] = (<const unsigned short*> (s + j * stride))[0]
        else:
            for j in range(count):
                memcpy(d + j * isz, s + j * stride, isz)
        d += nbytes
        s += outer


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

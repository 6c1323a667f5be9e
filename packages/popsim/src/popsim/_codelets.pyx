"""Codelets: one call runs one vertex (an instruction row) on its tile's memory, with the GIL released.

Every operand is an absolute byte offset into the arena, planned so that all operands of one row lie in
the memory of that row's tile. Elementwise codelets load blocks of up to BLOCK elements into doubles,
compute, and store back converting to the field's element type, so each kernel is written once for every
dtype while the inner loops stay free of type switches. Kinds, sub-ops, dtype codes and columns are the
names _opcodes.py declares (generated into _opcodes.pxi); an unknown kind or sub-op traps (TRAPPED).
"""

from libc.math cimport (INFINITY, acos, acosh, asin, asinh, atan, atan2, atanh, ceil, cos, cosh, erf, exp, expm1, fabs,
                        fabsf, floor, fmod, isnan, log, log1p, nearbyint, pow, sin, sinh, sqrt, tan, tanh)
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove, memset
from scipy.linalg.cython_blas cimport sgemm

from popsim._types cimport byte_t, int32_t, offset_t, u32

from popsim._opcodes_enums cimport *

include "_opcodes_report.pxi"

cdef extern from *:
    """
    #include <string.h>
    #include <stddef.h>
    #include <stdlib.h>
    /* Without F16C, GCC converts _Float16 in library calls: blocks convert with the F16C instructions when the
       CPU has them, else widening reads a table of every half's value (filled once by that same conversion).
       Both round to nearest even exactly as the plain conversion does. */
    static float ps_half_values[65536];
    static int ps_f16c;
    static void ps_fill_half_values(void) {
        for (int i = 0; i < 65536; i++) { unsigned short h = i; _Float16 f; memcpy(&f, &h, 2); ps_half_values[i] = f; }
    #if defined(__GNUC__) && defined(__x86_64__)
        ps_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    #endif
    }
    /* take ? a : b as a bit mask, so the choice costs no branch: where masks and running maxima of real
       data are close to random, and a mispredicted branch per element cost more than the element. */
    static inline double ps_pick(int take, double a, double b) {
        unsigned long long x, y, m = -(unsigned long long)(take != 0);
        memcpy(&x, &a, 8); memcpy(&y, &b, 8); x = (x & m) | (y & ~m); memcpy(&a, &x, 8); return a; }
    /* v > acc ? v : acc and v < acc ? v : acc as one maxsd / minsd (exactly these: acc on a tie or a NaN),
       where GCC would otherwise branch on near random comparisons. */
    #if defined(__SSE2__)
    #include <emmintrin.h>
    static inline double ps_larger(double v, double acc) {
        return _mm_cvtsd_f64(_mm_max_sd(_mm_set_sd(v), _mm_set_sd(acc))); }
    static inline double ps_smaller(double v, double acc) {
        return _mm_cvtsd_f64(_mm_min_sd(_mm_set_sd(v), _mm_set_sd(acc))); }
    #else
    static inline double ps_larger(double v, double acc) { return v > acc ? v : acc; }
    static inline double ps_smaller(double v, double acc) { return v < acc ? v : acc; }
    #endif
    static inline unsigned short ps_d2h(double d) {
        _Float16 f = (_Float16)(float)d; unsigned short h; memcpy(&h, &f, 2); return h; }
    #if defined(__GNUC__) && defined(__x86_64__)
    #include <immintrin.h>
    __attribute__((target("avx,f16c"))) static void ps_d2h_f16c(const double* d, unsigned short* h, ptrdiff_t n) {
        ptrdiff_t i = 0;
        for (; i + 4 <= n; i += 4)
            _mm_storel_epi64((__m128i*)(h + i), _mm_cvtps_ph(_mm256_cvtpd_ps(_mm256_loadu_pd(d + i)), 0));
        for (; i < n; i++) h[i] = _cvtss_sh((float)d[i], 0);
    }
    #endif
    static void ps_d2h_block(const double* d, unsigned short* h, ptrdiff_t n) {
    #if defined(__GNUC__) && defined(__x86_64__)
        if (ps_f16c) { ps_d2h_f16c(d, h, n); return; }
    #endif
        for (ptrdiff_t i = 0; i < n; i++) h[i] = ps_d2h(d[i]);
    }
    /* A block of halves to floats (exact) and floats to halves (round to nearest even, as ps_d2h rounds the
       float a double holds), 8 at a time with F16C: the table read per element cost more than the work. */
    #if defined(__GNUC__) && defined(__x86_64__)
    __attribute__((target("avx,f16c"))) static void ps_h2f_f16c(const unsigned short* h, float* f, ptrdiff_t n) {
        ptrdiff_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
        for (; i < n; i++) f[i] = _cvtsh_ss(h[i]);
    }
    __attribute__((target("avx,f16c"))) static void ps_f2h_f16c(const float* f, unsigned short* h, ptrdiff_t n) {
        ptrdiff_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i*)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(f + i), 0));
        for (; i < n; i++) h[i] = _cvtss_sh(f[i], 0);
    }
    #endif
    static void ps_h2f_block(const unsigned short* h, float* f, ptrdiff_t n) {
    #if defined(__GNUC__) && defined(__x86_64__)
        if (ps_f16c) { ps_h2f_f16c(h, f, n); return; }
    #endif
        for (ptrdiff_t i = 0; i < n; i++) f[i] = ps_half_values[h[i]];
    }
    static void ps_f2h_block(const float* f, unsigned short* h, ptrdiff_t n) {
    #if defined(__GNUC__) && defined(__x86_64__)
        if (ps_f16c) { ps_f2h_f16c(f, h, n); return; }
    #endif
        for (ptrdiff_t i = 0; i < n; i++) h[i] = ps_d2h(f[i]);
    }
    """
    void ps_fill_half_values() noexcept nogil
    double ps_pick(bint take, double a, double b) noexcept nogil
    double ps_larger(double v, double acc) noexcept nogil
    double ps_smaller(double v, double acc) noexcept nogil
    unsigned short ps_d2h(double d) noexcept nogil
    void ps_d2h_block(const double* d, unsigned short* h, Py_ssize_t n) noexcept nogil
    void ps_h2f_block(const unsigned short* h, float* f, Py_ssize_t n) noexcept nogil
    void ps_f2h_block(const float* f, unsigned short* h, Py_ssize_t n) noexcept nogil

ps_fill_half_values()


cdef extern from *:
    """
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
    #define PS_CLONES __attribute__((target_clones("avx2", "default")))
    #else
    #define PS_CLONES
    #endif
    /* out (m, n) = a (m, k) @ b (k, n) for the tiny per-tile blocks most plans produce, where a BLAS call
       costs more than the work. Every element sums its products in ascending k from zero, whichever code
       computes it, and accumulators stay in registers over the whole of k (GCC vector types). Each add waits
       on the previous one of its chain, so the more rows a pass holds, the more chains are in flight: the
       columns in full groups of 8 run in panels of near-equal strips of up to 8 rows (9 rows run as 5 + 4,
       not 8 + 1). The last 1-7 columns are read from a zero-padded copy of b's tail and run as one vector
       whose spare lanes are dropped, unless the block has too few rows to pay for the copy or exactly 4
       columns are left (a 4-wide vector fits them): those run in strips of up to 4 rows by 4 or 1-3
       columns. On x86-64 GCC also builds an AVX2 clone, picked at load time; without FMA contraction both
       clones round alike. */
    typedef float ps_v8 __attribute__((vector_size(32)));
    typedef float ps_v4 __attribute__((vector_size(16)));
    #define PS_PANEL_ROWS 8
    #define PS_LANES 8
    /* Fewer rows than this leave the last columns to the narrow strips (copying b's tail costs more). */
    #define PS_PACK_MIN_ROWS 4
    /* Tails of b up to this many rows are padded on the stack; longer ones in a heap buffer. */
    #define PS_TAIL_STACK_ROWS 256
    /* Forced inline, so these are compiled into each clone with its instruction set. */
    #define PS_INLINE static inline __attribute__((always_inline))

    /* R rows of out (row stride ldo) at columns 0..w-1 from R rows of a (stride k) and k rows of 8 columns of
       b (stride ldb). */
    #define PS_PANEL(R)                                                                               \
        PS_INLINE void ps_panel_##R(const float* a, const float* b, long ldb, float* out, long ldo,    \
                                    int k, int w) {                                                    \
            ps_v8 c[R];                                                                                \
            int r, kk;                                                                                 \
            for (r = 0; r < R; r++) c[r] = (ps_v8){0};                                                 \
            for (kk = 0; kk < k; kk++) {                                                               \
                ps_v8 v;                                                                               \
                memcpy(&v, b + kk * ldb, sizeof v);                                                    \
                for (r = 0; r < R; r++) c[r] += a[(long)r * k + kk] * v;                               \
            }                                                                                          \
            for (r = 0; r < R; r++) {                                                                  \
                float lanes[PS_LANES];                                                                 \
                memcpy(lanes, &c[r], sizeof lanes);                                                    \
                for (kk = 0; kk < w; kk++) out[r * ldo + kk] = lanes[kk];                              \
            }                                                                                          \
        }
    PS_PANEL(1) PS_PANEL(2) PS_PANEL(3) PS_PANEL(4) PS_PANEL(5) PS_PANEL(6) PS_PANEL(7) PS_PANEL(8)

    PS_INLINE void ps_panel(int rows, const float* a, const float* b, long ldb, float* out, long ldo,
                            int k, int w) {
        switch (rows) {
        case 1: ps_panel_1(a, b, ldb, out, ldo, k, w); break;
        case 2: ps_panel_2(a, b, ldb, out, ldo, k, w); break;
        case 3: ps_panel_3(a, b, ldb, out, ldo, k, w); break;
        case 4: ps_panel_4(a, b, ldb, out, ldo, k, w); break;
        case 5: ps_panel_5(a, b, ldb, out, ldo, k, w); break;
        case 6: ps_panel_6(a, b, ldb, out, ldo, k, w); break;
        case 7: ps_panel_7(a, b, ldb, out, ldo, k, w); break;
        default: ps_panel_8(a, b, ldb, out, ldo, k, w); break;
        }
    }

    /* R rows of out, columns j..j+3 as one vector of 4. */
    #define PS_STRIP4(R)                                                                              \
        PS_INLINE void ps_strip_##R##_4(const float* a, const float* b, float* out, int k, int n, int j) { \
            ps_v4 c[R];                                                                                \
            int r, kk;                                                                                 \
            for (r = 0; r < R; r++) c[r] = (ps_v4){0};                                                 \
            for (kk = 0; kk < k; kk++) {                                                               \
                ps_v4 v;                                                                               \
                memcpy(&v, b + (long)kk * n + j, sizeof v);                                            \
                for (r = 0; r < R; r++) c[r] += a[(long)r * k + kk] * v;                               \
            }                                                                                          \
            for (r = 0; r < R; r++) memcpy(out + (long)r * n + j, &c[r], sizeof c[r]);                \
        }
    /* The last 1-3 columns: R x W scalar accumulators. */
    #define PS_SCALARS(R, W)                                                                           \
        PS_INLINE void ps_strip_##R##_s##W(const float* a, const float* b, float* out, int k, int n, int j) { \
            float c[R][W];                                                                             \
            int r, w, kk;                                                                              \
            for (r = 0; r < R; r++) for (w = 0; w < W; w++) c[r][w] = 0.0f;                            \
            for (kk = 0; kk < k; kk++) {                                                               \
                const float* row = b + (long)kk * n + j;                                               \
                for (r = 0; r < R; r++) for (w = 0; w < W; w++) c[r][w] += a[(long)r * k + kk] * row[w]; \
            }                                                                                          \
            for (r = 0; r < R; r++) for (w = 0; w < W; w++) out[(long)r * n + j + w] = c[r][w];        \
        }
    #define PS_NARROW(R) PS_STRIP4(R) PS_SCALARS(R, 1) PS_SCALARS(R, 2) PS_SCALARS(R, 3)
    PS_NARROW(1)
    PS_NARROW(2)
    PS_NARROW(3)
    PS_NARROW(4)

    /* Columns j.. (fewer than 8) of R rows in narrow strips. */
    #define PS_NARROW_ROWS(R)                                                                          \
        j = first;                                                                                     \
        if (j + 4 <= n) { ps_strip_##R##_4(ai, b, oi, k, n, j); j += 4; }                              \
        if (n - j == 3) ps_strip_##R##_s3(ai, b, oi, k, n, j);                                         \
        else if (n - j == 2) ps_strip_##R##_s2(ai, b, oi, k, n, j);                                    \
        else if (n - j == 1) ps_strip_##R##_s1(ai, b, oi, k, n, j);

    PS_INLINE void ps_narrow_columns(const float* a, const float* b, float* out, int m, int k, int n, int first) {
        int i = 0, j;
        const float* ai;
        float* oi;
        for (; i + 4 <= m; i += 4) {
            ai = a + (long)i * k;
            oi = out + (long)i * n;
            PS_NARROW_ROWS(4)
        }
        ai = a + (long)i * k;
        oi = out + (long)i * n;
        switch (m - i) {
        case 3: { PS_NARROW_ROWS(3) } break;
        case 2: { PS_NARROW_ROWS(2) } break;
        case 1: { PS_NARROW_ROWS(1) } break;
        }
    }

    PS_CLONES static void ps_small_gemm(const float* a, const float* b, float* out, int m, int k, int n) {
        float stack_tail[PS_TAIL_STACK_ROWS * PS_LANES];
        float* tail = NULL;
        int full = n - n % PS_LANES, w = n - full, strips = (m + PS_PANEL_ROWS - 1) / PS_PANEL_ROWS;
        int i = 0, s, rows, j, kk, l;
        if (w && w != PS_LANES / 2 && m >= PS_PACK_MIN_ROWS) {
            tail = k > PS_TAIL_STACK_ROWS ? (float*)malloc((size_t)k * PS_LANES * sizeof(float)) : stack_tail;
            if (!tail) abort();
            for (kk = 0; kk < k; kk++)
                for (l = 0; l < PS_LANES; l++) tail[(long)kk * PS_LANES + l] = l < w ? b[(long)kk * n + full + l] : 0.0f;
        }
        for (s = 0; s < strips; s++) {
            rows = (m - i) / (strips - s);
            for (j = 0; j < full; j += PS_LANES)
                ps_panel(rows, a + (long)i * k, b + j, n, out + (long)i * n + j, n, k, PS_LANES);
            if (tail) ps_panel(rows, a + (long)i * k, tail, PS_LANES, out + (long)i * n + full, n, k, w);
            i += rows;
        }
        if (w && !tail) ps_narrow_columns(a, b, out, m, k, n, full);
        if (tail && tail != stack_tail) free(tail);
    }

    /* Implicit-GEMM direct convolution of one batch item for few output channels, unit column stride and
       unspaced input: out (m, oh * ow) = w (m, taps) @ window columns, where each tap's 8 outputs of an
       output row are 8 consecutive elements of a patch row, read in place rather than copied into columns.
       ``pad`` is the patch with enough zero rows and columns around it that every read lands inside
       (pad_rows x pad_cols per channel, the window of output (0, 0) at kernel tap (0, 0) at its origin).
       Every output sums its products in ascending tap order from zero, exactly as ps_small_gemm over the
       columns would. */
    #define PS_CONV_PANEL(R)                                                                          \
        PS_INLINE void ps_conv_panel_##R(const float* w, const float* pad, float* out, long pos,       \
                                         const int* geo, long taps, int x0, int lanes) {               \
            ps_v8 c[R];                                                                                \
            int r, ch, i, j;                                                                           \
            long t = 0, plane = (long)geo[1] * geo[2];                                                 \
            for (r = 0; r < R; r++) c[r] = (ps_v8){0};                                                 \
            for (ch = 0; ch < geo[0]; ch++)                                                            \
                for (i = 0; i < geo[3]; i++) {                                                         \
                    const float* src = pad + ch * plane + (long)i * geo[5] * geo[2] + x0;             \
                    for (j = 0; j < geo[4]; j++, t++) {                                                \
                        ps_v8 v;                                                                       \
                        memcpy(&v, src + (long)j * geo[6], sizeof v);                                  \
                        for (r = 0; r < R; r++) c[r] += w[(long)r * taps + t] * v;                     \
                    }                                                                                  \
                }                                                                                      \
            for (r = 0; r < R; r++) {                                                                  \
                float l8[PS_LANES];                                                                    \
                /* A full vector is one unaligned store: a variable-length copy would call memcpy. */  \
                if (lanes == PS_LANES) { memcpy(out + r * pos, &c[r], sizeof c[r]); continue; }        \
                memcpy(l8, &c[r], sizeof l8);                                                          \
                for (i = 0; i < lanes; i++) out[r * pos + i] = l8[i];                                  \
            }                                                                                          \
        }
    PS_CONV_PANEL(1) PS_CONV_PANEL(2) PS_CONV_PANEL(3) PS_CONV_PANEL(4)
    PS_CONV_PANEL(5) PS_CONV_PANEL(6) PS_CONV_PANEL(7) PS_CONV_PANEL(8)

    /* Rows 0..m-1 (m at most PS_PANEL_ROWS) of ps_conv_implicit. */
    PS_INLINE void ps_conv_strip(const float* w, const float* pad, float* out, int m, const int* geo, long taps,
                                 long pos) {
        int y, x0, lanes;
        for (y = 0; y < geo[7]; y++) {
            const float* row = pad + (long)y * geo[9] * geo[2];
            float* o = out + (long)y * geo[8];
            for (x0 = 0; x0 < geo[8]; x0 += PS_LANES) {
                lanes = geo[8] - x0 < PS_LANES ? geo[8] - x0 : PS_LANES;
                switch (m) {
                case 1: ps_conv_panel_1(w, row, o + x0, pos, geo, taps, x0, lanes); break;
                case 2: ps_conv_panel_2(w, row, o + x0, pos, geo, taps, x0, lanes); break;
                case 3: ps_conv_panel_3(w, row, o + x0, pos, geo, taps, x0, lanes); break;
                case 4: ps_conv_panel_4(w, row, o + x0, pos, geo, taps, x0, lanes); break;
                case 5: ps_conv_panel_5(w, row, o + x0, pos, geo, taps, x0, lanes); break;
                case 6: ps_conv_panel_6(w, row, o + x0, pos, geo, taps, x0, lanes); break;
                case 7: ps_conv_panel_7(w, row, o + x0, pos, geo, taps, x0, lanes); break;
                default: ps_conv_panel_8(w, row, o + x0, pos, geo, taps, x0, lanes); break;
                }
            }
        }
    }

    /* geo: channels, pad_rows, pad_cols, kernel rows, kernel cols, dilation rows, dilation cols, out rows,
       out cols, stride rows. The m rows run in near-equal strips of up to PS_PANEL_ROWS. */
    PS_CLONES static void ps_conv_implicit(const float* w, const float* pad, float* out, int m,
                                           const int* geo) {
        long taps = (long)geo[0] * geo[3] * geo[4], pos = (long)geo[7] * geo[8];
        int i = 0, s, strips = (m + PS_PANEL_ROWS - 1) / PS_PANEL_ROWS;
        for (s = 0; s < strips; s++) {
            int rows = (m - i) / (strips - s);
            ps_conv_strip(w + (long)i * taps, pad, out + (long)i * pos, rows, geo, taps, pos);
            i += rows;
        }
    }
    """
    void ps_small_gemm(const float* a, const float* b, float* out, int m, int k, int n) noexcept nogil
    void ps_conv_implicit(const float* w, const float* pad, float* out, int m, const int* geo) noexcept nogil

DEF BLOCK = 256
# Below this many multiply-adds a plain loop beats the overhead of a BLAS call.
DEF SMALL_GEMM_MACS = 32768
# A conv block of at most this many output channels keeps its rows in registers over all taps and positions
# (BLAS repacks the long window columns for each call, which costs more than such a skinny product).
DEF CONV_REGISTER_ROWS = 8
# The implicit conv GEMM's vector width (PS_LANES) and the words of its geometry (see ps_conv_implicit).
DEF IMPLICIT_LANES = 8
DEF IMPLICIT_GEOMETRY = 10
DEF IMPLICIT_MAX_ROWS = 64
# Rows a float32 reduction runs side by side (see reduce_float32_rows).
DEF REDUCE_CHAINS = 4


cdef inline void load(const byte_t* p, int dt, Py_ssize_t start, Py_ssize_t n, double* buf) noexcept nogil:
    """Elements start..start+n-1 (n at most BLOCK) of a field of dtype ``dt`` into ``buf``."""
    cdef Py_ssize_t i
    cdef float floats[BLOCK]
    if dt == DT_FLOAT32:
        for i in range(n):
            buf[i] = (<const float*> p)[start + i]
    elif dt == DT_FLOAT16:
        ps_h2f_block((<const unsigned short*> p) + start, floats, n)
        for i in range(n):
            buf[i] = floats[i]
    elif dt == DT_INT32:
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


cdef inline Py_ssize_t operand_at(int forms, int i, Py_ssize_t s, Py_ssize_t period, Py_ssize_t phase) noexcept nogil:
    """The element of operand ``i`` that output element ``s`` reads under the operand-forms mask ``forms``
    (_opcodes' OPERAND FORMS): (phase + s) % period when it repeats, else s (a scalar's reader ignores it)."""
    if forms >> (REPEAT_SHIFT + i) & 1:
        return (phase + s) % period
    return s


cdef inline Py_ssize_t unwrapped(int forms, Py_ssize_t s, Py_ssize_t cnt, Py_ssize_t period,
                                 Py_ssize_t phase) noexcept nogil:
    """``cnt`` cut so that output elements s..s+cnt-1 cross no multiple of the period of their repeating or
    held operands (if any): a stretch over which every operand is a contiguous slice or one element."""
    if forms >> REPEAT_SHIFT:
        return min(cnt, period - (phase + s) % period)
    return cnt


cdef inline void read_operand(const byte_t* p, int dt, int forms, int i, Py_ssize_t s, Py_ssize_t cnt,
                              Py_ssize_t period, Py_ssize_t phase, double* buf, double value) noexcept nogil:
    """Output elements s..s+cnt-1's elements of operand ``i`` (a stretch ``unwrapped`` cut) into ``buf``: a
    scalar's ``value``, a held operand's element (phase + s) // period, or the elements operand_at gives."""
    cdef Py_ssize_t j
    if forms >> (HELD_SHIFT + i) & 1:
        value = scalar(p + ((phase + s) // period) * itemsize_of(dt), dt)
    elif not forms >> i & 1:
        load(p, dt, operand_at(forms, i, s, period, phase), cnt, buf)
        return
    for j in range(cnt):
        buf[j] = value


cdef inline bint forms_ok(int forms, Py_ssize_t period, Py_ssize_t phase) noexcept nogil:
    """Whether a vertex's repeating operands (if any) have a period and a phase inside it."""
    return forms >> REPEAT_SHIFT == 0 or 0 <= phase < period


cdef inline int32_t to_int32(double v) noexcept nogil:
    """float -> int truncates toward zero; NaN and out-of-range values become INT_MIN, like x86."""
    if isnan(v) or v >= 2147483648.0 or v < -2147483648.0:
        return -2147483648
    return <int32_t> v


cdef inline void store(byte_t* p, int dt, Py_ssize_t start, Py_ssize_t n, const double* buf) noexcept nogil:
    cdef Py_ssize_t i
    if dt == DT_FLOAT32:
        for i in range(n):
            (<float*> p)[start + i] = <float> buf[i]
    elif dt == DT_FLOAT16:
        ps_d2h_block(buf, (<unsigned short*> p) + start, n)
    elif dt == DT_INT32:
        for i in range(n):
            (<int32_t*> p)[start + i] = to_int32(buf[i])
    else:
        for i in range(n):
            (<byte_t*> p)[start + i] = buf[i] != 0


cdef inline bint unary(int op, double* x, Py_ssize_t n) noexcept nogil:
    """x = op(x) in place; False (nothing done) for a sub-op without a codelet. copy and cast compute
    nothing: the load and store around them convert."""
    cdef Py_ssize_t i
    cdef double e
    if op == U_COPY or op == U_CAST:
        pass
    elif op == U_NEG:
        for i in range(n):
            x[i] = -x[i]
    elif op == U_EXP:
        for i in range(n):
            x[i] = exp(x[i])
    elif op == U_LOG:
        for i in range(n):
            x[i] = log(x[i])
    elif op == U_SQRT:
        for i in range(n):
            x[i] = sqrt(x[i])
    elif op == U_RSQRT:
        for i in range(n):
            x[i] = 1.0 / sqrt(x[i])
    elif op == U_TANH:
        for i in range(n):
            x[i] = tanh(x[i])
    elif op == U_SIGMOID:
        for i in range(n):
            e = exp(-fabs(x[i]))
            x[i] = 1.0 / (1.0 + e) if x[i] >= 0 else e / (1.0 + e)
    elif op == U_ERF:
        for i in range(n):
            x[i] = erf(x[i])
    elif op == U_ABS:
        for i in range(n):
            x[i] = fabs(x[i])
    elif op == U_SIN:
        for i in range(n):
            x[i] = sin(x[i])
    elif op == U_COS:
        for i in range(n):
            x[i] = cos(x[i])
    elif op == U_RELU:
        for i in range(n):
            x[i] = x[i] if x[i] > 0 else (x[i] if isnan(x[i]) else 0.0)
    elif op == U_SIGN:
        for i in range(n):
            x[i] = (x[i] > 0) - (x[i] < 0) if not isnan(x[i]) else x[i]
    elif op == U_LOGICAL_NOT:
        for i in range(n):
            x[i] = x[i] == 0
    elif op == U_ACOS:
        for i in range(n):
            x[i] = acos(x[i])
    elif op == U_ACOSH:
        for i in range(n):
            x[i] = acosh(x[i])
    elif op == U_ASIN:
        for i in range(n):
            x[i] = asin(x[i])
    elif op == U_ASINH:
        for i in range(n):
            x[i] = asinh(x[i])
    elif op == U_ATAN:
        for i in range(n):
            x[i] = atan(x[i])
    elif op == U_ATANH:
        for i in range(n):
            x[i] = atanh(x[i])
    elif op == U_COSH:
        for i in range(n):
            x[i] = cosh(x[i])
    elif op == U_SINH:
        for i in range(n):
            x[i] = sinh(x[i])
    elif op == U_TAN:
        for i in range(n):
            x[i] = tan(x[i])
    elif op == U_CEIL:
        for i in range(n):
            x[i] = ceil(x[i])
    elif op == U_FLOOR:
        for i in range(n):
            x[i] = floor(x[i])
    elif op == U_ROUND:
        for i in range(n):
            x[i] = nearbyint(x[i])  # round half to even, like np.round
    elif op == U_EXPM1:
        for i in range(n):
            x[i] = expm1(x[i])
    elif op == U_LOG1P:
        for i in range(n):
            x[i] = log1p(x[i])
    elif op == U_BITWISE_NOT:
        for i in range(n):
            x[i] = -x[i] - 1.0  # two's complement ~x of an int32
    else:
        return False
    return True


cdef inline bint binary(int op, double* a, const double* b, Py_ssize_t n, bint integer) noexcept nogil:
    """a = a op b in place; False (nothing done) for a sub-op without a codelet."""
    cdef Py_ssize_t i
    if op == B_ADD:
        for i in range(n):
            a[i] = a[i] + b[i]
    elif op == B_SUB:
        for i in range(n):
            a[i] = a[i] - b[i]
    elif op == B_MUL:
        for i in range(n):
            a[i] = a[i] * b[i]
    elif op == B_DIV:
        if integer:
            for i in range(n):
                a[i] = floor(a[i] / b[i]) if b[i] != 0 else 0.0
        else:
            for i in range(n):
                a[i] = a[i] / b[i]
    elif op == B_POW:
        for i in range(n):
            a[i] = pow(a[i], b[i])
    elif op == B_MAXIMUM:
        for i in range(n):
            a[i] = a[i] if (a[i] >= b[i] or isnan(a[i])) else b[i]
    elif op == B_MINIMUM:
        for i in range(n):
            a[i] = a[i] if (a[i] <= b[i] or isnan(a[i])) else b[i]
    elif op == B_EQ:
        for i in range(n):
            a[i] = a[i] == b[i]
    elif op == B_NE:
        for i in range(n):
            a[i] = a[i] != b[i]
    elif op == B_LT:
        for i in range(n):
            a[i] = a[i] < b[i]
    elif op == B_LE:
        for i in range(n):
            a[i] = a[i] <= b[i]
    elif op == B_GT:
        for i in range(n):
            a[i] = a[i] > b[i]
    elif op == B_GE:
        for i in range(n):
            a[i] = a[i] >= b[i]
    elif op == B_LOGICAL_AND:
        for i in range(n):
            a[i] = (a[i] != 0) and (b[i] != 0)
    elif op == B_LOGICAL_OR:
        for i in range(n):
            a[i] = (a[i] != 0) or (b[i] != 0)
    elif op == B_ATAN2:
        for i in range(n):
            a[i] = atan2(a[i], b[i])
    elif op == B_REMAINDER:
        for i in range(n):
            a[i] = remainder(a[i], b[i], integer)
    elif op == B_BITWISE_AND:
        for i in range(n):
            a[i] = <int32_t> a[i] & <int32_t> b[i]
    elif op == B_BITWISE_OR:
        for i in range(n):
            a[i] = <int32_t> a[i] | <int32_t> b[i]
    elif op == B_BITWISE_XOR:
        for i in range(n):
            a[i] = <int32_t> a[i] ^ <int32_t> b[i]
    else:
        return False
    return True


cdef inline bint has_float32_path(int op) noexcept nogil:
    """Whether binary_float32 runs ``op`` (_opcodes.BINARY_FLOAT32_OPS)."""
    return op == B_ADD or op == B_SUB or op == B_MUL or op == B_DIV


cdef inline void binary_float32(int op, const float* a, const float* b, float* out, Py_ssize_t n) noexcept nogil:
    """add, sub, mul and div of float32 without the trip through doubles (which rounds to the same float)."""
    cdef Py_ssize_t i
    if op == B_ADD:
        for i in range(n):
            out[i] = a[i] + b[i]
    elif op == B_SUB:
        for i in range(n):
            out[i] = a[i] - b[i]
    elif op == B_MUL:
        for i in range(n):
            out[i] = a[i] * b[i]
    else:  # B_DIV (see has_float32_path)
        for i in range(n):
            out[i] = a[i] / b[i]


cdef void binary_float16(int op, byte_t* base, const offset_t* row, int forms) noexcept nogil:
    """add, sub, mul and div of float16 in float32 (a BINARY vertex's, at most one operand a scalar, either
    may repeat): float32 rounds these ops of float16 values as the double path does before its float16
    rounding, so the results are the same bits, without the trip through doubles."""
    cdef float fa[BLOCK]
    cdef float fb[BLOCK]
    cdef float fo[BLOCK]
    cdef const unsigned short* a = <const unsigned short*> (base + row[C_A])
    cdef const unsigned short* b = <const unsigned short*> (base + row[C_B])
    cdef unsigned short* out = <unsigned short*> (base + row[C_OUT])
    cdef Py_ssize_t n = row[C_N], s = 0, cnt, i, period = row[C_P1], phase = row[C_P2]
    cdef int scalars = forms & ((1 << REPEAT_SHIFT) - 1)
    cdef float* splat = &fa[0] if scalars & 1 else &fb[0]
    if scalars:  # the scalar operand, widened once into every slot of its block
        ps_h2f_block(a if scalars & 1 else b, splat, 1)
        for i in range(1, BLOCK):
            splat[i] = splat[0]
    while s < n:
        cnt = unwrapped(forms, s, min(BLOCK, n - s), period, phase)
        if not scalars & 1:
            ps_h2f_block(a + operand_at(forms, 0, s, period, phase), fa, cnt)
        if not scalars & 2:
            ps_h2f_block(b + operand_at(forms, 1, s, period, phase), fb, cnt)
        binary_float32(op, fa, fb, fo, cnt)
        ps_f2h_block(fo, out + s, cnt)
        s += cnt


cdef inline bint unary_float32(int op, const float* x, float* out, Py_ssize_t n) noexcept nogil:
    """copy, neg, abs and relu of float32 directly (exact, so the same as the double path). Returns False
    for ops left to the general path."""
    cdef Py_ssize_t i
    cdef float v
    if op == U_COPY:
        memmove(out, x, n * sizeof(float))
    elif op == U_NEG:
        for i in range(n):
            out[i] = -x[i]
    elif op == U_ABS:
        for i in range(n):
            out[i] = fabsf(x[i])
    elif op == U_RELU:
        for i in range(n):
            v = x[i]
            out[i] = v if v > 0 else (v if v != v else 0.0)
    else:
        return False
    return True


cdef inline void where32(const byte_t* cond, const int32_t* a, Py_ssize_t step_a, const int32_t* b,
                         Py_ssize_t step_b, int32_t* out, Py_ssize_t n) noexcept nogil:
    """out = a if cond else b for 4-byte elements, as bit copies; a step of 0 repeats a scalar operand."""
    cdef Py_ssize_t i
    cdef int32_t mask
    for i in range(n):
        mask = -<int32_t> (cond[i] != 0)  # both operands are read, so the choice is a mask, not a branch
        out[i] = (a[i * step_a] & mask) | (b[i * step_b] & ~mask)


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
    """One element into a running sum, max, min or product; NaN propagates for max and min."""
    if op == R_SUM:
        return acc + v
    if op == R_PROD:
        return acc * v
    if acc != acc or v != v:  # NaN (rare, so this branch is well predicted): it stays, or it arrives
        return acc if acc != acc else v
    return ps_larger(v, acc) if op == R_MAX else ps_smaller(v, acc)


cdef inline double reduce_start(int op) noexcept nogil:
    """The value a reduction starts from: nothing summed, multiplied, or seen by max / min yet."""
    return 0.0 if op == R_SUM else (-INFINITY if op == R_MAX else (INFINITY if op == R_MIN else 1.0))


cdef inline Py_ssize_t reduce_float32_rows(int op, const float* src, byte_t* dst, int dt_out, Py_ssize_t rows,
                                           Py_ssize_t group) noexcept nogil:
    """reduce_rows of float32 rows four at a time: each row keeps its own chain in index order, so the
    results are those of one row at a time, but four chains are in flight (each add waits on the last).
    Returns how many rows it did (a multiple of four); the caller does the rest."""
    cdef double acc[REDUCE_CHAINS]
    cdef Py_ssize_t r = 0, i, c
    cdef const float* f
    while r + REDUCE_CHAINS <= rows:
        f = src + r * group
        for c in range(REDUCE_CHAINS):
            acc[c] = reduce_start(op)
        for i in range(group):
            for c in range(REDUCE_CHAINS):
                acc[c] = reduce_step(op, acc[c], f[c * group + i])
        store(dst, dt_out, r, REDUCE_CHAINS, acc)
        r += REDUCE_CHAINS
    return r


cdef inline void reduce_rows(int op, const byte_t* src, int dt_in, byte_t* dst, int dt_out,
                             Py_ssize_t rows, Py_ssize_t group) noexcept nogil:
    """dst[r] = reduce(src[r * group : (r + 1) * group]) in double, in index order (NaN propagates for max/min).
    float32 rows are read in place; other dtypes go through a staging buffer of doubles."""
    cdef double buf[BLOCK]
    cdef double acc
    cdef Py_ssize_t r, s, n, i, first = 0
    cdef const float* f
    if dt_in == DT_FLOAT32:
        first = reduce_float32_rows(op, <const float*> src, dst, dt_out, rows, group)
    for r in range(first, rows):
        acc = reduce_start(op)
        if dt_in == DT_FLOAT32:
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
    """``count`` elements of dtype ``dt`` as float32."""
    cdef double buf[BLOCK]
    cdef Py_ssize_t s = 0, i, n
    if dt == DT_FLOAT16:
        ps_h2f_block(<const unsigned short*> src, dst, count)
        return
    while s < count:
        n = min(BLOCK, count - s)
        load(src, dt, s, n, buf)
        for i in range(n):
            dst[s + i] = <float> buf[i]
        s += n


cdef inline void narrow(const float* src, byte_t* dst, int dt, Py_ssize_t count) noexcept nogil:
    """``count`` float32 values stored as dtype ``dt`` (each rounded once, as store rounds a double)."""
    cdef double buf[BLOCK]
    cdef Py_ssize_t s = 0, i, n
    if dt == DT_FLOAT16:
        ps_f2h_block(src, <unsigned short*> dst, count)
        return
    while s < count:
        n = min(BLOCK, count - s)
        for i in range(n):
            buf[i] = src[s + i]
        store(dst, dt, s, n, buf)
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
    if dt == DT_FLOAT32:
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
    expression's intermediates are exactly those of the separate vertices it replaces. ``n`` is at most
    BLOCK."""
    cdef Py_ssize_t i
    cdef unsigned short halves[BLOCK]
    if dt == DT_FLOAT32:
        for i in range(n):
            buf[i] = <float> buf[i]
    elif dt == DT_FLOAT16:
        store(<byte_t*> halves, dt, 0, n, buf)
        load(<byte_t*> halves, dt, 0, n, buf)
    elif dt == DT_INT32:
        for i in range(n):
            buf[i] = to_int32(buf[i])
    else:
        for i in range(n):
            buf[i] = buf[i] != 0


DEF EXPR_BLOCK = 64


cdef inline offset_t leaf_address(const offset_t* row, int leaf) noexcept nogil:
    """Arena address of a fused expression's leaf (fields a..f sit in the columns EXPR_LEAF_COLUMNS names)."""
    if leaf < 3:
        return row[C_A + leaf]
    return row[C_DTA + leaf - 3]


cdef bint expression_ok(const offset_t* prog) noexcept nogil:
    """Whether an EXPR program stays within the registers and names known ops (else the vertex traps)."""
    cdef offset_t leaves = prog[X_LEAVES], ops = prog[X_OPS], j, k
    cdef const offset_t* o
    if leaves < 0 or leaves > EXPR_LEAVES or ops < 1 or ops > EXPR_MAX_OPS:
        return False
    if prog[X_RESULT] < 0 or prog[X_RESULT] >= leaves + ops:
        return False
    for j in range(ops):
        o = prog + (1 + j) * NCOLS
        if o[O_DST] != leaves + j or not (o[O_KIND] == K_UNARY and 0 <= o[O_SUB] < U_END
                                         or o[O_KIND] == K_BINARY and 0 <= o[O_SUB] < B_END
                                         or o[O_KIND] == K_WHERE):
            return False
        for k in range(EXPR_SRCS):
            if o[O_SRC + k] < 0 or o[O_SRC + k] >= leaves + j:
                return False
    return True


cdef void run_expression_float32(byte_t* base, const offset_t* row, const offset_t* prog) noexcept nogil:
    """run_expression for float32 add/sub/mul/div only: the float32 loops round each op as the double path
    does, leaves are read in place, and the last op writes the output itself."""
    cdef float regs[EXPR_REGS * EXPR_BLOCK]
    cdef const float* src[EXPR_REGS]
    cdef Py_ssize_t n = row[C_N], s = 0, cnt, i, period = row[C_P1], phase = row[C_P2]
    cdef int leaves = <int> prog[X_LEAVES], ops = <int> prog[X_OPS], leaf, j
    cdef int forms = <int> prog[X_SCALARS]
    cdef int scalars = forms & ((1 << REPEAT_SHIFT) - 1)
    cdef float* out = <float*> (base + row[C_OUT])
    cdef float* d
    cdef const offset_t* o
    for leaf in range(leaves):
        if scalars & (1 << leaf):
            for i in range(EXPR_BLOCK):
                regs[leaf * EXPR_BLOCK + i] = (<const float*> (base + leaf_address(row, leaf)))[0]
            src[leaf] = regs + leaf * EXPR_BLOCK
    while s < n:
        cnt = unwrapped(forms, s, min(EXPR_BLOCK, n - s), period, phase)
        for leaf in range(leaves):
            if not scalars & (1 << leaf):
                src[leaf] = ((<const float*> (base + leaf_address(row, leaf)))
                             + operand_at(forms, leaf, s, period, phase))
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
    add/sub/mul/div program (X_FLOAT32) runs on floats directly. The program was checked (expression_ok)."""
    cdef double regs[EXPR_REGS * EXPR_BLOCK]
    cdef double values[EXPR_LEAVES]
    cdef Py_ssize_t n = row[C_N], s = 0, cnt, i, period = row[C_P1], phase = row[C_P2]
    cdef int leaves = <int> prog[X_LEAVES], ops = <int> prog[X_OPS], leaf, j
    cdef int forms = <int> prog[X_SCALARS]
    cdef int scalars = forms & ((1 << REPEAT_SHIFT) - 1)
    cdef const offset_t* o
    cdef double* d
    cdef double* a
    cdef double* b
    cdef double* c
    if prog[X_FLOAT32] and not forms >> HELD_SHIFT:
        run_expression_float32(base, row, prog)
        return
    for leaf in range(leaves):
        if scalars & (1 << leaf):
            values[leaf] = scalar(base + leaf_address(row, leaf), <int> prog[X_LEAF_DT + leaf])
    while s < n:
        cnt = unwrapped(forms, s, min(EXPR_BLOCK, n - s), period, phase)
        for leaf in range(leaves):
            read_operand(base + leaf_address(row, leaf), <int> prog[X_LEAF_DT + leaf], forms, leaf, s, cnt, period,
                         phase, regs + leaf * EXPR_BLOCK, values[leaf])
        for j in range(ops):
            o = prog + (1 + j) * NCOLS
            d = regs + o[O_DST] * EXPR_BLOCK
            a = regs + o[O_SRC] * EXPR_BLOCK
            b = regs + o[O_SRC + 1] * EXPR_BLOCK
            c = regs + o[O_SRC + 2] * EXPR_BLOCK
            if o[O_KIND] == K_WHERE:
                for i in range(cnt):
                    d[i] = ps_pick(a[i] != 0, b[i], c[i])
            else:
                memcpy(d, a, cnt * sizeof(double))
                if o[O_KIND] == K_UNARY:
                    unary(<int> o[O_SUB], d, cnt)
                else:
                    binary(<int> o[O_SUB], d, b, cnt, <bint> o[O_INTEGER])
            settle(<int> o[O_DT], d, cnt)
        store(base + row[C_OUT], <int> prog[X_OUT_DT], s, cnt, regs + prog[X_RESULT] * EXPR_BLOCK)
        s += cnt


cdef inline bint known_sub(int op, int sub) noexcept nogil:
    """Whether ``sub`` is a sub-op _opcodes.py declares for kind ``op`` (an unknown kind is never known)."""
    if op == K_UNARY:
        return 0 <= sub < U_END
    if op == K_BINARY:
        return 0 <= sub < B_END
    if op == K_REDUCE:
        return 0 <= sub < R_END
    if op == K_GATHER or op == K_SCATTER_ADD:
        return 0 <= sub < G_END
    return K_UNARY <= op < K_END and sub == S_DEFAULT


cdef inline int itemsize_of(int dt) noexcept nogil:
    if dt == DT_FLOAT32 or dt == DT_INT32:
        return 4
    return 2 if dt == DT_FLOAT16 else 1


cdef Py_ssize_t run_elementwise(byte_t* base, const offset_t* row) noexcept nogil:
    """A UNARY, BINARY or WHERE vertex; its P0 is the operands' forms mask (_opcodes' OPERAND FORMS): bit i
    marks operand i (a, b, c) as a scalar it broadcasts, bit REPEAT_SHIFT + i as repeating over P1 elements
    from P2, bit HELD_SHIFT + i as holding each element for P1 outputs from P2. Returns 0, or TRAPPED for a
    sub-op without a codelet or a phase outside its period. Held operands take the general (double) path."""
    cdef int op = <int> row[C_OP]
    cdef int sub = <int> row[C_SUB]
    cdef Py_ssize_t n = row[C_N], period = row[C_P1], phase = row[C_P2]
    cdef Py_ssize_t s = 0, cnt, i
    cdef double bufa[BLOCK]
    cdef double bufb[BLOCK]
    cdef double bufc[BLOCK]
    cdef int dta = <int> row[C_DTA], dtb = <int> row[C_DTB], dto = <int> row[C_DTOUT]
    cdef int forms = <int> row[C_P0]
    cdef int scalars = forms & ((1 << REPEAT_SHIFT) - 1)
    cdef double va, vb, vc
    cdef float splat[BLOCK]
    cdef const float* fa
    cdef const float* fb
    cdef const float* fs
    cdef const int32_t* wb
    cdef const int32_t* wc
    if not forms_ok(forms, period, phase):
        return TRAPPED
    if op == K_UNARY:
        if forms == 0 and dta == DT_FLOAT32 and dto == DT_FLOAT32 and unary_float32(
            sub, <const float*> (base + row[C_A]), <float*> (base + row[C_OUT]), n
        ):
            return 0
        va = scalar(base + row[C_A], dta) if scalars & 1 else 0.0
        while s < n:
            cnt = unwrapped(forms, s, min(BLOCK, n - s), period, phase)
            read_operand(base + row[C_A], dta, forms, 0, s, cnt, period, phase, bufa, va)
            if not unary(sub, bufa, cnt):
                return TRAPPED
            store(base + row[C_OUT], dto, s, cnt, bufa)
            s += cnt
    elif op == K_BINARY:
        if (dta == DT_FLOAT16 and dtb == DT_FLOAT16 and dto == DT_FLOAT16 and has_float32_path(sub) and scalars != 3
                and not forms >> HELD_SHIFT):
            binary_float16(sub, base, row, forms)
            return 0
        if (dta == DT_FLOAT32 and dtb == DT_FLOAT32 and dto == DT_FLOAT32 and has_float32_path(sub) and scalars != 3
                and not forms >> HELD_SHIFT):
            fa = <const float*> (base + row[C_A])
            fb = <const float*> (base + row[C_B])
            if forms == 0:
                binary_float32(sub, fa, fb, <float*> (base + row[C_OUT]), n)
                return 0
            # A scalar operand repeats over a block of floats; a repeating one is read up to each wrap.
            for i in range(BLOCK):
                splat[i] = fa[0] if scalars & 1 else fb[0]
            fs = splat
            while s < n:
                cnt = unwrapped(forms, s, min(BLOCK, n - s) if scalars else n - s, period, phase)
                binary_float32(sub, fs if scalars & 1 else fa + operand_at(forms, 0, s, period, phase),
                               fs if scalars & 2 else fb + operand_at(forms, 1, s, period, phase),
                               <float*> (base + row[C_OUT]) + s, cnt)
                s += cnt
            return 0
        va = scalar(base + row[C_A], dta) if scalars & 1 else 0.0
        vb = scalar(base + row[C_B], dtb) if scalars & 2 else 0.0
        while s < n:
            cnt = unwrapped(forms, s, min(BLOCK, n - s), period, phase)
            read_operand(base + row[C_A], dta, forms, 0, s, cnt, period, phase, bufa, va)
            read_operand(base + row[C_B], dtb, forms, 1, s, cnt, period, phase, bufb, vb)
            if not binary(sub, bufa, bufb, cnt, dta == DT_INT32):
                return TRAPPED
            store(base + row[C_OUT], dto, s, cnt, bufa)
            s += cnt
    else:
        if not scalars & 1 and dtb == dto and (dto == DT_FLOAT32 or dto == DT_INT32) and not forms >> HELD_SHIFT:
            # 4-byte results are bit copies of one of the two operands (either may be a scalar), stretch by
            # stretch up to each wrap of the repeating operands.
            while s < n:
                cnt = unwrapped(forms, s, n - s, period, phase)
                wb = <const int32_t*> (base + row[C_B])
                wc = <const int32_t*> (base + row[C_C])
                wb += 0 if scalars & 2 else operand_at(forms, 1, s, period, phase)
                wc += 0 if scalars & 4 else operand_at(forms, 2, s, period, phase)
                where32(base + row[C_A] + operand_at(forms, 0, s, period, phase), wb, 0 if scalars & 2 else 1,
                        wc, 0 if scalars & 4 else 1, <int32_t*> (base + row[C_OUT]) + s, cnt)
                s += cnt
            return 0
        vc = scalar(base + row[C_A], DT_BOOL) if scalars & 1 else 0.0
        va = scalar(base + row[C_B], dtb) if scalars & 2 else 0.0
        vb = scalar(base + row[C_C], dtb) if scalars & 4 else 0.0
        while s < n:
            cnt = unwrapped(forms, s, min(BLOCK, n - s), period, phase)
            read_operand(base + row[C_A], DT_BOOL, forms, 0, s, cnt, period, phase, bufc, vc)
            read_operand(base + row[C_B], dtb, forms, 1, s, cnt, period, phase, bufa, va)
            read_operand(base + row[C_C], dtb, forms, 2, s, cnt, period, phase, bufb, vb)
            for i in range(cnt):
                bufa[i] = ps_pick(bufc[i] != 0, bufa[i], bufb[i])
            store(base + row[C_OUT], dto, s, cnt, bufa)
            s += cnt
    return 0


cdef Py_ssize_t run_gather(byte_t* base, const offset_t* row) noexcept nogil:
    """GATHER / SCATTER_ADD: x viewed as (rows, size, inner) at C_A; n int32 indices at C_B; rows, inner and
    size in P0, P1 and P2. GATHER: out (rows, n, inner) = x[:, idx, :]. SCATTER_ADD: out (rows, size, inner)
    += c (rows, n, inner) at idx. Returns how many indices were out of range (counted unless the sub-op says a
    check vertex beside this one counts the user's own indices)."""
    cdef Py_ssize_t n = row[C_N], rows = row[C_P0], inner = row[C_P1], size = row[C_P2]
    cdef Py_ssize_t i, j, s, idx, at, first, m, bad = 0
    cdef int dta = <int> row[C_DTA]
    cdef int itemsize = itemsize_of(dta)
    cdef bint count = row[C_SUB] == G_COUNT_BAD
    cdef double bufa[BLOCK]
    cdef double bufb[BLOCK]
    for j in range(rows):
        for i in range(n):
            idx = (<const int32_t*> (base + row[C_B]))[i]
            if idx < 0:
                idx += size
            if idx < 0 or idx >= size:
                # Never touch memory outside the tile: a gathered slice becomes zeros, an update is dropped,
                # and the run reports an error.
                bad += count
                if row[C_OP] == K_GATHER:
                    memset(base + row[C_OUT] + ((j * n + i) * inner) * itemsize, 0, inner * itemsize)
                continue
            if row[C_OP] == K_GATHER:
                memcpy(base + row[C_OUT] + ((j * n + i) * inner) * itemsize,
                       base + row[C_A] + ((j * size + idx) * inner) * itemsize, inner * itemsize)
            else:
                at = (j * size + idx) * inner
                for first in range(0, inner, BLOCK):  # the buffers hold BLOCK elements of a longer slice
                    m = min(BLOCK, inner - first)
                    load(base + row[C_C], dta, (j * n + i) * inner + first, m, bufb)
                    load(base + row[C_OUT], dta, at + first, m, bufa)
                    for s in range(m):
                        bufa[s] += bufb[s]
                    store(base + row[C_OUT], dta, at + first, m, bufa)
    return bad


cdef inline bint conv_geometry_ok(const int32_t* g, const offset_t* row) noexcept nogil:
    """Whether a CONV vertex's geometry stays inside its fields: its sizes must equal the row's own."""
    cdef int i
    for i in range(CG_FIRST_ROW):
        if g[i] < 0 or (g[i] == 0 and i >= CG_KERNEL_ROWS):
            return False  # strides and dilations must be positive, every size non-negative
    return (<offset_t> g[CG_BATCH] * g[CG_CHANNELS] * g[CG_ROWS] * g[CG_COLS] == row[C_P0]
            and <offset_t> g[CG_OUT_CHANNELS] * row[C_P2] == row[C_P1]
            and <offset_t> g[CG_CHANNELS] * g[CG_KERNEL_ROWS] * g[CG_KERNEL_COLS] == row[C_P2]
            and <offset_t> g[CG_BATCH] * g[CG_OUT_CHANNELS] * g[CG_OUT_ROWS] * g[CG_OUT_COLS] == row[C_N])


cdef inline Py_ssize_t spaced(Py_ssize_t at, Py_ssize_t step, Py_ssize_t size) noexcept nogil:
    """The patch index at spaced coordinate ``at`` (elements ``step`` apart), or -1 for a zero there."""
    if step == 1:
        return at if 0 <= at < size else -1  # no division for the common unspaced input
    if at < 0 or at % step != 0 or at // step >= size:
        return -1
    return at // step


cdef inline Py_ssize_t gcd(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    while b:
        a, b = b, a % b
    return a


cdef inline (Py_ssize_t, Py_ssize_t) spaced_start(Py_ssize_t first, Py_ssize_t sw, Py_ssize_t uc,
                                                  Py_ssize_t period, Py_ssize_t ow) noexcept nogil:
    """The first output x whose window (at spaced column first + x * sw) lands on an element ``uc`` apart,
    and that element's patch column; x is ``ow`` (none) when no output does."""
    cdef Py_ssize_t x, at
    for x in range(min(period, ow)):
        at = first + x * sw
        if at % uc == 0:
            return x, at // uc
    return ow, 0


cdef struct ColumnTap:
    # Where the outputs of one output row read the patch at one kernel column: outputs lo..hi-1 read
    # inside the patch from column ``first`` on (unspaced input), or outputs x0, x0 + period, ... read
    # columns q0, q0 + dq, ... (spaced input).
    Py_ssize_t first, lo, hi, x0, q0


cdef void column_taps(const int32_t* g, ColumnTap* taps) noexcept nogil:
    """Each kernel column's ColumnTap: the same for every channel, kernel row and output row."""
    cdef Py_ssize_t width = g[CG_COLS], ow = g[CG_OUT_COLS], sw = g[CG_STRIDE_COLS], uc = g[CG_IN_DILATION_COLS]
    cdef Py_ssize_t period = uc // gcd(sw, uc), j, first
    for j in range(g[CG_KERNEL_COLS]):
        first = g[CG_FIRST_COL] + j * g[CG_DILATION_COLS]
        taps[j].first = first
        taps[j].lo = 0 if first >= 0 else min(ow, (sw - 1 - first) // sw)
        taps[j].hi = max(taps[j].lo, 0 if first >= width else min(ow, (width - 1 - first) // sw + 1))
        taps[j].x0, taps[j].q0 = spaced_start(first, sw, uc, period, ow)


cdef void conv_columns(const float* patch, const int32_t* g, const ColumnTap* taps, float* cols) noexcept nogil:
    """The (taps, out_rows * out_cols) window columns of one batch item's patch, zero where a window reads
    padding (outside the patch) or between spaced elements: the operand the AMP streams as it walks the
    windows in place. ``taps``: column_taps of the geometry."""
    cdef Py_ssize_t rows = g[CG_ROWS], width = g[CG_COLS], oh = g[CG_OUT_ROWS], ow = g[CG_OUT_COLS]
    cdef Py_ssize_t kh = g[CG_KERNEL_ROWS], kw = g[CG_KERNEL_COLS], sw = g[CG_STRIDE_COLS], pos = oh * ow
    cdef Py_ssize_t ur = g[CG_IN_DILATION_ROWS], uc = g[CG_IN_DILATION_COLS]
    cdef Py_ssize_t c, i, j, y, x, r, q, lo, hi
    # Outputs that read a spaced element recur every ``period`` outputs, dq patch columns apart.
    cdef Py_ssize_t period = uc // gcd(sw, uc), dq = sw // gcd(sw, uc)
    cdef float* dst
    cdef const float* src
    for c in range(g[CG_CHANNELS]):
        for i in range(kh):
            for y in range(oh):
                # The patch row is the same for every kernel column: decode it once.
                r = spaced(g[CG_FIRST_ROW] + y * g[CG_STRIDE_ROWS] + i * g[CG_DILATION_ROWS], ur, rows)
                for j in range(kw):
                    dst = cols + ((c * kh + i) * kw + j) * pos + y * ow
                    if r < 0:
                        memset(dst, 0, ow * sizeof(float))
                    elif uc != 1:
                        src = patch + (c * rows + r) * width
                        memset(dst, 0, ow * sizeof(float))
                        x, q = taps[j].x0, taps[j].q0
                        while x < ow:
                            if 0 <= q < width:
                                dst[x] = src[q]
                            x += period
                            q += dq
                    else:
                        src = patch + (c * rows + r) * width + taps[j].first
                        lo, hi = taps[j].lo, taps[j].hi
                        for x in range(lo):
                            dst[x] = 0.0
                        if sw == 1:
                            memcpy(dst + lo, src + lo, (hi - lo) * sizeof(float))
                        else:
                            for x in range(lo, hi):
                                dst[x] = src[x * sw]
                        for x in range(hi, ow):
                            dst[x] = 0.0


cdef Py_ssize_t implicit_geometry(const int32_t* g, int* geo) noexcept nogil:
    """Fill ``geo`` (ps_conv_implicit's geometry) and return the padded patch's size in floats when the
    implicit GEMM runs this CONV vertex: few output channels, unit column stride, unspaced input, and a
    padded patch no larger than the window columns it stands in for; otherwise 0."""
    cdef Py_ssize_t oh = g[CG_OUT_ROWS], ow = g[CG_OUT_COLS], rows, cols, size
    if (g[CG_OUT_CHANNELS] > IMPLICIT_MAX_ROWS or g[CG_STRIDE_COLS] != 1 or g[CG_IN_DILATION_ROWS] != 1
            or g[CG_IN_DILATION_COLS] != 1):
        return 0
    rows = (oh - 1) * g[CG_STRIDE_ROWS] + (g[CG_KERNEL_ROWS] - 1) * g[CG_DILATION_ROWS] + 1
    # Whole vectors of PS_LANES outputs read past the last output: their extra lanes are dropped.
    cols = (g[CG_KERNEL_COLS] - 1) * g[CG_DILATION_COLS] + (ow + IMPLICIT_LANES - 1) // IMPLICIT_LANES * IMPLICIT_LANES
    size = g[CG_CHANNELS] * rows * cols
    if size > <Py_ssize_t> g[CG_CHANNELS] * g[CG_KERNEL_ROWS] * g[CG_KERNEL_COLS] * oh * ow:
        return 0
    geo[0], geo[1], geo[2] = g[CG_CHANNELS], <int> rows, <int> cols
    geo[3], geo[4], geo[5], geo[6] = g[CG_KERNEL_ROWS], g[CG_KERNEL_COLS], g[CG_DILATION_ROWS], g[CG_DILATION_COLS]
    geo[7], geo[8], geo[9] = <int> oh, <int> ow, g[CG_STRIDE_ROWS]
    return size


cdef void pad_patch(const float* patch, const int32_t* g, const int* geo, float* pad) noexcept nogil:
    """One batch item's patch into ``pad`` (channels, geo rows, geo cols), zero outside the patch: padded row
    and column 0 are the patch's first_row and first_col."""
    cdef Py_ssize_t rows = g[CG_ROWS], width = g[CG_COLS], pr = geo[1], pc = geo[2], c, r, src_row, lo, hi
    cdef float* dst
    memset(pad, 0, g[CG_CHANNELS] * pr * pc * sizeof(float))
    lo = max(0, -g[CG_FIRST_COL])  # the first padded column inside the patch, and one past the last
    hi = min(pc, width - g[CG_FIRST_COL])
    if hi <= lo:
        return
    for c in range(g[CG_CHANNELS]):
        for r in range(pr):
            src_row = g[CG_FIRST_ROW] + r
            if 0 <= src_row < rows:
                dst = pad + (c * pr + r) * pc
                memcpy(dst + lo, patch + (c * rows + src_row) * width + g[CG_FIRST_COL] + lo, (hi - lo) * sizeof(float))


cdef Py_ssize_t run_conv(byte_t* base, const offset_t* row) noexcept nogil:
    """CONV: out (batch, out_channels, positions) = weights (out_channels, taps) @ the window columns of each
    batch item's patch, accumulated in float32 (then rounded once into float16 partials when out is
    float16). Returns TRAPPED, doing nothing, when the geometry disagrees with the row's field sizes."""
    cdef const int32_t* g = <const int32_t*> (base + row[C_C])
    cdef int dta = <int> row[C_DTA], dtb = <int> row[C_DTB], dto = <int> row[C_DTOUT]
    cdef Py_ssize_t taps = row[C_P2], oc = g[CG_OUT_CHANNELS], pos = <Py_ssize_t> g[CG_OUT_ROWS] * g[CG_OUT_COLS]
    cdef Py_ssize_t per_item = g[CG_CHANNELS] * g[CG_ROWS] * g[CG_COLS], b, i
    cdef float* patch
    cdef float* weights
    cdef float* cols
    cdef float* out
    cdef ColumnTap* column
    cdef int geo[IMPLICIT_GEOMETRY]
    cdef Py_ssize_t padded
    if not conv_geometry_ok(g, row):
        return TRAPPED
    if row[C_N] == 0:
        return 0
    patch = <float*> (base + row[C_A]) if dta == DT_FLOAT32 else <float*> malloc(max(row[C_P0], 1) * sizeof(float))
    weights = <float*> (base + row[C_B]) if dtb == DT_FLOAT32 else <float*> malloc(max(row[C_P1], 1) * sizeof(float))
    out = <float*> (base + row[C_OUT]) if dto == DT_FLOAT32 else <float*> malloc(row[C_N] * sizeof(float))
    # Scratch for the padded patch of the implicit GEMM, else the window columns.
    padded = implicit_geometry(g, geo) if taps else 0
    cols = <float*> malloc(max(padded if padded else taps * pos, 1) * sizeof(float))
    column = NULL
    if not padded:  # the window columns' kernel-column taps (the implicit GEMM reads the padded patch)
        column = <ColumnTap*> malloc(max(g[CG_KERNEL_COLS], 1) * sizeof(ColumnTap))
        column_taps(g, column)
    if dta != DT_FLOAT32:
        widen(base + row[C_A], dta, patch, row[C_P0])
    if dtb != DT_FLOAT32:
        widen(base + row[C_B], dtb, weights, row[C_P1])
    for b in range(g[CG_BATCH]):
        if taps == 0:
            memset(out + b * oc * pos, 0, oc * pos * sizeof(float))
            continue
        if padded:
            pad_patch(patch + b * per_item, g, geo, cols)
            ps_conv_implicit(weights, cols, out + b * oc * pos, <int> oc, geo)
            continue
        conv_columns(patch + b * per_item, g, column, cols)
        if oc <= CONV_REGISTER_ROWS:
            ps_small_gemm(weights, cols, out + b * oc * pos, <int> oc, <int> taps, <int> pos)
        else:
            gemm(weights, cols, out + b * oc * pos, <int> oc, <int> taps, <int> pos)
    if dto != DT_FLOAT32:
        narrow(out, base + row[C_OUT], dto, row[C_N])
        free(out)
    if dta != DT_FLOAT32:
        free(patch)
    if dtb != DT_FLOAT32:
        free(weights)
    free(cols)
    free(column)
    return 0


cdef Py_ssize_t run_instruction(byte_t* base, const offset_t* row, double fparam,
                                const offset_t* table) noexcept nogil:
    """Run one vertex (``table``: the instruction table, where EXPR programs sit); returns how many of its
    dynamic indices were out of range (those rows are skipped), or TRAPPED (nothing done) for a kind or
    sub-op the engine does not know."""
    cdef int op = <int> row[C_OP]
    cdef Py_ssize_t n = row[C_N]
    cdef Py_ssize_t s = 0, cnt, i, size
    cdef double bufa[BLOCK]
    cdef int dta = <int> row[C_DTA], dto = <int> row[C_DTOUT]
    cdef float* partial
    if not known_sub(op, <int> row[C_SUB]):
        return TRAPPED
    if op == K_UNARY or op == K_BINARY or op == K_WHERE:
        return run_elementwise(base, row)
    elif op == K_EXPR:
        if not expression_ok(table + row[C_P0] * NCOLS) or not forms_ok(
            <int> table[row[C_P0] * NCOLS + X_SCALARS], row[C_P1], row[C_P2]
        ):
            return TRAPPED
        run_expression(base, row, table + row[C_P0] * NCOLS)
    elif op == K_REDUCE:
        reduce_rows(<int> row[C_SUB], base + row[C_A], dta, base + row[C_OUT], dto, row[C_P0], row[C_P1])
    elif op == K_MATMUL:
        if dto == DT_FLOAT32:
            matmul_partial(base + row[C_A], base + row[C_B], dta, <float*> (base + row[C_OUT]),
                           <int> row[C_P0], <int> row[C_P1], <int> n)
        else:
            # float16 partials: accumulate in float32, then round once into the tile's partials.
            size = row[C_P0] * n
            partial = <float*> malloc(max(size, 1) * sizeof(float))
            matmul_partial(base + row[C_A], base + row[C_B], dta, partial, <int> row[C_P0], <int> row[C_P1], <int> n)
            narrow(partial, base + row[C_OUT], dto, size)
            free(partial)
    elif op == K_RNG:
        random_uniform(<const int32_t*> (base + row[C_A]), base + row[C_OUT], dto, row[C_P0], n)
    elif op == K_COPY:
        memcpy(base + row[C_OUT], base + row[C_A], n * itemsize_of(dto))
    elif op == K_FILL:
        for i in range(min(n, BLOCK)):
            bufa[i] = fparam
        while s < n:
            cnt = min(BLOCK, n - s)
            store(base + row[C_OUT], dto, s, cnt, bufa)
            s += cnt
    elif op == K_GATHER or op == K_SCATTER_ADD:
        return run_gather(base, row)
    elif op == K_CONV:
        return run_conv(base, row)
    return 0

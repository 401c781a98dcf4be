/* Products for the few rows of a decoding step, x86 with AVX2 and FMA, threaded over the
 * rows of W with OpenMP; all matrices row-major and contiguous.
 *
 *   fp32: y = x W^T + b, x (m x k) and W (n x k) in fp32.
 *   int8: y = (X Q^T) * (xscale xscale-column times wscale row) + b, X (m x k) and Q (n x k) in
 *         int8 with one fp32 scale per row of each: activations and weights both rounded to
 *         8 bits (quantize.py), the products summed exactly in 32-bit integers.
 *
 * With a few rows of x the product is a stream through W: every weight is read once per
 * group of up to four rows and used for each. The kernel keeps those rows of x in the L1
 * cache, loads a vector of weights of each of R rows of W at a time, and keeps rows x R
 * sums in registers (at most 12 of the 16 AVX2 registers, so nothing spills).
 *
 * Each output is summed in the same order whatever m is and wherever its row falls, so a
 * row's result does not depend on the rows batched with it. Int8 sums are exact, so they
 * equal any other exact sum bit for bit: torch._int_mm's for many rows, in particular.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vecmath.h"

static inline int32_t sum_lanes_i32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* Outputs [r0, r0 + R) of all M rows, fp32. M and R are constants at every call, so the
 * compiler unrolls the loops over them and the sums stay in registers. */
static inline __attribute__((always_inline)) void f32_rows_of_w(
    const float *x, const float *w, const float *b, float *y,
    long n, long k, long r0, const int M, const int R)
{
    __m256 acc[4][4];
    const long k8 = k & ~7L;
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm256_setzero_ps();
    /* The R rows of W are R short streams (2 KB at k = 512) that the hardware prefetcher
     * picks up late, so fetch the next block of rows at the pace this one is read, R * 32
     * bytes a step (one or two cache lines), into L2: the L1 keeps the rows of x, and its
     * own prefetcher takes the weights from L2. */
    const float *next = w + (r0 + R) * k;
    for (long j = 0; j < k8; j += 8) {
        __m256 wv[4];
        _mm_prefetch((const char *)(next + j * R), _MM_HINT_T1);
        if (R > 2)
            _mm_prefetch((const char *)(next + j * R + 16), _MM_HINT_T1);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            wv[r] = _mm256_loadu_ps(w + (r0 + r) * k + j);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * k + j);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[i][r] = _mm256_fmadd_ps(wv[r], xv, acc[i][r]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float s = sum_lanes(acc[i][r]);
            for (long j = k8; j < k; j++) /* k not a multiple of 8 */
                s += w[(r0 + r) * k + j] * x[i * k + j];
            y[i * n + r0 + r] = b ? s + b[r0 + r] : s;
        }
}

/* The same for int8 rows of W and rows of x widened to 16-bit integers (xw, once per call:
 * a few KB that stay in L1). Sixteen int8 weights are widened too, and _mm256_madd_epi16
 * multiplies them and adds neighbouring pairs into eight 32-bit sums: no rounding and,
 * below 2^31 / 127^2 = 133,000 terms, no overflow. (The faster unsigned-by-signed
 * _mm256_maddubs_epi16 saturates its 16-bit pair sums, so it is not exact.) Widening x once
 * instead of at every block of W takes M of the R + M widenings out of the inner loop,
 * which are shuffles that compete with the products for the vector ports. The scaling is the same sequence of fp32 operations as int8_linear's torch
 * path: (float) sum * (xscale[i] * wscale[j]), then + b[j]; -ffp-contract=off keeps the
 * compiler from fusing the last two into one FMA, which rounds once instead of twice. */
/* How many blocks of R rows of W ahead the int8 products fetch. One block ahead (a few
 * hundred cycles) is too little for memory's latency: two to eight ahead read a 58101 x
 * 512 matrix 1.2-1.3x faster at one to four rows of x, from 200 MB of such matrices. */
#define PREFETCH_AHEAD 4

static inline __attribute__((always_inline)) void i8_rows_of_w(
    const int16_t *xw, const float *xscale, const int8_t *w, const float *wscale,
    const float *b, float *y, long n, long k, long r0, const int M, const int R)
{
    __m256i acc[4][4];
    const long k16 = k & ~15L;
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm256_setzero_si256();
    /* Int8 rows are short (512 bytes at k = 512) and the hardware prefetcher falls behind
     * them: fetch the block of rows PREFETCH_AHEAD blocks on while this one is summed, at
     * the same pace. */
    const int8_t *next = w + (r0 + PREFETCH_AHEAD * R) * k;
    for (long j = 0; j < k16; j += 16) {
        _mm_prefetch((const char *)(next + j * R), _MM_HINT_T0);
        /* A row of W at a time, the rows of x read from L1 by each product. */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i wv =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + (r0 + r) * k + j)));
#pragma GCC unroll 4
            for (int i = 0; i < M; i++)
                acc[i][r] = _mm256_add_epi32(
                    acc[i][r],
                    _mm256_madd_epi16(wv, _mm256_loadu_si256((const __m256i *)(xw + i * k + j))));
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t s = sum_lanes_i32(acc[i][r]);
            for (long j = k16; j < k; j++) /* k not a multiple of 16 */
                s += (int32_t)w[(r0 + r) * k + j] * (int32_t)xw[i * k + j];
            const float v = (float)s * (xscale[i] * wscale[r0 + r]);
            y[i * n + r0 + r] = b ? v + b[r0 + r] : v;
        }
}

/* The same sums with AVX-512 VNNI (on 256-bit registers, so AVX512VL too): vpdpbusd
 * multiplies 32 unsigned by 32 signed bytes and adds each four neighbouring products into
 * eight 32-bit sums, one instruction where the path above needs a widening, a multiply-add
 * and an add for sixteen. Its first operand is unsigned, so x enters as x ^ 0x80 = x + 128
 * and the sum is corrected by 128 * sum(w), counted by the same instruction against a
 * vector of ones. Still exact: a product is at most 255 * 127 in size, so no 32-bit sum
 * overflows below 2^31 / (255 * 127) = 66,000 terms. */
__attribute__((target("avx512vnni,avx512vl"))) static inline __attribute__((always_inline))
void i8_rows_of_w_vnni(const int8_t *x, const float *xscale, const int8_t *w,
                       const float *wscale, const float *b, float *y, long n, long k, long r0,
                       const int M, const int R)
{
    __m256i acc[4][4], wsum[4];
    const long k32 = k & ~31L;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi8(1);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        wsum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int i = 0; i < M; i++)
            acc[i][r] = _mm256_setzero_si256();
    }
    const int8_t *next = w + (r0 + PREFETCH_AHEAD * R) * k;
    for (long j = 0; j < k32; j += 32) {
        __m256i wv[4];
        _mm_prefetch((const char *)(next + j * R), _MM_HINT_T0);
        if (R > 2)
            _mm_prefetch((const char *)(next + j * R + 64), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            wv[r] = _mm256_loadu_si256((const __m256i *)(w + (r0 + r) * k + j));
            wsum[r] = _mm256_dpbusd_epi32(wsum[r], ones, wv[r]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const __m256i xv = _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(x + i * k + j)), flip);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[i][r] = _mm256_dpbusd_epi32(acc[i][r], xv, wv[r]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t s = sum_lanes_i32(acc[i][r]) - 128 * sum_lanes_i32(wsum[r]);
            for (long j = k32; j < k; j++) /* k not a multiple of 32 */
                s += (int32_t)w[(r0 + r) * k + j] * (int32_t)x[i * k + j];
            const float v = (float)s * (xscale[i] * wscale[r0 + r]);
            y[i * n + r0 + r] = b ? v + b[r0 + r] : v;
        }
}

/* R rows of W per step: 4 keep four streams of weights in flight for one or two rows of x;
 * with three or four rows of x, 3 is the most that fits the registers. Measured on a
 * 768 x 50257 matrix, wider blocks than these ran slower. The int8 product of four rows
 * takes 2: with 3, GCC kept eight of the twelve sums on the stack, and 2 ran as fast or
 * faster on a 58101 x 512 matrix. */
#define F32_PRODUCT(M, R, NAME)                                                            \
    static void NAME(const float *x, const float *w, const float *b, float *y, long n,     \
                     long k, int threads)                                                  \
    {                                                                                      \
        const long blocks = n / R;                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")  \
        for (long q = 0; q < blocks; q++)                                                  \
            f32_rows_of_w(x, w, b, y, n, k, q * R, M, R);                                  \
        for (long r0 = blocks * R; r0 < n; r0++)                                           \
            f32_rows_of_w(x, w, b, y, n, k, r0, M, 1);                                     \
    }
/* ATTRIBUTES: a function target for the VNNI variant, whose 32 registers (EVEX) hold four
 * rows of W for any number of rows of x. */
#define I8_PRODUCT_OF(ROWS_OF_W, X, M, R, NAME, ATTRIBUTES)                                \
    ATTRIBUTES static void NAME(const X *x, const float *xs, const int8_t *w,              \
                                const float *ws, const float *b, float *y, long n, long k, \
                                int threads)                                               \
    {                                                                                      \
        const long blocks = n / R;                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")  \
        for (long q = 0; q < blocks; q++)                                                  \
            ROWS_OF_W(x, xs, w, ws, b, y, n, k, q * R, M, R);                              \
        for (long r0 = blocks * R; r0 < n; r0++)                                           \
            ROWS_OF_W(x, xs, w, ws, b, y, n, k, r0, M, 1);                                 \
    }
#define I8_PRODUCT(M, R, NAME) I8_PRODUCT_OF(i8_rows_of_w, int16_t, M, R, NAME, )
#define I8_VNNI_PRODUCT(M, R, NAME)                                                        \
    I8_PRODUCT_OF(i8_rows_of_w_vnni, int8_t, M, R, NAME,                                   \
                  __attribute__((target("avx512vnni,avx512vl"))))
F32_PRODUCT(1, 4, f32_1)
F32_PRODUCT(2, 4, f32_2)
F32_PRODUCT(3, 3, f32_3)
F32_PRODUCT(4, 3, f32_4)
I8_PRODUCT(1, 4, i8_1)
I8_PRODUCT(2, 4, i8_2)
I8_PRODUCT(3, 3, i8_3)
I8_PRODUCT(4, 2, i8_4)
I8_VNNI_PRODUCT(2, 4, i8v_2)
I8_VNNI_PRODUCT(3, 4, i8v_3)
I8_VNNI_PRODUCT(4, 4, i8v_4)

typedef void (*f32_product)(const float *, const float *, const float *, float *, long,
                            long, int);
typedef void (*i8_product)(const int16_t *, const float *, const int8_t *, const float *,
                           const float *, float *, long, long, int);
typedef void (*i8_vnni_product)(const int8_t *, const float *, const int8_t *, const float *,
                                const float *, float *, long, long, int);

/* Outputs [r0, r0 + R) of all m rows, four rows of x at a time: the R rows of W come from
 * memory for the first four and from the cache for the others. */
static inline __attribute__((always_inline)) void f32_groups_of_x(
    const float *x, const float *w, const float *b, float *y, long m, long n, long k, long r0,
    const int R)
{
    for (long i = 0; i < m; i += 4)
        switch (m - i < 4 ? m - i : 4) {
        case 1: f32_rows_of_w(x + i * k, w, b, y + i * n, n, k, r0, 1, R); break;
        case 2: f32_rows_of_w(x + i * k, w, b, y + i * n, n, k, r0, 2, R); break;
        case 3: f32_rows_of_w(x + i * k, w, b, y + i * n, n, k, r0, 3, R); break;
        default: f32_rows_of_w(x + i * k, w, b, y + i * n, n, k, r0, 4, R); break;
        }
}

/* More than four rows of x: W is still streamed once, three of its rows at a time. */
static void f32_many(const float *x, const float *w, const float *b, float *y, long m, long n,
                     long k, int threads)
{
    const long blocks = n / 3;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long q = 0; q < blocks; q++)
        f32_groups_of_x(x, w, b, y, m, n, k, q * 3, 3);
    for (long r0 = blocks * 3; r0 < n; r0++)
        f32_groups_of_x(x, w, b, y, m, n, k, r0, 1);
}

/* y (m x n) = x (m x k) W^T + b, W fp32 (n x k). b may be NULL. Any number of rows; each
 * output is summed in the same order whatever m is. */
void tformer_matvec(const float *x, const float *w, const float *b, float *y,
                    long m, long n, long k, int threads)
{
    static const f32_product by_rows[4] = {f32_1, f32_2, f32_3, f32_4};
    if (m > 4)
        f32_many(x, w, b, y, m, n, k, threads);
    else if (m > 0)
        by_rows[m - 1](x, w, b, y, n, k, threads);
}

/* The instruction set the int8 products use, decided once per process (matvec.py sets it
 * at load time): ISA_AVX512_VNNI where the CPU has it and it was not turned down, else
 * ISA_AVX_VNNI likewise, else ISA_AVX2. want >= 0 sets it (ISA_AVX2 where the CPU lacks
 * what it asks), -1 asks. Every level gives the same bits. */
enum { ISA_AVX2 = 1, ISA_AVX512_VNNI = 2, ISA_AVX_VNNI = 4 };
static int isa_level = ISA_AVX2;

static int cpu_has_vnni(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* ISA_AVX_VNNI: AVX2 and the VEX-encoded dot product of bytes (int8_bytes.h). */
int tformer_isa(int want)
{
    if (want >= 0)
        isa_level = want == ISA_AVX512_VNNI && cpu_has_vnni()                  ? ISA_AVX512_VNNI
                    : want == ISA_AVX_VNNI && __builtin_cpu_supports("avxvnni") ? ISA_AVX_VNNI
                                                                               : ISA_AVX2;
    return isa_level;
}

/* The AVX2 few-row product's method (where VNNI is not used): AVX2_WIDEN (i8_rows_of_w)
 * or AVX2_SIGN (rows_of_w_sign, int8_bytes.h). Both give the same, exact sums; matvec.py times both
 * once per process and sets the faster. want >= 0 sets it, -1 asks. */
enum { AVX2_WIDEN = 0, AVX2_SIGN = 1 };
static int avx2_method = AVX2_WIDEN;

int tformer_avx2_method(int want)
{
    if (want >= 0)
        avx2_method = want == AVX2_SIGN ? AVX2_SIGN : AVX2_WIDEN;
    return avx2_method;
}

/* --- Many rows: a blocked int8 product over weights packed once -------------------------
 *
 * From about eight rows on (beam search over a batch) a product is no longer a stream
 * through W but a matrix product, where each weight should be read from memory once and
 * then used for every row. torch._int_mm (oneDNN) does that, but reorders W into its own
 * layout at every call, and on CPUs without VNNI it can be slower than fp32's product by
 * far. Here W is packed once, when the layer is made, in the layout of the instruction set
 * the process uses (the `layout`: ISA_AVX512_VNNI, ISA_AVX2 or AVX2_BYTES, below;
 * tformer_pack_layout).
 *
 * AVX-512 VNNI: panels of 32 rows of W (32 outputs), and within a panel, for each group of
 * four along k, the 32 x 4 bytes that one vpdpbusd pair multiplies with four bytes of a row
 * of x. A panel at k = 512 is 16 KB and stays in the L1 cache while every block of up to 8
 * rows of x passes over it (16 sums of 16 lanes in registers), and the next panel is
 * fetched while the first block does. x enters shifted to unsigned (x ^ 0x80 = x + 128)
 * and 128 * sum(w), counted when packing, is taken off: the sums are exact, the same
 * integers as every other path's, and the scaling the same fp32 operations. */

#define PANEL 32 /* outputs per panel: two vectors of 16 lanes */
#define ROW_BLOCK 8 /* rows of x per pass over a panel: 16 of the 32 registers hold sums */

static inline long round_up(long a, long b) { return (a + b - 1) / b * b; }

/* Bytes of W packed for VNNI's product: n rounded up to a panel, k to a group of four. */
static long vnni_packed_size(long n, long k) { return round_up(n, PANEL) * round_up(k, 4); }

/* Pack q (n x k int8, row-major) into `packed` (vnni_packed_size bytes), zeros filling the
 * last panel and group, and the sum of each row of q into colsum (n). */
static void vnni_pack(const int8_t *q, long n, long k, int8_t *packed, int32_t *colsum)
{
    const long kp = round_up(k, 4);
    memset(packed, 0, (size_t)vnni_packed_size(n, k));
    for (long j = 0; j < n; j++) {
        int8_t *panel = packed + (j / PANEL) * PANEL * kp;
        int32_t sum = 0;
        for (long t = 0; t < k; t++) {
            panel[(t / 4) * PANEL * 4 + (j % PANEL) * 4 + t % 4] = q[j * k + t];
            sum += q[j * k + t];
        }
        colsum[j] = sum;
    }
}

#define VNNI512 __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* Rows [0, M) of xu (unsigned, rows kp bytes apart) times one panel: outputs j0 .. j0 + 31
 * (those below n) of each row, scaled as int8_reference scales them. `next`, where not
 * NULL, is the next panel, fetched into L1 at the pace this one is read. */
VNNI512 static inline __attribute__((always_inline)) void panel_block(
    const uint8_t *xu, long kp, const int8_t *panel, const int8_t *next, const int32_t *colsum,
    const float *xscale, const float *wscale, const float *b, float *y, long n, long j0,
    const int M)
{
    __m512i acc[ROW_BLOCK][2];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
        acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    for (long g = 0; g < kp / 4; g++) {
        if (next) {
            _mm_prefetch((const char *)(next + g * PANEL * 4), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + g * PANEL * 4 + 64), _MM_HINT_T0);
        }
        const __m512i w0 = _mm512_loadu_si512(panel + g * PANEL * 4);
        const __m512i w1 = _mm512_loadu_si512(panel + g * PANEL * 4 + 64);
#pragma GCC unroll 8
        for (int i = 0; i < M; i++) {
            int32_t four;
            memcpy(&four, xu + i * kp + g * 4, sizeof four);
            const __m512i xv = _mm512_set1_epi32(four);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], xv, w0);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], xv, w1);
        }
    }
    const long left = n - j0 < PANEL ? n - j0 : PANEL;
    const __mmask16 m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    const __mmask16 m1 = left >= PANEL ? 0xFFFF
                         : left <= 16  ? 0
                                       : (__mmask16)((1u << (left - 16)) - 1);
    const __m512i shift0 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m0, colsum + j0), 7);
    const __m512i shift1 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m1, colsum + j0 + 16), 7);
    const __m512 ws0 = _mm512_maskz_loadu_ps(m0, wscale + j0);
    const __m512 ws1 = _mm512_maskz_loadu_ps(m1, wscale + j0 + 16);
    const __m512 b0 = b ? _mm512_maskz_loadu_ps(m0, b + j0) : _mm512_setzero_ps();
    const __m512 b1 = b ? _mm512_maskz_loadu_ps(m1, b + j0 + 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
        const __m512 xs = _mm512_set1_ps(xscale[i]);
        __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][0], shift0)),
                                  _mm512_mul_ps(xs, ws0));
        __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][1], shift1)),
                                  _mm512_mul_ps(xs, ws1));
        if (b) {
            v0 = _mm512_add_ps(v0, b0);
            v1 = _mm512_add_ps(v1, b1);
        }
        _mm512_mask_storeu_ps(y + i * n + j0, m0, v0);
        _mm512_mask_storeu_ps(y + i * n + j0 + 16, m1, v1);
    }
}

/* All m rows times one panel, ROW_BLOCK rows at a time, then the rest. */
VNNI512 static void panel_rows(const uint8_t *xu, long m, long kp, const int8_t *panel,
                               const int8_t *next, const int32_t *colsum, const float *xscale,
                               const float *wscale, const float *b, float *y, long n, long j0)
{
    long i = 0;
    for (; i + ROW_BLOCK <= m; i += ROW_BLOCK)
        panel_block(xu + i * kp, kp, panel, i ? NULL : next, colsum, xscale + i, wscale, b,
                    y + i * n, n, j0, ROW_BLOCK);
    const int rest = (int)(m - i);
#define REST(R)                                                                            \
    case R:                                                                                \
        panel_block(xu + i * kp, kp, panel, i ? NULL : next, colsum, xscale + i, wscale, b,  \
                    y + i * n, n, j0, R);                                                  \
        break;
    switch (rest) {
        REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7)
    }
#undef REST
}

/* y = (X Q^T) * (xscale wscale^T) + b as tformer_matvec_int8, with Q packed by vnni_pack
 * (and its colsum). Returns 0, or -1 where it could not allocate the unsigned copy of X.
 * Only where cpu_has_vnni(). */
VNNI512 static int vnni_gemm(const int8_t *x, const float *xscale, const int8_t *packed,
                             const int32_t *colsum, const float *wscale, const float *b,
                             float *y, long m, long n, long k, int threads)
{
    const long kp = round_up(k, 4), panels = round_up(n, PANEL) / PANEL;
    uint8_t *xu = malloc((size_t)(m * kp));
    if (!xu)
        return -1;
    for (long i = 0; i < m; i++) {
        for (long t = 0; t < k; t++)
            xu[i * kp + t] = (uint8_t)x[i * k + t] ^ 0x80;
        for (long t = k; t < kp; t++) /* padding: its weights are 0 */
            xu[i * kp + t] = 0x80;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long p = 0; p < panels; p++)
        panel_rows(xu, m, kp, packed + p * PANEL * kp,
                   p + 1 < panels ? packed + (p + 1) * PANEL * kp : NULL, colsum, xscale,
                   wscale, b, y, n, p * PANEL);
    free(xu);
    return 0;
}

/* AVX2 alone: the same blocked product in 16-bit lanes. Without VNNI the byte product is
 * vpmaddubsw (unsigned by signed bytes), whose pair sums saturate at 16 bits: 2 * 255 * 127
 * does not fit, so its sums would not be exact. Widened to int16 (vpmovsxbw: once for W,
 * when packing; once a call for x), vpmaddwd multiplies sixteen pairs and adds each two
 * neighbours into eight 32-bit sums, exactly (the 32-bit sums hold 133,000 terms of
 * 127 * 127). Two instructions for sixteen products, where fp32 needs one FMA for eight,
 * and the weights half of fp32's bytes (twice int8's). Panels of 16
 * outputs; within a panel, for each pair along k, the 16 x 2 int16 (two vectors) that one
 * broadcast pair of a row of x multiplies. Blocks of four rows of x pass over a panel: 8
 * sums, two weight vectors, the broadcast and a product in 12 of the 16 registers (with six
 * rows, all 16 would be needed, and the compiler spilled sums to the stack: half the
 * speed). */

#define PANEL2 16 /* outputs per AVX2 panel: two vectors of 8 lanes */
#define ROW_BLOCK2 4

static long avx2_packed_size(long n, long k) { return round_up(n, PANEL2) * round_up(k, 2) * 2; }

static void avx2_pack(const int8_t *q, long n, long k, int16_t *packed, int32_t *colsum)
{
    const long kp = round_up(k, 2);
    memset(packed, 0, (size_t)avx2_packed_size(n, k));
    for (long j = 0; j < n; j++) {
        int16_t *panel = packed + (j / PANEL2) * PANEL2 * kp;
        int32_t sum = 0;
        for (long t = 0; t < k; t++) {
            panel[(t / 2) * PANEL2 * 2 + (j % PANEL2) * 2 + t % 2] = q[j * k + t];
            sum += q[j * k + t];
        }
        colsum[j] = sum;
    }
}

/* The sums of M rows times a panel (outputs j0 .. j0 + 15, those below n), scaled as
 * int8_reference scales them, into y. */
static inline __attribute__((always_inline)) void avx2_scale(
    const __m256i acc[][2], const float *xscale, const float *wscale, const float *b, float *y,
    long n, long j0, const int M)
{
    const long left = n - j0 < PANEL2 ? n - j0 : PANEL2;
    float ws[PANEL2] = {0}, bias[PANEL2] = {0};
    memcpy(ws, wscale + j0, sizeof(float) * (size_t)left);
    if (b)
        memcpy(bias, b + j0, sizeof(float) * (size_t)left);
    const __m256 ws0 = _mm256_loadu_ps(ws), ws1 = _mm256_loadu_ps(ws + 8);
    const __m256 b0 = _mm256_loadu_ps(bias), b1 = _mm256_loadu_ps(bias + 8);
#pragma GCC unroll 6
    for (int i = 0; i < M; i++) {
        const __m256 xs = _mm256_set1_ps(xscale[i]);
        __m256 v0 = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][0]), _mm256_mul_ps(xs, ws0));
        __m256 v1 = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][1]), _mm256_mul_ps(xs, ws1));
        if (b) {
            v0 = _mm256_add_ps(v0, b0);
            v1 = _mm256_add_ps(v1, b1);
        }
        if (left == PANEL2) {
            _mm256_storeu_ps(y + i * n + j0, v0);
            _mm256_storeu_ps(y + i * n + j0 + 8, v1);
        } else {
            float out[PANEL2];
            _mm256_storeu_ps(out, v0);
            _mm256_storeu_ps(out + 8, v1);
            memcpy(y + i * n + j0, out, sizeof(float) * (size_t)left);
        }
    }
}

/* Rows [0, M) of xw (int16, rows kp apart) times one panel: outputs j0 .. j0 + 15 (those
 * below n) of each row, scaled as int8_reference scales them. */
static inline __attribute__((always_inline)) void avx2_panel_block(
    const int16_t *xw, long kp, const int16_t *panel, const int16_t *next, const float *xscale,
    const float *wscale, const float *b, float *y, long n, long j0, const int M)
{
    __m256i acc[ROW_BLOCK2][2];
#pragma GCC unroll 6
    for (int i = 0; i < M; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (long g = 0; g < kp / 2; g++) {
        if (next) /* a 64-byte line of the next panel a step: all of it by the block's end */
            _mm_prefetch((const char *)(next + g * PANEL2 * 2), _MM_HINT_T0);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(panel + g * PANEL2 * 2));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(panel + g * PANEL2 * 2 + 16));
#pragma GCC unroll 6
        for (int i = 0; i < M; i++) {
            int32_t two;
            memcpy(&two, xw + i * kp + g * 2, sizeof two);
            const __m256i xv = _mm256_set1_epi32(two);
            acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(xv, w0));
            acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(xv, w1));
        }
    }
    avx2_scale(acc, xscale, wscale, b, y, n, j0, M);
}

static void avx2_panel_rows(const int16_t *xw, long m, long kp, const int16_t *panel,
                            const int16_t *next, const float *xscale, const float *wscale,
                            const float *b, float *y, long n, long j0)
{
    long i = 0;
    for (; i + ROW_BLOCK2 <= m; i += ROW_BLOCK2)
        avx2_panel_block(xw + i * kp, kp, panel, i ? NULL : next, xscale + i, wscale, b,
                         y + i * n, n, j0, ROW_BLOCK2);
#define REST(R)                                                                            \
    case R:                                                                                \
        avx2_panel_block(xw + i * kp, kp, panel, i ? NULL : next, xscale + i, wscale, b,   \
                         y + i * n, n, j0, R);                                             \
        break;
    switch ((int)(m - i)) {
        REST(1) REST(2) REST(3)
    }
#undef REST
}

/* vnni_gemm's product over W packed by avx2_pack. Returns 0, or -1 where it could not
 * allocate the widened copy of X. */
static int avx2_gemm(const int8_t *x, const float *xscale, const int16_t *packed,
                     const float *wscale, const float *b, float *y, long m, long n, long k,
                     int threads)
{
    const long kp = round_up(k, 2), panels = round_up(n, PANEL2) / PANEL2;
    int16_t *xw = malloc((size_t)(m * kp) * sizeof(int16_t));
    if (!xw)
        return -1;
    for (long i = 0; i < m; i++) {
        const long k16 = k & ~15L;
        for (long t = 0; t < k16; t += 16)
            _mm256_storeu_si256((__m256i *)(xw + i * kp + t),
                                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + i * k + t))));
        for (long t = k16; t < kp; t++) /* the padding's weights are 0 */
            xw[i * kp + t] = t < k ? x[i * k + t] : 0;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long p = 0; p < panels; p++)
        avx2_panel_rows(xw, m, kp, packed + p * PANEL2 * kp,
                        p + 1 < panels ? packed + (p + 1) * PANEL2 * kp : NULL, xscale, wscale,
                        b, y, n, p * PANEL2);
    free(xw);
    return 0;
}

/* AVX2 with bytes (layout AVX2_BYTES: with AVX-VNNI, or where the few-row products found
 * the byte method the faster): the same panels of 16 outputs, but of int8 weights in
 * groups of four along k, as VNNI's are: a vector holds four weights of each of eight
 * outputs, and one broadcast group of four bytes of a row of x (and of |x|) multiplies two
 * such vectors (int8_bytes.h). Half the bytes of the 16-bit panels. */
enum { AVX2_BYTES = 3 };

static long avx2b_packed_size(long n, long k) { return round_up(n, PANEL2) * round_up(k, 4); }

static void avx2b_pack(const int8_t *q, long n, long k, int8_t *packed, int32_t *colsum)
{
    const long kq = round_up(k, 4);
    memset(packed, 0, (size_t)avx2b_packed_size(n, k));
    for (long j = 0; j < n; j++) {
        int8_t *panel = packed + (j / PANEL2) * PANEL2 * kq;
        int32_t sum = 0;
        for (long t = 0; t < k; t++) {
            panel[(t / 4) * PANEL2 * 4 + (j % PANEL2) * 4 + t % 4] = q[j * k + t];
            sum += q[j * k + t];
        }
        colsum[j] = sum;
    }
}

/* The byte products, few-row and packed, twice: with AVX2's byte multiply-add, and with
 * AVX-VNNI's dot product where the CPU has it (int8_bytes.h). */
typedef void (*i8_bytes_product)(const int8_t *, const int8_t *, const float *, const int8_t *,
                                 const float *, const float *, float *, long, long, int);
#define BYTES_NAME(name) name##_sign
#define BYTES_TARGET
#include "int8_bytes.h"
#undef BYTES_NAME
#undef BYTES_TARGET
#define BYTES_NAME(name) name##_avxvnni
#define BYTES_TARGET __attribute__((target("avxvnni")))
#define BYTES_DOT
#include "int8_bytes.h"
#undef BYTES_NAME
#undef BYTES_TARGET
#undef BYTES_DOT

/* y = (X Q^T) * (xscale wscale^T) + b with X (m x k) and Q (n x k) int8, xscale (m) and
 * wscale (n) fp32. b may be NULL. Returns 0, or -1 where it could not allocate the copy of
 * x the AVX2 products read (widened to 16 bits, or |x|; on the stack up to 16 KB). */
int tformer_matvec_int8(const int8_t *x, const float *xscale, const int8_t *q,
                        const float *wscale, const float *b, float *y,
                        long m, long n, long k, int threads)
{
    static const i8_product by_rows[4] = {i8_1, i8_2, i8_3, i8_4};
    static const i8_bytes_product by_rows_sign[4] = {product_1_sign, product_2_sign,
                                                     product_3_sign, product_4_sign};
    static const i8_bytes_product by_rows_avxvnni[4] = {product_1_avxvnni, product_2_avxvnni,
                                                        product_3_avxvnni, product_4_avxvnni};
    /* One row reads W at close to the memory's rate either way, and there the sums of w
     * that VNNI adds cost more than it saves (0.70-0.93x, benchmarks/kernel_ab.py). */
    static const i8_vnni_product by_rows_vnni[4] = {NULL, i8v_2, i8v_3, i8v_4};
    const int vnni = isa_level == ISA_AVX512_VNNI, avx_vnni = isa_level == ISA_AVX_VNNI;
    const i8_bytes_product *bytes = avx_vnni                  ? by_rows_avxvnni
                                    : avx2_method == AVX2_SIGN ? by_rows_sign
                                                               : NULL;
    const long chunk = m < 4 ? m : 4;
    int16_t stack[8192], *xw = stack;
    if (chunk * k > 8192 && !(xw = malloc((size_t)(chunk * k) * sizeof(int16_t))))
        return -1;
    for (long i = 0; i < m; i += 4) {
        const long rows = m - i < 4 ? m - i : 4;
        const int8_t *xi = x + i * k;
        if (vnni && rows > 1) {
            by_rows_vnni[rows - 1](xi, xscale + i, q, wscale, b, y + i * n, n, k, threads);
        } else if (bytes) {
            int8_t *xa = (int8_t *)xw;
            const long k32 = (rows * k) & ~31L;
            for (long t = 0; t < k32; t += 32)
                _mm256_storeu_si256((__m256i *)(xa + t),
                                    _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(xi + t))));
            for (long t = k32; t < rows * k; t++)
                xa[t] = (int8_t)(xi[t] < 0 ? -xi[t] : xi[t]);
            bytes[rows - 1](xi, xa, xscale + i, q, wscale, b, y + i * n, n, k, threads);
        } else {
            const long k16 = (rows * k) & ~15L;
            for (long t = 0; t < k16; t += 16)
                _mm256_storeu_si256((__m256i *)(xw + t),
                                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xi + t))));
            for (long t = k16; t < rows * k; t++)
                xw[t] = xi[t];
            by_rows[rows - 1](xw, xscale + i, q, wscale, b, y + i * n, n, k, threads);
        }
    }
    if (xw != stack)
        free(xw);
    return 0;
}

/* The layout pack_int8 packs in for this process: ISA_AVX512_VNNI with VNNI, else
 * AVX2_BYTES with AVX-VNNI or where the few-row products chose the byte method, else
 * ISA_AVX2. */
int tformer_pack_layout(void)
{
    return isa_level == ISA_AVX512_VNNI                            ? ISA_AVX512_VNNI
           : isa_level == ISA_AVX_VNNI || avx2_method == AVX2_SIGN ? AVX2_BYTES
                                                                   : ISA_AVX2;
}

/* Bytes of W packed for the product in `layout` (ISA_AVX2, ISA_AVX512_VNNI, AVX2_BYTES). */
long tformer_packed_int8_size(long n, long k, int layout)
{
    return layout == ISA_AVX512_VNNI ? vnni_packed_size(n, k)
           : layout == AVX2_BYTES    ? avx2b_packed_size(n, k)
                                     : avx2_packed_size(n, k);
}

/* Pack q (n x k int8, row-major) for the product in `layout` into `packed`
 * (tformer_packed_int8_size bytes), and the sum of each row of q into colsum (n). */
void tformer_pack_int8(const int8_t *q, long n, long k, int8_t *packed, int32_t *colsum,
                       int layout)
{
    if (layout == ISA_AVX512_VNNI)
        vnni_pack(q, n, k, packed, colsum);
    else if (layout == AVX2_BYTES)
        avx2b_pack(q, n, k, packed, colsum);
    else
        avx2_pack(q, n, k, (int16_t *)packed, colsum);
}

/* y = (X Q^T) * (xscale wscale^T) + b as tformer_matvec_int8, with Q packed by
 * tformer_pack_int8 in `layout` (VNNI's only where the CPU has it: matvec.py checks).
 * Returns 0, or -1 where it could not allocate. */
int tformer_gemm_int8(const int8_t *x, const float *xscale, const int8_t *packed,
                      const int32_t *colsum, const float *wscale, const float *b, float *y,
                      long m, long n, long k, int layout, int threads)
{
    if (layout == ISA_AVX512_VNNI)
        return vnni_gemm(x, xscale, packed, colsum, wscale, b, y, m, n, k, threads);
    if (layout == AVX2_BYTES)
        return (isa_level == ISA_AVX_VNNI ? gemm_avxvnni : gemm_sign)(
            x, xscale, packed, colsum, wscale, b, y, m, n, k, threads);
    return avx2_gemm(x, xscale, (const int16_t *)packed, wscale, b, y, m, n, k, threads);
}

/* The rows of x (m x k, fp32) in int8 with one scale each, the same numbers as
 * quantize_rows's torch formula: scale = max |x| / 127 (1 for an all-zero row), then
 * x / scale rounded half to even and clamped to [-127, 127]. Each step rounds as torch's
 * does (a true division, no reciprocal), so the two agree bit for bit. */
void tformer_quantize_rows(const float *x, int8_t *xq, float *scale, long m, long k)
{
    const long k8 = k & ~7L;
    const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f),
                 hi = _mm256_set1_ps(127.0f);
    for (long i = 0; i < m; i++) {
        const float *row = x + i * k;
        int8_t *out = xq + i * k;
        __m256 mx = _mm256_setzero_ps();
        for (long j = 0; j < k8; j += 8)
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + j)));
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, mx);
        for (int l = 0; l < 8; l++)
            amax = lanes[l] > amax ? lanes[l] : amax;
        for (long j = k8; j < k; j++)
            amax = fabsf(row[j]) > amax ? fabsf(row[j]) : amax;
        float s = amax / 127.0f;
        if (!(s > 0.0f))
            s = 1.0f;
        scale[i] = s;
        const __m256 sv = _mm256_set1_ps(s);
        for (long j = 0; j < k8; j += 8) {
            __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + j), sv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i n = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
            const __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n),
                                                _mm256_extracti128_si256(n, 1));
            _mm_storel_epi64((__m128i *)(out + j), _mm_packs_epi16(n16, n16));
        }
        for (long j = k8; j < k; j++) {
            const float v = nearbyintf(row[j] / s);
            out[j] = (int8_t)(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v);
        }
    }
}

/* y = x W^T + b for an Int8Linear and a few rows of fp32 x: x rounded to int8 rows as
 * tformer_quantize_rows does, then tformer_matvec_int8. Returns 0, or -1 where it could not
 * allocate the rounded or widened rows. */
int tformer_linear_int8(const float *x, const int8_t *q, const float *wscale, const float *b,
                        float *y, long m, long n, long k, int threads)
{
    int8_t *xq = malloc((size_t)(m * k));
    float *xscale = malloc((size_t)m * sizeof(float));
    int ok = xq && xscale;
    if (ok) {
        tformer_quantize_rows(x, xq, xscale, m, k);
        ok = tformer_matvec_int8(xq, xscale, q, wscale, b, y, m, n, k, threads) == 0;
    }
    free(xq);
    free(xscale);
    return ok ? 0 : -1;
}

/* tformer_gemm_int8 on fp32 rows: x rounded to int8 (tformer_quantize_rows) first, as
 * tformer_linear_int8 does for tformer_matvec_int8. Returns 0, or -1 where it could not
 * allocate. */
int tformer_linear_int8_packed(const float *x, const int8_t *packed, const int32_t *colsum,
                               const float *wscale, const float *b, float *y, long m, long n,
                               long k, int layout, int threads)
{
    int8_t *xq = malloc((size_t)(m * k));
    float *xscale = malloc((size_t)m * sizeof(float));
    int ok = xq && xscale;
    if (ok) {
        tformer_quantize_rows(x, xq, xscale, m, k);
        ok = tformer_gemm_int8(xq, xscale, packed, colsum, wscale, b, y, m, n, k, layout,
                               threads) == 0;
    }
    free(xq);
    free(xscale);
    return ok ? 0 : -1;
}

/* y = (float) acc * (xscale[i] * wscale[j]) + b[j], in place over an m x n matrix of 32-bit
 * integer sums (torch._int_mm's output): int8_reference's scaling in one pass instead of
 * four, with the same fp32 operations in the same order. b may be NULL. */
void tformer_scale_int8(int32_t *acc, const float *xscale, const float *wscale, const float *b,
                        long m, long n, int threads)
{
    const long n8 = n & ~7L;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m * n > 65536)
    for (long i = 0; i < m; i++) {
        int32_t *row = acc + i * n;
        const __m256 xs = _mm256_set1_ps(xscale[i]);
        for (long j = 0; j < n8; j += 8) {
            const __m256 s = _mm256_mul_ps(xs, _mm256_loadu_ps(wscale + j));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((__m256i *)(row + j))), s);
            if (b)
                v = _mm256_add_ps(v, _mm256_loadu_ps(b + j));
            _mm256_storeu_ps((float *)(row + j), v);
        }
        for (long j = n8; j < n; j++) {
            float v = (float)row[j] * (xscale[i] * wscale[j]);
            if (b)
                v = v + b[j];
            memcpy(row + j, &v, sizeof v); /* the float takes the integer's place */
        }
    }
}

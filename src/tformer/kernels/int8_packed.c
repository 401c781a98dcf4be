/* The int8 product of many rows over weights packed once, x86 with AVX2 (and AVX-512 VNNI
 * or AVX-VNNI where the process uses them): the same exact sums as int8.c's few-row
 * product, and the same scaling. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tformer.h"
#include "vecmath.h"
#include "int8.h"

/* --- Many rows: a blocked int8 product over weights packed once -------------------------
 *
 * From about eight rows on (beam search over a batch) a product is no longer a stream
 * through W but a matrix product, where each weight should be read from memory once and
 * then used for every row. torch._int_mm (oneDNN) does that, but reorders W into its own
 * layout at every call, and on CPUs without VNNI it can be slower than fp32's product by
 * far. Here W is packed once, when the layer is made, in the layout of the instruction set
 * the process uses (the `layout`: TFORMER_ISA_AVX512_VNNI, TFORMER_ISA_AVX2 or
 * TFORMER_AVX2_BYTES, below; tformer_pack_layout).
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

/* AVX2 with bytes (layout TFORMER_AVX2_BYTES: with AVX-VNNI, or where the few-row products found
 * the byte method the faster): the same panels of 16 outputs, but of int8 weights in
 * groups of four along k, as VNNI's are: a vector holds four weights of each of eight
 * outputs, and one broadcast group of four bytes of a row of x (and of |x|) multiplies two
 * such vectors (int8_bytes.h). Half the bytes of the 16-bit panels. */

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
/* The packed byte products, twice: with AVX2's byte multiply-add, and with AVX-VNNI's dot
 * product where the CPU has it (int8_bytes.h). */
#define BYTES_NAME(name) name##_sign
#define BYTES_TARGET
#include "int8_bytes_packed.h"
#undef BYTES_NAME
#undef BYTES_TARGET
#define BYTES_NAME(name) name##_avxvnni
#define BYTES_TARGET __attribute__((target("avxvnni")))
#define BYTES_DOT
#include "int8_bytes_packed.h"
#undef BYTES_NAME
#undef BYTES_TARGET
#undef BYTES_DOT

/* The layout pack_int8 packs in for this process: TFORMER_ISA_AVX512_VNNI with VNNI, else
 * TFORMER_AVX2_BYTES with AVX-VNNI or where the few-row products chose the byte method, else
 * TFORMER_ISA_AVX2. */
int tformer_pack_layout(void)
{
    const int isa_level = tformer_isa(-1), avx2_method = tformer_avx2_method(-1);
    return isa_level == TFORMER_ISA_AVX512_VNNI ? TFORMER_ISA_AVX512_VNNI
           : isa_level == TFORMER_ISA_AVX_VNNI || avx2_method == TFORMER_AVX2_SIGN
               ? TFORMER_AVX2_BYTES
               : TFORMER_ISA_AVX2;
}

/* Bytes of W packed for the product in `layout` (TFORMER_ISA_AVX2, TFORMER_ISA_AVX512_VNNI,
 * TFORMER_AVX2_BYTES). */
long tformer_packed_int8_size(long n, long k, int layout)
{
    return layout == TFORMER_ISA_AVX512_VNNI ? vnni_packed_size(n, k)
           : layout == TFORMER_AVX2_BYTES    ? avx2b_packed_size(n, k)
                                     : avx2_packed_size(n, k);
}

/* Pack q (n x k int8, row-major) for the product in `layout` into `packed`
 * (tformer_packed_int8_size bytes), and the sum of each row of q into colsum (n). */
void tformer_pack_int8(const int8_t *q, long n, long k, int8_t *packed, int32_t *colsum,
                       int layout)
{
    if (layout == TFORMER_ISA_AVX512_VNNI)
        vnni_pack(q, n, k, packed, colsum);
    else if (layout == TFORMER_AVX2_BYTES)
        avx2b_pack(q, n, k, packed, colsum);
    else
        avx2_pack(q, n, k, (int16_t *)packed, colsum);
}

/* y = (X Q^T) * (xscale wscale^T) + b as tformer_matvec_int8, with Q packed by
 * tformer_pack_int8 in `layout` (VNNI's only where the CPU has it: int8.py checks).
 * Returns 0, or -1 where it could not allocate. */
int tformer_gemm_int8(const int8_t *x, const float *xscale, const int8_t *packed,
                      const int32_t *colsum, const float *wscale, const float *b, float *y,
                      long m, long n, long k, int layout, int threads)
{
    if (layout == TFORMER_ISA_AVX512_VNNI)
        return vnni_gemm(x, xscale, packed, colsum, wscale, b, y, m, n, k, threads);
    if (layout == TFORMER_AVX2_BYTES)
        return (tformer_isa(-1) == TFORMER_ISA_AVX_VNNI ? gemm_avxvnni : gemm_sign)(
            x, xscale, packed, colsum, wscale, b, y, m, n, k, threads);
    return avx2_gemm(x, xscale, (const int16_t *)packed, wscale, b, y, m, n, k, threads);
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

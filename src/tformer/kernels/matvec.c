/* y = x W^T + b for the few rows of a decoding step (x: m x k, W: n x k, y: m x n; fp32
 * activations, row-major, contiguous), with W in fp32 or in int8 with one scale per row.
 * x86 with AVX2 and FMA; threads over the rows of W with OpenMP.
 *
 * With a few rows of x the product is a stream through W: every weight is read once per
 * group of up to four rows and used for each. The kernel keeps those rows of x in the L1
 * cache, loads 8 weights of each of R rows of W at a time, and keeps rows x R sums of 8
 * lanes in registers (at most 12 of the 16 AVX2 registers, so nothing spills). Int8
 * weights are widened to floats in registers: a quarter of the bytes to read, the same
 * arithmetic (weight-only quantization: x stays fp32).
 *
 * Each output is summed in the same order whatever m is and wherever its row falls, so a
 * row's result does not depend on the rows batched with it.
 */
#include <immintrin.h>
#include <stdint.h>

static inline float sum_lanes(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight consecutive weights as floats: fp32 weights are loaded as they are, int8 ones
 * widened to 32-bit integers and converted. */
static inline __attribute__((always_inline)) __m256 load8(const void *w, long at, const int int8)
{
    if (int8)
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + at))));
    return _mm256_loadu_ps((const float *)w + at);
}

static inline __attribute__((always_inline)) float weight(const void *w, long at, const int int8)
{
    return int8 ? (float)((const int8_t *)w)[at] : ((const float *)w)[at];
}

/* Outputs [r0, r0 + R) of all M rows. M, R and int8 are constants at every call, so the
 * compiler unrolls the loops over them and the sums stay in registers. An int8 row of W is
 * summed in integers-as-floats and scaled once at the end. */
static inline __attribute__((always_inline)) void rows_of_w(
    const float *x, const void *w, const float *scale, const float *b, float *y,
    long n, long k, long r0, const int M, const int R, const int int8)
{
    __m256 acc[4][4];
    const long k8 = k & ~7L;
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm256_setzero_ps();
    /* Int8 rows are short (768 bytes at k = 768) and take longer to compute per byte; the
     * hardware prefetcher falls behind them. Fetching the next block of rows while this
     * one is summed, at the same pace, took the int8 kernel from 14 to 25 G weights/s over
     * the matrices of GPT-2 small (fp32 weights ran slower with it, so they go without). */
    const int8_t *next = (const int8_t *)w + (r0 + R) * k;
    for (long j = 0; j < k8; j += 8) {
        __m256 wv[4];
        if (int8)
            _mm_prefetch((const char *)(next + j * R), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            wv[r] = load8(w, (r0 + r) * k + j, int8);
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
                s += weight(w, (r0 + r) * k + j, int8) * x[i * k + j];
            if (int8)
                s *= scale[r0 + r];
            y[i * n + r0 + r] = b ? s + b[r0 + r] : s;
        }
}

/* R rows of W per step: 4 keep four streams of weights in flight for one or two rows of x;
 * with three or four rows of x, 3 is the most that fits the registers. Measured on a
 * 768 x 50257 matrix, wider blocks than these ran slower. */
#define PRODUCT(M, R, INT8, NAME)                                                          \
    static void NAME(const float *x, const void *w, const float *scale, const float *b,   \
                     float *y, long n, long k, int threads)                               \
    {                                                                                     \
        const long blocks = n / R;                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)") \
        for (long q = 0; q < blocks; q++)                                                 \
            rows_of_w(x, w, scale, b, y, n, k, q * R, M, R, INT8);                        \
        for (long r0 = blocks * R; r0 < n; r0++)                                          \
            rows_of_w(x, w, scale, b, y, n, k, r0, M, 1, INT8);                           \
    }
PRODUCT(1, 4, 0, f32_1)
PRODUCT(2, 4, 0, f32_2)
PRODUCT(3, 3, 0, f32_3)
PRODUCT(4, 3, 0, f32_4)
PRODUCT(1, 4, 1, i8_1)
PRODUCT(2, 4, 1, i8_2)
PRODUCT(3, 3, 1, i8_3)
PRODUCT(4, 3, 1, i8_4)

typedef void (*product)(const float *, const void *, const float *, const float *, float *,
                        long, long, int);

/* Any number of rows, four at a time: each group streams W once. */
static void rows_in_fours(const product by_rows[4], const float *x, const void *w,
                          const float *scale, const float *b, float *y,
                          long m, long n, long k, int threads)
{
    for (long i = 0; i < m; i += 4) {
        const long rows = m - i < 4 ? m - i : 4;
        by_rows[rows - 1](x + i * k, w, scale, b, y + i * n, n, k, threads);
    }
}

/* y (m x n) = x (m x k) W^T + b, W fp32 (n x k). b may be NULL. */
void tformer_matvec(const float *x, const float *w, const float *b, float *y,
                    long m, long n, long k, int threads)
{
    static const product f32[4] = {f32_1, f32_2, f32_3, f32_4};
    rows_in_fours(f32, x, w, NULL, b, y, m, n, k, threads);
}

/* y = x (diag(scale) Q)^T + b with Q int8 (n x k) and one fp32 scale per row of Q. */
void tformer_matvec_int8(const float *x, const int8_t *q, const float *scale, const float *b,
                         float *y, long m, long n, long k, int threads)
{
    static const product i8[4] = {i8_1, i8_2, i8_3, i8_4};
    rows_in_fours(i8, x, q, scale, b, y, m, n, k, threads);
}

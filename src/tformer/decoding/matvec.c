/* y = x W^T + b for the few rows of a decoding step (x: m x k, W: n x k, y: m x n; fp32,
 * row-major, contiguous). x86 with AVX2 and FMA; threads over the rows of W with OpenMP.
 *
 * With one to four rows of x the product is a stream through W: every weight is read once
 * and used m times. The kernel keeps the rows of x in the L1 cache, loads 8 weights of each
 * of R rows of W at a time, and keeps m x R sums of 8 lanes in registers (at most 12 of the
 * 16 AVX2 registers, so nothing spills). Each output is summed in the same order whatever m
 * is and wherever its row falls, so a row's result does not depend on the rows batched
 * with it.
 */
#include <immintrin.h>

static inline float sum_lanes(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Outputs [r0, r0 + R) of all M rows. M and R are constants at every call, so the compiler
 * unrolls the loops over them and the sums stay in registers. */
static inline __attribute__((always_inline)) void rows_of_w(
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
    for (long j = 0; j < k8; j += 8) {
        __m256 wv[4];
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
            const float *wr = w + (r0 + r) * k;
            float s = sum_lanes(acc[i][r]);
            for (long j = k8; j < k; j++) /* k not a multiple of 8 */
                s += wr[j] * x[i * k + j];
            y[i * n + r0 + r] = b ? s + b[r0 + r] : s;
        }
}

/* R rows of W per step: 4 keep four streams of weights in flight for one or two rows of x;
 * with three or four rows of x, 3 is the most that fits the registers. Measured on a
 * 768 x 50257 matrix, wider blocks than these ran slower. */
#define PRODUCT(M, R)                                                                      \
    static void product_##M(const float *x, const float *w, const float *b, float *y,     \
                            long n, long k, int threads)                                  \
    {                                                                                     \
        const long blocks = n / R;                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)") \
        for (long q = 0; q < blocks; q++)                                                 \
            rows_of_w(x, w, b, y, n, k, q * R, M, R);                                     \
        for (long r0 = blocks * R; r0 < n; r0++)                                          \
            rows_of_w(x, w, b, y, n, k, r0, M, 1);                                        \
    }
PRODUCT(1, 4)
PRODUCT(2, 4)
PRODUCT(3, 3)
PRODUCT(4, 3)

/* Returns 0, or -1 if m is not 1 to 4 (nothing is written then). b may be NULL. */
int tformer_matvec(const float *x, const float *w, const float *b, float *y,
                   long m, long n, long k, int threads)
{
    switch (m) {
    case 1: product_1(x, w, b, y, n, k, threads); return 0;
    case 2: product_2(x, w, b, y, n, k, threads); return 0;
    case 3: product_3(x, w, b, y, n, k, threads); return 0;
    case 4: product_4(x, w, b, y, n, k, threads); return 0;
    default: return -1;
    }
}

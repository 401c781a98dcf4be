/* fp32 products for the few rows of a decoding step, x86 with AVX2 and FMA, threaded over
 * the rows of W with OpenMP; all matrices row-major and contiguous: y = x W^T + b, x (m x k)
 * and W (n x k) in fp32.
 *
 * With a few rows of x the product is a stream through W: every weight is read once per
 * group of up to four rows and used for each. The kernel keeps those rows of x in the L1
 * cache, loads a vector of weights of each of R rows of W at a time, and keeps rows x R
 * sums in registers (at most 12 of the 16 AVX2 registers, so nothing spills).
 *
 * Each output is summed in the same order whatever m is and wherever its row falls, so a
 * row's result does not depend on the rows batched with it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tformer.h"
#include "vecmath.h"

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

/* The blocks of rows of W a thread takes at a time: a sixteenth of its share. Threads take
 * them as they come (schedule dynamic), so where the system holds one back (another process
 * on its core), the others take its share rather than wait for it; each output's sum is the
 * same whichever thread computes it. */
static long share(long blocks, int threads)
{
    const long chunk = blocks / (16L * (threads > 1 ? threads : 1));
    return chunk > 0 ? chunk : 1;
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
        const long blocks = n / R, chunk = share(blocks, threads);                        \
        _Pragma("omp parallel for schedule(dynamic, chunk) num_threads(threads) if (threads > 1)") \
        for (long q = 0; q < blocks; q++)                                                  \
            f32_rows_of_w(x, w, b, y, n, k, q * R, M, R);                                  \
        for (long r0 = blocks * R; r0 < n; r0++)                                           \
            f32_rows_of_w(x, w, b, y, n, k, r0, M, 1);                                     \
    }
F32_PRODUCT(1, 4, f32_1)
F32_PRODUCT(2, 4, f32_2)
F32_PRODUCT(3, 3, f32_3)
F32_PRODUCT(4, 3, f32_4)

typedef void (*f32_product)(const float *, const float *, const float *, float *, long,
                            long, int);

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
    const long blocks = n / 3, chunk = share(blocks, threads);
#pragma omp parallel for schedule(dynamic, chunk) num_threads(threads) if (threads > 1)
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

/* The kinds table's product for TFORMER_FP32 (kinds.c). */
int tformer_fp32_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                        int threads)
{
    tformer_matvec(x, (const float *)l->data, l->bias, y, m, l->n_out, l->n_in, threads);
    return 0;
}

/* The few-row product over int8 weights' bytes (see int8_bytes.h), included twice by int8.c. */
#include "int8_bytes.h"

/* Outputs [r0, r0 + R) of M rows of x (and |x| in xa), int8 rows of W; as i8_rows_of_w. */
BYTES_TARGET static inline __attribute__((always_inline)) void BYTES_NAME(rows_of_w)(
    const int8_t *x, const int8_t *xa, const float *xscale, const int8_t *w,
    const float *wscale, const float *b, float *y, long n, long k, long r0, const int M,
    const int R)
{
    __m256i acc[4][4];
    const long k32 = k & ~31L;
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm256_setzero_si256();
    const int8_t *next = w + (r0 + PREFETCH_AHEAD * R) * k;
    for (long j = 0; j < k32; j += 32) {
        _mm_prefetch((const char *)(next + j * R), _MM_HINT_T0);
        if (R > 2)
            _mm_prefetch((const char *)(next + j * R + 64), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (r0 + r) * k + j));
#pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i * k + j));
                const __m256i av = _mm256_loadu_si256((const __m256i *)(xa + i * k + j));
                acc[i][r] = BYTES_ACCUMULATE(acc[i][r], av, _mm256_sign_epi8(wv, xv));
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t s = sum_lanes_i32(acc[i][r]);
            for (long j = k32; j < k; j++) /* k not a multiple of 32 */
                s += (int32_t)w[(r0 + r) * k + j] * (int32_t)x[i * k + j];
            const float v = (float)s * (xscale[i] * wscale[r0 + r]);
            y[i * n + r0 + r] = b ? v + b[r0 + r] : v;
        }
}

/* All outputs of M rows, R rows of W per step (int8.c's I8_PRODUCT_OF for this pair). */
#define BYTES_PRODUCT(M, R)                                                                \
    BYTES_TARGET static void BYTES_NAME(product_##M)(                                      \
        const int8_t *x, const int8_t *xa, const float *xs, const int8_t *w,               \
        const float *ws, const float *b, float *y, long n, long k, int threads)            \
    {                                                                                      \
        const long blocks = n / R;                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")  \
        for (long q = 0; q < blocks; q++)                                                  \
            BYTES_NAME(rows_of_w)(x, xa, xs, w, ws, b, y, n, k, q * R, M, R);              \
        for (long r0 = blocks * R; r0 < n; r0++)                                           \
            BYTES_NAME(rows_of_w)(x, xa, xs, w, ws, b, y, n, k, r0, M, 1);                 \
    }
BYTES_PRODUCT(1, 4)
BYTES_PRODUCT(2, 4)
BYTES_PRODUCT(3, 3)
BYTES_PRODUCT(4, 2)
#undef BYTES_PRODUCT

#undef BYTES_ACCUMULATE

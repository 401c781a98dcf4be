/* The many-row product over int8 weights packed as bytes (see int8_bytes.h), included twice
 * by int8_packed.c. */
#include "int8_bytes.h"

/* Rows [0, M) of x (rows kq apart) times one panel of W packed by avx2b_pack: outputs
 * j0 .. j0 + 15 (those below n) of each row. One broadcast group of four bytes of a row
 * multiplies two vectors of the panel, each four weights of eight outputs. With AVX2, xa
 * holds |x| and the sign moves onto w; with AVX-VNNI, x holds x ^ 0x80 = x + 128 (unsigned,
 * one instruction a product, as AVX-512 VNNI's path) and 128 * sum(w) (colsum, counted when
 * packing) is taken off the sums; xa is unused. */
BYTES_TARGET static inline __attribute__((always_inline)) void BYTES_NAME(panel_block)(
    const int8_t *x, const int8_t *xa, long kq, const int8_t *panel, const int8_t *next,
    const int32_t *colsum, const float *xscale, const float *wscale, const float *b, float *y,
    long n, long j0, const int M)
{
    __m256i acc[ROW_BLOCK2][2];
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    (void)xa;
    (void)colsum;
#pragma GCC unroll 6
    for (int i = 0; i < M; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (long g = 0; g < kq / 4; g++) {
        if (next) /* a 64-byte line of the next panel a step: all of it by the block's end */
            _mm_prefetch((const char *)(next + g * PANEL2 * 4), _MM_HINT_T0);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(panel + g * PANEL2 * 4));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(panel + g * PANEL2 * 4 + 32));
#pragma GCC unroll 6
        for (int i = 0; i < M; i++) {
            int32_t four;
            memcpy(&four, x + i * kq + g * 4, sizeof four);
            const __m256i xv = _mm256_set1_epi32(four);
#ifdef BYTES_DOT
            acc[i][0] = _mm256_dpbusd_avx_epi32(acc[i][0], xv, w0);
            acc[i][1] = _mm256_dpbusd_avx_epi32(acc[i][1], xv, w1);
#else
            int32_t four_abs;
            memcpy(&four_abs, xa + i * kq + g * 4, sizeof four_abs);
            const __m256i av = _mm256_set1_epi32(four_abs);
            acc[i][0] = BYTES_ACCUMULATE(acc[i][0], av, _mm256_sign_epi8(w0, xv));
            acc[i][1] = BYTES_ACCUMULATE(acc[i][1], av, _mm256_sign_epi8(w1, xv));
#endif
        }
    }
#ifdef BYTES_DOT
    int32_t sums[PANEL2] = {0};
    memcpy(sums, colsum + j0, sizeof(int32_t) * (size_t)(n - j0 < PANEL2 ? n - j0 : PANEL2));
    const __m256i off0 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)sums), 7);
    const __m256i off1 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(sums + 8)), 7);
#pragma GCC unroll 6
    for (int i = 0; i < M; i++) {
        acc[i][0] = _mm256_sub_epi32(acc[i][0], off0);
        acc[i][1] = _mm256_sub_epi32(acc[i][1], off1);
    }
#endif
    avx2_scale(acc, xscale, wscale, b, y, n, j0, M);
}

BYTES_TARGET static void BYTES_NAME(panel_rows)(
    const int8_t *x, const int8_t *xa, long m, long kq, const int8_t *panel,
    const int8_t *next, const int32_t *colsum, const float *xscale, const float *wscale,
    const float *b, float *y, long n, long j0)
{
    long i = 0;
    for (; i + ROW_BLOCK2 <= m; i += ROW_BLOCK2)
        BYTES_NAME(panel_block)(x + i * kq, xa + i * kq, kq, panel, i ? NULL : next, colsum,
                                xscale + i, wscale, b, y + i * n, n, j0, ROW_BLOCK2);
#define REST(R)                                                                            \
    case R:                                                                                \
        BYTES_NAME(panel_block)(x + i * kq, xa + i * kq, kq, panel, i ? NULL : next,       \
                                colsum, xscale + i, wscale, b, y + i * n, n, j0, R);       \
        break;
    switch ((int)(m - i)) {
        REST(1) REST(2) REST(3)
    }
#undef REST
}

/* avx2_gemm's product over W packed by avx2b_pack (its row sums in colsum), x given as
 * int8 rows (m x k). Returns 0, or -1 where it could not allocate the copies of x (and, with
 * AVX2, of |x|) padded to groups of four. */
BYTES_TARGET static int BYTES_NAME(gemm)(const int8_t *x, const float *xscale,
                                         const int8_t *packed, const int32_t *colsum,
                                         const float *wscale, const float *b, float *y,
                                         long m, long n, long k, int threads)
{
    const long kq = round_up(k, 4), panels = round_up(n, PANEL2) / PANEL2;
    int8_t *xp = malloc((size_t)(2 * m * kq));
    if (!xp)
        return -1;
    int8_t *xa = xp + m * kq;
    const long k32 = k & ~31L;
    for (long i = 0; i < m; i++) {
        const int8_t *row = x + i * k;
        for (long t = 0; t < k32; t += 32) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(row + t));
#ifdef BYTES_DOT
            _mm256_storeu_si256((__m256i *)(xp + i * kq + t),
                                _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)));
#else
            _mm256_storeu_si256((__m256i *)(xp + i * kq + t), v);
            _mm256_storeu_si256((__m256i *)(xa + i * kq + t), _mm256_abs_epi8(v));
#endif
        }
        for (long t = k32; t < kq; t++) { /* the padding's weights are 0 */
            const int8_t v = t < k ? row[t] : 0;
#ifdef BYTES_DOT
            xp[i * kq + t] = (int8_t)(v ^ 0x80);
#else
            xp[i * kq + t] = v;
            xa[i * kq + t] = (int8_t)(v < 0 ? -v : v);
#endif
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long p = 0; p < panels; p++)
        BYTES_NAME(panel_rows)(xp, xa, m, kq, packed + p * PANEL2 * kq,
                               p + 1 < panels ? packed + (p + 1) * PANEL2 * kq : NULL, colsum,
                               xscale, wscale, b, y, n, p * PANEL2);
    free(xp);
    return 0;
}

#undef BYTES_ACCUMULATE

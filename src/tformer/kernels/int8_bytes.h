/* The int8 products over the weights' bytes as they are, for x86 without AVX-512 VNNI:
 * the few-row product (over rows of W) and the many-row one (over W packed in panels,
 * AVX2_BYTES). matvec.c includes this file twice, with
 *
 *   BYTES_NAME(name)  the suffix of the functions' names (name##_sign, name##_avxvnni)
 *   BYTES_TARGET      a function target, or nothing
 *   BYTES_DOT         defined: sums of four products with AVX-VNNI's vpdpbusd; else with
 *                     AVX2's byte multiply-add
 *
 * Both are exact in the same way. x's sign moves onto w (_mm256_sign_epi8), so every
 * product is |x| (unsigned bytes, xa, made once per call) times w * sign(x) (signed bytes),
 * each in [-127, 127] as quantize_rows makes them (a weight of -128 could not take a
 * negative sign; every int8 weight here comes from it):
 * - AVX2: _mm256_maddubs_epi16 multiplies 32 such pairs and adds neighbours into 16-bit
 *   sums, which saturate past 32767: a pair is at most 2 * 127 * 127 = 32258, so none
 *   does. _mm256_madd_epi16 against ones adds pairs of those into eight 32-bit sums. Four
 *   instructions for 32 products, where the 16-bit path needs two for 16 (plus the
 *   widenings); which is faster depends on the CPU's ports (matvec.py times both).
 * - AVX-VNNI (Intel's cores since Alder Lake, AMD's since Zen 4): _mm256_dpbusd_avx_epi32
 *   adds four such products into each 32-bit sum at once, without 16-bit steps: two
 *   instructions for 32 products in the few-row product. The packed product instead takes
 *   x + 128 as the unsigned bytes and takes 128 * sum(w) off, as AVX-512 VNNI's path does:
 *   one instruction for 32.
 */

#ifdef BYTES_DOT
#define BYTES_ACCUMULATE(acc, a, s) _mm256_dpbusd_avx_epi32(acc, a, s)
#else
#define BYTES_ACCUMULATE(acc, a, s)                                                        \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), ones))
#endif

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

/* All outputs of M rows, R rows of W per step (matvec.c's I8_PRODUCT_OF for this pair). */
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

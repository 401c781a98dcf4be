/* The K kinds' product over repacked weights (kquants.c's struct krepacked) for one
 * instruction set. kquants.c includes this file three times, with
 *
 *   KQ_NAME(name)  the suffix of the functions' names (name##_avx2, ...)
 *   KQ_TARGET      the function target
 *   KQ_VNNI        defined: sums of four byte products with a VNNI instruction (KQ_DPBUSD);
 *                  else with AVX2's byte multiply-add (pairs at most 2 * 63 * 127: no
 *                  saturation)
 *
 * Lane o of a vector is output o of a group of eight: register t of a super-block holds the
 * eight outputs' values 4t .. 4t + 3, so four byte products with x's four bytes, broadcast,
 * give each output its group of 16's sum in its own lane, which its scale multiplies. The
 * minimums' sum takes x's group sums two at a time against the outputs' minimums (16-bit
 * pairs, _mm256_madd_epi16). Both integer sums are the plain C ones exactly, and the fp32
 * operations the same in the same order: the results are the few-row product's, bit for
 * bit. */

#ifdef KQ_VNNI
#define KQ_SUM(acc, u, s) KQ_DPBUSD(acc, u, s)
#else
#define KQ_SUM(acc, u, s)                                                                  \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones))
#endif

/* Rows [i0, i0 + M) of x (M at most 4) against group gr of W's rows (8 outputs). */
KQ_TARGET static inline __attribute__((always_inline)) void KQ_NAME(kgroup)(
    const struct kx *xb, long i0, const struct krepacked *w, const float *b, float *y,
    long n, long nb, long gr, const int M)
{
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256 acc[4];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        acc[i] = _mm256_setzero_ps();
    const struct krepacked *blk = w + gr * nb;
    for (long sb = 0; sb < nb; sb++, blk++) {
        const __m256 d = _mm256_loadu_ps(blk->d), dmin = _mm256_loadu_ps(blk->dmin);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const long at = (i0 + i) * nb + sb;
            const uint8_t *xq = (const uint8_t *)(xb->q + at * QK);
            const int32_t *bs = xb->bsums + at * GROUPS;
            __m256i s = _mm256_setzero_si256(), mins = _mm256_setzero_si256();
            for (int g = 0; g < GROUPS; g++) {
                __m256i p = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int t = 4 * g; t < 4 * g + 4; t++) {
                    uint32_t four;
                    memcpy(&four, xq + 4 * t, sizeof four);
                    p = KQ_SUM(p, _mm256_loadu_si256((const __m256i *)blk->u[t]),
                               _mm256_set1_epi32((int)four));
                }
                s = _mm256_add_epi32(
                    s, _mm256_mullo_epi32(p, _mm256_loadu_si256((const __m256i *)blk->sc[g])));
            }
#pragma GCC unroll 8
            for (int h = 0; h < GROUPS / 2; h++) {
                const uint32_t pair = (uint16_t)bs[2 * h] | (uint32_t)bs[2 * h + 1] << 16;
                mins = _mm256_add_epi32(
                    mins, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)blk->mn[h]),
                                            _mm256_set1_epi32((int)pair)));
            }
            const __m256 dx = _mm256_set1_ps(xb->d[at]);
            const __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, dx));
            const __m256 t2 = _mm256_mul_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx));
            acc[i] = _mm256_add_ps(acc[i], _mm256_sub_ps(t1, t2));
        }
    }
    const long valid = n - gr * 8 < 8 ? n - gr * 8 : 8;
    float bias[8] = {0};
    if (b)
        memcpy(bias, b + gr * 8, (size_t)valid * sizeof(float));
#pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        const __m256 v = b ? _mm256_add_ps(acc[i], _mm256_loadu_ps(bias)) : acc[i];
        float out[8];
        _mm256_storeu_ps(out, v);
        memcpy(y + (i0 + i) * n + gr * 8, out, (size_t)valid * sizeof(float));
    }
}

KQ_TARGET static void KQ_NAME(kgroups)(const struct kx *xb, long i0, int M,
                                       const struct krepacked *w, const float *b, float *y,
                                       long n, long nb, long gr)
{
    switch (M) {
    case 1: KQ_NAME(kgroup)(xb, i0, w, b, y, n, nb, gr, 1); return;
    case 2: KQ_NAME(kgroup)(xb, i0, w, b, y, n, nb, gr, 2); return;
    case 3: KQ_NAME(kgroup)(xb, i0, w, b, y, n, nb, gr, 3); return;
    default: KQ_NAME(kgroup)(xb, i0, w, b, y, n, nb, gr, 4); return;
    }
}

#undef KQ_SUM

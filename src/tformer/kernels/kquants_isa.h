/* The K kinds' product over repacked weights (kquants.c's struct krepacked) for one
 * instruction set. kquants.c includes this file three times, with
 *
 *   KQ_NAME(name)  the suffix of the functions' names (name##_avx2, ...)
 *   KQ_TARGET      the function target
 *   KQ_VNNI        defined: sums of four byte products with a VNNI instruction (KQ_DPBUSD);
 *                  else with AVX2's byte multiply-add (pairs at most 2 * 63 * 127: no
 *                  saturation)
 *   KQ_512         defined: AVX-512 (F, BW, VNNI), eight outputs' two fours a register
 *
 * A register of W holds outputs' values four to a 32-bit lane, lane (o, h) values
 * 8c + 4h .. 8c + 4h + 3 of output o (struct krepacked's u[c]): x's eight bytes 8c .. 8c + 7
 * broadcast as one 64-bit word meet them in the same lanes, so one multiply-add of four byte
 * pairs a lane (vpdpbusd) serves four outputs (256-bit) or eight (512-bit) with no shuffle;
 * each register of W is loaded once for up to four rows of x. A group of 16 values is two
 * such steps; its sum a lane, at most 8 * 31 * 127 for q5_k (values below 32) and so within
 * 16 bits, times the group's scale with one 16-bit multiply-add (vpmaddwd against the scale
 * as [sc, 0]: the lane's top half, the sum's sign, meets the 0; with VNNI vpdpwssd, which
 * adds it too) instead of a 32-bit multiply, which costs two. q4_k's values stay below 16,
 * so the two groups of 16 that share a scale take it once (16 * 15 * 127 a lane); q6_k's
 * reach 63, and its sums take the scale after each step (4 * 63 * 127 a lane). Lanes
 * (o, 0) and (o, 1) are added once a super-block. The
 * minimums' sum takes x's group sums two at a time against the outputs' minimums (16-bit
 * pairs, _mm256_madd_epi16). Both integer sums are the plain C ones exactly, and the fp32
 * operations the same in the same order: the results are the few-row product's, bit for
 * bit.
 *
 * iq4_xs is repacked with its values plus 128 (1..241, struct unpacked's u) and minimums of
 * 128 times the scales: its sums a lane reach 8 * 241 * 127, past 16 bits, so each group's
 * takes its scale with a 32-bit multiply (the scales sign-extended); the minimums' sum is
 * taken from the scaled sum in integers, which leaves the sum over the values less 128,
 * the few-row product's, and no minimums. The byte multiply-add of AVX2 without VNNI would
 * saturate on such values: that path reads the file's bytes instead (kquants.c). */

/* The minimums' sums and the fp32 steps of a super-block, shared by both widths: s[i] (row i
 * of x: output o's scaled sum in lane o) and x's group sums against the minimums into
 * acc[i], as kquants.c's plain C product adds them. */
KQ_TARGET static inline __attribute__((always_inline)) void KQ_NAME(kfinish_sb)(
    const int kind, const struct kx *xb, long i0, long nb, long sb,
    const struct krepacked *blk, const __m256i *s, __m256 *acc, const int M)
{
    __m256i mins[4];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        mins[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int h = 0; h < GROUPS / 2; h++) {
        const __m256i mn = _mm256_loadu_si256((const __m256i *)blk->mn[h]);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const int32_t *bs = xb->bsums + ((i0 + i) * nb + sb) * GROUPS;
            const uint32_t pair = (uint16_t)bs[2 * h] | (uint32_t)bs[2 * h + 1] << 16;
            mins[i] = _mm256_add_epi32(mins[i],
                                       _mm256_madd_epi16(mn, _mm256_set1_epi32((int)pair)));
        }
    }
    const __m256 d = _mm256_loadu_ps(blk->d), dmin = _mm256_loadu_ps(blk->dmin);
#pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        const __m256 dx = _mm256_set1_ps(xb->d[(i0 + i) * nb + sb]);
        __m256i si = s[i];
        if (kind == TFORMER_IQ4_XS) { /* the values less 128, in integers */
            si = _mm256_sub_epi32(si, mins[i]);
            mins[i] = _mm256_setzero_si256();
        }
        const __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(d, dx));
        const __m256 t2 = _mm256_mul_ps(_mm256_cvtepi32_ps(mins[i]), _mm256_mul_ps(dmin, dx));
        acc[i] = _mm256_add_ps(acc[i], _mm256_sub_ps(t1, t2));
    }
}

/* Groups of 16 whose sums take their scale at once: two, a group of 32 that shares its
 * scale, where its sums a lane stay within their bound (q4_k: 16 * 15 * 127, within 16 bits
 * for the 16-bit multiply-add; iq4_xs: 16 * 241 * 127, within 32 for its 32-bit multiply);
 * q5_k's values reach 31 and take their scale every 16, q6_k's every step. */
#define KQ_GROUPS_A_SCALE(kind) ((kind) == TFORMER_Q4_K || (kind) == TFORMER_IQ4_XS ? 2 : 1)

/* x's eight bytes 8c .. 8c + 7 of row i's super-block, as one 64-bit word. */
#define KQ_EIGHT(i, c)                                                                     \
    ({                                                                                     \
        long long eight_;                                                                  \
        memcpy(&eight_, xq[i] + 8 * (c), sizeof eight_);                                   \
        eight_;                                                                            \
    })

#ifdef KQ_512
#define KQ_MAX_ROWS 4
/* Row i's (i < M, at most 4) integer sums of super-block blk, output o's in lane o of s8[i]:
 * a register of W (64 bytes: u[c]) for eight outputs. */
KQ_TARGET static inline __attribute__((always_inline)) void KQ_NAME(ksums)(
    const int kind, const uint8_t *const *xq, const struct krepacked *blk, __m256i *s8,
    const int M)
{
    __m512i s[4];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        s[i] = _mm512_setzero_si512();
    const int G = KQ_GROUPS_A_SCALE(kind);
#pragma GCC unroll 2
    for (int g = 0; g < GROUPS; g += G) {
        const __m256i sc16 = _mm256_loadu_si256((const __m256i *)blk->sc[g]);
        const __m512i sc = kind == TFORMER_IQ4_XS ? _mm512_cvtepi16_epi32(sc16)
                                                  : _mm512_cvtepu16_epi32(sc16);
        __m512i p[4];
#pragma GCC unroll 4
        for (int i = 0; i < M; i++)
            p[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int half = 0; half < 2 * G; half++) {
            const int c = 2 * g + half;
            const __m512i u = _mm512_loadu_si512((const void *)blk->u[c]);
#pragma GCC unroll 4
            for (int i = 0; i < M; i++)
                p[i] = _mm512_dpbusd_epi32(p[i], u, _mm512_set1_epi64(KQ_EIGHT(i, c)));
            if (kind == TFORMER_Q6_K) {
#pragma GCC unroll 4
                for (int i = 0; i < M; i++) {
                    s[i] = _mm512_dpwssd_epi32(s[i], p[i], sc);
                    p[i] = _mm512_setzero_si512();
                }
            }
        }
        if (kind == TFORMER_IQ4_XS) {
#pragma GCC unroll 4
            for (int i = 0; i < M; i++)
                s[i] = _mm512_add_epi32(s[i], _mm512_mullo_epi32(p[i], sc));
        } else if (kind != TFORMER_Q6_K) {
#pragma GCC unroll 4
            for (int i = 0; i < M; i++)
                s[i] = _mm512_dpwssd_epi32(s[i], p[i], sc);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++) /* lane (o, 0) + lane (o, 1), to lane o */
        s8[i] = _mm512_cvtepi64_epi32(_mm512_add_epi32(s[i], _mm512_srli_epi64(s[i], 32)));
}
#else
#define KQ_MAX_ROWS 2
#ifdef KQ_VNNI
#define KQ_SUM(acc, u, s) KQ_DPBUSD(acc, u, s)
#define KQ_SCALED(acc, p, sc) _mm256_dpwssd_avx_epi32(acc, p, sc)
#else
#define KQ_SCALED(acc, p, sc) _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc))
#define KQ_SUM(acc, u, s)                                                                  \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones))
#endif
/* Row i's (i < M, at most 2: AVX2 has 16 registers) integer sums of super-block blk,
 * output o's in lane o of s8[i]: two registers of W (u[c]'s halves) for four outputs each. */
KQ_TARGET static inline __attribute__((always_inline)) void KQ_NAME(ksums)(
    const int kind, const uint8_t *const *xq, const struct krepacked *blk, __m256i *s8,
    const int M)
{
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256i sa[2], sb[2];
#pragma GCC unroll 2
    for (int i = 0; i < M; i++)
        sa[i] = sb[i] = _mm256_setzero_si256();
    const int G = KQ_GROUPS_A_SCALE(kind);
#pragma GCC unroll 2
    for (int g = 0; g < GROUPS; g += G) {
        const __m128i sa16 = _mm_loadu_si128((const __m128i *)blk->sc[g][0]);
        const __m128i sb16 = _mm_loadu_si128((const __m128i *)blk->sc[g][4]);
        const __m256i sca = kind == TFORMER_IQ4_XS ? _mm256_cvtepi16_epi32(sa16)
                                                   : _mm256_cvtepu16_epi32(sa16);
        const __m256i scb = kind == TFORMER_IQ4_XS ? _mm256_cvtepi16_epi32(sb16)
                                                   : _mm256_cvtepu16_epi32(sb16);
        __m256i pa[2], pb[2];
#pragma GCC unroll 2
        for (int i = 0; i < M; i++)
            pa[i] = pb[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int half = 0; half < 2 * G; half++) {
            const int c = 2 * g + half;
            const __m256i ua = _mm256_loadu_si256((const __m256i *)blk->u[c][0]);
            const __m256i ub = _mm256_loadu_si256((const __m256i *)blk->u[c][4]);
#pragma GCC unroll 2
            for (int i = 0; i < M; i++) {
                const __m256i x8 = _mm256_set1_epi64x(KQ_EIGHT(i, c));
                pa[i] = KQ_SUM(pa[i], ua, x8);
                pb[i] = KQ_SUM(pb[i], ub, x8);
            }
            if (kind == TFORMER_Q6_K) {
#pragma GCC unroll 2
                for (int i = 0; i < M; i++) {
                    sa[i] = KQ_SCALED(sa[i], pa[i], sca);
                    sb[i] = KQ_SCALED(sb[i], pb[i], scb);
                    pa[i] = pb[i] = _mm256_setzero_si256();
                }
            }
        }
        if (kind == TFORMER_IQ4_XS) {
#pragma GCC unroll 2
            for (int i = 0; i < M; i++) {
                sa[i] = _mm256_add_epi32(sa[i], _mm256_mullo_epi32(pa[i], sca));
                sb[i] = _mm256_add_epi32(sb[i], _mm256_mullo_epi32(pb[i], scb));
            }
        } else if (kind != TFORMER_Q6_K) {
#pragma GCC unroll 2
            for (int i = 0; i < M; i++) {
                sa[i] = KQ_SCALED(sa[i], pa[i], sca);
                sb[i] = KQ_SCALED(sb[i], pb[i], scb);
            }
        }
    }
    /* [o0 o1 o4 o5 | o2 o3 o6 o7] from the pairs' sums, to outputs in order */
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
#pragma GCC unroll 2
    for (int i = 0; i < M; i++)
        s8[i] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(sa[i], sb[i]), order);
}
#undef KQ_SUM
#undef KQ_SCALED
#endif

/* Rows [i0, i0 + M) of x (M at most KQ_MAX_ROWS) against group gr of W's rows (8 outputs). */
KQ_TARGET static inline __attribute__((always_inline)) void KQ_NAME(kgroup)(
    const int kind, const struct kx *xb, long i0, const struct krepacked *w, const float *b,
    float *y, long n, long nb, long gr, const int M)
{
    __m256 acc[KQ_MAX_ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        acc[i] = _mm256_setzero_ps();
    const struct krepacked *blk = w + gr * nb;
    for (long sb = 0; sb < nb; sb++, blk++) {
        const uint8_t *xq[KQ_MAX_ROWS];
#pragma GCC unroll 4
        for (int i = 0; i < M; i++)
            xq[i] = (const uint8_t *)(xb->q + ((i0 + i) * nb + sb) * QK);
        __m256i s8[KQ_MAX_ROWS];
        KQ_NAME(ksums)(kind, xq, blk, s8, M);
        KQ_NAME(kfinish_sb)(kind, xb, i0, nb, sb, blk, s8, acc, M);
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

/* Each kind and number of rows its own copy of the kernel, constants folded. */
#define KQ_CALL(kind, rows)                                                                \
    {                                                                                      \
        KQ_NAME(kgroup)(kind, xb, i0, w, b, y, n, nb, gr, rows);                           \
        return;                                                                            \
    }
#ifdef KQ_512
#define KQ_ROWS(kind)                                                                      \
    switch (M) {                                                                           \
    case 1: KQ_CALL(kind, 1)                                                               \
    case 2: KQ_CALL(kind, 2)                                                               \
    case 3: KQ_CALL(kind, 3)                                                               \
    default: KQ_CALL(kind, 4)                                                              \
    }
#else
#define KQ_ROWS(kind)                                                                      \
    switch (M) {                                                                           \
    case 1: KQ_CALL(kind, 1)                                                               \
    default: KQ_CALL(kind, 2)                                                              \
    }
#endif

/* Rows [i0, i0 + M) of x against group gr of W's rows: M at most KQ_MAX_ROWS (4 with
 * KQ_512, else 2). */
KQ_TARGET static void KQ_NAME(kgroups)(int kind, const struct kx *xb, long i0, int M,
                                       const struct krepacked *w, const float *b, float *y,
                                       long n, long nb, long gr)
{
    if (kind == TFORMER_Q6_K)
        KQ_ROWS(TFORMER_Q6_K)
    if (kind == TFORMER_IQ4_XS)
        KQ_ROWS(TFORMER_IQ4_XS)
    if (kind == TFORMER_Q5_K)
        KQ_ROWS(TFORMER_Q5_K)
    KQ_ROWS(TFORMER_Q4_K)
}

#undef KQ_ROWS
#undef KQ_CALL
#undef KQ_MAX_ROWS
#undef KQ_EIGHT
#undef KQ_GROUPS_A_SCALE

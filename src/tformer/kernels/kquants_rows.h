/* The K kinds' product of few rows (decoding's) for one instruction set, straight from the
 * file's bytes. kquants.c includes this file three times, with
 *
 *   KQ_NAME(name)  the suffix of the functions' names (name##_avx2, ...)
 *   KQ_TARGET      the function target
 *   KQ_DPWSSD      defined: the scaled sums with a VNNI instruction, vpdpwssd (AVX-VNNI's,
 *                  256-bit); else AVX2's _mm256_madd_epi16 and an add
 *   KQ_512         defined: AVX-512 (BW, VNNI), 64 values a register, with vpdpwssd
 *
 * Each super-block of a tile of R rows of W is read once, for all M rows of x, and unpacked
 * in registers, never stored: the values (q4_k's nibbles; q5_k's with their fifth bits, q6_k's
 * with their top two) to bytes 0..63, the scales of their groups to 16-bit words. A chunk of
 * 32 values (64 with AVX-512) times x's bytes with _mm_maddubs_epi16 gives pairs of products
 * in 16 bits (at most 2 * 63 * 127: no saturation), which one 16-bit multiply-add by the
 * group's scale sums into 32-bit lanes: sum_g sc_g sum_{j in g} u_j q_j, exact (kquants.c's
 * text bounds it). The minimums' sum takes x's group sums in 16 bits (struct kx's s16)
 * against the minimums (q6_k: its scales, the sum times 32 after), one multiply-add.
 * iq4_xs's values are signed bytes (-127..113), looked up from their 4-bit indices with a
 * byte shuffle: the multiply takes their sizes against x's bytes given the values' signs
 * (pairs at most 2 * 127 * 127), and it has no minimums.
 *
 * Per super-block, each pair of an x row and a W row then has its two integer sums, s and
 * mins, across lanes; horizontal adds of four W rows at once give [s_0 .. s_3 | mins_0 ..
 * mins_3], and the fp32 operations are the plain C product's, lane by lane:
 * acc += (float)s * (d dx) - (float)mins * (dmin dx). Each output's result is thus the plain
 * C path's and the repacked product's bit for bit, whatever the rows of x or W it is tiled
 * with and the threads.
 */

#ifdef KQ_DPWSSD
#define KQ_WSUM(acc, p, s) KQ_DPWSSD(acc, p, s)
#else
#define KQ_WSUM(acc, p, s) _mm256_add_epi32(acc, _mm256_madd_epi16(p, s))
#endif

#define KQ_INLINE KQ_TARGET static inline __attribute__((always_inline))

/* The d and dmin of R rows' super-blocks (q6_k: d twice), as
 * [d_0 .. d_3 | dmin_0 .. dmin_3]; zeros past R. */
KQ_INLINE __m256 KQ_NAME(kd)(const int kind, const uint8_t *const *blk, const int R)
{
    uint32_t h[4] = {0, 0, 0, 0};
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        if (kind == TFORMER_Q6_K) {
            const uint32_t d = load_u16(blk[r] + 208);
            h[r] = d | d << 16;
        } else if (kind == TFORMER_IQ4_XS)
            h[r] = load_u16(blk[r]); /* dmin 0 */
        else
            memcpy(&h[r], blk[r], sizeof h[r]);
    }
    const __m256 v = _mm256_cvtph_ps(_mm_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3]));
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}

/* One row of x's super-block against R rows of W: s[r] (the scaled products, in eight
 * lanes) and m[r] (the minimums' sum, in four) -> acc (lane r: output r) as the plain C
 * product adds it. */
KQ_INLINE __m128 KQ_NAME(kfinish)(const int kind, __m128 acc, const __m256i *s, const __m128i *m,
                                  __m256 dd, float dx, const int R)
{
    __m256i v[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++) {
        if (r < R) {
            const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s[r]),
                                             _mm256_extracti128_si256(s[r], 1));
            v[r] = _mm256_set_m128i(m[r], s4);
        } else
            v[r] = _mm256_setzero_si256();
    }
    __m256i t = R > 2 ? _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),
                                          _mm256_hadd_epi32(v[2], v[3]))
                      : _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), v[2]);
    if (kind == TFORMER_Q6_K) /* the minimums are 32 times the scales */
        t = _mm256_sllv_epi32(t, _mm256_setr_epi32(0, 0, 0, 0, 5, 5, 5, 5));
    const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dd, _mm256_set1_ps(dx)));
    return _mm_add_ps(acc, _mm_sub_ps(_mm256_castps256_ps128(p), _mm256_extractf128_ps(p, 1)));
}

/* Byte c of a q4_k/q5_k register of scales (bytes 0-7 of each 128-bit lane) to every 16-bit
 * word, with _mm_shuffle_epi8 (a control byte with its top bit set gives 0). */
#define KQ_SCALE_WORDS(c)                                                                  \
    (char)(c), -128, (char)(c), -128, (char)(c), -128, (char)(c), -128, (char)(c), -128,    \
        (char)(c), -128, (char)(c), -128, (char)(c), -128

#ifndef KQ_512

/* 32 values a register. Super-block b of W's row at blk against M rows of x: s[i] (eight
 * lanes) and m[i] (four) for x row i. */
KQ_INLINE void KQ_NAME(kblock)(const int kind, const uint8_t *blk, const struct kx *xb,
                               const long *at, __m256i *s, __m128i *m, const int M)
{
    const __m256i low = _mm256_set1_epi8(15);
    __m256i acc[4];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        acc[i] = _mm256_setzero_si256();
    if (kind == TFORMER_IQ4_XS) {
        /* the values' sizes by index, in both 128-bit lanes; indices below 8 are the
         * negative values */
        const __m256i sizes = _mm256_setr_epi8(127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25,
                                               38, 53, 69, 89, 113, 127, 104, 83, 65, 49, 35,
                                               22, 10, 1, 13, 25, 38, 53, 69, 89, 113);
        const __m256i eight = _mm256_set1_epi8(8), one = _mm256_set1_epi8(1);
        int16_t sc[8];
        iq4xs_scales(blk, sc);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            /* 32 values c: the 16 bytes' low halves, then their high halves */
            const __m128i b = _mm_loadu_si128((const __m128i *)(blk + 8 + 16 * c));
            const __m256i idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low);
            const __m256i u = _mm256_shuffle_epi8(sizes, idx);
            const __m256i sign = _mm256_or_si256(_mm256_cmpgt_epi8(eight, idx), one); /* -1, 1 */
            const __m256i scw = _mm256_set1_epi16(sc[c]);
#pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(xb->q + at[i] * QK + 32 * c));
                acc[i] = KQ_WSUM(acc[i], _mm256_maddubs_epi16(u, _mm256_sign_epi8(xq, sign)), scw);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            m[i] = _mm_setzero_si128();
            s[i] = acc[i];
        }
        return;
    }
    if (kind == TFORMER_Q6_K) {
        /* 16 signed scales as words: words 2c, 2c + 1 (one 32-bit lane, broadcast) to the
         * low and high 128-bit lanes: groups 2c and 2c + 1 of chunk c */
        const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                              2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
        const __m256i top = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const int c = 4 * h + t;
                const __m256i lo = t & 1 ? b : a;
                const __m256i nib = _mm256_and_si256(t & 2 ? _mm256_srli_epi16(lo, 4) : lo, low);
                /* bits 2t, 2t + 1 of qh to bits 4, 5 (what a 16-bit shift moves across
                 * bytes falls outside the mask) */
                const __m256i hi = t == 0 ? _mm256_slli_epi16(qh, 4)
                                   : t == 1 ? _mm256_slli_epi16(qh, 2)
                                   : t == 2 ? qh
                                            : _mm256_srli_epi16(qh, 2);
                const __m256i u = _mm256_or_si256(nib, _mm256_and_si256(hi, top));
                const __m256i sc = _mm256_shuffle_epi8(
                    _mm256_permutevar8x32_epi32(words, _mm256_set1_epi32(c)), pick);
#pragma GCC unroll 4
                for (int i = 0; i < M; i++) {
                    const __m256i p = _mm256_maddubs_epi16(
                        u, _mm256_loadu_si256((const __m256i *)(xb->q + at[i] * QK + 32 * c)));
                    acc[i] = KQ_WSUM(acc[i], p, sc);
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const __m256i mm = _mm256_madd_epi16(
                words, _mm256_loadu_si256((const __m256i *)(xb->s16 + at[i] * KX_S16)));
            m[i] = _mm_add_epi32(_mm256_castsi256_si128(mm), _mm256_extracti128_si256(mm, 1));
            s[i] = acc[i];
        }
        return;
    }
    static const char scale_words[8][32] __attribute__((aligned(32))) = {
        {KQ_SCALE_WORDS(0), KQ_SCALE_WORDS(0)}, {KQ_SCALE_WORDS(1), KQ_SCALE_WORDS(1)},
        {KQ_SCALE_WORDS(2), KQ_SCALE_WORDS(2)}, {KQ_SCALE_WORDS(3), KQ_SCALE_WORDS(3)},
        {KQ_SCALE_WORDS(4), KQ_SCALE_WORDS(4)}, {KQ_SCALE_WORDS(5), KQ_SCALE_WORDS(5)},
        {KQ_SCALE_WORDS(6), KQ_SCALE_WORDS(6)}, {KQ_SCALE_WORDS(7), KQ_SCALE_WORDS(7)}};
    uint64_t sc8, mn8;
    k_scale_bytes(blk + 4, &sc8, &mn8);
    const __m256i scales = _mm256_set1_epi64x((long long)sc8);
    const uint8_t *qs = blk + (kind == TFORMER_Q4_K ? 16 : 48);
    const __m256i qh = kind == TFORMER_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                            : _mm256_setzero_si256();
    const __m256i sixteen = _mm256_set1_epi8(16);
    (void)qh, (void)sixteen;
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            const int c = 2 * j + half;
            __m256i u = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, low);
            if (kind == TFORMER_Q5_K) /* bit c of qh to bit 4 */
                u = _mm256_or_si256(u, _mm256_and_si256(c <= 4 ? _mm256_slli_epi16(qh, 4 - c)
                                                               : _mm256_srli_epi16(qh, c - 4),
                                                        sixteen));
            const __m256i sc = _mm256_shuffle_epi8(
                scales, _mm256_load_si256((const __m256i *)scale_words[c]));
#pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                const __m256i p = _mm256_maddubs_epi16(
                    u, _mm256_loadu_si256((const __m256i *)(xb->q + at[i] * QK + 32 * c)));
                acc[i] = KQ_WSUM(acc[i], p, sc);
            }
        }
    }
    const __m128i mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8));
#pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        m[i] = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)(xb->s16 + at[i] * KX_S16
                                                                      + GROUPS)));
        s[i] = acc[i];
    }
}

#else /* KQ_512 */

/* 64 values a register: as above, the lanes folded to eight at the end. */
KQ_INLINE void KQ_NAME(kblock)(const int kind, const uint8_t *blk, const struct kx *xb,
                               const long *at, __m256i *s, __m128i *m, const int M)
{
    const __m512i low = _mm512_set1_epi8(15);
    __m512i acc[4];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        acc[i] = _mm512_setzero_si512();
    if (kind == TFORMER_IQ4_XS) {
        const __m512i sizes = _mm512_broadcast_i32x4(_mm_setr_epi8(
            127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89, 113));
        const __m512i eight = _mm512_set1_epi8(8), zero = _mm512_setzero_si512();
        int16_t sc[8];
        iq4xs_scales(blk, sc);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            /* qs's 32 bytes c (bytes A, B: 16 each) as [A, A, B, B] in 128-bit lanes, the
             * second of each pair shifted: values 64c .. 64c + 63 in order */
            const __m512i v = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(blk + 8 + 32 * c)));
            const __m512i pairs = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(1, 1, 0, 0));
            const __m512i idx = _mm512_and_si512(
                _mm512_mask_srli_epi16(pairs, 0xff00ff00u, pairs, 4), low);
            const __m512i u = _mm512_shuffle_epi8(sizes, idx);
            const __mmask64 negative = _mm512_cmplt_epu8_mask(idx, eight);
            const __m512i scw = _mm512_inserti64x4(_mm512_set1_epi16(sc[2 * c]),
                                                   _mm256_set1_epi16(sc[2 * c + 1]), 1);
#pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                const __m512i xq = _mm512_loadu_si512((const void *)(xb->q + at[i] * QK + 64 * c));
                const __m512i signed_x = _mm512_mask_sub_epi8(xq, negative, zero, xq);
                acc[i] = _mm512_dpwssd_epi32(acc[i], _mm512_maddubs_epi16(u, signed_x), scw);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            m[i] = _mm_setzero_si128();
            s[i] = _mm256_add_epi32(_mm512_castsi512_si256(acc[i]),
                                    _mm512_extracti64x4_epi64(acc[i], 1));
        }
        return;
    }
    if (kind == TFORMER_Q6_K) {
        /* word w of chunk c's scales: group 4c + w / 8's */
        static const int16_t pick[4][32] __attribute__((aligned(64))) = {
            {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
            {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5,
             6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
            {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9,
             10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
            {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13,
             14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
        const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m512i wide = _mm512_castsi256_si512(words);
        const __m512i top = _mm512_set1_epi8(0x30);
        /* qh broadcast to both halves: bits 0, 1 (low half) and 2, 3 (high) to bits 4, 5
         * for values 0-63 of a half; bits 4, 5 and 6, 7 for values 64-127 */
        const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(
                _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
#pragma GCC unroll 2
            for (int t = 0; t < 2; t++) {
                const int c = 2 * h + t;
                const __m512i nib = _mm512_and_si512(t ? _mm512_srli_epi16(ql, 4) : ql, low);
                const __m512i hi = t ? _mm512_srlv_epi16(qh, down) : _mm512_sllv_epi16(qh, up);
                const __m512i u = _mm512_or_si512(nib, _mm512_and_si512(hi, top));
                const __m512i sc = _mm512_permutexvar_epi16(
                    _mm512_load_si512((const void *)pick[c]), wide);
#pragma GCC unroll 4
                for (int i = 0; i < M; i++) {
                    const __m512i p = _mm512_maddubs_epi16(
                        u, _mm512_loadu_si512((const void *)(xb->q + at[i] * QK + 64 * c)));
                    acc[i] = _mm512_dpwssd_epi32(acc[i], p, sc);
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const __m256i mm = _mm256_madd_epi16(
                words, _mm256_loadu_si256((const __m256i *)(xb->s16 + at[i] * KX_S16)));
            m[i] = _mm_add_epi32(_mm256_castsi256_si128(mm), _mm256_extracti128_si256(mm, 1));
            s[i] = _mm256_add_epi32(_mm512_castsi512_si256(acc[i]),
                                    _mm512_extracti64x4_epi64(acc[i], 1));
        }
        return;
    }
    /* chunk c (values 64c .. 64c + 63: groups of 32 2c, 2c + 1): scale 2c in the low 256
     * bits, 2c + 1 in the high */
    static const char scale_words[4][64] __attribute__((aligned(64))) = {
        {KQ_SCALE_WORDS(0), KQ_SCALE_WORDS(0), KQ_SCALE_WORDS(1), KQ_SCALE_WORDS(1)},
        {KQ_SCALE_WORDS(2), KQ_SCALE_WORDS(2), KQ_SCALE_WORDS(3), KQ_SCALE_WORDS(3)},
        {KQ_SCALE_WORDS(4), KQ_SCALE_WORDS(4), KQ_SCALE_WORDS(5), KQ_SCALE_WORDS(5)},
        {KQ_SCALE_WORDS(6), KQ_SCALE_WORDS(6), KQ_SCALE_WORDS(7), KQ_SCALE_WORDS(7)}};
    uint64_t sc8, mn8;
    k_scale_bytes(blk + 4, &sc8, &mn8);
    const __m512i scales = _mm512_set1_epi64((long long)sc8);
    const uint8_t *qs = blk + (kind == TFORMER_Q4_K ? 16 : 48);
    const __m512i qh = kind == TFORMER_Q5_K
        ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)))
        : _mm512_setzero_si512();
    const __m512i sixteen = _mm512_set1_epi8(16);
    (void)qh, (void)sixteen;
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        /* qs's 32 bytes c: values 64c .. 64c + 31 in their low halves, the next 32 in
         * their high; both halves of the register hold them, the high one shifted */
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
        __m512i u = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xffff0000u, v, 4), low);
        if (kind == TFORMER_Q5_K) { /* value 32i + l: bit i of qh[l], i = 2c or 2c + 1 */
            const __m512i bit = _mm512_inserti64x4(
                _mm512_set1_epi8((char)(1 << (2 * c))), _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
            u = _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(qh, bit), u, sixteen);
        }
        const __m512i sc = _mm512_shuffle_epi8(scales,
                                               _mm512_load_si512((const void *)scale_words[c]));
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const __m512i p = _mm512_maddubs_epi16(
                u, _mm512_loadu_si512((const void *)(xb->q + at[i] * QK + 64 * c)));
            acc[i] = _mm512_dpwssd_epi32(acc[i], p, sc);
        }
    }
    const __m128i mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8));
#pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        m[i] = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)(xb->s16 + at[i] * KX_S16
                                                                      + GROUPS)));
        s[i] = _mm256_add_epi32(_mm512_castsi512_si256(acc[i]),
                                _mm512_extracti64x4_epi64(acc[i], 1));
    }
}

#endif /* KQ_512 */

/* Rows [i0, i0 + M) of x (M at most 4) against W's rows [r0, r0 + R) (R at most 8: two
 * groups of four for the sums across lanes). */
KQ_INLINE void KQ_NAME(ktile)(const int kind, const struct kx *xb, long i0, const uint8_t *w,
                              const float *b, float *y, long n, long nb, long r0, const int M,
                              const int R)
{
    const long size = kq_size(kind), row = nb * size;
    const int G = (R + 3) / 4;
    __m128 acc[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        acc[i][0] = acc[i][1] = _mm_setzero_ps();
    /* W's rows are short streams (1,152 bytes at k = 2048 in q4_k) that the hardware
     * prefetcher picks up late: fetch the rows KQ_AHEAD tiles on, contiguous, at the pace
     * this tile's are read (R super-blocks a step). */
    const uint8_t *next = w + (r0 + KQ_AHEAD * R) * row;
    for (long sb = 0; sb < nb; sb++) {
#pragma GCC unroll 32
        for (long line = 0; line < (R * size + 63) / 64; line++)
            _mm_prefetch((const char *)(next + sb * R * size + 64 * line), KQ_HINT);
        const uint8_t *blk[8];
        long at[4];
        __m256i s[4][8];
        __m128i m[4][8];
#pragma GCC unroll 4
        for (int i = 0; i < M; i++)
            at[i] = (i0 + i) * nb + sb;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            blk[r] = w + (r0 + r) * row + sb * size;
            __m256i sr[4];
            __m128i mr[4];
            KQ_NAME(kblock)(kind, blk[r], xb, at, sr, mr, M);
#pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                s[i][r] = sr[i];
                m[i][r] = mr[i];
            }
        }
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) {
            const int RG = R - 4 * g < 4 ? R - 4 * g : 4;
            const __m256 dd = KQ_NAME(kd)(kind, blk + 4 * g, RG);
#pragma GCC unroll 4
            for (int i = 0; i < M; i++)
                acc[i][g] = KQ_NAME(kfinish)(kind, acc[i][g], s[i] + 4 * g, m[i] + 4 * g, dd,
                                             xb->d[at[i]], RG);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        float out[8];
        _mm_storeu_ps(out, acc[i][0]);
        _mm_storeu_ps(out + 4, acc[i][1]);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            y[(i0 + i) * n + r0 + r] = b ? out[r] + b[r0 + r] : out[r];
    }
}

/* Rows [i0, i0 + M) of x (M at most 4) times W's rows [r0, r1). */
KQ_TARGET static void KQ_NAME(krows)(int kind, const struct kx *xb, long i0, int M,
                                     const uint8_t *w, const float *b, float *y, long n, long nb,
                                     long r0, long r1)
{
#define KQ_STEP(KIND, MM, R)                                                               \
    {                                                                                      \
        long r = r0;                                                                       \
        for (; r + R <= r1; r += R)                                                        \
            KQ_NAME(ktile)(KIND, xb, i0, w, b, y, n, nb, r, MM, R);                        \
        for (; r < r1; r++)                                                                \
            KQ_NAME(ktile)(KIND, xb, i0, w, b, y, n, nb, r, MM, 1);                        \
        return;                                                                            \
    }
#define KQ_ROWS(KIND)                                                                      \
    switch (M) {                                                                           \
    case 1: KQ_STEP(KIND, 1, KQ_R1)                                                        \
    case 2: KQ_STEP(KIND, 2, KQ_R2)                                                        \
    case 3: KQ_STEP(KIND, 3, KQ_R3)                                                        \
    default: KQ_STEP(KIND, 4, KQ_R4)                                                       \
    }
    switch (kind) {
    case TFORMER_Q4_K: KQ_ROWS(TFORMER_Q4_K)
    case TFORMER_Q5_K: KQ_ROWS(TFORMER_Q5_K)
    case TFORMER_IQ4_XS: KQ_ROWS(TFORMER_IQ4_XS)
    default: KQ_ROWS(TFORMER_Q6_K)
    }
#undef KQ_ROWS
#undef KQ_STEP
}

#undef KQ_SCALE_WORDS
#undef KQ_INLINE
#undef KQ_WSUM

/* The block products for one instruction set. blocks.c includes this file three times,
 * with
 *
 *   BLK_NAME(name)  the suffix of the functions' names (name##_avx2, ...)
 *   BLK_TARGET      the function target
 *   BLK_DOT         defined: sums of four byte products with a VNNI instruction (BLK_DPBUSD,
 *                   AVX-VNNI's or AVX-512 VNNI's); else with AVX2's byte multiply-add
 *   BLK_BYTE_MASKS  defined: AVX-512 BW's byte masks set the 5-bit kinds' fifth bits
 *
 * A block's 32 products are summed exactly, into eight 32-bit lanes, from unsigned bytes
 * u (the weights' nibbles, or |w| for q8_0) and signed bytes s (x's, with w's sign moved
 * onto them for q8_0):
 * - AVX2: _mm256_maddubs_epi16 multiplies 32 pairs and adds neighbours into 16-bit sums,
 *   which saturate past 32767: a pair is at most 2 * 128 * 127 = 32512 (q8_0's |w| may be
 *   128 where a file holds -128; x's bytes are at most 127 in size), so none does.
 *   _mm256_madd_epi16 against ones adds those pairs into eight 32-bit sums.
 * - VNNI: one vpdpbusd adds four products into each 32-bit sum.
 * q4_0's nibbles are q + 8 (q5_0's 5-bit values q + 16): each lane starts from -8 (-16)
 * times the sum of its four x's (lane8, doubled for q5_0), so it holds its four products'
 * sum(q x) exactly, no larger than they are (an offset
 * spread over the lanes unevenly would grow the fp32 sums' rounding). The lanes go to fp32 (exact: at most
 * 4 * 128 * 127 in size) and into the row's fp32 sums with the block's scale d_w d_x, each
 * lane in the same order whatever the number of rows, so a row's result does not depend on
 * the rows it is batched with.
 */

#ifdef BLK_DOT
#define BLK_SUM(acc, u, s) BLK_DPBUSD(acc, u, s)
#else
#define BLK_SUM(acc, u, s)                                                                 \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones))
#endif

/* Outputs [r0, r0 + R) of M rows of x, as blocks (qx, dx, isum, sx: struct xblocks). */
BLK_TARGET static inline __attribute__((always_inline)) void BLK_NAME(tile)(
    const int kind, const struct xblocks *xb, long i0, const uint8_t *w, const float *b,
    float *y, long n, long nb, long r0, const int M, const int R)
{
    const long size = block_bytes(kind), row = nb * size;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    /* The 5-bit kinds' qh to bytes: byte j takes qh's byte j / 8 (shuffle), and is 16 where
     * its bit j % 8 is set (the mask's byte j has that bit alone). */
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                              0x0303030303030303);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i sixteen = _mm256_set1_epi8(16);
    (void)ones, (void)spread, (void)bit, (void)sixteen;
    __m256 acc[4][4];
    float off[4][4]; /* q4_1, q5_1: sum over blocks of m_w * d_x * sum(x) */
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[i][r] = _mm256_setzero_ps();
            off[i][r] = 0.0f;
        }
    const uint8_t *next = w + (r0 + BLK_PREFETCH_AHEAD * R) * row;
    for (long q = 0; q < nb; q++) {
        _mm_prefetch((const char *)(next + q * size * R), _MM_HINT_T0);
        if (R > 2)
            _mm_prefetch((const char *)(next + q * size * R + 64), _MM_HINT_T0);
        __m256i u[4], sgn[4];
        float dw[4], mw[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + (r0 + r) * row + q * size;
            dw[r] = _cvtsh_ss(load_u16(blk));
            if (kind == KIND_Q8_0) {
                sgn[r] = _mm256_loadu_si256((const __m256i *)(blk + 2));
                u[r] = _mm256_sign_epi8(sgn[r], sgn[r]);
            } else {
                const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + size - 16));
                u[r] = _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low);
                if (five_bits(kind)) {
#ifdef BLK_BYTE_MASKS
                    /* qh is a byte mask already: value j's fifth bit is its bit j */
                    u[r] = _mm256_mask_add_epi8(u[r], (__mmask32)load_u32(blk + size - 20), u[r],
                                                sixteen);
#else
                    const __m256i h = _mm256_shuffle_epi8(
                        _mm256_set1_epi32((int)load_u32(blk + size - 20)), spread);
                    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
                    u[r] = _mm256_or_si256(u[r], _mm256_and_si256(set, sixteen));
#endif
                }
                mw[r] = has_min(kind) ? _cvtsh_ss(load_u16(blk + 2)) : 0.0f;
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const long at = (i0 + i) * nb + q;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xb->qx + at * BLOCK));
            const float dx = xb->dx[at];
            const __m256i lane8 = offset_of(kind)
                ? _mm256_loadu_si256((const __m256i *)(xb->lane8 + 8 * at))
                : _mm256_setzero_si256();
            const __m256i start = kind == KIND_Q5_0 ? _mm256_slli_epi32(lane8, 1) : lane8;
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i s = kind == KIND_Q8_0 ? _mm256_sign_epi8(xv, sgn[r]) : xv;
                const __m256i sum = BLK_SUM(start, u[r], s);
                acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(dw[r] * dx),
                                            acc[i][r]);
                if (has_min(kind))
                    off[i][r] += mw[r] * xb->sx[at];
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float v = sum_lanes(acc[i][r]) + off[i][r];
            y[(i0 + i) * n + r0 + r] = b ? v + b[r0 + r] : v;
        }
}

/* Rows [i0, i0 + M) of x (M at most 4) times W's rows [r0, r1). */
BLK_TARGET static void BLK_NAME(rows)(int kind, const struct xblocks *xb, long i0, int M,
                                      const uint8_t *w, const float *b, float *y, long n,
                                      long nb, long r0, long r1)
{
#define BLK_STEP(KIND, MM, R)                                                              \
    {                                                                                      \
        long r = r0;                                                                       \
        for (; r + R <= r1; r += R)                                                        \
            BLK_NAME(tile)(KIND, xb, i0, w, b, y, n, nb, r, MM, R);                        \
        for (; r < r1; r++)                                                                \
            BLK_NAME(tile)(KIND, xb, i0, w, b, y, n, nb, r, MM, 1);                        \
        return;                                                                            \
    }
#define BLK_ROWS(KIND)                                                                     \
    switch (M) {                                                                           \
    case 1: BLK_STEP(KIND, 1, 4)                                                           \
    case 2: BLK_STEP(KIND, 2, 4)                                                           \
    case 3: BLK_STEP(KIND, 3, 3)                                                           \
    default: BLK_STEP(KIND, 4, 2)                                                          \
    }
    switch (kind) {
    case KIND_Q8_0: BLK_ROWS(KIND_Q8_0)
    case KIND_Q4_0: BLK_ROWS(KIND_Q4_0)
    case KIND_Q4_1: BLK_ROWS(KIND_Q4_1)
    case KIND_Q5_0: BLK_ROWS(KIND_Q5_0)
    default: BLK_ROWS(KIND_Q5_1)
    }
#undef BLK_ROWS
#undef BLK_STEP
}

/* The product over repacked weights (blocks.c's struct repacked: eight rows of W side by
 * side, a block's values one byte each): rows [i0, i0 + M) of x against the eight outputs
 * of one group. A register of W holds four outputs' values four to a 32-bit lane, lane
 * (o, h) values 8c + 4h .. 8c + 4h + 3 of output o, which x's eight bytes 8c .. 8c + 7,
 * broadcast as one 64-bit word, meet in the same lane: multiply-adds of four byte pairs a
 * lane (vpdpbusd, or AVX2's byte multiply-adds) sum each output's block exactly in its lanes
 * (o, 0) and (o, 1), the first starting from -offset * sum(q_x) (q8_0 on VNNI: from start,
 * x taken + 128), and each register of W serves up to four rows of x (BLK_512, whose 32
 * registers hold them; else two). (512-bit registers, eight outputs each, ran no faster
 * here: a block's 32 values are four of them, and the fp32 steps below, one a block, weigh
 * as much.) The pair of lanes added, as the plain C product: acc += (fp32) s * (d_w * d_x),
 * off += m_w * (d_x sum(q_x)), each a rounding of its own (the build does not fuse), and
 * acc + off (+ b) at the end, so the results are the plain C product's, bit for bit. */
BLK_TARGET static inline __attribute__((always_inline)) void BLK_NAME(group)(
    const int kind, const struct xblocks *xb, long i0, const struct repacked *w,
    const float *b, float *y, long n, long nb, long g, const int M)
{
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256 acc[4], off[4];
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
        acc[i] = off[i] = _mm256_setzero_ps();
    const struct repacked *blk = w + g * nb;
    for (long q = 0; q < nb; q++, blk++) {
        const uint8_t *xq[4];
        long at[4];
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            at[i] = (i0 + i) * nb + q;
            xq[i] = (const uint8_t *)(xb->qx + at[i] * BLOCK);
        }
        __m256i s8[4];
        __m256i sa[4], sb[4];
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            sa[i] = sb[i] = _mm256_set1_epi64x((uint32_t)(-offset_of(kind) * xb->isum[at[i]]));
#ifdef BLK_DOT
            if (kind == KIND_Q8_0) {
                sa[i] = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)blk->start));
                sb[i] = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(blk->start + 4)));
            }
#endif
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m256i va = _mm256_loadu_si256((const __m256i *)blk->u[c][0]);
            const __m256i vb = _mm256_loadu_si256((const __m256i *)blk->u[c][4]);
#pragma GCC unroll 4
            for (int i = 0; i < M; i++) {
                long long eight;
                memcpy(&eight, xq[i] + 8 * c, sizeof eight);
                const __m256i xs = _mm256_set1_epi64x(eight);
#ifdef BLK_DOT
                if (kind == KIND_Q8_0) {
                    const __m256i xu = _mm256_xor_si256(xs, _mm256_set1_epi8(-128));
                    sa[i] = BLK_SUM(sa[i], xu, va);
                    sb[i] = BLK_SUM(sb[i], xu, vb);
                    continue;
                }
#else
                if (kind == KIND_Q8_0) { /* signed weights: |w| times x with w's sign */
                    sa[i] = BLK_SUM(sa[i], _mm256_sign_epi8(va, va), _mm256_sign_epi8(xs, va));
                    sb[i] = BLK_SUM(sb[i], _mm256_sign_epi8(vb, vb), _mm256_sign_epi8(xs, vb));
                    continue;
                }
#endif
                sa[i] = BLK_SUM(sa[i], va, xs);
                sb[i] = BLK_SUM(sb[i], vb, xs);
            }
        }
        /* [o0 o1 o4 o5 | o2 o3 o6 o7] from the pairs' sums, to outputs in order */
        const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++)
            s8[i] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(sa[i], sb[i]), order);
        const __m256 dw = _mm256_loadu_ps(blk->d);
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xb->dx[at[i]]));
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(s8[i]), scale));
            if (has_min(kind))
                off[i] = _mm256_add_ps(
                    off[i], _mm256_mul_ps(_mm256_loadu_ps(blk->m), _mm256_set1_ps(xb->sx[at[i]])));
        }
    }
    const long valid = n - g * 8 < 8 ? n - g * 8 : 8;
    float bias[8] = {0};
    if (b)
        memcpy(bias, b + g * 8, (size_t)valid * sizeof(float));
#pragma GCC unroll 4
    for (int i = 0; i < M; i++) {
        __m256 v = _mm256_add_ps(acc[i], off[i]);
        if (b)
            v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
        float out[8];
        _mm256_storeu_ps(out, v);
        memcpy(y + (i0 + i) * n + g * 8, out, (size_t)valid * sizeof(float));
    }
}

/* Rows [i0, i0 + M) of x (M at most 4 with BLK_512, else 2) times groups [g0, g1) of
 * repacked W. */
BLK_TARGET static void BLK_NAME(groups)(int kind, const struct xblocks *xb, long i0, int M,
                                        const struct repacked *w, const float *b, float *y,
                                        long n, long nb, long g0, long g1)
{
#define BLK_GROUPS(KIND, MM)                                                               \
    {                                                                                      \
        for (long g = g0; g < g1; g++)                                                     \
            BLK_NAME(group)(KIND, xb, i0, w, b, y, n, nb, g, MM);                          \
        return;                                                                            \
    }
#ifdef BLK_512
#define BLK_KIND(KIND)                                                                     \
    switch (M) {                                                                           \
    case 1: BLK_GROUPS(KIND, 1)                                                            \
    case 2: BLK_GROUPS(KIND, 2)                                                            \
    case 3: BLK_GROUPS(KIND, 3)                                                            \
    default: BLK_GROUPS(KIND, 4)                                                           \
    }
#else
#define BLK_KIND(KIND)                                                                     \
    switch (M) {                                                                           \
    case 1: BLK_GROUPS(KIND, 1)                                                            \
    default: BLK_GROUPS(KIND, 2)                                                           \
    }
#endif
    switch (kind) {
    case KIND_Q8_0: BLK_KIND(KIND_Q8_0)
    case KIND_Q4_0: BLK_KIND(KIND_Q4_0)
    case KIND_Q4_1: BLK_KIND(KIND_Q4_1)
    case KIND_Q5_0: BLK_KIND(KIND_Q5_0)
    default: BLK_KIND(KIND_Q5_1)
    }
#undef BLK_KIND
#undef BLK_GROUPS
}

#undef BLK_SUM

/* Products with weights held as llama.cpp's K super-blocks (kquants.py): y = x W^T + b, W
 * (n x k) as rows of q4_k, q5_k, q6_k or iq4_xs super-blocks of 256 values, x (m x k) fp32.
 *
 * x is rounded once per call to Q8_K: one fp32 scale per 256 values (d = max|x| / 127,
 * q = roundf(x / d), as blocks.c rounds its 32-value blocks) and the integer sum of each 16
 * of its q (bsums). Every K format's weight is, per group of 16 values g,
 *
 *     w_j = d sc_g u_j - dmin mn_g          (u_j unsigned, 0..63; sc_g, mn_g integers)
 *
 * q4_k and q5_k with the 6-bit scale and minimum of the 32 values g is in; q6_k, whose
 * values are u - 32 with a signed 8-bit scale, with dmin = d and mn_g = 32 sc_g. iq4_xs
 * holds signed values, w_j = d sc_g v_j with v_j one of 16 bytes (IQ4_VALUES, -127..113)
 * and sc_g a 6-bit scale less 32 per 32 values: it is the same sum with u_j = v_j (kept
 * as v_j + 128 in a byte, struct unpacked's offset) and no minimums (dmin = 0). So a
 * super-block's product with x's is
 *
 *     dx (d sum_g sc_g sum_{j in g} u_j q_j  -  dmin sum_g mn_g bsum_g)
 *
 * two integer sums, exact (at most 16 groups of 16 * 63 * 127 times a scale of 128, some
 * 2.6e8, within int32), then scaled: the minimums come out of x's sums, as ggml's
 * vec_dot_q4_K_q8_K takes them; per super-block, acc += (float)s (d dx) - (float)mins
 * (dmin dx), in fp32, in that order, on every path.
 *
 * Decoding's few rows (below l->packed_min_rows, or any number where W has no repacked
 * copy) read the file's bytes: on the SIMD paths (kquants_rows.h, chosen by
 * tformer_blocks_isa) each super-block of a tile of W's rows is unpacked in registers for
 * up to four rows of x at a time, the scales applied with 16-bit multiply-adds; the plain C
 * path unpacks each to a struct unpacked (u, sc, mn, d, dmin) and sums it, the reference
 * the others equal bit for bit. Threads (OpenMP) take tiles of W's rows; x's rows pass in
 * chunks of 64. Products of many rows read W unpacked once and for all instead, eight rows
 * side by side (struct krepacked, kquants_isa.h), with the same sums and fp32 operations.
 *
 * The file ends with the quantizers (tformer_quantize_k, kinds.c's row for each K kind).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tformer.h"
#include "vecmath.h"

#define QK 256       /* values in a super-block */
#define GROUPS 16    /* groups of 16 values in a super-block, each with its scale */
#define X_CHUNK 64   /* rows of x that pass through W's rows at a time */
#define KQ_TILE 16   /* rows of W a thread takes at a time in the few-row product */
#ifndef KQ_AHEAD
#define KQ_AHEAD 2   /* tiles of rows ahead the few-row product fetches W */
#endif
#ifndef KQ_R1 /* rows of W a tile of the few-row product takes, for 1 to 4 rows of x */
#define KQ_R1 4
#define KQ_R2 4
#define KQ_R3 2
#define KQ_R4 2
#endif
#ifndef KQ_HINT
#define KQ_HINT _MM_HINT_T1
#endif

/* x as Q8_K: q (m x k int8), per super-block (m x nb) its scale d, and per group of 16 the
 * integer sum of its q (m x nb x 16); the few-row products' copy of the sums in 16 bits
 * (at most 16 * 127 in size), per super-block the 16 groups' and then the eight pairs'
 * (KX_S16 words). */
#define KX_S16 24
struct kx {
    int8_t *q;
    float *d;
    int32_t *bsums;
    int16_t *s16;
};

/* A super-block of W unpacked (see the file's text): value j is u[j] - offset (iq4_xs:
 * offset 128; the K kinds 0). */
struct unpacked {
    uint8_t u[QK];
    int32_t sc[GROUPS], mn[GROUPS];
    float d, dmin;
    int32_t offset;
};

/* iq4_xs's 16 values (llama.cpp's kvalues_iq4nl), in order: a 4-bit index picks one. */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

/* W repacked for products of many rows (tformer_kquants_repack): W's rows eight at a time
 * (a group; the last one filled out with zero rows), and for each super-block of the group
 * the eight rows' unpackings side by side: d and dmin in fp32; each group of 16's scale in
 * 16 bits, twice (sc[g][o][h]: the two halves of a 32-bit lane's pair, below); the minimums
 * (mn[g / 2][o][g % 2], 16-bit pairs); and the values a byte each, eight of an output at a
 * time in two fours: u[c][o][h] holds values 8c + 4h .. 8c + 4h + 3 of output o, so that a
 * register of W holds four (256-bit) or eight (512-bit) outputs' two fours side by side,
 * each of its 32-bit lanes (o, h) the four values that x's eight bytes 8c .. 8c + 7,
 * broadcast, meet in the same lane (kquants_isa.h says why). 2,880 bytes for eight rows'
 * super-blocks, 360 a row where the file's q4_k takes 144, q6_k 210. */
struct krepacked {
    float d[8], dmin[8];
    int16_t sc[GROUPS][8][2];
    int16_t mn[GROUPS / 2][8][2];
    uint8_t u[QK / 8][8][2][4];
};

static inline uint16_t load_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IEEE half to float in plain C, so the plain C path needs no F16C. */
static float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man) {
        const float v = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &v, sizeof bits);
        bits |= sign;
    } else
        bits = sign;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* --- The formats: scales and values out of a super-block --------------------------------- */

/* q4_k and q5_k: d, dmin (fp16), then 12 bytes holding eight 6-bit scales and eight 6-bit
 * minimums, one each per 32 values: bytes 0-3 hold scales 0-3 in their low six bits, bytes
 * 4-7 minimums 0-3; scales and minimums 4-7 have their low four bits in bytes 8-11 (the
 * scale's in the low half, the minimum's in the high) and their top two bits in the top two
 * bits of bytes 0-3 (scales) and 4-7 (minimums). */
static void k_scales(const uint8_t *blk, struct unpacked *p)
{
    const uint8_t *s = blk + 4;
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        if (j < 4) {
            sc = s[j] & 63;
            mn = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
            mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        p->sc[2 * j] = p->sc[2 * j + 1] = sc;
        p->mn[2 * j] = p->mn[2 * j + 1] = mn;
    }
    p->d = half_to_float(load_u16(blk));
    p->dmin = half_to_float(load_u16(blk + 2));
    p->offset = 0;
}

/* The same eight scales and minimums as bytes (scale j, minimum j in byte j of sc, mn), a
 * word of four at a time: the low six bits of bytes 0-3 and 4-7, and for 4-7 bytes 8-11's
 * halves with bytes 0-3's and 4-7's top two bits as bits 4 and 5 (shifted right by two,
 * masked: what the shift brings in from the next byte falls outside the mask). */
static inline void k_scale_bytes(const uint8_t *s, uint64_t *sc, uint64_t *mn)
{
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, top = 0x30303030u;
    *sc = (a & six) | (uint64_t)((c & four) | ((a >> 2) & top)) << 32;
    *mn = (b & six) | (uint64_t)(((c >> 4) & four) | ((b >> 2) & top)) << 32;
}

/* q6_k: ql (128 bytes), qh (64), 16 int8 scales, d (fp16) at byte 208. */
static void q6k_scales(const uint8_t *blk, struct unpacked *p)
{
    for (int g = 0; g < GROUPS; g++) {
        p->sc[g] = (int8_t)blk[192 + g];
        p->mn[g] = 32 * p->sc[g];
    }
    p->d = p->dmin = half_to_float(load_u16(blk + 208));
    p->offset = 0;
}

/* iq4_xs: d (fp16), then the top two bits of the eight scales (a 16-bit word, scale j's at
 * bits 2j, 2j + 1), their low four bits (four bytes, scale j's in the low half of byte
 * j / 2 for even j, the high half for odd), and qs[128]: 16 bytes per 32 values, values
 * 0-15 in their low halves, 16-31 in their high. Each scale is stored plus 32. */
static inline void iq4xs_scales(const uint8_t *blk, int16_t *sc)
{
    const unsigned top = load_u16(blk + 2);
    for (int j = 0; j < 8; j++)
        sc[j] = (int16_t)((((blk[4 + j / 2] >> 4 * (j % 2)) & 15) | ((top >> 2 * j & 3) << 4))
                          - 32);
}

static void iq4xs_unpack_c(const uint8_t *blk, struct unpacked *p)
{
    int16_t sc[8];
    iq4xs_scales(blk, sc);
    for (int g = 0; g < GROUPS; g++) {
        p->sc[g] = sc[g / 2];
        p->mn[g] = 0;
    }
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 16; l++) {
            const uint8_t b = blk[8 + 16 * j + l];
            p->u[32 * j + l] = (uint8_t)(IQ4_VALUES[b & 15] + 128);
            p->u[32 * j + 16 + l] = (uint8_t)(IQ4_VALUES[b >> 4] + 128);
        }
    p->d = half_to_float(load_u16(blk));
    p->dmin = 0.0f;
    p->offset = 128;
}

/* q4_k's 128 bytes qs from byte 16: each 64 values j are 32 bytes, values 64j .. 64j + 31
 * in their low halves, 64j + 32 .. 64j + 63 in their high halves. */
static void q4k_unpack_c(const uint8_t *blk, struct unpacked *p)
{
    k_scales(blk, p);
    const uint8_t *qs = blk + 16;
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            p->u[64 * j + l] = qs[32 * j + l] & 15;
            p->u[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
}

/* q5_k: q4_k's layout with 32 bytes qh (from byte 16, qs from 48): value 32i + l takes its
 * fifth bit from bit i of qh[l]. */
static void q5k_unpack_c(const uint8_t *blk, struct unpacked *p)
{
    k_scales(blk, p);
    const uint8_t *qh = blk + 16, *qs = blk + 48;
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            p->u[64 * j + l] = (qs[32 * j + l] & 15) | ((qh[l] >> (2 * j) & 1) << 4);
            p->u[64 * j + 32 + l] = (qs[32 * j + l] >> 4) | ((qh[l] >> (2 * j + 1) & 1) << 4);
        }
}

/* q6_k: each half h of 128 values has 64 bytes ql and 32 bytes qh; value 128h + 32s + l has
 * its low four bits from ql[64h + l + 32 (s & 1)] (the low half for s < 2, else the high)
 * and its top two from bits 2s, 2s + 1 of qh[32h + l]. */
static void q6k_unpack_c(const uint8_t *blk, struct unpacked *p)
{
    q6k_scales(blk, p);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                const uint8_t low = ql[l + 32 * (s & 1)];
                p->u[128 * h + 32 * s + l] =
                    (uint8_t)(((s < 2 ? low : low >> 4) & 15) | ((qh[l] >> (2 * s) & 3) << 4));
            }
    }
}

#define KQ_AVX2 __attribute__((target("avx2,fma,f16c")))

typedef void (*unpack_fn)(const uint8_t *blk, struct unpacked *p);
typedef void (*kquantize_fn)(const float *x, uint8_t *blk);
static void quantize_q4k(const float *x, uint8_t *blk);
static void quantize_q5k(const float *x, uint8_t *blk);
static void quantize_q6k(const float *x, uint8_t *blk);
static void quantize_iq4xs(const float *x, uint8_t *blk);

/* Each kind of this file's super-block size, plain C unpacking and quantizer, by kind (size
 * 0: not a kind of this file). */
static const struct {
    long size;
    unpack_fn unpack_c;
    kquantize_fn quantize;
} formats[TFORMER_KINDS] = {
    [TFORMER_Q4_K] = {144, q4k_unpack_c, quantize_q4k},
    [TFORMER_Q5_K] = {176, q5k_unpack_c, quantize_q5k},
    [TFORMER_Q6_K] = {210, q6k_unpack_c, quantize_q6k},
    [TFORMER_IQ4_XS] = {136, iq4xs_unpack_c, quantize_iq4xs},
};

static inline int is_kind_of_this_file(int kind)
{
    return kind >= 0 && kind < TFORMER_KINDS && formats[kind].size > 0;
}

/* The kind's super-block size, a constant the compiler folds into each kind's product. */
static inline long kq_size(int kind)
{
    return kind == TFORMER_Q4_K     ? 144
           : kind == TFORMER_Q5_K   ? 176
           : kind == TFORMER_IQ4_XS ? 136
                                    : 210;
}

/* The plain C path's integer sum: sum_g sc_g sum_{j in g} (u_j - offset) q_j. */
static int32_t dot_c(const uint8_t *u, const int8_t *q, const int32_t *sc, int32_t offset)
{
    int32_t total = 0;
    for (int g = 0; g < GROUPS; g++) {
        int32_t s = 0;
        for (int j = 16 * g; j < 16 * g + 16; j++)
            s += (u[j] - offset) * q[j];
        total += sc[g] * s;
    }
    return total;
}

/* --- x to Q8_K, and the product ------------------------------------------------------------ */

static void quantize_superblock(const float *x, int8_t *q, float *d, int32_t *bsums)
{
    float amax = 0.0f;
    for (int j = 0; j < QK; j++)
        amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    for (int g = 0; g < GROUPS; g++) {
        int32_t s = 0;
        for (int j = 16 * g; j < 16 * g + 16; j++) {
            q[j] = (int8_t)roundf(x[j] * inv);
            s += q[j];
        }
        bsums[g] = s;
    }
    *d = scale;
}

/* The same in AVX2, the same bytes (vecmath.h's roundf8). */
KQ_AVX2 static void quantize_superblock_avx2(const float *x, int8_t *q, float *d, int32_t *bsums)
{
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int t = 0; t < QK / 8; t++)
        m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + 8 * t), abs_mask));
    const float amax = max8(m);
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int c = 0; c < QK / 32; c++) {
        __m256i r[4];
        for (int t = 0; t < 4; t++)
            r[t] = roundf8(_mm256_mul_ps(_mm256_loadu_ps(x + 32 * c + 8 * t), vinv));
        _mm256_storeu_si256((__m256i *)(q + 32 * c), pack_bytes(r));
        /* the sums of the two groups of 16: [r0 + r1 | r2 + r3] summed within halves */
        const __m256i a = _mm256_add_epi32(r[0], r[1]), b = _mm256_add_epi32(r[2], r[3]);
        __m256i s = _mm256_hadd_epi32(a, b); /* [a01 a23 b01 b23 | a45 a67 b45 b67] */
        s = _mm256_hadd_epi32(s, s);         /* [a0-3 b0-3 .. | a4-7 b4-7 ..] */
        const __m128i g = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        bsums[2 * c] = _mm_cvtsi128_si32(g);
        bsums[2 * c + 1] = _mm_extract_epi32(g, 1);
    }
    *d = scale;
}

#define KQ_NAME(name) name##_avx2
#define KQ_TARGET KQ_AVX2
#include "kquants_isa.h"
#include "kquants_rows.h"
#undef KQ_NAME
#undef KQ_TARGET

#define KQ_VNNI
#define KQ_NAME(name) name##_avxvnni
#define KQ_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define KQ_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#include "kquants_isa.h"
#define KQ_DPWSSD(acc, p, s) _mm256_dpwssd_avx_epi32(acc, p, s)
#include "kquants_rows.h"
#undef KQ_DPWSSD
#undef KQ_NAME
#undef KQ_TARGET
#undef KQ_DPBUSD

#define KQ_NAME(name) name##_vnni512
#define KQ_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define KQ_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define KQ_512
#include "kquants_isa.h"
#include "kquants_rows.h"
#undef KQ_512
#undef KQ_NAME
#undef KQ_TARGET
#undef KQ_DPBUSD
#undef KQ_VNNI

/* The product over repacked W in plain C: each output's integer sums as the few-row
 * product's, and the same fp32 operations in the same order. */
static void kgroups_generic(int kind, const struct kx *xb, long i0, int M,
                            const struct krepacked *w, const float *b, float *y, long n, long nb,
                            long gr)
{
    for (int i = 0; i < M; i++)
        for (int o = 0; o < 8 && gr * 8 + o < n; o++) {
            float acc = 0.0f;
            for (long sb = 0; sb < nb; sb++) {
                const struct krepacked *blk = w + gr * nb + sb;
                const long at = (i0 + i) * nb + sb;
                const int8_t *xq = xb->q + at * QK;
                const int32_t *bs = xb->bsums + at * GROUPS;
                int32_t s = 0, mins = 0;
                for (int g = 0; g < GROUPS; g++) {
                    int32_t p = 0;
                    for (int j = 16 * g; j < 16 * g + 16; j++)
                        p += blk->u[j / 8][o][j / 4 % 2][j % 4] * xq[j];
                    s += blk->sc[g][o][0] * p;
                    mins += blk->mn[g / 2][o][g % 2] * bs[g];
                }
                if (kind == TFORMER_IQ4_XS) { /* kquants_isa.h: the values less 128 */
                    s -= mins;
                    mins = 0;
                }
                acc += (float)s * (blk->d[o] * xb->d[at])
                       - (float)mins * (blk->dmin[o] * xb->d[at]);
            }
            y[(i0 + i) * n + gr * 8 + o] = b ? acc + b[gr * 8 + o] : acc;
        }
}

typedef void (*kgroups_fn)(int, const struct kx *, long, int, const struct krepacked *,
                           const float *, float *, long, long, long);

/* Bytes of W (n x k, a K kind) repacked: n rounded up to a group of eight. */
long tformer_kquants_repacked_size(int kind, long n, long k)
{
    (void)kind;
    return (n + 7) / 8 * (k / QK) * (long)sizeof(struct krepacked);
}

/* W (n rows of a K kind's super-blocks, k values a row) into `out`
 * (tformer_kquants_repacked_size bytes), as struct krepacked says; iq4_xs's values with
 * their offset (u = v + 128), as w = d sc u - d (128 sc): its minimums 128 times its
 * scales, dmin its d. Returns 0, or -3 for a kind not of this file. */
int tformer_kquants_repack(int kind, const uint8_t *w, long n, long k, uint8_t *out)
{
    if (!is_kind_of_this_file(kind))
        return -3;
    const long nb = k / QK, size = formats[kind].size;
    const unpack_fn unpack = formats[kind].unpack_c;
    struct krepacked *r = (struct krepacked *)out;
    for (long g8 = 0; g8 < (n + 7) / 8; g8++)
        for (long sb = 0; sb < nb; sb++) {
            struct krepacked *blk = r + g8 * nb + sb;
            for (int o = 0; o < 8; o++) {
                const long row = g8 * 8 + o;
                struct unpacked p;
                if (row < n)
                    unpack(w + (row * nb + sb) * size, &p);
                else
                    memset(&p, 0, sizeof p); /* the last group filled out with zero rows */
                blk->d[o] = p.d;
                blk->dmin[o] = p.offset ? p.d : p.dmin;
                for (int g = 0; g < GROUPS; g++) {
                    blk->sc[g][o][0] = blk->sc[g][o][1] = (int16_t)p.sc[g];
                    /* at most 32 * 128 in size */
                    blk->mn[g / 2][o][g % 2] = (int16_t)(p.mn[g] + p.offset * p.sc[g]);
                }
                for (int c = 0; c < QK / 8; c++) /* eight values at a time */
                    memcpy(blk->u[c][o], p.u + 8 * c, 8);
            }
        }
    return 0;
}

static void kx_free(struct kx *xb)
{
    free(xb->q);
    free(xb->d);
    free(xb->bsums);
    free(xb->s16);
}

/* x (m x k) rounded to Q8_K into xb. Returns 0, or -1 where it could not allocate (xb then
 * holds nothing to free). */
static int kx_make(struct kx *xb, const float *x, long m, long k, int threads)
{
    const int generic = tformer_blocks_isa(-1) == TFORMER_BLOCKS_GENERIC;
    const long nb = k / QK;
    xb->q = malloc((size_t)(m * k));
    xb->d = malloc((size_t)(m * nb) * sizeof(float));
    xb->bsums = malloc((size_t)(m * nb) * GROUPS * sizeof(int32_t));
    xb->s16 = malloc((size_t)(m * nb) * KX_S16 * sizeof(int16_t));
    if (!(xb->q && xb->d && xb->bsums && xb->s16)) {
        kx_free(xb);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m * nb > 512)
    for (long t = 0; t < m * nb; t++) {
        const int32_t *bs = xb->bsums + t * GROUPS;
        int16_t *s16 = xb->s16 + t * KX_S16;
        (generic ? quantize_superblock : quantize_superblock_avx2)(
            x + t * QK, xb->q + t * QK, xb->d + t, xb->bsums + t * GROUPS);
        for (int g = 0; g < GROUPS; g++)
            s16[g] = (int16_t)bs[g];
        for (int h = 0; h < GROUPS / 2; h++)
            s16[GROUPS + h] = (int16_t)(bs[2 * h] + bs[2 * h + 1]);
    }
    return 0;
}

/* y (m x n) = x (m x k) W^T + b over l->packed, W repacked (tformer_kquants_repack): the
 * few-row product's results bit for bit on every path. Threads take groups of eight rows of
 * W, over which x's rows pass in chunks of X_CHUNK. */
static int kquants_repacked_linear(const struct tformer_linear *l, const float *x, float *y,
                                   long m, int threads)
{
    const long n = l->n_out, k = l->n_in, nb = k / QK, groups = (n + 7) / 8;
    struct kx xb;
    if (kx_make(&xb, x, m, k, threads))
        return -1;
    const int isa = tformer_blocks_isa(-1);
    const kgroups_fn run = isa == TFORMER_BLOCKS_GENERIC      ? kgroups_generic
                           : isa == TFORMER_BLOCKS_AVX_VNNI    ? kgroups_avxvnni
                           : isa == TFORMER_BLOCKS_AVX512_VNNI ? kgroups_vnni512
                                                               : kgroups_avx2;
    const struct krepacked *w = l->packed;
    const int step = isa == TFORMER_BLOCKS_AVX512_VNNI ? 4 : 2; /* rows of x at a time */
    for (long c = 0; c < m; c += X_CHUNK) {
        const long end = c + X_CHUNK < m ? c + X_CHUNK : m;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (long gr = 0; gr < groups; gr++)
            for (long i = c; i < end; i += step)
                run(l->kind, &xb, i, end - i < step ? (int)(end - i) : step, w, l->bias, y, n,
                    nb, gr);
    }
    kx_free(&xb);
    return 0;
}

/* The plain C few-row product: each super-block unpacked (struct unpacked) once for a chunk
 * of x's rows, then its integer sums; the reference the other paths equal bit for bit.
 * Threads take rows of W. */
static void kquants_linear_c(const struct tformer_linear *l, const struct kx *xb, float *y,
                             long m, int threads)
{
    const long n = l->n_out, nb = l->n_in / QK;
    const long size = formats[l->kind].size, row = nb * size;
    const unpack_fn unpack = formats[l->kind].unpack_c;
    const uint8_t *w = l->data;
    for (long c = 0; c < m; c += X_CHUNK) {
        const long rows = m - c < X_CHUNK ? m - c : X_CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (long r = 0; r < n; r++) {
            float acc[X_CHUNK];
            struct unpacked p;
            for (long i = 0; i < rows; i++)
                acc[i] = 0.0f;
            for (long b = 0; b < nb; b++) {
                unpack(w + r * row + b * size, &p);
                for (long i = 0; i < rows; i++) {
                    const long at = (c + i) * nb + b;
                    const int32_t *bs = xb->bsums + at * GROUPS;
                    int32_t mins = 0;
                    for (int g = 0; g < GROUPS; g++)
                        mins += p.mn[g] * bs[g];
                    const int32_t s = dot_c(p.u, xb->q + at * QK, p.sc, p.offset);
                    acc[i] += (float)s * (p.d * xb->d[at]) - (float)mins * (p.dmin * xb->d[at]);
                }
            }
            for (long i = 0; i < rows; i++)
                y[(c + i) * n + r] = l->bias ? acc[i] + l->bias[r] : acc[i];
        }
    }
}

typedef void (*krows_fn)(int, const struct kx *, long, int, const uint8_t *, const float *,
                         float *, long, long, long, long);

/* kinds.c's product for q4_k, q5_k, q6_k and iq4_xs: l->data holds n_out rows of n_in / 256
 * super-blocks, and l->packed, where not NULL, the same repacked, for products of
 * l->packed_min_rows rows and more. Below that (decoding's rows) the SIMD paths read the
 * file's bytes (kquants_rows.h): threads take tiles of KQ_TILE rows of W, over which x's
 * rows pass four at a time, in chunks of X_CHUNK. Returns 0, or -1 where it could not
 * allocate x's blocks. */
int tformer_kquants_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                           int threads)
{
    const long n = l->n_out, k = l->n_in, nb = k / QK;
    if (m <= 0 || n <= 0)
        return 0;
    const int isa = tformer_blocks_isa(-1); /* AVX-512 VNNI: with BW too */
    /* iq4_xs's repacked values would saturate AVX2's byte multiply-add (kquants_isa.h) */
    if (l->packed && m >= l->packed_min_rows
        && !(l->kind == TFORMER_IQ4_XS && isa == TFORMER_BLOCKS_AVX2))
        return kquants_repacked_linear(l, x, y, m, threads);
    struct kx xb;
    if (kx_make(&xb, x, m, k, threads))
        return -1;
    if (isa == TFORMER_BLOCKS_GENERIC) {
        kquants_linear_c(l, &xb, y, m, threads);
        kx_free(&xb);
        return 0;
    }
    const krows_fn rows = isa == TFORMER_BLOCKS_AVX_VNNI    ? krows_avxvnni
                          : isa == TFORMER_BLOCKS_AVX512_VNNI ? krows_vnni512
                                                              : krows_avx2;
    const long tiles = (n + KQ_TILE - 1) / KQ_TILE;
    for (long c = 0; c < m; c += X_CHUNK) {
        const long end = c + X_CHUNK < m ? c + X_CHUNK : m;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (long t = 0; t < tiles; t++) {
            const long r1 = (t + 1) * KQ_TILE < n ? (t + 1) * KQ_TILE : n;
            for (long i = c; i < end; i += 4)
                rows(l->kind, &xb, i, end - i < 4 ? (int)(end - i) : 4, l->data, l->bias, y, n,
                     nb, t * KQ_TILE, r1);
        }
    }
    kx_free(&xb);
    return 0;
}

/* --- Quantizing: fp32 rows to K super-blocks (kquants.py's quantize_*, which this computes
 * bit for bit, and says the method) ------------------------------------------------------ */

__attribute__((target("f16c"))) static uint16_t to_half(float v)
{
    return (uint16_t)_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
}

__attribute__((target("f16c"))) static float from_half(uint16_t h)
{
    return _cvtsh_ss(h);
}

static void store_u16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, sizeof v);
}

/* v limited to [lo, hi], inline (fminf and fmaxf are calls where NaNs need their rules;
 * no NaN comes here) */
static inline float clampf(float v, float lo, float hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* The searches' inner step, in AVX2 (which the library needs anyway): q = clamp(rint(v *
 * iscale), lo, hi) for 8n values v, and the sums in double of the fp32 products a q and
 * a q q (b q for sums[2]), as kquants.py's _dsum forms them. The sums of fp32 products of
 * such a block are exact or nearly in double, whatever their order. */
static inline __m256d add_ps_as_pd(__m256d acc, __m256 v)
{
    acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

static void trial_sums(const float *v, float iscale, float lo, float hi, const float *a,
                       const float *b, int n8, double *sums)
{
    const __m256 vs = _mm256_set1_ps(iscale), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd(), s2 = _mm256_setzero_pd();
    for (int c = 0; c < n8; c++) {
        __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * c), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, vlo), vhi);
        const __m256 aq = _mm256_mul_ps(_mm256_loadu_ps(a + 8 * c), q);
        s0 = add_ps_as_pd(s0, aq);
        s1 = add_ps_as_pd(s1, _mm256_mul_ps(aq, q));
        s2 = add_ps_as_pd(s2, _mm256_mul_ps(_mm256_loadu_ps(b + 8 * c), q));
    }
    sums[0] = sum_lanes_pd(s0);
    sums[1] = sum_lanes_pd(s1);
    sums[2] = sum_lanes_pd(s2);
}

/* The scale and minimum of 32 values (x ~ scale q - minimum, q in 0..nmax): kquants.py's
 * _search_scale_min, step for step. Products in fp32, their sums in double. */
static void search_scale_min(const float *x, int nmax, float rmin, int steps, float *scale,
                             float *minimum)
{
    float w[32], wx[32], shifted[32];
    double sq = 0.0;
    float lo = x[0], hi = x[0];
    for (int j = 0; j < 32; j++) {
        sq += (double)(x[j] * x[j]);
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
    }
    const float rms = (float)sqrt(sq / 32.0);
    lo = fminf(lo, 0.0f);
    if (hi - lo == 0.0f) {
        *scale = 0.0f;
        *minimum = -lo;
        return;
    }
    const float span = hi - lo;
    double sw = 0.0, sx = 0.0, sxx = 0.0;
    for (int j = 0; j < 32; j++) {
        w[j] = fabsf(x[j]) + rms;
        wx[j] = w[j] * x[j];
        shifted[j] = x[j] - lo;
        sw += (double)w[j];
        sx += (double)wx[j];
        sxx += (double)(wx[j] * x[j]);
    }
    double best = 0.0, best_scale = (double)(span / (float)nmax), best_min = (double)lo;
    for (int step = -1; step <= steps; step++) {
        /* step -1: the plain max-min rounding, its own scale and minimum */
        const float num = step < 0 ? (float)nmax : (float)(rmin + 0.1 * step + nmax);
        const float iscale = num / span;
        double sums[3];
        trial_sums(shifted, iscale, 0.0f, (float)nmax, w, wx, 4, sums);
        const double sl = sums[0], sl2 = sums[1], sxl = sums[2];
        double s = best_scale, o = best_min;
        if (step >= 0) {
            const double det = sw * sl2 - sl * sl;
            if (!(det > 0.0))
                continue;
            s = (sw * sxl - sx * sl) / det;
            o = (sl2 * sx - sl * sxl) / det;
            if (o > 0.0) {
                s = sxl / (sl2 > 0.0 ? sl2 : 1.0);
                o = 0.0;
            }
        }
        const double err = s * s * sl2 + 2 * s * o * sl - 2 * s * sxl + o * o * sw - 2 * o * sx + sxx;
        if (step < 0 || err < best) {
            best = err;
            best_scale = s;
            best_min = o;
        }
    }
    *scale = (float)best_scale;
    *minimum = -(float)best_min;
}

/* q4_k (nmax 15) or q5_k (31, with qh) of one super-block. */
static void quantize_qk(const float *x, int nmax, float rmin, int steps, uint8_t *blk)
{
    float scale[8], minimum[8], top_s = 0.0f, top_m = 0.0f;
    for (int j = 0; j < 8; j++) {
        search_scale_min(x + 32 * j, nmax, rmin, steps, scale + j, minimum + j);
        top_s = fmaxf(top_s, scale[j]);
        top_m = fmaxf(top_m, minimum[j]);
    }
    const float inv_s = top_s > 0.0f ? 63.0f / top_s : 0.0f;
    const float inv_m = top_m > 0.0f ? 63.0f / top_m : 0.0f;
    int ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        ls[j] = (int)fminf(rintf(inv_s * scale[j]), 63.0f);
        lm[j] = (int)fminf(rintf(inv_m * minimum[j]), 63.0f);
    }
    const uint16_t d = to_half(top_s / 63.0f), dmin = to_half(top_m / 63.0f);
    store_u16(blk, d);
    store_u16(blk + 2, dmin);
    uint8_t *s = blk + 4;
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4));
    }
    uint8_t q[QK];
    for (int j = 0; j < 8; j++) {
        const float dj = from_half(d) * (float)ls[j], mj = from_half(dmin) * (float)lm[j];
        for (int l = 0; l < 32; l++)
            q[32 * j + l] = dj == 0.0f ? 0
                : (uint8_t)clampf(rintf((x[32 * j + l] + mj) / dj), 0.0f, (float)nmax);
    }
    uint8_t *qs = blk + (nmax == 15 ? 16 : 48);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++)
            qs[32 * j + l] = (uint8_t)((q[64 * j + l] & 15) | ((q[64 * j + 32 + l] & 15) << 4));
    if (nmax == 31) {
        uint8_t *qh = blk + 16;
        for (int l = 0; l < 32; l++) {
            qh[l] = 0;
            for (int i = 0; i < 8; i++)
                qh[l] |= (uint8_t)((q[32 * i + l] >> 4) << i);
        }
    }
}

/* The scale of 16 values (x ~ scale q, q in -nmax..nmax-1): kquants.py's _search_scale. */
static float search_scale(const float *x, int nmax)
{
    float big = x[0], w[16], wx[16];
    for (int j = 1; j < 16; j++)
        if (fabsf(x[j]) > fabsf(big))
            big = x[j];
    if (fabsf(big) < 1e-15f)
        return 0.0f;
    for (int j = 0; j < 16; j++) {
        w[j] = x[j] * x[j];
        wx[j] = w[j] * x[j];
    }
    double scale = 0.0, best = 0.0;
    for (int s = -10; s <= 9; s++) {
        /* s -10: the first trial, -nmax / big; then -(nmax + s/10) / big, s = -9..9 */
        const float num = s < -9 ? (float)-nmax : (float)(-(nmax + 0.1 * s));
        const float iscale = num / big;
        double sums[3];
        trial_sums(x, iscale, (float)-nmax, (float)(nmax - 1), w, wx, 2, sums);
        const double sl2 = sums[1], sxl = sums[2];
        if (s < -9) {
            scale = sxl / (sl2 > 0.0 ? sl2 : 1.0);
            best = scale * sxl;
        } else if (sl2 > 0.0 && sxl * sxl > best * sl2) {
            scale = sxl / sl2;
            best = scale * sxl;
        }
    }
    return (float)scale;
}

static void quantize_q6k(const float *x, uint8_t *blk)
{
    float scale[16], big = 0.0f;
    for (int g = 0; g < 16; g++) {
        scale[g] = search_scale(x + 16 * g, 32);
        if (fabsf(scale[g]) > fabsf(big))
            big = scale[g];
    }
    const float iscale = big != 0.0f ? -128.0f / big : 0.0f;
    const uint16_t d = to_half(big != 0.0f ? 1.0f / iscale : 0.0f);
    int8_t sc[16];
    uint8_t q[QK];
    for (int g = 0; g < 16; g++) {
        sc[g] = (int8_t)fminf(rintf(iscale * scale[g]), 127.0f);
        const float dj = from_half(d) * (float)sc[g];
        for (int l = 0; l < 16; l++)
            q[16 * g + l] = dj == 0.0f ? 32
                : (uint8_t)(clampf(rintf(x[16 * g + l] / dj), -32.0f, 31.0f) + 32.0f);
    }
    for (int h = 0; h < 2; h++) {
        const uint8_t *v = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            blk[64 * h + l] = (uint8_t)((v[l] & 15) | ((v[l + 64] & 15) << 4));
            blk[64 * h + 32 + l] = (uint8_t)((v[l + 32] & 15) | ((v[l + 96] & 15) << 4));
            blk[128 + 32 * h + l] = (uint8_t)((v[l] >> 4) | ((v[l + 32] >> 4) << 2)
                                              | ((v[l + 64] >> 4) << 4) | ((v[l + 96] >> 4) << 6));
        }
    }
    memcpy(blk + 192, sc, 16);
    store_u16(blk + 208, d);
}

/* The index of IQ4_VALUES' value nearest to v, the larger one where two are as near (ggml's
 * best_index_int8): kquants.py's _iq4_nearest. */
static int iq4_nearest(float v)
{
    if (v <= (float)IQ4_VALUES[0])
        return 0;
    int above = 1; /* the first value above v */
    while (above < 15 && (float)IQ4_VALUES[above] <= v)
        above++;
    return v - (float)IQ4_VALUES[above - 1] < (float)IQ4_VALUES[above] - v ? above - 1 : above;
}

/* The sums of a trial of 32 values x, weights w at iscale, each value v the one nearest to
 * iscale x: in double, the fp32 products w v x and w v v. */
static void iq4_trial(const float *x, const float *w, float iscale, double *sxv, double *svv)
{
    double a = 0.0, b = 0.0;
    for (int j = 0; j < 32; j++) {
        const float v = (float)IQ4_VALUES[iq4_nearest(iscale * x[j])], wv = w[j] * v;
        a += (double)(wv * x[j]);
        b += (double)(wv * v);
    }
    *sxv = a;
    *svv = b;
}

/* The scale of 32 values, x ~ scale v with each v one of IQ4_VALUES (ggml's
 * quantize_row_iq4_nl_impl without an importance matrix: weights x^2): the least-squares
 * scale for the values nearest x at 127 / max (max the value largest in size), replaced
 * by that of any trial at (t - 127) / max, t = -7..7, that fits better. kquants.py's
 * _iq4_search, step for step. */
static float iq4_search(const float *x)
{
    float w[32], amax = 0.0f, big = 0.0f;
    for (int j = 0; j < 32; j++) {
        w[j] = x[j] * x[j];
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            big = x[j];
        }
    }
    if (amax < 1e-15f)
        return 0.0f;
    double sxv, svv;
    iq4_trial(x, w, 1.0f / (big / 127.0f), &sxv, &svv);
    double scale = svv > 0.0 ? sxv / svv : 0.0, best = scale * sxv;
    for (int t = -7; t <= 7; t++) {
        iq4_trial(x, w, (float)(t - 127) / big, &sxv, &svv);
        if (svv > 0.0 && sxv * sxv > best * svv) {
            scale = sxv / svv;
            best = scale * sxv;
        }
    }
    return (float)scale;
}

/* iq4_xs of one super-block: each 32 values' scale searched, the eight rounded to 6 bits
 * against d = -(the one largest in size) / 32, and the values chosen anew at the rounded
 * scales. */
static void quantize_iq4xs(const float *x, uint8_t *blk)
{
    float scale[8], top = 0.0f, big = 0.0f;
    for (int j = 0; j < 8; j++) {
        scale[j] = iq4_search(x + 32 * j);
        if (fabsf(scale[j]) > top) {
            top = fabsf(scale[j]);
            big = scale[j];
        }
    }
    const float d = -big / 32.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t L[QK];
    unsigned high = 0;
    memset(blk + 4, 0, 4);
    for (int j = 0; j < 8; j++) {
        const int l = (int)clampf(rintf(id * scale[j]), -32.0f, 31.0f);
        const float dl = d * (float)l, idl = dl != 0.0f ? 1.0f / dl : 0.0f;
        for (int v = 0; v < 32; v++)
            L[32 * j + v] = (uint8_t)iq4_nearest(idl * x[32 * j + v]);
        blk[4 + j / 2] |= (uint8_t)(((l + 32) & 15) << 4 * (j % 2));
        high |= (unsigned)((l + 32) >> 4) << 2 * j;
    }
    store_u16(blk, to_half(d));
    store_u16(blk + 2, (uint16_t)high);
    for (int j = 0; j < 8; j++)
        for (int v = 0; v < 16; v++)
            blk[8 + 16 * j + v] = (uint8_t)(L[32 * j + v] | L[32 * j + 16 + v] << 4);
}

static void quantize_q4k(const float *x, uint8_t *blk)
{
    quantize_qk(x, 15, -1.0f, 20, blk);
}

static void quantize_q5k(const float *x, uint8_t *blk)
{
    quantize_qk(x, 31, -0.5f, 15, blk);
}

/* n super-blocks of x (n * 256 fp32) to `kind`'s blocks (n * its bytes). Returns 0, or -3
 * for a kind that is not a K kind. */
int tformer_quantize_k(int kind, const float *x, long n, uint8_t *out, int threads)
{
    if (!is_kind_of_this_file(kind))
        return -3;
    const long size = formats[kind].size;
    const kquantize_fn quantize = formats[kind].quantize;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 64)
    for (long b = 0; b < n; b++)
        quantize(x + b * QK, out + b * size);
    return 0;
}

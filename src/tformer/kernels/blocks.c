/* Products with weights held as llama.cpp's blocks (blocks.py): y = x W^T + b, W (n x k) as
 * rows of q8_0, q4_0, q4_1, q5_0 or q5_1 blocks of 32 values, x (m x k) fp32, rounded once per call to
 * blocks of 32 values with one fp32 scale each (struct xblocks): d = max|x| / 127,
 * q = roundf(x / d), as blocks.py's quantize_activations. A block's 32 products are summed
 * exactly in integers and scaled by d_w d_x (q4_1 and q5_1 add m_w d_x sum(q_x)); the blocks'
 * results are summed in fp32. The 5-bit formats keep each value's fifth bit apart, in a
 * 32-bit word qh (bit j: value j's); with it a value is a byte 0..31 like a nibble.
 *
 * One entry point serves a decoding step's few rows and a prompt's many: x's rows go four
 * at a time through a tile of W's rows, which stays in the cache while x's rows pass. With
 * up to four rows the tile is a few rows of W and the product a stream through the weights,
 * as matvec.c's; with more, a tile is 16 rows of W (a few KB) and x's rows pass in chunks
 * of 64 (at most some 100 KB, in L2). Threads (OpenMP) take tiles of W. A layer that has
 * W repacked (struct repacked, below) gives products of many rows that instead.
 *
 * Paths (tformer_blocks_isa): plain C; AVX2 (byte multiply-adds); AVX-VNNI and AVX-512 VNNI
 * (vpdpbusd on 256-bit registers; the latter with AVX-512 BW's byte masks, and so kquants.c's
 * 512-bit products), each the same integer sums (blocks_isa.h).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tformer.h"
#include "vecmath.h"

#define BLOCK 32
#define KIND_Q8_0 TFORMER_Q8_0
#define KIND_Q4_0 TFORMER_Q4_0
#define KIND_Q4_1 TFORMER_Q4_1
#define KIND_Q5_0 TFORMER_Q5_0
#define KIND_Q5_1 TFORMER_Q5_1
#define BLK_PREFETCH_AHEAD 4
#define WIDE_TILE 16  /* rows of W a tile holds when x has more than four rows */
#define X_CHUNK 64    /* rows of x that pass through a tile at a time */

enum { BISA_GENERIC = TFORMER_BLOCKS_GENERIC, BISA_AVX2 = TFORMER_BLOCKS_AVX2,
       BISA_AVX_VNNI = TFORMER_BLOCKS_AVX_VNNI, BISA_AVX512_VNNI = TFORMER_BLOCKS_AVX512_VNNI };
static int blocks_isa = BISA_AVX2;

/* x as blocks: qx (m x k int8), and per block (m x nb) its scale dx, the integer sum of its
 * qx (isum), dx * isum (sx, q4_1's offset term), and -8 times the sums of its eight groups
 * of four (lane8, 8 per block: q4_0's offset, in the lanes of the vector sums). */
struct xblocks {
    int8_t *qx;
    float *dx;
    int32_t *isum;
    float *sx;
    int32_t *lane8;
};

/* W repacked for products of many rows (tformer_blocks_repack): W's rows eight at a time
 * (a group; the last one filled out with zero rows), and for each block of the group the
 * eight rows' scales, as fp32, and values, one byte each, eight of an output at a time in
 * two fours: u[c][o][h] holds values 8c + 4h .. 8c + 4h + 3 of output o, so that a 32-byte
 * load is four outputs' eight values and a 64-byte one eight outputs', each 32-bit lane
 * (o, h) four values that x's eight bytes 8c .. 8c + 7, broadcast as one word, meet in the
 * same lane (blocks_isa.h's group). The values are the file's: q8_0's signed bytes, the 4-
 * and 5-bit kinds' 0 .. 15 and 0 .. 31 with their offsets still in them (q4_0's 8, q5_0's
 * 16), m 0 where the kind has no minimum (q8_0's slot holds start instead). A block of
 * eight rows is 320 bytes, 40 a row where the file's q4_0 takes 18, q8_0 34. */
struct repacked {
    float d[8];
    union {
        float m[8];
        /* q8_0, which has no minimum: -128 times the sum of each row's block, which the
         * VNNI paths start from where they take x + 128 unsigned (blocks_isa.h) */
        int32_t start[8];
    };
    uint8_t u[4][8][2][4];
};

static inline void lane_sums(const int8_t *q, int32_t *lane8)
{
    for (int l = 0; l < 8; l++)
        lane8[l] = -8 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
}

/* kinds.c's table says the same; here it is a constant the compiler folds into each kind's
 * own copy of the tile. */
static inline long block_bytes(int kind)
{
    switch (kind) {
    case KIND_Q8_0: return 34;
    case KIND_Q4_0: return 18;
    case KIND_Q4_1: return 20;
    case KIND_Q5_0: return 22;
    default: return 24;
    }
}

/* Whether the kind has a minimum m (x = d q + m) instead of an offset in q. */
static inline int has_min(int kind)
{
    return kind == KIND_Q4_1 || kind == KIND_Q5_1;
}

/* The offset a kind's stored values carry (q = stored - offset): 8 for q4_0, 16 for q5_0. */
static inline int offset_of(int kind)
{
    return kind == KIND_Q4_0 ? 8 : kind == KIND_Q5_0 ? 16 : 0;
}

/* Whether the kind keeps a fifth bit for each value (qh, the 4 bytes before qs). */
static inline int five_bits(int kind)
{
    return kind == KIND_Q5_0 || kind == KIND_Q5_1;
}

static inline uint32_t load_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint16_t load_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* IEEE half to float, in plain C (the generic path's; the others use F16C). */
static float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man) { /* subnormal: man * 2^-24 */
        const float v = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &v, sizeof bits);
        bits |= sign;
    } else
        bits = sign;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One block of x (32 values) rounded: its scale, and q = roundf(x * (1 / d)). */
static void quantize_block_c(const float *x, int8_t *q, float *d, int32_t *isum, float *sx)
{
    float amax = 0.0f;
    for (int j = 0; j < BLOCK; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < BLOCK; j++) {
        q[j] = (int8_t)roundf(x[j] * inv);
        s += q[j];
    }
    *d = scale;
    *isum = s;
    *sx = scale * (float)s;
}

/* The same with AVX2: roundf exactly (vecmath.h's roundf8). */
__attribute__((target("avx2,fma"))) static void quantize_block_avx2(
    const float *x, int8_t *q, float *d, int32_t *isum, float *sx)
{
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], m = _mm256_setzero_ps();
    for (int t = 0; t < 4; t++) {
        v[t] = _mm256_loadu_ps(x + 8 * t);
        m = _mm256_max_ps(m, _mm256_and_ps(v[t], abs_mask));
    }
    const float amax = max8(m);
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i r[4];
    for (int t = 0; t < 4; t++)
        r[t] = roundf8(_mm256_mul_ps(v[t], vinv));
    _mm256_storeu_si256((__m256i *)q, pack_bytes(r));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    *d = scale;
    *isum = _mm_cvtsi128_si32(s4);
    *sx = scale * (float)*isum;
}

/* The plain C product: the same integer sums, a block at a time; inlined into rows_generic
 * once per kind, so that the kind's tests fold away out of the loops. */
static inline __attribute__((always_inline)) void rows_generic_kind(
    const int kind, const struct xblocks *xb, long i0, int M, const uint8_t *w, const float *b,
    float *y, long n, long nb, long r0, long r1)
{
    const long size = block_bytes(kind), row = nb * size;
    for (long r = r0; r < r1; r++)
        for (int i = 0; i < M; i++) {
            float acc = 0.0f, off = 0.0f;
            for (long q = 0; q < nb; q++) {
                const uint8_t *blk = w + r * row + q * size;
                const long at = (i0 + i) * nb + q;
                const int8_t *xq = xb->qx + at * BLOCK;
                int32_t s = 0;
                if (kind == KIND_Q8_0) {
                    for (int j = 0; j < BLOCK; j++)
                        s += (int32_t)(int8_t)blk[2 + j] * xq[j];
                } else {
                    const uint8_t *qs = blk + size - 16;
                    /* the 5-bit kinds' fifth bits, 16 for value j where bit j is set */
                    const uint32_t qh = five_bits(kind) ? load_u32(blk + size - 20) : 0;
                    for (int j = 0; j < 16; j++)
                        s += ((qs[j] & 15) | ((qh >> j & 1) << 4)) * xq[j]
                             + ((qs[j] >> 4) | ((qh >> (j + 16) & 1) << 4)) * xq[j + 16];
                    s -= offset_of(kind) * xb->isum[at];
                    if (has_min(kind))
                        off += half_to_float(load_u16(blk + 2)) * xb->sx[at];
                }
                acc += (float)s * (half_to_float(load_u16(blk)) * xb->dx[at]);
            }
            const float v = acc + off;
            y[(i0 + i) * n + r] = b ? v + b[r] : v;
        }
}

static void rows_generic(int kind, const struct xblocks *xb, long i0, int M, const uint8_t *w,
                         const float *b, float *y, long n, long nb, long r0, long r1)
{
    switch (kind) {
    case KIND_Q8_0: rows_generic_kind(KIND_Q8_0, xb, i0, M, w, b, y, n, nb, r0, r1); return;
    case KIND_Q4_0: rows_generic_kind(KIND_Q4_0, xb, i0, M, w, b, y, n, nb, r0, r1); return;
    case KIND_Q4_1: rows_generic_kind(KIND_Q4_1, xb, i0, M, w, b, y, n, nb, r0, r1); return;
    case KIND_Q5_0: rows_generic_kind(KIND_Q5_0, xb, i0, M, w, b, y, n, nb, r0, r1); return;
    default: rows_generic_kind(KIND_Q5_1, xb, i0, M, w, b, y, n, nb, r0, r1); return;
    }
}

/* The product over repacked W in plain C: for each output the same integer sum as
 * rows_generic's, and the same fp32 operations in the same order. */
static inline __attribute__((always_inline)) void groups_generic_kind(
    const int kind, const struct xblocks *xb, long i0, int M, const struct repacked *w,
    const float *b, float *y, long n, long nb, long g0, long g1)
{
    for (long g = g0; g < g1; g++)
        for (int i = 0; i < M; i++)
            for (int o = 0; o < 8 && g * 8 + o < n; o++) {
                float acc = 0.0f, off = 0.0f;
                for (long q = 0; q < nb; q++) {
                    const struct repacked *blk = w + g * nb + q;
                    const long at = (i0 + i) * nb + q;
                    const int8_t *xq = xb->qx + at * BLOCK;
                    int32_t s = 0;
                    for (int j = 0; j < BLOCK; j++) {
                        const uint8_t v = blk->u[j / 8][o][j / 4 % 2][j % 4];
                        s += (kind == KIND_Q8_0 ? (int32_t)(int8_t)v : (int32_t)v) * xq[j];
                    }
                    s -= offset_of(kind) * xb->isum[at];
                    if (has_min(kind))
                        off += blk->m[o] * xb->sx[at];
                    acc += (float)s * (blk->d[o] * xb->dx[at]);
                }
                const float v = acc + off;
                y[(i0 + i) * n + g * 8 + o] = b ? v + b[g * 8 + o] : v;
            }
}

static void groups_generic(int kind, const struct xblocks *xb, long i0, int M,
                           const struct repacked *w, const float *b, float *y, long n, long nb,
                           long g0, long g1)
{
    switch (kind) {
    case KIND_Q8_0: groups_generic_kind(KIND_Q8_0, xb, i0, M, w, b, y, n, nb, g0, g1); return;
    case KIND_Q4_0: groups_generic_kind(KIND_Q4_0, xb, i0, M, w, b, y, n, nb, g0, g1); return;
    case KIND_Q4_1: groups_generic_kind(KIND_Q4_1, xb, i0, M, w, b, y, n, nb, g0, g1); return;
    case KIND_Q5_0: groups_generic_kind(KIND_Q5_0, xb, i0, M, w, b, y, n, nb, g0, g1); return;
    default: groups_generic_kind(KIND_Q5_1, xb, i0, M, w, b, y, n, nb, g0, g1); return;
    }
}

#define BLK_NAME(name) name##_avx2
#define BLK_TARGET __attribute__((target("avx2,fma,f16c")))
#include "blocks_isa.h"
#undef BLK_NAME
#undef BLK_TARGET

#define BLK_DOT
#define BLK_NAME(name) name##_avxvnni
#define BLK_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define BLK_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#include "blocks_isa.h"
#undef BLK_NAME
#undef BLK_TARGET
#undef BLK_DPBUSD

#define BLK_NAME(name) name##_vnni512
#define BLK_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vnni,avx512vl,avx512bw")))
#define BLK_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define BLK_BYTE_MASKS
#define BLK_512
#include "blocks_isa.h"
#undef BLK_512
#undef BLK_BYTE_MASKS
#undef BLK_NAME
#undef BLK_TARGET
#undef BLK_DPBUSD
#undef BLK_DOT

typedef void (*rows_fn)(int, const struct xblocks *, long, int, const uint8_t *, const float *,
                        float *, long, long, long, long);

/* The path a level asks for where the CPU has it, else the best below it. */
int tformer_blocks_isa(int want)
{
    if (want >= 0) {
        if (want == BISA_AVX512_VNNI
            && !(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
                 && __builtin_cpu_supports("avx512bw")))
            want = BISA_AVX2;
        if (want == BISA_AVX_VNNI && !__builtin_cpu_supports("avxvnni"))
            want = BISA_AVX2;
        if (want > BISA_AVX512_VNNI)
            want = BISA_AVX2;
        blocks_isa = want;
    }
    return blocks_isa;
}

typedef void (*groups_fn)(int, const struct xblocks *, long, int, const struct repacked *,
                          const float *, float *, long, long, long, long);

static void xblocks_free(struct xblocks *xb)
{
    free(xb->qx);
    free(xb->dx);
    free(xb->isum);
    free(xb->sx);
    free(xb->lane8);
}

/* Block t of x rounded into xb. */
static inline void xblock_make(struct xblocks *xb, const float *x, long t, int isa)
{
    if (isa == BISA_GENERIC)
        quantize_block_c(x + t * BLOCK, xb->qx + t * BLOCK, xb->dx + t, xb->isum + t,
                         xb->sx + t);
    else
        quantize_block_avx2(x + t * BLOCK, xb->qx + t * BLOCK, xb->dx + t, xb->isum + t,
                            xb->sx + t);
    lane_sums(xb->qx + t * BLOCK, xb->lane8 + 8 * t);
}

/* x (m x k) rounded to blocks into xb, on the path set. Returns 0, or -1 where it could not
 * allocate (xb then holds nothing to free). */
static int xblocks_make(struct xblocks *xb, const float *x, long m, long k, int threads)
{
    const long nb = k / BLOCK;
    xb->qx = malloc((size_t)(m * k));
    xb->dx = malloc((size_t)(m * nb) * sizeof(float));
    xb->isum = malloc((size_t)(m * nb) * sizeof(int32_t));
    xb->sx = malloc((size_t)(m * nb) * sizeof(float));
    xb->lane8 = malloc((size_t)(m * nb) * 8 * sizeof(int32_t));
    if (!(xb->qx && xb->dx && xb->isum && xb->sx && xb->lane8)) {
        xblocks_free(xb);
        return -1;
    }
    const int isa = blocks_isa;
    /* One thread runs the loop itself: an OpenMP region of one thread still costs ~0.4 us
     * (~0.9 inside another region, as step.c's team calls this), a tenth of a small
     * product's piece. */
    if (threads > 1 && m * nb > 4096) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long t = 0; t < m * nb; t++)
            xblock_make(xb, x, t, isa);
    } else
        for (long t = 0; t < m * nb; t++)
            xblock_make(xb, x, t, isa);
    return 0;
}

/* y (m x n) = x (m x k) W^T + b, W (n x k) as blocks of `kind`, k a multiple of 32; b may
 * be NULL. Returns 0, or -1 where it could not allocate x's blocks. */
int tformer_blocks_linear(int kind, const float *x, long m, const uint8_t *w, long n, long k,
                          const float *b, float *y, int threads)
{
    const long nb = k / BLOCK;
    if (m <= 0 || n <= 0)
        return 0;
    struct xblocks xb;
    if (xblocks_make(&xb, x, m, k, threads))
        return -1;
    const int isa = blocks_isa;
    const rows_fn rows = isa == BISA_GENERIC      ? rows_generic
                         : isa == BISA_AVX_VNNI    ? rows_avxvnni
                         : isa == BISA_AVX512_VNNI ? rows_vnni512
                                                   : rows_avx2;
    if (m <= 4) {
        /* Tiles of 4 rows of W: a stream through the weights, split among threads, which
         * take a sixteenth of their share at a time as they come: where the system holds
         * one back (another process on its core), the others take its share. */
        const long tiles = (n + 3) / 4, chunk = tiles / (16L * threads) + 1;
        if (threads > 1) {
#pragma omp parallel for schedule(dynamic, chunk) num_threads(threads)
            for (long t = 0; t < tiles; t++)
                rows(kind, &xb, 0, (int)m, w, b, y, n, nb, t * 4, t * 4 + 4 < n ? t * 4 + 4 : n);
        } else
            for (long t = 0; t < tiles; t++)
                rows(kind, &xb, 0, (int)m, w, b, y, n, nb, t * 4, t * 4 + 4 < n ? t * 4 + 4 : n);
    } else {
        const long tiles = (n + WIDE_TILE - 1) / WIDE_TILE;
        for (long c = 0; c < m; c += X_CHUNK) {
            const long end = c + X_CHUNK < m ? c + X_CHUNK : m;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
            for (long t = 0; t < tiles; t++) {
                const long r1 = t * WIDE_TILE + WIDE_TILE < n ? t * WIDE_TILE + WIDE_TILE : n;
                for (long i = c; i < end; i += 4)
                    rows(kind, &xb, i, end - i < 4 ? (int)(end - i) : 4, w, b, y, n, nb,
                         t * WIDE_TILE, r1);
            }
        }
    }
    xblocks_free(&xb);
    return 0;
}

/* --- Many rows: W repacked (struct repacked) ---------------------------------------------
 *
 * A prompt's or a batch's product reads each block of W once for many rows of x, so what
 * counts is the work a block costs, not the bytes it takes. The file's layout spends it on
 * unpacking nibbles once per tile and on a scale, a conversion and a sum of eight lanes for
 * every pair of an x row and a W row. Repacked, the values are bytes already, and eight
 * outputs share each instruction: one block of x costs eight byte products, a conversion
 * and a scaling for eight outputs together. llama.cpp's ggml-cpu repacks Q4_0 into rows
 * interleaved likewise (repack.cpp). */

/* Bytes of W (n x k, `kind`) repacked: n rounded up to a group of eight. */
long tformer_blocks_repacked_size(int kind, long n, long k)
{
    (void)kind;
    return (n + 7) / 8 * (k / BLOCK) * (long)sizeof(struct repacked);
}

/* Block q of W's row r decoded to its 32 stored values (offsets kept) and scales. */
static void block_values(int kind, const uint8_t *blk, uint8_t *v, float *d, float *m)
{
    const long size = block_bytes(kind);
    *d = half_to_float(load_u16(blk));
    *m = has_min(kind) ? half_to_float(load_u16(blk + 2)) : 0.0f;
    if (kind == KIND_Q8_0) {
        memcpy(v, blk + 2, BLOCK);
        return;
    }
    const uint8_t *qs = blk + size - 16;
    const uint32_t qh = five_bits(kind) ? load_u32(blk + size - 20) : 0;
    for (int j = 0; j < 16; j++) {
        v[j] = (uint8_t)((qs[j] & 15) | ((qh >> j & 1) << 4));
        v[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16) & 1) << 4));
    }
}

/* W (n rows of `kind`'s blocks, k values a row) into `out` (tformer_blocks_repacked_size
 * bytes), as struct repacked says. Returns 0, or -3 for a kind not of this file. */
int tformer_blocks_repack(int kind, const uint8_t *w, long n, long k, uint8_t *out)
{
    if (kind < KIND_Q8_0 || kind > KIND_Q5_1)
        return -3;
    const long nb = k / BLOCK, size = block_bytes(kind);
    struct repacked *r = (struct repacked *)out;
    memset(out, 0, (size_t)tformer_blocks_repacked_size(kind, n, k));
    for (long row = 0; row < n; row++)
        for (long q = 0; q < nb; q++) {
            struct repacked *blk = r + (row / 8) * nb + q;
            const int o = (int)(row % 8);
            uint8_t v[BLOCK];
            block_values(kind, w + row * nb * size + q * size, v, &blk->d[o], &blk->m[o]);
            int32_t sum = 0;
            for (int j = 0; j < BLOCK; j++) {
                blk->u[j / 8][o][j / 4 % 2][j % 4] = v[j];
                sum += (int8_t)v[j];
            }
            if (kind == KIND_Q8_0)
                blk->start[o] = -128 * sum;
        }
    return 0;
}

/* y (m x n) = x (m x k) W^T + b over W repacked (tformer_blocks_repack): the plain C
 * product's results bit for bit on every path. Groups of W (2 KB or so a block of them)
 * stay in the cache while x's rows pass in chunks of X_CHUNK; threads take groups. Returns
 * 0, or -1 where it could not allocate x's blocks. */
int tformer_blocks_repacked_linear(int kind, const float *x, long m, const uint8_t *packed,
                                   long n, long k, const float *b, float *y, int threads)
{
    const long nb = k / BLOCK, groups = (n + 7) / 8;
    if (m <= 0 || n <= 0)
        return 0;
    struct xblocks xb;
    if (xblocks_make(&xb, x, m, k, threads))
        return -1;
    const int isa = blocks_isa;
    const groups_fn run = isa == BISA_GENERIC      ? groups_generic
                          : isa == BISA_AVX_VNNI    ? groups_avxvnni
                          : isa == BISA_AVX512_VNNI ? groups_vnni512
                                                    : groups_avx2;
    const struct repacked *w = (const struct repacked *)packed;
    const int step = isa == BISA_AVX512_VNNI ? 4 : 2; /* rows of x at a time (BLK_NAME(groups)) */
    for (long c = 0; c < m; c += X_CHUNK) {
        const long end = c + X_CHUNK < m ? c + X_CHUNK : m;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (long g = 0; g < groups; g++)
            for (long i = c; i < end; i += step)
                run(kind, &xb, i, end - i < step ? (int)(end - i) : step, w, b, y, n, nb, g,
                    g + 1);
    }
    xblocks_free(&xb);
    return 0;
}

/* kinds.c's product for q8_0, q4_0, q4_1, q5_0 and q5_1: l->data holds the blocks, and
 * l->packed, where not NULL, the same repacked, for products of l->packed_min_rows rows
 * and more. */
int tformer_blocks_kind_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                               int threads)
{
    if (l->packed && m >= l->packed_min_rows)
        return tformer_blocks_repacked_linear(l->kind, x, m, (const uint8_t *)l->packed,
                                              l->n_out, l->n_in, l->bias, y, threads);
    return tformer_blocks_linear(l->kind, x, m, (const uint8_t *)l->data, l->n_out, l->n_in,
                                 l->bias, y, threads);
}

/* --- Rows of a product over x rounded once (kinds.c's tformer_linear_rows) -------------- */

/* x (m x k) rounded to blocks as tformer_blocks_linear rounds it, for many products: a handle
 * for tformer_blocks_rows, or NULL where it could not allocate. */
void *tformer_blocks_round(const float *x, long m, long k, int threads)
{
    struct xblocks *xb = malloc(sizeof *xb);
    if (xb && xblocks_make(xb, x, m, k, threads)) {
        free(xb);
        return NULL;
    }
    return xb;
}

void tformer_blocks_round_free(void *xb)
{
    if (xb) {
        xblocks_free(xb);
        free(xb);
    }
}

/* y[i * ldy + r - r0] = (x_{i0 + i} W^T + b)_r for i < rows and r in [r0, r1), W l's blocks
 * (a kind of this file's), x tformer_blocks_round's: the products tformer_blocks_linear
 * computes for those outputs, bit for bit, on the calling thread. Returns 0, or -3 for a kind
 * not of this file. */
int tformer_blocks_rows(const struct tformer_linear *l, const void *xb, long i0, long rows,
                        float *y, long ldy, long r0, long r1)
{
    if (l->kind < KIND_Q8_0 || l->kind > KIND_Q5_1)
        return -3;
    const struct xblocks *x = xb;
    const long nb = l->n_in / BLOCK;
    const int isa = blocks_isa;
    const rows_fn run = isa == BISA_GENERIC      ? rows_generic
                        : isa == BISA_AVX_VNNI    ? rows_avxvnni
                        : isa == BISA_AVX512_VNNI ? rows_vnni512
                                                  : rows_avx2;
    /* W from row r0 on, and x from row i0 on, so that the products index y from 0 */
    const uint8_t *w = (const uint8_t *)l->data + r0 * nb * block_bytes(l->kind);
    const float *b = l->bias ? l->bias + r0 : NULL;
    for (long i = 0; i < rows; i += 4) {
        const long at = i0 + i;
        const struct xblocks view = {x->qx + at * nb * BLOCK, x->dx + at * nb, x->isum + at * nb,
                                     x->sx + at * nb, x->lane8 + at * nb * 8};
        run(l->kind, &view, 0, rows - i < 4 ? (int)(rows - i) : 4, w, b, y + i * ldy, ldy, nb, 0,
            r1 - r0);
    }
    return 0;
}

/* --- Quantizing: fp32 rows to blocks, as llama.cpp's reference quantizers (blocks.py's
 * quantize says the rules; it computes the same bytes in torch where this is not built) --- */

__attribute__((target("f16c"))) static void store_half(uint8_t *p, float v)
{
    const uint16_t h = (uint16_t)_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    memcpy(p, &h, sizeof h);
}

/* The value largest in size, with its sign (the first of equals), and the minimum and
 * maximum of a block. */
static void block_range(const float *x, float *big, float *lo, float *hi)
{
    float amax = 0.0f;
    *big = 0.0f;
    *lo = *hi = x[0];
    for (int j = 0; j < BLOCK; j++) {
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            *big = x[j];
        }
        *lo = x[j] < *lo ? x[j] : *lo;
        *hi = x[j] > *hi ? x[j] : *hi;
    }
}

/* One block of 32 values of a 4- or 5-bit kind: q = min(levels - 1, trunc(x / d + add)),
 * packed as nibbles (and qh). */
static void pack_small(const float *x, int kind, float inv, float lo, float add, uint8_t *blk)
{
    const int levels = five_bits(kind) ? 32 : 16;
    uint8_t q[BLOCK];
    for (int j = 0; j < BLOCK; j++) {
        const int v = (int)((x[j] - lo) * inv + add);
        q[j] = (uint8_t)(v < levels - 1 ? v : levels - 1);
    }
    const long size = block_bytes(kind);
    uint8_t *qs = blk + size - 16;
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)((q[j] & 15) | ((q[j + 16] & 15) << 4));
    if (five_bits(kind)) {
        uint32_t qh = 0;
        for (int j = 0; j < BLOCK; j++)
            qh |= (uint32_t)(q[j] >> 4) << j;
        memcpy(blk + size - 20, &qh, sizeof qh);
    }
}

static void quantize_block(const float *x, int kind, uint8_t *blk)
{
    float big, lo, hi;
    block_range(x, &big, &lo, &hi);
    if (kind == KIND_Q8_0) {
        const float d = fabsf(big) / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        store_half(blk, d);
        for (int j = 0; j < BLOCK; j++)
            blk[2 + j] = (uint8_t)(int8_t)roundf(x[j] * inv);
    } else if (has_min(kind)) { /* q4_1, q5_1: d = (max - min) / (levels - 1), m = min */
        const float d = (hi - lo) / (five_bits(kind) ? 31.0f : 15.0f);
        const float inv = d != 0.0f ? 1.0f / d : 0.0f;
        store_half(blk, d);
        store_half(blk + 2, lo);
        pack_small(x, kind, inv, lo, 0.5f, blk);
    } else { /* q4_0, q5_0: d = big / -(levels / 2), q = x / d + levels / 2 */
        const float half = five_bits(kind) ? 16.0f : 8.0f;
        const float d = big / -half, inv = d != 0.0f ? 1.0f / d : 0.0f;
        store_half(blk, d);
        pack_small(x, kind, inv, 0.0f, half + 0.5f, blk);
    }
}

/* n blocks of x (n * 32 fp32) to `kind`'s blocks (n * its bytes). Returns 0, or -3 for a
 * kind that is not one of this file's. */
int tformer_quantize_blocks(int kind, const float *x, long n, uint8_t *out, int threads)
{
    if (kind < KIND_Q8_0 || kind > KIND_Q5_1)
        return -3;
    const long size = block_bytes(kind);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 4096)
    for (long b = 0; b < n; b++)
        quantize_block(x + b * BLOCK, kind, out + b * size);  /* its branches: once a block */
    return 0;
}

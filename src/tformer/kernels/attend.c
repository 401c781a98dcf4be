/* A decoding step's attention: one query per row over the keys and values cached so far,
 * x86 with AVX2 and FMA; and attention over a paged cache in tiles (attend_tile.h, AVX-512
 * where the library's instruction set is AVX-512 VNNI, else AVX2), which serves decoding
 * steps and prompts' chunks alike.
 *
 * At a decoding step each of N rows (hypotheses) has one query per head and attends over the
 * T positions cached so far. torch's fused attention costs ~90 us a call at these sizes (a few
 * hundred thousand multiply-adds: OPUS-MT at beam 4 is 4 rows x 8 heads x ~30 positions x
 * 64), mostly fixed costs, and it needs the keys in one (N, H, T, d) block: so beam search
 * copies every layer's cache into the surviving hypotheses' order after every step
 * (DecoderCache.reorder), which is O(T) a step and O(T^2) a sentence.
 *
 * Here the keys stay where they were written, and a table tells where: rows[i, s] is the
 * buffer row that holds position s of query row i's history (its lineage through the
 * beams: position s was written, at step s, by whichever hypothesis occupied that row
 * then). Without a table, query row i reads buffer row i / group at every position: the
 * `group` beams of one sentence sharing its encoder output (cross-attention), or group 1
 * for a cache in query order. A bias (0 or -inf: the source's padding) can be added to the
 * scores of each buffer row.
 *
 * For each row i and head h:
 *
 *     score[s] = (q[i, h] . k[r(i, s), h, s]) * scale + bias[r(i, s), s]
 *     out[i, h] = sum_s exp(score[s] - max) v[r(i, s), h, s] / sum_s exp(score[s] - max)
 *
 * With grouped-query attention (Ainslie et al. 2023) the query heads share key/value heads
 * in groups of kv_group: query head h reads key/value head h / kv_group.
 *
 * Float rounding differs from torch's attention (other summation orders).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tformer.h"
#include "vecmath.h"

#define BLOCK 8 /* positions scored at once */

/* The dot products of q with the BLOCK keys k[0 .. BLOCK-1] (d floats each) into out: eight
 * independent sums, where one at a time would wait on each multiply-add before the next.
 * Each sum's lanes are added in the same tree whatever its place in the block, so a
 * position's score has the same bits in any block (the last block of a row repeats a key
 * to fill its places). */
static inline void dot_block(const float *q, const float *const k[BLOCK], long d, float *out)
{
    __m256 a[BLOCK];
    for (int b = 0; b < BLOCK; b++)
        a[b] = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= d; j += 8) {
        const __m256 qv = _mm256_loadu_ps(q + j);
        for (int b = 0; b < BLOCK; b++)
            a[b] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[b] + j), a[b]);
    }
    /* lanes 0-3 of `lo` hold the sums of a[0..3]'s halves, lanes 4-7 of the other halves */
    const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                                        _mm256_permute2f128_ps(lo, hi, 0x31)));
    for (; j < d; j++)
        for (int b = 0; b < BLOCK; b++)
            out[b] += q[j] * k[b][j];
}

/* Where the keys and values of a query row's positions lie. Position s of query row i is
 * at slot `slot` of buffer row `place(...)`: with a table (a lineage), buffer row
 * table[s], slot s; else buffer row i / group, slot s. */
struct places {
    const int64_t *rows; /* (n, ...) tables, rows_row apart; NULL: none */
    long rows_row, group;
};

static inline long place(const struct places *w, const int64_t *table, long i, long s,
                         long *slot)
{
    *slot = s;
    return table ? table[s] : i / w->group;
}

/* Ask for the n floats at p to be brought into the cache. */
static inline void fetch(const float *p, long n)
{
    for (long j = 0; j < n; j += 16)
        _mm_prefetch((const char *)(p + j), _MM_HINT_T0);
}

/* One query head's attention (query row i, head h, key/value head g) over positions
 * first .. T-1 of its history, into o (dv floats). bias: per buffer row, or NULL. */
static void attend_one(const float *qi, const float *k, long k_row, long k_head, long k_pos,
                       const float *v, long v_row, long v_head, long v_pos,
                       const struct places *w, const int64_t *table, long i, long g,
                       const float *bias, long bias_row, long first, long T, long d, long dv,
                       float scale, float *o)
{
    const long count = T - first;
    float p[count + BLOCK];
    float mx = -INFINITY;
    int nan = 0;
    long slot;
    for (long s0 = 0; s0 < count; s0 += BLOCK) {
        const float *keys[BLOCK];
        for (int b = 0; b < BLOCK; b++) {
            const long s = first + (s0 + b < count ? s0 + b : count - 1);
            const long r = place(w, table, i, s, &slot);
            keys[b] = k + r * k_row + g * k_head + slot * k_pos;
        }
        if (table) {
            /* Through a table the positions lie in rows the prefetcher cannot guess: fetch
             * the next block's keys and this block's values. */
            for (long s = first + s0 + BLOCK; s < first + s0 + 2 * BLOCK && s < T; s++) {
                const long r = place(w, table, i, s, &slot);
                fetch(k + r * k_row + g * k_head + slot * k_pos, d);
            }
            for (long s = first + s0; s < first + s0 + BLOCK && s < T; s++) {
                const long r = place(w, table, i, s, &slot);
                fetch(v + r * v_row + g * v_head + slot * v_pos, dv);
            }
        }
        dot_block(qi, keys, d, p + s0);
    }
    for (long c = 0; c < count; c++) {
        float x = p[c] * scale;
        if (bias)
            x += bias[place(w, table, i, first + c, &slot) * bias_row + first + c];
        p[c] = x;
        mx = x > mx ? x : mx;
        nan |= x != x;
    }
    if (nan) { /* as torch's softmax: a NaN score makes the row NaN (exp8 would zero it) */
        for (long j = 0; j < dv; j++)
            o[j] = NAN;
        return;
    }
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    long c = 0;
    for (; c + 8 <= count; c += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + c), m));
        _mm256_storeu_ps(p + c, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = sum_lanes(acc);
    for (; c < count; c++) {
        p[c] = expf(p[c] - mx);
        sum += p[c];
    }
    /* out = sum_s p[s] v[s], 64 floats at a time held in eight registers; a narrower rest
     * (dv not a multiple of 64) through memory, in the same order of operations. */
    long j0 = 0;
    for (; j0 + 64 <= dv; j0 += 64) {
        __m256 a[8];
        for (int u = 0; u < 8; u++)
            a[u] = _mm256_setzero_ps();
        for (c = 0; c < count; c++) {
            const __m256 wt = _mm256_set1_ps(p[c]);
            const long r = place(w, table, i, first + c, &slot);
            const float *vs = v + r * v_row + g * v_head + slot * v_pos + j0;
            for (int u = 0; u < 8; u++)
                a[u] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vs + 8 * u), a[u]);
        }
        for (int u = 0; u < 8; u++)
            _mm256_storeu_ps(o + j0 + 8 * u, a[u]);
    }
    for (long j = j0; j < dv; j++)
        o[j] = 0.0f;
    for (c = 0; c < count && j0 < dv; c++) {
        const long r = place(w, table, i, first + c, &slot);
        const float *vs = v + r * v_row + g * v_head + slot * v_pos;
        const __m256 wt = _mm256_set1_ps(p[c]);
        long j = j0;
        for (; j + 8 <= dv; j += 8)
            _mm256_storeu_ps(o + j, _mm256_fmadd_ps(wt, _mm256_loadu_ps(vs + j),
                                                    _mm256_loadu_ps(o + j)));
        for (; j < dv; j++)
            o[j] += p[c] * vs[j];
    }
    const float inv = 1.0f / sum;
    for (long j = 0; j < dv; j++)
        o[j] *= inv;
}

/* Strides are in floats (rows: in int64s); the last axis of q, k, v and out is contiguous.
 *   q     (n, H, d):  q + i * q_row + h * d
 *   k     key of buffer row r, key head g = h / kv_group, position s:
 *         k + r * k_row + g * k_head + s * k_pos
 *   v     the same with v's strides, dv floats
 *   rows  (n, >= length): rows + i * rows_row, each in [0, r); NULL: buffer row i / group
 *   bias  (buffer rows, >= length): bias + r * bias_row; NULL: none
 *   out   (n, H, dv), contiguous
 * own: where the `group` query rows of a buffer row are its last `own` positions in order
 * (several new tokens of one sequence; group = own), query row i reads positions up to
 * length - own + i % own and no later one (causal). 1: every row reads all `length`. */
int tformer_attend_step(const float *q, long q_row, const float *k, long k_row, long k_head,
                        long k_pos, const float *v, long v_row, long v_head, long v_pos,
                        const int64_t *rows, long rows_row, long group, const float *bias,
                        long bias_row, float *out, long n, long r, long heads, long kv_group,
                        long length, long own, long d, long dv, float scale, int threads)
{
    /* Returns -1, computing nothing, where the table names a row outside the r buffer rows. */
    if (rows)
        for (long i = 0; i < n; i++)
            for (long s = 0; s < length; s++)
                if (rows[i * rows_row + s] < 0 || rows[i * rows_row + s] >= r)
                    return -1;
    const struct places w = {rows, rows_row, group};
    const long work = n * heads * length * (d + dv);
    /* One thread runs the loop itself (an OpenMP region of one thread still costs ~0.4 us;
     * step.c's team calls this for a few heads at a time). */
#define ATTEND_STEP(ih)                                                                          \
    do {                                                                                       \
        const long i = (ih) / heads, h = (ih) % heads;                                         \
        const long T = length - own + 1 + i % own; /* the positions this row reads */          \
        attend_one(q + i * q_row + h * d, k, k_row, k_head, k_pos, v, v_row, v_head, v_pos, &w, \
                   rows ? rows + i * rows_row : 0, i, h / kv_group, bias, bias_row, 0, T, d,   \
                   dv, scale, out + (ih) * dv);                                                \
    } while (0)
    if (threads > 1 && work > 65536) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long ih = 0; ih < n * heads; ih++)
            ATTEND_STEP(ih);
    } else
        for (long ih = 0; ih < n * heads; ih++)
            ATTEND_STEP(ih);
#undef ATTEND_STEP
    return 0;
}

/* Paged attention in tiles (attend_tile.h): up to TILE queries that read the same
 * key/value head of one sequence's blocks (a group's query heads at a few consecutive new
 * tokens), a span of SPAN positions at a time while its keys and values are in the L1 cache,
 * so that a long history is read from memory once a tile instead of once a query. */
#define TILE 128 /* queries of a tile at most */
#define TILE_FLOATS 8192 /* and their sums of values (a tile's L1/L2 working set): 128 queries
                          * of 64 columns, 64 of 128, 32 of 256 */
#define SPAN 32 /* positions a query's softmax takes a step at a time */
#define COLUMNS 256 /* value columns a tile sums at once (wider values: the scores again) */

struct tile {
    const float *q[TILE]; /* each query's d floats */
    float *out[TILE];     /* and its dv outputs */
    long first[TILE], end[TILE]; /* the positions it reads: first .. end - 1 */
    float sink[TILE];     /* its head's sink logit, where `sinks` */
    int n, sinks;
};

/* Where positions s0 .. s0 + SPAN - 1 of key/value head g lie (found by walking the block
 * table): each one's key (its components kv->k_comp apart) and its value from column x0,
 * those before lo or from hi on given lo's and hi - 1's (no query reads them: their scores
 * are masked, their weights zeros, and the blocks they would name may be given back or not
 * yet held). Nothing is fetched ahead: a block holds a head's 16 positions in one run of
 * memory (4 KB at d = 64), which the hardware's prefetcher follows, and fetching the next
 * span's by hand made a decoding row's attention 10-20% slower. */
static void span_places(const struct tformer_kv *kv, long g, const int64_t *table, long block,
                        long x0, long s0, long lo, long hi, const float *keys[SPAN],
                        const float *values[SPAN])
{
    const float *k = kv->k + g * kv->k_head, *v = kv->v + g * kv->v_head + x0;
    const long start = s0 > lo ? s0 : lo;
    long c = start / block, slot = start % block;
    for (long s = start; s < s0 + SPAN && s < hi; s++) {
        keys[s - s0] = k + table[c] * kv->k_row + slot * kv->k_pos;
        values[s - s0] = v + table[c] * kv->v_row + slot * kv->v_pos;
        if (++slot == block) {
            slot = 0;
            c++;
        }
    }
    for (long b = 0; b < start - s0; b++) {
        keys[b] = keys[start - s0];
        values[b] = values[start - s0];
    }
    for (long b = hi - s0; b < SPAN; b++) {
        keys[b] = keys[b - 1];
        values[b] = values[b - 1];
    }
}

/* The first n lanes of eight, as a mask for AVX2's masked loads. */
static inline __m256i lanes_below(long n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#define AT_W 16
#define AT_NAME(name) name##_512
#define AT_TARGET __attribute__((target("avx2,fma,avx512f,avx512dq")))
#include "attend_tile.h"
#undef AT_W
#undef AT_NAME
#undef AT_TARGET
#define AT_W 8
#define AT_NAME(name) name##_256
#define AT_TARGET
#include "attend_tile.h"
#undef AT_W
#undef AT_NAME
#undef AT_TARGET

/* The same over a paged cache (Kwon et al. 2023): kv's rows are its blocks of `block`
 * positions, key head g of position `slot` of block b at kv->k + b * kv->k_row + g *
 * kv->k_head + slot * kv->k_pos (its components kv->k_comp apart; the values' contiguous). The
 * pool's keys lie turned (k_pos 1, k_comp block: attend_tile.h loads them where they lie);
 * any other layout is copied into that shape a span at a time. The n query rows are `tokens`
 * columns of new tokens of each of n / tokens sequences (row i: column i % tokens of
 * sequence i / tokens), of which sequence b's first counts[b] are real (counts NULL: all
 * `tokens`); the other rows' outputs are zeros. Sequence b's history is lengths[b]
 * positions, its real new tokens the last counts[b] of them (already stored), position s in
 * block table[b * table_row + s / block]; each token reads the positions up to its own
 * (causal), and with a sliding window > 0 only the last `window` of those (the blocks behind
 * may have been given back). The scores are q . k * scale, bounded by softcap * tanh(score /
 * softcap) where softcap > 0 (Gemma 2); with sinks (per query head, gpt-oss's), head h's
 * softmax has exp(sinks[h]) more in its denominator and nothing more in its sum of values.
 * The queries go in tiles (attend_tile.h): one sequence's query heads of a key/value head at
 * as many consecutive tokens as TILE queries and TILE_FLOATS sums of values allow (a larger
 * tile reads a long history from memory fewer times: 512 tokens over 7,000 positions of
 * SmolLM2's shape took 0.7-0.8x the time of 32-query tiles). Returns -1, computing nothing,
 * where a table names a block outside the pool or a sequence has fewer positions than real
 * new tokens. */
int tformer_attend_paged(const float *q, long q_row, const struct tformer_kv *kv,
                         const int64_t *table, long table_row, long block,
                         const int64_t *lengths, const int64_t *counts, long window, float *out,
                         long n, long tokens, long heads, long kv_group, long d, long dv,
                         float scale, float softcap, const float *sinks, int threads)
{
    long work = 0;
    for (long b = 0; b < n / tokens; b++) {
        const long real = counts ? counts[b] : tokens, T = lengths[b];
        const long first = window > 0 && T - real + 1 > window ? T - real + 1 - window : 0;
        if (T < real || real < 0 || real > tokens)
            return -1;
        for (long c = first / block; c <= (T - 1) / block; c++)
            if (table[b * table_row + c] < 0 || table[b * table_row + c] >= kv->rows)
                return -1;
        work += real * heads * (T - first) * (d + dv);
    }
    void (*const attend_tile)(const struct tile *, const struct tformer_kv *, long,
                              const int64_t *, long, long, long, long, float, float) =
        tformer_isa(-1) == TFORMER_ISA_AVX512_VNNI ? attend_tile_512 : attend_tile_256;
    const long columns = ((dv < COLUMNS ? dv : COLUMNS) + 15) / 16 * 16;
    const long most = TILE_FLOATS / columns < TILE ? TILE_FLOATS / columns : TILE;
    const long group = kv_group < most ? kv_group : most; /* query heads a tile takes */
    const long span = group < kv_group ? 1 : most / group; /* and tokens */
    const long heads_tiles = (kv_group + group - 1) / group;
    const long token_tiles = (tokens + span - 1) / span;
    const long kv_heads = heads / kv_group;
    const long tiles = n / tokens * kv_heads * heads_tiles * token_tiles;
    /* Tile u: sequence, key/value head, group of its query heads, tokens; interleaved over
     * the threads (a causal chunk's later tokens read more). */
#define ATTEND_TILE(u)                                                                           \
    do {                                                                                       \
        const long tt = (u) % token_tiles, hg = (u) / token_tiles % heads_tiles;               \
        const long g = (u) / token_tiles / heads_tiles % kv_heads;                             \
        const long b = (u) / token_tiles / heads_tiles / kv_heads;                             \
        const long real = counts ? counts[b] : tokens;                                         \
        const long h0 = g * kv_group + hg * group;                                             \
        const long h1 = h0 + group < (g + 1) * kv_group ? h0 + group : (g + 1) * kv_group;     \
        struct tile t;                                                                         \
        t.n = 0;                                                                               \
        t.sinks = sinks != NULL;                                                               \
        for (long tok = tt * span; tok < tokens && tok < (tt + 1) * span; tok++) {            \
            const long i = b * tokens + tok;                                                   \
            const long T = lengths[b] - real + 1 + tok; /* the positions it reads */           \
            for (long h = h0; h < h1; h++) {                                                   \
                if (tok >= real) { /* a column past the sequence's real tokens */              \
                    memset(out + (i * heads + h) * dv, 0, sizeof(float) * dv);                 \
                    continue;                                                                  \
                }                                                                              \
                t.q[t.n] = q + i * q_row + h * d;                                              \
                t.out[t.n] = out + (i * heads + h) * dv;                                       \
                t.sink[t.n] = sinks ? sinks[h] : 0.0f;                                         \
                t.first[t.n] = window > 0 && T > window ? T - window : 0;                     \
                t.end[t.n++] = T;                                                              \
            }                                                                                  \
        }                                                                                      \
        for (long x0 = 0; t.n && x0 < dv; x0 += COLUMNS)                                       \
            attend_tile(&t, kv, g, table + b * table_row, block, d, x0,                         \
                        dv - x0 < COLUMNS ? dv - x0 : COLUMNS, scale, softcap);                \
    } while (0)
    if (threads > 1 && work > 65536) {
#pragma omp parallel for schedule(static, 1) num_threads(threads)
        for (long u = 0; u < tiles; u++)
            ATTEND_TILE(u);
    } else
        for (long u = 0; u < tiles; u++)
            ATTEND_TILE(u);
#undef ATTEND_TILE
    return 0;
}

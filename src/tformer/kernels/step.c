/* One decoder layer's decoding step in one call, x86 with AVX2 and FMA: a translation
 * decoder's layer (self-attention, cross-attention, feed-forward) or a language model's
 * (GPT, Llama: self-attention and a plain or gated feed-forward).
 *
 * At a decoding step of beam search over one sentence (4 rows) a decoder layer makes six
 * matrix products of a few rows, two attentions over a few dozen positions, three layer
 * norms, three residual additions and an activation: ~25 small torch operations and module
 * calls. Each costs a few microseconds of Python and dispatch, while the products, which
 * have to stream the layer's weights from memory, take 10-100 us each: on OPUS-MT's shape
 * the calls around the arithmetic were about a third of a step. Here the layer runs as
 * the modules do, with the same products (kinds.c's table of them) and attention
 * (attend.c), in one call:
 *
 *     pre-norm:  x = x + SelfAttn(LN1(x));  x = x + CrossAttn(LN2(x));  x = x + FFN(LN3(x))
 *     post-norm: x = LN1(x + SelfAttn(x));  x = LN2(x + CrossAttn(x));  x = LN3(x + FFN(x))
 *
 * Self-attention stores the step's keys and values in the cache (position length - 1 of
 * buffer rows 0 .. n-1) and reads the history through a lineage table (attend.c); cross-
 * attention reads each sentence's encoder keys, shared by its n / sources beams, under a
 * padding bias. The products and attention give the bits the modules' kernels give on the
 * same inputs; the layer norm and the activation are written here and round differently
 * from torch's (within a few units in the last place).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tformer.h"
#include "vecmath.h"

/* y = (x - mean) / sqrt(var + eps) * weight + bias over each row of d, moments in double
 * (four lanes of each, then their sum). */
static void layer_norm(const struct tformer_norm *norm, const float *x, float *y, long m, long d)
{
    const long d4 = d & ~3L;
    for (long i = 0; i < m; i++) {
        const float *row = x + i * d;
        __m256d acc = _mm256_setzero_pd();
        for (long j = 0; j < d4; j += 4)
            acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm_loadu_ps(row + j)));
        double sum = sum_lanes_pd(acc);
        for (long j = d4; j < d; j++)
            sum += row[j];
        const double mean = sum / (double)d;
        const __m256d mv = _mm256_set1_pd(mean);
        acc = _mm256_setzero_pd();
        for (long j = 0; j < d4; j += 4) {
            const __m256d c = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(row + j)), mv);
            acc = _mm256_add_pd(acc, _mm256_mul_pd(c, c));
        }
        double sq = sum_lanes_pd(acc);
        for (long j = d4; j < d; j++)
            sq += (row[j] - mean) * (row[j] - mean);
        const float mu = (float)mean, rstd = (float)(1.0 / sqrt(sq / (double)d + norm->eps));
        const __m256 muv = _mm256_set1_ps(mu), rv = _mm256_set1_ps(rstd);
        const long d8 = d & ~7L;
        for (long j = 0; j < d8; j += 8) {
            const __m256 c = _mm256_sub_ps(_mm256_loadu_ps(row + j), muv);
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(c, rv), _mm256_loadu_ps(norm->weight + j));
            if (norm->bias)
                v = _mm256_add_ps(v, _mm256_loadu_ps(norm->bias + j));
            _mm256_storeu_ps(y + i * d + j, v);
        }
        for (long j = d8; j < d; j++) {
            const float v = (row[j] - mu) * rstd * norm->weight[j];
            y[i * d + j] = norm->bias ? v + norm->bias[j] : v;
        }
    }
}

/* y = x / sqrt(mean(x^2) + eps) * weight over each row of d (Zhang & Sennrich 2019), the
 * mean of squares in double. */
static void rms_norm(const struct tformer_norm *norm, const float *x, float *y, long m, long d)
{
    for (long i = 0; i < m; i++)
        rms_norm_row(x + i * d, norm->weight, norm->eps, y + i * d, d);
}

/* The norm of its kind over m rows of d; y may be x. */
static void normalize(const struct tformer_norm *norm, const float *x, float *y, long m, long d)
{
    if (norm->kind == TFORMER_NORM_RMS)
        rms_norm(norm, x, y, m, d);
    else
        layer_norm(norm, x, y, m, d);
}

/* The activation in place over count floats, eight lanes at a time where it has a vector
 * form. SiLU (vecmath.h's silu8) and GELU's tanh form take exp of -|u| only (exp8 is for
 * arguments <= 0): tanh(u) = sign(u) (1 - e) / (1 + e), with e = exp(-2 |u|). */
static void activate(int kind, float *x, long count)
{
    const long c8 = count & ~7L;
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f),
                 half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
    long j = 0;
    switch (kind) {
    case TFORMER_ACT_RELU: /* max(0, v) keeps a NaN, as torch's relu does */
        for (; j < c8; j += 8)
            _mm256_storeu_ps(x + j, _mm256_max_ps(zero, _mm256_loadu_ps(x + j)));
        for (; j < count; j++)
            x[j] = x[j] > 0.0f || x[j] != x[j] ? x[j] : 0.0f;
        break;
    case TFORMER_ACT_SILU:
        for (; j < c8; j += 8)
            _mm256_storeu_ps(x + j, silu8(_mm256_loadu_ps(x + j)));
        for (; j < count; j++)
            x[j] = silu1(x[j]);
        break;
    case TFORMER_ACT_GELU_TANH:
        for (; j < c8; j += 8) {
            const __m256 v = _mm256_loadu_ps(x + j);
            const __m256 u = _mm256_mul_ps(
                _mm256_set1_ps(0.7978845608028654f),
                _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(0.044715f),
                                               _mm256_mul_ps(_mm256_mul_ps(v, v), v))));
            const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_or_ps(u, sign)));
            const __m256 t = _mm256_or_ps(
                _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)),
                _mm256_and_ps(u, sign));
            _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_mul_ps(half, v), _mm256_add_ps(one, t)));
        }
        for (; j < count; j++) {
            const float v = x[j];
            x[j] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
        }
        break;
    default: /* TFORMER_ACT_GELU */
        for (; j < count; j++)
            x[j] = 0.5f * x[j] * (1.0f + erff(x[j] * (float)M_SQRT1_2));
        break;
    }
}

/* x (n x d_model) += y, then (post-norm) x = Norm(x). */
static void residual(int pre_norm, const struct tformer_norm *norm, float *x, const float *y,
                     long n, long d)
{
    for (long j = 0; j < n * d; j++)
        x[j] += y[j];
    if (!pre_norm)
        normalize(norm, x, x, n, d);
}

/* The G heads of a step's key k (G x dk) and value v (G x dv) stored at position s of
 * buffer row r of kv (a paged pool's turned keys component by component). */
static void store_kv(const struct tformer_kv *kv, long r, long s, const float *k,
                     const float *v, long G, long dk, long dv)
{
    for (long g = 0; g < G; g++) {
        float *key = kv->k + r * kv->k_row + g * kv->k_head + s * kv->k_pos;
        if (kv->k_comp == 1)
            memcpy(key, k + g * dk, sizeof(float) * dk);
        else
            for (long c = 0; c < dk; c++)
                key[c * kv->k_comp] = k[g * dk + c];
        memcpy(kv->v + r * kv->v_row + g * kv->v_head + s * kv->v_pos, v + g * dv,
               sizeof(float) * dv);
    }
}

/* attend.c's step over the keys and values of `kv`: rows and group as tformer_attend_step
 * takes them. Returns its status (-1: `rows` names a row outside kv's). */
static int attend(const struct tformer_decoder_layer *l, const float *q, long q_row,
                  const struct tformer_kv *kv, const int64_t *rows, long rows_row, long group,
                  const float *bias, long bias_row, float *out, long n, long T, int threads)
{
    return tformer_attend_step(q, q_row, kv->k, kv->k_row, kv->k_head, kv->k_pos, kv->v,
                               kv->v_row, kv->v_head, kv->v_pos, rows, rows_row, group, bias,
                               bias_row, out, n, kv->rows, l->heads, 1, T, 1, l->d_head,
                               l->d_value, l->scale, threads);
}

/* The sublayer's input: Norm(x) into h (pre-norm), or x itself (post-norm). */
static const float *sublayer_input(int pre_norm, const struct tformer_norm *norm,
                                   const float *x, float *h, long n, long d)
{
    if (!pre_norm)
        return x;
    normalize(norm, x, h, n, d);
    return h;
}

/* Floats of scratch tformer_decoder_layer_step needs per row: the normed input, q|k|v or
 * the FFN's hidden layer, the attention's output, a sublayer's output. */
long tformer_decoder_layer_scratch(const struct tformer_decoder_layer *l)
{
    const long width = l->qkv.n_out, ff = l->up.n_out;
    const long d = l->self_out.n_out, widest = width > ff ? width : ff;
    return d + widest + l->heads * l->d_value + d;
}

/* Where a decoder layer's step keeps its self-attention's keys and values: buffer rows
 * 0 .. n-1 of kv, the new position at length - 1 and every position read through a
 * lineage's rows (table NULL); or a paged pool's blocks, row i's listed at table + i *
 * table_row, lengths[i] its positions with the new one. */
struct self_places {
    const struct tformer_kv *kv;
    long length;
    const int64_t *rows;
    long rows_row;
    const int64_t *table;
    long table_row, block;
    const int64_t *lengths;
};

/* One step of layer `l` for n rows of x (n x d_model, updated in place): its self-attention
 * over `self` (above), cross-attention over the encoder's keys and values of cross_kv->rows
 * sentences (n a multiple of it: beam i reads sentence i / (n / sentences)) with a
 * (sentences x >= source_len) bias on their scores, bias_row apart (NULL: none), and the
 * feed-forward layer. scratch: n * tformer_decoder_layer_scratch(l) floats, the caller's
 * (a step of many rows needs a megabyte: allocated anew at each call, the system hands it
 * over zeroed page by page, which cost as much as the layer's attention). Returns 0; -1
 * where a product could not allocate; -2 where a lineage names a buffer row outside the
 * cache (the layer's output is then meaningless). */
static int decoder_layer_step(const struct tformer_decoder_layer *l, float *x, long n,
                              const struct self_places *self,
                              const struct tformer_kv *cross_kv, long source_len,
                              const float *bias, long bias_row, float *scratch, int threads)
{
    const long d = l->self_out.n_out, H = l->heads, dk = l->d_head, dv = l->d_value;
    const long qk = H * dk, width = l->qkv.n_out, ff = l->up.n_out;
    const long widest = width > ff ? width : ff;
    float *h = scratch, *wide = h + n * d, *att = wide + n * widest, *out = att + n * H * dv;
    int status = 0;

    /* self-attention */
    const float *in = sublayer_input(l->pre_norm, &l->self_norm, x, h, n, d);
    if ((status = tformer_linear(&l->qkv, in, wide, n, threads)))
        return status;
    for (long i = 0; i < n; i++) {
        long r = i, s = self->length - 1;
        if (self->table) {
            s = self->lengths[i] - 1;
            r = self->table[i * self->table_row + s / self->block];
            s %= self->block;
        }
        store_kv(self->kv, r, s, wide + i * width + qk, wide + i * width + 2 * qk, H, dk, dv);
    }
    if (self->table)
        status = tformer_attend_paged(wide, width, self->kv, self->table, self->table_row,
                                      self->block, self->lengths, NULL, 0, att, n, 1, H, 1,
                                      dk, dv, l->scale, 0.0f, NULL, threads);
    else
        status = attend(l, wide, width, self->kv, self->rows, self->rows_row, 1, NULL, 0, att,
                        n, self->length, threads);
    if (status)
        return -2;
    if ((status = tformer_linear(&l->self_out, att, out, n, threads)))
        return status;
    residual(l->pre_norm, &l->self_norm, x, out, n, d);

    /* cross-attention */
    in = sublayer_input(l->pre_norm, &l->cross_norm, x, h, n, d);
    if ((status = tformer_linear(&l->cross_q, in, wide, n, threads)))
        return status;
    attend(l, wide, qk, cross_kv, NULL, 0, n / cross_kv->rows, bias, bias_row, att, n,
           source_len, threads);
    if ((status = tformer_linear(&l->cross_out, att, out, n, threads)))
        return status;
    residual(l->pre_norm, &l->cross_norm, x, out, n, d);

    /* feed-forward */
    in = sublayer_input(l->pre_norm, &l->ff_norm, x, h, n, d);
    if ((status = tformer_linear(&l->up, in, wide, n, threads)))
        return status;
    activate(l->activation, wide, n * ff);
    if ((status = tformer_linear(&l->down, wide, out, n, threads)))
        return status;
    residual(l->pre_norm, &l->ff_norm, x, out, n, d);
    return 0;
}

/* decoder_layer_step over a cache of self_kv->rows >= n buffer rows, its keys and values
 * in query order: the step's go to position length - 1 of rows 0 .. n-1, and attention
 * reads positions 0 .. length-1 through rows (n x >= length int64, rows_row apart). */
int tformer_decoder_layer_step(const struct tformer_decoder_layer *l, float *x, long n,
                               const struct tformer_kv *self_kv, long length,
                               const int64_t *rows, long rows_row,
                               const struct tformer_kv *cross_kv, long source_len,
                               const float *bias, long bias_row, float *scratch, int threads)
{
    const struct self_places self = {self_kv, length, rows, rows_row, NULL, 0, 0, NULL};
    return decoder_layer_step(l, x, n, &self, cross_kv, source_len, bias, bias_row, scratch,
                              threads);
}

/* decoder_layer_step over a paged pool (decoding/beam_pool.py's): self_kv's rows are its
 * blocks of `block` positions, row i's listed in order at table + i * table_row; lengths[i]
 * counts its positions with the new one, stored at position lengths[i] - 1. Returns -2,
 * storing nothing, where a table names a block outside the pool or a length is below 1. */
int tformer_decoder_layer_step_paged(const struct tformer_decoder_layer *l, float *x, long n,
                                     const struct tformer_kv *self_kv, const int64_t *table,
                                     long table_row, long block, const int64_t *lengths,
                                     const struct tformer_kv *cross_kv, long source_len,
                                     const float *bias, long bias_row, float *scratch,
                                     int threads)
{
    for (long i = 0; i < n; i++) {
        if (lengths[i] < 1)
            return -2;
        for (long b = 0; b <= (lengths[i] - 1) / block; b++)
            if (table[i * table_row + b] < 0 || table[i * table_row + b] >= self_kv->rows)
                return -2;
    }
    const struct self_places self = {self_kv, 0, NULL, 0, table, table_row, block, lengths};
    return decoder_layer_step(l, x, n, &self, cross_kv, source_len, bias, bias_row, scratch,
                              threads);
}

/* --- A step's threads: one parallel region, its work taken in chunks ----------------------
 *
 * A batch-1 step of a 16-layer model makes ~100 products and attentions of tens of
 * microseconds to a millisecond each. Threaded one at a time, each is an OpenMP region whose
 * end waits for every thread of the team. Where another process wants a core, the system
 * sets one of them aside for its time slice (milliseconds) at any such end, while the others
 * spin in libgomp (GOMP_SPINCOUNT, ~10 ms here) on the core it could have had: on two cores
 * beside two busy processes, SmolLM2-135M decoded at 0.7-12 tokens/s on two threads against
 * 30-50 on one.
 *
 * So a step opens one region for all its layers (`team_step`). Thread 0 runs the layers; a
 * product or an attention is a job of chunks (rows of W, or a query row's head), which every
 * thread of the team takes from one counter as it comes, thread 0
 * too. Thread 0 waits only for the chunks taken, never for a thread that has not come: a
 * thread held back costs at most the chunk it holds, and the step goes at least at one
 * thread's pace. A waiting thread spins TEAM_SPIN pauses (~70 us) and then yields its core.
 *
 * A chunk is the same kernel on the same data, on one thread: a product's rows of W (a
 * multiple of PIECE_ROWS, so its tiles are the whole product's) through the kinds' table,
 * a head through attend.c. Every output has the bits it has from the whole call, on any
 * number of threads (tests/kernels/test_lm_step.py). */

#define TEAM_CLOSED 0xffffffffu /* a ticket's chunk while thread 0 writes the next job */
#define TEAM_SPIN 2000 /* pauses (~35 ns each on a Xeon of 2023) before a waiting thread yields */
#define PIECE_ROWS 16 /* a product's chunks start at multiples of these rows of W */
#define PIECE_BYTES (256L << 10) /* a thread's share of a product is cut into chunks of W's
                                  * bytes this size at least, four at most: each chunk rounds
                                  * x to blocks again (a microsecond) */
#define MAX_PIECES 512

typedef int (*chunk_fn)(const void *job, long chunk);

/* A product's chunk: rows r0 .. r1 of l (a kind's product, or a stack's part), written to
 * y's columns r0 .. r1 (rows y_row apart), `bias` (a stack's) added after where not NULL. */
struct piece {
    const struct tformer_linear *l;
    long r0, r1, y_row;
    float *y;
    const float *bias;
};

struct products {
    const float *x;
    long m;
    struct piece pieces[MAX_PIECES];
};

struct team {
    uint64_t ticket; /* the job's generation << 32 | its next chunk to take (TEAM_CLOSED) */
    long chunks, done; /* the job's chunks, those finished */
    int stop, status; /* the step is over; a chunk's first failure */
    chunk_fn run; /* the job, valid for a thread that took one of its chunks */
    const void *job;
    struct products products; /* the current product job's pieces */
};

/* How a step runs its products and attentions: each threaded on its own (team NULL), or
 * in chunks taken by the team's threads. */
struct exec {
    struct team *team;
    int threads;
};

static void team_wait(const uint64_t *ticket, uint64_t seen)
{
    for (long spin = 0; __atomic_load_n(ticket, __ATOMIC_ACQUIRE) == seen; spin++)
        if (spin < TEAM_SPIN)
            _mm_pause();
        else
            sched_yield();
}

/* Take and run the job's chunks until none is left; *seen: the ticket last read. A chunk is
 * taken by moving the ticket from (generation, i) to (generation, i + 1), so a thread that
 * read an earlier job's ticket takes nothing of the next: thread 0 closes the ticket (a new
 * generation) before it writes a job, and the count of chunks after. */
static void team_chunks(struct team *tm, uint64_t *seen)
{
    for (;;) {
        uint64_t t = __atomic_load_n(&tm->ticket, __ATOMIC_ACQUIRE);
        uint32_t i;
        do {
            i = (uint32_t)t;
            if (i == TEAM_CLOSED || (long)i >= __atomic_load_n(&tm->chunks, __ATOMIC_ACQUIRE)) {
                *seen = t;
                return;
            }
        } while (!__atomic_compare_exchange_n(&tm->ticket, &t, t + 1, 0, __ATOMIC_ACQUIRE,
                                              __ATOMIC_ACQUIRE));
        const int status = tm->run(tm->job, i);
        if (status) {
            int none = 0;
            __atomic_compare_exchange_n(&tm->status, &none, status, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED);
        }
        __atomic_add_fetch(&tm->done, 1, __ATOMIC_RELEASE);
    }
}

/* A thread other than 0: the jobs' chunks until the step is over. */
static void team_worker(struct team *tm)
{
    uint64_t seen;
    for (;;) {
        team_chunks(tm, &seen);
        if (__atomic_load_n(&tm->stop, __ATOMIC_ACQUIRE))
            return;
        team_wait(&tm->ticket, seen);
    }
}

/* Thread 0: a new generation of the ticket, no chunk to take; the job may be written. */
static void team_close(struct team *tm)
{
    const uint64_t generation = (__atomic_load_n(&tm->ticket, __ATOMIC_RELAXED) >> 32) + 1;
    __atomic_store_n(&tm->ticket, generation << 32 | TEAM_CLOSED, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* Thread 0: run the job written since team_close, `chunks` chunks of run(job, i), with
 * whichever threads come; returns the first failure of one, or 0. */
static int team_run(struct team *tm, chunk_fn run, const void *job, long chunks)
{
    tm->run = run;
    tm->job = job;
    __atomic_store_n(&tm->done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->status, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->chunks, chunks, __ATOMIC_RELAXED);
    const uint64_t t = __atomic_load_n(&tm->ticket, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->ticket, t & ~(uint64_t)TEAM_CLOSED, __ATOMIC_RELEASE);
    uint64_t seen;
    team_chunks(tm, &seen);
    for (long spin = 0; __atomic_load_n(&tm->done, __ATOMIC_ACQUIRE) < chunks; spin++)
        if (spin < TEAM_SPIN)
            _mm_pause();
        else
            sched_yield();
    return __atomic_load_n(&tm->status, __ATOMIC_RELAXED);
}

/* Thread 0, at the end: the others leave. */
static void team_stop(struct team *tm)
{
    __atomic_store_n(&tm->stop, 1, __ATOMIC_RELEASE);
    team_close(tm);
}

/* body(exec, arg) in one parallel region of `threads` threads, thread 0 running it and the
 * others taking its jobs' chunks; run plainly where the team cannot be had. */
static int team_step(int threads, int (*body)(const struct exec *, void *), void *arg)
{
    struct team *tm = threads > 1 ? calloc(1, sizeof *tm) : NULL;
    if (!tm) {
        const struct exec plain = {NULL, threads};
        return body(&plain, arg);
    }
    int status = 0;
#pragma omp parallel num_threads(threads)
    {
        if (omp_get_thread_num() == 0) {
            const int size = omp_get_num_threads();
            const struct exec e = {size > 1 ? tm : NULL, size};
            status = body(&e, arg);
            team_stop(tm);
        } else
            team_worker(tm);
    }
    free(tm);
    return status;
}

/* Whether a team's chunks can compute l's product of m rows: a kind whose rows of W lie one
 * after another (not the repacked copy of W a product of packed_min_rows rows takes), or a
 * stack of such parts. */
static int splits(const struct tformer_linear *l, long m)
{
    if (l->n_out == 0)
        return 1;
    if (l->kind == TFORMER_STACK) {
        const struct tformer_linear *parts = l->data;
        for (int p = 0; p < l->layout; p++)
            if (!splits(&parts[p], m))
                return 0;
        return 1;
    }
    if (l->kind < TFORMER_FP32 || l->kind >= TFORMER_KINDS)
        return 0;
    return !(l->packed && m >= l->packed_min_rows);
}

/* Bytes a row of W takes in l's kind. */
static long row_bytes(const struct tformer_linear *l)
{
    int32_t geometry[3];
    if (tformer_kind_geometry(l->kind, geometry))
        return 0;
    return l->n_in / geometry[0] * geometry[1];
}

/* One piece: rows r0 .. r1 of W through the kind's product, on this thread. */
static int run_piece(const void *job, long chunk)
{
    const struct products *pr = job;
    const struct piece *p = &pr->pieces[chunk];
    const long rows = p->r1 - p->r0, m = pr->m;
    struct tformer_linear sub = *p->l;
    sub.n_out = (int32_t)rows;
    sub.data = (const uint8_t *)p->l->data + p->r0 * row_bytes(p->l);
    sub.scales = p->l->scales ? p->l->scales + p->r0 : NULL;
    sub.bias = p->l->bias ? p->l->bias + p->r0 : NULL;
    sub.packed = NULL;
    sub.packed_sums = NULL;
    int status;
    if (m == 1) {
        float *y = p->y + p->r0;
        if ((status = tformer_linear(&sub, pr->x, y, 1, 1)))
            return status;
        if (p->bias)
            for (long r = 0; r < rows; r++)
                y[r] += p->bias[p->r0 + r];
        return 0;
    }
    float *part = malloc((size_t)(m * rows) * sizeof(float));
    if (!part)
        return -1;
    if (!(status = tformer_linear(&sub, pr->x, part, m, 1)))
        for (long i = 0; i < m; i++) {
            float *y = p->y + i * p->y_row + p->r0;
            for (long r = 0; r < rows; r++)
                y[r] = p->bias ? part[i * rows + r] + p->bias[p->r0 + r] : part[i * rows + r];
        }
    free(part);
    return status;
}

/* l's rows cut into pieces (after pr->pieces[*count]) for a team of `threads`: each thread's
 * share in 1 to 4 pieces of PIECE_BYTES at least. Returns 0, or -1 where they do not fit. */
static int cut(struct products *pr, long *count, const struct tformer_linear *l, float *y,
               long y_row, const float *bias, int threads)
{
    if (l->kind == TFORMER_STACK) {
        const struct tformer_linear *parts = l->data;
        long col = 0;
        for (int p = 0; p < l->layout; p++) {
            if (cut(pr, count, &parts[p], y + col, y_row, l->bias ? l->bias + col : NULL,
                    threads))
                return -1;
            col += parts[p].n_out;
        }
        return 0;
    }
    const long n = l->n_out, share = row_bytes(l) * n / threads;
    const long each = share / PIECE_BYTES, pieces = threads * (each < 1 ? 1 : each > 4 ? 4 : each);
    const long rows = ((n + pieces - 1) / pieces + PIECE_ROWS - 1) / PIECE_ROWS * PIECE_ROWS;
    for (long r0 = 0; r0 < n; r0 += rows) {
        if (*count == MAX_PIECES)
            return -1;
        pr->pieces[(*count)++] = (struct piece){l, r0, r0 + rows < n ? r0 + rows : n, y_row, y,
                                                bias};
    }
    return 0;
}

/* ys[j] (m x ls[j]->n_out) = x ls[j]'s product, for `count` linears of the same input. */
static int exec_linears(const struct exec *e, const struct tformer_linear *const *ls,
                        float *const *ys, int count, const float *x, long m)
{
    struct team *tm = e->team;
    int status = 0;
    if (tm) {
        team_close(tm);
        struct products *pr = &tm->products;
        long pieces = 0;
        pr->x = x;
        pr->m = m;
        for (int j = 0; j < count && !status; j++)
            status = cut(pr, &pieces, ls[j], ys[j], ls[j]->n_out, NULL, e->threads);
        if (!status)
            return team_run(tm, run_piece, pr, pieces);
    }
    /* no team, or more pieces than it holds: each product threaded on its own */
    for (int j = 0; j < count; j++)
        if ((status = tformer_linear(ls[j], x, ys[j], m, tm ? 1 : e->threads)))
            return status;
    return 0;
}

static int exec_linear(const struct exec *e, const struct tformer_linear *l, const float *x,
                       float *y, long m)
{
    return exec_linears(e, &l, &y, 1, x, m);
}

/* A language model's layer (models/gpt.py's GPTBlock), pre- or post-norm:
 *
 *     x = x + Attn(Norm1(x));  x = x + FFN(Norm2(x))
 *     Attn:  q|k|v = h Wqkv^T + b;  q, k = Rotary(QKNorm(q)), Rotary(QKNorm(k)) per head;
 *            the step's k, v stored; softmax(q k^T * scale + bias) v over every position
 *     FFN:   down(act(up(h))), or gated: down(act(gate(h)) * up(h)), or a mixture of
 *            experts' router and chosen experts (experts.c's tformer_moe_step)
 *
 * with heads query heads sharing kv_heads key/value heads (grouped-query attention). */

/* Rotate the first `rotated` dimensions of each of `heads` heads of d floats at x by the
 * angles whose cosines and sines are cos[0 .. rotated/2) and sin[...]: the products and
 * sums in the order layers/rotary.py writes them, so the bits are torch's. */
static void rotate(float *x, long heads, long d, long rotated, int interleaved, const float *cos,
                   const float *sin)
{
    const long half = rotated / 2;
    for (long h = 0; h < heads; h++) {
        float *v = x + h * d;
        if (interleaved)
            for (long j = 0; j < half; j++) {
                const float a = v[2 * j], b = v[2 * j + 1];
                v[2 * j] = a * cos[j] - b * sin[j];
                v[2 * j + 1] = a * sin[j] + b * cos[j];
            }
        else
            for (long j = 0; j < half; j++) {
                const float a = v[j], b = v[j + half];
                v[j] = a * cos[j] - b * sin[j];
                v[j + half] = b * cos[j] + a * sin[j];
            }
    }
}

/* Floats of scratch tformer_lm_layer_step needs per row: the normed input, q|k|v or the
 * FFN's hidden layers (two where gated), the attention's output, a sublayer's output. */
long tformer_lm_layer_scratch(const struct tformer_lm_layer *l)
{
    const long width = l->qkv.n_out, d = l->out.n_out;
    const long ff = (l->gate.n_out ? 2 : 1) * l->up.n_out;
    return d + (width > ff ? width : ff) + l->heads * l->d_value + d;
}

/* The step's queries and keys normed and rotated per head in place, and its keys and
 * values stored at position s of buffer row r of kv: one row of qkv (q | k | v). */
static void place_qkv(const struct tformer_lm_layer *l, float *qkv, long r, long s,
                      const struct tformer_kv *kv, const float *cos, const float *sin)
{
    const long H = l->heads, G = l->kv_heads, dk = l->d_head, dv = l->d_value;
    float *q = qkv, *k = q + H * dk, *v = k + G * dk;
    if (l->q_norm.weight) {
        normalize(&l->q_norm, q, q, H, dk);
        normalize(&l->k_norm, k, k, G, dk);
    }
    if (l->rotated) {
        rotate(q, H, dk, l->rotated, l->interleaved, cos, sin);
        rotate(k, G, dk, l->rotated, l->interleaved, cos, sin);
    }
    store_kv(kv, r, s, k, v, G, dk, dv);
}

/* The layer's attention for n rows (`tokens` new tokens of each of n / tokens sequences)
 * over kv's buffer rows in query order: tformer_attend_step's, or in a team one chunk per
 * query row and head (over a paged cache: per query row and key/value head, its query heads
 * one tile), through the same kernel on one thread. */
struct lm_attention {
    const struct tformer_lm_layer *l;
    const float *q; /* q|k|v rows, q_row apart */
    long q_row;
    const struct tformer_kv *kv;
    const float *bias; /* per sequence, bias_row apart, or NULL */
    long bias_row;
    float *out; /* (n, heads, d_value) */
    long n, tokens, length;
    /* a paged cache (tformer_attend_paged's): table != NULL */
    const int64_t *table, *lengths;
    long table_row, block, window;
};

static int lm_attention_chunk(const void *job, long chunk)
{
    const struct lm_attention *a = job;
    const struct tformer_lm_layer *l = a->l;
    const struct tformer_kv *kv = a->kv;
    const long H = l->heads, dk = l->d_head, dv = l->d_value;
    if (a->table) {
        /* a paged cache: query row i's heads of key/value head g, one tile that reads the
         * head's blocks once (tformer_attend_paged's), over the positions row i reads */
        const long group = H / l->kv_heads;
        const long i = chunk / l->kv_heads, g = chunk % l->kv_heads, b = i / a->tokens;
        const int64_t length = a->lengths[b] - a->tokens + 1 + i % a->tokens;
        struct tformer_kv head = *kv; /* key/value head g alone */
        head.k += g * kv->k_head;
        head.v += g * kv->v_head;
        return tformer_attend_paged(a->q + i * a->q_row + g * group * dk, a->q_row, &head,
                                    a->table + b * a->table_row, a->table_row, a->block,
                                    &length, NULL, a->window, a->out + (i * H + g * group) * dv,
                                    1, 1, group, group, dk, dv, l->scale, 0.0f, NULL, 1);
    }
    const long i = chunk / H, h = chunk % H, g = h / (H / l->kv_heads), b = i / a->tokens;
    const float *q = a->q + i * a->q_row + h * dk;
    float *out = a->out + (i * H + h) * dv;
    return tformer_attend_step(q, a->q_row, kv->k + b * kv->k_row + g * kv->k_head, kv->k_row,
                               kv->k_head, kv->k_pos, kv->v + b * kv->v_row + g * kv->v_head,
                               kv->v_row, kv->v_head, kv->v_pos, NULL, 0, 1,
                               a->bias ? a->bias + b * a->bias_row : NULL, a->bias_row, out, 1,
                               kv->rows, 1, 1, a->length - a->tokens + 1 + i % a->tokens, 1, dk,
                               dv, l->scale, 1);
}

static int exec_attention(const struct exec *e, const struct lm_attention *a)
{
    const struct tformer_lm_layer *l = a->l;
    const struct tformer_kv *kv = a->kv;
    if (e->team) {
        team_close(e->team);
        return team_run(e->team, lm_attention_chunk, a,
                        a->n * (a->table ? l->kv_heads : l->heads));
    }
    if (a->table)
        return tformer_attend_paged(a->q, a->q_row, kv, a->table, a->table_row, a->block,
                                    a->lengths, NULL, a->window, a->out, a->n, a->tokens,
                                    l->heads, l->heads / l->kv_heads, l->d_head, l->d_value,
                                    l->scale, 0.0f, NULL, e->threads);
    return tformer_attend_step(a->q, a->q_row, kv->k, kv->k_row, kv->k_head, kv->k_pos, kv->v,
                               kv->v_row, kv->v_head, kv->v_pos, NULL, 0, a->tokens, a->bias,
                               a->bias_row, a->out, a->n, kv->rows, l->heads,
                               l->heads / l->kv_heads, a->length, a->tokens, l->d_head,
                               l->d_value, l->scale, e->threads);
}

/* Where a layer's step works: h, the normed input; wide, q|k|v or the FFN's hidden layers;
 * att, the attention's output; out, a sublayer's output (tformer_lm_layer_scratch). */
struct lm_scratch {
    float *h, *wide, *att, *out;
};

static struct lm_scratch lm_scratch(const struct tformer_lm_layer *l, float *scratch, long n)
{
    const long d = l->out.n_out, width = l->qkv.n_out;
    const long hidden = (l->gate.n_out ? 2 : 1) * l->up.n_out;
    const long widest = width > hidden ? width : hidden;
    struct lm_scratch s = {scratch, scratch + n * d, NULL, NULL};
    s.att = s.wide + n * widest;
    s.out = s.att + n * l->heads * l->d_value;
    return s;
}

/* The layer's attention sublayer on n rows of x (in place): q|k|v, `place` (normed, rotated
 * and stored keys and values), the attention `a` (its q, out and l filled in here), the
 * output projection and the residual. */
static int lm_self_attention(const struct exec *e, const struct tformer_lm_layer *l, float *x,
                             long n, const struct lm_scratch *s, struct lm_attention *a,
                             void (*place)(const struct tformer_lm_layer *, float *, long,
                                           const void *),
                             const void *where)
{
    const long d = l->out.n_out, width = l->qkv.n_out;
    int status;
    const float *in = sublayer_input(l->pre_norm, &l->attn_norm, x, s->h, n, d);
    if ((status = exec_linear(e, &l->qkv, in, s->wide, n)))
        return status;
    for (long i = 0; i < n; i++)
        place(l, s->wide + i * width, i, where);
    a->l = l;
    a->q = s->wide;
    a->q_row = width;
    a->out = s->att;
    a->n = n;
    if (exec_attention(e, a))
        return -2;
    if ((status = exec_linear(e, &l->out, s->att, s->out, n)))
        return status;
    residual(l->pre_norm, &l->attn_norm, x, s->out, n, d);
    return 0;
}

/* The layer's feed-forward sublayer on n rows of x (in place); gated, its gate and up
 * products are one job. */
static int lm_feed_forward(const struct exec *e, const struct tformer_lm_layer *l, float *x,
                           long n, const struct lm_scratch *s)
{
    const long d = l->out.n_out, ff = l->up.n_out;
    float *wide = s->wide;
    int status = 0;
    const float *in = sublayer_input(l->pre_norm, &l->ff_norm, x, s->h, n, d);
    if (l->moe) { /* a mixture of experts (experts.c, its own threads: no team runs it) */
        if ((status = tformer_moe_step(l->moe, in, n, s->out, e->threads)))
            return status;
        residual(l->pre_norm, &l->ff_norm, x, s->out, n, d);
        return 0;
    }
    if (l->gate.n_out) {
        float *up = wide + n * ff;
        const struct tformer_linear *both[2] = {&l->gate, &l->up};
        float *const ys[2] = {wide, up};
        if ((status = exec_linears(e, both, ys, 2, in, n)))
            return status;
        activate(l->activation, wide, n * ff);
        for (long j = 0; j < n * ff; j++)
            wide[j] *= up[j];
    } else {
        if ((status = exec_linear(e, &l->up, in, wide, n)))
            return status;
        activate(l->activation, wide, n * ff);
    }
    if ((status = exec_linear(e, &l->down, wide, s->out, n)))
        return status;
    residual(l->pre_norm, &l->ff_norm, x, s->out, n, d);
    return 0;
}

/* Where tformer_lm_step's rows store their keys and values: row i is token i % tokens of
 * sequence i / tokens, at position length - tokens + i % tokens of buffer row i / tokens. */
struct lm_places {
    const struct tformer_kv *kv;
    long tokens, length;
    const float *cos, *sin;
};

static void lm_place(const struct tformer_lm_layer *l, float *qkv, long i, const void *where)
{
    const struct lm_places *p = where;
    const long half = l->rotated / 2;
    place_qkv(l, qkv, i / p->tokens, p->length - p->tokens + i % p->tokens, p->kv,
              p->cos ? p->cos + i * half : NULL, p->sin ? p->sin + i * half : NULL);
}

/* tformer_lm_step's arguments, for its body on a team. */
struct lm_step {
    const struct tformer_lm_layer *const *layers;
    const struct tformer_kv *const *kvs;
    long count;
    float *x;
    long n, tokens, length;
    const float *cos, *sin, *bias;
    long bias_row;
    float *scratch;
};

static int lm_step_body(const struct exec *e, void *arg)
{
    const struct lm_step *st = arg;
    int status = 0;
    for (long j = 0; j < st->count && !status; j++) {
        const struct tformer_lm_layer *l = st->layers[j];
        const struct lm_scratch s = lm_scratch(l, st->scratch, st->n);
        const struct lm_places places = {st->kvs[j], st->tokens, st->length, st->cos, st->sin};
        struct lm_attention a = {.kv = st->kvs[j], .bias = st->bias, .bias_row = st->bias_row,
                                 .tokens = st->tokens, .length = st->length};
        status = lm_self_attention(e, l, st->x, st->n, &s, &a, lm_place, &places);
        if (!status)
            status = lm_feed_forward(e, l, st->x, st->n, &s);
    }
    return status;
}

/* Whether a team's chunks can compute every product of the layer for n rows. */
static int lm_splits(const struct tformer_lm_layer *l, long n)
{
    return !l->moe && splits(&l->qkv, n) && splits(&l->out, n) && splits(&l->gate, n) && splits(&l->up, n)
           && splits(&l->down, n);
}

/* body(exec, arg), `count` layers' steps for n rows: in one parallel region (team_step)
 * where threads > 1 and a team can cut every product of every layer, else plainly. */
static int lm_layers_step(const struct tformer_lm_layer *const *layers, long count, long n,
                          int threads, int (*body)(const struct exec *, void *), void *arg)
{
    int team = threads > 1;
    for (long j = 0; j < count && team; j++)
        team = lm_splits(layers[j], n);
    if (team)
        return team_step(threads, body, arg);
    const struct exec plain = {NULL, threads};
    return body(&plain, arg);
}

/* `count` layers' steps, one after another, on n rows of x (n x d_model, updated in place):
 * layer j over its cache kvs[j], each as tformer_lm_layer_step takes it (scratch: n *
 * the largest tformer_lm_layer_scratch). With threads > 1 and products that a team can cut
 * (every kind's, below the rows from which a kind reads its repacked copy), the steps run in
 * one parallel region (team_step). Returns 0, or -1 where a product could not allocate. */
int tformer_lm_step(const struct tformer_lm_layer *const *layers,
                    const struct tformer_kv *const *kvs, long count, float *x, long n, long tokens,
                    long length, const float *cos, const float *sin, const float *bias,
                    long bias_row, float *scratch, int threads)
{
    struct lm_step st = {layers, kvs, count, x, n, tokens, length, cos, sin, bias, bias_row,
                         scratch};
    return lm_layers_step(layers, count, n, threads, lm_step_body, &st);
}

/* One step of layer `l` for n rows of x (n x d_model, updated in place): `tokens` new
 * tokens of each of n / tokens sequences, row i token i % tokens of sequence i / tokens.
 *   kv, length: the layer's cache, buffer row b for sequence b; the step's keys and values
 *       go to positions length - tokens .. length - 1, and each token attends positions
 *       0 .. its own (causal).
 *   cos, sin: (n x rotated/2) the angles of each row's position (NULL without rotary).
 *   bias: (n / tokens x >= length) added to each sequence's scores, bias_row apart: 0 or
 *       -inf for padding and positions outside a sliding window (NULL: none).
 *   scratch: n * tformer_lm_layer_scratch(l) floats, the caller's.
 * Returns 0, or -1 where a product could not allocate. */
int tformer_lm_layer_step(const struct tformer_lm_layer *l, float *x, long n, long tokens,
                          const struct tformer_kv *kv, long length, const float *cos,
                          const float *sin, const float *bias, long bias_row, float *scratch,
                          int threads)
{
    return tformer_lm_step(&l, &kv, 1, x, n, tokens, length, cos, sin, bias, bias_row, scratch,
                           threads);
}

/* Where tformer_lm_step_paged's rows store their keys and values. */
struct paged_places {
    const struct tformer_kv *kv;
    const int64_t *table, *lengths;
    long table_row, block, tokens;
    const float *cos, *sin;
};

static void paged_place(const struct tformer_lm_layer *l, float *qkv, long i, const void *where)
{
    const struct paged_places *p = where;
    const long half = l->rotated / 2, b = i / p->tokens;
    const long s = p->lengths[b] - p->tokens + i % p->tokens;
    place_qkv(l, qkv, p->table[b * p->table_row + s / p->block], s % p->block, p->kv,
              p->cos ? p->cos + i * half : NULL, p->sin ? p->sin + i * half : NULL);
}

/* tformer_lm_step_paged's arguments, for its body on a team. */
struct paged_step {
    const struct tformer_lm_layer *const *layers;
    const struct tformer_kv *const *kvs;
    long count;
    float *x;
    long n;
    struct paged_places places; /* kv: each layer's in turn */
    struct lm_attention a;      /* the same */
    float *scratch;
};

static int paged_body(const struct exec *e, void *arg)
{
    const struct paged_step *st = arg;
    int status = 0;
    for (long j = 0; j < st->count && !status; j++) {
        const struct tformer_lm_layer *l = st->layers[j];
        const struct lm_scratch s = lm_scratch(l, st->scratch, st->n);
        struct paged_places places = st->places;
        struct lm_attention a = st->a;
        places.kv = a.kv = st->kvs[j];
        status = lm_self_attention(e, l, st->x, st->n, &s, &a, paged_place, &places);
        if (!status)
            status = lm_feed_forward(e, l, st->x, st->n, &s);
    }
    return status;
}

/* `count` layers' steps over a paged cache, one after another, as tformer_lm_step runs them
 * over contiguous ones (one parallel region where a team can cut every product): `tokens`
 * new tokens of each of n / tokens sequences (row i of x: token i % tokens of sequence i /
 * tokens). Layer j's keys and values are kvs[j], whose buffer rows are its blocks of `block`
 * positions (every layer's the same blocks), and sequence b's positions lie in the blocks
 * its table names (table + b * table_row, as tformer_attend_paged reads it). lengths[b]
 * counts sequence b's positions with the new ones, which are stored at positions lengths[b]
 * - tokens .. lengths[b] - 1 (their blocks given); each reads the positions up to its own,
 * with window > 0 only the last `window`. cos, sin (per row) and scratch as tformer_lm_step
 * takes them. Returns 0; -1 where a product could not allocate; -2 where a table names a
 * block outside the pool or a sequence has fewer positions than new tokens (nothing is
 * stored then). */
int tformer_lm_step_paged(const struct tformer_lm_layer *const *layers,
                          const struct tformer_kv *const *kvs, long count, float *x, long n,
                          long tokens, const int64_t *table, long table_row, long block,
                          const int64_t *lengths, long window, const float *cos,
                          const float *sin, float *scratch, int threads)
{
    for (long i = 0; i < n; i++) {
        const long b = i / tokens, s = lengths[b] - tokens + i % tokens;
        if (s < 0)
            return -2;
        for (long j = 0; j < count; j++)
            if (table[b * table_row + s / block] < 0
                || table[b * table_row + s / block] >= kvs[j]->rows)
                return -2;
    }
    struct paged_step st = {
        layers, kvs, count, x, n,
        {NULL, table, lengths, table_row, block, tokens, cos, sin},
        {.tokens = tokens, .table = table, .lengths = lengths, .table_row = table_row,
         .block = block, .window = window},
        scratch};
    return lm_layers_step(layers, count, n, threads, paged_body, &st);
}

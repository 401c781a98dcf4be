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
#include <stdint.h>
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

/* One step of layer `l` for n rows of x (n x d_model, updated in place).
 *   self_kv, length: the layer's cache (self_kv->rows >= n buffer rows); the step's keys
 *       and values go to position length - 1 of buffer rows 0 .. n-1, and attention reads
 *       positions 0 .. length-1 through rows (n x >= length int64, rows_row apart).
 *   cross_kv, source_len, bias: the encoder's keys and values of cross_kv->rows sentences
 *       (n a multiple of it: beam i reads sentence i / (n / sentences)), and a (sentences x
 *       >= source_len) bias on their scores, bias_row apart (NULL: none).
 *   scratch: n * tformer_decoder_layer_scratch(l) floats, the caller's (a step of many rows
 *       needs a megabyte: allocated anew at each call, the system hands it over zeroed page
 *       by page, which cost as much as the layer's attention).
 * Returns 0; -1 where a product could not allocate; -2 where `rows` names a buffer row
 * outside the cache's (the layer's output is then meaningless). */
int tformer_decoder_layer_step(const struct tformer_decoder_layer *l, float *x, long n,
                               const struct tformer_kv *self_kv, long length,
                               const int64_t *rows, long rows_row,
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
    const long s = length - 1;
    for (long i = 0; i < n; i++)
        for (long hd = 0; hd < H; hd++) {
            memcpy(self_kv->k + i * self_kv->k_row + hd * self_kv->k_head + s * self_kv->k_pos,
                   wide + i * width + qk + hd * dk, sizeof(float) * dk);
            memcpy(self_kv->v + i * self_kv->v_row + hd * self_kv->v_head + s * self_kv->v_pos,
                   wide + i * width + 2 * qk + hd * dv, sizeof(float) * dv);
        }
    if (attend(l, wide, width, self_kv, rows, rows_row, 1, NULL, 0, att, n, length, threads))
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
    for (long g = 0; g < G; g++) {
        memcpy(kv->k + r * kv->k_row + g * kv->k_head + s * kv->k_pos, k + g * dk,
               sizeof(float) * dk);
        memcpy(kv->v + r * kv->v_row + g * kv->v_head + s * kv->v_pos, v + g * dv,
               sizeof(float) * dv);
    }
}

/* The layer's feed-forward sublayer on n rows of x (in place), over the caller's scratch. */
static int lm_feed_forward(const struct tformer_lm_layer *l, float *x, float *h, float *wide,
                           float *out, long n, int threads)
{
    const long d = l->out.n_out, ff = l->up.n_out;
    int status = 0;
    const float *in = sublayer_input(l->pre_norm, &l->ff_norm, x, h, n, d);
    if (l->moe) { /* a mixture of experts (experts.c) */
        if ((status = tformer_moe_step(l->moe, in, n, out, threads)))
            return status;
        residual(l->pre_norm, &l->ff_norm, x, out, n, d);
        return 0;
    }
    if (l->gate.n_out) {
        float *up = wide + n * ff;
        if ((status = tformer_linear(&l->gate, in, wide, n, threads))
            || (status = tformer_linear(&l->up, in, up, n, threads)))
            return status;
        activate(l->activation, wide, n * ff);
        for (long j = 0; j < n * ff; j++)
            wide[j] *= up[j];
    } else {
        if ((status = tformer_linear(&l->up, in, wide, n, threads)))
            return status;
        activate(l->activation, wide, n * ff);
    }
    if ((status = tformer_linear(&l->down, wide, out, n, threads)))
        return status;
    residual(l->pre_norm, &l->ff_norm, x, out, n, d);
    return 0;
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
    const long d = l->out.n_out, H = l->heads, dv = l->d_value, half = l->rotated / 2;
    const long width = l->qkv.n_out, ff = l->up.n_out;
    const long hidden = (l->gate.n_out ? 2 : 1) * ff;
    const long widest = width > hidden ? width : hidden;
    float *h = scratch, *wide = h + n * d, *att = wide + n * widest, *out = att + n * H * dv;
    int status = 0;

    /* self-attention */
    const float *in = sublayer_input(l->pre_norm, &l->attn_norm, x, h, n, d);
    if ((status = tformer_linear(&l->qkv, in, wide, n, threads)))
        return status;
    for (long i = 0; i < n; i++)
        place_qkv(l, wide + i * width, i / tokens, length - tokens + i % tokens, kv,
                  cos ? cos + i * half : NULL, sin ? sin + i * half : NULL);
    tformer_attend_step(wide, width, kv->k, kv->k_row, kv->k_head, kv->k_pos, kv->v, kv->v_row,
                        kv->v_head, kv->v_pos, NULL, 0, tokens, bias, bias_row, att, n,
                        kv->rows, H, H / l->kv_heads, length, tokens, l->d_head, dv, l->scale,
                        threads);
    if ((status = tformer_linear(&l->out, att, out, n, threads)))
        return status;
    residual(l->pre_norm, &l->attn_norm, x, out, n, d);
    return lm_feed_forward(l, x, h, wide, out, n, threads);
}

/* One step of layer `l` over a paged cache: `tokens` new tokens of each of n / tokens
 * sequences (row i of x: token i % tokens of sequence i / tokens). kv's buffer rows are its
 * kv->rows blocks of `block` positions, and sequence b's positions lie in the blocks its
 * table names (table + b * table_row, as tformer_attend_paged reads it). lengths[b] counts
 * sequence b's positions with the new ones, which are stored at positions lengths[b] -
 * tokens .. lengths[b] - 1 (their blocks given); each reads the positions up to its own,
 * with window > 0 only the last `window`. cos, sin (per row) and scratch as
 * tformer_lm_layer_step takes them.
 * Returns 0; -1 where a product could not allocate; -2 where a table names a block outside
 * the pool or a sequence has fewer positions than new tokens (nothing is stored then). */
int tformer_lm_layer_step_paged(const struct tformer_lm_layer *l, float *x, long n, long tokens,
                                const struct tformer_kv *kv, const int64_t *table,
                                long table_row, long block, const int64_t *lengths,
                                long window, const float *cos, const float *sin,
                                float *scratch, int threads)
{
    const long d = l->out.n_out, H = l->heads, dv = l->d_value, half = l->rotated / 2;
    const long width = l->qkv.n_out, ff = l->up.n_out;
    const long hidden = (l->gate.n_out ? 2 : 1) * ff;
    const long widest = width > hidden ? width : hidden;
    float *h = scratch, *wide = h + n * d, *att = wide + n * widest, *out = att + n * H * dv;
    int status = 0;

    for (long i = 0; i < n; i++) {
        const long b = i / tokens, s = lengths[b] - tokens + i % tokens;
        if (s < 0 || table[b * table_row + s / block] < 0
            || table[b * table_row + s / block] >= kv->rows)
            return -2;
    }
    /* self-attention */
    const float *in = sublayer_input(l->pre_norm, &l->attn_norm, x, h, n, d);
    if ((status = tformer_linear(&l->qkv, in, wide, n, threads)))
        return status;
    for (long i = 0; i < n; i++) {
        const long b = i / tokens, s = lengths[b] - tokens + i % tokens;
        place_qkv(l, wide + i * width, table[b * table_row + s / block], s % block, kv,
                  cos ? cos + i * half : NULL, sin ? sin + i * half : NULL);
    }
    if (tformer_attend_paged(wide, width, kv->k, kv->k_row, kv->k_head, kv->k_pos, kv->v,
                             kv->v_row, kv->v_head, kv->v_pos, table, table_row, block,
                             lengths, window, att, n, tokens, kv->rows, H, H / l->kv_heads,
                             l->d_head, dv, l->scale, threads))
        return -2;
    if ((status = tformer_linear(&l->out, att, out, n, threads)))
        return status;
    residual(l->pre_norm, &l->attn_norm, x, out, n, d);
    return lm_feed_forward(l, x, h, wide, out, n, threads);
}

/* A decoding step's attention: one query per row over the keys and values cached so far,
 * x86 with AVX2 and FMA.
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
 * Float rounding differs from torch's attention (other summation orders).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vecmath.h"

static inline float dot(const float *a, const float *b, long d)
{
    __m256 acc = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= d; j += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    float s = sum_lanes(acc);
    for (; j < d; j++)
        s += a[j] * b[j];
    return s;
}

/* y += w * x over dv floats. */
static inline void axpy(float *y, float w, const float *x, long dv)
{
    const __m256 wv = _mm256_set1_ps(w);
    long j = 0;
    for (; j + 8 <= dv; j += 8)
        _mm256_storeu_ps(y + j, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
    for (; j < dv; j++)
        y[j] += w * x[j];
}

/* Strides are in floats (rows: in int64s); the last axis of q, k, v and out is contiguous.
 *   q     (n, H, d):  q + i * q_row + h * d
 *   k     key of buffer row r, head h, position s: k + r * k_row + h * k_head + s * k_pos
 *   v     the same with v's strides, dv floats
 *   rows  (n, >= T): rows + i * rows_row, each in [0, r); NULL: buffer row i / group
 *   bias  (buffer rows, >= T): bias + r * bias_row; NULL: none
 *   out   (n, H, dv), contiguous */
int tformer_attend_step(const float *q, long q_row, const float *k, long k_row, long k_head,
                        long k_pos, const float *v, long v_row, long v_head, long v_pos,
                        const int64_t *rows, long rows_row, long group, const float *bias,
                        long bias_row, float *out, long n, long r, long heads, long T, long d,
                        long dv, float scale, int threads)
{
    /* Returns -1, computing nothing, where the table names a row outside the r buffer rows. */
    if (rows)
        for (long i = 0; i < n; i++)
            for (long s = 0; s < T; s++)
                if (rows[i * rows_row + s] < 0 || rows[i * rows_row + s] >= r)
                    return -1;
    const long work = n * heads * T * (d + dv);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && work > 65536)
    for (long ih = 0; ih < n * heads; ih++) {
        const long i = ih / heads, h = ih % heads;
        const float *qi = q + i * q_row + h * d;
        const int64_t *lineage = rows ? rows + i * rows_row : 0;
        float p[T];
        float mx = -INFINITY;
        int nan = 0;
        for (long s = 0; s < T; s++) {
            const long r = lineage ? lineage[s] : i / group;
            float x = dot(qi, k + r * k_row + h * k_head + s * k_pos, d) * scale;
            if (bias)
                x += bias[r * bias_row + s];
            p[s] = x;
            mx = x > mx ? x : mx;
            nan |= x != x;
        }
        float *o = out + ih * dv;
        if (nan) { /* as torch's softmax: a NaN score makes the row NaN (exp8 would zero it) */
            for (long j = 0; j < dv; j++)
                o[j] = NAN;
            continue;
        }
        const __m256 m = _mm256_set1_ps(mx);
        __m256 acc = _mm256_setzero_ps();
        long s = 0;
        for (; s + 8 <= T; s += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), m));
            _mm256_storeu_ps(p + s, e);
            acc = _mm256_add_ps(acc, e);
        }
        float sum = sum_lanes(acc);
        for (; s < T; s++) {
            p[s] = expf(p[s] - mx);
            sum += p[s];
        }
        for (long j = 0; j < dv; j++)
            o[j] = 0.0f;
        for (s = 0; s < T; s++) {
            const long r = lineage ? lineage[s] : i / group;
            axpy(o, p[s], v + r * v_row + h * v_head + s * v_pos, dv);
        }
        const float inv = 1.0f / sum;
        for (long j = 0; j < dv; j++)
            o[j] *= inv;
    }
    return 0;
}

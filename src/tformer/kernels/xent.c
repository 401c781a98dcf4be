/* Cross-entropy with label smoothing over rows of logits, forward and backward, without
 * writing out the log-probabilities; x86 with AVX2 and FMA.
 *
 * Row i of x (n x v) holds one token's logits and target[i] its right answer. With
 * lse = log sum_j exp(x_j) and the target distribution putting 1 - eps on the target and
 * eps / v on every token,
 *
 *     loss_i = (1 - eps) (lse - x_target) + eps (lse - sum_j x_j / v)
 *     d loss_i / d x_j = softmax(x)_j - (1 - eps) [j = target] - eps / v
 *
 * torch's F.cross_entropy writes log_softmax(x) into a new n x v tensor, reads it for the
 * loss, and its backward reads it again to write the gradient. Here the forward pass reads
 * each row twice (its maximum and sum, then the sum of exponentials) and keeps two floats a
 * row, its maximum m and log sum_j exp(x_j - m) (lse = m + that, which is not rounded to one
 * float: at |m| ~ 16 that rounding alone would move a probability near 1 by 1e-6); the
 * backward pass reads the row once more and writes the gradient.
 * Rows whose target is `ignore` (padding) have loss 0 and gradient 0. A row with a NaN or
 * +inf logit has loss NaN, as with torch (the exp below would pass over a NaN as a 0), so
 * that training sees a broken step as one and skips it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "tformer.h"
#include "vecmath.h"

/* loss[i], and stats[2 i] = the row's maximum, stats[2 i + 1] = log sum_j exp(x_j - max),
 * for each of the n rows. The targets are in [0, v) or `ignore`: the caller checks. */
void tformer_xent_forward(const float *x, const int64_t *target, long n, long v, float eps,
                          int64_t ignore, float *loss, float *stats, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 1)
    for (long i = 0; i < n; i++) {
        if (target[i] == ignore) {
            loss[i] = 0.0f;
            stats[2 * i] = stats[2 * i + 1] = 0.0f;
            continue;
        }
        const float *row = x + i * v;
        __m256 vmax = _mm256_set1_ps(-INFINITY), vsum = _mm256_setzero_ps();
        long j = 0;
        for (; j + 8 <= v; j += 8) {
            const __m256 xv = _mm256_loadu_ps(row + j);
            vmax = _mm256_max_ps(vmax, xv);
            vsum = _mm256_add_ps(vsum, xv);
        }
        float mx = max_lanes(vmax, -INFINITY), total = sum_lanes(vsum);
        for (long t = j; t < v; t++) {
            mx = row[t] > mx ? row[t] : mx;
            total += row[t];
        }
        if (isnan(total) || total == INFINITY) { /* a NaN or +inf logit, as torch: NaN */
            loss[i] = NAN;
            stats[2 * i] = stats[2 * i + 1] = NAN;
            continue;
        }
        const float logsum = logf(sum_exp(row, v, mx));
        stats[2 * i] = mx;
        stats[2 * i + 1] = logsum;
        /* lse - x = logsum - (x - max), as log_softmax computes it. The smoothing term only
         * where eps > 0: with a -inf logit it is infinite, and 0 * inf would be NaN. */
        loss[i] = (1.0f - eps) * (logsum - (row[target[i]] - mx));
        if (eps != 0.0f)
            loss[i] += eps * (logsum - (total / (float)v - mx));
    }
}

/* grad (n x v) = g[i] * (softmax(x_i) - (1 - eps) onehot(target[i]) - eps / v), with
 * softmax(x)_j = exp((x_j - max) - logsum) from the stats the forward pass kept; 0 on
 * ignored rows. g[i] is the gradient of whatever reduced the row losses with respect to
 * loss[i]. */
void tformer_xent_backward(const float *x, const int64_t *target, const float *stats,
                           const float *g, long n, long v, float eps, int64_t ignore,
                           float *grad, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 1)
    for (long i = 0; i < n; i++) {
        const float *row = x + i * v;
        float *out = grad + i * v;
        if (target[i] == ignore) {
            for (long j = 0; j < v; j++)
                out[j] = 0.0f;
            continue;
        }
        const float gi = g[i], spread = eps / (float)v;
        const float mx = stats[2 * i], logsum = stats[2 * i + 1];
        const __m256 m = _mm256_set1_ps(mx), l = _mm256_set1_ps(logsum);
        const __m256 vg = _mm256_set1_ps(gi), vspread = _mm256_set1_ps(spread);
        long j = 0;
        for (; j + 8 <= v; j += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(row + j), m), l));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(vg, _mm256_sub_ps(p, vspread)));
        }
        for (; j < v; j++)
            out[j] = gi * (expf((row[j] - mx) - logsum) - spread);
        out[target[i]] -= gi * (1.0f - eps);
    }
}

/* RMSNorm for training (Zhang & Sennrich 2019): y = x r w over each row of d floats, with
 * r = 1 / sqrt(mean(x^2) + eps), forward and backward; x86 with AVX2 and FMA.
 *
 * As torch operations the norm is five passes forward (square, mean, rsqrt, two products)
 * and about ten backward, each writing a tensor of the input's size. Here the forward pass
 * reads a row twice (its sum of squares in double, then the product: the decoding step's
 * rms_norm_row) and keeps r, one float a row;
 * with xh = x r and g = dy w, the backward pass is
 *
 *     dx = r (g - xh mean(g xh)),    dw = sum over rows of dy xh,
 *
 * one pass over the rows for dx and one over column blocks for dw, each column summed over
 * the rows in order: the same bits on any number of threads.
 */
#include <immintrin.h>
#include <math.h>

#include "tformer.h"
#include "vecmath.h"

#define COLUMNS 64 /* the width of a column block of dw */

/* The rows as the decoding step norms them (vecmath.h's rms_norm_row), keeping r. */
void tformer_rms_norm_forward(const float *x, const float *w, long rows, long d, float eps,
                              float *y, float *r, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 8)
    for (long i = 0; i < rows; i++)
        r[i] = rms_norm_row(x + i * d, w, eps, y + i * d, d);
}

/* dx (rows x d) and, where dw is not NULL, dw (d) from the upstream gradient dy and the r
 * the forward pass kept. */
void tformer_rms_norm_backward(const float *x, const float *w, const float *r, const float *dy,
                               long rows, long d, float *dx, float *dw, int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 8)
    for (long i = 0; i < rows; i++) {
        const float *xi = x + i * d, *gi = dy + i * d;
        float *out = dx + i * d;
        const float ri = r[i];
        /* mean(g xh) = r mean(dy w x) */
        __m256 acc = _mm256_setzero_ps();
        long j = 0;
        for (; j + 8 <= d; j += 8)
            acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(gi + j), _mm256_loadu_ps(w + j)),
                                  _mm256_loadu_ps(xi + j), acc);
        float s = sum_lanes(acc);
        for (; j < d; j++)
            s += gi[j] * w[j] * xi[j];
        const float c = ri * ri * s / (float)d; /* mean(g xh) r: the multiple of x taken off */
        const __m256 rv = _mm256_set1_ps(ri), cv = _mm256_set1_ps(c);
        for (j = 0; j + 8 <= d; j += 8) {
            const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(gi + j), _mm256_loadu_ps(w + j));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(rv, _mm256_fnmadd_ps(
                                                         cv, _mm256_loadu_ps(xi + j), g)));
        }
        for (; j < d; j++)
            out[j] = ri * (gi[j] * w[j] - c * xi[j]);
    }
    if (!dw)
        return;
    const long blocks = (d + COLUMNS - 1) / COLUMNS;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && blocks > 1)
    for (long b = 0; b < blocks; b++) {
        const long j0 = b * COLUMNS, j1 = j0 + COLUMNS < d ? j0 + COLUMNS : d;
        for (long j = j0; j < j1; j++)
            dw[j] = 0.0f;
        for (long i = 0; i < rows; i++) {
            const float ri = r[i], *xi = x + i * d, *gi = dy + i * d;
            for (long j = j0; j < j1; j++)
                dw[j] += gi[j] * (xi[j] * ri);
        }
    }
}

/* SwiGLU's gate for training: out = silu(g) * u and its gradients, one pass each; x86 with
 * AVX2 and FMA.
 *
 * A gated feed-forward layer (Shazeer 2020) computes down(silu(gate(x)) * up(x)). As torch
 * operations that is silu, then a product (two passes over the hidden layer, and silu's
 * output kept for the backward pass), and backward three passes: the product's two
 * gradients and silu's. With s = sigmoid(g),
 *
 *     out = g s u,    d out / d u = g s,    d out / d g = u s (1 + g (1 - s)),
 *
 * so one pass reads g and u and writes out, and one reads g, u and the upstream gradient and
 * writes both gradients; nothing but g and u is kept. sigmoid takes exp of -|g| only (exp8
 * is for arguments <= 0): s = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|).
 */
#include <immintrin.h>
#include <math.h>

#include "tformer.h"
#include "vecmath.h"

#define LANES 8
#define BLOCK 4096 /* floats a thread takes at a time */

/* out[j] = silu(g[j]) * u[j] for j < n. */
void tformer_silu_mul_forward(const float *g, const float *u, float *out, long n, int threads)
{
    const long blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && blocks > 1)
    for (long b = 0; b < blocks; b++) {
        const long end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        long j = b * BLOCK;
        for (; j + LANES <= end; j += LANES)  /* silu as the decoding step takes it */
            _mm256_storeu_ps(out + j, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + j)),
                                                    _mm256_loadu_ps(u + j)));
        for (; j < end; j++)
            out[j] = silu1(g[j]) * u[j];
    }
}

/* dg[j], du[j]: the gradients of out = silu(g) * u given dout, for j < n. */
void tformer_silu_mul_backward(const float *g, const float *u, const float *dout, float *dg,
                               float *du, long n, int threads)
{
    const long blocks = (n + BLOCK - 1) / BLOCK;
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && blocks > 1)
    for (long b = 0; b < blocks; b++) {
        const long end = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        long j = b * BLOCK;
        for (; j + LANES <= end; j += LANES) {
            const __m256 gv = _mm256_loadu_ps(g + j), d = _mm256_loadu_ps(dout + j);
            const __m256 s = sigmoid8(gv);
            /* s (1 + g (1 - s)) */
            const __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one));
            _mm256_storeu_ps(du + j, _mm256_mul_ps(d, _mm256_mul_ps(gv, s)));
            _mm256_storeu_ps(dg + j, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(u + j)),
                                                   slope));
        }
        for (; j < end; j++) {
            const float s = sigmoid1(g[j]);
            du[j] = dout[j] * g[j] * s;
            dg[j] = dout[j] * u[j] * (s * (1.0f + g[j] * (1.0f - s)));
        }
    }
}

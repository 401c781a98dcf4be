/* Rounding fp32 rows to int8 with one scale each, and scaling 32-bit integer sums back: the
 * two ends of every int8 product (int8.c, int8_packed.c) and of torch's (quantize.py). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tformer.h"
#include "vecmath.h"

/* The rows of x (m x k, fp32) in int8 with one scale each, the same numbers as
 * quantize_rows's torch formula: scale = max |x| / 127 (1 for an all-zero row), then
 * x / scale rounded half to even and clamped to [-127, 127]. Each step rounds as torch's
 * does (a true division, no reciprocal), so the two agree bit for bit. */
void tformer_quantize_rows(const float *x, int8_t *xq, float *scale, long m, long k)
{
    const long k8 = k & ~7L;
    const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f),
                 hi = _mm256_set1_ps(127.0f);
    for (long i = 0; i < m; i++) {
        const float *row = x + i * k;
        int8_t *out = xq + i * k;
        __m256 mx = _mm256_setzero_ps();
        for (long j = 0; j < k8; j += 8)
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + j)));
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, mx);
        for (int l = 0; l < 8; l++)
            amax = lanes[l] > amax ? lanes[l] : amax;
        for (long j = k8; j < k; j++)
            amax = fabsf(row[j]) > amax ? fabsf(row[j]) : amax;
        float s = amax / 127.0f;
        if (!(s > 0.0f))
            s = 1.0f;
        scale[i] = s;
        const __m256 sv = _mm256_set1_ps(s);
        for (long j = 0; j < k8; j += 8) {
            __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + j), sv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i n = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
            const __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n),
                                                _mm256_extracti128_si256(n, 1));
            _mm_storel_epi64((__m128i *)(out + j), _mm_packs_epi16(n16, n16));
        }
        for (long j = k8; j < k; j++) {
            const float v = nearbyintf(row[j] / s);
            out[j] = (int8_t)(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v);
        }
    }
}

/* y = (float) acc * (xscale[i] * wscale[j]) + b[j], in place over an m x n matrix of 32-bit
 * integer sums (torch._int_mm's output): int8_reference's scaling in one pass instead of
 * four, with the same fp32 operations in the same order. b may be NULL. */
void tformer_scale_int8(int32_t *acc, const float *xscale, const float *wscale, const float *b,
                        long m, long n, int threads)
{
    const long n8 = n & ~7L;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m * n > 65536)
    for (long i = 0; i < m; i++) {
        int32_t *row = acc + i * n;
        const __m256 xs = _mm256_set1_ps(xscale[i]);
        for (long j = 0; j < n8; j += 8) {
            const __m256 s = _mm256_mul_ps(xs, _mm256_loadu_ps(wscale + j));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((__m256i *)(row + j))), s);
            if (b)
                v = _mm256_add_ps(v, _mm256_loadu_ps(b + j));
            _mm256_storeu_ps((float *)(row + j), v);
        }
        for (long j = n8; j < n; j++) {
            float v = (float)row[j] * (xscale[i] * wscale[j]);
            if (b)
                v = v + b[j];
            memcpy(row + j, &v, sizeof v); /* the float takes the integer's place */
        }
    }
}

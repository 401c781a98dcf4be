/* Vector helpers the kernels share (x86 with AVX2 and FMA), one copy for every file that
 * includes this one. */
#ifndef TFORMER_VECMATH_H
#define TFORMER_VECMATH_H

#include <immintrin.h>
#include <math.h>

/* The sum of the eight lanes of v. */
static inline float sum_lanes(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for eight floats, to about an ulp: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by the
 * polynomial of the Cephes library's expf, and 2^n added to the exponent bits. Inputs below
 * -87.3 (where expf leaves the normal range) give 0: the kernels take exp of logit - max
 * (or of logit - logsumexp), never above 0, and terms that small do not change a sum that
 * holds exp(0) = 1, nor a probability by more than its rounding. */
static inline __m256 exp8(__m256 x)
{
    const __m256 tiny = _mm256_set1_ps(-87.3f);
    const __m256 keep = _mm256_cmp_ps(x, tiny, _CMP_GE_OQ);
    x = _mm256_max_ps(x, tiny);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), keep);
}

/* The largest of m and the eight lanes of v. */
static inline float max_lanes(__m256 v, float m)
{
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int l = 0; l < 8; l++)
        m = lanes[l] > m ? lanes[l] : m;
    return m;
}

/* sum_j exp(row[j] - mx) over a row of v floats, mx its maximum: eight lanes of exp8, the
 * lanes summed in order, then the remainder one by one. */
static inline float sum_exp(const float *row, long v, float mx)
{
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= v; j += 8)
        acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), m)));
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++)
        sum += lanes[l];
    for (; j < v; j++)
        sum += expf(row[j] - mx);
    return sum;
}

#endif

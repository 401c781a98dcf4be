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

/* exp8's sixteen-lane twin (AVX-512), the same steps: a lane of exp16 and of exp8 agree. */
__attribute__((target("avx2,fma,avx512f,avx512dq"))) static inline __m512 exp16(__m512 x)
{
    const __m512 tiny = _mm512_set1_ps(-87.3f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, tiny, _CMP_GE_OQ);
    x = _mm512_max_ps(x, tiny);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i scale = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(scale)));
}

/* The largest of the eight lanes of v, none of them NaN. */
static inline float max8(__m256 v)
{
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* roundf of eight floats, to int32, bit for bit: trunc(a) plus a's sign where
 * |a - trunc(a)| is at least 1/2 (a - trunc(a) is exact), so halves round away from zero. */
static inline __m256i roundf8(__m256 a)
{
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 tr = _mm256_round_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 frac = _mm256_and_ps(_mm256_sub_ps(a, tr), abs_mask);
    const __m256 step = _mm256_or_ps(_mm256_and_ps(a, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
    const __m256 up = _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), step);
    return _mm256_cvtps_epi32(_mm256_add_ps(tr, up));
}

/* Four vectors of eight int32, each within int8, to their 32 bytes in order: the packs work
 * within 128-bit lanes, so the result's 32-bit groups come out as 0 2 4 6 1 3 5 7 and are
 * permuted back. */
static inline __m256i pack_bytes(const __m256i *r)
{
    const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                          _mm256_packs_epi32(r[2], r[3]));
    return _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
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

/* The sum of the four lanes of v. */
static inline double sum_lanes_pd(__m256d v)
{
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* RMSNorm of one row of d floats into out: row / sqrt(mean(row^2) + eps) * weight, the mean
 * of squares in double (four lanes, then their sum). Returns 1 / sqrt(mean + eps). The
 * decoding step (step.c) and training's norm (rmsnorm.c) both take it, so both give the
 * same bits. */
static inline float rms_norm_row(const float *row, const float *weight, float eps, float *out,
                                 long d)
{
    const long d4 = d & ~3L, d8 = d & ~7L;
    __m256d acc = _mm256_setzero_pd();
    for (long j = 0; j < d4; j += 4) {
        const __m256d c = _mm256_cvtps_pd(_mm_loadu_ps(row + j));
        acc = _mm256_add_pd(acc, _mm256_mul_pd(c, c));
    }
    double sq = sum_lanes_pd(acc);
    for (long j = d4; j < d; j++)
        sq += (double)row[j] * row[j];
    const float rstd = (float)(1.0 / sqrt(sq / (double)d + eps));
    const __m256 rv = _mm256_set1_ps(rstd);
    for (long j = 0; j < d8; j += 8)
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(weight + j),
                                                _mm256_mul_ps(_mm256_loadu_ps(row + j), rv)));
    for (long j = d8; j < d; j++)
        out[j] = weight[j] * (row[j] * rstd);
    return rstd;
}

/* sigmoid(v) = 1 / (1 + exp(-v)) for eight floats, taking exp of -|v| only (exp8 is for
 * arguments <= 0): 1 / (1 + e) for v >= 0, e / (1 + e) below (blendv picks by the sign
 * bit), with e = exp(-|v|). */
static inline __m256 sigmoid8(__m256 v)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp8(_mm256_or_ps(v, _mm256_set1_ps(-0.0f)));
    return _mm256_div_ps(_mm256_blendv_ps(one, e, v), _mm256_add_ps(one, e));
}

/* sigmoid for one float, as the lanes' scalar rest. */
static inline float sigmoid1(float v)
{
    const float e = expf(-fabsf(v));
    return (v >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* silu(v) = v sigmoid(v) for eight floats, taking exp of -|v| only (exp8 is for arguments
 * <= 0): v / (1 + e) for v >= 0, v e / (1 + e) below, with e = exp(-|v|). */
static inline __m256 silu8(__m256 v)
{
    const __m256 e = exp8(_mm256_or_ps(v, _mm256_set1_ps(-0.0f)));
    const __m256 num = _mm256_blendv_ps(v, _mm256_mul_ps(v, e), v);
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* silu for one float, as the lanes' scalar rest. */
static inline float silu1(float v)
{
    return v / (1.0f + expf(-v));
}

#endif

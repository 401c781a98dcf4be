/* Dropout for training on the CPU, with a counter-based random number generator; x86 with
 * AVX2.
 *
 * torch's CPU dropout draws each element's keep-or-drop from a Mersenne Twister, one element
 * after another: some 12 ns an element, a quarter of a training step of a small Transformer
 * (where the matrix products are cheap). Here each element's random number is a pure function
 * of (seed, element index): a word of Philox4x32-10 (Salmon et al. 2011, "Parallel random
 * numbers: as easy as 1, 2, 3"; the generator behind CUDA's and torch's GPU dropout), keyed by
 * the seed. Elements go in blocks of 32, computed from eight counters at once, one per vector
 * lane: element i = 32 b + 8 w + l takes word w of Philox(counter = (8 b + l) as two 32-bit
 * halves, 0, 0; key = the seed's two halves). So
 *
 *   - blocks can be computed in any order, on any number of threads, with the same result;
 *   - the backward pass draws the same mask again from the seed instead of keeping it;
 *   - the answer can be checked against the generator's published known-answer vectors and a
 *     plain reimplementation (tests/kernels/test_dropout.py).
 *
 * An element is kept where its 32-bit word is >= threshold = floor(p * 2^32), with
 * probability 1 - p (to 2^-32), and multiplied by scale = 1 / (1 - p); a dropped one is
 * multiplied by 0, so that a NaN or an infinity stays one, as torch's dropout leaves it.
 */
#include <immintrin.h>
#include <stdint.h>

#include "tformer.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u /* the golden ratio */
#define PHILOX_W1 0xBB67AE85u /* sqrt(3) - 1 */
#define BLOCK 32              /* elements from one call of philox8: 8 counters x 4 words */

/* The high and low 32 bits of a[l] * m for eight lanes. _mm256_mul_epu32 multiplies the
 * even lanes into 64-bit products; the odd lanes are shifted down and multiplied the same
 * way, and the halves are blended back into place. */
static inline void mulhilo8(__m256i a, __m256i m, __m256i *hi, __m256i *lo)
{
    const __m256i even = _mm256_mul_epu32(a, m);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/* Philox4x32-10 of eight counters (c0[l], c1[l], c2[l], c3[l]), l < 8, under the key
 * (k0, k1): word w of lane l in lane l of words[w]. Each of the ten rounds multiplies words
 * 0 and 2 by the generator's constants, swaps the products' halves into place with words 1
 * and 3 and the key, and steps the key on (Salmon et al. 2011, fig. 2). */
static inline void philox8(__m256i c0, __m256i c1, __m256i c2, __m256i c3, uint32_t k0,
                           uint32_t k1, __m256i words[4])
{
    const __m256i m0 = _mm256_set1_epi32((int)PHILOX_M0), m1 = _mm256_set1_epi32((int)PHILOX_M1);
    for (int round = 0; round < 10; round++) {
        __m256i hi0, lo0, hi1, lo1;
        mulhilo8(c0, m0, &hi0, &lo0);
        mulhilo8(c2, m1, &hi1, &lo1);
        c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32((int)k0));
        c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32((int)k1));
        c1 = lo1;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    words[0] = c0;
    words[1] = c1;
    words[2] = c2;
    words[3] = c3;
}

/* The four words of Philox4x32-10 for one counter (c0, c1, c2, c3) and key (k0, k1), from
 * the same code as dropout's (lane 0 of philox8): exported for the generator's known-answer
 * tests. */
void tformer_philox4x32(const uint32_t *counter, const uint32_t *key, uint32_t *out)
{
    __m256i words[4];
    philox8(_mm256_set1_epi32((int)counter[0]), _mm256_set1_epi32((int)counter[1]),
            _mm256_set1_epi32((int)counter[2]), _mm256_set1_epi32((int)counter[3]), key[0],
            key[1], words);
    for (int w = 0; w < 4; w++)
        out[w] = (uint32_t)_mm256_extract_epi32(words[w], 0);
}

/* y[i] = x[i] * (word(seed, i) >= threshold ? scale : 0) for i < n. x and y may be the same
 * array. Run by the forward pass on the activations and by the backward pass, with the same
 * seed, on their gradient. */
void tformer_dropout(const float *x, float *y, long n, uint64_t seed, uint32_t threshold,
                     float scale, int threads)
{
    const long blocks = (n + BLOCK - 1) / BLOCK;
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    /* AVX2 compares signed integers: flipping the top bit of both sides orders unsigned
     * ones the same way. */
    const __m256i flip = _mm256_set1_epi32((int)0x80000000u);
    const __m256i limit = _mm256_set1_epi32((int)(threshold ^ 0x80000000u));
    const __m256 keep_scale = _mm256_set1_ps(scale);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks > 256)
    for (long b = 0; b < blocks; b++) {
        const uint64_t first = (uint64_t)b * 8; /* the counter of lane 0 */
        const __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)first), lane);
        /* The eight counters share their high half: first is a multiple of 8, so lane 7's
         * low half does not wrap. */
        const __m256i c1 = _mm256_set1_epi32((int)(uint32_t)(first >> 32));
        __m256i words[4];
        philox8(c0, c1, _mm256_setzero_si256(), _mm256_setzero_si256(), k0, k1, words);
        const long start = b * BLOCK;
        if (start + BLOCK <= n) {
            for (int w = 0; w < 4; w++) {
                const __m256i dropped = _mm256_cmpgt_epi32(limit, _mm256_xor_si256(words[w], flip));
                const __m256 factor = _mm256_andnot_ps(_mm256_castsi256_ps(dropped), keep_scale);
                const __m256 v = _mm256_loadu_ps(x + start + 8 * w);
                _mm256_storeu_ps(y + start + 8 * w, _mm256_mul_ps(v, factor));
            }
        } else { /* the last, partial block */
            uint32_t tail[BLOCK];
            for (int w = 0; w < 4; w++)
                _mm256_storeu_si256((__m256i *)(tail + 8 * w), words[w]);
            for (long i = start; i < n; i++)
                y[i] = x[i] * (tail[i - start] >= threshold ? scale : 0.0f);
        }
    }
}

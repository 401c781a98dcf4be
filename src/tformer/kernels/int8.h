/* What the int8 kernels (int8.c, int8_packed.c) share: not part of the library's interface
 * (tformer.h). */
#ifndef TFORMER_INT8_H
#define TFORMER_INT8_H

#include <immintrin.h>
#include <stdint.h>

static inline int32_t sum_lanes_i32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* How many blocks of R rows of W ahead the int8 products fetch. One block ahead (a few
 * hundred cycles) is too little for memory's latency: two to eight ahead read a 58101 x
 * 512 matrix 1.2-1.3x faster at one to four rows of x, from 200 MB of such matrices. */
#define PREFETCH_AHEAD 4

static inline long round_up(long a, long b) { return (a + b - 1) / b * b; }

#endif

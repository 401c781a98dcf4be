/* The int8 products over the weights' bytes as they are, for x86 without AVX-512 VNNI:
 * the few-row product (over rows of W) and the many-row one (over W packed in panels,
 * TFORMER_AVX2_BYTES). int8_bytes_rows.h and int8_bytes_packed.h include this
 * file, and int8.c and int8_packed.c include each of them twice, with
 *
 *   BYTES_NAME(name)  the suffix of the functions' names (name##_sign, name##_avxvnni)
 *   BYTES_TARGET      a function target, or nothing
 *   BYTES_DOT         defined: sums of four products with AVX-VNNI's vpdpbusd; else with
 *                     AVX2's byte multiply-add
 *
 * Both are exact in the same way. x's sign moves onto w (_mm256_sign_epi8), so every
 * product is |x| (unsigned bytes, xa, made once per call) times w * sign(x) (signed bytes),
 * each in [-127, 127] as quantize_rows makes them (a weight of -128 could not take a
 * negative sign; every int8 weight here comes from it):
 * - AVX2: _mm256_maddubs_epi16 multiplies 32 such pairs and adds neighbours into 16-bit
 *   sums, which saturate past 32767: a pair is at most 2 * 127 * 127 = 32258, so none
 *   does. _mm256_madd_epi16 against ones adds pairs of those into eight 32-bit sums. Four
 *   instructions for 32 products, where the 16-bit path needs two for 16 (plus the
 *   widenings); which is faster depends on the CPU's ports (int8.py times both).
 * - AVX-VNNI (Intel's cores since Alder Lake, AMD's since Zen 4): _mm256_dpbusd_avx_epi32
 *   adds four such products into each 32-bit sum at once, without 16-bit steps: two
 *   instructions for 32 products in the few-row product. The packed product instead takes
 *   x + 128 as the unsigned bytes and takes 128 * sum(w) off, as AVX-512 VNNI's path does:
 *   one instruction for 32.
 */

#ifdef BYTES_DOT
#define BYTES_ACCUMULATE(acc, a, s) _mm256_dpbusd_avx_epi32(acc, a, s)
#else
#define BYTES_ACCUMULATE(acc, a, s)                                                        \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), ones))
#endif

/* int8 products for the few rows of a decoding step, x86 with AVX2 and FMA (and AVX-512
 * VNNI or AVX-VNNI where the process uses them), threaded over the rows of W with OpenMP:
 * y = (X Q^T) * (xscale wscale^T) + b, X (m x k) and Q (n x k) in int8 with one fp32 scale
 * per row of each: activations and weights both rounded to 8 bits (quantize.c), the
 * products summed exactly in 32-bit integers. As fp32.c's products, a stream through W,
 * each output summed in the same order whatever m is; the sums are exact, so they equal
 * any other exact sum bit for bit (the many-row product's, int8_packed.c, and
 * torch._int_mm's).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tformer.h"
#include "vecmath.h"
#include "int8.h"

/* The same for int8 rows of W and rows of x widened to 16-bit integers (xw, once per call:
 * a few KB that stay in L1). Sixteen int8 weights are widened too, and _mm256_madd_epi16
 * multiplies them and adds neighbouring pairs into eight 32-bit sums: no rounding and,
 * below 2^31 / 127^2 = 133,000 terms, no overflow. (The faster unsigned-by-signed
 * _mm256_maddubs_epi16 saturates its 16-bit pair sums, so it is not exact.) Widening x once
 * instead of at every block of W takes M of the R + M widenings out of the inner loop,
 * which are shuffles that compete with the products for the vector ports. The scaling is
 * the same sequence of fp32 operations as int8_reference's torch path: (float) sum *
 * (xscale[i] * wscale[j]), then + b[j]; -ffp-contract=off keeps the compiler from fusing
 * the last two into one FMA, which rounds once instead of twice. */
static inline __attribute__((always_inline)) void i8_rows_of_w(
    const int16_t *xw, const float *xscale, const int8_t *w, const float *wscale,
    const float *b, float *y, long n, long k, long r0, const int M, const int R)
{
    __m256i acc[4][4];
    const long k16 = k & ~15L;
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[i][r] = _mm256_setzero_si256();
    /* Int8 rows are short (512 bytes at k = 512) and the hardware prefetcher falls behind
     * them: fetch the block of rows PREFETCH_AHEAD blocks on while this one is summed, at
     * the same pace. */
    const int8_t *next = w + (r0 + PREFETCH_AHEAD * R) * k;
    for (long j = 0; j < k16; j += 16) {
        _mm_prefetch((const char *)(next + j * R), _MM_HINT_T0);
        /* A row of W at a time, the rows of x read from L1 by each product. */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i wv =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + (r0 + r) * k + j)));
#pragma GCC unroll 4
            for (int i = 0; i < M; i++)
                acc[i][r] = _mm256_add_epi32(
                    acc[i][r],
                    _mm256_madd_epi16(wv, _mm256_loadu_si256((const __m256i *)(xw + i * k + j))));
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t s = sum_lanes_i32(acc[i][r]);
            for (long j = k16; j < k; j++) /* k not a multiple of 16 */
                s += (int32_t)w[(r0 + r) * k + j] * (int32_t)xw[i * k + j];
            const float v = (float)s * (xscale[i] * wscale[r0 + r]);
            y[i * n + r0 + r] = b ? v + b[r0 + r] : v;
        }
}

/* The same sums with AVX-512 VNNI (on 256-bit registers, so AVX512VL too): vpdpbusd
 * multiplies 32 unsigned by 32 signed bytes and adds each four neighbouring products into
 * eight 32-bit sums, one instruction where the path above needs a widening, a multiply-add
 * and an add for sixteen. Its first operand is unsigned, so x enters as x ^ 0x80 = x + 128
 * and the sum is corrected by 128 * sum(w), counted by the same instruction against a
 * vector of ones. Still exact: a product is at most 255 * 127 in size, so no 32-bit sum
 * overflows below 2^31 / (255 * 127) = 66,000 terms. */
__attribute__((target("avx512vnni,avx512vl"))) static inline __attribute__((always_inline))
void i8_rows_of_w_vnni(const int8_t *x, const float *xscale, const int8_t *w,
                       const float *wscale, const float *b, float *y, long n, long k, long r0,
                       const int M, const int R)
{
    __m256i acc[4][4], wsum[4];
    const long k32 = k & ~31L;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi8(1);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        wsum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int i = 0; i < M; i++)
            acc[i][r] = _mm256_setzero_si256();
    }
    const int8_t *next = w + (r0 + PREFETCH_AHEAD * R) * k;
    for (long j = 0; j < k32; j += 32) {
        __m256i wv[4];
        _mm_prefetch((const char *)(next + j * R), _MM_HINT_T0);
        if (R > 2)
            _mm_prefetch((const char *)(next + j * R + 64), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            wv[r] = _mm256_loadu_si256((const __m256i *)(w + (r0 + r) * k + j));
            wsum[r] = _mm256_dpbusd_epi32(wsum[r], ones, wv[r]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; i++) {
            const __m256i xv = _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(x + i * k + j)), flip);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[i][r] = _mm256_dpbusd_epi32(acc[i][r], xv, wv[r]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; i++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            int32_t s = sum_lanes_i32(acc[i][r]) - 128 * sum_lanes_i32(wsum[r]);
            for (long j = k32; j < k; j++) /* k not a multiple of 32 */
                s += (int32_t)w[(r0 + r) * k + j] * (int32_t)x[i * k + j];
            const float v = (float)s * (xscale[i] * wscale[r0 + r]);
            y[i * n + r0 + r] = b ? v + b[r0 + r] : v;
        }
}

/* ATTRIBUTES: a function target for the VNNI variant, whose 32 registers (EVEX) hold four
 * rows of W for any number of rows of x. */
#define I8_PRODUCT_OF(ROWS_OF_W, X, M, R, NAME, ATTRIBUTES)                                \
    ATTRIBUTES static void NAME(const X *x, const float *xs, const int8_t *w,              \
                                const float *ws, const float *b, float *y, long n, long k, \
                                int threads)                                               \
    {                                                                                      \
        const long blocks = n / R;                                                         \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)")  \
        for (long q = 0; q < blocks; q++)                                                  \
            ROWS_OF_W(x, xs, w, ws, b, y, n, k, q * R, M, R);                              \
        for (long r0 = blocks * R; r0 < n; r0++)                                           \
            ROWS_OF_W(x, xs, w, ws, b, y, n, k, r0, M, 1);                                 \
    }
#define I8_PRODUCT(M, R, NAME) I8_PRODUCT_OF(i8_rows_of_w, int16_t, M, R, NAME, )
#define I8_VNNI_PRODUCT(M, R, NAME)                                                        \
    I8_PRODUCT_OF(i8_rows_of_w_vnni, int8_t, M, R, NAME,                                   \
                  __attribute__((target("avx512vnni,avx512vl"))))
I8_PRODUCT(1, 4, i8_1)
I8_PRODUCT(2, 4, i8_2)
I8_PRODUCT(3, 3, i8_3)
I8_PRODUCT(4, 2, i8_4)
I8_VNNI_PRODUCT(2, 4, i8v_2)
I8_VNNI_PRODUCT(3, 4, i8v_3)
I8_VNNI_PRODUCT(4, 4, i8v_4)

typedef void (*i8_product)(const int16_t *, const float *, const int8_t *, const float *,
                           const float *, float *, long, long, int);
typedef void (*i8_vnni_product)(const int8_t *, const float *, const int8_t *, const float *,
                                const float *, float *, long, long, int);


/* The instruction set the int8 products use, decided once per process (library.py sets
 * it at load time): TFORMER_ISA_AVX512_VNNI where the CPU has it and it was not turned
 * down, else TFORMER_ISA_AVX_VNNI likewise, else TFORMER_ISA_AVX2. want >= 0 sets it
 * (TFORMER_ISA_AVX2 where the CPU lacks what it asks), -1 asks. Every level gives the same
 * bits. */
static int isa_level = TFORMER_ISA_AVX2;

static int cpu_has_vnni(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* TFORMER_ISA_AVX_VNNI: AVX2 and the VEX-encoded dot product of bytes (int8_bytes.h). */
int tformer_isa(int want)
{
    if (want >= 0)
        isa_level = want == TFORMER_ISA_AVX512_VNNI && cpu_has_vnni() ? TFORMER_ISA_AVX512_VNNI
                    : want == TFORMER_ISA_AVX_VNNI && __builtin_cpu_supports("avxvnni")
                        ? TFORMER_ISA_AVX_VNNI
                        : TFORMER_ISA_AVX2;
    return isa_level;
}

/* The AVX2 few-row product's method (where VNNI is not used): TFORMER_AVX2_WIDEN
 * (i8_rows_of_w) or TFORMER_AVX2_SIGN (rows_of_w_sign, int8_bytes_rows.h). Both give the
 * same, exact sums; int8.py times both once per process and sets the faster. want >= 0
 * sets it, -1 asks. */
static int avx2_method = TFORMER_AVX2_WIDEN;

int tformer_avx2_method(int want)
{
    if (want >= 0)
        avx2_method = want == TFORMER_AVX2_SIGN ? TFORMER_AVX2_SIGN : TFORMER_AVX2_WIDEN;
    return avx2_method;
}

/* The few-row byte products, twice: with AVX2's byte multiply-add, and with AVX-VNNI's dot
 * product where the CPU has it (int8_bytes.h). */
typedef void (*i8_bytes_product)(const int8_t *, const int8_t *, const float *, const int8_t *,
                                 const float *, const float *, float *, long, long, int);
#define BYTES_NAME(name) name##_sign
#define BYTES_TARGET
#include "int8_bytes_rows.h"
#undef BYTES_NAME
#undef BYTES_TARGET
#define BYTES_NAME(name) name##_avxvnni
#define BYTES_TARGET __attribute__((target("avxvnni")))
#define BYTES_DOT
#include "int8_bytes_rows.h"
#undef BYTES_NAME
#undef BYTES_TARGET
#undef BYTES_DOT

/* y = (X Q^T) * (xscale wscale^T) + b with X (m x k) and Q (n x k) int8, xscale (m) and
 * wscale (n) fp32. b may be NULL. Returns 0, or -1 where it could not allocate the copy of
 * x the AVX2 products read (widened to 16 bits, or |x|; on the stack up to 16 KB). */
int tformer_matvec_int8(const int8_t *x, const float *xscale, const int8_t *q,
                        const float *wscale, const float *b, float *y,
                        long m, long n, long k, int threads)
{
    static const i8_product by_rows[4] = {i8_1, i8_2, i8_3, i8_4};
    static const i8_bytes_product by_rows_sign[4] = {product_1_sign, product_2_sign,
                                                     product_3_sign, product_4_sign};
    static const i8_bytes_product by_rows_avxvnni[4] = {product_1_avxvnni, product_2_avxvnni,
                                                        product_3_avxvnni, product_4_avxvnni};
    /* One row reads W at close to the memory's rate either way, and there the sums of w
     * that VNNI adds cost more than it saves (0.70-0.93x, benchmarks/kernel_ab.py). */
    static const i8_vnni_product by_rows_vnni[4] = {NULL, i8v_2, i8v_3, i8v_4};
    const int vnni = isa_level == TFORMER_ISA_AVX512_VNNI;
    const int avx_vnni = isa_level == TFORMER_ISA_AVX_VNNI;
    const i8_bytes_product *bytes = avx_vnni                  ? by_rows_avxvnni
                                    : avx2_method == TFORMER_AVX2_SIGN ? by_rows_sign
                                                               : NULL;
    const long chunk = m < 4 ? m : 4;
    int16_t stack[8192], *xw = stack;
    if (chunk * k > 8192 && !(xw = malloc((size_t)(chunk * k) * sizeof(int16_t))))
        return -1;
    for (long i = 0; i < m; i += 4) {
        const long rows = m - i < 4 ? m - i : 4;
        const int8_t *xi = x + i * k;
        if (vnni && rows > 1) {
            by_rows_vnni[rows - 1](xi, xscale + i, q, wscale, b, y + i * n, n, k, threads);
        } else if (bytes) {
            int8_t *xa = (int8_t *)xw;
            const long k32 = (rows * k) & ~31L;
            for (long t = 0; t < k32; t += 32)
                _mm256_storeu_si256((__m256i *)(xa + t),
                                    _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(xi + t))));
            for (long t = k32; t < rows * k; t++)
                xa[t] = (int8_t)(xi[t] < 0 ? -xi[t] : xi[t]);
            bytes[rows - 1](xi, xa, xscale + i, q, wscale, b, y + i * n, n, k, threads);
        } else {
            const long k16 = (rows * k) & ~15L;
            for (long t = 0; t < k16; t += 16)
                _mm256_storeu_si256((__m256i *)(xw + t),
                                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xi + t))));
            for (long t = k16; t < rows * k; t++)
                xw[t] = xi[t];
            by_rows[rows - 1](xw, xscale + i, q, wscale, b, y + i * n, n, k, threads);
        }
    }
    if (xw != stack)
        free(xw);
    return 0;
}

/* y = x W^T + b for an Int8Linear and a few rows of fp32 x: x rounded to int8 rows as
 * tformer_quantize_rows does, then tformer_matvec_int8. Returns 0, or -1 where it could not
 * allocate the rounded or widened rows. */
int tformer_linear_int8(const float *x, const int8_t *q, const float *wscale, const float *b,
                        float *y, long m, long n, long k, int threads)
{
    int8_t *xq = malloc((size_t)(m * k));
    float *xscale = malloc((size_t)m * sizeof(float));
    int ok = xq && xscale;
    if (ok) {
        tformer_quantize_rows(x, xq, xscale, m, k);
        ok = tformer_matvec_int8(xq, xscale, q, wscale, b, y, m, n, k, threads) == 0;
    }
    free(xq);
    free(xscale);
    return ok ? 0 : -1;
}

/* The kinds table's product for TFORMER_INT8 (kinds.c): over the packed copy from
 * l->packed_min_rows rows on, where there is one, else the few-row product. */
int tformer_int8_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                        int threads)
{
    if (l->packed && m >= l->packed_min_rows)
        return tformer_linear_int8_packed(x, (const int8_t *)l->packed, l->packed_sums,
                                          l->scales, l->bias, y, m, l->n_out, l->n_in,
                                          l->layout, threads);
    return tformer_linear_int8(x, (const int8_t *)l->data, l->scales, l->bias, y, m, l->n_out,
                               l->n_in, threads);
}

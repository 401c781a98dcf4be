/* The weight formats' table: one row per kind of tformer.h's enum tformer_kind, as
 * llama.cpp's type_traits_cpu holds one per type. step.c's layers run every linear layer
 * through tformer_linear, whatever its kind; a new format adds its row here and its
 * product in a file of its own. A row also says the format's geometry (values and bytes a
 * block, the activations' blocks), which blocks.py's table repeats (and a test compares),
 * and for block kinds their quantizer. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "tformer.h"

static const struct tformer_kind_traits kinds[TFORMER_KINDS] = {
    [TFORMER_FP32] = {"fp32", tformer_fp32_linear, 1, 4, TFORMER_X_FP32, NULL, NULL, NULL},
    [TFORMER_INT8] = {"int8", tformer_int8_linear, 1, 1, TFORMER_X_FP32, NULL, NULL, NULL},
    [TFORMER_Q8_0] = {"q8_0", tformer_blocks_kind_linear, 32, 34, TFORMER_X_Q8_0,
                      tformer_quantize_blocks, tformer_blocks_repacked_size,
                      tformer_blocks_repack},
    [TFORMER_Q4_0] = {"q4_0", tformer_blocks_kind_linear, 32, 18, TFORMER_X_Q8_0,
                      tformer_quantize_blocks, tformer_blocks_repacked_size,
                      tformer_blocks_repack},
    [TFORMER_Q4_1] = {"q4_1", tformer_blocks_kind_linear, 32, 20, TFORMER_X_Q8_0,
                      tformer_quantize_blocks, tformer_blocks_repacked_size,
                      tformer_blocks_repack},
    [TFORMER_Q5_0] = {"q5_0", tformer_blocks_kind_linear, 32, 22, TFORMER_X_Q8_0,
                      tformer_quantize_blocks, tformer_blocks_repacked_size,
                      tformer_blocks_repack},
    [TFORMER_Q5_1] = {"q5_1", tformer_blocks_kind_linear, 32, 24, TFORMER_X_Q8_0,
                      tformer_quantize_blocks, tformer_blocks_repacked_size,
                      tformer_blocks_repack},
    [TFORMER_Q4_K] = {"q4_k", tformer_kquants_linear, 256, 144, TFORMER_X_Q8_K,
                      tformer_quantize_k, tformer_kquants_repacked_size,
                      tformer_kquants_repack},
    [TFORMER_Q5_K] = {"q5_k", tformer_kquants_linear, 256, 176, TFORMER_X_Q8_K,
                      tformer_quantize_k, tformer_kquants_repacked_size,
                      tformer_kquants_repack},
    [TFORMER_Q6_K] = {"q6_k", tformer_kquants_linear, 256, 210, TFORMER_X_Q8_K,
                      tformer_quantize_k, tformer_kquants_repacked_size,
                      tformer_kquants_repack},
    [TFORMER_STACK] = {"stack", tformer_stack_linear, 1, 1, TFORMER_X_FP32, NULL, NULL, NULL},
    [TFORMER_IQ4_XS] = {"iq4_xs", tformer_kquants_linear, 256, 136, TFORMER_X_Q8_K,
                        tformer_quantize_k, tformer_kquants_repacked_size,
                        tformer_kquants_repack},
};

static int repacked_for_the_call(const struct tformer_linear *l, const float *x, float *y,
                                 long m, int threads);

/* y (m x n_out) = x (m x n_in) W^T + b through the product of l's kind. A block kind's
 * layer that keeps no repacked copy (l->packed NULL) has W repacked for the call where it
 * has TFORMER_REPACK_CALL_ROWS rows or more (repacked_for_the_call). Returns the product's
 * status (0, or -1 where it could not allocate), or -3 where the kind has no row in this
 * build. */
int tformer_linear(const struct tformer_linear *l, const float *x, float *y, long m, int threads)
{
    if (l->kind < 0 || l->kind >= TFORMER_KINDS || !kinds[l->kind].linear)
        return -3;
    if (!l->packed && kinds[l->kind].repack && m >= TFORMER_REPACK_CALL_ROWS
        && m >= l->packed_min_rows)
        return repacked_for_the_call(l, x, y, m, threads);
    return kinds[l->kind].linear(l, x, y, m, threads);
}

/* The product of many rows over W repacked for this call alone, a slice of W's rows at a
 * time (some repack_slice_bytes of them repacked, so that a 128,256-row output layer does
 * not take its whole repacked size at once): where a layer keeps no repacked copy (that
 * copy takes 1.2 to 2.5 times the blocks' bytes), a product of enough rows still reads W
 * repacked, and pays for the repacking: at 1 thread, a 8192 x 2048 q4_k layer took 10.5 ms
 * to repack, 29 ms for 64 rows over its blocks and 36 repacked for the call (27 over a kept
 * copy), 399 and 316 (275) for 512 rows. The results are the kept copy's product's, bit for bit (the same kernel over
 * the same bytes); a slice's outputs go through a scratch into their columns of y.
 * Returns the product's status, or -1 where it could not allocate. */
static long repack_slice_bytes = 32L << 20;

static int repacked_for_the_call(const struct tformer_linear *l, const float *x, float *y,
                                 long m, int threads)
{
    const struct tformer_kind_traits *t = &kinds[l->kind];
    const long n = l->n_out, k = l->n_in;
    const long row_bytes = k / t->block_values * t->block_bytes;
    const long group_bytes = t->repacked_size(l->kind, 8, k); /* eight rows repacked */
    if (n <= 0 || m <= 0)
        return 0;
    long slice = group_bytes > 0 ? repack_slice_bytes / group_bytes * 8 : n;
    if (slice < 8)
        slice = 8;
    if (slice > n)
        slice = n;
    uint8_t *packed = malloc((size_t)t->repacked_size(l->kind, slice, k));
    float *part = slice < n ? malloc((size_t)(m * slice) * sizeof(float)) : NULL;
    if (!packed || (slice < n && !part)) {
        free(packed);
        free(part);
        return -1;
    }
    const uint8_t *w = l->data;
    int status = 0;
    for (long r0 = 0; r0 < n && !status; r0 += slice) {
        const long rows = n - r0 < slice ? n - r0 : slice, groups = (rows + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (long g = 0; g < groups; g++) {
            const long in_group = rows - g * 8 < 8 ? rows - g * 8 : 8;
            t->repack(l->kind, w + (r0 + g * 8) * row_bytes, in_group, k,
                      packed + g * group_bytes);
        }
        struct tformer_linear s = *l;
        s.n_out = (int32_t)rows;
        s.data = w + r0 * row_bytes;
        s.bias = l->bias ? l->bias + r0 : NULL;
        s.packed = packed;
        s.packed_min_rows = 1;
        status = t->linear(&s, x, part ? part : y, m, threads);
        if (part && !status)
            for (long i = 0; i < m; i++)
                memcpy(y + i * n + r0, part + i * rows, (size_t)rows * sizeof(float));
    }
    free(packed);
    free(part);
    return status;
}

/* The rows from which a block kind's product over W without a kept repacked copy repacks
 * W for the call (tformer_linear): blocks.py reads it. */
long tformer_repack_call_rows(void)
{
    return TFORMER_REPACK_CALL_ROWS;
}

/* The bytes of W repacked at a time for a call (repacked_for_the_call): set where `bytes`
 * is positive (the tests make slices of a few rows), returned either way. */
long tformer_repack_slice_bytes(long bytes)
{
    if (bytes > 0)
        repack_slice_bytes = bytes;
    return repack_slice_bytes;
}

/* The kind's name in the table ("" for none): formats.py checks its registry against it. */
const char *tformer_kind_name(int kind)
{
    if (kind < 0 || kind >= TFORMER_KINDS || !kinds[kind].name)
        return "";
    return kinds[kind].name;
}

/* The kind's geometry into geometry[3]: values a block, bytes a block, the activations'
 * blocks (TFORMER_X_*). Returns 0, or -3 where the kind has no row. */
int tformer_kind_geometry(int kind, int32_t *geometry)
{
    if (kind < 0 || kind >= TFORMER_KINDS || !kinds[kind].name)
        return -3;
    geometry[0] = kinds[kind].block_values;
    geometry[1] = kinds[kind].block_bytes;
    geometry[2] = kinds[kind].activation;
    return 0;
}

/* n blocks of x (n * the kind's values, fp32) to the kind's blocks (n * its bytes), as
 * llama.cpp's reference quantizer for the type writes them. Returns 0, or -3 where the
 * kind is not a block kind. */
int tformer_quantize(int kind, const float *x, long n, uint8_t *out, int threads)
{
    if (kind < 0 || kind >= TFORMER_KINDS || !kinds[kind].quantize)
        return -3;
    return kinds[kind].quantize(kind, x, n, out, threads);
}

/* The bytes W (n x k) of the kind takes repacked for products of many rows, or 0 where the
 * kind has no repacked form. */
long tformer_repacked_size(int kind, long n, long k)
{
    if (kind < 0 || kind >= TFORMER_KINDS || !kinds[kind].repacked_size)
        return 0;
    return kinds[kind].repacked_size(kind, n, k);
}

/* W (n rows of the kind's blocks, k values a row) repacked into out (tformer_repacked_size
 * bytes). Returns 0, or -3 where the kind has no repacked form. */
int tformer_repack(int kind, const uint8_t *w, long n, long k, uint8_t *out)
{
    if (kind < 0 || kind >= TFORMER_KINDS || !kinds[kind].repack)
        return -3;
    return kinds[kind].repack(kind, w, n, k, out);
}

/* A stack's product: l->data holds l->layout parts (no bias of their own), whose outputs
 * are y's columns in order (n_out the sum of theirs), each run through its own kind's
 * product into a scratch of m rows, then copied into place; l->bias added after. Returns
 * the first part's failure, or -1 where it could not allocate. */
int tformer_stack_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                         int threads)
{
    const struct tformer_linear *parts = l->data;
    long widest = 0, col = 0;
    for (int p = 0; p < l->layout; p++)
        widest = parts[p].n_out > widest ? parts[p].n_out : widest;
    if (m <= 0 || widest == 0)
        return 0;
    float *part = malloc((size_t)(m * widest) * sizeof(float));
    if (!part)
        return -1;
    for (int p = 0; p < l->layout; p++) {
        const int status = tformer_linear(&parts[p], x, part, m, threads);
        if (status) {
            free(part);
            return status;
        }
        for (long i = 0; i < m; i++)
            memcpy(y + i * l->n_out + col, part + i * parts[p].n_out,
                   (size_t)parts[p].n_out * sizeof(float));
        col += parts[p].n_out;
    }
    free(part);
    if (l->bias)
        for (long i = 0; i < m; i++)
            for (long r = 0; r < l->n_out; r++)
                y[i * l->n_out + r] += l->bias[r];
    return 0;
}

/* --- Row ranges over activations rounded once: a caller that runs several products of the
 * same rows (a mixture's experts) rounds them once per activation kind and splits the
 * products' output rows among its own threads. A kind with a product of row ranges over a
 * rounding made apart (below) runs that; any other (fp32, int8, the K kinds) runs its
 * table product over a view of W's rows [r0, r1) on the calling thread, rounding x itself. */

typedef int (*rows_fn)(const struct tformer_linear *l, const void *rounded, long i0, long rows,
                       float *y, long ldy, long r0, long r1);

static const rows_fn row_products[TFORMER_KINDS] = {
    [TFORMER_Q8_0] = tformer_blocks_rows, [TFORMER_Q4_0] = tformer_blocks_rows,
    [TFORMER_Q4_1] = tformer_blocks_rows, [TFORMER_Q5_0] = tformer_blocks_rows,
    [TFORMER_Q5_1] = tformer_blocks_rows,
};

/* x (m x k) for products of `activation`'s kinds into a (TFORMER_X_Q8_0: rounded once, with
 * blocks.c's rounding; the others keep x alone). Returns 0, or -1 where it could not
 * allocate (a then holds nothing to free). */
int tformer_round_activations(struct tformer_activations *a, int activation, const float *x,
                              long m, long k, int threads)
{
    a->x = x;
    a->m = m;
    a->k = k;
    a->activation = activation;
    a->data = NULL;
    if (activation == TFORMER_X_Q8_0 && m > 0 && !(a->data = tformer_blocks_round(x, m, k,
                                                                                  threads)))
        return -1;
    return 0;
}

void tformer_free_activations(struct tformer_activations *a)
{
    if (a->activation == TFORMER_X_Q8_0)
        tformer_blocks_round_free(a->data);
    a->data = NULL;
}

/* y[i * ldy + r - r0] = (x_{i0 + i} W^T + b)_r for i < rows, r in [r0, r1): outputs r0 ..
 * r1 - 1 of l's product over rows i0 .. i0 + rows - 1 of a (made for l's kind's activation),
 * as tformer_linear computes them, on the calling thread. Returns 0, -1 where it could not
 * allocate, -3 where the kind has no product (or is a stack, whose rows lie in parts). */
int tformer_linear_rows(const struct tformer_linear *l, const struct tformer_activations *a,
                        long i0, long rows, float *y, long ldy, long r0, long r1)
{
    if (l->kind < 0 || l->kind >= TFORMER_KINDS || !kinds[l->kind].linear
        || l->kind == TFORMER_STACK)
        return -3;
    if (rows <= 0 || r1 <= r0)
        return 0;
    const struct tformer_kind_traits *t = &kinds[l->kind];
    if (row_products[l->kind] && a->data && a->activation == t->activation)
        return row_products[l->kind](l, a->data, i0, rows, y, ldy, r0, r1);
    /* W's rows r0 .. r1 - 1 as a layer of their own, with no repacked copy */
    const long row_bytes = l->n_in / t->block_values * t->block_bytes;
    struct tformer_linear part = *l;
    part.n_out = (int32_t)(r1 - r0);
    part.data = (const uint8_t *)l->data + r0 * row_bytes;
    part.scales = l->scales ? l->scales + r0 : NULL;
    part.bias = l->bias ? l->bias + r0 : NULL;
    part.packed = NULL;
    part.packed_sums = NULL;
    const float *x = a->x + i0 * a->k;
    if (rows == 1 || ldy == r1 - r0)
        return t->linear(&part, x, y, rows, 1);
    float *tmp = malloc((size_t)(rows * (r1 - r0)) * sizeof(float));
    if (!tmp)
        return -1;
    const int status = t->linear(&part, x, tmp, rows, 1);
    for (long i = 0; i < rows && !status; i++)
        memcpy(y + i * ldy, tmp + i * (r1 - r0), (size_t)(r1 - r0) * sizeof(float));
    free(tmp);
    return status;
}

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
 * repacked, and pays for the repacking: at 1 thread, a 8192 x 2048 q4_k layer took 26 ms
 * to repack, 58 ms for 64 rows over its blocks and 29 over them repacked, 545 and 425 for
 * 512 rows. The results are the kept copy's product's, bit for bit (the same kernel over
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

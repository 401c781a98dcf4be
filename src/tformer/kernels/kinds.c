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

/* y (m x n_out) = x (m x n_in) W^T + b through the product of l's kind. Returns the
 * product's status (0, or -1 where it could not allocate), or -3 where the kind has no
 * row in this build. */
int tformer_linear(const struct tformer_linear *l, const float *x, float *y, long m, int threads)
{
    if (l->kind < 0 || l->kind >= TFORMER_KINDS || !kinds[l->kind].linear)
        return -3;
    return kinds[l->kind].linear(l, x, y, m, threads);
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

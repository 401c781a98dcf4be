/* The kernels' library: every function and structure another file, or Python through
 * ctypes (kernels/library.py's SIGNATURES and structures mirror this file), can reach.
 * Every .c file includes it, so the compiler checks each definition against its
 * declaration; nothing else declares a tformer_ function. */
#ifndef TFORMER_H
#define TFORMER_H

#include <stdint.h>

/* --- Weight formats: a linear layer's weight is one of these kinds (kernels/formats.py's
 * registry holds the same numbers); each has one row in kinds.c's table. ------------------ */
enum tformer_kind {
    TFORMER_FP32 = 0, /* data: float n_out x n_in */
    TFORMER_INT8 = 1, /* data: int8 n_out x n_in, scales: one per output row */
    TFORMER_Q8_0 = 2, /* data: n_out rows of n_in / 32 blocks (llama.cpp's block layouts) */
    TFORMER_Q4_0 = 3,
    TFORMER_Q4_1 = 4,
    TFORMER_Q5_0 = 5,
    TFORMER_Q5_1 = 6,
    TFORMER_Q4_K = 7, /* data: n_out rows of n_in / 256 super-blocks (llama.cpp's K layouts) */
    TFORMER_Q5_K = 8,
    TFORMER_Q6_K = 9,
    TFORMER_STACK = 10, /* data: `layout` struct tformer_linear parts, their outputs side by side */
    TFORMER_IQ4_XS = 11, /* data: n_out rows of n_in / 256 super-blocks (llama.cpp's IQ4_XS) */
    TFORMER_KINDS
};

/* A linear layer y = x W^T + b in one of the kinds. The fields after `bias` are the
 * format's own: int8 keeps a copy of data packed for products of many rows. */
struct tformer_linear {
    int32_t kind; /* enum tformer_kind */
    int32_t n_out, n_in;
    const void *data;
    const float *scales; /* NULL where the format keeps no scales apart from data */
    const float *bias; /* or NULL */
    const void *packed; /* int8: data packed for many rows (tformer_pack_int8); block kinds:
                         * data repacked (tformer_repack); or NULL */
    const int32_t *packed_sums; /* int8: the sum of each row of data */
    int32_t layout; /* of packed: TFORMER_ISA_AVX2, TFORMER_ISA_AVX512_VNNI, TFORMER_AVX2_BYTES */
    int32_t packed_min_rows; /* products of this many rows and more use packed */
};

/* One kind's product: y (m x n_out) = x (m x n_in, fp32) W^T + b. Returns 0, -1 where it
 * could not allocate, -3 where the kind has no kernel in this build. */
typedef int (*tformer_linear_fn)(const struct tformer_linear *l, const float *x, float *y,
                                 long m, int threads);

/* A row of kinds.c's table (llama.cpp's type_traits_cpu): the name formats.py gives the
 * kind, its product, and its geometry: the values a block holds along a row and the bytes
 * it takes (both 1 for formats of single values, fp32 and int8), and the blocks the
 * activations are rounded to (TFORMER_X_*), so that no kernel assumes a block size. */
enum { TFORMER_X_FP32 = 0, TFORMER_X_Q8_0 = 1, TFORMER_X_Q8_K = 2 };
/* A block kind's quantizer (llama.cpp's from_float): n blocks of x to their bytes. */
typedef int (*tformer_quantize_fn)(int kind, const float *x, long n, uint8_t *out, int threads);
/* A block kind's repacking for products of many rows (llama.cpp's repack): the bytes W
 * (n x k) takes repacked, and W's blocks into them; its product reads them from
 * tformer_linear's packed. */
typedef long (*tformer_repacked_size_fn)(int kind, long n, long k);
typedef int (*tformer_repack_fn)(int kind, const uint8_t *w, long n, long k, uint8_t *out);
struct tformer_kind_traits {
    const char *name;
    tformer_linear_fn linear;
    int32_t block_values, block_bytes, activation;
    tformer_quantize_fn quantize; /* NULL: not a block kind */
    tformer_repacked_size_fn repacked_size; /* NULL: no repacked form */
    tformer_repack_fn repack;
};

int tformer_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                   int threads);
/* A block kind's layer without a repacked copy has W repacked for a call of this many rows
 * and more (kinds.c's tformer_linear). */
#define TFORMER_REPACK_CALL_ROWS 64
long tformer_repack_call_rows(void);
long tformer_repack_slice_bytes(long bytes);
const char *tformer_kind_name(int kind);
int tformer_kind_geometry(int kind, int32_t *geometry);
int tformer_quantize(int kind, const float *x, long n, uint8_t *out, int threads);
long tformer_repacked_size(int kind, long n, long k);
int tformer_repack(int kind, const uint8_t *w, long n, long k, uint8_t *out);

/* --- fp32 (fp32.c) ----------------------------------------------------------------------- */
void tformer_matvec(const float *x, const float *w, const float *b, float *y, long m, long n,
                    long k, int threads);
int tformer_fp32_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                        int threads);

/* --- int8 (int8.c: few rows; int8_packed.c: many rows; quantize.c: rounding) ------------- */
enum { TFORMER_ISA_AVX2 = 1, TFORMER_ISA_AVX512_VNNI = 2, TFORMER_AVX2_BYTES = 3,
       TFORMER_ISA_AVX_VNNI = 4 };
enum { TFORMER_AVX2_WIDEN = 0, TFORMER_AVX2_SIGN = 1 };
int tformer_isa(int want);
int tformer_avx2_method(int want);
int tformer_matvec_int8(const int8_t *x, const float *xscale, const int8_t *q,
                        const float *wscale, const float *b, float *y, long m, long n, long k,
                        int threads);
int tformer_linear_int8(const float *x, const int8_t *q, const float *wscale, const float *b,
                        float *y, long m, long n, long k, int threads);
int tformer_int8_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                        int threads);
int tformer_pack_layout(void);
long tformer_packed_int8_size(long n, long k, int layout);
void tformer_pack_int8(const int8_t *q, long n, long k, int8_t *packed, int32_t *colsum,
                       int layout);
int tformer_gemm_int8(const int8_t *x, const float *xscale, const int8_t *packed,
                      const int32_t *colsum, const float *wscale, const float *b, float *y,
                      long m, long n, long k, int layout, int threads);
int tformer_linear_int8_packed(const float *x, const int8_t *packed, const int32_t *colsum,
                               const float *wscale, const float *b, float *y, long m, long n,
                               long k, int layout, int threads);
void tformer_quantize_rows(const float *x, int8_t *xq, float *scale, long m, long k);
void tformer_scale_int8(int32_t *acc, const float *xscale, const float *wscale, const float *b,
                        long m, long n, int threads);

/* --- llama.cpp's blocks: q8_0, q4_0, q4_1, q5_0, q5_1 (blocks.c, blocks_isa.h) ------------ */
enum { TFORMER_BLOCKS_GENERIC = 0, TFORMER_BLOCKS_AVX2 = 1, TFORMER_BLOCKS_AVX_VNNI = 2,
       TFORMER_BLOCKS_AVX512_VNNI = 3 };
int tformer_blocks_isa(int want);
int tformer_blocks_linear(int kind, const float *x, long m, const uint8_t *w, long n, long k,
                          const float *b, float *y, int threads);
int tformer_blocks_kind_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                               int threads);
int tformer_quantize_blocks(int kind, const float *x, long n, uint8_t *out, int threads);
long tformer_blocks_repacked_size(int kind, long n, long k);
int tformer_blocks_repack(int kind, const uint8_t *w, long n, long k, uint8_t *out);
int tformer_blocks_repacked_linear(int kind, const float *x, long m, const uint8_t *packed,
                                   long n, long k, const float *b, float *y, int threads);

/* --- llama.cpp's K super-blocks: q4_k, q5_k, q6_k (kquants.c, kquants_isa.h; the path is
 * tformer_blocks_isa's) --------------------------------------------------------------------- */
int tformer_kquants_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                           int threads);
int tformer_quantize_k(int kind, const float *x, long n, uint8_t *out, int threads);
long tformer_kquants_repacked_size(int kind, long n, long k);
int tformer_kquants_repack(int kind, const uint8_t *w, long n, long k, uint8_t *out);

/* --- A layer of parts in different kinds (kinds.c): a fused projection whose rows come in
 * several block formats ------------------------------------------------------------------ */
int tformer_stack_linear(const struct tformer_linear *l, const float *x, float *y, long m,
                         int threads);

/* --- A decoding step's attention (attend.c) and beam search's candidates (search.c) ------ */
/* Keys and values, (rows, heads, positions, d) with these strides in floats: component c of
 * the key at row r, head g, position s at k + r * k_row + g * k_head + s * k_pos + c * k_comp,
 * the value's at v + r * v_row + g * v_head + s * v_pos + c. A paged pool's rows are its
 * blocks, whose keys may lie turned (k_pos 1, k_comp the block's positions: a key component
 * of consecutive positions side by side, as tformer_attend_paged reads them fastest); every
 * other cache's components are contiguous (k_comp 1), as tformer_attend_step reads them. */
struct tformer_kv {
    float *k, *v;
    long rows, k_row, k_head, k_pos, k_comp, v_row, v_head, v_pos;
};

int tformer_attend_step(const float *q, long q_row, const float *k, long k_row, long k_head,
                        long k_pos, const float *v, long v_row, long v_head, long v_pos,
                        const int64_t *rows, long rows_row, long group, const float *bias,
                        long bias_row, float *out, long n, long r, long heads, long kv_group,
                        long length, long own, long d, long dv, float scale, int threads);
int tformer_attend_paged(const float *q, long q_row, const struct tformer_kv *kv,
                         const int64_t *table, long table_row, long block,
                         const int64_t *lengths, const int64_t *counts, long window, float *out,
                         long n, long tokens, long heads, long kv_group, long d, long dv,
                         float scale, float softcap, const float *sinks, int threads);
void tformer_top_logprobs(const float *x, const float *add, const int64_t *banned,
                          int nbanned, float *top, int64_t *idx, long n, long v, int k,
                          int threads);

/* --- A decoder layer's step in one call (step.c) ----------------------------------------- */
enum { TFORMER_NORM_LAYER, TFORMER_NORM_RMS };

struct tformer_norm {
    const float *weight, *bias; /* bias may be NULL (always for RMSNorm) */
    float eps;
    int kind; /* TFORMER_NORM_LAYER or TFORMER_NORM_RMS */
};

enum { TFORMER_ACT_RELU, TFORMER_ACT_GELU, TFORMER_ACT_GELU_TANH, TFORMER_ACT_SILU };

/* A translation decoder's layer (models/seq2seq.py's DecoderLayer). */
struct tformer_decoder_layer {
    struct tformer_linear qkv, self_out, cross_q, cross_out, up, down;
    struct tformer_norm self_norm, cross_norm, ff_norm;
    long heads, d_head, d_value;
    float scale; /* on the scores: d_head ** -0.5, as attend.py passes it */
    int pre_norm, activation;
};

struct tformer_moe; /* a mixture of experts' feed-forward (experts.c, below) */

/* A language model's layer (models/gpt.py's GPTBlock): heads query heads sharing kv_heads
 * key/value heads (grouped-query attention). */
struct tformer_lm_layer {
    struct tformer_linear qkv, out, gate, up, down; /* gate: n_out 0 where plain */
    struct tformer_norm attn_norm, ff_norm, q_norm, k_norm; /* q/k_norm: weight NULL for none */
    long heads, kv_heads, d_head, d_value;
    long rotated; /* the leading dimensions of each head that rotate; 0: no rotary */
    int interleaved; /* pairs (2i, 2i + 1), or else (i, i + rotated / 2) */
    float scale;
    int pre_norm, activation;
    const struct tformer_moe *moe; /* a mixture of experts in place of gate, up and down
                                    * (their n_out 0), or NULL */
};

long tformer_decoder_layer_scratch(const struct tformer_decoder_layer *l);
int tformer_decoder_layer_step(const struct tformer_decoder_layer *l, float *x, long n,
                               const struct tformer_kv *self_kv, long length,
                               const int64_t *rows, long rows_row,
                               const struct tformer_kv *cross_kv, long source_len,
                               const float *bias, long bias_row, float *scratch, int threads);
int tformer_decoder_layer_step_paged(const struct tformer_decoder_layer *l, float *x, long n,
                                     const struct tformer_kv *self_kv, const int64_t *table,
                                     long table_row, long block, const int64_t *lengths,
                                     const struct tformer_kv *cross_kv, long source_len,
                                     const float *bias, long bias_row, float *scratch,
                                     int threads);
long tformer_lm_layer_scratch(const struct tformer_lm_layer *l);
int tformer_lm_step(const struct tformer_lm_layer *const *layers,
                    const struct tformer_kv *const *kvs, long count, float *x, long n, long tokens,
                    long length, const float *cos, const float *sin, const float *bias,
                    long bias_row, float *scratch, int threads);
int tformer_lm_layer_step(const struct tformer_lm_layer *l, float *x, long n, long tokens,
                          const struct tformer_kv *kv, long length, const float *cos,
                          const float *sin, const float *bias, long bias_row, float *scratch,
                          int threads);
int tformer_lm_step_paged(const struct tformer_lm_layer *const *layers,
                          const struct tformer_kv *const *kvs, long count, float *x, long n,
                          long tokens, const int64_t *table, long table_row, long block,
                          const int64_t *lengths, long window, const float *cos,
                          const float *sin, float *scratch, int threads);

/* --- Training: dropout (dropout.c), the cross-entropy (xent.c), SwiGLU's gate (glu.c),
 * RMSNorm (rmsnorm.c) --------------------------------------------------------------------- */
void tformer_philox4x32(const uint32_t *counter, const uint32_t *key, uint32_t *out);
void tformer_dropout(const float *x, float *y, long n, uint64_t seed, uint32_t threshold,
                     float scale, int threads);
void tformer_xent_forward(const float *x, const int64_t *target, long n, long v, float eps,
                          int64_t ignore, float *loss, float *stats, int threads);
void tformer_xent_backward(const float *x, const int64_t *target, const float *stats,
                           const float *g, long n, long v, float eps, int64_t ignore,
                           float *grad, int threads);
void tformer_silu_mul_forward(const float *g, const float *u, float *out, long n, int threads);
void tformer_silu_mul_backward(const float *g, const float *u, const float *dout, float *dg,
                               float *du, long n, int threads);
void tformer_rms_norm_forward(const float *x, const float *w, long rows, long d, float eps,
                              float *y, float *r, int threads);
void tformer_rms_norm_backward(const float *x, const float *w, const float *r, const float *dy,
                               long rows, long d, float *dx, float *dw, int threads);

/* --- Products of row ranges over activations rounded once (kinds.c; blocks.c's rows): for
 * a caller that runs many products of the same rows and splits their outputs among its own
 * threads (experts.c) ------------------------------------------------------------------- */

/* x (m x k) as the products of one activation kind (TFORMER_X_*) read it: the fp32 rows, and
 * where this build rounds that kind apart from its products, the rounding (blocks.c's q8_0
 * blocks for TFORMER_X_Q8_0); data NULL otherwise, and the products round x themselves. */
struct tformer_activations {
    const float *x;
    long m, k;
    int32_t activation;
    void *data;
};

int tformer_round_activations(struct tformer_activations *a, int activation, const float *x,
                              long m, long k, int threads);
void tformer_free_activations(struct tformer_activations *a);
int tformer_linear_rows(const struct tformer_linear *l, const struct tformer_activations *a,
                        long i0, long rows, float *y, long ldy, long r0, long r1);
void *tformer_blocks_round(const float *x, long m, long k, int threads);
void tformer_blocks_round_free(void *xb);
int tformer_blocks_rows(const struct tformer_linear *l, const void *xb, long i0, long rows,
                        float *y, long ldy, long r0, long r1);

/* --- A mixture of experts' feed-forward on a few rows in one call (experts.c) ------------ */
enum { TFORMER_GLU_SILU = 0, TFORMER_GLU_CLAMPED = 1 };

/* The experts of a mixture (layers/experts.py's Experts): n_expert gated feed-forwards, each
 * projection a struct tformer_linear of its own (any kind with a product; biases in them),
 * gate[e] and up[e] d_ff x d, down[e] d x d_ff; and Qwen2-MoE's shared expert, every row's,
 * scaled by sigmoid(x . shared_scale) (shared_scale NULL: by 1; shared_up.n_out 0: none). */
struct tformer_experts {
    const struct tformer_linear *gate, *up, *down;
    int64_t n_expert;
    int32_t glu;        /* TFORMER_GLU_SILU: silu(gate) up; TFORMER_GLU_CLAMPED: gpt-oss's */
    float limit, alpha; /* the clamped gate's: gate <= limit, |up| <= limit, sigmoid(alpha g) */
    struct tformer_linear shared_gate, shared_up, shared_down; /* always silu(gate) up */
    const float *shared_scale;
};

int tformer_experts_step(const struct tformer_experts *e, const float *x, long m,
                         const int64_t *ids, const float *weights, long k, float *out,
                         int threads);

/* A mixture's router (layers/experts.py's Router): fp32 scores x W^T + b over the experts,
 * the k best, weighted by a softmax over every expert (renormalised over the k or not) or,
 * with `after`, over the k chosen scores alone. */
struct tformer_router {
    struct tformer_linear scores; /* fp32, n_expert x d */
    int32_t k, after, renormalise;
};

/* A mixture of experts' feed-forward: its router and its experts (a language model's layer
 * step runs it in place of a dense feed-forward: struct tformer_lm_layer's moe). */
struct tformer_moe {
    struct tformer_router router;
    struct tformer_experts experts;
};

int tformer_route(const struct tformer_router *r, const float *x, long m, int64_t *ids,
                  float *weights, int threads);
int tformer_moe_step(const struct tformer_moe *moe, const float *x, long m, float *out,
                     int threads);

#endif

/* A mixture of experts' feed-forward (layers/experts.py's MixtureOfExperts, past its router)
 * for a few rows in one call, x86 with AVX2 and FMA:
 *
 *     out_i = sum_j w_ij down_e(glu(gate_e x_i, up_e x_i)),  e = ids_ij
 *             [+ sigmoid(x_i . s) down_s(silu(gate_s x_i) up_s x_i), the shared expert]
 *
 * At a decoding step a token runs only its k experts, whose products are small (Qwen3-MoE's:
 * 768 x 2048): as modules, each expert's gate, up and down are a call of their own with
 * torch's glue around it, 3k calls and their Python a layer. Here the rows are grouped by
 * expert (a group: the rows that chose it, the shared expert's every row), x is rounded
 * once per activation kind the projections take (kinds.c's tformer_round_activations), and
 * one parallel region runs
 *
 *   1. every group's gate and up products, the threads splitting the output rows of all of
 *      them evenly (each thread a contiguous run through the concatenated rows, so that the
 *      weights it streams are the same amount, whichever experts they belong to);
 *   2. the gates (silu(g) u, as glu.c computes it; or gpt-oss's clamped form), and the
 *      hidden rows rounded once for the down products;
 *   3. every group's down products, split the same way;
 *   4. each row's sum of its experts' outputs times the router's weights, in the order of
 *      its choices (as layers/experts.py's route_tokens adds them for one row), then the
 *      shared expert's.
 *
 * The products are the table's (tformer_linear_rows): the same outputs as tformer_linear's
 * for those rows, so each expert's output is the module path's; the sums round as the
 * modules' do for one row, and within float rounding of them for several.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tformer.h"
#include "vecmath.h"

#define ACTIVATIONS 3 /* TFORMER_X_FP32, TFORMER_X_Q8_0, TFORMER_X_Q8_K */

/* The rows that go through one expert: its projections, its rows of the input, x (or of the
 * gathered copy past x's m rows) [x0, x0 + rows), its rows of the outputs [h0, h0 + rows),
 * its hidden width, where its hidden rows start (floats into the gate's and up's outputs),
 * and the rounded hidden rows its down product reads (a run of groups of one width), from
 * its row `at` on. */
struct group {
    const struct tformer_linear *gate, *up, *down;
    int64_t expert; /* -1: the shared expert */
    long x0, rows, h0, width, hidden, run, at;
    int clamped;
};

static int activation_of(const struct tformer_linear *l)
{
    int32_t geometry[3];
    return tformer_kind_geometry(l->kind, geometry) ? -1 : geometry[2];
}

/* g = c sigmoid(alpha c) (clamp(u, -limit, limit) + 1), c = min(g, limit), over n floats:
 * gpt-oss's gate (layers/experts.py's ClampedGLU), a NaN kept as torch's clamp keeps it. */
static void clamped_gate(float *g, const float *u, long n, float limit, float alpha)
{
    const __m256 lim = _mm256_set1_ps(limit), neg = _mm256_set1_ps(-limit);
    const __m256 a = _mm256_set1_ps(alpha), one = _mm256_set1_ps(1.0f);
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        /* min(x, y) returns y where either is NaN: x the limit keeps the value's NaN */
        const __m256 c = _mm256_min_ps(lim, _mm256_loadu_ps(g + j));
        const __m256 v = _mm256_max_ps(neg, _mm256_min_ps(lim, _mm256_loadu_ps(u + j)));
        const __m256 s = _mm256_mul_ps(c, sigmoid8(_mm256_mul_ps(a, c)));
        _mm256_storeu_ps(g + j, _mm256_mul_ps(s, _mm256_add_ps(v, one)));
    }
    for (; j < n; j++) {
        const float c = g[j] > limit ? limit : g[j];
        const float v = u[j] > limit ? limit : u[j] < -limit ? -limit : u[j];
        g[j] = c * sigmoid1(alpha * c) * (v + 1.0f);
    }
}

/* x . s over d floats, eight lanes and then their sum. */
static float dot(const float *x, const float *s, long d)
{
    __m256 acc = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= d; j += 8)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(s + j)));
    float sum = sum_lanes(acc);
    for (; j < d; j++)
        sum += x[j] * s[j];
    return sum;
}

/* The products of a phase (down 0: every group's gate and up; down 1: every group's down),
 * their output rows one after the other, thread t of T taking rows [t total / T, (t + 1)
 * total / T) of them (rounded to fours): the same amount of weights for each thread,
 * whichever experts they belong to. Gate rows go to gu + hidden, up rows to gu + floats +
 * hidden (each group's rows x its width), down rows to down_out's rows h0 .. (d wide).
 * Returns the first product's failure, or 0. */
static int share_products(const struct group *groups, long n_groups, int down,
                          const struct tformer_activations *in,
                          const struct tformer_activations *hid, float *gu, long floats,
                          float *down_out, long d, int t, int T)
{
    long total = 0;
    for (long g = 0; g < n_groups; g++)
        total += down ? d : 2 * groups[g].width;
    const long a = t * total / T & ~3L, b = t + 1 == T ? total : (t + 1) * total / T & ~3L;
    long start = 0;
    for (long g = 0; g < n_groups; g++)
        for (int p = down ? 2 : 0; p < (down ? 3 : 2); p++) {
            const struct group *G = &groups[g];
            const struct tformer_linear *l = p == 0 ? G->gate : p == 1 ? G->up : G->down;
            const long n = l->n_out, r0 = a > start ? a - start : 0;
            const long r1 = b - start < n ? b - start : n;
            start += n;
            if (r1 <= r0)
                continue;
            const int act = activation_of(l);
            const int status =
                down ? tformer_linear_rows(l, &hid[G->run * ACTIVATIONS + act], G->at, G->rows,
                                           down_out + G->h0 * d + r0, d, r0, r1)
                     : tformer_linear_rows(l, &in[act], G->x0, G->rows,
                                           gu + p * floats + G->hidden + r0, G->width, r0, r1);
            if (status)
                return status;
        }
    return 0;
}

/* out (m x d) = each row's experts (ids, m x k, and the router's weights for them, m x k)
 * and the shared expert, as the file's text says; x (m x d). Returns 0; -1 where it could
 * not allocate; -2 where an id names no expert or the experts' shapes do not fit together;
 * -3 where a projection's kind has no product here (out is then untouched). */
int tformer_experts_step(const struct tformer_experts *e, const float *x, long m,
                         const int64_t *ids, const float *weights, long k, float *out,
                         int threads)
{
    if (m <= 0)
        return 0;
    if (k <= 0)
        return -2;
    for (long c = 0; c < m * k; c++)
        if (ids[c] < 0 || ids[c] >= e->n_expert)
            return -2;
    const long d = e->gate[ids[0]].n_in, most = m * k + 1;
    const int shared = e->shared_up.n_out > 0;
    struct group *groups = calloc((size_t)most, sizeof *groups);
    long *slot = malloc((size_t)most * sizeof *slot);
    long *members = malloc((size_t)most * sizeof *members);
    float *scale = malloc((size_t)m * sizeof *scale);
    struct tformer_activations in[ACTIVATIONS] = {{0}}, *hid = NULL;
    float *work = NULL;
    int status = groups && slot && members && scale ? 0 : -1;

    /* Groups in the order their experts are first chosen (slot[c]: choice c's group), then
     * the shared expert's of every row. */
    long n_groups = 0;
    for (long c = 0; c < m * k && !status; c++) {
        long g = 0;
        while (g < n_groups && groups[g].expert != ids[c])
            g++;
        if (g == n_groups) {
            const int64_t u = ids[c];
            groups[n_groups++] = (struct group){.gate = e->gate + u, .up = e->up + u,
                                                .down = e->down + u, .expert = u, .x0 = -1,
                                                .width = e->gate[u].n_out,
                                                .clamped = e->glu == TFORMER_GLU_CLAMPED};
        }
        slot[c] = g;
        groups[g].rows++;
    }
    if (shared && !status)
        groups[n_groups++] = (struct group){.gate = &e->shared_gate, .up = &e->shared_up,
                                            .down = &e->shared_down, .expert = -1, .x0 = 0,
                                            .rows = m, .width = e->shared_up.n_out};
    /* Each group's rows of the outputs (h0) and hidden rows (hidden), and the runs of groups
     * of one width, whose hidden rows are rounded together for the down products (the
     * routed experts', the shared expert's): `at`, a group's first row in its run. */
    long rows = 0, floats = 0, n_runs = 0;
    for (long g = 0; g < n_groups && !status; g++) {
        struct group *G = &groups[g];
        if (G->gate->n_in != d || G->up->n_in != d || G->gate->n_out != G->width
            || G->up->n_out != G->width || G->down->n_in != G->width || G->down->n_out != d)
            status = -2;
        G->h0 = rows;
        G->hidden = floats;
        rows += G->rows;
        floats += G->rows * G->width;
        const int starts = g == 0 || G->width != groups[g - 1].width;
        n_runs += starts;
        G->run = n_runs - 1;
        G->at = starts ? 0 : groups[g - 1].at + groups[g - 1].rows;
    }
    /* slot[c] -> choice c's output row; members: each group's rows of x, in row order (the
     * shared expert's are x's own). A group reads x where its rows are consecutive (one row
     * always), else a gathered copy of them past x's m rows (x0 >= m). */
    long gathered = 0;
    if (!status) {
        long *filled = calloc((size_t)most, sizeof *filled);
        if (!filled)
            status = -1;
        for (long c = 0; c < m * k && !status; c++) {
            const long g = slot[c], r = groups[g].h0 + filled[g]++;
            members[r] = c / k;
            slot[c] = r;
        }
        free(filled);
    }
    for (long g = 0; g < n_groups && !status; g++) {
        struct group *G = &groups[g];
        if (G->expert < 0)
            continue;
        int consecutive = 1;
        for (long r = 1; r < G->rows; r++)
            consecutive &= members[G->h0 + r] == members[G->h0] + r;
        G->x0 = consecutive ? members[G->h0] : m + gathered;
        gathered += consecutive ? 0 : G->rows;
    }
    /* Working memory: the gathered rows (after a copy of x), the gates' outputs (then the
     * hidden rows), the ups', the downs'. */
    if (!status) {
        const long input = gathered ? (m + gathered) * d : 0;
        work = malloc((size_t)(input + 2 * floats + rows * d) * sizeof(float));
        hid = calloc((size_t)(n_runs * ACTIVATIONS), sizeof *hid);
        if (!work || !hid)
            status = -1;
    }
    const float *input = x;
    float *gu = NULL, *down_out = NULL;
    if (!status) {
        float *copy = work;
        gu = work + (gathered ? (m + gathered) * d : 0);
        down_out = gu + 2 * floats;
        if (gathered) {
            memcpy(copy, x, (size_t)(m * d) * sizeof(float));
            for (long g = 0; g < n_groups; g++)
                for (long r = 0; groups[g].x0 >= m && r < groups[g].rows; r++)
                    memcpy(copy + (groups[g].x0 + r) * d, x + members[groups[g].h0 + r] * d,
                           (size_t)d * sizeof(float));
            input = copy;
        }
        for (long i = 0; i < m; i++)
            scale[i] = shared && e->shared_scale ? sigmoid1(dot(x + i * d, e->shared_scale, d))
                                                 : 1.0f;
    }
    /* x (and the gathered rows) rounded once for each activation kind the gates and ups
     * take */
    for (long g = 0; g < n_groups && !status; g++)
        for (int p = 0; p < 2 && !status; p++) {
            const int act = activation_of(p ? groups[g].up : groups[g].gate);
            if (act < 0 || act >= ACTIVATIONS)
                status = -3;
            else if (!in[act].x)
                status = tformer_round_activations(&in[act], act, input, m + gathered, d,
                                                   threads);
        }
    for (long g = 0; g < n_groups && !status; g++) {
        const int act = activation_of(groups[g].down);
        status = act < 0 || act >= ACTIVATIONS ? -3 : 0;
    }

    if (!status) {
        int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            /* 1. every gate and up */
            const int mine = share_products(groups, n_groups, 0, in, hid, gu, floats, down_out,
                                            d, t, T);
            if (mine) {
#pragma omp atomic write
                failed = mine;
            }
#pragma omp barrier
            /* 2. the gates, over the gates' outputs; then each run's hidden rows rounded once
             * for each activation kind its downs take */
#pragma omp for schedule(static)
            for (long g = 0; g < n_groups; g++) {
                const struct group *G = &groups[g];
                if (G->clamped)
                    clamped_gate(gu + G->hidden, gu + floats + G->hidden, G->rows * G->width,
                                 e->limit, e->alpha);
                else
                    tformer_silu_mul_forward(gu + G->hidden, gu + floats + G->hidden,
                                             gu + G->hidden, G->rows * G->width, 1);
            }
#pragma omp single
            for (long g = 0; g < n_groups && !failed; g++) {
                const struct group *G = &groups[g];
                const int act = activation_of(G->down);
                struct tformer_activations *a = &hid[G->run * ACTIVATIONS + act];
                if (a->x)
                    continue;
                long g0 = g, all = 0; /* the run's first group, and its rows */
                while (g0 > 0 && groups[g0 - 1].run == G->run)
                    g0--;
                for (long h = g0; h < n_groups && groups[h].run == G->run; h++)
                    all += groups[h].rows;
                if (tformer_round_activations(a, act, gu + groups[g0].hidden, all, G->width, 1))
                    failed = -1;
            }
            /* 3. every down */
            const int theirs = failed ? 0 : share_products(groups, n_groups, 1, in, hid, gu,
                                                           floats, down_out, d, t, T);
            if (theirs) {
#pragma omp atomic write
                failed = theirs;
            }
#pragma omp barrier
            /* 4. each row's weighted sum of its experts, then the shared expert's */
            if (!failed) {
                const long chunks = (d + 255) / 256;
#pragma omp for schedule(static)
                for (long q = 0; q < m * chunks; q++) {
                    const long i = q / chunks, c0 = q % chunks * 256;
                    const long c1 = c0 + 256 < d ? c0 + 256 : d;
                    const float *sh = shared ? down_out + (groups[n_groups - 1].h0 + i) * d : NULL;
                    for (long c = c0; c < c1; c++) {
                        float acc = 0.0f;
                        for (long j = 0; j < k; j++)
                            acc = acc + weights[i * k + j] * down_out[slot[i * k + j] * d + c];
                        out[i * d + c] = sh ? acc + scale[i] * sh[c] : acc;
                    }
                }
            }
        }
        status = failed;
    }
    for (int a = 0; a < ACTIVATIONS; a++)
        if (in[a].x)
            tformer_free_activations(&in[a]);
    for (long r = 0; hid && r < n_runs * ACTIVATIONS; r++)
        if (hid[r].x)
            tformer_free_activations(&hid[r]);
    free(hid), free(work), free(groups), free(slot), free(members), free(scale);
    return status;
}

/* The router's choices for m rows of x (m x d): ids (m x k), best first (of equal scores the
 * lower id), and their weights (m x k), as layers/experts.py's Router computes them: scores
 * x W^T + b in fp32 (kinds.c's product of W's kind); a softmax over all the scores, the k
 * best's probabilities, renormalised to sum to 1 or not; or, `after`, a softmax over the k
 * best scores. Returns 0, -1 where it could not allocate, or the product's failure. */
int tformer_route(const struct tformer_router *r, const float *x, long m, int64_t *ids,
                  float *weights, int threads)
{
    const long n = r->scores.n_out, k = r->k;
    float *scores = malloc((size_t)(m * n) * sizeof(float));
    unsigned char *taken = malloc((size_t)n);
    int status = scores && taken ? tformer_linear(&r->scores, x, scores, m, threads) : -1;
    for (long i = 0; i < m && !status; i++) {
        const float *s = scores + i * n;
        int64_t *id = ids + i * k;
        float *w = weights + i * k;
        memset(taken, 0, (size_t)n);
        for (long j = 0; j < k; j++) {
            long best = -1;
            for (long e = 0; e < n; e++)
                if (!taken[e] && (best < 0 || s[e] > s[best]))
                    best = e;
            taken[best] = 1;
            id[j] = best;
        }
        /* exp of each score less the largest (the first chosen), over all or the chosen */
        const float top = s[id[0]];
        float total = 0.0f;
        if (r->after)
            for (long j = 0; j < k; j++)
                total += expf(s[id[j]] - top);
        else
            for (long e = 0; e < n; e++)
                total += expf(s[e] - top);
        float chosen = 0.0f;
        for (long j = 0; j < k; j++) {
            w[j] = expf(s[id[j]] - top) / total;
            chosen += w[j];
        }
        if (r->renormalise && !r->after)
            for (long j = 0; j < k; j++)
                w[j] /= chosen;
    }
    free(scores);
    free(taken);
    return status;
}

/* out (m x d) = the mixture's feed-forward on x (m x d): its router's choices, then
 * tformer_experts_step. Returns 0, or tformer_route's or tformer_experts_step's failure. */
int tformer_moe_step(const struct tformer_moe *moe, const float *x, long m, float *out,
                     int threads)
{
    const long k = moe->router.k;
    int64_t *ids = malloc((size_t)(m * k) * sizeof *ids);
    float *weights = malloc((size_t)(m * k) * sizeof *weights);
    int status = ids && weights ? tformer_route(&moe->router, x, m, ids, weights, threads) : -1;
    if (!status)
        status = tformer_experts_step(&moe->experts, x, m, ids, weights, k, out, threads);
    free(ids);
    free(weights);
    return status;
}

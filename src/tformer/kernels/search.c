/* Beam search's candidates, x86 with AVX2 and FMA.
 *
 * A beam search step needs, of each row of logits (one hypothesis's next-token scores over a
 * vocabulary of V), the best k of log_softmax(row) + the hypothesis's score. Written with
 * torch, that is a log-softmax into a fresh N x V tensor, an addition over all of it, and a
 * top-k: three passes over 15 MB at 64 rows of a 58k vocabulary, and a fresh allocation that
 * the kernel's page faults make expensive. A row's order is the same before and after the
 * log-softmax (it subtracts one number from the whole row), so this picks the best k of the
 * logits themselves while it finds their maximum, then sums exp(x - max) in a second pass
 * over the row (which the first has left in the L2 cache), and computes the log-softmax only
 * for the k it keeps (leaving out the columns it is told never to choose):
 *
 *     top[i, r] = ((x[i, j] - max_i) - log(sum_j' exp(x[i, j'] - max_i))) + add[i]
 *
 * the same sequence of fp32 operations as torch's log_softmax followed by the addition. Only
 * the sum of exponentials is summed in another order (and each exp rounded differently, by
 * about an ulp), so the values can differ from torch's in the last bits.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "tformer.h"
#include "vecmath.h"

/* Insert (x, j) into the k best so far, val[0] >= val[1] >= ... >= val[k - 1], in place
 * of the last (which leaves). x beats val[k - 1], or the list is not full yet (idx < 0). */
static inline void insert(float *val, int64_t *idx, int k, float x, int64_t j)
{
    int r = k - 1;
    while (r > 0 && (idx[r - 1] < 0 || x > val[r - 1])) {
        val[r] = val[r - 1];
        idx[r] = idx[r - 1];
        r--;
    }
    val[r] = x;
    idx[r] = j;
}

static inline int is_banned(int64_t j, const int64_t *banned, int nbanned)
{
    for (int b = 0; b < nbanned; b++)
        if (banned[b] == j)
            return 1;
    return 0;
}

/* One row: its best k columns (k <= v), best first, in val / idx, the banned ones counting
 * as -inf; equal values in the order of their columns. Returns the row's maximum, over all
 * columns. The first k columns fill the list whatever their values, so that it holds k
 * distinct columns even where fewer are finite. */
static float best_of_row(const float *x, long v, int k, const int64_t *banned, int nbanned,
                         float *val, int64_t *idx)
{
    for (int r = 0; r < k; r++) {
        val[r] = -INFINITY;
        idx[r] = -1;
    }
    float mx = -INFINITY;
    long j = 0;
    for (; j < v && idx[k - 1] < 0; j++) {
        mx = x[j] > mx ? x[j] : mx;
        insert(val, idx, k, is_banned(j, banned, nbanned) ? -INFINITY : x[j], j);
    }
    __m256 vmax = _mm256_set1_ps(mx), floor = _mm256_set1_ps(val[k - 1]);
    for (; j + 8 <= v; j += 8) {
        const __m256 xv = _mm256_loadu_ps(x + j);
        vmax = _mm256_max_ps(vmax, xv);
        int hits = _mm256_movemask_ps(_mm256_cmp_ps(xv, floor, _CMP_GT_OQ));
        if (hits) { /* rare after the first few hundred columns */
            while (hits) {
                const int l = __builtin_ctz(hits);
                hits &= hits - 1;
                if (x[j + l] > val[k - 1] && !is_banned(j + l, banned, nbanned))
                    insert(val, idx, k, x[j + l], j + l);
            }
            floor = _mm256_set1_ps(val[k - 1]);
        }
    }
    for (; j < v; j++) {
        mx = x[j] > mx ? x[j] : mx;
        if (x[j] > val[k - 1] && !is_banned(j, banned, nbanned))
            insert(val, idx, k, x[j], j);
    }
    return max_lanes(vmax, mx);
}

/* For each of the n rows of x (n x v, row-major): top (n x k) and idx (n x k) as described
 * at the top of the file; the log-softmax is over all columns, but the `nbanned` columns
 * in `banned` are never chosen (beam search's tokens that are never produced). */
void tformer_top_logprobs(const float *x, const float *add, const int64_t *banned,
                          int nbanned, float *top, int64_t *idx, long n, long v, int k,
                          int threads)
{
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 1)
    for (long i = 0; i < n; i++) {
        const float *row = x + i * v;
        float *val = top + i * k;
        const float mx = best_of_row(row, v, k, banned, nbanned, val, idx + i * k);
        const float sum = sum_exp(row, v, mx);
        const float logsum = logf(sum);
        for (int r = 0; r < k; r++)
            val[r] = ((val[r] - mx) - logsum) + add[i];
    }
}

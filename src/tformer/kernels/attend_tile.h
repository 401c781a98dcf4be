/* The paged attention's tile (attend.c's tformer_attend_paged), written once for two vector
 * widths: attend.c includes it with AT_W 16 (AVX-512) and 8 (AVX2), AT_NAME naming each
 * copy's functions and AT_TARGET their instruction set.
 *
 * A tile is up to TILE queries that read the same key/value head of one sequence: a group's
 * query heads at a few consecutive new tokens. The positions go a span of SPAN at a time,
 * and a score is taken W positions a vector: a vector holds one key component of W
 * positions, each query's scores are W positions a multiply-add (broadcasting the query's
 * component c), and several queries' scores are held in registers at once (register
 * blocking): a span's keys are loaded once for a row of queries, not once a query (nor
 * reduced across lanes a position at a time). The pool keeps its keys that way round
 * (turned: k_pos 1, a component of a block's positions side by side, as vLLM's key cache
 * does), so the vectors are loaded where they lie; keys in any other layout are copied into
 * that shape a span at a time first. The values need no turning: a query's output columns
 * take p[b] * values[b] a position at a time, W columns a vector, again several queries at
 * once.
 *
 * The softmax is taken online (Milakov & Gimelshein 2018, as flash attention does): each
 * query keeps its running maximum m, the sum l of exp(score - m) and the exp-weighted sum of
 * values, rescaled when m grows. Spans start at multiples of SPAN; a query skips the spans
 * outside its positions and masks the rest of a span it shares. Every query's arithmetic is
 * its own, in the same order whichever queries share its tile or its register block (a
 * score is one chain of multiply-adds over c = 0 .. d-1; a column one chain over the
 * positions in order): one query alone, a decoding step's, a chunk's of 512 tokens beside
 * other rows give it the same bits. */

#define AT_NK (SPAN / AT_W) /* vectors of a span's scores */

#if AT_W == 16
typedef __m512 AT_NAME(vec);
#define at_load(p) _mm512_loadu_ps(p)
#define at_store(p, x) _mm512_storeu_ps(p, x)
#define at_set1(x) _mm512_set1_ps(x)
#define at_zero() _mm512_setzero_ps()
#define at_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define at_mul(a, b) _mm512_mul_ps(a, b)
#define at_add(a, b) _mm512_add_ps(a, b)
#define at_sub(a, b) _mm512_sub_ps(a, b)
#define at_max(a, b) _mm512_max_ps(a, b)
#define at_exp(x) exp16(x)
#define at_load_part(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), p)
#define at_hsum(x) _mm512_reduce_add_ps(x)
#define at_hmax(x) _mm512_reduce_max_ps(x)
#define at_any_nan(x) (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0)
#define at_abs(x) _mm512_abs_ps(x)
#define at_sign(x) _mm512_and_ps(x, _mm512_set1_ps(-0.0f))
#define at_or(a, b) _mm512_or_ps(a, b)
#define at_div(a, b) _mm512_div_ps(a, b)
#define AT_QS 6  /* queries a block of scores holds, of AT_SK vectors each: 6 x 2 */
#define AT_SK 2
#define AT_QV 4  /* queries a block of output columns holds: 4 x 4 vectors */
#define AT_CV 4
#else
typedef __m256 AT_NAME(vec);
#define at_load(p) _mm256_loadu_ps(p)
#define at_store(p, x) _mm256_storeu_ps(p, x)
#define at_set1(x) _mm256_set1_ps(x)
#define at_zero() _mm256_setzero_ps()
#define at_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define at_mul(a, b) _mm256_mul_ps(a, b)
#define at_add(a, b) _mm256_add_ps(a, b)
#define at_sub(a, b) _mm256_sub_ps(a, b)
#define at_max(a, b) _mm256_max_ps(a, b)
#define at_exp(x) exp8(x)
#define at_load_part(p, n) _mm256_maskload_ps(p, lanes_below(n))
#define at_hsum(x) sum_lanes(x)
#define at_hmax(x) max8(x)
#define at_any_nan(x) (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0)
#define at_abs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define at_sign(x) _mm256_and_ps(x, _mm256_set1_ps(-0.0f))
#define at_or(a, b) _mm256_or_ps(a, b)
#define at_div(a, b) _mm256_div_ps(a, b)
#define AT_QS 6  /* 6 x 2 vectors, the span's 4 in two passes */
#define AT_SK 2
#define AT_QV 2  /* 2 x 4 vectors */
#define AT_CV 4
#endif
#define AT_VEC AT_NAME(vec)

/* cap * tanh(x / cap) (Gemma 2's soft cap on the scores), tanh(y) taken as
 * sign(y) (1 - t) / (1 + t) with t = exp(-2 |y|), so that the exponential's argument is never
 * above 0 (exp8 / exp16's range); -inf stays -inf only where the caller masks after this. */
AT_TARGET static inline __attribute__((always_inline)) AT_VEC AT_NAME(cap)(AT_VEC x, float cap)
{
    const AT_VEC y = at_mul(x, at_set1(1.0f / cap));
    const AT_VEC t = at_exp(at_mul(at_abs(y), at_set1(-2.0f)));
    const AT_VEC one = at_set1(1.0f);
    return at_mul(at_or(at_div(at_sub(one, t), at_add(one, t)), at_sign(y)), at_set1(cap));
}

/* The span's scores of nq queries (q[0 .. nq-1], d floats each) into s[j][b], AT_SK
 * vectors of positions at a time, vector u's component c at vec[u] + c * comp: one chain
 * of multiply-adds over the key's components per query and position. */
AT_TARGET static inline __attribute__((always_inline)) void AT_NAME(score)(
    const int nq, const float *const *q, const float *const vec[AT_NK], long comp, long d,
    float (*s)[SPAN])
{
    for (int u0 = 0; u0 < AT_NK; u0 += AT_SK) {
        AT_VEC a[AT_QS][AT_SK];
        for (int j = 0; j < nq; j++)
            for (int u = 0; u < AT_SK; u++)
                a[j][u] = at_zero();
        for (long c = 0; c < d; c++) {
            AT_VEC k[AT_SK];
            for (int u = 0; u < AT_SK; u++)
                k[u] = at_load(vec[u0 + u] + c * comp);
            for (int j = 0; j < nq; j++) {
                const AT_VEC x = at_set1(q[j][c]);
                for (int u = 0; u < AT_SK; u++)
                    a[j][u] = at_fma(x, k[u], a[j][u]);
            }
        }
        for (int j = 0; j < nq; j++)
            for (int u = 0; u < AT_SK; u++)
                at_store(s[j] + (u0 + u) * AT_W, a[j][u]);
    }
}

/* Where the span's key vectors lie (score's vec and comp): in the pool (kt NULL: the tile
 * found its keys turned, k_pos 1, and a vector's W positions in one block, block % W == 0);
 * else in kt (d x SPAN floats), where the span's keys are copied turned. A vector of positions no query
 * reads (wholly before lo or from hi on) is given one that some query reads: its scores are
 * masked, and the block it would name may be given back or not yet held. */
AT_TARGET static inline __attribute__((always_inline)) long AT_NAME(key_vectors)(
    const struct tformer_kv *kv, long d, long s0, long lo, long hi,
    const float *const keys[SPAN], float *kt, const float *vec[AT_NK])
{
    if (kt) {
        for (int b = 0; b < SPAN; b++)
            for (long c = 0; c < d; c++)
                kt[c * SPAN + b] = keys[b][c * kv->k_comp];
        for (int u = 0; u < AT_NK; u++)
            vec[u] = kt + u * AT_W;
        return SPAN;
    }
    int read = -1;
    for (int u = 0; u < AT_NK; u++) {
        const long p = s0 + u * AT_W, at = p > lo ? p : lo;
        vec[u] = NULL;
        if (p + AT_W > lo && p < hi) { /* keys[at - s0] is position at's, in p's block */
            vec[u] = keys[at - s0] - (at - p);
            read = read < 0 ? u : read;
        }
    }
    for (int u = 0; u < AT_NK; u++)
        vec[u] = vec[u] ? vec[u] : vec[read];
    return kv->k_comp;
}

/* Scores of positions before first or from end on (of the span from s0) to -inf. */
AT_TARGET static inline __attribute__((always_inline)) void AT_NAME(mask)(
    AT_VEC e[AT_NK], float *s, long s0, long first, long end)
{
    for (int u = 0; u < AT_NK; u++)
        at_store(s + u * AT_W, e[u]);
    for (int b = 0; b < SPAN; b++)
        if (s0 + b < first || s0 + b >= end)
            s[b] = -INFINITY;
    for (int u = 0; u < AT_NK; u++)
        e[u] = at_load(s + u * AT_W);
}

/* acc[j][x ..] += sum_b p[j][b] values[b][x ..] for nq queries and nc vectors of columns
 * from x (the last one `part` lanes wide where part > 0): one chain per column over the
 * positions in order. */
AT_TARGET static inline __attribute__((always_inline)) void AT_NAME(weigh)(
    const int nq, const int nc, int part, float *const *acc, const float *const *p,
    const float *const values[SPAN], long x)
{
    AT_VEC a[AT_QV][AT_CV];
    for (int j = 0; j < nq; j++)
        for (int u = 0; u < nc; u++)
            a[j][u] = at_load(acc[j] + x + u * AT_W);
    for (int b = 0; b < SPAN; b++) {
        AT_VEC val[AT_CV];
        for (int u = 0; u < nc; u++)
            val[u] = part && u == nc - 1 ? at_load_part(values[b] + x + u * AT_W, part)
                                         : at_load(values[b] + x + u * AT_W);
        for (int j = 0; j < nq; j++) {
            const AT_VEC w = at_set1(p[j][b]);
            for (int u = 0; u < nc; u++)
                a[j][u] = at_fma(w, val[u], a[j][u]);
        }
    }
    for (int j = 0; j < nq; j++)
        for (int u = 0; u < nc; u++)
            at_store(acc[j] + x + u * AT_W, a[j][u]);
}

/* The tile's attention over key/value head g's value columns x0 .. x0 + dv - 1 (dv <=
 * COLUMNS). */
AT_TARGET static void AT_NAME(attend_tile)(const struct tile *t, const struct tformer_kv *kv,
                                           long g, const int64_t *table, long block, long d,
                                           long x0, long dv, float scale, float softcap)
{
    const long width = (dv + AT_W - 1) / AT_W * AT_W; /* acc's columns, whole vectors */
    float acc[t->n][width], m[TILE], l[TILE];
    float s[TILE][SPAN] __attribute__((aligned(64)));
    const int in_place = kv->k_pos == 1 && block % AT_W == 0; /* keys read where they lie */
    float copied[in_place ? AT_W : d * SPAN] __attribute__((aligned(64)));
    float *const kt = in_place ? NULL : copied;
    int nan[TILE];
    long lo = t->first[0], hi = t->end[0];
    for (int j = 0; j < t->n; j++) {
        lo = t->first[j] < lo ? t->first[j] : lo;
        hi = t->end[j] > hi ? t->end[j] : hi;
        m[j] = -INFINITY;
        l[j] = 0.0f;
        nan[j] = 0;
        for (long c = 0; c < width; c++)
            acc[j][c] = 0.0f;
    }
    const AT_VEC scales = at_set1(scale);
    for (long s0 = lo / SPAN * SPAN; s0 < hi; s0 += SPAN) {
        const float *keys[SPAN], *values[SPAN];
        span_places(kv, g, table, block, x0, s0, lo, hi, keys, values);
        /* the queries that read this span */
        int on[TILE], n = 0;
        for (int j = 0; j < t->n; j++)
            if (s0 + SPAN > t->first[j] && s0 < t->end[j] && !nan[j])
                on[n++] = j;
        if (!n)
            continue;
        const float *vec[AT_NK];
        const long comp = AT_NAME(key_vectors)(kv, d, s0, lo, hi, keys, kt, vec);
        const float *qs[TILE];
        for (int i = 0; i < n; i++)
            qs[i] = t->q[on[i]];
        for (int i = 0; i < n; i += AT_QS) {
            switch (n - i < AT_QS ? n - i : AT_QS) {
#define AT_SCORE(c)                                                                              \
    case c:                                                                                    \
        AT_NAME(score)(c, qs + i, vec, comp, d, s + i);                                        \
        break;
                AT_SCORE(1) AT_SCORE(2) AT_SCORE(3) AT_SCORE(4) AT_SCORE(5) AT_SCORE(6)
#undef AT_SCORE
            }
        }
        /* each query's online softmax over the span; p (in s) its weights */
        int live = 0;
        float *accs[TILE];
        const float *ps[TILE];
        for (int i = 0; i < n; i++) {
            const int j = on[i];
            /* a span it partly reads: the positions it does not read masked first, since
             * their keys may be anything (a block's positions not yet written) */
            const int part = s0 < t->first[j] || s0 + SPAN > t->end[j];
            AT_VEC e[AT_NK];
            int odd = 0; /* a NaN score (before the cap, which would hide it) */
            for (int u = 0; u < AT_NK; u++)
                e[u] = at_mul(at_load(s[i] + u * AT_W), scales);
            if (part)
                AT_NAME(mask)(e, s[i], s0, t->first[j], t->end[j]);
            if (softcap > 0.0f) {
                for (int u = 0; u < AT_NK; u++) {
                    odd |= at_any_nan(e[u]);
                    e[u] = AT_NAME(cap)(e[u], softcap);
                }
                if (part) /* the cap took -inf to -softcap */
                    AT_NAME(mask)(e, s[i], s0, t->first[j], t->end[j]);
            }
            AT_VEC top = e[0];
            for (int u = 0; u < AT_NK; u++) {
                odd |= at_any_nan(e[u]);
                top = at_max(top, e[u]);
            }
            if (odd) { /* as torch's softmax: a NaN score makes the row NaN */
                nan[j] = 1;
                continue;
            }
            const float mx = at_hmax(top);
            if (mx > m[j]) {
                const float shrink = expf(m[j] - mx); /* 0 at the first span */
                l[j] *= shrink;
                const AT_VEC sh = at_set1(shrink);
                for (long x = 0; x < width; x += AT_W)
                    at_store(acc[j] + x, at_mul(at_load(acc[j] + x), sh));
                m[j] = mx;
            }
            const AT_VEC mv = at_set1(m[j]);
            AT_VEC sum = at_zero();
            for (int u = 0; u < AT_NK; u++) {
                e[u] = at_exp(at_sub(e[u], mv));
                sum = at_add(sum, e[u]);
                at_store(s[i] + u * AT_W, e[u]);
            }
            l[j] += at_hsum(sum);
            accs[live] = acc[j];
            ps[live++] = s[i];
        }
        /* the weighted values, AT_QV queries by AT_CV vectors of columns at a time */
        for (int i = 0; i < live; i += AT_QV) {
            const int nq = live - i < AT_QV ? live - i : AT_QV;
            long x = 0;
            for (; x + AT_CV * AT_W <= dv; x += AT_CV * AT_W)
                switch (nq) {
#define AT_WEIGH(c)                                                                              \
    case c:                                                                                    \
        AT_NAME(weigh)(c, AT_CV, 0, accs + i, ps + i, values, x);                              \
        break;
                    AT_WEIGH(1) AT_WEIGH(2)
#if AT_QV > 2
                    AT_WEIGH(3) AT_WEIGH(4)
#endif
#undef AT_WEIGH
                }
            for (; x < dv; x += AT_W) {
                const int part = dv - x < AT_W ? (int)(dv - x) : 0;
                for (int j = i; j < i + nq; j++)
                    AT_NAME(weigh)(1, 1, part, accs + j, ps + j, values, x);
            }
        }
    }
    for (int j = 0; j < t->n; j++) {
        /* a sink: one more logit in the softmax's denominator, with no value behind it */
        float inv;
        if (t->sinks && t->sink[j] > m[j]) {
            const float shrink = expf(m[j] - t->sink[j]);
            inv = shrink / (l[j] * shrink + 1.0f);
        } else
            inv = 1.0f / (t->sinks ? l[j] + expf(t->sink[j] - m[j]) : l[j]);
        long x = 0;
        const AT_VEC iv = at_set1(inv);
        for (; x + AT_W <= dv; x += AT_W)
            at_store(t->out[j] + x0 + x, nan[j] ? at_set1(NAN) : at_mul(at_load(acc[j] + x), iv));
        for (; x < dv; x++)
            t->out[j][x0 + x] = nan[j] ? NAN : acc[j][x] * inv;
    }
}

#undef AT_NK
#undef AT_VEC
#undef AT_QS
#undef AT_SK
#undef AT_QV
#undef AT_CV
#undef at_load
#undef at_store
#undef at_set1
#undef at_zero
#undef at_fma
#undef at_mul
#undef at_add
#undef at_sub
#undef at_max
#undef at_exp
#undef at_load_part
#undef at_hsum
#undef at_hmax
#undef at_any_nan
#undef at_abs
#undef at_sign
#undef at_or
#undef at_div

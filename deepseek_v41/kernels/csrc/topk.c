/* The indexer's top-k, the sampler's argmax, and the candidate pool (its blocks, and a Reindex layer's picks
 * inside them scored from the FP4 index keys). */
#include "dsv41.h"
#include "index_keys.h"

/* ------------------------------------------------------------------------------------------ indexer top-k */

/* Restores the min-heap h [n] below position i. */
static void sift_down(float *h, int64_t n, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && h[l] < h[m]) m = l;
        if (r < n && h[r] < h[m]) m = r;
        if (m == i) return;
        float t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* model/indexer.py topk_set for scores [R, N] fp32: per row the indices [k] (ascending) of the k largest scores,
 * ties at the k-th value going to the lowest indices; with drop_neg_inf, an index whose score is -inf reads -1
 * (topk_entries). The k-th largest value comes from a min-heap of k scores (heap: k floats). Indices only, so the
 * result is the torch code's exactly. Returns 0, or -1 (the row's output unspecified) when a row holds a NaN
 * (torch.topk ranks NaN above everything; the caller takes the torch code), -2 when k > N. */
typedef struct {
    const float *scores;
    int64_t N, k;
    int drop_neg_inf;
    float *heap;
    int64_t *out;
    _Atomic int status;
} topk_job;

#define TOPK_RUN 16  /* scores checked at once (one AVX-512 compare) before any is looked at alone */

/* Whether any of x[0 .. n-1] is above t (or, with or_equal, equal to it); n <= TOPK_RUN. */
static inline int any_above(const float *x, int64_t n, float t, int or_equal) {
#if defined(__AVX512F__)
    if (n == TOPK_RUN)
        return or_equal ? _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(t), _CMP_GE_OQ) != 0
                        : _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#endif
    int any = 0;
    for (int64_t j = 0; j < n; j++) any |= or_equal ? x[j] >= t : x[j] > t;
    return any;
}

/* The key of a float (not NaN) that orders as the float does (-0 just below +0): its bits with the sign bit
 * flipped for a positive value, every bit flipped for a negative one. */
static inline uint32_t order_key(float f) {
    uint32_t b = to_bits(f);
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

static inline float key_value(uint32_t key) { return from_bits(key & 0x80000000u ? key & 0x7FFFFFFFu : ~key); }

/* How many of x [N] have order_key >= t. */
static int64_t count_at_least(const float *x, int64_t N, uint32_t t) {
    int64_t count = 0, i = 0;
#if defined(__AVX512F__)
    const __m512i flip = _mm512_set1_epi32((int)0x80000000u), tv = _mm512_set1_epi32((int)t);
    for (; i + 16 <= N; i += 16) {
        __m512i b = _mm512_loadu_si512((const void *)(x + i));
        /* order_key: b ^ (b < 0 ? 0xFFFFFFFF : 0x80000000) */
        __m512i key = _mm512_xor_si512(b, _mm512_or_si512(_mm512_srai_epi32(b, 31), flip));
        count += __builtin_popcount(_mm512_cmpge_epu32_mask(key, tv));
    }
#endif
    for (; i < N; i++) count += order_key(x[i]) >= t;
    return count;
}

/* The k-th largest of x [N] (1 <= k <= N, no NaN), as the min-heap of the k largest would hold it at its root:
 * the largest key t with at least k values' keys >= t, found bit by bit from the top (32 counting passes, no
 * data-dependent branch). A -0 or +0 may come back for a zero: they compare equal, so the picks are the same. */
static float kth_bisect(const float *x, int64_t N, int64_t k) {
    uint32_t t = 0;
    for (int bit = 31; bit >= 0; bit--) {
        uint32_t c = t | (1u << bit);
        if (count_at_least(x, N, c) >= k) t = c;
    }
    return key_value(t);
}

#define TOPK_BISECT_N 8192  /* up to this many scores a row's k-th largest is found by kth_bisect, else by a heap */

/* The top-k rule of one row x [N] into o [k] (heap: k floats, for rows over TOPK_BISECT_N); 0, or -1 (o
 * unspecified) when x holds a NaN. The k-th largest value comes from kth_bisect, or for a long row from a
 * min-heap of k scores (a decode row's ~100 heap insertions cost a branch miss per level: ~5 us per row at
 * N = 800, issue 25), where runs of TOPK_RUN scores are checked at once against the heap's minimum (which only
 * rises), so the scores that cannot enter the heap are passed over without a branch each; then runs that cannot
 * be picked are passed over likewise. Either way the same k-th value (up to the sign of a zero), the same picks. */
int topk_row(const float *x, int64_t N, int64_t k, int drop_neg_inf, float *heap, int64_t *o) {
    if (k == 0) return 0;
    int nan = 0;
    for (int64_t i = 0; i < N; i++) nan |= x[i] != x[i];
    if (nan) return -1;
    float kth;
    if (N <= TOPK_BISECT_N) {
        kth = kth_bisect(x, N, k);
    } else {
        for (int64_t i = 0; i < k; i++) heap[i] = x[i];
        for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
        for (int64_t i = k; i < N; i += TOPK_RUN) {
            const int64_t n = N - i < TOPK_RUN ? N - i : TOPK_RUN;
            if (!any_above(x + i, n, heap[0], 0)) continue;
            for (int64_t j = i; j < i + n; j++)
                if (x[j] > heap[0]) {
                    heap[0] = x[j];
                    sift_down(heap, k, 0);
                }
        }
        kth = heap[0];
    }
    int64_t greater = 0;
    for (int64_t i = 0; i < N; i++) greater += x[i] > kth;
    int64_t ties = k - greater, m = 0;
    for (int64_t i = 0; i < N && m < k; i += TOPK_RUN) {
        const int64_t n = N - i < TOPK_RUN ? N - i : TOPK_RUN;
        if (!any_above(x + i, n, kth, 1)) continue;
        for (int64_t j = i; j < i + n && m < k; j++)
            if (x[j] > kth || (x[j] == kth && ties-- > 0)) o[m++] = drop_neg_inf && x[j] == -INFINITY ? -1 : j;
    }
    return 0;
}

/* The k-th largest (1 <= k <= m) of a [m] (no NaN), overwriting a: a selection with a three-way partition (runs of
 * equal values, common among the indexer's scores, cost one pass). */
static float kth_largest(float *a, int64_t m, int64_t k) {
#if defined(__AVX512F__)
    /* Vector steps while many remain: count the values above and equal to a pivot, then keep (compressed in place,
     * each store at or before the vector it reads) the side holding the k-th largest; no branch per value. */
    while (m > 64) {
        float x = a[0], y = a[m / 2], z = a[m - 1];
        const float p = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        const __m512 pv = _mm512_set1_ps(p);
        int64_t gt = 0, eq = 0, i = 0;
        for (; i + 16 <= m; i += 16) {
            const __m512 v = _mm512_loadu_ps(a + i);
            gt += __builtin_popcount(_mm512_cmp_ps_mask(v, pv, _CMP_GT_OQ));
            eq += __builtin_popcount(_mm512_cmp_ps_mask(v, pv, _CMP_EQ_OQ));
        }
        for (; i < m; i++) {
            gt += a[i] > p;
            eq += a[i] == p;
        }
        if (k > gt && k <= gt + eq) return p;
        const int above = k <= gt;
        int64_t n = 0;
        for (i = 0; i + 16 <= m; i += 16) {
            const __m512 v = _mm512_loadu_ps(a + i);
            const __mmask16 keep = above ? _mm512_cmp_ps_mask(v, pv, _CMP_GT_OQ)
                                         : _mm512_cmp_ps_mask(v, pv, _CMP_LT_OQ);
            _mm512_storeu_ps(a + n, _mm512_maskz_compress_ps(keep, v));  /* (n <= i: within what was read) */
            n += __builtin_popcount(keep);
        }
        for (; i < m; i++)
            if (above ? a[i] > p : a[i] < p) a[n++] = a[i];
        if (!above) k -= gt + eq;
        m = n;
    }
#endif
    int64_t lo = 0, hi = m;
    const int64_t want = k - 1;  /* the position in descending order */
    for (;;) {
        if (hi - lo <= 16) {  /* insertion sort, descending */
            for (int64_t i = lo + 1; i < hi; i++) {
                float v = a[i];
                int64_t j = i;
                for (; j > lo && a[j - 1] < v; j--) a[j] = a[j - 1];
                a[j] = v;
            }
            return a[want];
        }
        float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];  /* the median of three as pivot */
        float p = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t lt = lo, i = lo, gt = hi;  /* [lo, lt) > p, [lt, gt) == p, [gt, hi) < p */
        while (i < gt) {
            float v = a[i];
            if (v > p) {
                a[i++] = a[lt];
                a[lt++] = v;
            } else if (v < p) {
                a[i] = a[--gt];
                a[gt] = v;
            } else {
                i++;
            }
        }
        if (want < lt) hi = lt;
        else if (want < gt) return p;
        else lo = gt;
    }
}

/* topk_row's result (the same indices) without a heap (issue 25: a heap's ~k ln(N / k) sifts dominated a prefill
 * chunk's top-k). The scores are split into G disjoint groups and the maximum of each taken; when G >= k, the
 * k-th largest group maximum t0 is at most the k-th largest score (k groups hold a score >= t0), else t0 = -inf.
 * The scores >= t0 are gathered with their indices (in index order: typically a few k of them), the k-th largest
 * of those is the row's, and the picks follow topk_row's rule among them. With AVX-512 a group is one lane of 16
 * consecutive vectors (256 scores make 16 groups, lane maxima without a horizontal step), else 16 consecutive
 * scores; the scores past the last whole group are in none. Scratch: N / 16 + 2 N floats and N int32 (idx).
 * Returns 0, or -1 (o unspecified) when x holds a NaN. */
int topk_fast(const float *x, int64_t N, int64_t k, int drop_neg_inf, float *scratch, int32_t *idx, int64_t *o) {
    if (k == 0) return 0;
    float *gmax = scratch, *vals = gmax + N / 16, *work = vals + N;
    int64_t G = 0, grouped = 0;
    int nan = 0;
#if defined(__AVX512F__)
    __mmask16 odd = 0;
    for (; grouped + 256 <= N; grouped += 256, G += 16) {
        __m512 m = _mm512_loadu_ps(x + grouped);
        odd |= _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
        for (int v = 1; v < 16; v++) {
            const __m512 a = _mm512_loadu_ps(x + grouped + 16 * v);
            odd |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, a);
        }
        _mm512_storeu_ps(gmax + G, m);
    }
    nan |= odd != 0;
#endif
    for (; grouped + 16 <= N; grouped += 16) {
        const float *v = x + grouped;
        float m = v[0];
        for (int i = 0; i < 16; i++) {
            nan |= v[i] != v[i];
            m = v[i] > m ? v[i] : m;
        }
        gmax[G++] = m;
    }
    for (int64_t i = grouped; i < N; i++) nan |= x[i] != x[i];
    if (nan) return -1;
    float t0 = -INFINITY;
    if (G >= k) {
        memcpy(work, gmax, (size_t)G * sizeof(float));
        t0 = kth_largest(work, G, k);
    }
    int64_t m = 0, i = 0;
#if defined(__AVX512F__)
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= N; i += 16) {
        const __m512 a = _mm512_loadu_ps(x + i);
        const __mmask16 ge = _mm512_cmp_ps_mask(a, _mm512_set1_ps(t0), _CMP_GE_OQ);
        if (!ge) continue;
        /* compressed in registers and stored whole (a compress straight to memory is microcoded on Zen 4, ~20x
         * slower): up to 15 values past the m kept, into work's first 16 floats / idx's 16 spare */
        _mm512_storeu_ps(vals + m, _mm512_maskz_compress_ps(ge, a));
        _mm512_storeu_si512(idx + m, _mm512_maskz_compress_epi32(ge, _mm512_add_epi32(_mm512_set1_epi32((int32_t)i),
                                                                                        lanes)));
        m += __builtin_popcount(ge);
    }
#endif
    for (; i < N; i++)
        if (x[i] >= t0) {
            vals[m] = x[i];
            idx[m++] = (int32_t)i;
        }
    memcpy(work, vals, (size_t)m * sizeof(float));
    const float kth = kth_largest(work, m, k);
    int64_t greater = 0;
    for (int64_t c = 0; c < m; c++) greater += vals[c] > kth;
    int64_t ties = k - greater, at = 0;
    for (int64_t c = 0; c < m && at < k; c++)
        if (vals[c] > kth || (vals[c] == kth && ties-- > 0))
            o[at++] = drop_neg_inf && vals[c] == -INFINITY ? -1 : idx[c];
    return 0;
}

static void topk_item(const void *job, int64_t r) {
    const topk_job *j = job;
    if (topk_row(j->scores + r * j->N, j->N, j->k, j->drop_neg_inf, j->heap + r * j->k, j->out + r * j->k) != 0)
        atomic_store(&((topk_job *)j)->status, -1);
}

int dsv41_topk_set(const float *scores, int64_t R, int64_t N, int64_t k, int drop_neg_inf, float *heap,
                   int64_t *out) {
    if (k > N) return -2;
    topk_job job = {scores, N, k, drop_neg_inf, heap, out, 0};
    parallel_for(topk_item, &job, R);  /* one row per item; heap [R, k] */
    return atomic_load(&job.status);
}

/* x.max(dim=-1).indices of fp32 rows x [R, V] (V >= 1; engine/sampler.py argmax): per row the first index of the
 * largest value, NaN counting as the largest (the first NaN, when there is one). Two passes per row: a vectorized
 * one for the largest value and whether a NaN is present, then a scalar search for the first index holding it;
 * comparisons only, so exactly torch's indices. Rows over the pool. */
typedef struct {
    const float *x;
    int64_t V;
    int64_t *out;
} argmax_job;

static void argmax_item(const void *job, int64_t r) {
    const argmax_job *j = job;
    const int64_t V = j->V;
    const float *x = j->x + r * V;
    float m = x[0];
    int nan = x[0] != x[0];
    int64_t i = 1;
#if defined(__AVX512F__)
    if (V >= 16) {
        __m512 best = _mm512_loadu_ps(x);
        __mmask16 odd = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= V; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            odd |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best = _mm512_max_ps(best, v);
        }
        nan |= odd != 0;
        m = _mm512_reduce_max_ps(best);
    }
#endif
    for (; i < V; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    int64_t at = 0;
    if (nan) {
        while (x[at] == x[at]) at++;
    } else {
        while (x[at] != m) at++;
    }
    j->out[r] = at;
}

void dsv41_argmax(const float *x, int64_t R, int64_t V, int64_t *out) {
    argmax_job job = {x, V, out};
    parallel_for(argmax_item, &job, R);
}

/* ------------------------------------------------------------------------------------ candidate pool */

/* model/indexer.py candidate_blocks for scores [R, N] (already -inf where not visible) and visible counts [R]:
 * per row the block maxima over blocks of `block` entries (the last one short when N is not a multiple), the block
 * of the newest visible entry forced (+inf) when any is visible, the top min(keep, nblocks) blocks by topk_row's
 * rule, and mask [R, nblocks] (0 / 1 bytes) set on the chosen blocks whose maximum is above -inf. Comparisons only:
 * the torch code's mask exactly. Returns 0, -1 when a row holds a NaN (the caller takes the torch code), -2 when
 * the scratch cannot be had. */
typedef struct {
    const float *scores;
    const int64_t *visible;
    int64_t N, block, nblocks, keep;
    uint8_t *mask;
    _Atomic int status;
} blocks_job;

/* One row's candidate-pool mask (the rule above) of scores x [N] whose entries from `valid` on read -inf (valid
 * <= N; the entries there need not be written): block maxima into best [nb], the newest visible block forced,
 * the top `keep` (<= nb) blocks by topk_row's rule (topk_fast: scratch and idx as it takes them for nb, chosen
 * [keep]), mask [nb] set on the chosen blocks above -inf. nan_free: the caller found no NaN below `valid` (then
 * blocks of 8 take their maxima two to a vector). Returns 0, or -1 when a score below `valid` is NaN. */
int blocks_row(const float *x, int64_t N, int64_t valid, int64_t vis, int64_t block, int64_t nb, int64_t keep,
               int nan_free, float *best, float *scratch, int32_t *idx, int64_t *chosen, uint8_t *mask) {
    int64_t i = 0;
#if defined(__AVX512F__)
    if (block == 8 && nan_free)  /* two blocks per vector: lanes 0 and 8 end up holding their maxima */
        for (; 8 * i + 16 <= valid; i += 2) {
            __m512 a = _mm512_loadu_ps(x + 8 * i);
            a = _mm512_max_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(2, 3, 0, 1)));
            a = _mm512_max_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
            a = _mm512_max_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
            float m[16];
            _mm512_storeu_ps(m, a);
            best[i] = m[0];
            best[i + 1] = m[8];
        }
#endif
    for (; i < nb; i++) {
        float m = -INFINITY;
        const int64_t end = (i + 1) * block < valid ? (i + 1) * block : valid;
        for (int64_t s = i * block; s < end; s++) {
            if (x[s] != x[s]) return -1;
            if (x[s] > m) m = x[s];
        }
        best[i] = m;
    }
    (void)N;
    if (vis > 0 && (vis - 1) / block < nb) best[(vis - 1) / block] = INFINITY;
    memset(mask, 0, (size_t)nb);
    topk_fast(best, nb, keep, 0, scratch, idx, chosen);
    for (int64_t i = 0; i < keep; i++) mask[chosen[i]] = best[chosen[i]] > -INFINITY;
    return 0;
}

static void blocks_item(const void *job, int64_t r) {
    const blocks_job *j = job;
    const int64_t N = j->N, nb = j->nblocks, keep = j->keep;
    /* best [nb], topk_fast's scratch [nb / 16 + 2 nb], its idx [nb + 16] int32, then chosen [keep] int64 */
    const size_t floats = (size_t)(nb + nb / 16 + 3 * nb + 17) & ~(size_t)1;
    float *best = malloc(floats * sizeof(float) + (size_t)keep * sizeof(int64_t));
    if (!best) {
        atomic_store(&((blocks_job *)j)->status, -2);
        return;
    }
    float *scratch = best + nb;
    if (blocks_row(j->scores + r * N, N, N, j->visible[r], j->block, nb, keep, 0, best, scratch,
                   (int32_t *)(scratch + nb / 16 + 2 * nb), (int64_t *)(best + floats), j->mask + r * nb) != 0)
        atomic_store(&((blocks_job *)j)->status, -1);
    free(best);
}

int dsv41_candidate_blocks(const float *scores, const int64_t *visible, int64_t R, int64_t N, int64_t block,
                           int64_t keep, uint8_t *mask) {
    const int64_t nb = (N + block - 1) / block;
    blocks_job job = {scores, visible, N, block, nb, keep < nb ? keep : nb, mask, 0};
    parallel_for(blocks_item, &job, R);  /* one row per item */
    return atomic_load(&job.status);
}

/* A Reindex layer's top-k inside its candidate pool (model/attention.py Attention.select): for query r = (b, t)
 * the pool's blocks from mask [R, nblocks] as pool_entries takes them (the top min(keep, nblocks) of the 0 / 1
 * mask by topk_row's rule: the chosen blocks, then the lowest others, ascending), its entries' scores straight
 * from the packed FP4 index keys (as dsv41_index_scores scores them for one query: the even / odd path where
 * index_pairs_fit, else the widening path), -inf for entries of unchosen blocks, at or past n, or at or past
 * visible[r]; then the top k of those keep * block scores by topk_row's rule (drop_neg_inf), as global entry ids
 * out [R, k] (-1 where the pick is -inf). With AVX-512 the even / odd path scores 16 entries at a time in lanes
 * (lane_group). Scratch per query: keep * block + di + k + 1 floats, keep int64, 2 keep * block pointers.
 * Returns 0, -1 when an entry lies past its block table or its page is out of range, -2 when the scratch cannot
 * be had, -3 when a score is NaN (the caller takes the torch code, whose top-k ranks NaN first). */
typedef struct {
    fp4_pool p;  /* width: di */
    int64_t c, H, n, nblocks, block, keep, k;
    const uint8_t *mask;
    const int64_t *visible;
    const float *q, *w;
    int64_t *out;
    _Atomic int status;
} pool_job;

static void pool_item(const void *job, int64_t r) {
    const pool_job *j = job;
    const int64_t b = r / j->c, nb = j->nblocks, block = j->block, keep = j->keep, k = j->k, M = keep * block;
    const int64_t di = j->p.width, H = j->H, n = j->n, vis = j->visible[r] < n ? j->visible[r] : n;
    const uint8_t *mask = j->mask + r * nb;
    const float *qt = j->q + r * H * di, *wt = j->w + r * H;
    const size_t floats = (size_t)(M + di + k + 1) & ~(size_t)1;  /* even: the int64 part after them is aligned */
    float *scores = malloc(floats * sizeof(float) + (size_t)keep * sizeof(int64_t) + 2 * (size_t)M * sizeof(void *));
    if (!scores) {
        atomic_store(&((pool_job *)j)->status, -2);
        return;
    }
    float *key = scores + M, *heap = key + di;
    int64_t *chosen = (int64_t *)(scores + floats), *o = j->out + r * k;
    const uint8_t **kc = (const uint8_t **)(chosen + keep), **ks = kc + M;  /* each entry's key; NULL: not scored */
    int64_t set = 0, m = 0;
    for (int64_t i = 0; i < nb; i++) set += mask[i] != 0;
    int64_t others = keep - (set < keep ? set : keep);  /* unchosen blocks that fill the pool (pool_entries) */
    for (int64_t i = 0, taken = 0; i < nb && m < keep; i++)
        if (mask[i] ? taken++ < keep : others-- > 0) chosen[m++] = mask[i] ? i : -1 - i;
    const int pairs = index_pairs_fit(&j->p, 1, H);
    v16f qe[INDEX_PAIR_VECTORS], qo[INDEX_PAIR_VECTORS];
    if (pairs)
        for (int64_t v = 0; v < H * (di / FP4_ROW_BLOCK); v++) x_pairs(qt + v * FP4_ROW_BLOCK, &qe[v], &qo[v]);
    key_walk walk = {.p = &j->p, .table = j->p.tables + b * j->p.table_len, .page = -1,
                     .aligned = j->p.per_page * j->p.ratio == j->p.block_size};
    for (int64_t i = 0; i < keep; i++) {
        walk.page = -1;  /* the pool's blocks are not consecutive */
        for (int64_t e = 0; e < block; e++) {
            const int64_t s = chosen[i] * block + e, at = i * block + e;
            kc[at] = ks[at] = NULL;
            if (chosen[i] >= 0 && s < vis && key_next(&walk, s, &kc[at], &ks[at]) != 0) {
                atomic_store(&((pool_job *)j)->status, -1);
                free(scores);
                return;
            }
        }
    }
    int64_t at = 0;
#if defined(__AVX512F__)
    if (pairs)  /* 16 entries at a time in lanes (an entry not scored reads zero codes meanwhile) */
        for (; at + LANE_KEYS <= M; at += LANE_KEYS) {
            static const uint8_t zeros[64];  /* a key's codes and scales: di / 2 <= 64 bytes, di / 32 <= 4 */
            const uint8_t *kc16[LANE_KEYS], *ks16[LANE_KEYS];
            for (int m16 = 0; m16 < LANE_KEYS; m16++) {
                kc16[m16] = kc[at + m16] ? kc[at + m16] : zeros;
                ks16[m16] = ks[at + m16] ? ks[at + m16] : zeros;
            }
            lane_group(kc16, ks16, di / FP4_ROW_BLOCK, 1, H, di, qt, wt, M, scores + at);
        }
#endif
    for (; at < M; at++) {
        if (!kc[at]) continue;
        if (pairs) {
            v16f ke[4], ko[4];
            for (int64_t k0 = 0; k0 < di / FP4_ROW_BLOCK; k0++)
                weight_pairs(kc[at], ks[at], W_FP4, k0 * FP4_ROW_BLOCK, &ke[k0], &ko[k0]);
            scores[at] = pair_score(qe, qo, ke, ko, di / FP4_ROW_BLOCK, H, wt);
        } else {
            for (int64_t h = 0; h < di / 2; h++) memcpy(key + 2 * h, FP4_PAIRS[kc[at][h]], sizeof FP4_PAIRS[0]);
            scores[at] = widened_score(qt, wt, key, ks[at], H, di, j->p.block, j->p.fmt);
        }
    }
    for (at = 0; at < M; at++)
        if (!kc[at]) scores[at] = -INFINITY;
    if (topk_row(scores, M, k, 1, heap, o) != 0) {
        atomic_store(&((pool_job *)j)->status, -3);
        free(scores);
        return;
    }
    for (int64_t i = 0; i < k; i++)
        if (o[i] >= 0) o[i] = chosen[o[i] / block] * block + o[i] % block;
    free(scores);
}

int dsv41_pool_select(const uint8_t *codes, const uint8_t *scales, int64_t pages, int64_t per_page, int64_t di,
                      int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                      int64_t block_size, const float *q, const float *w, int64_t B, int64_t c, int64_t H, int64_t n,
                      const uint8_t *mask, int64_t nblocks, int64_t pool_block, int64_t keep,
                      const int64_t *visible, int64_t k, int64_t *out) {
    keep = keep < nblocks ? keep : nblocks;
    if (k > keep * pool_block) return -4;
    pool_job job = {{codes, scales, pages, per_page, di, block, fmt, tables, table_len, ratio, block_size}, c, H, n,
                    nblocks, pool_block, keep, k, mask, visible, q, w, out, 0};
    parallel_for(pool_item, &job, B * c);  /* one query per item */
    return atomic_load(&job.status);
}

/* The FP4 index keys of a paged pool read for scoring, what indexer.c and topk.c share: the key walk through the
 * block tables and the even / odd path's pair score (static inline, compiled into each), and the scoring of 16
 * keys in vector lanes (AVX-512) and the widened path, which indexer.c defines. */
#ifndef DSV41_INDEX_KEYS_H
#define DSV41_INDEX_KEYS_H

/* One row's index keys in order: entries s = 0, 1, ... of a pool through its block table, as (codes, scales)
 * pointers. A page-aligned pool (block_size = per_page * ratio) is walked page by page, the next page from the next
 * column of the table: the integer divisions come where a walk starts, not per entry or page. */
typedef struct {
    const fp4_pool *p;
    const int64_t *table;  /* this row's */
    int64_t page, slot, col;
    int aligned;
} key_walk;

/* The next entry's codes / scales (*kc, *ks): 0, or -1 when it lies past the block table or its page is out of
 * range. */
static inline int key_next(key_walk *k, int64_t s, const uint8_t **kc, const uint8_t **ks) {
    const fp4_pool *p = k->p;
    if (!k->aligned || k->page < 0 || k->slot == p->per_page) {  /* page -1: a walk that starts at any s */
        if (k->aligned && k->page >= 0) {  /* past a page's last entry: the next column's first */
            k->col++;
            k->slot = 0;
        } else {
            k->col = s * p->ratio / p->block_size;
            k->slot = s % p->per_page;
        }
        k->page = k->col < p->table_len ? k->table[k->col] : -1;
        if (k->page < 0 || k->page >= p->pages) return -1;
    }
    int64_t at = k->page * p->per_page + k->slot++;
    *kc = p->codes + at * (p->width / 2);
    *ks = p->scales + at * (p->width / p->block);
    return 0;
}

#define INDEX_PAIR_VECTORS 64  /* queries x heads x blocks of 32 the even / odd path keeps on the stack */

/* Whether a query's H heads of di values fit the even / odd path for keys in UE8M0 blocks of 32 (c queries at once). */
static inline int index_pairs_fit(const fp4_pool *p, int64_t c, int64_t H) {
    const int64_t nb = p->width / p->block;
    return p->fmt == FMT_UE8M0 && p->block == FP4_ROW_BLOCK && nb <= 4 && c * H * nb <= INDEX_PAIR_VECTORS;
}

/* One query's score of one key on the even / odd path: its heads' values qe / qo [H * nb] (x_pairs), the key's
 * ke / ko [nb] (weight_pairs, the scale folded in), head weights wt [H]. */
static inline __attribute__((always_inline)) float pair_score(const v16f *qe, const v16f *qo, const v16f *ke,
                                                              const v16f *ko, int64_t nb, int64_t H, const float *wt) {
    float acc = 0.0f;
    for (int64_t h = 0; h < H; h++) {
        const int64_t v = h * nb;
        v16f p = qe[v] * ke[0] + qo[v] * ko[0];
        for (int64_t k0 = 1; k0 < nb; k0++) p = p + qe[v + k0] * ke[k0] + qo[v + k0] * ko[k0];
        float d = sum16(p);
        acc += wt[h] * (d < 0.0f ? 0.0f : d);
    }
    return acc;
}

#if defined(__AVX512F__)
#define LANE_KEYS 16  /* keys scored at once in the lanes of each vector (lane_group) */

/* The even / odd path's scores of 16 keys (codes kc[m], scales ks[m], nb blocks of 32) for c queries q [c, H, di]
 * with head weights w [c, H] -> out[t * n + m] (indexer.c). */
DSV41_INTERNAL void lane_group(const uint8_t *const *kc, const uint8_t *const *ks, int64_t nb, int64_t c, int64_t H,
                               int64_t di, const float *q, const float *w, int64_t n, float *out);
#endif

/* One query's score (qt [H, di], wt [H]) of one key widened into key [di] (its E2M1 values) with scales ks: each
 * block's dot multiplied by its scale (indexer.c). */
DSV41_INTERNAL float widened_score(const float *qt, const float *wt, const float *key, const uint8_t *ks, int64_t H,
                                  int64_t di, int64_t block, int fmt);

#endif

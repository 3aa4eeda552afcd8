/* The FP4 index keys of a paged pool read for scoring (indexer.c, topk.c): the key walk through the block
 * tables, the even / odd path (pair scores; with AVX-512 16 keys in the lanes of each vector) and the widened
 * path. Static inline: each file that scores keys compiles its own copy, as when both lived in one file. */
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

/* key_next for entries s .. s + count - 1 (kc[m], ks[m]), on a copy of the walk held in registers (the walk's own
 * fields could alias the pool's, so each step would load them again); in a page-aligned pool, the rest of each
 * page's entries follow by adding the strides. */
static inline int key_run(key_walk *k, int64_t s, int count, const uint8_t **kc, const uint8_t **ks) {
    key_walk w = *k;
    const int64_t code_bytes = w.p->width / 2, scale_bytes = w.p->width / w.p->block;
    for (int m = 0; m < count; m++) {
        if (key_next(&w, s + m, &kc[m], &ks[m]) != 0) return -1;
        for (; w.aligned && m + 1 < count && w.slot < w.p->per_page; m++, w.slot++) {
            kc[m + 1] = kc[m] + code_bytes;
            ks[m + 1] = ks[m] + scale_bytes;
        }
    }
    *k = w;
    return 0;
}

/* Prefetches page `page` of pool p, its codes and scales (nothing when out of range). Always inlined: GCC takes a
 * function of prefetches alone for one without side effects and drops its calls. */
static inline __attribute__((always_inline)) void page_prefetch(const fp4_pool *p, int64_t page) {
    if (page < 0 || page >= p->pages) return;
    const int64_t code_bytes = p->per_page * (p->width / 2), scale_bytes = p->per_page * (p->width / p->block);
    for (int64_t i = 0; i < code_bytes; i += 64) __builtin_prefetch(p->codes + page * code_bytes + i);
    for (int64_t i = 0; i < scale_bytes; i += 64) __builtin_prefetch(p->scales + page * scale_bytes + i);
}

/* Four heads' entries T[i][byte][4 h4 .. 4 h4 + 3] of an index-score lookup table (H4 groups of 4 heads). */
static inline v4f lut4(const float *table, int64_t i, uint8_t byte, int64_t H4, int64_t h4) {
    v4f v;
    memcpy(&v, table + ((i * 256 + byte) * H4 + h4) * 4, sizeof v);
    return v;
}

#define INDEX_CHUNK 256
#define INDEX_LUT_CHUNK 2048
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

/* pair_score for one block of 32 and 4 heads. With AVX-512 the four heads' 16-lane sums are reduced together
 * (three shuffle-and-add levels for all four, where sum16 takes five steps each): the additions of sum16 in its
 * order, so the same bits. */
static inline __attribute__((always_inline)) float pair_score_4(const v16f *qe, const v16f *qo, const v16f *ke,
                                                                const v16f *ko, const float *wt) {
#if defined(__AVX512F__)
    __m512 p[4];
    for (int h = 0; h < 4; h++) {
        v16f t = qe[h] * ke[0] + qo[h] * ko[0];
        memcpy(&p[h], &t, sizeof t);
    }
    /* lanes i + 8 onto i (sum16's first level), two heads per vector: [h0 | h1], [h2 | h3] */
    __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(p[0], p[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(p[2], p[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(p[2], p[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lanes i + 4 onto i: head h's four partial sums in 128-bit lane h */
    __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a01, a23, _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 t = _mm512_add_ps(q, _mm512_permute_ps(q, _MM_SHUFFLE(1, 0, 3, 2)));  /* q0 + q2, q1 + q3 */
    __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));  /* (q0 + q2) + (q1 + q3) */
    float sums[16], acc = 0.0f;
    _mm512_storeu_ps(sums, u);
    for (int h = 0; h < 4; h++) {
        float d = sums[4 * h];
        acc += wt[h] * (d < 0.0f ? 0.0f : d);
    }
    return acc;
#else
    return pair_score(qe, qo, ke, ko, 1, 4, wt);
#endif
}

#if defined(__AVX512F__)
/* The even / odd path with 16 keys in the lanes of each vector (AVX-512): lane m of every vector belongs to key m,
 * so the 16 lanes of a head's products are 16 vectors added by sum16's tree, one vector addition per step for the
 * 16 keys, where pair_score reduces each key's vector horizontally. Each lane computes what weight_pairs,
 * pair_score and sum16 compute for its key, the same IEEE operations in the same order (no fused multiply-add:
 * -ffp-contract=off): the same bits, but for the sign of a NaN (a NaN scale byte), which x86 takes from one
 * operand or the other as the compiler orders them. */
#define LANE_KEYS 16
#define LANE_AHEAD 64  /* keys whose pages are prefetched ahead of the 16 scored */

/* 16 keys' code bytes and scales: word[k0][w] lane m = bytes 16 k0 + 4w .. 16 k0 + 4w + 3 of key m (byte 16 k0 + l
 * holds elements 32 k0 + 2l, low nibble, and 32 k0 + 2l + 1), scale[k0] lane m = its block k0's UE8M0 scale. */
typedef struct {
    __m512i word[4][4];
    __m512 scale[4];
} lane_keys;

/* Loads lane_keys for the nb blocks of 32 of keys kc[m] / ks[m]. The rows of 16 code bytes go through a 4 x 4
 * transpose of 32-bit words in each 128-bit lane (row i holds keys i, i + 4, i + 8, i + 12), which leaves word w
 * of key m in lane m. The scale bytes are decoded as UE8M0_VALUES (b << 23 is 2**(b - 127) for b = 1 .. 254). */
static inline __attribute__((always_inline)) void lane_load(const uint8_t *const *kc, const uint8_t *const *ks,
                                                            const int nb, lane_keys *k) {
    for (int k0 = 0; k0 < nb; k0++) {
        __m512i row[4];
        for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(kc[i] + 16 * k0)));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(kc[i + 4] + 16 * k0)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(kc[i + 8] + 16 * k0)), 2);
            row[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(kc[i + 12] + 16 * k0)), 3);
        }
        __m512i t0 = _mm512_unpacklo_epi32(row[0], row[1]), t1 = _mm512_unpackhi_epi32(row[0], row[1]);
        __m512i t2 = _mm512_unpacklo_epi32(row[2], row[3]), t3 = _mm512_unpackhi_epi32(row[2], row[3]);
        k->word[k0][0] = _mm512_unpacklo_epi64(t0, t2);
        k->word[k0][1] = _mm512_unpackhi_epi64(t0, t2);
        k->word[k0][2] = _mm512_unpacklo_epi64(t1, t3);
        k->word[k0][3] = _mm512_unpackhi_epi64(t1, t3);
        __m512i b = _mm512_set_epi32(ks[15][k0], ks[14][k0], ks[13][k0], ks[12][k0], ks[11][k0], ks[10][k0],
                                     ks[9][k0], ks[8][k0], ks[7][k0], ks[6][k0], ks[5][k0], ks[4][k0], ks[3][k0],
                                     ks[2][k0], ks[1][k0], ks[0][k0]);
        __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(b, 23));
        scale = _mm512_mask_mov_ps(scale, _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512()),
                                   _mm512_set1_ps(UE8M0_VALUES[0]));
        k->scale[k0] = _mm512_mask_mov_ps(scale, _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(UE8M0_NAN)),
                                          _mm512_set1_ps(UE8M0_VALUES[UE8M0_NAN]));
    }
}

/* The 16 keys' elements 32 k0 + 2l (*even) and 32 k0 + 2l + 1 (*odd), l < 16: weight_pairs' lane l of block k0,
 * the E2M1 value times the scale. vpermps reads the low 4 bits of each index: byte l shifted down to bit 0 gives
 * the low nibble, 4 bits further the high one. */
static inline __attribute__((always_inline)) void lane_values(const lane_keys *k, int k0, int l, __m512 *even,
                                                              __m512 *odd) {
    const __m512 values = _mm512_loadu_ps(E2M1_VALUES);
    __m512i at = _mm512_srli_epi32(k->word[k0][l / 4], 8 * (l % 4));
    *even = _mm512_mul_ps(_mm512_permutexvar_ps(at, values), k->scale[k0]);
    *odd = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(at, 4), values), k->scale[k0]);
}

/* Lane l's sums p of R heads (query values x + r * di): pair_score's qe * ke + qo * ko, then for each further block
 * p + qe * ke + qo * ko, the query values broadcast. */
static inline __attribute__((always_inline)) void lane_products(const lane_keys *k, const float *x, int64_t di,
                                                                const int R, const int nb, int l, __m512 *p) {
    __m512 even[4], odd[4];
    lane_values(k, 0, l, &even[0], &odd[0]);
    for (int k0 = 1; k0 < nb; k0++) lane_values(k, k0, l, &even[k0], &odd[k0]);
    for (int r = 0; r < R; r++) {
        const float *xr = x + r * di + 2 * l;
        __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(xr[0]), even[0]),
                                 _mm512_mul_ps(_mm512_set1_ps(xr[1]), odd[0]));
        for (int k0 = 1; k0 < nb; k0++)
            v = _mm512_add_ps(_mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(xr[32 * k0]), even[k0])),
                              _mm512_mul_ps(_mm512_set1_ps(xr[32 * k0 + 1]), odd[k0]));
        p[r] = v;
    }
}

/* sum16's tree over the lanes l, depth first so few vectors are live: h_i = p_i + p_(i+8) (lane_pair),
 * q_i = h_i + h_(i+4) (lane_quad), d = (q_0 + q_2) + (q_1 + q_3) (lane_heads). */
static inline __attribute__((always_inline)) void lane_pair(const lane_keys *k, const float *x, int64_t di,
                                                            const int R, const int nb, int i, __m512 *h) {
    __m512 a[4], b[4];
    lane_products(k, x, di, R, nb, i, a);
    lane_products(k, x, di, R, nb, i + 8, b);
    for (int r = 0; r < R; r++) h[r] = _mm512_add_ps(a[r], b[r]);
}

static inline __attribute__((always_inline)) void lane_quad(const lane_keys *k, const float *x, int64_t di,
                                                            const int R, const int nb, int i, __m512 *q) {
    __m512 a[4], b[4];
    lane_pair(k, x, di, R, nb, i, a);
    lane_pair(k, x, di, R, nb, i + 4, b);
    for (int r = 0; r < R; r++) q[r] = _mm512_add_ps(a[r], b[r]);
}

/* acc plus R heads' terms w_h relu(d_h) in head order (pair_score's acc += ...), head weights wt [R]. relu as
 * d < 0 ? 0 : d: a NaN d stays NaN (vmaxps would give 0). */
static inline __attribute__((always_inline)) __m512 lane_heads(const lane_keys *k, const float *x, const float *wt,
                                                               int64_t di, const int R, const int nb, __m512 acc) {
    __m512 a[4], b[4], c[4];
    lane_quad(k, x, di, R, nb, 0, a);
    lane_quad(k, x, di, R, nb, 2, b);
    for (int r = 0; r < R; r++) a[r] = _mm512_add_ps(a[r], b[r]);
    lane_quad(k, x, di, R, nb, 1, b);
    lane_quad(k, x, di, R, nb, 3, c);
    const __m512 zero = _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        __m512 d = _mm512_add_ps(a[r], _mm512_add_ps(b[r], c[r]));
        __m512 relu = _mm512_mask_mov_ps(d, _mm512_cmp_ps_mask(d, zero, _CMP_LT_OQ), zero);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(wt[r]), relu));
    }
    return acc;
}

/* One query's scores of the 16 keys: heads qt [H, di], head weights wt [H] -> out[0 .. 15]. One block (di = 32,
 * the index keys): a head at a time, the 32 decoded vectors hoisted out of the loop by the compiler; more blocks:
 * four heads at a time, so each position's values are decoded once per four heads. */
static inline __attribute__((always_inline)) void lane_scores(const lane_keys *k, const float *qt, const float *wt,
                                                              int64_t H, int64_t di, const int nb, float *out) {
    __m512 acc = _mm512_setzero_ps();
    int64_t h = 0;
    if (nb == 1)
        for (; h < H; h++) acc = lane_heads(k, qt + h * di, wt + h, di, 1, nb, acc);
    else
        for (; h + 4 <= H; h += 4) acc = lane_heads(k, qt + h * di, wt + h, di, 4, nb, acc);
    switch (H - h) {
    case 3: acc = lane_heads(k, qt + h * di, wt + h, di, 3, nb, acc); break;
    case 2: acc = lane_heads(k, qt + h * di, wt + h, di, 2, nb, acc); break;
    case 1: acc = lane_heads(k, qt + h * di, wt + h, di, 1, nb, acc); break;
    }
    _mm512_storeu_ps(out, acc);
}

/* The even / odd path's scores of 16 keys (codes kc[m], scales ks[m], nb blocks of 32) for c queries q [c, H, di]
 * with head weights w [c, H] -> out[t * n + m]. */
static inline void lane_group(const uint8_t *const *kc, const uint8_t *const *ks, int64_t nb, int64_t c, int64_t H,
                       int64_t di, const float *q, const float *w, int64_t n, float *out) {
    lane_keys k;
    if (nb == 1) {  /* the index keys' shape, compiled with its block count known */
        lane_load(kc, ks, 1, &k);
        for (int64_t t = 0; t < c; t++) lane_scores(&k, q + t * H * di, w + t * H, H, di, 1, out + t * n);
    } else {
        lane_load(kc, ks, (int)nb, &k);
        for (int64_t t = 0; t < c; t++) lane_scores(&k, q + t * H * di, w + t * H, H, di, (int)nb, out + t * n);
    }
}
#endif

/* One query's score (qt [H, di], wt [H]) of one key widened into key [di] (its E2M1 values) with scales ks: each
 * block's dot multiplied by its scale. */
static inline float widened_score(const float *qt, const float *wt, const float *key, const uint8_t *ks, int64_t H,
                           int64_t di, int64_t block, int fmt) {
    float acc = 0.0f;
    for (int64_t h = 0; h < H; h++) {
        float d = 0.0f;
        for (int64_t k0 = 0; k0 < di / block; k0++)
            d += dot(qt + h * di + k0 * block, key + k0 * block, block) * fp4_scale_decode(ks[k0], fmt);
        acc += wt[h] * (d < 0.0f ? 0.0f : d);
    }
    return acc;
}

#endif

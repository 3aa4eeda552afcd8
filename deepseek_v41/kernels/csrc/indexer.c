/* The indexer (model/indexer.py): scores straight from the paged FP4 index keys, and its queries of a few tokens. */
#include "dsv41.h"
#include "index_keys.h"

/* ------------------------------------------------------------------------------ indexer scores from FP4 */

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
void lane_group(const uint8_t *const *kc, const uint8_t *const *ks, int64_t nb, int64_t c, int64_t H, int64_t di,
                 const float *q, const float *w, int64_t n, float *out) {
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
float widened_score(const float *qt, const float *wt, const float *key, const uint8_t *ks, int64_t H,
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

/* Index scores of entries 0 .. n-1 of each row straight from its packed FP4 keys (model/indexer.py IndexScorer
 * over PagedContext.index_keys, without materializing the keys): q [B, c, H, di] and w [B, c, H] fp32 ->
 * out [B, c, n] = sum_h w_h relu(q_h . k_s), summed in fp32, each block's dot multiplied by its scale.
 * UE8M0 blocks of 32 (the index keys) with few queries (c * H * di / 32 <= INDEX_PAIR_VECTORS) take the even / odd
 * path: each key's codes decoded once for the row's c queries as even / odd lanes times the scale (weight_pairs),
 * dotted with the queries split the same way and summed by sum16 (pair_score). With AVX-512 it scores 16 keys at
 * a time, one key per vector lane (lane_group: the same operations for each key, so the same bits (NaN signs
 * aside), without a horizontal sum per key and head; 8K keys of the bench's decode query 60 -> 28 µs on one
 * thread), and the last n % 16 keys of a chunk one or two at a time. Otherwise long rows (lut: n >= 1024) with
 * a small table (di / 2 * 256 * H <= 65536 floats) go through a lookup table per query:
 * T[i][byte][h] = q_h[2i] e(byte & 15) + q_h[2i + 1] e(byte >> 4), so a key costs one vector load and add per code
 * byte for 4 heads at once (table scratch: di / 2 * 256 * ceil(H / 4) * 4 floats); else each key's codes are
 * widened into scratch (di floats) and each block's dot multiplied by its scale. Items of the pool: a row's keys
 * in chunks of INDEX_CHUNK (INDEX_LUT_CHUNK with a table, built per item). visible [B, c] (or NULL): the scores of
 * entries from a query's visible count on read -inf (model/indexer.py mask_invisible). Returns 0, -1 when an entry
 * lies past its block table or its page is out of range (nothing else is guaranteed written then), -2 when the
 * scratch cannot be had. */

typedef struct {
    fp4_pool p;  /* width: di */
    int64_t c, H, n, chunk, chunks;
    int lut;
    const float *q, *w;
    float *out;
    _Atomic int status;
} index_job;

static void index_item(const void *job, int64_t item) {
    const index_job *j = job;
    const int64_t b = item / j->chunks, s0 = item % j->chunks * j->chunk;
    const int64_t s1 = s0 + j->chunk < j->n ? s0 + j->chunk : j->n;
    const int64_t di = j->p.width, block = j->p.block, c = j->c, H = j->H, n = j->n, fmt = j->p.fmt;
    const int64_t H4 = (H + 3) / 4, nb = di / block, half = block / 2;
    float *key = malloc((size_t)(j->lut ? di / 2 * 256 * H4 * 4 : di) * sizeof(float)), *table = key;
    if (!key) {
        atomic_store(&((index_job *)j)->status, -2);
        return;
    }
    key_walk walk = {.p = &j->p, .table = j->p.tables + b * j->p.table_len, .page = -1,
                     .aligned = j->p.per_page * j->p.ratio == j->p.block_size};
    if (j->lut) {
        for (int64_t t = 0; t < c; t++) {
            const float *qt = j->q + (b * c + t) * H * di, *wt = j->w + (b * c + t) * H;
            for (int64_t i = 0; i < di / 2; i++) {
                float qe[64], qo[64];  /* the heads' pair of query values at code byte i (H <= 64) */
                for (int64_t h = 0; h < H4 * 4; h++) {
                    qe[h] = h < H ? qt[h * di + 2 * i] : 0.0f;
                    qo[h] = h < H ? qt[h * di + 2 * i + 1] : 0.0f;
                }
                for (int64_t byte = 0; byte < 256; byte++) {
                    float *e = table + (i * 256 + byte) * H4 * 4, lo = FP4_PAIRS[byte][0], hi = FP4_PAIRS[byte][1];
                    for (int64_t h = 0; h < H4 * 4; h++) e[h] = qe[h] * lo + qo[h] * hi;
                }
            }
            walk.page = -1;
            for (int64_t s = s0; s < s1; s++) {
                const uint8_t *kc, *ks;
                if (key_next(&walk, s, &kc, &ks) != 0) goto past_table;
                v4f acc[16] = {{0}};
                for (int64_t k0 = 0; k0 < nb; k0++) {
                    float sc = fp4_scale_decode(ks[k0], fmt);
                    for (int64_t h4 = 0; h4 < H4; h4++) {
                        /* four partial sums: independent chains of additions, kept in registers */
                        v4f p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
                        int64_t i = k0 * half, end = (k0 + 1) * half;
                        for (; i + 4 <= end; i += 4) {
                            p0 += lut4(table, i, kc[i], H4, h4);
                            p1 += lut4(table, i + 1, kc[i + 1], H4, h4);
                            p2 += lut4(table, i + 2, kc[i + 2], H4, h4);
                            p3 += lut4(table, i + 3, kc[i + 3], H4, h4);
                        }
                        for (; i < end; i++) p0 += lut4(table, i, kc[i], H4, h4);
                        acc[h4] += ((p0 + p1) + (p2 + p3)) * sc;
                    }
                }
                float score = 0.0f;
                for (int64_t h = 0; h < H; h++) {
                    float d = acc[h / 4][h % 4];
                    score += wt[h] * (d < 0.0f ? 0.0f : d);
                }
                j->out[(b * c + t) * n + s] = score;
            }
        }
        free(key);
        return;
    }
    if (index_pairs_fit(&j->p, c, H)) {
        /* UE8M0 blocks of 32 (the index keys' format) and few queries: each key decoded 32 values at a time as
         * even / odd lanes (weight_pairs, the scale folded in), dotted with the queries split the same way */
        v16f qe[INDEX_PAIR_VECTORS], qo[INDEX_PAIR_VECTORS];
        for (int64_t v = 0; v < c * H * nb; v++) x_pairs(j->q + b * c * H * di + v * FP4_ROW_BLOCK, &qe[v], &qo[v]);
        int64_t s = s0;
#if defined(__AVX512F__)
        /* The pages of the table's next columns, LANE_AHEAD keys ahead, are prefetched: pages in no particular order
         * defeat the hardware prefetcher (cold keys in pages of random order: 8K keys 180 -> 80 µs on one thread;
         * pages in order: no change; keys in cache: 5-10% slower) */
        const int64_t ahead = LANE_AHEAD * j->p.ratio / j->p.block_size + 1;  /* columns */
        int64_t fetched = -1;  /* the last column whose page was prefetched */
        for (; s + LANE_KEYS <= s1; s += LANE_KEYS) {  /* 16 keys at a time in lanes, the rest one or two at once */
            const uint8_t *kc[LANE_KEYS], *ks[LANE_KEYS];
            if (key_run(&walk, s, LANE_KEYS, kc, ks) != 0) goto past_table;
            for (fetched = fetched < walk.col ? walk.col : fetched;
                 fetched < walk.col + ahead && fetched + 1 < j->p.table_len; fetched++)
                page_prefetch(&j->p, walk.table[fetched + 1]);
            lane_group(kc, ks, nb, c, H, di, j->q + b * c * H * di, j->w + b * c * H, n, j->out + b * c * n + s);
        }
#endif
        if (nb == 1 && H == 4 && c == 1)  /* one decode query: two keys per pass, independent work side by side */
            for (; s + 2 <= s1; s += 2) {
                const uint8_t *kc0, *ks0, *kc1, *ks1;
                if (key_next(&walk, s, &kc0, &ks0) != 0 || key_next(&walk, s + 1, &kc1, &ks1) != 0) goto past_table;
                v16f ke0, ko0, ke1, ko1;
                weight_pairs(kc0, ks0, W_FP4, 0, &ke0, &ko0);
                weight_pairs(kc1, ks1, W_FP4, 0, &ke1, &ko1);
                j->out[b * n + s] = pair_score_4(qe, qo, &ke0, &ko0, j->w + b * 4);
                j->out[b * n + s + 1] = pair_score_4(qe, qo, &ke1, &ko1, j->w + b * 4);
            }
        for (; s < s1; s++) {
            const uint8_t *kc, *ks;
            if (key_next(&walk, s, &kc, &ks) != 0) goto past_table;
            v16f ke[4], ko[4];
            for (int64_t k0 = 0; k0 < nb; k0++) weight_pairs(kc, ks, W_FP4, k0 * FP4_ROW_BLOCK, &ke[k0], &ko[k0]);
            if (nb == 1 && H == 4)  /* the bench config's shape, unrolled with its vectors in registers (same sums) */
                for (int64_t t = 0; t < c; t++)
                    j->out[(b * c + t) * n + s] = pair_score_4(qe + t * 4, qo + t * 4, ke, ko,
                                                               j->w + (b * c + t) * 4);
            else
                for (int64_t t = 0; t < c; t++)
                    j->out[(b * c + t) * n + s] = pair_score(qe + t * H * nb, qo + t * H * nb, ke, ko, nb, H,
                                                             j->w + (b * c + t) * H);
        }
        free(key);
        return;
    }
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *kc, *ks;
        if (key_next(&walk, s, &kc, &ks) != 0) goto past_table;
        for (int64_t i = 0; i < di / 2; i++) memcpy(key + 2 * i, FP4_PAIRS[kc[i]], sizeof FP4_PAIRS[0]);
        for (int64_t t = 0; t < c; t++)
            j->out[(b * c + t) * n + s] = widened_score(j->q + (b * c + t) * H * di, j->w + (b * c + t) * H, key, ks,
                                                        H, di, block, fmt);
    }
    free(key);
    return;
past_table:
    atomic_store(&((index_job *)j)->status, -1);
    free(key);
}

int dsv41_index_scores(const uint8_t *codes, const uint8_t *scales, int64_t pages, int64_t per_page, int64_t di,
                       int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                       int64_t block_size, const float *q, const float *w, int64_t B, int64_t c, int64_t H, int64_t n,
                       int lut, const int64_t *visible, float *out) {
    const fp4_pool pool = {codes, scales, pages, per_page, di, block, fmt, tables, table_len, ratio, block_size};
    /* The even / odd path where it fits: with AVX-512 ~5x faster than a table (bench decode shape, 8K keys); without,
     * ~1.5x slower, but the same sums whatever the build. */
    if (index_pairs_fit(&pool, c, H)) lut = 0;
    int64_t chunk = lut ? INDEX_LUT_CHUNK : INDEX_CHUNK, chunks = n > 0 ? (n + chunk - 1) / chunk : 0;
    index_job job = {pool, c, H, n, chunk, chunks, lut, q, w, out, 0};
    parallel_for(index_item, &job, B * chunks);
    if (visible)  /* mask_invisible: -inf from each query's visible count on */
        for (int64_t r = 0; r < B * c; r++)
            for (int64_t s = visible[r] < 0 ? 0 : visible[r]; s < n; s++) out[r * n + s] = -INFINITY;
    return atomic_load(&job.status);
}

/* The indexer's queries of model/indexer.py Indexer.queries for a few tokens, one call instead of its chain of
 * small ops: q = upcast(fake_quant_fp4(rope(wq_b q_lat))) [N, H, di] (the fake quant, FP4 with a UE8M0 scale per
 * 32 values, only when fake_quant) and w = upcast(weights_proj x) * scale [N, H]. q_lat [N, qr], x [N, D] and the
 * weights (wq_b [H * di, qr], w_proj [H, D]) are all fp32 or all bf16 bits; q and w are fp32. RoPE on the last r
 * dims with phases cos / sin fp32 [N, r]. bf16: the projections and RoPE rounded where the torch code rounds them
 * (its kernel path's bits), and the fake-quant values rounded to bf16 as its .to(bf16) does before the upcast;
 * fp32: the GEMVs add in another order than ATen's. RoPE and the fake quant are the torch code's operations, so
 * its bits. Returns 0, or -1 when scratch cannot be had. */
int dsv41_indexer_queries(const void *q_lat, const void *x, int bf16, int64_t N, int64_t qr, int64_t D,
                          const void *wq_b, int64_t H, int64_t di, const void *w_proj, const float *cos_,
                          const float *sin_, int64_t r, int fake_quant, float scale, float *q, float *w) {
    int64_t widest = qr > D ? qr : D;
    /* bf16: the GEMVs' widened inputs (N * max(qr, D) floats) and their bf16 outputs (the heads, the weights);
     * fp32: the GEMVs write straight into q and w. */
    float *scratch = bf16 ? malloc((size_t)(N * widest) * sizeof(float)) : NULL;
    uint16_t *heads = bf16 ? malloc((size_t)(N * H * di + N * H) * sizeof(uint16_t)) : NULL;
    if (bf16 && !(scratch && heads)) {
        free(scratch);
        free(heads);
        return -1;
    }
    void *qh = bf16 ? (void *)heads : (void *)q, *wh = bf16 ? (void *)(heads + N * H * di) : (void *)w;
    linear_into(q_lat, bf16, N, 1, qr, wq_b, bf16, H * di, qh, bf16, scratch);
    rope_rows(qh, bf16, cos_, sin_, N, H, di, r, 1, qh);
    if (bf16) bf16_row(heads, N * H * di, q);  /* upcast (exact) */
    if (fake_quant)
        for (int64_t row = 0; row < N * H; row++) {
            float *v = q + row * di;
            /* In place: each block's amax is taken before its values are written, each pair read before written. */
            fp4_quantize_row(v, di, 32, FMT_UE8M0, NULL, NULL, v);
            if (bf16)
                for (int64_t i = 0; i < di; i++) v[i] = from_bits((uint32_t)bf16_round(v[i]) << 16);
        }
    linear_into(x, bf16, N, 1, D, w_proj, bf16, H, wh, bf16, scratch);
    for (int64_t i = 0; i < N * H; i++) w[i] = load_at(wh, bf16, i) * scale;
    free(scratch);
    free(heads);
    return 0;
}

/* ------------------------------------------------------------------- prefill selection (scores + top-k) */

/* The index-source selection of model/attention.py Attention.select for a chunk of queries over all N index keys,
 * fused (issue 25): per query the scores of Indexer.score (IndexScorer) masked by mask_invisible, the top k of
 * them by topk_entries' rule and, when mask is not NULL, the candidate pool of candidate_blocks; the [c, N] scores
 * are never written out. q [B, c, H, di], w [B, c, H] and keys [B, N, di] fp32, visible [B, c] int64 ->
 * picks [B, c, k] int64 (-1 where the pick is -inf), mask [B, c, nblocks] bytes (blocks of `block` entries, the top
 * `keep` of them).
 *
 * The scores are the torch code's bits where ATen's fp32 GEMM sums each dot q_h . k_s as one chain of fused
 * multiply-adds over d from 0 (what MKL's kernels do; tests/kernels checks it on the machine): each dot here is that
 * chain, then relu, then sum_h w_h relu(d_h) as the batched [1, H] x [H, N] product sums it (w_0 r_0, then + w_h
 * r_h in head order, each product rounded). With the FP4 queries and keys of the paged cache (one UE8M0 block per
 * 32 dims) every dot is exact in any order anyway. Then the picks and mask are those of the scores by topk_row /
 * blocks_row: exactly the torch code's. Only entries below each query's visible count are scored (the others are
 * -inf): topk_entries' picks lie among them when there are at least k, else they are all of them followed by -1.
 *
 * Work: the keys transposed into scratch [B, di, N16] (N16 = N rounded up to 16, zeros after N) by items of 256
 * keys; then items of SELECT_QUERIES queries of one row: with AVX-512 and H = 4, 16 keys x 4 queries x 4 heads in
 * 16 vector accumulators (one key vector loaded per d for 16 multiply-adds; with AVX512-BF16, when every dot is
 * exact, two dims per bf16 dot product: select_4x4_pairs), else one head at a time; each query's scores in a
 * scratch row of its item, its picks by topk_fast (topk_row's indices). Returns 0, -1 when a visible score is NaN
 * (torch.topk ranks NaN first: the caller takes the torch code), -2 when scratch cannot be had, -4 when k > N. */
#define SELECT_QUERIES 4
#define SELECT_KEYS 256

/* Exponent statistics of rows whose values may be FP4 with a scale (fp4_rows): ok while every value is zero or a
 * normal number with at most one fraction bit (E2M1 values times a power of two, and bf16 exactly); span: the
 * largest spread of a row's exponents, lo / hi: the smallest / largest exponent of all. */
typedef struct {
    int ok, span, lo, hi;
} exp_stats;

static void fp4_rows(const float *x, int64_t rows, int64_t n, exp_stats *st) {
    for (int64_t r = 0; r < rows; r++) {
        int lo = 1000, hi = -1000;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t b = to_bits(x[r * n + i]), e = (b >> 23) & 0xff;
            if ((b & 0x7fffffff) == 0) continue;
            if (e == 0 || e == 0xff || (b & 0x3fffff) != 0) st->ok = 0;
            const int ex = (int)e - 127;
            lo = ex < lo ? ex : lo;
            hi = ex > hi ? ex : hi;
        }
        if (hi < lo) continue;  /* all zero */
        st->span = hi - lo > st->span ? hi - lo : st->span;
        st->lo = lo < st->lo ? lo : st->lo;
        st->hi = hi > st->hi ? hi : st->hi;
    }
}

typedef struct {
    const float *q, *w, *keys;
    int64_t c, H, di, N, N16, k, block, nb, keep;
    const int64_t *visible;
    float *keys_t;
    uint32_t *pairs, *q_pairs;  /* bf16 pairs of the transposed keys [B, di / 2, N16] and queries [B, c, H, di / 2] */
    /* int8 codes (select_4x4_int8): keys [B, di / 4, N16] (4 signed bytes a word), their exponents [B, N16] and
     * 128 x their sums [B, N16]; queries [B, c, H, di / 4] (4 bytes + 128 a word) and exponents [B, c, H] */
    uint32_t *codes, *q_codes;
    float *k_exp, *q_exp;
    int32_t *k_corr;
    int int8;
    exp_stats *key_stats;       /* per transpose item */
    int exact;                  /* every dot exact: the bf16 dot products may compute them (dsv41_index_select) */
    int need_kt;                /* some tile scores from the transposed fp32 keys */
    int64_t *picks;
    uint8_t *mask;
    _Atomic int status;
} select_job;

/* Items of SELECT_KEYS keys of one row: their exponent statistics (key_stats, first pass), then (second pass) the
 * layouts the scoring reads: the transposed fp32 keys (need_kt), the int8 codes (int8) or the bf16 pairs (exact). */
static void select_stats(const void *job, int64_t item) {
    const select_job *j = job;
    const int64_t chunks = (j->N16 + SELECT_KEYS - 1) / SELECT_KEYS, b = item / chunks;
    const int64_t s0 = item % chunks * SELECT_KEYS, real = (s0 + SELECT_KEYS < j->N ? s0 + SELECT_KEYS : j->N) - s0;
    exp_stats st = {1, 0, 1000, -1000};
    if (real > 0) fp4_rows(j->keys + (b * j->N + s0) * j->di, real, j->di, &st);
    j->key_stats[item] = st;
}

static void select_layout(const void *job, int64_t item) {
    const select_job *j = job;
    const int64_t chunks = (j->N16 + SELECT_KEYS - 1) / SELECT_KEYS, b = item / chunks;
    const int64_t s0 = item % chunks * SELECT_KEYS;
    const int64_t s1 = s0 + SELECT_KEYS < j->N16 ? s0 + SELECT_KEYS : j->N16, di = j->di;
    const float *keys = j->keys + b * j->N * di;
    if (j->need_kt) {
        float *kt = j->keys_t + b * di * j->N16;
        for (int64_t d = 0; d < di; d++)
            for (int64_t s = s0; s < s1; s++) kt[d * j->N16 + s] = s < j->N ? keys[s * di + d] : 0.0f;
    }
    if (j->int8)
        for (int64_t s = s0; s < s1; s++) {
            int32_t code[32] = {0}, sum = 0;
            int m = 0;
            if (s < j->N) {
                const float *row = keys + s * di;
                int lo = 1000;
                for (int64_t i = 0; i < di; i++) {
                    const int e = (int)((to_bits(row[i]) >> 23) & 0xff) - 127;
                    if (row[i] != 0.0f && e < lo) lo = e;
                }
                m = lo == 1000 ? 0 : lo - 1;  /* each value an integer times 2^m: (2 + fraction bit) 2^(e - lo) */
                const float unit = from_bits((uint32_t)(127 - m) << 23);  /* 2^-m (m >= -127: normal) */
                for (int64_t i = 0; i < di; i++) {
                    code[i] = (int32_t)(row[i] * unit);
                    sum += code[i];
                }
            }
            j->k_exp[b * j->N16 + s] = (float)m;
            j->k_corr[b * j->N16 + s] = 128 * sum;
            for (int64_t g = 0; g < di / 4; g++)
                j->codes[(b * (di / 4) + g) * j->N16 + s] = (uint32_t)(uint8_t)code[4 * g]
                    | (uint32_t)(uint8_t)code[4 * g + 1] << 8 | (uint32_t)(uint8_t)code[4 * g + 2] << 16
                    | (uint32_t)(uint8_t)code[4 * g + 3] << 24;
        }
    else if (j->exact)  /* (exact as bf16: at most one fraction bit) */
        for (int64_t i = 0; i < di / 2; i++)
            for (int64_t s = s0; s < s1; s++)
                j->pairs[(b * (di / 2) + i) * j->N16 + s] =
                    s < j->N ? to_bits(keys[s * di + 2 * i]) >> 16 | (to_bits(keys[s * di + 2 * i + 1]) & 0xffff0000u)
                             : 0;
}

/* One query's scores (qt [H, di], wt [H]) of keys s0 .. s0 + 15 (kt: the transposed keys at s0, row stride ld)
 * -> out[0 .. 15]; one head at a time. */
static inline void select_one(const float *kt, int64_t ld, const float *qt, const float *wt, int64_t H, int64_t di,
                              float *out) {
#if defined(__AVX512F__)
    __m512 score = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; h++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < di; d++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(qt[h * di + d]), _mm512_loadu_ps(kt + d * ld), acc);
        acc = _mm512_mask_mov_ps(acc, _mm512_cmp_ps_mask(acc, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps());
        __m512 term = _mm512_mul_ps(_mm512_set1_ps(wt[h]), acc);
        score = h == 0 ? term : _mm512_add_ps(score, term);
    }
    _mm512_storeu_ps(out, score);
#else
    for (int m = 0; m < 16; m++) {
        float score = 0.0f;
        for (int64_t h = 0; h < H; h++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < di; d++) acc = fmaf(qt[h * di + d], kt[d * ld + m], acc);
            float term = wt[h] * (acc < 0.0f ? 0.0f : acc);
            score = h == 0 ? term : score + term;
        }
        out[m] = score;
    }
#endif
}

#if defined(__AVX512F__)
/* The 16 heads' dots acc [4 queries x 4 heads] into scores out + t * ld_out: relu, then w_0 r_0 + w_1 r_1 + ... in
 * head order (select_one's operations per lane). */
static inline __attribute__((always_inline)) void select_heads(const __m512 *acc, const float *wt, float *out,
                                                               int64_t ld_out) {
    const __m512 zero = _mm512_setzero_ps();
    for (int t = 0; t < 4; t++) {
        __m512 score = zero;
        for (int h = 0; h < 4; h++) {
            __m512 a = acc[t * 4 + h];
            a = _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), zero);
            __m512 term = _mm512_mul_ps(_mm512_set1_ps(wt[t * 4 + h]), a);
            score = h == 0 ? term : _mm512_add_ps(score, term);
        }
        _mm512_storeu_ps(out + t * ld_out, score);
    }
}

/* select_one for 4 queries of 4 heads at once (qt [4, 4, di], wt [4, 4]; out + t * ld_out): the same operations per
 * lane, so the same bits. */
static inline __attribute__((always_inline)) void select_4x4(const float *kt, int64_t ld, const float *qt,
                                                             const float *wt, int64_t di, float *out,
                                                             int64_t ld_out) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < di; d++) {
        const __m512 kv = _mm512_loadu_ps(kt + d * ld);
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qt[i * di + d]), kv, acc[i]);
    }
    select_heads(acc, wt, out, ld_out);
}
#endif

#if defined(__AVX512VNNI__)
/* select_4x4 from int8 codes when every dot is exact (select_job.int8): each value an integer of at most 96 times a
 * power of two per row, the dots of four dims at a time by vpdpbusd (the queries' codes + 128 as unsigned bytes,
 * 128 x the key's code sum taken off after), exact in int32, converted exactly and scaled by 2^(query exponent +
 * key exponent) (exact: normal): the exact sums, so the chains' bits. kc: the keys' words at s0 (row stride ld),
 * qc [16, di / 4] the 4 x 4 query heads' words, q_exp [16], k_corr / k_exp at s0. */
static inline __attribute__((always_inline)) void select_4x4_int8(const uint32_t *kc, int64_t ld, const uint32_t *qc,
                                                                  const float *q_exp, const int32_t *k_corr,
                                                                  const float *k_exp, const float *wt, int64_t di,
                                                                  float *out, int64_t ld_out) {
    __m512i acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t g = 0; g < di / 4; g++) {
        const __m512i kv = _mm512_loadu_si512(kc + g * ld);
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32((int)qc[i * (di / 4) + g]), kv);
    }
    const __m512i corr = _mm512_loadu_si512(k_corr);
    const __m512 ke = _mm512_loadu_ps(k_exp);
    __m512 dots[16];
    for (int i = 0; i < 16; i++)
        dots[i] = _mm512_scalef_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], corr)),
                                   _mm512_add_ps(ke, _mm512_set1_ps(q_exp[i])));
    select_heads(dots, wt, out, ld_out);
}
#endif

#if defined(__AVX512BF16__)
/* select_4x4 when every dot is exact (select_job.exact): the products of two dims at a time as bf16 dot products
 * (vdpbf16ps: half the instructions). Exact sums in any order are the chain's sums, so the same bits. kp: the
 * keys' bf16 pairs at s0 (row stride ld), qp [4, 4, di / 2] the queries' pairs. */
static inline __attribute__((always_inline)) void select_4x4_pairs(const uint32_t *kp, int64_t ld, const uint32_t *qp,
                                                                   const float *wt, int64_t di, float *out,
                                                                   int64_t ld_out) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < di / 2; d++) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kp + d * ld);
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32((int)qp[i * (di / 2) + d]), kv);
    }
    select_heads(acc, wt, out, ld_out);
}
#endif

static void select_item(const void *job, int64_t item) {
    const select_job *j = job;
    const int64_t tiles = (j->c + SELECT_QUERIES - 1) / SELECT_QUERIES, b = item / tiles;
    const int64_t t0 = item % tiles * SELECT_QUERIES, nt = j->c - t0 < SELECT_QUERIES ? j->c - t0 : SELECT_QUERIES;
    const int64_t H = j->H, di = j->di, N = j->N, N16 = j->N16, k = j->k, nb = j->nb, keep = j->keep;
    /* the rows [SELECT_QUERIES, N16], best [nb], topk_fast's scratch [L / 16 + 2 L] and idx [L + 16] int32 (L:
     * the larger of N and nb), then chosen [keep] int64 (aligned) */
    const int64_t L = N > nb ? N : nb;
    const size_t floats = (size_t)(SELECT_QUERIES * N16 + nb + L / 16 + 3 * L + 17) & ~(size_t)1;
    float *rows = malloc(floats * sizeof(float) + (size_t)keep * sizeof(int64_t));
    if (!rows) {
        atomic_store(&((select_job *)j)->status, -2);
        return;
    }
    float *best = rows + SELECT_QUERIES * N16, *scratch = best + nb;
    int32_t *idx = (int32_t *)(scratch + L / 16 + 2 * L);
    int64_t *chosen = (int64_t *)(rows + floats);
    int64_t vis[SELECT_QUERIES], most = 0;
    for (int64_t t = 0; t < nt; t++) {
        const int64_t v = j->visible[b * j->c + t0 + t];
        vis[t] = v < 0 ? 0 : v > N ? N : v;
        most = vis[t] > most ? vis[t] : most;
    }
    const float *q = j->q + (b * j->c + t0) * H * di, *w = j->w + (b * j->c + t0) * H;
    const float *kt = j->keys_t + b * di * N16;
    for (int64_t s = 0; s < most; s += 16) {
#if defined(__AVX512VNNI__)
        if (j->int8 && H == 4 && nt == 4) {
            const int64_t row = (b * j->c + t0) * H;
            select_4x4_int8(j->codes + b * (di / 4) * N16 + s, N16, j->q_codes + row * (di / 4), j->q_exp + row,
                            j->k_corr + b * N16 + s, j->k_exp + b * N16 + s, w, di, rows + s, N16);
            continue;
        }
#endif
#if defined(__AVX512BF16__)
        if (j->exact && H == 4 && nt == 4) {
            select_4x4_pairs(j->pairs + b * (di / 2) * N16 + s, N16, j->q_pairs + (b * j->c + t0) * H * (di / 2), w,
                             di, rows + s, N16);
            continue;
        }
#endif
#if defined(__AVX512F__)
        if (H == 4 && nt == 4) {
            select_4x4(kt + s, N16, q, w, di, rows + s, N16);
            continue;
        }
#endif
        for (int64_t t = 0; t < nt; t++)
            if (s < vis[t]) select_one(kt + s, N16, q + t * H * di, w + t * H, H, di, rows + t * N16 + s);
    }
    for (int64_t t = 0; t < nt; t++) {
        const int64_t r = b * j->c + t0 + t, kk = k < vis[t] ? k : vis[t];
        const float *x = rows + t * N16;
        int64_t *o = j->picks + r * k;
        if (topk_fast(x, vis[t], kk, 1, scratch, idx, o) != 0) goto nan;
        for (int64_t i = kk; i < k; i++) o[i] = -1;
        if (j->mask && blocks_row(x, N, vis[t], j->visible[r], j->block, nb, keep, 1, best, scratch, idx, chosen,
                                  j->mask + r * nb) != 0)
            goto nan;
    }
    free(rows);
    return;
nan:
    atomic_store(&((select_job *)j)->status, -1);
    free(rows);
}

int dsv41_index_select(const float *q, const float *w, const float *keys, int64_t B, int64_t c, int64_t H,
                       int64_t di, int64_t N, const int64_t *visible, int64_t k, int64_t block, int64_t keep,
                       int64_t *picks, uint8_t *mask) {
    if (k > N) return -4;
    const int64_t N16 = (N + 15) / 16 * 16, nb = mask ? (N + block - 1) / block : 0;
    const int64_t items = B * ((N16 + SELECT_KEYS - 1) / SELECT_KEYS);
#if defined(__AVX512BF16__)
    const int pairs = di % 2 == 0 && H == 4;
#else
    const int pairs = 0;
#endif
#if defined(__AVX512VNNI__)
    const int int8 = pairs && di % 4 == 0 && di <= 32;
#else
    const int int8 = 0;
#endif
    /* int8 scratch: key codes [B, di / 4, N16], exponents and corrections [B, N16]; query codes and exponents */
    void *int8_scratch = int8 ? malloc((size_t)(B * (di / 4) * N16 + 2 * B * N16 + B * c * H * (di / 4) + B * c * H
                                                + 64) * 4) : NULL;
    float *keys_t = malloc((size_t)(B * di * N16 + 16) * sizeof(float));
    exp_stats *key_stats = malloc((size_t)items * sizeof(exp_stats));
    uint32_t *kp = pairs ? malloc((size_t)(B * (di / 2) * N16 + 16) * sizeof(uint32_t)) : NULL;
    uint32_t *qp = pairs ? malloc((size_t)(B * c * H * (di / 2) + 16) * sizeof(uint32_t)) : NULL;
    if (!keys_t || !key_stats || (pairs && !(kp && qp)) || (int8 && !int8_scratch)) {
        free(int8_scratch);
        free(keys_t);
        free(key_stats);
        free(kp);
        free(qp);
        return -2;
    }
    select_job job = {q, w, keys, c, H, di, N, N16, k, block, nb, mask ? (keep < nb ? keep : nb) : 0, visible,
                      keys_t, kp, qp, NULL, NULL, NULL, NULL, NULL, 0, key_stats, 0, 1, picks, mask, 0};
    if (int8) {
        job.codes = int8_scratch;
        job.k_exp = (float *)(job.codes + B * (di / 4) * N16);
        job.k_corr = (int32_t *)(job.k_exp + B * N16);
        job.q_codes = (uint32_t *)(job.k_corr + B * N16);
        job.q_exp = (float *)(job.q_codes + B * c * H * (di / 4));
    }
    parallel_for(select_stats, &job, items);
    if (pairs) {
        /* Every dot exact (then any order of addition gives the chain's sums): each query head's and key's values
         * zero or normal with at most one fraction bit (FP4 values times a power of two), so each product is a
         * multiple of 2^(lo_q + lo_k - 2) below 2^(hi_q + hi_k + 2) for the exponents of its two rows, and the sum
         * of di <= 32 of them stays below 2^(hi_q + hi_k + 7): exact when the two rows' spreads add up to at most
         * 15, the smallest multiple normal and the largest sum finite. */
        exp_stats qs = {1, 0, 1000, -1000}, ks = {1, 0, 1000, -1000};
        fp4_rows(q, B * c * H, di, &qs);
        for (int64_t i = 0; i < items; i++) {
            ks.ok &= key_stats[i].ok;
            ks.span = key_stats[i].span > ks.span ? key_stats[i].span : ks.span;
            ks.lo = key_stats[i].lo < ks.lo ? key_stats[i].lo : ks.lo;
            ks.hi = key_stats[i].hi > ks.hi ? key_stats[i].hi : ks.hi;
        }
        job.exact = di <= 32 && qs.ok && ks.ok && qs.span + ks.span <= 15 && qs.lo + ks.lo >= -124 &&
                    qs.hi + ks.hi <= 120;
        if (job.exact)
            for (int64_t i = 0; i < B * c * H * (di / 2); i++)
                qp[i] = to_bits(q[2 * i]) >> 16 | (to_bits(q[2 * i + 1]) & 0xffff0000u);
        /* int8 codes: every row's values integers of at most 3 x 2^5 = 96 times 2^m (spreads <= 5), the sums of di
         * <= 32 products below 2^19 (exact in int32 and fp32), every nonzero dot at least 2^(lo_q - 1 + lo_k - 1),
         * normal, and far from overflow */
        job.int8 = int8 && job.exact && qs.span <= 5 && ks.span <= 5 && qs.lo - 1 + ks.lo - 1 >= -126 &&
                   qs.hi + ks.hi <= 100;
        if (job.int8)
            for (int64_t r = 0; r < B * c * H; r++) {
                const float *row = q + r * di;
                int lo = 1000;
                for (int64_t i = 0; i < di; i++) {
                    const int e = (int)((to_bits(row[i]) >> 23) & 0xff) - 127;
                    if (row[i] != 0.0f && e < lo) lo = e;
                }
                const int m = lo == 1000 ? 0 : lo - 1;
                const float unit = from_bits((uint32_t)(127 - m) << 23);
                job.q_exp[r] = (float)m;
                for (int64_t g = 0; g < di / 4; g++) {
                    uint32_t word = 0;
                    for (int e = 0; e < 4; e++)
                        word |= (uint32_t)(uint8_t)((int32_t)(row[4 * g + e] * unit) + 128) << (8 * e);
                    job.q_codes[r * (di / 4) + g] = word;
                }
            }
    }
    /* the 4 x 4 tiles of the exact paths cover every query when c is a multiple of 4 (H = 4 there) */
    job.need_kt = !((job.int8 || job.exact) && c % SELECT_QUERIES == 0);
    parallel_for(select_layout, &job, items);
    parallel_for(select_item, &job, B * ((c + SELECT_QUERIES - 1) / SELECT_QUERIES));
    free(int8_scratch);
    free(keys_t);
    free(key_stats);
    free(kp);
    free(qp);
    return atomic_load(&job.status);
}

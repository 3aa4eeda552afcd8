/* The indexer (model/indexer.py): scores straight from the paged FP4 index keys, and its queries of a few tokens. */
#include "dsv41.h"
#include "index_keys.h"

/* ------------------------------------------------------------------------------ indexer scores from FP4 */

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

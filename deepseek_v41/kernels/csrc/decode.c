/* A decode step's layers in one call (issue 25; deepseek_v41/kernels/fast/decode.py builds the arguments).
 *
 * dsv41_decode_layers runs blocks [first, last) of a one-token-per-row decode step over the paged KV cache: for each
 * block the same kernel calls, in the same order and with the same arguments, as the installed module paths make
 * (deepseek_v41/kernels/fast: block.py, attention.py, moe.py, and cache/paged_context.py), so its results are theirs
 * bit for bit. What Python decided per call there (which path, the shapes, the context's entry counts) is decided
 * here from the same facts: the rows' positions, the layer's roles and ratios.
 *
 * Per layer (model/block.py, model/attention.py): the attention site's mixing and collapse + norm; the projections
 * (attn_prologue); the window ring step; for a sparse layer the compressor (pending pair of a ratio-2 layer read
 * from and written back to the cache; completed entries and index keys scattered into the FP4 pools), the indexer
 * of an index-source layer (queries, then scores + top-k and the candidate pool, or a Reindex layer's pool
 * selection) and the gather of the picked entries; attention; the output projections; expand; then the FFN
 * site's mixing, collapse + norm, router, routed + shared experts and expand.
 *
 * Returns 0; DSV41_DECLINED when a kernel the module path would leave to the torch code declines (a NaN among the
 * indexer's scores): the step's pending pairs are then restored, so the caller can run the whole step on the module
 * path (every other write of the step is rewritten with the same bytes there); -2 when memory runs out; -1 when an
 * entry lies past its block table. step->failed_layer says where. */
#include "dsv41.h"

#define DSV41_DECLINED 1

static int64_t max_visible(const int64_t *positions, int64_t B, int64_t ratio) {
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t v = (positions[b] + 1) / ratio;
        n = v > n ? v : n;
    }
    return n;
}

static int completes(const int64_t *positions, int64_t B, int64_t ratio) {
    for (int64_t b = 0; b < B; b++)
        if ((positions[b] + 1) / ratio > positions[b] / ratio) return 1;
    return 0;
}

static void widen(const void *x, int bf16, int64_t n, float *out) {
    if (bf16) bf16_row(x, n, out);
    else memcpy(out, x, (size_t)n * sizeof(float));
}

/* Put back the pending pairs of the step's rows as they were before it: the first `count` ratio-2 layers whose pairs
 * were saved (saved: [count, B, 2, d], in layer order). */
static void restore_pending(const dsv41_decode_step *S, const dsv41_decode_layer *layers, int64_t first,
                            int64_t count, const float *saved) {
    for (int64_t j = first; count > 0; j++) {
        const dsv41_decode_layer *L = &layers[j];
        if (!(L->compress && !S->skip_compress[j] && L->ratio == 2)) continue;
        count--;
        for (int64_t b = 0; b < S->B; b++, saved += 2 * L->d)
            memcpy(S->pending + ((S->slots[b] * S->pending_layers + L->pending_index) * 2) * L->d, saved,
                   (size_t)(2 * L->d) * sizeof(float));
    }
}

typedef struct {
    float *pre_a, *post_a, *comb_a, *post_f, *comb_f, *kv32, *keys, *pending, *new_pending, *entries32, *iq, *iw,
        *scores, *heap, *selected, *attend, *gate, *gate_w;
    void *x, *q_lat, *q, *kv, *latent, *entries, *ikeys, *o, *y;
    int64_t *key_pos, *group, *visible, *gate_idx;
    uint8_t *new_codes, *new_scales;
    float *saved;  /* the pending pairs before the step (restore_pending) */
    float *mix, *q32, *o32;  /* hc_mix's rows when hc * D > ROW_ON_STACK; wide bf16 queries (attend) */
} arena;

static void *take(char **at, int64_t bytes) {
    void *p = *at;
    *at += (bytes + 63) / 64 * 64;
    return p;
}

int dsv41_decode_layers(const dsv41_decode_layer *layers, int64_t first, int64_t last, dsv41_decode_step *S) {
    const int64_t B = S->B, R = S->R;
    const dsv41_decode_layer *M = &layers[first];
    const size_t el = M->bf16 ? 2 : 4;
    /* Sizes: the widest of each buffer over the layers. */
    int64_t D = M->D, hc = M->hc, qr = 0, Hd = 0, d = 0, di = 0, iHd = 0, iH = 0, topk = 0, ncap = 0, E = 0,
            ke = 0, pend = 0;
    for (int64_t j = first; j < last; j++) {
        const dsv41_decode_layer *L = &layers[j];
        qr = L->qr > qr ? L->qr : qr;
        Hd = L->H * L->d > Hd ? L->H * L->d : Hd;
        d = L->d > d ? L->d : d;
        di = L->di > di ? L->di : di;
        iHd = L->iH * L->idi > iHd ? L->iH * L->idi : iHd;
        iH = L->iH > iH ? L->iH : iH;
        topk = L->index_topk > topk ? L->index_topk : topk;
        E = L->E > E ? L->E : E;
        ke = L->k_experts > ke ? L->k_experts : ke;
        if (L->sparse) {
            int64_t n = max_visible(S->positions, B, L->src_ratio);
            ncap = n > ncap ? n : ncap;
        }
        if (L->compress && !S->skip_compress[j] && L->ratio == 2) pend++;
    }
    const int wide_q = M->bf16 && Hd > ROW_ON_STACK;  /* the module path widens such queries (fast/attention.py) */
    int64_t wide = d > di ? d : di;
    int64_t bytes = 0;
#define SZ(n) (((int64_t)(n) + 63) / 64 * 64)
    bytes += SZ(B * hc * 4) * 3 + SZ(B * hc * hc * 4) * 2 + SZ(B * d * 4) + SZ(B * (R + 1) * d * 4) +
             SZ(B * 2 * d * 4) * 2 + SZ(B * wide * 4) + SZ(B * iHd * 4) + SZ(B * iH * 4) + SZ(B * ncap * 4 + 4) +
             SZ(B * topk * 4 + 4) + SZ(B * topk * d * 4 + 4) + SZ(B * Hd * (R + 1 + topk) * 4) + SZ(B * E * 4) +
             SZ(B * ke * 4);
    bytes += SZ(B * D * el) * 2 + SZ(B * qr * el) + SZ(B * Hd * el) * 2 + SZ(B * d * el) * 3 + SZ(B * di * el);
    bytes += SZ(B * (R + 1) * 8) + SZ(B * 8) * 2 + SZ(B * ke * 8);
    bytes += SZ(B * d) + SZ(B * d / 32 + 1);
    bytes += SZ(pend * B * 2 * d * 4 + 4);
    bytes += SZ(hc * D > ROW_ON_STACK ? B * hc * D * 4 : 4) + SZ(wide_q ? B * Hd * 4 : 4) * 2;
#undef SZ
    char *base = aligned_alloc(64, (size_t)bytes), *at = base;
    if (!base) return -2;
    arena A;
    A.pre_a = take(&at, B * hc * 4), A.post_a = take(&at, B * hc * 4), A.post_f = take(&at, B * hc * 4);
    A.comb_a = take(&at, B * hc * hc * 4), A.comb_f = take(&at, B * hc * hc * 4);
    A.kv32 = take(&at, B * d * 4), A.keys = take(&at, B * (R + 1) * d * 4);
    A.pending = take(&at, B * 2 * d * 4), A.new_pending = take(&at, B * 2 * d * 4);
    A.entries32 = take(&at, B * wide * 4), A.iq = take(&at, B * iHd * 4), A.iw = take(&at, B * iH * 4);
    A.scores = take(&at, B * ncap * 4 + 4), A.heap = take(&at, B * topk * 4 + 4);
    A.selected = take(&at, B * topk * d * 4 + 4), A.attend = take(&at, B * Hd * (R + 1 + topk) * 4);
    A.gate = take(&at, B * E * 4), A.gate_w = take(&at, B * ke * 4);
    A.x = take(&at, B * D * el), A.y = take(&at, B * D * el), A.o = take(&at, B * Hd * el);
    A.q_lat = take(&at, B * qr * el), A.q = take(&at, B * Hd * el);
    A.kv = take(&at, B * d * el), A.latent = take(&at, B * d * el), A.entries = take(&at, B * d * el);
    A.ikeys = take(&at, B * di * el);
    A.key_pos = take(&at, B * (R + 1) * 8), A.group = take(&at, B * 8), A.visible = take(&at, B * 8);
    A.gate_idx = take(&at, B * ke * 8);
    A.new_codes = take(&at, B * d), A.new_scales = take(&at, B * d / 32 + 1);
    A.saved = take(&at, pend * B * 2 * d * 4 + 4);
    A.mix = hc * D > ROW_ON_STACK ? take(&at, B * hc * D * 4) : (take(&at, 4), NULL);
    A.q32 = take(&at, wide_q ? B * Hd * 4 : 4), A.o32 = take(&at, wide_q ? B * Hd * 4 : 4);

    /* The streams: in -> middle (after the attention) -> out, through two buffers of the caller's (S->streams[0],
     * [1]) that are never the layer's own input. */
    int status = 0;
    const void *in = S->streams_in;
    const float *pre_in = S->pre_in;
    int64_t saved_layers = 0;
    const int64_t T = S->topk_width;  /* columns of S->topk per layer */
    int64_t j = first;
    for (; j < last; j++) {
        const dsv41_decode_layer *L = &layers[j];
        const int bf16 = (int)L->bf16;
        void *middle = in == S->streams[0] ? S->streams[1] : S->streams[0];
        void *out = middle == S->streams[0] ? S->streams[1] : S->streams[0];
        const float *cos_ = S->cos[L->rope], *sin_ = S->sin[L->rope];
        if (S->taps)  /* the layer's input streams (DSpark's target features) */
            memcpy((char *)S->taps + j * S->taps_stride, in, (size_t)(B * hc * D) * el);
        /* ---- attention site */
        dsv41_hc_mix(in, bf16, B, hc, D, L->mix[0], L->mix[1], L->mix[2], L->norm_eps, L->hc_eps, L->iters, A.mix,
                     A.pre_a, A.post_a, A.comb_a);
        dsv41_hc_collapse(in, bf16, pre_in, B, hc, D, L->attn_norm, L->attn_norm_eps, A.x);
        if (dsv41_attn_prologue(A.x, bf16, B, D, L->wq_a, L->qr, L->q_norm, L->q_eps, L->wq_b, L->H, L->d, L->wkv,
                                L->kv_norm, L->kv_eps, cos_, sin_, L->r, A.q_lat, A.q, A.kv) != 0) {
            status = -2;
            break;
        }
        widen(A.kv, bf16, B * L->d, A.kv32);
        dsv41_window_step(S->ring_codes, S->ring_scales, S->ring_pos, S->ring_layers, L->layer, R, L->d, S->slots, B,
                          S->positions, 1, A.kv32, A.new_codes, A.new_scales, A.keys, A.key_pos);
        const float *selected = NULL;
        const int64_t *picks = NULL;
        int64_t k = 0;
        if (L->sparse) {
            if (L->compress && !S->skip_compress[j]) {
                float *pk = NULL, *ps = NULL;
                if (L->ratio == 2) {  /* the open pairs of the rows (ctx.pending), kept for restore_pending */
                    float *keep = A.saved + saved_layers * B * 2 * L->d;
                    for (int64_t b = 0; b < B; b++)
                        memcpy(A.pending + b * 2 * L->d,
                               S->pending + ((S->slots[b] * S->pending_layers + L->pending_index) * 2) * L->d,
                               (size_t)(2 * L->d) * sizeof(float));
                    memcpy(keep, A.pending, (size_t)(B * 2 * L->d) * sizeof(float));
                    saved_layers++;
                    pk = A.pending, ps = A.pending + L->d;
                }
                int done = completes(S->positions, B, L->ratio);
                const float *ccos = NULL, *csin = NULL;
                if (done) {
                    ccos = L->ratio == 2 ? S->pair_cos[L->rope] : cos_;
                    csin = L->ratio == 2 ? S->pair_sin[L->rope] : sin_;
                }
                if (dsv41_compress(A.x, bf16, B, 1, D, S->positions, L->ratio, L->c_wkv, L->c_wgate, L->d, L->c_norm,
                                   L->c_eps, pk, ps, pk ? 2 * L->d : 0, ccos, csin, done ? L->r : 0, L->c_wk, L->di,
                                   L->c_knorm, L->c_keps, A.latent, L->ratio == 2 ? A.group : NULL,
                                   L->ratio == 2 ? A.new_pending : NULL, done ? A.entries : NULL,
                                   done ? A.ikeys : NULL) != 0) {
                    status = -2;
                    break;
                }
                if (L->ratio == 2)  /* ctx.set_pending */
                    for (int64_t b = 0; b < B; b++)
                        memcpy(S->pending + ((S->slots[b] * S->pending_layers + L->pending_index) * 2) * L->d,
                               A.new_pending + b * 2 * L->d, (size_t)(2 * L->d) * sizeof(float));
                if (done) {  /* ctx.add_entries: the entries, then their index keys */
                    const int64_t *group = L->ratio == 2 ? A.group : S->positions;
                    int64_t written = 0;
                    for (int p = 0; p < 2; p++) {
                        int64_t width = p ? L->di : L->d;
                        widen(p ? A.ikeys : A.entries, bf16, B * width, A.entries32);
                        written = dsv41_fp4_scatter(L->pools[2 * p], L->pools[2 * p + 1], L->pool_pages,
                                                    L->per_page, width, p ? 32 : 16, p ? 1 : 0, S->tables,
                                                    S->table_len, L->ratio, S->block_size, group, S->write_from, B, 1,
                                                    A.entries32);
                        if (written < 0) break;
                    }
                    if (written < 0) {
                        status = -1;
                        break;
                    }
                    S->written[j] = written;
                }
            }
            int64_t N = max_visible(S->positions, B, L->src_ratio);  /* ctx.num_entries(kv_source) */
            int64_t *mine = S->topk + j * B * T;
            if (L->index) {  /* Attention.select */
                int64_t kk = L->index_topk < N ? L->index_topk : N;
                S->k[j] = kk;
                if (kk > 0) {
                    if (dsv41_indexer_queries(A.q_lat, A.x, bf16, B, L->qr, D, L->iq_wq_b, L->iH, L->idi, L->iq_wproj,
                                              cos_, sin_, L->r, 1, L->iq_scale, A.iq, A.iw) != 0) {
                        status = -2;
                        break;
                    }
                    for (int64_t b = 0; b < B; b++) A.visible[b] = (S->positions[b] + 1) / L->ratio;
                    const uint8_t *codes = L->pools[2], *scales = L->pools[3];
                    if (L->candidate_source >= 0 && L->keep * L->block < N) {  /* Reindex: inside the pool */
                        const uint8_t *blocks = S->pool + L->candidate_source * B * S->pool_width;
                        int64_t nblocks = S->nblocks[L->candidate_source];
                        int64_t keep = L->keep < nblocks ? L->keep : nblocks;
                        int64_t local = kk < keep * L->block ? kk : keep * L->block;
                        S->k[j] = kk = local;
                        int st = dsv41_pool_select(codes, scales, L->pool_pages, L->per_page, L->di, 32, 1, S->tables,
                                                   S->table_len, L->src_ratio, S->block_size, A.iq, A.iw, B, 1, L->iH,
                                                   N, blocks, nblocks, L->block, L->keep, A.visible, kk, mine);
                        if (st != 0) {
                            status = st == -1 ? -1 : st == -2 ? -2 : DSV41_DECLINED;
                            break;
                        }
                    } else {
                        int lut = N >= S->lut_rows && L->iH <= 64 && L->idi / 2 * 256 * ((L->iH + 3) / 4) * 4 <= 1 << 16;
                        int st = dsv41_index_scores(codes, scales, L->pool_pages, L->per_page, L->di, 32, 1, S->tables,
                                                    S->table_len, L->src_ratio, S->block_size, A.iq, A.iw, B, 1, L->iH,
                                                    N, lut, A.visible, A.scores);
                        if (st != 0) {
                            status = st == -2 ? -2 : -1;
                            break;
                        }
                        if (L->is_candidate_source) {
                            int64_t nblocks = (N + L->block - 1) / L->block;
                            S->nblocks[j] = nblocks;
                            st = dsv41_candidate_blocks(A.scores, A.visible, B, N, L->block, L->keep,
                                                        S->pool + j * B * S->pool_width);
                            if (st != 0) {
                                status = st == -2 ? -2 : DSV41_DECLINED;
                                break;
                            }
                        }
                        if (dsv41_topk_set(A.scores, B, N, kk, 1, A.heap, mine) != 0) {
                            status = DSV41_DECLINED;
                            break;
                        }
                    }
                }
            }
            k = S->k[L->index_source];
            if (k > 0) {  /* ctx.gather_entries: the picked entries, -1 reading zeros */
                picks = S->topk + L->index_source * B * T;
                if (dsv41_fp4_gather(L->pools[0], L->pools[1], L->pool_pages, L->per_page, L->d, 16, 0, S->tables,
                                     S->table_len, L->src_ratio, S->block_size, picks, B, k, A.selected) != 0) {
                    status = -1;
                    break;
                }
                selected = A.selected;
            }
        }
        if (wide_q) {  /* queries wider than a stack row: widened, attended in fp32, rounded once */
            widen(A.q, 1, B * L->H * L->d, A.q32);
            dsv41_attend_few(A.q32, 0, S->positions, A.keys, A.key_pos, B, 1, L->H, L->d, R + 1, L->window, selected,
                             picks, k, L->sink, L->scale, A.attend, A.o32);
            for (int64_t i = 0; i < B * L->H * L->d; i++) ((uint16_t *)A.o)[i] = bf16_round(A.o32[i]);
        } else {
            dsv41_attend_few(A.q, bf16, S->positions, A.keys, A.key_pos, B, 1, L->H, L->d, R + 1, L->window,
                             selected, picks, k, L->sink, L->scale, A.attend, A.o);
        }
        if (dsv41_attn_epilogue(A.o, bf16, B, L->H, L->d, cos_, sin_, L->r, L->wo_a, L->groups, L->rank, L->wo_b, D,
                                A.y) != 0) {
            status = -2;
            break;
        }
        dsv41_hc_expand(in, bf16, A.y, A.post_a, A.comb_a, B, hc, D, middle);
        /* ---- FFN site */
        dsv41_hc_mix(middle, bf16, B, hc, D, L->mix[3], L->mix[4], L->mix[5], L->norm_eps, L->hc_eps, L->iters, A.mix,
                     S->pre_out, A.post_f, A.comb_f);
        dsv41_hc_collapse(middle, bf16, A.pre_a, B, hc, D, L->ffn_norm, L->ffn_norm_eps, A.x);
        if (dsv41_gate(A.x, bf16, B, D, L->gate_w, (int)L->gate_bf16, L->E, L->gate_bias, L->k_experts, (int)L->norm_topk,
                       L->route_scale, A.gate, A.gate_idx, A.gate_w) != 0) {
            status = -2;
            break;
        }
        int st = dsv41_moe(A.x, bf16, B, D, A.gate_idx, A.gate_w, L->k_experts, (int)L->moe_kind, L->w13, L->sc13,
                           L->w2, L->sc2, L->E, L->inter, L->limit, L->s1, L->s3, L->s2, (int)L->s_bf16, L->s_inter,
                           A.y, bf16);
        if (st != 0) {
            status = st == -2 ? -2 : -3;
            break;
        }
        dsv41_hc_expand(middle, bf16, A.y, A.post_f, A.comb_f, B, hc, D, out);
        in = out;
        pre_in = S->pre_out;
    }
    S->failed_layer = status ? j : -1;
    S->streams_out = (void *)in;
    if (status) restore_pending(S, layers, first, saved_layers, A.saved);
    free(base);
    return status;
}

/* The few-query attention (model/attention.py _attend_few) and the query / KV and output
 * projections of the attention for a few tokens. */
#include "dsv41.h"

/* ------------------------------------------------------------------------------------ few-query attention */

typedef struct {
    const void *q;  /* fp32, or bf16 bits (bf16), as out */
    const float *keys, *selected, *sink;
    const int64_t *q_pos, *key_pos, *topk;
    int bf16;
    int64_t T, H, d, L, window, k;
    float scale;
    float *scratch;
    void *out;
} attend_job;

#define ATTEND_MAX_HEADS 256  /* heads of one query the kernel keeps on the stack */

/* q . key over d values for one head: 16 lanes at a time (each lane adding in order), summed by sum16, then the
 * last d % 16 products one by one. */
static inline float dot16(const float *q, const float *key, int64_t d) {
    v16f acc = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) acc += load16(q + i) * load16(key + i);
    float s = sum16(acc);
    for (; i < d; i++) s += q[i] * key[i];
    return s;
}

/* o [d] = sum over the unmasked rows j of e_j * row_j with e_j = exp(s_j - top), in j order (each element adding
 * in that order), and e_j added to *total in the same order: rows are the window keys kb [L, d], then the selected
 * entries sel [n - L, d]; s [n] holds -inf for a masked row. */
static void weighted_sum(const float *s, int64_t n, float top, const float *kb, int64_t L, const float *sel,
                         int64_t d, float *o, float *total) {
    memset(o, 0, (size_t)d * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        if (s[j] == -INFINITY) continue;
        const float *v = j < L ? kb + j * d : sel + (j - L) * d;
        float e = expf(s[j] - top);
        *total += e;
        for (int64_t i = 0; i < d; i++) o[i] += e * v[i];
    }
}

/* weighted_sum for a fixed d: the sums stay in registers (the same operations, so the same bits). */
/* s [n] := exp(s[j] - top) (expf's bits; 16 at a time with AVX-512: expf16), -1 where s[j] is -inf (a masked
 * row: an exponential is never -1), so that the weighted sums after it call nothing (a call in their loop kept
 * their vector sums in memory: every zmm register is the callee's to clobber). */
static void exps_of(float *s, int64_t n, float top) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(s + j);
        __mmask16 masked = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
        __m512 e = expf16(_mm512_sub_ps(v, _mm512_set1_ps(top)));
        _mm512_storeu_ps(s + j, _mm512_mask_blend_ps(masked, e, _mm512_set1_ps(-1.0f)));
    }
#endif
    for (; j < n; j++) s[j] = s[j] == -INFINITY ? -1.0f : expf(s[j] - top);
}

/* weighted_sum for a fixed d, after exps_of: the sums stay in registers (the same operations, so the same bits). */
#define WEIGHTED_SUM(D)                                                                                        \
    static void weighted_exps_##D(const float *e, int64_t n, const float *kb, int64_t L, const float *sel,      \
                                  float *o, float *total) {                                                     \
        v16f acc[D / 16];                                                                                      \
        for (int c = 0; c < D / 16; c++) acc[c] = (v16f){0};                                                   \
        float sum = *total;                                                                                    \
        for (int64_t j = 0; j < n; j++) {                                                                      \
            if (e[j] == -1.0f) continue;                                                                       \
            const float *v = j < L ? kb + j * D : sel + (j - L) * D;                                           \
            sum += e[j];                                                                                       \
            for (int c = 0; c < D / 16; c++) acc[c] += e[j] * load16(v + 16 * c);                              \
        }                                                                                                      \
        *total = sum;                                                                                          \
        memcpy(o, acc, sizeof acc);                                                                            \
    }
WEIGHTED_SUM(64)
WEIGHTED_SUM(128)
#undef WEIGHTED_SUM

/* One query token, all its heads: each key row (window key or selected entry) is read once for every head, first
 * for the scores, then for the weighted sum. scratch [H, L + k]: the scores, -inf where masked (for d 64 / 128
 * then their exponentials, exps_of). */
static void attend_item(const void *job, int64_t bt) {
    const attend_job *a = job;
    const int64_t b = bt / a->T, H = a->H, d = a->d, L = a->L, k = a->k, window = a->window, n = L + k;
    const float *kb = a->keys + b * L * d, scale = a->scale, *qt = (const float *)a->q + bt * H * d;
    const int64_t *kp = a->key_pos + b * L, p = a->q_pos[bt];
    const float *sel = a->selected ? a->selected + bt * k * d : 0;
    const int64_t *picks = a->topk ? a->topk + bt * k : 0;
    float *scratch = a->scratch + bt * H * n, *out = (float *)a->out + bt * H * d;
    const float *sink = a->sink;
    float q_row[ROW_ON_STACK], out_row[ROW_ON_STACK];  /* bf16: H * d <= ROW_ON_STACK */
    if (a->bf16) {  /* the query widened exactly, the output rounded to bf16 at the end */
        bf16_row((const uint16_t *)a->q + bt * H * d, H * d, q_row);
        qt = q_row;
        out = out_row;
    }
    int64_t j = 0;
#if defined(__AVX512F__)
    if (H % 4 == 0 && d % 16 == 0)  /* 4 keys x 4 heads at once: each dot16's operations, summed by sum16_by16 */
        for (; j + 4 <= n; j += 4) {
            int seen[4];
            const float *v[4];
            for (int c = 0; c < 4; c++) {
                int64_t jc = j + c;
                seen[c] = jc < L ? kp[jc] >= 0 && kp[jc] <= p && kp[jc] > p - window : picks[jc - L] >= 0;
                v[c] = jc < L ? kb + jc * d : sel + (jc - L) * d;
            }
            for (int64_t h0 = 0; h0 < H; h0 += 4) {
                __m512 acc[4][4];
                for (int c = 0; c < 4; c++)
                    for (int h = 0; h < 4; h++) acc[c][h] = _mm512_setzero_ps();
                for (int64_t i = 0; i < d; i += 16) {
                    __m512 qv[4];
                    for (int h = 0; h < 4; h++) {
                        qv[h] = _mm512_loadu_ps(qt + (h0 + h) * d + i);
                        __asm__("" : "+v"(qv[h]));  /* held in a register for the 4 keys */
                    }
                    for (int c = 0; c < 4; c++) {
                        __m512 kv = _mm512_loadu_ps(v[c] + i);
                        __asm__("" : "+v"(kv));
                        for (int h = 0; h < 4; h++) acc[c][h] = _mm512_add_ps(acc[c][h], _mm512_mul_ps(kv, qv[h]));
                    }
                }
                float dots[16];
                _mm512_storeu_ps(dots, sum16_by16(acc));  /* dots[4 c + h] */
                for (int c = 0; c < 4; c++)
                    for (int h = 0; h < 4; h++)
                        scratch[(h0 + h) * n + j + c] = seen[c] ? dots[4 * c + h] * scale : -INFINITY;
            }
        }
#endif
    for (; j < n; j++) {
        int seen = j < L ? kp[j] >= 0 && kp[j] <= p && kp[j] > p - window : picks[j - L] >= 0;
        const float *v = j < L ? kb + j * d : sel + (j - L) * d;
        for (int64_t h = 0; h < H; h++) scratch[h * n + j] = seen ? dot16(qt + h * d, v, d) * scale : -INFINITY;
    }
    float total[ATTEND_MAX_HEADS], top[ATTEND_MAX_HEADS];
    for (int64_t h = 0; h < H; h++) {
        float m = sink[h];
        for (int64_t j = 0; j < n; j++) m = scratch[h * n + j] > m ? scratch[h * n + j] : m;
        top[h] = m;
        total[h] = expf(sink[h] - m);
    }
    for (int64_t h = 0; h < H; h++) {
        float *o = out + h * d;
        if (d == 64 || d == 128) {
            exps_of(scratch + h * n, n, top[h]);
            if (d == 64)
                weighted_exps_64(scratch + h * n, n, kb, L, sel, o, &total[h]);
            else
                weighted_exps_128(scratch + h * n, n, kb, L, sel, o, &total[h]);
        } else
            weighted_sum(scratch + h * n, n, top[h], kb, L, sel, d, o, &total[h]);
        float inv = 1.0f / total[h];
        for (int64_t i = 0; i < d; i++) o[i] *= inv;
    }
    if (a->bf16)
        for (int64_t i = 0; i < H * d; i++) store_out(a->out, bt * H * d + i, out[i], 1);
}

/* One softmax with a sink per (query, head) over the window keys and the selected entries (model/attention.py
 * _attend_few): q [B, T, H, d]; keys [B, L, d] with key_pos [B, L] (a key is seen by a query at position p when
 * p - window < key_pos <= p); selected [B, T, k, d] with topk [B, T, k] (-1 = none); sink [H]. out [B, T, H, d]
 * = sum_j softmax_j(s) v_j with the sink in the denominator; masked keys are skipped (their weight is 0).
 * q and out are fp32, or bf16 bits (bf16: q widened exactly, out rounded to nearest even at the end, as casting the
 * fp32 result would; H * d <= ROW_ON_STACK); keys, selected and sink fp32. scratch: H * (L + k) floats per query;
 * H <= ATTEND_MAX_HEADS. */
void dsv41_attend_few(const void *q, int bf16, const int64_t *q_pos, const float *keys, const int64_t *key_pos,
                      int64_t B, int64_t T, int64_t H, int64_t d, int64_t L, int64_t window, const float *selected,
                      const int64_t *topk, int64_t k, const float *sink, float scale, float *scratch, void *out) {
    attend_job job = {.q = q, .keys = keys, .selected = selected, .sink = sink, .q_pos = q_pos, .key_pos = key_pos,
                      .topk = topk, .bf16 = bf16, .T = T, .H = H, .d = d, .L = L, .window = window, .k = k,
                      .scale = scale, .scratch = scratch, .out = out};
    parallel_for(attend_item, &job, B * T);  /* one query token (all its heads) per item; scratch [B * T, H, L + k] */
}

/* ------------------------------------------------------------------- attention projections of a few tokens */

/* The query and window-KV projections of model/attention.py Attention.forward for a few tokens, one call instead
 * of seven module calls: q_lat = q_norm(wq_a x) [N, qr]; q = rope(wq_b q_lat) [N, H, d]; kv = rope(kv_norm(wkv x))
 * [N, d], RoPE on the last r dims with phases cos / sin fp32 [N, r]. x, the weights and the outputs are all fp32
 * or all bf16 bits (bf16: each step's output rounded where the torch code rounds it, so the same bits as its
 * kernel path; fp32: the GEMVs add in another order than ATen's). Returns 0, or -1 when scratch cannot be had. */
int dsv41_attn_prologue(const void *x, int bf16, int64_t N, int64_t D, const void *wq_a, int64_t qr,
                        const void *q_norm, float q_eps, const void *wq_b, int64_t H, int64_t d, const void *wkv,
                        const void *kv_norm, float kv_eps, const float *cos_, const float *sin_, int64_t r,
                        void *q_lat, void *q, void *kv) {
    int64_t widest = D > qr ? D : qr;
    float *scratch = malloc((size_t)(N * widest + (widest > d ? widest : d)) * sizeof(float));
    if (!scratch) return -1;
    float *row = scratch + N * widest;  /* max(D, qr, d) floats: norm_rows of q_lat (qr) and of kv (d) */
    linear_into(x, bf16, N, 1, D, wq_a, bf16, qr, q_lat, bf16, scratch);
    norm_rows(q_lat, bf16, N, qr, q_norm, q_eps, row);
    linear_into(q_lat, bf16, N, 1, qr, wq_b, bf16, H * d, q, bf16, scratch);
    rope_rows(q, bf16, cos_, sin_, N, H, d, r, 1, q);
    linear_into(x, bf16, N, 1, D, wkv, bf16, d, kv, bf16, scratch);
    norm_rows(kv, bf16, N, d, kv_norm, kv_eps, row);
    rope_rows(kv, bf16, cos_, sin_, N, 1, d, r, 1, kv);
    free(scratch);
    return 0;
}

/* The output side of Attention.forward for a few tokens: y = wo_b(wo_a(inverse_rope(o))) with o [N, H, d], the
 * grouped wo_a [G * rank, H * d / G] and wo_b [D, G * rank]: y [N, D]; dtypes and rounding as in
 * dsv41_attn_prologue. Returns 0, or -1 when scratch cannot be had. */
int dsv41_attn_epilogue(const void *o, int bf16, int64_t N, int64_t H, int64_t d, const float *cos_,
                        const float *sin_, int64_t r, const void *wo_a, int64_t G, int64_t rank, const void *wo_b,
                        int64_t D, void *y) {
    const size_t size = bf16 ? 2 : 4;
    int64_t widest = H * d > G * rank ? H * d : G * rank;
    void *rotated = malloc((size_t)(N * H * d) * size), *low = malloc((size_t)(N * G * rank) * size);
    float *scratch = malloc((size_t)(N * widest) * sizeof(float));
    int status = -1;
    if (rotated && low && scratch) {
        rope_rows(o, bf16, cos_, sin_, N, H, d, r, -1, rotated);
        linear_into(rotated, bf16, N, G, H * d / G, wo_a, bf16, rank, low, bf16, scratch);
        linear_into(low, bf16, N, 1, G * rank, wo_b, bf16, D, y, bf16, scratch);
        status = 0;
    }
    free(rotated);
    free(low);
    free(scratch);
    return status;
}

/* ------------------------------------------------------------------ prefill attention: logits and output */

/* The two matmul halves of model/attention.py sparse_attention for a chunk of c queries of a prefill forward
 * (issue 25), causal (no key_limit) and banded; the softmax between them stays torch's. The torch code's einsums are
 * batched GEMMs whose every output ATen / MKL sums as one chain of fused multiply-adds over the contraction, from 0
 * (tests/kernels checks it on the machine); these kernels make the same chains, so the same bits.
 *
 * Shapes: q [B, c, H, d] fp32 (queries i0 .. i0 + c - 1 of the forward's T), q_pos [B, c]; keys [B, L, d] fp32 with
 * key_pos [B, L]: rows 0 .. P-1 earlier (any order, -1 empty), rows P .. L-1 the T new ones; band = min(window, T);
 * sel [B, c, k, d] fp32 with idx [B, c, k] (-1 = none; the row read as it is), sink [H].
 *
 * dsv41_band_logits: out [B, c, H, n], n = P + band + k + 1, the torch code's concatenated logits: the earlier rows'
 * dots times scale (-inf unless p - window < key_pos <= p and key_pos >= 0), the band's (query i's new rows
 * i - band + 1 .. i; -inf for rows before the first or a key_pos < 0), the selected entries' (-inf where idx < 0),
 * then sink[h]. Each dot: the chain over d, then one multiplication by scale. Vectorized over 16 rows at a time from
 * the rows transposed (scratch [B, d, P16 + the chunk's band columns] and per item [d, k16]); d <= 256 (else -3).
 *
 * dsv41_band_output: o [B, c, H, d] = (probs[:P] . earlier rows + probs[P:P + band] . band rows) + probs[P + band:
 * P + band + k] . selected, each product a chain over its rows in order (band rows before the first read as zero
 * rows, as the torch code's padding), from probs [B, c, H, n]. Vectorized over d.
 *
 * Skipped work, the same bits: the dots of a block of 16 earlier rows none of which the query sees (their logits
 * are -inf whatever the dots), and the earlier rows' chain of a query whose probabilities there are all 0 when
 * every earlier row is finite (each fma(0, v, acc) from +0 leaves +0; acc is never -0 in a chain from +0). Queries
 * past the first `window` of a forward see no earlier row: most of a 2K chunk's. */
#define BAND_ITEM 4  /* queries per item */

typedef struct {
    const float *q, *keys, *sel, *sink, *probs;
    const int64_t *q_pos, *key_pos, *idx;
    int64_t B, c, H, d, L, P, i0, band, window, k, n, T, P16, ld, span16;
    int prev_finite;  /* band_output: every earlier row of every batch row finite */
    float scale;
    float *kt;  /* [B, d, ld]: earlier rows at 0 .., then the new rows i0 - band + 1 .. i0 + c - 1 from P16 on */
    float *out;
    _Atomic int status;
} band_job;

#if defined(__AVX512F__)
/* One round of a 16 x 16 transpose in registers: rows i and i + S (bit S of i clear) swap their off-diagonal S x S
 * blocks. */
#define TRANSPOSE_ROUND(S)                                                                                      \
    do {                                                                                                        \
        const __m512i lo = _mm512_loadu_si512(TRANSPOSE_LO[S == 8 ? 0 : S == 4 ? 1 : S == 2 ? 2 : 3]);          \
        const __m512i hi = _mm512_loadu_si512(TRANSPOSE_HI[S == 8 ? 0 : S == 4 ? 1 : S == 2 ? 2 : 3]);          \
        _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) if ((i & S) == 0) {                               \
            const __m512 a = v[i], b = v[i + S];                                                                \
            v[i] = _mm512_permutex2var_ps(a, lo, b);                                                            \
            v[i + S] = _mm512_permutex2var_ps(a, hi, b);                                                        \
        }                                                                                                       \
    } while (0)

/* lane l of row i after a round of block size S: (l & S) == 0 ? row i's lane l : row i + S's lane l - S (LO), and
 * row i + S's: (l & S) == 0 ? row i's lane l + S : row i + S's lane l (HI); indices >= 16 name the second row. */
static const int32_t TRANSPOSE_LO[4][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                            {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                                            {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                                            {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
static const int32_t TRANSPOSE_HI[4][16] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                                            {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                                            {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                                            {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
#endif

/* dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols (a copy, transposed); zeros where r >= rows up
 * to rows16 (rows rounded up to 16). With AVX-512, 16 x 16 blocks through four rounds of lane permutes. */
static void transpose_rows(const float *src, int64_t ld_src, int64_t rows, int64_t cols, float *dst, int64_t ld_dst) {
    const int64_t rows16 = (rows + 15) / 16 * 16;
    int64_t c0 = 0;
#if defined(__AVX512F__)
    for (; c0 + 16 <= cols; c0 += 16)
        for (int64_t r0 = 0; r0 < rows16; r0 += 16) {
            __m512 v[16];
            for (int i = 0; i < 16; i++)
                v[i] = r0 + i < rows ? _mm512_loadu_ps(src + (r0 + i) * ld_src + c0) : _mm512_setzero_ps();
            TRANSPOSE_ROUND(8);
            TRANSPOSE_ROUND(4);
            TRANSPOSE_ROUND(2);
            TRANSPOSE_ROUND(1);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + (c0 + i) * ld_dst + r0, v[i]);
        }
#endif
    for (int64_t c = c0; c < cols; c++)
        for (int64_t r = 0; r < rows16; r++) dst[c * ld_dst + r] = r < rows ? src[r * ld_src + c] : 0.0f;
}

/* Item 0: the earlier rows [P, d] -> kt[:, 0 .. P16); item 1 + m: the band - 1 zero columns, then new rows
 * i0 - band + 1 + 16 m .. of the chunk's bands (the rows before the first read as zero). */
static void band_transpose(const void *job, int64_t item) {
    const band_job *j = job;
    const int64_t per = 1 + j->span16 / 16, b = item / per, m = item % per, d = j->d;
    float *kt = j->kt + b * d * j->ld;
    const float *keys = j->keys + b * j->L * d;
    if (m == 0) {
        if (j->P) transpose_rows(keys, d, j->P, d, kt, j->ld);
        return;
    }
    const int64_t first = j->i0 - j->band + 1 + 16 * (m - 1);  /* new row of column P16 + 16 (m - 1) */
    float rows[16 * 256];  /* d <= 256 */
    int64_t count = 0;
    for (int64_t r = 0; r < 16; r++) {
        const int64_t row = first + r;
        if (row >= 0 && row < j->T) memcpy(rows + r * d, keys + (j->P + row) * d, (size_t)d * sizeof(float));
        else memset(rows + r * d, 0, (size_t)d * sizeof(float));
        count = r + 1;
    }
    transpose_rows(rows, d, count, d, kt + j->P16 + 16 * (m - 1), j->ld);
}

/* dots of H heads (qt [H, d]) with 16 transposed rows at kt (row stride ld) times scale -> o[h * n + 0 .. 15]. */
static inline void band_dots16(const float *kt, int64_t ld, const float *qt, int64_t H, int64_t d, float scale,
                               float *o, int64_t n) {
#if defined(__AVX512F__)
    int64_t h = 0;
    for (; h + 4 <= H; h += 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t dd = 0; dd < d; dd++) {
            const __m512 kv = _mm512_loadu_ps(kt + dd * ld);
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(qt[h * d + dd]), kv, a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(qt[(h + 1) * d + dd]), kv, a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(qt[(h + 2) * d + dd]), kv, a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(qt[(h + 3) * d + dd]), kv, a3);
        }
        const __m512 sc = _mm512_set1_ps(scale);
        _mm512_storeu_ps(o + h * n, _mm512_mul_ps(a0, sc));
        _mm512_storeu_ps(o + (h + 1) * n, _mm512_mul_ps(a1, sc));
        _mm512_storeu_ps(o + (h + 2) * n, _mm512_mul_ps(a2, sc));
        _mm512_storeu_ps(o + (h + 3) * n, _mm512_mul_ps(a3, sc));
    }
    for (; h < H; h++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t dd = 0; dd < d; dd++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(qt[h * d + dd]), _mm512_loadu_ps(kt + dd * ld), a);
        _mm512_storeu_ps(o + h * n, _mm512_mul_ps(a, _mm512_set1_ps(scale)));
    }
#else
    for (int64_t h = 0; h < H; h++)
        for (int m = 0; m < 16; m++) {
            float a = 0.0f;
            for (int64_t dd = 0; dd < d; dd++) a = fmaf(qt[h * d + dd], kt[dd * ld + m], a);
            o[h * n + m] = a * scale;
        }
#endif
}

/* band_dots16 for rows 0 .. count-1, 16 at a time (two blocks at once, 8 chains in flight, measured slower). */
static inline void band_dots(const float *kt, int64_t ld, const float *qt, int64_t H, int64_t d, float scale,
                             float *o, int64_t n, int64_t count) {
    for (int64_t s = 0; s < count; s += 16) band_dots16(kt + s, ld, qt, H, d, scale, o + s, n);
}

static void band_logits_item(const void *job, int64_t item) {
    const band_job *j = job;
    const int64_t per = (j->c + BAND_ITEM - 1) / BAND_ITEM, b = item / per, t0 = item % per * BAND_ITEM;
    const int64_t t1 = t0 + BAND_ITEM < j->c ? t0 + BAND_ITEM : j->c;
    const int64_t H = j->H, d = j->d, n = j->n, P = j->P, band = j->band, k = j->k, k16 = (k + 15) / 16 * 16;
    const int64_t P16 = j->P16, ld = j->ld, width = (P16 > band ? P16 : band) + k16 + 16;
    /* one query's dots land in rows [H, width] first (16 at a time may run past each part), then are copied */
    float *buf = malloc((size_t)(H * width + d * k16 + 16) * sizeof(float));
    if (!buf) {
        atomic_store(&((band_job *)j)->status, -2);
        return;
    }
    float *selt = buf + H * width;
    const float *kt = j->kt + b * d * ld;
    const int64_t *kp = j->key_pos + b * j->L;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t r = b * j->c + t, i = j->i0 + t, p = j->q_pos[r];
        const float *qt = j->q + r * H * d;
        float *o = j->out + r * H * n;
        for (int64_t s = 0; s < P; s += 16) {  /* (a block no row of which this query sees: masked, no dots) */
            int seen = 0;
            for (int64_t m = s; m < s + 16 && m < P; m++) seen |= kp[m] <= p && kp[m] > p - j->window && kp[m] >= 0;
            if (seen) band_dots16(kt + s, ld, qt, H, d, j->scale, buf + s, width);
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t s = 0; s < P; s++) {
                const int64_t kps = kp[s];
                o[h * n + s] = kps <= p && kps > p - j->window && kps >= 0 ? buf[h * width + s] : -INFINITY;
            }
        band_dots(kt + P16 + t, ld, qt, H, d, j->scale, buf, width, band);
        for (int64_t h = 0; h < H; h++)
            for (int64_t w = 0; w < band; w++) {
                const int64_t row = i - band + 1 + w;
                o[h * n + P + w] = row >= 0 && kp[P + row] >= 0 ? buf[h * width + w] : -INFINITY;
            }
        if (k) {
            const float *sel = j->sel + r * k * d;
            const int64_t *ix = j->idx + r * k;
            transpose_rows(sel, d, k, d, selt, k16);
            band_dots(selt, k16, qt, H, d, j->scale, buf, width, k);
            for (int64_t h = 0; h < H; h++)
                for (int64_t m = 0; m < k; m++) o[h * n + P + band + m] = ix[m] >= 0 ? buf[h * width + m] : -INFINITY;
        }
        for (int64_t h = 0; h < H; h++) o[h * n + n - 1] = j->sink[h];
    }
    free(buf);
}

int dsv41_band_logits(const float *q, const int64_t *q_pos, const float *keys, const int64_t *key_pos, int64_t B,
                      int64_t c, int64_t H, int64_t d, int64_t L, int64_t P, int64_t i0, int64_t band,
                      int64_t window, const float *sel, const int64_t *idx, int64_t k, const float *sink, float scale,
                      float *out) {
    if (d > 256) return -3;
    /* the chunk's band columns: new rows i0 - band + 1 .. i0 + c - 1 (c + band - 1), read 16 at a time up to 16 past */
    const int64_t T = L - P, P16 = (P + 15) / 16 * 16, span16 = (c + band - 1 + 15) / 16 * 16 + 16;
    const int64_t ld = P16 + span16;
    float *kt = malloc((size_t)(B * d * ld) * sizeof(float));
    if (!kt) return -2;
    band_job job = {.q = q, .keys = keys, .sel = sel, .sink = sink, .q_pos = q_pos, .key_pos = key_pos, .idx = idx,
                    .B = B, .c = c, .H = H, .d = d, .L = L, .P = P, .i0 = i0, .band = band, .window = window, .k = k,
                    .n = P + band + k + 1, .T = T, .P16 = P16, .ld = ld, .span16 = span16, .scale = scale, .kt = kt,
                    .out = out};
    parallel_for(band_transpose, &job, B * (1 + span16 / 16));
    parallel_for(band_logits_item, &job, B * ((c + BAND_ITEM - 1) / BAND_ITEM));
    free(kt);
    return atomic_load(&job.status);
}

/* acc [H, d] (d = 16 v) = sum over rows l of probs[h * n + l] * row_l, in l order from 0 (rows: pointers, NULL for
 * a zero row). */
static inline void band_weighted(const float *probs, int64_t n, const float *const *rows, int64_t count, int64_t H,
                                 int64_t d, float *acc) {
#if defined(__AVX512F__)
    if (H == 4 && d == 64) {  /* the 16 accumulators in registers */
        __m512 a[16];
        for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
        for (int64_t l = 0; l < count; l++) {
            __m512 v[4];
            for (int e = 0; e < 4; e++) v[e] = rows[l] ? _mm512_loadu_ps(rows[l] + 16 * e) : _mm512_setzero_ps();
            for (int h = 0; h < 4; h++) {
                const __m512 pr = _mm512_set1_ps(probs[h * n + l]);
                for (int e = 0; e < 4; e++) a[h * 4 + e] = _mm512_fmadd_ps(pr, v[e], a[h * 4 + e]);
            }
        }
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(acc + 16 * i, a[i]);
        return;
    }
#endif
    for (int64_t h = 0; h < H; h++)
        for (int64_t e = 0; e < d; e++) {
            float a = 0.0f;
            for (int64_t l = 0; l < count; l++) a = fmaf(probs[h * n + l], rows[l] ? rows[l][e] : 0.0f, a);
            acc[h * d + e] = a;
        }
}

static void band_output_item(const void *job, int64_t item) {
    const band_job *j = job;
    const int64_t per = (j->c + BAND_ITEM - 1) / BAND_ITEM, b = item / per, t0 = item % per * BAND_ITEM;
    const int64_t t1 = t0 + BAND_ITEM < j->c ? t0 + BAND_ITEM : j->c;
    const int64_t H = j->H, d = j->d, n = j->n, P = j->P, band = j->band, k = j->k;
    const int64_t most = P > band ? (P > k ? P : k) : (band > k ? band : k);
    float *acc = malloc((size_t)(3 * H * d) * sizeof(float) + (size_t)most * sizeof(float *));
    if (!acc) {
        atomic_store(&((band_job *)j)->status, -2);
        return;
    }
    float *acc2 = acc + H * d, *acc3 = acc2 + H * d;
    const float **rows = (const float **)(acc3 + H * d);
    const float *keys = j->keys + b * j->L * d;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t r = b * j->c + t, i = j->i0 + t;
        const float *pr = j->probs + r * H * n;
        int any = 0;
        for (int64_t h = 0; h < H && !any; h++)
            for (int64_t s = 0; s < P; s++) any |= pr[h * n + s] != 0.0f;
        if (any || !j->prev_finite) {
            for (int64_t s = 0; s < P; s++) rows[s] = keys + s * d;
            band_weighted(pr, n, rows, P, H, d, acc);
        } else {  /* each fma(0, v, acc) of the chain from +0 leaves +0 for a finite v */
            memset(acc, 0, (size_t)(H * d) * sizeof(float));
        }
        for (int64_t w = 0; w < band; w++) {
            const int64_t row = i - band + 1 + w;
            rows[w] = row >= 0 ? keys + (P + row) * d : NULL;
        }
        band_weighted(pr + P, n, rows, band, H, d, acc2);
        float *o = j->out + r * H * d;
        for (int64_t e = 0; e < H * d; e++) o[e] = acc[e] + acc2[e];
        if (k) {
            for (int64_t m = 0; m < k; m++) rows[m] = j->sel + (r * k + m) * d;
            band_weighted(pr + P + band, n, rows, k, H, d, acc3);
            for (int64_t e = 0; e < H * d; e++) o[e] = o[e] + acc3[e];
        }
    }
    free(acc);
}

int dsv41_band_output(const float *probs, const float *keys, int64_t B, int64_t c, int64_t H, int64_t d, int64_t L,
                      int64_t P, int64_t i0, int64_t band, const float *sel, int64_t k, float *out) {
    int finite = 1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t e = 0; e < P * d; e++) finite &= isfinite(keys[b * L * d + e]) != 0;
    band_job job = {.keys = keys, .sel = sel, .probs = probs, .B = B, .c = c, .H = H, .d = d, .L = L, .P = P,
                    .i0 = i0, .band = band, .k = k, .n = P + band + k + 1, .T = L - P, .prev_finite = finite,
                    .out = out};
    parallel_for(band_output_item, &job, B * ((c + BAND_ITEM - 1) / BAND_ITEM));
    return atomic_load(&job.status);
}

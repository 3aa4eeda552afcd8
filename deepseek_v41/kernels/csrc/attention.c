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

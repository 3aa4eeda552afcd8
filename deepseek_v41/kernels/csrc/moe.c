/* The MoE router, the clamped SwiGLU and the routed and shared experts (model/moe.py). */
#include "dsv41.h"

/* ----------------------------------------------------------------------------------- MoE router, SwiGLU */

typedef struct {
    const void *x;
    int x_bf16, norm_topk;
    int64_t D, E, k;
    const float *Wf, *bias;
    float route_scale, *scratch;
    int64_t *indices;
    float *weights;
} gate_job;

static void gate_item(const void *job, int64_t n) {
    const gate_job *g = job;
    const int64_t D = g->D, E = g->E, k = g->k;
    const float *bias = g->bias;
    int64_t *indices = g->indices;
    float *weights = g->weights, *scratch = g->scratch + n * E;
    float x_row[ROW_ON_STACK];  /* a bf16 token widened (D <= ROW_ON_STACK then) */
    const float *xn = (const float *)g->x + n * D;
    if (g->x_bf16) {
        bf16_row((const uint16_t *)g->x + n * D, D, x_row);
        xn = x_row;
    }
    for (int64_t e = 0; e < E; e++) {
        float z = dot(xn, g->Wf + e * D, D);
        scratch[e] = sqrtf(z > 20.0f ? z : log1pf(expf(z)));
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= indices[n * k + i] == e;
            if (taken) continue;
            float v = scratch[e] + bias[e], top = best < 0 ? 0.0f : scratch[best] + bias[best];
            /* NaN ranks above every number, as in torch.topk: a corrupted router shows, not hides */
            if (best < 0 || (isnan(v) ? !isnan(top) : v > top)) best = e;
        }
        indices[n * k + j] = best;
        weights[n * k + j] = scratch[best];
        sum += scratch[best];
    }
    for (int64_t j = 0; j < k; j++) {
        float w = weights[n * k + j];
        if (g->norm_topk) w = w / (sum + 1e-20f);
        weights[n * k + j] = w * g->route_scale;
    }
}

/* MoE router (model/moe.py Gate, text tokens): scores = sqrt(softplus(x @ W^T)) [N, E] of x [N, D], W [E, D];
 * the k experts of largest score + bias[E] (descending, the lower id first on a tie) into indices [N, k], their
 * scores (divided by their sum + 1e-20 when norm_topk) times route_scale into weights [N, k]. x and W are fp32, or
 * bf16 bits (x_bf16 / w_bf16; widened exactly: a bf16 token on the stack, D <= ROW_ON_STACK then, a bf16 W once
 * per call on the heap). Tokens over the pool (a decode step's router ran alone on one core: issue 25).
 * scratch: N * E floats. Returns 0, or -2 (nothing computed) when memory for W cannot be had. */
int dsv41_gate(const void *x, int x_bf16, int64_t N, int64_t D, const void *W, int w_bf16, int64_t E,
               const float *bias, int64_t k, int norm_topk, float route_scale, float *scratch, int64_t *indices,
               float *weights) {
    float *wide = w_bf16 ? malloc((size_t)(E * D) * sizeof(float)) : NULL;  /* bf16 W widened once per call */
    if (w_bf16 && !wide) return -2;
    if (w_bf16) bf16_row((const uint16_t *)W, E * D, wide);
    gate_job job = {x, x_bf16, norm_topk, D, E, k, w_bf16 ? wide : (const float *)W, bias, route_scale, scratch,
                    indices, weights};
    parallel_for(gate_item, &job, N);
    free(wide);
    return 0;
}

/* silu(min(gate, limit)) * clamp(up, -limit, limit) (model/moe.py clamped_swiglu; limit <= 0: no clamping) of
 * rows gate / up [N, inter] read with row stride `stride` (a fused [N, 2 * inter] projection passes its halves)
 * into out [N, inter]. */
void dsv41_swiglu(const float *gate, const float *up, int64_t N, int64_t inter, int64_t stride, float limit,
                  float *out) {
    for (int64_t n = 0; n < N; n++) {
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= inter; i += 16) {  /* the same operations, 16 at a time (expf16: expf's bits) */
            __m512 g = _mm512_loadu_ps(gate + n * stride + i), u = _mm512_loadu_ps(up + n * stride + i);
            if (limit > 0) {
                __m512 lim = _mm512_set1_ps(limit);
                g = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, lim, _CMP_GT_OQ), g, lim);
                u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, _mm512_sub_ps(_mm512_setzero_ps(), lim), _CMP_LT_OQ),
                                         u, _mm512_sub_ps(_mm512_setzero_ps(), lim));
                u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, lim, _CMP_GT_OQ), u, lim);
            }
            __m512 t = expf16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN))));
            _mm512_storeu_ps(out + n * inter + i,
                             _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), t)), u));
        }
#endif
        for (; i < inter; i++) {
            float g = gate[n * stride + i], u = up[n * stride + i];
            if (limit > 0) {
                g = g > limit ? limit : g;
                u = u < -limit ? -limit : (u > limit ? limit : u);
            }
            out[n * inter + i] = g / (1.0f + expf(-g)) * u;
        }
    }
}
/* ----------------------------------------------------------------------------- routed and shared experts */

/* The experts of one dsv41_moe call (model/moe.py Expert: out += gain * w2 (silu(min(gate, limit)) *
 * clamp(up, +-limit)), gate rows w1 [inter, D], up rows w3 [inter, D], w2 [D, inter]), in two pool jobs: the
 * hidden rows of every expert (MOE_ITEM_ROWS of one expert's gate and up rows per item), then the output
 * (MOE_ITEM_ROWS output rows per item, every expert's w2 rows in expert order, so each output value gets its
 * experts' terms in the same order as one thread would add them). Expert i (ascending id; the shared expert, -1,
 * last) takes tokens[first[i] .. first[i + 1]) with router weights gain[...]; xs holds their rows [M, D] and
 * hidden their hidden rows [M, inter_i]. */
#define MOE_ITEM_ROWS 32

typedef struct {
    int64_t D, inter, s_inter, ldh, n;
    const int64_t *experts, *first, *tokens, *item_first;
    const float *gain, *xs;
    float *hidden, *out;
    wrows w13, w2;      /* the routed experts' [E * 2 * inter, D] (gate, then up rows per expert), [E * D, inter] */
    wrows s1, s3, s2;   /* the shared expert's [s_inter, D], [s_inter, D], [D, s_inter] */
    float limit;
} moe_job;

static int64_t moe_inter(const moe_job *j, int64_t i) { return j->experts[i] < 0 ? j->s_inter : j->inter; }

/* Expert i's gate / up / down matrices and the rows where its own start. */
static void moe_weights(const moe_job *j, int64_t i, const wrows **gate, int64_t *g0, const wrows **up, int64_t *u0,
                        const wrows **down, int64_t *d0) {
    int64_t e = j->experts[i];
    if (e < 0) {
        *gate = &j->s1, *up = &j->s3, *down = &j->s2, *g0 = *u0 = *d0 = 0;
        return;
    }
    *gate = *up = &j->w13, *down = &j->w2;
    *g0 = e * 2 * j->inter, *u0 = *g0 + j->inter, *d0 = e * j->D;
}

static void moe_hidden_item(const void *job, int64_t item) {
    const moe_job *j = job;
    int64_t i = 0;
    while (j->item_first[i + 1] <= item) i++;
    int64_t inter = moe_inter(j, i), r0 = (item - j->item_first[i]) * MOE_ITEM_ROWS;
    int64_t r1 = r0 + MOE_ITEM_ROWS < inter ? r0 + MOE_ITEM_ROWS : inter, t0 = j->first[i], n_e = j->first[i + 1] - t0;
    const wrows *gate_w, *up_w, *down_w;
    int64_t g0, u0, d0;
    moe_weights(j, i, &gate_w, &g0, &up_w, &u0, &down_w, &d0);
    const float *xs = j->xs + t0 * j->D;
    const int64_t ldh = j->ldh;
    float *hidden = j->hidden + t0 * ldh;
    float gate[16 * MOE_ITEM_ROWS], up[16 * MOE_ITEM_ROWS];  /* [token][row of the item] */
    for (int64_t n = 0; n < n_e; n += 16) {
        int64_t m = n_e - n < 16 ? n_e - n : 16;
        for (int64_t r = r0; r < r1; r += 4) {
            int64_t rows = r1 - r < 4 ? r1 - r : 4;
            dots_block(xs + n * j->D, j->D, m, gate_w, g0 + r, rows, gate + (r - r0), MOE_ITEM_ROWS);
            dots_block(xs + n * j->D, j->D, m, up_w, u0 + r, rows, up + (r - r0), MOE_ITEM_ROWS);
        }
        for (int64_t t = 0; t < m; t++)  /* the item's rows at once (swiglu's 16-wide path) */
            dsv41_swiglu(gate + t * MOE_ITEM_ROWS, up + t * MOE_ITEM_ROWS, 1, r1 - r0, MOE_ITEM_ROWS, j->limit,
                         hidden + (n + t) * ldh + r0);
    }
}

static void moe_out_item(const void *job, int64_t item) {
    const moe_job *j = job;
    int64_t d0 = item * MOE_ITEM_ROWS, d1 = d0 + MOE_ITEM_ROWS < j->D ? d0 + MOE_ITEM_ROWS : j->D;
    const int64_t ldh = j->ldh;
    float y[16 * 4];
    for (int64_t i = 0; i < j->n; i++) {
        int64_t t0 = j->first[i], n_e = j->first[i + 1] - t0;
        const wrows *gate_w, *up_w, *down_w;
        int64_t g0, u0, row0;
        moe_weights(j, i, &gate_w, &g0, &up_w, &u0, &down_w, &row0);
        for (int64_t d = d0; d < d1; d += 4) {
            int64_t rows = d1 - d < 4 ? d1 - d : 4;
            for (int64_t n = 0; n < n_e; n += 16) {
                int64_t m = n_e - n < 16 ? n_e - n : 16;
                dots_block(j->hidden + (t0 + n) * ldh, ldh, m, down_w, row0 + d, rows, y, 4);
                for (int64_t t = 0; t < m; t++) {
                    float *o = j->out + j->tokens[t0 + n + t] * j->D + d;
                    for (int64_t r = 0; r < rows; r++) o[r] += y[4 * t + r] * j->gain[t0 + n + t];
                }
            }
        }
    }
}

/* The routed experts of a few tokens (model/moe.py MoE.dispatch), plus the shared expert when s1 is given
 * (MoE.forward): x [N, D] fp32 or bf16 bits (x_bf16), indices / weights [N, k] (the router's); the routed experts'
 * w13 [E, 2 * inter, D] (gate rows, then up rows) and w2 [E, D, inter] as bf16 bits (kind W_BF16: the bf16
 * model's own, or copies of an fp32 model's that are exact in bf16) or as FP4 codes [.., D / 2] / [.., inter / 2]
 * with UE8M0 scales sc13 [E, 2 * inter, D / 32] / sc2 [E, D, inter / 32] (kind W_FP4: the checkpoint's format, a
 * quarter of bf16's bytes; D and inter multiples of 32); shared s1 / s3 [s_inter, D] and s2 [D, s_inter], fp32 or
 * bf16 bits (s_bf16).
 * out [N, D] (fp32, or bf16 bits rounded to nearest even from the fp32 result: out_bf16) = the sum over the picked
 * experts in ascending id of weight * expert(x), then + shared(x) (the order of MoE.forward), in fp32 throughout
 * (no bf16 rounding between the steps; the same values from either kind when they hold the same weights). Each
 * expert's weights are read once for all its tokens, split over the pool (moe_job). Returns 0, -1 (nothing
 * computed) when an index is outside [0, E), -2 when memory for the scratch cannot be had. */
int dsv41_moe(const void *x, int x_bf16, int64_t N, int64_t D, const int64_t *indices, const float *weights,
              int64_t k, int kind, const void *w13, const uint8_t *sc13, const void *w2, const uint8_t *sc2, int64_t E,
              int64_t inter, float limit, const void *s1, const void *s3, const void *s2, int s_bf16, int64_t s_inter,
              void *out, int out_bf16) {
    for (int64_t i = 0; i < N * k; i++)
        if (indices[i] < 0 || indices[i] >= E) return -1;
    int64_t M = N * k + (s1 ? N : 0), I = s1 && s_inter > inter ? s_inter : inter;
    int64_t *ints = malloc((size_t)(3 * (E + 2) + M) * sizeof(int64_t));
    float *floats = malloc((size_t)(M * (1 + D + I) + (x_bf16 ? N * D : 0) + (out_bf16 ? N * D : 0)) * sizeof(float));
    if (!ints || !floats) {
        free(ints);
        free(floats);
        return -2;
    }
    int64_t *experts = ints, *first = experts + E + 2, *item_first = first + E + 2, *tokens = item_first + E + 2;
    float *gain = floats, *xs = gain + M, *hidden = xs + M * D, *xf = hidden + M * I;
    float *sums = out_bf16 ? xf + (x_bf16 ? N * D : 0) : (float *)out;  /* fp32 sums, rounded into a bf16 out last */
    if (x_bf16) bf16_row((const uint16_t *)x, N * D, xf);
    const float *xr = x_bf16 ? xf : (const float *)x;
    int64_t n = 0, m = 0;
    first[0] = item_first[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t at = m;
        for (int64_t t = 0; t < N; t++)
            for (int64_t j = 0; j < k; j++)
                if (indices[t * k + j] == e) {
                    tokens[m] = t;
                    gain[m++] = weights[t * k + j];
                }
        if (m > at) {
            experts[n] = e;
            first[++n] = m;
        }
    }
    if (s1) {
        for (int64_t t = 0; t < N; t++) {
            tokens[m] = t;
            gain[m++] = 1.0f;
        }
        experts[n] = -1;
        first[++n] = m;
    }
    for (int64_t i = 0; i < m; i++) memcpy(xs + i * D, xr + tokens[i] * D, (size_t)D * sizeof(float));
    const int s_kind = s_bf16 ? W_BF16 : W_FP32;
    moe_job job = {D, inter, s1 ? s_inter : 0, I, n, experts, first, tokens, item_first, gain, xs, hidden, sums,
                   {w13, sc13, kind, D}, {w2, sc2, kind, inter}, {s1, 0, s_kind, D}, {s3, 0, s_kind, D},
                   {s2, 0, s_kind, s_inter}, limit};
    for (int64_t i = 0; i < n; i++)
        item_first[i + 1] = item_first[i] + (moe_inter(&job, i) + MOE_ITEM_ROWS - 1) / MOE_ITEM_ROWS;
    memset(sums, 0, (size_t)(N * D) * sizeof(float));
    parallel_for(moe_hidden_item, &job, item_first[n]);
    parallel_for(moe_out_item, &job, (D + MOE_ITEM_ROWS - 1) / MOE_ITEM_ROWS);
    if (out_bf16)
        for (int64_t i = 0; i < N * D; i++) ((uint16_t *)out)[i] = bf16_round(sums[i]);
    free(ints);
    free(floats);
    return 0;
}

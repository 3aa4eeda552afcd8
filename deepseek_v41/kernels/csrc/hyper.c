/* mHC, the manifold-constrained hyper-connections (model/hyper.py): mixing coefficients with Sinkhorn, collapse and
 * expand of the residual streams. */
#include "dsv41.h"

/* ---------------------------------------------------------------------------------------------------- mHC */

/* The dots of x [n] with 4 rows w [4, n] (rows ldw apart) into out [4]: each exactly dot(x, row, n) (the same
 * lanes adding in the same order), with x read once for the 4 rows and 16 independent sums in flight. */
static void dot4(const float *x, const float *w, int64_t ldw, int64_t n, float *out) {
    v8f a[4] = {{0}}, b[4] = {{0}}, c[4] = {{0}}, d[4] = {{0}};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        v8f x0 = load8(x + i), x1 = load8(x + i + 8), x2 = load8(x + i + 16), x3 = load8(x + i + 24);
        for (int r = 0; r < 4; r++) {
            const float *y = w + r * ldw + i;
            a[r] += x0 * load8(y);
            b[r] += x1 * load8(y + 8);
            c[r] += x2 * load8(y + 16);
            d[r] += x3 * load8(y + 24);
        }
    }
    for (; i + 8 <= n; i += 8)
        for (int r = 0; r < 4; r++) a[r] += load8(x + i) * load8(w + r * ldw + i);
    for (int r = 0; r < 4; r++) {
        float s = sum8((a[r] + b[r]) + (c[r] + d[r]));
        for (int64_t j = i; j < n; j++) s += x[j] * w[r * ldw + j];
        out[r] = s;
    }
}


/* mHC coefficients of one site (model/hyper.py hc_mix) from streams [N, hc, D] (fp32, or bf16 bits: bf16): mixing
 * logits rms_normalize(flat) @ fn^T [N, (2 + hc) * hc], scaled per part (pre | post | comb) and shifted by base; then
 * pre = sigmoid + hc_eps [N, hc], post = 2 sigmoid [N, hc], comb = Sinkhorn(softmax(rows) + hc_eps) [N, hc, hc].
 * scratch: N * hc * D floats when hc * D > ROW_ON_STACK (else unused, may be NULL). hc <= MAX_HC_MIX. */
#define MAX_HC_MIX 16
typedef struct {
    const void *streams;  /* fp32, or bf16 bits (bf16) */
    const float *fn, *base, *scale;
    int bf16;
    int64_t N, hc, D, iters;
    float norm_eps, hc_eps;
    float *scratch, *pre, *post, *comb;
} hc_mix_job;

static void hc_mix_finish(const hc_mix_job *p, int64_t n, float *mix);

static void hc_mix_item(const void *job, int64_t n) {
    const hc_mix_job *p = job;
    const int64_t hc = p->hc, width = hc * p->D, mixes = (2 + hc) * hc;
    const float *fn = p->fn;
    float mix[MAX_HC_MIX * (MAX_HC_MIX + 2)], row[ROW_ON_STACK];  /* the normalized row, on the stack when short */
    float *scratch = width <= ROW_ON_STACK ? row : p->scratch + n * width;
    const float *x = (const float *)p->streams + n * width;
    if (p->bf16) {  /* widened (exactly) in place of the row, then normalized there */
        bf16_row((const uint16_t *)p->streams + n * width, width, scratch);
        x = scratch;
    }
    const float f = rms_factor(x, width, p->norm_eps);
    for (int64_t i = 0; i < width; i++) scratch[i] = x[i] * f;
    int64_t k = 0;
    for (; k + 4 <= mixes; k += 4) dot4(scratch, fn + k * width, width, width, mix + k);
    for (; k < mixes; k++) mix[k] = dot(scratch, fn + k * width, width);
    hc_mix_finish(p, n, mix);
}

#if defined(__AVX512F__)
/* hc_mix_item for tokens 2 m and 2 m + 1 at once (hc_mix_pairs), with each block of 4 rows of fn loaded once for
 * both: dot4's sums, each 32 values as two 16-lane vectors ([a | b] and [c | d]: the same lanes adding in the same
 * order), then sum8((a + b) + (c + d)) as dot4 ends; the rows past a multiple of 4 by dot, as hc_mix_item. */
static void hc_mix_pair_item(const void *job, int64_t m) {
    const hc_mix_job *p = job;
    const int64_t hc = p->hc, width = hc * p->D, mixes = (2 + hc) * hc, n0 = 2 * m;
    const int64_t T = p->N - n0 < 2 ? p->N - n0 : 2;
    const float *fn = p->fn;
    float mix[2][MAX_HC_MIX * (MAX_HC_MIX + 2)], row[ROW_ON_STACK];  /* 2 * width <= ROW_ON_STACK (hc_mix_pairs) */
    const float *xs[2] = {row, row + width};
    for (int64_t t = 0; t < T; t++) {  /* each token's row normalized, as hc_mix_item does */
        float *r = row + t * width;
        const float *x = (const float *)p->streams + (n0 + t) * width;
        if (p->bf16) {
            bf16_row((const uint16_t *)p->streams + (n0 + t) * width, width, r);
            x = r;
        }
        const float f = rms_factor(x, width, p->norm_eps);
        for (int64_t i = 0; i < width; i++) r[i] = x[i] * f;
    }
    if (T == 1) xs[1] = xs[0];
    int64_t k = 0;
    for (; k + 4 <= mixes; k += 4) {
        __m512 lo[2][4], hi[2][4];
        for (int t = 0; t < 2; t++)
            for (int r = 0; r < 4; r++) lo[t][r] = hi[t][r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < width; i += 32) {
            __m512 x0[2], x1[2];
            for (int t = 0; t < 2; t++) {
                x0[t] = _mm512_loadu_ps(xs[t] + i), x1[t] = _mm512_loadu_ps(xs[t] + i + 16);
                __asm__("" : "+v"(x0[t]), "+v"(x1[t]));  /* in registers for the 4 rows */
            }
            for (int r = 0; r < 4; r++) {
                const float *w = fn + (k + r) * width + i;
                __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
                for (int t = 0; t < 2; t++) {
                    lo[t][r] = _mm512_add_ps(lo[t][r], _mm512_mul_ps(x0[t], w0));
                    hi[t][r] = _mm512_add_ps(hi[t][r], _mm512_mul_ps(x1[t], w1));
                }
            }
        }
        for (int t = 0; t < 2; t++)
            for (int r = 0; r < 4; r++) {
                __m256 ab = _mm256_add_ps(_mm512_castps512_ps256(lo[t][r]),
                                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lo[t][r]), 1)));
                __m256 cd = _mm256_add_ps(_mm512_castps512_ps256(hi[t][r]),
                                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(hi[t][r]), 1)));
                v8f v;
                __m256 sum = _mm256_add_ps(ab, cd);
                memcpy(&v, &sum, sizeof v);
                mix[t][k + r] = sum8(v);
            }
    }
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = k; j < mixes; j++) mix[t][j] = dot(xs[t], fn + j * width, width);
        hc_mix_finish(p, n0 + t, mix[t]);
    }
}
#endif

/* Whether hc_mix_pair_item takes the tokens two at a time: two normalized rows on its stack, whole 32s. */
static int hc_mix_pairs(const hc_mix_job *p) {
#if defined(__AVX512F__)
    return 2 * p->hc * p->D <= ROW_ON_STACK && (p->hc * p->D) % 32 == 0;
#else
    (void)p;
    return 0;
#endif
}

/* The rest of one token's coefficients from its mixing logits mix [(2 + hc) * hc]. */
static void hc_mix_finish(const hc_mix_job *p, int64_t n, float *mix) {
    const int64_t hc = p->hc, mixes = (2 + hc) * hc;
    const float *base = p->base, *scale = p->scale;
    float *pre = p->pre, *post = p->post, *comb = p->comb;
    const float hc_eps = p->hc_eps;
    int64_t k;
    for (k = 0; k < mixes; k++) mix[k] = mix[k] * scale[k < hc ? 0 : (k < 2 * hc ? 1 : 2)] + base[k];
    for (int64_t i = 0; i < hc; i++) {
        pre[n * hc + i] = 1.0f / (1.0f + expf(-mix[i])) + hc_eps;
        post[n * hc + i] = 2.0f * (1.0f / (1.0f + expf(-mix[hc + i])));
    }
    float *c = comb + n * hc * hc;
    for (int64_t i = 0; i < hc; i++) {
        const float *logits = mix + 2 * hc + i * hc;
        float m = logits[0], s = 0.0f;
        for (int64_t j = 1; j < hc; j++) m = logits[j] > m ? logits[j] : m;
        for (int64_t j = 0; j < hc; j++) s += (c[i * hc + j] = expf(logits[j] - m));
        for (int64_t j = 0; j < hc; j++) c[i * hc + j] = c[i * hc + j] / s + hc_eps;
    }
}

/* Sinkhorn's iterations on the comb of tokens 16 * g .. 16 * g + 15 at once, token t in lane t (model/hyper.py
 * sinkhorn): columns first, then rows and columns, iters times in all; per token the same sums and divisions in
 * the same order as one matrix at a time, so the same bits. */
static void hc_sinkhorn_item(const void *job, int64_t g) {
    const hc_mix_job *p = job;
    const int64_t hc = p->hc, hh = hc * hc, t0 = 16 * g, lanes = p->N - t0 < 16 ? p->N - t0 : 16;
    float *comb = p->comb + t0 * hh;
    v16f c[MAX_HC_MIX * MAX_HC_MIX];
    float lane[16];
    for (int64_t e = 0; e < hh; e++) {
        for (int64_t t = 0; t < 16; t++) lane[t] = t < lanes ? comb[t * hh + e] : 1.0f;
        c[e] = load16(lane);
    }
    v16f eps = {0};
    eps += p->hc_eps;
    for (int64_t it = 0; it < 2 * p->iters - 1; it++) {
        int cols = it % 2 == 0;
        for (int64_t i = 0; i < hc; i++) {
            v16f s = {0};
            for (int64_t j = 0; j < hc; j++) s += cols ? c[j * hc + i] : c[i * hc + j];
            s += eps;
            for (int64_t j = 0; j < hc; j++) {
                if (cols) c[j * hc + i] /= s;
                else c[i * hc + j] /= s;
            }
        }
    }
    for (int64_t e = 0; e < hh; e++) {
        memcpy(lane, &c[e], sizeof lane);
        for (int64_t t = 0; t < lanes; t++) comb[t * hh + e] = lane[t];
    }
}

/* Tokens over the pool, then Sinkhorn 16 tokens per item (one item inline for up to 16 tokens). */
void dsv41_hc_mix(const void *streams, int bf16, int64_t N, int64_t hc, int64_t D, const float *fn,
                  const float *base, const float *scale, float norm_eps, float hc_eps, int64_t iters, float *scratch,
                  float *pre, float *post, float *comb) {
    hc_mix_job job = {streams, fn, base, scale, bf16, N, hc, D, iters, norm_eps, hc_eps, scratch, pre, post, comb};
#if defined(__AVX512F__)
    if (hc_mix_pairs(&job))
        parallel_for(hc_mix_pair_item, &job, (N + 1) / 2);
    else
#endif
        parallel_for(hc_mix_item, &job, N);
    if (N <= 16)
        hc_sinkhorn_item(&job, 0);
    else
        parallel_for(hc_sinkhorn_item, &job, (N + 15) / 16);
}

#define HC_POOL_ROWS 64  /* from this many tokens collapse / expand split them over the pool */

/* Collapse sum_i w_i R_i of streams [N, hc, D] with weights [N, hc], then RMSNorm (weight [D], eps) when
 * norm_weight is given: out [N, D] (model/hyper.py collapse + the sub-layer's input norm). streams, norm_weight and
 * out are fp32, or bf16 bits (bf16; out rounded to nearest even, as casting the fp32 result would; D <=
 * ROW_ON_STACK): the same arithmetic in fp32 either way. Many tokens go over the pool. */
typedef struct {
    const void *streams, *norm_weight, *y;
    const float *w, *post, *comb;
    int bf16;
    int64_t hc, D;
    float eps;
    void *out;
} hc_job;

static void hc_collapse_item(const void *job, int64_t n) {
    const hc_job *j = job;
    const int64_t hc = j->hc, D = j->D;
    const int bf16 = j->bf16;
    const float *w = j->w + n * hc;
    const void *x = bf16 ? (const void *)((const uint16_t *)j->streams + n * hc * D)
                         : (const void *)((const float *)j->streams + n * hc * D);
    float row[ROW_ON_STACK], *o = bf16 ? row : (float *)j->out + n * D;
    for (int64_t k = 0; k < D; k++) o[k] = w[0] * load_at(x, bf16, k);
    for (int64_t i = 1; i < hc; i++) {
        float wi = w[i];
        for (int64_t k = 0; k < D; k++) o[k] += wi * load_at(x, bf16, i * D + k);
    }
    if (j->norm_weight) {
        float f = rms_factor(o, D, j->eps);
        for (int64_t k = 0; k < D; k++) o[k] = (o[k] * f) * load_at(j->norm_weight, bf16, k);
    }
    if (bf16)
        for (int64_t k = 0; k < D; k++) store_out(j->out, n * D + k, o[k], 1);
}

void dsv41_hc_collapse(const void *streams, int bf16, const float *w, int64_t N, int64_t hc, int64_t D,
                       const void *norm_weight, float eps, void *out) {
    hc_job job = {streams, norm_weight, 0, w, 0, 0, bf16, hc, D, eps, out};
    if (N < HC_POOL_ROWS)  /* a few tokens' work is less than waking the pool */
        for (int64_t n = 0; n < N; n++) hc_collapse_item(&job, n);
    else
        parallel_for(hc_collapse_item, &job, N);
}

/* Expand R'_j = post_j y + sum_i comb[i, j] R_i: streams [N, hc, D], y [N, D], post [N, hc], comb [N, hc, hc]
 * -> out [N, hc, D] (model/hyper.py expand); streams, y and out fp32, or bf16 bits (bf16, as for collapse). Many
 * tokens go over the pool. */
static void hc_expand_item(const void *job, int64_t n) {
    const hc_job *e = job;
    const int64_t hc = e->hc, D = e->D;
    const int bf16 = e->bf16;
    const float *c = e->comb + n * hc * hc;
    const void *x = bf16 ? (const void *)((const uint16_t *)e->streams + n * hc * D)
                         : (const void *)((const float *)e->streams + n * hc * D);
    const void *yn = bf16 ? (const void *)((const uint16_t *)e->y + n * D)
                          : (const void *)((const float *)e->y + n * D);
    float row[ROW_ON_STACK];
    for (int64_t j = 0; j < hc; j++) {
        float *o = bf16 ? row : (float *)e->out + (n * hc + j) * D;
        for (int64_t k = 0; k < D; k++) o[k] = c[j] * load_at(x, bf16, k);
        for (int64_t i = 1; i < hc; i++) {
            float cij = c[i * hc + j];
            for (int64_t k = 0; k < D; k++) o[k] += cij * load_at(x, bf16, i * D + k);
        }
        float p = e->post[n * hc + j];
        for (int64_t k = 0; k < D; k++) o[k] = p * load_at(yn, bf16, k) + o[k];
        if (bf16)
            for (int64_t k = 0; k < D; k++) store_out(e->out, (n * hc + j) * D + k, o[k], 1);
    }
}

void dsv41_hc_expand(const void *streams, int bf16, const void *y, const float *post, const float *comb, int64_t N,
                     int64_t hc, int64_t D, void *out) {
    hc_job job = {streams, 0, y, 0, post, comb, bf16, hc, D, 0.0f, out};
    if (N < HC_POOL_ROWS)
        for (int64_t n = 0; n < N; n++) hc_expand_item(&job, n);
    else
        parallel_for(hc_expand_item, &job, N);
}

/* The dense projections of a few tokens (GEMV): fp32, bf16 or FP4 weight rows, each read once for all tokens. */
#include "dsv41.h"

/* ------------------------------------------------------------------------------- dense projections (GEMV) */

/* The dots of T tokens x [T, K] (rows ldx apart) with 4 weight rows w[0..3] [K] (scales s[0..3] for FP4) of one
 * kind: out [T][rows] (rows ldo apart; the first `rows` <= 4 of each token's 4 dots, written straight from the
 * registers when all 4 are wanted). One 16-lane accumulator per (token, row), then summed by sum16, then the remaining products
 * one by one. fp32 weights: lane j adds the products i + j, 16 at a time, the last K % 16 one by one. bf16 and FP4
 * weights: 32 at a time, lane j adding the product of weight i + 2j then that of i + 2j + 1 (weight_pairs: half
 * the decoding steps of 16 at a time), the last K % 32 one by one; bf16 and FP4 rows holding the same values give
 * the same bits. Every dot is the same sequence of operations whatever T is and whichever other rows or tokens
 * share the call (a token's projection does not depend on the batch). Each block of weights is loaded (and
 * widened or decoded) once for the T tokens, each token's values once for the 4 rows; the rows `ahead` bytes on
 * are prefetched (prefetch_rows). Inlined with constant T and kind (dots_block), so the
 * accumulators live in registers; with AVX-512 the fp32 kind holds the 4 rows' weights and each token's values in
 * registers (GCC otherwise folded them into the multiplies as memory operands: 23 loads per 16 products instead
 * of 8, the loop bound by loads) and sums 4 tokens' 16 dots at once (sum16_by16). */
/* Prefetch hints for the weights `ahead` bytes on (the next block of rows) into L1, and PREFETCH_FAR times as far
 * on into L2. Hints into L1 alone (prefetcht0) filled its few miss buffers with reads from DRAM, so at 8 tokens the
 * loads of the next rows waited for the dots of these; hints into L2 alone left each row's first load waiting on
 * L2 at 1 token. The fp32 LM head of bench-8m (8.4 MB) read from DRAM on one core: 1.1 ms -> 0.57 ms at 8 tokens,
 * 0.73 -> 0.40 ms at 1 (bf16: 0.50 -> 0.22 ms at 1); issue 25. */
#define PREFETCH_FAR 8
static inline __attribute__((always_inline)) void prefetch_rows(const char *at, int64_t ahead) {
    __builtin_prefetch(at + ahead, 0, 3);
    __builtin_prefetch(at + PREFETCH_FAR * ahead, 0, 1);
}


/* The dots [T][4] (res, 4 per token) into out [T][rows] (rows ldo apart): the first `rows` of each token's 4. */
static inline __attribute__((always_inline)) void dots_out(const float *res, const int T, float *out, int64_t ldo,
                                                           int64_t rows) {
    if (rows == 4)
        for (int t = 0; t < T; t++) memcpy(out + t * ldo, res + 4 * t, 4 * sizeof(float));
    else
        for (int t = 0; t < T; t++)
            for (int64_t r = 0; r < rows; r++) out[t * ldo + r] = res[4 * t + r];
}

static inline __attribute__((always_inline)) void dots_body(const float *x, int64_t ldx, const int T,
                                                            const void *const *w, const uint8_t *const *s,
                                                            const int kind, int64_t K, int64_t ahead, float *out,
                                                            int64_t ldo, int64_t rows) {
    float res[16];
    int64_t i = 0;
#if defined(__AVX512F__)
    if (kind == W_FP32) {  /* the same operations, with the 4 rows' weights held in registers for the T tokens */
        __m512 a[4][4];
        for (int t = 0; t < 4; t++)
            for (int r = 0; r < 4; r++) a[t][r] = _mm512_setzero_ps();
        for (; i + 16 <= K; i += 16) {
            __m512 wv[4];
            for (int r = 0; r < 4; r++) {
                wv[r] = _mm512_loadu_ps((const float *)w[r] + i);
                __asm__("" : "+v"(wv[r]));  /* in a register: GCC would reload it from memory for every token */
                prefetch_rows((const char *)w[r] + i * 4, ahead);
            }
            for (int t = 0; t < T; t++) {
                __m512 xt = _mm512_loadu_ps(x + t * ldx + i);
                __asm__("" : "+v"(xt));  /* one load per token, not one per row */
                for (int r = 0; r < 4; r++) a[t][r] = _mm512_add_ps(a[t][r], _mm512_mul_ps(xt, wv[r]));
            }
        }
        if (T == 4 && K % 16 == 0) {  /* straight from the register into out (no store and reload of res) */
            __m512 v = sum16_by16(a);
            if (rows == 4) {
                _mm_storeu_ps(out, _mm512_castps512_ps128(v));
                _mm_storeu_ps(out + ldo, _mm512_extractf32x4_ps(v, 1));
                _mm_storeu_ps(out + 2 * ldo, _mm512_extractf32x4_ps(v, 2));
                _mm_storeu_ps(out + 3 * ldo, _mm512_extractf32x4_ps(v, 3));
                return;
            }
            _mm512_storeu_ps(res, v);
        } else if (T == 4) {
            _mm512_storeu_ps(res, sum16_by16(a));
        } else {
            for (int t = 0; t < T; t++)
                for (int r = 0; r < 4; r++) {
                    v16f v;
                    memcpy(&v, &a[t][r], sizeof v);
                    res[4 * t + r] = sum16(v);
                }
        }
        for (; i < K; i++)
            for (int t = 0; t < T; t++)
                for (int r = 0; r < 4; r++) res[4 * t + r] += x[t * ldx + i] * ((const float *)w[r])[i];
        dots_out(res, T, out, ldo, rows);
        return;
    }
#endif
    v16f acc[4][4];
    for (int t = 0; t < T; t++)  /* (a memset of all 16 was a library call per dots call, 3 % of a decode step) */
        for (int r = 0; r < 4; r++) acc[t][r] = (v16f){0};
    if (kind == W_FP32) {
        for (; i + 16 <= K; i += 16) {
            v16f w0 = load16((const float *)w[0] + i), w1 = load16((const float *)w[1] + i),
                 w2 = load16((const float *)w[2] + i), w3 = load16((const float *)w[3] + i);
            for (int r = 0; r < 4; r++) prefetch_rows((const char *)w[r] + i * 4, ahead);
            for (int t = 0; t < T; t++) {
                v16f xt = load16(x + t * ldx + i);
                acc[t][0] += xt * w0;
                acc[t][1] += xt * w1;
                acc[t][2] += xt * w2;
                acc[t][3] += xt * w3;
            }
        }
    } else {
        for (; i + 32 <= K; i += 32) {
            v16f we[4], wo[4];
            for (int r = 0; r < 4; r++) {
                weight_pairs(w[r], s[r], kind, i, &we[r], &wo[r]);
                prefetch_rows((const char *)w[r] + (kind == W_BF16 ? i * 2 : i / 2), ahead);
            }
            for (int t = 0; t < T; t++) {
                v16f xe, xo;
                x_pairs(x + t * ldx + i, &xe, &xo);
                for (int r = 0; r < 4; r++) acc[t][r] = acc[t][r] + xe * we[r] + xo * wo[r];
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < 4; r++) res[4 * t + r] = sum16(acc[t][r]);
    for (; i < K; i++)
        for (int t = 0; t < T; t++)
            for (int r = 0; r < 4; r++) res[4 * t + r] += x[t * ldx + i] * weight1(w[r], s[r], kind, i);
    dots_out(res, T, out, ldo, rows);
}

#define DOTS(T, KIND) \
    static void dots_##T##_##KIND(const float *x, int64_t ldx, const void *const *w, const uint8_t *const *s, \
                                  int64_t K, int64_t ahead, float *out, int64_t ldo, int64_t rows) {      \
        dots_body(x, ldx, T, w, s, KIND, K, ahead, out, ldo, rows);                                        \
    }
DOTS(1, 0) DOTS(2, 0) DOTS(3, 0) DOTS(4, 0) DOTS(1, 1) DOTS(2, 1) DOTS(3, 1) DOTS(4, 1)
DOTS(1, 2) DOTS(2, 2) DOTS(3, 2) DOTS(4, 2)
#undef DOTS

typedef void (*dots_fn)(const float *, int64_t, const void *const *, const uint8_t *const *, int64_t, int64_t,
                        float *, int64_t, int64_t);
static const dots_fn DOTS_BY[3][5] = {{NULL, dots_1_0, dots_2_0, dots_3_0, dots_4_0},
                                      {NULL, dots_1_1, dots_2_1, dots_3_1, dots_4_1},
                                      {NULL, dots_1_2, dots_2_2, dots_3_2, dots_4_2}};

/* res [N][rows] = the dots of N tokens x [N, K] (rows ldx apart) with rows row .. row + rows - 1 of m, for rows
 * <= 4 (a short block repeats its last row, whose extra results are dropped): blocks of up to 4 tokens. res rows
 * are ldr apart. The next block of rows is prefetched, by every block of tokens (so at 8 tokens the second block's
 * dots give the prefetches of the first time to land). */
void dots_block(const float *x, int64_t ldx, int64_t N, const wrows *m, int64_t row, int64_t rows, float *res,
                int64_t ldr) {
    const void *rp[4];
    const uint8_t *sp[4];
    for (int r = 0; r < 4; r++) {
        rp[r] = wrow(m, row + (r < rows ? r : rows - 1));
        sp[r] = srow(m, row + (r < rows ? r : rows - 1));
    }
    const int64_t block_bytes = (const char *)wrow(m, row + 4) - (const char *)wrow(m, row);
    if (m->kind == W_FP4)  /* the next blocks' scale bytes (a row's first load of them waited on memory) */
        prefetch_rows((const char *)sp[0], (const char *)srow(m, row + 4) - (const char *)srow(m, row));
    for (int64_t n = 0; n < N; n += 4) {
        int64_t T = N - n < 4 ? N - n : 4;
        DOTS_BY[m->kind][T](x + n * ldx, ldx, rp, sp, m->K, block_bytes, res + n * ldr, ldr, rows);
    }
}

/* A GEMV job: out [N, G * O] = x [N, G * K] @ W [G * O, K]^T by groups (see linear_into), GEMV_ITEM_ROWS weight
 * rows of one group per item. */
#define GEMV_ITEM_ROWS 32
#define GEMV_SPLIT_BYTES 32768  /* from this many bytes of weights a projection is split over the pool */

typedef struct {
    const float *x;
    int64_t N, G, K, O;
    const void *W;
    int w_bf16, out_bf16;
    void *out;
} gemv_job;

static void gemv_item(const void *job, int64_t item) {
    const gemv_job *j = job;
    int64_t per_group = (j->O + GEMV_ITEM_ROWS - 1) / GEMV_ITEM_ROWS, g = item / per_group;
    int64_t o0 = (item % per_group) * GEMV_ITEM_ROWS, o1 = o0 + GEMV_ITEM_ROWS < j->O ? o0 + GEMV_ITEM_ROWS : j->O;
    const int64_t ldx = j->G * j->K, ldo = j->G * j->O;
    const wrows m = {j->W, 0, j->w_bf16 ? W_BF16 : W_FP32, j->K};
    float res[16 * 4];
    for (int64_t o = o0; o < o1; o += 4) {
        int64_t rows = o1 - o < 4 ? o1 - o : 4;
        if (!j->out_bf16) {  /* fp32 out: the dots straight into it */
            dots_block(j->x + g * j->K, ldx, j->N, &m, g * j->O + o, rows, (float *)j->out + g * j->O + o, ldo);
            continue;
        }
        for (int64_t n = 0; n < j->N; n += 16) {
            int64_t t_n = j->N - n < 16 ? j->N - n : 16;
            dots_block(j->x + n * ldx + g * j->K, ldx, t_n, &m, g * j->O + o, rows, res, 4);
            for (int64_t t = 0; t < t_n; t++)
                for (int64_t r = 0; r < rows; r++)
                    store_out(j->out, (n + t) * ldo + g * j->O + o + r, res[4 * t + r], j->out_bf16);
        }
    }
}

/* out [N, G * O] = x [N, G * K] @ W [G * O, K]^T by groups: out[n, g * O + o] = x[n, g * K : (g + 1) * K] . W[g * O
 * + o] (torch.nn.functional.linear without bias when G = 1; the grouped low-rank output projection of
 * model/attention.py GroupedLinear otherwise) for a few tokens, summed in fp32 (dots_body). x is fp32 or bf16 bits
 * (x_bf16), W fp32 or bf16 bits (w_bf16), out fp32 or bf16 bits rounded to nearest even (out_bf16). Each block of
 * 4 weight rows is read once for all N tokens; large weights are split over the pool. scratch: N * G * K floats
 * when x is bf16. */
void linear_into(const void *x, int x_bf16, int64_t N, int64_t G, int64_t K, const void *W, int w_bf16, int64_t O,
                 void *out, int out_bf16, float *scratch) {
    const float *xf = (const float *)x;
    if (x_bf16) {
        bf16_row((const uint16_t *)x, N * G * K, scratch);
        xf = scratch;
    }
    if (O <= 0) return;
    gemv_job job = {xf, N, G, K, O, W, w_bf16, out_bf16, out};
    int64_t items = G * ((O + GEMV_ITEM_ROWS - 1) / GEMV_ITEM_ROWS);
    size_t bytes = (size_t)(G * O * K) * (w_bf16 ? 2 : 4);
    if (bytes >= GEMV_SPLIT_BYTES)
        parallel_for(gemv_item, &job, items);
    else
        for (int64_t i = 0; i < items; i++) gemv_item(&job, i);
}

/* linear_into with out in x's dtype and its scratch from the heap. Returns 0, or -1 (nothing computed) when the
 * scratch cannot be allocated. */
int dsv41_linear(const void *x, int x_bf16, int64_t N, int64_t G, int64_t K, const void *W, int w_bf16, int64_t O,
                 void *out) {
    size_t floats = (size_t)(x_bf16 ? N * G * K : 0);
    float *scratch = floats ? malloc(floats * sizeof(float)) : NULL;
    if (floats && !scratch) return -1;
    linear_into(x, x_bf16, N, G, K, W, w_bf16, O, out, x_bf16, scratch);
    free(scratch);
    return 0;
}

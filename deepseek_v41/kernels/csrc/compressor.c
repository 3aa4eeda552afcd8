/* The compressed entries and index keys of a few tokens (model/compressor.py, model/attention.py
 * Attention.compress; MODEL_REFERENCE.md §3.8, §3.9). */
#include "dsv41.h"

/* ------------------------------------------------------------------- compressed entries of a few tokens */

/* The compressed latent of ratio-2 row b (model/compressor.py, MODEL_REFERENCE.md §3.8): its sequence aligned to
 * pairs, [pending token if its start is odd] + its T tokens, slot k holding token min(k + 1 - odd, T) of
 * [pending, kv[b, 0], ..., kv[b, T - 1]] (so a last, unpaired token pairs with itself); pair j mixes its two slots
 * by a per-channel softmax of their scores: latent[j] = kv0 * p0 + kv1 * p1 (fp32, rounded to bf16 when the model
 * is bf16), for j < G. group[j]: the pair's absolute index (start - odd) / 2 + j when the row completes it, else -1.
 * new_pending [2, d]: (kv, score) of the last token when it opens a pair, else zeros. kv / score: the row's [T, d]
 * projections (fp32); pending kv / score: [d] fp32, or NULL (zeros). */
static void compress_pairs(const float *kv, const float *score, int64_t T, int64_t d, int64_t start,
                           const float *pending_kv, const float *pending_score, int64_t G, void *latent, int bf16,
                           int64_t *group, float *new_pending) {
    const int64_t odd = start & 1, complete = (odd + T) / 2;  /* start & 1: Python's start % 2, negatives too */
    for (int64_t j = 0; j < G; j++) {
        const float *k2[2], *s2[2];
        for (int64_t h = 0; h < 2; h++) {
            int64_t slot = 2 * j + h + 1 - odd < T ? 2 * j + h + 1 - odd : T;
            k2[h] = slot ? kv + (slot - 1) * d : pending_kv;
            s2[h] = slot ? score + (slot - 1) * d : pending_score;
        }
        for (int64_t c = 0; c < d; c++) {
            float a = k2[0] ? k2[0][c] : 0.0f, b = k2[1] ? k2[1][c] : 0.0f;
            float sa = s2[0] ? s2[0][c] : 0.0f, sb = s2[1] ? s2[1][c] : 0.0f;
            float m = sa > sb ? sa : sb, ea = expf(sa - m), eb = expf(sb - m), sum = ea + eb;
            store_out(latent, j * d + c, a * (ea / sum) + b * (eb / sum), bf16);  /* torch.softmax divides */
        }
        group[j] = j < complete ? (start - odd) / 2 + j : -1;
    }
    int open = (odd + T) % 2 == 1;  /* the last token opens a pair */
    for (int64_t c = 0; c < d; c++) {
        new_pending[c] = open ? kv[(T - 1) * d + c] : 0.0f;
        new_pending[d + c] = open ? score[(T - 1) * d + c] : 0.0f;
    }
}

/* Attention.compress of model/attention.py for a few tokens x [B, T, D] at positions [B, T] (each row
 * consecutive), one call instead of ~40 tensor ops: the compressor's latent [B, G, d] (ratio 1: G = T, norm(wkv
 * x); ratio 2: G = (T + 1) / 2, the pairs of compress_pairs with kv = x wkv^T and score = x wgate^T in fp32, then
 * norm), groups [B, G] (ratio 2 only; ratio 1's are the positions) and the new pending pairs [B, 2, d] (ratio 2).
 * With entries (cos_ not NULL), also the entries rope(latent) [B, G, d] and index keys rope(k_norm(wk latent)) [B,
 * G, di] at the entry positions max(group, 0) * ratio (RoPE on the last r dims). Phases fp32 [B, L, r]: ratio 1,
 * L = T, at the tokens' positions; ratio 2, L = T + 1, at positions start - 1 .. start + T - 1 of each row, which
 * hold every complete pair's position; position 0 (an incomplete pair, or a position below 0 clamped) rotates by
 * cos 1 and sin -0 / +0, rope.py's phases there. x, the weights, latent and entries / keys are all fp32 or all
 * bf16 bits (bf16: rounded where the torch code rounds: the same bits wherever its projections run in this
 * library's GEMV); pending (kv, score rows pending_stride apart, or NULL: zeros) and new_pending are fp32.
 * Returns 0, or -1 when scratch cannot be had. */
int dsv41_compress(const void *x, int bf16, int64_t B, int64_t T, int64_t D, const int64_t *positions,
                   int64_t ratio, const void *wkv, const void *wgate, int64_t d, const void *norm, float eps,
                   const float *pending_kv, const float *pending_score, int64_t pending_stride, const float *cos_,
                   const float *sin_, int64_t r, const void *wk, int64_t di, const void *k_norm, float k_eps,
                   void *latent, int64_t *group, float *new_pending, void *entries, void *keys) {
    const int64_t N = B * T, G = ratio == 2 ? (T + 1) / 2 : T, E = B * G, widest = d > di ? d : di;
    const int64_t wide = N * D > E * d ? N * D : E * d;  /* linear_into's scratch: x, then the latent, widened */
    const int64_t proj = ratio == 2 ? 2 * N * d : 0;     /* kv and score, fp32 */
    const int64_t phase = cos_ ? 2 * E * r : 0;          /* each entry's cos and sin rows */
    float *scratch = malloc((size_t)(wide + proj + widest + phase) * sizeof(float));
    if (!scratch) return -1;
    float *kv = scratch + wide, *score = kv + N * d, *row = kv + proj, *ec = row + widest, *es = ec + E * r;
    const size_t size = bf16 ? 2 : 4;
    if (ratio == 1) {
        linear_into(x, bf16, N, 1, D, wkv, bf16, d, latent, bf16, scratch);
    } else {
        linear_into(x, bf16, N, 1, D, wkv, bf16, d, kv, 0, scratch);
        linear_into(x, bf16, N, 1, D, wgate, bf16, d, score, 0, scratch);
        for (int64_t b = 0; b < B; b++)
            compress_pairs(kv + b * T * d, score + b * T * d, T, d, positions[b * T],
                           pending_kv ? pending_kv + b * pending_stride : NULL,
                           pending_score ? pending_score + b * pending_stride : NULL, G,
                           (char *)latent + (size_t)(b * G * d) * size, bf16, group + b * G, new_pending + b * 2 * d);
    }
    norm_rows(latent, bf16, E, d, norm, eps, row);
    if (cos_) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < G; j++) {
                int64_t e = b * G + j, at = -1;  /* the phase row of the entry's position; -1: position 0 */
                if (ratio == 1 && positions[e] > 0)
                    at = e;
                else if (ratio == 2 && group[e] > 0)
                    at = b * (T + 1) + 2 * group[e] - (positions[b * T] - 1);
                for (int64_t i = 0; i < r; i++) {
                    ec[e * r + i] = at < 0 ? 1.0f : cos_[at * r + i];
                    es[e * r + i] = at < 0 ? (i % 2 ? 0.0f : -0.0f) : sin_[at * r + i];
                }
            }
        rope_rows(latent, bf16, ec, es, E, 1, d, r, 1, entries);
        linear_into(latent, bf16, E, 1, d, wk, bf16, di, keys, bf16, scratch);
        norm_rows(keys, bf16, E, di, k_norm, k_eps, row);
        rope_rows(keys, bf16, ec, es, E, 1, di, r, 1, keys);
    }
    free(scratch);
    return 0;
}

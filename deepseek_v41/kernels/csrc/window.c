/* The SWA window ring of FP8 rows (cache/paged_context.py PagedContext.window): read, quantize, write. */
#include "dsv41.h"

/* ------------------------------------------------------------------------------------- SWA window ring */

/* One layer's window step (cache/paged_context.py PagedContext.window) for rows slots [B]:
 * rings codes [S, L, R, d], scales [S, L, R, d / 32], pos [S, L, R] (int32, -1 = empty); new rows kv [B, T, d]
 * at positions [B, T]. Writes keys [B, R + T, d] (the R ring rows decoded, then the new rows' FP8 values) and
 * key_pos [B, R + T] (ring rows at or past the row's first new position read -1), then stores the last
 * min(T, R) new rows in the ring at position % R: after reading, as a long chunk may wrap over rows it read. */
typedef struct {
    uint8_t *ring_codes, *ring_scales;
    int32_t *ring_pos;
    int64_t L, layer, R, d, T;
    const int64_t *slots, *positions;
    const float *kv;
    uint8_t *new_codes, *new_scales;
    float *keys;
    int64_t *key_pos;
} window_job;

static void window_item(const void *job, int64_t b) {
    const window_job *j = job;
    int64_t R = j->R, d = j->d, T = j->T, nb = d / 32, tail = T < R ? T : R;
    int64_t ring = (j->slots[b] * j->L + j->layer) * R;
    const int64_t *pos = j->positions + b * T;
    float *out = j->keys + b * (R + T) * d;
    int64_t *out_pos = j->key_pos + b * (R + T);
    uint8_t *new_codes = j->new_codes + b * T * d, *new_scales = j->new_scales + b * T * nb;
    for (int64_t r = 0; r < R; r++) {
        int64_t p = j->ring_pos[ring + r];
        out_pos[r] = (p >= 0 && p < pos[0]) ? p : -1;
        fp8_dequantize_row(j->ring_codes + (ring + r) * d, j->ring_scales + (ring + r) * nb, d, out + r * d);
    }
    fp8_quantize_row(j->kv + b * T * d, T * d, new_codes, new_scales, out + R * d);
    for (int64_t t = 0; t < T; t++) out_pos[R + t] = pos[t];
    for (int64_t t = T - tail; t < T; t++) {
        int64_t row = ring + ((pos[t] % R) + R) % R;
        memcpy(j->ring_codes + row * d, new_codes + t * d, (size_t)d);
        memcpy(j->ring_scales + row * nb, new_scales + t * nb, (size_t)nb);
        j->ring_pos[row] = (int32_t)pos[t];
    }
}

/* new_codes [B, T, d] / new_scales [B, T, d / 32]: scratch. Rows of distinct slots go over the pool (one row per
 * item); a slot given twice reads what the earlier row wrote, so then the rows run in order on the caller. */
void dsv41_window_step(uint8_t *ring_codes, uint8_t *ring_scales, int32_t *ring_pos, int64_t L, int64_t layer,
                       int64_t R, int64_t d, const int64_t *slots, int64_t B, const int64_t *positions, int64_t T,
                       const float *kv, uint8_t *new_codes, uint8_t *new_scales, float *keys, int64_t *key_pos) {
    window_job job = {ring_codes, ring_scales, ring_pos, L, layer, R, d, T, slots, positions, kv, new_codes,
                      new_scales, keys, key_pos};
    int distinct = 1;
    for (int64_t a = 0; a < B && distinct; a++)
        for (int64_t b = a + 1; b < B; b++) distinct &= slots[a] != slots[b];
    if (distinct) {
        parallel_for(window_item, &job, B);
        return;
    }
    for (int64_t b = 0; b < B; b++) window_item(&job, b);
}

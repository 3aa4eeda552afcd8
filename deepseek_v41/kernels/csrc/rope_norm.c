/* RoPE (model/rope.py) and RMSNorm (model/norm.py) over rows of fp32 or bf16 values. */
#include "dsv41.h"

/* ------------------------------------------------------------------------------------------ RoPE, RMSNorm */

/* Interleaved RoPE on the last r dims of x [N, H, d] with phases cos / sin [N, r] (rope.py phases: each angle
 * twice, sin negated on the pair's first element): out = x, tail * cos + swap(tail) * sin (sign = -1 negates
 * sin: the inverse rotation). x and out are fp32, or bf16 bits (bf16: the head dims copied, the tail widened,
 * rotated in fp32 and rounded, as rope.py does for bf16). The same two products and one sum per element as
 * rope.py: bit-identical. */
void rope_rows(const void *x, int bf16, const float *cos_, const float *sin_, int64_t N, int64_t H, int64_t d,
               int64_t r, int sign, void *out) {
    const size_t size = bf16 ? sizeof(uint16_t) : sizeof(float);
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos_ + n * r, *s = sin_ + n * r;
        for (int64_t h = 0; h < H; h++) {
            const char *xi = (const char *)x + (n * H + h) * d * size;
            char *o = (char *)out + (n * H + h) * d * size;
            if (o != xi) memcpy(o, xi, (size_t)(d - r) * size);
            for (int64_t i = d - r; i < d; i += 2) {
                float a = load_at(xi, bf16, i), b = load_at(xi, bf16, i + 1);
                int64_t j = i - (d - r);
                float s0 = sign < 0 ? -s[j] : s[j], s1 = sign < 0 ? -s[j + 1] : s[j + 1];
                store_out(o, i, a * c[j] + b * s0, bf16);
                store_out(o, i + 1, b * c[j + 1] + a * s1, bf16);
            }
        }
    }
}

void dsv41_rope(const float *x, const float *cos_, const float *sin_, int64_t N, int64_t H, int64_t d, int64_t r,
                int sign, float *out) {
    rope_rows(x, 0, cos_, sin_, N, H, d, r, sign, out);
}

void dsv41_rope_bf16(const uint16_t *x, const float *cos_, const float *sin_, int64_t N, int64_t H, int64_t d,
                     int64_t r, int sign, uint16_t *out) {
    rope_rows(x, 1, cos_, sin_, N, H, d, r, sign, out);
}
/* RMSNorm over the last dim of x [N, D]: out = x * rsqrt(mean(x^2) + eps) (* weight [D] when given). */
void dsv41_rms_norm(const float *x, int64_t N, int64_t D, const float *weight, float eps, float *out) {
    for (int64_t n = 0; n < N; n++) {
        const float *xi = x + n * D;
        float *o = out + n * D;
        float f = rms_factor(xi, D, eps);
        if (weight)
            for (int64_t i = 0; i < D; i++) o[i] = (xi[i] * f) * weight[i];
        else
            for (int64_t i = 0; i < D; i++) o[i] = xi[i] * f;
    }
}

/* dsv41_rms_norm for bf16 x, weight and out (bits; weight may be NULL): each row widened to fp32 in scratch [D],
 * normalised in fp32 as above and rounded to bf16 (RMSNorm of a bf16 model: upcast, normalise, cast back). */
void dsv41_rms_norm_bf16(const uint16_t *x, int64_t N, int64_t D, const uint16_t *weight, float eps, float *scratch,
                         uint16_t *out) {
    for (int64_t n = 0; n < N; n++) {
        bf16_row(x + n * D, D, scratch);
        float f = rms_factor(scratch, D, eps);
        uint16_t *o = out + n * D;
        if (weight)
            for (int64_t i = 0; i < D; i++) o[i] = bf16_round((scratch[i] * f) * load_at(weight, 1, i));
        else
            for (int64_t i = 0; i < D; i++) o[i] = bf16_round(scratch[i] * f);
    }
}

/* RMSNorm of rows x [N, D] in place (fp32, or bf16 bits rounded once): (x * rsqrt(mean(x^2) + eps)) * weight, the
 * operations of dsv41_rms_norm / dsv41_rms_norm_bf16 (weight fp32 or bf16 bits like x). row: D floats scratch. */
void norm_rows(void *x, int bf16, int64_t N, int64_t D, const void *weight, float eps, float *row) {
    for (int64_t n = 0; n < N; n++) {
        void *xn = (char *)x + (size_t)(n * D) * (bf16 ? 2 : 4);
        for (int64_t i = 0; i < D; i++) row[i] = load_at(xn, bf16, i);
        float f = rms_factor(row, D, eps);
        for (int64_t i = 0; i < D; i++) store_out(xn, i, (row[i] * f) * load_at(weight, bf16, i), bf16);
    }
}

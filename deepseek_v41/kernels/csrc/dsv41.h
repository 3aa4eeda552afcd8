/* Fused CPU kernels for the decode step (bench/README.md, "Fused CPU kernels").
 *
 * Plain C99 (plus the GCC / Clang vector extension, for accumulators that stay in registers) over contiguous
 * fp32 / bf16 bits / uint8 / int64 buffers, compiled on first use by deepseek_v41/kernels and called through
 * ctypes. Each function replaces a chain of small tensor ops whose cost at decode size is all dispatch. The
 * quantization kernels, RoPE and the top-k are bit-exact with the torch code (the same IEEE operations in the
 * same order; built with -ffp-contract=off so no multiply-add is fused); the others (norms, mHC, attention,
 * router, experts, indexer scores, GEMV) sum in a different order than ATen, so they agree to rounding
 * (tests/kernels).
 *
 * Formats (MODEL_REFERENCE.md §4): E4M3FN bytes, E2M1 nibbles (element 2i in the low nibble), UE8M0 bytes
 * (2**(b - 127); 0 is 2**-127, 255 is NaN). NaN / inf / -0 follow the package policy of deepseek_v41/quant.
 *
 * The library is the files of this folder, one per concept (codecs, pool, window, rope_norm, hyper, gemv,
 * attention, compressor, moe, indexer, topk; decode: a decode step's layers, calling the others), built by one
 * compiler call (deepseek_v41/kernels/loader.py). This header is what they share: the formats and their tables,
 * the thread pool's parallel_for, the fp32 / bf16 row helpers and vector sums (static inline, so each file inlines
 * them as one file did), the GEMV weight rows, the functions one file defines for others (hidden: the library
 * exports the dsv41_* entry points alone), and the entry points, whose ctypes signatures sit beside their Python
 * wrappers (the modules of deepseek_v41/kernels and kernels/fast/decode.py; tests/kernels checks that the two
 * agree).
 */
#ifndef DSV41_H
#define DSV41_H

#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

/* Functions one file defines and others call: hidden, so the library exports the dsv41_* entry points alone. */
#define DSV41_INTERNAL __attribute__((visibility("hidden")))

/* ---------------------------------------------------------------------------------------------- formats */

#define E4M3_MAX 448.0f
#define E2M1_MAX 6.0f
#define FP8_AMAX_FLOOR 1e-4f
#define UE8M0_NAN 255

static inline float from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* bf16 bits [n] widened to fp32 (exact). */
static inline void bf16_row(const uint16_t *w, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)w[i] << 16;
        memcpy(out + i, &bits, 4);
    }
}

/* Rows of up to this many floats that a kernel widens or builds on its stack (bf16 inputs widened to fp32, a token's
 * normalized mHC streams, rows rounded to bf16 at the end) instead of going through a caller's scratch. */
#define ROW_ON_STACK 8192

/* fp32 -> bf16 bits, round to nearest even; NaN -> the quiet NaN 0x7FC0 (c10::BFloat16's conversion). */
static inline uint16_t bf16_round(float f) {
    if (f != f) return 0x7FC0;
    uint32_t b = to_bits(f);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* UE8M0 byte of the smallest power of two >= v (v >= 0, NaN or +inf -> 255); formats.ue8m0_encode_ceil. */
static inline uint8_t ue8m0_encode_ceil(float v) {
    uint32_t bits = to_bits(v);
    int32_t exponent = (int32_t)((bits >> 23) & 0xFF), mantissa = (int32_t)(bits & 0x7FFFFF);
    int32_t byte = exponent == 0 ? (mantissa > 0x400000) : exponent + (mantissa != 0);
    return (uint8_t)(byte > UE8M0_NAN ? UE8M0_NAN : byte);
}

static inline float ue8m0_decode(uint8_t b) {
    if (b == UE8M0_NAN) return NAN;
    return from_bits(b == 0 ? 0x400000u : (uint32_t)b << 23);
}

/* E4M3FN byte of y (|y| <= 448 or NaN), round to nearest even; -0, values rounding to 0 and NaN give 0x00. */
static inline uint8_t e4m3_encode(float y) {
    if (isnan(y)) return 0;
    float a = fabsf(y);
    uint32_t magnitude;
    if (a < 0.015625f) {               /* below 2**-6: subnormal codes, spacing 2**-9 (scaling is exact) */
        magnitude = (uint32_t)rintf(a * 512.0f);  /* 8 is the smallest normal, code 0x08: continuous */
    } else {
        int e = (int)((to_bits(a) >> 23) & 0xFF) - 127;            /* a = 1.f * 2**e, e in [-6, 8] */
        float m = rintf((a * from_bits((uint32_t)(127 - e) << 23) - 1.0f) * 8.0f);  /* exact until rintf */
        magnitude = ((uint32_t)(e + 7) << 3) + (uint32_t)m;       /* m == 8 carries into the exponent */
    }
    if (magnitude == 0) return 0;
    return (uint8_t)(magnitude | (y < 0 ? 0x80u : 0u));
}

/* Decoding tables, filled by dsv41_init (codecs.c). */
DSV41_INTERNAL extern float E4M3_VALUES[256];
static const float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Both E2M1 values of each code byte (element 2i in the low nibble): one 8-byte lookup decodes a byte. */
DSV41_INTERNAL extern float FP4_PAIRS[256][2];
DSV41_INTERNAL extern float UE8M0_VALUES[256]; /* ue8m0_decode of every byte */
/* E4M3_VALUES of the codes whose exponent field is 0 (subnormals, +-0) or 15 (the largest values, the NaN codes 0x7F /
 * 0xFF) at index (sign << 4) | code & 15: the entries fp8_dequantize_row's AVX-512 path takes from the table. */
DSV41_INTERNAL extern float E4M3_EDGE[32];

static inline float e4m3_decode(uint8_t b) { return E4M3_VALUES[b]; }

enum { FMT_E4M3 = 0, FMT_UE8M0 = 1 };

static inline float fp4_scale_decode(uint8_t b, int fmt) { return fmt == FMT_E4M3 ? e4m3_decode(b) : ue8m0_decode(b); }

/* A pool of FP4 entries in pages (the compressed KV and index keys of the paged cache), read through block
 * tables. */
typedef struct {
    const uint8_t *codes, *scales;  /* [pages, per_page, width / 2], [pages, per_page, width / block] */
    int64_t pages, per_page, width, block;
    int fmt;
    const int64_t *tables;          /* [rows, table_len]: the pages of each row's entries */
    int64_t table_len, ratio, block_size;
} fp4_pool;

/* ------------------------------------------------------------------------------------------ thread pool */

typedef void (*pool_fn)(const void *job, int64_t item);

/* fn(job, i) for i in [0, items), on the pool when it has workers, else (or when busy) on the caller. The job's
 * fields are set before it opens (release); a worker reads them after it joins (acquire). The caller takes items
 * too, closes the job when none is left, and waits for the workers that joined. */
DSV41_INTERNAL void parallel_for(pool_fn fn, const void *job, int64_t items);

/* ------------------------------------------------------------------------------------- fp32 / bf16 rows */

/* Element i of a row of fp32 values, or of bf16 bits widened to fp32 (exact). */
static inline float load_at(const void *x, int bf16, int64_t i) {
    return bf16 ? from_bits((uint32_t)((const uint16_t *)x)[i] << 16) : ((const float *)x)[i];
}

/* Stores v as element i of a row of fp32 values, or of bf16 bits rounded to nearest even. */
static inline void store_out(void *out, int64_t at, float v, int bf16) {
    if (bf16)
        ((uint16_t *)out)[at] = bf16_round(v);
    else
        ((float *)out)[at] = v;
}

/* Eight fp32 lanes as one value (GCC / Clang vector extension): accumulators that stay in registers. Loads go
 * through memcpy, so no alignment is assumed. */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Sixteen fp32 lanes (split into narrower registers where the machine has none this wide). */
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)). With AVX, in four vector steps (the lane-by-lane form
 * compiles to ~15 scalar steps): the same additions, so the same bits. */
static inline float sum8(v8f a) {
#if defined(__AVX__)
    __m256 v;
    memcpy(&v, &a, sizeof v);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  /* a[i] + a[i + 4] */
    __m128 t = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(2, 3, 0, 1)));         /* q0 + q1, ., q2 + q3, . */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehl_ps(t, t)));
#else
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
#endif
}

/* Sum of x[i] * y[i] over n values: four 8-lane accumulators (each lane adds in order) added pairwise, then the
 * remaining values one by one. */
static inline float dot(const float *x, const float *y, int64_t n) {
    v8f a = {0}, b = {0}, c = {0}, d = {0};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a += load8(x + i) * load8(y + i);
        b += load8(x + i + 8) * load8(y + i + 8);
        c += load8(x + i + 16) * load8(y + i + 16);
        d += load8(x + i + 24) * load8(y + i + 24);
    }
    for (; i + 8 <= n; i += 8) a += load8(x + i) * load8(y + i);
    float s = sum8((a + b) + (c + d));
    for (; i < n; i++) s += x[i] * y[i];
    return s;
}

/* 1 / sqrt(mean(x^2) + eps) over n values. */
static inline float rms_factor(const float *x, int64_t n, float eps) {
    return 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
}

/* ------------------------------------------------------------------------------------ GEMV weight rows */

/* A matrix of weight rows, each K long: fp32 values, bf16 bits, or FP4 E2M1 codes (two per byte, element 2i in
 * the low nibble) with one UE8M0 scale byte per 32 weights (MODEL_REFERENCE.md §4, the routed experts' format). */
enum { W_FP32, W_BF16, W_FP4 };
#define FP4_ROW_BLOCK 32

typedef struct {
    const void *w;
    const uint8_t *scales;  /* W_FP4 only: [rows, K / 32] */
    int kind;
    int64_t K;
} wrows;

static inline const void *wrow(const wrows *m, int64_t r) {
    return (const char *)m->w + (m->kind == W_FP4 ? r * m->K / 2 : r * m->K * (m->kind == W_BF16 ? 2 : 4));
}

static inline const uint8_t *srow(const wrows *m, int64_t r) {
    return m->kind == W_FP4 ? m->scales + r * (m->K / 32) : 0;
}


/* Weights i .. i + 31 of a row of bf16 bits (exactly widened) or FP4 codes (E2M1 values times the block's UE8M0
 * scale: the fp32 products quant/fp4.py's decoding computes) as two vectors: the even-numbered weights i + 2j in
 * *even, the odd-numbered i + 2j + 1 in *odd. Both formats keep such a pair side by side (a bf16 pair in one 32-bit
 * word, an FP4 pair in one byte, element 2j in the low half), so one load and one or two steps give 32 weights. */
static inline __attribute__((always_inline)) void weight_pairs(const void *w, const uint8_t *s, int kind, int64_t i,
                                                               v16f *even, v16f *odd) {
#if defined(__AVX512F__)
    if (kind == W_BF16) {
        __m512i words = _mm512_loadu_si512((const void *)((const uint16_t *)w + i));
        __m512i lo = _mm512_slli_epi32(words, 16), hi = _mm512_and_si512(words, _mm512_set1_epi32((int)0xFFFF0000u));
        memcpy(even, &lo, sizeof *even);
        memcpy(odd, &hi, sizeof *odd);
    } else {  /* the 16 E2M1 values times the scale, looked up by vpermps, which reads the low 4 bits of each lane:
               * the low nibble, then (shifted) the high one */
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)w + i / 2)));
        __m512 table = _mm512_mul_ps(_mm512_loadu_ps(E2M1_VALUES), _mm512_set1_ps(UE8M0_VALUES[s[i / FP4_ROW_BLOCK]]));
        __m512 lo = _mm512_permutexvar_ps(bytes, table);
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
        memcpy(even, &lo, sizeof *even);
        memcpy(odd, &hi, sizeof *odd);
    }
#else
    float e[16], o[16];
    for (int j = 0; j < 16; j++) {
        if (kind == W_BF16) {
            e[j] = from_bits((uint32_t)((const uint16_t *)w)[i + 2 * j] << 16);
            o[j] = from_bits((uint32_t)((const uint16_t *)w)[i + 2 * j + 1] << 16);
        } else {
            uint8_t byte = ((const uint8_t *)w)[i / 2 + j];
            float scale = UE8M0_VALUES[s[i / FP4_ROW_BLOCK]];
            e[j] = E2M1_VALUES[byte & 15] * scale;
            o[j] = E2M1_VALUES[byte >> 4] * scale;
        }
    }
    *even = load16(e);
    *odd = load16(o);
#endif
}

/* x[i .. i + 31] split the same way: the even-numbered values, then the odd-numbered ones. */
static inline __attribute__((always_inline)) void x_pairs(const float *x, v16f *even, v16f *odd) {
#if defined(__AVX512F__)
    __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    __m512i even_at = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    __m512i odd_at = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512 lo = _mm512_permutex2var_ps(a, even_at, b), hi = _mm512_permutex2var_ps(a, odd_at, b);
    memcpy(even, &lo, sizeof *even);
    memcpy(odd, &hi, sizeof *odd);
#else
    float e[16], o[16];
    for (int j = 0; j < 16; j++) {
        e[j] = x[2 * j];
        o[j] = x[2 * j + 1];
    }
    *even = load16(e);
    *odd = load16(o);
#endif
}

/* Weight i of a row, one at a time (the last K % 16 or K % 32). */
static inline float weight1(const void *w, const uint8_t *s, int kind, int64_t i) {
    if (kind == W_FP32) return ((const float *)w)[i];
    if (kind == W_BF16) return from_bits((uint32_t)((const uint16_t *)w)[i] << 16);
    uint8_t byte = ((const uint8_t *)w)[i / 2];
    return E2M1_VALUES[i % 2 ? byte >> 4 : byte & 15] * UE8M0_VALUES[s[i / FP4_ROW_BLOCK]];
}

typedef float v4f __attribute__((vector_size(16)));

/* The 16 lanes of a added as a tree of vector halves: 16 -> 8 -> 4 -> 2 -> 1. With AVX-512, in five vector steps
 * (the lane-by-lane form compiles to ~30 scalar steps, once per dot: most of an index score's cost): the same
 * additions, so the same bits. */
static inline float sum16(v16f a) {
#if defined(__AVX512F__)
    __m512 v;
    memcpy(&v, &a, sizeof v);
    __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), upper);  /* a[i] + a[i + 8] */
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  /* h[i] + h[i + 4] */
    __m128 t = _mm_add_ps(q, _mm_movehl_ps(q, q));                                   /* q0 + q2, q1 + q3 */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 1, 1, 1))));
#else
    v8f h = {a[0] + a[8], a[1] + a[9], a[2] + a[10], a[3] + a[11], a[4] + a[12], a[5] + a[13], a[6] + a[14],
             a[7] + a[15]};
    v4f q = {h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]};
    return (q[0] + q[2]) + (q[1] + q[3]);
#endif
}

#if defined(__AVX512F__)
/* Lane 4 t + r: sum16(a[t][r]), for the 16 vectors a [4][4]: the same additions as sum16 (each lane pair of a
 * vector added in the same tree: halves of 8, 4, 2, 1), done for 16 vectors at once in 15 vector additions and 30
 * shuffles instead of 64 and 48: each step adds the lower and upper halves of two vectors' partial sums side by
 * side. Fed transposed (v[4 r + t] = a[t][r]), the last step leaves output 4 t + r in lane 4 t + r. */
static inline __attribute__((always_inline)) __m512 sum16_by16(__m512 a[4][4]) {
    __m512 s[8], u[4], v[2];
    for (int m = 0; m < 8; m++) {  /* s[m] = [h of v[2m] (8 lanes), h of v[2m + 1]]: h[i] = v[i] + v[i + 8] */
        __m512 p = a[(2 * m) % 4][(2 * m) / 4], q = a[(2 * m + 1) % 4][(2 * m + 1) / 4];
        s[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int n = 0; n < 4; n++)  /* u[n], 128-bit lane j: q of v[4n + j]: q[i] = h[i] + h[i + 4] */
        u[n] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * n], s[2 * n + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(s[2 * n], s[2 * n + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int n = 0; n < 2; n++)  /* v[n], lane j: q0 + q2, q1 + q3 of v[4 (2n) + j], then of v[4 (2n + 1) + j] */
        v[n] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * n], u[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * n], u[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane j, element e: t0 + t1 of v[4e + j] = a[j][e] */
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX512F__)
/* expf of 16 floats, bit for bit the expf of glibc's libm on x86-64 (glibc 2.36's __expf_fma, the variant it picks on
 * a CPU with FMA: sysdeps/ieee754/flt-32/e_expf.c, compiled with its multiply-adds fused): x N / ln 2 = k + r in
 * double, 2^(k / N) from a table of N = 32, a cubic in r, rounded to float once. Lanes with |x| >= 88, an inf or a
 * NaN take libm's expf itself. Checked against the libm expf over all 2^32 floats (issue 25): identical bits, NaN
 * for NaN. The kernels' generic builds call expf, so they agree with this where libm is that glibc. */
static const uint64_t EXPF_TABLE[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

static inline __attribute__((always_inline)) __m256 expf8_core(__m256 x8) {
    const __m512d inv = _mm512_set1_pd(0x1.71547652b82fep+5), shift = _mm512_set1_pd(0x1.8p+52);
    __m512d xd = _mm512_cvtps_pd(x8), z = _mm512_mul_pd(inv, xd), kd = _mm512_add_pd(z, shift);
    __m512i ki = _mm512_castpd_si512(kd);
    kd = _mm512_sub_pd(kd, shift);
    __m512d r = _mm512_fmsub_pd(inv, xd, kd);  /* glibc's r = z - kd, with z's product fused */
    __m512i idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
    __m512i lo = _mm512_permutex2var_epi64(_mm512_loadu_si512((const void *)EXPF_TABLE), idx,
                                           _mm512_loadu_si512((const void *)(EXPF_TABLE + 8)));
    __m512i hi = _mm512_permutex2var_epi64(_mm512_loadu_si512((const void *)(EXPF_TABLE + 16)), idx,
                                           _mm512_loadu_si512((const void *)(EXPF_TABLE + 24)));
    __m512i t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(idx, _mm512_set1_epi64(16)), lo, hi);
    __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));
    __m512d p = _mm512_fmadd_pd(_mm512_set1_pd(0x1.c6af84b912394p-20), r, _mm512_set1_pd(0x1.ebfce50fac4f3p-13));
    __m512d y = _mm512_fmadd_pd(_mm512_set1_pd(0x1.62e42ff0c52d6p-6), r, _mm512_set1_pd(1.0));
    y = _mm512_fmadd_pd(p, _mm512_mul_pd(r, r), y);
    return _mm512_cvtpd_ps(_mm512_mul_pd(y, s));
}

static inline __m512 expf16(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __mmask16 big = _mm512_cmpge_epu32_mask(_mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(0x7ff)),
                                            _mm512_set1_epi32(0x42b));  /* |x| >= 88, inf, NaN */
    __m256 lo = expf8_core(_mm512_castps512_ps256(x));
    __m256 hi = expf8_core(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    __m512 y = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
    if (big) {
        float xs[16], ys[16];
        _mm512_storeu_ps(xs, x);
        _mm512_storeu_ps(ys, y);
        for (int l = 0; l < 16; l++)
            if (big >> l & 1) ys[l] = expf(xs[l]);
        y = _mm512_loadu_ps(ys);
    }
    return y;
}
#endif

/* ------------------------------------------------------------------------- internal, across the files */

DSV41_INTERNAL void fp8_quantize_row(const float *x, int64_t n, uint8_t *codes, uint8_t *scales, float *values);
DSV41_INTERNAL void fp8_dequantize_row(const uint8_t *codes, const uint8_t *scales, int64_t n, float *out);
DSV41_INTERNAL void fp4_quantize_row(const float *x, int64_t n, int64_t block, int fmt, uint8_t *codes, uint8_t *scales,
                                     float *values);
DSV41_INTERNAL void fp4_dequantize_row(const uint8_t *codes, const uint8_t *scales, int64_t n, int64_t block, int fmt,
                                       float *out);
DSV41_INTERNAL void rope_rows(const void *x, int bf16, const float *cos_, const float *sin_, int64_t N, int64_t H,
                              int64_t d, int64_t r, int sign, void *out);
DSV41_INTERNAL void norm_rows(void *x, int bf16, int64_t N, int64_t D, const void *weight, float eps, float *row);
DSV41_INTERNAL void dots_block(const float *x, int64_t ldx, int64_t N, const wrows *m, int64_t row, int64_t rows,
                               float *res, int64_t ldr);
DSV41_INTERNAL void linear_into(const void *x, int x_bf16, int64_t N, int64_t G, int64_t K, const void *W, int w_bf16,
                                int64_t O, void *out, int out_bf16, float *scratch);

/* ---------------------------------------------------------------------- the library's entry points */

/* codecs.c */
int dsv41_init(void);
void dsv41_fp8_quantize(const float *x, int64_t rows, int64_t n, uint8_t *codes, uint8_t *scales, float *values);
void dsv41_fp8_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t n, float *out);
void dsv41_fp4_quantize(const float *x, int64_t rows, int64_t n, int64_t block, int fmt, uint8_t *codes,
                        uint8_t *scales, float *values);
void dsv41_fp4_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t n, int64_t block,
                          int fmt, float *out);
int dsv41_fp4_gather(const uint8_t *codes, const uint8_t *scales, int64_t pages, int64_t per_page, int64_t width,
                     int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                     int64_t block_size, const int64_t *idx, int64_t B, int64_t M, float *out);
int64_t dsv41_fp4_scatter(uint8_t *codes, uint8_t *scales, int64_t pages, int64_t per_page, int64_t width,
                          int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                          int64_t block_size, const int64_t *group, const int64_t *write_from, int64_t B, int64_t G,
                          const float *x);

/* pool.c */
void dsv41_set_spin(int64_t ns);
int64_t dsv41_get_spin(void);
long dsv41_pool_sleeps(void);
int dsv41_set_threads(int threads);
void dsv41_prefetch(const int64_t *addr, int64_t n);

/* window.c */
void dsv41_window_step(uint8_t *ring_codes, uint8_t *ring_scales, int32_t *ring_pos, int64_t L, int64_t layer,
                       int64_t R, int64_t d, const int64_t *slots, int64_t B, const int64_t *positions, int64_t T,
                       const float *kv, uint8_t *new_codes, uint8_t *new_scales, float *keys, int64_t *key_pos);

/* rope_norm.c */
void dsv41_rope(const float *x, const float *cos_, const float *sin_, int64_t N, int64_t H, int64_t d, int64_t r,
                int sign, float *out);
void dsv41_rope_bf16(const uint16_t *x, const float *cos_, const float *sin_, int64_t N, int64_t H, int64_t d,
                     int64_t r, int sign, uint16_t *out);
void dsv41_rms_norm(const float *x, int64_t N, int64_t D, const float *weight, float eps, float *out);
void dsv41_rms_norm_bf16(const uint16_t *x, int64_t N, int64_t D, const uint16_t *weight, float eps, float *scratch,
                         uint16_t *out);

/* hyper.c */
void dsv41_hc_mix(const void *streams, int bf16, int64_t N, int64_t hc, int64_t D, const float *fn,
                  const float *base, const float *scale, float norm_eps, float hc_eps, int64_t iters, float *scratch,
                  float *pre, float *post, float *comb);
void dsv41_hc_collapse(const void *streams, int bf16, const float *w, int64_t N, int64_t hc, int64_t D,
                       const void *norm_weight, float eps, void *out);
void dsv41_hc_expand(const void *streams, int bf16, const void *y, const float *post, const float *comb, int64_t N,
                     int64_t hc, int64_t D, void *out);

/* gemv.c */
int dsv41_linear(const void *x, int x_bf16, int64_t N, int64_t G, int64_t K, const void *W, int w_bf16, int64_t O,
                 void *out);

/* attention.c */
void dsv41_attend_few(const void *q, int bf16, const int64_t *q_pos, const float *keys, const int64_t *key_pos,
                      int64_t B, int64_t T, int64_t H, int64_t d, int64_t L, int64_t window, const float *selected,
                      const int64_t *topk, int64_t k, const float *sink, float scale, float *scratch, void *out);
int dsv41_band_logits(const float *q, const int64_t *q_pos, const float *keys, const int64_t *key_pos, int64_t B,
                      int64_t c, int64_t H, int64_t d, int64_t L, int64_t P, int64_t i0, int64_t band,
                      int64_t window, const float *sel, const int64_t *idx, int64_t k, const float *sink, float scale,
                      float *out);
int dsv41_band_output(const float *probs, const float *keys, int64_t B, int64_t c, int64_t H, int64_t d, int64_t L,
                      int64_t P, int64_t i0, int64_t band, const float *sel, int64_t k, float *out);
int dsv41_attn_prologue(const void *x, int bf16, int64_t N, int64_t D, const void *wq_a, int64_t qr,
                        const void *q_norm, float q_eps, const void *wq_b, int64_t H, int64_t d, const void *wkv,
                        const void *kv_norm, float kv_eps, const float *cos_, const float *sin_, int64_t r,
                        void *q_lat, void *q, void *kv);
int dsv41_attn_epilogue(const void *o, int bf16, int64_t N, int64_t H, int64_t d, const float *cos_,
                        const float *sin_, int64_t r, const void *wo_a, int64_t G, int64_t rank, const void *wo_b,
                        int64_t D, void *y);

/* compressor.c */
int dsv41_compress(const void *x, int bf16, int64_t B, int64_t T, int64_t D, const int64_t *positions,
                   int64_t ratio, const void *wkv, const void *wgate, int64_t d, const void *norm, float eps,
                   const float *pending_kv, const float *pending_score, int64_t pending_stride, const float *cos_,
                   const float *sin_, int64_t r, const void *wk, int64_t di, const void *k_norm, float k_eps,
                   void *latent, int64_t *group, float *new_pending, void *entries, void *keys);

/* moe.c */
int dsv41_gate(const void *x, int x_bf16, int64_t N, int64_t D, const void *W, int w_bf16, int64_t E,
               const float *bias, int64_t k, int norm_topk, float route_scale, float *scratch, int64_t *indices,
               float *weights);
void dsv41_swiglu(const float *gate, const float *up, int64_t N, int64_t inter, int64_t stride, float limit,
                  float *out);
int dsv41_moe(const void *x, int x_bf16, int64_t N, int64_t D, const int64_t *indices, const float *weights,
              int64_t k, int kind, const void *w13, const uint8_t *sc13, const void *w2, const uint8_t *sc2, int64_t E,
              int64_t inter, float limit, const void *s1, const void *s3, const void *s2, int s_bf16, int64_t s_inter,
              void *out, int out_bf16);

/* indexer.c */
int dsv41_index_scores(const uint8_t *codes, const uint8_t *scales, int64_t pages, int64_t per_page, int64_t di,
                       int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                       int64_t block_size, const float *q, const float *w, int64_t B, int64_t c, int64_t H, int64_t n,
                       int lut, const int64_t *visible, float *out);
int dsv41_indexer_queries(const void *q_lat, const void *x, int bf16, int64_t N, int64_t qr, int64_t D,
                          const void *wq_b, int64_t H, int64_t di, const void *w_proj, const float *cos_,
                          const float *sin_, int64_t r, int fake_quant, float scale, float *q, float *w);
int dsv41_index_select(const float *q, const float *w, const float *keys, int64_t B, int64_t c, int64_t H,
                       int64_t di, int64_t N, const int64_t *visible, int64_t k, int64_t block, int64_t keep,
                       int64_t *picks, uint8_t *mask);

/* topk.c */
/* model/indexer.py topk_set of one row x [N] into o [k] (heap: k floats); -1 when x holds a NaN (topk.c). */
DSV41_INTERNAL int topk_row(const float *x, int64_t N, int64_t k, int drop_neg_inf, float *heap, int64_t *o);
/* topk_row's indices from a selection instead of a heap (scratch: N / 16 + 2 N floats, idx: N + 16 int32). */
DSV41_INTERNAL int topk_fast(const float *x, int64_t N, int64_t k, int drop_neg_inf, float *scratch, int32_t *idx,
                             int64_t *o);
/* model/indexer.py candidate_blocks of one row, x read below `valid` only (topk.c). */
DSV41_INTERNAL int blocks_row(const float *x, int64_t N, int64_t valid, int64_t vis, int64_t block, int64_t nb,
                              int64_t keep, int nan_free, float *best, float *scratch, int32_t *idx,
                              int64_t *chosen, uint8_t *mask);
int dsv41_topk_set(const float *scores, int64_t R, int64_t N, int64_t k, int drop_neg_inf, float *heap,
                   int64_t *out);
void dsv41_argmax(const float *x, int64_t R, int64_t V, int64_t *out);
int dsv41_candidate_blocks(const float *scores, const int64_t *visible, int64_t R, int64_t N, int64_t block,
                           int64_t keep, uint8_t *mask);
int dsv41_pool_select(const uint8_t *codes, const uint8_t *scales, int64_t pages, int64_t per_page, int64_t di,
                      int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                      int64_t block_size, const float *q, const float *w, int64_t B, int64_t c, int64_t H, int64_t n,
                      const uint8_t *mask, int64_t nblocks, int64_t pool_block, int64_t keep,
                      const int64_t *visible, int64_t k, int64_t *out);

/* decode.c: a decode step's layers in one call. The layout of both structs is mirrored field by field by
 * deepseek_v41/kernels/fast/decode.py (_Layer, _Step); tests/kernels checks their sizes. */
#define DSV41_ROPES 4 /* RoPE tables a step's phases may come from */
typedef struct {
    int64_t layer, hc, D, bf16, iters;
    float norm_eps, hc_eps;
    const float *mix[6]; /* fn, base, scale of the attention site, then of the FFN site (fp32) */
    const void *attn_norm, *ffn_norm;
    float attn_norm_eps, ffn_norm_eps;
    /* attention: projections, RoPE (r dims, the step's table rope), output, window, sink */
    const void *wq_a, *q_norm, *wq_b, *wkv, *kv_norm;
    float q_eps, kv_eps;
    int64_t qr, H, d, r, rope;
    const void *wo_a, *wo_b;
    int64_t groups, rank, window;
    const float *sink;
    float scale, iq_scale;
    /* CSA2: sparse (not window-only); the kv / index / candidate sources (-1: none); compressor of a kv source */
    int64_t sparse, kv_source, index_source, candidate_source, is_candidate_source, ratio, src_ratio;
    int64_t compress, pending_index, di;
    const void *c_wkv, *c_wgate, *c_norm, *c_wk, *c_knorm;
    float c_eps, c_keps;
    /* the indexer of an index source: query weights, heads, head dim, top-k, candidate blocks */
    int64_t index, iH, idi, index_topk, block, keep;
    const void *iq_wq_b, *iq_wproj;
    /* the kv source's FP4 pools: main codes, scales, index codes, scales [pages, per_page, ...] */
    uint8_t *pools[4];
    int64_t pool_pages, per_page;
    /* MoE: router, routed experts (kind 2 FP4, 1 bf16), shared expert */
    const void *gate_w;
    const float *gate_bias;
    int64_t gate_bf16, E, k_experts, norm_topk, moe_kind, inter, s_bf16, s_inter;
    float route_scale, limit;
    const void *w13, *w2, *s1, *s3, *s2;
    const uint8_t *sc13, *sc2;
} dsv41_decode_layer;

typedef struct {
    int64_t B, R, ring_layers, pending_layers, table_len, block_size, lut_rows, topk_width, pool_width, failed_layer;
    const int64_t *positions, *slots, *tables, *write_from, *skip_compress;
    const float *cos[DSV41_ROPES], *sin[DSV41_ROPES], *pair_cos[DSV41_ROPES], *pair_sin[DSV41_ROPES];
    uint8_t *ring_codes, *ring_scales;
    int32_t *ring_pos;
    float *pending;
    const void *streams_in;
    const float *pre_in;
    void *streams[2], *streams_out;
    float *pre_out;
    int64_t *topk, *k, *nblocks, *written; /* per layer: picks [L, B, topk_width], their count, pool blocks, entries */
    uint8_t *pool;                          /* per layer: the candidate pool [L, B, pool_width] */
    void *taps;                             /* or NULL: each layer's input streams, layer j at j * taps_stride bytes */
    int64_t taps_stride;
} dsv41_decode_step;

int dsv41_decode_layers(const dsv41_decode_layer *layers, int64_t first, int64_t last, dsv41_decode_step *S);

#endif

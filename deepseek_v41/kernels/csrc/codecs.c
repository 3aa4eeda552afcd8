/* FP8 / FP4 blocks and paged FP4 entries (MODEL_REFERENCE.md §4; quant/fp8.py, quant/fp4.py,
 * cache/paged_context.py): the format tables, quantization and decoding of rows, and the gather / scatter of
 * compressed entries through block tables. Bit-exact with the torch code. */
#include "dsv41.h"

float E4M3_VALUES[256];

/* Both E2M1 values of each code byte (element 2i in the low nibble): one 8-byte lookup decodes a byte. */
float FP4_PAIRS[256][2];
float UE8M0_VALUES[256]; /* ue8m0_decode of every byte */
/* E4M3_VALUES of the codes whose exponent field is 0 (subnormals, +-0) or 15 (the largest values, the NaN codes 0x7F /
 * 0xFF) at index (sign << 4) | code & 15: the entries fp8_dequantize_row's AVX-512 path takes from the table. */
float E4M3_EDGE[32];

/* Called once by the loader. Returns the number of E4M3 table entries, so the loader can check the call ran. */
int dsv41_init(void) {
    for (int c = 0; c < 256; c++) UE8M0_VALUES[c] = ue8m0_decode((uint8_t)c);
    for (int c = 0; c < 256; c++) {
        FP4_PAIRS[c][0] = E2M1_VALUES[c & 15];
        FP4_PAIRS[c][1] = E2M1_VALUES[c >> 4];
    }
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? (float)m * 0.001953125f : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if ((c & 0x7F) == 0x7F) v = NAN;
        E4M3_VALUES[c] = (c & 0x80) ? -v : v;
    }
    for (int i = 0; i < 32; i++) E4M3_EDGE[i] = E4M3_VALUES[(i & 16) << 3 | (i & 8 ? 0x78 : 0) | (i & 7)];
    return 256;
}

/* Largest |x| of n values; NaN when any is NaN (torch's amax). */
static float abs_max(const float *x, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) return NAN;
        float a = fabsf(x[i]);
        if (a > m) m = a;
    }
    return m;
}

/* ------------------------------------------------------------------------------------------- FP8 blocks */

/* One row of n values (n % 32 == 0) -> E4M3 codes [n], UE8M0 scales [n / 32], decoded values [n]
 * (quant/fp8.py quantize_fp8_values). */
void fp8_quantize_row(const float *x, int64_t n, uint8_t *codes, uint8_t *scales, float *values) {
    for (int64_t b0 = 0; b0 < n; b0 += 32) {
        float amax = abs_max(x + b0, 32);
        float floor_amax = isnan(amax) ? amax : (amax < FP8_AMAX_FLOOR ? FP8_AMAX_FLOOR : amax);
        uint8_t sb = ue8m0_encode_ceil(floor_amax / E4M3_MAX);
        float scale = ue8m0_decode(sb);
        scales[b0 / 32] = sb;
        for (int64_t i = b0; i < b0 + 32; i++) {
            float y = x[i] / scale;
            if (!isnan(y)) y = y < -E4M3_MAX ? -E4M3_MAX : (y > E4M3_MAX ? E4M3_MAX : y);
            uint8_t c = e4m3_encode(y);
            codes[i] = c;
            if (values) values[i] = e4m3_decode(c) * scale;
        }
    }
}

#if defined(__AVX512F__)
/* E4M3_VALUES of 16 codes: the fp32 bits built from the code (sign, exponent field + 120, mantissa << 20), exact
 * for exponent fields 1 .. 14 (and 15 but for the NaN codes); codes of exponent field 0 or 15 take the table's
 * entry from E4M3_EDGE (lo, hi) by vpermt2ps instead, so -0, the subnormals and even the NaN bits are the table's. */
static inline __m512 e4m3_decode16(const uint8_t *codes, __m512 lo, __m512 hi) {
    __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes));  /* sign-extended: bit 31 the sign */
    __m512i bits = _mm512_add_epi32(_mm512_and_si512(_mm512_slli_epi32(c, 20), _mm512_set1_epi32((int)0x87F00000u)),
                                    _mm512_set1_epi32(120 << 23));
    __mmask16 edge = _mm512_testn_epi32_mask(_mm512_add_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x78)),
                                                              _mm512_set1_epi32(8)), _mm512_set1_epi32(0x70));
    __m512i at = _mm512_ternarylogic_epi32(_mm512_set1_epi32(16), _mm512_srli_epi32(c, 3), c, 0xCA);  /* sign, c & 15 */
    return _mm512_mask_blend_ps(edge, _mm512_castsi512_ps(bits), _mm512_permutex2var_ps(lo, at, hi));
}
#endif

/* One row of E4M3 codes [n] and UE8M0 scale bytes [n / 32] -> values [n] (quant/fp8.py dequantize_fp8): each table
 * value times its block's scale. With AVX-512, 16 values at a time (e4m3_decode16): the same products. */
void fp8_dequantize_row(const uint8_t *codes, const uint8_t *scales, int64_t n, float *out) {
    int64_t start = 0;
#if defined(__AVX512F__)
    const __m512 lo = _mm512_loadu_ps(E4M3_EDGE), hi = _mm512_loadu_ps(E4M3_EDGE + 16);
    for (; start + 32 <= n; start += 32) {
        __m512 scale = _mm512_set1_ps(ue8m0_decode(scales[start / 32]));
        _mm512_storeu_ps(out + start, _mm512_mul_ps(e4m3_decode16(codes + start, lo, hi), scale));
        _mm512_storeu_ps(out + start + 16, _mm512_mul_ps(e4m3_decode16(codes + start + 16, lo, hi), scale));
    }
#endif
    for (int64_t b0 = start; b0 < n; b0 += 32) {
        float scale = ue8m0_decode(scales[b0 / 32]);
        for (int64_t i = b0; i < b0 + 32; i++) out[i] = E4M3_VALUES[codes[i]] * scale;
    }
}

void dsv41_fp8_quantize(const float *x, int64_t rows, int64_t n, uint8_t *codes, uint8_t *scales, float *values) {
    for (int64_t r = 0; r < rows; r++)
        fp8_quantize_row(x + r * n, n, codes + r * n, scales + r * (n / 32), values ? values + r * n : 0);
}

void dsv41_fp8_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) fp8_dequantize_row(codes + r * n, scales + r * (n / 32), n, out + r * n);
}

/* ------------------------------------------------------------------------------------------- FP4 blocks */

/* Nearest E2M1 code of y in [-6, 6] (or NaN), ties to the even code; -0 and NaN give code 0 (fp4._round_e2m1). */
static uint8_t e2m1_code(float y) {
    if (isnan(y)) return 0;
    float a = fabsf(y);
    float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
    float q = rintf(y / step) * step;
    if (q == 0.0f) return 0;
    float qa = fabsf(q);
    uint8_t index = (uint8_t)(qa < 2.0f ? qa * 2.0f : (qa < 4.0f ? qa + 2.0f : qa * 0.5f + 4.0f));
    return (uint8_t)(index | (q < 0 ? 8 : 0));
}

/* One row of n values (n % block == 0, block even) -> packed codes [n / 2], scale bytes [n / block] and, when
 * values is given, the decoded values [n] (quant/fp4.py _quantize_blocks). */
void fp4_quantize_row(const float *x, int64_t n, int64_t block, int fmt, uint8_t *codes, uint8_t *scales,
                      float *values) {
    for (int64_t b0 = 0; b0 < n; b0 += block) {
        float amax = abs_max(x + b0, block);
        uint8_t sb;
        if (fmt == FMT_E4M3) {
            float s = amax / E2M1_MAX;
            s = s < 0.001953125f ? 0.001953125f : (s > E4M3_MAX ? E4M3_MAX : s);
            sb = isnan(amax) ? 0x7F : e4m3_encode(s);
        } else {
            float floor_amax = isnan(amax) ? amax : (amax < E2M1_MAX * 0x1p-126f ? E2M1_MAX * 0x1p-126f : amax);
            sb = ue8m0_encode_ceil(floor_amax / E2M1_MAX);
        }
        float scale = fp4_scale_decode(sb, fmt);
        if (scales) scales[b0 / block] = sb;
        for (int64_t i = b0; i < b0 + block; i += 2) {
            float y0 = x[i] / scale, y1 = x[i + 1] / scale;
            if (!isnan(y0)) y0 = y0 < -E2M1_MAX ? -E2M1_MAX : (y0 > E2M1_MAX ? E2M1_MAX : y0);
            if (!isnan(y1)) y1 = y1 < -E2M1_MAX ? -E2M1_MAX : (y1 > E2M1_MAX ? E2M1_MAX : y1);
            uint8_t c0 = e2m1_code(y0), c1 = e2m1_code(y1);
            if (codes) codes[i / 2] = (uint8_t)(c0 | (c1 << 4));
            if (values) {
                values[i] = E2M1_VALUES[c0] * scale;
                values[i + 1] = E2M1_VALUES[c1] * scale;
            }
        }
    }
}

/* One row of packed codes [n / 2] and scale bytes [n / block] -> values [n]: each E2M1 value times its block's
 * scale (quant/fp4.py dequantize_fp4). With AVX-512 and blocks of 16 or 32, 32 values at a time: the 16 code bytes'
 * low and high nibbles looked up by vpermps, times the scales, then interleaved (element 2j from byte j's low
 * nibble): the same products. */
void fp4_dequantize_row(const uint8_t *codes, const uint8_t *scales, int64_t n, int64_t block, int fmt, float *out) {
    int64_t start = 0;
#if defined(__AVX512F__)
    if (block == 16 || block == 32) {
        const __m512 table = _mm512_loadu_ps(E2M1_VALUES);
        const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
        for (; start + 32 <= n; start += 32) {
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + start / 2)));
            __m512 scale = _mm512_set1_ps(fp4_scale_decode(scales[start / block], fmt));
            if (block == 16)  /* bytes 8 .. 15 hold the next block's values */
                scale = _mm512_mask_blend_ps(0xFF00, scale, _mm512_set1_ps(fp4_scale_decode(scales[start / 16 + 1],
                                                                                            fmt)));
            __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(bytes, table), scale);
            __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table), scale);
            _mm512_storeu_ps(out + start, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(out + start + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
    }
#endif
    for (int64_t b0 = start; b0 < n; b0 += block) {
        float scale = fp4_scale_decode(scales[b0 / block], fmt);
        for (int64_t i = b0; i < b0 + block; i += 2) {
            uint8_t byte = codes[i / 2];
            out[i] = E2M1_VALUES[byte & 15] * scale;
            out[i + 1] = E2M1_VALUES[byte >> 4] * scale;
        }
    }
}

void dsv41_fp4_quantize(const float *x, int64_t rows, int64_t n, int64_t block, int fmt, uint8_t *codes,
                        uint8_t *scales, float *values) {
    for (int64_t r = 0; r < rows; r++)
        fp4_quantize_row(x + r * n, n, block, fmt, codes ? codes + r * (n / 2) : 0,
                         scales ? scales + r * (n / block) : 0, values ? values + r * n : 0);
}

void dsv41_fp4_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t n, int64_t block,
                          int fmt, float *out) {
    for (int64_t r = 0; r < rows; r++)
        fp4_dequantize_row(codes + r * (n / 2), scales + r * (n / block), n, block, fmt, out + r * n);
}

/* -------------------------------------------------------------------------- paged compressed entries */

/* Page and slot of entry g of a sequence (cache/paged_context.py _locate); -1 when the block table is too short. */
static int64_t entry_page(const int64_t *table, int64_t table_len, int64_t g, int64_t ratio, int64_t block_size) {
    int64_t col = (g * ratio) / block_size;
    return col < table_len ? table[col] : -1;
}

/* Decode entries idx [B, M] (-1 = none: zeros) of one FP4 pool, codes [pages, per_page, width / 2] and scales
 * [pages, per_page, width / block], through block tables [B, table_len], into out [B, M, width].
 * Returns 0, or -1 when an index lies past its block table or its page is out of range. */
typedef struct {
    fp4_pool p;
    int64_t M;
    const int64_t *idx;
    float *out;
    _Atomic int status;
} gather_job;

#define GATHER_AHEAD 32  /* entries whose codes and scales are prefetched before the first of them is decoded */

static void gather_item(const void *job, int64_t b) {
    const gather_job *j = job;
    const fp4_pool *p = &j->p;
    const int64_t half = p->width / 2, nscales = p->width / p->block;
    for (int64_t e0 = 0; e0 < j->M; e0 += GATHER_AHEAD) {
        /* the entries' places first, their reads started together (selected entries lie anywhere in the pool:
         * one cache miss each, which then overlap), then their decoding */
        const int64_t e1 = e0 + GATHER_AHEAD < j->M ? e0 + GATHER_AHEAD : j->M;
        int64_t at[GATHER_AHEAD];
        for (int64_t e = e0; e < e1; e++) {
            int64_t g = j->idx[b * j->M + e];
            at[e - e0] = -1;
            if (g < 0) continue;
            int64_t page = entry_page(p->tables + b * p->table_len, p->table_len, g, p->ratio, p->block_size);
            if (page < 0 || page >= p->pages) {
                atomic_store(&((gather_job *)j)->status, -1);
                return;
            }
            at[e - e0] = page * p->per_page + g % p->per_page;
            __builtin_prefetch(p->codes + at[e - e0] * half);
            __builtin_prefetch(p->scales + at[e - e0] * nscales);
        }
        for (int64_t e = e0; e < e1; e++) {
            float *row = j->out + (b * j->M + e) * p->width;
            if (at[e - e0] < 0)
                memset(row, 0, (size_t)p->width * sizeof(float));
            else
                fp4_dequantize_row(p->codes + at[e - e0] * half, p->scales + at[e - e0] * nscales, p->width, p->block,
                                   p->fmt, row);
        }
    }
}

int dsv41_fp4_gather(const uint8_t *codes, const uint8_t *scales, int64_t pages, int64_t per_page, int64_t width,
                     int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                     int64_t block_size, const int64_t *idx, int64_t B, int64_t M, float *out) {
    gather_job job = {{codes, scales, pages, per_page, width, block, fmt, tables, table_len, ratio, block_size}, M,
                      idx, out, 0};
    parallel_for(gather_item, &job, B);  /* one row's entries per item */
    return atomic_load(&job.status);
}

/* Quantize entries x [B, G, width] of groups group [B, G] into one FP4 pool (the inverse of dsv41_fp4_gather).
 * Groups below 0 or whose first position g * ratio is below write_from[b] are skipped. Returns the number of
 * entries written, or -1 when a group lies past its block table or its page is out of range. */
int64_t dsv41_fp4_scatter(uint8_t *codes, uint8_t *scales, int64_t pages, int64_t per_page, int64_t width,
                          int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                          int64_t block_size, const int64_t *group, const int64_t *write_from, int64_t B, int64_t G,
                          const float *x) {
    int64_t written = 0;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t j = 0; j < G; j++) {
            int64_t g = group[b * G + j];
            if (g < 0 || g * ratio < write_from[b]) continue;
            int64_t page = entry_page(tables + b * table_len, table_len, g, ratio, block_size);
            if (page < 0 || page >= pages) return -1;
            int64_t at = page * per_page + g % per_page;
            fp4_quantize_row(x + (b * G + j) * width, width, block, fmt, codes + at * (width / 2),
                             scales + at * (width / block), 0);
            written++;
        }
    }
    return written;
}

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
 */
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

#define E4M3_MAX 448.0f
#define E2M1_MAX 6.0f
#define FP8_AMAX_FLOOR 1e-4f
#define UE8M0_NAN 255

static float from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static uint32_t to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* bf16 bits [n] widened to fp32 (exact). */
static void bf16_row(const uint16_t *w, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)w[i] << 16;
        memcpy(out + i, &bits, 4);
    }
}

/* Rows of up to this many floats that a kernel widens or builds on its stack (bf16 inputs widened to fp32, a token's
 * normalized mHC streams, rows rounded to bf16 at the end) instead of going through a caller's scratch. */
#define ROW_ON_STACK 8192

/* fp32 -> bf16 bits, round to nearest even; NaN -> the quiet NaN 0x7FC0 (c10::BFloat16's conversion). */
static uint16_t bf16_round(float f) {
    if (f != f) return 0x7FC0;
    uint32_t b = to_bits(f);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* UE8M0 byte of the smallest power of two >= v (v >= 0, NaN or +inf -> 255); formats.ue8m0_encode_ceil. */
static uint8_t ue8m0_encode_ceil(float v) {
    uint32_t bits = to_bits(v);
    int32_t exponent = (int32_t)((bits >> 23) & 0xFF), mantissa = (int32_t)(bits & 0x7FFFFF);
    int32_t byte = exponent == 0 ? (mantissa > 0x400000) : exponent + (mantissa != 0);
    return (uint8_t)(byte > UE8M0_NAN ? UE8M0_NAN : byte);
}

static float ue8m0_decode(uint8_t b) {
    if (b == UE8M0_NAN) return NAN;
    return from_bits(b == 0 ? 0x400000u : (uint32_t)b << 23);
}

/* E4M3FN byte of y (|y| <= 448 or NaN), round to nearest even; -0, values rounding to 0 and NaN give 0x00. */
static uint8_t e4m3_encode(float y) {
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

static float E4M3_VALUES[256];
static const float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Both E2M1 values of each code byte (element 2i in the low nibble): one 8-byte lookup decodes a byte. */
static float FP4_PAIRS[256][2];
static float UE8M0_VALUES[256]; /* ue8m0_decode of every byte */
/* E4M3_VALUES of the codes whose exponent field is 0 (subnormals, +-0) or 15 (the largest values, the NaN codes 0x7F /
 * 0xFF) at index (sign << 4) | code & 15: the entries fp8_dequantize_row's AVX-512 path takes from the table. */
static float E4M3_EDGE[32];

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

static float e4m3_decode(uint8_t b) { return E4M3_VALUES[b]; }

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

/* ------------------------------------------------------------------------------------------ thread pool */

/* Worker threads that take a job's items beside the calling thread, so the decode step's memory-bound work (the
 * projections and experts) reads its weights on every core (bench/README.md, "Fourth round"). Python sets the
 * thread count (dsv41_set_threads) to torch's for a few-token forward and lowers torch's to one meanwhile, so the
 * two pools never spin on the same core. A job's items go out one at a time from a shared counter; each item
 * writes outputs no other item writes, and each output is computed by the same operations in the same order
 * whichever thread takes it: results are bit-identical to one thread's. A worker joins a job only while it is
 * open: the caller closes it once no item is left and waits only for the workers that joined, so a worker the OS
 * has not scheduled (another process, or another thread pool, spinning on its core) costs nothing. One job runs
 * at a time: a caller that finds the pool busy (a kernel called from a second Python thread: ctypes lets go of
 * the GIL) runs its items itself. A worker spins for pool_spin_ns after a job, then sleeps: Python sets 2 ms for a
 * few-token forward (it calls the pool every ~100 µs) and 0 outside one, so that between the kernels of a prefill
 * chunk no worker spins on a core torch's own threads need (dsv41_set_spin). A spinning worker that finds it was
 * descheduled (another process wants its core) sleeps at once. */
#define POOL_MAX_WORKERS 63
#define POOL_OPEN ((uint64_t)1 << 63)
#define POOL_DESCHEDULED_NS 1000000  /* a gap between two clock reads of a spinning worker that means descheduled */

static _Atomic int64_t pool_spin_ns = 2000000;

/* How long a worker spins for the next job before it sleeps, in ns (negative: 0); a spinning worker sees a new
 * value within a few µs. */
void dsv41_set_spin(int64_t ns) { atomic_store_explicit(&pool_spin_ns, ns < 0 ? 0 : ns, memory_order_relaxed); }
int64_t dsv41_get_spin(void) { return atomic_load_explicit(&pool_spin_ns, memory_order_relaxed); }

typedef void (*pool_fn)(const void *job, int64_t item);

static struct {
    pthread_mutex_t busy;            /* held by the caller running a job (or changing the workers) */
    pthread_mutex_t lock;            /* with wake: sleeping workers */
    pthread_cond_t wake;
    int workers;                     /* running workers */
    int keep;                        /* workers with index >= keep leave (set_threads) */
    int sleepers;
    long sleeps;                     /* times a worker went to sleep (dsv41_pool_sleeps) */
    _Atomic long generation;         /* bumped per job */
    _Atomic uint64_t joined;         /* POOL_OPEN while the job takes workers, plus the number that joined it */
    _Atomic int done;                /* workers that joined and finished */
    _Atomic int64_t next;            /* the next item to take */
    int64_t items;
    pool_fn fn;
    const void *job;
    pthread_t threads[POOL_MAX_WORKERS];
    long born[POOL_MAX_WORKERS];     /* the generation each worker starts after */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void pool_take(void) {
    int64_t i;
    while ((i = atomic_fetch_add_explicit(&pool.next, 1, memory_order_relaxed)) < pool.items) pool.fn(pool.job, i);
}

static void *pool_worker(void *arg) {
    int index = (int)(intptr_t)arg;
    long seen = pool.born[index], g;
    for (;;) {
        int64_t since = 0, last = 0;
        for (unsigned spins = 1; (g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen;
             spins++) {
            cpu_relax();
            if (spins % 256) continue;
            int64_t now = now_ns();
            if (!since) since = now;
            /* Sleep once the spin time is over, or at once when this thread was descheduled between two looks at
             * the clock (256 pauses take ~5-40 µs): another thread or process wants this core, and spinning on it
             * would take the time slices of the thread it waits for (issue 22). */
            if (now - since >= atomic_load_explicit(&pool_spin_ns, memory_order_relaxed)
                || (last && now - last >= POOL_DESCHEDULED_NS)) {
                pthread_mutex_lock(&pool.lock);
                pool.sleepers++;
                pool.sleeps++;
                while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen)
                    pthread_cond_wait(&pool.wake, &pool.lock);
                pool.sleepers--;
                pthread_mutex_unlock(&pool.lock);
            }
            last = now;
        }
        seen = g;
        if (index >= pool.keep) return NULL;  /* set_threads bumps the generation (no job) to say so */
        uint64_t state = atomic_load_explicit(&pool.joined, memory_order_relaxed);
        while (state & POOL_OPEN)  /* join while the job is open; its fields were set before it opened */
            if (atomic_compare_exchange_weak_explicit(&pool.joined, &state, state + 1, memory_order_acquire,
                                                      memory_order_relaxed)) {
                pool_take();
                atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
                break;
            }
    }
}

/* Wakes the workers for the next generation (pool.busy held). */
static void pool_bump(void) {
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_mutex_lock(&pool.lock);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
}

/* fn(job, i) for i in [0, items), on the pool when it has workers, else (or when busy) on the caller. The job's
 * fields are set before it opens (release); a worker reads them after it joins (acquire). The caller takes items
 * too, closes the job when none is left, and waits for the workers that joined. */
static void parallel_for(pool_fn fn, const void *job, int64_t items) {
    if (pool.workers == 0 || items < 2 || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int64_t i = 0; i < items; i++) fn(job, i);
        return;
    }
    pool.fn = fn;
    pool.job = job;
    pool.items = items;
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.joined, POOL_OPEN, memory_order_release);
    pool_bump();
    pool_take();
    int joined = (int)(atomic_fetch_and_explicit(&pool.joined, ~POOL_OPEN, memory_order_acq_rel) & ~POOL_OPEN);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < joined) cpu_relax();
    pthread_mutex_unlock(&pool.busy);
}

/* How many times the pool's workers went to sleep since the library loaded (tests). */
long dsv41_pool_sleeps(void) {
    pthread_mutex_lock(&pool.lock);
    long sleeps = pool.sleeps;
    pthread_mutex_unlock(&pool.lock);
    return sleeps;
}

static void pool_after_fork(void) {  /* the child has no workers (only the forking thread survives a fork) */
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = pool.keep = pool.sleepers = 0;
}

/* Up to `threads` threads in all for the kernels' jobs (the caller + threads - 1 workers, at most
 * POOL_MAX_WORKERS); 1 runs every job on the caller. Returns the threads now used (fewer when a worker could not
 * be started). */
int dsv41_set_threads(int threads) {
    static int forks_handled = 0;
    int want = threads < 1 ? 0 : threads - 1;
    if (want > POOL_MAX_WORKERS) want = POOL_MAX_WORKERS;
    pthread_mutex_lock(&pool.busy);
    if (!forks_handled) forks_handled = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    if (want < pool.workers) {  /* the surplus workers see a new generation with no job open, and leave */
        pool.keep = want;
        pool_bump();
        for (int i = want; i < pool.workers; i++) pthread_join(pool.threads[i], NULL);
        pool.workers = want;
    }
    while (pool.workers < want) {
        int i = pool.workers;
        pool.keep = want;
        pool.born[i] = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (pthread_create(&pool.threads[i], NULL, pool_worker, (void *)(intptr_t)i) != 0) break;
        pool.workers++;
    }
    pool.keep = pool.workers;
    pthread_mutex_unlock(&pool.busy);
    return pool.workers + 1;
}

/* ------------------------------------------------------------------------------------------- FP8 blocks */

/* One row of n values (n % 32 == 0) -> E4M3 codes [n], UE8M0 scales [n / 32], decoded values [n]
 * (quant/fp8.py quantize_fp8_values). */
static void fp8_quantize_row(const float *x, int64_t n, uint8_t *codes, uint8_t *scales, float *values) {
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
static void fp8_dequantize_row(const uint8_t *codes, const uint8_t *scales, int64_t n, float *out) {
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

enum { FMT_E4M3 = 0, FMT_UE8M0 = 1 };

static float fp4_scale_decode(uint8_t b, int fmt) { return fmt == FMT_E4M3 ? e4m3_decode(b) : ue8m0_decode(b); }

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
static void fp4_quantize_row(const float *x, int64_t n, int64_t block, int fmt, uint8_t *codes, uint8_t *scales,
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
static void fp4_dequantize_row(const uint8_t *codes, const uint8_t *scales, int64_t n, int64_t block, int fmt,
                               float *out) {
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
    const uint8_t *codes, *scales;  /* [pages, per_page, width / 2], [pages, per_page, width / block] */
    int64_t pages, per_page, width, block;
    int fmt;
    const int64_t *tables;          /* [rows, table_len]: the pages of each row's entries */
    int64_t table_len, ratio, block_size;
} fp4_pool;

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

/* ------------------------------------------------------------------------------- RoPE, RMSNorm, mHC */

/* Element i of a row of fp32 values, or of bf16 bits widened to fp32 (exact). */
static float load_at(const void *x, int bf16, int64_t i) {
    return bf16 ? from_bits((uint32_t)((const uint16_t *)x)[i] << 16) : ((const float *)x)[i];
}

/* Stores v as element i of a row of fp32 values, or of bf16 bits rounded to nearest even. */
static void store_out(void *out, int64_t at, float v, int bf16) {
    if (bf16)
        ((uint16_t *)out)[at] = bf16_round(v);
    else
        ((float *)out)[at] = v;
}

/* Interleaved RoPE on the last r dims of x [N, H, d] with phases cos / sin [N, r] (rope.py phases: each angle
 * twice, sin negated on the pair's first element): out = x, tail * cos + swap(tail) * sin (sign = -1 negates
 * sin: the inverse rotation). x and out are fp32, or bf16 bits (bf16: the head dims copied, the tail widened,
 * rotated in fp32 and rounded, as rope.py does for bf16). The same two products and one sum per element as
 * rope.py: bit-identical. */
static void rope_rows(const void *x, int bf16, const float *cos_, const float *sin_, int64_t N, int64_t H,
                      int64_t d, int64_t r, int sign, void *out) {
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

/* Eight fp32 lanes as one value (GCC / Clang vector extension): accumulators that stay in registers. Loads go
 * through memcpy, so no alignment is assumed. */
typedef float v8f __attribute__((vector_size(32)));

static v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Sixteen fp32 lanes (split into narrower registers where the machine has none this wide). */
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static v16f load16(const float *p) {
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
static float dot(const float *x, const float *y, int64_t n) {
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

/* 1 / sqrt(mean(x^2) + eps) over n values. */
static float rms_factor(const float *x, int64_t n, float eps) {
    return 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
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

static void hc_mix_item(const void *job, int64_t n) {
    const hc_mix_job *p = job;
    const int64_t hc = p->hc, width = hc * p->D, mixes = (2 + hc) * hc;
    const float *fn = p->fn, *base = p->base, *scale = p->scale;
    float *pre = p->pre, *post = p->post, *comb = p->comb;
    float mix[MAX_HC_MIX * (MAX_HC_MIX + 2)], row[ROW_ON_STACK];  /* the normalized row, on the stack when short */
    float *scratch = width <= ROW_ON_STACK ? row : p->scratch + n * width;
    const float *x = (const float *)p->streams + n * width;
    if (p->bf16) {  /* widened (exactly) in place of the row, then normalized there */
        bf16_row((const uint16_t *)p->streams + n * width, width, scratch);
        x = scratch;
    }
    const float hc_eps = p->hc_eps, f = rms_factor(x, width, p->norm_eps);
    for (int64_t i = 0; i < width; i++) scratch[i] = x[i] * f;
    int64_t k = 0;
    for (; k + 4 <= mixes; k += 4) dot4(scratch, fn + k * width, width, width, mix + k);
    for (; k < mixes; k++) mix[k] = dot(scratch, fn + k * width, width);
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

/* ------------------------------------------------------------------------- attention, MoE router, SwiGLU */

/* MoE router (model/moe.py Gate, text tokens): scores = sqrt(softplus(x @ W^T)) [N, E] of x [N, D], W [E, D];
 * the k experts of largest score + bias[E] (descending, the lower id first on a tie) into indices [N, k], their
 * scores (divided by their sum + 1e-20 when norm_topk) times route_scale into weights [N, k]. x and W are fp32, or
 * bf16 bits (x_bf16 / w_bf16; widened exactly: a bf16 token on the stack, D <= ROW_ON_STACK then, a bf16 W once
 * per call on the heap). scratch: E floats. Returns 0, or -2 (nothing computed) when memory for W cannot be had. */
int dsv41_gate(const void *x, int x_bf16, int64_t N, int64_t D, const void *W, int w_bf16, int64_t E,
               const float *bias, int64_t k, int norm_topk, float route_scale, float *scratch, int64_t *indices,
               float *weights) {
    float x_row[ROW_ON_STACK];  /* a bf16 token widened (D <= ROW_ON_STACK then) */
    float *wide = w_bf16 ? malloc((size_t)(E * D) * sizeof(float)) : NULL;  /* bf16 W widened once per call */
    if (w_bf16 && !wide) return -2;
    if (w_bf16) bf16_row((const uint16_t *)W, E * D, wide);
    const float *Wf = w_bf16 ? wide : (const float *)W;
    for (int64_t n = 0; n < N; n++) {
        const float *xn = (const float *)x + n * D;
        if (x_bf16) {
            bf16_row((const uint16_t *)x + n * D, D, x_row);
            xn = x_row;
        }
        for (int64_t e = 0; e < E; e++) {
            float z = dot(xn, Wf + e * D, D);
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
            if (norm_topk) w = w / (sum + 1e-20f);
            weights[n * k + j] = w * route_scale;
        }
    }
    free(wide);
    return 0;
}

/* silu(min(gate, limit)) * clamp(up, -limit, limit) (model/moe.py clamped_swiglu; limit <= 0: no clamping) of
 * rows gate / up [N, inter] read with row stride `stride` (a fused [N, 2 * inter] projection passes its halves)
 * into out [N, inter]. */
void dsv41_swiglu(const float *gate, const float *up, int64_t N, int64_t inter, int64_t stride, float limit,
                  float *out) {
    for (int64_t n = 0; n < N; n++) {
        for (int64_t i = 0; i < inter; i++) {
            float g = gate[n * stride + i], u = up[n * stride + i];
            if (limit > 0) {
                g = g > limit ? limit : g;
                u = u < -limit ? -limit : (u > limit ? limit : u);
            }
            out[n * inter + i] = g / (1.0f + expf(-g)) * u;
        }
    }
}

/* ------------------------------------------------------------------------------- dense projections (GEMV) */

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

static const void *wrow(const wrows *m, int64_t r) {
    return (const char *)m->w + (m->kind == W_FP4 ? r * m->K / 2 : r * m->K * (m->kind == W_BF16 ? 2 : 4));
}

static const uint8_t *srow(const wrows *m, int64_t r) { return m->kind == W_FP4 ? m->scales + r * (m->K / 32) : 0; }


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
static float weight1(const void *w, const uint8_t *s, int kind, int64_t i) {
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
#define WEIGHTED_SUM(D)                                                                                        \
    static void weighted_sum_##D(const float *s, int64_t n, float top, const float *kb, int64_t L,             \
                                 const float *sel, float *o, float *total) {                                    \
        v16f acc[D / 16];                                                                                      \
        memset(acc, 0, sizeof acc);                                                                            \
        for (int64_t j = 0; j < n; j++) {                                                                      \
            if (s[j] == -INFINITY) continue;                                                                   \
            const float *v = j < L ? kb + j * D : sel + (j - L) * D;                                           \
            float e = expf(s[j] - top);                                                                        \
            *total += e;                                                                                       \
            for (int c = 0; c < D / 16; c++) acc[c] += e * load16(v + 16 * c);                                 \
        }                                                                                                      \
        memcpy(o, acc, sizeof acc);                                                                            \
    }
WEIGHTED_SUM(64)
WEIGHTED_SUM(128)
#undef WEIGHTED_SUM

/* One query token, all its heads: each key row (window key or selected entry) is read once for every head, first
 * for the scores, then for the weighted sum. scratch [H, L + k]: the scores, -inf where masked. */
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
    for (int64_t j = 0; j < n; j++) {
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
        if (d == 64)
            weighted_sum_64(scratch + h * n, n, top[h], kb, L, sel, o, &total[h]);
        else if (d == 128)
            weighted_sum_128(scratch + h * n, n, top[h], kb, L, sel, o, &total[h]);
        else
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


/* The dots of T tokens x [T, K] (rows ldx apart) with 4 weight rows w[0..3] [K] (scales s[0..3] for FP4) of one
 * kind: res [T][4]. One 16-lane accumulator per (token, row), then summed by sum16, then the remaining products
 * one by one. fp32 weights: lane j adds the products i + j, 16 at a time, the last K % 16 one by one. bf16 and FP4
 * weights: 32 at a time, lane j adding the product of weight i + 2j then that of i + 2j + 1 (weight_pairs: half
 * the decoding steps of 16 at a time), the last K % 32 one by one; bf16 and FP4 rows holding the same values give
 * the same bits. Every dot is the same sequence of operations whatever T is and whichever other rows or tokens
 * share the call (a token's projection does not depend on the batch). Each block of weights is loaded (and
 * widened or decoded) once for the T tokens, each token's values once for the 4 rows; the rows `ahead` bytes on
 * are prefetched. Inlined with constant T and kind (dots_block), so the accumulators live in registers. */
static inline __attribute__((always_inline)) void dots_body(const float *x, int64_t ldx, const int T,
                                                            const void *const *w, const uint8_t *const *s,
                                                            const int kind, int64_t K, int64_t ahead, float *res) {
    v16f acc[4][4];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    if (kind == W_FP32) {
        for (; i + 16 <= K; i += 16) {
            v16f w0 = load16((const float *)w[0] + i), w1 = load16((const float *)w[1] + i),
                 w2 = load16((const float *)w[2] + i), w3 = load16((const float *)w[3] + i);
            for (int r = 0; r < 4; r++) __builtin_prefetch((const char *)w[r] + ahead + i * 4);
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
                __builtin_prefetch((const char *)w[r] + ahead + (kind == W_BF16 ? i * 2 : i / 2));
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
}

#define DOTS(T, KIND) \
    static void dots_##T##_##KIND(const float *x, int64_t ldx, const void *const *w, const uint8_t *const *s, \
                                  int64_t K, int64_t ahead, float *res) {                                  \
        dots_body(x, ldx, T, w, s, KIND, K, ahead, res);                                                   \
    }
DOTS(1, 0) DOTS(2, 0) DOTS(3, 0) DOTS(4, 0) DOTS(1, 1) DOTS(2, 1) DOTS(3, 1) DOTS(4, 1)
DOTS(1, 2) DOTS(2, 2) DOTS(3, 2) DOTS(4, 2)
#undef DOTS

typedef void (*dots_fn)(const float *, int64_t, const void *const *, const uint8_t *const *, int64_t, int64_t,
                        float *);
static const dots_fn DOTS_BY[3][5] = {{NULL, dots_1_0, dots_2_0, dots_3_0, dots_4_0},
                                      {NULL, dots_1_1, dots_2_1, dots_3_1, dots_4_1},
                                      {NULL, dots_1_2, dots_2_2, dots_3_2, dots_4_2}};

/* res [N][rows] = the dots of N tokens x [N, K] (rows ldx apart) with rows row .. row + rows - 1 of m, for rows
 * <= 4 (a short block repeats its last row, whose extra results are dropped): blocks of up to 4 tokens. res rows
 * are ldr apart. The next block of rows is prefetched. */
static void dots_block(const float *x, int64_t ldx, int64_t N, const wrows *m, int64_t row, int64_t rows,
                       float *res, int64_t ldr) {
    const void *rp[4];
    const uint8_t *sp[4];
    for (int r = 0; r < 4; r++) {
        rp[r] = wrow(m, row + (r < rows ? r : rows - 1));
        sp[r] = srow(m, row + (r < rows ? r : rows - 1));
    }
    const int64_t block_bytes = (const char *)wrow(m, row + 4) - (const char *)wrow(m, row);
    float part[16];
    for (int64_t n = 0; n < N; n += 4) {
        int64_t T = N - n < 4 ? N - n : 4;
        DOTS_BY[m->kind][T](x + n * ldx, ldx, rp, sp, m->K, n ? 0 : block_bytes, part);
        for (int64_t t = 0; t < T; t++)
            for (int64_t r = 0; r < rows; r++) res[(n + t) * ldr + r] = part[4 * t + r];
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
static void linear_into(const void *x, int x_bf16, int64_t N, int64_t G, int64_t K, const void *W, int w_bf16,
                        int64_t O, void *out, int out_bf16, float *scratch) {
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

/* ------------------------------------------------------------------- attention projections of a few tokens */

/* RMSNorm of rows x [N, D] in place (fp32, or bf16 bits rounded once): (x * rsqrt(mean(x^2) + eps)) * weight, the
 * operations of dsv41_rms_norm / dsv41_rms_norm_bf16 (weight fp32 or bf16 bits like x). row: D floats scratch. */
static void norm_rows(void *x, int bf16, int64_t N, int64_t D, const void *weight, float eps, float *row) {
    for (int64_t n = 0; n < N; n++) {
        void *xn = (char *)x + (size_t)(n * D) * (bf16 ? 2 : 4);
        for (int64_t i = 0; i < D; i++) row[i] = load_at(xn, bf16, i);
        float f = rms_factor(row, D, eps);
        for (int64_t i = 0; i < D; i++) store_out(xn, i, (row[i] * f) * load_at(weight, bf16, i), bf16);
    }
}

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

/* The indexer's queries of model/indexer.py Indexer.queries for a few tokens, one call instead of its chain of
 * small ops: q = upcast(fake_quant_fp4(rope(wq_b q_lat))) [N, H, di] (the fake quant, FP4 with a UE8M0 scale per
 * 32 values, only when fake_quant) and w = upcast(weights_proj x) * scale [N, H]. q_lat [N, qr], x [N, D] and the
 * weights (wq_b [H * di, qr], w_proj [H, D]) are all fp32 or all bf16 bits; q and w are fp32. RoPE on the last r
 * dims with phases cos / sin fp32 [N, r]. bf16: the projections and RoPE rounded where the torch code rounds them
 * (its kernel path's bits), and the fake-quant values rounded to bf16 as its .to(bf16) does before the upcast;
 * fp32: the GEMVs add in another order than ATen's. RoPE and the fake quant are the torch code's operations, so
 * its bits. Returns 0, or -1 when scratch cannot be had. */
int dsv41_indexer_queries(const void *q_lat, const void *x, int bf16, int64_t N, int64_t qr, int64_t D,
                          const void *wq_b, int64_t H, int64_t di, const void *w_proj, const float *cos_,
                          const float *sin_, int64_t r, int fake_quant, float scale, float *q, float *w) {
    int64_t widest = qr > D ? qr : D;
    /* bf16: the GEMVs' widened inputs (N * max(qr, D) floats) and their bf16 outputs (the heads, the weights);
     * fp32: the GEMVs write straight into q and w. */
    float *scratch = bf16 ? malloc((size_t)(N * widest) * sizeof(float)) : NULL;
    uint16_t *heads = bf16 ? malloc((size_t)(N * H * di + N * H) * sizeof(uint16_t)) : NULL;
    if (bf16 && !(scratch && heads)) {
        free(scratch);
        free(heads);
        return -1;
    }
    void *qh = bf16 ? (void *)heads : (void *)q, *wh = bf16 ? (void *)(heads + N * H * di) : (void *)w;
    linear_into(q_lat, bf16, N, 1, qr, wq_b, bf16, H * di, qh, bf16, scratch);
    rope_rows(qh, bf16, cos_, sin_, N, H, di, r, 1, qh);
    if (bf16) bf16_row(heads, N * H * di, q);  /* upcast (exact) */
    if (fake_quant)
        for (int64_t row = 0; row < N * H; row++) {
            float *v = q + row * di;
            /* In place: each block's amax is taken before its values are written, each pair read before written. */
            fp4_quantize_row(v, di, 32, FMT_UE8M0, NULL, NULL, v);
            if (bf16)
                for (int64_t i = 0; i < di; i++) v[i] = from_bits((uint32_t)bf16_round(v[i]) << 16);
        }
    linear_into(x, bf16, N, 1, D, w_proj, bf16, H, wh, bf16, scratch);
    for (int64_t i = 0; i < N * H; i++) w[i] = load_at(wh, bf16, i) * scale;
    free(scratch);
    free(heads);
    return 0;
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
    float gate[16 * 4], up[16 * 4];
    for (int64_t r = r0; r < r1; r += 4) {
        int64_t rows = r1 - r < 4 ? r1 - r : 4;
        for (int64_t n = 0; n < n_e; n += 16) {
            int64_t m = n_e - n < 16 ? n_e - n : 16;
            dots_block(xs + n * j->D, j->D, m, gate_w, g0 + r, rows, gate, 4);
            dots_block(xs + n * j->D, j->D, m, up_w, u0 + r, rows, up, 4);
            for (int64_t t = 0; t < m; t++)
                dsv41_swiglu(gate + 4 * t, up + 4 * t, 1, rows, 4, j->limit, hidden + (n + t) * ldh + r);
        }
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

/* ------------------------------------------------------------------------------ indexer scores from FP4 */

/* One row's index keys in order: entries s = 0, 1, ... of a pool through its block table, as (codes, scales)
 * pointers. A page-aligned pool (block_size = per_page * ratio) is walked page by page, the next page from the next
 * column of the table: the integer divisions come where a walk starts, not per entry or page. */
typedef struct {
    const fp4_pool *p;
    const int64_t *table;  /* this row's */
    int64_t page, slot, col;
    int aligned;
} key_walk;

/* The next entry's codes / scales (*kc, *ks): 0, or -1 when it lies past the block table or its page is out of
 * range. */
static inline int key_next(key_walk *k, int64_t s, const uint8_t **kc, const uint8_t **ks) {
    const fp4_pool *p = k->p;
    if (!k->aligned || k->page < 0 || k->slot == p->per_page) {  /* page -1: a walk that starts at any s */
        if (k->aligned && k->page >= 0) {  /* past a page's last entry: the next column's first */
            k->col++;
            k->slot = 0;
        } else {
            k->col = s * p->ratio / p->block_size;
            k->slot = s % p->per_page;
        }
        k->page = k->col < p->table_len ? k->table[k->col] : -1;
        if (k->page < 0 || k->page >= p->pages) return -1;
    }
    int64_t at = k->page * p->per_page + k->slot++;
    *kc = p->codes + at * (p->width / 2);
    *ks = p->scales + at * (p->width / p->block);
    return 0;
}

/* key_next for entries s .. s + count - 1 (kc[m], ks[m]), on a copy of the walk held in registers (the walk's own
 * fields could alias the pool's, so each step would load them again); in a page-aligned pool, the rest of each
 * page's entries follow by adding the strides. */
static inline int key_run(key_walk *k, int64_t s, int count, const uint8_t **kc, const uint8_t **ks) {
    key_walk w = *k;
    const int64_t code_bytes = w.p->width / 2, scale_bytes = w.p->width / w.p->block;
    for (int m = 0; m < count; m++) {
        if (key_next(&w, s + m, &kc[m], &ks[m]) != 0) return -1;
        for (; w.aligned && m + 1 < count && w.slot < w.p->per_page; m++, w.slot++) {
            kc[m + 1] = kc[m] + code_bytes;
            ks[m + 1] = ks[m] + scale_bytes;
        }
    }
    *k = w;
    return 0;
}

/* Prefetches page `page` of pool p, its codes and scales (nothing when out of range). Always inlined: GCC takes a
 * function of prefetches alone for one without side effects and drops its calls. */
static inline __attribute__((always_inline)) void page_prefetch(const fp4_pool *p, int64_t page) {
    if (page < 0 || page >= p->pages) return;
    const int64_t code_bytes = p->per_page * (p->width / 2), scale_bytes = p->per_page * (p->width / p->block);
    for (int64_t i = 0; i < code_bytes; i += 64) __builtin_prefetch(p->codes + page * code_bytes + i);
    for (int64_t i = 0; i < scale_bytes; i += 64) __builtin_prefetch(p->scales + page * scale_bytes + i);
}

/* Four heads' entries T[i][byte][4 h4 .. 4 h4 + 3] of an index-score lookup table (H4 groups of 4 heads). */
static v4f lut4(const float *table, int64_t i, uint8_t byte, int64_t H4, int64_t h4) {
    v4f v;
    memcpy(&v, table + ((i * 256 + byte) * H4 + h4) * 4, sizeof v);
    return v;
}

#define INDEX_CHUNK 256
#define INDEX_LUT_CHUNK 2048
#define INDEX_PAIR_VECTORS 64  /* queries x heads x blocks of 32 the even / odd path keeps on the stack */

/* Whether a query's H heads of di values fit the even / odd path for keys in UE8M0 blocks of 32 (c queries at once). */
static int index_pairs_fit(const fp4_pool *p, int64_t c, int64_t H) {
    const int64_t nb = p->width / p->block;
    return p->fmt == FMT_UE8M0 && p->block == FP4_ROW_BLOCK && nb <= 4 && c * H * nb <= INDEX_PAIR_VECTORS;
}

/* One query's score of one key on the even / odd path: its heads' values qe / qo [H * nb] (x_pairs), the key's
 * ke / ko [nb] (weight_pairs, the scale folded in), head weights wt [H]. */
static inline __attribute__((always_inline)) float pair_score(const v16f *qe, const v16f *qo, const v16f *ke,
                                                              const v16f *ko, int64_t nb, int64_t H, const float *wt) {
    float acc = 0.0f;
    for (int64_t h = 0; h < H; h++) {
        const int64_t v = h * nb;
        v16f p = qe[v] * ke[0] + qo[v] * ko[0];
        for (int64_t k0 = 1; k0 < nb; k0++) p = p + qe[v + k0] * ke[k0] + qo[v + k0] * ko[k0];
        float d = sum16(p);
        acc += wt[h] * (d < 0.0f ? 0.0f : d);
    }
    return acc;
}

/* pair_score for one block of 32 and 4 heads. With AVX-512 the four heads' 16-lane sums are reduced together
 * (three shuffle-and-add levels for all four, where sum16 takes five steps each): the additions of sum16 in its
 * order, so the same bits. */
static inline __attribute__((always_inline)) float pair_score_4(const v16f *qe, const v16f *qo, const v16f *ke,
                                                                const v16f *ko, const float *wt) {
#if defined(__AVX512F__)
    __m512 p[4];
    for (int h = 0; h < 4; h++) {
        v16f t = qe[h] * ke[0] + qo[h] * ko[0];
        memcpy(&p[h], &t, sizeof t);
    }
    /* lanes i + 8 onto i (sum16's first level), two heads per vector: [h0 | h1], [h2 | h3] */
    __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(p[0], p[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(p[2], p[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(p[2], p[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lanes i + 4 onto i: head h's four partial sums in 128-bit lane h */
    __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a01, a23, _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 t = _mm512_add_ps(q, _mm512_permute_ps(q, _MM_SHUFFLE(1, 0, 3, 2)));  /* q0 + q2, q1 + q3 */
    __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));  /* (q0 + q2) + (q1 + q3) */
    float sums[16], acc = 0.0f;
    _mm512_storeu_ps(sums, u);
    for (int h = 0; h < 4; h++) {
        float d = sums[4 * h];
        acc += wt[h] * (d < 0.0f ? 0.0f : d);
    }
    return acc;
#else
    return pair_score(qe, qo, ke, ko, 1, 4, wt);
#endif
}

#if defined(__AVX512F__)
/* The even / odd path with 16 keys in the lanes of each vector (AVX-512): lane m of every vector belongs to key m,
 * so the 16 lanes of a head's products are 16 vectors added by sum16's tree, one vector addition per step for the
 * 16 keys, where pair_score reduces each key's vector horizontally. Each lane computes what weight_pairs,
 * pair_score and sum16 compute for its key, the same IEEE operations in the same order (no fused multiply-add:
 * -ffp-contract=off): the same bits, but for the sign of a NaN (a NaN scale byte), which x86 takes from one
 * operand or the other as the compiler orders them. */
#define LANE_KEYS 16
#define LANE_AHEAD 64  /* keys whose pages are prefetched ahead of the 16 scored */

/* 16 keys' code bytes and scales: word[k0][w] lane m = bytes 16 k0 + 4w .. 16 k0 + 4w + 3 of key m (byte 16 k0 + l
 * holds elements 32 k0 + 2l, low nibble, and 32 k0 + 2l + 1), scale[k0] lane m = its block k0's UE8M0 scale. */
typedef struct {
    __m512i word[4][4];
    __m512 scale[4];
} lane_keys;

/* Loads lane_keys for the nb blocks of 32 of keys kc[m] / ks[m]. The rows of 16 code bytes go through a 4 x 4
 * transpose of 32-bit words in each 128-bit lane (row i holds keys i, i + 4, i + 8, i + 12), which leaves word w
 * of key m in lane m. The scale bytes are decoded as UE8M0_VALUES (b << 23 is 2**(b - 127) for b = 1 .. 254). */
static inline __attribute__((always_inline)) void lane_load(const uint8_t *const *kc, const uint8_t *const *ks,
                                                            const int nb, lane_keys *k) {
    for (int k0 = 0; k0 < nb; k0++) {
        __m512i row[4];
        for (int i = 0; i < 4; i++) {
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(kc[i] + 16 * k0)));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(kc[i + 4] + 16 * k0)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(kc[i + 8] + 16 * k0)), 2);
            row[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(kc[i + 12] + 16 * k0)), 3);
        }
        __m512i t0 = _mm512_unpacklo_epi32(row[0], row[1]), t1 = _mm512_unpackhi_epi32(row[0], row[1]);
        __m512i t2 = _mm512_unpacklo_epi32(row[2], row[3]), t3 = _mm512_unpackhi_epi32(row[2], row[3]);
        k->word[k0][0] = _mm512_unpacklo_epi64(t0, t2);
        k->word[k0][1] = _mm512_unpackhi_epi64(t0, t2);
        k->word[k0][2] = _mm512_unpacklo_epi64(t1, t3);
        k->word[k0][3] = _mm512_unpackhi_epi64(t1, t3);
        __m512i b = _mm512_set_epi32(ks[15][k0], ks[14][k0], ks[13][k0], ks[12][k0], ks[11][k0], ks[10][k0],
                                     ks[9][k0], ks[8][k0], ks[7][k0], ks[6][k0], ks[5][k0], ks[4][k0], ks[3][k0],
                                     ks[2][k0], ks[1][k0], ks[0][k0]);
        __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(b, 23));
        scale = _mm512_mask_mov_ps(scale, _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512()),
                                   _mm512_set1_ps(UE8M0_VALUES[0]));
        k->scale[k0] = _mm512_mask_mov_ps(scale, _mm512_cmpeq_epi32_mask(b, _mm512_set1_epi32(UE8M0_NAN)),
                                          _mm512_set1_ps(UE8M0_VALUES[UE8M0_NAN]));
    }
}

/* The 16 keys' elements 32 k0 + 2l (*even) and 32 k0 + 2l + 1 (*odd), l < 16: weight_pairs' lane l of block k0,
 * the E2M1 value times the scale. vpermps reads the low 4 bits of each index: byte l shifted down to bit 0 gives
 * the low nibble, 4 bits further the high one. */
static inline __attribute__((always_inline)) void lane_values(const lane_keys *k, int k0, int l, __m512 *even,
                                                              __m512 *odd) {
    const __m512 values = _mm512_loadu_ps(E2M1_VALUES);
    __m512i at = _mm512_srli_epi32(k->word[k0][l / 4], 8 * (l % 4));
    *even = _mm512_mul_ps(_mm512_permutexvar_ps(at, values), k->scale[k0]);
    *odd = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(at, 4), values), k->scale[k0]);
}

/* Lane l's sums p of R heads (query values x + r * di): pair_score's qe * ke + qo * ko, then for each further block
 * p + qe * ke + qo * ko, the query values broadcast. */
static inline __attribute__((always_inline)) void lane_products(const lane_keys *k, const float *x, int64_t di,
                                                                const int R, const int nb, int l, __m512 *p) {
    __m512 even[4], odd[4];
    lane_values(k, 0, l, &even[0], &odd[0]);
    for (int k0 = 1; k0 < nb; k0++) lane_values(k, k0, l, &even[k0], &odd[k0]);
    for (int r = 0; r < R; r++) {
        const float *xr = x + r * di + 2 * l;
        __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(xr[0]), even[0]),
                                 _mm512_mul_ps(_mm512_set1_ps(xr[1]), odd[0]));
        for (int k0 = 1; k0 < nb; k0++)
            v = _mm512_add_ps(_mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(xr[32 * k0]), even[k0])),
                              _mm512_mul_ps(_mm512_set1_ps(xr[32 * k0 + 1]), odd[k0]));
        p[r] = v;
    }
}

/* sum16's tree over the lanes l, depth first so few vectors are live: h_i = p_i + p_(i+8) (lane_pair),
 * q_i = h_i + h_(i+4) (lane_quad), d = (q_0 + q_2) + (q_1 + q_3) (lane_heads). */
static inline __attribute__((always_inline)) void lane_pair(const lane_keys *k, const float *x, int64_t di,
                                                            const int R, const int nb, int i, __m512 *h) {
    __m512 a[4], b[4];
    lane_products(k, x, di, R, nb, i, a);
    lane_products(k, x, di, R, nb, i + 8, b);
    for (int r = 0; r < R; r++) h[r] = _mm512_add_ps(a[r], b[r]);
}

static inline __attribute__((always_inline)) void lane_quad(const lane_keys *k, const float *x, int64_t di,
                                                            const int R, const int nb, int i, __m512 *q) {
    __m512 a[4], b[4];
    lane_pair(k, x, di, R, nb, i, a);
    lane_pair(k, x, di, R, nb, i + 4, b);
    for (int r = 0; r < R; r++) q[r] = _mm512_add_ps(a[r], b[r]);
}

/* acc plus R heads' terms w_h relu(d_h) in head order (pair_score's acc += ...), head weights wt [R]. relu as
 * d < 0 ? 0 : d: a NaN d stays NaN (vmaxps would give 0). */
static inline __attribute__((always_inline)) __m512 lane_heads(const lane_keys *k, const float *x, const float *wt,
                                                               int64_t di, const int R, const int nb, __m512 acc) {
    __m512 a[4], b[4], c[4];
    lane_quad(k, x, di, R, nb, 0, a);
    lane_quad(k, x, di, R, nb, 2, b);
    for (int r = 0; r < R; r++) a[r] = _mm512_add_ps(a[r], b[r]);
    lane_quad(k, x, di, R, nb, 1, b);
    lane_quad(k, x, di, R, nb, 3, c);
    const __m512 zero = _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        __m512 d = _mm512_add_ps(a[r], _mm512_add_ps(b[r], c[r]));
        __m512 relu = _mm512_mask_mov_ps(d, _mm512_cmp_ps_mask(d, zero, _CMP_LT_OQ), zero);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(wt[r]), relu));
    }
    return acc;
}

/* One query's scores of the 16 keys: heads qt [H, di], head weights wt [H] -> out[0 .. 15]. One block (di = 32,
 * the index keys): a head at a time, the 32 decoded vectors hoisted out of the loop by the compiler; more blocks:
 * four heads at a time, so each position's values are decoded once per four heads. */
static inline __attribute__((always_inline)) void lane_scores(const lane_keys *k, const float *qt, const float *wt,
                                                              int64_t H, int64_t di, const int nb, float *out) {
    __m512 acc = _mm512_setzero_ps();
    int64_t h = 0;
    if (nb == 1)
        for (; h < H; h++) acc = lane_heads(k, qt + h * di, wt + h, di, 1, nb, acc);
    else
        for (; h + 4 <= H; h += 4) acc = lane_heads(k, qt + h * di, wt + h, di, 4, nb, acc);
    switch (H - h) {
    case 3: acc = lane_heads(k, qt + h * di, wt + h, di, 3, nb, acc); break;
    case 2: acc = lane_heads(k, qt + h * di, wt + h, di, 2, nb, acc); break;
    case 1: acc = lane_heads(k, qt + h * di, wt + h, di, 1, nb, acc); break;
    }
    _mm512_storeu_ps(out, acc);
}

/* The even / odd path's scores of 16 keys (codes kc[m], scales ks[m], nb blocks of 32) for c queries q [c, H, di]
 * with head weights w [c, H] -> out[t * n + m]. */
static void lane_group(const uint8_t *const *kc, const uint8_t *const *ks, int64_t nb, int64_t c, int64_t H,
                       int64_t di, const float *q, const float *w, int64_t n, float *out) {
    lane_keys k;
    if (nb == 1) {  /* the index keys' shape, compiled with its block count known */
        lane_load(kc, ks, 1, &k);
        for (int64_t t = 0; t < c; t++) lane_scores(&k, q + t * H * di, w + t * H, H, di, 1, out + t * n);
    } else {
        lane_load(kc, ks, (int)nb, &k);
        for (int64_t t = 0; t < c; t++) lane_scores(&k, q + t * H * di, w + t * H, H, di, (int)nb, out + t * n);
    }
}
#endif

/* One query's score (qt [H, di], wt [H]) of one key widened into key [di] (its E2M1 values) with scales ks: each
 * block's dot multiplied by its scale. */
static float widened_score(const float *qt, const float *wt, const float *key, const uint8_t *ks, int64_t H,
                           int64_t di, int64_t block, int fmt) {
    float acc = 0.0f;
    for (int64_t h = 0; h < H; h++) {
        float d = 0.0f;
        for (int64_t k0 = 0; k0 < di / block; k0++)
            d += dot(qt + h * di + k0 * block, key + k0 * block, block) * fp4_scale_decode(ks[k0], fmt);
        acc += wt[h] * (d < 0.0f ? 0.0f : d);
    }
    return acc;
}

/* Index scores of entries 0 .. n-1 of each row straight from its packed FP4 keys (model/indexer.py IndexScorer
 * over PagedContext.index_keys, without materializing the keys): q [B, c, H, di] and w [B, c, H] fp32 ->
 * out [B, c, n] = sum_h w_h relu(q_h . k_s), summed in fp32, each block's dot multiplied by its scale.
 * UE8M0 blocks of 32 (the index keys) with few queries (c * H * di / 32 <= INDEX_PAIR_VECTORS) take the even / odd
 * path: each key's codes decoded once for the row's c queries as even / odd lanes times the scale (weight_pairs),
 * dotted with the queries split the same way and summed by sum16 (pair_score). With AVX-512 it scores 16 keys at
 * a time, one key per vector lane (lane_group: the same operations for each key, so the same bits (NaN signs
 * aside), without a horizontal sum per key and head; 8K keys of the bench's decode query 60 -> 28 µs on one
 * thread), and the last n % 16 keys of a chunk one or two at a time. Otherwise long rows (lut: n >= 1024) with
 * a small table (di / 2 * 256 * H <= 65536 floats) go through a lookup table per query:
 * T[i][byte][h] = q_h[2i] e(byte & 15) + q_h[2i + 1] e(byte >> 4), so a key costs one vector load and add per code
 * byte for 4 heads at once (table scratch: di / 2 * 256 * ceil(H / 4) * 4 floats); else each key's codes are
 * widened into scratch (di floats) and each block's dot multiplied by its scale. Items of the pool: a row's keys
 * in chunks of INDEX_CHUNK (INDEX_LUT_CHUNK with a table, built per item). visible [B, c] (or NULL): the scores of
 * entries from a query's visible count on read -inf (model/indexer.py mask_invisible). Returns 0, -1 when an entry
 * lies past its block table or its page is out of range (nothing else is guaranteed written then), -2 when the
 * scratch cannot be had. */

typedef struct {
    fp4_pool p;  /* width: di */
    int64_t c, H, n, chunk, chunks;
    int lut;
    const float *q, *w;
    float *out;
    _Atomic int status;
} index_job;

static void index_item(const void *job, int64_t item) {
    const index_job *j = job;
    const int64_t b = item / j->chunks, s0 = item % j->chunks * j->chunk;
    const int64_t s1 = s0 + j->chunk < j->n ? s0 + j->chunk : j->n;
    const int64_t di = j->p.width, block = j->p.block, c = j->c, H = j->H, n = j->n, fmt = j->p.fmt;
    const int64_t H4 = (H + 3) / 4, nb = di / block, half = block / 2;
    float *key = malloc((size_t)(j->lut ? di / 2 * 256 * H4 * 4 : di) * sizeof(float)), *table = key;
    if (!key) {
        atomic_store(&((index_job *)j)->status, -2);
        return;
    }
    key_walk walk = {.p = &j->p, .table = j->p.tables + b * j->p.table_len, .page = -1,
                     .aligned = j->p.per_page * j->p.ratio == j->p.block_size};
    if (j->lut) {
        for (int64_t t = 0; t < c; t++) {
            const float *qt = j->q + (b * c + t) * H * di, *wt = j->w + (b * c + t) * H;
            for (int64_t i = 0; i < di / 2; i++) {
                float qe[64], qo[64];  /* the heads' pair of query values at code byte i (H <= 64) */
                for (int64_t h = 0; h < H4 * 4; h++) {
                    qe[h] = h < H ? qt[h * di + 2 * i] : 0.0f;
                    qo[h] = h < H ? qt[h * di + 2 * i + 1] : 0.0f;
                }
                for (int64_t byte = 0; byte < 256; byte++) {
                    float *e = table + (i * 256 + byte) * H4 * 4, lo = FP4_PAIRS[byte][0], hi = FP4_PAIRS[byte][1];
                    for (int64_t h = 0; h < H4 * 4; h++) e[h] = qe[h] * lo + qo[h] * hi;
                }
            }
            walk.page = -1;
            for (int64_t s = s0; s < s1; s++) {
                const uint8_t *kc, *ks;
                if (key_next(&walk, s, &kc, &ks) != 0) goto past_table;
                v4f acc[16] = {{0}};
                for (int64_t k0 = 0; k0 < nb; k0++) {
                    float sc = fp4_scale_decode(ks[k0], fmt);
                    for (int64_t h4 = 0; h4 < H4; h4++) {
                        /* four partial sums: independent chains of additions, kept in registers */
                        v4f p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
                        int64_t i = k0 * half, end = (k0 + 1) * half;
                        for (; i + 4 <= end; i += 4) {
                            p0 += lut4(table, i, kc[i], H4, h4);
                            p1 += lut4(table, i + 1, kc[i + 1], H4, h4);
                            p2 += lut4(table, i + 2, kc[i + 2], H4, h4);
                            p3 += lut4(table, i + 3, kc[i + 3], H4, h4);
                        }
                        for (; i < end; i++) p0 += lut4(table, i, kc[i], H4, h4);
                        acc[h4] += ((p0 + p1) + (p2 + p3)) * sc;
                    }
                }
                float score = 0.0f;
                for (int64_t h = 0; h < H; h++) {
                    float d = acc[h / 4][h % 4];
                    score += wt[h] * (d < 0.0f ? 0.0f : d);
                }
                j->out[(b * c + t) * n + s] = score;
            }
        }
        free(key);
        return;
    }
    if (index_pairs_fit(&j->p, c, H)) {
        /* UE8M0 blocks of 32 (the index keys' format) and few queries: each key decoded 32 values at a time as
         * even / odd lanes (weight_pairs, the scale folded in), dotted with the queries split the same way */
        v16f qe[INDEX_PAIR_VECTORS], qo[INDEX_PAIR_VECTORS];
        for (int64_t v = 0; v < c * H * nb; v++) x_pairs(j->q + b * c * H * di + v * FP4_ROW_BLOCK, &qe[v], &qo[v]);
        int64_t s = s0;
#if defined(__AVX512F__)
        /* The pages of the table's next columns, LANE_AHEAD keys ahead, are prefetched: pages in no particular order
         * defeat the hardware prefetcher (cold keys in pages of random order: 8K keys 180 -> 80 µs on one thread;
         * pages in order: no change; keys in cache: 5-10% slower) */
        const int64_t ahead = LANE_AHEAD * j->p.ratio / j->p.block_size + 1;  /* columns */
        int64_t fetched = -1;  /* the last column whose page was prefetched */
        for (; s + LANE_KEYS <= s1; s += LANE_KEYS) {  /* 16 keys at a time in lanes, the rest one or two at once */
            const uint8_t *kc[LANE_KEYS], *ks[LANE_KEYS];
            if (key_run(&walk, s, LANE_KEYS, kc, ks) != 0) goto past_table;
            for (fetched = fetched < walk.col ? walk.col : fetched;
                 fetched < walk.col + ahead && fetched + 1 < j->p.table_len; fetched++)
                page_prefetch(&j->p, walk.table[fetched + 1]);
            lane_group(kc, ks, nb, c, H, di, j->q + b * c * H * di, j->w + b * c * H, n, j->out + b * c * n + s);
        }
#endif
        if (nb == 1 && H == 4 && c == 1)  /* one decode query: two keys per pass, independent work side by side */
            for (; s + 2 <= s1; s += 2) {
                const uint8_t *kc0, *ks0, *kc1, *ks1;
                if (key_next(&walk, s, &kc0, &ks0) != 0 || key_next(&walk, s + 1, &kc1, &ks1) != 0) goto past_table;
                v16f ke0, ko0, ke1, ko1;
                weight_pairs(kc0, ks0, W_FP4, 0, &ke0, &ko0);
                weight_pairs(kc1, ks1, W_FP4, 0, &ke1, &ko1);
                j->out[b * n + s] = pair_score_4(qe, qo, &ke0, &ko0, j->w + b * 4);
                j->out[b * n + s + 1] = pair_score_4(qe, qo, &ke1, &ko1, j->w + b * 4);
            }
        for (; s < s1; s++) {
            const uint8_t *kc, *ks;
            if (key_next(&walk, s, &kc, &ks) != 0) goto past_table;
            v16f ke[4], ko[4];
            for (int64_t k0 = 0; k0 < nb; k0++) weight_pairs(kc, ks, W_FP4, k0 * FP4_ROW_BLOCK, &ke[k0], &ko[k0]);
            if (nb == 1 && H == 4)  /* the bench config's shape, unrolled with its vectors in registers (same sums) */
                for (int64_t t = 0; t < c; t++)
                    j->out[(b * c + t) * n + s] = pair_score_4(qe + t * 4, qo + t * 4, ke, ko,
                                                               j->w + (b * c + t) * 4);
            else
                for (int64_t t = 0; t < c; t++)
                    j->out[(b * c + t) * n + s] = pair_score(qe + t * H * nb, qo + t * H * nb, ke, ko, nb, H,
                                                             j->w + (b * c + t) * H);
        }
        free(key);
        return;
    }
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *kc, *ks;
        if (key_next(&walk, s, &kc, &ks) != 0) goto past_table;
        for (int64_t i = 0; i < di / 2; i++) memcpy(key + 2 * i, FP4_PAIRS[kc[i]], sizeof FP4_PAIRS[0]);
        for (int64_t t = 0; t < c; t++)
            j->out[(b * c + t) * n + s] = widened_score(j->q + (b * c + t) * H * di, j->w + (b * c + t) * H, key, ks,
                                                        H, di, block, fmt);
    }
    free(key);
    return;
past_table:
    atomic_store(&((index_job *)j)->status, -1);
    free(key);
}

int dsv41_index_scores(const uint8_t *codes, const uint8_t *scales, int64_t pages, int64_t per_page, int64_t di,
                       int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                       int64_t block_size, const float *q, const float *w, int64_t B, int64_t c, int64_t H, int64_t n,
                       int lut, const int64_t *visible, float *out) {
    const fp4_pool pool = {codes, scales, pages, per_page, di, block, fmt, tables, table_len, ratio, block_size};
    /* The even / odd path where it fits: with AVX-512 ~5x faster than a table (bench decode shape, 8K keys); without,
     * ~1.5x slower, but the same sums whatever the build. */
    if (index_pairs_fit(&pool, c, H)) lut = 0;
    int64_t chunk = lut ? INDEX_LUT_CHUNK : INDEX_CHUNK, chunks = n > 0 ? (n + chunk - 1) / chunk : 0;
    index_job job = {pool, c, H, n, chunk, chunks, lut, q, w, out, 0};
    parallel_for(index_item, &job, B * chunks);
    if (visible)  /* mask_invisible: -inf from each query's visible count on */
        for (int64_t r = 0; r < B * c; r++)
            for (int64_t s = visible[r] < 0 ? 0 : visible[r]; s < n; s++) out[r * n + s] = -INFINITY;
    return atomic_load(&job.status);
}

/* -------------------------------------------------------------------------------------- prefetch hints */

/* Prefetches the two cache lines at each of addr [n] (model/warm.py: the Python objects a few-token forward of a
 * block is about to read, which the previous layers' weights evicted). Only hints: a prefetch reads nothing and
 * never faults, so a stale or invalid address costs a wasted line at most. */
void dsv41_prefetch(const int64_t *addr, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        __builtin_prefetch((const char *)(intptr_t)addr[i], 0, 3);
        __builtin_prefetch((const char *)(intptr_t)addr[i] + 64, 0, 3);
    }
}

/* ------------------------------------------------------------------------------------------ indexer top-k */

/* Restores the min-heap h [n] below position i. */
static void sift_down(float *h, int64_t n, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && h[l] < h[m]) m = l;
        if (r < n && h[r] < h[m]) m = r;
        if (m == i) return;
        float t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* model/indexer.py topk_set for scores [R, N] fp32: per row the indices [k] (ascending) of the k largest scores,
 * ties at the k-th value going to the lowest indices; with drop_neg_inf, an index whose score is -inf reads -1
 * (topk_entries). The k-th largest value comes from a min-heap of k scores (heap: k floats). Indices only, so the
 * result is the torch code's exactly. Returns 0, or -1 (the row's output unspecified) when a row holds a NaN
 * (torch.topk ranks NaN above everything; the caller takes the torch code), -2 when k > N. */
typedef struct {
    const float *scores;
    int64_t N, k;
    int drop_neg_inf;
    float *heap;
    int64_t *out;
    _Atomic int status;
} topk_job;

#define TOPK_RUN 16  /* scores checked at once (one AVX-512 compare) before any is looked at alone */

/* Whether any of x[0 .. n-1] is above t (or, with or_equal, equal to it); n <= TOPK_RUN. */
static inline int any_above(const float *x, int64_t n, float t, int or_equal) {
#if defined(__AVX512F__)
    if (n == TOPK_RUN)
        return or_equal ? _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(t), _CMP_GE_OQ) != 0
                        : _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#endif
    int any = 0;
    for (int64_t j = 0; j < n; j++) any |= or_equal ? x[j] >= t : x[j] > t;
    return any;
}

/* The top-k rule of one row x [N] into o [k] (heap: k floats); 0, or -1 (o unspecified) when x holds a NaN.
 * Runs of TOPK_RUN scores are checked at once against the heap's minimum (which only rises), so the scores that
 * cannot enter the heap, or cannot be picked, are passed over without a branch each: the same heap, the same
 * picks. */
static int topk_row(const float *x, int64_t N, int64_t k, int drop_neg_inf, float *heap, int64_t *o) {
    if (k == 0) return 0;
    int nan = 0;
    for (int64_t i = 0; i < N; i++) nan |= x[i] != x[i];
    if (nan) return -1;
    for (int64_t i = 0; i < k; i++) heap[i] = x[i];
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
    for (int64_t i = k; i < N; i += TOPK_RUN) {
        const int64_t n = N - i < TOPK_RUN ? N - i : TOPK_RUN;
        if (!any_above(x + i, n, heap[0], 0)) continue;
        for (int64_t j = i; j < i + n; j++)
            if (x[j] > heap[0]) {
                heap[0] = x[j];
                sift_down(heap, k, 0);
            }
    }
    float kth = heap[0];
    int64_t greater = 0;
    for (int64_t i = 0; i < N; i++) greater += x[i] > kth;
    int64_t ties = k - greater, m = 0;
    for (int64_t i = 0; i < N && m < k; i += TOPK_RUN) {
        const int64_t n = N - i < TOPK_RUN ? N - i : TOPK_RUN;
        if (!any_above(x + i, n, kth, 1)) continue;
        for (int64_t j = i; j < i + n && m < k; j++)
            if (x[j] > kth || (x[j] == kth && ties-- > 0)) o[m++] = drop_neg_inf && x[j] == -INFINITY ? -1 : j;
    }
    return 0;
}

static void topk_item(const void *job, int64_t r) {
    const topk_job *j = job;
    if (topk_row(j->scores + r * j->N, j->N, j->k, j->drop_neg_inf, j->heap + r * j->k, j->out + r * j->k) != 0)
        atomic_store(&((topk_job *)j)->status, -1);
}

int dsv41_topk_set(const float *scores, int64_t R, int64_t N, int64_t k, int drop_neg_inf, float *heap,
                   int64_t *out) {
    if (k > N) return -2;
    topk_job job = {scores, N, k, drop_neg_inf, heap, out, 0};
    parallel_for(topk_item, &job, R);  /* one row per item; heap [R, k] */
    return atomic_load(&job.status);
}

/* x.max(dim=-1).indices of fp32 rows x [R, V] (V >= 1; engine/sampler.py argmax): per row the first index of the
 * largest value, NaN counting as the largest (the first NaN, when there is one). Two passes per row: a vectorized
 * one for the largest value and whether a NaN is present, then a scalar search for the first index holding it;
 * comparisons only, so exactly torch's indices. Rows over the pool. */
typedef struct {
    const float *x;
    int64_t V;
    int64_t *out;
} argmax_job;

static void argmax_item(const void *job, int64_t r) {
    const argmax_job *j = job;
    const int64_t V = j->V;
    const float *x = j->x + r * V;
    float m = x[0];
    int nan = x[0] != x[0];
    int64_t i = 1;
#if defined(__AVX512F__)
    if (V >= 16) {
        __m512 best = _mm512_loadu_ps(x);
        __mmask16 odd = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= V; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            odd |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            best = _mm512_max_ps(best, v);
        }
        nan |= odd != 0;
        m = _mm512_reduce_max_ps(best);
    }
#endif
    for (; i < V; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    int64_t at = 0;
    if (nan) {
        while (x[at] == x[at]) at++;
    } else {
        while (x[at] != m) at++;
    }
    j->out[r] = at;
}

void dsv41_argmax(const float *x, int64_t R, int64_t V, int64_t *out) {
    argmax_job job = {x, V, out};
    parallel_for(argmax_item, &job, R);
}

/* ------------------------------------------------------------------------------------ candidate pool */

/* model/indexer.py candidate_blocks for scores [R, N] (already -inf where not visible) and visible counts [R]:
 * per row the block maxima over blocks of `block` entries (the last one short when N is not a multiple), the block
 * of the newest visible entry forced (+inf) when any is visible, the top min(keep, nblocks) blocks by topk_row's
 * rule, and mask [R, nblocks] (0 / 1 bytes) set on the chosen blocks whose maximum is above -inf. Comparisons only:
 * the torch code's mask exactly. Returns 0, -1 when a row holds a NaN (the caller takes the torch code), -2 when
 * the scratch cannot be had. */
typedef struct {
    const float *scores;
    const int64_t *visible;
    int64_t N, block, nblocks, keep;
    uint8_t *mask;
    _Atomic int status;
} blocks_job;

static void blocks_item(const void *job, int64_t r) {
    const blocks_job *j = job;
    const int64_t N = j->N, block = j->block, nb = j->nblocks, keep = j->keep, vis = j->visible[r];
    const float *x = j->scores + r * N;
    uint8_t *mask = j->mask + r * nb;
    const size_t floats = (size_t)(nb + keep + 1) & ~(size_t)1;  /* even: the int64 part after them is aligned */
    float *best = malloc(floats * sizeof(float) + (size_t)keep * sizeof(int64_t));
    if (!best) {
        atomic_store(&((blocks_job *)j)->status, -2);
        return;
    }
    float *heap = best + nb;
    int64_t *chosen = (int64_t *)(best + floats);
    for (int64_t i = 0; i < nb; i++) {
        float m = -INFINITY;
        for (int64_t s = i * block; s < (i + 1) * block && s < N; s++) {
            if (x[s] != x[s]) goto nan;
            if (x[s] > m) m = x[s];
        }
        best[i] = m;
    }
    if (vis > 0 && (vis - 1) / block < nb) best[(vis - 1) / block] = INFINITY;
    memset(mask, 0, (size_t)nb);
    topk_row(best, nb, keep, 0, heap, chosen);
    for (int64_t i = 0; i < keep; i++) mask[chosen[i]] = best[chosen[i]] > -INFINITY;
    free(best);
    return;
nan:
    atomic_store(&((blocks_job *)j)->status, -1);
    free(best);
}

int dsv41_candidate_blocks(const float *scores, const int64_t *visible, int64_t R, int64_t N, int64_t block,
                           int64_t keep, uint8_t *mask) {
    const int64_t nb = (N + block - 1) / block;
    blocks_job job = {scores, visible, N, block, nb, keep < nb ? keep : nb, mask, 0};
    parallel_for(blocks_item, &job, R);  /* one row per item */
    return atomic_load(&job.status);
}

/* A Reindex layer's top-k inside its candidate pool (model/attention.py Attention.select): for query r = (b, t)
 * the pool's blocks from mask [R, nblocks] as pool_entries takes them (the top min(keep, nblocks) of the 0 / 1
 * mask by topk_row's rule: the chosen blocks, then the lowest others, ascending), its entries' scores straight
 * from the packed FP4 index keys (as dsv41_index_scores scores them for one query: the even / odd path where
 * index_pairs_fit, else the widening path), -inf for entries of unchosen blocks, at or past n, or at or past
 * visible[r]; then the top k of those keep * block scores by topk_row's rule (drop_neg_inf), as global entry ids
 * out [R, k] (-1 where the pick is -inf). With AVX-512 the even / odd path scores 16 entries at a time in lanes
 * (lane_group). Scratch per query: keep * block + di + k + 1 floats, keep int64, 2 keep * block pointers.
 * Returns 0, -1 when an entry lies past its block table or its page is out of range, -2 when the scratch cannot
 * be had, -3 when a score is NaN (the caller takes the torch code, whose top-k ranks NaN first). */
typedef struct {
    fp4_pool p;  /* width: di */
    int64_t c, H, n, nblocks, block, keep, k;
    const uint8_t *mask;
    const int64_t *visible;
    const float *q, *w;
    int64_t *out;
    _Atomic int status;
} pool_job;

static void pool_item(const void *job, int64_t r) {
    const pool_job *j = job;
    const int64_t b = r / j->c, nb = j->nblocks, block = j->block, keep = j->keep, k = j->k, M = keep * block;
    const int64_t di = j->p.width, H = j->H, n = j->n, vis = j->visible[r] < n ? j->visible[r] : n;
    const uint8_t *mask = j->mask + r * nb;
    const float *qt = j->q + r * H * di, *wt = j->w + r * H;
    const size_t floats = (size_t)(M + di + k + 1) & ~(size_t)1;  /* even: the int64 part after them is aligned */
    float *scores = malloc(floats * sizeof(float) + (size_t)keep * sizeof(int64_t) + 2 * (size_t)M * sizeof(void *));
    if (!scores) {
        atomic_store(&((pool_job *)j)->status, -2);
        return;
    }
    float *key = scores + M, *heap = key + di;
    int64_t *chosen = (int64_t *)(scores + floats), *o = j->out + r * k;
    const uint8_t **kc = (const uint8_t **)(chosen + keep), **ks = kc + M;  /* each entry's key; NULL: not scored */
    int64_t set = 0, m = 0;
    for (int64_t i = 0; i < nb; i++) set += mask[i] != 0;
    int64_t others = keep - (set < keep ? set : keep);  /* unchosen blocks that fill the pool (pool_entries) */
    for (int64_t i = 0, taken = 0; i < nb && m < keep; i++)
        if (mask[i] ? taken++ < keep : others-- > 0) chosen[m++] = mask[i] ? i : -1 - i;
    const int pairs = index_pairs_fit(&j->p, 1, H);
    v16f qe[INDEX_PAIR_VECTORS], qo[INDEX_PAIR_VECTORS];
    if (pairs)
        for (int64_t v = 0; v < H * (di / FP4_ROW_BLOCK); v++) x_pairs(qt + v * FP4_ROW_BLOCK, &qe[v], &qo[v]);
    key_walk walk = {.p = &j->p, .table = j->p.tables + b * j->p.table_len, .page = -1,
                     .aligned = j->p.per_page * j->p.ratio == j->p.block_size};
    for (int64_t i = 0; i < keep; i++) {
        walk.page = -1;  /* the pool's blocks are not consecutive */
        for (int64_t e = 0; e < block; e++) {
            const int64_t s = chosen[i] * block + e, at = i * block + e;
            kc[at] = ks[at] = NULL;
            if (chosen[i] >= 0 && s < vis && key_next(&walk, s, &kc[at], &ks[at]) != 0) {
                atomic_store(&((pool_job *)j)->status, -1);
                free(scores);
                return;
            }
        }
    }
    int64_t at = 0;
#if defined(__AVX512F__)
    if (pairs)  /* 16 entries at a time in lanes (an entry not scored reads zero codes meanwhile) */
        for (; at + LANE_KEYS <= M; at += LANE_KEYS) {
            static const uint8_t zeros[64];  /* a key's codes and scales: di / 2 <= 64 bytes, di / 32 <= 4 */
            const uint8_t *kc16[LANE_KEYS], *ks16[LANE_KEYS];
            for (int m16 = 0; m16 < LANE_KEYS; m16++) {
                kc16[m16] = kc[at + m16] ? kc[at + m16] : zeros;
                ks16[m16] = ks[at + m16] ? ks[at + m16] : zeros;
            }
            lane_group(kc16, ks16, di / FP4_ROW_BLOCK, 1, H, di, qt, wt, M, scores + at);
        }
#endif
    for (; at < M; at++) {
        if (!kc[at]) continue;
        if (pairs) {
            v16f ke[4], ko[4];
            for (int64_t k0 = 0; k0 < di / FP4_ROW_BLOCK; k0++)
                weight_pairs(kc[at], ks[at], W_FP4, k0 * FP4_ROW_BLOCK, &ke[k0], &ko[k0]);
            scores[at] = pair_score(qe, qo, ke, ko, di / FP4_ROW_BLOCK, H, wt);
        } else {
            for (int64_t h = 0; h < di / 2; h++) memcpy(key + 2 * h, FP4_PAIRS[kc[at][h]], sizeof FP4_PAIRS[0]);
            scores[at] = widened_score(qt, wt, key, ks[at], H, di, j->p.block, j->p.fmt);
        }
    }
    for (at = 0; at < M; at++)
        if (!kc[at]) scores[at] = -INFINITY;
    if (topk_row(scores, M, k, 1, heap, o) != 0) {
        atomic_store(&((pool_job *)j)->status, -3);
        free(scores);
        return;
    }
    for (int64_t i = 0; i < k; i++)
        if (o[i] >= 0) o[i] = chosen[o[i] / block] * block + o[i] % block;
    free(scores);
}

int dsv41_pool_select(const uint8_t *codes, const uint8_t *scales, int64_t pages, int64_t per_page, int64_t di,
                      int64_t block, int fmt, const int64_t *tables, int64_t table_len, int64_t ratio,
                      int64_t block_size, const float *q, const float *w, int64_t B, int64_t c, int64_t H, int64_t n,
                      const uint8_t *mask, int64_t nblocks, int64_t pool_block, int64_t keep,
                      const int64_t *visible, int64_t k, int64_t *out) {
    keep = keep < nblocks ? keep : nblocks;
    if (k > keep * pool_block) return -4;
    pool_job job = {{codes, scales, pages, per_page, di, block, fmt, tables, table_len, ratio, block_size}, c, H, n,
                    nblocks, pool_block, keep, k, mask, visible, q, w, out, 0};
    parallel_for(pool_item, &job, B * c);  /* one query per item */
    return atomic_load(&job.status);
}

/* The thread pool of the library (parallel_for: the items of a job over worker threads beside the caller) and
 * prefetch hints. */
#include "dsv41.h"

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
void parallel_for(pool_fn fn, const void *job, int64_t items) {
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

/* The thread pool every kernel runs on (kernels.h): persistent workers that spin briefly,
 * then sleep, waiting for the next run, because a decode step issues hundreds of short
 * runs; and the count of physical cores the default size comes from. */

#include "blade/kernels.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* Persistent workers wait for a new generation number. A decode step issues hundreds of
 * small runs back to back, so waiting starts with a spin (a run costs a cache-line
 * handoff, no syscall); a worker that sees nothing for SPIN_NS blocks on a condition
 * variable, so an idle pool costs no CPU. Waking a blocked worker costs tens of
 * microseconds, which the spin keeps out of the gaps inside a forward pass. The caller
 * waits for completion the same way. The budget is time, not iterations, because the
 * pause instruction's latency differs tenfold between CPUs. */
#define SPIN_NS 200000u

typedef struct worker {
    blade_threadpool *pool;
    int ith;
    pthread_t thread;
} worker;

struct blade_threadpool {
    int n;
    worker *workers; /* n - 1 of them; the caller is thread 0 */

    void (*fn)(void *ctx, int ith, int nth);
    void *ctx;
    _Atomic bool stop;
    /* Spinning workers read gen while finishing ones write pending: separate cache lines
     * keep each finish from disturbing the others' spin. */
    _Alignas(64) _Atomic unsigned gen;
    _Alignas(64) _Atomic int pending; /* workers still running the current generation */

    /* Sleepers announce themselves before their final check under the mutex; the side
     * that changes the state reads the count after its change and wakes them only if
     * needed (sequentially consistent atomics make one of the two see the other). */
    _Alignas(64) _Atomic int sleepers;
    _Atomic bool caller_sleeping;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    pthread_cond_t done;

    pthread_mutex_t run_mu; /* serializes runs from different caller threads */
};

/* The pool whose run this thread is inside, so a nested run executes inline instead of
 * waiting on workers that are busy running its parent. */
static _Thread_local const blade_threadpool *current_pool;

typedef struct spin {
    unsigned iter;
    uint64_t start_ns;
} spin;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* One more round of waiting; false once the spin budget is spent. The clock is read
 * every 64 rounds only. */
static bool spin_again(spin *s)
{
    cpu_relax();
    if (++s->iter % 64)
        return true;
    uint64_t t = now_ns();
    if (!s->start_ns)
        s->start_ns = t;
    return t - s->start_ns < SPIN_NS;
}

static void finish_one(blade_threadpool *p)
{
    if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_sleeping)) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
}

static unsigned wait_generation(blade_threadpool *p, unsigned seen)
{
    spin s = {0, 0};
    do {
        unsigned g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen)
            return g;
    } while (spin_again(&s));
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleepers, 1);
    unsigned g;
    while ((g = atomic_load(&p->gen)) == seen)
        pthread_cond_wait(&p->wake, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->mu);
    return g;
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    blade_threadpool *p = w->pool;
    unsigned seen = 0;
    for (;;) {
        seen = wait_generation(p, seen);
        if (atomic_load(&p->stop))
            return NULL;
        current_pool = p;
        p->fn(p->ctx, w->ith, p->n);
        current_pool = NULL;
        finish_one(p);
    }
}

static void publish(blade_threadpool *p)
{
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_seq_cst);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
}

blade_threadpool *blade_threadpool_new(int n_threads)
{
    if (n_threads <= 0)
        n_threads = blade_physical_cores();
    blade_threadpool *p = aligned_alloc(_Alignof(blade_threadpool), sizeof *p);
    if (!p)
        return NULL;
    memset(p, 0, sizeof *p);
    p->n = n_threads;
    p->workers = calloc((size_t)n_threads, sizeof *p->workers);
    if (!p->workers) {
        free(p);
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    pthread_mutex_init(&p->run_mu, NULL);
    for (int i = 1; i < n_threads; i++) {
        worker *w = &p->workers[i];
        w->pool = p;
        w->ith = i;
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            /* Fewer threads than asked is still a working pool. */
            p->n = i;
            break;
        }
    }
    return p;
}

void blade_threadpool_free(blade_threadpool *p)
{
    if (!p)
        return;
    atomic_store(&p->stop, true);
    publish(p);
    for (int i = 1; i < p->n; i++)
        pthread_join(p->workers[i].thread, NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->run_mu);
    free(p->workers);
    free(p);
}

int blade_threadpool_size(const blade_threadpool *p)
{
    return p->n;
}

void blade_threadpool_run(blade_threadpool *p, void (*fn)(void *ctx, int ith, int nth), void *ctx)
{
    if (p->n == 1 || current_pool == p) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&p->run_mu);
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->pending, p->n - 1);
    publish(p);

    const blade_threadpool *outer = current_pool;
    current_pool = p;
    fn(ctx, 0, p->n);
    current_pool = outer;

    spin s = {0, 0};
    while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) {
        if (spin_again(&s))
            continue;
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_sleeping, true);
        while (atomic_load(&p->pending) > 0)
            pthread_cond_wait(&p->done, &p->mu);
        atomic_store(&p->caller_sleeping, false);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&p->run_mu);
}

typedef struct alone_call {
    void (*fn)(void *ctx);
    void *ctx;
} alone_call;

static void run_on_thread0(void *ctx, int ith, int nth)
{
    (void)nth;
    const alone_call *c = ctx;
    if (ith == 0)
        c->fn(c->ctx);
}

void blade_threadpool_run_alone(blade_threadpool *p, void (*fn)(void *ctx), void *ctx)
{
    alone_call c = {fn, ctx};
    blade_threadpool_run(p, run_on_thread0, &c);
}

/* ---- core count ---- */

static int read_int_file(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    int v = -1;
    if (fscanf(f, "%d", &v) != 1)
        v = -1;
    fclose(f);
    return v;
}

/* Distinct (package, core) pairs among the CPUs this process may run on: SMT siblings
 * share a core's execution units, so more threads than cores only adds contention. */
int blade_physical_cores(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    int allowed = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int fallback = allowed > 0 ? allowed : online > 0 ? (int)online : 1;

    enum { MAX_CORES = 1024 };
    int64_t keys[MAX_CORES];
    int n_keys = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (allowed > 0 && !CPU_ISSET(cpu, &set))
            continue;
        if (allowed <= 0 && cpu >= online)
            break;
        char path[128];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/core_id", cpu);
        int core = read_int_file(path);
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", cpu);
        int pkg = read_int_file(path);
        if (core < 0 || pkg < 0)
            return fallback;
        int64_t key = (int64_t)pkg << 32 | (uint32_t)core;
        bool seen = false;
        for (int i = 0; i < n_keys && !seen; i++)
            seen = keys[i] == key;
        if (!seen) {
            if (n_keys == MAX_CORES)
                return fallback;
            keys[n_keys++] = key;
        }
    }
    return n_keys > 0 ? n_keys : fallback;
}

/* The thread pool and work sharing: many short runs back to back, each thread's share of
 * a partition, nested runs executing inline, runs alone on the caller, several callers at
 * once, idle pools that sleep and free cleanly, the caller blocking until a run ends, the
 * default size, and work sharing handing out every unit exactly once. */
#include "testutil.h"

#include "blade/kernels.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_THREADS 8

typedef struct coverage {
    int nth_expected;
    _Atomic int calls[MAX_THREADS];
    _Atomic int bad_nth;
    _Atomic int bad_ith;
    int run_mask[MAX_THREADS]; /* written by thread ith only: the last run it saw */
    int run;
} coverage;

static void count(void *ctx, int ith, int nth)
{
    coverage *c = ctx;
    if (nth != c->nth_expected)
        atomic_fetch_add(&c->bad_nth, 1);
    if (ith < 0 || ith >= nth || ith >= MAX_THREADS) {
        atomic_fetch_add(&c->bad_ith, 1);
        return;
    }
    atomic_fetch_add(&c->calls[ith], 1);
    c->run_mask[ith] = c->run;
}

/* Many tiny runs: every thread index runs exactly once per run, with the pool size, and
 * the run has fully finished (every thread saw this run) when blade_threadpool_run
 * returns. */
static void test_many_runs(void **state)
{
    (void)state;
    for (int n = 1; n <= MAX_THREADS; n++) {
        blade_threadpool *p = blade_threadpool_new(n);
        assert_non_null(p);
        assert_int_equal(blade_threadpool_size(p), n);
        coverage *c = calloc(1, sizeof *c);
        c->nth_expected = n;
        /* Pools larger than the machine wait on the scheduler each run, so they get fewer. */
        const int runs = n <= 2 ? 20000 : 300;
        for (int r = 1; r <= runs; r++) {
            c->run = r;
            blade_threadpool_run(p, count, c);
            for (int i = 0; i < n; i++)
                if (c->run_mask[i] != r)
                    fail_msg("pool of %d: thread %d missed run %d", n, i, r);
        }
        for (int i = 0; i < n; i++)
            assert_int_equal(atomic_load(&c->calls[i]), runs);
        assert_int_equal(atomic_load(&c->bad_nth), 0);
        assert_int_equal(atomic_load(&c->bad_ith), 0);
        blade_threadpool_free(p);
        free(c);
    }
}

/* A partitioned sum, as kernels use the pool: each thread takes its share of rows. */
typedef struct partition {
    int64_t n;
    int64_t *out;
} partition;

static void fill(void *ctx, int ith, int nth)
{
    partition *w = ctx;
    int64_t a = w->n * ith / nth, b = w->n * (ith + 1) / nth;
    for (int64_t i = a; i < b; i++)
        w->out[i] += i + 1;
}

static void test_partition(void **state)
{
    (void)state;
    blade_threadpool *p = blade_threadpool_new(4);
    partition w = {.n = 10007, .out = calloc(10007, sizeof(int64_t))};
    for (int r = 0; r < 100; r++)
        blade_threadpool_run(p, fill, &w);
    for (int64_t i = 0; i < w.n; i++)
        assert_int_equal(w.out[i], 100 * (i + 1));
    free(w.out);
    blade_threadpool_free(p);
}

/* Nested use: a run issued from inside a run on the same pool executes inline as one
 * thread instead of deadlocking on busy workers. */
typedef struct nested {
    blade_threadpool *p;
    _Atomic int inner_calls;
    _Atomic int inner_bad;
} nested;

static void inner(void *ctx, int ith, int nth)
{
    nested *s = ctx;
    if (ith != 0 || nth != 1)
        atomic_fetch_add(&s->inner_bad, 1);
    atomic_fetch_add(&s->inner_calls, 1);
}

static void outer(void *ctx, int ith, int nth)
{
    (void)ith;
    (void)nth;
    nested *s = ctx;
    blade_threadpool_run(s->p, inner, s);
}

static void test_nested(void **state)
{
    (void)state;
    nested s = {.p = blade_threadpool_new(3)};
    for (int r = 0; r < 200; r++)
        blade_threadpool_run(s.p, outer, &s);
    assert_int_equal(atomic_load(&s.inner_calls), 200 * 3);
    assert_int_equal(atomic_load(&s.inner_bad), 0);
    blade_threadpool_free(s.p);
}

/* A run alone: fn runs once per call, on the calling thread, and the runs it issues on the
 * pool execute inline as one thread. */
typedef struct alone {
    nested inner;
    pthread_t caller;
    int calls;
    int off_caller;
} alone;

static void alone_fn(void *ctx)
{
    alone *a = ctx;
    a->calls++;
    a->off_caller += !pthread_equal(pthread_self(), a->caller);
    blade_threadpool_run(a->inner.p, inner, &a->inner);
}

static void test_run_alone(void **state)
{
    (void)state;
    alone a = {.inner = {.p = blade_threadpool_new(3)}, .caller = pthread_self()};
    for (int r = 0; r < 200; r++)
        blade_threadpool_run_alone(a.inner.p, alone_fn, &a);
    assert_int_equal(a.calls, 200);
    assert_int_equal(a.off_caller, 0);
    assert_int_equal(atomic_load(&a.inner.inner_calls), 200);
    assert_int_equal(atomic_load(&a.inner.inner_bad), 0);
    blade_threadpool_free(a.inner.p);
}

/* Two caller threads sharing one pool: runs are serialized, none is lost. */
typedef struct shared_use {
    blade_threadpool *p;
    coverage c;
} shared_use;

static void tally(void *ctx, int ith, int nth)
{
    coverage *c = ctx;
    (void)nth;
    atomic_fetch_add(&c->calls[ith], 1);
}

static void *caller(void *arg)
{
    shared_use *u = arg;
    for (int r = 0; r < 2000; r++)
        blade_threadpool_run(u->p, tally, &u->c);
    return NULL;
}

static void test_concurrent_callers(void **state)
{
    (void)state;
    shared_use *u = calloc(1, sizeof *u);
    u->p = blade_threadpool_new(2);
    pthread_t a, b;
    pthread_create(&a, NULL, caller, u);
    pthread_create(&b, NULL, caller, u);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    assert_int_equal(atomic_load(&u->c.calls[0]), 4000);
    assert_int_equal(atomic_load(&u->c.calls[1]), 4000);
    blade_threadpool_free(u->p);
    free(u);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Freed at once, after workers have gone to sleep, and after a pause between runs long
 * enough for the workers (and the caller's wait) to block rather than spin. */
static void test_idle_and_free(void **state)
{
    (void)state;
    blade_threadpool_free(blade_threadpool_new(4));
    blade_threadpool_free(NULL);

    blade_threadpool *p = blade_threadpool_new(4);
    coverage *c = calloc(1, sizeof *c);
    c->nth_expected = 4;
    for (int r = 1; r <= 5; r++) {
        sleep_ms(20);
        c->run = r;
        blade_threadpool_run(p, count, c);
    }
    for (int i = 0; i < 4; i++)
        assert_int_equal(atomic_load(&c->calls[i]), 5);
    sleep_ms(20);
    blade_threadpool_free(p);
    free(c);
}

static void slow(void *ctx, int ith, int nth)
{
    (void)nth;
    coverage *c = ctx;
    /* Thread 0 finishes first, so the caller outlasts its spin and blocks. */
    if (ith != 0)
        sleep_ms(15);
    atomic_fetch_add(&c->calls[ith], 1);
}

static void test_caller_blocks(void **state)
{
    (void)state;
    blade_threadpool *p = blade_threadpool_new(3);
    coverage *c = calloc(1, sizeof *c);
    for (int r = 0; r < 5; r++)
        blade_threadpool_run(p, slow, c);
    for (int i = 0; i < 3; i++)
        assert_int_equal(atomic_load(&c->calls[i]), 5);
    blade_threadpool_free(p);
    free(c);
}

static void test_default_size(void **state)
{
    (void)state;
    int cores = blade_physical_cores();
    assert_true(cores >= 1);
    blade_threadpool *p = blade_threadpool_new(0);
    assert_int_equal(blade_threadpool_size(p), cores);
    blade_threadpool_free(p);
}

/* Work sharing: every unit is handed out exactly once, whatever the pool size and the
 * unit count; a thread that is held up has the rest of its share taken by the others. */
typedef struct shared_work {
    blade_work_share *w;
    int64_t n;
    _Atomic int *taken;     /* per unit: how many times it was handed out */
    _Atomic int64_t stolen; /* units a thread took outside its own share */
    int slow_thread;        /* sleeps before its first piece; -1: none */
} shared_work;

static void take_all(void *ctx, int ith, int nth)
{
    shared_work *s = ctx;
    if (ith == s->slow_thread)
        sleep_ms(20);
    int64_t own_b = s->n * ith / nth, own_e = s->n * (ith + 1) / nth, b, e;
    while (blade_work_share_next(s->w, ith, &b, &e)) {
        if (b < 0 || e > s->n || b >= e) {
            atomic_fetch_add(&s->taken[0], 1000);
            continue;
        }
        for (int64_t u = b; u < e; u++) {
            atomic_fetch_add(&s->taken[u], 1);
            if (u < own_b || u >= own_e)
                atomic_fetch_add(&s->stolen, 1);
        }
    }
}

static void test_work_share(void **state)
{
    (void)state;
    const int64_t counts[] = {0, 1, 3, 7, 160, 10007};
    for (int n = 1; n <= 4; n++) {
        blade_threadpool *p = blade_threadpool_new(n);
        shared_work s = {.w = blade_work_share_new(n), .slow_thread = -1};
        assert_non_null(s.w);
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            s.n = counts[c];
            s.taken = calloc((size_t)s.n + 1, sizeof *s.taken);
            for (int r = 0; r < 50; r++) {
                blade_work_share_reset(s.w, s.n);
                blade_threadpool_run(p, take_all, &s);
            }
            for (int64_t u = 0; u < s.n; u++)
                if (atomic_load(&s.taken[u]) != 50)
                    fail_msg("pool of %d, %lld units: unit %lld handed out %d times in 50 runs", n,
                             (long long)s.n, (long long)u, atomic_load(&s.taken[u]));
            free(s.taken);
        }
        if (n > 1) {
            /* The last thread sleeps: the others finish its share before it wakes. */
            s.n = 1000;
            s.slow_thread = n - 1;
            s.taken = calloc((size_t)s.n, sizeof *s.taken);
            atomic_store(&s.stolen, 0);
            blade_work_share_reset(s.w, s.n);
            blade_threadpool_run(p, take_all, &s);
            for (int64_t u = 0; u < s.n; u++)
                assert_int_equal(atomic_load(&s.taken[u]), 1);
            assert_true(atomic_load(&s.stolen) > 0);
            s.slow_thread = -1;
            free(s.taken);
        }
        /* A share sized for n threads, run inline by one: that thread takes everything. */
        s.n = 777;
        s.taken = calloc((size_t)s.n, sizeof *s.taken);
        blade_work_share_reset(s.w, s.n);
        take_all(&s, 0, 1);
        for (int64_t u = 0; u < s.n; u++)
            assert_int_equal(atomic_load(&s.taken[u]), 1);
        free(s.taken);
        blade_work_share_free(s.w);
        blade_threadpool_free(p);
    }
    blade_work_share_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_runs),      cmocka_unit_test(test_partition),
        cmocka_unit_test(test_nested),         cmocka_unit_test(test_run_alone),
        cmocka_unit_test(test_concurrent_callers),
        cmocka_unit_test(test_idle_and_free),  cmocka_unit_test(test_caller_blocks),
        cmocka_unit_test(test_default_size),   cmocka_unit_test(test_work_share),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

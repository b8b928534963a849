/* The semantic cache's background thread: batched database writes and the sweep timer
 * (see background.h). */
#include "semantic_cache/background.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Queued changes beyond this many bytes are dropped: a stalled disk must not grow memory
 * without bound. */
#define MAX_BACKLOG_BYTES ((size_t)64 << 20)
/* A failing database is reported once per this many seconds, not once per write. */
#define WARN_INTERVAL_S 60.0

typedef enum { OP_PUT, OP_DELETE, OP_TOUCH } op_kind;

typedef struct sc_op {
    struct sc_op *next;
    op_kind kind;
    size_t bytes;
    double last_hit;
    uint8_t key[SC_KEY_LEN];
    sc_row row;  /* OP_PUT, pointing into vec */
    float vec[]; /* OP_PUT: the embedding, then model, finish reason, text, extra */
} sc_op;

struct sc_background {
    sc_store *store;
    int32_t dim;
    double tick_interval_s;
    void (*tick)(void *ctx);
    void *ctx;
    sc_log_fn log;
    void *log_ctx;

    pthread_t thread;
    bool running, stopping;
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    sc_op *head, *tail;
    size_t queued_bytes;
    uint64_t queued, written; /* changes queued and taken care of, ever */
    sc_background_counts counts;
    char failure[BLADE_ERROR_LEN]; /* since the last flush */
    double last_warning;
};

static double monotonic_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void free_ops(sc_op *op)
{
    while (op) {
        sc_op *next = op->next;
        free(op);
        op = next;
    }
}

sc_background *sc_background_new(sc_store *store, int32_t dim, double tick_interval_s, void (*tick)(void *ctx),
                                  void *ctx, sc_log_fn log, void *log_ctx, blade_error *err)
{
    sc_background *b = calloc(1, sizeof *b);
    if (!b) {
        blade_error_set(err, "semantic cache: out of memory");
        return NULL;
    }
    *b = (sc_background){.store = store, .dim = dim, .tick_interval_s = tick_interval_s, .tick = tick, .ctx = ctx,
                         .log = log, .log_ctx = log_ctx, .last_warning = -WARN_INTERVAL_S};
    pthread_mutex_init(&b->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&b->wake, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&b->done, NULL);
    return b;
}

static void enqueue(sc_background *b, sc_op *op)
{
    pthread_mutex_lock(&b->mu);
    if (!op || (op->kind != OP_DELETE && b->queued_bytes + op->bytes > MAX_BACKLOG_BYTES)) {
        b->counts.dropped++;
        pthread_mutex_unlock(&b->mu);
        free(op);
        return;
    }
    if (b->tail)
        b->tail->next = op;
    else
        b->head = op;
    b->tail = op;
    b->queued_bytes += op->bytes;
    b->queued++;
    pthread_cond_signal(&b->wake);
    pthread_mutex_unlock(&b->mu);
}

static void enqueue_key(sc_background *b, op_kind kind, const uint8_t key[SC_KEY_LEN], double last_hit)
{
    if (!b->store)
        return;
    sc_op *op = calloc(1, sizeof *op);
    if (op) {
        op->kind = kind;
        op->bytes = sizeof *op;
        op->last_hit = last_hit;
        memcpy(op->key, key, SC_KEY_LEN);
    }
    enqueue(b, op);
}

void sc_background_delete(sc_background *b, const uint8_t key[SC_KEY_LEN])
{
    enqueue_key(b, OP_DELETE, key, 0.0);
}

void sc_background_touch(sc_background *b, const uint8_t key[SC_KEY_LEN], double last_hit)
{
    enqueue_key(b, OP_TOUCH, key, last_hit);
}

void sc_background_put(sc_background *b, const sc_row *row)
{
    if (!b->store)
        return;
    size_t vec_bytes = row->embedding ? (size_t)b->dim * sizeof(float) : 0;
    size_t model_len = strlen(row->model), finish_len = strlen(row->finish_reason);
    size_t size = sizeof(sc_op) + vec_bytes + model_len + 1 + finish_len + 1 + row->text_len + row->extra_len;
    sc_op *op = calloc(1, size);
    if (op) {
        op->kind = OP_PUT;
        op->bytes = size;
        sc_row *r = &op->row;
        *r = *row;
        char *p = (char *)op->vec + vec_bytes;
        if (row->embedding) {
            memcpy(op->vec, row->embedding, vec_bytes);
            r->embedding = op->vec;
        }
        r->model = memcpy(p, row->model, model_len + 1);
        p += model_len + 1;
        r->finish_reason = memcpy(p, row->finish_reason, finish_len + 1);
        p += finish_len + 1;
        if (row->text_len)
            memcpy(p, row->text, row->text_len);
        r->text = p;
        p += row->text_len;
        if (row->extra_len)
            memcpy(p, row->extra, row->extra_len);
        r->extra = p;
    }
    enqueue(b, op);
}

static int apply_op(sc_store *s, const sc_op *op, blade_error *err)
{
    switch (op->kind) {
    case OP_PUT:
        return sc_store_put(s, &op->row, err);
    case OP_DELETE:
        return sc_store_delete(s, op->key, err);
    default:
        return sc_store_touch(s, op->key, op->last_hit, err);
    }
}

/* Writes a batch in one transaction; on failure none of it is kept. */
static void write_batch(sc_background *b, sc_op *batch, uint64_t n)
{
    blade_error err = {{0}};
    int rc = sc_store_begin(b->store, &err);
    for (sc_op *op = batch; rc == 0 && op; op = op->next)
        rc = apply_op(b->store, op, &err);
    if (rc == 0)
        rc = sc_store_commit(b->store, &err);
    if (rc)
        sc_store_rollback(b->store);
    pthread_mutex_lock(&b->mu);
    if (rc) {
        b->counts.errors += n;
        snprintf(b->failure, sizeof b->failure, "%s", err.msg);
    } else {
        b->counts.writes += n;
    }
    bool warn = rc && monotonic_now() - b->last_warning >= WARN_INTERVAL_S;
    if (warn)
        b->last_warning = monotonic_now();
    pthread_mutex_unlock(&b->mu);
    if (warn) {
        char msg[BLADE_ERROR_LEN + 128];
        snprintf(msg, sizeof msg, "warning: semantic cache: %" PRIu64 " database changes lost (the entries stay in memory): %s",
                 n, err.msg);
        b->log(b->log_ctx, msg);
    }
}

static void deadline_in(struct timespec *ts, double seconds)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    double whole = floor(seconds);
    ts->tv_sec += (time_t)whole;
    ts->tv_nsec += (long)((seconds - whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static void *thread_main(void *arg)
{
    sc_background *b = arg;
    bool ticking = b->tick_interval_s > 0;
    double next_tick = monotonic_now() + b->tick_interval_s;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        if (!b->head && !b->stopping) {
            if (ticking) {
                struct timespec ts;
                deadline_in(&ts, fmax(next_tick - monotonic_now(), 0.0));
                pthread_cond_timedwait(&b->wake, &b->mu, &ts);
            } else {
                pthread_cond_wait(&b->wake, &b->mu);
            }
        }
        if (b->head) {
            /* everything queued meanwhile goes in one transaction */
            sc_op *batch = b->head;
            uint64_t n = 0;
            for (sc_op *op = batch; op; op = op->next)
                n++;
            b->head = b->tail = NULL;
            b->queued_bytes = 0;
            pthread_mutex_unlock(&b->mu);
            write_batch(b, batch, n);
            free_ops(batch);
            pthread_mutex_lock(&b->mu);
            b->written += n;
            pthread_cond_broadcast(&b->done);
            continue;
        }
        if (b->stopping)
            break;
        if (ticking && monotonic_now() >= next_tick) {
            pthread_mutex_unlock(&b->mu);
            b->tick(b->ctx);
            pthread_mutex_lock(&b->mu);
            next_tick = monotonic_now() + b->tick_interval_s;
        }
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

int sc_background_run(sc_background *b, blade_error *err)
{
    if (!b->store && b->tick_interval_s <= 0)
        return 0; /* nothing to do: no thread */
    if (pthread_create(&b->thread, NULL, thread_main, b) != 0)
        return blade_error_set(err, "semantic cache: cannot start its thread");
    b->running = true;
    return 0;
}

void sc_background_discard(sc_background *b)
{
    pthread_mutex_lock(&b->mu);
    free_ops(b->head);
    b->head = b->tail = NULL;
    b->queued_bytes = 0;
    b->written = b->queued;
    pthread_cond_broadcast(&b->done);
    pthread_mutex_unlock(&b->mu);
}

void sc_background_free(sc_background *b)
{
    if (!b)
        return;
    if (b->running) {
        pthread_mutex_lock(&b->mu);
        b->stopping = true;
        pthread_cond_signal(&b->wake);
        pthread_mutex_unlock(&b->mu);
        pthread_join(b->thread, NULL);
    }
    free_ops(b->head); /* queued while no thread ran */
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->wake);
    pthread_cond_destroy(&b->done);
    free(b);
}

int sc_background_flush(sc_background *b, blade_error *err)
{
    pthread_mutex_lock(&b->mu);
    uint64_t target = b->queued;
    while (b->running && b->written < target)
        pthread_cond_wait(&b->done, &b->mu);
    int rc = 0;
    if (b->failure[0]) {
        rc = blade_error_set(err, "semantic cache: %s", b->failure);
        b->failure[0] = 0;
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}

sc_background_counts sc_background_get_counts(sc_background *b)
{
    pthread_mutex_lock(&b->mu);
    sc_background_counts c = b->counts;
    pthread_mutex_unlock(&b->mu);
    return c;
}

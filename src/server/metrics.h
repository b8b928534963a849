#ifndef BLADE_SERVER_METRICS_H
#define BLADE_SERVER_METRICS_H

/* Prometheus metrics of `blade serve`, named like vLLM's with a blade: prefix so existing
 * dashboards carry over: request counts by HTTP status and finish reason, token counters,
 * latency histograms (TTFT, TPOT, inter-token, end-to-end, queue) and the engine's gauges
 * (running and waiting requests, KV blocks, prefix-cache hit rate, preemptions). */

#include "api/buf.h"
#include "api/job.h"
#include "blade/disagg.h"
#include "blade/semantic_cache.h"

#include <pthread.h>
#include <stdint.h>

#define METRICS_MAX_BUCKETS 32

typedef struct metrics_hist {
    const double *bounds;
    int n_bounds;
    uint64_t counts[METRICS_MAX_BUCKETS + 1]; /* per bucket, the last one +Inf */
    double sum;
    uint64_t count;
} metrics_hist;

typedef struct metrics_status {
    int status;
    uint64_t count;
} metrics_status;

typedef struct metrics_data {
    metrics_status by_status[24];
    int n_status;
    uint64_t finished_stop, finished_length;
    uint64_t prompt_tokens, generation_tokens, cached_tokens;
    metrics_hist ttft, tpot, itl, e2e, queue;
    int64_t http_in_flight;
    uint64_t remote_prefills[BLADE_DISAGG_CAUSES]; /* decode role: by outcome */
} metrics_data;

typedef struct metrics {
    pthread_mutex_t mu;
    metrics_data d;
    blade_prefill_service *prefill; /* prefill role: its counters are shown too */
} metrics;

void metrics_init(metrics *m);
void metrics_destroy(metrics *m);
/* One HTTP request answered with status (499: the client closed the connection first). */
void metrics_count_status(metrics *m, int status);
void metrics_observe(metrics *m, const api_timing *t);
void metrics_observe_e2e(metrics *m, double seconds);
void metrics_in_flight(metrics *m, int delta);
/* A remote prefill tried for a request (decode role), by outcome. */
void metrics_remote_prefill(metrics *m, blade_disagg_cause cause);
/* The text exposition format; e may be NULL while the model loads; queued: the requests
 * admitted that have no token yet (what --max-queue bounds), which the server counts. */
void metrics_render(metrics *m, blade_engine *e, int queued, api_buf *out);
/* The semantic cache's figures (blade:semantic_cache_*). */
void metrics_render_semcache(blade_semcache *c, api_buf *out);

#endif

/* The Prometheus metrics of `blade serve` (metrics.h): counters and histograms updated as
 * events are applied, and the text exposition /metrics serves. */

#include "server/metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* vLLM's buckets, extended downwards: a small model on a CPU answers in milliseconds. */
static const double ttft_bounds[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                     1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double token_bounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
                                      0.2,    0.3,   0.4,    0.5,   0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double request_bounds[] = {0.01, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,   1.5,   2.0,   2.5,  5.0,
                                        10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                                        1920.0, 7680.0};

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

void metrics_init(metrics *m)
{
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    m->d.ttft = (metrics_hist){.bounds = ttft_bounds, .n_bounds = COUNT(ttft_bounds)};
    m->d.tpot = (metrics_hist){.bounds = token_bounds, .n_bounds = COUNT(token_bounds)};
    m->d.itl = (metrics_hist){.bounds = token_bounds, .n_bounds = COUNT(token_bounds)};
    m->d.e2e = (metrics_hist){.bounds = request_bounds, .n_bounds = COUNT(request_bounds)};
    m->d.queue = (metrics_hist){.bounds = request_bounds, .n_bounds = COUNT(request_bounds)};
}

void metrics_destroy(metrics *m)
{
    pthread_mutex_destroy(&m->mu);
}

static void hist_add(metrics_hist *h, double x)
{
    int i = 0;
    while (i < h->n_bounds && x > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += x;
    h->count++;
}

void metrics_count_status(metrics *m, int status)
{
    pthread_mutex_lock(&m->mu);
    int i = 0;
    while (i < m->d.n_status && m->d.by_status[i].status != status)
        i++;
    if (i == m->d.n_status && i < COUNT(m->d.by_status))
        m->d.by_status[m->d.n_status++].status = status;
    if (i < m->d.n_status)
        m->d.by_status[i].count++;
    pthread_mutex_unlock(&m->mu);
}

void metrics_observe(metrics *m, const api_timing *t)
{
    if (!t->token && !t->choice_finished)
        return;
    pthread_mutex_lock(&m->mu);
    if (t->token) {
        m->d.generation_tokens++;
        if (t->itl >= 0)
            hist_add(&m->d.itl, t->itl);
    }
    if (t->choice_finished) {
        if (t->finish == BLADE_FINISH_STOP)
            m->d.finished_stop++;
        else if (t->finish == BLADE_FINISH_LENGTH)
            m->d.finished_length++;
        if (t->completion_tokens > 0)
            hist_add(&m->d.ttft, t->ttft);
        if (t->tpot >= 0)
            hist_add(&m->d.tpot, t->tpot);
        if (t->first_of_prompt) {
            hist_add(&m->d.queue, t->queue);
            m->d.prompt_tokens += (uint64_t)t->prompt_tokens;
            m->d.cached_tokens += (uint64_t)t->cached_tokens;
        }
    }
    pthread_mutex_unlock(&m->mu);
}

void metrics_observe_e2e(metrics *m, double seconds)
{
    pthread_mutex_lock(&m->mu);
    hist_add(&m->d.e2e, seconds);
    pthread_mutex_unlock(&m->mu);
}

void metrics_in_flight(metrics *m, int delta)
{
    pthread_mutex_lock(&m->mu);
    m->d.http_in_flight += delta;
    pthread_mutex_unlock(&m->mu);
}

void metrics_remote_prefill(metrics *m, blade_disagg_cause cause)
{
    pthread_mutex_lock(&m->mu);
    m->d.remote_prefills[cause]++;
    pthread_mutex_unlock(&m->mu);
}

static void out_printf(api_buf *out, const char *fmt, ...) BLADE_PRINTF(2, 3);
static void out_printf(api_buf *out, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > 0)
        api_buf_append(out, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

static void header(api_buf *out, const char *name, const char *type, const char *help)
{
    out_printf(out, "# HELP blade:%s %s\n# TYPE blade:%s %s\n", name, help, name, type);
}

static void scalar(api_buf *out, const char *name, const char *type, const char *help, double v)
{
    header(out, name, type, help);
    out_printf(out, "blade:%s %.17g\n", name, v);
}

static void hist(api_buf *out, const char *name, const char *help, const metrics_hist *h)
{
    header(out, name, "histogram", help);
    uint64_t cum = 0;
    for (int i = 0; i < h->n_bounds; i++) {
        cum += h->counts[i];
        out_printf(out, "blade:%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i], (unsigned long long)cum);
    }
    cum += h->counts[h->n_bounds];
    out_printf(out, "blade:%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
    out_printf(out, "blade:%s_sum %.17g\n", name, h->sum);
    out_printf(out, "blade:%s_count %llu\n", name, (unsigned long long)h->count);
}

void metrics_render(metrics *m, blade_engine *e, int queued, api_buf *out)
{
    pthread_mutex_lock(&m->mu);
    metrics_data snap = m->d;
    pthread_mutex_unlock(&m->mu);

    header(out, "http_requests_total", "counter", "HTTP requests answered, by status (499: the client left first).");
    for (int i = 0; i < snap.n_status; i++)
        out_printf(out, "blade:http_requests_total{status=\"%d\"} %llu\n", snap.by_status[i].status,
                   (unsigned long long)snap.by_status[i].count);
    scalar(out, "http_requests_in_flight", "gauge", "HTTP requests being answered now.", (double)snap.http_in_flight);
    scalar(out, "http_requests_queued", "gauge", "Admitted requests that have not started yet (what --max-queue bounds).",
           (double)queued);
    header(out, "request_success_total", "counter", "Choices that finished, by finish reason.");
    out_printf(out, "blade:request_success_total{finished_reason=\"stop\"} %llu\n",
               (unsigned long long)snap.finished_stop);
    out_printf(out, "blade:request_success_total{finished_reason=\"length\"} %llu\n",
               (unsigned long long)snap.finished_length);
    scalar(out, "prompt_tokens_total", "counter", "Prompt tokens of finished requests.", (double)snap.prompt_tokens);
    scalar(out, "prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.",
           (double)snap.cached_tokens);
    scalar(out, "generation_tokens_total", "counter", "Generated tokens.", (double)snap.generation_tokens);
    hist(out, "time_to_first_token_seconds", "Time from submission to the first generated token.", &snap.ttft);
    hist(out, "time_per_output_token_seconds", "Mean time per generated token after the first, per choice.",
         &snap.tpot);
    hist(out, "inter_token_latency_seconds", "Time between consecutive tokens of a choice.", &snap.itl);
    hist(out, "e2e_request_latency_seconds", "Time from receiving a request to its last token.", &snap.e2e);
    hist(out, "request_queue_time_seconds", "Time a request waited before it was first scheduled.", &snap.queue);

    header(out, "remote_prefills_total", "counter",
           "Decode role: prompts sent to a prefill worker, by outcome (other than ok: computed here instead).");
    for (int c = 0; c < BLADE_DISAGG_CAUSES; c++)
        out_printf(out, "blade:remote_prefills_total{result=\"%s\"} %llu\n", blade_disagg_cause_name(c),
                   (unsigned long long)snap.remote_prefills[c]);
    if (m->prefill) {
        blade_prefill_service_stats ps;
        blade_prefill_service_stats_get(m->prefill, &ps);
        scalar(out, "prefill_service_served_total", "counter", "Prefill role: prefills shipped to decode workers.",
               (double)ps.served);
        scalar(out, "prefill_service_failed_total", "counter",
               "Prefill role: decode workers' requests that failed (each logged with its reason).", (double)ps.failed);
        scalar(out, "prefill_service_blocks_sent_total", "counter", "Prefill role: KV blocks shipped.",
               (double)ps.blocks_sent);
        scalar(out, "prefill_service_blocks_skipped_total", "counter",
               "Prefill role: KV blocks not shipped because the decode worker held them.", (double)ps.blocks_skipped);
    }

    if (!e)
        return;
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    scalar(out, "num_requests_running", "gauge", "Sequences running in the engine.", st.running);
    scalar(out, "num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", st.waiting);
    scalar(out, "kv_blocks_total", "gauge", "KV cache blocks in the pool.", st.kv_blocks_total);
    scalar(out, "kv_blocks_used", "gauge", "KV cache blocks held by running sequences.", st.kv_blocks_used);
    scalar(out, "kv_blocks_cached", "gauge", "Unreferenced KV blocks kept for prefix reuse (evictable).",
           st.kv_blocks_cached);
    scalar(out, "kv_blocks_free", "gauge", "KV cache blocks holding nothing.", st.kv_blocks_free);
    scalar(out, "kv_blocks_pinned", "gauge", "KV blocks of pinned prefixes.", st.kv_blocks_pinned);
    scalar(out, "kv_cache_usage_perc", "gauge", "Fraction of KV blocks held by running sequences.",
           st.kv_blocks_total ? (double)st.kv_blocks_used / st.kv_blocks_total : 0);
    scalar(out, "kv_utilisation", "gauge",
           "Token slots holding KV / slots allocated to sequences, averaged over the engine's steps.",
           st.kv_utilisation);
    scalar(out, "prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / tokens looked up.",
           st.prefix_hit_rate);
    scalar(out, "prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           (double)st.prefix_query_tokens);
    scalar(out, "prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
           (double)st.prefix_hit_tokens);
    scalar(out, "num_preemptions_total", "counter", "Sequences preempted to free KV blocks.", (double)st.preemptions);
    scalar(out, "kv_cache_evictions_total", "counter", "Cached KV blocks evicted for reuse.", (double)st.evictions);
    scalar(out, "engine_steps_total", "counter", "Engine steps run.", (double)st.steps);
    scalar(out, "spec_decode_num_draft_tokens_total", "counter", "Drafted tokens the model verified.",
           (double)st.spec_draft_tokens);
    scalar(out, "spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens accepted.",
           (double)st.spec_accepted_tokens);
    if (st.draft_kv_blocks_total) {
        scalar(out, "spec_decode_draft_kv_blocks_total", "gauge", "The draft model's KV cache blocks.",
               st.draft_kv_blocks_total);
        scalar(out, "spec_decode_draft_kv_blocks_used", "gauge", "Draft KV blocks held by speculating sequences.",
               st.draft_kv_blocks_used);
    }
    /* bucket le=n counts verify steps that kept at most n drafts */
    header(out, "spec_decode_acceptance_length", "histogram", "Drafts accepted per verify step.");
    uint64_t cum = 0;
    for (int n = 0; n <= BLADE_SPEC_MAX_K; n++) {
        cum += st.spec_accept_hist[n];
        out_printf(out, "blade:spec_decode_acceptance_length_bucket{le=\"%d\"} %llu\n", n, (unsigned long long)cum);
    }
    out_printf(out, "blade:spec_decode_acceptance_length_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)cum);
    out_printf(out, "blade:spec_decode_acceptance_length_sum %llu\n", (unsigned long long)st.spec_accepted_tokens);
    out_printf(out, "blade:spec_decode_acceptance_length_count %llu\n", (unsigned long long)st.spec_verifies);
}

/* A cumulative histogram of the cache's own (bounds plus +Inf), as Prometheus wants it. */
static void cumulative_hist(api_buf *out, const char *name, const char *help, const double *bounds, int n_bounds,
                            const uint64_t *cumulative, double sum)
{
    header(out, name, "histogram", help);
    for (int i = 0; i < n_bounds; i++)
        out_printf(out, "blade:%s_bucket{le=\"%g\"} %llu\n", name, bounds[i], (unsigned long long)cumulative[i]);
    out_printf(out, "blade:%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cumulative[n_bounds]);
    out_printf(out, "blade:%s_sum %.17g\n", name, sum);
    out_printf(out, "blade:%s_count %llu\n", name, (unsigned long long)cumulative[n_bounds]);
}

void metrics_render_semcache(blade_semcache *c, api_buf *out)
{
    blade_semcache_stats st;
    blade_semcache_get_stats(c, &st);
    scalar(out, "semantic_cache_exact_hits_total", "counter", "Requests answered from the exact tier.",
           (double)st.exact_hits);
    scalar(out, "semantic_cache_semantic_hits_total", "counter",
           "Requests answered from the semantic tier (a near-duplicate prompt).", (double)st.semantic_hits);
    scalar(out, "semantic_cache_misses_total", "counter", "Lookups that found nothing.", (double)st.misses);
    scalar(out, "semantic_cache_inserts_total", "counter", "Answers stored.", (double)st.inserts);
    scalar(out, "semantic_cache_evictions_total", "counter", "Entries evicted for capacity.", (double)st.evictions);
    scalar(out, "semantic_cache_expirations_total", "counter", "Entries removed by the TTL.",
           (double)st.expirations);
    scalar(out, "semantic_cache_entries", "gauge", "Entries stored.", (double)st.entries);
    scalar(out, "semantic_cache_bytes", "gauge", "Bytes the capacity counts (payloads, vectors, bookkeeping).",
           (double)st.bytes);
    scalar(out, "semantic_cache_index_bytes", "gauge", "Bytes of the HNSW graphs on top of that.",
           (double)st.index_bytes);
    scalar(out, "semantic_cache_db_errors_total", "counter", "Failed database writes.", (double)st.db_errors);
    cumulative_hist(out, "semantic_cache_lookup_seconds", "Time of one cache lookup (both tiers).",
                    blade_semcache_latency_bounds_s, BLADE_SEMCACHE_LATENCY_BUCKETS - 1,
                    st.lookup_latency.cumulative, st.lookup_latency.sum);
    cumulative_hist(out, "semantic_cache_hit_similarity", "Cosine similarity of semantic hits.",
                    blade_semcache_similarity_bounds, BLADE_SEMCACHE_SIMILARITY_BUCKETS - 1,
                    st.hit_similarity.cumulative, st.hit_similarity.sum);
    cumulative_hist(out, "semantic_cache_miss_similarity",
                    "Nearest entry's similarity on semantic-tier misses: where the threshold cuts.",
                    blade_semcache_similarity_bounds, BLADE_SEMCACHE_SIMILARITY_BUCKETS - 1,
                    st.miss_similarity.cumulative, st.miss_similarity.sum);
}

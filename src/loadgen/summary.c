/* From a run's records to the figures `blade bench serve` reports (summary.h), printed as
 * a table and written as JSON. */

#include "loadgen/summary.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int push(double **a, size_t *n, size_t *cap, double v)
{
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 256;
        double *g = realloc(*a, c * sizeof *g);
        if (!g)
            return -1;
        *a = g;
        *cap = c;
    }
    (*a)[(*n)++] = v;
    return 0;
}

static void add_cause(lg_summary *s, const lg_record *r)
{
    char cause[32];
    lg_record_cause(r, cause, sizeof cause);
    for (int i = 0; i < s->n_causes; i++)
        if (!strcmp(s->causes[i].cause, cause)) {
            s->causes[i].count++;
            return;
        }
    /* More distinct causes than slots end up in the last one, so none goes uncounted. */
    lg_cause *c = &s->causes[s->n_causes < LG_MAX_CAUSES ? s->n_causes++ : LG_MAX_CAUSES - 1];
    if (c->count == 0) {
        snprintf(c->cause, sizeof c->cause, "%s", cause);
        snprintf(c->example, sizeof c->example, "%s", r->error ? r->error : "");
    }
    c->count++;
}

static void server_figures(const lg_run_result *r, lg_summary *s)
{
    s->kv_usage_mean = s->kv_usage_peak = s->kv_blocks_total = s->prefix_hit_rate = s->kv_utilisation = NAN;
    double sum = 0;
    size_t n = 0;
    for (size_t i = 0; i < r->n_samples; i++) {
        double u = r->samples[i].kv_usage;
        if (isnan(u))
            continue;
        sum += u;
        n++;
        if (!(u <= s->kv_usage_peak))
            s->kv_usage_peak = u;
    }
    if (n)
        s->kv_usage_mean = sum / (double)n;
    if (!r->n_samples)
        return;
    const lg_sample *first = &r->samples[0], *last = &r->samples[r->n_samples - 1];
    s->kv_blocks_total = last->kv_total;
    double lookups = last->query_tokens - first->query_tokens;
    if (lookups > 0)
        s->prefix_hit_rate = (last->hit_tokens - first->hit_tokens) / lookups;
    s->kv_utilisation = last->kv_utilisation;
}

int lg_summarize(const lg_run_result *r, double price_per_hour, const lg_slo *slo, lg_summary *s)
{
    memset(s, 0, sizeof *s);
    s->duration = r->duration;
    s->have_slo = slo && lg_slo_any(slo);
    if (s->have_slo)
        s->slo = *slo;
    double *v[4] = {0};
    size_t n[4] = {0}, cap[4] = {0};
    enum { TTFT, TPOT, ITL, E2E };
    int rc = -1;
    for (size_t i = 0; i < r->n_records; i++) {
        const lg_record *q = &r->records[i];
        if (q->failure != LG_OK) {
            s->failed++;
            add_cause(s, q);
            continue;
        }
        s->completed++;
        s->input_tokens += q->input_tokens;
        s->output_tokens += q->output_tokens;
        if (!q->usage_reported)
            s->usage_missing++;
        double ttft = lg_record_ttft(q) * 1e3, tpot = lg_record_tpot(q) * 1e3, e2e = lg_record_e2e(q) * 1e3;
        if ((!isnan(ttft) && push(&v[TTFT], &n[TTFT], &cap[TTFT], ttft)) ||
            (!isnan(tpot) && push(&v[TPOT], &n[TPOT], &cap[TPOT], tpot)) || push(&v[E2E], &n[E2E], &cap[E2E], e2e))
            goto out;
        for (int32_t k = 1; k < q->n_chunks; k++)
            if (push(&v[ITL], &n[ITL], &cap[ITL], (q->chunks[k] - q->chunks[k - 1]) * 1e3))
                goto out;
        if (s->have_slo && lg_slo_met(slo, ttft, tpot, e2e))
            s->good++;
    }
    lg_dist_compute(v[TTFT], n[TTFT], &s->ttft);
    lg_dist_compute(v[TPOT], n[TPOT], &s->tpot);
    lg_dist_compute(v[ITL], n[ITL], &s->itl);
    lg_dist_compute(v[E2E], n[E2E], &s->e2e);
    double d = s->duration > 0 ? s->duration : NAN;
    s->request_throughput = (double)s->completed / d;
    s->input_throughput = (double)s->input_tokens / d;
    s->output_throughput = (double)s->output_tokens / d;
    s->total_throughput = (double)(s->input_tokens + s->output_tokens) / d;
    s->goodput = s->have_slo ? (double)s->good / d : NAN;
    s->price_per_hour = price_per_hour > 0 ? price_per_hour : NAN;
    s->cost_output = lg_cost_per_million(s->price_per_hour, s->duration, (double)s->output_tokens);
    s->cost_total = lg_cost_per_million(s->price_per_hour, s->duration, (double)(s->input_tokens + s->output_tokens));
    s->hours_output = lg_cost_per_million(1.0, s->duration, (double)s->output_tokens);
    s->hours_total = lg_cost_per_million(1.0, s->duration, (double)(s->input_tokens + s->output_tokens));
    server_figures(r, s);
    s->client_cpu = r->client_cpu;
    s->client_wall = r->client_wall;
    s->client_cpu_share = r->client_wall > 0 ? r->client_cpu / r->client_wall : NAN;
    s->client_peak_rss = r->client_peak_rss;
    rc = 0;
out:
    for (int i = 0; i < 4; i++)
        free(v[i]);
    return rc;
}

static void dist_row(FILE *out, const char *name, const lg_dist *d)
{
    fprintf(out, "  %-6s %10.2f %10.2f %10.2f %10.2f   (%zu values)\n", name, d->mean, d->median, d->p90, d->p99,
            d->n);
}

void lg_summary_print(FILE *out, const lg_summary *s)
{
    fprintf(out, "requests            %zu completed, %zu failed, in %.2f s\n", s->completed, s->failed, s->duration);
    fprintf(out, "tokens              %lld in, %lld out%s\n", (long long)s->input_tokens, (long long)s->output_tokens,
            s->usage_missing ? " (some counted with the tokenizer: the server reported no usage)" : "");
    fprintf(out,
            "throughput          %.2f requests/s, %.1f input tokens/s, %.1f output tokens/s, %.1f total tokens/s\n",
            s->request_throughput, s->input_throughput, s->output_throughput, s->total_throughput);
    if (s->have_slo) {
        fprintf(out, "goodput             %.2f requests/s (%zu of %zu met", s->goodput, s->good, s->completed);
        if (s->slo.ttft_ms > 0)
            fprintf(out, " TTFT <= %g ms", s->slo.ttft_ms);
        if (s->slo.tpot_ms > 0)
            fprintf(out, " TPOT <= %g ms", s->slo.tpot_ms);
        if (s->slo.e2e_ms > 0)
            fprintf(out, " E2E <= %g ms", s->slo.e2e_ms);
        fprintf(out, ")\n");
    }
    fprintf(out, "latency (ms)      mean     median        p90        p99\n");
    dist_row(out, "TTFT", &s->ttft);
    dist_row(out, "TPOT", &s->tpot);
    dist_row(out, "ITL", &s->itl);
    dist_row(out, "E2E", &s->e2e);
    if (!isnan(s->price_per_hour))
        fprintf(out, "cost                $%.4f per 1M output tokens, $%.4f per 1M total tokens (at $%g/hour)\n",
                s->cost_output, s->cost_total, s->price_per_hour);
    fprintf(out, "instance time       %.4f hours per 1M output tokens, %.4f per 1M total tokens%s\n", s->hours_output,
            s->hours_total, isnan(s->price_per_hour) ? " (--price-per-hour P prices it)" : "");
    for (int i = 0; i < s->n_causes; i++)
        fprintf(out, "failed              %zu x %s%s%s\n", s->causes[i].count, s->causes[i].cause,
                s->causes[i].example[0] ? ": " : "", s->causes[i].example);
    if (!isnan(s->kv_usage_mean) || !isnan(s->prefix_hit_rate)) {
        fprintf(out, "server              KV blocks held %.1f%% on average, %.1f%% at peak, of %.0f",
                s->kv_usage_mean * 100, s->kv_usage_peak * 100, s->kv_blocks_total);
        if (!isnan(s->prefix_hit_rate))
            fprintf(out, "; prefix cache hit %.1f%% of prompt tokens", s->prefix_hit_rate * 100);
        if (!isnan(s->kv_utilisation))
            fprintf(out, "; KV slot utilisation %.1f%%", s->kv_utilisation * 100);
        fprintf(out, "\n");
    }
    fprintf(out, "client              CPU %.2f s in %.2f s (%.1f%% of one core), peak RSS %.1f MiB\n", s->client_cpu,
            s->client_wall, s->client_cpu_share * 100, (double)s->client_peak_rss / (1 << 20));
}

bool lg_summary_warn_client(FILE *err, const lg_summary *s)
{
    if (!(s->client_cpu_share > LG_CLIENT_CPU_WARN))
        return false;
    fprintf(err,
            "warning: the benchmark client itself used %.1f%% of a core over the run (%.2f s of CPU in %.2f s), "
            "over %.0f%%: on a machine with few cores it takes CPU time from the server it measures\n",
            s->client_cpu_share * 100, s->client_cpu, s->client_wall, LG_CLIENT_CPU_WARN * 100);
    return true;
}

json_t *lg_json_number(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

json_t *lg_json_text(const char *s)
{
    json_t *j = json_string(s);
    if (j)
        return j;
    /* Not UTF-8 (a message cut mid-character, or a server's raw bytes): keep the ASCII. */
    char *copy = strdup(s);
    if (!copy)
        return json_string("");
    for (char *p = copy; *p; p++)
        if ((unsigned char)*p >= 0x80)
            *p = '?';
    j = json_string(copy);
    free(copy);
    return j;
}

static json_t *dist_json(const lg_dist *d)
{
    return json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:I}", "mean", lg_json_number(d->mean), "median",
                     lg_json_number(d->median), "p90", lg_json_number(d->p90), "p99", lg_json_number(d->p99), "min",
                     lg_json_number(d->min), "max", lg_json_number(d->max), "count", (json_int_t)d->n);
}

void lg_summary_to_json(const lg_summary *s, json_t *obj)
{
    json_t *res = json_object();
    json_object_set_new(res, "duration_s", lg_json_number(s->duration));
    json_object_set_new(res, "completed", json_integer((json_int_t)s->completed));
    json_object_set_new(res, "failed", json_integer((json_int_t)s->failed));
    json_object_set_new(res, "input_tokens", json_integer(s->input_tokens));
    json_object_set_new(res, "output_tokens", json_integer(s->output_tokens));
    json_object_set_new(res, "request_throughput", lg_json_number(s->request_throughput));
    json_object_set_new(res, "input_token_throughput", lg_json_number(s->input_throughput));
    json_object_set_new(res, "output_token_throughput", lg_json_number(s->output_throughput));
    json_object_set_new(res, "total_token_throughput", lg_json_number(s->total_throughput));
    json_object_set_new(res, "goodput", lg_json_number(s->goodput));
    json_object_set_new(res, "good_requests", s->have_slo ? json_integer((json_int_t)s->good) : json_null());
    json_object_set_new(res, "ttft_ms", dist_json(&s->ttft));
    json_object_set_new(res, "tpot_ms", dist_json(&s->tpot));
    json_object_set_new(res, "itl_ms", dist_json(&s->itl));
    json_object_set_new(res, "e2e_ms", dist_json(&s->e2e));
    json_object_set_new(res, "cost_per_million_output_tokens", lg_json_number(s->cost_output));
    json_object_set_new(res, "cost_per_million_total_tokens", lg_json_number(s->cost_total));
    json_object_set_new(res, "instance_hours_per_million_output_tokens", lg_json_number(s->hours_output));
    json_object_set_new(res, "instance_hours_per_million_total_tokens", lg_json_number(s->hours_total));
    json_object_set_new(res, "requests_without_usage", json_integer((json_int_t)s->usage_missing));
    json_object_set_new(obj, "results", res);

    json_t *fails = json_array();
    for (int i = 0; i < s->n_causes; i++)
        json_array_append_new(fails, json_pack("{s:s, s:I, s:o}", "cause", s->causes[i].cause, "count",
                                               (json_int_t)s->causes[i].count, "example",
                                               lg_json_text(s->causes[i].example)));
    json_object_set_new(obj, "failures", fails);

    json_object_set_new(obj, "server",
                        json_pack("{s:o, s:o, s:o, s:o, s:o}", "kv_usage_mean", lg_json_number(s->kv_usage_mean),
                                  "kv_usage_peak", lg_json_number(s->kv_usage_peak), "kv_blocks_total",
                                  lg_json_number(s->kv_blocks_total), "prefix_cache_hit_rate",
                                  lg_json_number(s->prefix_hit_rate), "kv_utilisation",
                                  lg_json_number(s->kv_utilisation)));
    json_object_set_new(obj, "client",
                        json_pack("{s:o, s:o, s:o, s:I}", "cpu_s", lg_json_number(s->client_cpu), "wall_s",
                                  lg_json_number(s->client_wall), "cpu_share", lg_json_number(s->client_cpu_share),
                                  "peak_rss_bytes", (json_int_t)s->client_peak_rss));
}

json_t *lg_requests_json(const lg_run_result *r)
{
    json_t *a = json_array();
    for (size_t i = 0; i < r->n_records; i++) {
        const lg_record *q = &r->records[i];
        char cause[32];
        lg_record_cause(q, cause, sizeof cause);
        json_array_append_new(
            a, json_pack("{s:I, s:i, s:o, s:o, s:o, s:o, s:i, s:i, s:I, s:I, s:s, s:o}", "session",
                         (json_int_t)q->session, "turn", q->turn, "start_s", lg_json_number(q->start), "ttft_ms",
                         lg_json_number(lg_record_ttft(q) * 1e3), "tpot_ms", lg_json_number(lg_record_tpot(q) * 1e3),
                         "e2e_ms", lg_json_number(lg_record_e2e(q) * 1e3), "prompt_len", q->prompt_len, "max_tokens",
                         q->max_tokens, "input_tokens", (json_int_t)q->input_tokens, "output_tokens",
                         (json_int_t)q->output_tokens, "failure", cause, "error",
                         lg_json_text(q->error ? q->error : "")));
    }
    return a;
}

json_t *lg_samples_json(const lg_run_result *r)
{
    json_t *a = json_array();
    for (size_t i = 0; i < r->n_samples; i++) {
        const lg_sample *s = &r->samples[i];
        json_array_append_new(
            a, json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o}", "t_s", lg_json_number(s->t), "kv_blocks_used",
                         lg_json_number(s->kv_used), "kv_blocks_total", lg_json_number(s->kv_total), "kv_usage",
                         lg_json_number(s->kv_usage), "prefix_hit_tokens", lg_json_number(s->hit_tokens),
                         "prefix_query_tokens", lg_json_number(s->query_tokens), "running", lg_json_number(s->running),
                         "waiting", lg_json_number(s->waiting), "kv_utilisation", lg_json_number(s->kv_utilisation)));
    }
    return a;
}

void lg_progress_bar(const lg_progress *p, void *user)
{
    (void)user;
    double frac = p->total > 0 ? (double)p->done / (double)p->total
                  : p->duration > 0 ? p->elapsed / p->duration
                                    : 0;
    if (frac > 1)
        frac = 1;
    char bar[31];
    int fill = (int)(frac * 30);
    for (int i = 0; i < 30; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[30] = 0;
    if (p->total > 0)
        fprintf(stderr, "\r[%s] %lld/%lld requests, %lld failed, %d in flight, %.1f s ", bar, (long long)p->done,
                (long long)p->total, (long long)p->failed, p->in_flight, p->elapsed);
    else
        fprintf(stderr, "\r[%s] %lld requests, %lld failed, %d in flight, %.1f/%.0f s ", bar, (long long)p->done,
                (long long)p->failed, p->in_flight, p->elapsed, p->duration);
    fflush(stderr);
}

void lg_progress_end(void)
{
    fputc('\n', stderr);
}

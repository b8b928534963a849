/* The --report page of `blade bench serve` (html.h): one self-contained HTML file with
 * inline SVG charts, which opens anywhere without a network. */

#include "loadgen/html.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLUE "#2b6cb0"
#define ORANGE "#c05621"
#define GREEN "#2f855a"
#define PURPLE "#6b46c1"
#define GREY "#718096"

static void esc(FILE *f, const char *s)
{
    for (; *s; s++) {
        switch (*s) {
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '&': fputs("&amp;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

/* ---- charts ---- */

typedef struct chart {
    FILE *f;
    double x0, x1, y0, y1;
    int n_legend;
} chart;

enum { W = 640, H = 280, ML = 64, MR = 16, MT = 34, MB = 44 };

/* 1, 2 or 5 times a power of ten, giving about `target` intervals over range. */
static double nice_step(double range, int target)
{
    double raw = range / target;
    double mag = pow(10, floor(log10(raw)));
    double f = raw / mag;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
}

static double nice_max(double v)
{
    if (!(v > 0))
        return 1;
    double step = nice_step(v, 5);
    return ceil(v / step) * step;
}

static double px(const chart *c, double x)
{
    return ML + (x - c->x0) / (c->x1 - c->x0) * (W - ML - MR);
}

static double py(const chart *c, double y)
{
    return H - MB - (y - c->y0) / (c->y1 - c->y0) * (H - MT - MB);
}

static void tick_label(char *buf, size_t cap, double v, double step)
{
    if (step >= 1 || v == 0)
        snprintf(buf, cap, "%.0f", v);
    else
        snprintf(buf, cap, "%.*f", (int)ceil(-log10(step)), v);
}

static void chart_begin(chart *c, FILE *f, const char *title, const char *xlabel, const char *ylabel, double x0,
                        double x1, double y0, double y1)
{
    c->f = f;
    c->x0 = x0;
    c->x1 = x1 > x0 ? x1 : x0 + 1;
    c->y0 = y0;
    c->y1 = y1 > y0 ? y1 : y0 + 1;
    c->n_legend = 0;
    fprintf(f, "<figure><svg viewBox=\"0 0 %d %d\" width=\"%d\" height=\"%d\" role=\"img\">\n", W, H, W, H);
    fprintf(f, "<text x=\"%d\" y=\"20\" class=\"t\">", ML);
    esc(f, title);
    fprintf(f, "</text>\n");
    double xs = nice_step(c->x1 - c->x0, 6), ys = nice_step(c->y1 - c->y0, 5);
    char lab[32];
    for (double v = ceil(c->x0 / xs) * xs; v <= c->x1 + xs * 1e-9; v += xs) {
        tick_label(lab, sizeof lab, v, xs);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" class=\"g\"/>", px(c, v), MT, px(c, v), H - MB);
        fprintf(f, "<text x=\"%.1f\" y=\"%d\" class=\"a\" text-anchor=\"middle\">%s</text>\n", px(c, v), H - MB + 16,
                lab);
    }
    for (double v = ceil(c->y0 / ys) * ys; v <= c->y1 + ys * 1e-9; v += ys) {
        tick_label(lab, sizeof lab, v, ys);
        fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" class=\"g\"/>", ML, py(c, v), W - MR, py(c, v));
        fprintf(f, "<text x=\"%d\" y=\"%.1f\" class=\"a\" text-anchor=\"end\">%s</text>\n", ML - 6, py(c, v) + 4, lab);
    }
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" class=\"frame\"/>\n", ML, MT, W - ML - MR,
            H - MT - MB);
    fprintf(f, "<text x=\"%d\" y=\"%d\" class=\"a\" text-anchor=\"middle\">", (ML + W - MR) / 2, H - 8);
    esc(f, xlabel);
    fprintf(f, "</text><text transform=\"translate(14 %d) rotate(-90)\" class=\"a\" text-anchor=\"middle\">",
            (MT + H - MB) / 2);
    esc(f, ylabel);
    fprintf(f, "</text>\n");
}

static void chart_legend(chart *c, const char *label, const char *color)
{
    int x = W - MR - 170, y = MT + 16 + 16 * c->n_legend++;
    fprintf(c->f, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"%s\" stroke-width=\"2\"/>", x, y - 4, x + 18,
            y - 4, color);
    fprintf(c->f, "<text x=\"%d\" y=\"%d\" class=\"a\">", x + 24, y);
    esc(c->f, label);
    fprintf(c->f, "</text>\n");
}

/* A polyline through the points; `step` draws a staircase (a value holds until the next),
 * the honest shape for counts sampled at instants. */
static void chart_line(chart *c, const double *xs, const double *ys, size_t n, const char *color, bool step,
                       bool dashed)
{
    if (!n)
        return;
    fprintf(c->f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\"%s points=\"", color,
            dashed ? " stroke-dasharray=\"5 4\"" : "");
    for (size_t i = 0; i < n; i++) {
        if (isnan(ys[i]))
            continue;
        if (step && i > 0 && !isnan(ys[i - 1]))
            fprintf(c->f, "%.1f,%.1f ", px(c, xs[i]), py(c, ys[i - 1]));
        fprintf(c->f, "%.1f,%.1f ", px(c, xs[i]), py(c, ys[i]));
    }
    fprintf(c->f, "\"/>\n");
}

static void chart_vline(chart *c, double x, const char *label, const char *color)
{
    if (isnan(x))
        return;
    fprintf(c->f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"%s\" stroke-dasharray=\"3 3\"/>",
            px(c, x), MT, px(c, x), H - MB, color);
    fprintf(c->f, "<text x=\"%.1f\" y=\"%d\" class=\"a\" fill=\"%s\">%s</text>\n", px(c, x) + 3, MT + 12, color, label);
}

static void chart_end(chart *c, const char *caption)
{
    fprintf(c->f, "</svg><figcaption>");
    esc(c->f, caption);
    fprintf(c->f, "</figcaption></figure>\n");
}

static void chart_empty(FILE *f, const char *title, const char *why)
{
    fprintf(f, "<figure class=\"empty\"><p><b>");
    esc(f, title);
    fprintf(f, "</b>: ");
    esc(f, why);
    fprintf(f, "</p></figure>\n");
}

/* ---- the figures ---- */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef double (*record_figure)(const lg_record *);

/* The empirical CDF of one per-request latency over completed requests, drawn through at
 * most 400 quantiles so a long run's page stays small. */
static void cdf_chart(FILE *f, const lg_run_result *r, const char *name, record_figure fig, const lg_dist *d)
{
    double *v = malloc((r->n_records ? r->n_records : 1) * sizeof *v);
    size_t n = 0;
    for (size_t i = 0; v && i < r->n_records; i++) {
        double x = r->records[i].failure == LG_OK ? fig(&r->records[i]) * 1e3 : NAN;
        if (!isnan(x))
            v[n++] = x;
    }
    char title[96];
    snprintf(title, sizeof title, "%s: cumulative distribution", name);
    if (n < 2) {
        chart_empty(f, title, "fewer than two requests have this figure");
        free(v);
        return;
    }
    qsort(v, n, sizeof *v, cmp_double);
    size_t m = n < 400 ? n : 400;
    double xs[400], ys[400];
    for (size_t k = 0; k < m; k++) {
        size_t i = m == n ? k : (size_t)((double)k / (double)(m - 1) * (double)(n - 1));
        xs[k] = v[i];
        ys[k] = (double)(i + 1) / (double)n;
    }
    chart c;
    char xlabel[64];
    snprintf(xlabel, sizeof xlabel, "%s (ms)", name);
    chart_begin(&c, f, title, xlabel, "fraction of requests", 0, nice_max(v[n - 1]), 0, 1);
    chart_line(&c, xs, ys, m, BLUE, true, false);
    chart_vline(&c, d->median, "p50", GREEN);
    chart_vline(&c, d->p90, "p90", ORANGE);
    chart_vline(&c, d->p99, "p99", PURPLE);
    char cap[160];
    snprintf(cap, sizeof cap, "%zu requests; median %.2f ms, p90 %.2f ms, p99 %.2f ms.", n, d->median, d->p90, d->p99);
    chart_end(&c, cap);
    free(v);
}

/* Inter-token gaps as a histogram: a second hump far to the right is decode stalling
 * behind other requests' prefills. The axis ends at 1.5 x p99; longer gaps are counted in
 * the last bar. */
static void itl_chart(FILE *f, const lg_run_result *r, const lg_dist *d)
{
    if (d->n < 2) {
        chart_empty(f, "ITL: histogram", "no request streamed two or more text chunks");
        return;
    }
    enum { BINS = 50 };
    double hi = nice_max(d->p99 * 1.5 > d->p99 ? d->p99 * 1.5 : d->max);
    double counts[BINS] = {0}, edges[BINS];
    size_t over = 0;
    for (size_t i = 0; i < r->n_records; i++) {
        const lg_record *q = &r->records[i];
        if (q->failure != LG_OK)
            continue;
        for (int32_t k = 1; k < q->n_chunks; k++) {
            double g = (q->chunks[k] - q->chunks[k - 1]) * 1e3;
            int b = (int)(g / hi * BINS);
            if (b >= BINS) {
                b = BINS - 1;
                over++;
            }
            counts[b < 0 ? 0 : b]++;
        }
    }
    double top = 0;
    for (int b = 0; b < BINS; b++) {
        edges[b] = hi * b / BINS;
        counts[b] /= (double)d->n;
        if (counts[b] > top)
            top = counts[b];
    }
    chart c;
    chart_begin(&c, f, "ITL: histogram", "gap between streamed chunks (ms)", "fraction of gaps", 0, hi, 0,
                nice_max(top));
    for (int b = 0; b < BINS; b++)
        if (counts[b] > 0)
            fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"/>\n", px(&c, edges[b]),
                    py(&c, counts[b]), px(&c, hi / BINS) - px(&c, 0) - 1, py(&c, 0) - py(&c, counts[b]), BLUE);
    chart_vline(&c, d->median, "p50", GREEN);
    chart_vline(&c, d->p99, "p99", PURPLE);
    char cap[200];
    snprintf(cap, sizeof cap, "%zu gaps; mean %.2f ms, p99 %.2f ms, longest %.2f ms%s.", d->n, d->mean, d->p99, d->max,
             over ? " (gaps past the axis are in the last bar)" : "");
    chart_end(&c, cap);
}

/* Output tokens per second and the mean number of requests in flight, in 60 intervals of
 * the run (50 ms at least). A request's tokens are spread over its text chunks, so the
 * total matches its reported count. */
static void time_charts(FILE *f, const lg_run_result *r)
{
    if (!(r->duration > 0) || !r->n_records) {
        chart_empty(f, "Throughput over time", "no request finished");
        return;
    }
    double width = r->duration / 60 > 0.05 ? r->duration / 60 : 0.05;
    size_t bins = (size_t)ceil(r->duration / width);
    if (bins < 2)
        bins = 2;
    /* One point more than bins: the staircase's last step runs to the end of the run. */
    double *t = calloc(bins + 1, sizeof *t), *tok = calloc(bins + 1, sizeof *tok),
           *inflight = calloc(bins + 1, sizeof *inflight);
    if (!t || !tok || !inflight)
        goto out;
    for (size_t b = 0; b <= bins; b++)
        t[b] = (double)b * width;
    for (size_t i = 0; i < r->n_records; i++) {
        const lg_record *q = &r->records[i];
        if (q->failure == LG_OK && q->n_chunks) {
            double per = (double)q->output_tokens / q->n_chunks;
            for (int32_t k = 0; k < q->n_chunks; k++) {
                size_t b = (size_t)(q->chunks[k] / width);
                tok[b < bins ? b : bins - 1] += per / width;
            }
        }
        for (size_t b = 0; b < bins; b++) {
            double lo = q->start > t[b] ? q->start : t[b], hi = q->end < t[b + 1] ? q->end : t[b + 1];
            if (hi > lo)
                inflight[b] += (hi - lo) / width;
        }
    }
    double top_tok = 0, top_in = 0;
    for (size_t b = 0; b < bins; b++) {
        top_tok = tok[b] > top_tok ? tok[b] : top_tok;
        top_in = inflight[b] > top_in ? inflight[b] : top_in;
    }
    tok[bins] = tok[bins - 1];
    inflight[bins] = inflight[bins - 1];
    chart c;
    chart_begin(&c, f, "Output throughput over time", "time since the first request (s)", "output tokens/s", 0,
                t[bins], 0, nice_max(top_tok));
    chart_line(&c, t, tok, bins + 1, BLUE, true, false);
    char cap[160];
    snprintf(cap, sizeof cap, "Tokens streamed in each %.2f s interval, per second.", width);
    chart_end(&c, cap);

    double *run = NULL, *wait = NULL, *st = NULL;
    size_t ns = r->n_samples;
    if (r->scraped && ns && (run = malloc(ns * sizeof *run)) && (wait = malloc(ns * sizeof *wait)) &&
        (st = malloc(ns * sizeof *st))) {
        for (size_t i = 0; i < ns; i++) {
            st[i] = r->samples[i].t;
            run[i] = r->samples[i].running;
            wait[i] = r->samples[i].waiting;
            top_in = run[i] > top_in ? run[i] : top_in;
            top_in = wait[i] > top_in ? wait[i] : top_in;
        }
    }
    chart_begin(&c, f, "Requests in flight over time", "time since the first request (s)", "requests", 0, t[bins], 0,
                nice_max(top_in));
    chart_line(&c, t, inflight, bins + 1, BLUE, true, false);
    chart_legend(&c, "in flight (client)", BLUE);
    if (st) {
        chart_line(&c, st, run, ns, GREEN, true, false);
        chart_legend(&c, "running (server)", GREEN);
        chart_line(&c, st, wait, ns, ORANGE, true, false);
        chart_legend(&c, "waiting (server)", ORANGE);
    }
    chart_end(&c, "Requests sent and not yet finished, averaged over each interval; with blade, the engine's running "
                  "and waiting sequences as /metrics reported them.");
    free(run);
    free(wait);
    free(st);
out:
    free(t);
    free(tok);
    free(inflight);
}

static void server_charts(FILE *f, const lg_run_result *r)
{
    if (!r->scraped || r->n_samples < 2) {
        chart_empty(f, "KV cache and prefix cache over time",
                    "the endpoint exposes no blade /metrics (or the run was too short to sample)");
        return;
    }
    size_t n = r->n_samples;
    double *t = malloc(n * sizeof *t), *used = malloc(n * sizeof *used), *total = malloc(n * sizeof *total),
           *hit = malloc(n * sizeof *hit);
    if (!t || !used || !total || !hit)
        goto out;
    const lg_sample *s0 = &r->samples[0];
    double top = 0;
    for (size_t i = 0; i < n; i++) {
        const lg_sample *s = &r->samples[i];
        t[i] = s->t;
        used[i] = s->kv_used;
        total[i] = s->kv_total;
        double q = s->query_tokens - s0->query_tokens;
        hit[i] = q > 0 ? (s->hit_tokens - s0->hit_tokens) / q * 100 : NAN;
        if (used[i] > top)
            top = used[i];
        if (total[i] > top)
            top = total[i];
    }
    chart c;
    chart_begin(&c, f, "KV cache blocks over time", "time since the first request (s)", "blocks", 0, t[n - 1], 0,
                nice_max(top));
    chart_line(&c, t, used, n, BLUE, true, false);
    chart_legend(&c, "held by running requests", BLUE);
    chart_line(&c, t, total, n, GREY, true, true);
    chart_legend(&c, "pool size", GREY);
    chart_end(&c, "blade:kv_blocks_used and blade:kv_blocks_total, sampled from /metrics.");
    chart_begin(&c, f, "Prefix-cache hit rate over time", "time since the first request (s)", "% of prompt tokens",
                0, t[n - 1], 0, 100);
    chart_line(&c, t, hit, n, GREEN, false, false);
    chart_end(&c, "Prompt tokens found in the prefix cache / prompt tokens looked up, from the start of the run to "
                  "each sample (blade:prefix_cache_hits_total, blade:prefix_cache_queries_total).");
out:
    free(t);
    free(used);
    free(total);
    free(hit);
}

/* ---- tables ---- */

static void config_rows(FILE *f, const char *prefix, const json_t *v)
{
    if (json_is_object(v)) {
        const char *key;
        json_t *child;
        json_object_foreach((json_t *)v, key, child)
        {
            char name[128];
            snprintf(name, sizeof name, "%s%s%s", prefix, *prefix ? "." : "", key);
            config_rows(f, name, child);
        }
        return;
    }
    char *text = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    fprintf(f, "<tr><th>");
    esc(f, prefix);
    fprintf(f, "</th><td>");
    esc(f, text ? text : "");
    fprintf(f, "</td></tr>\n");
    free(text);
}

static void figure_row(FILE *f, const char *name, const char *fmt, double v)
{
    fprintf(f, "<tr><th>%s</th><td>", name);
    if (isnan(v))
        fprintf(f, "-");
    else
        fprintf(f, fmt, v);
    fprintf(f, "</td></tr>\n");
}

static void dist_row(FILE *f, const char *name, const lg_dist *d)
{
    fprintf(f, "<tr><th>%s</th>", name);
    const double v[] = {d->mean, d->median, d->p90, d->p99, d->max};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        if (isnan(v[i]))
            fprintf(f, "<td>-</td>");
        else
            fprintf(f, "<td>%.2f</td>", v[i]);
    fprintf(f, "<td>%zu</td></tr>\n", d->n);
}

static const char *style =
    "body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1340px;color:#1a202c;padding:0 16px}"
    "h1{font-size:20px}h2{font-size:16px;margin-top:28px}"
    "table{border-collapse:collapse;margin:8px 0}th,td{padding:3px 10px;border-bottom:1px solid #e2e8f0;"
    "text-align:right}th{text-align:left;font-weight:600}"
    ".grid{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0;border:1px solid #e2e8f0;padding:6px}"
    "figure.empty{width:628px;color:#718096}figcaption{font-size:12px;color:#4a5568;max-width:628px}"
    "svg text{font:11px system-ui,sans-serif}svg .t{font-size:13px;font-weight:600}svg .a{fill:#4a5568}"
    "svg .g{stroke:#edf2f7}svg .frame{fill:none;stroke:#a0aec0}";

int lg_write_html(const char *path, const char *title, const json_t *config, const lg_run_result *r,
                  const lg_summary *s, blade_error *err)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return blade_error_set(err, "cannot write %s: %s", path, strerror(errno));
    fprintf(f, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>");
    esc(f, title);
    fprintf(f, "</title><style>%s</style></head><body>\n<h1>", style);
    esc(f, title);
    fprintf(f, "</h1>\n<div class=\"grid\"><div><h2>Results</h2><table>\n");
    fprintf(f, "<tr><th>requests completed / failed</th><td>%zu / %zu</td></tr>\n", s->completed, s->failed);
    figure_row(f, "duration (s)", "%.2f", s->duration);
    fprintf(f, "<tr><th>input / output tokens</th><td>%lld / %lld</td></tr>\n", (long long)s->input_tokens,
            (long long)s->output_tokens);
    figure_row(f, "request throughput (req/s)", "%.2f", s->request_throughput);
    figure_row(f, "input throughput (tok/s)", "%.1f", s->input_throughput);
    figure_row(f, "output throughput (tok/s)", "%.1f", s->output_throughput);
    figure_row(f, "total throughput (tok/s)", "%.1f", s->total_throughput);
    figure_row(f, "goodput (req/s)", "%.2f", s->goodput);
    figure_row(f, "cost per 1M output tokens ($)", "%.4f", s->cost_output);
    figure_row(f, "cost per 1M total tokens ($)", "%.4f", s->cost_total);
    figure_row(f, "instance-hours per 1M output tokens", "%.4f", s->hours_output);
    figure_row(f, "KV blocks held, mean (%)", "%.1f", s->kv_usage_mean * 100);
    figure_row(f, "KV blocks held, peak (%)", "%.1f", s->kv_usage_peak * 100);
    figure_row(f, "prefix-cache hit rate (%)", "%.1f", s->prefix_hit_rate * 100);
    figure_row(f, "KV slot utilisation (%)", "%.1f", s->kv_utilisation * 100);
    figure_row(f, "client CPU (% of one core)", "%.1f", s->client_cpu_share * 100);
    figure_row(f, "client peak RSS (MiB)", "%.1f", (double)s->client_peak_rss / (1 << 20));
    fprintf(f, "</table>\n<h2>Latency (ms)</h2><table><tr><th></th><th>mean</th><th>median</th><th>p90</th>"
               "<th>p99</th><th>max</th><th>n</th></tr>\n");
    dist_row(f, "TTFT", &s->ttft);
    dist_row(f, "TPOT", &s->tpot);
    dist_row(f, "ITL", &s->itl);
    dist_row(f, "E2E", &s->e2e);
    fprintf(f, "</table>\n");
    if (s->n_causes) {
        fprintf(f, "<h2>Failures</h2><table><tr><th>cause</th><th>count</th><th>first message</th></tr>\n");
        for (int i = 0; i < s->n_causes; i++) {
            fprintf(f, "<tr><th>");
            esc(f, s->causes[i].cause);
            fprintf(f, "</th><td>%zu</td><td style=\"text-align:left\">", s->causes[i].count);
            esc(f, s->causes[i].example);
            fprintf(f, "</td></tr>\n");
        }
        fprintf(f, "</table>\n");
    }
    fprintf(f, "</div><div><h2>Configuration</h2><table>\n");
    config_rows(f, "", config);
    fprintf(f, "</table></div></div>\n<h2>Latency distributions</h2><div class=\"grid\">\n");
    cdf_chart(f, r, "TTFT", lg_record_ttft, &s->ttft);
    cdf_chart(f, r, "TPOT", lg_record_tpot, &s->tpot);
    cdf_chart(f, r, "E2E", lg_record_e2e, &s->e2e);
    itl_chart(f, r, &s->itl);
    fprintf(f, "</div>\n<h2>Over time</h2><div class=\"grid\">\n");
    time_charts(f, r);
    server_charts(f, r);
    fprintf(f, "</div>\n</body></html>\n");
    if (fclose(f))
        return blade_error_set(err, "cannot write %s: %s", path, strerror(errno));
    return 0;
}

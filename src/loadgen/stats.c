/* The arithmetic behind every figure of `blade bench serve` (stats.h): percentiles,
 * distributions, cost per million tokens and SLO checks, free of I/O so tests can pin it. */

#include "loadgen/stats.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

double lg_percentile(const double *sorted, size_t n, double p)
{
    if (n == 0)
        return NAN;
    double rank = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(rank);
    if (lo >= n - 1)
        return sorted[n - 1];
    double frac = rank - (double)lo;
    return sorted[lo] + frac * (sorted[lo + 1] - sorted[lo]);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void lg_dist_compute(double *values, size_t n, lg_dist *d)
{
    d->n = n;
    if (n == 0) {
        d->mean = d->median = d->p90 = d->p99 = d->min = d->max = NAN;
        return;
    }
    qsort(values, n, sizeof *values, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += values[i];
    d->mean = sum / (double)n;
    d->median = lg_percentile(values, n, 50);
    d->p90 = lg_percentile(values, n, 90);
    d->p99 = lg_percentile(values, n, 99);
    d->min = values[0];
    d->max = values[n - 1];
}

double lg_cost_per_million(double price_per_hour, double duration_s, double tokens)
{
    if (!(tokens > 0))
        return NAN;
    return price_per_hour * duration_s / 3600.0 / tokens * 1e6;
}

bool lg_slo_any(const lg_slo *s)
{
    return s->ttft_ms > 0 || s->tpot_ms > 0 || s->e2e_ms > 0;
}

bool lg_slo_met(const lg_slo *s, double ttft_ms, double tpot_ms, double e2e_ms)
{
    if (s->ttft_ms > 0 && !(ttft_ms <= s->ttft_ms))
        return false;
    if (s->tpot_ms > 0 && !isnan(tpot_ms) && !(tpot_ms <= s->tpot_ms))
        return false;
    if (s->e2e_ms > 0 && !(e2e_ms <= s->e2e_ms))
        return false;
    return true;
}

int lg_slo_parse(const char *spec, lg_slo *s, char *msg, size_t msg_len)
{
    memset(s, 0, sizeof *s);
    const char *p = spec;
    while (*p) {
        const char *eq = strchr(p, '=');
        size_t klen = eq ? (size_t)(eq - p) : 0;
        double *dst = NULL;
        if (klen == 4 && !strncmp(p, "ttft", 4))
            dst = &s->ttft_ms;
        else if (klen == 4 && !strncmp(p, "tpot", 4))
            dst = &s->tpot_ms;
        else if (klen == 3 && !strncmp(p, "e2e", 3))
            dst = &s->e2e_ms;
        if (!dst) {
            snprintf(msg, msg_len, "--slo expects ttft=MS,tpot=MS[,e2e=MS], got '%s'", spec);
            return -1;
        }
        char *end;
        errno = 0;
        double v = strtod(eq + 1, &end);
        if (errno || end == eq + 1 || (*end && *end != ',') || !isfinite(v) || v <= 0) {
            snprintf(msg, msg_len, "--slo: '%.*s' needs a positive number of milliseconds", (int)klen, p);
            return -1;
        }
        *dst = v;
        p = *end ? end + 1 : end;
    }
    if (!lg_slo_any(s)) {
        snprintf(msg, msg_len, "--slo names no objective");
        return -1;
    }
    return 0;
}

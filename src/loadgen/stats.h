#ifndef BLADE_LOADGEN_STATS_H
#define BLADE_LOADGEN_STATS_H

/* The arithmetic behind every figure `blade bench serve` reports, kept free of I/O so the
 * tests can check it exactly against hand-computed values. */

#include <stdbool.h>
#include <stddef.h>

/* Percentile p (0..100) of n ascending values by linear interpolation between the two
 * closest ranks, numpy's default method: rank = p/100 * (n-1), result = v[floor] +
 * frac * (v[floor+1] - v[floor]). NAN for n == 0, so an empty figure never reads as 0. */
double lg_percentile(const double *sorted, size_t n, double p);

/* Summary of one latency figure; every field NAN when n == 0. */
typedef struct lg_dist {
    size_t n;
    double mean, median, p90, p99, min, max;
} lg_dist;

/* Sorts values in place, then fills d. */
void lg_dist_compute(double *values, size_t n, lg_dist *d);

/* What running for duration_s seconds at price_per_hour costs per million tokens:
 * price x duration / 3600 / tokens x 1e6. NAN when no tokens were produced. With a
 * price of 1 it is instance-hours per million tokens, the price-free form. */
double lg_cost_per_million(double price_per_hour, double duration_s, double tokens);

/* Service-level objectives in milliseconds; a value <= 0 is not checked. */
typedef struct lg_slo {
    double ttft_ms, tpot_ms, e2e_ms;
} lg_slo;

bool lg_slo_any(const lg_slo *s);
/* A request with a single output token has no TPOT (tpot_ms NAN) and meets any TPOT
 * objective: there was no gap between tokens to be slow. */
bool lg_slo_met(const lg_slo *s, double ttft_ms, double tpot_ms, double e2e_ms);
/* Parses "ttft=200,tpot=50[,e2e=2000]" (milliseconds). -1 with a message in msg. */
int lg_slo_parse(const char *spec, lg_slo *s, char *msg, size_t msg_len);

#endif

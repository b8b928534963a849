#ifndef BLADE_LOADGEN_SUMMARY_H
#define BLADE_LOADGEN_SUMMARY_H

/* From a run's records to the figures `blade bench serve` reports, and those figures as
 * text, JSON (the file `blade bench compare` reads) and the input of the HTML report. */

#include "loadgen/client.h"
#include "loadgen/stats.h"

#include <jansson.h>
#include <stdio.h>

#define LG_MAX_CAUSES 16

typedef struct lg_cause {
    char cause[32];     /* as lg_record_cause */
    size_t count;
    char example[256];  /* the first such failure's message */
} lg_cause;

typedef struct lg_summary {
    double duration;    /* seconds, first request sent to last finished */
    size_t completed, failed;
    int64_t input_tokens, output_tokens; /* of completed requests */
    double request_throughput, input_throughput, output_throughput, total_throughput; /* per second */
    lg_dist ttft, tpot, itl, e2e; /* milliseconds */
    bool have_slo;
    lg_slo slo;
    size_t good;        /* completed requests meeting every objective */
    double goodput;     /* good requests per second */
    /* cost per million tokens: at the price (NAN without one), and in instance-hours */
    double price_per_hour;
    double cost_output, cost_total;
    double hours_output, hours_total;
    lg_cause causes[LG_MAX_CAUSES];
    int n_causes;
    size_t usage_missing; /* completed requests whose tokens were counted here, not by the server */
    /* from blade's /metrics over the run; NAN when not scraped or not exposed */
    double kv_usage_mean, kv_usage_peak, kv_blocks_total;
    double prefix_hit_rate; /* hits / lookups between the first and last sample */
    double kv_utilisation;  /* the server's own figure at the end of the run */
    /* the client's own cost over the run (lg_run_result): CPU and wall seconds, their
     * ratio (1 = one core busy the whole time) and its peak resident set in bytes */
    double client_cpu, client_wall, client_cpu_share;
    int64_t client_peak_rss;
} lg_summary;

/* Over this share of one core the client competes with the server it measures. */
#define LG_CLIENT_CPU_WARN 0.10

/* price_per_hour <= 0: no price; slo NULL or empty: no goodput. -1 when memory runs out. */
int lg_summarize(const lg_run_result *r, double price_per_hour, const lg_slo *slo, lg_summary *s);

void lg_summary_print(FILE *out, const lg_summary *s);
/* A warning on err when the client used more than LG_CLIENT_CPU_WARN of a core; true if
 * it did. */
bool lg_summary_warn_client(FILE *err, const lg_summary *s);

/* {"results": ..., "failures": ..., "server": ..., "client": ...} members added to obj. */
void lg_summary_to_json(const lg_summary *s, json_t *obj);
/* Per-request figures and the /metrics samples, for the JSON file. */
json_t *lg_requests_json(const lg_run_result *r);
json_t *lg_samples_json(const lg_run_result *r);
/* json_real that maps NAN and infinities to null, which JSON has no numbers for. */
json_t *lg_json_number(double v);
/* json_string that never fails on bytes that are not UTF-8 (they become '?'). */
json_t *lg_json_text(const char *s);

/* A progress bar on stderr, redrawn in place; for lg_run_config.progress when stderr is a
 * terminal. */
void lg_progress_bar(const lg_progress *p, void *user);
/* Ends the progress bar's line. */
void lg_progress_end(void);

#endif

#ifndef BLADE_LOADGEN_CLIENT_H
#define BLADE_LOADGEN_CLIENT_H

/* The measuring client: replays a workload against an OpenAI-compatible endpoint over
 * libcurl's multi interface (every request streaming on one thread, so no client thread
 * competes with the server for the CPU and every timestamp comes from one clock), and
 * samples the server's /metrics while it runs.
 *
 * Each request is POST /v1/completions with "stream": true, "max_tokens" = the workload's
 * output length, "temperature": 0 and "stream_options": {"include_usage": true}. Times are
 * taken when bytes arrive: TTFT runs from handing the request to the connection (connection
 * set-up included, as a real client sees it) to the first chunk carrying text; every gap
 * between such chunks is an inter-token latency.
 *
 * The caller initialises libcurl (curl_global_init) once before the first call. */

#include "blade/error.h"
#include "blade/tokenizer.h"
#include "loadgen/workload.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum lg_failure {
    LG_OK,
    LG_FAIL_HTTP,       /* the server answered with a status other than 200 */
    LG_FAIL_CONNECTION, /* refused, reset or broken off */
    LG_FAIL_TIMEOUT,    /* over the per-request time limit */
    LG_FAIL_STREAM      /* an error event in the stream, or a stream that ended without [DONE] */
} lg_failure;

typedef struct lg_record {
    int64_t session;
    int32_t turn;
    double start;          /* seconds since the run started: request handed to the connection */
    double end;            /* seconds since the run started: its last byte */
    double *chunks;        /* arrival time of each chunk that carried text (same clock) */
    int32_t n_chunks;
    int32_t prompt_len;    /* tokens the workload sent */
    int32_t max_tokens;
    int64_t input_tokens;  /* the server's usage when reported, else counted here */
    int64_t output_tokens;
    bool usage_reported;
    lg_failure failure;
    int http_status;       /* 0 when no response came */
    lg_label label;        /* what the workload meant the request to be */
    int cache_tier;        /* X-Blade-Semantic-Cache: 0 none, 1 exact, 2 semantic */
    float cache_similarity;
    char *error;           /* what went wrong, for failures; malloc'd */
} lg_record;

/* Time to first token, time per output token after the first ((E2E - TTFT) / (output
 * tokens - 1)) and end-to-end latency, in seconds. NAN where undefined: no text chunk for
 * TTFT, fewer than two output tokens for TPOT. */
double lg_record_ttft(const lg_record *r);
double lg_record_tpot(const lg_record *r);
double lg_record_e2e(const lg_record *r);
/* "HTTP 503", "connection error", "timeout", "stream error"; "" for success. */
void lg_record_cause(const lg_record *r, char *buf, size_t cap);

/* One /metrics sample of a blade server; NAN for a figure the server did not expose. */
typedef struct lg_sample {
    double t;
    double kv_used, kv_total, kv_usage;  /* blocks held by running sequences, pool size, ratio */
    double hit_tokens, query_tokens;     /* prefix cache counters since the server started */
    double running, waiting;
    double kv_utilisation;               /* token slots used / allocated, when exposed */
} lg_sample;

typedef struct lg_progress {
    int64_t done, failed;
    int64_t total;   /* 0: the run is bounded by time */
    int in_flight;
    double elapsed, duration;
} lg_progress;

typedef struct lg_run_config {
    const char *url;                 /* base URL, e.g. http://127.0.0.1:8080 */
    const char *model;
    const char *api_key;             /* NULL: no Authorization header */
    const lg_workload *workload;
    const blade_tokenizer *tok;      /* renders text prompts and counts tokens the server did not */
    bool prompt_text;                /* send prompts as text, not token ids */
    bool ignore_eos;                 /* add the "ignore_eos" extension (blade, vLLM) */
    bool semantic_cache;             /* add "semantic_cache": true (blade): answers may be stored */
    int64_t num_requests;            /* 0: until the duration has passed (one of the two is set) */
    double duration;                 /* seconds during which new requests start; 0: no limit */
    double request_rate;             /* requests (sessions) per second; INFINITY: all at once */
    double burstiness;
    uint64_t seed;                   /* of the arrival times */
    int max_concurrency;             /* 0: unlimited */
    double timeout;                  /* seconds per request; 0: none */
    bool warmup;                     /* one uncounted request first */
    double scrape_interval;          /* seconds between /metrics samples; 0: none */
    void (*progress)(const lg_progress *p, void *user);
    void *progress_user;
} lg_run_config;

typedef struct lg_run_result {
    lg_record *records;   /* in the order they finished */
    size_t n_records;
    double duration;      /* first request sent to last request finished */
    lg_sample *samples;
    size_t n_samples;
    bool scraped;         /* the endpoint exposes blade's /metrics */
    /* What the client itself cost, from the start of lg_run (warm-up included) to its end:
     * CPU seconds of this process (user + system, every thread) and wall seconds, and the
     * process's peak resident set (ru_maxrss) in bytes. */
    double client_cpu, client_wall;
    int64_t client_peak_rss;
} lg_run_result;

/* -1 only when the run could not take place (the warm-up request failed, or memory ran
 * out); failed measured requests are results, not errors. */
int lg_run(const lg_run_config *cfg, lg_run_result *out, blade_error *err);
void lg_run_result_free(lg_run_result *r);

/* GET base_url + path: the status and body (malloc'd, NUL-terminated). -1 with a message
 * when no HTTP answer came. */
int lg_http_get(const char *base_url, const char *path, const char *api_key, double timeout, long *status,
                char **body, blade_error *err);

/* The value of an unlabelled Prometheus sample "name value" in text. */
bool lg_prom_value(const char *text, const char *name, double *out);

#endif

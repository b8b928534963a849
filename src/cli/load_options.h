#ifndef BLADE_CLI_LOAD_OPTIONS_H
#define BLADE_CLI_LOAD_OPTIONS_H

/* The load the benchmark clients send (bench serve, bench ablation): its flags (workload,
 * arrivals, request options, report), declared once for both, and its record as JSON, which
 * decides whether two results can be compared. */

#include "cli/flags.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct cli_load_options {
    lg_workload_config wl;
    const char *api_key;
    bool prompt_text, ignore_eos, warmup;
    int64_t num_requests;
    double duration, request_rate, burstiness, timeout, price_per_hour;
    long long max_concurrency;
    lg_slo slo;
    const char *json_path;
} cli_load_options;

/* Starts with its own sections ("workload", ...). */
extern const cli_flag cli_load_flags[];

void cli_load_options_init(cli_load_options *o);
/* Checks what the flags say together and fills the defaults that depend on the workload;
 * -1 after reporting a usage error of cmd. */
int cli_load_finalize(cli_load_options *o, const cli_command *cmd);

/* What decides the traffic: two results are comparable only when this is equal. */
json_t *cli_load_workload_json(const cli_load_options *o);
/* Request count or duration, arrivals and concurrency. */
json_t *cli_load_json(const cli_load_options *o);
json_t *cli_load_slo_json(const lg_slo *s);
/* The path as a JSON string, or null. */
json_t *cli_json_path(const char *p);

#endif

#ifndef BLADE_CLI_LOAD_RUN_H
#define BLADE_CLI_LOAD_RUN_H

/* Sending a load to an OpenAI-compatible server, as bench serve and bench ablation do:
 * asking the server for its model, running the workload with a progress bar, summarising,
 * and writing the result document. */

#include "blade/tokenizer.h"
#include "cli/load_options.h"
#include "loadgen/client.h"
#include "loadgen/summary.h"

#include <jansson.h>

typedef struct cli_load_target {
    const char *url, *model, *tokenizer_path;
    int32_t max_context; /* 0: unknown */
} cli_load_target;

/* Builds the workload, runs it with a progress bar on a terminal, and summarises. Errors
 * are reported on stderr. */
int cli_load_run(const cli_load_options *o, const cli_load_target *t, const blade_tokenizer *tok,
                 lg_run_result *res, lg_summary *sum);
/* The first model GET /v1/models lists: its id (malloc'd) and, when the server says (blade
 * and vLLM do), its context length. Errors are reported on stderr. */
int cli_load_query_models(const char *url, const char *api_key, char **id, int32_t *max_context);
/* The time now, as a JSON string (UTC, ISO 8601). */
json_t *cli_json_now(void);
/* Writes doc to path, indented; reports a failure on stderr. */
int cli_json_write(const char *path, json_t *doc);

#endif

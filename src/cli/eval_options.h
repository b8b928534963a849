#ifndef BLADE_CLI_EVAL_OPTIONS_H
#define BLADE_CLI_EVAL_OPTIONS_H

/* The flags the evaluation commands (perplexity, eval) share, parsed in one place so they
 * mean the same in each, and the steps both take before scoring. */

#include "blade/eval.h"
#include "blade/model.h"

#include <getopt.h>

/* getopt codes of the shared long-only flags; a command's own start at CLI_EVAL_OPT_END. */
enum cli_eval_opt {
    CLI_EVAL_OPT_CHUNKS = 1000,
    CLI_EVAL_OPT_KV_TYPE,
    CLI_EVAL_OPT_BATCH_TOKENS,
    CLI_EVAL_OPT_END
};

/* What the shared flags set: the model (-m; the base for eval), the text (-f) and the
 * evaluation config. */
typedef struct cli_eval_args {
    const char *model_path;
    const char *text_path;
    blade_eval_config cfg;
} cli_eval_args;

/* The shared flags' entries for a command's getopt_long table, and its short options. */
#define CLI_EVAL_SHORTOPTS "m:f:c:t:h"
#define CLI_EVAL_LONGOPTS                                                                  \
    {"model", required_argument, 0, 'm'}, {"file", required_argument, 0, 'f'},                      \
    {"ctx-size", required_argument, 0, 'c'}, {"chunks", required_argument, 0, CLI_EVAL_OPT_CHUNKS}, \
        {"kv-type", required_argument, 0, CLI_EVAL_OPT_KV_TYPE},                                    \
        {"batch-tokens", required_argument, 0, CLI_EVAL_OPT_BATCH_TOKENS},                          \
        {"threads", required_argument, 0, 't'}

/* Defaults: the shared stories260K model when present, no text, blade_eval_config_default. */
void cli_eval_args_init(cli_eval_args *a);
/* Handles one getopt result: 1 when it was a shared flag, 0 when not, -1 on a bad value
 * (already reported on stderr). */
int cli_eval_option(cli_eval_args *a, int code, const char *arg);
/* blade_model_load, reporting a failure on stderr. */
blade_model *cli_eval_load_model(const char *path);
/* Reads the text file and cuts it into chunks with m's tokenizer, reporting a failure on
 * stderr with the file's name. */
int cli_eval_read_text(blade_eval_text *t, const blade_model *m, const char *text_path,
                       const blade_eval_config *cfg);

#endif

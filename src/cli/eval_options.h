#ifndef BLADE_CLI_EVAL_OPTIONS_H
#define BLADE_CLI_EVAL_OPTIONS_H

/* The flags the evaluation commands (perplexity, eval) share, declared once so they mean the
 * same in each, and the steps both take before scoring. */

#include "blade/eval.h"
#include "blade/model.h"
#include "cli/flags.h"

/* What the shared flags set: the model (-m; the base for eval), the text (-f) and the
 * evaluation config. */
typedef struct cli_eval_args {
    const char *model_path;
    const char *text_path;
    blade_eval_config cfg;
} cli_eval_args;

extern const cli_flag cli_eval_flags[];

/* Defaults: the shared stories260K model when present, no text, blade_eval_config_default. */
void cli_eval_args_init(cli_eval_args *a);
/* blade_model_load, reporting a failure on stderr. */
blade_model *cli_eval_load_model(const char *path);
/* Reads the text file and cuts it into chunks with m's tokenizer, reporting a failure on
 * stderr with the file's name. */
int cli_eval_read_text(blade_eval_text *t, const blade_model *m, const char *text_path,
                       const blade_eval_config *cfg);

#endif

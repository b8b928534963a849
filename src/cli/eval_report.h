#ifndef BLADE_CLI_EVAL_REPORT_H
#define BLADE_CLI_EVAL_REPORT_H

/* How the evaluation commands (perplexity, eval, and the quantizer's gate) show their
 * results: a progress bar on a terminal, tables for people, JSON for scripts, and a
 * gate's verdict term by term. */

#include "blade/eval.h"

#include <stdbool.h>
#include <stdio.h>

/* What the tables and the JSON name besides the numbers. */
typedef struct cli_eval_info {
    const char *base_path;
    const char *cand_path;
    const char *text_path;
    blade_kv_type base_kv;
    blade_kv_type cand_kv;
} cli_eval_info;

/* A blade_eval_progress_fn drawing a bar on stderr; user is unused. */
void cli_eval_progress(const blade_eval_progress *p, void *user);
/* Ends the bar's line. */
void cli_eval_progress_done(void);

void cli_eval_print_table(FILE *out, const cli_eval_info *info, const blade_eval_result *r);
/* gate may be NULL. Returns 0, or -1 when writing failed. */
int cli_eval_print_json(FILE *out, const cli_eval_info *info, const blade_eval_result *r, const char *gate_expr,
                        const blade_gate *gate);
/* One line per term, or only the failing ones. */
void cli_gate_print(FILE *out, const blade_gate *g, const blade_eval_result *r, bool only_failing);

#endif

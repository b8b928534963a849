#ifndef BLADE_CLI_QUANTIZE_GATE_H
#define BLADE_CLI_QUANTIZE_GATE_H

/* `blade quantize --gate`: the quantized file is judged against its input (blade eval's
 * comparison) before it may take OUT's name. Everything that can be checked before the
 * conversion (the expression, the base model, the text) is, so a mistake costs no
 * conversion time. */

#include "blade/error.h"
#include "blade/eval.h"
#include "blade/model.h"

typedef struct cli_quantize_gate {
    const char *expr;
    blade_gate gate;
    const char *text_path;
    blade_eval_config cfg;
    const char *in_path, *out_path; /* as the tables name them */
    blade_model *base;
    blade_eval_text text;
} cli_quantize_gate;

/* Loads the input as the base model and cuts the text into chunks; a failure is reported on
 * stderr. The expression is already parsed and cfg set. */
int cli_quantize_gate_open(cli_quantize_gate *g);
/* Evaluates the file at written_path against the base: the table on stdout, the verdict on
 * stderr. Returns 0 when every condition holds, 3 when one fails, -1 with err set when the
 * evaluation itself fails. */
int cli_quantize_gate_judge(cli_quantize_gate *g, const char *written_path, blade_error *err);
void cli_quantize_gate_close(cli_quantize_gate *g);

#endif

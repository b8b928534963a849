/* The quantizer's quality gate (quantize_gate.h). */

#include "cli/quantize_gate.h"

#include "cli/eval_options.h"
#include "cli/eval_report.h"

#include <stdio.h>

int cli_quantize_gate_open(cli_quantize_gate *g)
{
    if (!(g->base = cli_eval_load_model(g->in_path)))
        return -1;
    if (cli_eval_read_text(&g->text, g->base, g->text_path, &g->cfg)) {
        blade_model_free(g->base);
        g->base = NULL;
        return -1;
    }
    return 0;
}

int cli_quantize_gate_judge(cli_quantize_gate *g, const char *written_path, blade_error *err)
{
    blade_model *cand = blade_model_load(written_path, err);
    if (!cand)
        return -1;
    int rc = -1;
    blade_eval_result r = {0};
    if (blade_eval_check_vocab(g->base, cand, err))
        goto done;
    fprintf(stderr, "gate %s: evaluating %s against %s on %s\n", g->expr, g->out_path, g->in_path, g->text_path);
    if (cli_eval_run_compare(g->base, cand, &g->text, &g->cfg, &r)) {
        blade_error_set(err, "the evaluation failed");
        goto done;
    }
    cli_eval_info info = {.base_path = g->in_path, .cand_path = g->out_path, .text_path = g->text_path,
                          .base_kv = BLADE_KV_F16, .cand_kv = g->cfg.kv_type};
    printf("\n");
    cli_eval_print_table(stdout, &info, &r);
    fflush(stdout);
    rc = cli_gate_report(&g->gate, &r) ? 3 : 0;
done:
    blade_eval_result_free(&r);
    blade_model_free(cand);
    return rc;
}

void cli_quantize_gate_close(cli_quantize_gate *g)
{
    blade_eval_text_free(&g->text);
    blade_model_free(g->base);
    g->base = NULL;
}

/* `blade eval`: what a change to a model (a quantized file, a KV cache type) costs in
 * quality against its base (eval.h), with an optional gate on the result. */

#include "blade/eval.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/eval_options.h"
#include "cli/eval_report.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef struct eval_options {
    cli_eval_args shared;
    const char *cand_path, *gate_expr;
    bool json;
} eval_options;

static void eval_init(void *opts)
{
    eval_options *o = opts;
    cli_eval_args_init(&o->shared);
}

#define O eval_options
static const cli_flag eval_flags[] = {
    {.name = "candidate", .kind = CLI_PATH, CLI_AT(O, cand_path), .metavar = "FILE", .required = true,
     .help = "the GGUF to judge; it must have the base's vocabulary"},
    {.name = "json", .kind = CLI_BOOL, CLI_AT(O, json), .help = "the results as JSON on stdout instead of tables"},
    {.name = "gate", .kind = CLI_STRING, CLI_AT(O, gate_expr), .metavar = "EXPR",
     .help = "conditions the candidate must meet, e.g. \"kld<=0.02,ppl<=+1.5%,top1>=0.95\" (measures kld, "
             "kld_median, kld_p90, kld_p99, kld_max, ppl, top1); exit status 3 and the failing conditions on "
             "stderr when one fails"},
    {0},
};
#undef O

static int eval_main(int argc, char **argv);

const cli_command cli_cmd_eval = {
    .name = "eval",
    .summary = "what a quantization or KV type costs in quality: PPL, KL divergence, top-1",
    .synopsis = "-m BASE.gguf --candidate CAND.gguf -f TEXT [options]",
    .about = "What a change to a model costs in quality: a quantized file, or a KV cache type, against the\n"
             "base it came from. Both models score the text's chunks by the llama.cpp perplexity method\n"
             "(see `blade perplexity --help`) and every scored position is compared: perplexity of both,\n"
             "the change in perplexity (ΔPPL, with the standard error of the per-token NLL difference\n"
             "carried to the ratio), the KL divergence of the candidate's next-token distribution from the\n"
             "base's (mean, median, p90, p99, max), how often the most likely token agrees (top-1), and\n"
             "the same per chunk. The candidate may be the base file itself (to judge a KV type alone).\n",
    .tables = (const cli_table[]){{cli_eval_flags, offsetof(eval_options, shared)}, {eval_flags, 0}, {0}},
    .opts_size = sizeof(eval_options),
    .init = eval_init,
    .main = eval_main,
};

static int eval_main(int argc, char **argv)
{
    eval_options o;
    int parsed = cli_parse(&cli_cmd_eval, argc, argv, &o);
    if (parsed != CLI_RUN)
        return parsed;
    const char *base_path = o.shared.model_path, *text_path = o.shared.text_path, *cand_path = o.cand_path,
               *gate_expr = o.gate_expr;
    bool json = o.json;
    blade_eval_config cfg = o.shared.cfg;
    if (!base_path)
        return cli_usage_error(&cli_cmd_eval, "no base model given (-m FILE)");
    blade_gate gate;
    blade_error err = {{0}};
    if (gate_expr && blade_gate_parse(gate_expr, &gate, &err)) {
        fprintf(stderr, "error: --gate: %s\n", err.msg);
        return 2;
    }

    int rc = 1;
    blade_eval_text text = {0};
    blade_eval_result r = {0};
    blade_model *base = cli_eval_load_model(base_path);
    /* the same file (a KV type judged alone) is loaded once */
    bool same = strcmp(base_path, cand_path) == 0;
    blade_model *cand = !base || same ? base : cli_eval_load_model(cand_path);
    if (!cand)
        goto done;
    if (blade_eval_check_vocab(base, cand, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto done;
    }
    if (cli_eval_read_text(&text, base, text_path, &cfg))
        goto done;
    fprintf(stderr, "%zu tokens, %d chunks of %d; base KV f16, candidate KV %s\n", text.n_tokens, text.n_chunks,
            text.n_ctx, blade_kv_type_name(cfg.kv_type));
    bool tty = isatty(STDERR_FILENO);
    if (tty)
        cfg.progress = cli_eval_progress;
    int failed = blade_eval_compare(base, cand, &text, &cfg, &r, &err);
    if (tty)
        cli_eval_progress_done();
    if (failed) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto done;
    }
    cli_eval_info info = {.base_path = base_path, .cand_path = cand_path, .text_path = text_path,
                          .base_kv = BLADE_KV_F16, .cand_kv = cfg.kv_type};
    if (json) {
        if (cli_eval_print_json(stdout, &info, &r, gate_expr, gate_expr ? &gate : NULL)) {
            fprintf(stderr, "error: cannot write the JSON report\n");
            goto done;
        }
    } else {
        cli_eval_print_table(stdout, &info, &r);
    }
    rc = 0;
    if (gate_expr) {
        if (blade_gate_failures(&gate, &r)) {
            fprintf(stderr, "gate failed:\n");
            cli_gate_print(stderr, &gate, &r, true);
            rc = 3;
        } else {
            fprintf(stderr, "gate passed:\n");
            cli_gate_print(stderr, &gate, &r, false);
        }
    }
done:
    blade_eval_result_free(&r);
    blade_eval_text_free(&text);
    if (cand != base)
        blade_model_free(cand);
    blade_model_free(base);
    return rc;
}

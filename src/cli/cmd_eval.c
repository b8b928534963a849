/* `blade eval`: what a change to a model (a quantized file, a KV cache type) costs in
 * quality against its base (eval.h), with an optional gate on the result. */

#include "blade/eval.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/eval_options.h"
#include "cli/eval_report.h"

#include <getopt.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void eval_usage(FILE *out)
{
    fprintf(out,
            "usage: blade eval -m BASE.gguf --candidate CAND.gguf -f TEXT [-c CTX] [--chunks N]\n"
            "                  [--kv-type T] [--json] [--gate EXPR]\n\n"
            "What a change to a model costs in quality: a quantized file, or a KV cache type, against the\n"
            "base it came from. Both models score the text's chunks by the llama.cpp perplexity method\n"
            "(see `blade perplexity --help`) and every scored position is compared: perplexity of both,\n"
            "the change in perplexity (ΔPPL, with the standard error of the per-token NLL difference\n"
            "carried to the ratio), the KL divergence of the candidate's next-token distribution from the\n"
            "base's (mean, median, p90, p99, max), how often the most likely token agrees (top-1), and\n"
            "the same per chunk. The candidate may be the base file itself (to judge a KV type alone).\n\n"
            "  -m, --model FILE       the base GGUF (default: ../shared/models/stories260K.gguf if present)\n"
            "      --candidate FILE   the GGUF to judge; it must have the base's vocabulary\n"
            "  -f, --file FILE        text to score\n"
            "  -c, --ctx-size N       chunk length in tokens (default 512)\n"
            "      --chunks N         score at most N chunks (default: all)\n"
            "      --kv-type T        the candidate's KV cache type: f16 (default), bf16, f32; the base's is f16\n"
            "      --batch-tokens N   tokens per forward call (default 512; a longer chunk is split)\n"
            "  -t, --threads N        compute threads (default: physical cores)\n"
            "      --json             the results as JSON on stdout instead of tables\n"
            "      --gate EXPR        conditions the candidate must meet, e.g. \"kld<=0.02,ppl<=+1.5%%,top1>=0.95\"\n"
            "                         (measures kld, kld_median, kld_p90, kld_p99, kld_max, ppl, top1);\n"
            "                         exit status 3 and the failing conditions on stderr when one fails\n"
            "  -h, --help             this help\n");
}

enum { OPT_CANDIDATE = CLI_EVAL_OPT_END, OPT_JSON, OPT_GATE };

int cmd_eval(int argc, char **argv)
{
    static const struct option longopts[] = {
        CLI_EVAL_LONGOPTS,
        {"candidate", required_argument, 0, OPT_CANDIDATE},
        {"json", no_argument, 0, OPT_JSON},
        {"gate", required_argument, 0, OPT_GATE},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    cli_eval_args a;
    cli_eval_args_init(&a);
    const char *cand_path = NULL, *gate_expr = NULL;
    bool json = false;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, CLI_EVAL_SHORTOPTS, longopts, NULL)) != -1) {
        int handled = cli_eval_option(&a, c, optarg);
        if (handled < 0)
            return 2;
        if (handled)
            continue;
        switch (c) {
        case OPT_CANDIDATE: cand_path = optarg; break;
        case OPT_JSON: json = true; break;
        case OPT_GATE: gate_expr = optarg; break;
        case 'h': eval_usage(stdout); return 0;
        default: eval_usage(stderr); return 2;
        }
    }
    const char *base_path = a.model_path, *text_path = a.text_path;
    blade_eval_config cfg = a.cfg;
    if (!base_path || !cand_path || !text_path || optind < argc) {
        eval_usage(stderr);
        return 2;
    }
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

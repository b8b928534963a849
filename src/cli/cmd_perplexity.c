/* `blade perplexity`: a model's perplexity on a text by the llama.cpp method, run through
 * the batched model runner (eval.h). */

#include "blade/eval.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/eval_options.h"
#include "cli/eval_report.h"

#include <getopt.h>
#include <stdio.h>
#include <unistd.h>

static void perplexity_usage(FILE *out)
{
    fprintf(out,
            "usage: blade perplexity -m MODEL -f TEXT [-c CTX] [--chunks N] [--kv-type T] [-t N]\n\n"
            "Perplexity by the llama.cpp method: the whole text is tokenized once with BOS first and cut\n"
            "into non-overlapping chunks of CTX tokens (the remainder dropped). Each chunk is evaluated\n"
            "from an empty context with its first token replaced by BOS, and the predictions at positions\n"
            "CTX/2 .. CTX-2 are scored against the token that follows each. The chunks run through the\n"
            "batched model runner that run and serve use, several to a forward call.\n\n"
            "  -m, --model FILE       GGUF model (default: ../shared/models/stories260K.gguf if present)\n"
            "  -f, --file FILE        text to score\n"
            "  -c, --ctx-size N       chunk length in tokens (default 512)\n"
            "      --chunks N         score at most N chunks (default: all)\n"
            "      --kv-type T        KV cache element type: f16 (default), bf16, f32\n"
            "      --batch-tokens N   tokens per forward call (default 512; a longer chunk is split)\n"
            "  -t, --threads N        compute threads (default: physical cores)\n"
            "  -h, --help             this help\n");
}

int cmd_perplexity(int argc, char **argv)
{
    static const struct option longopts[] = {CLI_EVAL_LONGOPTS, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    cli_eval_args a;
    cli_eval_args_init(&a);
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, CLI_EVAL_SHORTOPTS, longopts, NULL)) != -1) {
        int handled = cli_eval_option(&a, c, optarg);
        if (handled < 0)
            return 2;
        if (handled)
            continue;
        perplexity_usage(c == 'h' ? stdout : stderr);
        return c == 'h' ? 0 : 2;
    }
    if (!a.model_path || !a.text_path || optind < argc) {
        perplexity_usage(stderr);
        return 2;
    }
    blade_model *m = cli_eval_load_model(a.model_path);
    if (!m)
        return 1;
    blade_eval_config cfg = a.cfg;
    blade_eval_text text;
    if (cli_eval_read_text(&text, m, a.text_path, &cfg)) {
        blade_model_free(m);
        return 1;
    }
    fprintf(stderr, "%zu tokens, %d chunks of %d, KV %s\n", text.n_tokens, text.n_chunks, text.n_ctx,
            blade_kv_type_name(cfg.kv_type));
    bool tty = isatty(STDERR_FILENO);
    if (tty)
        cfg.progress = cli_eval_progress;
    blade_error err = {{0}};
    blade_perplexity_result r;
    int rc = blade_perplexity(m, &text, &cfg, &r, &err);
    if (tty)
        cli_eval_progress_done();
    if (rc) {
        fprintf(stderr, "error: %s\n", err.msg);
    } else {
        fprintf(stderr, "%lld predictions scored; %lld tokens in %.2f s (%.0f tokens/s)\n", (long long)r.n_scored,
                (long long)r.tokens_run, r.seconds, r.seconds > 0 ? (double)r.tokens_run / r.seconds : 0.0);
        printf("PPL = %.4f +/- %.4f\n", r.ppl, r.ppl_se);
    }
    blade_eval_text_free(&text);
    blade_model_free(m);
    return rc ? 1 : 0;
}

/* `blade perplexity`: a model's perplexity on a text by the llama.cpp method, run through
 * the batched model runner (eval.h). */

#include "blade/eval.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/eval_options.h"
#include "cli/eval_report.h"

#include <stdio.h>
#include <unistd.h>

static void perplexity_init(void *opts)
{
    cli_eval_args_init(opts);
}

static int perplexity_main(int argc, char **argv);

const cli_command cli_cmd_perplexity = {
    .name = "perplexity",
    .summary = "measure perplexity on a text file (llama.cpp method)",
    .synopsis = "-m MODEL -f TEXT [-c CTX] [--chunks N] [--kv-type T] [-t N]",
    .about = "Perplexity by the llama.cpp method: the whole text is tokenized once with BOS first and cut\n"
             "into non-overlapping chunks of CTX tokens (the remainder dropped). Each chunk is evaluated\n"
             "from an empty context with its first token replaced by BOS, and the predictions at positions\n"
             "CTX/2 .. CTX-2 are scored against the token that follows each. The chunks run through the\n"
             "batched model runner that run and serve use, several to a forward call.\n",
    .tables = (const cli_table[]){{cli_eval_flags, 0}, {0}},
    .opts_size = sizeof(cli_eval_args),
    .init = perplexity_init,
    .main = perplexity_main,
};

static int perplexity_main(int argc, char **argv)
{
    cli_eval_args a;
    int parsed = cli_parse(&cli_cmd_perplexity, argc, argv, &a);
    if (parsed != CLI_RUN)
        return parsed;
    if (!a.model_path)
        return cli_usage_error(&cli_cmd_perplexity, "no model given (-m FILE)");
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

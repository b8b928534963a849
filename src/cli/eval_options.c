/* The flags and steps the evaluation commands share (eval_options.h). */

#include "cli/eval_options.h"

#include "cli/cli_util.h"

#include <stdio.h>
#include <stdlib.h>

#define A cli_eval_args
const cli_flag cli_eval_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(A, model_path), .metavar = "FILE",
     .dflt = "../shared/models/stories260K.gguf if present", .help = "GGUF model; eval's base"},
    {.name = "file", .letter = 'f', .kind = CLI_PATH, CLI_AT(A, text_path), .metavar = "FILE", .required = true,
     .help = "text to score"},
    {.name = "ctx-size", .letter = 'c', .kind = CLI_INT, CLI_AT(A, cfg.n_ctx), .min = 4, .max = 1 << 20,
     .metavar = "N", .help = "chunk length in tokens"},
    {.name = "chunks", .kind = CLI_INT, CLI_AT(A, cfg.max_chunks), .min = 1, .max = 1 << 30, .metavar = "N",
     .dflt = "all", .help = "score at most N chunks"},
    {.name = "kv-type", .kind = CLI_ENUM, CLI_AT(A, cfg.kv_type), .choice_at = cli_kv_type_choice, .metavar = "T",
     .help = "KV cache element type; eval sets the candidate's, the base always uses f16"},
    {.name = "batch-tokens", .kind = CLI_INT, CLI_AT(A, cfg.batch_tokens), .min = 1, .max = 1 << 16,
     .metavar = "N", .help = "tokens per forward call; a longer chunk is split"},
    {.name = "threads", .letter = 't', .kind = CLI_INT, CLI_AT(A, cfg.n_threads), .min = 1, .max = 1024,
     .metavar = "N", .dflt = "physical cores", .help = "compute threads"},
    {0},
};
#undef A

void cli_eval_args_init(cli_eval_args *a)
{
    a->model_path = cli_default_model();
    a->text_path = NULL;
    blade_eval_config_default(&a->cfg);
}

blade_model *cli_eval_load_model(const char *path)
{
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    if (!m)
        fprintf(stderr, "error: %s\n", err.msg);
    return m;
}

int cli_eval_read_text(blade_eval_text *t, const blade_model *m, const char *text_path,
                       const blade_eval_config *cfg)
{
    size_t len;
    char *text = cli_read_file(text_path, &len);
    if (!text)
        return -1;
    blade_error err = {{0}};
    int rc = blade_eval_text_init(t, m, text, len, cfg, &err);
    free(text);
    if (rc)
        fprintf(stderr, "error: %s: %s\n", text_path, err.msg);
    return rc;
}

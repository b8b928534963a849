/* The flags and steps the evaluation commands share (eval_options.h). */

#include "cli/eval_options.h"

#include "cli/cli_util.h"

#include <stdio.h>
#include <stdlib.h>

void cli_eval_args_init(cli_eval_args *a)
{
    a->model_path = cli_default_model();
    a->text_path = NULL;
    blade_eval_config_default(&a->cfg);
}

int cli_eval_option(cli_eval_args *a, int c, const char *arg)
{
    blade_eval_config *cfg = &a->cfg;
    long long v;
    switch (c) {
    case 'm': a->model_path = arg; return 1;
    case 'f': a->text_path = arg; return 1;
    case 'c':
        if (!cli_parse_int("-c", arg, 4, 1 << 20, &v))
            return -1;
        cfg->n_ctx = (int32_t)v;
        return 1;
    case 't':
        if (!cli_parse_int("--threads", arg, 1, 1024, &v))
            return -1;
        cfg->n_threads = (int)v;
        return 1;
    case CLI_EVAL_OPT_CHUNKS:
        if (!cli_parse_int("--chunks", arg, 1, 1 << 30, &v))
            return -1;
        cfg->max_chunks = (int32_t)v;
        return 1;
    case CLI_EVAL_OPT_BATCH_TOKENS:
        if (!cli_parse_int("--batch-tokens", arg, 1, 1 << 16, &v))
            return -1;
        cfg->batch_tokens = (int32_t)v;
        return 1;
    case CLI_EVAL_OPT_KV_TYPE: {
        int t = blade_kv_type_from_name(arg);
        if (t < 0) {
            fprintf(stderr, "error: --kv-type: unknown KV type '%s' (known:", arg);
            for (int k = 0; k < BLADE_KV_TYPE_COUNT; k++)
                fprintf(stderr, " %s", blade_kv_type_name((blade_kv_type)k));
            fprintf(stderr, ")\n");
            return -1;
        }
        cfg->kv_type = (blade_kv_type)t;
        return 1;
    }
    default: return 0;
    }
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

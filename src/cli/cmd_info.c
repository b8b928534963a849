/* `blade info`: what a GGUF model holds and what its KV cache costs. */

#include "blade/gguf.h"
#include "blade/model.h"
#include "blade/types.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

static void human_bytes(char *buf, size_t cap, double b)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (b >= 1024.0 && u < 4) {
        b /= 1024.0;
        u++;
    }
    snprintf(buf, cap, u ? "%.2f %s" : "%.0f %s", b, units[u]);
}

static void print_kv_table(const blade_hparams *hp, blade_kv_type type)
{
    const char *label = blade_kv_type_name(type);
    size_t elem_bytes = blade_kv_type_size(type);
    blade_kv_store_config one_token = blade_model_kv_config(hp, type, 1, 1);
    uint64_t per_token = blade_kv_store_block_bytes(&one_token);
    char buf[32];
    human_bytes(buf, sizeof buf, (double)per_token);
    printf("  %s: 2 x %d layers x %d KV heads x %d head dim x %zu bytes = %llu bytes (%s) per token\n", label,
           hp->n_layer, hp->n_head_kv, hp->head_dim, elem_bytes, (unsigned long long)per_token, buf);
    printf("    %-8s %14s %14s %14s\n", "context", "1 seq", "8 seqs", "64 seqs");
    static const int contexts[] = {4096, 32768};
    static const int seqs[] = {1, 8, 64};
    for (int c = 0; c < 2; c++) {
        printf("    %-8s", contexts[c] == 4096 ? "4K" : "32K");
        for (int s = 0; s < 3; s++) {
            human_bytes(buf, sizeof buf, (double)per_token * contexts[c] * seqs[s]);
            printf(" %14s", buf);
        }
        printf("\n");
    }
}

/* What 1 GiB of KV holds for every --kv-type, as the engine allocates it (blocks of 16
 * tokens; the 8-bit types' per-token scales and their alignment included). */
static void print_kv_type_capacity(const blade_hparams *hp)
{
    const int32_t block = 16;
    const size_t gib = (size_t)1 << 30;
    int64_t f16_tokens = cli_kv_tokens(hp, BLADE_KV_F16, block, gib);
    printf("  per --kv-type, in 1 GiB (blocks of %d tokens):\n", block);
    printf("    %-6s %16s %12s %22s %8s\n", "type", "bytes per token", "tokens", "full-context seqs", "vs f16");
    for (int t = 0; t < BLADE_KV_TYPE_COUNT; t++) {
        blade_kv_store_config one_block = blade_model_kv_config(hp, (blade_kv_type)t, block, 1);
        int64_t tokens = cli_kv_tokens(hp, (blade_kv_type)t, block, gib);
        char seqs[32];
        snprintf(seqs, sizeof seqs, "%lld x %d", (long long)(tokens / hp->n_ctx_train), hp->n_ctx_train);
        printf("    %-6s %16.1f %12lld %22s %7.2fx\n", blade_kv_type_name((blade_kv_type)t),
               (double)blade_kv_store_block_bytes(&one_block) / block, (long long)tokens, seqs,
               f16_tokens ? (double)tokens / (double)f16_tokens : 0.0);
    }
}

typedef struct info_options {
    const char *model, *model_arg;
    bool list_tensors;
} info_options;

static const cli_flag info_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(info_options, model), .metavar = "FILE",
     .dflt = "../shared/models/stories260K.gguf if present",
     .help = "GGUF model (may also be given as the argument)"},
    {.name = "tensors", .kind = CLI_BOOL, CLI_AT(info_options, list_tensors),
     .help = "also list every tensor with its type and shape"},
    {0},
};

static int info_main(int argc, char **argv);

const cli_command cli_cmd_info = {
    .name = "info",
    .summary = "describe a model: shapes, tensor types, parameters, KV cache arithmetic",
    .synopsis = "[-m] MODEL [--tensors]",
    .about = "Prints architecture, shapes, tensor types, parameter count, weight bytes and the KV cache\n"
             "arithmetic (bytes per token = 2 x layers x KV heads x head dim x bytes per element, with\n"
             "totals at 4K and 32K context for 1, 8 and 64 concurrent sequences, and what 1 GiB holds\n"
             "for every --kv-type).\n",
    .tables = (const cli_table[]){{info_flags, 0}, {0}},
    .positionals = (const cli_positional[]){
        {.metavar = "MODEL", CLI_ARG_AT(info_options, model_arg), .optional = true, .help = "GGUF model, as -m"},
        {0}},
    .opts_size = sizeof(info_options),
    .main = info_main,
};

static int info_main(int argc, char **argv)
{
    info_options o;
    int rc = cli_parse(&cli_cmd_info, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    if (o.model && o.model_arg)
        return cli_usage_error(&cli_cmd_info, "the model is given twice: -m %s and %s", o.model, o.model_arg);
    const char *path = o.model ? o.model : o.model_arg ? o.model_arg : cli_default_model();
    bool list_tensors = o.list_tensors;
    if (!path)
        return cli_usage_error(&cli_cmd_info, "no model given");
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    if (!m) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    const blade_hparams *hp = &m->hp;
    const gguf_file *f = m->file;
    char *name = gguf_get_string(f, "general.name", NULL, NULL);
    printf("model:         %s\n", path);
    printf("name:          %s\n", name ? name : "(none)");
    free(name);
    printf("gguf:          version %u, %llu metadata keys, %llu tensors, alignment %u\n", f->version,
           (unsigned long long)f->n_kv, (unsigned long long)f->n_tensors, f->alignment);
    printf("architecture:  %s\n", hp->arch_name);
    printf("vocabulary:    %d tokens (%s tokenizer)\n", hp->n_vocab,
           blade_tokenizer_kind(m->tokenizer) == BLADE_VOCAB_SPM ? "llama/SentencePiece" : "gpt2/byte-level BPE");
    printf("context:       %d tokens (trained)\n", hp->n_ctx_train);
    printf("embedding:     %d\n", hp->n_embd);
    printf("layers:        %d\n", hp->n_layer);
    printf("heads:         %d query, %d KV (GQA group %d), head dim %d\n", hp->n_head, hp->n_head_kv,
           hp->n_head / hp->n_head_kv, hp->head_dim);
    printf("feed-forward:  %d (SwiGLU)\n", hp->n_ff);
    printf("rope:          %s, %d dims, base %g, linear scale %g%s\n", hp->rope_neox ? "NeoX" : "normal", hp->n_rot,
           hp->rope_base, hp->rope_scale, m->rope_freqs.data ? ", per-pair frequency factors (rope_freqs)" : "");
    printf("rms norm eps:  %g\n", hp->rms_eps);
    printf("extras:        %s%s%s\n", hp->tied_embeddings ? "tied embeddings " : "",
           m->layers[0].bq.data ? "QKV bias " : "", m->layers[0].q_norm.data ? "Q/K RMSNorm" : "");

    uint64_t count_by_type[BLADE_TYPE_COUNT] = {0}, bytes_by_type[BLADE_TYPE_COUNT] = {0};
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        count_by_type[f->tensors[i].type]++;
        bytes_by_type[f->tensors[i].type] += f->tensors[i].nbytes;
    }
    char buf[32];
    printf("tensor types: ");
    for (int t = 0; t < BLADE_TYPE_COUNT; t++)
        if (count_by_type[t]) {
            human_bytes(buf, sizeof buf, (double)bytes_by_type[t]);
            printf(" %s x %llu (%s)", blade_type_traits_get((uint32_t)t)->name,
                   (unsigned long long)count_by_type[t], buf);
        }
    printf("\n");
    human_bytes(buf, sizeof buf, (double)m->weight_bytes);
    printf("parameters:    %llu (%.3f M)\n", (unsigned long long)m->n_params, m->n_params / 1e6);
    printf("weight bytes:  %llu (%s, %.2f bits per parameter)\n", (unsigned long long)m->weight_bytes, buf,
           8.0 * (double)m->weight_bytes / (double)(m->n_params ? m->n_params : 1));
    printf("KV cache:\n");
    print_kv_table(hp, BLADE_KV_F16);
    print_kv_type_capacity(hp);
    if (list_tensors) {
        printf("tensors:\n");
        for (uint64_t i = 0; i < f->n_tensors; i++) {
            const gguf_tensor *t = &f->tensors[i];
            printf("  %-40s %-6s [%lld", t->name, blade_type_traits_get(t->type)->name, (long long)t->ne[0]);
            for (uint32_t d = 1; d < t->n_dims; d++)
                printf(", %lld", (long long)t->ne[d]);
            printf("] %zu bytes\n", t->nbytes);
        }
    }
    blade_model_free(m);
    return 0;
}

/* The engine flags the serving subcommands share, and what they do with them (engine_options.h). */

#include "cli/engine_options.h"

#include "blade/kernels.h"
#include "blade/kv_type.h"
#include "blade/types.h"
#include "cli/cli_util.h"

#include <stdlib.h>
#include <string.h>

static const cli_choice sched_modes[] = {{"continuous", BLADE_SCHED_CONTINUOUS}, {"static", BLADE_SCHED_STATIC}, {0}};
static const cli_choice kv_allocs[] = {{"paged", false}, {"contiguous", true}, {0}};
static const cli_choice spec_modes[] = {
    {"none", BLADE_SPEC_NONE}, {"ngram", BLADE_SPEC_NGRAM}, {"draft", BLADE_SPEC_DRAFT}, {"self", BLADE_SPEC_SELF}, {0}};

/* A type blade quantizes to and multiplies with. */
static bool parse_self_type(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    int t = blade_type_from_name(value);
    const blade_type_traits *tr = t >= 0 ? blade_type_traits_get((uint32_t)t) : NULL;
    if (!tr || !tr->from_float || !blade_matmul_supported((uint32_t)t)) {
        snprintf(why, cap, "--%s expects a weight type blade quantizes to (e.g. q4_0, q8_0, q4_k), got '%s'", f->name,
                 value);
        return false;
    }
    *(uint32_t *)dest = (uint32_t)t;
    return true;
}

#define E cli_engine_options
const cli_flag cli_engine_flags[] = {
    CLI_SECTION("engine options"),
    {.name = "threads", .letter = 't', .kind = CLI_INT, CLI_AT(E, cfg.n_threads), .min = 1, .max = 1024,
     .metavar = "N", .dflt = "physical cores", .help = "compute threads"},
    {.name = "ctx-size", .letter = 'c', .kind = CLI_INT, CLI_AT(E, cfg.max_context), .min = 2, .max = 1 << 24,
     .metavar = "N", .dflt = "the model's", .help = "longest prompt + output of one request"},
    {.name = "kv-mem", .kind = CLI_SIZE_OR_FRACTION, CLI_AT(E, kv_mem), .min = 1, .max = 0x1p50, .metavar = "SIZE",
     .help = "KV cache memory: bytes with a K/M/G suffix, e.g. 2G, or a fraction of the memory available at "
             "start, e.g. 0.5"},
    {.name = "kv-type", .kind = CLI_ENUM, CLI_AT(E, cfg.kv_type), .choice_at = cli_kv_type_choice, .metavar = "T",
     .help = "KV cache element type"},
    {.name = "block-size", .kind = CLI_INT, CLI_AT(E, cfg.block_size), .min = 1, .max = 1024, .metavar = "N",
     .help = "tokens per KV block"},
    {.name = "max-batch-tokens", .kind = CLI_INT, CLI_AT(E, cfg.sched.max_batch_tokens), .min = 1, .max = 1 << 20,
     .metavar = "N", .help = "token budget of one step"},
    {.name = "max-seqs", .kind = CLI_INT, CLI_AT(E, cfg.sched.max_seqs), .min = 1, .max = 4096, .metavar = "N",
     .help = "sequences per step"},
    {.name = "pin-prefix", .kind = CLI_PATH, CLI_AT(E, pin_prefix_file), .metavar = "FILE",
     .help = "compute FILE's text once and keep its KV cached for good"},
    {.name = "batch-aging-steps", .kind = CLI_INT, CLI_AT(E, cfg.sched.batch_aging_steps), .min = 0, .max = 1 << 30,
     .metavar = "N", .help = "steps after which a waiting batch request ranks as interactive"},
    CLI_SECTION("speculative decoding (greedy output is bit-identical either way)"),
    {.name = "spec", .kind = CLI_ENUM, CLI_AT(E, cfg.spec.mode), .choices = spec_modes, .metavar = "MODE",
     .help = "the drafter: ngram (prompt lookup), draft (--draft-model) or self (the model's first --self-layers "
             "layers)"},
    {.name = "draft-model", .kind = CLI_PATH, CLI_AT(E, cfg.spec.draft_model_path), .metavar = "FILE",
     .help = "a GGUF with this model's vocabulary drafts (implies --spec draft)"},
    {.name = "draft-kv-mem", .kind = CLI_SIZE, CLI_AT(E, cfg.spec.draft_kv_mem_bytes), .min = 1, .max = 0x1p50,
     .metavar = "SIZE", .dflt = "as many tokens as --kv-mem holds",
     .help = "the draft model's KV memory (or --self-type's copy's)"},
    {.name = "self-layers", .kind = CLI_INT, CLI_AT(E, cfg.spec.self_layers), .min = 1, .max = 1 << 16,
     .metavar = "L", .dflt = "a quarter of the layers; all with --self-type",
     .help = "layers of the model that draft with --spec self"},
    {.name = "self-type", .kind = CLI_CUSTOM, CLI_AT(E, cfg.spec.self_type), .parse = parse_self_type,
     .metavar = "TYPE", .dflt = "the model's own weights",
     .help = "--spec self drafts with a copy of its layers and classifier requantized to TYPE at load (e.g. "
             "q4_0): fewer bytes per drafted token"},
    {.name = "no-draft-lookup", .kind = CLI_BOOL, .negate = true, CLI_AT(E, cfg.spec.draft_lookup),
     .help = "draft with the model alone (--spec draft or self): by default prompt lookup's candidate goes in "
             "where the model is less sure of its own"},
    {.name = "spec-k", .kind = CLI_INT, CLI_AT(E, cfg.spec.k), .min = 1, .max = BLADE_SPEC_MAX_K, .metavar = "N",
     .help = "most drafted tokens per sequence and step; each step picks fewer from each request's acceptance and "
             "the verify cost measured at start, none when the step is compute-bound"},
    {.name = "spec-fixed-k", .kind = CLI_BOOL, .negate = true, CLI_AT(E, cfg.spec.adaptive),
     .help = "always draft --spec-k tokens (to measure a given k)"},
    {.name = "ngram-min", .kind = CLI_INT, CLI_AT(E, cfg.spec.ngram_min), .min = 1, .max = 64, .metavar = "N",
     .help = "shortest suffix prompt lookup tries"},
    {.name = "ngram-max", .kind = CLI_INT, CLI_AT(E, cfg.spec.ngram_max), .min = 1, .max = 64, .metavar = "N",
     .help = "longest suffix prompt lookup tries"},
    CLI_SECTION("baseline modes (to measure what each technique buys)"),
    {.name = "scheduler", .kind = CLI_ENUM, CLI_AT(E, cfg.sched.mode), .choices = sched_modes,
     .help = "static: request-level batching, a batch formed and run to completion, finished members keeping "
             "their seats"},
    {.name = "no-prefix-cache", .kind = CLI_BOOL, .negate = true, CLI_AT(E, cfg.prefix_caching),
     .help = "never reuse cached prompt blocks"},
    {.name = "no-chunked-prefill", .kind = CLI_BOOL, .negate = true, CLI_AT(E, cfg.sched.chunked_prefill),
     .help = "run each prompt whole, in a step of its own"},
    {.name = "kv-alloc", .kind = CLI_ENUM, CLI_AT(E, cfg.sched.contiguous_kv), .choices = kv_allocs,
     .help = "contiguous: reserve each request's maximum length up front"},
    {0},
};
#undef E

void cli_engine_options_init(cli_engine_options *o)
{
    memset(o, 0, sizeof *o);
    blade_engine_config_default(&o->cfg);
    o->kv_mem.fraction = 0.25;
}

static size_t available_memory(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb ? (size_t)kb * 1024 : (size_t)4 << 30;
}

int cli_engine_finalize(cli_engine_options *o, const blade_model *m)
{
    o->cfg.kv_mem_bytes = o->kv_mem.fraction > 0 ? (size_t)((double)available_memory() * o->kv_mem.fraction)
                                                  : o->kv_mem.bytes;
    if (o->cfg.max_context <= 0 || o->cfg.max_context > m->hp.n_ctx_train)
        o->cfg.max_context = m->hp.n_ctx_train;
    if (o->cfg.spec.draft_model_path && o->cfg.spec.mode == BLADE_SPEC_NONE)
        o->cfg.spec.mode = BLADE_SPEC_DRAFT;
    return 0;
}

int64_t cli_kv_tokens(const blade_hparams *hp, blade_kv_type t, int32_t block_size, size_t bytes)
{
    blade_kv_store_config one_block = blade_model_kv_config(hp, t, block_size, 0);
    size_t block_bytes = blade_kv_store_block_bytes(&one_block);
    return block_bytes ? (int64_t)(bytes / block_bytes) * block_size : 0;
}

void cli_engine_describe(FILE *out, const cli_engine_options *o, blade_engine *e)
{
    const blade_engine_config *c = &o->cfg;
    int64_t tokens = blade_engine_kv_tokens(e);
    int32_t ctx = blade_engine_max_context(e);
    fprintf(out, "techniques: paged KV %s (blocks of %d), prefix caching %s, continuous batching %s, "
                 "chunked prefill %s, speculative decoding %s",
            c->sched.contiguous_kv ? "OFF (contiguous reservation)" : "on", c->block_size,
            c->prefix_caching ? "on" : "OFF", c->sched.mode == BLADE_SCHED_STATIC ? "OFF (static)" : "on",
            c->sched.chunked_prefill ? "on" : "OFF", blade_spec_mode_name(c->spec.mode));
    if (c->spec.mode == BLADE_SPEC_NGRAM)
        fprintf(out, " (k %s%d, n-grams %d..%d)", c->spec.adaptive ? "<= " : "", c->spec.k, c->spec.ngram_min,
                c->spec.ngram_max);
    if (c->spec.mode == BLADE_SPEC_DRAFT)
        fprintf(out, " (k %s%d, draft %s)", c->spec.adaptive ? "<= " : "", c->spec.k, c->spec.draft_model_path);
    if (c->spec.mode == BLADE_SPEC_SELF)
        fprintf(out, " (k %s%d, first %d layers%s%s)", c->spec.adaptive ? "<= " : "", c->spec.k, c->spec.self_layers,
                c->spec.self_type == BLADE_SPEC_SELF_OWN ? "" : ", a copy in ",
                c->spec.self_type == BLADE_SPEC_SELF_OWN ? "" : blade_type_traits_get(c->spec.self_type)->name);
    int32_t draft_ctx = blade_engine_draft_context(e);
    if (draft_ctx > 0 && draft_ctx < ctx)
        fprintf(out, "; the draft model's context is %d tokens: longer sequences decode without speculation",
                draft_ctx);
    fprintf(out, "\n");
    fprintf(out, "KV cache: %.2f GiB of %s = %lld tokens = %lld full-context (%d-token) sequences; "
                 "step budget %d tokens, %d sequences\n",
            (double)c->kv_mem_bytes / 1073741824.0, blade_kv_type_name(c->kv_type), (long long)tokens,
            (long long)(tokens / ctx), ctx, c->sched.max_batch_tokens, c->sched.max_seqs);
    const blade_hparams *hp = &blade_engine_model(e)->hp;
    int64_t f16_tokens = cli_kv_tokens(hp, BLADE_KV_F16, c->block_size, c->kv_mem_bytes);
    fprintf(out, "KV cache by --kv-type, same memory:");
    for (int t = 0; t < BLADE_KV_TYPE_COUNT; t++) {
        int64_t n = cli_kv_tokens(hp, (blade_kv_type)t, c->block_size, c->kv_mem_bytes);
        fprintf(out, "%s %s %lld tokens = %lld sequences (%.2fx f16)", t ? "," : "", blade_kv_type_name((blade_kv_type)t),
                (long long)n, (long long)(n / ctx), f16_tokens ? (double)n / (double)f16_tokens : 0.0);
    }
    fprintf(out, "\n");
}

void cli_engine_print_spec(FILE *out, blade_engine *e)
{
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    if (st.spec_verifies == 0)
        return;
    fprintf(out, "speculative decoding: %llu drafts verified, %llu accepted (%.1f%%), %.2f tokens per verify step\n",
            (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted_tokens,
            100.0 * (double)st.spec_accepted_tokens / (double)st.spec_draft_tokens,
            1.0 + (double)st.spec_accepted_tokens / (double)st.spec_verifies);
}

typedef struct pin_wait {
    bool failed;
    char error[256];
} pin_wait;

static void on_pin_event(const blade_token_event *ev)
{
    pin_wait *w = ev->user;
    if (ev->finish == BLADE_FINISH_ERROR || ev->finish == BLADE_FINISH_ABORT) {
        w->failed = true;
        snprintf(w->error, sizeof w->error, "%s", ev->error ? ev->error : "aborted");
    }
}

int cli_engine_pin_prefix(const cli_engine_options *o, blade_engine *e)
{
    if (!o->pin_prefix_file)
        return 0;
    size_t len;
    char *text = cli_read_file(o->pin_prefix_file, &len);
    if (!text)
        return -1;
    pin_wait w = {0};
    blade_request q;
    blade_request_default(&q);
    q.prompt_text = text;
    q.prompt_text_len = len;
    q.max_tokens = 1;
    q.sampling.temperature = 0;
    q.pin_prefix = true;
    q.callback = on_pin_event;
    q.user = &w;
    blade_error err = {{0}};
    uint64_t id = blade_engine_submit(e, &q, &err);
    free(text);
    if (!id) {
        fprintf(stderr, "error: --pin-prefix %s: %s\n", o->pin_prefix_file, err.msg);
        return -1;
    }
    blade_engine_wait_idle(e);
    if (w.failed) {
        fprintf(stderr, "error: --pin-prefix %s: %s\n", o->pin_prefix_file, w.error);
        return -1;
    }
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    fprintf(stderr, "pinned %s: %d KV blocks kept for good\n", o->pin_prefix_file, st.kv_blocks_pinned);
    return 0;
}

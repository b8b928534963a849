#include "cli/engine_options.h"

#include "blade/kv_type.h"
#include "cli/cli_util.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>


const struct option cli_engine_longopts[] = {
    {"kv-mem", required_argument, 0, OPT_KV_MEM},
    {"block-size", required_argument, 0, OPT_BLOCK_SIZE},
    {"kv-type", required_argument, 0, OPT_KV_TYPE},
    {"max-batch-tokens", required_argument, 0, OPT_MAX_BATCH_TOKENS},
    {"max-seqs", required_argument, 0, OPT_MAX_SEQS},
    {"no-prefix-cache", no_argument, 0, OPT_NO_PREFIX_CACHE},
    {"no-chunked-prefill", no_argument, 0, OPT_NO_CHUNKED_PREFILL},
    {"scheduler", required_argument, 0, OPT_SCHEDULER},
    {"kv-alloc", required_argument, 0, OPT_KV_ALLOC},
    {"pin-prefix", required_argument, 0, OPT_PIN_PREFIX},
    {"ctx-size", required_argument, 0, OPT_CTX_SIZE},
    {"threads", required_argument, 0, OPT_THREADS},
    {"batch-aging-steps", required_argument, 0, OPT_BATCH_AGING},
};
const size_t cli_engine_longopts_count = sizeof cli_engine_longopts / sizeof cli_engine_longopts[0];

void cli_engine_options_init(cli_engine_options *o)
{
    memset(o, 0, sizeof *o);
    blade_engine_config_default(&o->cfg);
    o->kv_mem_fraction = 0.25;
}

void cli_engine_usage(FILE *out)
{
    fprintf(out,
            "engine options:\n"
            "  -t, --threads N            compute threads (default: physical cores)\n"
            "  -c, --ctx-size N           longest prompt + output of one request (default: the model's)\n"
            "      --kv-mem SIZE          KV cache memory: bytes with K/M/G suffix (e.g. 2G), or a fraction\n"
            "                             of available memory (e.g. 0.5); default 0.25\n"
            "      --kv-type T            KV element type: f16 (default), bf16, f32, or q8_0 / fp8 (8 bits\n"
            "                             with a scale per token and head: about twice the tokens)\n"
            "      --block-size N         tokens per KV block (default 16)\n"
            "      --max-batch-tokens N   token budget of one step (default 256)\n"
            "      --max-seqs N           sequences per step (default 64)\n"
            "      --pin-prefix FILE      compute FILE's text once and keep its KV cached for good\n"
            "      --batch-aging-steps N  steps after which a waiting batch request ranks as interactive\n"
            "                             (default 256)\n"
            "baseline modes (to measure what each technique buys):\n"
            "      --scheduler static     request-level batching: form a batch and run it to completion,\n"
            "                             finished members keeping their seats (default: continuous)\n"
            "      --no-prefix-cache      never reuse cached prompt blocks\n"
            "      --no-chunked-prefill   run each prompt whole, in a step of its own\n"
            "      --kv-alloc contiguous  reserve each request's maximum length up front (default: paged)\n");
}

/* "2G", "512M", "1073741824" -> bytes; "0.5" -> a fraction of available memory. */
static int parse_kv_mem(cli_engine_options *o, const char *arg)
{
    char *end;
    double v = strtod(arg, &end);
    if (end == arg || v <= 0) {
        fprintf(stderr, "error: --kv-mem expects a size like 2G or a fraction like 0.5, got '%s'\n", arg);
        return -1;
    }
    if (*end == 0 && v < 1.0) {
        o->kv_mem_fraction = v;
        return 0;
    }
    double unit = 1;
    if (*end) {
        switch (toupper((unsigned char)*end)) {
        case 'K': unit = 1024.0; break;
        case 'M': unit = 1024.0 * 1024; break;
        case 'G': unit = 1024.0 * 1024 * 1024; break;
        default:
            fprintf(stderr, "error: --kv-mem: unknown unit in '%s' (use K, M or G)\n", arg);
            return -1;
        }
        if (end[1] && strcasecmp(end + 1, "iB") && strcasecmp(end + 1, "B")) {
            fprintf(stderr, "error: --kv-mem: unknown unit in '%s'\n", arg);
            return -1;
        }
    }
    if (v * unit > 1e15) {
        fprintf(stderr, "error: --kv-mem %s is larger than any machine\n", arg);
        return -1;
    }
    o->cfg.kv_mem_bytes = (size_t)(v * unit);
    o->kv_mem_fraction = 0;
    return 0;
}

int cli_engine_option(cli_engine_options *o, int code, const char *arg)
{
    long long n;
    blade_engine_config *c = &o->cfg;
    switch (code) {
    case 't': return cli_engine_option(o, OPT_THREADS, arg);
    case 'c': return cli_engine_option(o, OPT_CTX_SIZE, arg);
    case OPT_KV_MEM: return parse_kv_mem(o, arg) ? -1 : 1;
    case OPT_BLOCK_SIZE:
        if (!cli_parse_int("--block-size", arg, 1, 1024, &n))
            return -1;
        c->block_size = (int32_t)n;
        return 1;
    case OPT_KV_TYPE: {
        int t = blade_kv_type_from_name(arg);
        if (t < 0) {
            fprintf(stderr, "error: --kv-type expects one of %s, got '%s'\n", blade_kv_type_names(), arg);
            return -1;
        }
        c->kv_type = (blade_kv_type)t;
        return 1;
    }
    case OPT_MAX_BATCH_TOKENS:
        if (!cli_parse_int("--max-batch-tokens", arg, 1, 1 << 20, &n))
            return -1;
        c->sched.max_batch_tokens = (int32_t)n;
        return 1;
    case OPT_MAX_SEQS:
        if (!cli_parse_int("--max-seqs", arg, 1, 4096, &n))
            return -1;
        c->sched.max_seqs = (int32_t)n;
        return 1;
    case OPT_NO_PREFIX_CACHE: c->prefix_caching = false; return 1;
    case OPT_NO_CHUNKED_PREFILL: c->sched.chunked_prefill = false; return 1;
    case OPT_SCHEDULER:
        if (strcmp(arg, "static") && strcmp(arg, "continuous")) {
            fprintf(stderr, "error: --scheduler expects continuous or static, got '%s'\n", arg);
            return -1;
        }
        c->sched.mode = strcmp(arg, "static") ? BLADE_SCHED_CONTINUOUS : BLADE_SCHED_STATIC;
        return 1;
    case OPT_KV_ALLOC:
        if (strcmp(arg, "paged") && strcmp(arg, "contiguous")) {
            fprintf(stderr, "error: --kv-alloc expects paged or contiguous, got '%s'\n", arg);
            return -1;
        }
        c->sched.contiguous_kv = !strcmp(arg, "contiguous");
        return 1;
    case OPT_PIN_PREFIX: o->pin_prefix_file = arg; return 1;
    case OPT_CTX_SIZE:
        if (!cli_parse_int("--ctx-size", arg, 2, 1 << 24, &n))
            return -1;
        c->max_context = (int32_t)n;
        return 1;
    case OPT_THREADS:
        if (!cli_parse_int("--threads", arg, 1, 1024, &n))
            return -1;
        c->n_threads = (int)n;
        return 1;
    case OPT_BATCH_AGING:
        if (!cli_parse_int("--batch-aging-steps", arg, 0, 1 << 30, &n))
            return -1;
        c->sched.batch_aging_steps = (int32_t)n;
        return 1;
    default: return 0;
    }
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
    if (o->kv_mem_fraction > 0)
        o->cfg.kv_mem_bytes = (size_t)((double)available_memory() * o->kv_mem_fraction);
    if (o->cfg.max_context <= 0 || o->cfg.max_context > m->hp.n_ctx_train)
        o->cfg.max_context = m->hp.n_ctx_train;
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
                 "chunked prefill %s\n",
            c->sched.contiguous_kv ? "OFF (contiguous reservation)" : "on", c->block_size,
            c->prefix_caching ? "on" : "OFF", c->sched.mode == BLADE_SCHED_STATIC ? "OFF (static)" : "on",
            c->sched.chunked_prefill ? "on" : "OFF");
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

struct option *cli_merge_longopts(const struct option *own, size_t n_own)
{
    struct option *all = calloc(n_own + cli_engine_longopts_count + 1, sizeof *all);
    if (!all)
        return NULL;
    memcpy(all, own, n_own * sizeof *own);
    memcpy(all + n_own, cli_engine_longopts, cli_engine_longopts_count * sizeof *all);
    return all;
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

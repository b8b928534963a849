/* `blade bench`: the model runner's speed on this machine (prefill, generation against the
 * memory-bandwidth roofline, batched decode), for one or several KV types. */

#include "blade/bench.h"
#include "blade/kernels.h"
#include "blade/kv_store.h"
#include "blade/model.h"
#include "blade/runner.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/flags.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_KV_TYPES 8

/* One KV type under test: its own store and runner, sharing the model and the pool. */
typedef struct bench_kv {
    blade_kv_type type;
    blade_kv_store *kv;
    blade_runner *runner;
    bool context_ready; /* the aggregate-decode context is in every sequence's blocks */
} bench_kv;

typedef struct bench {
    blade_model *m;
    blade_threadpool *pool;
    bench_kv kvs[MAX_KV_TYPES];
    int n_kv;
    bench_kv *cur; /* the type being measured */
    int32_t *blocks; /* identity block table: pp and tg use the first per_single blocks, then
                      * aggregate-decode sequence s owns per_seq blocks from single + s * per_seq */
    int32_t per_single, per_seq;
    int32_t depth, max_batch;
    float *logits;
    uint64_t rng;
} bench;

static int32_t random_token(bench *b)
{
    b->rng = b->rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((b->rng >> 33) % (uint64_t)b->m->hp.n_vocab);
}

static int forward(bench *b, blade_batch_seq *seqs, int n, blade_error *err)
{
    return blade_runner_forward(b->cur->runner, seqs, n, err);
}

static double run_pp(bench *b, int32_t n_prompt, blade_error *err)
{
    int32_t *toks = malloc((size_t)n_prompt * sizeof *toks);
    for (int32_t i = 0; i < n_prompt; i++)
        toks[i] = random_token(b);
    blade_batch_seq s = {.tokens = toks, .n_tokens = n_prompt, .pos0 = 0, .block_table = b->blocks,
                         .n_blocks = b->per_single, .n_logits = 1, .logits = b->logits};
    double t0 = cli_now();
    int rc = forward(b, &s, 1, err);
    double dt = cli_now() - t0;
    free(toks);
    return rc ? -1.0 : n_prompt / dt;
}

static double run_tg(bench *b, int32_t n_gen, blade_error *err)
{
    double t0 = cli_now();
    for (int32_t i = 0; i < n_gen; i++) {
        int32_t tok = random_token(b);
        blade_batch_seq s = {.tokens = &tok, .n_tokens = 1, .pos0 = i, .block_table = b->blocks,
                             .n_blocks = b->per_single, .n_logits = 1, .logits = b->logits};
        if (forward(b, &s, 1, err))
            return -1.0;
    }
    return n_gen / (cli_now() - t0);
}

#define DECODE_STEPS 32

static int32_t *seq_blocks(bench *b, int32_t s)
{
    return b->blocks + b->per_single + s * b->per_seq;
}

/* The first sequence's context computed once (in runner-sized chunks), then its blocks
 * copied to the others: every sequence reads a context of its own, as in serving, without
 * paying for max_batch prefills of it. */
static int prepare_context(bench *b, blade_error *err)
{
    int32_t step = blade_runner_max_batch_tokens(b->cur->runner);
    int32_t *toks = malloc((size_t)step * sizeof *toks);
    for (int32_t p = 0; p < b->depth; p += step) {
        int32_t n = b->depth - p < step ? b->depth - p : step;
        for (int32_t i = 0; i < n; i++)
            toks[i] = random_token(b);
        blade_batch_seq s = {.tokens = toks, .n_tokens = n, .pos0 = p, .block_table = seq_blocks(b, 0),
                             .n_blocks = b->per_seq};
        if (forward(b, &s, 1, err)) {
            free(toks);
            return -1;
        }
    }
    free(toks);
    int32_t used = (b->depth + 15) / 16;
    for (int32_t s = 1; s < b->max_batch; s++)
        for (int32_t i = 0; i < used; i++)
            blade_kv_store_copy_block(b->cur->kv, seq_blocks(b, 0)[i], seq_blocks(b, s)[i]);
    b->cur->context_ready = true;
    return 0;
}

static double run_batched(bench *b, int32_t n_seqs, blade_error *err)
{
    if (!b->cur->context_ready && prepare_context(b, err))
        return -1.0;
    blade_batch_seq *seqs = calloc((size_t)n_seqs, sizeof *seqs);
    int32_t *toks = malloc((size_t)n_seqs * sizeof *toks);
    double rate = -1.0;
    double t0 = cli_now();
    for (int32_t step = 0; step < DECODE_STEPS; step++) {
        for (int32_t s = 0; s < n_seqs; s++) {
            toks[s] = random_token(b);
            seqs[s] = (blade_batch_seq){.tokens = toks + s, .n_tokens = 1, .pos0 = b->depth + step,
                                        .block_table = seq_blocks(b, s), .n_blocks = b->per_seq,
                                        .n_logits = 1, .logits = b->logits + (size_t)s * b->m->hp.n_vocab};
        }
        if (forward(b, seqs, n_seqs, err))
            goto done;
    }
    rate = (double)n_seqs * DECODE_STEPS / (cli_now() - t0);
done:
    free(seqs);
    free(toks);
    return rate;
}

typedef struct figure {
    char name[32];
    blade_kv_type kv_type;
    blade_stats s;
    bool has_roofline; /* tg */
    blade_stats roofline;  /* fraction */
    blade_stats bandwidth; /* bytes/s */
} figure;

/* Bytes per pass of the bandwidth probe: large enough to leave every cache, short enough
 * (~20 ms a pass) to run before each tg repetition. */
#define PROBE_BYTES ((size_t)1 << 30)

/* One figure for every KV type, into out[0 .. n_kv): the types take turns within each
 * repetition, so a ratio between them sees the same stretch of the machine's load.
 * With roofline set, the memory bandwidth is measured right before and right after each
 * timed run, and that run's tokens/s is set against the larger of the two: on a shared
 * machine the bandwidth a run gets drifts from minute to minute, a ratio of two
 * measurements taken minutes apart would mostly measure the drift, and a run that
 * caught a faster stretch than the probe before it would otherwise read above 100%. */
static int measure(bench *b, const char *name, double (*fn)(bench *, int32_t, blade_error *), int32_t arg, int reps,
                   bool roofline, figure *out, blade_error *err)
{
    double values[MAX_KV_TYPES][64], bw[MAX_KV_TYPES][64], fraction[MAX_KV_TYPES][64];
    bool tty = isatty(STDERR_FILENO);
    for (int r = -1; r < reps; r++)
        for (int k = 0; k < b->n_kv; k++) {
            b->cur = &b->kvs[k];
            if (tty)
                fprintf(stderr, "\r%-10s %-5s run %d/%d ", name, blade_kv_type_name(b->cur->type), r + 2, reps + 1);
            if (roofline && r >= 0)
                bw[k][r] = blade_measure_read_bandwidth(b->pool, PROBE_BYTES, 3);
            double v = fn(b, arg, err);
            if (v < 0)
                return -1;
            if (roofline && r >= 0) {
                double after = blade_measure_read_bandwidth(b->pool, PROBE_BYTES, 3);
                if (after > bw[k][r])
                    bw[k][r] = after;
            }
            if (r >= 0) {
                values[k][r] = v;
                fraction[k][r] = roofline ? (double)b->m->weight_bytes * v / bw[k][r] : 0.0;
            }
        }
    for (int k = 0; k < b->n_kv; k++) {
        snprintf(out[k].name, sizeof out[k].name, "%s", name);
        out[k].kv_type = b->kvs[k].type;
        out[k].s = blade_stats_of(values[k], reps);
        out[k].has_roofline = roofline;
        if (roofline) {
            out[k].roofline = blade_stats_of(fraction[k], reps);
            out[k].bandwidth = blade_stats_of(bw[k], reps);
        }
    }
    return 0;
}

#define MAX_BATCHES 16

typedef struct bench_options {
    const char *model_path;
    long long n_prompt, n_gen, reps, threads, depth;
    struct batch_sizes {
        int32_t n[MAX_BATCHES];
        int count;
    } batches;
    struct kv_types {
        blade_kv_type t[MAX_KV_TYPES];
        int count;
    } kv_types;
    bool json;
} bench_options;

static void bench_init(void *opts)
{
    bench_options *o = opts;
    o->n_prompt = 512;
    o->n_gen = 128;
    o->reps = 5;
    o->depth = 128;
    o->batches = (struct batch_sizes){{1, 4, 8, 16}, 4};
    o->kv_types = (struct kv_types){{BLADE_KV_F16}, 1};
}

/* Calls item() on each comma-separated item of value; false at the first it refuses. */
static bool each_item(const char *value, void *acc, bool (*item)(const char *text, void *acc))
{
    const char *p = value;
    for (;;) {
        char text[32];
        size_t len = strcspn(p, ",");
        if (len >= sizeof text)
            return false;
        snprintf(text, sizeof text, "%.*s", (int)len, p);
        if (!item(text, acc))
            return false;
        if (!p[len])
            return true;
        p += len + 1;
    }
}

static bool batch_item(const char *text, void *acc)
{
    struct batch_sizes *got = acc;
    long long v;
    if (!cli_int_in(text, 0, 256, &v) || (v > 0 && got->count == MAX_BATCHES))
        return false;
    if (v > 0)
        got->n[got->count++] = (int32_t)v;
    return true;
}

/* "1,4,8,16": batch sizes, 0s dropped. */
static bool parse_batches(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    struct batch_sizes got = {{0}, 0};
    if (!each_item(value, &got, batch_item)) {
        snprintf(why, cap, "--%s expects a comma-separated list of at most %d batch sizes in [0, 256], got '%s'",
                 f->name, MAX_BATCHES, value);
        return false;
    }
    *(struct batch_sizes *)dest = got;
    return true;
}

static bool kv_type_item(const char *text, void *acc)
{
    struct kv_types *got = acc;
    int t = blade_kv_type_from_name(text);
    if (t < 0 || got->count == MAX_KV_TYPES)
        return false;
    got->t[got->count++] = (blade_kv_type)t;
    return true;
}

/* "f16,q8_0": KV types measured side by side. */
static bool parse_kv_types(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    struct kv_types got = {{0}, 0};
    if (!each_item(value, &got, kv_type_item)) {
        snprintf(why, cap, "--%s expects a comma-separated list of at most %d of %s, got '%s'", f->name, MAX_KV_TYPES,
                 blade_kv_type_names(), value);
        return false;
    }
    *(struct kv_types *)dest = got;
    return true;
}

#define O bench_options
static const cli_flag bench_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(O, model_path), .metavar = "FILE", .required = true,
     .help = "GGUF model"},
    {.name = "n-prompt", .kind = CLI_INT, CLI_AT(O, n_prompt), .min = 0, .max = 1 << 16, .metavar = "P",
     .help = "prompt length for pp; 0 skips it"},
    {.name = "n-predict", .letter = 'n', .kind = CLI_INT, CLI_AT(O, n_gen), .min = 0, .max = 1 << 16,
     .metavar = "N", .help = "tokens generated for tg; 0 skips it"},
    {.name = "batches", .letter = 'b', .kind = CLI_CUSTOM, CLI_AT(O, batches), .parse = parse_batches,
     .metavar = "LIST", .dflt = "1,4,8,16", .help = "concurrent sequences for aggregate decode; 0 skips it"},
    {.name = "depth", .letter = 'd', .kind = CLI_INT, CLI_AT(O, depth), .min = 1, .max = 1 << 20, .metavar = "D",
     .help = "context of each aggregate-decode sequence"},
    {.name = "repetitions", .letter = 'r', .kind = CLI_INT, CLI_AT(O, reps), .min = 1, .max = 64, .metavar = "R",
     .help = "runs per figure"},
    {.name = "threads", .letter = 't', .kind = CLI_INT, CLI_AT(O, threads), .min = 1, .max = 1024, .metavar = "N",
     .dflt = "physical cores", .help = "threads"},
    {.name = "kv-type", .kind = CLI_CUSTOM, CLI_AT(O, kv_types), .parse = parse_kv_types,
     .values = blade_kv_type_names, .metavar = "LIST", .dflt = "f16",
     .help = "KV cache element types, comma-separated, measured side by side"},
    {.name = "json", .kind = CLI_BOOL, CLI_AT(O, json), .help = "print one JSON object instead of the table"},
    {0},
};
#undef O

static int bench_main(int argc, char **argv);

const cli_command cli_cmd_bench = {
    .name = "bench",
    .summary = "measure prompt processing, generation and batched decode speed",
    .synopsis = "-m MODEL [--n-prompt P] [-n N] [-b LIST] [-d D] [-r R] [--kv-type LIST] [options]",
    .about = "Measures the model runner on this machine:\n"
             "  ppP    prompt processing: one P-token prefill in a single batch, tokens/s\n"
             "  tgN    single-sequence generation of N tokens from an empty context, tokens/s, and the\n"
             "         fraction of the memory-bandwidth roofline: weight bytes x tokens/s / bandwidth, with\n"
             "         the machine's read bandwidth measured right before and after each tg run (the\n"
             "         larger of the two)\n"
             "  Bx     aggregate decode tokens/s of B sequences decoding together, each with a D-token\n"
             "         context, over 32 steps (the context is prefilled once, untimed, and its blocks\n"
             "         copied to every sequence)\n"
             "Each figure is the mean +- standard deviation over R runs, after one warm-up run. Given\n"
             "several KV types, every figure is measured for each, runs taking turns, with the ratio\n"
             "of each to the first type measured in the same run.\n\n"
             "The other bench commands (each with its --help):\n"
             "  blade bench engine -m MODEL --workload W     the engine's techniques against their baselines\n"
             "  blade bench serve --url URL --workload W     measure an OpenAI-compatible endpoint\n"
             "  blade bench ablation -m MODEL --workload W   what each serving technique buys\n"
             "  blade bench compare BASE.json NEW.json       fail on a performance regression\n"
             "  blade bench semantic-cache                   the semantic cache's lookup latency and memory\n",
    .tables = (const cli_table[]){{bench_flags, 0}, {0}},
    .opts_size = sizeof(bench_options),
    .init = bench_init,
    .main = bench_main,
};

static int bench_main(int argc, char **argv)
{
    bench_options o;
    int rc = cli_parse(&cli_cmd_bench, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    const char *model_path = o.model_path;
    long long n_prompt = o.n_prompt, n_gen = o.n_gen, reps = o.reps, threads = o.threads, depth = o.depth;
    const int32_t *batches = o.batches.n;
    int n_batches = o.batches.count;
    bool json = o.json;
    bench b = {0};
    b.n_kv = o.kv_types.count;
    for (int k = 0; k < b.n_kv; k++)
        b.kvs[k].type = o.kv_types.t[k];

    blade_error err = {{0}};
    b.rng = 42;
    b.depth = (int32_t)depth;
    rc = 1;
    b.max_batch = 1;
    for (int i = 0; i < n_batches; i++)
        b.max_batch = batches[i] > b.max_batch ? batches[i] : b.max_batch;
    b.m = blade_model_load(model_path, &err);
    if (!b.m)
        goto done;
    int32_t longest = (int32_t)(n_prompt > n_gen ? n_prompt : n_gen);
    b.per_single = (longest + 15) / 16;
    b.per_seq = (b.depth + DECODE_STEPS + 15) / 16;
    int32_t n_blocks = b.per_single + b.per_seq * b.max_batch;
    /* the context is prefilled in chunks of at most 512 tokens */
    int32_t max_tokens = (int32_t)(n_prompt > 512 ? n_prompt : 512);
    if (b.max_batch > max_tokens)
        max_tokens = b.max_batch;
    if (!(b.pool = blade_threadpool_new((int)threads))) {
        blade_error_set(&err, "cannot start %lld threads", threads);
        goto done;
    }
    for (int k = 0; k < b.n_kv; k++) {
        blade_kv_store_config store_cfg = blade_model_kv_config(&b.m->hp, b.kvs[k].type, 16, n_blocks);
        if (!(b.kvs[k].kv = blade_kv_store_new(&store_cfg, &err)) ||
            !(b.kvs[k].runner = blade_runner_new(b.m, b.kvs[k].kv, b.pool, max_tokens, &err)))
            goto done;
    }
    b.blocks = malloc((size_t)n_blocks * sizeof *b.blocks);
    b.logits = malloc((size_t)b.max_batch * b.m->hp.n_vocab * sizeof *b.logits);
    if (!b.blocks || !b.logits) {
        blade_error_set(&err, "out of memory");
        goto done;
    }
    for (int32_t i = 0; i < n_blocks; i++)
        b.blocks[i] = i;

    figure figs[20 * MAX_KV_TYPES];
    int n_figs = 0;
    const figure *tg = NULL;
    char name[32];
    if (n_prompt > 0) {
        snprintf(name, sizeof name, "pp%lld", n_prompt);
        if (measure(&b, name, run_pp, (int32_t)n_prompt, (int)reps, false, &figs[n_figs], &err))
            goto done;
        n_figs += b.n_kv;
    }
    if (n_gen > 0) {
        snprintf(name, sizeof name, "tg%lld", n_gen);
        if (measure(&b, name, run_tg, (int32_t)n_gen, (int)reps, true, &figs[n_figs], &err))
            goto done;
        tg = &figs[n_figs];
        n_figs += b.n_kv;
    }
    for (int i = 0; i < n_batches; i++) {
        snprintf(name, sizeof name, "decode x%d", batches[i]);
        if (measure(&b, name, run_batched, batches[i], (int)reps, false, &figs[n_figs], &err))
            goto done;
        n_figs += b.n_kv;
    }
    if (isatty(STDERR_FILENO))
        fprintf(stderr, "\r%40s\r", "");

    const char *isa = blade_isa_name(blade_isa_active());
    if (json) {
        printf("{\"model\": \"%s\", \"weight_bytes\": %zu, \"threads\": %d, \"isa\": \"%s\", \"kv_type\": \"%s\", "
               "\"depth\": %d, ",
               model_path, b.m->weight_bytes, blade_threadpool_size(b.pool), isa, blade_kv_type_name(b.kvs[0].type),
               b.depth);
        if (tg)
            printf("\"bandwidth_bytes_per_s\": %.0f, ", tg->bandwidth.mean);
        printf("\"results\": [");
        for (int i = 0; i < n_figs; i++) {
            printf("%s{\"test\": \"%s\", \"kv_type\": \"%s\", \"tokens_per_s\": %.3f, \"stddev\": %.3f", i ? ", " : "",
                   figs[i].name, blade_kv_type_name(figs[i].kv_type), figs[i].s.mean, figs[i].s.stddev);
            if (figs[i].has_roofline)
                printf(", \"roofline_fraction\": %.4f, \"roofline_stddev\": %.4f", figs[i].roofline.mean,
                       figs[i].roofline.stddev);
            if (b.n_kv > 1)
                printf(", \"ratio_to_%s\": %.4f", blade_kv_type_name(b.kvs[0].type),
                       figs[i].s.mean / figs[i - i % b.n_kv].s.mean);
            printf("}");
        }
        printf("]}\n");
    } else {
        printf("model: %s (%.2f GiB of weights, %llu parameters)\n", model_path, b.m->weight_bytes / 1073741824.0,
               (unsigned long long)b.m->n_params);
        printf("threads: %d, kernels: %s, KV cache:", blade_threadpool_size(b.pool), isa);
        for (int k = 0; k < b.n_kv; k++)
            printf("%s %s", k ? "," : "", blade_kv_type_name(b.kvs[k].type));
        printf(", decode context %d tokens", b.depth);
        if (tg)
            printf(", memory read bandwidth: %.2f +- %.2f GB/s (around each tg run)", tg->bandwidth.mean / 1e9,
                   tg->bandwidth.stddev / 1e9);
        printf("\n\n| %-12s | %-5s | %18s | %16s |%s\n", "test", "KV", "tokens/s", "roofline",
               b.n_kv > 1 ? " vs first KV |" : "");
        printf("| %-12s | %-5s | %18s | %16s |%s\n", "------------", "-----", "------------------", "----------------",
               b.n_kv > 1 ? " ----------- |" : "");
        for (int i = 0; i < n_figs; i++) {
            char rf[32] = "", ratio[32] = "";
            if (figs[i].has_roofline)
                snprintf(rf, sizeof rf, "%5.1f%% +- %4.1f", figs[i].roofline.mean * 100, figs[i].roofline.stddev * 100);
            if (b.n_kv > 1)
                snprintf(ratio, sizeof ratio, " %10.3fx |", figs[i].s.mean / figs[i - i % b.n_kv].s.mean);
            printf("| %-12s | %-5s | %9.2f +- %6.2f | %16s |%s\n", figs[i].name, blade_kv_type_name(figs[i].kv_type),
                   figs[i].s.mean, figs[i].s.stddev, rf, ratio);
        }
    }
    rc = 0;
done:
    if (rc)
        fprintf(stderr, "error: %s\n", err.msg);
    free(b.blocks);
    free(b.logits);
    for (int k = 0; k < b.n_kv; k++) {
        blade_runner_free(b.kvs[k].runner);
        blade_kv_store_free(b.kvs[k].kv);
    }
    blade_threadpool_free(b.pool);
    blade_model_free(b.m);
    return rc;
}

/* `blade bench`: the model runner's speed on this machine (prefill, generation against the
 * memory-bandwidth roofline, batched decode). */

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

typedef struct bench {
    blade_model *m;
    blade_kv_store *kv;
    blade_threadpool *pool;
    blade_runner *runner;
    int32_t *blocks; /* identity block table: sequence s owns blocks [s*per_seq, (s+1)*per_seq) */
    int32_t per_seq;
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
    return blade_runner_forward(b->runner, seqs, n, err);
}

static double run_pp(bench *b, int32_t n_prompt, blade_error *err)
{
    int32_t *toks = malloc((size_t)n_prompt * sizeof *toks);
    for (int32_t i = 0; i < n_prompt; i++)
        toks[i] = random_token(b);
    blade_batch_seq s = {.tokens = toks, .n_tokens = n_prompt, .pos0 = 0, .block_table = b->blocks,
                         .n_blocks = b->per_seq, .n_logits = 1, .logits = b->logits};
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
                             .n_blocks = b->per_seq, .n_logits = 1, .logits = b->logits};
        if (forward(b, &s, 1, err))
            return -1.0;
    }
    return n_gen / (cli_now() - t0);
}

#define CONTEXT 128
#define DECODE_STEPS 32

static double run_batched(bench *b, int32_t n_seqs, blade_error *err)
{
    blade_batch_seq *seqs = calloc((size_t)n_seqs, sizeof *seqs);
    int32_t *toks = malloc((size_t)n_seqs * CONTEXT * sizeof *toks);
    double rate = -1.0;
    for (int32_t i = 0; i < n_seqs * CONTEXT; i++)
        toks[i] = random_token(b);
    /* untimed prefill, a few sequences per call to stay inside the runner's batch size */
    for (int32_t s = 0; s < n_seqs; s++) {
        blade_batch_seq p = {.tokens = toks + s * CONTEXT, .n_tokens = CONTEXT, .pos0 = 0,
                             .block_table = b->blocks + s * b->per_seq, .n_blocks = b->per_seq};
        if (forward(b, &p, 1, err))
            goto done;
    }
    double t0 = cli_now();
    for (int32_t step = 0; step < DECODE_STEPS; step++) {
        for (int32_t s = 0; s < n_seqs; s++) {
            toks[s] = random_token(b);
            seqs[s] = (blade_batch_seq){.tokens = toks + s, .n_tokens = 1, .pos0 = CONTEXT + step,
                                        .block_table = b->blocks + s * b->per_seq, .n_blocks = b->per_seq,
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
    blade_stats s;
    bool has_roofline; /* tg */
    blade_stats roofline;  /* fraction */
    blade_stats bandwidth; /* bytes/s */
} figure;

/* Bytes per pass of the bandwidth probe: large enough to leave every cache, short enough
 * (~20 ms a pass) to run before each tg repetition. */
#define PROBE_BYTES ((size_t)1 << 30)

/* With roofline set, the memory bandwidth is measured right before and right after each
 * timed run, and that run's tokens/s is set against the larger of the two: on a shared
 * machine the bandwidth a run gets drifts from minute to minute, a ratio of two
 * measurements taken minutes apart would mostly measure the drift, and a run that
 * caught a faster stretch than the probe before it would otherwise read above 100%. */
static int measure(bench *b, const char *name, double (*fn)(bench *, int32_t, blade_error *), int32_t arg, int reps,
                   bool roofline, figure *out, blade_error *err)
{
    double values[64], bw[64], fraction[64];
    bool tty = isatty(STDERR_FILENO);
    snprintf(out->name, sizeof out->name, "%s", name);
    for (int r = -1; r < reps; r++) {
        if (tty)
            fprintf(stderr, "\r%-10s run %d/%d ", name, r + 2, reps + 1);
        if (roofline && r >= 0)
            bw[r] = blade_measure_read_bandwidth(b->pool, PROBE_BYTES, 3);
        double v = fn(b, arg, err);
        if (v < 0)
            return -1;
        if (roofline && r >= 0) {
            double after = blade_measure_read_bandwidth(b->pool, PROBE_BYTES, 3);
            if (after > bw[r])
                bw[r] = after;
        }
        if (r >= 0) {
            values[r] = v;
            fraction[r] = roofline ? (double)b->m->weight_bytes * v / bw[r] : 0.0;
        }
    }
    out->s = blade_stats_of(values, reps);
    out->has_roofline = roofline;
    if (roofline) {
        out->roofline = blade_stats_of(fraction, reps);
        out->bandwidth = blade_stats_of(bw, reps);
    }
    return 0;
}

#define MAX_BATCHES 16

typedef struct bench_options {
    const char *model_path;
    long long n_prompt, n_gen, reps, threads;
    struct batch_sizes {
        int32_t n[MAX_BATCHES];
        int count;
    } batches;
    blade_kv_type kv_type;
    bool json;
} bench_options;

static void bench_init(void *opts)
{
    bench_options *o = opts;
    o->n_prompt = 512;
    o->n_gen = 128;
    o->reps = 5;
    o->batches = (struct batch_sizes){{1, 4, 8, 16}, 4};
    o->kv_type = BLADE_KV_F16;
}

/* "1,4,8,16": batch sizes, 0s dropped. */
static bool parse_batches(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    struct batch_sizes got = {{0}, 0};
    const char *p = value;
    for (;;) {
        char item[32];
        size_t len = strcspn(p, ",");
        long long v;
        snprintf(item, sizeof item, "%.*s", (int)(len < sizeof item ? len : sizeof item - 1), p);
        if (len >= sizeof item || !cli_int_in(item, 0, 256, &v)) {
            snprintf(why, cap, "--%s expects a comma-separated list of batch sizes in [0, 256], got '%s'", f->name,
                     value);
            return false;
        }
        if (v > 0 && got.count == MAX_BATCHES) {
            snprintf(why, cap, "--%s takes at most %d batch sizes, got '%s'", f->name, MAX_BATCHES, value);
            return false;
        }
        if (v > 0)
            got.n[got.count++] = (int32_t)v;
        if (!p[len])
            break;
        p += len + 1;
    }
    *(struct batch_sizes *)dest = got;
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
    {.name = "repetitions", .letter = 'r', .kind = CLI_INT, CLI_AT(O, reps), .min = 1, .max = 64, .metavar = "R",
     .help = "runs per figure"},
    {.name = "threads", .letter = 't', .kind = CLI_INT, CLI_AT(O, threads), .min = 1, .max = 1024, .metavar = "N",
     .dflt = "physical cores", .help = "threads"},
    {.name = "kv-type", .kind = CLI_ENUM, CLI_AT(O, kv_type), .choice_at = cli_kv_type_choice, .metavar = "T",
     .help = "KV cache element type"},
    {.name = "json", .kind = CLI_BOOL, CLI_AT(O, json), .help = "print one JSON object instead of the table"},
    {0},
};
#undef O

static int bench_main(int argc, char **argv);

const cli_command cli_cmd_bench = {
    .name = "bench",
    .summary = "measure prompt processing, generation and batched decode speed",
    .synopsis = "-m MODEL [--n-prompt 512] [-n 128] [-b 1,4,8,16] [-r 5] [-t N] [--json]",
    .about = "Measures the model runner on this machine:\n"
             "  ppP    prompt processing: one P-token prefill in a single batch, tokens/s\n"
             "  tgN    single-sequence generation of N tokens from an empty context, tokens/s, and the\n"
             "         fraction of the memory-bandwidth roofline: weight bytes x tokens/s / bandwidth, with\n"
             "         the machine's read bandwidth measured right before and after each tg run (the\n"
             "         larger of the two)\n"
             "  Bx     aggregate decode tokens/s of B sequences decoding together, each with a 128-token\n"
             "         context (prefilled untimed), over 32 steps\n"
             "Each figure is the mean +- standard deviation over R runs, after one warm-up run.\n\n"
             "The other bench commands (each with its --help):\n"
             "  blade bench engine -m MODEL --workload W     the engine's techniques against their baselines\n"
             "  blade bench serve --url URL --workload W     measure an OpenAI-compatible endpoint\n"
             "  blade bench ablation -m MODEL --workload W   what each serving technique buys\n"
             "  blade bench compare BASE.json NEW.json       fail on a performance regression\n",
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
    long long n_prompt = o.n_prompt, n_gen = o.n_gen, reps = o.reps, threads = o.threads;
    const int32_t *batches = o.batches.n;
    int n_batches = o.batches.count;
    bool json = o.json;
    blade_kv_type kv_type = o.kv_type;

    blade_error err = {{0}};
    bench b = {0};
    b.rng = 42;
    rc = 1;
    int32_t max_batch = 1;
    for (int i = 0; i < n_batches; i++)
        max_batch = batches[i] > max_batch ? batches[i] : max_batch;
    b.m = blade_model_load(model_path, &err);
    if (!b.m)
        goto done;
    int32_t longest = (int32_t)(n_prompt > n_gen ? n_prompt : n_gen);
    if (longest < CONTEXT + DECODE_STEPS)
        longest = CONTEXT + DECODE_STEPS;
    b.per_seq = (longest + 15) / 16;
    int32_t n_blocks = b.per_seq * max_batch;
    blade_kv_store_config store_cfg = blade_model_kv_config(&b.m->hp, kv_type, 16, n_blocks);
    b.kv = blade_kv_store_new(&store_cfg, &err);
    b.pool = blade_threadpool_new((int)threads);
    int32_t max_tokens = (int32_t)(n_prompt > CONTEXT ? n_prompt : CONTEXT);
    if (max_batch > max_tokens)
        max_tokens = max_batch;
    if (b.kv && b.pool)
        b.runner = blade_runner_new(b.m, b.kv, b.pool, max_tokens, &err);
    b.blocks = malloc((size_t)n_blocks * sizeof *b.blocks);
    b.logits = malloc((size_t)max_batch * b.m->hp.n_vocab * sizeof *b.logits);
    if (!b.runner || !b.blocks || !b.logits)
        goto done;
    for (int32_t i = 0; i < n_blocks; i++)
        b.blocks[i] = i;

    figure figs[20];
    int n_figs = 0;
    const figure *tg = NULL;
    char name[32];
    if (n_prompt > 0) {
        snprintf(name, sizeof name, "pp%lld", n_prompt);
        if (measure(&b, name, run_pp, (int32_t)n_prompt, (int)reps, false, &figs[n_figs++], &err))
            goto done;
    }
    if (n_gen > 0) {
        snprintf(name, sizeof name, "tg%lld", n_gen);
        if (measure(&b, name, run_tg, (int32_t)n_gen, (int)reps, true, &figs[n_figs], &err))
            goto done;
        tg = &figs[n_figs++];
    }
    for (int i = 0; i < n_batches; i++) {
        snprintf(name, sizeof name, "decode x%d", batches[i]);
        if (measure(&b, name, run_batched, batches[i], (int)reps, false, &figs[n_figs++], &err))
            goto done;
    }
    if (isatty(STDERR_FILENO))
        fprintf(stderr, "\r%40s\r", "");

    const char *isa = blade_isa_name(blade_isa_active());
    if (json) {
        printf("{\"model\": \"%s\", \"weight_bytes\": %zu, \"threads\": %d, \"isa\": \"%s\", \"kv_type\": \"%s\", ",
               model_path, b.m->weight_bytes, blade_threadpool_size(b.pool), isa,
               blade_kv_type_name(kv_type));
        if (tg)
            printf("\"bandwidth_bytes_per_s\": %.0f, ", tg->bandwidth.mean);
        printf("\"results\": [");
        for (int i = 0; i < n_figs; i++) {
            printf("%s{\"test\": \"%s\", \"tokens_per_s\": %.3f, \"stddev\": %.3f", i ? ", " : "", figs[i].name,
                   figs[i].s.mean, figs[i].s.stddev);
            if (figs[i].has_roofline)
                printf(", \"roofline_fraction\": %.4f, \"roofline_stddev\": %.4f", figs[i].roofline.mean,
                       figs[i].roofline.stddev);
            printf("}");
        }
        printf("]}\n");
    } else {
        printf("model: %s (%.2f GiB of weights, %llu parameters)\n", model_path, b.m->weight_bytes / 1073741824.0,
               (unsigned long long)b.m->n_params);
        printf("threads: %d, kernels: %s, KV cache: %s", blade_threadpool_size(b.pool), isa,
               blade_kv_type_name(kv_type));
        if (tg)
            printf(", memory read bandwidth: %.2f +- %.2f GB/s (around each tg run)", tg->bandwidth.mean / 1e9,
                   tg->bandwidth.stddev / 1e9);
        printf("\n\n| %-12s | %18s | %16s |\n", "test", "tokens/s", "roofline");
        printf("| %-12s | %18s | %16s |\n", "------------", "------------------", "----------------");
        for (int i = 0; i < n_figs; i++) {
            char rf[32] = "";
            if (figs[i].has_roofline)
                snprintf(rf, sizeof rf, "%5.1f%% +- %4.1f", figs[i].roofline.mean * 100, figs[i].roofline.stddev * 100);
            printf("| %-12s | %9.2f +- %6.2f | %16s |\n", figs[i].name, figs[i].s.mean, figs[i].s.stddev, rf);
        }
    }
    rc = 0;
done:
    if (rc)
        fprintf(stderr, "error: %s\n", err.msg);
    free(b.blocks);
    free(b.logits);
    blade_runner_free(b.runner);
    blade_threadpool_free(b.pool);
    blade_kv_store_free(b.kv);
    blade_model_free(b.m);
    return rc;
}

#include "blade/bench.h"
#include "blade/kernels.h"
#include "blade/kv_store.h"
#include "blade/model.h"
#include "blade/runner.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void bench_usage(FILE *out)
{
    fprintf(out,
            "usage: blade bench -m MODEL [-p 512] [-n 128] [-b 1,4,8,16] [-r 5] [-t N] [--json]\n"
            "       blade bench engine -m MODEL --workload W   (see blade bench engine --help)\n"
            "       blade bench serve --url URL --workload W   measure an OpenAI-compatible endpoint\n"
            "       blade bench ablation -m MODEL --workload W what each serving technique buys\n"
            "       blade bench compare BASE.json NEW.json     fail on a performance regression\n"
            "       blade bench kv-transfer                    KV cache transfer between two workers (UCX)\n\n"
            "Measures the model runner on this machine:\n"
            "  ppP    prompt processing: one P-token prefill in a single batch, tokens/s\n"
            "  tgN    single-sequence generation of N tokens from an empty context, tokens/s, and the\n"
            "         fraction of the memory-bandwidth roofline: weight bytes x tokens/s / bandwidth, with\n"
            "         the machine's read bandwidth measured right before and after each tg run (the\n"
            "         larger of the two)\n"
            "  Bx     aggregate decode tokens/s of B sequences decoding together, each with a 128-token\n"
            "         context (prefilled untimed), over 32 steps\n"
            "Each figure is the mean +- standard deviation over R runs, after one warm-up run.\n\n"
            "  -m, --model FILE     GGUF model\n"
            "  -p, --n-prompt P     prompt length for pp (default 512; 0 skips)\n"
            "  -n, --n-gen N        tokens for tg (default 128; 0 skips)\n"
            "  -b, --batches LIST   concurrent sequences for aggregate decode (default 1,4,8,16; 0 skips)\n"
            "  -r, --repetitions R  runs per figure (default 5)\n"
            "  -t, --threads N      threads (default: physical cores)\n"
            "      --kv-type T      KV cache element type: f16 (default), bf16, f32\n"
            "      --json           print one JSON object instead of the table\n"
            "  -h, --help           this help\n");
}

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

static int parse_batches(const char *s, int32_t *out, int *n)
{
    *n = 0;
    char *copy = strdup(s), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        long long v;
        if (*n >= 16 || !cli_parse_int("-b", tok, 0, 256, &v)) {
            free(copy);
            return -1;
        }
        if (v > 0)
            out[(*n)++] = (int32_t)v;
    }
    free(copy);
    return 0;
}

int cmd_bench(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "engine"))
        return cmd_bench_engine(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "serve"))
        return cmd_bench_serve(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "ablation"))
        return cmd_bench_ablation(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "compare"))
        return cmd_bench_compare(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "kv-transfer"))
        return cmd_bench_kv_transfer(argc - 1, argv + 1);
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},       {"n-prompt", required_argument, 0, 'p'},
        {"n-gen", required_argument, 0, 'n'},       {"batches", required_argument, 0, 'b'},
        {"repetitions", required_argument, 0, 'r'}, {"threads", required_argument, 0, 't'},
        {"kv-type", required_argument, 0, 'K'},     {"json", no_argument, 0, 'J'},
        {"help", no_argument, 0, 'h'},              {0, 0, 0, 0},
    };
    const char *model_path = NULL;
    long long n_prompt = 512, n_gen = 128, reps = 5, threads = 0;
    int32_t batches[16] = {1, 4, 8, 16};
    int n_batches = 4;
    bool json = false;
    int kv_type = BLADE_KV_F16;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:p:n:b:r:t:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'p':
            if (!cli_parse_int("-p", optarg, 0, 1 << 16, &n_prompt))
                return 2;
            break;
        case 'n':
            if (!cli_parse_int("-n", optarg, 0, 1 << 16, &n_gen))
                return 2;
            break;
        case 'b':
            if (parse_batches(optarg, batches, &n_batches))
                return 2;
            break;
        case 'r':
            if (!cli_parse_int("-r", optarg, 1, 64, &reps))
                return 2;
            break;
        case 't':
            if (!cli_parse_int("-t", optarg, 1, 1024, &threads))
                return 2;
            break;
        case 'K':
            if ((kv_type = blade_kv_type_from_name(optarg)) < 0) {
                fprintf(stderr, "error: --kv-type expects f16, bf16 or f32, got '%s'\n", optarg);
                return 2;
            }
            break;
        case 'J': json = true; break;
        case 'h': bench_usage(stdout); return 0;
        default: bench_usage(stderr); return 2;
        }
    }
    if (!model_path || optind != argc) {
        bench_usage(stderr);
        return 2;
    }

    blade_error err = {{0}};
    bench b = {0};
    b.rng = 42;
    int rc = 1;
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
    blade_kv_store_config store_cfg = blade_model_kv_config(&b.m->hp, (blade_kv_type)kv_type, 16, n_blocks);
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
               blade_kv_type_name((blade_kv_type)kv_type));
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
               blade_kv_type_name((blade_kv_type)kv_type));
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

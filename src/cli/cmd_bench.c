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
            "usage: blade bench -m MODEL [-p 512] [-n 128] [-b 1,4,8,16] [-d 128] [-r 5] [-t N] [--kv-type T,...]\n"
            "                   [--json]\n"
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
            "  Bx     aggregate decode tokens/s of B sequences decoding together, each with a D-token\n"
            "         context, over 32 steps (the context is prefilled once, untimed, and its blocks\n"
            "         copied to every sequence)\n"
            "Each figure is the mean +- standard deviation over R runs, after one warm-up run. Given\n"
            "several KV types, every figure is measured for each, runs taking turns, with the ratio\n"
            "of each to the first type measured in the same run.\n\n"
            "  -m, --model FILE     GGUF model\n"
            "  -p, --n-prompt P     prompt length for pp (default 512; 0 skips)\n"
            "  -n, --n-gen N        tokens for tg (default 128; 0 skips)\n"
            "  -b, --batches LIST   concurrent sequences for aggregate decode (default 1,4,8,16; 0 skips)\n"
            "  -d, --depth D        context of each aggregate-decode sequence (default 128)\n"
            "  -r, --repetitions R  runs per figure (default 5)\n"
            "  -t, --threads N      threads (default: physical cores)\n"
            "      --kv-type LIST   KV cache element types, comma-separated: f16 (default), bf16, f32,\n"
            "                       q8_0, fp8\n"
            "      --json           print one JSON object instead of the table\n"
            "  -h, --help           this help\n");
}

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

/* "f16,q8_0" -> types; false (reported) on an unknown name or too many. */
static bool parse_kv_types(const char *s, bench *b)
{
    b->n_kv = 0;
    char *copy = strdup(s), *save = NULL;
    bool ok = copy != NULL;
    for (char *tok = ok ? strtok_r(copy, ",", &save) : NULL; ok && tok; tok = strtok_r(NULL, ",", &save)) {
        int t = blade_kv_type_from_name(tok);
        if (t < 0 || b->n_kv == MAX_KV_TYPES) {
            fprintf(stderr, t < 0 ? "error: --kv-type expects a list of %s, got '%s'\n"
                                  : "error: --kv-type: at most 8 types (%s), got '%s'\n",
                    blade_kv_type_names(), tok);
            ok = false;
        } else {
            b->kvs[b->n_kv++].type = (blade_kv_type)t;
        }
    }
    free(copy);
    return ok && b->n_kv > 0;
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
        {"depth", required_argument, 0, 'd'},       {"repetitions", required_argument, 0, 'r'},
        {"threads", required_argument, 0, 't'},     {"kv-type", required_argument, 0, 'K'},
        {"json", no_argument, 0, 'J'},              {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *model_path = NULL;
    long long n_prompt = 512, n_gen = 128, reps = 5, threads = 0, depth = 128;
    int32_t batches[16] = {1, 4, 8, 16};
    int n_batches = 4;
    bool json = false;
    bench b = {0};
    b.n_kv = 1;
    b.kvs[0].type = BLADE_KV_F16;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:p:n:b:d:r:t:h", longopts, NULL)) != -1) {
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
        case 'd':
            if (!cli_parse_int("-d", optarg, 1, 1 << 20, &depth))
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
            if (!parse_kv_types(optarg, &b))
                return 2;
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
    b.rng = 42;
    b.depth = (int32_t)depth;
    int rc = 1;
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

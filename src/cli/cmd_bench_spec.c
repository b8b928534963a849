/* `blade bench spec`: what speculative decoding buys on this machine, every figure a ratio
 * measured in one run. First the verify-cost curve (a step of T new tokens against a step
 * of one, and a long chunk's cost per token: the compute per byte that speculation lives
 * on), then greedy decoding of the same prompts with each drafter, the configurations
 * taking turns prompt by prompt so that a machine shared with other work slows all of them
 * alike: single-stream decode tokens/s, the speed-up of the runner's time alone and the one
 * the curve predicts from each run's own acceptance, acceptance, mean accepted length and
 * mean k, and the aggregate tokens/s of many concurrent streams; then each run's own steps,
 * which show where its speed-up and the curve's part. */

#include "blade/engine.h"
#include "blade/kv_store.h"
#include "blade/model.h"
#include "blade/runner.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"
#include "cli/flags.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_MODES 5
#define CURVE_MAX 9
#define CURVE_CTX 64

typedef struct stream {
    int32_t n_out;
    double t_first, t_last;
    bool done;
} stream;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

static void on_event(const blade_token_event *ev)
{
    stream *s = ev->user;
    double t = cli_now();
    pthread_mutex_lock(&mu);
    if (ev->token >= 0) {
        if (s->n_out++ == 0)
            s->t_first = t;
        s->t_last = t;
    }
    if (ev->finish != BLADE_FINISH_NONE) {
        s->done = true;
        pthread_cond_broadcast(&cv);
    }
    pthread_mutex_unlock(&mu);
}

static int submit(blade_engine *e, const int32_t *prompt, int32_t n_prompt, int32_t n_gen, stream *s)
{
    memset(s, 0, sizeof *s);
    blade_request q;
    blade_request_default(&q);
    q.prompt_tokens = prompt;
    q.n_prompt_tokens = n_prompt;
    q.max_tokens = n_gen;
    q.ignore_eos = true;
    q.sampling.temperature = 0;
    q.callback = on_event;
    q.user = s;
    blade_error err = {{0}};
    if (!blade_engine_submit(e, &q, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static void wait_all(stream *s, int n)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n; i++)
        while (!s[i].done)
            pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One timed step for the curve: T = n new tokens after the CURVE_CTX-token context (every
 * row's logits, as a verify step has), or with n 0 that context itself as one chunk. */
static int curve_step(blade_runner *r, const int32_t *toks, const int32_t *rows, float *logits, int n, double *ms)
{
    int32_t blocks[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    blade_batch_seq b = {.tokens = toks, .n_tokens = n ? n : CURVE_CTX, .pos0 = n ? CURVE_CTX : 0,
                         .block_table = blocks, .n_blocks = 8, .logit_rows = rows, .n_logits = n ? n : 1,
                         .logits = logits};
    blade_error err = {{0}};
    double t0 = cli_now();
    if (blade_runner_forward(r, &b, 1, &err)) {
        fprintf(stderr, "error: verify curve: %s\n", err.msg);
        return -1;
    }
    *ms = (cli_now() - t0) * 1e3;
    return 0;
}

/* Median time of a step of T new tokens, T = 1..CURVE_MAX, and of the CURVE_CTX-token chunk,
 * all taking turns. Fills ms[0..CURVE_MAX] (ms[0]: the chunk), stages[0..CURVE_MAX] with the
 * stage times of each size's median step, and *prefill_ratio with the median over the turns
 * of how many times faster per token the turn's chunk ran than its one-token step: the
 * host's memory changes speed within seconds, and a ratio of two medians taken apart (the
 * chunks once ran after all the turns) read 7.9x where the run's own one-token steps made it
 * 6.6x (MEASURED.md, stop 41). An untimed step of CURVE_MAX tokens follows each chunk: a
 * one-token step right after a chunk measured 3-6% slower than after a step of nine tokens
 * (stop 35). */
static int verify_curve(const blade_model *m, int threads, int reps, double *ms, blade_stage_times *stages,
                        double *prefill_ratio)
{
    blade_error err = {{0}};
    blade_kv_store_config sc = blade_model_kv_config(&m->hp, BLADE_KV_F16, 16, 8);
    blade_threadpool *pool = blade_threadpool_new(threads);
    blade_kv_store *store = pool ? blade_kv_store_new(&sc, &err) : NULL;
    blade_runner *r = store ? blade_runner_new(m, store, pool, CURVE_CTX, &err) : NULL;
    float *logits = malloc((size_t)CURVE_CTX * m->hp.n_vocab * sizeof(float));
    double *t = calloc((size_t)reps * (CURVE_MAX + 1), sizeof *t);
    double *sorted = calloc((size_t)reps, sizeof *sorted);
    blade_stage_times *st = calloc((size_t)reps * (CURVE_MAX + 1), sizeof *st);
    int rc = -1;
    if (!r || !logits || !t || !sorted || !st) {
        fprintf(stderr, "error: verify curve: %s\n", err.msg[0] ? err.msg : "out of memory");
        goto out;
    }
    int32_t toks[CURVE_CTX], rows[CURVE_CTX];
    for (int i = 0; i < CURVE_CTX; i++) {
        toks[i] = 1 + (i * 37) % (m->hp.n_vocab - 1);
        rows[i] = i;
    }
    /* the context every step attends to, untimed */
    double first;
    if (curve_step(r, toks, rows, logits, 0, &first))
        goto out;
    for (int rep = 0; rep < reps; rep++) {
        for (int n = 1; n <= CURVE_MAX; n++) {
            blade_runner_set_stage_times(r, &st[(size_t)n * reps + rep]);
            if (curve_step(r, toks, rows, logits, n, &t[(size_t)n * reps + rep]))
                goto out;
        }
        blade_runner_set_stage_times(r, &st[rep]);
        if (curve_step(r, toks, rows, logits, 0, &t[rep]))
            goto out;
        blade_runner_set_stage_times(r, NULL);
        double settle;
        if (curve_step(r, toks, rows, logits, CURVE_MAX, &settle))
            goto out;
    }
    for (int rep = 0; rep < reps; rep++)
        sorted[rep] = t[(size_t)reps + rep] / (t[rep] / CURVE_CTX);
    qsort(sorted, (size_t)reps, sizeof *sorted, cmp_double);
    *prefill_ratio = sorted[reps / 2];
    for (int n = 0; n <= CURVE_MAX; n++) {
        const double *tn = t + (size_t)n * reps;
        memcpy(sorted, tn, (size_t)reps * sizeof *sorted);
        qsort(sorted, (size_t)reps, sizeof *sorted, cmp_double);
        ms[n] = sorted[reps / 2];
        int median = 0;
        while (tn[median] != ms[n])
            median++;
        stages[n] = st[(size_t)n * reps + median];
    }
    rc = 0;
out:
    blade_runner_free(r);
    free(st);
    free(sorted);
    free(t);
    free(logits);
    blade_kv_store_free(store);
    blade_threadpool_free(pool);
    return rc;
}

static void print_stage_row(const char *label, const blade_stage_times *st)
{
    printf("| %s |", label);
    for (int i = 0; i < BLADE_STAGE_COUNT; i++)
        printf(" %.3f |", st->forwards ? st->seconds[i] * 1e3 / (double)st->forwards : 0.0);
    printf("\n");
}

/* Where the median steps' time went, stage by stage: what grows with the tokens of a verify
 * step besides its matrix products. */
static void print_stages(const blade_stage_times *stages)
{
    printf("where the median step's time goes, ms (each stage as the calling thread sees it):\n| new tokens T |");
    for (int i = 0; i < BLADE_STAGE_COUNT; i++)
        printf(" %s |", blade_runner_stage_name((blade_runner_stage)i));
    printf("\n|---|");
    for (int i = 0; i < BLADE_STAGE_COUNT; i++)
        printf("---|");
    printf("\n");
    char label[32];
    for (int n = 1; n <= CURVE_MAX; n++) {
        snprintf(label, sizeof label, "%d", n);
        print_stage_row(label, &stages[n]);
    }
    snprintf(label, sizeof label, "%d-token chunk", CURVE_CTX);
    print_stage_row(label, &stages[0]);
    printf("\n");
}

typedef struct mode_result {
    const char *name;
    blade_engine *e;
    double decode_s;     /* single stream: time from first to last token, summed */
    int64_t decode_tokens; /* tokens after the first, summed */
    blade_engine_stats single; /* statistics after the single-stream runs */
    double multi_s;            /* concurrent streams: wall time of each round, summed */
    int64_t multi_tokens;
    blade_engine_stats multi;  /* statistics after the concurrent rounds */
} mode_result;

/* Cost of a step of T new tokens in units of a one-token step, from the measured curve
 * (ms[1..CURVE_MAX]); beyond it, the last measured slope goes on. */
static double step_cost(const double *ms, int T)
{
    if (T <= CURVE_MAX)
        return ms[T] / ms[1];
    return (ms[CURVE_MAX] + (ms[CURVE_MAX] - ms[CURVE_MAX - 1]) * (T - CURVE_MAX)) / ms[1];
}

/* The speed-up over plain decode that the curve and a run's own acceptance predict: its
 * decode tokens over what their steps cost, a step without drafts 1 and a verify of k
 * drafts step_cost(k + 1). The drafter's own time is left out, so the gap between this
 * and the measured speed-up is what drafting and the engine's other work cost. */
static double predicted_speedup(const double *ms, const blade_engine_stats *st, int64_t decode_tokens)
{
    double cost = (double)decode_tokens - (double)(st->spec_accepted_tokens + st->spec_verifies);
    if (cost < 0)
        cost = 0;
    for (int k = 1; k <= BLADE_SPEC_MAX_K; k++)
        cost += (double)st->spec_draft_hist[k] * step_cost(ms, k + 1);
    return cost > 0 ? (double)decode_tokens / cost : 1.0;
}

/* Runner seconds per decode token of a run's one-sequence decode steps: their cost with the
 * drafting and the engine's other work left out. */
static double forward_per_token(const blade_engine_stats *st, int64_t decode_tokens)
{
    double s = 0;
    for (int t = 1; t <= BLADE_SPEC_MAX_K + 1; t++)
        s += st->solo_decode_seconds[t];
    return decode_tokens > 0 ? s / (double)decode_tokens : 0;
}

/* The run's own verify curve: its steps of T tokens against its one-token steps, the
 * count of each after it, what drafting took per step, and how often the drafting model was
 * called (a drafter that does not pay should seldom be). */
static void print_steps_as_run(const char *name, const blade_engine_stats *st)
{
    if (!st->solo_decode_steps[1])
        return;
    double one = st->solo_decode_seconds[1] / (double)st->solo_decode_steps[1];
    uint64_t steps = st->solo_decode_steps[1];
    printf("%s: one-token steps %.3f ms (%llu)", name, one * 1e3, (unsigned long long)steps);
    const char *sep = "; T =";
    for (int t = 2; t <= BLADE_SPEC_MAX_K + 1; t++) {
        if (!st->solo_decode_steps[t])
            continue;
        steps += st->solo_decode_steps[t];
        printf("%s %d: %.2f (%llu)", sep, t, st->solo_decode_seconds[t] / (double)st->solo_decode_steps[t] / one,
               (unsigned long long)st->solo_decode_steps[t]);
        sep = ",";
    }
    printf("; drafting %.3f ms per step", steps ? st->spec_draft_seconds / (double)steps * 1e3 : 0.0);
    if (st->spec_draft_calls)
        printf(", drafter called at %llu steps, %llu of them verifying drafts",
               (unsigned long long)st->spec_draft_calls, (unsigned long long)st->spec_verifies);
    printf("\n");
}

typedef struct bench_spec_options {
    const char *model, *text;
    long long n_prompts, prompt_len, n_gen, n_streams, rounds, reps;
    cli_engine_options engine;
} bench_spec_options;

static void bench_spec_init(void *opts)
{
    bench_spec_options *o = opts;
    o->text = "../shared/eval/stories-corpus.txt";
    o->n_prompts = 4;
    o->prompt_len = 32;
    o->n_gen = 128;
    o->n_streams = 16;
    o->rounds = 3;
    o->reps = 7;
    cli_engine_options_init(&o->engine);
    o->engine.kv_mem = (cli_size){.bytes = (size_t)256 << 20};
}

#define O bench_spec_options
static const cli_flag bench_spec_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(O, model), .metavar = "FILE",
     .dflt = "../shared/models/stories260K.gguf if present", .help = "target model"},
    {.name = "file", .letter = 'f', .kind = CLI_PATH, CLI_AT(O, text), .metavar = "FILE",
     .help = "the text prompts are cut from"},
    {.name = "prompts", .kind = CLI_INT, CLI_AT(O, n_prompts), .min = 1, .max = 1000, .metavar = "N",
     .help = "prompts, from evenly spaced places in the text"},
    {.name = "prompt-len", .kind = CLI_INT, CLI_AT(O, prompt_len), .min = 1, .max = 1 << 16, .metavar = "N",
     .help = "tokens of each prompt"},
    {.name = "n-predict", .letter = 'n', .kind = CLI_INT, CLI_AT(O, n_gen), .min = 2, .max = 1 << 20, .metavar = "N",
     .help = "tokens generated per prompt"},
    {.name = "streams", .kind = CLI_INT, CLI_AT(O, n_streams), .min = 0, .max = 1024, .metavar = "N",
     .help = "concurrent streams of the load test; 0: none"},
    {.name = "rounds", .kind = CLI_INT, CLI_AT(O, rounds), .min = 1, .max = 1000, .metavar = "N",
     .help = "rounds of the load test, each running every configuration once, in turn"},
    {.name = "reps", .kind = CLI_INT, CLI_AT(O, reps), .min = 1, .max = 1000, .metavar = "N",
     .help = "repetitions of each verify-curve point"},
    {0},
};
#undef O

static int bench_spec_main(int argc, char **argv);

const cli_command cli_cmd_bench_spec = {
    .name = "bench spec",
    .summary = "speculative decoding: the verify-cost curve and each drafter against plain decoding",
    .synopsis = "-m MODEL [--draft-model FILE] [options] [engine options]",
    .about = "Speculative decoding measured in one run: the verify-cost curve and where each size's time goes\n"
             "stage by stage (norms and conversions, the projections, attention), then greedy decoding of the same\n"
             "prompts (cut from a text) without speculation, with n-gram lookup, self-draft (--self-layers) and\n"
             "the draft model, taking turns: single-stream decode tokens/s and each ratio to plain, the ratio\n"
             "of the runner's time alone (its steps alone: drafting and the engine's other work left out),\n"
             "the ratio the curve predicts from the run's own acceptance, acceptance rate, mean accepted\n"
             "length (tokens per verify step) and mean k, then the aggregate tokens/s of --streams\n"
             "concurrent streams. Last, each run's steps as they ran: T-token steps against its one-token\n"
             "steps, and drafting's time per step. The KV memory defaults to 256M here.\n",
    .tables = (const cli_table[]){{bench_spec_flags, 0}, {cli_engine_flags, offsetof(bench_spec_options, engine)},
                                  {0}},
    .opts_size = sizeof(bench_spec_options),
    .init = bench_spec_init,
    .main = bench_spec_main,
};

static int bench_spec_main(int argc, char **argv)
{
    bench_spec_options o;
    int rc = cli_parse(&cli_cmd_bench_spec, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    cli_engine_options eo = o.engine;
    const char *model_path = o.model ? o.model : cli_default_model(), *text_path = o.text;
    long long n_prompts = o.n_prompts, prompt_len = o.prompt_len, n_gen = o.n_gen, n_streams = o.n_streams,
              rounds = o.rounds, reps = o.reps;
    if (!model_path)
        return cli_usage_error(&cli_cmd_bench_spec, "no model given (-m FILE)");
    rc = 1;
    blade_error err = {{0}};
    blade_model *m = blade_model_load(model_path, &err);
    char *text = NULL;
    int32_t *prompts = NULL;
    mode_result modes[MAX_MODES] = {{0}};
    int n_modes = 0;
    stream *streams = NULL;
    if (!m) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto out;
    }
    cli_engine_finalize(&eo, m);
    size_t text_len;
    if (!(text = cli_read_file(text_path, &text_len)))
        goto out;
    int32_t *all = NULL;
    size_t n_all = 0;
    if (blade_tokenizer_encode(m->tokenizer, text, text_len, false, false, &all, &n_all, &err)) {
        fprintf(stderr, "error: %s: %s\n", text_path, err.msg);
        goto out;
    }
    /* prompts from evenly spaced places in the text, each after BOS */
    prompts = malloc((size_t)n_prompts * (size_t)prompt_len * sizeof *prompts);
    if (!prompts || n_all < (size_t)(n_prompts * prompt_len)) {
        fprintf(stderr, "error: %s has %zu tokens, too few for %lld prompts of %lld\n", text_path, n_all, n_prompts,
                prompt_len);
        free(all);
        goto out;
    }
    for (long long p = 0; p < n_prompts; p++) {
        size_t at = (size_t)p * (n_all - (size_t)prompt_len) / (size_t)n_prompts;
        int32_t *dst = prompts + p * prompt_len;
        dst[0] = blade_tokenizer_bos(m->tokenizer) >= 0 ? blade_tokenizer_bos(m->tokenizer) : all[at];
        memcpy(dst + 1, all + at, (size_t)(prompt_len - 1) * sizeof *dst);
    }
    free(all);

    int threads = eo.cfg.n_threads;
    double curve[CURVE_MAX + 1];
    blade_stage_times stages[CURVE_MAX + 1];
    printf("verify cost on %s, %d threads (median of %lld, after a %d-token context):\n", model_path,
           threads > 0 ? threads : blade_physical_cores(), reps, CURVE_CTX);
    fflush(stdout);
    double prefill_ratio;
    if (verify_curve(m, threads, (int)reps, curve, stages, &prefill_ratio))
        goto out;
    printf("| new tokens T | step ms | cost vs T=1 |\n|---|---|---|\n");
    for (int n = 1; n <= CURVE_MAX; n++)
        printf("| %d (k=%d) | %.2f | %.2f |\n", n, n - 1, curve[n], curve[n] / curve[1]);
    printf("a %d-token chunk: %.1f ms = %.2f ms per token: prefill is %.1fx faster per token than decode "
           "(median over the turns)\n\n",
           CURVE_CTX, curve[0], curve[0] / CURVE_CTX, prefill_ratio);
    print_stages(stages);

    /* the draft model runs twice: as configured (prompt lookup beside it unless
     * --no-draft-lookup), and alone, to show what lookup adds */
    blade_spec_mode wanted[MAX_MODES] = {BLADE_SPEC_NONE, BLADE_SPEC_NGRAM, BLADE_SPEC_SELF};
    bool lookup[MAX_MODES] = {false, false, eo.cfg.spec.draft_lookup};
    n_modes = 3;
    if (eo.cfg.spec.draft_model_path) {
        wanted[n_modes] = BLADE_SPEC_DRAFT;
        lookup[n_modes++] = eo.cfg.spec.draft_lookup;
        if (eo.cfg.spec.draft_lookup) {
            wanted[n_modes] = BLADE_SPEC_DRAFT;
            lookup[n_modes++] = false;
        }
    }
    for (int i = 0; i < n_modes; i++) {
        blade_engine_config cfg = eo.cfg;
        cfg.spec.mode = wanted[i];
        cfg.spec.draft_lookup = lookup[i];
        modes[i].name = wanted[i] == BLADE_SPEC_DRAFT && !lookup[i] && eo.cfg.spec.draft_lookup
                            ? "draft, no lookup"
                            : blade_spec_mode_name(wanted[i]);
        if (!(modes[i].e = blade_engine_new(m, &cfg, &err))) {
            fprintf(stderr, "error: %s: %s\n", modes[i].name, err.msg);
            goto out;
        }
    }
    printf("single stream: %lld prompts of %lld tokens, %lld greedy tokens each\n", n_prompts, prompt_len, n_gen);
    fflush(stdout);
    stream s1;
    for (long long p = 0; p < n_prompts; p++)
        for (int i = 0; i < n_modes; i++) {
            if (submit(modes[i].e, prompts + p * prompt_len, (int32_t)prompt_len, (int32_t)n_gen, &s1))
                goto out;
            wait_all(&s1, 1);
            modes[i].decode_s += s1.t_last - s1.t_first;
            modes[i].decode_tokens += s1.n_out - 1;
        }
    for (int i = 0; i < n_modes; i++)
        blade_engine_stats_get(modes[i].e, &modes[i].single);
    if (n_streams > 0) {
        printf("%lld concurrent streams, %lld rounds\n", n_streams, rounds);
        fflush(stdout);
        streams = calloc((size_t)n_streams, sizeof *streams);
        if (!streams)
            goto out;
        /* each round runs every configuration once, starting one further along, so a slow
         * spell of a shared machine falls on all of them alike */
        for (long long round = 0; round < rounds; round++)
            for (int turn = 0; turn < n_modes; turn++) {
                mode_result *mr = &modes[(turn + round) % n_modes];
                double t0 = cli_now();
                for (long long s = 0; s < n_streams; s++)
                    if (submit(mr->e, prompts + (s % n_prompts) * prompt_len, (int32_t)prompt_len, (int32_t)n_gen,
                               &streams[s]))
                        goto out;
                wait_all(streams, (int)n_streams);
                mr->multi_s += cli_now() - t0;
                for (long long s = 0; s < n_streams; s++)
                    mr->multi_tokens += streams[s].n_out;
            }
        for (int i = 0; i < n_modes; i++)
            blade_engine_stats_get(modes[i].e, &modes[i].multi);
    }
    printf("\n| drafter | decode tok/s (1 stream) | vs plain | its steps alone | curve predicts | acceptance | "
           "mean accepted length | mean k |");
    if (n_streams > 0)
        printf(" %lld streams tok/s | vs plain | drafts per token |", n_streams);
    printf("\n|---|---|---|---|---|---|---|---|%s\n", n_streams > 0 ? "---|---|---|" : "");
    double base1 = modes[0].decode_tokens / modes[0].decode_s, baseN = modes[0].multi_tokens / (modes[0].multi_s + 1e-12);
    double base_fwd = forward_per_token(&modes[0].single, modes[0].decode_tokens);
    for (int i = 0; i < n_modes; i++) {
        const blade_engine_stats *st = &modes[i].single;
        double tps = modes[i].decode_tokens / modes[i].decode_s, fwd = forward_per_token(st, modes[i].decode_tokens);
        printf("| %s | %.1f | %.2fx | %.2fx | %.2fx |", modes[i].name, tps, tps / base1, fwd > 0 ? base_fwd / fwd : 0.0,
               predicted_speedup(curve, st, modes[i].decode_tokens));
        if (st->spec_verifies)
            printf(" %.1f%% | %.2f | %.2f |", 100.0 * st->spec_accepted_tokens / (double)st->spec_draft_tokens,
                   1.0 + (double)st->spec_accepted_tokens / (double)st->spec_verifies,
                   (double)st->spec_draft_tokens / (double)st->spec_verifies);
        else
            printf(" - | 1 | 0 |");
        if (n_streams > 0) {
            double agg = modes[i].multi_tokens / modes[i].multi_s;
            /* how far speculation backed off under load */
            uint64_t drafts = modes[i].multi.spec_draft_tokens - modes[i].single.spec_draft_tokens;
            printf(" %.1f | %.2fx | %.2f |", agg, agg / baseN, (double)drafts / (double)modes[i].multi_tokens);
        }
        printf("\n");
    }
    printf("\nsingle-stream decode steps as they ran (cost of T tokens vs the same run's one-token steps):\n");
    for (int i = 0; i < n_modes; i++)
        print_steps_as_run(modes[i].name, &modes[i].single);
    rc = 0;
out:
    for (int i = 0; i < n_modes; i++)
        blade_engine_free(modes[i].e, false);
    free(streams);
    free(prompts);
    free(text);
    blade_model_free(m);
    return rc;
}

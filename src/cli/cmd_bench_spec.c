/* `blade bench spec`: what speculative decoding buys on this machine, every figure a ratio
 * measured in one run. First the verify-cost curve (a step of T new tokens against a step
 * of one, and a long chunk's cost per token: the compute per byte that speculation lives
 * on), then greedy decoding of the same prompts with each drafter, the configurations
 * taking turns prompt by prompt so that a machine shared with other work slows all of them
 * alike: single-stream decode tokens/s, acceptance, mean accepted length and mean k, and
 * the aggregate tokens/s of many concurrent streams. */

#include "blade/engine.h"
#include "blade/kv_store.h"
#include "blade/model.h"
#include "blade/runner.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_MODES 4
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

/* Median time of a step of T new tokens (every row's logits, as a verify step has), T =
 * 1..CURVE_MAX, after a CURVE_CTX-token context, the sizes taking turns; and of one
 * CURVE_CTX-token chunk. Fills ms[0..CURVE_MAX] (ms[0]: the chunk). */
static int verify_curve(const blade_model *m, int threads, int reps, double *ms)
{
    blade_error err = {{0}};
    blade_kv_store_config sc = blade_model_kv_config(&m->hp, BLADE_KV_F16, 16, 8);
    blade_threadpool *pool = blade_threadpool_new(threads);
    blade_kv_store *store = pool ? blade_kv_store_new(&sc, &err) : NULL;
    blade_runner *r = store ? blade_runner_new(m, store, pool, CURVE_CTX, &err) : NULL;
    float *logits = malloc((size_t)CURVE_CTX * m->hp.n_vocab * sizeof(float));
    int rc = -1;
    if (!r || !logits) {
        fprintf(stderr, "error: verify curve: %s\n", err.msg[0] ? err.msg : "out of memory");
        goto out;
    }
    int32_t blocks[8] = {0, 1, 2, 3, 4, 5, 6, 7}, toks[CURVE_CTX], rows[CURVE_CTX];
    for (int i = 0; i < CURVE_CTX; i++) {
        toks[i] = 1 + (i * 37) % (m->hp.n_vocab - 1);
        rows[i] = i;
    }
    double *t = calloc((size_t)reps * (CURVE_MAX + 1), sizeof *t);
    for (int rep = 0; rep < reps && t; rep++)
        for (int n = 0; n <= CURVE_MAX; n++) {
            int32_t len = n ? n : CURVE_CTX;
            blade_batch_seq b = {.tokens = toks, .n_tokens = len, .pos0 = n ? CURVE_CTX : 0, .block_table = blocks,
                                 .n_blocks = 8, .logit_rows = rows, .n_logits = n ? n : 1, .logits = logits};
            double t0 = cli_now();
            if (blade_runner_forward(r, &b, 1, &err)) {
                fprintf(stderr, "error: verify curve: %s\n", err.msg);
                free(t);
                goto out;
            }
            t[(size_t)n * reps + rep] = (cli_now() - t0) * 1e3;
        }
    if (!t)
        goto out;
    for (int n = 0; n <= CURVE_MAX; n++) {
        qsort(t + (size_t)n * reps, (size_t)reps, sizeof *t, cmp_double);
        ms[n] = t[(size_t)n * reps + reps / 2];
    }
    free(t);
    rc = 0;
out:
    free(logits);
    blade_runner_free(r);
    blade_kv_store_free(store);
    blade_threadpool_free(pool);
    return rc;
}

typedef struct mode_result {
    const char *name;
    blade_engine *e;
    double decode_s;     /* single stream: time from first to last token, summed */
    int64_t decode_tokens; /* tokens after the first, summed */
    blade_engine_stats single; /* statistics after the single-stream runs */
    double multi_s;
    int64_t multi_tokens;
} mode_result;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: blade bench spec -m MODEL [--draft-model FILE] [options] [engine options]\n\n"
            "Speculative decoding measured in one run: the verify-cost curve, then greedy decoding of the same\n"
            "prompts (cut from a text) without speculation, with n-gram lookup, self-draft (--self-layers) and\n"
            "the draft model, taking turns: single-stream decode tokens/s and each ratio to plain, acceptance\n"
            "rate, mean accepted length (tokens per verify step) and mean k, then the aggregate tokens/s of\n"
            "--streams concurrent streams.\n\n"
            "  -m, --model FILE     target model\n"
            "      --text FILE      prompts are cut from it (default ../shared/eval/stories-corpus.txt)\n"
            "      --prompts N      prompts (default 4), each --prompt-len tokens (default 32)\n"
            "      --prompt-len N\n"
            "  -n, --n-gen N        tokens generated per prompt (default 128)\n"
            "      --streams N      concurrent streams of the load test (default 16; 0: none)\n"
            "      --reps N         repetitions of each verify-curve point (default 7)\n\n");
    cli_engine_usage(out);
}

int cmd_bench_spec(int argc, char **argv)
{
    enum { O_TEXT = 1, O_PROMPTS, O_PROMPT_LEN, O_STREAMS, O_REPS };
    static const struct option own[] = {
        {"model", required_argument, 0, 'm'},  {"text", required_argument, 0, O_TEXT},
        {"prompts", required_argument, 0, O_PROMPTS}, {"prompt-len", required_argument, 0, O_PROMPT_LEN},
        {"n-gen", required_argument, 0, 'n'},  {"streams", required_argument, 0, O_STREAMS},
        {"reps", required_argument, 0, O_REPS}, {"help", no_argument, 0, 'h'},
    };
    struct option *longopts = cli_merge_longopts(own, sizeof own / sizeof own[0]);
    if (!longopts)
        return 1;
    cli_engine_options eo;
    cli_engine_options_init(&eo);
    eo.kv_mem_fraction = 0;
    eo.cfg.kv_mem_bytes = (size_t)256 << 20;
    const char *model_path = NULL, *text_path = "../shared/eval/stories-corpus.txt";
    long long n_prompts = 4, prompt_len = 32, n_gen = 128, n_streams = 16, reps = 7;
    int c, rc = 2;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:n:t:c:h", longopts, NULL)) != -1) {
        int h = cli_engine_option(&eo, c, optarg);
        if (h < 0)
            goto out_opts;
        if (h)
            continue;
        switch (c) {
        case 'm': model_path = optarg; break;
        case O_TEXT: text_path = optarg; break;
        case O_PROMPTS: if (!cli_parse_int("--prompts", optarg, 1, 1000, &n_prompts)) goto out_opts; break;
        case O_PROMPT_LEN: if (!cli_parse_int("--prompt-len", optarg, 1, 1 << 16, &prompt_len)) goto out_opts; break;
        case 'n': if (!cli_parse_int("--n-gen", optarg, 2, 1 << 20, &n_gen)) goto out_opts; break;
        case O_STREAMS: if (!cli_parse_int("--streams", optarg, 0, 1024, &n_streams)) goto out_opts; break;
        case O_REPS: if (!cli_parse_int("--reps", optarg, 1, 1000, &reps)) goto out_opts; break;
        case 'h': usage(stdout); rc = 0; goto out_opts;
        default: usage(stderr); goto out_opts;
        }
    }
    if (!model_path && !(model_path = cli_default_model())) {
        fprintf(stderr, "error: no model given (-m FILE)\n");
        goto out_opts;
    }
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
    printf("verify cost on %s, %d threads (median of %lld, after a %d-token context):\n", model_path,
           threads > 0 ? threads : 0, reps, CURVE_CTX);
    fflush(stdout);
    if (verify_curve(m, threads, (int)reps, curve))
        goto out;
    printf("| new tokens T | step ms | cost vs T=1 |\n|---|---|---|\n");
    for (int n = 1; n <= CURVE_MAX; n++)
        printf("| %d (k=%d) | %.2f | %.2f |\n", n, n - 1, curve[n], curve[n] / curve[1]);
    printf("a %d-token chunk: %.1f ms = %.2f ms per token: prefill is %.1fx faster per token than decode\n\n",
           CURVE_CTX, curve[0], curve[0] / CURVE_CTX, curve[1] / (curve[0] / CURVE_CTX));

    blade_spec_mode wanted[MAX_MODES] = {BLADE_SPEC_NONE, BLADE_SPEC_NGRAM, BLADE_SPEC_SELF};
    n_modes = 3;
    if (eo.cfg.spec.draft_model_path)
        wanted[n_modes++] = BLADE_SPEC_DRAFT;
    for (int i = 0; i < n_modes; i++) {
        blade_engine_config cfg = eo.cfg;
        cfg.spec.mode = wanted[i];
        modes[i].name = blade_spec_mode_name(wanted[i]);
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
        printf("%lld concurrent streams\n", n_streams);
        fflush(stdout);
        streams = calloc((size_t)n_streams, sizeof *streams);
        if (!streams)
            goto out;
        for (int i = 0; i < n_modes; i++) {
            double t0 = cli_now();
            for (long long s = 0; s < n_streams; s++)
                if (submit(modes[i].e, prompts + (s % n_prompts) * prompt_len, (int32_t)prompt_len, (int32_t)n_gen,
                           &streams[s]))
                    goto out;
            wait_all(streams, (int)n_streams);
            modes[i].multi_s = cli_now() - t0;
            for (long long s = 0; s < n_streams; s++)
                modes[i].multi_tokens += streams[s].n_out;
        }
    }
    printf("\n| drafter | decode tok/s (1 stream) | vs plain | acceptance | mean accepted length | mean k |");
    if (n_streams > 0)
        printf(" %lld streams tok/s | vs plain |", n_streams);
    printf("\n|---|---|---|---|---|---|%s\n", n_streams > 0 ? "---|---|" : "");
    double base1 = modes[0].decode_tokens / modes[0].decode_s, baseN = modes[0].multi_tokens / (modes[0].multi_s + 1e-12);
    for (int i = 0; i < n_modes; i++) {
        const blade_engine_stats *st = &modes[i].single;
        double tps = modes[i].decode_tokens / modes[i].decode_s;
        printf("| %s | %.1f | %.2fx |", modes[i].name, tps, tps / base1);
        if (st->spec_verifies)
            printf(" %.1f%% | %.2f | %.2f |", 100.0 * st->spec_accepted_tokens / (double)st->spec_draft_tokens,
                   1.0 + (double)st->spec_accepted_tokens / (double)st->spec_verifies,
                   (double)st->spec_draft_tokens / (double)st->spec_verifies);
        else
            printf(" - | 1 | 0 |");
        if (n_streams > 0) {
            double agg = modes[i].multi_tokens / modes[i].multi_s;
            printf(" %.1f | %.2fx |", agg, agg / baseN);
        }
        printf("\n");
    }
    rc = 0;
out:
    for (int i = 0; i < n_modes; i++)
        blade_engine_free(modes[i].e, false);
    free(streams);
    free(prompts);
    free(text);
    blade_model_free(m);
out_opts:
    free(longopts);
    return rc;
}

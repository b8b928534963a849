#include "blade/engine.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* `blade bench engine`: the engine's techniques measured in-process, each against its
 * baseline mode in the same run, on seeded synthetic workloads. Outputs end where the
 * workload says (the client stops reading, as a stop condition would), so lengths are
 * exact whatever the model. */

typedef struct req {
    int32_t *prompt;
    int32_t n_prompt;
    int32_t out_len;   /* tokens the client wants */
    int32_t after_req; /* arrives once that request (-1: none) ... */
    int32_t after_tokens; /* ... has received this many tokens (or finished) */
    /* measured */
    double t_submit, t_first, t_last, t_done;
    double max_gap;
    int32_t n_out;
    uint64_t id;
    bool done;
    blade_engine *engine;
} req;

typedef struct workload {
    req *reqs;
    int n;
    int32_t max_tokens; /* the cap every request carries, as a client would set it */
} workload;

static uint64_t rng_state;
static uint32_t rnd(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}
static double unif(void)
{
    return (rnd() + 0.5) / 2147483648.0;
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static double t_start;

static void on_event(const blade_token_event *ev)
{
    req *r = ev->user;
    double t = cli_now() - t_start;
    pthread_mutex_lock(&mu);
    if (ev->token >= 0 && r->n_out < r->out_len) {
        if (r->n_out == 0)
            r->t_first = t;
        else if (t - r->t_last > r->max_gap)
            r->max_gap = t - r->t_last;
        r->t_last = t;
        if (++r->n_out == r->out_len && ev->finish == BLADE_FINISH_NONE)
            blade_engine_abort(r->engine, ev->request_id);
    }
    if (ev->finish != BLADE_FINISH_NONE) {
        r->done = true;
        r->t_done = t;
        pthread_cond_broadcast(&cv);
    }
    pthread_mutex_unlock(&mu);
}

static int32_t random_token(const blade_model *m)
{
    /* skip the first few hundred ids: control and byte tokens in most vocabularies */
    int32_t lo = m->hp.n_vocab > 1000 ? 300 : 3;
    return lo + (int32_t)(rnd() % (uint32_t)(m->hp.n_vocab - lo));
}

static bool released(const workload *w, int i)
{
    const req *r = &w->reqs[i];
    if (r->after_req < 0)
        return true;
    pthread_mutex_lock(&mu);
    const req *dep = &w->reqs[r->after_req];
    bool ok = dep->done || dep->n_out >= r->after_tokens;
    pthread_mutex_unlock(&mu);
    return ok;
}

typedef struct run_result {
    double seconds;
    uint64_t tokens;
    double mean_ttft, max_gap, throughput;
    blade_engine_stats stats;
} run_result;

static int run(const blade_model *m, const cli_engine_options *base, const workload *w, run_result *out)
{
    blade_error err = {{0}};
    blade_engine *e = blade_engine_new(m, &base->cfg, &err);
    if (!e) {
        fprintf(stderr, "error: %s\n", err.msg);
        return -1;
    }
    for (int i = 0; i < w->n; i++) {
        req *r = &w->reqs[i];
        r->engine = e;
        r->n_out = 0;
        r->done = false;
        r->max_gap = 0;
        r->t_first = r->t_last = 0;
    }
    bool tty = isatty(STDERR_FILENO);
    t_start = cli_now();
    int next = 0, finished = 0;
    while (finished < w->n) {
        while (next < w->n && released(w, next)) {
            req *r = &w->reqs[next++];
            blade_request q;
            blade_request_default(&q);
            q.prompt_tokens = r->prompt;
            q.n_prompt_tokens = r->n_prompt;
            q.max_tokens = w->max_tokens;
            q.ignore_eos = true;
            q.sampling.temperature = 0;
            q.callback = on_event;
            q.user = r;
            r->t_submit = cli_now() - t_start;
            if (!(r->id = blade_engine_submit(e, &q, &err))) {
                fprintf(stderr, "error: %s\n", err.msg);
                blade_engine_free(e, false);
                return -1;
            }
        }
        pthread_mutex_lock(&mu);
        finished = 0;
        for (int i = 0; i < w->n; i++)
            finished += w->reqs[i].done;
        if (finished < w->n) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 20 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&cv, &mu, &ts);
        }
        pthread_mutex_unlock(&mu);
        if (tty)
            fprintf(stderr, "\r  %d/%d requests done, %.1f s ", finished, w->n, cli_now() - t_start);
    }
    if (tty)
        fprintf(stderr, "\r%50s\r", "");
    double end = 0, ttft = 0, gap = 0;
    uint64_t tokens = 0;
    for (int i = 0; i < w->n; i++) {
        req *r = &w->reqs[i];
        end = r->t_done > end ? r->t_done : end;
        ttft += r->t_first - r->t_submit;
        gap = r->max_gap > gap ? r->max_gap : gap;
        tokens += (uint64_t)r->n_out;
    }
    blade_engine_stats_get(e, &out->stats);
    blade_engine_free(e, false);
    out->seconds = end;
    out->tokens = tokens;
    out->throughput = (double)tokens / end;
    out->mean_ttft = ttft / w->n;
    out->max_gap = gap;
    return 0;
}

static void free_workload(workload *w)
{
    for (int i = 0; i < w->n; i++)
        free(w->reqs[i].prompt);
    free(w->reqs);
}

static req *add_req(workload *w, int32_t n_prompt)
{
    req *r = &w->reqs[w->n++];
    memset(r, 0, sizeof *r);
    r->n_prompt = n_prompt;
    r->after_req = -1;
    r->prompt = malloc((size_t)n_prompt * sizeof *r->prompt);
    return r;
}

/* 32 requests at once, prompts of 32..256 tokens, wanted outputs log-uniform in 16..512
 * (many short answers, a few long ones), every request capped at max_tokens 512. */
static void mixed_workload(const blade_model *m, workload *w)
{
    w->reqs = calloc(32, sizeof *w->reqs);
    w->max_tokens = 512;
    for (int i = 0; i < 32; i++) {
        req *r = add_req(w, 32 + (int32_t)(rnd() % 225));
        for (int32_t t = 0; t < r->n_prompt; t++)
            r->prompt[t] = random_token(m);
        r->out_len = (int32_t)lround(16.0 * pow(32.0, unif()));
    }
}

/* One request carries the shared prefix first (as a system prompt would be warmed), then
 * 16 requests arrive together: the 1024-token shared prefix plus 32 tokens of their own. */
static void shared_prefix_workload(const blade_model *m, workload *w, int32_t prefix)
{
    w->reqs = calloc(17, sizeof *w->reqs);
    w->max_tokens = 16;
    int32_t *shared = malloc((size_t)prefix * sizeof *shared);
    for (int32_t t = 0; t < prefix; t++)
        shared[t] = random_token(m);
    for (int i = 0; i < 17; i++) {
        req *r = add_req(w, prefix + 32);
        memcpy(r->prompt, shared, (size_t)prefix * sizeof *shared);
        for (int32_t t = prefix; t < r->n_prompt; t++)
            r->prompt[t] = random_token(m);
        r->out_len = 16;
        if (i > 0) {
            r->after_req = 0; /* the warm-up request has finished */
            r->after_tokens = 1 << 30;
        }
    }
    free(shared);
}

/* Eight sequences decoding 192 tokens each; once they are under way a long prompt arrives. */
static void interference_workload(const blade_model *m, workload *w, int32_t long_prompt)
{
    w->reqs = calloc(9, sizeof *w->reqs);
    w->max_tokens = 192;
    for (int i = 0; i < 9; i++) {
        req *r = add_req(w, i < 8 ? 16 : long_prompt);
        for (int32_t t = 0; t < r->n_prompt; t++)
            r->prompt[t] = random_token(m);
        r->out_len = i < 8 ? 192 : 1;
        if (i == 8) {
            r->after_req = 0; /* the decoders are a quarter of the way through */
            r->after_tokens = 48;
        }
    }
}

static void print_row(const char *name, const run_result *r, const char *extra)
{
    printf("| %-34s | %8.1f | %9.2f | %10.3f | %10.3f | %7llu | %s\n", name, r->seconds, r->throughput, r->mean_ttft,
           r->max_gap, (unsigned long long)r->stats.preemptions, extra);
}

static void print_header(void)
{
    printf("| %-34s | %8s | %9s | %10s | %10s | %7s | notes\n", "configuration", "time s", "tokens/s", "mean TTFT s",
           "max gap s", "preempt");
    printf("| %-34s | %8s | %9s | %10s | %10s | %7s | -----\n", "----------------------------------", "--------",
           "---------", "----------", "----------", "-------");
}

enum { WORKLOAD_MIXED, WORKLOAD_SHARED_PREFIX, WORKLOAD_INTERFERENCE };

/* A run and the workload's own reading of it: shared-prefix's TTFT leaves out the warm-up
 * request, interference's gap is the decoders'. */
static int run_workload(const blade_model *m, const cli_engine_options *o, const workload *w, int kind,
                        run_result *out)
{
    if (run(m, o, w, out))
        return -1;
    if (kind == WORKLOAD_SHARED_PREFIX) {
        double ttft = 0;
        for (int i = 1; i < w->n; i++)
            ttft += w->reqs[i].t_first - w->reqs[i].t_submit;
        out->mean_ttft = ttft / (w->n - 1);
    } else if (kind == WORKLOAD_INTERFERENCE) {
        double gap = 0;
        for (int i = 0; i < 8; i++)
            gap = w->reqs[i].max_gap > gap ? w->reqs[i].max_gap : gap;
        out->max_gap = gap;
    }
    return 0;
}

/* With a KV type other than f16, the default configuration once more with f16 KV in the
 * same memory: what the narrower cache buys (fewer preemptions, more sequences at once). */
static int compare_kv_type(const blade_model *m, const cli_engine_options *o, const workload *w, int kind,
                           const run_result *a)
{
    if (o->cfg.kv_type == BLADE_KV_F16)
        return 0;
    cli_engine_options f16 = *o;
    f16.cfg.kv_type = BLADE_KV_F16;
    fprintf(stderr, "f16 KV in the same memory...\n");
    run_result b;
    if (run_workload(m, &f16, w, kind, &b))
        return -1;
    char note[160];
    snprintf(note, sizeof note, "throughput %s/f16 = %.2fx, mean TTFT f16/%s = %.2fx, most running %d vs %d",
             blade_kv_type_name(o->cfg.kv_type), a->throughput / b.throughput, blade_kv_type_name(o->cfg.kv_type),
             b.mean_ttft / a->mean_ttft, a->stats.max_running, b.stats.max_running);
    print_row("--kv-type f16 (same KV memory)", &b, note);
    return 0;
}

static const cli_choice workloads[] = {
    {"mixed", WORKLOAD_MIXED}, {"shared-prefix", WORKLOAD_SHARED_PREFIX}, {"interference", WORKLOAD_INTERFERENCE}, {0}};

typedef struct bench_engine_options {
    const char *model_path;
    int workload;
    long long seed;
    cli_engine_options engine;
} bench_engine_options;

static void bench_engine_init(void *opts)
{
    bench_engine_options *o = opts;
    o->seed = 1;
    cli_engine_options_init(&o->engine);
}

#define O bench_engine_options
static const cli_flag bench_engine_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(O, model_path), .metavar = "FILE", .required = true,
     .help = "GGUF model"},
    {.name = "workload", .letter = 'w', .kind = CLI_ENUM, CLI_AT(O, workload), .choices = workloads, .metavar = "W",
     .required = true, .help = "the workload, described above"},
    {.name = "seed", .kind = CLI_INT, CLI_AT(O, seed), .min = 0, .max = CLI_INT64_MAX, .metavar = "N",
     .help = "workload seed"},
    {0},
};
#undef O

static int bench_engine_main(int argc, char **argv);

const cli_command cli_cmd_bench_engine = {
    .name = "bench engine",
    .summary = "the engine's techniques in-process, each against its baseline mode",
    .synopsis = "-m MODEL --workload W [options]",
    .about = "Runs a seeded workload through the engine in-process, once with every technique on and once\n"
             "with each technique's baseline mode, in the same run, and prints the ratios:\n"
             "  mixed          32 requests, outputs 16..512 tokens (log-uniform), 32..256-token prompts:\n"
             "                 continuous vs --scheduler static throughput; KV utilisation paged vs\n"
             "                 --kv-alloc contiguous, and requests that fit in 1 GiB each way\n"
             "  shared-prefix  16 requests sharing a 1024-token prefix + 32 own tokens, after one warm-up\n"
             "                 request: mean TTFT with vs --no-prefix-cache\n"
             "  interference   8 sequences decoding when a 2048-token prompt arrives: longest gap between\n"
             "                 the decoders' tokens, chunked vs --no-chunked-prefill\n"
             "With --kv-type other than f16, every workload also runs its default configuration with f16\n"
             "KV in the same --kv-mem: throughput and preemptions of the narrower cache against f16's.\n",
    .tables = (const cli_table[]){{bench_engine_flags, 0}, {cli_engine_flags, offsetof(bench_engine_options, engine)},
                                  {0}},
    .opts_size = sizeof(bench_engine_options),
    .init = bench_engine_init,
    .main = bench_engine_main,
};

static int bench_engine_main(int argc, char **argv)
{
    bench_engine_options opts;
    int rc = cli_parse(&cli_cmd_bench_engine, argc, argv, &opts);
    if (rc != CLI_RUN)
        return rc;
    cli_engine_options o = opts.engine;
    const char *model_path = opts.model_path;
    blade_error err = {{0}};
    blade_model *m = blade_model_load(model_path, &err);
    if (!m) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    cli_engine_finalize(&o, m);
    rng_state = (uint64_t)opts.seed * 2654435761u + 1;
    rc = 1;
    workload w = {0};
    run_result a, b, c2;
    blade_kv_store_config one_token = blade_model_kv_config(&m->hp, o.cfg.kv_type, 1, 1);
    double kv_bytes_token = (double)blade_kv_store_block_bytes(&one_token);
    printf("model: %s, threads: %d, KV %.2f GiB of %s (%lld tokens), step budget %d tokens, %d sequences\n\n",
           model_path, o.cfg.n_threads, (double)o.cfg.kv_mem_bytes / 1073741824.0, blade_kv_type_name(o.cfg.kv_type),
           (long long)cli_kv_tokens(&m->hp, o.cfg.kv_type, o.cfg.block_size, o.cfg.kv_mem_bytes),
           o.cfg.sched.max_batch_tokens, o.cfg.sched.max_seqs);
    switch (opts.workload) {
    case WORKLOAD_MIXED: {
        mixed_workload(m, &w);
        cli_engine_options st = o, ct = o;
        st.cfg.sched.mode = BLADE_SCHED_STATIC;
        ct.cfg.sched.contiguous_kv = true;
        fprintf(stderr, "continuous batching, paged KV...\n");
        if (run_workload(m, &o, &w, opts.workload, &a))
            goto done;
        fprintf(stderr, "static batching...\n");
        if (run(m, &st, &w, &b))
            goto done;
        fprintf(stderr, "contiguous KV reservation...\n");
        if (run(m, &ct, &w, &c2))
            goto done;
        print_header();
        char note[160];
        snprintf(note, sizeof note, "KV utilisation %.1f%%", 100 * a.stats.kv_utilisation);
        print_row("continuous, paged (default)", &a, note);
        snprintf(note, sizeof note, "throughput ratio continuous/static = %.2fx", a.throughput / b.throughput);
        print_row("--scheduler static", &b, note);
        snprintf(note, sizeof note, "KV utilisation %.1f%%", 100 * c2.stats.kv_utilisation);
        print_row("--kv-alloc contiguous", &c2, note);
        if (compare_kv_type(m, &o, &w, opts.workload, &a))
            goto done;
        /* requests of this mix that fit in 1 GiB: what each allocator holds per request */
        double paged_tokens = 0, contiguous_tokens = 0;
        int32_t bs = o.cfg.block_size;
        for (int i = 0; i < w.n; i++) {
            int32_t len = w.reqs[i].n_prompt + w.reqs[i].out_len;
            paged_tokens += (double)((len + bs - 1) / bs * bs);
            contiguous_tokens += (double)(w.reqs[i].n_prompt + w.max_tokens);
        }
        double gib = 1073741824.0;
        printf("\nrequests of this mix that fit in 1 GiB of KV: paged %.0f, contiguous %.0f (%.2fx)\n",
               gib / (kv_bytes_token * paged_tokens / w.n), gib / (kv_bytes_token * contiguous_tokens / w.n),
               contiguous_tokens / paged_tokens);
        break;
    }
    case WORKLOAD_SHARED_PREFIX: {
        shared_prefix_workload(m, &w, 1024);
        cli_engine_options nc = o;
        nc.cfg.prefix_caching = false;
        const cli_engine_options *cfgs[2] = {&o, &nc};
        run_result *res[2] = {&a, &b};
        for (int k = 0; k < 2; k++) {
            fprintf(stderr, "%s...\n", k ? "--no-prefix-cache" : "prefix caching on");
            if (run_workload(m, cfgs[k], &w, opts.workload, res[k]))
                goto done;
        }
        print_header();
        char note[160];
        snprintf(note, sizeof note, "prefix hit rate %.1f%%", 100 * a.stats.prefix_hit_rate);
        print_row("prefix caching (default)", &a, note);
        snprintf(note, sizeof note, "mean TTFT ratio = %.1fx", b.mean_ttft / a.mean_ttft);
        print_row("--no-prefix-cache", &b, note);
        if (compare_kv_type(m, &o, &w, opts.workload, &a))
            goto done;
        break;
    }
    case WORKLOAD_INTERFERENCE: {
        int32_t long_prompt = o.cfg.max_context - 1 < 2048 ? o.cfg.max_context - 1 : 2048;
        interference_workload(m, &w, long_prompt);
        cli_engine_options nc = o;
        nc.cfg.sched.chunked_prefill = false;
        const cli_engine_options *cfgs[2] = {&o, &nc};
        run_result *res[2] = {&a, &b};
        for (int k = 0; k < 2; k++) {
            fprintf(stderr, "%s...\n", k ? "--no-chunked-prefill" : "chunked prefill on");
            if (run_workload(m, cfgs[k], &w, opts.workload, res[k]))
                goto done;
        }
        print_header();
        char note[160];
        snprintf(note, sizeof note, "%d-token prompt into 8 decoders", long_prompt);
        print_row("chunked prefill (default)", &a, note);
        snprintf(note, sizeof note, "longest-gap ratio = %.1fx", b.max_gap / a.max_gap);
        print_row("--no-chunked-prefill", &b, note);
        if (compare_kv_type(m, &o, &w, opts.workload, &a))
            goto done;
        break;
    }
    }
    rc = 0;
done:
    free_workload(&w);
    blade_model_free(m);
    return rc;
}

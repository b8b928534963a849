/* `blade bench serve` (measure an OpenAI-compatible endpoint under a seeded workload) and
 * `blade bench ablation` (start blade serve once per configuration, from the naive
 * baseline adding one technique at a time, and measure each with the same workload). */
#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"
#include "loadgen/client.h"
#include "loadgen/html.h"
#include "loadgen/summary.h"
#include "loadgen/workload.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- the options serve and ablation share: workload, arrivals, limits, output ---- */

enum {
    OPT_WORKLOAD = 2000,
    OPT_SEED,
    OPT_TEXT,
    OPT_DATASET,
    OPT_INPUT_LEN,
    OPT_OUTPUT_LEN,
    OPT_GROUPS,
    OPT_PER_GROUP,
    OPT_PREFIX_LEN,
    OPT_TURNS,
    OPT_LONG_LEN,
    OPT_LONG_EVERY,
    OPT_RATE,
    OPT_BURSTINESS,
    OPT_CONCURRENCY,
    OPT_NUM_REQUESTS,
    OPT_DURATION,
    OPT_SLO,
    OPT_PRICE,
    OPT_PROMPT_FORMAT,
    OPT_IGNORE_EOS,
    OPT_TIMEOUT,
    OPT_NO_WARMUP,
    OPT_JSON,
    OPT_API_KEY,
    /* command-specific */
    OPT_URL,
    OPT_MODEL_NAME,
    OPT_TOKENIZER,
    OPT_REPORT,
};

static const struct option load_longopts[] = {
    {"workload", required_argument, 0, OPT_WORKLOAD},
    {"seed", required_argument, 0, OPT_SEED},
    {"text", required_argument, 0, OPT_TEXT},
    {"dataset", required_argument, 0, OPT_DATASET},
    {"input-len", required_argument, 0, OPT_INPUT_LEN},
    {"output-len", required_argument, 0, OPT_OUTPUT_LEN},
    {"groups", required_argument, 0, OPT_GROUPS},
    {"prompts-per-group", required_argument, 0, OPT_PER_GROUP},
    {"prefix-len", required_argument, 0, OPT_PREFIX_LEN},
    {"turns", required_argument, 0, OPT_TURNS},
    {"long-len", required_argument, 0, OPT_LONG_LEN},
    {"long-every", required_argument, 0, OPT_LONG_EVERY},
    {"request-rate", required_argument, 0, OPT_RATE},
    {"burstiness", required_argument, 0, OPT_BURSTINESS},
    {"max-concurrency", required_argument, 0, OPT_CONCURRENCY},
    {"num-requests", required_argument, 0, OPT_NUM_REQUESTS},
    {"duration", required_argument, 0, OPT_DURATION},
    {"slo", required_argument, 0, OPT_SLO},
    {"price-per-hour", required_argument, 0, OPT_PRICE},
    {"prompt-format", required_argument, 0, OPT_PROMPT_FORMAT},
    {"ignore-eos", no_argument, 0, OPT_IGNORE_EOS},
    {"timeout", required_argument, 0, OPT_TIMEOUT},
    {"no-warmup", no_argument, 0, OPT_NO_WARMUP},
    {"json", required_argument, 0, OPT_JSON},
    {"api-key", required_argument, 0, OPT_API_KEY},
};
#define N_LOAD_OPTS (sizeof load_longopts / sizeof load_longopts[0])

typedef struct load_options {
    lg_workload_config wl;
    bool have_workload;
    const char *api_key;
    bool prompt_text, ignore_eos, warmup;
    int64_t num_requests;
    double duration, request_rate, burstiness, timeout, price_per_hour;
    long long max_concurrency;
    lg_slo slo;
    const char *json_path;
} load_options;

static void load_options_init(load_options *o)
{
    memset(o, 0, sizeof *o);
    o->api_key = getenv("BLADE_API_KEY");
    if (o->api_key && !*o->api_key)
        o->api_key = NULL;
    o->warmup = true;
    o->request_rate = INFINITY;
    o->burstiness = 1;
    o->timeout = 600;
}

static void load_usage(FILE *out)
{
    fprintf(out,
            "workload (seeded: the same seed sends the same requests):\n"
            "      --workload W          random | shared-prefix | multi-turn | long-interference | file (required)\n"
            "      --seed N              (default 0)\n"
            "      --input-len A[:B]     prompt tokens, BOS included, drawn uniformly from A..B (random: 256;\n"
            "                            shared-prefix: the unique suffix, 32; multi-turn: each user message, 64;\n"
            "                            long-interference: the short prompts, 32)\n"
            "      --output-len A[:B]    tokens asked for (max_tokens) (random 128, shared-prefix 64, multi-turn 64,\n"
            "                            long-interference 128; file: the recorded answer's length)\n"
            "      --text FILE           cut prompts from this text's tokens (e.g. ../shared/eval/stories-corpus.txt)\n"
            "                            instead of random vocabulary entries\n"
            "      --groups G            shared-prefix: distinct prefixes (default 4); request i uses prefix i mod G\n"
            "      --prompts-per-group P shared-prefix: requests per prefix, G x P in all (default 16)\n"
            "      --prefix-len S        shared-prefix: tokens of each prefix (default 512)\n"
            "      --turns T             multi-turn: turns per conversation (default 4); each turn's prompt is the\n"
            "                            conversation so far (the transcript's answers, the same on every server)\n"
            "                            and is sent once the previous turn is answered\n"
            "      --long-len L          long-interference: tokens of the long prompts (default 1536)\n"
            "      --long-every K        long-interference: one long prompt in every K requests (default 8)\n"
            "      --dataset FILE        file: ShareGPT-style JSON [{\"conversations\": [{\"from\": \"human\", ...},\n"
            "                            {\"from\": \"gpt\", ...}]}]: the human turn is the prompt, the gpt turn's\n"
            "                            length in tokens the output length\n"
            "load:\n"
            "      --num-requests N      requests to measure (default 100; shared-prefix: G x P)\n"
            "      --duration S          or: start requests for S seconds, then let those in flight finish\n"
            "      --request-rate R      sessions per second, Poisson arrivals (default inf: all at once)\n"
            "      --burstiness B        gamma-distributed gaps of shape B instead (1 = Poisson, < 1 burstier)\n"
            "      --max-concurrency C   requests in flight at most (default: no limit)\n"
            "      --timeout S           seconds one request may take (default 600)\n"
            "      --no-warmup           skip the uncounted warm-up request\n"
            "requests:\n"
            "      --prompt-format F     tokens (default: prompts sent as token ids, exact lengths) or text\n"
            "                            (detokenized, for servers that take only strings: lengths approximate)\n"
            "      --ignore-eos          ask the server to generate all max_tokens (blade and vLLM extension)\n"
            "      --api-key KEY         sent as a bearer token (default: $BLADE_API_KEY)\n"
            "report:\n"
            "      --slo ttft=MS,tpot=MS[,e2e=MS]  goodput: requests per second meeting every objective\n"
            "      --price-per-hour P    what the machine costs per hour, for cost per million tokens\n"
            "      --json FILE           every figure, per-request records and the configuration\n");
}

static bool parse_range(const char *flag, const char *s, lg_range *r)
{
    char *end;
    long lo = strtol(s, &end, 10), hi = lo;
    if (end != s && *end == ':') {
        const char *b = end + 1;
        hi = strtol(b, &end, 10);
        if (end == b)
            hi = -1;
    }
    if (end == s || *end || lo < 1 || hi < lo || hi > (1L << 24)) {
        fprintf(stderr, "error: %s expects N or A:B with 1 <= A <= B, got '%s'\n", flag, s);
        return false;
    }
    r->lo = (int32_t)lo;
    r->hi = (int32_t)hi;
    return true;
}

static bool parse_positive_int(const char *flag, const char *s, long long max, int32_t *out)
{
    long long n;
    if (!cli_parse_int(flag, s, 1, max, &n))
        return false;
    *out = (int32_t)n;
    return true;
}

/* 1: handled, 0: not a load option, -1: a bad value (reported). */
static int load_option(load_options *o, int code, const char *arg)
{
    long long n;
    char msg[256];
    switch (code) {
    case OPT_WORKLOAD: {
        int k = lg_workload_from_name(arg);
        if (k < 0) {
            fprintf(stderr, "error: --workload expects random, shared-prefix, multi-turn, long-interference or file, "
                            "got '%s'\n", arg);
            return -1;
        }
        o->wl.kind = (lg_workload_kind)k;
        o->have_workload = true;
        return 1;
    }
    case OPT_SEED:
        if (!cli_parse_int("--seed", arg, 0, INT64_MAX, &n))
            return -1;
        o->wl.seed = (uint64_t)n;
        return 1;
    case OPT_TEXT: o->wl.text_path = arg; return 1;
    case OPT_DATASET: o->wl.dataset_path = arg; return 1;
    case OPT_INPUT_LEN: return parse_range("--input-len", arg, &o->wl.input_len) ? 1 : -1;
    case OPT_OUTPUT_LEN: return parse_range("--output-len", arg, &o->wl.output_len) ? 1 : -1;
    case OPT_GROUPS: return parse_positive_int("--groups", arg, 1 << 20, &o->wl.groups) ? 1 : -1;
    case OPT_PER_GROUP:
        return parse_positive_int("--prompts-per-group", arg, 1 << 20, &o->wl.prompts_per_group) ? 1 : -1;
    case OPT_PREFIX_LEN: return parse_positive_int("--prefix-len", arg, 1 << 24, &o->wl.prefix_len) ? 1 : -1;
    case OPT_TURNS: return parse_positive_int("--turns", arg, 1024, &o->wl.turns) ? 1 : -1;
    case OPT_LONG_LEN: return parse_positive_int("--long-len", arg, 1 << 24, &o->wl.long_len) ? 1 : -1;
    case OPT_LONG_EVERY: return parse_positive_int("--long-every", arg, 1 << 20, &o->wl.long_every) ? 1 : -1;
    case OPT_RATE:
        if (!strcmp(arg, "inf")) {
            o->request_rate = INFINITY;
            return 1;
        }
        return cli_parse_float("--request-rate", arg, 1e-6, 1e9, &o->request_rate) ? 1 : -1;
    case OPT_BURSTINESS: return cli_parse_float("--burstiness", arg, 1e-3, 1e3, &o->burstiness) ? 1 : -1;
    case OPT_CONCURRENCY: return cli_parse_int("--max-concurrency", arg, 1, 1 << 20, &o->max_concurrency) ? 1 : -1;
    case OPT_NUM_REQUESTS:
        if (!cli_parse_int("--num-requests", arg, 1, 1LL << 40, &n))
            return -1;
        o->num_requests = n;
        return 1;
    case OPT_DURATION: return cli_parse_float("--duration", arg, 1e-3, 1e7, &o->duration) ? 1 : -1;
    case OPT_SLO:
        if (lg_slo_parse(arg, &o->slo, msg, sizeof msg)) {
            fprintf(stderr, "error: %s\n", msg);
            return -1;
        }
        return 1;
    case OPT_PRICE: return cli_parse_float("--price-per-hour", arg, 0, 1e9, &o->price_per_hour) ? 1 : -1;
    case OPT_PROMPT_FORMAT:
        if (strcmp(arg, "tokens") && strcmp(arg, "text")) {
            fprintf(stderr, "error: --prompt-format expects tokens or text, got '%s'\n", arg);
            return -1;
        }
        o->prompt_text = !strcmp(arg, "text");
        return 1;
    case OPT_IGNORE_EOS: o->ignore_eos = true; return 1;
    case OPT_TIMEOUT: return cli_parse_float("--timeout", arg, 0, 1e7, &o->timeout) ? 1 : -1;
    case OPT_NO_WARMUP: o->warmup = false; return 1;
    case OPT_JSON: o->json_path = arg; return 1;
    case OPT_API_KEY: o->api_key = arg; return 1;
    default: return 0;
    }
}

static int load_finalize(load_options *o)
{
    if (!o->have_workload) {
        fprintf(stderr, "error: --workload is required (random, shared-prefix, multi-turn, long-interference, file)\n");
        return -1;
    }
    if (o->duration > 0 && isinf(o->request_rate) && !o->max_concurrency) {
        fprintf(stderr, "error: --duration with every request due at once needs --max-concurrency (or a "
                        "--request-rate)\n");
        return -1;
    }
    lg_workload_resolve(&o->wl);
    if (!o->num_requests && !o->duration)
        o->num_requests = lg_workload_default_requests(&o->wl);
    /* Only as many dataset conversations are tokenized as the run can use. */
    o->wl.dataset_limit = o->duration > 0 ? 0 : o->num_requests;
    return 0;
}

/* The options of the command followed by the load options (and, with engine, the engine
 * options), zero-terminated. */
static struct option *merge_options(const struct option *own, size_t n_own, bool engine)
{
    struct option *both = calloc(n_own + N_LOAD_OPTS + 1, sizeof *both);
    if (!both)
        return NULL;
    memcpy(both, own, n_own * sizeof *own);
    memcpy(both + n_own, load_longopts, sizeof load_longopts);
    if (!engine)
        return both;
    struct option *all = cli_merge_longopts(both, n_own + N_LOAD_OPTS);
    free(both);
    return all;
}

/* ---- configuration as JSON ---- */

static json_t *range_json(lg_range r)
{
    return json_pack("[i, i]", r.lo, r.hi);
}

static json_t *path_json(const char *p)
{
    return p ? lg_json_text(p) : json_null();
}

/* What decides the traffic: two results are comparable only when this is equal. */
static json_t *workload_json(const load_options *o)
{
    const lg_workload_config *c = &o->wl;
    json_t *j = json_pack("{s:s, s:I, s:o, s:o, s:o, s:s, s:b}", "name", lg_workload_name(c->kind), "seed",
                          (json_int_t)c->seed, "input_len", range_json(c->input_len), "output_len",
                          range_json(c->output_len), "text", path_json(c->text_path), "prompt_format",
                          o->prompt_text ? "text" : "tokens", "ignore_eos", o->ignore_eos);
    switch (c->kind) {
    case LG_WORKLOAD_SHARED_PREFIX:
        json_object_set_new(j, "groups", json_integer(c->groups));
        json_object_set_new(j, "prompts_per_group", json_integer(c->prompts_per_group));
        json_object_set_new(j, "prefix_len", json_integer(c->prefix_len));
        break;
    case LG_WORKLOAD_MULTI_TURN: json_object_set_new(j, "turns", json_integer(c->turns)); break;
    case LG_WORKLOAD_LONG_INTERFERENCE:
        json_object_set_new(j, "long_len", json_integer(c->long_len));
        json_object_set_new(j, "long_every", json_integer(c->long_every));
        break;
    case LG_WORKLOAD_FILE: json_object_set_new(j, "dataset", path_json(c->dataset_path)); break;
    default: break;
    }
    return j;
}

static json_t *load_json(const load_options *o)
{
    return json_pack("{s:o, s:o, s:o, s:f, s:o, s:b}", "num_requests",
                     o->num_requests ? json_integer(o->num_requests) : json_null(), "duration_s",
                     o->duration > 0 ? json_real(o->duration) : json_null(), "request_rate",
                     isinf(o->request_rate) ? json_string("inf") : json_real(o->request_rate), "burstiness",
                     o->burstiness, "max_concurrency",
                     o->max_concurrency ? json_integer(o->max_concurrency) : json_null(), "warmup", o->warmup);
}

static json_t *slo_json(const lg_slo *s)
{
    if (!lg_slo_any(s))
        return json_null();
    return json_pack("{s:o, s:o, s:o}", "ttft_ms", s->ttft_ms > 0 ? json_real(s->ttft_ms) : json_null(), "tpot_ms",
                     s->tpot_ms > 0 ? json_real(s->tpot_ms) : json_null(), "e2e_ms",
                     s->e2e_ms > 0 ? json_real(s->e2e_ms) : json_null());
}

static json_t *now_json(void)
{
    char buf[32];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return json_string(buf);
}

static int write_json(const char *path, json_t *doc)
{
    if (json_dump_file(doc, path, JSON_INDENT(1)) != 0) {
        fprintf(stderr, "error: cannot write %s\n", path);
        return -1;
    }
    return 0;
}

/* ---- shared run ---- */

typedef struct target {
    const char *url, *model, *tokenizer_path;
    int32_t max_context; /* 0: unknown */
} target;

/* Builds the workload, runs it with a progress bar on a terminal, and summarises. Errors
 * are reported on stderr. */
static int run_load(const load_options *o, const target *t, const blade_tokenizer *tok, lg_run_result *res,
                    lg_summary *sum)
{
    blade_error err = {{0}};
    lg_workload *w = lg_workload_new(&o->wl, tok, t->max_context, &err);
    if (!w) {
        fprintf(stderr, "error: %s\n", err.msg);
        return -1;
    }
    if (o->wl.kind == LG_WORKLOAD_FILE) {
        size_t skipped, used = lg_workload_dataset_size(w, &skipped);
        printf("%s: %zu conversations in use, %zu skipped (malformed, under 4 tokens, or over the context)\n",
               o->wl.dataset_path, used, skipped);
    }
    bool tty = isatty(STDERR_FILENO);
    lg_run_config rc = {
        .url = t->url,
        .model = t->model,
        .api_key = o->api_key,
        .workload = w,
        .tok = tok,
        .prompt_text = o->prompt_text,
        .ignore_eos = o->ignore_eos,
        .num_requests = o->num_requests,
        .duration = o->duration,
        .request_rate = o->request_rate,
        .burstiness = o->burstiness,
        .seed = o->wl.seed,
        .max_concurrency = (int)o->max_concurrency,
        .timeout = o->timeout,
        .warmup = o->warmup,
        .scrape_interval = 0.5,
        .progress = tty ? lg_progress_bar : NULL,
    };
    int rc_run = lg_run(&rc, res, &err);
    if (tty)
        lg_progress_end();
    lg_workload_free(w);
    if (rc_run) {
        fprintf(stderr, "error: %s\n", err.msg);
        return -1;
    }
    if (lg_summarize(res, o->price_per_hour, &o->slo, sum)) {
        fprintf(stderr, "error: out of memory\n");
        lg_run_result_free(res);
        return -1;
    }
    lg_summary_warn_client(stderr, sum);
    return 0;
}

/* The first model GET /v1/models lists: its id and, when the server says (blade and vLLM
 * do), its context length. */
static int query_models(const char *url, const char *api_key, char **id, int32_t *max_context)
{
    long status = 0;
    char *body = NULL;
    blade_error err = {{0}};
    *id = NULL;
    *max_context = 0;
    if (lg_http_get(url, "/v1/models", api_key, 30, &status, &body, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return -1;
    }
    json_t *j = status == 200 ? json_loads(body, 0, NULL) : NULL;
    json_t *m = json_array_get(json_object_get(j, "data"), 0);
    const char *s = json_string_value(json_object_get(m, "id"));
    json_t *len = json_object_get(m, "max_model_len");
    if (json_is_integer(len) && json_integer_value(len) > 0 && json_integer_value(len) <= INT32_MAX)
        *max_context = (int32_t)json_integer_value(len);
    if (s)
        *id = strdup(s);
    json_decref(j);
    if (!*id) {
        fprintf(stderr, "error: GET %s/v1/models answered %ld without a model id%s: %.200s\n", url, status,
                status == 401 ? " (give --api-key)" : "", body);
        free(body);
        return -1;
    }
    free(body);
    return 0;
}

static bool is_file(const char *path)
{
    struct stat st;
    return path && stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, R_OK) == 0;
}

/* ---- blade bench serve ---- */

static void serve_usage(FILE *out)
{
    fprintf(out,
            "usage: blade bench serve --url http://HOST:PORT --workload W [options]\n\n"
            "Measures an OpenAI-compatible endpoint (blade serve, vLLM, llama.cpp's server, ...) under a seeded\n"
            "synthetic workload: streaming POST /v1/completions with max_tokens = the output length, temperature 0\n"
            "and stream_options.include_usage. Prints request and token throughput, mean/median/p90/p99 of TTFT\n"
            "(to the first text chunk), TPOT ((E2E - TTFT) / (output tokens - 1)), ITL (every gap between\n"
            "chunks) and E2E, goodput, failures by cause, and cost per million output and total tokens. Token\n"
            "counts are the server's usage when it reports one, else counted with the tokenizer. When the\n"
            "endpoint is blade, /metrics is sampled every 0.5 s (KV blocks, prefix-cache hits). The client's\n"
            "own CPU time and peak RSS are reported too, with a warning above 10%% of a core: on a machine\n"
            "with few cores, such a client takes CPU time from the server it measures.\n\n"
            "      --url URL             the server's base URL (required)\n"
            "      --model NAME          the model to ask for (default: the first one GET /v1/models lists)\n"
            "      --tokenizer GGUF      the tokenizer prompts are built and tokens counted with (its metadata\n"
            "                            only: the weights are not read). Default: --model, then the id\n"
            "                            /v1/models reports, if either is a GGUF file readable here\n"
            "                            (start blade serve with --alias /path/to/model.gguf, or pass this)\n"
            "      --report FILE.html    a self-contained page with latency distributions, throughput and\n"
            "                            in-flight requests over time, and blade's KV and prefix-cache figures\n"
            "  -h, --help                this help\n");
    load_usage(out);
}

static json_t *result_doc(const lg_run_result *res, const lg_summary *sum, json_t *config)
{
    json_t *doc = json_pack("{s:i, s:o, s:O}", "blade_bench_serve", 1, "date", now_json(), "config", config);
    lg_summary_to_json(sum, doc);
    json_object_set_new(doc, "requests", lg_requests_json(res));
    json_object_set_new(doc, "metrics_samples", lg_samples_json(res));
    return doc;
}

static json_t *serve_config(const load_options *o, const target *t)
{
    return json_pack("{s:s, s:s, s:o, s:o, s:o, s:o, s:o, s:f}", "url", t->url, "model", t->model, "tokenizer",
                     path_json(t->tokenizer_path), "workload", workload_json(o), "load", load_json(o),
                     "price_per_hour", o->price_per_hour > 0 ? json_real(o->price_per_hour) : json_null(), "slo",
                     slo_json(&o->slo), "timeout_s", o->timeout);
}

int cmd_bench_serve(int argc, char **argv)
{
    static const struct option own[] = {
        {"url", required_argument, 0, OPT_URL},
        {"model", required_argument, 0, OPT_MODEL_NAME},
        {"tokenizer", required_argument, 0, OPT_TOKENIZER},
        {"report", required_argument, 0, OPT_REPORT},
        {"help", no_argument, 0, 'h'},
    };
    struct option *longopts = merge_options(own, sizeof own / sizeof own[0], false);
    if (!longopts)
        return 1;
    load_options o;
    load_options_init(&o);
    const char *url = NULL, *model = NULL, *tokenizer = NULL, *report = NULL;
    int c, status = 2;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        int handled = load_option(&o, c, optarg);
        if (handled < 0)
            goto out_opts;
        if (handled)
            continue;
        switch (c) {
        case OPT_URL: url = optarg; break;
        case OPT_MODEL_NAME: model = optarg; break;
        case OPT_TOKENIZER: tokenizer = optarg; break;
        case OPT_REPORT: report = optarg; break;
        case 'h': serve_usage(stdout); status = 0; goto out_opts;
        default: serve_usage(stderr); goto out_opts;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s'\n", argv[optind]);
        goto out_opts;
    }
    if (!url) {
        fprintf(stderr, "error: --url is required (e.g. --url http://127.0.0.1:8080)\n");
        goto out_opts;
    }
    if (load_finalize(&o))
        goto out_opts;

    status = 1;
    cli_raise_fd_limit();
    curl_global_init(CURL_GLOBAL_DEFAULT);
    char *listed = NULL;
    int32_t max_context = 0;
    blade_tokenizer *tok = NULL;
    lg_run_result res = {0};
    json_t *config = NULL;
    if (query_models(url, o.api_key, &listed, &max_context))
        goto out;
    if (!tokenizer)
        tokenizer = is_file(model) ? model : is_file(listed) ? listed : NULL;
    if (!tokenizer) {
        fprintf(stderr, "error: no tokenizer: the server's model '%s' is not a GGUF file readable here; pass "
                        "--tokenizer with the served model's GGUF (or any GGUF with the same vocabulary)\n",
                model ? model : listed);
        goto out;
    }
    blade_error err = {{0}};
    if (!(tok = blade_tokenizer_load_file(tokenizer, &err))) {
        fprintf(stderr, "error: --tokenizer: %s\n", err.msg);
        goto out;
    }
    target t = {.url = url, .model = model ? model : listed, .tokenizer_path = tokenizer, .max_context = max_context};
    printf("blade bench serve: %s workload against %s (model %s), %s\n", lg_workload_name(o.wl.kind), url, t.model,
           o.duration > 0 ? "time-bounded" : "request-bounded");
    fflush(stdout);
    lg_summary sum;
    if (run_load(&o, &t, tok, &res, &sum))
        goto out;
    lg_summary_print(stdout, &sum);
    config = serve_config(&o, &t);
    if (o.json_path) {
        json_t *doc = result_doc(&res, &sum, config);
        int w = write_json(o.json_path, doc);
        json_decref(doc);
        if (w)
            goto out;
        printf("wrote %s\n", o.json_path);
    }
    if (report) {
        char title[512];
        snprintf(title, sizeof title, "blade bench serve: %s workload, %s (%s)", lg_workload_name(o.wl.kind), t.model,
                 url);
        if (lg_write_html(report, title, config, &res, &sum, &err)) {
            fprintf(stderr, "error: %s\n", err.msg);
            goto out;
        }
        printf("wrote %s\n", report);
    }
    status = 0;
out:
    json_decref(config);
    lg_run_result_free(&res);
    blade_tokenizer_free(tok);
    free(listed);
    curl_global_cleanup();
out_opts:
    free(longopts);
    return status;
}

/* ---- blade bench ablation ---- */

/* The techniques in the order the ablation adds them, with the serve flags that turn each
 * off (and on, for one that is not on by default): row k of the table runs with the first k
 * on and the rest off, so adding a technique is one line here. */
static const struct technique {
    const char *name;
    const char *off[3];
    const char *on[3];
} techniques[] = {
    {"continuous batching", {"--scheduler", "static"}, {NULL}},
    {"paged KV", {"--kv-alloc", "contiguous"}, {NULL}},
    {"prefix caching", {"--no-prefix-cache"}, {NULL}},
    {"chunked prefill", {"--no-chunked-prefill"}, {NULL}},
    {"8-bit KV cache (q8_0)", {"--kv-type", "f16"}, {"--kv-type", "q8_0"}},
};
#define N_TECHNIQUES (sizeof techniques / sizeof techniques[0])
#define MAX_PASS 32
#define MAX_SERVER_ARGS (8 + 2 * MAX_PASS + 3 * N_TECHNIQUES + 1)

typedef struct pass_arg {
    char flag[40];
    const char *value; /* NULL for a switch */
} pass_arg;

typedef struct server_proc {
    pid_t pid;
    char url[64];
    char log_path[256];
} server_proc;

static void ablation_usage(FILE *out)
{
    fprintf(out,
            "usage: blade bench ablation -m MODEL --workload W [options] [engine options]\n\n"
            "Reproduces what each serving technique buys. Starts `blade serve` (this binary) on a free loopback\n"
            "port once per configuration, from the naive baseline (static batching, contiguous KV reservation, no\n"
            "prefix cache, no chunked prefill, f16 KV) adding one technique at a time (continuous batching, paged\n"
            "KV, prefix caching, chunked prefill, --kv-type q8_0: everything on), runs the same seeded workload\n"
            "against each, stops it with SIGTERM, and prints one table: throughput, TTFT and TPOT p50/p99, KV\n"
            "slot utilisation (token slots used / allocated, when /metrics exposes blade:kv_utilisation), cost\n"
            "per million tokens, and each row's ratio to the baseline.\n"
            "Requests carry ignore_eos, so every configuration generates the same tokens. Each server's output\n"
            "goes to a temporary log, kept and named if it fails.\n\n"
            "  -m, --model FILE          GGUF model to serve (its tokenizer builds the prompts)\n"
            "  -h, --help                this help\n");
    load_usage(out);
    fprintf(out, "(--json writes every configuration's figures.) Engine options are passed to every server:\n");
    cli_engine_usage(out);
}

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static void print_log_tail(const char *path)
{
    size_t len;
    char *text = cli_read_file(path, &len);
    if (!text)
        return;
    const char *p = text + len;
    for (int lines = 0; p > text && lines < 20; p--)
        if (p[-1] == '\n' && p != text + len)
            lines++;
    fprintf(stderr, "--- last lines of %s ---\n%s\n", path, p);
    free(text);
}

/* The serve command line of configuration k, NULL-terminated; argv points into pass,
 * techniques and port. *flags: where the engine flags start. */
static void server_argv(const char **argv, int *flags, const char *model, const char *port, const pass_arg *pass,
                        int n_pass, size_t k)
{
    int n = 0;
    argv[n++] = "blade";
    argv[n++] = "serve";
    argv[n++] = "-m";
    argv[n++] = model;
    argv[n++] = "--host";
    argv[n++] = "127.0.0.1";
    argv[n++] = "--port";
    argv[n++] = port;
    *flags = n;
    for (int i = 0; i < n_pass; i++) {
        argv[n++] = pass[i].flag;
        if (pass[i].value)
            argv[n++] = pass[i].value;
    }
    for (size_t t = 0; t < N_TECHNIQUES; t++) {
        const char *const *flags = t < k ? techniques[t].on : techniques[t].off;
        for (int j = 0; j < 3 && flags[j]; j++)
            argv[n++] = flags[j];
    }
    argv[n] = NULL;
}

static void print_argv(FILE *out, const char *const *argv)
{
    for (int i = 0; argv[i]; i++)
        fprintf(out, "%s%s", i ? " " : "", argv[i]);
    fprintf(out, "\n");
}

/* The wait status of the stopped server. */
static int server_stop(server_proc *sp)
{
    if (sp->pid <= 0)
        return 0;
    kill(sp->pid, SIGTERM);
    int st = 0;
    pid_t got = 0;
    for (int i = 0; i < 3000 && (got = waitpid(sp->pid, &st, WNOHANG)) == 0; i++)
        usleep(20000);
    if (got == 0) {
        fprintf(stderr, "warning: blade serve (pid %d) did not stop within 60 s of SIGTERM; killing it\n",
                (int)sp->pid);
        kill(sp->pid, SIGKILL);
        waitpid(sp->pid, &st, 0);
    }
    sp->pid = 0;
    return st;
}

/* Starts blade serve on the port argv names and waits until GET /health answers 200. */
static int server_start(server_proc *sp, const char *const *argv, int port)
{
    snprintf(sp->url, sizeof sp->url, "http://127.0.0.1:%d", port);
    const char *tmp = getenv("TMPDIR");
    snprintf(sp->log_path, sizeof sp->log_path, "%s/blade-ablation-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    int log = mkstemp(sp->log_path);
    if (log < 0) {
        fprintf(stderr, "error: cannot create a server log in %s\n", tmp && *tmp ? tmp : "/tmp");
        return -1;
    }
    printf("  $ ");
    print_argv(stdout, argv);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        /* A server must not outlive an interrupted ablation. */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        dup2(log, STDOUT_FILENO);
        dup2(log, STDERR_FILENO);
        close(log);
        execv("/proc/self/exe", (char *const *)argv);
        _exit(127);
    }
    close(log);
    if (pid < 0) {
        fprintf(stderr, "error: cannot start blade serve\n");
        return -1;
    }
    sp->pid = pid;
    double deadline = cli_now() + 600;
    while (cli_now() < deadline) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            sp->pid = 0;
            fprintf(stderr, "error: blade serve exited before it was ready\n");
            print_log_tail(sp->log_path);
            return -1;
        }
        long status = 0;
        char *body = NULL;
        if (lg_http_get(sp->url, "/health", NULL, 2, &status, &body, NULL) == 0 && status == 200) {
            free(body);
            return 0;
        }
        free(body);
        usleep(100000);
    }
    fprintf(stderr, "error: blade serve was not ready after 600 s\n");
    server_stop(sp);
    print_log_tail(sp->log_path);
    return -1;
}

typedef struct ablation_row {
    char name[64];
    lg_summary sum;
    json_t *flags;
} ablation_row;

static void ratio_cell(char *buf, size_t cap, double v)
{
    if (isnan(v))
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "x%.2f", v);
}

static void print_ablation_table(FILE *out, const ablation_row *rows, size_t n, bool priced)
{
    fprintf(out, "\n%-24s %8s %10s %9s %9s %9s %9s %8s %10s %8s %8s %7s\n", "configuration", "req/s", "out tok/s",
            "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "KV util", priced ? "$/1M tok" : "h/1M tok",
            "tok/s", "cost", "failed");
    fprintf(out, "%-24s %8s %10s %9s %9s %9s %9s %8s %10s %8s %8s %7s\n", "", "", "", "(ms)", "(ms)", "(ms)", "(ms)",
            "", "(total)", "vs base", "vs base", "");
    const lg_summary *b = &rows[0].sum;
    double base_cost = priced ? b->cost_total : b->hours_total;
    for (size_t i = 0; i < n; i++) {
        const lg_summary *s = &rows[i].sum;
        char util[16] = "-", tok[16], cost[16];
        if (!isnan(s->kv_utilisation))
            snprintf(util, sizeof util, "%.1f%%", s->kv_utilisation * 100);
        double c = priced ? s->cost_total : s->hours_total;
        ratio_cell(tok, sizeof tok, s->total_throughput / b->total_throughput);
        ratio_cell(cost, sizeof cost, c / base_cost);
        fprintf(out, "%-24s %8.2f %10.1f %9.1f %9.1f %9.2f %9.2f %8s %10.4f %8s %8s %7zu\n", rows[i].name,
                s->request_throughput, s->output_throughput, s->ttft.median, s->ttft.p99, s->tpot.median, s->tpot.p99,
                util, c, tok, cost, s->failed);
    }
    if (!priced)
        fprintf(out, "(cost in instance-hours per million tokens; --price-per-hour P prices it)\n");
}

int cmd_bench_ablation(int argc, char **argv)
{
    static const struct option own[] = {
        {"model", required_argument, 0, 'm'},
        {"help", no_argument, 0, 'h'},
    };
    struct option *longopts = merge_options(own, sizeof own / sizeof own[0], true);
    if (!longopts)
        return 1;
    load_options o;
    load_options_init(&o);
    o.ignore_eos = true;
    cli_engine_options scratch;
    cli_engine_options_init(&scratch);
    pass_arg pass[MAX_PASS];
    int n_pass = 0;
    const char *model = NULL;
    int c, status = 2;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:t:c:h", longopts, NULL)) != -1) {
        int code = c == 't' ? OPT_THREADS : c == 'c' ? OPT_CTX_SIZE : c; /* the long name is passed on to serve */
        int handled = load_option(&o, code, optarg);
        if (handled < 0)
            goto out_opts;
        if (handled)
            continue;
        const struct option *eo = NULL;
        for (size_t i = 0; i < cli_engine_longopts_count; i++)
            if (cli_engine_longopts[i].val == code)
                eo = &cli_engine_longopts[i];
        if (eo) {
            for (size_t t = 0; t < N_TECHNIQUES; t++)
                if (!strcmp(techniques[t].off[0] + 2, eo->name)) {
                    fprintf(stderr, "error: --%s is what the ablation varies; it cannot be given\n", eo->name);
                    goto out_opts;
                }
            if (cli_engine_option(&scratch, code, optarg) < 0)
                goto out_opts;
            if (n_pass == MAX_PASS) {
                fprintf(stderr, "error: more than %d engine options\n", MAX_PASS);
                goto out_opts;
            }
            snprintf(pass[n_pass].flag, sizeof pass[n_pass].flag, "--%s", eo->name);
            pass[n_pass++].value = eo->has_arg ? optarg : NULL;
            continue;
        }
        switch (c) {
        case 'm': model = optarg; break;
        case 'h': ablation_usage(stdout); status = 0; goto out_opts;
        default: ablation_usage(stderr); goto out_opts;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s'\n", argv[optind]);
        goto out_opts;
    }
    if (!model && !(model = cli_default_model())) {
        fprintf(stderr, "error: no model given (-m FILE)\n");
        goto out_opts;
    }
    if (load_finalize(&o))
        goto out_opts;

    status = 1;
    cli_raise_fd_limit();
    curl_global_init(CURL_GLOBAL_DEFAULT);
    blade_tokenizer *tok = NULL;
    ablation_row rows[N_TECHNIQUES + 1];
    size_t n_rows = 0;
    char *listed = NULL;
    server_proc sp = {0};
    blade_error err = {{0}};
    if (!(tok = blade_tokenizer_load_file(model, &err))) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto out;
    }
    const char *server_args[MAX_SERVER_ARGS];
    int32_t max_context = 0;
    for (size_t k = 0; k <= N_TECHNIQUES; k++) {
        ablation_row *row = &rows[k];
        if (k == 0)
            snprintf(row->name, sizeof row->name, "baseline");
        else
            snprintf(row->name, sizeof row->name, "+ %s", techniques[k - 1].name);
        int port = free_port(), first_flag;
        if (port < 0) {
            fprintf(stderr, "error: no free loopback port\n");
            goto out;
        }
        char port_text[16];
        snprintf(port_text, sizeof port_text, "%d", port);
        server_argv(server_args, &first_flag, model, port_text, pass, n_pass, k);
        printf("[%zu/%zu] %s\n", k + 1, N_TECHNIQUES + 1, row->name);
        fflush(stdout);
        if (server_start(&sp, server_args, port))
            goto out;
        if (k == 0 && query_models(sp.url, o.api_key, &listed, &max_context)) {
            server_stop(&sp);
            goto out;
        }
        target t = {.url = sp.url, .model = listed, .tokenizer_path = model, .max_context = max_context};
        lg_run_result res;
        int rc = run_load(&o, &t, tok, &res, &row->sum);
        int st = server_stop(&sp);
        if (rc) {
            print_log_tail(sp.log_path);
            goto out;
        }
        lg_run_result_free(&res);
        if (WIFSIGNALED(st))
            fprintf(stderr, "warning: blade serve died of signal %d (%s) (log kept: %s)\n", WTERMSIG(st),
                    strsignal(WTERMSIG(st)), sp.log_path);
        else if (WEXITSTATUS(st) != 0)
            fprintf(stderr, "warning: blade serve exited with status %d (log kept: %s)\n", WEXITSTATUS(st),
                    sp.log_path);
        else
            unlink(sp.log_path);
        row->flags = json_array();
        for (int i = first_flag; server_args[i]; i++)
            json_array_append_new(row->flags, json_string(server_args[i]));
        n_rows++;
        printf("  %.2f requests/s, %.1f output tokens/s, TTFT p50 %.1f ms, TPOT p50 %.2f ms, %zu failed; client CPU "
               "%.1f%% of a core\n",
               row->sum.request_throughput, row->sum.output_throughput, row->sum.ttft.median, row->sum.tpot.median,
               row->sum.failed, row->sum.client_cpu_share * 100);
        fflush(stdout);
    }
    print_ablation_table(stdout, rows, n_rows, o.price_per_hour > 0);
    if (o.json_path) {
        json_t *rows_json = json_array();
        for (size_t i = 0; i < n_rows; i++) {
            json_t *r = json_pack("{s:s, s:O}", "name", rows[i].name, "serve_flags", rows[i].flags);
            lg_summary_to_json(&rows[i].sum, r);
            json_array_append_new(rows_json, r);
        }
        json_t *doc = json_pack("{s:i, s:o, s:o, s:{s:o, s:o, s:o}, s:o}", "blade_bench_ablation", 1, "date",
                                now_json(), "model", lg_json_text(model), "config", "workload", workload_json(&o),
                                "load", load_json(&o), "price_per_hour",
                                o.price_per_hour > 0 ? json_real(o.price_per_hour) : json_null(), "rows", rows_json);
        int w = write_json(o.json_path, doc);
        json_decref(doc);
        if (w)
            goto out;
        printf("wrote %s\n", o.json_path);
    }
    status = 0;
out:
    for (size_t i = 0; i < n_rows; i++)
        json_decref(rows[i].flags);
    blade_tokenizer_free(tok);
    free(listed);
    curl_global_cleanup();
out_opts:
    free(longopts);
    return status;
}

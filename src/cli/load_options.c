/* The load the benchmark clients send, its flags and its JSON record (load_options.h). */

#include "cli/load_options.h"

#include "loadgen/html.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void cli_load_options_init(cli_load_options *o)
{
    memset(o, 0, sizeof *o);
    o->warmup = true;
    o->request_rate = INFINITY;
    o->burstiness = 1;
    o->timeout = 600;
    o->wl.exact_share = o->wl.reword_share = o->wl.near_miss_share = -1;
}

/* "N" or "A:B" with 1 <= A <= B. */
static bool parse_range(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    char *end;
    long lo = strtol(value, &end, 10), hi = lo;
    if (end != value && *end == ':') {
        const char *b = end + 1;
        hi = strtol(b, &end, 10);
        if (end == b)
            hi = -1;
    }
    if (end == value || *end || lo < 1 || hi < lo || hi > (1L << 24)) {
        snprintf(why, cap, "--%s expects N or A:B with 1 <= A <= B <= %ld, got '%s'", f->name, 1L << 24, value);
        return false;
    }
    *(lg_range *)dest = (lg_range){(int32_t)lo, (int32_t)hi};
    return true;
}

static bool parse_slo(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    (void)f;
    return lg_slo_parse(value, dest, why, cap) == 0;
}

static bool workload_choice(int i, cli_choice *out)
{
    if (i < 0 || i >= LG_WORKLOAD_COUNT)
        return false;
    *out = (cli_choice){lg_workload_name((lg_workload_kind)i), i};
    return true;
}

static const cli_choice prompt_formats[] = {{"tokens", false}, {"text", true}, {0}};

#define L cli_load_options
const cli_flag cli_load_flags[] = {
    CLI_SECTION("workload (seeded: the same seed sends the same requests)"),
    {.name = "workload", .letter = 'w', .kind = CLI_ENUM, CLI_AT(L, wl.kind), .choice_at = workload_choice,
     .metavar = "W", .required = true, .help = "the kind of traffic"},
    {.name = "seed", .kind = CLI_INT, CLI_AT(L, wl.seed), .min = 0, .max = CLI_INT64_MAX, .metavar = "N",
     .help = "workload seed"},
    {.name = "input-len", .kind = CLI_CUSTOM, CLI_AT(L, wl.input_len), .parse = parse_range, .metavar = "A[:B]",
     .dflt = "",
     .help = "prompt tokens, BOS included, drawn uniformly from A..B (random: 256; shared-prefix: the unique "
             "suffix, 32; multi-turn: each user message, 64; long-interference: the short prompts, 32)"},
    {.name = "output-len", .kind = CLI_CUSTOM, CLI_AT(L, wl.output_len), .parse = parse_range, .metavar = "A[:B]",
     .dflt = "",
     .help = "tokens asked for, as max_tokens (random 128, shared-prefix 64, multi-turn 64, long-interference "
             "128; file: the recorded answer's length)"},
    {.name = "text", .kind = CLI_PATH, CLI_AT(L, wl.text_path), .metavar = "FILE",
     .help = "cut prompts from this text's tokens (e.g. ../shared/eval/stories-corpus.txt) instead of random "
             "vocabulary entries"},
    {.name = "groups", .kind = CLI_INT, CLI_AT(L, wl.groups), .min = 1, .max = 1 << 20, .metavar = "G",
     .dflt = "4", .help = "shared-prefix: distinct prefixes; request i uses prefix i mod G"},
    {.name = "prompts-per-group", .kind = CLI_INT, CLI_AT(L, wl.prompts_per_group), .min = 1, .max = 1 << 20,
     .metavar = "P", .dflt = "16", .help = "shared-prefix: requests per prefix, G x P in all"},
    {.name = "prefix-len", .kind = CLI_INT, CLI_AT(L, wl.prefix_len), .min = 1, .max = 1 << 24, .metavar = "S",
     .dflt = "512", .help = "shared-prefix: tokens of each prefix"},
    {.name = "turns", .kind = CLI_INT, CLI_AT(L, wl.turns), .min = 1, .max = 1024, .metavar = "T", .dflt = "4",
     .help = "multi-turn: turns per conversation; each turn's prompt is the conversation so far (the "
             "transcript's answers, the same on every server) and is sent once the previous turn is answered"},
    {.name = "long-len", .kind = CLI_INT, CLI_AT(L, wl.long_len), .min = 1, .max = 1 << 24, .metavar = "L",
     .dflt = "1536", .help = "long-interference: tokens of the long prompts"},
    {.name = "long-every", .kind = CLI_INT, CLI_AT(L, wl.long_every), .min = 1, .max = 1 << 20, .metavar = "K",
     .dflt = "8", .help = "long-interference: one long prompt in every K requests"},
    {.name = "dataset", .kind = CLI_PATH, CLI_AT(L, wl.dataset_path), .metavar = "FILE",
     .help = "file: ShareGPT-style JSON [{\"conversations\": [{\"from\": \"human\", ...}, {\"from\": \"gpt\", "
             "...}]}]: the human turn is the prompt, the gpt turn's length in tokens the output length"},
    {.name = "pool", .kind = CLI_INT, CLI_AT(L, wl.pool), .min = 1, .max = 1 << 20, .metavar = "N", .dflt = "50",
     .help = "semantic: base prompts, asked first; the requests after them repeat one exactly, reword one (a "
             "swap of neighbouring words, casing, punctuation), nearly miss one (one word replaced: alike, "
             "asking something else) or are fresh. Prompts are --input-len words (default 12:20) of --text or "
             "the vocabulary; requests opt in with \"semantic_cache\": true, and the report counts cache hits "
             "(X-Blade-Semantic-Cache) per kind: a hit on a base, near-miss or fresh prompt is a false hit"},
    {.name = "exact-share", .kind = CLI_DOUBLE, CLI_AT(L, wl.exact_share), .min = 0, .max = 1, .metavar = "X",
     .dflt = "0.3", .help = "semantic: share of the requests after the pool that repeat a base prompt"},
    {.name = "reword-share", .kind = CLI_DOUBLE, CLI_AT(L, wl.reword_share), .min = 0, .max = 1, .metavar = "X",
     .dflt = "0.3", .help = "semantic: share that reword one"},
    {.name = "near-miss-share", .kind = CLI_DOUBLE, CLI_AT(L, wl.near_miss_share), .min = 0, .max = 1,
     .metavar = "X", .dflt = "0.2", .help = "semantic: share that nearly miss one (fresh: the rest)"},
    CLI_SECTION("load"),
    {.name = "num-requests", .kind = CLI_INT, CLI_AT(L, num_requests), .min = 1, .max = 0x1p40, .metavar = "N",
     .dflt = "100; shared-prefix: G x P; semantic: pool + 200", .help = "requests to measure"},
    {.name = "duration", .kind = CLI_DOUBLE, CLI_AT(L, duration), .min = 1e-3, .max = 1e7, .metavar = "S",
     .dflt = "", .help = "or: start requests for S seconds, then let those in flight finish"},
    {.name = "request-rate", .kind = CLI_DOUBLE, CLI_AT(L, request_rate), .min = 1e-6, .max = INFINITY,
     .metavar = "R", .help = "sessions per second, Poisson arrivals; inf: all at once"},
    {.name = "burstiness", .kind = CLI_DOUBLE, CLI_AT(L, burstiness), .min = 1e-3, .max = 1e3, .metavar = "B",
     .help = "gamma-distributed gaps of shape B instead (1 = Poisson, < 1 burstier)"},
    {.name = "max-concurrency", .kind = CLI_INT, CLI_AT(L, max_concurrency), .min = 1, .max = 1 << 20,
     .metavar = "C", .dflt = "no limit", .help = "requests in flight at most"},
    {.name = "timeout", .kind = CLI_DOUBLE, CLI_AT(L, timeout), .min = 0, .max = 1e7, .metavar = "S",
     .help = "seconds one request may take"},
    {.name = "no-warmup", .kind = CLI_BOOL, .negate = true, CLI_AT(L, warmup),
     .help = "skip the uncounted warm-up request"},
    CLI_SECTION("requests"),
    {.name = "prompt-format", .kind = CLI_ENUM, CLI_AT(L, prompt_text), .choices = prompt_formats,
     .help = "tokens: prompts sent as token ids, exact lengths; text: detokenized, for servers that take only "
             "strings (lengths approximate)"},
    {.name = "ignore-eos", .kind = CLI_BOOL, CLI_AT(L, ignore_eos),
     .help = "ask the server to generate all max_tokens (blade and vLLM extension)"},
    {.name = "api-key", .kind = CLI_STRING, CLI_AT(L, api_key), .metavar = "KEY", .dflt = "$BLADE_API_KEY",
     .help = "sent as a bearer token"},
    CLI_SECTION("report"),
    {.name = "slo", .kind = CLI_CUSTOM, CLI_AT(L, slo), .parse = parse_slo, .metavar = "ttft=MS,tpot=MS[,e2e=MS]",
     .help = "goodput: requests per second meeting every objective"},
    {.name = "price-per-hour", .kind = CLI_DOUBLE, CLI_AT(L, price_per_hour), .min = 0, .max = 1e9, .metavar = "P",
     .dflt = "", .help = "what the machine costs per hour, for cost per million tokens"},
    {.name = "json", .kind = CLI_PATH, CLI_AT(L, json_path), .metavar = "FILE",
     .help = "every figure, per-request records and the configuration"},
    {0},
};
#undef L

int cli_load_finalize(cli_load_options *o, const cli_command *cmd)
{
    if (o->duration > 0 && isinf(o->request_rate) && !o->max_concurrency) {
        cli_usage_error(cmd, "--duration with every request due at once needs --max-concurrency (or a "
                             "--request-rate)");
        return -1;
    }
    if (!o->api_key && (o->api_key = getenv("BLADE_API_KEY")) && !*o->api_key)
        o->api_key = NULL;
    lg_workload_resolve(&o->wl);
    if (!o->num_requests && !o->duration)
        o->num_requests = lg_workload_default_requests(&o->wl);
    /* Only as many dataset conversations are tokenized as the run can use. */
    o->wl.dataset_limit = o->duration > 0 ? 0 : o->num_requests;
    return 0;
}

/* ---- the record ---- */

static json_t *range_json(lg_range r)
{
    return json_pack("[i, i]", r.lo, r.hi);
}

json_t *cli_json_path(const char *p)
{
    return p ? lg_json_text(p) : json_null();
}

/* What decides the traffic: two results are comparable only when this is equal. */
json_t *cli_load_workload_json(const cli_load_options *o)
{
    const lg_workload_config *c = &o->wl;
    json_t *j = json_pack("{s:s, s:I, s:o, s:o, s:o, s:s, s:b}", "name", lg_workload_name(c->kind), "seed",
                          (json_int_t)c->seed, "input_len", range_json(c->input_len), "output_len",
                          range_json(c->output_len), "text", cli_json_path(c->text_path), "prompt_format",
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
    case LG_WORKLOAD_FILE: json_object_set_new(j, "dataset", cli_json_path(c->dataset_path)); break;
    case LG_WORKLOAD_SEMANTIC:
        json_object_set_new(j, "pool", json_integer(c->pool));
        json_object_set_new(j, "exact_share", json_real(c->exact_share));
        json_object_set_new(j, "reword_share", json_real(c->reword_share));
        json_object_set_new(j, "near_miss_share", json_real(c->near_miss_share));
        break;
    default: break;
    }
    return j;
}

json_t *cli_load_json(const cli_load_options *o)
{
    return json_pack("{s:o, s:o, s:o, s:f, s:o, s:b}", "num_requests",
                     o->num_requests ? json_integer(o->num_requests) : json_null(), "duration_s",
                     o->duration > 0 ? json_real(o->duration) : json_null(), "request_rate",
                     isinf(o->request_rate) ? json_string("inf") : json_real(o->request_rate), "burstiness",
                     o->burstiness, "max_concurrency",
                     o->max_concurrency ? json_integer(o->max_concurrency) : json_null(), "warmup", o->warmup);
}

json_t *cli_load_slo_json(const lg_slo *s)
{
    if (!lg_slo_any(s))
        return json_null();
    return json_pack("{s:o, s:o, s:o}", "ttft_ms", s->ttft_ms > 0 ? json_real(s->ttft_ms) : json_null(), "tpot_ms",
                     s->tpot_ms > 0 ? json_real(s->tpot_ms) : json_null(), "e2e_ms",
                     s->e2e_ms > 0 ? json_real(s->e2e_ms) : json_null());
}


/* `blade bench serve`: measures an OpenAI-compatible endpoint under a seeded workload. */

#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/load_options.h"
#include "cli/load_run.h"
#include "loadgen/cache_report.h"
#include "loadgen/html.h"

#include <curl/curl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct bench_serve_options {
    const char *url, *model, *tokenizer, *report;
    cli_load_options load;
} bench_serve_options;

static void bench_serve_init(void *opts)
{
    bench_serve_options *o = opts;
    cli_load_options_init(&o->load);
}

#define O bench_serve_options
static const cli_flag bench_serve_flags[] = {
    {.name = "url", .kind = CLI_STRING, CLI_AT(O, url), .metavar = "URL", .required = true,
     .help = "the server's base URL, e.g. http://127.0.0.1:8080"},
    {.name = "model", .kind = CLI_STRING, CLI_AT(O, model), .metavar = "NAME",
     .dflt = "the first one GET /v1/models lists", .help = "the model to ask for"},
    {.name = "tokenizer", .kind = CLI_PATH, CLI_AT(O, tokenizer), .metavar = "GGUF", .dflt = "",
     .help = "the tokenizer prompts are built and tokens counted with; only its metadata is read, not the "
             "weights. Without it: --model, then the id /v1/models reports, when either is a GGUF file readable "
             "here (start blade serve with --alias /path/to/model.gguf)"},
    {.name = "report", .kind = CLI_PATH, CLI_AT(O, report), .metavar = "FILE.html",
     .help = "a self-contained page with latency distributions, throughput and in-flight requests over time, "
             "and blade's KV and prefix-cache figures"},
    {0},
};
#undef O

static int bench_serve_main(int argc, char **argv);

const cli_command cli_cmd_bench_serve = {
    .name = "bench serve",
    .summary = "measure an OpenAI-compatible endpoint under a seeded workload",
    .synopsis = "--url http://HOST:PORT --workload W [options]",
    .about =
        "Measures an OpenAI-compatible endpoint (blade serve, vLLM, llama.cpp's server, ...) under a\n"
        "seeded synthetic workload: streaming POST /v1/completions with max_tokens = the output length,\n"
        "temperature 0 and stream_options.include_usage. Prints request and token throughput,\n"
        "mean/median/p90/p99 of TTFT (to the first text chunk), TPOT ((E2E - TTFT) / (output tokens - 1)),\n"
        "ITL (every gap between chunks) and E2E, goodput, failures by cause, and cost per million output\n"
        "and total tokens. Token counts are the server's usage when it reports one, else counted with the\n"
        "tokenizer. When the endpoint is blade, /metrics is sampled every 0.5 s (KV blocks, prefix-cache\n"
        "hits). The client's own CPU time and peak RSS are reported too, with a warning above 10% of a\n"
        "core: on a machine with few cores, such a client takes CPU time from the server it measures.\n",
    .tables = (const cli_table[]){{bench_serve_flags, 0}, {cli_load_flags, offsetof(bench_serve_options, load)}, {0}},
    .opts_size = sizeof(bench_serve_options),
    .init = bench_serve_init,
    .main = bench_serve_main,
};

static bool is_file(const char *path)
{
    struct stat st;
    return path && stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, R_OK) == 0;
}

static json_t *result_doc(const lg_run_result *res, const lg_summary *sum, json_t *config)
{
    json_t *doc = json_pack("{s:i, s:o, s:O}", "blade_bench_serve", 1, "date", cli_json_now(), "config", config);
    lg_summary_to_json(sum, doc);
    json_object_set_new(doc, "requests", lg_requests_json(res));
    json_object_set_new(doc, "metrics_samples", lg_samples_json(res));
    return doc;
}

static json_t *serve_config(const cli_load_options *o, const cli_load_target *t)
{
    return json_pack("{s:s, s:s, s:o, s:o, s:o, s:o, s:o, s:f}", "url", t->url, "model", t->model, "tokenizer",
                     cli_json_path(t->tokenizer_path), "workload", cli_load_workload_json(o), "load", cli_load_json(o),
                     "price_per_hour", o->price_per_hour > 0 ? json_real(o->price_per_hour) : json_null(), "slo",
                     cli_load_slo_json(&o->slo), "timeout_s", o->timeout);
}

static int bench_serve_main(int argc, char **argv)
{
    bench_serve_options opts;
    int status = cli_parse(&cli_cmd_bench_serve, argc, argv, &opts);
    if (status != CLI_RUN)
        return status;
    cli_load_options o = opts.load;
    const char *url = opts.url, *model = opts.model, *tokenizer = opts.tokenizer, *report = opts.report;
    if (cli_load_finalize(&o, &cli_cmd_bench_serve))
        return 2;

    status = 1;
    cli_raise_fd_limit();
    curl_global_init(CURL_GLOBAL_DEFAULT);
    char *listed = NULL;
    int32_t max_context = 0;
    blade_tokenizer *tok = NULL;
    lg_run_result res = {0};
    json_t *config = NULL;
    if (cli_load_query_models(url, o.api_key, &listed, &max_context))
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
    cli_load_target t = {.url = url, .model = model ? model : listed, .tokenizer_path = tokenizer,
                         .max_context = max_context};
    printf("blade bench serve: %s workload against %s (model %s), %s\n", lg_workload_name(o.wl.kind), url, t.model,
           o.duration > 0 ? "time-bounded" : "request-bounded");
    fflush(stdout);
    lg_summary sum;
    if (cli_load_run(&o, &t, tok, &res, &sum))
        goto out;
    lg_summary_print(stdout, &sum);
    lg_cache_report cache;
    lg_cache_report_make(&res, &cache);
    if (o.wl.kind == LG_WORKLOAD_SEMANTIC)
        lg_cache_report_print(stdout, &cache);
    config = serve_config(&o, &t);
    if (o.json_path) {
        json_t *doc = result_doc(&res, &sum, config);
        if (o.wl.kind == LG_WORKLOAD_SEMANTIC)
            json_object_set_new(doc, "semantic_cache", lg_cache_report_json(&cache));
        int w = cli_json_write(o.json_path, doc);
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
    return status;
}

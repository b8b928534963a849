/* Sending a load to an OpenAI-compatible server and recording the result (load_run.h). */

#include "cli/load_run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

json_t *cli_json_now(void)
{
    char buf[32];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return json_string(buf);
}

int cli_json_write(const char *path, json_t *doc)
{
    if (json_dump_file(doc, path, JSON_INDENT(1)) != 0) {
        fprintf(stderr, "error: cannot write %s\n", path);
        return -1;
    }
    return 0;
}

int cli_load_run(const cli_load_options *o, const cli_load_target *t, const blade_tokenizer *tok, lg_run_result *res,
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
        .semantic_cache = o->wl.kind == LG_WORKLOAD_SEMANTIC,
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

int cli_load_query_models(const char *url, const char *api_key, char **id, int32_t *max_context)
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

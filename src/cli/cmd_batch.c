/* `blade batch`: runs an OpenAI Batch API file through the engine, offline. */

#include "api/api.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"
#include "common/file.h"
#include "common/output_file.h"

#include <errno.h>
#include <openssl/rand.h>
#include <poll.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

/* A line longer than this is refused without parsing, as `blade serve` refuses such a body. */
#define MAX_LINE_BYTES (8u << 20)

typedef struct batch_options {
    const char *model_path, *in_path, *out_path, *alias, *template_file;
    long long max_inflight;
    cli_engine_options engine;
} batch_options;

static void batch_init(void *opts)
{
    batch_options *o = opts;
    o->max_inflight = 256;
    cli_engine_options_init(&o->engine);
}

#define B batch_options
static const cli_flag batch_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(B, model_path), .metavar = "FILE",
     .dflt = "../shared/models/stories260K.gguf if present", .help = "GGUF model"},
    {.name = "input", .letter = 'i', .kind = CLI_PATH, CLI_AT(B, in_path), .metavar = "FILE", .required = true,
     .help = "requests (JSONL, a regular file)"},
    {.name = "output", .letter = 'o', .kind = CLI_PATH, CLI_AT(B, out_path), .metavar = "FILE", .required = true,
     .help = "results (JSONL), replaced when the run completes"},
    {.name = "alias", .kind = CLI_STRING, CLI_AT(B, alias), .metavar = "NAME",
     .help = "model name to accept in bodies (also accepted: the file's name)"},
    {.name = "chat-template", .kind = CLI_PATH, CLI_AT(B, template_file), .metavar = "FILE",
     .dflt = "the model's tokenizer.chat_template", .help = "Jinja chat template"},
    {.name = "max-inflight", .kind = CLI_INT, CLI_AT(B, max_inflight), .min = 1, .max = 1 << 16, .metavar = "N",
     .help = "lines running at once, bounding memory"},
    {0},
};
#undef B

static int batch_main(int argc, char **argv);

const cli_command cli_cmd_batch = {
    .name = "batch",
    .summary = "run an OpenAI Batch API JSONL file through the engine",
    .synopsis = "-m MODEL -i REQUESTS.jsonl -o RESULTS.jsonl [options]",
    .about =
        "Runs an OpenAI Batch API file through the engine in the batch traffic class. Each input line is\n"
        "  {\"custom_id\": ID, \"method\": \"POST\", \"url\": \"/v1/completions\", \"/v1/chat/completions\" or\n"
        "   \"/v1/embeddings\", \"body\": {...}}\n"
        "and gives one output line, in the order requests finish (match them by custom_id):\n"
        "  {\"id\", \"custom_id\", \"response\": {\"status_code\", \"request_id\", \"body\"}, \"error\": null}\n"
        "A body the API refuses gets its status code and OpenAI error object as the response; a line that\n"
        "is not a request at all (invalid JSON, no custom_id, unknown url, no body, over 8 MiB) gets\n"
        "\"response\": null and \"error\": {\"code\", \"message\"}. Neither stops the run. Requests run\n"
        "concurrently (continuous batching across lines); a summary goes to stderr, and a progress bar\n"
        "too when stderr is a terminal.\n\n"
        "A file in which two lines share a custom_id is refused before anything runs (exit status 1,\n"
        "naming the id and both lines), as OpenAI's Batch API refuses it: results are matched by custom_id.\n"
        "The results are written to a temporary file beside FILE and renamed onto it only when the run\n"
        "completes, so a failed or interrupted run leaves an existing FILE as it was. An output that is\n"
        "the same file as an input (the requests, model, template or pin-prefix file, also through a\n"
        "hard link or symlink) is refused (exit status 2). A FIFO or /dev/stdout is written in place.\n",
    .tables = (const cli_table[]){{batch_flags, 0}, {cli_engine_flags, offsetof(batch_options, engine)}, {0}},
    .opts_size = sizeof(batch_options),
    .init = batch_init,
    .main = batch_main,
};

typedef struct batch_item {
    json_t *custom_id;
    long line;
} batch_item;

typedef struct batch_run {
    FILE *out;
    api_model *am;
    api_sink sink;
    long lines_total; /* -1: unknown */
    long lines_read, inflight, ok, failed;
    int64_t prompt_tokens, completion_tokens;
    double t_start, t_progress;
    bool tty;
    bool write_failed;
} batch_run;

static void write_line(batch_run *b, json_t *line)
{
    if (json_dumpf(line, b->out, JSON_COMPACT) || fputc('\n', b->out) == EOF)
        b->write_failed = true;
    json_decref(line);
}

static json_t *custom_id_value(const batch_item *it)
{
    return it->custom_id ? json_incref(it->custom_id) : json_null();
}

static void random_id(char *out, size_t cap)
{
    unsigned char r[12] = {0};
    RAND_bytes(r, sizeof r);
    size_t n = (size_t)snprintf(out, cap, "batch_req_");
    for (size_t i = 0; i < sizeof r && n + 2 < cap; i++)
        n += (size_t)snprintf(out + n, cap - n, "%02x", r[i]);
}

/* A line that is not a request. */
static void line_error(batch_run *b, const batch_item *it, const char *code, const char *fmt, ...)
    BLADE_PRINTF(4, 5);
static void line_error(batch_run *b, const batch_item *it, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char id[48];
    random_id(id, sizeof id);
    json_t *err = json_object();
    json_object_set_new(err, "code", json_string(code));
    json_t *m = json_string(msg);
    json_object_set_new(err, "message", m ? m : json_string("(the message held invalid UTF-8)"));
    json_t *line = json_object();
    json_object_set_new(line, "id", json_string(id));
    json_object_set_new(line, "custom_id", custom_id_value(it));
    json_object_set_new(line, "response", json_null());
    json_object_set_new(line, "error", err);
    write_line(b, line);
    b->failed++;
}

/* A request the API answered (successfully or with an HTTP error). */
static void line_response(batch_run *b, const batch_item *it, int status, const char *request_id, json_t *body)
{
    char id[48];
    random_id(id, sizeof id);
    json_t *resp = json_object();
    json_object_set_new(resp, "status_code", json_integer(status));
    json_object_set_new(resp, "request_id", request_id ? json_string(request_id) : json_null());
    json_object_set_new(resp, "body", body);
    json_t *line = json_object();
    json_object_set_new(line, "id", json_string(id));
    json_object_set_new(line, "custom_id", custom_id_value(it));
    json_object_set_new(line, "response", resp);
    json_object_set_new(line, "error", json_null());
    write_line(b, line);
    if (status == 200)
        b->ok++;
    else
        b->failed++;
}

static void item_free(batch_item *it)
{
    json_decref(it->custom_id);
    free(it);
}

/* Validates one input line and submits it; lines that cannot run are answered at once. */
static void start_line(batch_run *b, const char *text, size_t len)
{
    batch_item *it = calloc(1, sizeof *it);
    if (!it) {
        batch_item none = {.line = b->lines_read};
        line_error(b, &none, "server_error", "line %ld: out of memory", b->lines_read);
        return;
    }
    it->line = b->lines_read;
    long ln = it->line;
    if (len > MAX_LINE_BYTES) {
        line_error(b, it, "line_too_long", "line %ld is %zu bytes; the limit is %u bytes", ln, len, MAX_LINE_BYTES);
        item_free(it);
        return;
    }
    json_error_t jerr;
    json_t *req = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!req) {
        line_error(b, it, "invalid_json", "line %ld is not valid JSON: %s at column %d", ln, jerr.text, jerr.column);
        item_free(it);
        return;
    }
    json_t *v;
    const char *url;
    api_endpoint ep;
    if (!json_is_object(req)) {
        line_error(b, it, "invalid_request", "line %ld must be a JSON object", ln);
        goto done;
    }
    if ((v = json_object_get(req, "custom_id")))
        it->custom_id = json_incref(v);
    if (!json_is_string(v) || json_string_length(v) == 0) {
        line_error(b, it, "invalid_custom_id", "line %ld: 'custom_id' must be a non-empty string, got %s", ln,
                   !v ? "nothing" : json_is_string(v) ? "an empty string" : "another type");
        goto done;
    }
    v = json_object_get(req, "method");
    if (!json_is_string(v) || strcmp(json_string_value(v), "POST")) {
        line_error(b, it, "invalid_method", "line %ld: 'method' must be \"POST\"", ln);
        goto done;
    }
    v = json_object_get(req, "url");
    url = json_is_string(v) ? json_string_value(v) : NULL;
    if (!url || (strcmp(url, "/v1/completions") && strcmp(url, "/v1/chat/completions") &&
                 strcmp(url, "/v1/embeddings"))) {
        line_error(b, it, "invalid_url",
                   "line %ld: 'url' must be \"/v1/completions\", \"/v1/chat/completions\" or \"/v1/embeddings\", "
                   "got %.100s%s%s",
                   ln, url ? "\"" : "", url ? url : "a non-string", url ? "\"" : "");
        goto done;
    }
    ep = !strcmp(url, "/v1/completions") ? API_COMPLETIONS : !strcmp(url, "/v1/chat/completions") ? API_CHAT
                                                                                                    : API_EMBEDDINGS;
    v = json_object_get(req, "body");
    if (!json_is_object(v)) {
        line_error(b, it, "invalid_body", "line %ld: 'body' must be a JSON object with the request, got %s", ln,
                   v ? "another type" : "nothing");
        goto done;
    }
    api_error aerr;
    json_t *stream = json_object_get(v, "stream");
    if (json_is_true(stream)) {
        api_bad_request(&aerr, "stream", "'stream' is not supported in a batch");
        line_response(b, it, aerr.status, NULL, api_error_json(&aerr));
        goto done;
    }
    api_request r;
    if (api_parse(b->am, ep, v, &r, &aerr)) {
        line_response(b, it, aerr.status, NULL, api_error_json(&aerr));
        goto done;
    }
    api_job *job = api_job_submit(b->am, &r, &b->sink, cli_now(), &aerr);
    if (!job) {
        line_response(b, it, aerr.status, NULL, api_error_json(&aerr));
        goto done;
    }
    api_job_set_user(job, it);
    b->inflight++;
    json_decref(req);
    return;
done:
    json_decref(req);
    item_free(it);
}

static void finish_job(batch_run *b, api_job *job)
{
    batch_item *it = api_job_user(job);
    int64_t p, c, k;
    api_job_usage(job, &p, &c, &k);
    b->prompt_tokens += p;
    b->completion_tokens += c;
    line_response(b, it, api_job_status(job), api_job_id(job), api_job_response(job));
    item_free(it);
    api_job_free(job);
    b->inflight--;
}

static void pump(batch_run *b)
{
    api_event *ev = api_sink_take(&b->sink);
    while (ev) {
        api_event *next = ev->next;
        api_job *job = ev->job;
        api_timing t;
        api_job_apply(job, ev, NULL, &t);
        api_event_free(ev);
        if (api_job_done(job))
            finish_job(b, job);
        ev = next;
    }
}

static void progress(batch_run *b, bool last)
{
    if (!b->tty)
        return;
    double now = cli_now();
    if (!last && now - b->t_progress < 0.2)
        return;
    b->t_progress = now;
    long done = b->ok + b->failed;
    double el = now - b->t_start;
    double rate = el > 0 ? (double)b->completion_tokens / el : 0;
    char bar[31];
    int fill = b->lines_total > 0 ? (int)(30.0 * (double)done / (double)b->lines_total) : 0;
    for (int i = 0; i < 30; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[30] = 0;
    if (b->lines_total > 0)
        fprintf(stderr, "\r[%s] %ld/%ld lines, %ld running, %.0f tokens/s  ", bar, done, b->lines_total,
                b->inflight, rate);
    else
        fprintf(stderr, "\r%ld lines done, %ld running, %.0f tokens/s  ", done, b->inflight, rate);
    if (last)
        fputc('\n', stderr);
    fflush(stderr);
}

/* A line's length without its "\n" or "\r\n". */
static size_t line_length(const char *line, ssize_t n)
{
    if (n > 0 && line[n - 1] == '\n')
        n--;
    if (n > 0 && line[n - 1] == '\r')
        n--;
    return (size_t)n;
}

/* OpenAI's Batch API refuses a file in which two requests share a custom_id, since results
 * are matched to requests by it; so does this, before anything runs. Counts the lines too,
 * for the progress bar. */
static int scan_input(FILE *in, const char *path, long *n_lines)
{
    json_t *seen = json_object();
    char *line = NULL, *dup_id = NULL;
    size_t cap = 0;
    ssize_t n;
    long ln = 0, dups = 0, dup_line = 0, first_line = 0;
    while (seen && (n = getline(&line, &cap, in)) >= 0) {
        ln++;
        size_t len = line_length(line, n);
        if (len > MAX_LINE_BYTES)
            continue;
        json_t *req = json_loadb(line, len, JSON_REJECT_DUPLICATES, NULL);
        json_t *id = json_object_get(req, "custom_id");
        if (json_is_string(id) && json_string_length(id) > 0) {
            const char *v = json_string_value(id);
            json_t *prev = json_object_getn(seen, v, json_string_length(id));
            if (!prev) {
                json_object_setn_new(seen, v, json_string_length(id), json_integer(ln));
            } else if (dups++ == 0) {
                dup_id = json_dumps(id, JSON_ENCODE_ANY);
                dup_line = ln;
                first_line = (long)json_integer_value(prev);
            }
        }
        json_decref(req);
    }
    bool failed = !seen || ferror(in);
    free(line);
    json_decref(seen);
    if (failed) {
        fprintf(stderr, "error: cannot read %s%s\n", path, seen ? "" : ": out of memory");
        free(dup_id);
        return -1;
    }
    if (dups) {
        size_t id_len = dup_id ? strlen(dup_id) : 0;
        fprintf(stderr,
                "error: %s: line %ld repeats custom_id %.64s%s of line %ld (%ld duplicate custom_id%s in the file); "
                "results are matched to requests by custom_id, so, as OpenAI's Batch API does, blade batch refuses "
                "the file: give every request its own custom_id\n",
                path, dup_line, dup_id ? dup_id : "?", id_len > 64 ? "..." : "", first_line, dups, dups > 1 ? "s" : "");
        free(dup_id);
        return -1;
    }
    rewind(in);
    *n_lines = ln;
    return 0;
}

/* The results must never land on a file the run reads. Compared by device and inode, so
 * a hard link or a symlink to an input counts as the input. */
static int refuse_input_as_output(const char *out_path, const char *what, const char *in_path,
                                  const struct stat *in_st)
{
    struct stat st;
    if (stat(out_path, &st) != 0 || st.st_dev != in_st->st_dev || st.st_ino != in_st->st_ino)
        return 0;
    fprintf(stderr,
            "error: refusing to write the results to %s: it is the same file as the %s %s (device %u:%u, inode %llu); "
            "blade batch never overwrites its input, choose another output file\n",
            out_path, what, in_path, major(st.st_dev), minor(st.st_dev), (unsigned long long)st.st_ino);
    return -1;
}

static int refuse_inputs_as_output(const char *out_path, FILE *in, const char *in_path, const char *model_path,
                                   const char *template_file, const char *pin_prefix_file)
{
    struct stat st;
    if (fstat(fileno(in), &st) != 0) {
        fprintf(stderr, "error: cannot stat %s: %s\n", in_path, strerror(errno));
        return -1;
    }
    if (refuse_input_as_output(out_path, "requests file", in_path, &st))
        return -1;
    const char *what[] = {"model", "chat template", "pin-prefix file"};
    const char *paths[] = {model_path, template_file, pin_prefix_file};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++)
        if (paths[i] && stat(paths[i], &st) == 0 && refuse_input_as_output(out_path, what[i], paths[i], &st))
            return -1;
    return 0;
}

/* What a failed run leaves at the output, for its error message. */
static const char *left_as(const blade_output *o)
{
    if (!o->target)
        return "";
    return o->exists ? "; the output file is as it was before the run" : "; no output file was created";
}

static int batch_main(int argc, char **argv)
{
    batch_options o;
    int rc = cli_parse(&cli_cmd_batch, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    cli_engine_options eo = o.engine;
    const char *model_path = o.model_path, *in_path = o.in_path, *out_path = o.out_path, *alias = o.alias,
               *template_file = o.template_file;
    long long max_inflight = o.max_inflight;
    if (!model_path && !(model_path = cli_default_model()))
        return cli_usage_error(&cli_cmd_batch, "no model given (-m FILE)");

    rc = 1;
    blade_error err = {{0}};
    FILE *in = blade_fopen_regular(in_path, &err);
    if (!in) {
        fprintf(stderr, "error: %s\n", err.msg);
        return rc;
    }
    blade_output output;
    if (blade_output_prepare(&output, out_path, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        fclose(in);
        return rc;
    }
    batch_run b = {0};
    b.sink.fd = -1;
    b.tty = isatty(STDERR_FILENO);
    if (refuse_inputs_as_output(out_path, in, in_path, model_path, template_file, eo.pin_prefix_file)) {
        rc = 2;
        goto before_model;
    }
    if (scan_input(in, in_path, &b.lines_total))
        goto before_model;
    /* Before the engine's threads exist, so that a signal cannot slip past the temporary's
     * cover (output_file.h). */
    if (blade_output_open(&output, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto before_model;
    }
    b.out = output.f;
    blade_model *m = blade_model_load(model_path, &err);
    blade_engine *e = NULL;
    api_model am = {0};
    bool have_am = false;
    char *line = NULL;
    size_t cap = 0;
    if (!m)
        goto fail;
    cli_engine_finalize(&eo, m);
    if (!(e = blade_engine_new(m, &eo.cfg, &err)))
        goto fail;
    if (api_model_init(&am, e, model_path, alias, template_file, &err))
        goto fail;
    have_am = true;
    am.batch_class = true;
    if (api_sink_init(&b.sink, &err))
        goto fail;
    cli_engine_describe(stderr, &eo, e);
    if (cli_engine_pin_prefix(&eo, e)) {
        err.msg[0] = 0;
        goto fail;
    }
    b.am = &am;
    b.t_start = cli_now();
    bool eof = false;
    /* Once a write has failed the run has failed: no more lines are started. */
    while ((!eof && !b.write_failed) || b.inflight > 0) {
        while (!eof && !b.write_failed && b.inflight < max_inflight) {
            ssize_t n = getline(&line, &cap, in);
            if (n < 0) {
                eof = true;
                break;
            }
            b.lines_read++;
            start_line(&b, line, line_length(line, n));
        }
        if (b.inflight > 0) {
            struct pollfd p = {.fd = b.sink.fd, .events = POLLIN};
            poll(&p, 1, b.tty ? 200 : -1);
            pump(&b);
        }
        progress(&b, false);
    }
    progress(&b, true);
    if (ferror(in)) {
        blade_error_set(&err, "reading %s failed after %ld lines%s", in_path, b.lines_read, left_as(&output));
        goto fail;
    }
    if (b.write_failed) {
        blade_error_set(&err, "writing the results to %s failed%s", out_path, left_as(&output));
        goto fail;
    }
    if (blade_output_commit(&output, &err))
        goto fail;
    double el = cli_now() - b.t_start;
    fprintf(stderr,
            "batch: %ld requests: %ld ok, %ld failed; %lld prompt tokens, %lld completion tokens; %.1f completion "
            "tokens/s; %.2f s\n",
            b.ok + b.failed, b.ok, b.failed, (long long)b.prompt_tokens, (long long)b.completion_tokens,
            el > 0 ? (double)b.completion_tokens / el : 0.0, el);
    rc = 0;
fail:
    if (rc && err.msg[0])
        fprintf(stderr, "error: %s\n", err.msg);
    free(line);
    blade_engine_free(e, false);
    api_sink_destroy(&b.sink);
    if (have_am)
        api_model_destroy(&am);
    blade_model_free(m);
before_model:
    blade_output_abort(&output);
    fclose(in);
    return rc;
}

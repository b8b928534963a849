/* The measuring client (see client.h): one thread drives every stream through libcurl's
 * multi interface and sleeps in curl_multi_poll whenever nothing can move. */
#include "loadgen/client.h"

#include <curl/curl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <time.h>

/* The longest sleep in curl_multi_poll when nothing is due: a bound, not a tick. */
#define MAX_WAIT_MS 1000
/* Seconds between progress reports, when there is a progress callback. */
#define PROGRESS_INTERVAL 0.1

/* A NUL-terminated growable buffer; after a failed allocation it keeps what it had and
 * sets failed. */
typedef struct buf {
    char *data;
    size_t len, cap;
    bool failed;
} buf;

static void buf_add(buf *b, const char *p, size_t n)
{
    size_t need = b->len + n + 1;
    if (b->failed || need < n)
        return;
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < need)
            cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d) {
            b->failed = true;
            return;
        }
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
}

static void buf_free(buf *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU seconds (user + system) of every thread of this process so far, and its peak
 * resident set in bytes. */
static double process_cpu(int64_t *peak_rss)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return NAN;
    if (peak_rss)
        *peak_rss = (int64_t)ru.ru_maxrss * 1024; /* Linux counts it in KiB */
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           (double)ru.ru_stime.tv_usec * 1e-6;
}

/* ---- records ---- */

double lg_record_ttft(const lg_record *r)
{
    return r->n_chunks > 0 ? r->chunks[0] - r->start : NAN;
}

double lg_record_tpot(const lg_record *r)
{
    if (r->output_tokens < 2 || r->n_chunks == 0)
        return NAN;
    return (lg_record_e2e(r) - lg_record_ttft(r)) / (double)(r->output_tokens - 1);
}

double lg_record_e2e(const lg_record *r)
{
    return r->end - r->start;
}

void lg_record_cause(const lg_record *r, char *buf, size_t cap)
{
    switch (r->failure) {
    case LG_OK: snprintf(buf, cap, "%s", ""); break;
    case LG_FAIL_HTTP: snprintf(buf, cap, "HTTP %d", r->http_status); break;
    case LG_FAIL_CONNECTION: snprintf(buf, cap, "connection error"); break;
    case LG_FAIL_TIMEOUT: snprintf(buf, cap, "timeout"); break;
    case LG_FAIL_STREAM: snprintf(buf, cap, "stream error"); break;
    }
}

/* ---- Prometheus text ---- */

bool lg_prom_value(const char *text, const char *name, double *out)
{
    size_t len = strlen(name);
    for (const char *line = text; line && *line;) {
        if (!strncmp(line, name, len) && line[len] == ' ') {
            char *end;
            double v = strtod(line + len + 1, &end);
            if (end != line + len + 1) {
                *out = v;
                return true;
            }
        }
        line = strchr(line, '\n');
        if (line)
            line++;
    }
    return false;
}

/* Reads one blade /metrics page; false when it holds none of blade's figures. */
static bool parse_sample(const char *text, double t, lg_sample *s)
{
    static const struct {
        const char *name;
        size_t offset;
    } fields[] = {
        {"blade:kv_blocks_used", offsetof(lg_sample, kv_used)},
        {"blade:kv_blocks_total", offsetof(lg_sample, kv_total)},
        {"blade:kv_cache_usage_perc", offsetof(lg_sample, kv_usage)},
        {"blade:prefix_cache_hits_total", offsetof(lg_sample, hit_tokens)},
        {"blade:prefix_cache_queries_total", offsetof(lg_sample, query_tokens)},
        {"blade:num_requests_running", offsetof(lg_sample, running)},
        {"blade:num_requests_waiting", offsetof(lg_sample, waiting)},
        {"blade:kv_utilisation", offsetof(lg_sample, kv_utilisation)},
    };
    bool any = false;
    s->t = t;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        double *dst = (double *)((char *)s + fields[i].offset);
        *dst = NAN;
        if (lg_prom_value(text, fields[i].name, dst))
            any = true;
    }
    return any;
}

/* ---- synchronous GET ---- */

static size_t to_buf(char *p, size_t size, size_t n, void *user)
{
    buf *b = user;
    buf_add(b, p, size * n);
    return b->failed ? 0 : size * n;
}

static struct curl_slist *auth_header(struct curl_slist *list, const char *api_key)
{
    if (!api_key)
        return list;
    size_t n = strlen(api_key) + 32;
    char *h = malloc(n);
    if (!h)
        return list;
    snprintf(h, n, "Authorization: Bearer %s", api_key);
    struct curl_slist *l = curl_slist_append(list, h);
    free(h);
    return l ? l : list;
}

static char *join_url(const char *base, const char *path)
{
    size_t n = strlen(base);
    while (n && base[n - 1] == '/')
        n--;
    size_t total = n + strlen(path) + 1;
    char *u = malloc(total);
    if (u)
        snprintf(u, total, "%.*s%s", (int)n, base, path);
    return u;
}

int lg_http_get(const char *base_url, const char *path, const char *api_key, double timeout, long *status,
                char **body, blade_error *err)
{
    char *url = join_url(base_url, path);
    CURL *h = curl_easy_init();
    struct curl_slist *headers = auth_header(NULL, api_key);
    buf b = {0};
    char errbuf[CURL_ERROR_SIZE] = "";
    int rc = -1;
    if (!url || !h) {
        blade_error_set(err, "out of memory");
        goto out;
    }
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, to_buf);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    if (timeout > 0)
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(timeout * 1000));
    CURLcode code = curl_easy_perform(h);
    if (code != CURLE_OK) {
        blade_error_set(err, "GET %s: %s", url, errbuf[0] ? errbuf : curl_easy_strerror(code));
        goto out;
    }
    if (b.failed) {
        blade_error_set(err, "GET %s: out of memory", url);
        goto out;
    }
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, status);
    *body = b.data ? b.data : calloc(1, 1);
    b.data = NULL;
    rc = *body ? 0 : blade_error_set(err, "out of memory");
out:
    buf_free(&b);
    curl_slist_free_all(headers);
    curl_easy_cleanup(h);
    free(url);
    return rc;
}

/* ---- the run ---- */

typedef struct session_slot {
    lg_session s;
    int64_t index;
    int32_t planned; /* turns to send: fewer than the session has when the count runs out */
    int32_t next;    /* the turn to send next */
    struct session_slot *next_ready;
} session_slot;

typedef struct request {
    CURL *h;
    struct request *prev, *next; /* the runner's requests in flight */
    session_slot *slot;
    int32_t turn;
    char *body;
    buf sse;     /* stream bytes not yet parsed into events */
    buf text;    /* generated text */
    buf errbody; /* the body of a non-200 answer */
    double *chunks;
    int32_t n_chunks, cap_chunks;
    long status;
    bool status_known, done, usage, oom;
    char *stream_error;
    int64_t usage_prompt, usage_completion;
    double start, last_byte;
    int cache_tier; /* from X-Blade-Semantic-Cache */
    float cache_similarity;
    char curl_error[CURL_ERROR_SIZE];
} request;

typedef struct runner {
    const lg_run_config *cfg;
    CURLM *multi;
    struct curl_slist *headers;
    char *completions_url;
    double t0;
    lg_run_result *res;
    size_t cap_records, cap_samples;
    session_slot *ready_head, *ready_tail;
    request *active;
    int in_flight;
    int64_t done, failed;
    bool stopped; /* the duration has passed: nothing new starts */
    CURL *scrape;
    buf scrape_body;
    double next_scrape;
    bool scraping;
} runner;

static void stream_error(request *q, const char *msg)
{
    if (q->stream_error)
        return;
    q->stream_error = strdup(msg);
    if (!q->stream_error)
        q->oom = true;
}

static void push_chunk(request *q, double t)
{
    if (q->n_chunks == q->cap_chunks) {
        int32_t cap = q->cap_chunks ? q->cap_chunks * 2 : 64;
        double *c = realloc(q->chunks, (size_t)cap * sizeof *c);
        if (!c) {
            q->oom = true;
            return;
        }
        q->chunks = c;
        q->cap_chunks = cap;
    }
    q->chunks[q->n_chunks++] = t;
}

static void handle_data(request *q, const char *data, size_t len, double now)
{
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        q->done = true;
        return;
    }
    json_error_t je;
    json_t *j = json_loadb(data, len, 0, &je);
    if (!j) {
        char msg[256];
        snprintf(msg, sizeof msg, "unparseable stream event: %s", je.text);
        stream_error(q, msg);
        return;
    }
    json_t *e = json_object_get(j, "error");
    if (e) {
        const char *msg = json_string_value(json_object_get(e, "message"));
        stream_error(q, msg ? msg : "the stream carried an error event");
    }
    json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
    json_t *text = json_object_get(choice, "text");
    if (!json_is_string(text))
        text = json_object_get(json_object_get(choice, "delta"), "content");
    if (json_is_string(text) && json_string_length(text) > 0) {
        push_chunk(q, now);
        buf_add(&q->text, json_string_value(text), json_string_length(text));
    }
    json_t *usage = json_object_get(j, "usage");
    if (json_is_object(usage)) {
        json_t *pt = json_object_get(usage, "prompt_tokens"), *ct = json_object_get(usage, "completion_tokens");
        if (json_is_integer(pt) && json_is_integer(ct)) {
            q->usage = true;
            q->usage_prompt = json_integer_value(pt);
            q->usage_completion = json_integer_value(ct);
        }
    }
    json_decref(j);
}

/* One Server-Sent Event: its data lines joined by newlines, as the SSE format defines. */
static void handle_event(request *q, char *ev, double now)
{
    buf data = {0};
    bool any = false;
    for (char *line = ev; line;) {
        char *nl = strchr(line, '\n');
        if (nl)
            *nl = 0;
        if (!strncmp(line, "data:", 5)) {
            const char *d = line[5] == ' ' ? line + 6 : line + 5;
            if (any)
                buf_add(&data, "\n", 1);
            buf_add(&data, d, strlen(d));
            any = true;
        }
        line = nl ? nl + 1 : NULL;
    }
    if (data.failed)
        q->oom = true;
    else if (any)
        handle_data(q, data.data ? data.data : "", data.len, now);
    buf_free(&data);
}

static size_t on_stream(char *p, size_t size, size_t n, void *user)
{
    request *q = user;
    size_t len = size * n;
    double now = mono();
    q->last_byte = now;
    if (!q->status_known) {
        curl_easy_getinfo(q->h, CURLINFO_RESPONSE_CODE, &q->status);
        q->status_known = true;
    }
    if (q->status != 200) {
        if (q->errbody.len < 4096)
            buf_add(&q->errbody, p, len);
        return len;
    }
    /* Carriage returns are dropped so "\r\n" line ends read like "\n" ones. */
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && p[j] != '\r')
            j++;
        buf_add(&q->sse, p + i, j - i);
        i = j + 1;
    }
    if (q->sse.failed)
        return 0;
    char *start = q->sse.data;
    char *end;
    while (start && (end = strstr(start, "\n\n"))) {
        *end = 0;
        handle_event(q, start, now);
        start = end + 2;
    }
    if (start && start != q->sse.data) {
        size_t rest = q->sse.len - (size_t)(start - q->sse.data);
        memmove(q->sse.data, start, rest + 1);
        q->sse.len = rest;
    }
    return q->oom ? 0 : len;
}

static int render_text(const blade_tokenizer *tok, const int32_t *ids, int32_t n, buf *out)
{
    size_t cap = blade_tokenizer_max_token_bytes(tok) + 8;
    char *piece = malloc(cap);
    if (!piece)
        return -1;
    blade_detokenizer d;
    blade_detokenizer_init(&d, tok, false);
    for (int32_t i = 0; i < n; i++)
        buf_add(out, piece, blade_detokenizer_push(&d, ids[i], piece, cap));
    buf_add(out, piece, blade_detokenizer_flush(&d, piece, cap));
    free(piece);
    return out->failed ? -1 : 0;
}

/* A semantic cache hit announces itself in "X-Blade-Semantic-Cache: hit; tier=T;
 * similarity=S". */
static size_t on_header(char *data, size_t size, size_t n, void *user)
{
    request *q = user;
    size_t len = size * n;
    static const char name[] = "x-blade-semantic-cache:";
    if (len > sizeof name && !strncasecmp(data, name, sizeof name - 1)) {
        char line[160];
        snprintf(line, sizeof line, "%.*s", (int)(len < sizeof line ? len : sizeof line - 1), data);
        const char *tier = strstr(line, "tier="), *sim = strstr(line, "similarity=");
        if (tier && strstr(line, "hit"))
            q->cache_tier = !strncmp(tier + 5, "exact", 5) ? 1 : 2;
        if (sim)
            q->cache_similarity = strtof(sim + 11, NULL);
    }
    return len;
}

static char *request_body(const lg_run_config *cfg, const lg_turn *t)
{
    json_t *prompt;
    if (cfg->prompt_text) {
        buf text = {0};
        if (render_text(cfg->tok, t->tokens, t->n_tokens, &text)) {
            buf_free(&text);
            return NULL;
        }
        prompt = json_stringn(text.data ? text.data : "", text.len);
        buf_free(&text);
    } else {
        prompt = json_array();
        for (int32_t i = 0; prompt && i < t->n_tokens; i++)
            json_array_append_new(prompt, json_integer(t->tokens[i]));
    }
    json_t *o = json_pack("{s:s, s:o, s:i, s:b, s:{s:b}, s:f}", "model", cfg->model, "prompt", prompt, "max_tokens",
                          t->output_len, "stream", 1, "stream_options", "include_usage", 1, "temperature", 0.0);
    if (!o)
        return NULL;
    if (cfg->ignore_eos)
        json_object_set_new(o, "ignore_eos", json_true());
    if (cfg->semantic_cache)
        json_object_set_new(o, "semantic_cache", json_true());
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static void request_free(request *q)
{
    if (!q)
        return;
    curl_easy_cleanup(q->h);
    free(q->body);
    buf_free(&q->sse);
    buf_free(&q->text);
    buf_free(&q->errbody);
    free(q->chunks);
    free(q->stream_error);
    free(q);
}

static int start_request(runner *r, session_slot *slot, blade_error *err)
{
    request *q = calloc(1, sizeof *q);
    if (!q || !(q->h = curl_easy_init()))
        goto oom;
    q->slot = slot;
    q->turn = slot->next++;
    if (!(q->body = request_body(r->cfg, &slot->s.turns[q->turn])))
        goto oom;
    CURL *h = q->h;
    curl_easy_setopt(h, CURLOPT_URL, r->completions_url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, r->headers);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, q->body);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(q->body));
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_stream);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, q);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, q);
    curl_easy_setopt(h, CURLOPT_PRIVATE, q);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, q->curl_error);
    if (r->cfg->timeout > 0)
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(r->cfg->timeout * 1000));
    q->start = mono();
    if (curl_multi_add_handle(r->multi, h) != CURLM_OK)
        goto oom;
    q->next = r->active;
    if (r->active)
        r->active->prev = q;
    r->active = q;
    r->in_flight++;
    return 0;
oom:
    request_free(q);
    return blade_error_set(err, "out of memory starting a request");
}

/* The record of a finished request; q is freed. */
static int finish_request(runner *r, request *q, CURLcode code, lg_record *rec, blade_error *err)
{
    const lg_turn *t = &q->slot->s.turns[q->turn];
    memset(rec, 0, sizeof *rec);
    rec->session = q->slot->index;
    rec->turn = q->turn;
    rec->prompt_len = t->n_tokens;
    rec->max_tokens = t->output_len;
    rec->start = q->start - r->t0;
    rec->end = (q->last_byte > 0 ? q->last_byte : mono()) - r->t0;
    rec->label = t->label;
    rec->cache_tier = q->cache_tier;
    rec->cache_similarity = q->cache_similarity;
    /* A last event the server closed the connection on, without the blank line after it. */
    if (code == CURLE_OK && q->sse.len > 0)
        handle_event(q, q->sse.data, q->last_byte);
    char msg[512] = "";
    if (code == CURLE_OPERATION_TIMEDOUT) {
        rec->failure = LG_FAIL_TIMEOUT;
        snprintf(msg, sizeof msg, "%s", q->curl_error[0] ? q->curl_error : curl_easy_strerror(code));
    } else if (code != CURLE_OK && !q->oom) {
        rec->failure = LG_FAIL_CONNECTION;
        snprintf(msg, sizeof msg, "%s", q->curl_error[0] ? q->curl_error : curl_easy_strerror(code));
    } else if (q->oom) {
        request_free(q);
        return blade_error_set(err, "out of memory reading a stream");
    } else {
        curl_easy_getinfo(q->h, CURLINFO_RESPONSE_CODE, &q->status);
        rec->http_status = (int)q->status;
        if (q->status != 200) {
            rec->failure = LG_FAIL_HTTP;
            json_t *j = q->errbody.data ? json_loads(q->errbody.data, 0, NULL) : NULL;
            const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
            snprintf(msg, sizeof msg, "%s", m ? m : q->errbody.data ? q->errbody.data : "");
            json_decref(j);
        } else if (q->stream_error) {
            rec->failure = LG_FAIL_STREAM;
            snprintf(msg, sizeof msg, "%s", q->stream_error);
        } else if (!q->done) {
            rec->failure = LG_FAIL_STREAM;
            snprintf(msg, sizeof msg, "the stream ended without data: [DONE]");
        }
    }
    if (rec->failure != LG_OK) {
        if (!(rec->error = strdup(msg)))
            goto oom;
    } else {
        rec->usage_reported = q->usage;
        /* a cache hit generates nothing (usage says 0) but delivers its text: counted here */
        if (q->usage && !q->cache_tier) {
            rec->input_tokens = q->usage_prompt;
            rec->output_tokens = q->usage_completion;
        } else {
            int32_t *ids = NULL;
            size_t n = 0;
            if (blade_tokenizer_encode(r->cfg->tok, q->text.data ? q->text.data : "", q->text.len, false, false, &ids,
                                       &n, err)) {
                request_free(q);
                return -1;
            }
            free(ids);
            rec->input_tokens = t->n_tokens;
            rec->output_tokens = (int64_t)n;
        }
        if (q->n_chunks) {
            if (!(rec->chunks = malloc((size_t)q->n_chunks * sizeof *rec->chunks)))
                goto oom;
            for (int32_t i = 0; i < q->n_chunks; i++)
                rec->chunks[i] = q->chunks[i] - r->t0;
            rec->n_chunks = q->n_chunks;
        }
    }
    request_free(q);
    return 0;
oom:
    free(rec->error);
    rec->error = NULL;
    request_free(q);
    return blade_error_set(err, "out of memory");
}

static void enqueue(runner *r, session_slot *s)
{
    s->next_ready = NULL;
    if (r->ready_tail)
        r->ready_tail->next_ready = s;
    else
        r->ready_head = s;
    r->ready_tail = s;
}

static session_slot *dequeue(runner *r)
{
    session_slot *s = r->ready_head;
    if (s && !(r->ready_head = s->next_ready))
        r->ready_tail = NULL;
    return s;
}

static void slot_free(session_slot *s)
{
    if (s) {
        lg_session_free(&s->s);
        free(s);
    }
}

static int add_record(runner *r, lg_record *rec)
{
    lg_run_result *res = r->res;
    if (res->n_records == r->cap_records) {
        size_t cap = r->cap_records ? r->cap_records * 2 : 256;
        lg_record *g = realloc(res->records, cap * sizeof *g);
        if (!g)
            return -1;
        res->records = g;
        r->cap_records = cap;
    }
    res->records[res->n_records++] = *rec;
    return 0;
}

static int add_sample(runner *r, const lg_sample *s)
{
    lg_run_result *res = r->res;
    if (res->n_samples == r->cap_samples) {
        size_t cap = r->cap_samples ? r->cap_samples * 2 : 128;
        lg_sample *g = realloc(res->samples, cap * sizeof *g);
        if (!g)
            return -1;
        res->samples = g;
        r->cap_samples = cap;
    }
    res->samples[res->n_samples++] = *s;
    return 0;
}

static void start_scrape(runner *r)
{
    char *url = join_url(r->cfg->url, "/metrics");
    CURL *h = curl_easy_init();
    if (!url || !h) {
        free(url);
        curl_easy_cleanup(h);
        return;
    }
    buf_free(&r->scrape_body);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, r->headers);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, to_buf);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &r->scrape_body);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 5000L);
    free(url);
    if (curl_multi_add_handle(r->multi, h) != CURLM_OK) {
        curl_easy_cleanup(h);
        return;
    }
    r->scrape = h;
}

/* A sample answered while the run goes on. A server too busy to answer in time costs one
 * sample; one that has no blade /metrics ends the scraping. */
static void finish_scrape(runner *r, CURLcode code)
{
    long status = 0;
    curl_easy_getinfo(r->scrape, CURLINFO_RESPONSE_CODE, &status);
    curl_multi_remove_handle(r->multi, r->scrape);
    curl_easy_cleanup(r->scrape);
    r->scrape = NULL;
    if (code != CURLE_OK)
        return;
    lg_sample s;
    if (status != 200 || !r->scrape_body.data || !parse_sample(r->scrape_body.data, mono() - r->t0, &s)) {
        r->scraping = false;
        return;
    }
    if (add_sample(r, &s))
        r->scraping = false;
}

/* A sample taken on the spot, at time t of the run: the counters at its very start and
 * end. */
static void scrape_now(runner *r, double t)
{
    long status = 0;
    char *body = NULL;
    lg_sample s;
    if (lg_http_get(r->cfg->url, "/metrics", r->cfg->api_key, 5.0, &status, &body, NULL) == 0 && status == 200 &&
        parse_sample(body, t, &s)) {
        if (add_sample(r, &s))
            r->scraping = false;
    } else {
        r->scraping = false;
    }
    free(body);
}

static void report_progress(runner *r, double now)
{
    if (!r->cfg->progress)
        return;
    lg_progress p = {.done = r->done, .failed = r->failed, .total = r->cfg->num_requests,
                     .in_flight = r->in_flight, .elapsed = now - r->t0, .duration = r->cfg->duration};
    r->cfg->progress(&p, r->cfg->progress_user);
}

/* Handles every finished transfer; the warm-up's record goes to *warm instead of the run. */
static int drain_messages(runner *r, lg_record *warm, bool *warm_done, blade_error *err)
{
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(r->multi, &left))) {
        if (m->msg != CURLMSG_DONE)
            continue;
        CURL *h = m->easy_handle;
        CURLcode code = m->data.result;
        if (h == r->scrape) {
            finish_scrape(r, code);
            continue;
        }
        request *q = NULL;
        curl_easy_getinfo(h, CURLINFO_PRIVATE, (char **)&q);
        curl_multi_remove_handle(r->multi, h);
        if (q->prev)
            q->prev->next = q->next;
        else
            r->active = q->next;
        if (q->next)
            q->next->prev = q->prev;
        r->in_flight--;
        session_slot *slot = q->slot;
        lg_record rec;
        if (finish_request(r, q, code, &rec, err)) {
            if (!warm)
                slot_free(slot);
            return -1;
        }
        if (warm) {
            *warm = rec;
            *warm_done = true;
            continue;
        }
        if (add_record(r, &rec)) {
            free(rec.chunks);
            free(rec.error);
            slot_free(slot);
            return blade_error_set(err, "out of memory");
        }
        r->done++;
        if (rec.failure != LG_OK)
            r->failed++;
        if (slot->next < slot->planned && !r->stopped)
            enqueue(r, slot);
        else
            slot_free(slot);
    }
    return 0;
}

/* Sleeps until a socket is ready, one of libcurl's own timers fires (curl_multi_poll
 * shortens the wait to those itself) or wait_s has passed, then moves every transfer on.
 * The callers bound wait_s by the next thing that can happen, never by something that
 * cannot yet, so a client with nothing to do takes no CPU from the server it measures. */
static void poll_once(runner *r, double wait_s)
{
    int running;
    curl_multi_perform(r->multi, &running);
    double ms = ceil(wait_s * 1000);
    curl_multi_poll(r->multi, NULL, 0, !(ms > 0) ? 0 : ms > MAX_WAIT_MS ? MAX_WAIT_MS : (int)ms, NULL);
    curl_multi_perform(r->multi, &running);
}

static int warmup(runner *r, blade_error *err)
{
    session_slot *slot = calloc(1, sizeof *slot);
    if (!slot)
        return blade_error_set(err, "out of memory");
    slot->index = -1;
    slot->planned = 1;
    int rc = -1;
    if (lg_workload_warmup(r->cfg->workload, &slot->s, err) || start_request(r, slot, err))
        goto out;
    lg_record rec;
    bool done = false;
    r->t0 = mono();
    while (!done) {
        poll_once(r, MAX_WAIT_MS / 1e3);
        if (drain_messages(r, &rec, &done, err))
            goto out;
    }
    if (rec.failure != LG_OK) {
        char cause[64];
        lg_record_cause(&rec, cause, sizeof cause);
        blade_error_set(err, "the warm-up request failed (%s): %s", cause, rec.error ? rec.error : "");
    } else {
        rc = 0;
    }
    free(rec.chunks);
    free(rec.error);
out:
    slot_free(slot);
    return rc;
}

/* Starts the sessions that have arrived, then as many ready turns as the concurrency
 * limit lets through. */
static int admit(runner *r, lg_arrivals *arr, double *next_arrival, int64_t *planned, int64_t *next_session,
                 double now, blade_error *err)
{
    const lg_run_config *cfg = r->cfg;
    int32_t turns = lg_workload_turns(cfg->workload);
    /* With every request due at once and a concurrency limit, sessions are made as room
     * frees up, so a run bounded by time does not queue requests without end. */
    bool lazy = !isfinite(cfg->request_rate) && cfg->max_concurrency > 0;
    for (;;) {
        while (r->ready_head && (cfg->max_concurrency <= 0 || r->in_flight < cfg->max_concurrency)) {
            session_slot *slot = dequeue(r);
            if (r->stopped) {
                slot_free(slot);
                continue;
            }
            if (start_request(r, slot, err)) {
                slot_free(slot);
                return -1;
            }
        }
        bool due = !r->stopped && (cfg->num_requests == 0 || *planned < cfg->num_requests) && *next_arrival <= now;
        if (!due || (lazy && (r->ready_head || r->in_flight >= cfg->max_concurrency)))
            return 0;
        session_slot *slot = calloc(1, sizeof *slot);
        if (!slot)
            return blade_error_set(err, "out of memory");
        slot->index = (*next_session)++;
        if (lg_workload_session(cfg->workload, slot->index, &slot->s, err)) {
            free(slot);
            return -1;
        }
        int64_t left = cfg->num_requests ? cfg->num_requests - *planned : turns;
        slot->planned = left < turns ? (int32_t)left : turns;
        *planned += slot->planned;
        enqueue(r, slot);
        *next_arrival = lg_arrivals_next(arr);
    }
}

int lg_run(const lg_run_config *cfg, lg_run_result *out, blade_error *err)
{
    memset(out, 0, sizeof *out);
    runner r = {.cfg = cfg, .res = out};
    int rc = -1;
    double cpu0 = process_cpu(NULL), wall0 = mono();
    r.multi = curl_multi_init();
    r.completions_url = join_url(cfg->url, "/v1/completions");
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    /* libcurl would otherwise hold larger bodies back for a 100-continue round trip. */
    struct curl_slist *h2 = h ? curl_slist_append(h, "Expect:") : NULL;
    r.headers = h2 ? auth_header(h2, cfg->api_key) : NULL;
    if (!r.headers)
        curl_slist_free_all(h2 ? h2 : h);
    if (!r.multi || !r.completions_url || !r.headers) {
        blade_error_set(err, "out of memory");
        goto out;
    }
    if (cfg->warmup && warmup(&r, err))
        goto out;

    /* Taken before the clock starts, so the first request leaves at time 0. */
    r.scraping = cfg->scrape_interval > 0;
    if (r.scraping)
        scrape_now(&r, 0);
    r.t0 = mono();
    r.next_scrape = cfg->scrape_interval;
    lg_arrivals arr;
    lg_arrivals_init(&arr, cfg->request_rate, cfg->burstiness, cfg->seed);
    double next_arrival = lg_arrivals_next(&arr), next_progress = 0;
    int64_t planned = 0, next_session = 0;
    for (;;) {
        double now = mono() - r.t0;
        if (cfg->duration > 0 && now >= cfg->duration)
            r.stopped = true;
        if (admit(&r, &arr, &next_arrival, &planned, &next_session, now, err))
            goto out;
        if (r.scraping && !r.scrape && now >= r.next_scrape) {
            start_scrape(&r);
            while (r.next_scrape <= now)
                r.next_scrape += cfg->scrape_interval;
        }
        bool all_planned = r.stopped || (cfg->num_requests > 0 && planned >= cfg->num_requests);
        if (all_planned && r.in_flight == 0 && !r.ready_head)
            break;
        /* An arrival the concurrency limit holds back starts when a request finishes, which
         * its socket tells; only one that could start now is a reason to wake. */
        double until = INFINITY;
        if (!all_planned && (cfg->max_concurrency <= 0 || r.in_flight < cfg->max_concurrency))
            until = next_arrival;
        if (cfg->duration > 0 && !r.stopped && cfg->duration < until)
            until = cfg->duration;
        /* A sample still in flight is waited for on its socket. */
        if (r.scraping && !r.scrape && r.next_scrape < until)
            until = r.next_scrape;
        if (cfg->progress && next_progress < until)
            until = next_progress;
        poll_once(&r, until - now);
        if (drain_messages(&r, NULL, NULL, err))
            goto out;
        double t = mono();
        if (t - r.t0 >= next_progress) {
            report_progress(&r, t);
            next_progress = t - r.t0 + PROGRESS_INTERVAL;
        }
    }
    out->duration = 0;
    for (size_t i = 0; i < out->n_records; i++)
        if (out->records[i].end > out->duration)
            out->duration = out->records[i].end;
    if (r.scraping)
        scrape_now(&r, mono() - r.t0);
    out->scraped = out->n_samples > 0;
    report_progress(&r, mono());
    out->client_cpu = process_cpu(&out->client_peak_rss) - cpu0;
    out->client_wall = mono() - wall0;
    rc = 0;
out:
    while (r.ready_head)
        slot_free(dequeue(&r));
    while (r.active) {
        request *q = r.active;
        r.active = q->next;
        curl_multi_remove_handle(r.multi, q->h);
        slot_free(q->slot);
        request_free(q);
    }
    if (r.scrape) {
        curl_multi_remove_handle(r.multi, r.scrape);
        curl_easy_cleanup(r.scrape);
    }
    curl_multi_cleanup(r.multi);
    curl_slist_free_all(r.headers);
    buf_free(&r.scrape_body);
    free(r.completions_url);
    if (rc)
        lg_run_result_free(out);
    return rc;
}

void lg_run_result_free(lg_run_result *r)
{
    for (size_t i = 0; i < r->n_records; i++) {
        free(r->records[i].chunks);
        free(r->records[i].error);
    }
    free(r->records);
    free(r->samples);
    memset(r, 0, sizeof *r);
}

/* The router's HTTP side (router.h): libmicrohttpd, one thread per connection; each
 * completion is relayed from the chosen worker through libcurl, streams chunk by chunk. */

#include "router/router.h"

#include <curl/curl.h>
#include <jansson.h>
#include <microhttpd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BODY ((size_t)32 << 20)
#define TRIES 3

/* How requests ended, for /metrics: every completion request is counted once, so that
 * none is lost silently (the sum is the number of requests). */
enum outcome {
    OUT_OK,
    OUT_WORKER_STATUS,
    OUT_BAD_REQUEST,
    OUT_NO_WORKER,
    OUT_MIDSTREAM,
    OUT_CLIENT_GONE,
    OUT_INTERNAL,
    OUT_COUNT
};
static const char *const outcome_names[] = {"ok",          "worker_error_status", "bad_request",   "no_worker",
                                            "worker_failed_midstream", "client_gone", "internal_error"};

/* Why an attempt on a worker failed before its answer began, for /metrics: the request
 * then went to another worker (or, out of tries or workers, ended no_worker). */
enum attempt_cause { ATTEMPT_UNREACHABLE, ATTEMPT_FAILED, ATTEMPT_COUNT };
static const char *const attempt_names[] = {"unreachable", "failed_before_answer"};

struct router {
    router_config cfg;
    pool *pool;
    struct MHD_Daemon *d;
    int port;
    pthread_mutex_t mu;
    uint64_t outcomes[OUT_COUNT];
    uint64_t attempts_failed[ATTEMPT_COUNT], prefix_routed, load_routed, disaggregated;
};

typedef struct rconn {
    router *r;
    /* the request's own reference, and a streaming response's: libmicrohttpd may end the
     * request before it destroys the response */
    atomic_int refs;
    char *body;
    size_t len;
    bool too_big;
    /* the relay */
    pool_choice choice;
    bool chosen;
    CURLM *multi;
    CURL *easy;
    struct curl_slist *headers;
    char *buf; /* received from the worker, not yet passed on */
    size_t buf_len, buf_pos, buf_cap;
    bool done, failed, ended;
    CURLcode result;
    /* the last two bytes passed on: "\n\n" ends an SSE event, after which an error event
     * may follow as it is */
    char tail[2];
    char curl_error[CURL_ERROR_SIZE];
} rconn;

static void count(router *r, enum outcome o)
{
    pthread_mutex_lock(&r->mu);
    r->outcomes[o]++;
    pthread_mutex_unlock(&r->mu);
}

static enum MHD_Result respond(struct MHD_Connection *mc, int status, const char *ctype, const char *body)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(body), (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp)
        return MHD_NO;
    MHD_add_response_header(resp, "Content-Type", ctype);
    enum MHD_Result ret = MHD_queue_response(mc, (unsigned)status, resp);
    MHD_destroy_response(resp);
    return ret;
}

/* An error object in OpenAI's shape, as blade serve writes them. */
static enum MHD_Result respond_error(struct MHD_Connection *mc, int status, const char *type, const char *msg)
{
    json_t *j = json_pack("{s:{s:s, s:s, s:n, s:n}}", "error", "message", msg, "type", type, "param", "code");
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    enum MHD_Result ret = respond(mc, status, "application/json", text ? text : "{}");
    free(text);
    return ret;
}

/* ---- the routing key of a request body ---- */

static void key_of(const router *r, json_t *body, pool_key *k)
{
    int bt = r->cfg.pool.block_tokens > 0 ? r->cfg.pool.block_tokens : 16;
    json_t *prompt = json_object_get(body, "prompt");
    if (json_is_array(prompt) && json_array_size(prompt) > 0 && !json_is_integer(json_array_get(prompt, 0)))
        prompt = json_array_get(prompt, 0); /* several prompts: the first decides */
    k->n = 0;
    if (json_is_array(prompt)) {
        size_t n = json_array_size(prompt);
        int32_t *toks = malloc((n ? n : 1) * sizeof *toks);
        if (!toks)
            return;
        for (size_t i = 0; i < n; i++)
            toks[i] = (int32_t)json_integer_value(json_array_get(prompt, i));
        pool_key_tokens(k, toks, n, bt);
        free(toks);
        return;
    }
    if (json_is_string(prompt)) {
        pool_key_bytes(k, json_string_value(prompt), json_string_length(prompt), bt);
        return;
    }
    /* chat: the conversation's roles and contents in order */
    json_t *msgs = json_object_get(body, "messages");
    size_t i;
    json_t *m;
    char *text = NULL;
    size_t len = 0;
    json_array_foreach(msgs, i, m)
    {
        json_t *content = json_object_get(m, "content");
        char *piece = json_is_string(content) ? strdup(json_string_value(content)) : json_dumps(content, JSON_COMPACT);
        const char *role = json_string_value(json_object_get(m, "role"));
        size_t add = (piece ? strlen(piece) : 0) + (role ? strlen(role) : 0) + 2;
        char *grown = realloc(text, len + add + 1);
        if (grown) {
            text = grown;
            len += (size_t)snprintf(text + len, add + 1, "%s\n%s\n", role ? role : "", piece ? piece : "");
        }
        free(piece);
    }
    if (text)
        pool_key_bytes(k, text, len, bt);
    free(text);
}

/* ---- relaying ---- */

static size_t on_worker_data(char *data, size_t size, size_t n, void *user)
{
    rconn *c = user;
    size_t add = size * n;
    if (c->buf_len + add > c->buf_cap) {
        size_t cap = c->buf_cap ? c->buf_cap : 16384;
        while (cap < c->buf_len + add)
            cap *= 2;
        if (cap > MAX_BODY * 4)
            return 0;
        char *grown = realloc(c->buf, cap);
        if (!grown)
            return 0;
        c->buf = grown;
        c->buf_cap = cap;
    }
    memcpy(c->buf + c->buf_len, data, add);
    c->buf_len += add;
    return add;
}

static void relay_end(rconn *c)
{
    if (c->easy) {
        curl_multi_remove_handle(c->multi, c->easy);
        curl_easy_cleanup(c->easy);
        c->easy = NULL;
    }
    curl_multi_cleanup(c->multi);
    c->multi = NULL;
    curl_slist_free_all(c->headers);
    c->headers = NULL;
}

/* Starts the request on the chosen worker. */
static bool relay_start(rconn *c, const char *path, struct MHD_Connection *mc)
{
    char url[POOL_URL_MAX + 64];
    snprintf(url, sizeof url, "%s%s", c->choice.url, path);
    c->multi = curl_multi_init();
    c->easy = curl_easy_init();
    if (!c->multi || !c->easy)
        return false;
    c->headers = curl_slist_append(NULL, "Content-Type: application/json");
    const char *auth = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, "Authorization");
    char line[POOL_URL_MAX + 64];
    if (auth && strlen(auth) < 4096) {
        char *h = malloc(strlen(auth) + 32);
        if (h) {
            sprintf(h, "Authorization: %s", auth);
            c->headers = curl_slist_append(c->headers, h);
            free(h);
        }
    }
    if (c->choice.prefill_kv[0]) {
        snprintf(line, sizeof line, "X-Blade-Prefill: %s", c->choice.prefill_kv);
        c->headers = curl_slist_append(c->headers, line);
    }
    c->buf_len = c->buf_pos = 0;
    c->done = c->failed = false;
    c->result = CURLE_OK;
    c->tail[0] = c->tail[1] = '\n';
    c->curl_error[0] = 0;
    curl_easy_setopt(c->easy, CURLOPT_URL, url);
    curl_easy_setopt(c->easy, CURLOPT_POSTFIELDS, c->body);
    curl_easy_setopt(c->easy, CURLOPT_POSTFIELDSIZE, (long)c->len);
    curl_easy_setopt(c->easy, CURLOPT_HTTPHEADER, c->headers);
    curl_easy_setopt(c->easy, CURLOPT_WRITEFUNCTION, on_worker_data);
    curl_easy_setopt(c->easy, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(c->easy, CURLOPT_ERRORBUFFER, c->curl_error);
    curl_easy_setopt(c->easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c->easy, CURLOPT_CONNECTTIMEOUT_MS, 3000L);
    return curl_multi_add_handle(c->multi, c->easy) == CURLM_OK;
}

/* Moves the transfer on until there is data to pass on (all: until it ended) or it
 * ended. */
static void relay_pump(rconn *c, bool all)
{
    while (!c->done && (all || c->buf_pos == c->buf_len)) {
        int running = 0;
        curl_multi_perform(c->multi, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(c->multi, &left)))
            if (msg->msg == CURLMSG_DONE) {
                c->done = true;
                c->result = msg->data.result;
                c->failed = msg->data.result != CURLE_OK;
                if (c->failed && !c->curl_error[0])
                    snprintf(c->curl_error, sizeof c->curl_error, "%s", curl_easy_strerror(msg->data.result));
            }
        if (!c->done && (all || c->buf_pos == c->buf_len))
            curl_multi_poll(c->multi, NULL, 0, 100, NULL);
    }
}

static long relay_status(rconn *c)
{
    long status = 0;
    curl_easy_getinfo(c->easy, CURLINFO_RESPONSE_CODE, &status);
    return status;
}

static void finish_choice(rconn *c, bool failed)
{
    if (c->chosen) {
        pool_done(c->r->pool, &c->choice, failed);
        c->chosen = false;
    }
}

/* The stream after its first bytes: chunks as they come; a worker failing now ends the
 * client's stream with an error event and [DONE]. */
static ssize_t stream_reader(void *cls, uint64_t pos, char *out, size_t max)
{
    rconn *c = cls;
    (void)pos;
    if (c->ended)
        return MHD_CONTENT_READER_END_OF_STREAM;
    relay_pump(c, false);
    if (c->buf_pos < c->buf_len) {
        size_t n = c->buf_len - c->buf_pos < max ? c->buf_len - c->buf_pos : max;
        memcpy(out, c->buf + c->buf_pos, n);
        c->buf_pos += n;
        for (size_t i = n >= 2 ? n - 2 : 0; i < n; i++) {
            c->tail[0] = c->tail[1];
            c->tail[1] = out[i];
        }
        if (c->buf_pos == c->buf_len)
            c->buf_pos = c->buf_len = 0;
        return (ssize_t)n;
    }
    c->ended = true;
    if (c->failed) {
        char msg[CURL_ERROR_SIZE + POOL_URL_MAX + 64];
        snprintf(msg, sizeof msg, "the worker %s failed while streaming (%s); the answer is incomplete",
                 c->choice.url, c->curl_error);
        json_t *j = json_pack("{s:{s:s, s:s, s:n, s:s}}", "error", "message", msg, "type", "server_error", "param",
                              "code", "worker_failed_midstream");
        char *text = json_dumps(j, JSON_COMPACT);
        json_decref(j);
        /* a worker cut off inside an event leaves half a line: end it so the error event
         * parses as one */
        bool at_event_end = c->tail[0] == '\n' && c->tail[1] == '\n';
        int n = snprintf(out, max, "%sdata: %s\n\ndata: [DONE]\n\n", at_event_end ? "" : "\n\n", text ? text : "{}");
        free(text);
        count(c->r, OUT_MIDSTREAM);
        finish_choice(c, true);
        return n > 0 && (size_t)n < max ? n : MHD_CONTENT_READER_END_WITH_ERROR;
    }
    count(c->r, OUT_OK);
    finish_choice(c, false);
    return MHD_CONTENT_READER_END_OF_STREAM;
}

static void rconn_release(rconn *c)
{
    if (atomic_fetch_sub(&c->refs, 1) != 1)
        return;
    relay_end(c);
    finish_choice(c, false);
    free(c->body);
    free(c->buf);
    free(c);
}

static void stream_free(void *cls)
{
    rconn *c = cls;
    if (!c->ended) {
        count(c->r, OUT_CLIENT_GONE);
        c->ended = true;
    }
    relay_end(c); /* closing the worker's connection aborts the request there */
    finish_choice(c, false);
    rconn_release(c);
}

/* The attempt on the chosen worker failed before its answer began: the worker leaves the
 * pool (until it answers a poll) and this request's candidates; counted by cause. */
static void attempt_failed(rconn *c, bool *exclude)
{
    bool unreachable = c->result == CURLE_COULDNT_CONNECT || c->result == CURLE_OPERATION_TIMEDOUT ||
                       c->result == CURLE_COULDNT_RESOLVE_HOST;
    pthread_mutex_lock(&c->r->mu);
    c->r->attempts_failed[unreachable ? ATTEMPT_UNREACHABLE : ATTEMPT_FAILED]++;
    pthread_mutex_unlock(&c->r->mu);
    exclude[c->choice.worker] = true;
    relay_end(c);
    finish_choice(c, true);
}

static enum MHD_Result serve_completion(rconn *c, struct MHD_Connection *mc, const char *path)
{
    router *r = c->r;
    json_error_t je;
    json_t *body = json_loadb(c->body ? c->body : "", c->len, 0, &je);
    if (!json_is_object(body)) {
        json_decref(body);
        count(r, OUT_BAD_REQUEST);
        char msg[256];
        snprintf(msg, sizeof msg, "the request body is not a JSON object (%s)", je.text);
        return respond_error(mc, 400, "invalid_request_error", msg);
    }
    pool_key key;
    key_of(r, body, &key);
    bool stream = json_is_true(json_object_get(body, "stream"));
    json_decref(body);

    bool exclude[POOL_MAX_WORKERS] = {false};
    for (int attempt = 0; attempt < TRIES; attempt++) {
        if (!pool_choose(r->pool, &key, exclude, &c->choice))
            break;
        c->chosen = true;
        pthread_mutex_lock(&r->mu);
        if (c->choice.prefix_hit)
            r->prefix_routed++;
        else
            r->load_routed++;
        if (c->choice.prefill_kv[0])
            r->disaggregated++;
        pthread_mutex_unlock(&r->mu);
        if (!relay_start(c, path, mc)) {
            relay_end(c);
            finish_choice(c, false);
            count(r, OUT_INTERNAL);
            return respond_error(mc, 500, "server_error", "out of memory");
        }
        /* until its first bytes, a failing worker costs the client nothing: try another */
        relay_pump(c, false);
        long status = relay_status(c);
        if (c->failed || status == 0) {
            fprintf(stderr, "blade router: worker %s failed before answering (%s); trying another\n",
                    c->choice.url, c->curl_error);
            attempt_failed(c, exclude);
            continue;
        }
        if (stream && status == 200) {
            struct MHD_Response *resp =
                MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, c, stream_free);
            if (!resp) {
                relay_end(c);
                finish_choice(c, false);
                count(r, OUT_INTERNAL);
                return MHD_NO;
            }
            atomic_fetch_add(&c->refs, 1);
            MHD_add_response_header(resp, "Content-Type", "text/event-stream");
            MHD_add_response_header(resp, "Cache-Control", "no-cache");
            enum MHD_Result ret = MHD_queue_response(mc, MHD_HTTP_OK, resp);
            MHD_destroy_response(resp);
            return ret;
        }
        /* the whole answer, relayed with the worker's status */
        relay_pump(c, true);
        if (c->failed) {
            fprintf(stderr, "blade router: worker %s failed before its answer was complete (%s); trying another\n",
                    c->choice.url, c->curl_error);
            attempt_failed(c, exclude);
            continue;
        }
        char *text = malloc(c->buf_len + 1);
        if (!text) {
            relay_end(c);
            finish_choice(c, false);
            count(r, OUT_INTERNAL);
            return MHD_NO;
        }
        memcpy(text, c->buf, c->buf_len);
        text[c->buf_len] = 0;
        count(r, status == 200 ? OUT_OK : OUT_WORKER_STATUS);
        relay_end(c);
        finish_choice(c, false);
        enum MHD_Result ret = respond(mc, (int)status, "application/json", text);
        free(text);
        return ret;
    }
    count(r, OUT_NO_WORKER);
    return respond_error(mc, 503, "server_error", "no worker can take the request now (none is up, or all failed it)");
}

/* ---- GET ---- */

static enum MHD_Result serve_health(router *r, struct MHD_Connection *mc)
{
    char why[256], *workers = pool_describe(r->pool);
    bool etcd_ok = pool_etcd_ok(r->pool, why, sizeof why);
    json_error_t je;
    json_t *j = json_pack("{s:s, s:o}", "status", etcd_ok ? "ok" : "degraded", "workers",
                          workers ? json_loads(workers, 0, &je) : json_array());
    if (!etcd_ok)
        json_object_set_new(j, "etcd", json_pack("{s:b, s:s}", "current", 0, "reason", why));
    free(workers);
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    enum MHD_Result ret = respond(mc, 200, "application/json", text ? text : "{}");
    free(text);
    return ret;
}

static enum MHD_Result serve_metrics(router *r, struct MHD_Connection *mc)
{
    char text[4096];
    size_t n = 0;
    pthread_mutex_lock(&r->mu);
    n += (size_t)snprintf(text + n, sizeof text - n,
                          "# HELP blade_router:requests_total Requests answered, by how they ended.\n"
                          "# TYPE blade_router:requests_total counter\n");
    for (int o = 0; o < OUT_COUNT; o++)
        n += (size_t)snprintf(text + n, sizeof text - n, "blade_router:requests_total{result=\"%s\"} %llu\n",
                              outcome_names[o], (unsigned long long)r->outcomes[o]);
    n += (size_t)snprintf(text + n, sizeof text - n,
                          "# HELP blade_router:attempts_failed_total Attempts on a worker that failed before its "
                          "answer began (the request then went to another worker), by why.\n"
                          "# TYPE blade_router:attempts_failed_total counter\n");
    for (int k = 0; k < ATTEMPT_COUNT; k++)
        n += (size_t)snprintf(text + n, sizeof text - n, "blade_router:attempts_failed_total{cause=\"%s\"} %llu\n",
                              attempt_names[k], (unsigned long long)r->attempts_failed[k]);
    n += (size_t)snprintf(
        text + n, sizeof text - n,
        "# HELP blade_router:routed_total Worker choices, by reason.\n# TYPE blade_router:routed_total counter\n"
        "blade_router:routed_total{reason=\"prefix\"} %llu\nblade_router:routed_total{reason=\"load\"} %llu\n"
        "# HELP blade_router:disaggregated_total Requests sent to a decode worker with a prefill worker.\n"
        "# TYPE blade_router:disaggregated_total counter\nblade_router:disaggregated_total %llu\n",
        (unsigned long long)r->prefix_routed, (unsigned long long)r->load_routed,
        (unsigned long long)r->disaggregated);
    pthread_mutex_unlock(&r->mu);
    return respond(mc, 200, "text/plain; version=0.0.4", text);
}

static enum MHD_Result serve_models(router *r, struct MHD_Connection *mc)
{
    char url[POOL_URL_MAX + 16], *body = NULL;
    if (!pool_any(r->pool, url, POOL_URL_MAX))
        return respond_error(mc, 503, "server_error", "no worker is up");
    strcat(url, "/v1/models");
    rconn c = {.r = r};
    CURL *e = curl_easy_init();
    long status = 0;
    if (e) {
        curl_easy_setopt(e, CURLOPT_URL, url);
        curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 5000L);
        curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_worker_data);
        curl_easy_setopt(e, CURLOPT_WRITEDATA, &c);
        if (curl_easy_perform(e) == CURLE_OK)
            curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &status);
        curl_easy_cleanup(e);
    }
    if (status == 0 || !(body = malloc(c.buf_len + 1))) {
        free(c.buf);
        return respond_error(mc, 502, "server_error", "the worker did not answer GET /v1/models");
    }
    memcpy(body, c.buf, c.buf_len);
    body[c.buf_len] = 0;
    free(c.buf);
    enum MHD_Result ret = respond(mc, (int)status, "application/json", body);
    free(body);
    return ret;
}

/* ---- libmicrohttpd ---- */

static enum MHD_Result on_request(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    router *r = cls;
    (void)version;
    rconn *c = *con_cls;
    if (!c) {
        if (!(c = calloc(1, sizeof *c)))
            return MHD_NO;
        c->r = r;
        atomic_init(&c->refs, 1);
        *con_cls = c;
        return MHD_YES;
    }
    if (*upload_size) {
        if (c->len + *upload_size > MAX_BODY) {
            c->too_big = true;
        } else {
            char *grown = realloc(c->body, c->len + *upload_size + 1);
            if (!grown)
                return MHD_NO;
            c->body = grown;
            memcpy(c->body + c->len, upload, *upload_size);
            c->len += *upload_size;
            c->body[c->len] = 0;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    bool post = !strcmp(method, "POST"), get = !strcmp(method, "GET");
    if (post && (!strcmp(url, "/v1/completions") || !strcmp(url, "/v1/chat/completions"))) {
        if (c->too_big) {
            count(r, OUT_BAD_REQUEST);
            return respond_error(mc, 413, "invalid_request_error", "the request body is larger than 32 MiB");
        }
        return serve_completion(c, mc, url);
    }
    if (get && !strcmp(url, "/health"))
        return serve_health(r, mc);
    if (get && !strcmp(url, "/metrics"))
        return serve_metrics(r, mc);
    if (get && !strncmp(url, "/v1/models", 10))
        return serve_models(r, mc);
    return respond_error(mc, 404, "invalid_request_error", "no such endpoint");
}

static void on_completed(void *cls, struct MHD_Connection *mc, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    (void)cls;
    (void)mc;
    (void)toe;
    rconn *c = *con_cls;
    if (!c)
        return;
    rconn_release(c);
    *con_cls = NULL;
}

router *router_start(const router_config *cfg, blade_error *err)
{
    router *r = calloc(1, sizeof *r);
    if (!r)
        return blade_error_set(err, "out of memory"), NULL;
    r->cfg = *cfg;
    pthread_mutex_init(&r->mu, NULL);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (!(r->pool = pool_new(&cfg->pool, err))) {
        router_stop(r);
        return NULL;
    }
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
    bool v6 = strchr(cfg->host, ':') != NULL;
    if (v6 ? inet_pton(AF_INET6, cfg->host, &a6->sin6_addr) != 1 : inet_pton(AF_INET, cfg->host, &a4->sin_addr) != 1) {
        blade_error_set(err, "--listen: '%s' is not a numeric address", cfg->host);
        router_stop(r);
        return NULL;
    }
    if (v6) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)cfg->port);
    } else {
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)cfg->port);
    }
    r->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | (v6 ? MHD_USE_IPv6 : 0),
                            0, NULL, NULL, on_request, r, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, r, MHD_OPTION_CONNECTION_TIMEOUT, 600u,
                            MHD_OPTION_END);
    if (!r->d) {
        blade_error_set(err, "cannot listen on %s:%d (in use, or not an address of this host)", cfg->host, cfg->port);
        router_stop(r);
        return NULL;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(r->d, MHD_DAEMON_INFO_BIND_PORT);
    r->port = di ? di->port : cfg->port;
    return r;
}

int router_port(const router *r)
{
    return r->port;
}

void router_stop(router *r)
{
    if (!r)
        return;
    if (r->d)
        MHD_stop_daemon(r->d);
    pool_free(r->pool);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

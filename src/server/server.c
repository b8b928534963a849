/* `blade serve`'s HTTP server (see server.h): the access handler of libmicrohttpd, the
 * OpenAI endpoints, streaming, and the lifecycle; connections come through the gate. */
#include "server/server.h"

#include "api/api.h"
#include "common/test_aid.h"
#include "server/cache_front.h"
#include "server/gate.h"
#include "server/http_head.h"
#include "server/metrics.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum route { R_NONE, R_HEALTH, R_METRICS, R_MODELS, R_MODEL, R_COMPLETIONS, R_CHAT, R_EMBEDDINGS };
enum state { S_LOADING, S_READY, S_DRAINING };

typedef struct conn {
    server *s;
    struct MHD_Connection *mc;
    enum route route;
    const char *model_id; /* R_MODEL */
    double t_start;
    int status;           /* what was queued; 0 while nothing was */
    gate_conn *gc;        /* the connection's record at the gate (NULL: not the gate's) */
    bool close;           /* answer with Connection: close */
    api_buf body;
    size_t received;      /* body bytes read, kept or not */
    api_sink sink;
    api_job *job;
    bool admitted;        /* counted in server.inflight and listed in server.active */
    bool waiting_first;   /* counted in server.queued until its first event */
    atomic_int kick;      /* set by the drain: abort with 503 */
    bool disconnected;
    double deadline;      /* 0: none */
    int fd;               /* the client's socket, watched for hang-ups */
    cache_ticket ticket;  /* the request's part in the semantic cache */
    api_buf out;          /* stream bytes not yet handed to libmicrohttpd */
    size_t out_pos;
    bool out_end;
    bool held;            /* the stream has had its test-aid hold */
    struct conn *next, *prev; /* server.active, from admission until the answer is sent */
} conn;

struct server {
    server_config cfg;
    struct MHD_Daemon *d;
    gate *gate;
    int port;
    bool has_key;
    unsigned char key_hash[32];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    enum state state;
    api_model *am;
    blade_semcache *semcache; /* NULL: off; set before the state turns ready */
    int inflight; /* admitted requests not yet answered in full */
    int queued;   /* jobs that have not produced an event yet */
    conn *active;
    metrics m;
    char role[16];     /* both, prefill or decode */
    char kv_addr[300]; /* prefill role: HOST:PORT of the KV service */
    /* Test aid (common/test_aid.h) for fault tests that SIGKILL a worker mid-answer:
     * BLADE_TEST_ANSWER_HOLD_MS holds a stream after its first chunk, and any other
     * completion before its response, for that long. */
    int hold_answer_ms;
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- responses ---- */

static enum MHD_Result respond(conn *c, int status, const char *ctype, char *body, size_t len, const char *hname,
                               const char *hvalue)
{
    if (!body)
        return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    if (hname)
        MHD_add_response_header(r, hname, hvalue);
    if (c->close)
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ret = MHD_queue_response(c->mc, (unsigned int)status, r);
    MHD_destroy_response(r);
    if (ret == MHD_YES)
        c->status = status;
    return ret;
}

static enum MHD_Result respond_json(conn *c, int status, json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return respond(c, status, "application/json", s, s ? strlen(s) : 0, NULL, NULL);
}

static enum MHD_Result respond_error_with(conn *c, const api_error *e, const char *hname, const char *hvalue)
{
    size_t len;
    char *s = api_error_body(e, &len);
    return respond(c, e->status, "application/json", s, len, hname, hvalue);
}

static enum MHD_Result respond_error(conn *c, const api_error *e)
{
    return respond_error_with(c, e, NULL, NULL);
}

/* ---- routing and admission ---- */

static enum route find_route(const char *url, const char **model_id)
{
    if (!strcmp(url, "/health"))
        return R_HEALTH;
    if (!strcmp(url, "/metrics"))
        return R_METRICS;
    if (!strcmp(url, "/v1/models"))
        return R_MODELS;
    if (!strncmp(url, "/v1/models/", 11) && url[11]) {
        *model_id = url + 11;
        return R_MODEL;
    }
    if (!strcmp(url, "/v1/completions"))
        return R_COMPLETIONS;
    if (!strcmp(url, "/v1/chat/completions"))
        return R_CHAT;
    if (!strcmp(url, "/v1/embeddings"))
        return R_EMBEDDINGS;
    return R_NONE;
}

static void key_digest(const char *key, size_t len, unsigned char out[32])
{
    unsigned int n = 0;
    EVP_Digest(key, len, out, &n, EVP_sha256(), NULL);
}

/* The key is compared through its digest with a constant-time compare, so neither the
 * contents nor the length of the expected key leak through timing. */
static bool authorized(server *s, struct MHD_Connection *mc, api_error *err)
{
    if (!s->has_key)
        return true;
    const char *h = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h) {
        api_error_set(err, 401, "invalid_request_error", "missing_api_key", NULL,
                      "No API key was provided: send the header 'Authorization: Bearer <key>'");
        return false;
    }
    if (strncasecmp(h, "Bearer ", 7)) {
        api_error_set(err, 401, "invalid_request_error", "invalid_api_key", NULL,
                      "The Authorization header must have the form 'Bearer <key>'");
        return false;
    }
    const char *key = h + 7;
    while (*key == ' ')
        key++;
    unsigned char digest[32];
    key_digest(key, strlen(key), digest);
    if (CRYPTO_memcmp(digest, s->key_hash, sizeof digest)) {
        api_error_set(err, 401, "invalid_request_error", "invalid_api_key", NULL, "Incorrect API key provided");
        return false;
    }
    return true;
}

static const char *state_message(enum state st)
{
    return st == S_LOADING ? "the model is still loading; try again shortly"
                           : "the server is shutting down and takes no new requests";
}

static enum MHD_Result framing_field(void *cls, enum MHD_ValueKind kind, const char *key, const char *value)
{
    (void)kind;
    http_framing_field(cls, key, strlen(key), value ? value : "", value ? strlen(value) : 0);
    return MHD_YES;
}

/* The gate checked the first request of the connection byte by byte; later ones on a
 * keep-alive connection are checked here, from the fields libmicrohttpd parsed, before any
 * of the body is read. An answer given now, before the body, closes the connection, so a
 * body that is not read can never be taken for the next request. */
static enum MHD_Result first_call(conn *c, const char *url, const char *method, const char *version)
{
    server *s = c->s;
    api_error err;
    http_framing f = {0};
    MHD_get_connection_values(c->mc, MHD_HEADER_KIND, framing_field, &f);
    c->close = (f.n_length && f.length) || f.n_te;
    if (http_framing_check(&f, strcmp(version, MHD_HTTP_VERSION_1_0) ? 1 : 0, &err))
        return respond_error(c, &err);
    c->route = find_route(url, &c->model_id);
    if (c->route == R_NONE) {
        api_error_set(&err, 404, "invalid_request_error", "unknown_url", NULL,
                      "Unknown request URL: %.32s %.200s. This server answers POST /v1/completions, POST "
                      "/v1/chat/completions, POST /v1/embeddings, GET /v1/models, GET /health and GET /metrics",
                      method, url);
        return respond_error(c, &err);
    }
    bool post = c->route == R_COMPLETIONS || c->route == R_CHAT || c->route == R_EMBEDDINGS;
    bool ok = post ? !strcmp(method, "POST") : (!strcmp(method, "GET") || !strcmp(method, "HEAD"));
    if (!ok) {
        api_error_set(&err, 405, "invalid_request_error", "method_not_allowed", NULL,
                      "Method %.32s is not allowed on %.200s; use %s", method, url, post ? "POST" : "GET");
        return respond_error_with(c, &err, MHD_HTTP_HEADER_ALLOW, post ? "POST" : "GET, HEAD");
    }
    if (c->route == R_HEALTH || c->route == R_METRICS)
        return MHD_YES;
    if (!authorized(s, c->mc, &err))
        return respond_error_with(c, &err, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    pthread_mutex_lock(&s->mu);
    enum state st = s->state;
    pthread_mutex_unlock(&s->mu);
    if (st != S_READY) {
        api_error_set(&err, 503, "server_error", "unavailable", NULL, "%s", state_message(st));
        return respond_error(c, &err);
    }
    if (post && f.n_length && f.length > s->cfg.max_body) {
        api_error_set(&err, 413, "invalid_request_error", "request_too_large", NULL,
                      "The request body is %llu bytes; the limit is %zu bytes (--max-body)",
                      (unsigned long long)f.length, s->cfg.max_body);
        return respond_error(c, &err);
    }
    return MHD_YES;
}

/* Admission of a job: refused while draining (503) or when too many requests already wait
 * for their first token (429). The job is registered at once, so the limit holds under
 * any number of concurrent connections. */
static bool admit(conn *c, api_error *err)
{
    server *s = c->s;
    bool ok = false;
    pthread_mutex_lock(&s->mu);
    if (s->state != S_READY) {
        api_error_set(err, 503, "server_error", "unavailable", NULL, "%s", state_message(s->state));
    } else if (s->queued >= s->cfg.max_queue) {
        api_error_set(err, 429, "rate_limit_exceeded", "rate_limit_exceeded", NULL,
                      "%d requests are already waiting to start (--max-queue %d); try again later", s->queued,
                      s->cfg.max_queue);
    } else {
        s->queued++;
        s->inflight++;
        c->admitted = true;
        c->waiting_first = true;
        c->next = s->active;
        c->prev = NULL;
        if (s->active)
            s->active->prev = c;
        s->active = c;
        ok = true;
    }
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static void started(conn *c)
{
    pthread_mutex_lock(&c->s->mu);
    if (c->waiting_first)
        c->s->queued--;
    c->waiting_first = false;
    pthread_mutex_unlock(&c->s->mu);
}

/* The request is answered in full (or its client is gone): a drain may end once every
 * admitted request got here, so a stream's last bytes are never cut off. */
static void leave(conn *c)
{
    server *s = c->s;
    pthread_mutex_lock(&s->mu);
    if (c->waiting_first)
        s->queued--;
    c->waiting_first = false;
    s->inflight--;
    c->admitted = false;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->active = c->next;
    if (c->next)
        c->next->prev = c->prev;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---- driving a job ---- */

static void pump(conn *c, api_buf *sse)
{
    api_event *ev = api_sink_take(&c->sink);
    if (ev && c->waiting_first)
        started(c);
    while (ev) {
        api_event *next = ev->next;
        api_timing t;
        api_job_apply(c->job, ev, sse, &t);
        metrics_observe(&c->s->m, &t);
        api_event_free(ev);
        ev = next;
    }
}

enum wake { WAKE_EVENTS, WAKE_DEADLINE, WAKE_GONE };

/* Sleeps until an event arrives, the deadline passes or the client hangs up. Only
 * POLLRDHUP is asked of the socket: data a client pipelines behind its request must not
 * count as a hang-up. */
static enum wake wait_step(conn *c)
{
    struct pollfd p[2] = {{.fd = c->sink.fd, .events = POLLIN}, {.fd = c->fd, .events = POLLRDHUP}};
    nfds_t n = c->fd >= 0 && !c->disconnected ? 2 : 1;
    int ms = -1;
    if (c->deadline > 0) {
        double left = c->deadline - now();
        if (left <= 0)
            return WAKE_DEADLINE;
        ms = left > 3600 ? 3600 * 1000 : (int)(left * 1000) + 1;
    }
    int r = poll(p, n, ms);
    if (r == 0)
        return c->deadline > 0 && now() >= c->deadline ? WAKE_DEADLINE : WAKE_EVENTS;
    if (r > 0 && n == 2 && (p[1].revents & (POLLRDHUP | POLLHUP | POLLERR)))
        return WAKE_GONE;
    return WAKE_EVENTS;
}

/* Runs the job until it is done or, when streaming, until there are bytes to send. */
static void drive(conn *c, api_buf *sse)
{
    for (;;) {
        if (atomic_exchange(&c->kick, 0)) {
            char msg[160];
            snprintf(msg, sizeof msg, "the server is shutting down: the request was aborted after the drain timeout "
                                      "of %g s",
                     c->s->cfg.drain_timeout);
            api_job_abort(c->job, 503, "server_error", msg);
        }
        pump(c, sse);
        if (api_job_done(c->job) || (sse && (sse->len > 0 || sse->failed)))
            return;
        switch (wait_step(c)) {
        case WAKE_DEADLINE: {
            char msg[160];
            snprintf(msg, sizeof msg, "the request took longer than the server's limit of %g s (--timeout) and was "
                                      "aborted",
                     c->s->cfg.timeout);
            c->deadline = 0;
            api_job_abort(c->job, 504, "timeout", msg);
            break;
        }
        case WAKE_GONE:
            c->disconnected = true;
            api_job_abort(c->job, 499, "client_closed", "the client closed the connection");
            if (sse)
                return;
            break;
        case WAKE_EVENTS: break;
        }
    }
}

static void end_job(conn *c)
{
    if (!c->job)
        return;
    if (!api_job_done(c->job)) {
        c->disconnected = true;
        api_job_abort(c->job, 499, "client_closed", "the client closed the connection");
        drive(c, NULL);
    }
    if (api_job_status(c->job) == 200)
        metrics_observe_e2e(&c->s->m, now() - c->t_start);
    if (c->ticket.active)
        cache_store(c->s->semcache, &c->ticket, c->job);
    cache_ticket_free(&c->ticket);
    started(c);
    api_job_free(c->job);
    c->job = NULL;
}

/* The job is over: from now on a connection that makes no progress is idle again (the
 * switch from no timeout restarts libmicrohttpd's clock, so the wait is not held against it). */
static void idle_again(conn *c)
{
    MHD_set_connection_option(c->mc, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned int)c->s->cfg.idle_timeout);
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    conn *c = cls;
    if (pos > 0 && !c->held) {
        c->held = true;
        blade_test_aid_hold("BLADE_TEST_ANSWER_HOLD_MS", c->s->hold_answer_ms, "a stream after its first chunk");
    }
    for (;;) {
        if (c->out.failed)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        if (c->out_pos < c->out.len) {
            size_t n = c->out.len - c->out_pos;
            if (n > max)
                n = max;
            memcpy(buf, c->out.data + c->out_pos, n);
            c->out_pos += n;
            if (c->out_pos == c->out.len)
                c->out.len = c->out_pos = 0;
            return (ssize_t)n;
        }
        if (c->out_end)
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (api_job_done(c->job)) {
            api_job_stream_end(c->job, &c->out);
            end_job(c);
            c->out_end = true;
            idle_again(c);
            continue;
        }
        drive(c, &c->out);
        if (c->disconnected)
            return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

/* Decode role: has a prefill worker compute the request's prompt; true with req->import
 * pointing into rp when it did. A failure is logged and counted, and the prompt is then
 * computed here: the answer is the same. */
static bool remote_prefill(conn *c, api_request *req, blade_remote_prefill *rp)
{
    server *s = c->s;
    if (!s->cfg.disagg || req->ep == API_EMBEDDINGS || req->n_prompts != 1 || req->n != 1 || req->logprobs >= 0)
        return false;
    const char *peer = MHD_lookup_connection_value(c->mc, MHD_HEADER_KIND, "X-Blade-Prefill");
    if (!peer || !*peer)
        peer = s->cfg.prefill_peer;
    if (!peer || !*peer)
        return false;
    char host[256];
    uint16_t port;
    blade_error err = {{0}};
    blade_disagg_cause cause = BLADE_DISAGG_LOCAL;
    if (!blade_disagg_parse_peer(peer, host, sizeof host, &port, &err)) {
        blade_request q;
        blade_request_default(&q);
        q.prompt_tokens = req->prompts[0].tokens;
        q.n_prompt_tokens = req->prompts[0].n_tokens;
        q.sampling = req->sampling;
        q.cache_salt = req->cache_salt;
        cause = blade_remote_prefill_run(s->am->engine, s->cfg.disagg, host, port, &q, rp, &err);
    }
    metrics_remote_prefill(&s->m, cause);
    if (cause != BLADE_DISAGG_OK) {
        fprintf(stderr, "blade serve: remote prefill at %s not used (%s): %s; computing the prompt here\n", peer,
                blade_disagg_cause_name(cause), err.msg);
        return false;
    }
    req->import = &rp->in.import;
    return true;
}

/* The key the client presented (whether or not the server checks keys): half of its
 * tenant in the semantic cache. */
static const char *presented_key(conn *c)
{
    const char *h = MHD_lookup_connection_value(c->mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7))
        return NULL;
    h += 7;
    while (*h == ' ')
        h++;
    return h;
}

/* Answers from the semantic cache: the stored text replayed in the request's own shape
 * (a stream when it asked for one), no token generated, the hit named in a header and in a
 * "semantic_cache" field of the response (of every chunk, when streaming). */
static enum MHD_Result serve_hit(conn *c, api_request *req, const blade_semcache_hit *hit)
{
    api_error err;
    api_buf sse = {0};
    bool stream = req->stream;
    api_job *job = api_job_replay(c->s->am, req, hit->response.text, hit->response.text_len, cache_hit_finish(hit),
                                  "semantic_cache", cache_hit_json(hit), stream ? &sse : NULL, &err);
    if (!job)
        return respond_error(c, &err);
    started(c);
    char header[96];
    cache_hit_header(hit, header, sizeof header);
    enum MHD_Result ret;
    if (stream) {
        ret = sse.failed ? MHD_NO
                         : respond(c, 200, "text/event-stream", sse.data ? sse.data : strdup(""), sse.len,
                                   "X-Blade-Semantic-Cache", header);
    } else {
        json_t *resp = api_job_response(job);
        char *body = json_dumps(resp, JSON_COMPACT);
        json_decref(resp);
        ret = respond(c, 200, "application/json", body, body ? strlen(body) : 0, "X-Blade-Semantic-Cache", header);
    }
    metrics_observe_e2e(&c->s->m, now() - c->t_start);
    api_job_free(job);
    idle_again(c);
    return ret;
}

static enum MHD_Result serve_completion(conn *c)
{
    server *s = c->s;
    api_error err;
    api_request req;
    api_endpoint ep = c->route == R_CHAT ? API_CHAT : c->route == R_EMBEDDINGS ? API_EMBEDDINGS : API_COMPLETIONS;
    int rc = api_parse_body(s->am, ep, c->body.data ? c->body.data : "", c->body.len, &req, &err);
    api_buf_free(&c->body);
    if (rc)
        return respond_error(c, &err);
    blade_error berr = {{0}};
    if (api_sink_init(&c->sink, &berr)) {
        api_request_free(&req);
        api_error_set(&err, 500, "server_error", NULL, NULL, "%s", berr.msg);
        return respond_error(c, &err);
    }
    if (!admit(c, &err)) {
        api_request_free(&req);
        return respond_error(c, &err);
    }
    if (s->semcache) {
        if (cache_ticket_init(&c->ticket, s->am, &req, presented_key(c))) {
            api_request_free(&req);
            api_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
            return respond_error(c, &err);
        }
        blade_semcache_hit hit = {0};
        double deadline = s->cfg.timeout > 0 ? c->t_start + s->cfg.timeout : 0;
        if (c->ticket.active && cache_lookup(s->semcache, s->am, &req, &c->ticket, deadline, &hit)) {
            enum MHD_Result ret = serve_hit(c, &req, &hit);
            blade_semcache_hit_clear(&hit);
            cache_ticket_free(&c->ticket);
            return ret;
        }
    }
    bool stream = req.stream;
    blade_remote_prefill rp;
    bool remote = remote_prefill(c, &req, &rp);
    c->job = api_job_submit(s->am, &req, &c->sink, c->t_start, &err);
    if (remote)
        blade_remote_prefill_free(&rp);
    if (!c->job)
        return respond_error(c, &err);
    /* While the job runs, silence on the wire is the engine thinking (a long queue or
     * prefill), not an idle client: only --timeout bounds it. */
    MHD_set_connection_option(c->mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c->mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    c->fd = ci ? ci->connect_fd : -1;
    c->deadline = s->cfg.timeout > 0 ? c->t_start + s->cfg.timeout : 0;

    if (stream) {
        c->held = false;
        api_job_stream_start(c->job, &c->out);
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, c, NULL);
        if (!r)
            return MHD_NO;
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        enum MHD_Result ret = MHD_queue_response(c->mc, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        if (ret == MHD_YES)
            c->status = 200;
        return ret;
    }
    drive(c, NULL);
    if (c->disconnected) {
        end_job(c);
        return MHD_NO;
    }
    int status = api_job_status(c->job);
    json_t *resp = api_job_response(c->job);
    end_job(c);
    idle_again(c);
    blade_test_aid_hold("BLADE_TEST_ANSWER_HOLD_MS", s->hold_answer_ms, "an answer before sending it");
    return respond_json(c, status, resp);
}

static enum MHD_Result serve_get(conn *c)
{
    server *s = c->s;
    pthread_mutex_lock(&s->mu);
    enum state st = s->state;
    blade_semcache *cache = s->semcache;
    int queued = s->queued;
    pthread_mutex_unlock(&s->mu);
    if (c->route == R_HEALTH) {
        const char *word = st == S_READY ? "ok" : st == S_LOADING ? "loading" : "draining";
        json_t *j = json_pack("{s:s, s:s}", "status", word, "role", s->role);
        /* what a router pairs workers by: KV from engines with another fingerprint never mixes */
        if (j && st != S_LOADING) {
            char hex[2 * BLADE_ENGINE_FINGERPRINT_BYTES + 1];
            blade_engine_fingerprint_hex(s->am->engine, hex);
            json_object_set_new(j, "kv_fingerprint", json_string(hex));
        }
        if (j && s->kv_addr[0])
            json_object_set_new(j, "kv", json_string(s->kv_addr));
        return respond_json(c, st == S_READY ? 200 : 503, j);
    }
    if (c->route == R_METRICS) {
        api_buf out = {0};
        metrics_render(&s->m, st == S_LOADING ? NULL : s->am->engine, queued, &out);
        if (cache)
            metrics_render_semcache(cache, &out);
        if (out.failed) {
            api_buf_free(&out);
            return MHD_NO;
        }
        return respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", out.data ? out.data : strdup(""), out.len,
                       NULL, NULL);
    }
    json_t *j = api_models_json(s->am, c->route == R_MODEL ? c->model_id : NULL);
    if (!j) {
        api_error err;
        api_error_set(&err, 404, "invalid_request_error", "model_not_found", "model",
                      "The model '%.200s' does not exist; this server serves '%s'", c->model_id, s->am->names[0]);
        return respond_error(c, &err);
    }
    return respond_json(c, 200, j);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    server *s = cls;
    conn *c = *con_cls;
    if (!c) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        gate_conn *gc = ci ? ci->socket_context : NULL;
        /* the watchdog already answered 408: nothing more may be written */
        if (!gate_request_head(s->gate, gc) || !(c = calloc(1, sizeof *c)))
            return MHD_NO;
        c->s = s;
        c->mc = mc;
        c->gc = gc;
        c->t_start = now();
        c->fd = -1;
        c->sink.fd = -1;
        atomic_init(&c->kick, 0);
        *con_cls = c;
        metrics_in_flight(&s->m, 1);
        /* the body has its own deadlines at the gate, which answer 408 where libmicrohttpd's
         * idle timeout would close without a word */
        MHD_set_connection_option(mc, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
        enum MHD_Result r = first_call(c, url, method, version);
        if (c->status)
            gate_request_body(s->gate, gc);
        return r;
    }
    if (c->status) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        gate_request_progress(s->gate, c->gc);
        c->received += *upload_size;
        if (c->received > s->cfg.max_body) {
            /* libmicrohttpd cannot answer in the middle of an upload: the rest is read and
             * dropped so the client gets its 413, but an upload that goes on far past the
             * limit has the connection closed instead. */
            api_buf_free(&c->body);
            *upload_size = 0;
            if (c->received > 2 * s->cfg.max_body + (1u << 20)) {
                c->status = 413;
                return MHD_NO;
            }
            return MHD_YES;
        }
        api_buf_append(&c->body, upload, *upload_size);
        *upload_size = 0;
        if (c->body.failed) {
            api_error err;
            api_error_set(&err, 500, "server_error", NULL, NULL, "out of memory while reading the request body");
            return respond_error(c, &err);
        }
        return MHD_YES;
    }
    if (!gate_request_body(s->gate, c->gc))
        return MHD_NO;
    idle_again(c);
    c->close = gate_conn_reserved(c->gc);
    if (c->received > s->cfg.max_body) {
        api_error err;
        api_error_set(&err, 413, "invalid_request_error", "request_too_large", NULL,
                      "The request body is %zu bytes; the limit is %zu bytes (--max-body)", c->received,
                      s->cfg.max_body);
        return respond_error(c, &err);
    }
    if (c->route == R_COMPLETIONS || c->route == R_CHAT || c->route == R_EMBEDDINGS)
        return serve_completion(c);
    return serve_get(c);
}

static void on_completed(void *cls, struct MHD_Connection *mc, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    server *s = cls;
    conn *c = *con_cls;
    (void)mc;
    if (!c)
        return;
    end_job(c);
    cache_ticket_free(&c->ticket);
    if (c->admitted)
        leave(c);
    bool cut = gate_request_done(s->gate, c->gc);
    bool gone = c->disconnected || (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK && !c->out_end && c->status == 200);
    if (!cut)
        metrics_count_status(&s->m, gone || !c->status ? 499 : c->status);
    metrics_in_flight(&s->m, -1);
    api_buf_free(&c->body);
    api_buf_free(&c->out);
    api_sink_destroy(&c->sink);
    free(c);
    *con_cls = NULL;
}

/* ---- connections, through the gate ---- */

static bool hand_off(void *ctx, int fd, const struct sockaddr *sa, socklen_t len)
{
    server *s = ctx;
    return MHD_add_connection(s->d, fd, sa, len) == MHD_YES;
}

static void gate_answered(void *ctx, int status)
{
    server *s = ctx;
    metrics_count_status(&s->m, status);
}

static void on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    server *s = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
        *socket_context = ci ? gate_conn_started(s->gate, ci->connect_fd) : NULL;
    } else {
        gate_conn_closed(s->gate, *socket_context);
        *socket_context = NULL;
    }
}

/* ---- lifecycle ---- */

static int listen_on(const char *host, int port, int *bound_port, blade_error *err)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int g = getaddrinfo(host, ps, &hints, &res);
    if (g)
        return blade_error_set(err, "--host %s: %s", host, gai_strerror(g));
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        bind(fd, res->ai_addr, res->ai_addrlen) || listen(fd, 512)) {
        blade_error_set(err, "cannot listen on %s port %d: %s", host, port, strerror(errno));
        if (fd >= 0)
            close(fd);
        freeaddrinfo(res);
        return -1;
    }
    freeaddrinfo(res);
    struct sockaddr_storage sa;
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    *bound_port = sa.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&sa)->sin6_port)
                                           : ntohs(((struct sockaddr_in *)&sa)->sin_port);
    return fd;
}

server *server_start(const server_config *cfg, blade_error *err)
{
    server *s = calloc(1, sizeof *s);
    if (!s)
        return blade_error_set(err, "out of memory"), NULL;
    s->cfg = *cfg;
    s->hold_answer_ms = blade_test_aid_ms("BLADE_TEST_ANSWER_HOLD_MS");
    snprintf(s->role, sizeof s->role, "both");
    if (cfg->api_key) {
        s->has_key = true;
        key_digest(cfg->api_key, strlen(cfg->api_key), s->key_hash);
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    metrics_init(&s->m);
    int fd = listen_on(cfg->host, cfg->port, &s->port, err);
    if (fd < 0) {
        server_stop(s);
        return NULL;
    }
    /* libmicrohttpd gets only the connections the gate hands it. Its own limit is a backstop
     * above the gate's (which keeps the count), with room for the probe slots and for the
     * moment between a close and libmicrohttpd's bookkeeping of it. Its pool must hold the
     * largest head the gate lets through. */
    unsigned int flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                         MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC;
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, s, MHD_OPTION_CONNECTION_LIMIT,
                            (unsigned int)cfg->max_connections + GATE_PROBE_SLOTS + 64,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)65536, MHD_OPTION_STRICT_FOR_CLIENT, 1,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)cfg->idle_timeout, MHD_OPTION_END);
    if (!s->d) {
        close(fd);
        blade_error_set(err, "cannot start the HTTP server on %s port %d", cfg->host, s->port);
        server_stop(s);
        return NULL;
    }
    gate_config gc = {.max_connections = cfg->max_connections, .max_per_ip = cfg->max_connections_per_ip,
                      .cap_loopback = cfg->limit_loopback, .header_timeout = cfg->header_timeout,
                      .body_timeout = cfg->body_timeout, .idle_timeout = cfg->idle_timeout,
                      .max_body = cfg->max_body};
    gate_hooks hooks = {.ctx = s, .hand_off = hand_off, .answered = gate_answered};
    if (!(s->gate = gate_new(fd, &gc, &hooks, err)) || gate_run(s->gate, err)) {
        server_stop(s);
        return NULL;
    }
    return s;
}

int server_port(const server *s)
{
    return s->port;
}

void server_set_semantic_cache(server *s, blade_semcache *c)
{
    pthread_mutex_lock(&s->mu);
    s->semcache = c;
    pthread_mutex_unlock(&s->mu);
}

void server_set_model(server *s, api_model *am)
{
    pthread_mutex_lock(&s->mu);
    s->am = am;
    s->state = S_READY;
    pthread_mutex_unlock(&s->mu);
}

void server_set_role(server *s, const char *role, blade_prefill_service *ps, const char *kv_addr)
{
    pthread_mutex_lock(&s->mu);
    snprintf(s->role, sizeof s->role, "%s", role);
    snprintf(s->kv_addr, sizeof s->kv_addr, "%s", kv_addr ? kv_addr : "");
    s->m.prefill = ps;
    pthread_mutex_unlock(&s->mu);
}

static void wait_inflight(server *s, double seconds)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    double t = (double)until.tv_sec + (double)until.tv_nsec * 1e-9 + seconds;
    until.tv_sec = (time_t)t;
    until.tv_nsec = (long)((t - (double)until.tv_sec) * 1e9);
    while (s->inflight > 0)
        if (pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT)
            break;
}

void server_drain(server *s)
{
    pthread_mutex_lock(&s->mu);
    if (s->state == S_READY)
        s->state = S_DRAINING;
    wait_inflight(s, s->cfg.drain_timeout);
    if (s->inflight > 0) {
        uint64_t one = 1;
        for (conn *c = s->active; c; c = c->next) {
            atomic_store(&c->kick, 1);
            ssize_t w = write(c->sink.fd, &one, sizeof one);
            (void)w;
        }
        /* An aborted request ends within one engine step; the bound only guards against a
         * client that stopped reading its stream. */
        wait_inflight(s, 10.0);
    }
    pthread_mutex_unlock(&s->mu);
}

void server_stop(server *s)
{
    if (!s)
        return;
    gate_stop(s->gate);
    if (s->d)
        MHD_stop_daemon(s->d);
    gate_free(s->gate);
    metrics_destroy(&s->m);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

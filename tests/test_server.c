/* `blade serve` end to end, over real sockets against a real server process: OpenAI shapes,
 * greedy output equal to `blade run`, prefix caching through the API, streaming, n/seed/
 * logprobs, a suite of hostile requests, client disconnects freeing KV blocks, the queue
 * and time limits, and draining on SIGTERM. */
#include "testutil.h"

#include "blade/chat_template.h"
#include "blade/model.h"
#include "blade/synth.h"
#include "blade/tokenizer.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define API_KEY "test-key-123"

typedef struct srv {
    pid_t pid;
    int port;
    FILE *out;
    char log[8192]; /* what it printed until ready */
} srv;

static srv g_main;
static srv g_extra; /* the second server of a test, killed by its teardown if the test fails */
static char *g_model;
static char *g_template_file;
static char *g_template_source;

/* ---- the server process ---- */

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Starts `blade serve ARGS --port 0` and waits until it says it is ready. */
static void srv_start(srv *s, const char *args)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "exec '%s' serve -m '%s' --port 0 --kv-mem 64M -t 2 %s", BLADE_BINARY, g_model, args);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* the server must not outlive a test binary that crashes */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    s->pid = pid;
    s->out = fdopen(fds[0], "r");
    s->port = 0;
    s->log[0] = 0;
    char line[1024];
    while (fgets(line, sizeof line, s->out)) {
        size_t used = strlen(s->log);
        snprintf(s->log + used, sizeof s->log - used, "%s", line);
        const char *p = strstr(line, "listening on http://127.0.0.1:");
        if (p)
            s->port = atoi(p + strlen("listening on http://127.0.0.1:"));
        if (strstr(line, "blade serve: ready"))
            return;
    }
    fail_msg("blade serve exited before it was ready (%s)", cmd);
}

/* SIGTERM, then the exit status (which under ASan also reports leaks). */
static int srv_stop(srv *s)
{
    kill(s->pid, SIGTERM);
    int status = 0;
    double until = mono() + 60;
    pid_t r;
    while ((r = waitpid(s->pid, &status, WNOHANG)) == 0 && mono() < until)
        usleep(20000);
    if (r == 0) {
        kill(s->pid, SIGKILL);
        waitpid(s->pid, &status, 0);
        fclose(s->out);
        return -1;
    }
    fclose(s->out);
    s->pid = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int stop_extra(void **state)
{
    (void)state;
    if (g_extra.pid > 0) {
        kill(g_extra.pid, SIGKILL);
        waitpid(g_extra.pid, NULL, 0);
        fclose(g_extra.out);
        g_extra.pid = 0;
    }
    return 0;
}

/* ---- a raw HTTP/1.1 client (every byte under the test's control) ---- */

/* Connects from the loopback address src (all of 127/8 is this machine), or any if NULL. */
static int dial_from(int port, const char *src)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    if (src) {
        struct sockaddr_in b = {.sin_family = AF_INET};
        assert_int_equal(inet_pton(AF_INET, src, &b.sin_addr), 1);
        assert_int_equal(bind(fd, (struct sockaddr *)&b, sizeof b), 0);
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    struct timeval tv = {.tv_sec = 120};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static int dial(int port)
{
    return dial_from(port, NULL);
}

static bool send_all(int fd, const void *data, size_t n)
{
    const char *p = data;
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

static char *recv_all(int fd, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        ssize_t r = recv(fd, buf + n, cap - n, 0);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

typedef struct resp {
    int status;
    char *raw;
    char *body; /* de-chunked, NUL-terminated */
    size_t body_len;
} resp;

static void resp_free(resp *r)
{
    free(r->raw);
    free(r->body);
    memset(r, 0, sizeof *r);
}

static void parse_resp(char *raw, size_t n, resp *r)
{
    memset(r, 0, sizeof *r);
    r->raw = raw;
    if (sscanf(raw, "HTTP/1.1 %d", &r->status) != 1)
        r->status = 0;
    char *hend = strstr(raw, "\r\n\r\n");
    r->body = calloc(1, n + 1);
    if (!hend)
        return;
    *hend = 0;
    char *b = hend + 4;
    size_t blen = n - (size_t)(b - raw);
    bool chunked = strcasestr(raw, "Transfer-Encoding: chunked") != NULL;
    if (!chunked) {
        memcpy(r->body, b, blen);
        r->body_len = blen;
        return;
    }
    char *end = b + blen;
    while (b < end) {
        char *nl;
        unsigned long sz = strtoul(b, &nl, 16);
        if (nl == b || !(nl = strstr(nl, "\r\n")) || sz == 0)
            break;
        b = nl + 2;
        if (b + sz > end)
            sz = (unsigned long)(end - b);
        memcpy(r->body + r->body_len, b, sz);
        r->body_len += sz;
        b += sz + 2;
    }
}

static void build_request(char *out, size_t cap, const char *method, const char *path, const char *headers,
                          size_t body_len, bool auth)
{
    snprintf(out, cap,
             "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s%s%sContent-Type: "
             "application/json\r\nContent-Length: %zu\r\n\r\n",
             method, path, auth ? "Authorization: Bearer " API_KEY "\r\n" : "", headers ? headers : "",
             headers && *headers && headers[strlen(headers) - 1] != '\n' ? "\r\n" : "", body_len);
}

static void http_raw(int port, const void *req, size_t len, resp *r)
{
    int fd = dial(port);
    send_all(fd, req, len);
    size_t n;
    char *raw = recv_all(fd, &n);
    close(fd);
    parse_resp(raw, n, r);
}

static void http_ex(int port, const char *method, const char *path, const char *headers, const char *body,
                    size_t body_len, bool auth, resp *r)
{
    char head[2048];
    build_request(head, sizeof head, method, path, headers, body_len, auth);
    size_t hl = strlen(head);
    char *req = malloc(hl + body_len + 1);
    memcpy(req, head, hl);
    if (body_len)
        memcpy(req + hl, body, body_len);
    http_raw(port, req, hl + body_len, r);
    free(req);
}

static void post(int port, const char *path, const char *body, resp *r)
{
    http_ex(port, "POST", path, NULL, body, strlen(body), true, r);
}

static json_t *body_json(const resp *r)
{
    json_error_t e;
    json_t *j = json_loadb(r->body, r->body_len, 0, &e);
    if (!j)
        fail_msg("response is not JSON (%s): %.300s", e.text, r->body);
    return j;
}

/* POSTs and returns the decoded 200 response. */
static json_t *post_ok(int port, const char *path, const char *body)
{
    resp r;
    post(port, path, body, &r);
    if (r.status != 200)
        fail_msg("POST %s %s -> %d %s", path, body, r.status, r.body);
    json_t *j = body_json(&r);
    resp_free(&r);
    return j;
}

static const char *choice_text(json_t *resp, size_t i)
{
    json_t *c = json_array_get(json_object_get(resp, "choices"), i);
    json_t *msg = json_object_get(c, "message");
    return json_string_value(json_object_get(msg ? msg : c, msg ? "content" : "text"));
}

static long long usage_field(json_t *resp, const char *key)
{
    return json_integer_value(json_object_get(json_object_get(resp, "usage"), key));
}

static long long metric(int port, const char *name)
{
    resp r;
    http_ex(port, "GET", "/metrics", NULL, NULL, 0, false, &r);
    assert_int_equal(r.status, 200);
    char pat[160];
    snprintf(pat, sizeof pat, "\n%s ", name);
    const char *p = strstr(r.body, pat);
    long long v = p ? (long long)strtod(p + strlen(pat), NULL) : -1;
    resp_free(&r);
    return v;
}

static char *run_capture(const char *args, int *status)
{
    char *out = NULL;
    *status = run_blade(args, &out, 0);
    return out;
}

/* ---- setup ---- */

static int setup(void **state)
{
    (void)state;
    g_model = shared_path("models/stories260K.gguf");
    char *cases_path = shared_path("chat-templates/cases.json");
    if (access(g_model, R_OK) || access(cases_path, R_OK)) {
        fprintf(stderr, "shared model or chat templates missing\n");
        free(cases_path);
        return -1;
    }
    json_error_t e;
    json_t *cases = json_load_file(cases_path, 0, &e);
    free(cases_path);
    if (!cases)
        return -1;
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *c = json_array_get(cases, i);
        if (!strcmp(json_string_value(json_object_get(c, "name")), "teknium/OpenHermes-2.5-Mistral-7B")) {
            g_template_source = strdup(json_string_value(json_object_get(c, "template")));
            break;
        }
    }
    json_decref(cases);
    if (!g_template_source)
        return -1;
    g_template_file = temp_path("server-chatml.jinja");
    write_file(g_template_file, g_template_source, strlen(g_template_source));
    char args[1024];
    snprintf(args, sizeof args, "--api-key %s --chat-template '%s' --alias stories", API_KEY, g_template_file);
    srv_start(&g_main, args);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    int rc = srv_stop(&g_main);
    free(g_model);
    free(g_template_file);
    free(g_template_source);
    if (rc != 0)
        fprintf(stderr, "blade serve exited with %d after SIGTERM\n", rc);
    return rc == 0 ? 0 : -1;
}

/* ---- tests ---- */

/* ---- the semantic cache ---- */

/* POSTs a completion as the client holding `key` (NULL: no Authorization header) to a
 * server without --api-key; returns the decoded 200 response and, in hdr, the value of
 * X-Blade-Semantic-Cache ("" when absent). */
static json_t *cached_post(int port, const char *key, const char *body, char *hdr, size_t hdr_cap)
{
    char headers[256] = "";
    if (key)
        snprintf(headers, sizeof headers, "Authorization: Bearer %s", key);
    resp r;
    http_ex(port, "POST", "/v1/completions", headers, body, strlen(body), false, &r);
    if (r.status != 200)
        fail_msg("POST %s -> %d %s", body, r.status, r.body);
    hdr[0] = 0;
    const char *h = strcasestr(r.raw, "\r\nX-Blade-Semantic-Cache: ");
    if (h) {
        h += strlen("\r\nX-Blade-Semantic-Cache: ");
        size_t n = strcspn(h, "\r");
        snprintf(hdr, hdr_cap, "%.*s", (int)(n < hdr_cap ? n : hdr_cap - 1), h);
    }
    json_t *j = r.body[0] == '{' ? body_json(&r) : json_string(r.body);
    resp_free(&r);
    return j;
}

#define GREEDY(prompt, extra) "{\"prompt\": \"" prompt "\", \"max_tokens\": 60, \"temperature\": 0, \"stop\": [\".\"]" extra "}"

/* ---- embeddings ---- */

static void expect_400(int port, const char *body, const char *param, const char *words)
{
    resp r;
    post(port, "/v1/embeddings", body, &r);
    if (r.status != 400 || !strstr(r.body, words))
        fail_msg("%s -> %d %s (expected 400 with '%s')", body, r.status, r.body, words);
    json_t *j = body_json(&r);
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "error"), "param")), param);
    json_decref(j);
    resp_free(&r);
}

static double vec_norm(json_t *v)
{
    double n = 0;
    for (size_t i = 0; i < json_array_size(v); i++)
        n += json_real_value(json_array_get(v, i)) * json_real_value(json_array_get(v, i));
    return sqrt(n);
}

/* /v1/embeddings on the main server: token ids and text give the same vector for the same
 * tokens, usage counts them, and every malformed input is a 400 naming 'input' (or the
 * parameter at fault). */
static void test_embeddings_api(void **state)
{
    (void)state;
    int port = g_main.port;
    json_t *a = post_ok(port, "/v1/embeddings", "{\"input\": \"Once upon a time\", \"model\": \"stories\"}");
    json_t *va = json_object_get(json_array_get(json_object_get(a, "data"), 0), "embedding");
    assert_int_equal(json_array_size(va), 64);
    assert_true(fabs(vec_norm(va) - 1) < 1e-5);
    long long n = usage_field(a, "prompt_tokens");
    assert_int_equal(usage_field(a, "total_tokens"), n);
    /* the same tokens as ids */
    blade_model *m = load_model(g_model);
    int32_t *ids = NULL;
    size_t n_ids = 0;
    blade_error err = {{0}};
    assert_int_equal(blade_tokenizer_encode(m->tokenizer, "Once upon a time", 16, true, true, &ids, &n_ids, &err), 0);
    blade_model_free(m);
    char body[512];
    int at = snprintf(body, sizeof body, "{\"input\": [[");
    for (size_t i = 0; i < n_ids; i++)
        at += snprintf(body + at, sizeof body - (size_t)at, "%s%d", i ? "," : "", ids[i]);
    snprintf(body + at, sizeof body - (size_t)at, "], \"Lily\"]}");
    free(ids);
    assert_int_equal((long long)n_ids, n);
    json_t *b = post_ok(port, "/v1/embeddings", body);
    assert_true(json_equal(json_object_get(json_array_get(json_object_get(b, "data"), 0), "embedding"), va));
    assert_int_equal(json_array_size(json_object_get(b, "data")), 2);
    json_decref(a);
    json_decref(b);

    expect_400(port, "{}", "input", "'input' is required");
    expect_400(port, "{\"input\": 5}", "input", "must be a string, an array of strings");
    expect_400(port, "{\"input\": []}", "input", "empty array");
    expect_400(port, "{\"input\": [\"a\", \"\"]}", "input", "'input[1]' is an empty string");
    expect_400(port, "{\"input\": [1, \"a\"]}", "input", "must be a token id");
    expect_400(port, "{\"input\": [[1, 100000]]}", "input", "between 0 and 511");
    expect_400(port, "{\"input\": [{}]}", "input", "'input[0]' must be a string or an array of token ids");
    expect_400(port, "{\"input\": \"x\", \"encoding_format\": \"hex\"}", "encoding_format", "'encoding_format' must be");
    expect_400(port, "{\"input\": \"x\", \"dimensions\": 0}", "dimensions", "between 1 and 64");
    expect_400(port, "{\"input\": \"x\", \"user\": 3}", "user", "must be a string");
    /* a whole context of tokens is an input (nothing is generated), one more is not */
    size_t cap = 2049 * 8 + 64;
    char *big = malloc(cap);
    at = snprintf(big, cap, "{\"input\": [");
    for (int i = 0; i < 2049; i++)
        at += snprintf(big + at, cap - (size_t)at, "%s%d", i ? "," : "", 3 + i % 400);
    snprintf(big + at, cap - (size_t)at, "]}");
    expect_400(port, big, "input", "maximum context length is 2048");
    char *comma = strrchr(big, ',');
    snprintf(comma, cap - (size_t)(comma - big), "]}");
    json_decref(post_ok(port, "/v1/embeddings", big));
    free(big);
}

/* --embed-model: embeddings (and the cache's similarity) from another model, the prompt's
 * text tokenized again for it. */
static void test_embed_model(void **state)
{
    (void)state;
    char *path = temp_path("server-embedder.gguf");
    blade_synth_spec spec = {
        .arch = BLADE_ARCH_LLAMA, .n_vocab = 512, .n_embd = 32, .n_layer = 2, .n_head = 2, .n_head_kv = 1,
        .head_dim = 16, .n_ff = 64, .n_ctx = 512, .rope_base = 10000.0f, .scheme = {.type = BLADE_TYPE_F32}, .seed = 3,
        .vocab_path = g_model,
    };
    blade_error err = {{0}};
    if (blade_synth_write(&spec, path, false, &err))
        fail_msg("%s", err.msg);
    char args[1024];
    snprintf(args, sizeof args, "--embed-model '%s' --embed-pooling last --semantic-cache", path);
    srv_start(&g_extra, args);
    assert_non_null(strstr(g_extra.log, "last pooling, 32 dimensions"));
    int port = g_extra.port;
    resp r;
    http_ex(port, "POST", "/v1/embeddings", NULL, "{\"input\": \"Once upon a time\"}", 29, false, &r);
    assert_int_equal(r.status, 200);
    json_t *j = body_json(&r);
    json_t *v = json_object_get(json_array_get(json_object_get(j, "data"), 0), "embedding");
    assert_int_equal(json_array_size(v), 32);
    assert_true(fabs(vec_norm(v) - 1) < 1e-5);
    json_decref(j);
    resp_free(&r);
    char h[128];
    json_t *first = cached_post(port, "k", GREEDY("Once upon a time", ""), h, sizeof h);
    assert_string_equal(h, "");
    json_t *again = cached_post(port, "k", GREEDY("Once upon a time", ""), h, sizeof h);
    assert_string_equal(h, "hit; tier=exact; similarity=1.0000");
    assert_string_equal(choice_text(again, 0), choice_text(first, 0));
    json_decref(first);
    json_decref(again);
    assert_int_equal(metric(port, "blade:semantic_cache_inserts_total"), 1);
    assert_int_equal(srv_stop(&g_extra), 0);
    remove(path);
    free(path);
}


/* A greedy answer is stored and given back to the same tenant only: another key, another
 * cache_salt, "semantic_cache": false and an unstored sampled request all miss; a hit
 * says so in a header and a field, counts no generated token, and streams as SSE; a
 * reworded prompt hits the semantic tier; /metrics counts it all. */
static void test_semantic_cache_tenants(void **state)
{
    (void)state;
    srv_start(&g_extra, "--semantic-cache --semantic-threshold 0.9");
    int port = g_extra.port;
    char h[128];
    json_t *first = cached_post(port, "key-a", GREEDY("Once upon a time", ""), h, sizeof h);
    assert_string_equal(h, "");
    assert_true(usage_field(first, "completion_tokens") > 0);
    const char *text = choice_text(first, 0);
    assert_string_equal(json_string_value(json_object_get(json_array_get(json_object_get(first, "choices"), 0),
                                                          "finish_reason")),
                        "stop");

    json_t *again = cached_post(port, "key-a", GREEDY("Once upon a time", ""), h, sizeof h);
    assert_string_equal(h, "hit; tier=exact; similarity=1.0000");
    assert_string_equal(choice_text(again, 0), text);
    assert_int_equal(usage_field(again, "completion_tokens"), 0);
    assert_int_equal(usage_field(again, "prompt_tokens"), usage_field(first, "prompt_tokens"));
    json_t *field = json_object_get(again, "semantic_cache");
    assert_true(json_is_true(json_object_get(field, "hit")));
    assert_string_equal(json_string_value(json_object_get(field, "tier")), "exact");
    json_decref(again);

    const char *misses[] = {NULL, NULL, NULL, NULL};
    json_t *other = cached_post(port, "key-b", GREEDY("Once upon a time", ""), h, sizeof h);
    misses[0] = h[0] ? "another key" : NULL;
    assert_string_equal(choice_text(other, 0), text); /* the same greedy answer, computed again */
    json_decref(other);
    json_decref(cached_post(port, NULL, GREEDY("Once upon a time", ""), h, sizeof h));
    misses[1] = h[0] ? "no key" : NULL;
    json_decref(cached_post(port, "key-a", GREEDY("Once upon a time", ", \"cache_salt\": \"s1\""), h, sizeof h));
    misses[2] = h[0] ? "another cache_salt" : NULL;
    json_decref(cached_post(port, "key-a", GREEDY("Once upon a time", ", \"semantic_cache\": false"), h, sizeof h));
    misses[3] = h[0] ? "semantic_cache false" : NULL;
    for (int i = 0; i < 4; i++)
        if (misses[i])
            fail_msg("the cache answered a request with %s", misses[i]);
    /* sampled: neither looked up nor stored, unless the request opts in */
    const char *sampled = "{\"prompt\": \"One day\", \"max_tokens\": 8, \"temperature\": 0.9, \"seed\": 3}";
    json_decref(cached_post(port, "key-a", sampled, h, sizeof h));
    json_decref(cached_post(port, "key-a", sampled, h, sizeof h));
    assert_string_equal(h, "");
    const char *opted = "{\"prompt\": \"One day\", \"max_tokens\": 8, \"temperature\": 0.9, \"seed\": 3, "
                        "\"semantic_cache\": true}";
    json_decref(cached_post(port, "key-a", opted, h, sizeof h));
    assert_string_equal(h, "");
    json_decref(cached_post(port, "key-a", opted, h, sizeof h));
    assert_string_equal(h, "hit; tier=exact; similarity=1.0000");

    /* a near-duplicate (a trailing space) is a semantic hit, replayed as a stream */
    json_t *sse = cached_post(port, "key-a",
                              GREEDY("Once upon a time ", ", \"stream\": true, \"stream_options\": {\"include_usage\": true}"),
                              h, sizeof h);
    assert_non_null(strstr(h, "tier=semantic"));
    double sim = strtod(strstr(h, "similarity=") + strlen("similarity="), NULL);
    assert_true(sim >= 0.9 && sim < 1.0);
    const char *body = json_string_value(sse);
    assert_non_null(strstr(body, "\"finish_reason\":\"stop\""));
    assert_non_null(strstr(body, "\"completion_tokens\":0"));
    assert_non_null(strstr(body, "data: [DONE]"));
    /* every chunk names the hit */
    int chunks = 0, named = 0;
    for (const char *p = strstr(body, "data: {"); p; p = strstr(p + 1, "data: {")) {
        chunks++;
        const char *end = strstr(p, "\n\n");
        const char *f = strstr(p, "\"semantic_cache\":{\"hit\":true,\"tier\":\"semantic\"");
        named += f && end && f < end;
    }
    assert_true(chunks >= 3);
    assert_int_equal(named, chunks);
    json_decref(sse);
    json_decref(first);

    assert_int_equal(metric(port, "blade:semantic_cache_exact_hits_total"), 2);
    assert_int_equal(metric(port, "blade:semantic_cache_semantic_hits_total"), 1);
    /* key-a, key-b, no key, salt s1, the opted-in sampled one ("false" stored nothing) */
    assert_int_equal(metric(port, "blade:semantic_cache_entries"), 5);
    assert_true(metric(port, "blade:semantic_cache_bytes") > 0);
    assert_true(metric(port, "blade:semantic_cache_lookup_seconds_count") >= 8);
    assert_int_equal(srv_stop(&g_extra), 0);
}

/* Two entries at most and a TTL: the least recently used goes first, and an entry older
 * than the TTL is never answered. */
static void test_semantic_cache_eviction_ttl(void **state)
{
    (void)state;
    srv_start(&g_extra, "--semantic-cache --semantic-threshold 1 --semantic-cache-entries 2 --semantic-cache-ttl 3");
    int port = g_extra.port;
    char h[128];
    json_decref(cached_post(port, "k", GREEDY("The cat", ""), h, sizeof h));
    json_decref(cached_post(port, "k", GREEDY("The dog", ""), h, sizeof h));
    json_decref(cached_post(port, "k", GREEDY("The dog", ""), h, sizeof h));
    assert_string_equal(h, "hit; tier=exact; similarity=1.0000");
    json_decref(cached_post(port, "k", GREEDY("A bird", ""), h, sizeof h)); /* evicts the cat */
    assert_int_equal(metric(port, "blade:semantic_cache_evictions_total"), 1);
    assert_int_equal(metric(port, "blade:semantic_cache_entries"), 2);
    json_decref(cached_post(port, "k", GREEDY("A bird", ""), h, sizeof h));
    assert_string_equal(h, "hit; tier=exact; similarity=1.0000");
    json_decref(cached_post(port, "k", GREEDY("The cat", ""), h, sizeof h));
    assert_string_equal(h, "");
    sleep(4);
    json_decref(cached_post(port, "k", GREEDY("A bird", ""), h, sizeof h));
    assert_string_equal(h, "");
    assert_true(metric(port, "blade:semantic_cache_expirations_total") >= 1);
    assert_int_equal(srv_stop(&g_extra), 0);
}

/* With --semantic-cache-db the entries survive a restart; a damaged file is moved aside
 * with a warning and the server starts with an empty cache. */
static void test_semantic_cache_persistence(void **state)
{
    (void)state;
    char *db = temp_path("server-semcache.db");
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -f '%s' '%s'.corrupt-*", db, db);
    run_command(cmd, NULL);
    char args[1024];
    snprintf(args, sizeof args, "--semantic-cache --semantic-cache-db '%s' 2>&1", db);
    srv_start(&g_extra, args);
    char h[128];
    json_t *first = cached_post(g_extra.port, "k", GREEDY("Lily went", ""), h, sizeof h);
    assert_string_equal(h, "");
    assert_int_equal(srv_stop(&g_extra), 0);

    srv_start(&g_extra, args);
    assert_non_null(strstr(g_extra.log, "1 entries loaded"));
    json_t *again = cached_post(g_extra.port, "k", GREEDY("Lily went", ""), h, sizeof h);
    assert_string_equal(h, "hit; tier=exact; similarity=1.0000");
    assert_string_equal(choice_text(again, 0), choice_text(first, 0));
    json_decref(cached_post(g_extra.port, "other", GREEDY("Lily went", ""), h, sizeof h));
    assert_string_equal(h, ""); /* tenants stay apart after a restart too */
    assert_int_equal(srv_stop(&g_extra), 0);
    json_decref(first);
    json_decref(again);

    char junk[4096];
    memset(junk, 0x5a, sizeof junk);
    memcpy(junk, "SQLite format 3", 16);
    assert_int_equal(write_file(db, junk, sizeof junk), 0);
    srv_start(&g_extra, args);
    assert_non_null(strstr(g_extra.log, "warning: semantic cache:"));
    assert_non_null(strstr(g_extra.log, "0 entries loaded"));
    json_decref(cached_post(g_extra.port, "k", GREEDY("Lily went", ""), h, sizeof h));
    assert_string_equal(h, "");
    json_decref(cached_post(g_extra.port, "k", GREEDY("Lily went", ""), h, sizeof h));
    assert_string_equal(h, "hit; tier=exact; similarity=1.0000");
    assert_int_equal(srv_stop(&g_extra), 0);
    snprintf(cmd, sizeof cmd, "ls '%s'.corrupt-* >/dev/null 2>&1", db);
    assert_int_equal(run_command(cmd, NULL), 0);
    snprintf(cmd, sizeof cmd, "rm -f '%s' '%s'.corrupt-* '%s'-wal '%s'-shm", db, db, db, db);
    run_command(cmd, NULL);
    free(db);
}

static void test_health_models_metrics(void **state)
{
    (void)state;
    resp r;
    http_ex(g_main.port, "GET", "/health", NULL, NULL, 0, false, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"ok\""));
    resp_free(&r);
    http_ex(g_main.port, "GET", "/v1/models", NULL, NULL, 0, true, &r);
    assert_int_equal(r.status, 200);
    json_t *j = body_json(&r);
    assert_string_equal(json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id")),
                        "stories");
    json_decref(j);
    resp_free(&r);
    http_ex(g_main.port, "GET", "/v1/models/stories260K.gguf", NULL, NULL, 0, true, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    http_ex(g_main.port, "GET", "/metrics", NULL, NULL, 0, false, &r);
    assert_int_equal(r.status, 200);
    const char *names[] = {"blade:time_to_first_token_seconds_bucket", "blade:e2e_request_latency_seconds_count",
                           "blade:time_per_output_token_seconds", "blade:inter_token_latency_seconds",
                           "blade:request_queue_time_seconds", "blade:num_requests_running",
                           "blade:num_requests_waiting", "blade:kv_blocks_used", "blade:kv_blocks_cached",
                           "blade:prefix_cache_hit_rate", "blade:kv_utilisation", "blade:num_preemptions_total",
                           "blade:prompt_tokens_total", "blade:generation_tokens_total",
                           "blade:spec_decode_num_draft_tokens_total", "blade:spec_decode_num_accepted_tokens_total",
                           "blade:spec_decode_acceptance_length_bucket{le=\"0\"}",
                           "blade:http_requests_total{status=\"200\"}"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strstr(r.body, names[i]))
            fail_msg("/metrics lacks %s", names[i]);
    resp_free(&r);
}

static void test_completion_equals_run(void **state)
{
    (void)state;
    json_t *j = post_ok(g_main.port, "/v1/completions",
                        "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":40,\"temperature\":0}");
    assert_string_equal(json_string_value(json_object_get(j, "object")), "text_completion");
    assert_true(strncmp(json_string_value(json_object_get(j, "id")), "cmpl-", 5) == 0);
    assert_non_null(json_object_get(j, "created"));
    assert_non_null(json_object_get(j, "system_fingerprint"));
    assert_string_equal(json_string_value(json_object_get(j, "model")), "stories");
    const char *text = choice_text(j, 0);
    assert_true(strlen(text) > 20);
    assert_int_equal(usage_field(j, "completion_tokens"), 40);
    assert_int_equal(usage_field(j, "total_tokens"), usage_field(j, "prompt_tokens") + 40);
    char args[1024];
    int st;
    snprintf(args, sizeof args, "run -m '%s' -p 'Once upon a time' -n 40 --temp 0", g_model);
    char *out = run_capture(args, &st);
    assert_int_equal(st, 0);
    char *want = malloc(strlen(text) + 64);
    sprintf(want, "Once upon a time%s\n", text);
    assert_string_equal(out, want);
    free(want);
    free(out);
    json_decref(j);
}

/* Renders messages exactly as the server must (the model's BOS/EOS texts). */
static char *render(json_t *messages)
{
    blade_error err = {{0}};
    blade_model *m = blade_model_load(g_model, &err);
    assert_non_null(m);
    blade_template *t = blade_template_parse(g_template_source, strlen(g_template_source), &err);
    assert_non_null(t);
    char *out = NULL;
    size_t len = 0;
    const blade_tokenizer *tok = m->tokenizer;
    assert_int_equal(blade_template_render_chat(t, messages, true,
                                                blade_tokenizer_token_text(tok, blade_tokenizer_bos(tok)),
                                                blade_tokenizer_token_text(tok, blade_tokenizer_eos(tok)), &out, &len,
                                                &err),
                     0);
    blade_template_free(t);
    blade_model_free(m);
    return out;
}

static void test_chat_equals_run_and_caches_prefix(void **state)
{
    (void)state;
    const char *system = "You are a storyteller. You tell short, happy stories about a little dog, a cat and "
                         "a bird who live in a big green park.";
    char body[2048];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},{\"role\":\"user\",\"content\":[{\"type\":"
             "\"text\",\"text\":\"Tell me about the dog.\"}]}],\"max_completion_tokens\":30,\"temperature\":0}",
             system);
    json_t *j = post_ok(g_main.port, "/v1/chat/completions", body);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion");
    json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    assert_string_equal(json_string_value(json_object_get(msg, "role")), "assistant");
    const char *text = choice_text(j, 0);

    json_t *messages = json_pack("[{s:s, s:s}, {s:s, s:s}]", "role", "system", "content", system, "role", "user",
                                 "content", "Tell me about the dog.");
    char *rendered = render(messages);
    json_decref(messages);
    char *prompt_file = temp_path("server-chat-prompt.txt");
    write_file(prompt_file, rendered, strlen(rendered));
    char args[1024];
    int st;
    long long n_gen = usage_field(j, "completion_tokens");
    snprintf(args, sizeof args, "run -m '%s' -f '%s' --parse-special --no-bos -n %lld --temp 0", g_model, prompt_file,
             n_gen);
    char *full = run_capture(args, &st);
    assert_int_equal(st, 0);
    /* `blade run` prints the prompt as given, the continuation and a newline. */
    char *want = malloc(strlen(rendered) + strlen(text) + 2);
    sprintf(want, "%s%s\n", rendered, text);
    assert_string_equal(full, want);
    free(want);
    free(full);
    free(prompt_file);
    free(rendered);

    /* the same system prompt again: its full blocks come from the prefix cache */
    json_t *first_usage = json_object_get(j, "usage");
    assert_non_null(json_object_get(json_object_get(first_usage, "prompt_tokens_details"), "cached_tokens"));
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},{\"role\":\"user\",\"content\":\"And the "
             "cat?\"}],\"max_tokens\":5,\"temperature\":0}",
             system);
    json_t *j2 = post_ok(g_main.port, "/v1/chat/completions", body);
    long long cached = json_integer_value(
        json_object_get(json_object_get(json_object_get(j2, "usage"), "prompt_tokens_details"), "cached_tokens"));
    assert_true(cached >= 16);
    assert_true(cached < usage_field(j2, "prompt_tokens"));
    json_decref(j2);
    json_decref(j);
}

/* Splits an SSE body into its data payloads. */
static int sse_events(const char *body, json_t **events, int cap, bool *done)
{
    int n = 0;
    *done = false;
    const char *p = body;
    while ((p = strstr(p, "data: ")) != NULL) {
        p += 6;
        const char *end = strstr(p, "\n\n");
        assert_non_null(end);
        if (!strncmp(p, "[DONE]", 6)) {
            *done = true;
            assert_string_equal(end + 2, "");
            break;
        }
        json_error_t e;
        json_t *j = json_loadb(p, (size_t)(end - p), 0, &e);
        if (!j)
            fail_msg("bad SSE payload: %.*s", (int)(end - p), p);
        assert_true(n < cap);
        events[n++] = j;
        p = end + 2;
    }
    return n;
}

static void test_streaming(void **state)
{
    (void)state;
    json_t *plain = post_ok(g_main.port, "/v1/completions",
                            "{\"prompt\":\"The cat\",\"max_tokens\":30,\"temperature\":0}");
    resp r;
    post(g_main.port, "/v1/completions",
         "{\"prompt\":\"The cat\",\"max_tokens\":30,\"temperature\":0,\"stream\":true,"
         "\"stream_options\":{\"include_usage\":true}}",
         &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strcasestr(r.raw, "Content-Type: text/event-stream"));
    json_t *ev[128];
    bool done;
    int n = sse_events(r.body, ev, 128, &done);
    assert_true(done);
    assert_true(n >= 3);
    char text[4096] = "";
    for (int i = 0; i < n - 2; i++) {
        assert_string_equal(json_string_value(json_object_get(ev[i], "object")), "text_completion");
        json_t *c = json_array_get(json_object_get(ev[i], "choices"), 0);
        strcat(text, json_string_value(json_object_get(c, "text")));
        assert_true(json_is_null(json_object_get(c, "finish_reason")));
    }
    json_t *last = json_array_get(json_object_get(ev[n - 2], "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(last, "finish_reason")), "length");
    assert_int_equal(json_array_size(json_object_get(ev[n - 1], "choices")), 0);
    assert_int_equal(usage_field(ev[n - 1], "completion_tokens"), 30);
    assert_string_equal(text, choice_text(plain, 0));
    for (int i = 0; i < n; i++)
        json_decref(ev[i]);
    resp_free(&r);
    json_decref(plain);

    post(g_main.port, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":8,\"stream\":true,\"seed\":1}", &r);
    assert_int_equal(r.status, 200);
    n = sse_events(r.body, ev, 128, &done);
    assert_true(done);
    json_t *d0 = json_object_get(json_array_get(json_object_get(ev[0], "choices"), 0), "delta");
    assert_string_equal(json_string_value(json_object_get(d0, "role")), "assistant");
    assert_string_equal(json_string_value(json_object_get(ev[0], "object")), "chat.completion.chunk");
    json_t *fin = json_array_get(json_object_get(ev[n - 1], "choices"), 0);
    assert_non_null(json_string_value(json_object_get(fin, "finish_reason")));
    assert_null(json_object_get(ev[n - 1], "usage"));
    for (int i = 0; i < n; i++)
        json_decref(ev[i]);
    resp_free(&r);
}

static void test_n_seed_stop_logprobs(void **state)
{
    (void)state;
    const char *body = "{\"prompt\":[\"Once upon a time\",\"The dog\"],\"n\":3,\"max_tokens\":12,\"seed\":42,"
                       "\"temperature\":1.0}";
    json_t *a = post_ok(g_main.port, "/v1/completions", body);
    json_t *b = post_ok(g_main.port, "/v1/completions", body);
    assert_int_equal(json_array_size(json_object_get(a, "choices")), 6);
    for (size_t i = 0; i < 6; i++) {
        json_t *c = json_array_get(json_object_get(a, "choices"), i);
        assert_int_equal(json_integer_value(json_object_get(c, "index")), (json_int_t)i);
        assert_string_equal(choice_text(a, i), choice_text(b, i));
    }
    /* the choices of one prompt sample differently */
    assert_true(strcmp(choice_text(a, 0), choice_text(a, 1)) || strcmp(choice_text(a, 1), choice_text(a, 2)));
    json_decref(a);
    json_decref(b);

    json_t *s = post_ok(g_main.port, "/v1/completions",
                        "{\"prompt\":\"Once upon a time\",\"max_tokens\":40,\"temperature\":0,\"stop\":[\"Lily\"]}");
    json_t *c = json_array_get(json_object_get(s, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
    assert_null(strstr(choice_text(s, 0), "Lily"));
    json_decref(s);

    json_t *l = post_ok(g_main.port, "/v1/completions",
                        "{\"prompt\":\"Once upon a time\",\"max_tokens\":5,\"temperature\":0,\"logprobs\":3}");
    json_t *lp = json_object_get(json_array_get(json_object_get(l, "choices"), 0), "logprobs");
    assert_int_equal(json_array_size(json_object_get(lp, "tokens")), 5);
    assert_int_equal(json_array_size(json_object_get(lp, "token_logprobs")), 5);
    assert_int_equal(json_array_size(json_object_get(lp, "text_offset")), 5);
    json_t *top0 = json_array_get(json_object_get(lp, "top_logprobs"), 0);
    assert_true(json_object_size(top0) >= 3);
    assert_true(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), 0)) <= 0);
    json_decref(l);

    json_t *cl = post_ok(g_main.port, "/v1/chat/completions",
                         "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":4,\"temperature\":0,"
                         "\"ignore_eos\":true,\"logprobs\":true,\"top_logprobs\":2}");
    json_t *content =
        json_object_get(json_object_get(json_array_get(json_object_get(cl, "choices"), 0), "logprobs"), "content");
    assert_int_equal(json_array_size(content), 4);
    json_t *e0 = json_array_get(content, 0);
    assert_true(json_is_string(json_object_get(e0, "token")));
    assert_true(json_is_array(json_object_get(e0, "bytes")));
    assert_int_equal(json_array_size(json_object_get(e0, "top_logprobs")), 2);
    json_decref(cl);
}

typedef struct bad_case {
    const char *method, *path, *body, *headers;
    bool no_auth;
    int status;
    const char *needle; /* in the error message */
} bad_case;

static char *repeat_json(const char *head, const char *unit, int count, const char *sep, const char *tail)
{
    size_t cap = strlen(head) + (strlen(unit) + strlen(sep)) * (size_t)count + strlen(tail) + 1;
    char *s = malloc(cap);
    strcpy(s, head);
    char *p = s + strlen(s);
    for (int i = 0; i < count; i++) {
        p = stpcpy(p, unit);
        if (i + 1 < count)
            p = stpcpy(p, sep);
    }
    strcpy(p, tail);
    return s;
}

static void check_bad(const bad_case *c, int i)
{
    resp r;
    const char *body = c->body ? c->body : "";
    http_ex(g_main.port, c->method, c->path, c->headers, body, strlen(body), !c->no_auth, &r);
    if (r.status != c->status)
        fail_msg("case %d (%s %s %.80s): status %d, want %d: %.300s", i, c->method, c->path, body, r.status, c->status,
                 r.body);
    if (c->status != 200) {
        json_t *j = body_json(&r);
        const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
        if (!msg || !json_object_get(json_object_get(j, "error"), "type"))
            fail_msg("case %d: no OpenAI error object: %s", i, r.body);
        if (c->needle && !strstr(msg, c->needle))
            fail_msg("case %d: message '%s' lacks '%s'", i, msg, c->needle);
        json_decref(j);
    }
    resp_free(&r);
}

static void test_bad_inputs(void **state)
{
    (void)state;
    const char *C = "/v1/completions", *H = "/v1/chat/completions";
    char *many_stops = repeat_json("{\"prompt\":\"a\",\"stop\":[", "\"x\"", 5000, ",", "]}");
    char *long_stop = repeat_json("{\"prompt\":\"a\",\"stop\":\"", "y", 1000, "", "\"}");
    char *deep = repeat_json("", "[", 100000, "", "");
    char *huge_prompt = repeat_json("{\"prompt\":\"", "word ", 180000, "", "\"}");
    char *huge_tokens = repeat_json("{\"prompt\":[", "1", 3000, ",", "]}");
    char *many_prompts = repeat_json("{\"prompt\":[", "\"a\"", 100, ",", "]}");
    char *many_choices = repeat_json("{\"n\":16,\"prompt\":[", "\"a\"", 20, ",", "]}");
    const bad_case cases[] = {
        {"POST", C, "{", NULL, false, 400, "not valid JSON"},
        {"POST", C, "{\"prompt\": \"abc", NULL, false, 400, "not valid JSON"},
        {"POST", C, "", NULL, false, 400, "empty"},
        {"POST", C, "[]", NULL, false, 400, "JSON object"},
        {"POST", C, "null", NULL, false, 400, NULL},
        {"POST", C, "\"prompt\"", NULL, false, 400, "JSON object, got a string"},
        {"POST", C, "{}", NULL, false, 400, "'prompt' is required"},
        {"POST", C, "{\"prompt\":42}", NULL, false, 400, "'prompt' must be"},
        {"POST", C, "{\"prompt\":[]}", NULL, false, 400, "empty array"},
        {"POST", C, "{\"prompt\":[\"a\",1]}", NULL, false, 400, "prompt[1]"},
        {"POST", C, "{\"prompt\":[99999]}", NULL, false, 400, "prompt[0]"},
        {"POST", C, "{\"prompt\":[-1]}", NULL, false, 400, "prompt[0]"},
        {"POST", C, "{\"prompt\":[[1,2],[]]}", NULL, false, 400, "empty token array"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":\"ten\"}", NULL, false, 400, "'max_tokens' must be an integer"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":-5}", NULL, false, 400, "'max_tokens' must be between"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":0}", NULL, false, 400, "max_tokens"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":1e30}", NULL, false, 400, "max_tokens"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":2.5}", NULL, false, 400, "integer"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":5000}", NULL, false, 400, "maximum context length is 2048"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":99999999999999999999999}", NULL, false, 400, "not valid JSON"},
        {"POST", C, "{\"prompt\":\"a\",\"temperature\":3}", NULL, false, 400, "'temperature' must be between 0 and 2"},
        {"POST", C, "{\"prompt\":\"a\",\"temperature\":-1}", NULL, false, 400, "temperature"},
        {"POST", C, "{\"prompt\":\"a\",\"temperature\":\"hot\"}", NULL, false, 400, "'temperature' must be a number"},
        {"POST", C, "{\"prompt\":\"a\",\"temperature\":NaN}", NULL, false, 400, "not valid JSON"},
        {"POST", C, "{\"prompt\":\"a\",\"top_p\":1.5}", NULL, false, 400, "top_p"},
        {"POST", C, "{\"prompt\":\"a\",\"n\":0}", NULL, false, 400, "'n' must be between 1 and 16"},
        {"POST", C, "{\"prompt\":\"a\",\"n\":1000}", NULL, false, 400, "'n'"},
        {"POST", C, "{\"prompt\":\"a\",\"presence_penalty\":5}", NULL, false, 400, "presence_penalty"},
        {"POST", C, "{\"prompt\":\"a\",\"frequency_penalty\":[]}", NULL, false, 400, "frequency_penalty"},
        {"POST", C, "{\"prompt\":\"a\",\"repetition_penalty\":0}", NULL, false, 400, "repetition_penalty"},
        {"POST", C, "{\"prompt\":\"a\",\"seed\":\"abc\"}", NULL, false, 400, "'seed' must be an integer"},
        {"POST", C, many_stops, NULL, false, 400, "at most 16"},
        {"POST", C, long_stop, NULL, false, 400, "1 to 256 bytes"},
        {"POST", C, "{\"prompt\":\"a\",\"stop\":[1,2]}", NULL, false, 400, "'stop[0]' must be a string"},
        {"POST", C, "{\"prompt\":\"a\",\"stop\":{}}", NULL, false, 400, "'stop' must be"},
        {"POST", C, "{\"prompt\":\"a\",\"logprobs\":10}", NULL, false, 400, "'logprobs'"},
        {"POST", C, "{\"prompt\":\"a\",\"logprobs\":true}", NULL, false, 400, "not a boolean"},
        {"POST", C, "{\"prompt\":\"a\",\"echo\":true,\"logprobs\":1}", NULL, false, 400, "echo"},
        {"POST", C, "{\"prompt\":\"a\",\"stream\":\"yes\"}", NULL, false, 400, "'stream' must be a boolean"},
        {"POST", C, "{\"prompt\":\"a\",\"speculative\":1}", NULL, false, 400, "'speculative' must be a boolean"},
        {"POST", C, "{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":true}}", NULL, false, 400,
         "only allowed when 'stream' is true"},
        {"POST", C, "{\"prompt\":\"a\",\"priority\":\"urgent\"}", NULL, false, 400, "priority"},
        {"POST", C, "{\"prompt\":\"a\",\"cache_salt\":123}", NULL, false, 400, "cache_salt"},
        {"POST", C, "{\"prompt\":\"a\",\"logit_bias\":{\"1\":5}}", NULL, false, 400, "logit_bias"},
        {"POST", C, "{\"prompt\":\"a\",\"suffix\":\"zzz\"}", NULL, false, 400, "suffix"},
        {"POST", C, "{\"prompt\":\"a\",\"prompt\":\"b\"}", NULL, false, 400, "duplicate"},
        {"POST", C, "{\"prompt\":\"a\\u0000b\"}", NULL, false, 400, "not valid JSON"},
        {"POST", C, "{\"prompt\":\"\xff\xfe\"}", NULL, false, 400, "not valid JSON"},
        {"POST", C, "{\"prompt\":\"\xc3\x28\"}", NULL, false, 400, "not valid JSON"},
        {"POST", C, deep, NULL, false, 400, "depth"},
        {"POST", C, huge_prompt, NULL, false, 400, "maximum context length is 2048"},
        {"POST", C, huge_tokens, NULL, false, 400, "maximum context length is 2048"},
        {"POST", C, many_prompts, NULL, false, 400, "at most 64"},
        {"POST", C, many_choices, NULL, false, 400, "choices"},
        {"POST", C, "{\"prompt\":\"a\",\"model\":\"gpt-4\"}", NULL, false, 404, "does not exist"},
        {"POST", C, "{\"prompt\":\"a\",\"model\":7}", NULL, false, 400, "'model' must be a string"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":2}", NULL, true, 401, "API key"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":2}", "Authorization: Bearer wrong", true, 401, "Incorrect"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":2}", "Authorization: Basic dXNlcjpwYXNz", true, 401, "Bearer"},
        {"GET", C, NULL, NULL, false, 405, "not allowed"},
        {"DELETE", H, NULL, NULL, false, 405, "not allowed"},
        {"POST", "/v1/models", "{}", NULL, false, 405, "use GET"},
        {"POST", "/v2/completions", "{}", NULL, false, 404, "Unknown request URL"},
        {"GET", "/v1/models/gpt-4", NULL, NULL, false, 404, "does not exist"},
        {"POST", H, "{}", NULL, false, 400, "'messages' is required"},
        {"POST", H, "{\"messages\":[]}", NULL, false, 400, "at least one message"},
        {"POST", H, "{\"messages\":\"hi\"}", NULL, false, 400, "'messages' must be an array"},
        {"POST", H, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", NULL, false, 400, "wizard"},
        {"POST", H, "{\"messages\":[{\"content\":\"x\"}]}", NULL, false, 400, "role"},
        {"POST", H, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", NULL, false, 400, "content"},
        {"POST", H, "{\"messages\":[{\"role\":\"user\"}]}", NULL, false, 400, "is required"},
        {"POST", H,
         "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":\"x\"}}]}]}",
         NULL, false, 400, "only text parts"},
        {"POST", H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", NULL, false, 400,
         "needs 'logprobs': true"},
        {"POST", H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":50}",
         NULL, false, 400, "top_logprobs"},
        {"POST", H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\"}]}",
         NULL, false, 400, "tool"},
        {"POST", C, "{\"prompt\":\"a\",\"max_tokens\":2,\"temperature\":0,\"unknown\":{\"x\":[1,2]},\"foo\":null}", NULL,
         false, 200, NULL},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    assert_true(n >= 40);
    for (int i = 0; i < n; i++)
        check_bad(&cases[i], i);
    free(many_stops);
    free(long_stop);
    free(deep);
    free(huge_prompt);
    free(huge_tokens);
    free(many_prompts);
    free(many_choices);

    resp r;
    /* a body announced as over the limit is refused before it is sent */
    char head[512];
    snprintf(head, sizeof head,
             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " API_KEY
             "\r\nContent-Length: 10485760\r\n\r\n");
    http_raw(g_main.port, head, strlen(head), &r);
    assert_int_equal(r.status, 413);
    assert_non_null(strstr(r.body, "--max-body"));
    resp_free(&r);

    /* a chunked upload that runs past the limit is answered 413 too */
    size_t big = (size_t)9 << 20;
    char *chunked = malloc(big + 4096);
    int hl = sprintf(chunked, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " API_KEY
                              "\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
    size_t pos = (size_t)hl;
    for (size_t sent = 0; sent < big; sent += 65536) {
        pos += (size_t)sprintf(chunked + pos, "10000\r\n");
        memset(chunked + pos, 'a', 65536);
        pos += 65536;
        pos += (size_t)sprintf(chunked + pos, "\r\n");
    }
    pos += (size_t)sprintf(chunked + pos, "0\r\n\r\n");
    http_raw(g_main.port, chunked, pos, &r);
    free(chunked);
    assert_int_equal(r.status, 413);
    resp_free(&r);

    /* a body cut short by a client that goes away gets no answer and harms nothing */
    int fd = dial(g_main.port);
    snprintf(head, sizeof head,
             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " API_KEY
             "\r\nContent-Length: 100\r\n\r\n{\"prompt\":");
    send_all(fd, head, strlen(head));
    close(fd);
    /* nor does garbage that is not HTTP */
    http_raw(g_main.port, "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n", 22, &r);
    assert_int_equal(r.status, 400);
    resp_free(&r);

    http_ex(g_main.port, "GET", "/health", NULL, NULL, 0, false, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    json_t *ok = post_ok(g_main.port, "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":3}");
    assert_int_equal(usage_field(ok, "completion_tokens"), 3);
    json_decref(ok);
}

/* ---- HTTP framing, deadlines and connection caps (raw bytes, as an attacker sends them) ---- */

/* Reads until the server closes the connection or `limit` seconds pass; *elapsed is the time
 * from the call to the close (or the limit), *closed whether the server closed. */
static char *recv_until_close(int fd, double limit, size_t *len, double *elapsed, bool *closed)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    double t0 = mono(), until = t0 + limit;
    *closed = false;
    for (;;) {
        double left = until - mono();
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&p, 1, (int)(left * 1000) + 1) <= 0)
            break;
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        ssize_t r = recv(fd, buf + n, cap - n, 0);
        if (r <= 0) {
            *closed = true;
            break;
        }
        n += (size_t)r;
    }
    buf[n] = 0;
    *len = n;
    *elapsed = mono() - t0;
    return buf;
}

/* Status lines in a raw answer: each starts a line (a message may quote "HTTP/1.1"). */
static int count_responses(const char *raw)
{
    int n = 0;
    for (const char *p = raw; (p = strstr(p, "HTTP/1.")); p++)
        if ((p == raw || p[-1] == '\n') && p[8] == ' ' && p[9] >= '1' && p[9] <= '5')
            n++;
    return n;
}

typedef struct answer {
    resp r;
    int n;          /* responses */
    bool closed;    /* by the server */
    double elapsed; /* from the last byte sent to the close */
} answer;

/* Sends req on fd and reads everything the server sends until it closes (or limit). */
static void answer_on(int fd, const void *req, size_t len, double limit, answer *a)
{
    assert_true(send_all(fd, req, len));
    size_t n;
    char *raw = recv_until_close(fd, limit, &n, &a->elapsed, &a->closed);
    close(fd);
    a->n = count_responses(raw);
    parse_resp(raw, n, &a->r);
}

/* One answer of `status` as an OpenAI error object naming `needle`, then the connection
 * closed, all within `within` seconds. */
static void expect_refusal(const char *what, answer *a, int status, const char *needle, double within)
{
    if (a->r.status != status || a->n != 1 || !a->closed || a->elapsed > within)
        fail_msg("%s: status %d (want %d), %d responses, %s after %.2f s (want within %.1f s): %.300s", what,
                 a->r.status, status, a->n, a->closed ? "closed" : "still open", a->elapsed, within, a->r.raw);
    if (!strcasestr(a->r.raw, "Content-Type: application/json") || !strcasestr(a->r.raw, "Connection: close"))
        fail_msg("%s: not a JSON answer with Connection: close: %.300s", what, a->r.raw);
    json_t *j = body_json(&a->r);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    if (!msg || !strstr(msg, needle))
        fail_msg("%s: the error message lacks '%s': %.300s", what, needle, a->r.body);
    json_decref(j);
    resp_free(&a->r);
}

#define POST_HEAD "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " API_KEY "\r\n"
#define SMALL_BODY "{\"prompt\":\"Once\",\"max_tokens\":2}"
#define HEALTH_REQ "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

/* Asks for /health on fd and reads the answer, leaving the keep-alive connection open. */
static void health_keep_alive(int fd)
{
    assert_true(send_all(fd, HEALTH_REQ, strlen(HEALTH_REQ)));
    char buf[4096];
    ssize_t got = recv(fd, buf, sizeof buf - 1, 0);
    assert_true(got > 0);
    buf[got] = 0;
    assert_non_null(strstr(buf, "HTTP/1.1 200"));
}

/* Each refusal comes at once (the idle timeout is 15 s), as JSON, alone, and closes the
 * connection, so nothing after the refused head is ever served: on a fresh connection (the
 * gate's checks) and after a first request on a keep-alive one (the access handler's). */
static void test_framing(void **state)
{
    (void)state;
    char *long_field = repeat_json("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ", "a", 40000, "", "\r\n\r\n");
    char *long_url = repeat_json("GET /", "a", 40000, "", " HTTP/1.1\r\nHost: x\r\n\r\n");
    struct {
        const char *name, *req;
        int status;
        const char *needle;
    } cases[] = {
        {"two Content-Length", POST_HEAD "Content-Length: 32\r\nContent-Length: 5\r\n\r\n" SMALL_BODY HEALTH_REQ, 400,
         "more than one Content-Length"},
        {"Content-Length and chunked",
         POST_HEAD "Content-Length: 60\r\nTransfer-Encoding: chunked\r\n\r\n20\r\n" SMALL_BODY "\r\n0\r\n\r\n" HEALTH_REQ,
         400, "both Content-Length and Transfer-Encoding"},
        {"negative Content-Length", POST_HEAD "Content-Length: -5\r\n\r\n" SMALL_BODY, 400, "decimal number"},
        {"non-numeric Content-Length", POST_HEAD "Content-Length: abc\r\n\r\n" SMALL_BODY, 400, "decimal number"},
        {"Transfer-Encoding gzip", POST_HEAD "Transfer-Encoding: gzip\r\n\r\n" SMALL_BODY, 501, "'gzip' is not supported"},
        {"Transfer-Encoding gzip, chunked", POST_HEAD "Transfer-Encoding: gzip, chunked\r\n\r\n20\r\n" SMALL_BODY,
         501, "'gzip' is not supported"},
        {"chunk of 2^64-1 bytes", POST_HEAD "Transfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nabc", 413,
         "--max-body"},
        {"chunk over the body limit", POST_HEAD "Transfer-Encoding: chunked\r\n\r\n1000000\r\nabc", 413, "--max-body"},
        {"GARBAGE", "GARBAGE\r\n\r\n", 400, "request line"},
        {"the start of a TLS hello", "\x16\x03\x01", 400, "request line"},
        {"HTTP/2.0", "GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505, "HTTP/2.0 is not supported"},
        {"no Host", "GET /health HTTP/1.1\r\n\r\n", 400, "Host"},
        {"folded header", "GET /health HTTP/1.1\r\nHost: x\r\nX-A: b\r\n c\r\n\r\n", 400, "folding"},
        {"space before colon", POST_HEAD "Content-Length : 5\r\n\r\nhello", 400, "whitespace before its colon"},
        {"bare LF", "GET /health HTTP/1.1\nHost: x\n\n", 400, "request line"},
        {"header too long", long_field, 431, "longer than"},
        {"URL too long", long_url, 414, "longer than"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        answer a;
        answer_on(dial(g_main.port), cases[i].req, strlen(cases[i].req), 10, &a);
        expect_refusal(cases[i].name, &a, cases[i].status, cases[i].needle, 5);
    }
    free(long_field);
    free(long_url);

    /* later requests on a keep-alive connection */
    struct {
        const char *name, *req;
        int status;
        const char *needle;
    } later[] = {
        {"two Content-Length, second request", POST_HEAD "Content-Length: 32\r\nContent-Length: 5\r\n\r\n" SMALL_BODY
         HEALTH_REQ, 400, "more than one Content-Length"},
        {"Content-Length and chunked, second request",
         POST_HEAD "Content-Length: 60\r\nTransfer-Encoding: chunked\r\n\r\n20\r\n" SMALL_BODY "\r\n0\r\n\r\n" HEALTH_REQ,
         400, "both Content-Length and Transfer-Encoding"},
        {"Transfer-Encoding gzip, second request", POST_HEAD "Transfer-Encoding: gzip\r\n\r\n" SMALL_BODY, 501,
         "'gzip' is not supported"},
    };
    for (size_t i = 0; i < sizeof later / sizeof later[0]; i++) {
        int fd = dial(g_main.port);
        health_keep_alive(fd);
        answer a;
        answer_on(fd, later[i].req, strlen(later[i].req), 10, &a);
        expect_refusal(later[i].name, &a, later[i].status, later[i].needle, 5);
    }

    /* the largest head the gate lets through is one libmicrohttpd takes too */
    char *big = repeat_json("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n", "X-Field-Number-Padded: "
                            "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567"
                            "890123456789\r\n", 97, "", "\r\n");
    assert_true(strlen(big) > 12000 && strlen(big) < 16384);
    resp r;
    http_raw(g_main.port, big, strlen(big), &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    free(big);
}

/* Sends `line` on fd every `every` seconds until the server answers and closes the
 * connection (or limit); a->elapsed counts from the first line. Closes fd. */
static void answer_trickled(int fd, const char *line, double every, double limit, answer *a)
{
    double t0 = mono(), el;
    size_t n = 0;
    char *raw = NULL;
    a->closed = false;
    while (!a->closed && mono() - t0 < limit) {
        send_all(fd, line, strlen(line));
        free(raw);
        raw = recv_until_close(fd, every, &n, &el, &a->closed);
        if (n && !a->closed) {
            /* an answer came: wait for the close that follows it */
            size_t m;
            char *rest = recv_until_close(fd, 2, &m, &el, &a->closed);
            raw = realloc(raw, n + m + 1);
            memcpy(raw + n, rest, m + 1);
            free(rest);
            n += m;
            break;
        }
    }
    a->elapsed = mono() - t0;
    close(fd);
    a->n = count_responses(raw);
    parse_resp(raw, n, &a->r);
}

/* A head or body that trickles in is cut at its deadline with 408 (no byte extends it), a
 * body that stops short gets 408 instead of a silent close, and the same holds for the next
 * request of a keep-alive connection. */
static void test_deadlines(void **state)
{
    (void)state;
    srv *s = &g_extra;
    srv_start(s, "--header-timeout 0.5 --body-timeout 1.5 --idle-timeout 1");
    answer a;

    /* a head trickling in, one line every 0.2 s */
    const char *start = "GET /health HTTP/1.1\r\nHost: x\r\n";
    int fd = dial(s->port);
    assert_true(send_all(fd, start, strlen(start)));
    answer_trickled(fd, "X-Trickle: 1\r\n", 0.2, 6, &a);
    expect_refusal("trickled head", &a, 408, "--header-timeout", 2.5);

    /* a body shorter than its Content-Length: 408 once no byte came for --idle-timeout */
    const char *short_body = POST_HEAD "Content-Length: 100\r\n\r\n{\"prompt\":";
    answer_on(dial(s->port), short_body, strlen(short_body), 6, &a);
    if (a.elapsed < 0.8)
        fail_msg("the short body was answered after %.2f s, before the idle timeout of 1 s", a.elapsed);
    expect_refusal("short body", &a, 408, "--idle-timeout", 3);

    /* a body trickling in, a byte every 0.2 s: 408 at --body-timeout */
    fd = dial(s->port);
    const char *head = POST_HEAD "Content-Length: 100\r\n\r\n";
    assert_true(send_all(fd, head, strlen(head)));
    answer_trickled(fd, " ", 0.2, 6, &a);
    if (a.elapsed < 1.3)
        fail_msg("the trickled body was cut after %.2f s, before --body-timeout 1.5", a.elapsed);
    expect_refusal("trickled body", &a, 408, "--body-timeout", 3.5);

    /* the next head on a keep-alive connection, trickling: cut at --idle-timeout +
     * --header-timeout after the first answer */
    fd = dial(s->port);
    health_keep_alive(fd);
    assert_true(send_all(fd, start, strlen("GET /health HTTP/1.1\r\n")));
    answer_trickled(fd, "X-Trickle: 1\r\n", 0.2, 6, &a);
    if (a.elapsed < 1.2)
        fail_msg("the second head was cut after %.2f s, before --idle-timeout 1 + --header-timeout 0.5",
                 a.elapsed);
    expect_refusal("trickled second head", &a, 408, "--header-timeout", 3.5);

    resp r;
    http_ex(s->port, "GET", "/health", NULL, NULL, 0, false, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    /* each cut request is counted once, as 408, not also as a client gone away */
    assert_int_equal(metric(s->port, "blade:http_requests_total{status=\"408\"}"), 4);
    assert_true(metric(s->port, "blade:http_requests_total{status=\"499\"}") <= 0);
    assert_int_equal(srv_stop(s), 0);
}

/* A connection whose head is not complete yet. */
static int trickler(int port, const char *src)
{
    const char *start = "GET /health HTTP/1.1\r\nHost: x\r\n";
    int fd = dial_from(port, src);
    assert_true(send_all(fd, start, strlen(start)));
    return fd;
}

/* Whether the server has closed fd (within `within` seconds). */
static bool closed_within(int fd, double within)
{
    size_t n;
    double el;
    bool closed;
    free(recv_until_close(fd, within, &n, &el, &closed));
    return closed;
}

/* GET path on a fresh connection from src; the status, within `within` seconds. */
static int get_from(int port, const char *src, const char *path, double within)
{
    char req[256];
    snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
    answer a;
    answer_on(dial_from(port, src), req, strlen(req), within, &a);
    int status = a.closed ? a.r.status : -1;
    resp_free(&a.r);
    return status;
}

/* n keep-alive connections from src that each had a GET /v1/models answered and stay open
 * (not /health: a probe may get a slot kept for probes, which closes after one answer). A 503
 * for want of a slot is tried again: the server frees a closed connection's slot a moment
 * after its client sees the close. */
static void open_idle(int port, const char *src, int *fds, int n)
{
    const char *req = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
    for (int i = 0; i < n; i++)
        for (int tries = 0;; tries++) {
            fds[i] = dial_from(port, src);
            assert_true(send_all(fds[i], req, strlen(req)));
            char buf[8192];
            ssize_t got = recv(fds[i], buf, sizeof buf - 1, 0);
            assert_true(got > 0);
            buf[got] = 0;
            if (strstr(buf, "HTTP/1.1 200"))
                break;
            assert_true(strstr(buf, "HTTP/1.1 503") && tries < 40);
            close(fds[i]);
            usleep(50000);
        }
}

/* The per-address cap, and /health answered at once while every slot is held by connections
 * trickling their heads or idling. */
static void test_connection_caps(void **state)
{
    (void)state;
    srv *s = &g_extra;
    srv_start(s, "--max-connections 8 --max-connections-per-ip 4 --limit-loopback --header-timeout 30");
    int t[16];

    /* the cap's worth of trickling connections from one address; a fifth replaces the oldest */
    for (int i = 0; i < 4; i++)
        t[i] = trickler(s->port, "127.0.0.1");
    usleep(100000);
    t[4] = trickler(s->port, "127.0.0.1");
    assert_true(closed_within(t[0], 2));
    for (int i = 1; i < 5; i++)
        assert_false(closed_within(t[i], 0.05));
    /* /health from the same address and from another is answered at once */
    double t0 = mono();
    assert_int_equal(get_from(s->port, "127.0.0.1", "/health", 5), 200);
    assert_int_equal(get_from(s->port, "127.0.0.2", "/health", 5), 200);
    if (mono() - t0 > 3)
        fail_msg("/health took %.2f s while trickling connections were held", mono() - t0);
    /* more trickling connections than --max-connections, from several addresses */
    char src[32];
    for (int i = 5; i < 16; i++) {
        snprintf(src, sizeof src, "127.0.1.%d", i % 4 + 1);
        t[i] = trickler(s->port, src);
    }
    t0 = mono();
    assert_int_equal(get_from(s->port, "127.0.0.3", "/health", 5), 200);
    assert_int_equal(get_from(s->port, "127.0.0.3", "/v1/models", 5), 200);
    if (mono() - t0 > 3)
        fail_msg("/health and /v1/models took %.2f s while trickling connections were held", mono() - t0);
    for (int i = 0; i < 16; i++)
        close(t[i]);

    /* open connections: four idle ones from an address, then a fifth request from it is
     * refused with 503, except /health */
    int idle[8];
    open_idle(s->port, "127.0.0.5", idle, 4);
    answer a;
    const char *models = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
    answer_on(dial_from(s->port, "127.0.0.5"), models, strlen(models), 5, &a);
    expect_refusal("fifth connection from one address", &a, 503, "--max-connections-per-ip", 2);
    assert_int_equal(get_from(s->port, "127.0.0.5", "/health", 5), 200);
    /* every slot open: /v1/models gets 503, /health still 200 (a slot kept for probes) */
    open_idle(s->port, "127.0.0.6", idle + 4, 4);
    answer_on(dial_from(s->port, "127.0.0.7"), models, strlen(models), 5, &a);
    expect_refusal("every slot taken", &a, 503, "--max-connections", 2);
    assert_int_equal(get_from(s->port, "127.0.0.7", "/health", 5), 200);
    for (int i = 0; i < 8; i++)
        close(idle[i]);
    assert_int_equal(srv_stop(s), 0);
}

/* Twenty streaming clients leave mid-stream: every request is aborted, and every KV block
 * is back in the pool within moments, long before the requests could have finished; with
 * speculation (draft_kv), the draft model's blocks too. */
static void disconnects_free_blocks(const srv *s, bool draft_kv)
{
    enum { N = 20 };
    int port = s->port;
    long long gone_before = metric(port, "blade:http_requests_total{status=\"499\"}");
    if (gone_before < 0)
        gone_before = 0;
    long long tokens_before = metric(port, "blade:generation_tokens_total");
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":1900,\"ignore_eos\":true,\"stream\":true}";
    char head[1024];
    build_request(head, sizeof head, "POST", "/v1/completions", NULL, strlen(body), true);
    int fds[N];
    for (int i = 0; i < N; i++) {
        fds[i] = dial(port);
        assert_true(send_all(fds[i], head, strlen(head)));
        assert_true(send_all(fds[i], body, strlen(body)));
    }
    for (int i = 0; i < N; i++) {
        /* wait for two events: the stream is under way */
        char buf[65536];
        size_t n = 0;
        int seen = 0;
        while (seen < 2 && n < sizeof buf - 1) {
            ssize_t r = recv(fds[i], buf + n, sizeof buf - 1 - n, 0);
            assert_true(r > 0);
            n += (size_t)r;
            buf[n] = 0;
            seen = 0;
            for (const char *p = buf; (p = strstr(p, "data: ")); p += 6)
                seen++;
        }
    }
    assert_true(metric(port, "blade:num_requests_running") > 0);
    for (int i = 0; i < N; i++)
        close(fds[i]);
    double until = mono() + 10;
    long long used = -1, running = -1;
    long long draft_used = 0;
    while (mono() < until) {
        used = metric(port, "blade:kv_blocks_used");
        running = metric(port, "blade:num_requests_running");
        if (draft_kv)
            draft_used = metric(port, "blade:spec_decode_draft_kv_blocks_used");
        if (used == 0 && running == 0 && draft_used == 0)
            break;
        usleep(50000);
    }
    assert_int_equal(used, 0);
    assert_int_equal(running, 0);
    assert_int_equal(draft_used, 0);
    /* had they run on, the blocks would only be free after N x 1900 tokens */
    long long generated = metric(port, "blade:generation_tokens_total") - tokens_before;
    if (generated > N * 1900 / 2)
        fail_msg("%lld tokens were generated for the %d dropped streams: they were not aborted", generated, N);
    until = mono() + 10;
    while (metric(port, "blade:http_requests_total{status=\"499\"}") < gone_before + N && mono() < until)
        usleep(50000);
    assert_true(metric(port, "blade:http_requests_total{status=\"499\"}") >= gone_before + N);
}

static void test_disconnects_free_blocks(void **state)
{
    (void)state;
    disconnects_free_blocks(&g_main, false);
}

/* With speculation on (a Q8_0 copy of the model's first layers, with a KV of its own,
 * drafting four tokens a step), greedy text over HTTP is what the plain server gives, and
 * dropped streams give back the drafter's KV as well as the target's. */
static void test_speculation_over_http(void **state)
{
    (void)state;
    srv_start(&g_extra, "--spec self --self-layers 2 --self-type q8_0 --spec-fixed-k --spec-k 4");
    const char *body = "{\"prompt\":\"Once upon a time, there was a little girl\",\"max_tokens\":120,\"temperature\":0}";
    json_t *plain = post_ok(g_main.port, "/v1/completions", body), *spec = post_ok(g_extra.port, "/v1/completions", body);
    assert_string_equal(choice_text(spec, 0), choice_text(plain, 0));
    json_decref(plain);
    json_decref(spec);
    long long drafted = metric(g_extra.port, "blade:spec_decode_num_draft_tokens_total");
    assert_true(drafted > 0);
    assert_true(metric(g_extra.port, "blade:spec_decode_draft_kv_blocks_total") > 0);
    disconnects_free_blocks(&g_extra, true);
    /* the dropped streams were speculating */
    assert_true(metric(g_extra.port, "blade:spec_decode_num_draft_tokens_total") > drafted);
    assert_int_equal(srv_stop(&g_extra), 0);
}

/* The queue limit (429), the time limit (504) outlasting a shorter idle timeout, and a model
 * without a chat template (400). */
static void test_limits(void **state)
{
    (void)state;
    srv *s = &g_extra;
    srv_start(s, "--max-queue 2 --max-seqs 1 --timeout 3 --idle-timeout 1");
    /* 128 choices of 2000 tokens (the most one request may ask), one sequence at a time:
     * a Zen 5 core decodes them in about 23 s, far longer than the timeout (sixteen choices
     * finished inside the 3 s on that CPU) */
    const char *body = "{\"prompt\":[\"Once\",\"Once\",\"Once\",\"Once\",\"Once\",\"Once\",\"Once\",\"Once\"],"
                       "\"max_tokens\":2000,\"n\":16,\"ignore_eos\":true}";
    char head[1024];
    build_request(head, sizeof head, "POST", "/v1/completions", NULL, strlen(body), false);
    /* the first runs (it is no longer queued once it has a token), then two more wait whole */
    int fds[3];
    for (int i = 0; i < 3; i++) {
        fds[i] = dial(s->port);
        send_all(fds[i], head, strlen(head));
        send_all(fds[i], body, strlen(body));
        double until = mono() + 5;
        bool in = false;
        while (!in && mono() < until) {
            in = metric(s->port, "blade:num_requests_running") == 1 && metric(s->port, "blade:http_requests_queued") == i;
            if (!in)
                usleep(5000);
        }
        assert_true(in);
    }
    resp r;
    post(s->port, "/v1/completions", body, &r);
    assert_int_equal(r.status, 429);
    assert_non_null(strstr(r.body, "--max-queue"));
    resp_free(&r);
    for (int i = 0; i < 3; i++) {
        size_t n;
        char *raw = recv_all(fds[i], &n);
        close(fds[i]);
        parse_resp(raw, n, &r);
        assert_int_equal(r.status, 504);
        assert_non_null(strstr(r.body, "--timeout"));
        resp_free(&r);
    }
    post(s->port, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", &r);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, "no chat template"));
    resp_free(&r);
    json_t *ok = post_ok(s->port, "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":2}");
    json_decref(ok);
    assert_int_equal(srv_stop(s), 0);
}

/* SIGTERM while a stream runs: health and new requests get 503, the stream still ends
 * normally, and the server exits 0. */
static void test_drain(void **state)
{
    (void)state;
    srv *s = &g_extra;
    srv_start(s, "--drain-timeout 120 --max-seqs 1");
    /* The stream must outlast the health check on a fast machine and end well within the
     * drain timeout on a slow one (sanitizers): one sequence at a time makes its length
     * predictable from a measured rate, and it is sized to about two seconds. */
    double t = mono();
    json_t *probe = post_ok(s->port, "/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":200,\"ignore_eos\":true}");
    json_decref(probe);
    double rate = 200 / (mono() - t);
    int total = rate * 2 < 400 ? 400 : rate * 2 > 32000 ? 32000 : (int)(rate * 2);
    int choices = (total + 1999) / 2000;
    char body[256];
    snprintf(body, sizeof body, "{\"prompt\":\"Once\",\"max_tokens\":%d,\"n\":%d,\"ignore_eos\":true,\"stream\":true}",
             (total + choices - 1) / choices, choices);
    char head[1024];
    build_request(head, sizeof head, "POST", "/v1/completions", NULL, strlen(body), false);
    int fd = dial(s->port);
    send_all(fd, head, strlen(head));
    send_all(fd, body, strlen(body));
    char first[4096];
    ssize_t got = recv(fd, first, sizeof first, 0);
    assert_true(got > 0);
    kill(s->pid, SIGTERM);
    resp r;
    double until = mono() + 10;
    do {
        http_ex(s->port, "GET", "/health", NULL, NULL, 0, false, &r);
        if (r.status == 503)
            break;
        resp_free(&r);
        usleep(20000);
    } while (mono() < until);
    assert_int_equal(r.status, 503);
    assert_non_null(strstr(r.body, "draining"));
    resp_free(&r);
    post(s->port, "/v1/completions", "{\"prompt\":\"a\"}", &r);
    assert_int_equal(r.status, 503);
    assert_non_null(strstr(r.body, "shutting down"));
    resp_free(&r);
    size_t n;
    char *rest = recv_all(fd, &n);
    close(fd);
    char *all = malloc((size_t)got + n + 1);
    memcpy(all, first, (size_t)got);
    memcpy(all + got, rest, n + 1);
    free(rest);
    parse_resp(all, (size_t)got + n, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"finish_reason\":\"length\""));
    assert_non_null(strstr(r.body, "data: [DONE]\n\n"));
    resp_free(&r);
    int status;
    assert_int_equal(waitpid(s->pid, &status, 0), s->pid);
    fclose(s->out);
    s->pid = 0;
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_health_models_metrics),
        cmocka_unit_test(test_completion_equals_run),
        cmocka_unit_test(test_chat_equals_run_and_caches_prefix),
        cmocka_unit_test(test_streaming),
        cmocka_unit_test(test_n_seed_stop_logprobs),
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_framing),
        cmocka_unit_test_teardown(test_deadlines, stop_extra),
        cmocka_unit_test_teardown(test_connection_caps, stop_extra),
        cmocka_unit_test(test_disconnects_free_blocks),
        cmocka_unit_test_teardown(test_speculation_over_http, stop_extra),
        cmocka_unit_test_teardown(test_limits, stop_extra),
        cmocka_unit_test_teardown(test_drain, stop_extra),
        cmocka_unit_test(test_embeddings_api),
        cmocka_unit_test_teardown(test_embed_model, stop_extra),
        cmocka_unit_test_teardown(test_semantic_cache_tenants, stop_extra),
        cmocka_unit_test_teardown(test_semantic_cache_eviction_ttl, stop_extra),
        cmocka_unit_test_teardown(test_semantic_cache_persistence, stop_extra),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

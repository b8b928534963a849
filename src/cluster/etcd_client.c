/* etcd v3 client over the JSON gateway (etcd_client.h): one bounded HTTP POST per call,
 * a keep-alive thread per registration and a streaming watch thread per prefix. */

#include "blade/etcd_client.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_ENDPOINTS 8
#define MAX_RESPONSE (64u << 20)
/* A watch stream whose connection went quiet this long is checked with a request: a host
 * that vanished without closing its sockets would otherwise look like a quiet prefix. */
#define WATCH_CHECK_MS 2000

struct blade_etcd {
    char *endpoints[MAX_ENDPOINTS];
    int n_endpoints;
    int preferred; /* the endpoint that answered last */
    int timeout_ms;
};

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void init_curl(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The wall-clock time ms from now, as pthread_cond_timedwait wants it. */
static struct timespec realtime_in(int64_t ms)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (ms % 1000) * 1000000;
    if (t.tv_nsec >= 1000000000) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000;
    }
    return t;
}

blade_etcd *blade_etcd_new(const blade_etcd_config *cfg, blade_error *err)
{
    pthread_once(&curl_once, init_curl);
    blade_etcd *e = calloc(1, sizeof *e);
    if (!e) {
        blade_error_set(err, "etcd: out of memory");
        return NULL;
    }
    e->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 5000;
    const char *p = cfg->endpoints ? cfg->endpoints : "";
    while (*p) {
        size_t n = strcspn(p, ",");
        if (n > 0) {
            if (e->n_endpoints == MAX_ENDPOINTS) {
                blade_error_set(err, "etcd: more than %d endpoints", MAX_ENDPOINTS);
                blade_etcd_free(e);
                return NULL;
            }
            /* Trailing slashes would double the one each path starts with. */
            size_t m = n;
            while (m > 0 && p[m - 1] == '/')
                m--;
            e->endpoints[e->n_endpoints++] = strndup(p, m);
        }
        p += n + (p[n] == ',');
    }
    if (e->n_endpoints == 0) {
        blade_error_set(err, "etcd: no endpoint given (e.g. http://127.0.0.1:2379)");
        blade_etcd_free(e);
        return NULL;
    }
    for (int i = 0; i < e->n_endpoints; i++)
        if (!e->endpoints[i] || (strncmp(e->endpoints[i], "http://", 7) && strncmp(e->endpoints[i], "https://", 8))) {
            blade_error_set(err, "etcd: endpoint '%s' is not an http:// or https:// URL",
                            e->endpoints[i] ? e->endpoints[i] : "?");
            blade_etcd_free(e);
            return NULL;
        }
    return e;
}

void blade_etcd_free(blade_etcd *e)
{
    if (!e)
        return;
    for (int i = 0; i < e->n_endpoints; i++)
        free(e->endpoints[i]);
    free(e);
}

/* ---- encoding ---- */

static char *b64_encode(const void *data, size_t len)
{
    char *out = malloc(4 * ((len + 2) / 3) + 1);
    if (out)
        EVP_EncodeBlock((unsigned char *)out, data, (int)len);
    return out;
}

/* Decoded bytes, NUL-terminated, in a malloc'd buffer; NULL when not base64. */
static uint8_t *b64_decode(const char *text, size_t *len)
{
    size_t n = strlen(text);
    if (n % 4)
        return NULL;
    uint8_t *out = malloc(n / 4 * 3 + 1);
    if (!out)
        return NULL;
    int got = n ? EVP_DecodeBlock(out, (const unsigned char *)text, (int)n) : 0;
    if (got < 0) {
        free(out);
        return NULL;
    }
    /* EVP_DecodeBlock counts the padding as zero bytes. */
    size_t pad = (n >= 1 && text[n - 1] == '=') + (n >= 2 && text[n - 2] == '=');
    *len = (size_t)got - pad;
    out[*len] = 0;
    return out;
}

/* The end of the key range that holds exactly the keys starting with prefix: the prefix
 * with its last byte below 0xff incremented (etcd's own rule); "\0" (every key) if none. */
static char *prefix_end_b64(const char *prefix)
{
    size_t n = strlen(prefix);
    uint8_t *end = malloc(n + 1);
    if (!end)
        return NULL;
    memcpy(end, prefix, n);
    while (n > 0 && end[n - 1] == 0xff)
        n--;
    if (n == 0) {
        end[0] = 0;
        n = 1;
    } else {
        end[n - 1]++;
    }
    char *b = b64_encode(end, n);
    free(end);
    return b;
}

/* An int64 field, which the gateway writes as a string (and omits when 0). */
static int64_t get_i64(const json_t *obj, const char *name)
{
    const json_t *v = json_object_get(obj, name);
    if (json_is_integer(v))
        return (int64_t)json_integer_value(v);
    if (json_is_string(v))
        return strtoll(json_string_value(v), NULL, 10);
    return 0;
}

static json_t *i64_json(int64_t v)
{
    char buf[24];
    snprintf(buf, sizeof buf, "%lld", (long long)v);
    return json_string(buf);
}

/* ---- requests ---- */

typedef struct body {
    char *data;
    size_t len, cap;
    bool too_big;
} body;

static size_t collect(char *ptr, size_t size, size_t nmemb, void *user)
{
    body *b = user;
    size_t n = size * nmemb;
    if (b->len + n > MAX_RESPONSE) {
        b->too_big = true;
        return 0;
    }
    if (b->len + n + 1 > b->cap) {
        size_t cap = (b->len + n + 1) * 2;
        char *d = realloc(b->data, cap);
        if (!d)
            return 0;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, ptr, n);
    b->len += n;
    b->data[b->len] = 0;
    return n;
}

static CURL *new_handle(const char *url, const char *payload, struct curl_slist *headers, int timeout_ms)
{
    CURL *h = curl_easy_init();
    if (!h)
        return NULL;
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, payload);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)timeout_ms);
    if (timeout_ms > 0)
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    /* Membership traffic must not wander through a proxy set for other uses. */
    curl_easy_setopt(h, CURLOPT_NOPROXY, "*");
    return h;
}

/* The message of an error body ({"error": "...", "message": "..."}), else the status. */
static void http_error(const char *endpoint, const char *path, long status, const char *text, blade_error *err)
{
    json_t *j = text ? json_loads(text, 0, NULL) : NULL;
    const char *msg = j ? json_string_value(json_object_get(j, "message")) : NULL;
    if (!msg && j)
        msg = json_string_value(json_object_get(j, "error"));
    blade_error_set(err, "etcd %s%s: HTTP %ld%s%s", endpoint, path, status, msg ? ": " : "", msg ? msg : "");
    json_decref(j);
}

/* POSTs body to path on the first endpoint that answers and parses the reply. Steals
 * body. */
static json_t *request(blade_etcd *e, const char *path, json_t *req, blade_error *err)
{
    char *payload = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    if (!payload) {
        blade_error_set(err, "etcd %s: out of memory", path);
        return NULL;
    }
    struct curl_slist *headers = curl_slist_append(NULL, "Content-Type: application/json");
    json_t *result = NULL;
    int64_t deadline = now_ms() + e->timeout_ms;
    int first = __atomic_load_n(&e->preferred, __ATOMIC_RELAXED);
    for (int k = 0; k < e->n_endpoints && !result; k++) {
        int i = (first + k) % e->n_endpoints;
        int left = (int)(deadline - now_ms());
        if (left <= 0) {
            blade_error_set(err, "etcd %s: no answer within %d ms", path, e->timeout_ms);
            break;
        }
        char url[512];
        snprintf(url, sizeof url, "%s%s", e->endpoints[i], path);
        body b = {0};
        CURL *h = new_handle(url, payload, headers, left);
        if (!h) {
            blade_error_set(err, "etcd %s: out of memory", url);
            break;
        }
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, collect);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
        CURLcode rc = curl_easy_perform(h);
        long status = 0;
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
        curl_easy_cleanup(h);
        if (rc != CURLE_OK) {
            blade_error_set(err, "etcd %s: %s", url, b.too_big ? "reply too large" : curl_easy_strerror(rc));
        } else if (status != 200) {
            http_error(e->endpoints[i], path, status, b.data, err);
        } else {
            json_error_t je;
            result = json_loadb(b.data ? b.data : "", b.len, 0, &je);
            if (!json_is_object(result)) {
                blade_error_set(err, "etcd %s: reply is not a JSON object: %s", url, je.text);
                json_decref(result);
                result = NULL;
            } else {
                __atomic_store_n(&e->preferred, i, __ATOMIC_RELAXED);
            }
        }
        free(b.data);
        /* An HTTP error is etcd's answer; only unreachable endpoints are worth a retry. */
        if (rc == CURLE_OK && !result)
            break;
    }
    curl_slist_free_all(headers);
    free(payload);
    return result;
}

static int check_key(const char *key, blade_error *err)
{
    if (!key || !*key)
        return blade_error_set(err, "etcd: empty key");
    return 0;
}

int blade_etcd_put(blade_etcd *e, const char *key, const void *value, size_t len, int64_t lease, blade_error *err)
{
    if (check_key(key, err))
        return -1;
    char *k = b64_encode(key, strlen(key)), *v = b64_encode(value, len);
    json_t *req = json_pack("{s:s?, s:s?}", "key", k, "value", v);
    free(k);
    free(v);
    if (req && lease)
        json_object_set_new(req, "lease", i64_json(lease));
    json_t *resp = req ? request(e, "/v3/kv/put", req, err) : NULL;
    if (!req)
        blade_error_set(err, "etcd put: out of memory");
    json_decref(resp);
    return resp ? 0 : -1;
}

void blade_etcd_list_free(blade_etcd_list *l)
{
    for (size_t i = 0; i < l->n; i++) {
        free(l->kvs[i].key);
        free(l->kvs[i].value);
    }
    free(l->kvs);
    memset(l, 0, sizeof *l);
}

/* One kv object of a reply into out; -1 when its fields are not what etcd sends. */
static int parse_kv(const json_t *kv, blade_etcd_kv *out)
{
    memset(out, 0, sizeof *out);
    const char *k = json_string_value(json_object_get(kv, "key"));
    const char *v = json_string_value(json_object_get(kv, "value"));
    size_t klen = 0;
    out->key = k ? (char *)b64_decode(k, &klen) : NULL;
    out->value = b64_decode(v ? v : "", &out->value_len);
    if (!out->key || !out->value || strlen(out->key) != klen) {
        free(out->key);
        free(out->value);
        return -1;
    }
    out->create_revision = get_i64(kv, "create_revision");
    out->mod_revision = get_i64(kv, "mod_revision");
    out->version = get_i64(kv, "version");
    out->lease = get_i64(kv, "lease");
    return 0;
}

/* A request naming one key, or every key under it as a prefix. */
static json_t *key_request(blade_etcd *e, const char *path, const char *key, bool prefix, blade_error *err)
{
    if (check_key(key, err))
        return NULL;
    char *k = b64_encode(key, strlen(key)), *end = prefix ? prefix_end_b64(key) : NULL;
    json_t *req = k && (end || !prefix) ? json_pack("{s:s}", "key", k) : NULL;
    if (req && end)
        json_object_set_new(req, "range_end", json_string(end));
    free(k);
    free(end);
    if (!req) {
        blade_error_set(err, "etcd %s: out of memory", path);
        return NULL;
    }
    return request(e, path, req, err);
}

static int range(blade_etcd *e, const char *key, bool prefix, blade_etcd_list *out, blade_error *err)
{
    memset(out, 0, sizeof *out);
    json_t *resp = key_request(e, "/v3/kv/range", key, prefix, err);
    if (!resp)
        return -1;
    out->revision = get_i64(json_object_get(resp, "header"), "revision");
    json_t *kvs = json_object_get(resp, "kvs");
    size_t n = json_array_size(kvs);
    out->kvs = calloc(n ? n : 1, sizeof *out->kvs);
    int rc = out->kvs ? 0 : blade_error_set(err, "etcd range: out of memory");
    for (size_t i = 0; rc == 0 && i < n; i++) {
        if (parse_kv(json_array_get(kvs, i), &out->kvs[i]))
            rc = blade_error_set(err, "etcd range: malformed key-value %zu in the reply", i);
        else
            out->n++;
    }
    json_decref(resp);
    if (rc)
        blade_etcd_list_free(out);
    return rc;
}

int blade_etcd_get(blade_etcd *e, const char *key, blade_etcd_list *out, blade_error *err)
{
    return range(e, key, false, out, err);
}

int blade_etcd_list_prefix(blade_etcd *e, const char *prefix, blade_etcd_list *out, blade_error *err)
{
    return range(e, prefix, true, out, err);
}

int blade_etcd_delete(blade_etcd *e, const char *key, bool prefix, int64_t *deleted, blade_error *err)
{
    json_t *resp = key_request(e, "/v3/kv/deleterange", key, prefix, err);
    if (!resp)
        return -1;
    if (deleted)
        *deleted = get_i64(resp, "deleted");
    json_decref(resp);
    return 0;
}

int blade_etcd_lease_grant(blade_etcd *e, int64_t ttl_s, int64_t *lease, int64_t *granted_ttl, blade_error *err)
{
    json_t *req = json_object();
    json_object_set_new(req, "TTL", i64_json(ttl_s));
    json_t *resp = request(e, "/v3/lease/grant", req, err);
    if (!resp)
        return -1;
    *lease = get_i64(resp, "ID");
    if (granted_ttl)
        *granted_ttl = get_i64(resp, "TTL");
    const char *msg = json_string_value(json_object_get(resp, "error"));
    int rc = 0;
    if (*lease == 0)
        rc = blade_error_set(err, "etcd lease grant: %s", msg && *msg ? msg : "no lease in the reply");
    json_decref(resp);
    return rc;
}

int blade_etcd_lease_keepalive(blade_etcd *e, int64_t lease, int64_t *ttl, blade_error *err)
{
    json_t *req = json_object();
    json_object_set_new(req, "ID", i64_json(lease));
    json_t *resp = request(e, "/v3/lease/keepalive", req, err);
    if (!resp)
        return -1;
    /* A stream endpoint: one {"result": ...} per request sent. */
    json_t *res = json_object_get(resp, "result");
    int rc = 0;
    if (!json_is_object(res)) {
        json_t *error = json_object_get(resp, "error");
        const char *msg = json_string_value(json_object_get(error, "message"));
        rc = blade_error_set(err, "etcd lease keepalive: %s", msg ? msg : "no result in the reply");
    } else {
        *ttl = get_i64(res, "TTL");
    }
    json_decref(resp);
    return rc;
}

int blade_etcd_lease_revoke(blade_etcd *e, int64_t lease, blade_error *err)
{
    json_t *req = json_object();
    json_object_set_new(req, "ID", i64_json(lease));
    json_t *resp = request(e, "/v3/lease/revoke", req, err);
    json_decref(resp);
    return resp ? 0 : -1;
}

/* ---- registration ---- */

struct blade_etcd_registration {
    blade_etcd *e;
    char *key;
    uint8_t *value;
    size_t value_len;
    int ttl_s;
    int64_t lease;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    bool ok;
    int renewals;
    blade_error last;
};

/* Grants a lease and puts the key under it (caller holds no lock; reads value under mu). */
static int establish(blade_etcd_registration *r, blade_error *err)
{
    int64_t lease, ttl;
    if (blade_etcd_lease_grant(r->e, r->ttl_s, &lease, &ttl, err))
        return -1;
    pthread_mutex_lock(&r->mu);
    uint8_t *v = malloc(r->value_len + 1);
    size_t n = r->value_len;
    if (v)
        memcpy(v, r->value, n);
    pthread_mutex_unlock(&r->mu);
    int rc = v ? blade_etcd_put(r->e, r->key, v, n, lease, err) : blade_error_set(err, "etcd: out of memory");
    free(v);
    if (rc) {
        blade_etcd_lease_revoke(r->e, lease, NULL);
        return -1;
    }
    pthread_mutex_lock(&r->mu);
    r->lease = lease;
    pthread_mutex_unlock(&r->mu);
    return 0;
}

static void *keep_alive(void *arg)
{
    blade_etcd_registration *r = arg;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        /* A third of the TTL leaves two more tries before the lease lapses; after a failure
         * retry every second. */
        int64_t wait_ms = r->ok ? (int64_t)r->ttl_s * 1000 / 3 : 1000;
        struct timespec until = realtime_in(wait_ms);
        while (!r->stop && pthread_cond_timedwait(&r->cv, &r->mu, &until) != ETIMEDOUT)
            ;
        if (r->stop)
            break;
        int64_t lease = r->lease;
        pthread_mutex_unlock(&r->mu);

        blade_error err = {{0}};
        int64_t ttl = 0;
        int rc = blade_etcd_lease_keepalive(r->e, lease, &ttl, &err);
        bool renewed = false;
        if (rc == 0 && ttl <= 0) {
            /* etcd lost the lease (it lapsed while we could not reach it): the key went
             * with it, so both are made again. */
            rc = establish(r, &err);
            renewed = rc == 0;
        }
        pthread_mutex_lock(&r->mu);
        r->ok = rc == 0;
        r->renewals += renewed;
        if (rc)
            r->last = err;
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

blade_etcd_registration *blade_etcd_register(blade_etcd *e, const char *key, const void *value, size_t len, int ttl_s,
                                             blade_error *err)
{
    if (check_key(key, err))
        return NULL;
    if (ttl_s < 2) {
        blade_error_set(err, "etcd registration: TTL of %d s (at least 2)", ttl_s);
        return NULL;
    }
    blade_etcd_registration *r = calloc(1, sizeof *r);
    if (!r || !(r->key = strdup(key)) || !(r->value = malloc(len + 1))) {
        if (r)
            free(r->key);
        free(r);
        blade_error_set(err, "etcd registration: out of memory");
        return NULL;
    }
    memcpy(r->value, value, len);
    r->value_len = len;
    r->e = e;
    r->ttl_s = ttl_s;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    if (establish(r, err) == 0) {
        r->ok = true;
        if (pthread_create(&r->thread, NULL, keep_alive, r) == 0)
            return r;
        blade_error_set(err, "etcd registration: cannot start the keep-alive thread");
        blade_etcd_lease_revoke(e, r->lease, NULL);
    }
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r->key);
    free(r->value);
    free(r);
    return NULL;
}

int blade_etcd_registration_update(blade_etcd_registration *r, const void *value, size_t len, blade_error *err)
{
    uint8_t *v = malloc(len + 1);
    if (!v)
        return blade_error_set(err, "etcd registration: out of memory");
    memcpy(v, value, len);
    pthread_mutex_lock(&r->mu);
    free(r->value);
    r->value = v;
    r->value_len = len;
    int64_t lease = r->lease;
    pthread_mutex_unlock(&r->mu);
    /* If the lease was lost meanwhile the put fails and the thread re-creates both with
     * the new value. */
    return blade_etcd_put(r->e, r->key, value, len, lease, err);
}

bool blade_etcd_registration_ok(blade_etcd_registration *r, blade_error *why)
{
    pthread_mutex_lock(&r->mu);
    bool ok = r->ok;
    if (!ok && why)
        *why = r->last;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

int blade_etcd_registration_renewals(blade_etcd_registration *r)
{
    pthread_mutex_lock(&r->mu);
    int n = r->renewals;
    pthread_mutex_unlock(&r->mu);
    return n;
}

void blade_etcd_unregister(blade_etcd_registration *r)
{
    if (!r)
        return;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL);
    blade_etcd_lease_revoke(r->e, r->lease, NULL);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r->key);
    free(r->value);
    free(r);
}

/* ---- watch ---- */

struct blade_etcd_watch {
    blade_etcd *e;
    char *prefix;
    blade_etcd_watch_fn fn;
    void *user;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    CURLM *multi; /* the stream in progress, woken on stop */
    int64_t next_revision; /* first revision not yet delivered; 0: list first */
    bool connected;
    /* The stream's bytes not yet parsed (a partial line). */
    char *line;
    size_t line_len, line_cap;
    bool overflow;
    bool canceled;       /* etcd ended the watch (compaction, error) */
    int64_t last_data_ms;
};

static bool stopping(blade_etcd_watch *w)
{
    pthread_mutex_lock(&w->mu);
    bool s = w->stop;
    pthread_mutex_unlock(&w->mu);
    return s;
}

/* Sleeps up to ms unless stopped; true when stopped. */
static bool nap(blade_etcd_watch *w, int64_t ms)
{
    struct timespec until = realtime_in(ms);
    pthread_mutex_lock(&w->mu);
    while (!w->stop && pthread_cond_timedwait(&w->cv, &w->mu, &until) != ETIMEDOUT)
        ;
    bool s = w->stop;
    pthread_mutex_unlock(&w->mu);
    return s;
}

static void emit(blade_etcd_watch *w, blade_etcd_event_type type, const blade_etcd_kv *kv, const char *reason)
{
    blade_etcd_event ev = {.type = type, .reason = reason};
    if (kv) {
        ev.key = kv->key;
        ev.value = kv->value;
        ev.value_len = kv->value_len;
        ev.revision = kv->mod_revision;
    }
    w->fn(&ev, w->user);
}

static void set_connected(blade_etcd_watch *w, bool up, const char *reason)
{
    if (w->connected == up)
        return;
    w->connected = up;
    emit(w, up ? BLADE_ETCD_RECONNECTED : BLADE_ETCD_DISCONNECTED, NULL, reason);
}

/* RESET and the prefix as it is now; the stream then starts after the listed revision. */
static int relist(blade_etcd_watch *w, blade_error *err)
{
    blade_etcd_list l;
    if (blade_etcd_list_prefix(w->e, w->prefix, &l, err))
        return -1;
    emit(w, BLADE_ETCD_RESET, NULL, NULL);
    for (size_t i = 0; i < l.n; i++)
        emit(w, BLADE_ETCD_PUT, &l.kvs[i], NULL);
    w->next_revision = l.revision + 1;
    blade_etcd_list_free(&l);
    return 0;
}

/* One line of the stream: a watch response. */
static void handle_message(blade_etcd_watch *w, const char *text, size_t len)
{
    json_t *j = json_loadb(text, len, 0, NULL);
    json_t *res = json_object_get(j, "result");
    if (!json_is_object(res)) {
        w->canceled = true; /* {"error": ...}: the gateway ends the stream */
        json_decref(j);
        return;
    }
    if (json_is_true(json_object_get(res, "canceled")) || get_i64(res, "compact_revision") > 0) {
        if (get_i64(res, "compact_revision") > 0)
            w->next_revision = 0; /* history gone: list again */
        w->canceled = true;
    }
    /* A store behind the revision this watch resumes from is not the one it watched (etcd
     * back without its data, or from an older backup): its events would start below the
     * resume point and never be delivered. List it afresh. */
    int64_t store_revision = get_i64(json_object_get(res, "header"), "revision");
    if (json_is_true(json_object_get(res, "created")) && store_revision > 0 && store_revision + 1 < w->next_revision) {
        w->next_revision = 0;
        w->canceled = true;
    }
    json_t *events = json_object_get(res, "events");
    for (size_t i = 0; i < json_array_size(events); i++) {
        json_t *ev = json_array_get(events, i);
        blade_etcd_kv kv;
        if (parse_kv(json_object_get(ev, "kv"), &kv))
            continue;
        const char *type = json_string_value(json_object_get(ev, "type"));
        /* PUT is the enum's zero value, which the gateway leaves out. */
        bool del = type && !strcmp(type, "DELETE");
        if (kv.mod_revision >= w->next_revision) {
            emit(w, del ? BLADE_ETCD_DELETE : BLADE_ETCD_PUT, &kv, NULL);
            w->next_revision = kv.mod_revision + 1;
        }
        free(kv.key);
        free(kv.value);
    }
    json_decref(j);
}

static size_t stream_data(char *ptr, size_t size, size_t nmemb, void *user)
{
    blade_etcd_watch *w = user;
    size_t n = size * nmemb;
    w->last_data_ms = now_ms();
    for (size_t i = 0; i < n; i++) {
        if (ptr[i] == '\n') {
            if (w->line_len)
                handle_message(w, w->line, w->line_len);
            w->line_len = 0;
            continue;
        }
        if (w->line_len + 1 >= w->line_cap) {
            size_t cap = w->line_cap ? w->line_cap * 2 : 4096;
            char *l = cap <= MAX_RESPONSE ? realloc(w->line, cap) : NULL;
            if (!l) {
                w->overflow = true;
                return 0;
            }
            w->line = l;
            w->line_cap = cap;
        }
        w->line[w->line_len++] = ptr[i];
    }
    return n;
}

/* Runs one watch stream until it breaks, etcd cancels it or the watch is stopped; the
 * reason it ended is in err. */
static void run_stream(blade_etcd_watch *w, const char *endpoint, blade_error *err)
{
    char *k = b64_encode(w->prefix, strlen(w->prefix)), *end = prefix_end_b64(w->prefix);
    json_t *req = json_pack("{s:{s:s?, s:s?, s:o}}", "create_request", "key", k, "range_end", end, "start_revision",
                            i64_json(w->next_revision));
    free(k);
    free(end);
    char *payload = req ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    char url[512];
    snprintf(url, sizeof url, "%s/v3/watch", endpoint);
    struct curl_slist *headers = curl_slist_append(NULL, "Content-Type: application/json");
    CURL *h = payload ? new_handle(url, payload, headers, 0) : NULL;
    CURLM *m = h ? curl_multi_init() : NULL;
    if (!m) {
        blade_error_set(err, "etcd watch: out of memory");
        goto done;
    }
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, stream_data);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, w);
    curl_multi_add_handle(m, h);
    pthread_mutex_lock(&w->mu);
    w->multi = m;
    pthread_mutex_unlock(&w->mu);
    w->line_len = 0;
    w->canceled = w->overflow = false;
    w->last_data_ms = now_ms();
    int64_t started = now_ms();
    bool created = false;
    for (;;) {
        int running = 0;
        curl_multi_perform(m, &running);
        if (!created && w->last_data_ms > started) {
            created = true;
            set_connected(w, true, NULL);
        }
        if (!running) {
            CURLMsg *msg;
            int q;
            CURLcode rc = CURLE_OK;
            while ((msg = curl_multi_info_read(m, &q)))
                if (msg->msg == CURLMSG_DONE)
                    rc = msg->data.result;
            long status = 0;
            curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
            if (rc != CURLE_OK)
                blade_error_set(err, "etcd watch %s: %s", url, w->overflow ? "message too large" : curl_easy_strerror(rc));
            else if (status != 200)
                blade_error_set(err, "etcd watch %s: HTTP %ld", url, status);
            else
                blade_error_set(err, "etcd watch %s: stream ended", url);
            break;
        }
        if (w->canceled) {
            blade_error_set(err, "etcd watch %s: canceled by etcd", url);
            break;
        }
        if (stopping(w))
            break;
        /* A quiet stream is checked by a request of its own: a vanished host leaves the
         * connection open and silent forever. */
        if (now_ms() - w->last_data_ms > WATCH_CHECK_MS) {
            blade_etcd_list probe;
            blade_error perr = {{0}};
            char probe_key[] = "\x01";
            if (blade_etcd_get(w->e, probe_key, &probe, &perr)) {
                blade_error_set(err, "etcd watch: %s", perr.msg);
                break;
            }
            blade_etcd_list_free(&probe);
            if (!created) {
                blade_error_set(err, "etcd watch %s: no answer to the watch request", url);
                break;
            }
            w->last_data_ms = now_ms();
        }
        curl_multi_poll(m, NULL, 0, 500, NULL);
    }
done:
    pthread_mutex_lock(&w->mu);
    w->multi = NULL;
    pthread_mutex_unlock(&w->mu);
    if (m) {
        curl_multi_remove_handle(m, h);
        curl_multi_cleanup(m);
    }
    if (h)
        curl_easy_cleanup(h);
    curl_slist_free_all(headers);
    free(payload);
}

static void *watch_thread(void *arg)
{
    blade_etcd_watch *w = arg;
    int64_t backoff = 100;
    int endpoint = 0;
    while (!stopping(w)) {
        blade_error err = {{0}};
        if (w->next_revision == 0) {
            if (relist(w, &err) == 0) {
                set_connected(w, true, NULL);
                continue;
            }
        } else {
            run_stream(w, w->e->endpoints[endpoint], &err);
            if (stopping(w))
                break;
            if (w->connected)
                backoff = 100;
            if (w->connected && w->next_revision == 0)
                continue; /* compacted: list again at once */
            /* Another member may answer where this one did not. */
            endpoint = (endpoint + 1) % w->e->n_endpoints;
        }
        set_connected(w, false, err.msg);
        if (nap(w, backoff))
            break;
        backoff = backoff * 2 > 1000 ? 1000 : backoff * 2;
    }
    return NULL;
}

blade_etcd_watch *blade_etcd_watch_prefix(blade_etcd *e, const char *prefix, blade_etcd_watch_fn fn, void *user,
                                          blade_error *err)
{
    if (check_key(prefix, err))
        return NULL;
    blade_etcd_watch *w = calloc(1, sizeof *w);
    if (!w || !(w->prefix = strdup(prefix))) {
        free(w);
        blade_error_set(err, "etcd watch: out of memory");
        return NULL;
    }
    w->e = e;
    w->fn = fn;
    w->user = user;
    /* Starts as connected so that a first failure is reported as DISCONNECTED. */
    w->connected = true;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    if (pthread_create(&w->thread, NULL, watch_thread, w) != 0) {
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        free(w->prefix);
        free(w);
        blade_error_set(err, "etcd watch: cannot start its thread");
        return NULL;
    }
    return w;
}

void blade_etcd_watch_stop(blade_etcd_watch *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_signal(&w->cv);
    if (w->multi)
        curl_multi_wakeup(w->multi);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w->line);
    free(w->prefix);
    free(w);
}

/* The router's workers (worker_pool.h): the list (static or watched in etcd), the poller
 * that keeps each one's role, fingerprint and load, the prefix table and the choice. */

#include "router/worker_pool.h"

#include "blade/etcd_client.h"

#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PREFIX_SLOTS (1u << 16)
#define POLL_MS 500

typedef struct worker {
    char url[POOL_URL_MAX];
    char key[POOL_URL_MAX];    /* its etcd key; "" for a static worker */
    bool listed;               /* in the static list or present in etcd */
    bool healthy;              /* its last poll answered 200 */
    char role[16];
    char kv[POOL_URL_MAX];
    char fingerprint[72];
    int64_t running, waiting;  /* as its /metrics said */
    int inflight;              /* requests this router has on it now */
} worker;

typedef struct prefix_slot {
    uint64_t hash;
    int worker;
} prefix_slot;

struct pool {
    pool_config cfg;
    pthread_mutex_t mu;
    worker w[POOL_MAX_WORKERS];
    int n;
    prefix_slot *prefix; /* direct-mapped: a newer block takes an older one's slot */
    uint64_t rr;
    blade_etcd *etcd;
    blade_etcd_watch *watch;
    bool etcd_ok;
    char etcd_why[256];
    char prefix_key[256];
    pthread_t poller;
    atomic_bool stop;
};

/* ---- routing keys: chained FNV-1a over each block ---- */

static uint64_t fnv(uint64_t h, const void *data, size_t n)
{
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

void pool_key_tokens(pool_key *k, const int32_t *tokens, size_t n, int block_tokens)
{
    uint64_t h = 0xcbf29ce484222325ull;
    k->n = 0;
    for (size_t b = 0; (b + 1) * (size_t)block_tokens <= n && k->n < 64; b++) {
        for (int i = 0; i < block_tokens; i++) {
            uint8_t t[4];
            uint32_t v = (uint32_t)tokens[b * (size_t)block_tokens + (size_t)i];
            for (int j = 0; j < 4; j++)
                t[j] = (uint8_t)(v >> (8 * j));
            h = fnv(h, t, 4);
        }
        k->hashes[k->n++] = h;
    }
}

/* Text prompts: blocks of 4 bytes a token, roughly what a tokenizer makes of English. */
void pool_key_bytes(pool_key *k, const char *text, size_t n, int block_tokens)
{
    uint64_t h = 0x84222325cbf29ce4ull;
    size_t block = (size_t)block_tokens * 4;
    k->n = 0;
    for (size_t b = 0; (b + 1) * block <= n && k->n < 64; b++) {
        h = fnv(h, text + b * block, block);
        k->hashes[k->n++] = h;
    }
}

/* ---- the workers ---- */

static int find_url(pool *p, const char *url)
{
    for (int i = 0; i < p->n; i++)
        if (!strcmp(p->w[i].url, url))
            return i;
    return -1;
}

/* A worker's slot, reused for the same URL (a worker restarted at its address). */
static worker *add_worker(pool *p, const char *url, const char *key)
{
    int i = find_url(p, url);
    if (i < 0) {
        if (p->n == POOL_MAX_WORKERS)
            return NULL;
        i = p->n++;
        memset(&p->w[i], 0, sizeof p->w[i]);
        snprintf(p->w[i].url, sizeof p->w[i].url, "%s", url);
    }
    snprintf(p->w[i].key, sizeof p->w[i].key, "%s", key);
    p->w[i].listed = true;
    return &p->w[i];
}

static void on_etcd(const blade_etcd_event *ev, void *user)
{
    pool *p = user;
    pthread_mutex_lock(&p->mu);
    switch (ev->type) {
    case BLADE_ETCD_RESET:
        for (int i = 0; i < p->n; i++)
            if (p->w[i].key[0])
                p->w[i].listed = false;
        break;
    case BLADE_ETCD_PUT: {
        json_error_t je;
        json_t *j = json_loadb((const char *)ev->value, ev->value_len, 0, &je);
        const char *url = json_string_value(json_object_get(j, "url"));
        if (url && strlen(url) < POOL_URL_MAX && strlen(ev->key) < POOL_URL_MAX)
            add_worker(p, url, ev->key);
        else
            fprintf(stderr, "blade router: etcd key %s holds no worker URL; ignored\n", ev->key);
        json_decref(j);
        break;
    }
    case BLADE_ETCD_DELETE:
        for (int i = 0; i < p->n; i++)
            if (!strcmp(p->w[i].key, ev->key)) {
                p->w[i].listed = false;
                p->w[i].healthy = false;
                fprintf(stderr, "blade router: worker %s left (its registration is gone)\n", p->w[i].url);
            }
        break;
    case BLADE_ETCD_DISCONNECTED:
        p->etcd_ok = false;
        snprintf(p->etcd_why, sizeof p->etcd_why, "%s", ev->reason ? ev->reason : "disconnected");
        fprintf(stderr, "blade router: etcd unreachable (%s); keeping the last view of the workers\n", p->etcd_why);
        break;
    case BLADE_ETCD_RECONNECTED:
        p->etcd_ok = true;
        p->etcd_why[0] = 0;
        fprintf(stderr, "blade router: etcd reachable again\n");
        break;
    }
    pthread_mutex_unlock(&p->mu);
}

/* ---- polling ---- */

static size_t collect(char *data, size_t size, size_t n, void *user)
{
    char **buf = user;
    size_t have = *buf ? strlen(*buf) : 0, add = size * n;
    if (have + add > (1u << 20))
        return 0;
    char *grown = realloc(*buf, have + add + 1);
    if (!grown)
        return 0;
    memcpy(grown + have, data, add);
    grown[have + add] = 0;
    *buf = grown;
    return add;
}

static char *http_get(CURL *c, const char *url, const char *path, long *status)
{
    char full[POOL_URL_MAX + 32], *body = NULL;
    snprintf(full, sizeof full, "%s%s", url, path);
    curl_easy_reset(c);
    curl_easy_setopt(c, CURLOPT_URL, full);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 1000L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &body);
    *status = 0;
    if (curl_easy_perform(c) != CURLE_OK) {
        free(body);
        return NULL;
    }
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
    return body ? body : strdup("");
}

static int64_t metric_value(const char *text, const char *name)
{
    char line[128];
    snprintf(line, sizeof line, "\n%s ", name);
    const char *at = strstr(text, line);
    return at ? strtoll(at + strlen(line), NULL, 10) : 0;
}

/* One worker's state, read without the lock (the poller is the only writer of these). */
static void poll_one(CURL *c, const char *url, worker *out)
{
    long status;
    char *health = http_get(c, url, "/health", &status);
    json_error_t je;
    json_t *j = health ? json_loads(health, 0, &je) : NULL;
    out->healthy = status == 200 && json_is_object(j);
    snprintf(out->role, sizeof out->role, "%s", json_string_value(json_object_get(j, "role")) ?: "both");
    snprintf(out->kv, sizeof out->kv, "%s", json_string_value(json_object_get(j, "kv")) ?: "");
    snprintf(out->fingerprint, sizeof out->fingerprint, "%s",
             json_string_value(json_object_get(j, "kv_fingerprint")) ?: "");
    json_decref(j);
    free(health);
    if (!out->healthy)
        return;
    char *m = http_get(c, url, "/metrics", &status);
    if (m && status == 200) {
        out->running = metric_value(m, "blade:num_requests_running");
        out->waiting = metric_value(m, "blade:num_requests_waiting");
    }
    free(m);
}

static void *poller(void *arg)
{
    pool *p = arg;
    CURL *c = curl_easy_init();
    while (c && !atomic_load(&p->stop)) {
        pthread_mutex_lock(&p->mu);
        int n = p->n;
        char urls[POOL_MAX_WORKERS][POOL_URL_MAX];
        bool listed[POOL_MAX_WORKERS];
        for (int i = 0; i < n; i++) {
            memcpy(urls[i], p->w[i].url, POOL_URL_MAX);
            listed[i] = p->w[i].listed;
        }
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < n && !atomic_load(&p->stop); i++) {
            if (!listed[i])
                continue;
            worker got = {0};
            poll_one(c, urls[i], &got);
            pthread_mutex_lock(&p->mu);
            worker *w = &p->w[i];
            if (w->healthy != got.healthy)
                fprintf(stderr, "blade router: worker %s %s\n", w->url,
                        got.healthy ? "is up" : "does not answer; out of the pool");
            w->healthy = got.healthy && w->listed;
            memcpy(w->role, got.role, sizeof w->role);
            memcpy(w->kv, got.kv, sizeof w->kv);
            memcpy(w->fingerprint, got.fingerprint, sizeof w->fingerprint);
            w->running = got.running;
            w->waiting = got.waiting;
            pthread_mutex_unlock(&p->mu);
        }
        for (int t = 0; t < POLL_MS / 50 && !atomic_load(&p->stop); t++)
            nanosleep(&(struct timespec){0, 50 * 1000 * 1000}, NULL);
    }
    curl_easy_cleanup(c);
    return NULL;
}

pool *pool_new(const pool_config *cfg, blade_error *err)
{
    pool *p = calloc(1, sizeof *p);
    if (!p || !(p->prefix = calloc(PREFIX_SLOTS, sizeof *p->prefix))) {
        free(p);
        return blade_error_set(err, "out of memory"), NULL;
    }
    p->cfg = *cfg;
    if (p->cfg.block_tokens <= 0)
        p->cfg.block_tokens = 16;
    if (p->cfg.slack <= 0)
        p->cfg.slack = 4;
    for (size_t i = 0; i < PREFIX_SLOTS; i++)
        p->prefix[i].worker = -1;
    pthread_mutex_init(&p->mu, NULL);
    atomic_init(&p->stop, false);
    if (cfg->workers) {
        char *list = strdup(cfg->workers), *save = NULL;
        for (char *u = strtok_r(list, ",", &save); u; u = strtok_r(NULL, ",", &save)) {
            size_t l = strlen(u);
            while (l && u[l - 1] == '/')
                u[--l] = 0;
            if (strncmp(u, "http://", 7) || l >= POOL_URL_MAX || !add_worker(p, u, "")) {
                blade_error_set(err, "--workers: '%s' is not an http:// URL (or too many workers)", u);
                free(list);
                pool_free(p);
                return NULL;
            }
        }
        free(list);
    }
    if (cfg->etcd) {
        blade_etcd_config ec = {.endpoints = cfg->etcd, .timeout_ms = 2000};
        snprintf(p->prefix_key, sizeof p->prefix_key, "blade/%s/workers/", cfg->cluster);
        p->etcd_ok = true;
        if (!(p->etcd = blade_etcd_new(&ec, err)) ||
            !(p->watch = blade_etcd_watch_prefix(p->etcd, p->prefix_key, on_etcd, p, err))) {
            pool_free(p);
            return NULL;
        }
    }
    if (pthread_create(&p->poller, NULL, poller, p) != 0) {
        blade_error_set(err, "cannot start the worker poller");
        p->poller = 0;
        pool_free(p);
        return NULL;
    }
    return p;
}

void pool_free(pool *p)
{
    if (!p)
        return;
    atomic_store(&p->stop, true);
    if (p->poller)
        pthread_join(p->poller, NULL);
    blade_etcd_watch_stop(p->watch);
    blade_etcd_free(p->etcd);
    pthread_mutex_destroy(&p->mu);
    free(p->prefix);
    free(p);
}

/* ---- choosing ---- */

static int64_t load_of(const worker *w)
{
    return w->inflight + w->running + w->waiting;
}

static bool candidate(const pool *p, int i, bool (*ok)(const worker *, const void *), const void *arg,
                      const bool *exclude)
{
    const worker *w = &p->w[i];
    return w->healthy && w->listed && !(exclude && exclude[i]) && ok(w, arg);
}

/* Among workers that pass ok(): the holder of the longest prefix (if within the slack of
 * the least loaded), else the least loaded; ties take turns: the turn-th of them (mod
 * their number), so that requests of one choice each, in a row, spread over all tied
 * workers whatever their places in the table. -1 when none passes. */
static int pick(pool *p, uint64_t turn, const pool_key *k, bool (*ok)(const worker *, const void *), const void *arg,
                const bool *exclude, bool use_prefix, bool *hit)
{
    int least = -1, ties = 0;
    int64_t least_load = 0;
    for (int i = 0; i < p->n; i++) {
        if (!candidate(p, i, ok, arg, exclude))
            continue;
        int64_t load = load_of(&p->w[i]);
        if (ties == 0 || load < least_load) {
            least_load = load;
            ties = 1;
        } else if (load == least_load) {
            ties++;
        }
    }
    for (int i = 0, skip = ties ? (int)(turn % (uint64_t)ties) : 0; i < p->n && least < 0; i++)
        if (candidate(p, i, ok, arg, exclude) && load_of(&p->w[i]) == least_load && skip-- == 0)
            least = i;
    *hit = false;
    if (least < 0 || !use_prefix || p->cfg.policy == POLICY_ROUND_ROBIN)
        return least;
    for (int b = k->n - 1; b >= 0; b--) {
        const prefix_slot *s = &p->prefix[k->hashes[b] & (PREFIX_SLOTS - 1)];
        if (s->hash != k->hashes[b] || s->worker < 0)
            continue;
        const worker *w = &p->w[s->worker];
        if (!candidate(p, s->worker, ok, arg, exclude))
            continue;
        if (load_of(w) <= least_load + p->cfg.slack) {
            *hit = true;
            return s->worker;
        }
        break;
    }
    return least;
}

static bool role_is(const worker *w, const void *role)
{
    return !strcmp(w->role, role);
}

static bool prefill_for(const worker *w, const void *fingerprint)
{
    return !strcmp(w->role, "prefill") && w->kv[0] && w->fingerprint[0] && !strcmp(w->fingerprint, fingerprint);
}

bool pool_choose(pool *p, const pool_key *k, const bool *exclude, pool_choice *out)
{
    memset(out, 0, sizeof *out);
    out->prefill = -1;
    pthread_mutex_lock(&p->mu);
    /* one turn per choice, shared by its picks: each pick's ties then rotate request by
     * request (a turn per pick would step a decode pick by three and could land on the
     * same worker every time) */
    uint64_t turn = p->rr++;
    int i = pick(p, turn, k, role_is, "both", exclude, true, &out->prefix_hit);
    if (i < 0 && (i = pick(p, turn, k, role_is, "decode", exclude, true, &out->prefix_hit)) >= 0) {
        bool unused;
        out->prefill = pick(p, turn, k, prefill_for, p->w[i].fingerprint, exclude, false, &unused);
        if (out->prefill >= 0) {
            snprintf(out->prefill_kv, sizeof out->prefill_kv, "%s", p->w[out->prefill].kv);
            p->w[out->prefill].inflight++;
        }
    }
    if (i >= 0) {
        out->worker = i;
        snprintf(out->url, sizeof out->url, "%s", p->w[i].url);
        p->w[i].inflight++;
        for (int b = 0; b < k->n; b++)
            p->prefix[k->hashes[b] & (PREFIX_SLOTS - 1)] = (prefix_slot){k->hashes[b], i};
    }
    pthread_mutex_unlock(&p->mu);
    return i >= 0;
}

void pool_done(pool *p, const pool_choice *c, bool failed)
{
    pthread_mutex_lock(&p->mu);
    p->w[c->worker].inflight--;
    if (failed && p->w[c->worker].healthy) {
        p->w[c->worker].healthy = false;
        fprintf(stderr, "blade router: worker %s failed a request; out of the pool until it answers a poll\n",
                p->w[c->worker].url);
    }
    if (c->prefill >= 0)
        p->w[c->prefill].inflight--;
    pthread_mutex_unlock(&p->mu);
}

bool pool_any(pool *p, char *url, size_t cap)
{
    bool found = false;
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < p->n && !found; i++)
        if (p->w[i].healthy && p->w[i].listed && strcmp(p->w[i].role, "prefill")) {
            snprintf(url, cap, "%s", p->w[i].url);
            found = true;
        }
    pthread_mutex_unlock(&p->mu);
    return found;
}

char *pool_describe(pool *p)
{
    json_t *arr = json_array();
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < p->n; i++) {
        const worker *w = &p->w[i];
        if (!w->listed)
            continue;
        json_array_append_new(arr, json_pack("{s:s, s:s, s:b, s:I, s:I, s:i, s:s}", "url", w->url, "role", w->role,
                                             "healthy", w->healthy, "running", (json_int_t)w->running, "waiting",
                                             (json_int_t)w->waiting, "inflight", w->inflight, "kv_fingerprint",
                                             w->fingerprint));
    }
    pthread_mutex_unlock(&p->mu);
    char *text = json_dumps(arr, JSON_COMPACT);
    json_decref(arr);
    return text;
}

bool pool_etcd_ok(pool *p, char *why, size_t cap)
{
    pthread_mutex_lock(&p->mu);
    bool ok = !p->etcd || p->etcd_ok;
    snprintf(why, cap, "%s", p->etcd_why);
    pthread_mutex_unlock(&p->mu);
    return ok;
}

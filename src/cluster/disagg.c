/* Prefill and decode workers over the KV transport (disagg.h): the prefill service's
 * thread, the decode side's remote prefill, and the authenticated JSON control messages
 * between them. */

#include "blade/disagg.h"

#include "blade/kv_transport.h"
#include "blade/kv_wire.h"
#include "blade/model.h"
#include "common/test_aid.h"

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CONTROL_MAX_BYTES ((size_t)64 << 20)

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int timeout_of(const blade_disagg_config *cfg)
{
    return cfg->timeout_ms > 0 ? cfg->timeout_ms : 10000;
}

const char *blade_disagg_cause_name(blade_disagg_cause c)
{
    static const char *const names[] = {"ok", "connect", "peer", "refused", "local"};
    return c >= 0 && c < BLADE_DISAGG_CAUSES ? names[c] : "unknown";
}

int blade_disagg_parse_peer(const char *s, char *host, size_t cap, uint16_t *port, blade_error *err)
{
    const char *colon = strrchr(s, ':'), *h = s;
    size_t hl = colon ? (size_t)(colon - s) : 0;
    if (hl >= 2 && s[0] == '[' && s[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    char *end;
    long p = colon ? strtol(colon + 1, &end, 10) : -1;
    if (!colon || hl == 0 || hl >= cap || !colon[1] || *end || p < 0 || p > 65535)
        return blade_error_set(err, "'%s' is not HOST:PORT", s);
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = (uint16_t)p;
    return 0;
}

/* ---- control messages: JSON, then its digest ---- */

static int send_control(blade_kv_conn *c, const blade_cluster_key *key, json_t *msg, blade_error *err)
{
    char *text = json_dumps(msg, JSON_COMPACT);
    if (!text)
        return blade_error_set(err, "out of memory");
    uint8_t mac[BLADE_CLUSTER_MAC_BYTES];
    size_t len = strlen(text);
    int rc = blade_cluster_sign(key, text, len, mac);
    if (rc == 0) {
        struct iovec iov[2] = {{text, len}, {mac, sizeof mac}};
        rc = blade_kv_send(c, iov, 2, err);
    } else {
        blade_error_set(err, "cannot sign a control message");
    }
    free(text);
    return rc;
}

/* A received control message checked: NULL with err set when it fails its digest or is
 * not a JSON object. */
static json_t *parse_control(const blade_kv_conn *c, const blade_cluster_key *key, const void *buf, size_t len,
                             blade_error *err)
{
    if (len < BLADE_CLUSTER_MAC_BYTES ||
        !blade_cluster_verify(key, buf, len - BLADE_CLUSTER_MAC_BYTES, (const uint8_t *)buf + len - BLADE_CLUSTER_MAC_BYTES))
        return blade_error_set(err, "control message from %s fails its %s", blade_kv_conn_peer(c),
                               key ? "HMAC" : "checksum"),
               NULL;
    json_error_t je;
    json_t *msg = json_loadb(buf, len - BLADE_CLUSTER_MAC_BYTES, 0, &je);
    if (!json_is_object(msg)) {
        json_decref(msg);
        return blade_error_set(err, "control message from %s is not a JSON object", blade_kv_conn_peer(c)), NULL;
    }
    return msg;
}

/* NULL with err set when the message does not arrive or fails parse_control; *refused
 * tells the second from the first. */
static json_t *recv_control(blade_kv_conn *c, const blade_cluster_key *key, int timeout_ms, bool *refused,
                            blade_error *err)
{
    void *buf;
    size_t len;
    *refused = false;
    if (blade_kv_recv_within(c, CONTROL_MAX_BYTES, timeout_ms, &buf, &len, err))
        return NULL;
    *refused = true;
    json_t *msg = parse_control(c, key, buf, len, err);
    free(buf);
    return msg;
}

/* Transfer ids travel as hex text: JSON numbers are not exact past 2^53. */
static void id_text(uint64_t id, char out[17])
{
    snprintf(out, 17, "%016llx", (unsigned long long)id);
}

static bool id_of(json_t *msg, uint64_t *id)
{
    const char *s = json_string_value(json_object_get(msg, "transfer"));
    char *end;
    if (!s || strlen(s) != 16)
        return false;
    *id = strtoull(s, &end, 16);
    return *end == 0;
}

static json_t *sampling_json(const blade_sampling_params *p)
{
    char seed[17];
    id_text(p->seed, seed);
    return json_pack("{s:f, s:i, s:f, s:f, s:f, s:i, s:f, s:f, s:s}", "temperature", (double)p->temperature, "top_k",
                     p->top_k, "top_p", (double)p->top_p, "min_p", (double)p->min_p, "repeat_penalty",
                     (double)p->repeat_penalty, "repeat_last_n", p->repeat_last_n, "presence_penalty",
                     (double)p->presence_penalty, "frequency_penalty", (double)p->frequency_penalty, "seed", seed);
}

/* Floats went out as doubles exactly (float -> double is exact) and come back rounded to
 * the same float. */
static int sampling_of(json_t *j, blade_sampling_params *p, blade_error *err)
{
    json_t *seed = json_object_get(j, "seed");
    json_t *t = json_object_get(j, "temperature"), *tk = json_object_get(j, "top_k"), *tp = json_object_get(j, "top_p"),
           *mp = json_object_get(j, "min_p"), *rp = json_object_get(j, "repeat_penalty"),
           *rn = json_object_get(j, "repeat_last_n"), *pp = json_object_get(j, "presence_penalty"),
           *fp = json_object_get(j, "frequency_penalty");
    if (!json_is_number(t) || !json_is_integer(tk) || !json_is_number(tp) || !json_is_number(mp) ||
        !json_is_number(rp) || !json_is_integer(rn) || !json_is_number(pp) || !json_is_number(fp) ||
        !json_is_string(seed) || strlen(json_string_value(seed)) != 16)
        return blade_error_set(err, "PREFILL: sampling parameters missing or of the wrong type");
    json_int_t k = json_integer_value(tk), n = json_integer_value(rn);
    if (k < INT32_MIN || k > INT32_MAX || n < INT32_MIN || n > INT32_MAX)
        return blade_error_set(err, "PREFILL: sampling parameter out of range");
    char *end;
    *p = (blade_sampling_params){
        .temperature = (float)json_number_value(t), .top_k = (int32_t)k, .top_p = (float)json_number_value(tp),
        .min_p = (float)json_number_value(mp), .repeat_penalty = (float)json_number_value(rp),
        .repeat_last_n = (int32_t)n, .presence_penalty = (float)json_number_value(pp),
        .frequency_penalty = (float)json_number_value(fp),
        .seed = strtoull(json_string_value(seed), &end, 16),
    };
    if (*end)
        return blade_error_set(err, "PREFILL: the seed is not hexadecimal");
    return blade_sampling_params_validate(p, err);
}

/* ---- the prefill service ---- */

/* Decode connections parked at once while the engine computes their prompts: the engine
 * batches them (a short prompt no longer waits behind a long one). Past this many, new
 * connections wait in UCX's queue; their connect times out and the decode worker computes
 * the prompt itself. */
#define MAX_PARKED 64
/* How often parked prompts are looked at while no peer connects: the latency a finished
 * prefill may wait before its KV is sent. */
#define PARKED_POLL_MS 5

struct blade_prefill_service {
    blade_engine *e;
    blade_disagg_config cfg;
    blade_cluster_key key;
    bool has_key;
    blade_kv_transport *t;
    pthread_t thread;
    atomic_bool stop;
    pthread_mutex_t mu;
    blade_prefill_service_stats stats;
    /* Test aids (common/test_aid.h) for fault tests that SIGKILL this worker mid-request:
     * BLADE_TEST_PREFILL_HOLD_MS holds each request before its prompt is computed (the
     * decode worker waits as for a long prompt), BLADE_TEST_KV_FRAME_HOLD_MS between the
     * FIRST message and the KV frame (the decode worker waits mid-transfer). */
    int hold_prefill_ms, hold_frame_ms;
};

/* One decode worker's request, parked from its PREFILL until the engine has exported its
 * prompt's KV. The engine thread fills the outcome; the service thread does all of UCX. */
typedef struct prefill_job {
    blade_kv_conn *c;
    uint64_t tid, id;
    int32_t *prompt;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    blade_finish_reason finish;
    int32_t first_token;
    const blade_kv_export *ex;
    char error[256];
} prefill_job;

static void on_export(const blade_token_event *ev)
{
    prefill_job *j = ev->user;
    if (ev->finish == BLADE_FINISH_NONE)
        return;
    pthread_mutex_lock(&j->mu);
    j->finish = ev->finish;
    j->first_token = ev->token;
    j->ex = ev->kv_export;
    snprintf(j->error, sizeof j->error, "%s", ev->error ? ev->error : blade_finish_reason_name(ev->finish));
    j->done = true;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

static bool job_done(prefill_job *j)
{
    pthread_mutex_lock(&j->mu);
    bool done = j->done;
    pthread_mutex_unlock(&j->mu);
    return done;
}

static void job_free(prefill_job *j)
{
    blade_kv_conn_close(j->c);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j->prompt);
    free(j);
}

static const blade_cluster_key *key_of(const blade_prefill_service *ps)
{
    return ps->has_key ? &ps->key : NULL;
}

/* The prompt of a PREFILL message, checked against the vocabulary. */
static int32_t *prompt_of(json_t *msg, int32_t n_vocab, int32_t max_tokens, int32_t *n, blade_error *err)
{
    json_t *toks = json_object_get(msg, "tokens");
    size_t count = json_array_size(toks);
    if (!json_is_array(toks) || count == 0 || count > (size_t)max_tokens)
        return blade_error_set(err, "PREFILL: 1 to %d prompt tokens expected", max_tokens), NULL;
    int32_t *out = malloc(count * sizeof *out);
    if (!out)
        return blade_error_set(err, "out of memory"), NULL;
    for (size_t i = 0; i < count; i++) {
        json_t *v = json_array_get(toks, i);
        json_int_t t = json_integer_value(v);
        if (!json_is_integer(v) || t < 0 || t >= n_vocab) {
            free(out);
            return blade_error_set(err, "PREFILL: prompt token %zu is not an id below %d", i, n_vocab), NULL;
        }
        out[i] = (int32_t)t;
    }
    *n = (int32_t)count;
    return out;
}

/* The KV frame, after the test aid's hold, if one is set. */
static int send_frame(const blade_prefill_service *ps, blade_kv_conn *c, const blade_kv_wire_frame_out *fo,
                      blade_error *err)
{
    blade_test_aid_hold("BLADE_TEST_KV_FRAME_HOLD_MS", ps->hold_frame_ms, "a KV frame before sending it");
    return blade_kv_send_frame(c, fo, err);
}

/* Tells the decode worker its prefill failed, where FIRST was due: it then computes the
 * prompt itself. */
static void send_failure(blade_kv_conn *c, const blade_cluster_key *key, uint64_t tid, const char *why)
{
    char t[17];
    id_text(tid, t);
    json_t *msg = json_pack("{s:s, s:s}", "transfer", t, "error", why);
    if (msg)
        send_control(c, key, msg, &(blade_error){{0}});
    json_decref(msg);
}

/* Reads a decode worker's PREFILL and submits its prompt; the parked job, or NULL with the
 * reason (the connection then closed). */
static prefill_job *start_prefill(blade_prefill_service *ps, blade_kv_conn *c, blade_error *err)
{
    const blade_cluster_key *key = key_of(ps);
    bool refused;
    json_t *msg = recv_control(c, key, timeout_of(&ps->cfg), &refused, err);
    prefill_job *j = msg ? calloc(1, sizeof *j) : NULL;
    if (!j) {
        if (msg)
            blade_error_set(err, "out of memory");
        json_decref(msg);
        blade_kv_conn_close(c);
        return NULL;
    }
    j->c = c;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    blade_request q;
    blade_request_default(&q);
    int32_t n_prompt = 0;
    const char *salt = json_string_value(json_object_get(msg, "cache_salt"));
    if (!id_of(msg, &j->tid)) {
        blade_error_set(err, "PREFILL: no transfer id");
    } else if (!sampling_of(json_object_get(msg, "sampling"), &q.sampling, err) &&
               (j->prompt = prompt_of(msg, blade_engine_model(ps->e)->hp.n_vocab,
                                      blade_engine_max_context(ps->e) - 1, &n_prompt, err))) {
        q.prompt_tokens = j->prompt;
        q.n_prompt_tokens = n_prompt;
        q.max_tokens = 1;
        q.export_kv = true;
        q.cache_salt = salt;
        q.callback = on_export;
        q.user = j;
        blade_test_aid_hold("BLADE_TEST_PREFILL_HOLD_MS", ps->hold_prefill_ms, "a prefill before computing its prompt");
        if (!(j->id = blade_engine_submit(ps->e, &q, err)))
            send_failure(c, key, j->tid, err->msg);
    }
    json_decref(msg);
    if (!j->id) {
        job_free(j);
        return NULL;
    }
    return j;
}

/* Ships a finished prefill: HAVE query, FIRST and the frame of the blocks the decode worker
 * lacks, its DONE; or the prefill's failure. -1 with the reason when it was not taken. */
static int finish_prefill(blade_prefill_service *ps, prefill_job *j, blade_error *err)
{
    const blade_cluster_key *key = key_of(ps);
    if (j->finish != BLADE_FINISH_EXPORTED) {
        blade_error_set(err, "the prefill ended: %s", j->error);
        send_failure(j->c, key, j->tid, err->msg);
        return -1;
    }
    int rc = -1;
    uint8_t fp[BLADE_ENGINE_FINGERPRINT_BYTES], *query = NULL;
    size_t qlen, rlen;
    void *reply = NULL;
    bool refused, *have = calloc((size_t)j->ex->n_hashes + 1, sizeof *have);
    blade_engine_fingerprint(ps->e, fp);
    blade_kv_wire_frame_out fo = {0};
    if (!have)
        blade_error_set(err, "out of memory");
    if (have && !blade_kv_wire_have_query(fp, j->tid, j->ex->hashes, j->ex->n_hashes, key, &query, &qlen, err) &&
        !blade_kv_send(j->c, &(struct iovec){query, qlen}, 1, err) &&
        !blade_kv_recv(j->c, (size_t)j->ex->n_hashes + 4096, &reply, &rlen, err) &&
        !blade_kv_wire_have_reply_parse(reply, rlen, j->tid, j->ex->n_hashes, key, have, err) &&
        !blade_kv_handoff_encode(ps->e, j->ex, j->tid, have, key, &fo, err)) {
        char t[17];
        id_text(j->tid, t);
        json_t *first = json_pack("{s:s, s:i}", "transfer", t, "first_token", j->first_token), *done = NULL;
        /* the decode side's last word: closing before it would cut the frame short */
        if (first && !send_control(j->c, key, first, err) && !send_frame(ps, j->c, &fo, err) &&
            (done = recv_control(j->c, key, timeout_of(&ps->cfg), &refused, err))) {
            const char *why = json_string_value(json_object_get(done, "error"));
            if (why)
                blade_error_set(err, "the decode worker refused the KV: %s", why);
            rc = why ? -1 : 0;
        }
        json_decref(done);
        json_decref(first);
        if (rc == 0) {
            pthread_mutex_lock(&ps->mu);
            ps->stats.served++;
            ps->stats.blocks_sent += (uint64_t)fo.n_sent;
            ps->stats.blocks_skipped += (uint64_t)(j->ex->n_blocks - fo.n_sent);
            pthread_mutex_unlock(&ps->mu);
        }
    }
    blade_kv_wire_frame_out_free(&fo);
    free(have);
    free(query);
    free(reply);
    return rc;
}

static void count_failure(blade_prefill_service *ps, const char *peer, const char *why)
{
    fprintf(stderr, "blade prefill service: request from %s failed: %s\n", peer, why);
    pthread_mutex_lock(&ps->mu);
    ps->stats.failed++;
    pthread_mutex_unlock(&ps->mu);
}

/* Accepts connections and parks their prompts in the engine, then ships each prefill as it
 * finishes. Every UCX call stays on this thread (the worker is single-threaded); only the
 * exchanges around a prefill block it, each bounded by the message timeout. */
static void *service_loop(void *arg)
{
    blade_prefill_service *ps = arg;
    prefill_job *parked[MAX_PARKED];
    int n = 0;
    while (!atomic_load(&ps->stop)) {
        blade_error err = {{0}};
        if (n < MAX_PARKED) {
            blade_kv_conn *c = blade_kv_transport_accept(ps->t, n ? PARKED_POLL_MS : 200, &err);
            if (c) {
                char peer[sizeof err.msg];
                snprintf(peer, sizeof peer, "%s", blade_kv_conn_peer(c));
                if ((parked[n] = start_prefill(ps, c, &err)))
                    n++;
                else
                    count_failure(ps, peer, err.msg);
            } else if (!strstr(err.msg, "no peer connected")) {
                fprintf(stderr, "blade prefill service: %s\n", err.msg);
            }
        } else {
            /* full: wait for the oldest rather than spin */
            pthread_mutex_lock(&parked[0]->mu);
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += PARKED_POLL_MS * 1000000L;
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000L;
            }
            if (!parked[0]->done)
                pthread_cond_timedwait(&parked[0]->cv, &parked[0]->mu, &until);
            pthread_mutex_unlock(&parked[0]->mu);
        }
        for (int i = 0; i < n;) {
            prefill_job *j = parked[i];
            if (!job_done(j)) {
                i++;
                continue;
            }
            blade_error why = {{0}};
            if (finish_prefill(ps, j, &why))
                count_failure(ps, blade_kv_conn_peer(j->c), why.msg);
            if (j->finish == BLADE_FINISH_EXPORTED)
                blade_engine_export_release(ps->e, j->id);
            job_free(j);
            parked[i] = parked[--n];
        }
    }
    /* stopping: the engine outlives the service, so parked prompts are aborted (an export
     * finished meanwhile is released by the same abort) and waited for */
    for (int i = 0; i < n; i++) {
        prefill_job *j = parked[i];
        blade_engine_abort(ps->e, j->id);
        pthread_mutex_lock(&j->mu);
        while (!j->done)
            pthread_cond_wait(&j->cv, &j->mu);
        pthread_mutex_unlock(&j->mu);
        job_free(j);
    }
    return NULL;
}

blade_prefill_service *blade_prefill_service_start(blade_engine *e, const blade_disagg_config *cfg,
                                                   const char *host, uint16_t port, blade_error *err)
{
    blade_prefill_service *ps = calloc(1, sizeof *ps);
    if (!ps)
        return blade_error_set(err, "out of memory"), NULL;
    ps->e = e;
    ps->cfg = *cfg;
    if (cfg->key) {
        ps->key = *cfg->key;
        ps->has_key = true;
    }
    ps->cfg.key = NULL;
    ps->hold_prefill_ms = blade_test_aid_ms("BLADE_TEST_PREFILL_HOLD_MS");
    ps->hold_frame_ms = blade_test_aid_ms("BLADE_TEST_KV_FRAME_HOLD_MS");
    atomic_init(&ps->stop, false);
    pthread_mutex_init(&ps->mu, NULL);
    blade_kv_transport_config tc = {.key = key_of(ps), .timeout_ms = timeout_of(cfg), .transports = cfg->transports};
    if (!(ps->t = blade_kv_transport_new(&tc, err)) || blade_kv_transport_listen(ps->t, host, port, err) ||
        pthread_create(&ps->thread, NULL, service_loop, ps) != 0) {
        if (ps->t && !err->msg[0])
            blade_error_set(err, "cannot start the prefill service's thread");
        blade_kv_transport_free(ps->t);
        pthread_mutex_destroy(&ps->mu);
        blade_cluster_key_wipe(&ps->key);
        free(ps);
        return NULL;
    }
    return ps;
}

uint16_t blade_prefill_service_port(const blade_prefill_service *ps)
{
    return blade_kv_transport_port(ps->t);
}

void blade_prefill_service_stats_get(blade_prefill_service *ps, blade_prefill_service_stats *out)
{
    pthread_mutex_lock(&ps->mu);
    *out = ps->stats;
    pthread_mutex_unlock(&ps->mu);
}

void blade_prefill_service_stop(blade_prefill_service *ps)
{
    if (!ps)
        return;
    atomic_store(&ps->stop, true);
    pthread_join(ps->thread, NULL);
    blade_kv_transport_free(ps->t);
    pthread_mutex_destroy(&ps->mu);
    blade_cluster_key_wipe(&ps->key);
    free(ps);
}

/* ---- the decode side ---- */

static json_t *prefill_message(uint64_t tid, const blade_request *q)
{
    json_t *toks = json_array();
    for (int32_t i = 0; toks && i < q->n_prompt_tokens; i++)
        if (json_array_append_new(toks, json_integer(q->prompt_tokens[i]))) {
            json_decref(toks);
            return NULL;
        }
    char t[17];
    id_text(tid, t);
    return json_pack("{s:s, s:o, s:o, s:s?}", "transfer", t, "tokens", toks, "sampling", sampling_json(&q->sampling),
                     "cache_salt", q->cache_salt);
}

/* DONE: the frame was taken, or why not (best effort: the answer no longer depends on it). */
static void send_done(blade_kv_conn *c, const blade_cluster_key *key, uint64_t tid, const char *error)
{
    char t[17];
    id_text(tid, t);
    json_t *msg = json_pack("{s:s, s:s?}", "transfer", t, "error", error);
    blade_error ignored = {{0}};
    void *buf = NULL;
    size_t len;
    /* Closing at once could drop DONE before the peer reads it: the peer closes first. */
    if (msg && !send_control(c, key, msg, &ignored) && !blade_kv_recv_within(c, 64, 2000, &buf, &len, &ignored))
        free(buf);
    json_decref(msg);
}

/* The exchange after connecting; cause and err on failure. */
static blade_disagg_cause exchange(blade_engine *e, const blade_disagg_config *cfg, blade_kv_conn *c,
                                   const blade_request *q, blade_remote_prefill *out, blade_error *err)
{
    const blade_cluster_key *key = cfg->key;
    uint8_t nonce[BLADE_CLUSTER_NONCE_BYTES];
    if (blade_cluster_nonce(nonce))
        return blade_error_set(err, "no random transfer id"), BLADE_DISAGG_LOCAL;
    uint64_t tid = 0;
    memcpy(&tid, nonce, sizeof tid);
    json_t *msg = prefill_message(tid, q);
    if (!msg)
        return blade_error_set(err, "out of memory"), BLADE_DISAGG_LOCAL;
    int rc = send_control(c, key, msg, err);
    json_decref(msg);
    if (rc)
        return BLADE_DISAGG_PEER;

    /* HAVE: answered from this engine's prefix cache */
    const blade_kv_store *store = blade_engine_kv_store(e);
    int32_t bs = store->block_size, n_full = q->n_prompt_tokens / bs;
    int wait = cfg->prefill_timeout_ms > 0 ? cfg->prefill_timeout_ms : 600000;
    void *query;
    size_t qlen;
    if (blade_kv_recv_within(c, (size_t)n_full * BLADE_HASH_BYTES + 4096, wait, &query, &qlen, err))
        return BLADE_DISAGG_PEER;
    uint8_t fp[BLADE_ENGINE_FINGERPRINT_BYTES];
    blade_engine_fingerprint(e, fp);
    uint64_t qtid;
    uint8_t(*hashes)[BLADE_HASH_BYTES] = NULL;
    int32_t n_hashes = 0;
    bool refused = true;
    rc = blade_kv_wire_have_query_parse(query, qlen, fp, key, n_full, &qtid, &hashes, &n_hashes, err);
    if (rc) {
        /* a prefill that failed says why in a control message where the query was due */
        blade_error ignored = {{0}};
        json_t *ctl = parse_control(c, key, query, qlen, &ignored);
        const char *why = json_string_value(json_object_get(ctl, "error"));
        if (why)
            blade_error_set(err, "the prefill worker failed: %s", why);
        json_decref(ctl);
        free(query);
        return why ? BLADE_DISAGG_PEER : BLADE_DISAGG_REFUSED;
    }
    free(query);
    blade_disagg_cause cause = BLADE_DISAGG_REFUSED;
    bool *have = calloc((size_t)n_hashes + 1, sizeof *have);
    uint8_t *reply = NULL;
    size_t rlen;
    json_t *first = NULL;
    void *frame = NULL;
    size_t flen;
    if (qtid != tid || n_hashes != n_full) {
        blade_error_set(err, "HAVE query for transfer %016llx with %d hashes; asked for %016llx with %d",
                        (unsigned long long)qtid, n_hashes, (unsigned long long)tid, n_full);
        goto out;
    }
    if (!have) {
        cause = BLADE_DISAGG_LOCAL;
        blade_error_set(err, "out of memory");
        goto out;
    }
    blade_kv_handoff_have(e, (const uint8_t(*)[BLADE_HASH_BYTES])hashes, n_hashes, have);
    cause = BLADE_DISAGG_PEER;
    if (blade_kv_wire_have_reply(tid, have, n_hashes, key, &reply, &rlen, err) ||
        blade_kv_send(c, &(struct iovec){reply, rlen}, 1, err))
        goto out;
    if (!(first = recv_control(c, key, timeout_of(cfg), &refused, err))) {
        cause = refused ? BLADE_DISAGG_REFUSED : BLADE_DISAGG_PEER;
        goto out;
    }
    uint64_t ftid;
    json_t *ft = json_object_get(first, "first_token");
    if (!id_of(first, &ftid) || ftid != tid) {
        cause = BLADE_DISAGG_REFUSED;
        blade_error_set(err, "FIRST message for another transfer");
        goto out;
    }
    if (json_is_string(json_object_get(first, "error"))) {
        blade_error_set(err, "the prefill worker failed: %s", json_string_value(json_object_get(first, "error")));
        goto out;
    }
    int32_t n_blocks = (q->n_prompt_tokens + bs - 1) / bs;
    if (blade_kv_recv(c, blade_kv_wire_max_frame_bytes(store, q->n_prompt_tokens, n_blocks), &frame, &flen, err))
        goto out;
    cause = BLADE_DISAGG_REFUSED;
    if (!json_is_integer(ft) || blade_kv_handoff_receive(e, frame, flen, tid, have, n_hashes, key, &out->in, err)) {
        if (!json_is_integer(ft))
            blade_error_set(err, "FIRST message without a first token");
        goto out;
    }
    /* the blocks must be this prompt's: a frame of another prompt would be wrong KV */
    if (out->in.frame.n_tokens != q->n_prompt_tokens ||
        memcmp(out->in.frame.tokens, q->prompt_tokens, (size_t)q->n_prompt_tokens * sizeof *q->prompt_tokens)) {
        blade_kv_handoff_in_free(&out->in);
        blade_error_set(err, "the KV frame holds another prompt's tokens");
        goto out;
    }
    json_int_t t = json_integer_value(ft);
    if (t < 0 || t >= blade_engine_model(e)->hp.n_vocab) {
        blade_kv_handoff_in_free(&out->in);
        blade_error_set(err, "first token %lld is outside the vocabulary", (long long)t);
        goto out;
    }
    out->in.import.first_token = (int32_t)t;
    out->blocks_sent = out->in.frame.n_sent;
    out->blocks_held = n_blocks - out->in.frame.n_sent;
    out->frame_bytes = flen;
    cause = BLADE_DISAGG_OK;
out:
    if (frame)
        send_done(c, key, tid, cause == BLADE_DISAGG_OK ? NULL : err->msg);
    free(frame);
    json_decref(first);
    free(reply);
    free(have);
    free(hashes);
    return cause;
}

blade_disagg_cause blade_remote_prefill_run(blade_engine *e, const blade_disagg_config *cfg, const char *host,
                                            uint16_t port, const blade_request *q, blade_remote_prefill *out,
                                            blade_error *err)
{
    memset(out, 0, sizeof *out);
    if (port == 0)
        return blade_error_set(err, "the prefill worker's port is 0"), BLADE_DISAGG_CONNECT;
    double t0 = seconds_now();
    blade_kv_transport_config tc = {.key = cfg->key, .timeout_ms = timeout_of(cfg), .transports = cfg->transports};
    blade_kv_transport *t = blade_kv_transport_new(&tc, err);
    if (!t)
        return BLADE_DISAGG_LOCAL;
    blade_kv_conn *c = blade_kv_transport_connect(t, host, port, err);
    blade_disagg_cause cause = c ? exchange(e, cfg, c, q, out, err) : BLADE_DISAGG_CONNECT;
    blade_kv_conn_close(c);
    blade_kv_transport_free(t);
    out->seconds = seconds_now() - t0;
    return cause;
}

void blade_remote_prefill_free(blade_remote_prefill *rp)
{
    blade_kv_handoff_in_free(&rp->in);
}

/* KV transport over UCX (kv_transport.h): socket-address connection establishment, a
 * mutual HMAC challenge-response per connection, and length-prefixed messages on UCX
 * streams sent from iovecs. Every wait progresses the worker and sleeps on its event fd
 * until a deadline, so nothing blocks past the transport's timeout. */

#include "blade/kv_transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

#define MAX_PENDING 16
#define MSG_HEADER_BYTES 16
#define HELLO_BYTES 40
#define ANSWER_BYTES 72
static const uint8_t msg_magic[4] = {'B', 'L', 'K', 'M'};
static const uint8_t hello_magic[4] = {'B', 'L', 'K', 'T'};
#define HANDSHAKE_VERSION 1

struct blade_kv_transport {
    ucp_context_h context;
    ucp_worker_h worker;
    int efd;
    ucp_listener_h listener;
    uint16_t port;
    ucp_conn_request_h pending[MAX_PENDING];
    int n_pending;
    bool has_pending; /* n_pending > 0, as progress_until watches it */
    blade_cluster_key key;
    bool keyed;
    int timeout_ms;
    bool copy_payload;
};

struct blade_kv_conn {
    blade_kv_transport *t;
    ucp_ep_h ep;
    bool failed; /* peer gone, timed out or desynchronised: only closing remains */
    ucs_status_t fail_status;
    /* The endpoint itself failed or hung, so closing cannot flush; after a protocol
     * violation it can, and the peer then learns at once that it was dropped. */
    bool ep_dead;
    char peer[64];
};

/* What a completion callback reports to the waiting call. */
typedef struct op_state {
    bool done;
    ucs_status_t status;
    size_t length;
} op_state;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

const char *blade_kv_transport_ucx_version(void)
{
    static char text[32];
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    snprintf(text, sizeof text, "UCX %u.%u.%u", major, minor, release);
    return text;
}

/* Progresses until *done or the deadline; false on timeout. Sleeps on the worker's event
 * fd in between, never longer than 100 ms so a missed wakeup only costs latency. */
static bool progress_until(blade_kv_transport *t, const bool *done, int64_t deadline)
{
    for (;;) {
        while (ucp_worker_progress(t->worker))
            ;
        if (*done)
            return true;
        int64_t left = deadline - now_ms();
        if (left <= 0)
            return false;
        ucs_status_t st = ucp_worker_arm(t->worker);
        if (st == UCS_ERR_BUSY)
            continue;
        struct pollfd p = {.fd = t->efd, .events = POLLIN};
        poll(&p, 1, (int)(left < 100 ? left : 100));
    }
}

static void fail_conn(blade_kv_conn *c, ucs_status_t st)
{
    if (!c->failed) {
        c->failed = true;
        c->fail_status = st;
    }
}

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    blade_kv_conn *c = arg;
    c->ep_dead = true;
    fail_conn(c, status);
}

static void on_send_done(void *req, ucs_status_t status, void *user)
{
    (void)req;
    op_state *s = user;
    s->status = status;
    s->done = true;
}

static void on_recv_done(void *req, ucs_status_t status, size_t length, void *user)
{
    (void)req;
    op_state *s = user;
    s->status = status;
    s->length = length;
    s->done = true;
}

/* Forces the endpoint closed: outstanding requests complete with an error. */
static void close_ep(blade_kv_conn *c, bool force)
{
    if (!c->ep)
        return;
    op_state s = {0};
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                             UCP_OP_ATTR_FIELD_FLAGS,
                             .cb.send = on_send_done,
                             .user_data = &s,
                             .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    void *req = ucp_ep_close_nbx(c->ep, &p);
    c->ep = NULL;
    if (UCS_PTR_IS_PTR(req)) {
        /* A graceful close flushes: bounded, then forced by destroying nothing more. */
        if (!progress_until(c->t, &s.done, now_ms() + 1000))
            ucp_request_cancel(c->t->worker, req);
        progress_until(c->t, &s.done, now_ms() + 1000);
        if (s.done)
            ucp_request_free(req);
    }
}

/* Waits for an operation started with callback state s; on timeout or failure the
 * connection is broken and forced closed, which completes the request. */
static int wait_op(blade_kv_conn *c, void *req, op_state *s, int64_t deadline, const char *what, blade_error *err)
{
    if (UCS_PTR_IS_ERR(req)) {
        fail_conn(c, UCS_PTR_STATUS(req));
        return blade_error_set(err, "%s %s: %s", what, c->peer, ucs_status_string(UCS_PTR_STATUS(req)));
    }
    if (req == NULL) {
        s->done = true;
        s->status = UCS_OK;
        return 0;
    }
    bool in_time = progress_until(c->t, &s->done, deadline);
    if (!in_time) {
        fail_conn(c, UCS_ERR_TIMED_OUT);
        c->ep_dead = true;
        ucp_request_cancel(c->t->worker, req);
        close_ep(c, true);
        progress_until(c->t, &s->done, now_ms() + 1000);
    }
    if (s->done)
        ucp_request_free(req);
    if (!in_time)
        return blade_error_set(err, "%s %s: timed out after %d ms", what, c->peer, c->t->timeout_ms);
    if (s->status != UCS_OK) {
        fail_conn(c, s->status);
        return blade_error_set(err, "%s %s: %s", what, c->peer, ucs_status_string(s->status));
    }
    return 0;
}

static int check_usable(blade_kv_conn *c, const char *what, blade_error *err)
{
    if (c->failed)
        return blade_error_set(err, "%s %s: connection unusable (%s)", what, c->peer, ucs_status_string(c->fail_status));
    return 0;
}

static int send_iov(blade_kv_conn *c, ucp_dt_iov_t *iov, size_t n, int64_t deadline, blade_error *err)
{
    if (check_usable(c, "send to", err))
        return -1;
    op_state s = {0};
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                             UCP_OP_ATTR_FIELD_DATATYPE,
                             .cb.send = on_send_done,
                             .user_data = &s,
                             .datatype = ucp_dt_make_iov()};
    return wait_op(c, ucp_stream_send_nbx(c->ep, iov, n, &p), &s, deadline, "send to", err);
}

/* Receives exactly len bytes. */
static int recv_exact(blade_kv_conn *c, void *buf, size_t len, int64_t deadline, blade_error *err)
{
    if (check_usable(c, "receive from", err))
        return -1;
    if (len == 0)
        return 0;
    op_state s = {0};
    size_t got = 0;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                             UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS,
                             .cb.recv_stream = on_recv_done,
                             .user_data = &s,
                             .datatype = ucp_dt_make_contig(1),
                             .flags = UCP_STREAM_RECV_FLAG_WAITALL};
    void *req = ucp_stream_recv_nbx(c->ep, buf, len, &got, &p);
    if (wait_op(c, req, &s, deadline, "receive from", err))
        return -1;
    size_t n = req ? s.length : got;
    if (n != len) {
        fail_conn(c, UCS_ERR_MESSAGE_TRUNCATED);
        return blade_error_set(err, "receive from %s: %zu of %zu bytes", c->peer, n, len);
    }
    return 0;
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static int send_pieces(blade_kv_conn *c, const struct iovec *pre, size_t n_pre, const struct iovec *iov, size_t n_iov,
                       const struct iovec *post, size_t n_post, blade_error *err)
{
    size_t total = 0, n = 1 + n_pre + n_iov + n_post;
    const struct iovec *parts[3] = {pre, iov, post};
    const size_t counts[3] = {n_pre, n_iov, n_post};
    for (int k = 0; k < 3; k++)
        for (size_t i = 0; i < counts[k]; i++)
            total += parts[k][i].iov_len;
    uint8_t header[MSG_HEADER_BYTES] = {0};
    memcpy(header, msg_magic, 4);
    put64(header + 8, total);
    ucp_dt_iov_t *v = malloc(n * sizeof *v);
    uint8_t *flat = NULL;
    if (!v)
        return blade_error_set(err, "send to %s: out of memory", c->peer);
    v[0] = (ucp_dt_iov_t){header, sizeof header};
    size_t m = 1;
    if (c->t->copy_payload) {
        flat = malloc(total ? total : 1);
        if (!flat) {
            free(v);
            return blade_error_set(err, "send to %s: out of memory for %zu bytes", c->peer, total);
        }
        uint8_t *p = flat;
        for (int k = 0; k < 3; k++)
            for (size_t i = 0; i < counts[k]; i++) {
                memcpy(p, parts[k][i].iov_base, parts[k][i].iov_len);
                p += parts[k][i].iov_len;
            }
        v[m++] = (ucp_dt_iov_t){flat, total};
    } else {
        for (int k = 0; k < 3; k++)
            for (size_t i = 0; i < counts[k]; i++)
                if (parts[k][i].iov_len)
                    v[m++] = (ucp_dt_iov_t){parts[k][i].iov_base, parts[k][i].iov_len};
    }
    int rc = send_iov(c, v, m, now_ms() + c->t->timeout_ms, err);
    free(v);
    free(flat);
    return rc;
}

int blade_kv_send(blade_kv_conn *c, const struct iovec *iov, size_t n_iov, blade_error *err)
{
    return send_pieces(c, NULL, 0, iov, n_iov, NULL, 0, err);
}

int blade_kv_send_frame(blade_kv_conn *c, const blade_kv_wire_frame_out *f, blade_error *err)
{
    struct iovec head = {f->head, f->head_len};
    struct iovec digest = {(void *)f->digest, sizeof f->digest};
    return send_pieces(c, &head, 1, f->iov, f->n_iov, &digest, 1, err);
}

int blade_kv_recv(blade_kv_conn *c, size_t max_bytes, void **buf, size_t *len, blade_error *err)
{
    return blade_kv_recv_within(c, max_bytes, c->t->timeout_ms, buf, len, err);
}

int blade_kv_recv_within(blade_kv_conn *c, size_t max_bytes, int timeout_ms, void **buf, size_t *len,
                         blade_error *err)
{
    *buf = NULL;
    *len = 0;
    int64_t deadline = now_ms() + timeout_ms;
    uint8_t header[MSG_HEADER_BYTES];
    if (recv_exact(c, header, sizeof header, deadline, err))
        return -1;
    uint64_t n = get64(header + 8);
    if (memcmp(header, msg_magic, 4)) {
        fail_conn(c, UCS_ERR_INVALID_PARAM);
        return blade_error_set(err, "receive from %s: not a blade message (bad magic); connection dropped", c->peer);
    }
    if (n > max_bytes) {
        /* Reading it to stay in step would let the peer make us read without end. */
        fail_conn(c, UCS_ERR_EXCEEDS_LIMIT);
        return blade_error_set(err, "receive from %s: message of %llu bytes exceeds the %zu accepted; connection dropped",
                               c->peer, (unsigned long long)n, max_bytes);
    }
    uint8_t *b = malloc(n ? n : 1);
    if (!b) {
        fail_conn(c, UCS_ERR_NO_MEMORY);
        return blade_error_set(err, "receive from %s: out of memory for %llu bytes", c->peer, (unsigned long long)n);
    }
    if (recv_exact(c, b, n, deadline, err)) {
        free(b);
        return -1;
    }
    *buf = b;
    *len = n;
    return 0;
}

const char *blade_kv_conn_peer(const blade_kv_conn *c)
{
    return c->peer;
}

void blade_kv_conn_close(blade_kv_conn *c)
{
    if (!c)
        return;
    close_ep(c, c->ep_dead);
    free(c);
}

/* ---- the handshake ---- */

static int send_bytes(blade_kv_conn *c, const void *buf, size_t len, int64_t deadline, blade_error *err)
{
    ucp_dt_iov_t v = {(void *)buf, len};
    return send_iov(c, &v, 1, deadline, err);
}

static void put_hello_prefix(uint8_t *p, bool keyed)
{
    memcpy(p, hello_magic, 4);
    p[4] = HANDSHAKE_VERSION;
    p[5] = keyed;
    p[6] = p[7] = 0;
}

static int check_hello_prefix(blade_kv_conn *c, const uint8_t *p, blade_error *err)
{
    if (memcmp(p, hello_magic, 4) || p[6] || p[7])
        return blade_error_set(err, "handshake with %s: not a blade KV peer", c->peer);
    if (p[4] != HANDSHAKE_VERSION)
        return blade_error_set(err, "handshake with %s: protocol version %u, this blade speaks %d", c->peer, p[4],
                               HANDSHAKE_VERSION);
    if (p[5] != c->t->keyed)
        return blade_error_set(err, "handshake with %s: %s", c->peer,
                               p[5] ? "the peer has a cluster key and this node has none"
                                    : "the peer has no cluster key and this node has one; dropped");
    return 0;
}

static int proof(blade_kv_conn *c, const char *role, const uint8_t *nl, const uint8_t *nc, uint8_t *out,
                 blade_error *err)
{
    if (!c->t->keyed) {
        memset(out, 0, BLADE_CLUSTER_MAC_BYTES);
        return 0;
    }
    if (blade_cluster_proof(&c->t->key, role, nl, nc, out))
        return blade_error_set(err, "handshake with %s: libcrypto failed", c->peer);
    return 0;
}

static int check_proof(blade_kv_conn *c, const char *role, const uint8_t *nl, const uint8_t *nc, const uint8_t *got,
                       blade_error *err)
{
    uint8_t want[BLADE_CLUSTER_MAC_BYTES];
    if (proof(c, role, nl, nc, want, err))
        return -1;
    if (!blade_cluster_mac_equal(want, got))
        return blade_error_set(err, "handshake with %s: the peer could not prove it holds the cluster key; dropped",
                               c->peer);
    return 0;
}

/* Listener: hello(nonce_l) -> answer(nonce_c, proof_c) -> proof_l. */
static int handshake_listener(blade_kv_conn *c, blade_error *err)
{
    int64_t deadline = now_ms() + c->t->timeout_ms;
    uint8_t hello[HELLO_BYTES], answer[ANSWER_BYTES], mine[BLADE_CLUSTER_MAC_BYTES];
    put_hello_prefix(hello, c->t->keyed);
    if (blade_cluster_nonce(hello + 8))
        return blade_error_set(err, "handshake: no random bytes from the operating system");
    if (send_bytes(c, hello, sizeof hello, deadline, err) || recv_exact(c, answer, sizeof answer, deadline, err) ||
        check_hello_prefix(c, answer, err) || check_proof(c, "connector", hello + 8, answer + 8, answer + 40, err) ||
        proof(c, "listener", hello + 8, answer + 8, mine, err) || send_bytes(c, mine, sizeof mine, deadline, err))
        return -1;
    return 0;
}

static int handshake_connector(blade_kv_conn *c, blade_error *err)
{
    int64_t deadline = now_ms() + c->t->timeout_ms;
    uint8_t hello[HELLO_BYTES], answer[ANSWER_BYTES], theirs[BLADE_CLUSTER_MAC_BYTES];
    if (recv_exact(c, hello, sizeof hello, deadline, err))
        return -1;
    put_hello_prefix(answer, c->t->keyed);
    /* A key mismatch is still answered (with no proof), so the listener logs the reason
     * instead of a vanished peer. */
    if (check_hello_prefix(c, hello, err)) {
        memset(answer + 8, 0, sizeof answer - 8);
        /* Then wait (briefly) for the listener to drop us, so the answer is read before
         * the connection goes. */
        if (send_bytes(c, answer, sizeof answer, deadline, NULL) == 0)
            recv_exact(c, theirs, sizeof theirs, now_ms() + 1000, NULL);
        return -1;
    }
    if (blade_cluster_nonce(answer + 8))
        return blade_error_set(err, "handshake: no random bytes from the operating system");
    if (proof(c, "connector", hello + 8, answer + 8, answer + 40, err) ||
        send_bytes(c, answer, sizeof answer, deadline, err) || recv_exact(c, theirs, sizeof theirs, deadline, err) ||
        check_proof(c, "listener", hello + 8, answer + 8, theirs, err))
        return -1;
    return 0;
}

/* ---- transports, listeners, connections ---- */

blade_kv_transport *blade_kv_transport_new(const blade_kv_transport_config *cfg, blade_error *err)
{
    blade_kv_transport *t = calloc(1, sizeof *t);
    if (!t) {
        blade_error_set(err, "KV transport: out of memory");
        return NULL;
    }
    t->efd = -1;
    t->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 10000;
    t->copy_payload = cfg->copy_payload;
    if (cfg->key) {
        t->key = *cfg->key;
        t->keyed = true;
    }
    ucp_config_t *config;
    ucs_status_t st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) {
        blade_error_set(err, "KV transport: UCX configuration: %s", ucs_status_string(st));
        free(t);
        return NULL;
    }
    if (cfg->transports && (st = ucp_config_modify(config, "TLS", cfg->transports)) != UCS_OK) {
        blade_error_set(err, "KV transport: UCX transports '%s': %s", cfg->transports, ucs_status_string(st));
        ucp_config_release(config);
        free(t);
        return NULL;
    }
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                           .features = UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP,
                           .mt_workers_shared = 0};
    st = ucp_init(&params, config, &t->context);
    ucp_config_release(config);
    if (st != UCS_OK) {
        blade_error_set(err, "KV transport: UCX init (%s): %s", blade_kv_transport_ucx_version(), ucs_status_string(st));
        free(t);
        return NULL;
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    st = ucp_worker_create(t->context, &wp, &t->worker);
    if (st == UCS_OK)
        st = ucp_worker_get_efd(t->worker, &t->efd);
    if (st != UCS_OK) {
        blade_error_set(err, "KV transport: UCX worker: %s", ucs_status_string(st));
        blade_kv_transport_free(t);
        return NULL;
    }
    return t;
}

void blade_kv_transport_process_defaults(void)
{
    setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
}

void blade_kv_transport_free(blade_kv_transport *t)
{
    if (!t)
        return;
    for (int i = 0; i < t->n_pending; i++)
        ucp_listener_reject(t->listener, t->pending[i]);
    if (t->listener)
        ucp_listener_destroy(t->listener);
    if (t->worker)
        ucp_worker_destroy(t->worker);
    if (t->context)
        ucp_cleanup(t->context);
    blade_cluster_key_wipe(&t->key);
    free(t);
}

static void on_conn_request(ucp_conn_request_h req, void *arg)
{
    blade_kv_transport *t = arg;
    if (t->n_pending == MAX_PENDING)
        ucp_listener_reject(t->listener, req);
    else
        t->pending[t->n_pending++] = req;
    t->has_pending = true;
}

static int resolve(const char *host, uint16_t port, bool passive, struct sockaddr_storage *out, socklen_t *len,
                   blade_error *err)
{
    char service[8];
    snprintf(service, sizeof service, "%u", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0)}, *res;
    int rc = getaddrinfo(host && *host ? host : NULL, service, &hints, &res);
    if (rc)
        return blade_error_set(err, "cannot resolve %s: %s", host && *host ? host : "(any)", gai_strerror(rc));
    memcpy(out, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

static void addr_text(const struct sockaddr_storage *a, char *out, size_t cap)
{
    char host[INET6_ADDRSTRLEN] = "?";
    uint16_t port = 0;
    if (a->ss_family == AF_INET) {
        const struct sockaddr_in *s = (const struct sockaddr_in *)a;
        inet_ntop(AF_INET, &s->sin_addr, host, sizeof host);
        port = ntohs(s->sin_port);
    } else if (a->ss_family == AF_INET6) {
        const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)a;
        inet_ntop(AF_INET6, &s->sin6_addr, host, sizeof host);
        port = ntohs(s->sin6_port);
    }
    snprintf(out, cap, a->ss_family == AF_INET6 ? "[%s]:%u" : "%s:%u", host, port);
}

int blade_kv_transport_listen(blade_kv_transport *t, const char *host, uint16_t port, blade_error *err)
{
    if (t->listener)
        return blade_error_set(err, "KV transport: already listening on port %u", t->port);
    if (blade_cluster_check_listener(host, t->keyed ? &t->key : NULL, err))
        return -1;
    struct sockaddr_storage sa;
    socklen_t sl;
    if (resolve(host, port, true, &sa, &sl, err))
        return -1;
    ucp_listener_params_t lp = {.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
                                .sockaddr = {.addr = (const struct sockaddr *)&sa, .addrlen = sl},
                                .conn_handler = {.cb = on_conn_request, .arg = t}};
    ucs_status_t st = ucp_listener_create(t->worker, &lp, &t->listener);
    if (st != UCS_OK) {
        t->listener = NULL;
        return blade_error_set(err, "KV transport: cannot listen on %s port %u: %s", host && *host ? host : "*", port,
                               ucs_status_string(st));
    }
    ucp_listener_attr_t attr = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if (ucp_listener_query(t->listener, &attr) == UCS_OK)
        t->port = ntohs(attr.sockaddr.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&attr.sockaddr)->sin6_port
                                                            : ((struct sockaddr_in *)&attr.sockaddr)->sin_port);
    return 0;
}

uint16_t blade_kv_transport_port(const blade_kv_transport *t)
{
    return t->port;
}

static blade_kv_conn *new_conn(blade_kv_transport *t)
{
    blade_kv_conn *c = calloc(1, sizeof *c);
    if (c)
        c->t = t;
    return c;
}

static ucp_ep_params_t ep_params(blade_kv_conn *c)
{
    return (ucp_ep_params_t){.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER,
                             .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                             .err_handler = {.cb = on_ep_error, .arg = c}};
}

/* Creates the endpoint and authenticates the peer; the connection, or NULL (c freed). */
static blade_kv_conn *open_conn(blade_kv_conn *c, const ucp_ep_params_t *p, bool listener, blade_error *err)
{
    ucs_status_t st = ucp_ep_create(c->t->worker, p, &c->ep);
    if (st != UCS_OK) {
        blade_error_set(err, "KV transport: %s %s: %s", listener ? "accepting" : "connecting to", c->peer,
                        ucs_status_string(st));
        free(c);
        return NULL;
    }
    if (listener ? handshake_listener(c, err) : handshake_connector(c, err)) {
        fail_conn(c, UCS_ERR_REJECTED);
        blade_kv_conn_close(c);
        return NULL;
    }
    return c;
}

blade_kv_conn *blade_kv_transport_accept(blade_kv_transport *t, int timeout_ms, blade_error *err)
{
    if (!t->listener) {
        blade_error_set(err, "KV transport: accept without listening");
        return NULL;
    }
    int wait = timeout_ms > 0 ? timeout_ms : t->timeout_ms;
    if (!progress_until(t, &t->has_pending, now_ms() + wait)) {
        blade_error_set(err, "KV transport: no peer connected within %d ms", wait);
        return NULL;
    }
    ucp_conn_request_h req = t->pending[0];
    memmove(t->pending, t->pending + 1, (size_t)--t->n_pending * sizeof *t->pending);
    t->has_pending = t->n_pending > 0;
    blade_kv_conn *c = new_conn(t);
    if (!c) {
        ucp_listener_reject(t->listener, req);
        blade_error_set(err, "KV transport: out of memory");
        return NULL;
    }
    ucp_conn_request_attr_t ra = {.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR};
    if (ucp_conn_request_query(req, &ra) == UCS_OK)
        addr_text(&ra.client_address, c->peer, sizeof c->peer);
    else
        snprintf(c->peer, sizeof c->peer, "(unknown peer)");
    ucp_ep_params_t p = ep_params(c);
    p.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
    p.conn_request = req;
    return open_conn(c, &p, true, err);
}

blade_kv_conn *blade_kv_transport_connect(blade_kv_transport *t, const char *host, uint16_t port, blade_error *err)
{
    blade_kv_conn *c = new_conn(t);
    if (!c) {
        blade_error_set(err, "KV transport: out of memory");
        return NULL;
    }
    struct sockaddr_storage sa;
    socklen_t sl;
    if (resolve(host, port, false, &sa, &sl, err)) {
        free(c);
        return NULL;
    }
    addr_text(&sa, c->peer, sizeof c->peer);
    ucp_ep_params_t p = ep_params(c);
    p.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr = (ucs_sock_addr_t){.addr = (const struct sockaddr *)&sa, .addrlen = sl};
    return open_conn(c, &p, false, err);
}

/* The UCX KV transport: a real KV frame travels from one store's blocks to another's over
 * loopback and between two network namespaces over a veth bridge; peers without the
 * cluster key are dropped at the handshake; oversized messages, silent and vanished peers
 * and closed ports give errors within the timeout, never hangs. */

#include "testutil.h"

#include "blade/kv_transport.h"
#include "cluster/netns.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define N_LAYER 4
#define N_HEAD 2
#define HEAD_DIM 16
#define BS 8
#define N_BLOCKS 16
#define N_TOKENS 37
#define N_VOCAB 32000

static const uint8_t fingerprint[32] = {0xb1, 0xad, 0xe};
static const int32_t src_blocks[5] = {3, 4, 9, 0, 12};
static const int32_t dst_blocks[5] = {10, 11, 12, 13, 14};

static blade_cluster_key test_key(char fill)
{
    blade_cluster_key k = {.len = 32};
    memset(k.bytes, fill, 32);
    return k;
}

static blade_kv_store *new_store(unsigned seed)
{
    blade_kv_store_config cfg = {.n_layer = N_LAYER, .n_head_kv = N_HEAD, .head_dim = HEAD_DIM, .type = BLADE_KV_F16,
                                 .block_size = BS, .n_blocks = N_BLOCKS};
    blade_kv_store *s = blade_kv_store_new(&cfg, NULL);
    assert_non_null(s);
    size_t area = (size_t)N_LAYER * N_BLOCKS * s->block_stride;
    for (size_t i = 0; i < area; i++) {
        s->k[i] = (uint8_t)(i * 31 + seed);
        s->v[i] = (uint8_t)(i * 17 + seed * 3);
    }
    return s;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- the sending side, run in a thread or a namespace child ---- */

typedef enum { SEND_FRAME, SEND_HUGE, SEND_NOTHING, VANISH } peer_action;

typedef struct peer {
    int timeout_ms;
    const char *host;
    uint16_t port;
    const blade_cluster_key *key;
    peer_action action;
    const char *transports;
    int rc;
    char err[BLADE_ERROR_LEN];
} peer;

static void *run_peer(void *arg)
{
    peer *p = arg;
    blade_error err = {{0}};
    blade_kv_transport_config cfg = {.key = p->key, .timeout_ms = p->timeout_ms ? p->timeout_ms : 3000,
                                     .transports = p->transports};
    blade_kv_transport *t = blade_kv_transport_new(&cfg, &err);
    blade_kv_conn *c = t ? blade_kv_transport_connect(t, p->host, p->port, &err) : NULL;
    p->rc = c ? 0 : -1;
    if (c && p->action == SEND_FRAME) {
        blade_kv_store *s = new_store(1);
        int32_t tokens[N_TOKENS];
        uint8_t hashes[N_TOKENS / BS][BLADE_HASH_BYTES];
        for (int i = 0; i < N_TOKENS; i++)
            tokens[i] = i * 701 % N_VOCAB;
        memset(hashes, 0x5a, sizeof hashes);
        blade_kv_wire_source src = {.store = s, .fingerprint = fingerprint, .transfer_id = 7, .tokens = tokens,
                                    .n_tokens = N_TOKENS, .hashes = (const uint8_t (*)[BLADE_HASH_BYTES])hashes,
                                    .blocks = src_blocks};
        blade_kv_wire_frame_out f;
        p->rc = blade_kv_wire_encode(&src, p->key, &f, &err);
        if (p->rc == 0) {
            p->rc = blade_kv_send_frame(c, &f, &err);
            blade_kv_wire_frame_out_free(&f);
        }
        /* The receiver acknowledges, so closing never races the data. */
        void *ack = NULL;
        size_t len;
        if (p->rc == 0)
            p->rc = blade_kv_recv(c, 16, &ack, &len, &err);
        free(ack);
        blade_kv_store_free(s);
    } else if (c && p->action == SEND_HUGE) {
        static char big[1 << 16];
        struct iovec v = {big, sizeof big};
        p->rc = blade_kv_send(c, &v, 1, &err);
        void *ack = NULL;
        size_t len;
        blade_kv_recv(c, 16, &ack, &len, NULL); /* until the receiver drops us */
        free(ack);
    } else if (c && p->action == SEND_NOTHING) {
        void *ack = NULL;
        size_t len;
        blade_kv_recv(c, 16, &ack, &len, NULL);
        free(ack);
    }
    /* VANISH: close at once. */
    blade_kv_conn_close(c);
    blade_kv_transport_free(t);
    snprintf(p->err, sizeof p->err, "%s", err.msg);
    return NULL;
}

/* ---- the receiving side ---- */

/* Accepts one peer, receives a frame, decodes it into dst and checks every block; 0 or -1
 * with err set. */
static int receive_frame(blade_kv_transport *t, blade_error *err)
{
    blade_kv_conn *c = blade_kv_transport_accept(t, 5000, err);
    if (!c)
        return -1;
    blade_kv_store *dst = new_store(2), *want = new_store(1);
    const blade_cluster_key key = test_key('k');
    blade_kv_wire_expect x = {.fingerprint = fingerprint, .key = &key, .transfer_id = 7, .n_vocab = N_VOCAB,
                              .max_tokens = 4096};
    void *buf = NULL;
    size_t len = 0;
    blade_kv_wire_received r = {0};
    int rc = blade_kv_recv(c, blade_kv_wire_max_frame_bytes(dst, 4096, 5), &buf, &len, err);
    if (rc == 0)
        rc = blade_kv_wire_decode(buf, len, &x, dst, dst_blocks, 5, &r, err);
    for (int j = 0; rc == 0 && j < 5; j++)
        for (int l = 0; l < N_LAYER; l++)
            if (memcmp(blade_kv_store_k(want, l, src_blocks[j], 0), blade_kv_store_k(dst, l, dst_blocks[j], 0),
                       dst->block_stride) ||
                memcmp(blade_kv_store_v(want, l, src_blocks[j], 0), blade_kv_store_v(dst, l, dst_blocks[j], 0),
                       dst->block_stride))
                rc = blade_error_set(err, "block %d layer %d differs after the transfer", j, l);
    if (rc == 0) {
        struct iovec ack = {"ok", 2};
        rc = blade_kv_send(c, &ack, 1, err);
    }
    blade_kv_wire_received_free(&r);
    free(buf);
    blade_kv_store_free(dst);
    blade_kv_store_free(want);
    blade_kv_conn_close(c);
    return rc;
}

static blade_kv_transport *listener(const blade_cluster_key *key, const char *host, int timeout_ms)
{
    blade_error err = {{0}};
    blade_kv_transport_config cfg = {.key = key, .timeout_ms = timeout_ms, .transports = "tcp"};
    blade_kv_transport *t = blade_kv_transport_new(&cfg, &err);
    if (!t)
        fail_msg("%s", err.msg);
    if (blade_kv_transport_listen(t, host, 0, &err))
        fail_msg("%s", err.msg);
    assert_true(blade_kv_transport_port(t) > 0);
    return t;
}

static void test_frame_over_loopback(void **state)
{
    (void)state;
    blade_cluster_key key = test_key('k');
    blade_kv_transport *t = listener(&key, "127.0.0.1", 3000);
    peer p = {.host = "127.0.0.1", .port = blade_kv_transport_port(t), .key = &key, .action = SEND_FRAME,
              .transports = "tcp"};
    pthread_t th;
    pthread_create(&th, NULL, run_peer, &p);
    blade_error err = {{0}};
    int rc = receive_frame(t, &err);
    pthread_join(th, NULL);
    if (rc)
        fail_msg("receiver: %s", err.msg);
    if (p.rc)
        fail_msg("sender: %s", p.err);
    blade_kv_transport_free(t);
}

/* A connector with another key, or none, never gets a connection; the listener says why. */
static void test_handshake_refusals(void **state)
{
    (void)state;
    blade_cluster_key key = test_key('k'), other = test_key('x');
    const blade_cluster_key *peer_keys[2] = {&other, NULL};
    const char *reasons[2] = {"could not prove it holds the cluster key", "the peer has no cluster key"};
    for (int i = 0; i < 2; i++) {
        blade_kv_transport *t = listener(&key, "127.0.0.1", 3000);
        peer p = {.host = "127.0.0.1", .port = blade_kv_transport_port(t), .key = peer_keys[i], .action = SEND_FRAME,
                  .transports = "tcp"};
        pthread_t th;
        pthread_create(&th, NULL, run_peer, &p);
        blade_error err = {{0}};
        blade_kv_conn *c = blade_kv_transport_accept(t, 5000, &err);
        pthread_join(th, NULL);
        assert_null(c);
        if (!strstr(err.msg, reasons[i]))
            fail_msg("listener said '%s', expected '%s'", err.msg, reasons[i]);
        assert_int_equal(p.rc, -1);
        assert_true(p.err[0] != 0);
        blade_kv_transport_free(t);
    }
}

static void test_unkeyed_only_on_loopback(void **state)
{
    (void)state;
    blade_error err = {{0}};
    blade_kv_transport_config cfg = {.timeout_ms = 1000, .transports = "tcp"};
    blade_kv_transport *t = blade_kv_transport_new(&cfg, &err);
    assert_non_null(t);
    assert_int_equal(blade_kv_transport_listen(t, "0.0.0.0", 0, &err), -1);
    assert_non_null(strstr(err.msg, "without a cluster key"));
    assert_int_equal(blade_kv_transport_listen(t, "127.0.0.1", 0, &err), 0);
    blade_kv_transport_free(t);
}

/* An announced message above the receiver's bound drops the connection unread; a silent
 * peer makes the receive time out; a vanished one makes it fail; all within the bound. */
static void test_bounded_receives(void **state)
{
    (void)state;
    blade_cluster_key key = test_key('k');
    peer_action actions[3] = {SEND_HUGE, SEND_NOTHING, VANISH};
    const char *reasons[3] = {"exceeds the 1024 accepted", "timed out", "receive from"};
    for (int i = 0; i < 3; i++) {
        /* The peer outwaits the receiver, so the silent one is still there at its timeout. */
        blade_kv_transport *t = listener(&key, "127.0.0.1", 1000);
        peer p = {.timeout_ms = 4000, .host = "127.0.0.1", .port = blade_kv_transport_port(t), .key = &key, .action = actions[i],
                  .transports = "tcp"};
        pthread_t th;
        pthread_create(&th, NULL, run_peer, &p);
        blade_error err = {{0}};
        blade_kv_conn *c = blade_kv_transport_accept(t, 5000, &err);
        if (!c)
            fail_msg("%s", err.msg);
        void *buf = NULL;
        size_t len;
        int64_t t0 = now_ms();
        assert_int_equal(blade_kv_recv(c, 1024, &buf, &len, &err), -1);
        int64_t took = now_ms() - t0;
        assert_null(buf);
        if (!strstr(err.msg, reasons[i]))
            fail_msg("receive said '%s', expected '%s'", err.msg, reasons[i]);
        assert_true(took < 1000 + 1500);
        /* Broken for good: the next call fails at once. */
        assert_int_equal(blade_kv_recv(c, 1024, &buf, &len, &err), -1);
        assert_non_null(strstr(err.msg, "unusable"));
        blade_kv_conn_close(c);
        pthread_join(th, NULL);
        blade_kv_transport_free(t);
    }
}

static void test_connect_to_closed_port(void **state)
{
    (void)state;
    blade_cluster_key key = test_key('k');
    /* A port just released by a listener: nothing listens there now. */
    blade_kv_transport *t = listener(&key, "127.0.0.1", 3000);
    uint16_t port = blade_kv_transport_port(t);
    blade_kv_transport_free(t);
    blade_error err = {{0}};
    blade_kv_transport_config cfg = {.key = &key, .timeout_ms = 2000, .transports = "tcp"};
    blade_kv_transport *c = blade_kv_transport_new(&cfg, &err);
    int64_t t0 = now_ms();
    assert_null(blade_kv_transport_connect(c, "127.0.0.1", port, &err));
    assert_true(now_ms() - t0 < 2000 + 1500);
    assert_true(err.msg[0] != 0);
    blade_kv_transport_free(c);
}

/* ---- between two namespaces ---- */

/* The two ends run as fresh processes (this program re-executed with --netns-role): UCX's
 * progress thread does not survive fork, so a forked child of a process that used UCX
 * would never see a connection request. */
static int netns_receiver(uint16_t port)
{
    blade_cluster_key key = test_key('k');
    blade_error err = {{0}};
    blade_kv_transport_config cfg = {.key = &key, .timeout_ms = 5000, .transports = "tcp"};
    blade_kv_transport *t = blade_kv_transport_new(&cfg, &err);
    int rc = t ? blade_kv_transport_listen(t, "10.77.0.1", port, &err) : -1;
    if (rc == 0)
        rc = receive_frame(t, &err);
    if (rc)
        fprintf(stderr, "receiver in namespace: %s\n", err.msg);
    blade_kv_transport_free(t);
    return rc ? 1 : 0;
}

static int netns_sender(uint16_t port)
{
    blade_cluster_key key = test_key('k');
    peer p = {.host = "10.77.0.1", .port = port, .key = &key, .action = SEND_FRAME, .transports = "tcp"};
    /* The listener may still be starting: retry refused connections for a moment. */
    for (int attempt = 0; attempt < 40; attempt++) {
        run_peer(&p);
        if (p.rc == 0)
            return 0;
        struct timespec ms100 = {0, 100 * 1000 * 1000};
        nanosleep(&ms100, NULL);
    }
    fprintf(stderr, "sender in namespace: %s\n", p.err);
    return 1;
}

static void test_frame_between_namespaces(void **state)
{
    (void)state;
    blade_error why = {{0}};
    if (!blade_netns_usable(&why)) {
        note_skipped("KV transfer between network namespaces not tested: %s", why.msg);
        skip();
    }
    blade_netns net;
    if (blade_netns_create(&net, 2, &why))
        fail_msg("%s", why.msg);
    char port[8];
    snprintf(port, sizeof port, "%d", 20000 + getpid() % 20000);
    char *rx_argv[] = {"/proc/self/exe", "--netns-role", "receiver", port, NULL};
    char *tx_argv[] = {"/proc/self/exe", "--netns-role", "sender", port, NULL};
    pid_t rx = blade_netns_spawn_cmd(&net, 0, rx_argv, NULL, &why);
    pid_t tx = rx > 0 ? blade_netns_spawn_cmd(&net, 1, tx_argv, NULL, &why) : -1;
    int rx_status = rx > 0 ? blade_netns_wait(&net, rx, 15000) : -1;
    int tx_status = tx > 0 ? blade_netns_wait(&net, tx, 5000) : -1;
    blade_netns_destroy(&net);
    assert_int_equal(tx_status, 0);
    assert_int_equal(rx_status, 0);
}

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "--netns-role"))
        return !strcmp(argv[2], "receiver") ? netns_receiver((uint16_t)atoi(argv[3])) : netns_sender((uint16_t)atoi(argv[3]));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_frame_over_loopback),
        cmocka_unit_test(test_handshake_refusals),
        cmocka_unit_test(test_unkeyed_only_on_loopback),
        cmocka_unit_test(test_bounded_receives),
        cmocka_unit_test(test_connect_to_closed_port),
        cmocka_unit_test(test_frame_between_namespaces),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The etcd client against a real etcd that the test starts on loopback: keys and prefixes,
 * leases that lapse and take their keys with them, registrations kept alive and restored
 * after etcd restarts, watches that see puts and deletes and resume after a restart
 * without losing an event (also when etcd comes back without its data), and calls to a
 * dead or silent etcd that fail in time. */

#include "testutil.h"

#include "blade/etcd_client.h"
#include "etcd_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&t, NULL);
}

typedef struct fixture {
    etcd_server server;
    blade_etcd *e;
    blade_etcd_watch *watch; /* a watch a failed test left running: stopped in the teardown */
} fixture;

/* Without etcd the fixture is NULL and each test skips (loudly, once). */
static int setup(void **state)
{
    *state = NULL;
    if (!etcd_binary()) {
        note_skipped("etcd not installed (Debian package etcd-server, scripts/install-deps.sh): the etcd client is not tested");
        return 0;
    }
    fixture *f = calloc(1, sizeof *f);
    if (etcd_server_start(&f->server)) {
        free(f);
        return -1;
    }
    blade_etcd_config cfg = {.endpoints = f->server.url, .timeout_ms = 2000};
    f->e = blade_etcd_new(&cfg, NULL);
    *state = f;
    return f->e ? 0 : -1;
}

static int teardown(void **state)
{
    fixture *f = *state;
    if (!f)
        return 0;
    blade_etcd_watch_stop(f->watch);
    blade_etcd_free(f->e);
    etcd_server_stop(&f->server);
    free(f);
    return 0;
}

static fixture *need_etcd(void **state)
{
    if (!*state)
        skip();
    return *state;
}

static bool key_present(blade_etcd *e, const char *key)
{
    blade_etcd_list l;
    blade_error err = {{0}};
    if (blade_etcd_get(e, key, &l, &err))
        fail_msg("%s", err.msg);
    bool present = l.n == 1;
    blade_etcd_list_free(&l);
    return present;
}

static void test_keys_and_prefixes(void **state)
{
    fixture *f = need_etcd(state);
    blade_error err = {{0}};
    static const uint8_t binary[] = {0, 1, 2, 0xff, 0, 'x'};
    assert_int_equal(blade_etcd_put(f->e, "blade/w/a", binary, sizeof binary, 0, &err), 0);
    assert_int_equal(blade_etcd_put(f->e, "blade/w/b", "two", 3, 0, &err), 0);
    assert_int_equal(blade_etcd_put(f->e, "blade/w0", "outside", 7, 0, &err), 0);
    assert_int_equal(blade_etcd_put(f->e, "blade/x", "", 0, 0, &err), 0);

    blade_etcd_list l;
    assert_int_equal(blade_etcd_list_prefix(f->e, "blade/w/", &l, &err), 0);
    assert_int_equal(l.n, 2);
    assert_string_equal(l.kvs[0].key, "blade/w/a");
    assert_int_equal(l.kvs[0].value_len, sizeof binary);
    assert_memory_equal(l.kvs[0].value, binary, sizeof binary);
    assert_string_equal(l.kvs[1].key, "blade/w/b");
    assert_string_equal((char *)l.kvs[1].value, "two");
    assert_true(l.revision >= l.kvs[1].mod_revision);
    blade_etcd_list_free(&l);

    assert_int_equal(blade_etcd_get(f->e, "blade/x", &l, &err), 0);
    assert_int_equal(l.n, 1);
    assert_int_equal(l.kvs[0].value_len, 0);
    blade_etcd_list_free(&l);
    assert_int_equal(blade_etcd_get(f->e, "blade/none", &l, &err), 0);
    assert_int_equal(l.n, 0);
    blade_etcd_list_free(&l);

    int64_t deleted;
    assert_int_equal(blade_etcd_delete(f->e, "blade/w/", true, &deleted, &err), 0);
    assert_int_equal(deleted, 2);
    assert_true(key_present(f->e, "blade/w0"));
    assert_int_equal(blade_etcd_delete(f->e, "blade/w0", false, &deleted, &err), 0);
    assert_int_equal(deleted, 1);
    assert_false(key_present(f->e, "blade/w0"));
}

/* A key under a lease nobody renews is gone within the TTL (plus etcd's expiry check); a
 * renewed one stays; a revoked lease takes its key at once. */
static void test_lease_expiry(void **state)
{
    fixture *f = need_etcd(state);
    blade_error err = {{0}};
    int64_t lease, ttl;
    assert_int_equal(blade_etcd_lease_grant(f->e, 2, &lease, &ttl, &err), 0);
    assert_int_equal(ttl, 2);
    assert_int_equal(blade_etcd_put(f->e, "lease/k", "v", 1, lease, &err), 0);
    blade_etcd_list l;
    assert_int_equal(blade_etcd_get(f->e, "lease/k", &l, &err), 0);
    assert_int_equal(l.kvs[0].lease, lease);
    blade_etcd_list_free(&l);
    int64_t t0 = now_ms();
    while (key_present(f->e, "lease/k") && now_ms() - t0 < 5000)
        sleep_ms(100);
    int64_t gone_after = now_ms() - t0;
    assert_false(key_present(f->e, "lease/k"));
    assert_true(gone_after >= 1000 && gone_after <= 3500);
    /* The lease is gone too: a keep-alive says TTL 0. */
    assert_int_equal(blade_etcd_lease_keepalive(f->e, lease, &ttl, &err), 0);
    assert_int_equal(ttl, 0);

    blade_etcd_registration *r = blade_etcd_register(f->e, "lease/reg", "worker", 6, 2, &err);
    if (!r)
        fail_msg("%s", err.msg);
    sleep_ms(3000);
    assert_true(key_present(f->e, "lease/reg"));
    assert_true(blade_etcd_registration_ok(r, NULL));
    assert_int_equal(blade_etcd_registration_update(r, "load=3", 6, &err), 0);
    assert_int_equal(blade_etcd_get(f->e, "lease/reg", &l, &err), 0);
    assert_string_equal((char *)l.kvs[0].value, "load=3");
    blade_etcd_list_free(&l);
    blade_etcd_unregister(r);
    assert_false(key_present(f->e, "lease/reg"));
}

/* ---- watching ---- */

typedef struct recorder {
    pthread_mutex_t mu;
    char log[64][96];
    int n;
} recorder;

static void record(const blade_etcd_event *ev, void *user)
{
    recorder *r = user;
    static const char *const names[] = {"PUT", "DELETE", "RESET", "DISCONNECTED", "RECONNECTED"};
    pthread_mutex_lock(&r->mu);
    if (r->n < 64) {
        if (ev->type == BLADE_ETCD_PUT)
            snprintf(r->log[r->n++], sizeof r->log[0], "PUT %s=%.*s", ev->key, (int)ev->value_len,
                     (const char *)ev->value);
        else if (ev->type == BLADE_ETCD_DELETE)
            snprintf(r->log[r->n++], sizeof r->log[0], "DELETE %s", ev->key);
        else
            snprintf(r->log[r->n++], sizeof r->log[0], "%s", names[ev->type]);
    }
    pthread_mutex_unlock(&r->mu);
}

/* Waits up to ms for `line` to be recorded at or after index from; its index or -1. */
static int wait_event(recorder *r, const char *line, int from, int ms)
{
    int64_t until = now_ms() + ms;
    do {
        pthread_mutex_lock(&r->mu);
        for (int i = from; i < r->n; i++)
            if (!strcmp(r->log[i], line)) {
                pthread_mutex_unlock(&r->mu);
                return i;
            }
        pthread_mutex_unlock(&r->mu);
        sleep_ms(20);
    } while (now_ms() < until);
    pthread_mutex_lock(&r->mu);
    fprintf(stderr, "no '%s' among %d events:\n", line, r->n);
    for (int i = 0; i < r->n; i++)
        fprintf(stderr, "  %s\n", r->log[i]);
    pthread_mutex_unlock(&r->mu);
    return -1;
}

static void test_watch_and_restart(void **state)
{
    fixture *f = need_etcd(state);
    blade_error err = {{0}};
    assert_int_equal(blade_etcd_put(f->e, "w/before", "1", 1, 0, &err), 0);
    assert_int_equal(blade_etcd_put(f->e, "other", "x", 1, 0, &err), 0);
    recorder rec = {.mu = PTHREAD_MUTEX_INITIALIZER};
    blade_etcd_watch *w = blade_etcd_watch_prefix(f->e, "w/", record, &rec, &err);
    assert_non_null(w);
    /* The listing first, then live events. */
    assert_int_equal(wait_event(&rec, "RESET", 0, 3000), 0);
    assert_int_equal(wait_event(&rec, "PUT w/before=1", 0, 3000), 1);
    sleep_ms(200); /* let the stream be created, so the put below is a live event */
    assert_int_equal(blade_etcd_put(f->e, "w/a", "A", 1, 0, &err), 0);
    int i = wait_event(&rec, "PUT w/a=A", 2, 3000);
    assert_true(i >= 2);
    assert_int_equal(blade_etcd_delete(f->e, "w/before", false, NULL, &err), 0);
    assert_true(wait_event(&rec, "DELETE w/before", i, 3000) > i);
    assert_int_equal(blade_etcd_put(f->e, "other2", "x", 1, 0, &err), 0);

    /* etcd crashes: the watch says so, calls fail within the timeout. */
    etcd_server_kill(&f->server);
    assert_true(wait_event(&rec, "DISCONNECTED", 0, 3000) > 0);
    int64_t t0 = now_ms();
    assert_int_equal(blade_etcd_put(f->e, "w/lost", "x", 1, 0, &err), -1);
    assert_true(now_ms() - t0 < 2500);
    assert_non_null(strstr(err.msg, f->server.url));

    /* Back again: a put made before the watch reconnects is still delivered, because the
     * watch resumes from the revision after the last one it saw. */
    assert_int_equal(etcd_server_restart(&f->server), 0);
    assert_int_equal(blade_etcd_put(f->e, "w/after", "B", 1, 0, &err), 0);
    int r = wait_event(&rec, "RECONNECTED", 0, 5000);
    assert_true(r > 0);
    assert_true(wait_event(&rec, "PUT w/after=B", 0, 5000) > 0);
    assert_int_equal(blade_etcd_delete(f->e, "w/a", false, NULL, &err), 0);
    assert_true(wait_event(&rec, "DELETE w/a", r, 3000) > r);
    blade_etcd_watch_stop(w);

    /* Nothing outside the prefix, and no event twice. */
    for (int k = 0; k < rec.n; k++) {
        assert_null(strstr(rec.log[k], "other"));
        for (int m = k + 1; m < rec.n; m++)
            if (!strncmp(rec.log[k], "PUT", 3) || !strncmp(rec.log[k], "DELETE", 6))
                assert_string_not_equal(rec.log[k], rec.log[m]);
    }
}

/* etcd back without its data restarts its revisions far below where the watch would
 * resume: the watch notices (the store's revision is behind it) and lists afresh, so
 * what happens in the new store is delivered. */
static void test_watch_follows_an_emptied_store(void **state)
{
    fixture *f = need_etcd(state);
    blade_error err = {{0}};
    for (int i = 0; i < 20; i++)
        assert_int_equal(blade_etcd_put(f->e, "other", "x", 1, 0, &err), 0);
    assert_int_equal(blade_etcd_put(f->e, "w/old", "1", 1, 0, &err), 0);
    /* on the heap: a failed assertion leaves the watch writing here until the teardown */
    recorder *rec = calloc(1, sizeof *rec);
    assert_non_null(rec);
    pthread_mutex_init(&rec->mu, NULL);
    f->watch = blade_etcd_watch_prefix(f->e, "w/", record, rec, &err);
    assert_non_null(f->watch);
    assert_int_equal(wait_event(rec, "PUT w/old=1", 0, 3000), 1);
    sleep_ms(200); /* the stream created */
    assert_int_equal(etcd_server_restart_empty(&f->server), 0);
    assert_int_equal(blade_etcd_put(f->e, "w/new", "N", 1, 0, &err), 0);
    int reset = wait_event(rec, "RESET", 2, 5000);
    assert_true(reset > 1);
    assert_true(wait_event(rec, "PUT w/new=N", reset, 5000) > reset);
    /* and live events after it */
    assert_int_equal(blade_etcd_delete(f->e, "w/new", false, NULL, &err), 0);
    assert_true(wait_event(rec, "DELETE w/new", reset, 5000) > reset);
    blade_etcd_watch_stop(f->watch);
    f->watch = NULL;
    pthread_mutex_destroy(&rec->mu);
    free(rec);
}

/* A registration outlives an etcd crash: the key is back after the restart. */
static void test_registration_survives_restart(void **state)
{
    fixture *f = need_etcd(state);
    blade_error err = {{0}};
    blade_etcd_registration *r = blade_etcd_register(f->e, "reg/w1", "addr", 4, 2, &err);
    assert_non_null(r);
    etcd_server_kill(&f->server);
    sleep_ms(1500);
    assert_false(blade_etcd_registration_ok(r, &err));
    assert_true(err.msg[0] != 0);
    assert_int_equal(etcd_server_restart(&f->server), 0);
    int64_t t0 = now_ms();
    while (!(blade_etcd_registration_ok(r, NULL) && key_present(f->e, "reg/w1")) && now_ms() - t0 < 5000)
        sleep_ms(100);
    assert_true(blade_etcd_registration_ok(r, NULL));
    assert_true(key_present(f->e, "reg/w1"));
    blade_etcd_unregister(r);
    assert_false(key_present(f->e, "reg/w1"));
}

/* etcd that is not there (refused) or that never answers (a socket that accepts but
 * stays silent): errors within the timeout, a watch that reports it and stops at once. */
static void test_unreachable(void **state)
{
    (void)state;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 8), 0);
    getsockname(fd, (struct sockaddr *)&a, &len);
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", ntohs(a.sin_port));
    blade_etcd_config cfg = {.endpoints = url, .timeout_ms = 700};
    blade_error err = {{0}};
    blade_etcd *e = blade_etcd_new(&cfg, &err);
    int64_t t0 = now_ms();
    assert_int_equal(blade_etcd_put(e, "k", "v", 1, 0, &err), -1);
    int64_t took = now_ms() - t0;
    assert_true(took >= 600 && took < 1500);
    assert_non_null(strstr(err.msg, "imeout"));
    recorder rec = {.mu = PTHREAD_MUTEX_INITIALIZER};
    blade_etcd_watch *w = blade_etcd_watch_prefix(e, "p/", record, &rec, &err);
    assert_true(wait_event(&rec, "DISCONNECTED", 0, 3000) == 0);
    t0 = now_ms();
    blade_etcd_watch_stop(w);
    assert_true(now_ms() - t0 < 1000);
    blade_etcd_free(e);
    close(fd);

    /* Refused at once. */
    cfg.endpoints = "http://127.0.0.1:1";
    e = blade_etcd_new(&cfg, &err);
    t0 = now_ms();
    assert_int_equal(blade_etcd_get(e, "k", &(blade_etcd_list){0}, &err), -1);
    assert_true(now_ms() - t0 < 700);
    blade_etcd_free(e);

    cfg.endpoints = "ftp://x";
    assert_null(blade_etcd_new(&cfg, &err));
    assert_non_null(strstr(err.msg, "not an http://"));
    cfg.endpoints = "";
    assert_null(blade_etcd_new(&cfg, &err));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_keys_and_prefixes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lease_expiry, setup, teardown),
        cmocka_unit_test_setup_teardown(test_watch_and_restart, setup, teardown),
        cmocka_unit_test_setup_teardown(test_watch_follows_an_emptied_store, setup, teardown),
        cmocka_unit_test_setup_teardown(test_registration_survives_restart, setup, teardown),
        cmocka_unit_test(test_unreachable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

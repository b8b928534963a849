/* `blade router` in front of `blade serve` workers, every process in a network namespace
 * of its own:
 *  - two `both` workers listed statically: answers (greedy, seeded, streaming, and a
 *    worker's error object) equal a lone server's; requests sharing a prompt prefix go to
 *    the worker that computed it (routed by prefix, prefix-cache hits on that worker) while
 *    round-robin spreads them; a worker SIGKILLed is replaced, the answers unchanged;
 *  - workers found through etcd: a decode worker paired with the prefill worker of its KV
 *    fingerprint, never with one of another KV type; answers equal a lone server's; a
 *    decode worker SIGKILLed leaves the pool within its lease and requests then get 503
 *    with a count by cause.
 * Skips where namespaces cannot be made or etcd is not installed. */

#include "testutil.h"

#include "cluster_harness.h"
#include "etcd_server.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define RPORT 8000
#define WPORT 8080

static void need_netns(void)
{
    blade_error why = {{0}};
    if (!blade_netns_usable(&why)) {
        note_skipped("blade router not tested: %s", why.msg);
        skip();
    }
}

static pid_t worker(blade_netns *net, int i, const char *model, const char *extra, const char *name)
{
    char args[2048];
    snprintf(args, sizeof args, "serve -m %s --host %s --port %d --kv-mem 64M -t 1 %s", model, net->addr[i], WPORT,
             extra);
    char *log = temp_path(name);
    unlink(log);
    pid_t pid = ns_blade(net, i, args, log);
    free(log);
    return pid;
}

static const char *const bodies[] = {
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"Once upon a time there was a little girl named Lily. She loved to "
    "play outside\",\"max_tokens\":30,\"temperature\":0}",
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"The cat sat\",\"max_tokens\":20,\"temperature\":0.9,\"seed\":11}",
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"One day, a boy\",\"max_tokens\":25,\"temperature\":0.7,"
    "\"seed\":3,\"stream\":true}",
    "{\"model\":\"nope\",\"prompt\":\"x\"}",
};
#define N_BODIES (sizeof bodies / sizeof *bodies)

/* Every body through the router (in host `router`) against the lone server's answer. */
static void compare(const blade_netns *net, int router, int lone, const char *what)
{
    for (size_t b = 0; b < N_BODIES; b++) {
        char *want_r = ns_complete(net, lone, net->addr[lone], WPORT, bodies[b]);
        char *got_r = ns_complete(net, router, net->addr[router], RPORT, bodies[b]);
        char *want = completion_text(want_r), *got = completion_text(got_r);
        bool error_object = strstr(want_r, "\"error\"") != NULL;
        if ((error_object ? strcmp(want_r, got_r) : strcmp(want, got)) || (!error_object && !want[0]))
            fail_msg("%s, request %zu: the router said\n  %s\na lone server\n  %s", what, b, got_r, want_r);
        free(want);
        free(got);
        free(want_r);
        free(got_r);
    }
}

/* A prompt of token ids: group g's 64-token prefix, then a suffix of its own. */
static void prefix_body(char *out, size_t cap, int group, int i)
{
    size_t n = (size_t)snprintf(out, cap, "{\"model\":\"stories260K.gguf\",\"max_tokens\":2,\"prompt\":[");
    for (int t = 0; t < 80; t++)
        n += (size_t)snprintf(out + n, cap - n, "%s%d", t ? "," : "", t < 64 ? 10 + 7 * group + t : 300 + i * 3 + t);
    snprintf(out + n, cap - n, "]}");
}

static long router_metric(const blade_netns *net, int router, const char *sample)
{
    return ns_metric(net, router, net->addr[router], RPORT, sample);
}

enum { S_ROUTER, S_A, S_B, S_LONE, S_HOSTS };

static void start_router(blade_netns *net, int host, const char *workers, const char *policy, const char *name)
{
    char args[2048];
    snprintf(args, sizeof args, "router --listen %s:%d %s --policy %s", net->addr[host], RPORT, workers, policy);
    char *log = temp_path(name);
    unlink(log);
    ns_blade(net, host, args, log);
    free(log);
    ns_wait_healthy(net, host, RPORT);
}

static void test_router_both_workers(void **state)
{
    (void)state;
    need_netns();
    char *model = require_shared("models/stories260K.gguf");
    blade_netns net;
    blade_error err = {{0}};
    if (blade_netns_create(&net, S_HOSTS, &err))
        fail_msg("%s", err.msg);
    pid_t a = worker(&net, S_A, model, "", "router-a.log");
    worker(&net, S_B, model, "", "router-b.log");
    worker(&net, S_LONE, model, "", "router-lone.log");
    for (int i = S_A; i < S_HOSTS; i++)
        ns_wait_healthy(&net, i, WPORT);
    char workers[256];
    snprintf(workers, sizeof workers, "--workers http://%s:%d,http://%s:%d", net.addr[S_A], WPORT, net.addr[S_B],
             WPORT);
    start_router(&net, S_ROUTER, workers, "cache-aware", "router.log");
    sleep(1); /* a poll of both workers */
    compare(&net, S_ROUTER, S_LONE, "two both workers");

    /* two prefix groups, four requests each, one after another: all but each group's
     * first are routed to the worker holding the prefix */
    long prefix0 = router_metric(&net, S_ROUTER, "blade_router:routed_total{reason=\"prefix\"}");
    char body[2048];
    for (int i = 0; i < 8; i++) {
        prefix_body(body, sizeof body, i % 2, i);
        free(ns_complete(&net, S_ROUTER, net.addr[S_ROUTER], RPORT, body));
    }
    assert_int_equal(router_metric(&net, S_ROUTER, "blade_router:routed_total{reason=\"prefix\"}") - prefix0, 6);
    long hits = ns_metric(&net, S_ROUTER, net.addr[S_A], WPORT, "blade:prefix_cache_hits_total") +
                ns_metric(&net, S_ROUTER, net.addr[S_B], WPORT, "blade:prefix_cache_hits_total");
    assert_true(hits >= 6 * 64);

    /* a worker killed: its requests go to the other one, answers unchanged */
    kill(a, SIGKILL);
    blade_netns_wait(&net, a, 5000);
    compare(&net, S_ROUTER, S_LONE, "one worker killed");
    assert_int_equal(router_metric(&net, S_ROUTER, "blade_router:requests_total{result=\"no_worker\"}"), 0);
    assert_int_equal(router_metric(&net, S_ROUTER, "blade_router:requests_total{result=\"worker_error_status\"}"), 2);
    blade_netns_destroy(&net);
    free(model);
}

enum { E_ROUTER, E_PREFILL, E_PREFILL_Q8, E_DECODE, E_LONE, E_HOSTS };

static void test_router_etcd_disaggregated(void **state)
{
    (void)state;
    need_netns();
    if (!etcd_binary()) {
        note_skipped("blade router with etcd not tested: etcd is not installed");
        skip();
    }
    char *model = require_shared("models/stories260K.gguf");
    char *key = temp_path("router.key"), *data = temp_path("router-etcd");
    write_file(key, "router-test-key-0123456789abcdef\n", 33);
    chmod(key, 0600);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", data);
    run_command(cmd, NULL);
    blade_netns net;
    blade_error err = {{0}};
    if (blade_netns_create(&net, E_HOSTS, &err))
        fail_msg("%s", err.msg);
    char client[64];
    snprintf(client, sizeof client, "http://%s:2379", net.addr[E_ROUTER]);
    char *etcd_log = temp_path("router-etcd.log");
    ns_etcd(&net, E_ROUTER, data, etcd_log);

    char common[1024], extra[1536];
    snprintf(common, sizeof common, "--etcd %s --cluster t --etcd-ttl 2 --cluster-key-file %s --kv-transports tcp",
             client, key);
    snprintf(extra, sizeof extra, "--role prefill --kv-listen %s:9000 %s", net.addr[E_PREFILL], common);
    worker(&net, E_PREFILL, model, extra, "router-prefill.log");
    snprintf(extra, sizeof extra, "--role prefill --kv-type q8_0 --kv-listen %s:9000 %s", net.addr[E_PREFILL_Q8],
             common);
    worker(&net, E_PREFILL_Q8, model, extra, "router-prefill-q8.log");
    snprintf(extra, sizeof extra, "--role decode %s", common);
    pid_t decode = worker(&net, E_DECODE, model, extra, "router-decode.log");
    worker(&net, E_LONE, model, "", "router-lone2.log");
    for (int i = E_PREFILL; i < E_HOSTS; i++)
        ns_wait_healthy(&net, i, WPORT);
    snprintf(extra, sizeof extra, "--etcd %s --cluster t", client);
    start_router(&net, E_ROUTER, extra, "cache-aware", "router-etcd-router.log");
    /* every registered worker polled */
    for (int t = 0; t < 50; t++) {
        char args[128];
        snprintf(args, sizeof args, "http://%s:%d/health", net.addr[E_ROUTER], RPORT);
        char *h = ns_curl(&net, E_ROUTER, args);
        int healthy = 0;
        for (const char *p = h; (p = strstr(p, "\"healthy\":true")); p++)
            healthy++;
        free(h);
        if (healthy == 3)
            break;
        usleep(200000);
    }
    compare(&net, E_ROUTER, E_LONE, "prefill and decode workers from etcd");
    assert_int_equal(router_metric(&net, E_ROUTER, "blade_router:disaggregated_total"), (long)N_BODIES);
    assert_int_equal(ns_metric(&net, E_ROUTER, net.addr[E_PREFILL], WPORT, "blade:prefill_service_served_total"),
                     (long)N_BODIES - 1); /* the unknown model is refused before any prefill */
    assert_int_equal(ns_metric(&net, E_ROUTER, net.addr[E_PREFILL_Q8], WPORT, "blade:prefill_service_served_total"),
                     0);

    /* the decode worker dies: its lease lapses, no worker can decode, 503 counted */
    kill(decode, SIGKILL);
    blade_netns_wait(&net, decode, 5000);
    sleep(4);
    char *r = ns_complete(&net, E_ROUTER, net.addr[E_ROUTER], RPORT, bodies[0]);
    if (!strstr(r, "no worker can take the request"))
        fail_msg("with no decode worker left the router said %s", r);
    free(r);
    assert_int_equal(router_metric(&net, E_ROUTER, "blade_router:requests_total{result=\"no_worker\"}"), 1);
    blade_netns_destroy(&net);
    run_command(cmd, NULL);
    free(etcd_log);
    free(key);
    free(data);
    free(model);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_router_both_workers),
        cmocka_unit_test(test_router_etcd_disaggregated),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Faults in a cluster (issue 23), every process in a network namespace of its own, each
 * answer checked against a lone colocated server's (greedy and seeded sampling are
 * bit-identical through every path) and every request found in the router's
 * blade_router:requests_total by how it ended:
 *  - a prefill worker SIGKILLed while it holds a KV frame (after FIRST, before the frame)
 *    and while it computes a prompt: the decode worker computes the prompt itself, the
 *    client's answer is complete and identical; restarted at the same address it is used
 *    again (a fresh UCX connection, nothing stale);
 *  - a decode worker SIGKILLed while it holds a stream after its first chunk and a
 *    non-streaming answer: the stream ends with an error event naming the cause and
 *    [DONE], the other request is retried on the second decode worker and answered; new
 *    requests go to the survivor and the dead worker leaves the router's view within its
 *    lease; restarted at its address it serves again, taking turns with the other one; a
 *    prefill worker of another model (another KV fingerprint) is never paired with either;
 *  - etcd SIGKILLed: the router keeps routing on its last view and /health says degraded
 *    with the reason; etcd back on its data: /health ok, routing on; etcd back without its
 *    data: the workers register again, and a worker that joins later is seen and used.
 * The kills land at the right point every time through the test aids of
 * common/test_aid.h (BLADE_TEST_..._HOLD_MS), not through timing. Skips where namespaces
 * cannot be made or etcd is not installed. Namespaces, processes and data directories go
 * in the teardown, also after a failure. */

#include "testutil.h"

#include "cluster_harness.h"
#include "etcd_server.h"

#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define RPORT 8000
#define WPORT 8080
/* Far longer than the steps between a hold's start and the kill, even on a loaded
 * machine: a held worker is always killed inside its hold. */
#define HOLD "120000"

typedef struct fixture {
    blade_netns net;
    char *model, *key, *etcd_data, *other_model;
    pid_t etcd;
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    *state = f;
    return f ? 0 : -1;
}

static void remove_tree(const char *path)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    run_command(cmd, NULL);
}

static int teardown(void **state)
{
    fixture *f = *state;
    if (f->net.n)
        blade_netns_destroy(&f->net);
    if (f->etcd_data) {
        remove_tree(f->etcd_data);
        free(f->etcd_data);
    }
    if (f->other_model)
        unlink(f->other_model);
    free(f->other_model);
    free(f->model);
    free(f->key);
    free(f);
    return 0;
}

/* The namespaces, the model and the cluster key; skips where namespaces cannot be made
 * (and, with etcd, where it is not installed). */
static void begin(fixture *f, int hosts, bool etcd)
{
    blade_error why = {{0}};
    if (!blade_netns_usable(&why)) {
        note_skipped("cluster faults not tested: %s", why.msg);
        skip();
    }
    if (etcd && !etcd_binary()) {
        note_skipped("cluster faults with etcd not tested: etcd is not installed");
        skip();
    }
    f->model = require_shared("models/stories260K.gguf");
    f->key = temp_path("faults.key");
    write_file(f->key, "faults-test-key-0123456789abcdef\n", 33);
    chmod(f->key, 0600);
    if (etcd) {
        f->etcd_data = temp_path("faults-etcd");
        remove_tree(f->etcd_data);
    }
    blade_error err = {{0}};
    if (blade_netns_create(&f->net, hosts, &err))
        fail_msg("%s", err.msg);
}

/* `blade serve` in host i with the test aid env (NAME=VALUE or NULL) set for it alone. */
static pid_t worker(fixture *f, int i, const char *model, const char *extra, const char *env, const char *log_name)
{
    char args[2048], name[64] = "";
    snprintf(args, sizeof args, "serve -m %s --host %s --port %d --kv-mem 64M -t 1 %s", model ? model : f->model,
             f->net.addr[i], WPORT, extra);
    const char *eq = env ? strchr(env, '=') : NULL;
    if (eq) {
        snprintf(name, sizeof name, "%.*s", (int)(eq - env), env);
        setenv(name, eq + 1, 1);
    }
    char *log = temp_path(log_name);
    pid_t pid = ns_blade(&f->net, i, args, log);
    free(log);
    if (eq)
        unsetenv(name);
    return pid;
}

static void kill_worker(fixture *f, pid_t pid)
{
    kill(pid, SIGKILL);
    blade_netns_wait(&f->net, pid, 5000);
}

/* Flags of a worker in a cluster: the key, UCX over TCP between namespaces, and
 * registration in the router host's etcd when etcd_host >= 0. */
static void cluster_flags(const fixture *f, int etcd_host, char *out, size_t cap)
{
    size_t n = (size_t)snprintf(out, cap, "--cluster-key-file %s --kv-transports tcp --kv-timeout 60", f->key);
    if (etcd_host >= 0)
        snprintf(out + n, cap - n, " --etcd http://%s:2379 --cluster t --etcd-ttl 2", f->net.addr[etcd_host]);
}

static pid_t start_router(fixture *f, int host, const char *how, const char *log_name)
{
    char args[1024];
    snprintf(args, sizeof args, "router --listen %s:%d %s --policy cache-aware", f->net.addr[host], RPORT, how);
    char *log = temp_path(log_name);
    pid_t pid = ns_blade(&f->net, host, args, log);
    free(log);
    ns_wait_healthy(&f->net, host, RPORT);
    return pid;
}

/* After the faults the router still stops cleanly on SIGTERM: exit status 0 (under the
 * sanitizers, also nothing leaked on the failure paths it went through). */
static void stop_router(fixture *f, pid_t router)
{
    kill(router, SIGTERM);
    assert_int_equal(blade_netns_wait(&f->net, router, 20000), 0);
}

/* The router's GET /health, parsed. */
static json_t *router_health(const fixture *f, int router)
{
    char args[128];
    snprintf(args, sizeof args, "http://%s:%d/health", f->net.addr[router], RPORT);
    char *text = ns_curl(&f->net, router, args);
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    free(text);
    return j;
}

/* How many workers of a role the router lists as healthy; whether host i's URL is listed
 * at all (listed may be NULL). */
static int router_healthy(const fixture *f, int router, const char *role, int i, bool *listed)
{
    json_t *h = router_health(f, router);
    char url[64];
    snprintf(url, sizeof url, "http://%s:%d", f->net.addr[i >= 0 ? i : 0], WPORT);
    int healthy = 0;
    if (listed)
        *listed = false;
    size_t k;
    json_t *w;
    json_array_foreach(json_object_get(h, "workers"), k, w)
    {
        if (!strcmp(json_string_value(json_object_get(w, "role")) ?: "", role) &&
            json_is_true(json_object_get(w, "healthy")))
            healthy++;
        if (listed && i >= 0 && !strcmp(json_string_value(json_object_get(w, "url")) ?: "", url))
            *listed = true;
    }
    json_decref(h);
    return healthy;
}

/* Waits up to 15 s for the router to see `want` healthy workers of a role. */
static void wait_healthy(const fixture *f, int router, const char *role, int want)
{
    int got = 0;
    for (int t = 0; t < 150 && (got = router_healthy(f, router, role, -1, NULL)) != want; t++)
        usleep(100000);
    if (got != want)
        fail_msg("the router sees %d healthy %s workers, not %d", got, role, want);
}

/* Waits up to 15 s until the router has `want` requests in flight on workers of a role. */
static void wait_inflight(const fixture *f, int router, const char *role, int want)
{
    json_int_t got = 0;
    for (int t = 0; t < 150; t++) {
        json_t *h = router_health(f, router);
        size_t k;
        json_t *w;
        got = 0;
        json_array_foreach(json_object_get(h, "workers"), k, w)
        {
            if (!strcmp(json_string_value(json_object_get(w, "role")) ?: "", role))
                got += json_integer_value(json_object_get(w, "inflight"));
        }
        json_decref(h);
        if (got == want)
            return;
        usleep(100000);
    }
    fail_msg("the router has %lld requests in flight on %s workers, not %d", (long long)got, role, want);
}

/* Waits up to 15 s until the router's /health status is `status`. */
static void wait_status(const fixture *f, int router, const char *status)
{
    for (int t = 0; t < 150; t++) {
        json_t *h = router_health(f, router);
        bool ok = !strcmp(json_string_value(json_object_get(h, "status")) ?: "", status);
        json_decref(h);
        if (ok)
            return;
        usleep(100000);
    }
    fail_msg("the router's /health did not turn %s", status);
}

/* Waits up to 30 s for a line in a log (a test aid saying it holds). */
static void wait_log(const char *log_name, const char *needle)
{
    char *log = temp_path(log_name);
    for (int t = 0; t < 300; t++) {
        char *text = read_file(log, NULL);
        bool found = text && strstr(text, needle);
        free(text);
        if (found) {
            free(log);
            return;
        }
        usleep(100000);
    }
    fail_msg("'%s' never appeared in %s", needle, log);
}

static const char *const greedy =
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"Once upon a time there was a little girl named Lily. She loved to "
    "play outside in the park with her friends and her dog\",\"max_tokens\":40,\"temperature\":0}";
static const char *const seeded_stream =
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"Once upon a time there was a little girl named Lily. She loved to "
    "play outside in the park with her friends and her dog. One day\",\"max_tokens\":30,\"temperature\":0.7,"
    "\"top_k\":20,\"seed\":3,\"stream\":true}";
static const char *const seeded =
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"The cat sat on the mat and looked at the big red ball\","
    "\"max_tokens\":24,\"temperature\":0.9,\"seed\":11}";

static const char *const short_a =
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"A little bird sang\",\"max_tokens\":20,\"temperature\":0}";
static const char *const short_b =
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"Tom went to the shop\",\"max_tokens\":20,\"temperature\":0}";

/* A router's (or a worker's) answer against the lone server's for the same body. */
static void expect_same(const fixture *f, int lone, const char *body, const char *got_r, const char *what)
{
    char *want_r = ns_complete(&f->net, lone, f->net.addr[lone], WPORT, body);
    char *want = completion_text(want_r), *got = completion_text(got_r);
    if (!want[0] || strcmp(want, got) || strstr(got_r, "\"error\""))
        fail_msg("%s: the router said\n  %s\na lone server\n  %s", what, got_r, want_r);
    free(want);
    free(got);
    free(want_r);
}

/* A request through the router now, against the lone server. */
static void check_request(const fixture *f, int router, int lone, const char *body, const char *what)
{
    char *got = ns_complete(&f->net, router, f->net.addr[router], RPORT, body);
    expect_same(f, lone, body, got, what);
    free(got);
}

/* A background request's output once its curl ended. */
static char *finish_bg(fixture *f, pid_t pid, const char *out_name)
{
    if (blade_netns_wait(&f->net, pid, 60000) != 0)
        fail_msg("the client of %s did not end well", out_name);
    char *path = temp_path(out_name), *text = read_file(path, NULL);
    free(path);
    return text ? text : strdup("");
}

static pid_t start_bg(fixture *f, int router, const char *body, const char *out_name)
{
    char *path = temp_path(out_name);
    pid_t pid = ns_complete_bg(&f->net, router, f->net.addr[router], RPORT, body, path);
    free(path);
    return pid;
}

static long metric(const fixture *f, int from, int host, int port, const char *sample)
{
    return ns_metric(&f->net, from, f->net.addr[host], port, sample);
}

/* The router's count of requests by result, and that these are all it ever got: no
 * request went uncounted. */
static void expect_outcomes(const fixture *f, int router, long ok, long midstream, long total)
{
    static const char *const results[] = {"ok",          "worker_error_status", "bad_request",   "no_worker",
                                          "worker_failed_midstream", "client_gone", "internal_error"};
    long sum = 0;
    for (size_t k = 0; k < sizeof results / sizeof *results; k++) {
        char sample[96];
        snprintf(sample, sizeof sample, "blade_router:requests_total{result=\"%s\"}", results[k]);
        long v = metric(f, router, router, RPORT, sample);
        assert_true(v >= 0);
        sum += v;
    }
    assert_int_equal(metric(f, router, router, RPORT, "blade_router:requests_total{result=\"ok\"}"), ok);
    assert_int_equal(
        metric(f, router, router, RPORT, "blade_router:requests_total{result=\"worker_failed_midstream\"}"), midstream);
    assert_int_equal(sum, total);
}

/* A prefill worker in host i, its KV service on ADDR:9000 (the same address each time);
 * env: a test aid for it alone. */
static pid_t start_prefill(fixture *f, int i, int etcd_host, const char *model, const char *env, const char *log_name)
{
    char flags[1024], extra[1536];
    cluster_flags(f, etcd_host, flags, sizeof flags);
    snprintf(extra, sizeof extra, "--role prefill --kv-listen %s:9000 %s", f->net.addr[i], flags);
    return worker(f, i, model, extra, env, log_name);
}

static pid_t start_decode(fixture *f, int i, int etcd_host, const char *env, const char *log_name)
{
    char flags[1024], extra[1536];
    cluster_flags(f, etcd_host, flags, sizeof flags);
    snprintf(extra, sizeof extra, "--role decode %s", flags);
    return worker(f, i, NULL, extra, env, log_name);
}

static void expect_log(const char *log_name, const char *needle)
{
    char *path = temp_path(log_name), *text = read_file(path, NULL);
    if (!text || !strstr(text, needle))
        fail_msg("'%s' is not in %s", needle, path);
    free(text);
    free(path);
}

enum { P_ROUTER, P_PREFILL, P_DECODE, P_LONE, P_HOSTS };

static void test_prefill_killed_mid_transfer(void **state)
{
    fixture *f = *state;
    begin(f, P_HOSTS, false);
    pid_t prefill = start_prefill(f, P_PREFILL, -1, NULL, "BLADE_TEST_KV_FRAME_HOLD_MS=" HOLD, "faults-p1.log");
    start_decode(f, P_DECODE, -1, NULL, "faults-p-decode.log");
    worker(f, P_LONE, NULL, "", NULL, "faults-p-lone.log");
    for (int i = P_PREFILL; i < P_HOSTS; i++)
        ns_wait_healthy(&f->net, i, WPORT);
    char how[256];
    snprintf(how, sizeof how, "--workers http://%s:%d,http://%s:%d", f->net.addr[P_PREFILL], WPORT,
             f->net.addr[P_DECODE], WPORT);
    pid_t router = start_router(f, P_ROUTER, how, "faults-p-router.log");
    wait_healthy(f, P_ROUTER, "prefill", 1);
    wait_healthy(f, P_ROUTER, "decode", 1);

    /* Two requests at once: the first's KV frame is held, the second waits for the
     * service (it serves one connection at a time); the kill cuts both. */
    pid_t a = start_bg(f, P_ROUTER, greedy, "faults-p-a.out");
    wait_log("faults-p1.log", "holding a KV frame");
    pid_t b = start_bg(f, P_ROUTER, seeded_stream, "faults-p-b.out");
    wait_inflight(f, P_ROUTER, "decode", 2); /* b is paired with the prefill worker too */
    kill_worker(f, prefill);
    char *ra = finish_bg(f, a, "faults-p-a.out"), *rb = finish_bg(f, b, "faults-p-b.out");
    expect_same(f, P_LONE, greedy, ra, "prefill worker killed holding the KV frame");
    expect_same(f, P_LONE, seeded_stream, rb, "prefill worker killed while another request waited for it");
    free(ra);
    free(rb);
    assert_int_equal(metric(f, P_ROUTER, P_DECODE, WPORT, "blade:remote_prefills_total{result=\"ok\"}"), 0);
    assert_int_equal(metric(f, P_ROUTER, P_DECODE, WPORT, "blade:remote_prefills_total{result=\"peer\"}") +
                         metric(f, P_ROUTER, P_DECODE, WPORT, "blade:remote_prefills_total{result=\"connect\"}"),
                     2);
    expect_log("faults-p-decode.log", "computing the prompt here");

    /* Restarted at its address, held before computing the prompt: as a long prompt. */
    prefill = start_prefill(f, P_PREFILL, -1, NULL, "BLADE_TEST_PREFILL_HOLD_MS=" HOLD, "faults-p2.log");
    ns_wait_healthy(&f->net, P_PREFILL, WPORT);
    wait_healthy(f, P_ROUTER, "prefill", 1);
    a = start_bg(f, P_ROUTER, seeded, "faults-p-c.out");
    wait_log("faults-p2.log", "holding a prefill");
    kill_worker(f, prefill);
    ra = finish_bg(f, a, "faults-p-c.out");
    expect_same(f, P_LONE, seeded, ra, "prefill worker killed computing the prompt");
    free(ra);
    assert_int_equal(metric(f, P_ROUTER, P_DECODE, WPORT, "blade:remote_prefills_total{result=\"ok\"}"), 0);

    /* Restarted again, nothing held: used again, over a fresh UCX connection. */
    start_prefill(f, P_PREFILL, -1, NULL, NULL, "faults-p3.log");
    ns_wait_healthy(&f->net, P_PREFILL, WPORT);
    wait_healthy(f, P_ROUTER, "prefill", 1);
    check_request(f, P_ROUTER, P_LONE, greedy, "prefill worker restarted at its address");
    check_request(f, P_ROUTER, P_LONE, seeded_stream, "prefill worker restarted at its address (stream)");
    assert_int_equal(metric(f, P_ROUTER, P_PREFILL, WPORT, "blade:prefill_service_served_total"), 2);
    assert_int_equal(metric(f, P_ROUTER, P_DECODE, WPORT, "blade:remote_prefills_total{result=\"ok\"}"), 2);
    /* every request answered in full, none counted otherwise */
    expect_outcomes(f, P_ROUTER, 5, 0, 5);
    stop_router(f, router);
}

/* The router's view of host i: listed at all (its registration present). */
static bool router_lists(const fixture *f, int router, int i)
{
    bool listed;
    router_healthy(f, router, "", i, &listed);
    return listed;
}

static void wait_listed(const fixture *f, int router, int i, bool want)
{
    for (int t = 0; t < 150; t++) {
        if (router_lists(f, router, i) == want)
            return;
        usleep(100000);
    }
    fail_msg("the router %s host %d's worker after 15 s", want ? "does not list" : "still lists", i);
}

/* Writes an unrelated key n times: the store's revision climbs, as it does where etcd
 * serves more than this cluster, so a store that comes back empty restarts far below the
 * revision a watcher resumes from. */
static void bump_revision(const fixture *f, int etcd, int n)
{
    char args[192];
    snprintf(args, sizeof args,
             "-o /dev/null http://%s:2379/v3/kv/put -d '{\"key\":\"ZmF1bHRzL3BhZA==\",\"value\":\"eA==\"}'",
             f->net.addr[etcd]);
    for (int i = 0; i < n; i++)
        free(ns_curl(&f->net, etcd, args));
}

/* etcd and a router watching it, in host `router`; the router's pid. */
static pid_t start_etcd_router(fixture *f, int router, int bump, const char *router_log)
{
    char *log = temp_path("faults-etcd.log");
    pid_t etcd = ns_etcd(&f->net, router, f->etcd_data, log);
    free(log);
    bump_revision(f, router, bump);
    char how[128];
    snprintf(how, sizeof how, "--etcd http://%s:2379 --cluster t", f->net.addr[router]);
    f->etcd = etcd;
    return start_router(f, router, how, router_log);
}

enum { D_ROUTER, D_PREFILL, D_OTHER, D_DEC1, D_DEC2, D_LONE, D_HOSTS };

static void test_decode_killed(void **state)
{
    fixture *f = *state;
    begin(f, D_HOSTS, true);
    f->other_model = synth_small_model("faults-other.gguf", 7);
    pid_t router = start_etcd_router(f, D_ROUTER, 0, "faults-d-router.log");
    start_prefill(f, D_PREFILL, D_ROUTER, NULL, NULL, "faults-d-prefill.log");
    start_prefill(f, D_OTHER, D_ROUTER, f->other_model, NULL, "faults-d-other.log");
    pid_t dec1 = start_decode(f, D_DEC1, D_ROUTER, "BLADE_TEST_ANSWER_HOLD_MS=" HOLD, "faults-d-dec1.log");
    worker(f, D_LONE, NULL, "", NULL, "faults-d-lone.log");
    for (int i = D_PREFILL; i < D_HOSTS; i++)
        if (i != D_DEC2)
            ns_wait_healthy(&f->net, i, WPORT);
    wait_healthy(f, D_ROUTER, "prefill", 2);
    wait_healthy(f, D_ROUTER, "decode", 1);

    /* A stream held after its first chunk and an answer held before it is sent, both on
     * the one decode worker; a second one joins, then the first dies. */
    pid_t s = start_bg(f, D_ROUTER, seeded_stream, "faults-d-s.out");
    pid_t n = start_bg(f, D_ROUTER, greedy, "faults-d-n.out");
    wait_log("faults-d-dec1.log", "holding a stream after its first chunk");
    wait_log("faults-d-dec1.log", "holding an answer before sending it");
    pid_t dec2 = start_decode(f, D_DEC2, D_ROUTER, NULL, "faults-d-dec2.log");
    ns_wait_healthy(&f->net, D_DEC2, WPORT);
    wait_healthy(f, D_ROUTER, "decode", 2);
    kill_worker(f, dec1);
    char *rs = finish_bg(f, s, "faults-d-s.out"), *rn = finish_bg(f, n, "faults-d-n.out");
    /* the stream: its first chunk, then an error event naming the cause, then [DONE] */
    const char *first = strstr(rs, "data: {"), *error = strstr(rs, "\"code\":\"worker_failed_midstream\"");
    size_t len = strlen(rs);
    if (!first || !strstr(first, "\"text\"") || !error || first > error || !strstr(rs, "failed while streaming") ||
        len < 14 || strcmp(rs + len - 14, "data: [DONE]\n\n"))
        fail_msg("the stream cut by the decode worker's death reads\n%s", rs);
    expect_same(f, D_LONE, greedy, rn, "non-streaming request on a decode worker that died");
    free(rs);
    free(rn);

    /* new requests go to the survivor at once; the dead worker leaves within its lease */
    check_request(f, D_ROUTER, D_LONE, greedy, "after a decode worker died");
    check_request(f, D_ROUTER, D_LONE, seeded, "after a decode worker died (seeded)");
    check_request(f, D_ROUTER, D_LONE, seeded_stream, "after a decode worker died (stream)");
    /* none of them was tried on the dead worker: the one failed attempt is the held
     * non-streaming request's */
    const char *failed = "blade_router:attempts_failed_total{cause=\"failed_before_answer\"}",
               *unreachable = "blade_router:attempts_failed_total{cause=\"unreachable\"}";
    assert_int_equal(metric(f, D_ROUTER, D_ROUTER, RPORT, failed), 1);
    assert_int_equal(metric(f, D_ROUTER, D_ROUTER, RPORT, unreachable), 0);
    wait_listed(f, D_ROUTER, D_DEC1, false);

    /* Restarted at its address it serves again: two requests in a row with no prefix to
     * follow (prompts under one routing block) take turns over the two idle decode
     * workers; then, the other one gone, it takes all. */
    start_decode(f, D_DEC1, D_ROUTER, NULL, "faults-d-dec1b.log");
    ns_wait_healthy(&f->net, D_DEC1, WPORT);
    wait_healthy(f, D_ROUTER, "decode", 2);
    const char *remote_ok = "blade:remote_prefills_total{result=\"ok\"}";
    long dec2_ok = metric(f, D_ROUTER, D_DEC2, WPORT, remote_ok);
    check_request(f, D_ROUTER, D_LONE, short_a, "two decode workers, one restarted (a)");
    check_request(f, D_ROUTER, D_LONE, short_b, "two decode workers, one restarted (b)");
    assert_int_equal(metric(f, D_ROUTER, D_DEC1, WPORT, remote_ok), 1);
    assert_int_equal(metric(f, D_ROUTER, D_DEC2, WPORT, remote_ok), dec2_ok + 1);
    kill_worker(f, dec2);
    check_request(f, D_ROUTER, D_LONE, greedy, "decode worker restarted at its address");
    check_request(f, D_ROUTER, D_LONE, seeded_stream, "decode worker restarted at its address (stream)");
    assert_int_equal(metric(f, D_ROUTER, D_DEC1, WPORT, remote_ok), 3);

    /* the prefill worker of another model was never paired */
    assert_int_equal(metric(f, D_ROUTER, D_OTHER, WPORT, "blade:prefill_service_served_total"), 0);
    assert_true(metric(f, D_ROUTER, D_PREFILL, WPORT, "blade:prefill_service_served_total") >= 5);
    expect_outcomes(f, D_ROUTER, 8, 1, 9);
    stop_router(f, router);
}

/* How many workers are registered in the etcd of host `etcd` (a count-only range read of
 * blade/t/workers/ through etcd's JSON gateway; keys travel as base64). */
static long registered(const fixture *f, int etcd)
{
    char args[320];
    snprintf(args, sizeof args,
             "http://%s:2379/v3/kv/range -d '{\"key\":\"YmxhZGUvdC93b3JrZXJzLw==\",\"range_end\":"
             "\"YmxhZGUvdC93b3JrZXJzMA==\",\"count_only\":true}'",
             f->net.addr[etcd]);
    char *out = ns_curl(&f->net, etcd, args);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    /* int64 fields come as strings; a count of zero is left out */
    const char *count = json_string_value(json_object_get(j, "count"));
    long n = j ? (count ? strtol(count, NULL, 10) : 0) : -1;
    json_decref(j);
    free(out);
    return n;
}

static void wait_registered(const fixture *f, int etcd, long want)
{
    long got = -1;
    for (int t = 0; t < 150 && (got = registered(f, etcd)) != want; t++)
        usleep(100000);
    if (got != want)
        fail_msg("%ld workers registered in etcd after 15 s, not %ld", got, want);
}

static long disaggregated(const fixture *f, int router)
{
    return metric(f, router, router, RPORT, "blade_router:disaggregated_total");
}

enum { E_ROUTER, E_PREFILL, E_DECODE, E_LONE, E_LATE, E_HOSTS };

static void test_etcd_restarted(void **state)
{
    fixture *f = *state;
    begin(f, E_HOSTS, true);
    pid_t router = start_etcd_router(f, E_ROUTER, 30, "faults-e-router.log"), etcd = f->etcd;
    char *log = temp_path("faults-etcd.log");
    start_prefill(f, E_PREFILL, E_ROUTER, NULL, NULL, "faults-e-prefill.log");
    pid_t decode = start_decode(f, E_DECODE, E_ROUTER, NULL, "faults-e-decode.log");
    worker(f, E_LONE, NULL, "", NULL, "faults-e-lone.log");
    for (int i = E_PREFILL; i <= E_LONE; i++)
        ns_wait_healthy(&f->net, i, WPORT);
    wait_healthy(f, E_ROUTER, "prefill", 1);
    wait_healthy(f, E_ROUTER, "decode", 1);
    check_request(f, E_ROUTER, E_LONE, greedy, "etcd up");
    assert_int_equal(disaggregated(f, E_ROUTER), 1);

    /* etcd down: the last view still routes, /health says why it may be stale */
    kill_worker(f, etcd);
    wait_status(f, E_ROUTER, "degraded");
    json_t *h = router_health(f, E_ROUTER), *e = json_object_get(h, "etcd");
    assert_true(json_is_false(json_object_get(e, "current")));
    assert_non_null(json_string_value(json_object_get(e, "reason")));
    json_decref(h);
    check_request(f, E_ROUTER, E_LONE, seeded, "etcd down");
    assert_int_equal(disaggregated(f, E_ROUTER), 2);
    sleep(3); /* past the workers' 2 s lease, which they cannot renew now */

    /* etcd back on its data */
    etcd = ns_etcd(&f->net, E_ROUTER, f->etcd_data, log);
    wait_status(f, E_ROUTER, "ok");
    wait_registered(f, E_ROUTER, 2);
    wait_healthy(f, E_ROUTER, "prefill", 1);
    wait_healthy(f, E_ROUTER, "decode", 1);
    check_request(f, E_ROUTER, E_LONE, seeded_stream, "etcd restarted");
    assert_int_equal(disaggregated(f, E_ROUTER), 3);

    /* etcd back without its data: the workers register again, and the router's view
     * follows the new store: a worker that joins now is used, one that dies now leaves */
    kill_worker(f, etcd);
    remove_tree(f->etcd_data);
    etcd = ns_etcd(&f->net, E_ROUTER, f->etcd_data, log);
    free(log);
    wait_registered(f, E_ROUTER, 2);
    wait_status(f, E_ROUTER, "ok");
    start_decode(f, E_LATE, E_ROUTER, NULL, "faults-e-late.log");
    ns_wait_healthy(&f->net, E_LATE, WPORT);
    wait_registered(f, E_ROUTER, 3);
    kill_worker(f, decode);
    wait_listed(f, E_ROUTER, E_DECODE, false);
    wait_listed(f, E_ROUTER, E_LATE, true);
    wait_healthy(f, E_ROUTER, "decode", 1);
    check_request(f, E_ROUTER, E_LONE, greedy, "etcd restarted without its data");
    assert_int_equal(disaggregated(f, E_ROUTER), 4);
    assert_int_equal(metric(f, E_ROUTER, E_LATE, WPORT, "blade:remote_prefills_total{result=\"ok\"}"), 1);
    expect_outcomes(f, E_ROUTER, 4, 0, 4);
    stop_router(f, router);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_prefill_killed_mid_transfer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_killed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_etcd_restarted, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* `blade serve --role prefill|decode` as separate processes in network namespaces (private
 * addresses, UCX over TCP, a cluster key): completions through the disaggregated pair are
 * bit-identical to a colocated server's, greedy and seeded, streaming and not; every prompt
 * went through the prefill worker; with the prefill worker killed (SIGKILL) the decode
 * worker computes prompts itself and the answers stay identical; a prefill worker refuses
 * to listen beyond loopback without a key. Skips where namespaces cannot be made. */

#include "testutil.h"

#include "cluster_harness.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { PREFILL, DECODE, COLOCATED, N_HOSTS };

static void need_netns(void)
{
    blade_error why = {{0}};
    if (!blade_netns_usable(&why)) {
        note_skipped("disaggregated serving across namespaces not tested: %s", why.msg);
        skip();
    }
}

static pid_t start_server(blade_netns *net, int i, const char *model, const char *extra, const char *log)
{
    char args[2048];
    snprintf(args, sizeof args, "serve -m %s --host %s --port 8080 --kv-mem 64M -t 1 %s", model, net->addr[i], extra);
    pid_t pid = ns_blade(net, i, args, log);
    return pid;
}

static char *complete(const blade_netns *net, int i, const char *body)
{
    return ns_complete(net, i, net->addr[i], 8080, body);
}

static long metric(const blade_netns *net, int i, const char *name)
{
    return ns_metric(net, i, net->addr[i], 8080, name);
}

static const char *const bodies[] = {
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"Once upon a time there was a little girl named Lily. She loved to "
    "play outside in the park with her friends and her dog\",\"max_tokens\":40,\"temperature\":0}",
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"The cat sat\",\"max_tokens\":24,\"temperature\":0.9,\"seed\":11}",
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"Once upon a time there was a little girl named Lily. She loved to "
    "play outside in the park with her friends and her dog. One day\",\"max_tokens\":30,\"temperature\":0.7,"
    "\"top_k\":20,\"seed\":3,\"stream\":true}",
    "{\"model\":\"stories260K.gguf\",\"prompt\":\"A\",\"max_tokens\":5,\"temperature\":1.2,\"seed\":77,"
    "\"repetition_penalty\":1.3}",
};
#define N_BODIES (sizeof bodies / sizeof *bodies)

static void compare_all(const blade_netns *net, const char *what)
{
    for (size_t b = 0; b < N_BODIES; b++) {
        char *want_r = complete(net, COLOCATED, bodies[b]), *got_r = complete(net, DECODE, bodies[b]);
        char *want = completion_text(want_r), *got = completion_text(got_r);
        if (!want[0] || strcmp(want, got))
            fail_msg("%s, request %zu: decode worker said\n  %s\nthe colocated server\n  %s", what, b, got_r, want_r);
        free(want);
        free(got);
        free(want_r);
        free(got_r);
    }
}

static void test_prefill_decode_in_namespaces(void **state)
{
    (void)state;
    need_netns();
    char *model = require_shared("models/stories260K.gguf");
    char *key = temp_path("cluster-serve.key");
    write_file(key, "0123456789abcdef0123456789abcdef\n", 33);
    chmod(key, 0600);
    char *logs[N_HOSTS] = {temp_path("cluster-serve-prefill.log"), temp_path("cluster-serve-decode.log"),
                           temp_path("cluster-serve-both.log")};
    for (int i = 0; i < N_HOSTS; i++)
        unlink(logs[i]);
    blade_netns net;
    blade_error err = {{0}};
    if (blade_netns_create(&net, N_HOSTS, &err))
        fail_msg("%s", err.msg);
    char extra[1024];
    snprintf(extra, sizeof extra, "--role prefill --kv-listen %s:9000 --cluster-key-file %s --kv-transports tcp",
             net.addr[PREFILL], key);
    pid_t prefill = start_server(&net, PREFILL, model, extra, logs[PREFILL]);
    snprintf(extra, sizeof extra, "--role decode --prefill %s:9000 --cluster-key-file %s --kv-transports tcp",
             net.addr[PREFILL], key);
    start_server(&net, DECODE, model, extra, logs[DECODE]);
    start_server(&net, COLOCATED, model, "", logs[COLOCATED]);
    for (int i = 0; i < N_HOSTS; i++)
        ns_wait_healthy(&net, i, 8080);

    compare_all(&net, "disaggregated");
    long ok = metric(&net, DECODE, "blade:remote_prefills_total{result=\"ok\"}");
    long served = metric(&net, PREFILL, "blade:prefill_service_served_total");
    assert_int_equal(ok, (long)N_BODIES);
    assert_int_equal(served, (long)N_BODIES);
    /* request 2 shares request 0's first blocks, which the decode worker held */
    assert_true(metric(&net, PREFILL, "blade:prefill_service_blocks_skipped_total") > 0);

    kill(prefill, SIGKILL);
    blade_netns_wait(&net, prefill, 5000);
    compare_all(&net, "prefill worker killed");
    assert_int_equal(metric(&net, DECODE, "blade:remote_prefills_total{result=\"ok\"}"), ok);
    assert_true(metric(&net, DECODE, "blade:remote_prefills_total{result=\"connect\"}") +
                    metric(&net, DECODE, "blade:remote_prefills_total{result=\"peer\"}") ==
                (long)N_BODIES);
    blade_netns_destroy(&net);
    char *log = read_file(logs[DECODE], NULL);
    assert_non_null(strstr(log, "computing the prompt here"));
    free(log);
    for (int i = 0; i < N_HOSTS; i++)
        free(logs[i]);
    free(key);
    free(model);
}

/* Without a key a prefill worker listens on loopback only; other options are checked
 * against the role. */
static void test_role_refusals(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf");
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "serve -m %s --port 0 --kv-mem 16M -t 1 --role prefill --kv-listen 0.0.0.0:0", model);
    int rc = run_blade_within(60, args, &out, 1);
    assert_int_equal(rc, 1);
    bool named = strstr(out, "key") != NULL;
    if (!named)
        fail_msg("a keyless non-loopback KV listener was not refused for its key: %s", out);
    free(out);
    snprintf(args, sizeof args, "serve -m %s --port 0 --prefill 127.0.0.1:1", model);
    rc = run_blade_within(60, args, &out, 1);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "--prefill is for --role decode"));
    free(out);
    snprintf(args, sizeof args, "serve -m %s --role middle", model);
    rc = run_blade_within(60, args, &out, 1);
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "--role expects"));
    free(out);
    free(model);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_role_refusals),
        cmocka_unit_test(test_prefill_decode_in_namespaces),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The network-namespace harness: hosts reach each other over the bridge and only there,
 * commands run inside a host, everything is removed by destroy, and namespaces left by a
 * run that was killed are cleaned up by the next one. Skips (saying why) where namespaces
 * cannot be made: not root, no iproute2. */

#include "testutil.h"

#include "cluster/netns.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static bool ns_exists(const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "/run/netns/%s", name);
    return access(path, F_OK) == 0;
}

static void need_netns(void)
{
    blade_error why = {{0}};
    if (!blade_netns_usable(&why)) {
        note_skipped("network namespace harness not tested: %s", why.msg);
        skip();
    }
}

/* Host 0 listens on its address; a TCP connection from host 1 carries one byte back. */
static int serve_one(void *arg)
{
    (void)arg;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(7777)};
    inet_pton(AF_INET, "10.77.0.1", &a.sin_addr);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 1))
        return 1;
    int c = accept(fd, NULL, NULL);
    char b = 0;
    return c >= 0 && read(c, &b, 1) == 1 && b == 'x' ? 0 : 2;
}

static int connect_to(const char *addr)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(7777)};
    inet_pton(AF_INET, addr, &a.sin_addr);
    struct timeval tv = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    if (rc == 0 && write(fd, "x", 1) != 1)
        rc = -1;
    close(fd);
    return rc;
}

static int send_one(void *arg)
{
    (void)arg;
    for (int i = 0; i < 50; i++) {
        if (connect_to("10.77.0.1") == 0)
            return 0;
        usleep(20000);
    }
    return 1;
}

/* The run's network, removed by teardown even when an assertion ends the test early. */
static blade_netns net;

static int teardown(void **state)
{
    (void)state;
    blade_netns_destroy(&net);
    return 0;
}

static void test_hosts_reach_each_other(void **state)
{
    (void)state;
    need_netns();
    blade_error err = {{0}};
    if (blade_netns_create(&net, 3, &err))
        fail_msg("%s", err.msg);
    assert_string_equal(net.addr[0], "10.77.0.1");
    assert_string_equal(net.addr[2], "10.77.0.3");
    assert_true(ns_exists(net.hub) && ns_exists(net.name[0]) && ns_exists(net.name[2]));
    pid_t server = blade_netns_spawn(&net, 0, serve_one, NULL, &err);
    pid_t client = blade_netns_spawn(&net, 1, send_one, NULL, &err);
    assert_int_equal(blade_netns_wait(&net, client, 5000), 0);
    assert_int_equal(blade_netns_wait(&net, server, 5000), 0);

    /* A command inside host 2 sees its own address and not ours. */
    char *log = temp_path("netns-ip-addr.log");
    unlink(log);
    char *argv[] = {"ip", "-4", "-o", "addr", "show", "dev", "eth0", NULL};
    pid_t ip = blade_netns_spawn_cmd(&net, 2, argv, log, &err);
    assert_int_equal(blade_netns_wait(&net, ip, 5000), 0);
    char *out = read_file(log, NULL);
    assert_non_null(out);
    assert_non_null(strstr(out, "10.77.0.3/24"));
    free(out);
    unlink(log);
    free(log);

    /* A child still running is killed by destroy, and every namespace goes. */
    pid_t stuck = blade_netns_spawn(&net, 0, serve_one, NULL, &err);
    assert_true(stuck > 0);
    char names[4][64];
    snprintf(names[0], 64, "%s", net.hub);
    for (int i = 0; i < 3; i++)
        snprintf(names[i + 1], 64, "%s", net.name[i]);
    blade_netns_destroy(&net);
    for (int i = 0; i < 4; i++)
        assert_false(ns_exists(names[i]));
}

/* Namespaces named for a process that no longer exists are removed at the next creation;
 * those of a live process are left alone. */
static void test_stale_cleanup(void **state)
{
    (void)state;
    need_netns();
    /* A pid above pid_max's default range belongs to nobody. */
    const char *stale = "bladens-4999999-0-hub";
    char live[64];
    snprintf(live, sizeof live, "bladens-%d-999-hub", (int)getpid());
    char cmd[160];
    snprintf(cmd, sizeof cmd, "ip netns add %s && ip netns add %s", stale, live);
    assert_int_equal(system(cmd), 0);
    assert_true(blade_netns_cleanup_stale() >= 1);
    assert_false(ns_exists(stale));
    assert_true(ns_exists(live));
    snprintf(cmd, sizeof cmd, "ip netns del %s", live);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_hosts_reach_each_other, teardown),
        cmocka_unit_test(test_stale_cleanup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

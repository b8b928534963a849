/* Helpers for tests of blade processes in network namespaces (cluster_harness.h). */

#include "cluster_harness.h"

#include "etcd_server.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char *ns_curl(const blade_netns *net, int i, const char *args)
{
    size_t cap = strlen(args) + 256;
    char *cmd = malloc(cap), *out = NULL;
    snprintf(cmd, cap, "ip netns exec %s curl -s --max-time 60 %s", net->name[i], args);
    run_command(cmd, &out);
    free(cmd);
    return out ? out : strdup("");
}

void ns_wait_healthy(const blade_netns *net, int i, int port)
{
    char args[160];
    snprintf(args, sizeof args, "-o /dev/null -w '%%{http_code}' http://%s:%d/health", net->addr[i], port);
    for (int t = 0; t < 300; t++) {
        char *code = ns_curl(net, i, args);
        bool ok = !strcmp(code, "200");
        free(code);
        if (ok)
            return;
        usleep(100000);
    }
    fail_msg("the server in host %d did not become healthy", i);
}

pid_t ns_blade(blade_netns *net, int i, const char *args, const char *log)
{
    char *argv[64], *line = malloc(strlen(args) + strlen(BLADE_BINARY) + 2);
    sprintf(line, "%s %s", BLADE_BINARY, args);
    int n = 0;
    for (char *tok = strtok(line, " "); tok && n < 63; tok = strtok(NULL, " "))
        argv[n++] = tok;
    argv[n] = NULL;
    blade_error err = {{0}};
    pid_t pid = blade_netns_spawn_cmd(net, i, argv, log, &err);
    free(line);
    if (pid < 0)
        fail_msg("%s", err.msg);
    return pid;
}

char *ns_complete(const blade_netns *net, int from, const char *host, int port, const char *body)
{
    size_t cap = strlen(body) + 256;
    char *args = malloc(cap);
    snprintf(args, cap, "-N http://%s:%d/v1/completions -H 'Content-Type: application/json' -d '%s'", host, port,
             body);
    char *out = ns_curl(net, from, args);
    free(args);
    return out;
}

pid_t ns_complete_bg(blade_netns *net, int from, const char *host, int port, const char *body, const char *out_path)
{
    char url[128];
    snprintf(url, sizeof url, "http://%s:%d/v1/completions", host, port);
    char *argv[] = {"curl", "-s", "-N", "--max-time", "60", "-H", "Content-Type: application/json", "-d", (char *)body,
                    url, NULL};
    blade_error err = {{0}};
    unlink(out_path);
    pid_t pid = blade_netns_spawn_cmd(net, from, argv, out_path, &err);
    if (pid < 0)
        fail_msg("%s", err.msg);
    return pid;
}

pid_t ns_etcd(blade_netns *net, int i, const char *data_dir, const char *log)
{
    char client[64], peer[64], cluster[96], health[96];
    snprintf(client, sizeof client, "http://%s:2379", net->addr[i]);
    snprintf(peer, sizeof peer, "http://%s:2380", net->addr[i]);
    snprintf(cluster, sizeof cluster, "t=%s", peer);
    /* short raft timers: a single member elects itself at once and leases can be short */
    char *argv[] = {(char *)etcd_binary(), "--name", "t", "--data-dir", (char *)data_dir, "--listen-client-urls",
                    client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                    "--initial-advertise-peer-urls", peer, "--initial-cluster", cluster, "--heartbeat-interval", "50",
                    "--election-timeout", "250", NULL};
    blade_error err = {{0}};
    pid_t pid = blade_netns_spawn_cmd(net, i, argv, log, &err);
    if (pid < 0)
        fail_msg("%s", err.msg);
    snprintf(health, sizeof health, "%s/health", client);
    for (int t = 0; t < 100; t++) {
        char *h = ns_curl(net, i, health);
        bool up = strstr(h, "true") != NULL;
        free(h);
        if (up)
            return pid;
        usleep(100000);
    }
    fail_msg("etcd in host %d did not answer within 10 s (log: %s)", i, log);
    return -1;
}

long ns_metric(const blade_netns *net, int from, const char *host, int port, const char *sample)
{
    char args[160], line[256];
    snprintf(args, sizeof args, "http://%s:%d/metrics", host, port);
    char *m = ns_curl(net, from, args);
    snprintf(line, sizeof line, "\n%s ", sample); /* a sample, not its # HELP line */
    const char *p = strstr(m, line);
    long v = p ? strtol(p + strlen(line), NULL, 10) : -1;
    free(m);
    return v;
}

char *completion_text(const char *resp)
{
    size_t n = 0;
    char *out = calloc(strlen(resp) + 1, 1);
    for (const char *p = resp; (p = strstr(p, "\"text\":\"")) != NULL;) {
        p += 8;
        while (*p && !(*p == '"' && p[-1] != '\\'))
            out[n++] = *p++;
        out[n++] = '|';
    }
    const char *f = strstr(resp, "\"finish_reason\":\"");
    if (f)
        for (f += 17; *f && *f != '"';)
            out[n++] = *f++;
    return out;
}

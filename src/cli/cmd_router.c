/* `blade router`: the cluster's OpenAI front door (src/router/router.h). */

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "router/router.h"

#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void router_usage(FILE *out)
{
    fprintf(out,
            "usage: blade router --listen HOST:PORT (--workers URL,... | --etcd URL --cluster NAME) [options]\n\n"
            "The OpenAI front door of a cluster of `blade serve` workers: POST /v1/completions and\n"
            "/v1/chat/completions (streaming or not) go to the worker holding the prompt's first blocks\n"
            "(prefix-cache aware) unless it is busier than the least loaded by more than --slack; `both`\n"
            "workers first, else a decode worker with a prefill worker of the same KV fingerprint (the\n"
            "decode worker is told which with X-Blade-Prefill). Workers' answers and error objects are\n"
            "relayed unchanged; a worker that fails before answering is replaced (3 tries). GET /health\n"
            "lists the workers, GET /metrics counts requests by how they ended.\n\n"
            "      --listen HOST:PORT   where clients connect (default 127.0.0.1:8080)\n"
            "      --workers URL,...    the workers' base URLs (http://HOST:PORT)\n"
            "      --etcd URL,...       or: etcd endpoints, workers registered by `blade serve --etcd`\n"
            "      --cluster NAME       the cluster's key prefix in etcd (blade/NAME/workers/)\n"
            "      --policy P           cache-aware (default) or round-robin (for comparison)\n"
            "      --block-tokens N     tokens per routing block (default 16, the KV block size)\n"
            "      --slack N            load (running + waiting + in flight) a prefix holder may exceed\n"
            "                           the least loaded worker's by and still be chosen (default 4)\n"
            "  -h, --help               this help\n");
}

int cmd_router(int argc, char **argv)
{
    enum { O_LISTEN = 256, O_WORKERS, O_ETCD, O_CLUSTER, O_POLICY, O_BLOCK, O_SLACK };
    static const struct option opts[] = {
        {"listen", required_argument, 0, O_LISTEN}, {"workers", required_argument, 0, O_WORKERS},
        {"etcd", required_argument, 0, O_ETCD},     {"cluster", required_argument, 0, O_CLUSTER},
        {"policy", required_argument, 0, O_POLICY}, {"block-tokens", required_argument, 0, O_BLOCK},
        {"slack", required_argument, 0, O_SLACK},   {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    router_config rc = {.host = "127.0.0.1", .port = 8080};
    char host[256] = "127.0.0.1";
    long long n;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case O_LISTEN: {
            const char *colon = strrchr(optarg, ':');
            size_t hl = colon ? (size_t)(colon - optarg) : 0;
            if (hl >= 2 && optarg[0] == '[' && optarg[hl - 1] == ']') {
                optarg++;
                hl -= 2;
            }
            if (!colon || hl >= sizeof host || !cli_parse_int("--listen port", colon + 1, 0, 65535, &n))
                return 2;
            memcpy(host, optarg, hl);
            host[hl] = 0;
            if (!hl)
                snprintf(host, sizeof host, "0.0.0.0");
            rc.port = (int)n;
            break;
        }
        case O_WORKERS: rc.pool.workers = optarg; break;
        case O_ETCD: rc.pool.etcd = optarg; break;
        case O_CLUSTER: rc.pool.cluster = optarg; break;
        case O_POLICY:
            if (!strcmp(optarg, "cache-aware"))
                rc.pool.policy = POLICY_CACHE_AWARE;
            else if (!strcmp(optarg, "round-robin"))
                rc.pool.policy = POLICY_ROUND_ROBIN;
            else {
                fprintf(stderr, "error: --policy expects cache-aware or round-robin, got '%s'\n", optarg);
                return 2;
            }
            break;
        case O_BLOCK:
            if (!cli_parse_int("--block-tokens", optarg, 1, 4096, &n))
                return 2;
            rc.pool.block_tokens = (int)n;
            break;
        case O_SLACK:
            if (!cli_parse_int("--slack", optarg, 0, 1 << 20, &n))
                return 2;
            rc.pool.slack = (int)n;
            break;
        case 'h': router_usage(stdout); return 0;
        default: router_usage(stderr); return 2;
        }
    }
    if (!rc.pool.workers == !rc.pool.etcd || (rc.pool.etcd && !rc.pool.cluster)) {
        fprintf(stderr, "error: give --workers, or --etcd with --cluster\n");
        return 2;
    }
    rc.host = host;
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    blade_error err = {{0}};
    router *r = router_start(&rc, &err);
    if (!r) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    printf("blade router: listening on http://%s:%d; workers from %s; policy %s\n", host, router_port(r),
           rc.pool.workers ? "--workers" : "etcd", rc.pool.policy == POLICY_ROUND_ROBIN ? "round-robin" : "cache-aware");
    fflush(stdout);
    int sig;
    sigwait(&sigs, &sig);
    router_stop(r);
    printf("blade router: stopped\n");
    return 0;
}

/* `blade router`: the cluster's OpenAI front door (src/router/router.h). */

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "router/router.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct router_options {
    const char *listen;
    pool_config pool;
} router_options;

static void router_init(void *opts)
{
    router_options *o = opts;
    o->listen = "127.0.0.1:8080";
    o->pool.block_tokens = 16;
    o->pool.slack = 4;
}

static const cli_choice policy_choices[] = {
    {"cache-aware", POLICY_CACHE_AWARE}, {"round-robin", POLICY_ROUND_ROBIN}, {NULL, 0}};

#define O router_options
static const cli_flag router_flags[] = {
    {.name = "listen", .kind = CLI_STRING, CLI_AT(O, listen), .metavar = "HOST:PORT", .help = "where clients connect"},
    {.name = "workers", .kind = CLI_STRING, CLI_AT(O, pool.workers), .metavar = "URL,...",
     .help = "the workers' base URLs (http://HOST:PORT)"},
    {.name = "etcd", .kind = CLI_STRING, CLI_AT(O, pool.etcd), .metavar = "URL,...",
     .help = "or: etcd endpoints, workers registered by `blade serve --etcd`"},
    {.name = "cluster", .kind = CLI_STRING, CLI_AT(O, pool.cluster), .metavar = "NAME",
     .help = "the cluster's key prefix in etcd (blade/NAME/workers/)"},
    {.name = "policy", .kind = CLI_ENUM, CLI_AT(O, pool.policy_choice), .choices = policy_choices, .metavar = "P",
     .help = "cache-aware, or round-robin (the baseline it is measured against)"},
    {.name = "block-tokens", .kind = CLI_INT, CLI_AT(O, pool.block_tokens), .min = 1, .max = 4096, .metavar = "N",
     .help = "tokens per routing block (the KV block size)"},
    {.name = "slack", .kind = CLI_INT, CLI_AT(O, pool.slack), .min = 0, .max = 1 << 20, .metavar = "N",
     .help = "load (running + waiting + in flight) a prefix holder may exceed the least loaded worker's by and "
             "still be chosen"},
    {0},
};
#undef O

static int router_main(int argc, char **argv);

const cli_command cli_cmd_router = {
    .name = "router",
    .summary = "the OpenAI front door of a cluster: cache- and load-aware routing to workers",
    .synopsis = "--listen HOST:PORT (--workers URL,... | --etcd URL --cluster NAME) [options]",
    .about = "The OpenAI front door of a cluster of `blade serve` workers: POST /v1/completions and\n"
             "/v1/chat/completions (streaming or not) go to the worker holding the prompt's first blocks\n"
             "(prefix-cache aware) unless it is busier than the least loaded by more than --slack; `both`\n"
             "workers first, else a decode worker with a prefill worker of the same KV fingerprint (the\n"
             "decode worker is told which with X-Blade-Prefill). Workers' answers and error objects are\n"
             "relayed unchanged; a worker that fails before answering is replaced (3 tries). GET /health\n"
             "lists the workers, GET /metrics counts requests by how they ended.\n",
    .tables = (const cli_table[]){{router_flags, 0}, {0}},
    .opts_size = sizeof(router_options),
    .init = router_init,
    .main = router_main,
};

static int router_main(int argc, char **argv)
{
    router_options o;
    int prc = cli_parse(&cli_cmd_router, argc, argv, &o);
    if (prc != CLI_RUN)
        return prc;
    router_config rc = {.pool = o.pool};
    rc.pool.policy = (pool_policy)o.pool.policy_choice;
    char host[256];
    long long n;
    const char *l = o.listen, *colon = strrchr(l, ':');
    size_t hl = colon ? (size_t)(colon - l) : 0;
    if (hl >= 2 && l[0] == '[' && l[hl - 1] == ']') {
        l++;
        hl -= 2;
    }
    if (!colon || hl >= sizeof host || !cli_int_in(colon + 1, 0, 65535, &n))
        return cli_usage_error(&cli_cmd_router, "--listen expects HOST:PORT, got '%s'", o.listen);
    memcpy(host, l, hl);
    host[hl] = 0;
    if (!hl)
        snprintf(host, sizeof host, "0.0.0.0");
    rc.port = (int)n;
    if (!rc.pool.workers == !rc.pool.etcd || (rc.pool.etcd && !rc.pool.cluster)) {
        return cli_usage_error(&cli_cmd_router, "give --workers, or --etcd with --cluster");
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

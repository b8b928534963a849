#include "api/api.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"
#include "cli/serve_role.h"
#include "server/server.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void serve_usage(FILE *out)
{
    fprintf(out,
            "usage: blade serve -m MODEL [options]\n\n"
            "An OpenAI-compatible HTTP server: POST /v1/completions, POST /v1/chat/completions (both with\n"
            "\"stream\": true for Server-Sent Events), GET /v1/models, GET /health (503 while loading or\n"
            "draining) and GET /metrics (Prometheus). SIGTERM or SIGINT drains: new requests get 503,\n"
            "in-flight ones finish (up to --drain-timeout), then the server exits with status 0.\n\n"
            "  -m, --model FILE         GGUF model\n"
            "      --host ADDR          address to listen on (default 127.0.0.1: this machine only)\n"
            "      --port N             TCP port; 0 picks a free one (default 8080)\n"
            "      --api-key KEY        require 'Authorization: Bearer KEY' on /v1/* (/health and\n"
            "                           /metrics stay open; default: the BLADE_API_KEY environment\n"
            "                           variable, else no key)\n"
            "      --alias NAME         model id to report and accept (also accepted: the file's name)\n"
            "      --chat-template FILE Jinja chat template (default: the model's tokenizer.chat_template)\n"
            "      --max-body SIZE      largest request body, bytes with K/M suffix (default 8M)\n"
            "      --max-queue N        requests waiting to start before 429 (default 256)\n"
            "      --timeout SECONDS    longest a request may take in all, 0 = no limit (default 600)\n"
            "      --drain-timeout SECONDS  time in-flight requests get on shutdown (default 30)\n"
            "      --max-connections N  open connections, idle keep-alive ones included; one thread\n"
            "                           each (default 1024). As many more may be sending their first\n"
            "                           request head, without a thread; when those are full, the\n"
            "                           oldest of the address holding the most is closed for a\n"
            "                           newcomer. 16 more are kept for GET /health and /metrics\n"
            "      --max-connections-per-ip N  connections one client address (IPv6: one /64) may\n"
            "                           hold open, and as many still sending their head (a new one\n"
            "                           replaces its oldest); past it, 503. 0 = no cap (default 256;\n"
            "                           loopback clients are exempt unless --limit-loopback)\n"
            "      --limit-loopback     apply --max-connections-per-ip to loopback clients too (by\n"
            "                           default they are exempt: with the default --host every client\n"
            "                           is loopback, and so is a reverse proxy on this machine)\n"
            "      --idle-timeout SECONDS  close a keep-alive connection after this long without\n"
            "                           traffic; an upload that stalls this long gets 408; while its\n"
            "                           request generates, only --timeout applies (default 15)\n"
            "      --header-timeout SECONDS  a request head must be complete this long after the\n"
            "                           connection opens (for a later request on a keep-alive\n"
            "                           connection: after the previous answer plus --idle-timeout);\n"
            "                           bytes that trickle in do not extend it; else 408 (default 10)\n"
            "      --body-timeout SECONDS  a request body must be complete this long after its head,\n"
            "                           else 408 (default 60)\n"
            "  -h, --help               this help\n\n"
            "request limits: n <= %d; stop: at most %d strings of 1..%d bytes; completions logprobs 0..%d,\n"
            "chat top_logprobs 0..%d; at most %d prompts and %d choices per request; prompt + max_tokens\n"
            "within the context. Extensions: top_k, min_p, repetition_penalty, ignore_eos, priority\n"
            "(\"interactive\" or \"batch\"), cache_salt.\n\n",
            API_MAX_N, API_MAX_STOP, API_MAX_STOP_BYTES, API_MAX_LOGPROBS, API_MAX_TOP_LOGPROBS, API_MAX_PROMPTS,
            API_MAX_CHOICES);
    serve_role_usage(out);
    cli_engine_usage(out);
}

enum {
    OPT_HOST = 256,
    OPT_PORT,
    OPT_API_KEY,
    OPT_ALIAS,
    OPT_TEMPLATE,
    OPT_MAX_BODY,
    OPT_MAX_QUEUE,
    OPT_TIMEOUT,
    OPT_DRAIN,
    OPT_MAX_CONN,
    OPT_MAX_CONN_IP,
    OPT_LIMIT_LOOPBACK,
    OPT_IDLE,
    OPT_HEADER_TIMEOUT,
    OPT_BODY_TIMEOUT,
};

static bool parse_size(const char *flag, const char *s, size_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    double unit = 1;
    switch (toupper((unsigned char)*end)) {
    case 0: break;
    case 'K': unit = 1024.0; end++; break;
    case 'M': unit = 1024.0 * 1024; end++; break;
    case 'G': unit = 1024.0 * 1024 * 1024; end++; break;
    default: end = (char *)"?"; break;
    }
    if (*end == 'B' || *end == 'b')
        end++;
    if (errno || end == s || *end || !(v >= 1) || v * unit > 1024.0 * 1024 * 1024) {
        fprintf(stderr, "error: %s expects a size from 1 byte to 1G (e.g. 8M), got '%s'\n", flag, s);
        return false;
    }
    *out = (size_t)(v * unit);
    return true;
}

int cmd_serve(int argc, char **argv)
{
    static const struct option own[] = {
        {"model", required_argument, 0, 'm'},
        {"host", required_argument, 0, OPT_HOST},
        {"port", required_argument, 0, OPT_PORT},
        {"api-key", required_argument, 0, OPT_API_KEY},
        {"alias", required_argument, 0, OPT_ALIAS},
        {"chat-template", required_argument, 0, OPT_TEMPLATE},
        {"max-body", required_argument, 0, OPT_MAX_BODY},
        {"max-queue", required_argument, 0, OPT_MAX_QUEUE},
        {"timeout", required_argument, 0, OPT_TIMEOUT},
        {"drain-timeout", required_argument, 0, OPT_DRAIN},
        {"max-connections", required_argument, 0, OPT_MAX_CONN},
        {"max-connections-per-ip", required_argument, 0, OPT_MAX_CONN_IP},
        {"limit-loopback", no_argument, 0, OPT_LIMIT_LOOPBACK},
        {"idle-timeout", required_argument, 0, OPT_IDLE},
        {"header-timeout", required_argument, 0, OPT_HEADER_TIMEOUT},
        {"body-timeout", required_argument, 0, OPT_BODY_TIMEOUT},
        {"help", no_argument, 0, 'h'},
    };
    const size_t n_own = sizeof own / sizeof own[0];
    struct option *own_all = malloc((n_own + serve_role_longopts_count) * sizeof *own_all);
    if (!own_all)
        return 1;
    memcpy(own_all, own, sizeof own);
    memcpy(own_all + n_own, serve_role_longopts, serve_role_longopts_count * sizeof *own_all);
    struct option *longopts = cli_merge_longopts(own_all, n_own + serve_role_longopts_count);
    free(own_all);
    if (!longopts)
        return 1;
    serve_role_options ro;
    serve_role_init(&ro);
    cli_engine_options eo;
    cli_engine_options_init(&eo);
    server_config sc = {.host = "127.0.0.1", .port = 8080, .api_key = getenv("BLADE_API_KEY"),
                        .max_body = 8u << 20, .max_queue = 256, .timeout = 600, .drain_timeout = 30,
                        .max_connections = 1024, .idle_timeout = 15, .max_connections_per_ip = 256,
                        .header_timeout = 10, .body_timeout = 60};
    if (sc.api_key && !*sc.api_key)
        sc.api_key = NULL;
    const char *model_path = NULL, *alias = NULL, *template_file = NULL;
    long long n;
    double x;
    int c, rc = 2;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:t:c:h", longopts, NULL)) != -1) {
        int handled = cli_engine_option(&eo, c, optarg);
        if (!handled)
            handled = serve_role_option(&ro, c, optarg);
        if (handled < 0)
            goto out;
        if (handled)
            continue;
        switch (c) {
        case 'm': model_path = optarg; break;
        case OPT_HOST: sc.host = optarg; break;
        case OPT_PORT:
            if (!cli_parse_int("--port", optarg, 0, 65535, &n))
                goto out;
            sc.port = (int)n;
            break;
        case OPT_API_KEY:
            if (!*optarg) {
                fprintf(stderr, "error: --api-key is empty\n");
                goto out;
            }
            sc.api_key = optarg;
            break;
        case OPT_ALIAS: alias = optarg; break;
        case OPT_TEMPLATE: template_file = optarg; break;
        case OPT_MAX_BODY:
            if (!parse_size("--max-body", optarg, &sc.max_body))
                goto out;
            break;
        case OPT_MAX_QUEUE:
            if (!cli_parse_int("--max-queue", optarg, 1, 1 << 20, &n))
                goto out;
            sc.max_queue = (int)n;
            break;
        case OPT_TIMEOUT:
            if (!cli_parse_float("--timeout", optarg, 0, 1e7, &x))
                goto out;
            sc.timeout = x;
            break;
        case OPT_DRAIN:
            if (!cli_parse_float("--drain-timeout", optarg, 0, 1e7, &x))
                goto out;
            sc.drain_timeout = x;
            break;
        case OPT_MAX_CONN:
            if (!cli_parse_int("--max-connections", optarg, 1, 65536, &n))
                goto out;
            sc.max_connections = (int)n;
            break;
        case OPT_MAX_CONN_IP:
            if (!cli_parse_int("--max-connections-per-ip", optarg, 0, 65536, &n))
                goto out;
            sc.max_connections_per_ip = (int)n;
            break;
        case OPT_LIMIT_LOOPBACK: sc.limit_loopback = true; break;
        case OPT_IDLE:
            if (!cli_parse_int("--idle-timeout", optarg, 1, 86400, &n))
                goto out;
            sc.idle_timeout = (int)n;
            break;
        case OPT_HEADER_TIMEOUT:
            if (!cli_parse_float("--header-timeout", optarg, 0.05, 86400, &x))
                goto out;
            sc.header_timeout = x;
            break;
        case OPT_BODY_TIMEOUT:
            if (!cli_parse_float("--body-timeout", optarg, 0.05, 86400, &x))
                goto out;
            sc.body_timeout = x;
            break;
        case 'h': serve_usage(stdout); rc = 0; goto out;
        default: serve_usage(stderr); goto out;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s'\n", argv[optind]);
        goto out;
    }
    if (!model_path && !(model_path = cli_default_model())) {
        fprintf(stderr, "error: no model given (-m FILE)\n");
        goto out;
    }

    if (serve_role_prepare(&ro, &sc))
        goto out;

    /* Every thread started from here on inherits this mask, so the signals reach only the
     * sigwait below, never a connection or engine thread in the middle of its work. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    /* a socket per connection, as many again for heads still arriving, and the probe slots */
    long long fds = cli_raise_fd_limit(), want = 2LL * sc.max_connections + 128;
    if (fds >= 0 && fds < want)
        fprintf(stderr,
                "warning: the open-file limit is %lld, below the %lld that --max-connections %d needs; raise it "
                "(ulimit -n) or lower --max-connections\n",
                fds, want, sc.max_connections);

    rc = 1;
    blade_error err = {{0}};
    server *srv = server_start(&sc, &err);
    if (!srv) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto out;
    }
    bool v6 = strchr(sc.host, ':') != NULL;
    printf("blade serve: listening on http://%s%s%s:%d (loading %s)\n", v6 ? "[" : "", sc.host, v6 ? "]" : "",
           server_port(srv), model_path);
    fflush(stdout);

    blade_model *m = blade_model_load(model_path, &err);
    blade_engine *e = NULL;
    api_model am = {0};
    bool have_am = false;
    if (!m)
        goto stop;
    cli_engine_finalize(&eo, m);
    if (!(e = blade_engine_new(m, &eo.cfg, &err)))
        goto stop;
    if (api_model_init(&am, e, model_path, alias, template_file, &err))
        goto stop;
    have_am = true;
    cli_engine_describe(stdout, &eo, e);
    if (cli_engine_pin_prefix(&eo, e)) {
        err.msg[0] = 0;
        goto stop;
    }
    printf("model: %s; chat: %s\n", am.names[0], am.chat_template ? "on" : "off (no usable chat template)");
    if (!am.chat_template)
        printf("  %s\n", am.chat_template_error);
    printf("auth: %s; limits: body %zu bytes, queue %d, timeout %g s, drain %g s, %d connections idle for at "
           "most %d s\n",
           sc.api_key ? "API key required" : "none", sc.max_body, sc.max_queue, sc.timeout, sc.drain_timeout,
           sc.max_connections, sc.idle_timeout);
    char per_ip[64] = "none";
    if (sc.max_connections_per_ip)
        snprintf(per_ip, sizeof per_ip, "%d%s", sc.max_connections_per_ip,
                 sc.limit_loopback ? "" : " (loopback exempt)");
    printf("connections: head within %g s, body within %g s, per address %s\n", sc.header_timeout,
           sc.body_timeout, per_ip);
    if (serve_role_start(&ro, e, srv, &sc, &err))
        goto stop;
    server_set_model(srv, &am);
    printf("blade serve: ready\n");
    fflush(stdout);

    int sig = 0;
    sigwait(&sigs, &sig);
    printf("blade serve: %s received, draining (up to %g s)\n", sig == SIGINT ? "SIGINT" : "SIGTERM",
           sc.drain_timeout);
    fflush(stdout);
    server_drain(srv);
    rc = 0;
stop:
    if (rc && err.msg[0])
        fprintf(stderr, "error: %s\n", err.msg);
    server_stop(srv);
    serve_role_stop(&ro);
    blade_engine_free(e, false);
    if (have_am)
        api_model_destroy(&am);
    blade_model_free(m);
    if (!rc) {
        printf("blade serve: stopped\n");
        fflush(stdout);
    }
out:
    blade_cluster_key_wipe(&ro.key);
    free(longopts);
    return rc;
}

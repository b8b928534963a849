/* `blade serve`: the OpenAI-compatible HTTP server around one engine. */

#include "api/api.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"
#include "cli/serve_role.h"
#include "cli/serve_cache.h"
#include "server/server.h"

#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct serve_options {
    const char *model_path, *alias, *template_file;
    server_config sc;
    cli_serve_cache cache;
    cli_engine_options engine;
    serve_role_options role;
} serve_options;

static void serve_init(void *opts)
{
    serve_options *o = opts;
    o->sc = (server_config){.host = "127.0.0.1", .port = 8080, .max_body = 8u << 20, .max_queue = 256,
                            .timeout = 600, .drain_timeout = 30, .max_connections = 1024, .idle_timeout = 15,
                            .max_connections_per_ip = 256, .header_timeout = 10, .body_timeout = 60};
    cli_serve_cache_init(&o->cache);
    cli_engine_options_init(&o->engine);
    serve_role_init(&o->role);
}

#define S serve_options
static const cli_flag serve_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(S, model_path), .metavar = "FILE",
     .dflt = "../shared/models/stories260K.gguf if present", .help = "GGUF model"},
    {.name = "host", .kind = CLI_STRING, CLI_AT(S, sc.host), .metavar = "ADDR",
     .help = "address to listen on; 127.0.0.1 is this machine only"},
    {.name = "port", .kind = CLI_INT, CLI_AT(S, sc.port), .min = 0, .max = 65535, .metavar = "N",
     .help = "TCP port; 0 picks a free one"},
    {.name = "api-key", .kind = CLI_STRING, CLI_AT(S, sc.api_key), .metavar = "KEY",
     .dflt = "the BLADE_API_KEY environment variable, else no key",
     .help = "require 'Authorization: Bearer KEY' on /v1/* (/health and /metrics stay open)"},
    {.name = "alias", .kind = CLI_STRING, CLI_AT(S, alias), .metavar = "NAME",
     .help = "model id to report and accept (also accepted: the file's name)"},
    {.name = "chat-template", .kind = CLI_PATH, CLI_AT(S, template_file), .metavar = "FILE",
     .dflt = "the model's tokenizer.chat_template", .help = "Jinja chat template"},
    CLI_SECTION("limits"),
    {.name = "max-body", .kind = CLI_SIZE, CLI_AT(S, sc.max_body), .min = 1, .max = 1 << 30, .metavar = "SIZE",
     .help = "largest request body, bytes with a K/M suffix"},
    {.name = "max-queue", .kind = CLI_INT, CLI_AT(S, sc.max_queue), .min = 1, .max = 1 << 20, .metavar = "N",
     .help = "requests waiting to start before 429"},
    {.name = "timeout", .kind = CLI_DOUBLE, CLI_AT(S, sc.timeout), .min = 0, .max = 1e7, .metavar = "SECONDS",
     .help = "longest a request may take in all; 0 = no limit"},
    {.name = "drain-timeout", .kind = CLI_DOUBLE, CLI_AT(S, sc.drain_timeout), .min = 0, .max = 1e7,
     .metavar = "SECONDS", .help = "time in-flight requests get on shutdown"},
    CLI_SECTION("connections"),
    {.name = "max-connections", .kind = CLI_INT, CLI_AT(S, sc.max_connections), .min = 1, .max = 65536,
     .metavar = "N",
     .help = "open connections, idle keep-alive ones included; one thread each. As many more may be sending "
             "their first request head, without a thread; when those are full, the oldest of the address "
             "holding the most is closed for a newcomer. 16 more are kept for GET /health and /metrics"},
    {.name = "max-connections-per-ip", .kind = CLI_INT, CLI_AT(S, sc.max_connections_per_ip), .min = 0,
     .max = 65536, .metavar = "N",
     .help = "connections one client address (IPv6: one /64) may hold open, and as many still sending their "
             "head (a new one replaces its oldest); past it, 503. 0 = no cap. Loopback clients are exempt "
             "unless --limit-loopback"},
    {.name = "limit-loopback", .kind = CLI_BOOL, CLI_AT(S, sc.limit_loopback),
     .help = "apply --max-connections-per-ip to loopback clients too (by default they are exempt: with the "
             "default --host every client is loopback, and so is a reverse proxy on this machine)"},
    {.name = "idle-timeout", .kind = CLI_INT, CLI_AT(S, sc.idle_timeout), .min = 1, .max = 86400,
     .metavar = "SECONDS",
     .help = "close a keep-alive connection after this long without traffic; an upload that stalls this long "
             "gets 408; while its request generates, only --timeout applies"},
    {.name = "header-timeout", .kind = CLI_DOUBLE, CLI_AT(S, sc.header_timeout), .min = 0.05, .max = 86400,
     .metavar = "SECONDS",
     .help = "a request head must be complete this long after the connection opens (for a later request on a "
             "keep-alive connection: after the previous answer plus --idle-timeout); bytes that trickle in do "
             "not extend it; else 408"},
    {.name = "body-timeout", .kind = CLI_DOUBLE, CLI_AT(S, sc.body_timeout), .min = 0.05, .max = 86400,
     .metavar = "SECONDS", .help = "a request body must be complete this long after its head, else 408"},
    {0},
};
#undef S

static void serve_epilogue(FILE *out)
{
    fprintf(out,
            "request limits: n <= %d; stop: at most %d strings of 1..%d bytes; completions logprobs 0..%d,\n"
            "chat top_logprobs 0..%d; at most %d prompts and %d choices per request; prompt + max_tokens\n"
            "within the context. Extensions: top_k, min_p, repetition_penalty, ignore_eos, priority\n"
            "(\"interactive\" or \"batch\"), cache_salt, semantic_cache. Embeddings: at most %d inputs.\n",
            API_MAX_N, API_MAX_STOP, API_MAX_STOP_BYTES, API_MAX_LOGPROBS, API_MAX_TOP_LOGPROBS, API_MAX_PROMPTS,
            API_MAX_CHOICES, API_MAX_EMBED_INPUTS);
}

static int serve_main(int argc, char **argv);

const cli_command cli_cmd_serve = {
    .name = "serve",
    .summary = "serve the OpenAI API over HTTP (completions, chat, streaming, metrics)",
    .synopsis = "-m MODEL [options]",
    .about = "An OpenAI-compatible HTTP server: POST /v1/completions, POST /v1/chat/completions (both with\n"
             "\"stream\": true for Server-Sent Events), POST /v1/embeddings, GET /v1/models, GET /health (503\n"
             "while loading or draining) and GET /metrics (Prometheus). SIGTERM or SIGINT drains: new requests\n"
             "get 503, in-flight ones finish (up to --drain-timeout), then the server exits with status 0.\n",
    .tables = (const cli_table[]){{serve_flags, 0},
                                  {cli_serve_cache_flags, offsetof(serve_options, cache)},
                                  {cli_engine_flags, offsetof(serve_options, engine)},
                                  {serve_role_flags, offsetof(serve_options, role)},
                                  {0}},
    .opts_size = sizeof(serve_options),
    .init = serve_init,
    .epilogue = serve_epilogue,
    .main = serve_main,
};

static int serve_main(int argc, char **argv)
{
    serve_options o;
    int rc = cli_parse(&cli_cmd_serve, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    server_config sc = o.sc;
    cli_engine_options eo = o.engine;
    const char *model_path = o.model_path, *alias = o.alias, *template_file = o.template_file;
    if (!sc.api_key && (sc.api_key = getenv("BLADE_API_KEY")) && !*sc.api_key)
        sc.api_key = NULL;
    if (!model_path && !(model_path = cli_default_model()))
        return cli_usage_error(&cli_cmd_serve, "no model given (-m FILE)");
    serve_role_options *ro = &o.role;
    if (serve_role_prepare(ro, &sc)) {
        serve_role_stop(ro);
        return 2;
    }

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
        serve_role_stop(ro);
        return 1;
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
    if (cli_serve_cache_start(&o.cache, &am, &eo, &err))
        goto stop;
    server_set_semantic_cache(srv, o.cache.cache);
    cli_engine_describe(stdout, &eo, e);
    cli_serve_cache_describe(stdout, &o.cache, &am);
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
    if (serve_role_start(ro, e, srv, &sc, &err))
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
    serve_role_stop(ro);
    cli_serve_cache_stop(&o.cache);
    blade_engine_free(e, false);
    if (have_am)
        api_model_destroy(&am);
    blade_model_free(m);
    if (!rc) {
        printf("blade serve: stopped\n");
        fflush(stdout);
    }
    return rc;
}

/* The cluster worker flags of `blade serve` (serve_role.h). */

#include "cli/serve_role.h"

#include "cli/cli_util.h"

#include <string.h>

enum { OPT_ROLE = SERVE_ROLE_OPT_BASE, OPT_KV_LISTEN, OPT_PREFILL, OPT_KEY_FILE, OPT_KV_TRANSPORTS, OPT_KV_TIMEOUT };

const struct option serve_role_longopts[] = {
    {"role", required_argument, 0, OPT_ROLE},
    {"kv-listen", required_argument, 0, OPT_KV_LISTEN},
    {"prefill", required_argument, 0, OPT_PREFILL},
    {"cluster-key-file", required_argument, 0, OPT_KEY_FILE},
    {"kv-transports", required_argument, 0, OPT_KV_TRANSPORTS},
    {"kv-timeout", required_argument, 0, OPT_KV_TIMEOUT},
};
const size_t serve_role_longopts_count = sizeof serve_role_longopts / sizeof serve_role_longopts[0];

void serve_role_init(serve_role_options *o)
{
    memset(o, 0, sizeof *o);
    o->role = ROLE_BOTH;
    o->timeout_ms = 10000;
}

int serve_role_option(serve_role_options *o, int code, const char *arg)
{
    long long n;
    switch (code) {
    case OPT_ROLE:
        if (!strcmp(arg, "both"))
            o->role = ROLE_BOTH;
        else if (!strcmp(arg, "prefill"))
            o->role = ROLE_PREFILL;
        else if (!strcmp(arg, "decode"))
            o->role = ROLE_DECODE;
        else {
            fprintf(stderr, "error: --role expects both, prefill or decode, got '%s'\n", arg);
            return -1;
        }
        return 1;
    case OPT_KV_LISTEN: o->kv_listen = arg; return 1;
    case OPT_PREFILL: o->prefill_peer = arg; return 1;
    case OPT_KEY_FILE: o->key_file = arg; return 1;
    case OPT_KV_TRANSPORTS: o->transports = arg; return 1;
    case OPT_KV_TIMEOUT:
        if (!cli_parse_int("--kv-timeout", arg, 1, 3600, &n))
            return -1;
        o->timeout_ms = (int)n * 1000;
        return 1;
    default: return 0;
    }
}

void serve_role_usage(FILE *out)
{
    fprintf(out,
            "cluster worker (prefill/decode disaggregation, docs/cluster.md):\n"
            "      --role ROLE          both (default: prefill and decode here), prefill (also serve\n"
            "                           decode workers' prompts over --kv-listen) or decode (have a\n"
            "                           prefill worker compute prompts, then decode; a failed transfer\n"
            "                           is logged and the prompt computed here)\n"
            "      --kv-listen HOST:PORT  prefill: where decode workers reach the KV service (UCX);\n"
            "                           a non-loopback address needs --cluster-key-file (default\n"
            "                           127.0.0.1:0, any free port)\n"
            "      --prefill HOST:PORT  decode: the prefill worker to use (a router names one per\n"
            "                           request with the X-Blade-Prefill header instead)\n"
            "      --cluster-key-file FILE  the cluster secret: every KV frame and control message\n"
            "                           carries an HMAC under it; peers without it are dropped\n"
            "      --kv-transports TLS  UCX transports (UCX_TLS syntax; 'tcp' between network\n"
            "                           namespaces of one host; default: UCX's choice)\n"
            "      --kv-timeout SECONDS bound on connecting and on each KV message (default 10)\n\n");
}

int serve_role_prepare(serve_role_options *o, server_config *sc)
{
    if (o->key_file) {
        blade_error warn = {{0}}, err = {{0}};
        if (blade_cluster_key_load(o->key_file, &o->key, &warn, &err)) {
            fprintf(stderr, "error: --cluster-key-file: %s\n", err.msg);
            return -1;
        }
        if (warn.msg[0])
            fprintf(stderr, "warning: --cluster-key-file: %s\n", warn.msg);
        o->has_key = true;
    }
    if (o->kv_listen && o->role != ROLE_PREFILL) {
        fprintf(stderr, "error: --kv-listen is for --role prefill\n");
        return -1;
    }
    if (o->prefill_peer && o->role != ROLE_DECODE) {
        fprintf(stderr, "error: --prefill is for --role decode\n");
        return -1;
    }
    o->disagg = (blade_disagg_config){.key = o->has_key ? &o->key : NULL, .transports = o->transports,
                                      .timeout_ms = o->timeout_ms};
    if (o->role == ROLE_DECODE) {
        sc->disagg = &o->disagg;
        sc->prefill_peer = o->prefill_peer;
    }
    return 0;
}

int serve_role_start(serve_role_options *o, blade_engine *e, server *srv, blade_error *err)
{
    const char *role = o->role == ROLE_PREFILL ? "prefill" : o->role == ROLE_DECODE ? "decode" : "both";
    if (o->role != ROLE_PREFILL) {
        server_set_role(srv, role, NULL, NULL);
        printf("role: %s%s%s; cluster key: %s\n", role, o->prefill_peer ? ", prefill worker " : "",
               o->prefill_peer ? o->prefill_peer : "", o->has_key ? "yes" : "no");
        return 0;
    }
    char host[256] = "127.0.0.1";
    uint16_t port = 0;
    if (o->kv_listen && blade_disagg_parse_peer(o->kv_listen, host, sizeof host, &port, err))
        return -1;
    if (!(o->service = blade_prefill_service_start(e, &o->disagg, host, port, err)))
        return -1;
    bool v6 = strchr(host, ':') != NULL;
    char addr[300];
    snprintf(addr, sizeof addr, "%s%s%s:%u", v6 ? "[" : "", host, v6 ? "]" : "", blade_prefill_service_port(o->service));
    server_set_role(srv, role, o->service, addr);
    printf("role: prefill; KV service on %s (UCX); cluster key: %s\n", addr, o->has_key ? "yes" : "no");
    return 0;
}

void serve_role_stop(serve_role_options *o)
{
    blade_prefill_service_stop(o->service);
    o->service = NULL;
    blade_cluster_key_wipe(&o->key);
}

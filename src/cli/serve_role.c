/* The cluster worker flags of `blade serve` (serve_role.h). */

#include "cli/serve_role.h"

#include "blade/kv_transport.h"

#include <ctype.h>
#include <jansson.h>
#include <string.h>

static const cli_choice role_choices[] = {
    {"both", ROLE_BOTH}, {"prefill", ROLE_PREFILL}, {"decode", ROLE_DECODE}, {NULL, 0}};

#define R serve_role_options
const cli_flag serve_role_flags[] = {
    CLI_SECTION("cluster worker (prefill/decode disaggregation, docs/cluster.md)"),
    {.name = "role", .kind = CLI_ENUM, CLI_AT(R, role), .choices = role_choices, .metavar = "ROLE",
     .help = "both: prefill and decode here; prefill: also serve decode workers' prompts over --kv-listen; "
             "decode: have a prefill worker compute prompts, then decode (a failed transfer is logged and the "
             "prompt computed here)"},
    {.name = "kv-listen", .kind = CLI_STRING, CLI_AT(R, kv_listen), .metavar = "HOST:PORT",
     .dflt = "127.0.0.1:0, any free port",
     .help = "prefill: where decode workers reach the KV service (UCX); a non-loopback address needs "
             "--cluster-key-file"},
    {.name = "prefill", .kind = CLI_STRING, CLI_AT(R, prefill_peer), .metavar = "HOST:PORT",
     .help = "decode: the prefill worker to use (a router names one per request with the X-Blade-Prefill "
             "header instead)"},
    {.name = "cluster-key-file", .kind = CLI_PATH, CLI_AT(R, key_file), .metavar = "FILE",
     .help = "the cluster secret: every KV frame and control message carries an HMAC under it; peers without "
             "it are dropped"},
    {.name = "kv-transports", .kind = CLI_STRING, CLI_AT(R, transports), .metavar = "TLS",
     .dflt = "UCX's choice", .help = "UCX transports (UCX_TLS syntax; 'tcp' between network namespaces of one host)"},
    {.name = "kv-timeout", .kind = CLI_INT, CLI_AT(R, timeout_s), .min = 1, .max = 3600, .metavar = "SECONDS",
     .help = "bound on connecting and on each KV message"},
    {.name = "etcd", .kind = CLI_STRING, CLI_AT(R, etcd), .metavar = "URL,...",
     .help = "register this worker in etcd (with --cluster) for `blade router --etcd`: its URL, role, KV "
             "address and fingerprint, under a lease"},
    {.name = "cluster", .kind = CLI_STRING, CLI_AT(R, cluster), .metavar = "NAME",
     .help = "the cluster's key prefix in etcd (blade/NAME/workers/)"},
    {.name = "advertise", .kind = CLI_STRING, CLI_AT(R, advertise), .metavar = "URL", .dflt = "http://HOST:PORT",
     .help = "the URL routers reach this worker at"},
    {.name = "etcd-ttl", .kind = CLI_INT, CLI_AT(R, etcd_ttl), .min = 2, .max = 3600, .metavar = "SECONDS",
     .help = "the lease: a worker that stops renewing leaves within it"},
    {0},
};
#undef R

void serve_role_init(serve_role_options *o)
{
    memset(o, 0, sizeof *o);
    o->role = ROLE_BOTH;
    o->timeout_s = 10;
    o->etcd_ttl = 5;
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
    if (o->role == ROLE_PREFILL)
        blade_kv_transport_process_defaults(); /* before the server's threads */
    if (o->kv_listen && o->role != ROLE_PREFILL) {
        fprintf(stderr, "error: --kv-listen is for --role prefill\n");
        return -1;
    }
    if (!o->etcd != !o->cluster) {
        fprintf(stderr, "error: --etcd and --cluster go together\n");
        return -1;
    }
    if (o->prefill_peer && o->role != ROLE_DECODE) {
        fprintf(stderr, "error: --prefill is for --role decode\n");
        return -1;
    }
    o->disagg = (blade_disagg_config){.key = o->has_key ? &o->key : NULL, .transports = o->transports,
                                      .timeout_ms = o->timeout_s * 1000};
    if (o->role == ROLE_DECODE) {
        sc->disagg = &o->disagg;
        sc->prefill_peer = o->prefill_peer;
    }
    return 0;
}

/* The worker's registration: what a router needs before its first poll. */
static int register_worker(serve_role_options *o, blade_engine *e, const char *role, const char *kv,
                           const server_config *sc, int port, blade_error *err)
{
    char url[512], key[768];
    bool v6 = strchr(sc->host, ':') != NULL;
    if (o->advertise)
        snprintf(url, sizeof url, "%s", o->advertise);
    else
        snprintf(url, sizeof url, "http://%s%s%s:%d", v6 ? "[" : "", sc->host, v6 ? "]" : "", port);
    snprintf(key, sizeof key, "blade/%s/workers/", o->cluster);
    size_t kl = strlen(key);
    for (const char *p = url + (strncmp(url, "http://", 7) ? 0 : 7); *p && kl + 1 < sizeof key; p++)
        key[kl++] = (char)(isalnum((unsigned char)*p) || *p == '.' || *p == '-' ? *p : '_');
    key[kl] = 0;
    char hex[2 * BLADE_ENGINE_FINGERPRINT_BYTES + 1];
    blade_engine_fingerprint_hex(e, hex);
    json_t *j = json_pack("{s:s, s:s, s:s, s:s}", "url", url, "role", role, "kv", kv ? kv : "", "kv_fingerprint", hex);
    char *value = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    blade_etcd_config ec = {.endpoints = o->etcd, .timeout_ms = 2000};
    if (value && (o->etcd_client = blade_etcd_new(&ec, err)))
        o->registration = blade_etcd_register(o->etcd_client, key, value, strlen(value), o->etcd_ttl, err);
    free(value);
    if (!o->registration)
        return -1;
    printf("etcd: registered as %s (%s) with a %d s lease\n", key, url, o->etcd_ttl);
    return 0;
}

int serve_role_start(serve_role_options *o, blade_engine *e, server *srv, const server_config *sc, blade_error *err)
{
    const char *role = o->role == ROLE_PREFILL ? "prefill" : o->role == ROLE_DECODE ? "decode" : "both";
    if (o->role != ROLE_PREFILL) {
        server_set_role(srv, role, NULL, NULL);
        printf("role: %s%s%s; cluster key: %s\n", role, o->prefill_peer ? ", prefill worker " : "",
               o->prefill_peer ? o->prefill_peer : "", o->has_key ? "yes" : "no");
        return o->etcd ? register_worker(o, e, role, NULL, sc, server_port(srv), err) : 0;
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
    return o->etcd ? register_worker(o, e, role, addr, sc, server_port(srv), err) : 0;
}

void serve_role_stop(serve_role_options *o)
{
    blade_etcd_unregister(o->registration);
    o->registration = NULL;
    blade_etcd_free(o->etcd_client);
    o->etcd_client = NULL;
    blade_prefill_service_stop(o->service);
    o->service = NULL;
    blade_cluster_key_wipe(&o->key);
}

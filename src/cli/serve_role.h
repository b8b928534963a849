#ifndef BLADE_CLI_SERVE_ROLE_H
#define BLADE_CLI_SERVE_ROLE_H

/* `blade serve --role both|prefill|decode` and the flags of a cluster worker, kept apart
 * from serve's own flags: parsing, the cluster key, and the prefill service's lifetime. */

#include "blade/cluster_auth.h"
#include "blade/disagg.h"
#include "blade/etcd_client.h"
#include "server/server.h"

#include "cli/flags.h"

#include <stdbool.h>
#include <stdio.h>

typedef enum serve_role { ROLE_BOTH, ROLE_PREFILL, ROLE_DECODE } serve_role;

typedef struct serve_role_options {
    int role; /* serve_role */
    const char *kv_listen;    /* prefill: HOST:PORT of the KV service */
    const char *prefill_peer; /* decode: the prefill worker's KV service, HOST:PORT */
    const char *key_file;
    const char *transports;
    int timeout_s;
    const char *etcd;         /* register in etcd under blade/<cluster>/workers/ */
    const char *cluster;
    const char *advertise;    /* the URL a router reaches this worker at */
    int etcd_ttl;
    blade_etcd *etcd_client;
    blade_etcd_registration *registration;
    blade_cluster_key key;
    bool has_key;
    blade_disagg_config disagg;
    blade_prefill_service *service;
} serve_role_options;

/* The flags, writing into a serve_role_options (a table of `blade serve`'s). */
extern const cli_flag serve_role_flags[];

void serve_role_init(serve_role_options *o);
/* Before the server starts: loads the key, checks the flags agree with the role, and sets
 * sc's decode fields. -1 with the reason on stderr. */
int serve_role_prepare(serve_role_options *o, server_config *sc);
/* Once the engine runs: starts the prefill role's KV service and prints where it listens;
 * with --etcd registers the worker (URL, role, KV address, fingerprint) under a lease kept
 * alive until serve_role_stop. */
int serve_role_start(serve_role_options *o, blade_engine *e, server *srv, const server_config *sc, blade_error *err);
void serve_role_stop(serve_role_options *o);

#endif

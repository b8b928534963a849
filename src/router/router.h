#ifndef BLADE_ROUTER_ROUTER_H
#define BLADE_ROUTER_ROUTER_H

/* `blade router`: the OpenAI front door of a cluster. POST /v1/completions and
 * /v1/chat/completions (streaming or not) go to the worker(s) the pool chooses
 * (worker_pool.h); the worker's answer, status and error objects included, is relayed
 * unchanged, a stream chunk by chunk. A worker that cannot be reached, or fails before its
 * answer starts, is taken out of the pool and the request tried on another (up to three
 * tries); one that fails mid-stream ends the client's stream with an error event naming
 * the cause. A client that goes away closes the worker's connection, which aborts the
 * request there. Every request is counted in /metrics by how it ended. GET /health
 * reports the workers and whether the etcd view is current; GET /v1/models is a worker's. */

#include "blade/error.h"
#include "router/worker_pool.h"

typedef struct router_config {
    const char *host;   /* numeric address to listen on */
    int port;           /* 0: any free port */
    pool_config pool;
} router_config;

typedef struct router router;

router *router_start(const router_config *cfg, blade_error *err);
int router_port(const router *r);
void router_stop(router *r);

#endif

#ifndef BLADE_SERVER_SERVER_H
#define BLADE_SERVER_SERVER_H

/* The HTTP side of `blade serve` (libmicrohttpd, one thread per connection): routing,
 * API-key checks, body limits, the OpenAI endpoints over src/api, Server-Sent Events
 * streaming, /health, /metrics and the lifecycle (loading, ready, draining).
 *
 * A connection's thread waits on its job's event queue and on its own socket at once, so
 * a client that goes away is noticed while its request is still generating and the
 * request is aborted at once (its KV blocks return to the pool within one engine step).
 *
 * Connections reach libmicrohttpd through the gate (gate.h), which holds each one until its
 * first request head is complete and strictly valid, caps connections per client address and
 * enforces the head and body deadlines. */

#include "api/model.h"
#include "blade/disagg.h"
#include "blade/error.h"
#include "blade/semantic_cache.h"

#include <stddef.h>

typedef struct server_config {
    const char *host;      /* numeric address; default 127.0.0.1 */
    int port;              /* 0: any free port (server_port tells which) */
    const char *api_key;   /* NULL: no authentication */
    size_t max_body;       /* bytes */
    int max_queue;         /* requests waiting for their first token before 429 */
    double timeout;        /* seconds a request may take in all; 0: unbounded */
    double drain_timeout;  /* seconds in-flight requests get to finish on shutdown */
    int max_connections;   /* open connections, idle keep-alive ones included */
    int idle_timeout;      /* seconds a connection may sit without traffic (idle keep-alive,
                            * unread response) before it is closed; a stalled upload gets 408 */
    int max_connections_per_ip; /* per client address (IPv6: per /64); 0: no cap */
    bool limit_loopback;   /* apply max_connections_per_ip to loopback clients too */
    double header_timeout; /* seconds from connect (or the previous answer plus idle_timeout)
                            * to a complete request head; no byte extends it */
    double body_timeout;   /* seconds from a complete head to a complete body */
    /* Decode role: prompts of single-choice requests without logprobs are computed by a
     * prefill worker (the X-Blade-Prefill: HOST:PORT header's, else prefill_peer's) and
     * imported; when that fails the prompt is computed here. NULL: colocated. */
    const blade_disagg_config *disagg;
    const char *prefill_peer;
} server_config;

typedef struct server server;

/* Listens at once (GET /health answers 503 until server_set_model). */
server *server_start(const server_config *cfg, blade_error *err);
int server_port(const server *s);
/* Before server_set_model: answer repeated and near-repeated requests from c
 * (cache_front.h); c must outlive the server. */
void server_set_semantic_cache(server *s, blade_semcache *c);
/* The model is loaded: requests are served from now on. am must outlive the server. */
void server_set_model(server *s, api_model *am);
/* The worker's role for /health (a router reads it); prefill role: its KV service, whose
 * counters /metrics shows, and the address decode workers reach it at. */
void server_set_role(server *s, const char *role, blade_prefill_service *ps, const char *kv_addr);
/* Stops taking new requests (503, /health 503), lets in-flight ones finish for up to
 * drain_timeout seconds, then aborts what is left and waits for it to end. */
void server_drain(server *s);
/* Closes every connection and frees the server. */
void server_stop(server *s);

#endif

#ifndef BLADE_SERVER_GATE_H
#define BLADE_SERVER_GATE_H

/* The front door of `blade serve`. It owns the listening socket and holds every new
 * connection, on one thread and without reading from it (it peeks), until the connection's
 * first request head is complete and passes http_head's strict checks; only then is the
 * socket handed to libmicrohttpd, which parses the same bytes again. So:
 *   - malformed or ambiguous heads are answered here with an OpenAI-style JSON error and the
 *     connection closed, before libmicrohttpd could answer with its own HTML page or read a
 *     smuggled request;
 *   - a client that trickles its head holds no libmicrohttpd slot or thread, only a socket,
 *     and never longer than the head deadline, which no byte extends;
 *   - one address holds at most --max-connections-per-ip connections still sending their head
 *     (a new one replaces its oldest) and at most as many open; when all heads pending are
 *     full, the oldest of the address holding the most is closed for the newcomer; and a few
 *     slots past --max-connections are kept for GET /health and /metrics.
 * Once a connection is libmicrohttpd's, the server reports each request's phases here and a
 * watchdog on the same thread answers 408 and shuts the socket down when a later request's
 * head (on a keep-alive connection) or a request body does not arrive in time. */

#include "blade/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <sys/socket.h>

#define GATE_PROBE_SLOTS 16 /* connections past max_connections kept for /health and /metrics */

typedef struct gate_config {
    int max_connections;   /* connections handed over and open at once (probe slots aside) */
    int max_per_ip;        /* per client address (IPv6: per /64); 0: no cap */
    bool cap_loopback;     /* apply max_per_ip to loopback clients too */
    double header_timeout; /* seconds from accept to a complete head */
    double body_timeout;   /* seconds from a complete head to a complete body */
    double idle_timeout;   /* seconds without body bytes before 408; also the keep-alive wait */
    size_t max_body;       /* bytes; a first chunk announced larger is refused with 413 */
} gate_config;

typedef struct gate_hooks {
    void *ctx;
    /* Gives the connection to the HTTP library; false when it was refused (fd closed). */
    bool (*hand_off)(void *ctx, int fd, const struct sockaddr *sa, socklen_t len);
    /* A request the gate answered itself, for the metrics. */
    void (*answered)(void *ctx, int status);
} gate_hooks;

typedef struct gate gate;
typedef struct gate_conn gate_conn;

/* Takes over listen_fd (closed by gate_free). Nothing is accepted before gate_run. */
gate *gate_new(int listen_fd, const gate_config *cfg, const gate_hooks *hooks, blade_error *err);
int gate_run(gate *g, blade_error *err);
/* Stops accepting and closes the connections the gate still holds; those handed over stay. */
void gate_stop(gate *g);
/* Once the HTTP library has closed every connection it was given. */
void gate_free(gate *g);

/* From the HTTP library's connection callbacks: a handed-over socket starts (NULL if it is not
 * one of the gate's) and closes. */
gate_conn *gate_conn_started(gate *g, int fd);
void gate_conn_closed(gate *g, gate_conn *c);
/* Keep connections in probe slots open for one answer only. */
bool gate_conn_reserved(const gate_conn *c);

/* The phases of each request on a connection, from its thread (c may be NULL). head and body
 * return false once the watchdog has answered 408 and cut the connection. */
bool gate_request_head(gate *g, gate_conn *c);   /* its head is parsed; the body deadline starts */
void gate_request_progress(gate *g, gate_conn *c); /* body bytes arrived */
bool gate_request_body(gate *g, gate_conn *c);   /* the body is in (or an answer is queued) */
/* Answered; waiting for the next head. True when the answer was the watchdog's 408 (which
 * the gate has counted already). */
bool gate_request_done(gate *g, gate_conn *c);

#endif

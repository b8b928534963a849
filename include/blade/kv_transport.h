#ifndef BLADE_KV_TRANSPORT_H
#define BLADE_KV_TRANSPORT_H

/* Moving KV frames and control messages between workers over UCX (libucp): a listener and
 * a connector with UCX's socket-address connection establishment, then length-prefixed
 * messages on UCX streams. A message is sent straight from the caller's buffers (a UCX iovec
 * datatype), so a KV frame travels from the store's blocks without being copied into one
 * buffer first (kv_wire.h's frame pieces).
 *
 * Every connection starts with a mutual challenge-response on the cluster key
 * (cluster_auth.h): a peer that cannot prove it holds the key is dropped before any message
 * is delivered. Without a key only loopback listeners are allowed.
 *
 * Every receive is bounded in size (the caller's limit; a larger announced message drops
 * the connection unread) and every operation in time (the transport's timeout): a dead or
 * silent peer gives an error, never a hang. After a timeout or peer failure a connection is
 * broken for good (the stream may be mid-message) and only closing it remains.
 *
 * A transport (one UCX context and worker) is used by one thread at a time. */

#include "blade/cluster_auth.h"
#include "blade/error.h"
#include "blade/kv_wire.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

typedef struct blade_kv_transport blade_kv_transport;
typedef struct blade_kv_conn blade_kv_conn;

typedef struct blade_kv_transport_config {
    const blade_cluster_key *key; /* copied; NULL: unauthenticated, loopback listeners only */
    int timeout_ms;               /* bound on every connect, handshake, send and receive; <= 0: 10 s */
    /* UCX transports to use (UCX_TLS syntax, e.g. "tcp"); NULL: UCX's own choice. Processes
     * on one host in different network namespaces need "tcp": UCX would otherwise pick
     * shared memory, which does not cross the namespaces' network boundary. */
    const char *transports;
    /* Copy a frame into one buffer before sending instead of sending from the blocks: the
     * switch that measures what sending in place saves. */
    bool copy_payload;
} blade_kv_transport_config;

blade_kv_transport *blade_kv_transport_new(const blade_kv_transport_config *cfg, blade_error *err);
/* All connections must be closed first. */
void blade_kv_transport_free(blade_kv_transport *t);
/* Sets the UCX defaults a process that listens needs, where the environment does not set
 * them already: listeners reuse their address (UCX_TCP_CM_REUSEADDR), so a worker
 * restarted at its address listens again while its killed predecessor's connections sit
 * in TIME_WAIT (on Linux two live listeners still cannot share a port). UCX reads this
 * only from the environment, at each transport's start: call it before any thread starts. */
void blade_kv_transport_process_defaults(void);
/* "UCX 1.13.1" and the like. */
const char *blade_kv_transport_ucx_version(void);

/* Starts listening on host:port (port 0 picks a free one). A non-loopback host needs a
 * key (blade_cluster_check_listener). One listener per transport. */
int blade_kv_transport_listen(blade_kv_transport *t, const char *host, uint16_t port, blade_error *err);
uint16_t blade_kv_transport_port(const blade_kv_transport *t);
/* Waits up to timeout_ms for a peer to connect and authenticate; NULL with err set on
 * timeout or a failed handshake (that peer is dropped). */
blade_kv_conn *blade_kv_transport_accept(blade_kv_transport *t, int timeout_ms, blade_error *err);
/* Connects and authenticates within the transport's timeout. */
blade_kv_conn *blade_kv_transport_connect(blade_kv_transport *t, const char *host, uint16_t port, blade_error *err);

/* Sends one message made of the pieces in order. */
int blade_kv_send(blade_kv_conn *c, const struct iovec *iov, size_t n_iov, blade_error *err);
/* Sends an encoded KV frame: header, the blocks in place, digest. */
int blade_kv_send_frame(blade_kv_conn *c, const blade_kv_wire_frame_out *frame, blade_error *err);
/* Receives one message of at most max_bytes into a malloc'd buffer (*buf, *len). */
int blade_kv_recv(blade_kv_conn *c, size_t max_bytes, void **buf, size_t *len, blade_error *err);
/* The same with its own time bound (a reply that waits for a prefill to be computed). */
int blade_kv_recv_within(blade_kv_conn *c, size_t max_bytes, int timeout_ms, void **buf, size_t *len,
                         blade_error *err);
/* The peer's address as text, for logs. */
const char *blade_kv_conn_peer(const blade_kv_conn *c);
void blade_kv_conn_close(blade_kv_conn *c);

#endif

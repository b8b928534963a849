#ifndef BLADE_DISAGG_H
#define BLADE_DISAGG_H

/* Prefill/decode disaggregation between two workers over the KV transport (UCX). The
 * decode worker drives each request: it connects to a prefill worker, asks it to compute
 * the prompt, tells it which blocks it already holds, and receives the first token and the
 * missing blocks, which it imports into its own engine (kv_handoff.h) and decodes. When
 * anything fails (the prefill worker is gone, refuses, or sends a frame that fails a
 * check) the decode worker computes the prompt itself: the answer is the same.
 *
 * One connection per request, every message authenticated:
 *   decode -> prefill   PREFILL  control: transfer id, prompt tokens, sampling, cache salt
 *   prefill -> decode   HAVE query (kv_wire.h): the prompt's full-block hashes
 *   decode -> prefill   HAVE reply: which of them the decode worker holds
 *   prefill -> decode   FIRST    control: the first token (or the prefill's error)
 *   prefill -> decode   KV frame of the blocks the decode worker lacks
 *   decode -> prefill   DONE     control: accepted, or the reason it was refused (the
 *                                prefill side closes only then, so no frame is cut short)
 * A control message is JSON followed by its digest (HMAC-SHA256 under the cluster key;
 * SHA-256 without one, loopback only). */

#include "blade/cluster_auth.h"
#include "blade/engine.h"
#include "blade/error.h"
#include "blade/kv_handoff.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct blade_disagg_config {
    const blade_cluster_key *key; /* NULL: loopback peers only */
    const char *transports;       /* UCX_TLS syntax; NULL: UCX's choice ("tcp" across namespaces) */
    int timeout_ms;               /* connect and each message; <= 0: 10 s */
    int prefill_timeout_ms;       /* how long the decode side waits for the prompt to be computed;
                                   * <= 0: 600 s */
} blade_disagg_config;

/* ---- the prefill worker ---- */

typedef struct blade_prefill_service blade_prefill_service;

/* Listens on host:port (port 0: any; a non-loopback host needs a key) and serves decode
 * workers' requests from engine e on a thread of its own: up to 64 prompts at once, which
 * the engine batches. */
blade_prefill_service *blade_prefill_service_start(blade_engine *e, const blade_disagg_config *cfg,
                                                   const char *host, uint16_t port, blade_error *err);
uint16_t blade_prefill_service_port(const blade_prefill_service *ps);
typedef struct blade_prefill_service_stats {
    uint64_t served;   /* prefills shipped */
    uint64_t failed;   /* requests that ended with an error (logged with the reason) */
    uint64_t blocks_sent, blocks_skipped; /* skipped: the decode worker held them */
} blade_prefill_service_stats;
void blade_prefill_service_stats_get(blade_prefill_service *ps, blade_prefill_service_stats *out);
void blade_prefill_service_stop(blade_prefill_service *ps);

/* ---- the decode worker ---- */

/* Why a remote prefill was not used (the prompt is then computed locally). */
typedef enum blade_disagg_cause {
    BLADE_DISAGG_OK = 0,
    BLADE_DISAGG_CONNECT,   /* no connection or handshake with the prefill worker */
    BLADE_DISAGG_PEER,      /* the prefill worker failed, refused or went silent */
    BLADE_DISAGG_REFUSED,   /* a message from it failed a check (digest, fingerprint, sizes...) */
    BLADE_DISAGG_LOCAL,     /* this side could not proceed (memory) */
    BLADE_DISAGG_CAUSES
} blade_disagg_cause;
const char *blade_disagg_cause_name(blade_disagg_cause c);

typedef struct blade_remote_prefill {
    blade_kv_handoff_in in;   /* in.import is ready to submit with the prompt */
    int32_t blocks_sent, blocks_held;
    double seconds;           /* connect to frame received */
    size_t frame_bytes;
} blade_remote_prefill;

/* Has host:port compute q's prompt (prompt_tokens, sampling, cache_salt are read) for
 * engine e. BLADE_DISAGG_OK with out filled, or the cause with err set (nothing kept). */
blade_disagg_cause blade_remote_prefill_run(blade_engine *e, const blade_disagg_config *cfg, const char *host,
                                            uint16_t port, const blade_request *q, blade_remote_prefill *out,
                                            blade_error *err);
void blade_remote_prefill_free(blade_remote_prefill *rp);

/* "HOST:PORT" or "[V6]:PORT" into host (cap bytes) and port (0 allowed: a listener's any). */
int blade_disagg_parse_peer(const char *s, char *host, size_t cap, uint16_t *port, blade_error *err);

#endif

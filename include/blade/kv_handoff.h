#ifndef BLADE_KV_HANDOFF_H
#define BLADE_KV_HANDOFF_H

/* Handing a finished prefill from one engine to another over the KV wire format: the
 * prefill side turns an engine's export (engine.h) into a frame, the decode side turns a
 * received frame into an engine import. Both sides only move data between the engine's
 * plan data and kv_wire; which transport carries the bytes is the caller's business.
 *
 *   prefill engine: export_kv request -> BLADE_FINISH_EXPORTED event (blade_kv_export)
 *   decode side:    blade_kv_handoff_have (HAVE reply from its prefix cache)
 *   prefill side:   blade_kv_handoff_encode (only the blocks the decode side lacks)
 *   decode side:    blade_kv_handoff_receive (checks everything, stages the blocks)
 *                   -> blade_request.import, submitted to the decode engine */

#include "blade/cluster_auth.h"
#include "blade/engine.h"
#include "blade/error.h"
#include "blade/kv_wire.h"

#include <stdbool.h>
#include <stdint.h>

/* A frame of an export from engine e; have (n_hashes entries, the decode side's HAVE
 * reply) or NULL to send every block. The frame points into e's store: send it before
 * releasing the export. */
int blade_kv_handoff_encode(blade_engine *e, const blade_kv_export *ex, uint64_t transfer_id, const bool *have,
                            const blade_cluster_key *key, blade_kv_wire_frame_out *out, blade_error *err);

/* have[i] for each of a query's n hashes: whether engine e's prefix cache holds it. */
void blade_kv_handoff_have(blade_engine *e, const uint8_t (*hashes)[BLADE_HASH_BYTES], int32_t n, bool *have);

/* A received frame, checked and staged for engine e. */
typedef struct blade_kv_handoff_in {
    blade_kv_wire_received frame; /* the tokens, hashes and sent block list */
    blade_kv_import import;       /* staging store and sent list; first_token is the caller's */
} blade_kv_handoff_in;

/* Checks frame against e (fingerprint, shape, vocabulary, context, held: the HAVE reply the
 * decode side gave, or NULL) and copies its blocks into a new staging store. On success
 * in->import is ready but for first_token; pass it to blade_engine_submit (which takes the
 * staging store) or free it with blade_kv_handoff_in_free. -1 with the reason otherwise,
 * nothing kept. */
int blade_kv_handoff_receive(blade_engine *e, const void *frame, size_t len, uint64_t transfer_id, const bool *held,
                             int32_t n_held, const blade_cluster_key *key, blade_kv_handoff_in *in, blade_error *err);
/* Frees what receive kept; a staging store the engine took (in->import.staging set to
 * NULL by the caller after a successful submit) is not freed twice. */
void blade_kv_handoff_in_free(blade_kv_handoff_in *in);

#endif

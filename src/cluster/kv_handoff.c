/* A prefill handed between engines (kv_handoff.h): an engine's export becomes a KV wire
 * frame, a received frame becomes a staging store and an engine import. */

#include "blade/kv_handoff.h"

#include "blade/model.h"

#include <stdlib.h>
#include <string.h>

int blade_kv_handoff_encode(blade_engine *e, const blade_kv_export *ex, uint64_t transfer_id, const bool *have,
                            const blade_cluster_key *key, blade_kv_wire_frame_out *out, blade_error *err)
{
    uint8_t fp[BLADE_ENGINE_FINGERPRINT_BYTES];
    blade_engine_fingerprint(e, fp);
    bool *skip = NULL;
    if (have) {
        if (!(skip = calloc((size_t)ex->n_blocks, sizeof *skip)))
            return blade_error_set(err, "out of memory");
        memcpy(skip, have, (size_t)ex->n_hashes * sizeof *skip);
    }
    blade_kv_wire_source src = {
        .store = blade_engine_kv_store(e), .fingerprint = fp, .transfer_id = transfer_id, .tokens = ex->tokens,
        .n_tokens = ex->n_tokens, .hashes = ex->hashes, .blocks = ex->blocks, .skip = skip,
    };
    int rc = blade_kv_wire_encode(&src, key, out, err);
    free(skip);
    return rc;
}

void blade_kv_handoff_have(blade_engine *e, const uint8_t (*hashes)[BLADE_HASH_BYTES], int32_t n, bool *have)
{
    blade_engine_kv_have(e, hashes, n, have);
}

int blade_kv_handoff_receive(blade_engine *e, const void *frame, size_t len, uint64_t transfer_id, const bool *held,
                             int32_t n_held, const blade_cluster_key *key, blade_kv_handoff_in *in, blade_error *err)
{
    memset(in, 0, sizeof *in);
    uint8_t fp[BLADE_ENGINE_FINGERPRINT_BYTES];
    blade_engine_fingerprint(e, fp);
    const blade_kv_store *store = blade_engine_kv_store(e);
    blade_kv_wire_expect x = {
        .fingerprint = fp, .key = key, .transfer_id = transfer_id,
        .n_vocab = blade_engine_model(e)->hp.n_vocab, .max_tokens = blade_engine_max_context(e) - 1,
        .held = held, .n_held = n_held,
    };
    blade_kv_wire_header h;
    if (blade_kv_wire_peek(frame, len, &x, store, &h, err))
        return -1;
    /* before the staging store is sized by it */
    if (h.frame_bytes != len)
        return blade_error_set(err, "KV frame of %zu bytes, its header implies %llu", len,
                               (unsigned long long)h.frame_bytes);
    blade_kv_store_config cfg = {
        .n_layer = store->n_layer, .n_head_kv = store->n_head_kv, .head_dim = store->head_dim,
        .type = store->type, .block_size = store->block_size, .n_blocks = h.n_sent ? (int32_t)h.n_sent : 1,
    };
    blade_kv_store *staging = blade_kv_store_new(&cfg, err);
    int32_t *dst = staging ? malloc((size_t)cfg.n_blocks * sizeof *dst) : NULL;
    if (!dst) {
        blade_kv_store_free(staging);
        return staging ? blade_error_set(err, "out of memory") : -1;
    }
    for (int32_t j = 0; j < cfg.n_blocks; j++)
        dst[j] = j;
    int rc = blade_kv_wire_decode(frame, len, &x, staging, dst, (int32_t)h.n_sent, &in->frame, err);
    free(dst);
    if (rc) {
        blade_kv_store_free(staging);
        return -1;
    }
    in->import = (blade_kv_import){.n_tokens = in->frame.n_tokens, .staging = staging, .sent = in->frame.sent, .n_sent = in->frame.n_sent};
    return 0;
}

void blade_kv_handoff_in_free(blade_kv_handoff_in *in)
{
    blade_kv_store_free(in->import.staging);
    blade_kv_wire_received_free(&in->frame);
    memset(in, 0, sizeof *in);
}

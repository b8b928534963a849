/* libFuzzer target for the KV frame and HAVE-message decoders (cmake -DBLADE_FUZZ=ON with
 * clang; run build/fuzz_kv_wire [corpus dir]). The first input byte picks the decoder; for
 * frames the rest is taken as a frame without its digest and sealed here, so the fuzzer
 * explores the checks behind the digest instead of stopping at it. Any crash, sanitizer
 * report, or a write outside the offered blocks is a bug. */

#include "blade/kv_wire.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { N_LAYER = 2, N_HEAD = 2, HEAD_DIM = 4, BS = 4, N_BLOCKS = 8 };
static const uint8_t fingerprint[32] = {42};
static const int32_t offered[3] = {1, 4, 6};

static blade_kv_store *store;
static uint8_t *before_k, *before_v;
static size_t area;

static void init(void)
{
    blade_kv_store_config cfg = {.n_layer = N_LAYER, .n_head_kv = N_HEAD, .head_dim = HEAD_DIM, .type = BLADE_KV_F16,
                                 .block_size = BS, .n_blocks = N_BLOCKS};
    store = blade_kv_store_new(&cfg, NULL);
    area = (size_t)N_LAYER * N_BLOCKS * store->block_stride;
    before_k = malloc(area);
    before_v = malloc(area);
}

/* Every block other than the offered ones must be as it was. */
static void check_untouched(void)
{
    for (int32_t l = 0; l < N_LAYER; l++)
        for (int32_t b = 0; b < N_BLOCKS; b++) {
            if (b == offered[0] || b == offered[1] || b == offered[2])
                continue;
            size_t off = ((size_t)l * N_BLOCKS + b) * store->block_stride;
            if (memcmp(store->k + off, before_k + off, store->block_stride) ||
                memcmp(store->v + off, before_v + off, store->block_stride))
                abort();
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!store)
        init();
    if (size < 1)
        return 0;
    uint8_t mode = data[0];
    data++;
    size--;
    if (mode % 3 == 0) {
        /* A frame: seal the input with a SHA-256 digest. */
        uint8_t *frame = malloc(size + BLADE_CLUSTER_MAC_BYTES);
        memcpy(frame, data, size);
        blade_cluster_sign(NULL, frame, size, frame + size);
        memcpy(before_k, store->k, area);
        memcpy(before_v, store->v, area);
        blade_kv_wire_expect x = {.fingerprint = fingerprint, .transfer_id = 1, .n_vocab = 1000, .max_tokens = 64};
        blade_kv_wire_received r;
        if (blade_kv_wire_decode(frame, size + BLADE_CLUSTER_MAC_BYTES, &x, store, offered, 3, &r, NULL) == 0)
            blade_kv_wire_received_free(&r);
        check_untouched();
        free(frame);
    } else if (mode % 3 == 1) {
        uint64_t id;
        uint8_t(*hashes)[BLADE_HASH_BYTES] = NULL;
        int32_t n;
        if (blade_kv_wire_have_query_parse(data, size, fingerprint, NULL, 64, &id, &hashes, &n, NULL) == 0)
            free(hashes);
    } else {
        bool have[64];
        blade_kv_wire_have_reply_parse(data, size, 1, mode % 64, NULL, have, NULL);
    }
    return 0;
}

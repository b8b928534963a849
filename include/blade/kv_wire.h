#ifndef BLADE_KV_WIRE_H
#define BLADE_KV_WIRE_H

/* The KV transfer wire format: how a prefill worker ships a request's KV blocks to a
 * decode worker, and how the two agree first on which blocks need to travel.
 *
 * A frame, every integer little-endian:
 *   header (BLADE_KV_WIRE_HEADER_BYTES)
 *     magic "BLKV", version u16, kind u16 (1 = KV frame), flags u32 (bit 0: keyed digest),
 *     header bytes u32, transfer id u64, model fingerprint [32], KV type u32, block size u32,
 *     layers u32, KV heads u32, head dim u32, reserved u32 (0), block bytes u64 (one layer's K or V of one
 *     block, as the store lays it out), token count u32, blocks sent u32, payload bytes u64
 *   token ids        u32 x token count
 *   block hashes     [32] x (token count / block size): the prefix cache's chained hash of
 *                    every full block (kv_cache.h)
 *   blocks sent      u32 x blocks sent: logical block indices, strictly increasing, below
 *                    ceil(token count / block size)
 *   payload          for each layer: K of each sent block, then V of each sent block, each
 *                    `block bytes` long: the store's own bytes, scales included
 *   digest [32]      HMAC-SHA256 under the cluster key (flag bit 0) or SHA-256, over
 *                    everything before it
 * The digest trails the payload so a sender can stream layers as it produces them.
 *
 * The block-hash exchange, before a frame: the prefill side sends a HAVE query (kind 2:
 * the fingerprint and the request's full-block hashes), the decode side answers with a HAVE
 * reply (kind 3: a bitmap of the hashes it already holds), and the frame then carries only
 * the missing blocks. Both messages share the frame's first 24 bytes (magic .. transfer id)
 * and end in a digest too.
 *
 * Every field of a received message is hostile: decoding checks all of them against the
 * receiver's expectations and its store before it writes a single byte. */

#include "blade/cluster_auth.h"
#include "blade/error.h"
#include "blade/kv_cache.h"
#include "blade/kv_store.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define BLADE_KV_WIRE_VERSION 1
#define BLADE_KV_WIRE_HEADER_BYTES 104
#define BLADE_KV_WIRE_FINGERPRINT_BYTES 32
/* Bounds a receiver applies even when its caller allows more: enough for a million-token
 * context, small enough that the sizes derived from them cannot overflow. */
#define BLADE_KV_WIRE_MAX_TOKENS (1 << 24)

enum { BLADE_KV_WIRE_FRAME = 1, BLADE_KV_WIRE_HAVE_QUERY = 2, BLADE_KV_WIRE_HAVE_REPLY = 3 };

/* ---- sending a frame ---- */

typedef struct blade_kv_wire_source {
    const blade_kv_store *store;
    const uint8_t *fingerprint; /* BLADE_KV_WIRE_FINGERPRINT_BYTES: the model's identity */
    uint64_t transfer_id;       /* chosen by the receiver; ties the frame to one request */
    const int32_t *tokens;
    int32_t n_tokens;
    /* The chained hashes of the n_tokens / block_size full blocks (kv_cache_seq.hashes). */
    const uint8_t (*hashes)[BLADE_HASH_BYTES];
    /* Physical block of each logical block: ceil(n_tokens / block_size) entries. */
    const int32_t *blocks;
    /* Optional, one per logical block: true where the receiver already holds the block (its
     * HAVE reply), which then does not travel. NULL sends every block. */
    const bool *skip;
} blade_kv_wire_source;

/* An encoded frame: the header and tables in one buffer, the payload as pieces pointing
 * straight into the store (adjacent blocks merged), the digest last. Sending head, iov[]
 * and digest in order sends the frame without copying the blocks. */
typedef struct blade_kv_wire_frame_out {
    uint8_t *head;
    size_t head_len;
    struct iovec *iov;
    size_t n_iov;
    uint8_t digest[BLADE_CLUSTER_MAC_BYTES];
    size_t frame_bytes; /* head + payload + digest */
    int32_t n_sent;
} blade_kv_wire_frame_out;

/* key NULL: SHA-256 digest only (loopback clusters). Returns 0 or -1 with err set (a
 * source whose arrays disagree with its store, or out of memory). The store's blocks must
 * not change until the frame is sent. */
int blade_kv_wire_encode(const blade_kv_wire_source *src, const blade_cluster_key *key, blade_kv_wire_frame_out *out,
                         blade_error *err);
void blade_kv_wire_frame_out_free(blade_kv_wire_frame_out *out);
/* The whole frame in one malloc'd buffer (a copy of the blocks), or NULL. */
uint8_t *blade_kv_wire_flatten(const blade_kv_wire_frame_out *out, size_t *len);

/* ---- receiving a frame ---- */

typedef struct blade_kv_wire_expect {
    const uint8_t *fingerprint;    /* the receiver's model; frames of another are refused */
    const blade_cluster_key *key;  /* NULL: the frame must carry a plain SHA-256 digest */
    uint64_t transfer_id;          /* the id the receiver handed out for this request */
    int32_t n_vocab;               /* token ids must be below it */
    int32_t max_tokens;            /* at most this many tokens (and BLADE_KV_WIRE_MAX_TOKENS) */
    /* Optional: the receiver's HAVE reply (n_held = the query's hash count). The frame must
     * then send exactly the blocks not held: every block past n_held and each i < n_held
     * with held[i] false. */
    const bool *held;
    int32_t n_held;
} blade_kv_wire_expect;

/* The fixed header's fields as sent. */
typedef struct blade_kv_wire_header {
    uint16_t version;
    uint16_t kind;
    uint32_t flags;
    uint64_t transfer_id;
    uint8_t fingerprint[BLADE_KV_WIRE_FINGERPRINT_BYTES];
    uint32_t kv_type, block_size, n_layer, n_head_kv, head_dim;
    uint64_t block_bytes;
    uint32_t n_tokens, n_sent;
    uint64_t payload_bytes;
    uint64_t frame_bytes; /* the whole frame's length these fields imply */
} blade_kv_wire_header;

/* Parses and checks a frame's fixed header (len >= BLADE_KV_WIRE_HEADER_BYTES) against the
 * expectations and the store's shape: what a receiver reads first, to know how many bytes
 * to accept before receiving the rest. 0, or -1 with the reason in err. */
int blade_kv_wire_peek(const void *buf, size_t len, const blade_kv_wire_expect *x, const blade_kv_store *store,
                       blade_kv_wire_header *h, blade_error *err);

/* What a decoded frame said. Arrays are malloc'd; free with blade_kv_wire_received_free. */
typedef struct blade_kv_wire_received {
    uint64_t transfer_id;
    int32_t *tokens;
    int32_t n_tokens;
    uint8_t (*hashes)[BLADE_HASH_BYTES]; /* n_tokens / block_size */
    int32_t n_hashes;
    int32_t n_blocks;    /* logical blocks: ceil(n_tokens / block_size) */
    int32_t *sent;       /* logical index of each block that travelled */
    int32_t n_sent;
} blade_kv_wire_received;
void blade_kv_wire_received_free(blade_kv_wire_received *r);

/* Checks the whole frame (header, sizes, token ids, block order, digest) and only then
 * copies sent block j into physical block dst_blocks[j] of store, for j < n_sent. dst_blocks
 * are the n_dst free blocks the receiver offers; a frame sending more is refused. On any
 * refusal (-1, reason in err) nothing is written to the store. */
int blade_kv_wire_decode(const void *frame, size_t len, const blade_kv_wire_expect *x, const blade_kv_store *store,
                         const int32_t *dst_blocks, int32_t n_dst, blade_kv_wire_received *out, blade_error *err);

/* The largest frame a receiver offering n_blocks free blocks for at most max_tokens tokens
 * can be sent: the bound to give a transport's receive. */
size_t blade_kv_wire_max_frame_bytes(const blade_kv_store *store, int32_t max_tokens, int32_t n_blocks);

/* ---- which blocks the receiver already holds ---- */

/* A HAVE query for n hashes, malloc'd into *msg. */
int blade_kv_wire_have_query(const uint8_t *fingerprint, uint64_t transfer_id, const uint8_t (*hashes)[BLADE_HASH_BYTES],
                             int32_t n, const blade_cluster_key *key, uint8_t **msg, size_t *len, blade_error *err);
/* Checks a HAVE query against the receiver's fingerprint and key (at most max_hashes) and
 * returns its transfer id and hashes (malloc'd). */
int blade_kv_wire_have_query_parse(const void *msg, size_t len, const uint8_t *fingerprint,
                                   const blade_cluster_key *key, int32_t max_hashes, uint64_t *transfer_id,
                                   uint8_t (**hashes)[BLADE_HASH_BYTES], int32_t *n, blade_error *err);
/* A HAVE reply: have[i] true where the receiver holds hash i of the query. */
int blade_kv_wire_have_reply(uint64_t transfer_id, const bool *have, int32_t n, const blade_cluster_key *key,
                             uint8_t **msg, size_t *len, blade_error *err);
/* Checks a HAVE reply for the query the sender made (its transfer id and n hashes) and
 * fills have[n]. */
int blade_kv_wire_have_reply_parse(const void *msg, size_t len, uint64_t transfer_id, int32_t n,
                                   const blade_cluster_key *key, bool *have, blade_error *err);

#endif

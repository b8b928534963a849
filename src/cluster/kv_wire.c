/* The KV transfer wire format (kv_wire.h): encoding a request's blocks from a paged store
 * into a frame whose payload points at the blocks themselves, and decoding a hostile frame
 * into offered free blocks only once every field and the digest have been checked. */

#include "blade/kv_wire.h"

#include <stdlib.h>
#include <string.h>

static const uint8_t magic[4] = {'B', 'L', 'K', 'V'};
#define FLAG_KEYED 1u
#define HAVE_QUERY_FIXED 64
#define HAVE_REPLY_FIXED 32

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

/* The 24 bytes every message starts with. */
static void put_prefix(uint8_t *p, uint16_t kind, const blade_cluster_key *key, uint32_t fixed_bytes, uint64_t id)
{
    memcpy(p, magic, 4);
    put16(p + 4, BLADE_KV_WIRE_VERSION);
    put16(p + 6, kind);
    put32(p + 8, key ? FLAG_KEYED : 0);
    put32(p + 12, fixed_bytes);
    put64(p + 16, id);
}

static const char *kind_name(uint16_t kind)
{
    switch (kind) {
    case BLADE_KV_WIRE_FRAME:
        return "KV frame";
    case BLADE_KV_WIRE_HAVE_QUERY:
        return "HAVE query";
    case BLADE_KV_WIRE_HAVE_REPLY:
        return "HAVE reply";
    }
    return "message";
}

static int check_prefix(const uint8_t *p, size_t len, uint16_t kind, uint32_t fixed_bytes, const blade_cluster_key *key,
                        blade_error *err)
{
    const char *what = kind_name(kind);
    if (len < fixed_bytes)
        return blade_error_set(err, "%s truncated: %zu bytes, its fixed header alone has %u", what, len, fixed_bytes);
    if (memcmp(p, magic, 4))
        return blade_error_set(err, "%s: bad magic %02x %02x %02x %02x (not a blade KV message)", what, p[0], p[1],
                               p[2], p[3]);
    if (get16(p + 4) != BLADE_KV_WIRE_VERSION)
        return blade_error_set(err, "%s: wire version %u, this blade speaks %d", what, get16(p + 4),
                               BLADE_KV_WIRE_VERSION);
    if (get16(p + 6) != kind)
        return blade_error_set(err, "%s expected, got message kind %u", what, get16(p + 6));
    uint32_t flags = get32(p + 8);
    if (flags & ~FLAG_KEYED)
        return blade_error_set(err, "%s: unknown flags 0x%x", what, flags);
    if (key && !(flags & FLAG_KEYED))
        return blade_error_set(err, "%s carries no HMAC but this cluster has a key: the sender lacks the key", what);
    if (!key && (flags & FLAG_KEYED))
        return blade_error_set(err, "%s carries an HMAC but this node has no cluster key to check it", what);
    if (get32(p + 12) != fixed_bytes)
        return blade_error_set(err, "%s: header of %u bytes, expected %u", what, get32(p + 12), fixed_bytes);
    return 0;
}

/* The digest trailing msg[0..len): checked before any content is believed. */
static int check_digest(const uint8_t *msg, size_t len, const blade_cluster_key *key, const char *what, blade_error *err)
{
    if (!blade_cluster_verify(key, msg, len - BLADE_CLUSTER_MAC_BYTES, msg + len - BLADE_CLUSTER_MAC_BYTES))
        return blade_error_set(err, "%s: %s mismatch (corrupted in transit%s)", what, key ? "HMAC" : "checksum",
                               key ? " or sent by a peer without the cluster key" : "");
    return 0;
}

/* a * b and a + b into *out; false on overflow. */
static bool mul_ok(uint64_t a, uint64_t b, uint64_t *out)
{
    if (b != 0 && a > UINT64_MAX / b)
        return false;
    *out = a * b;
    return true;
}
static bool add_ok(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a > UINT64_MAX - b)
        return false;
    *out = a + b;
    return true;
}

static int32_t blocks_for(int64_t n_tokens, int32_t block_size)
{
    return (int32_t)((n_tokens + block_size - 1) / block_size);
}

/* Bytes of the tables after the fixed header. */
static uint64_t tables_bytes(uint64_t n_tokens, uint64_t n_hashes, uint64_t n_sent)
{
    return 4 * n_tokens + BLADE_HASH_BYTES * n_hashes + 4 * n_sent;
}

/* ---- encoding ---- */

static int add_piece(blade_kv_wire_frame_out *out, uint8_t *p, size_t len)
{
    if (out->n_iov > 0) {
        struct iovec *last = &out->iov[out->n_iov - 1];
        if ((uint8_t *)last->iov_base + last->iov_len == p) {
            last->iov_len += len;
            return 0;
        }
    }
    out->iov[out->n_iov++] = (struct iovec){.iov_base = p, .iov_len = len};
    return 0;
}

int blade_kv_wire_encode(const blade_kv_wire_source *src, const blade_cluster_key *key, blade_kv_wire_frame_out *out,
                         blade_error *err)
{
    memset(out, 0, sizeof *out);
    const blade_kv_store *s = src->store;
    if (src->n_tokens <= 0 || src->n_tokens > BLADE_KV_WIRE_MAX_TOKENS)
        return blade_error_set(err, "KV frame: %d tokens (1 to %d can travel)", src->n_tokens,
                               BLADE_KV_WIRE_MAX_TOKENS);
    int32_t n_blocks = blocks_for(src->n_tokens, s->block_size), n_hashes = src->n_tokens / s->block_size;
    int32_t n_sent = 0;
    for (int32_t i = 0; i < n_blocks; i++) {
        if (src->blocks[i] < 0 || src->blocks[i] >= s->n_blocks)
            return blade_error_set(err, "KV frame: logical block %d is physical block %d, outside the store's %d", i,
                                   src->blocks[i], s->n_blocks);
        n_sent += !(src->skip && src->skip[i]);
    }
    for (int32_t i = 0; i < src->n_tokens; i++)
        if (src->tokens[i] < 0)
            return blade_error_set(err, "KV frame: token %d has the negative id %d", i, src->tokens[i]);

    uint64_t payload = (uint64_t)s->n_layer * 2 * (uint64_t)n_sent * s->block_stride;
    out->head_len = BLADE_KV_WIRE_HEADER_BYTES + tables_bytes((uint64_t)src->n_tokens, (uint64_t)n_hashes, (uint64_t)n_sent);
    out->frame_bytes = out->head_len + payload + BLADE_CLUSTER_MAC_BYTES;
    out->n_sent = n_sent;
    out->head = malloc(out->head_len);
    out->iov = malloc(((size_t)s->n_layer * 2 * (size_t)n_sent + 1) * sizeof *out->iov);
    if (!out->head || !out->iov) {
        blade_kv_wire_frame_out_free(out);
        return blade_error_set(err, "KV frame: out of memory for %d tokens", src->n_tokens);
    }

    uint8_t *h = out->head;
    put_prefix(h, BLADE_KV_WIRE_FRAME, key, BLADE_KV_WIRE_HEADER_BYTES, src->transfer_id);
    memcpy(h + 24, src->fingerprint, BLADE_KV_WIRE_FINGERPRINT_BYTES);
    put32(h + 56, (uint32_t)s->type);
    put32(h + 60, (uint32_t)s->block_size);
    put32(h + 64, (uint32_t)s->n_layer);
    put32(h + 68, (uint32_t)s->n_head_kv);
    put32(h + 72, (uint32_t)s->head_dim);
    put32(h + 76, 0);
    put64(h + 80, s->block_stride);
    put32(h + 88, (uint32_t)src->n_tokens);
    put32(h + 92, (uint32_t)n_sent);
    put64(h + 96, payload);
    uint8_t *p = h + BLADE_KV_WIRE_HEADER_BYTES;
    for (int32_t i = 0; i < src->n_tokens; i++, p += 4)
        put32(p, (uint32_t)src->tokens[i]);
    for (int32_t i = 0; i < n_hashes; i++, p += BLADE_HASH_BYTES)
        memcpy(p, src->hashes[i], BLADE_HASH_BYTES);
    for (int32_t i = 0; i < n_blocks; i++)
        if (!(src->skip && src->skip[i])) {
            put32(p, (uint32_t)i);
            p += 4;
        }

    for (int32_t l = 0; l < s->n_layer; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int32_t i = 0; i < n_blocks; i++)
                if (!(src->skip && src->skip[i]))
                    add_piece(out, kv ? blade_kv_store_v(s, l, src->blocks[i], 0) : blade_kv_store_k(s, l, src->blocks[i], 0),
                              s->block_stride);

    blade_cluster_mac *m = blade_cluster_mac_begin(key, err);
    int rc = m ? blade_cluster_mac_update(m, out->head, out->head_len) : -1;
    for (size_t i = 0; rc == 0 && i < out->n_iov; i++)
        rc = blade_cluster_mac_update(m, out->iov[i].iov_base, out->iov[i].iov_len);
    if (m && rc != 0)
        blade_cluster_mac_abort(m);
    else if (m)
        rc = blade_cluster_mac_end(m, out->digest);
    if (rc != 0) {
        blade_kv_wire_frame_out_free(out);
        return blade_error_set(err, "KV frame: libcrypto failed computing the digest");
    }
    return 0;
}

void blade_kv_wire_frame_out_free(blade_kv_wire_frame_out *out)
{
    free(out->head);
    free(out->iov);
    memset(out, 0, sizeof *out);
}

uint8_t *blade_kv_wire_flatten(const blade_kv_wire_frame_out *out, size_t *len)
{
    uint8_t *buf = malloc(out->frame_bytes);
    if (!buf)
        return NULL;
    uint8_t *p = buf;
    memcpy(p, out->head, out->head_len);
    p += out->head_len;
    for (size_t i = 0; i < out->n_iov; i++) {
        memcpy(p, out->iov[i].iov_base, out->iov[i].iov_len);
        p += out->iov[i].iov_len;
    }
    memcpy(p, out->digest, BLADE_CLUSTER_MAC_BYTES);
    *len = out->frame_bytes;
    return buf;
}

/* ---- decoding ---- */

int blade_kv_wire_peek(const void *buf, size_t len, const blade_kv_wire_expect *x, const blade_kv_store *s,
                       blade_kv_wire_header *h, blade_error *err)
{
    const uint8_t *p = buf;
    if (check_prefix(p, len, BLADE_KV_WIRE_FRAME, BLADE_KV_WIRE_HEADER_BYTES, x->key, err))
        return -1;
    memset(h, 0, sizeof *h);
    h->version = get16(p + 4);
    h->kind = get16(p + 6);
    h->flags = get32(p + 8);
    h->transfer_id = get64(p + 16);
    memcpy(h->fingerprint, p + 24, BLADE_KV_WIRE_FINGERPRINT_BYTES);
    h->kv_type = get32(p + 56);
    h->block_size = get32(p + 60);
    h->n_layer = get32(p + 64);
    h->n_head_kv = get32(p + 68);
    h->head_dim = get32(p + 72);
    h->block_bytes = get64(p + 80);
    h->n_tokens = get32(p + 88);
    h->n_sent = get32(p + 92);
    h->payload_bytes = get64(p + 96);

    if (h->transfer_id != x->transfer_id)
        return blade_error_set(err, "KV frame for transfer %llu, expected transfer %llu (stale or replayed)",
                               (unsigned long long)h->transfer_id, (unsigned long long)x->transfer_id);
    if (memcmp(h->fingerprint, x->fingerprint, BLADE_KV_WIRE_FINGERPRINT_BYTES))
        return blade_error_set(err, "KV frame from another model: its fingerprint differs from this worker's");
    if (h->kv_type != (uint32_t)s->type)
        return blade_error_set(err, "KV frame of KV type %u (%s), this store holds %s", h->kv_type,
                               h->kv_type < BLADE_KV_TYPE_COUNT ? blade_kv_type_name((blade_kv_type)h->kv_type) : "unknown",
                               blade_kv_type_name(s->type));
    if (h->block_size != (uint32_t)s->block_size || h->n_layer != (uint32_t)s->n_layer ||
        h->n_head_kv != (uint32_t)s->n_head_kv || h->head_dim != (uint32_t)s->head_dim)
        return blade_error_set(err,
                               "KV frame shape (block size %u, %u layers, %u KV heads, head dim %u) differs from "
                               "this store's (%d, %d, %d, %d)",
                               h->block_size, h->n_layer, h->n_head_kv, h->head_dim, s->block_size, s->n_layer,
                               s->n_head_kv, s->head_dim);
    if (get32(p + 76) != 0)
        return blade_error_set(err, "KV frame: reserved header field is %u, must be 0", get32(p + 76));
    if (h->block_bytes != s->block_stride)
        return blade_error_set(err, "KV frame: %llu bytes per block and layer, this store lays out %zu",
                               (unsigned long long)h->block_bytes, s->block_stride);
    int64_t max_tokens = x->max_tokens < BLADE_KV_WIRE_MAX_TOKENS ? x->max_tokens : BLADE_KV_WIRE_MAX_TOKENS;
    if (h->n_tokens == 0 || h->n_tokens > max_tokens)
        return blade_error_set(err, "KV frame of %u tokens: 1 to %lld accepted", h->n_tokens, (long long)max_tokens);
    int32_t n_blocks = blocks_for(h->n_tokens, s->block_size);
    if (h->n_sent > (uint32_t)n_blocks)
        return blade_error_set(err, "KV frame sends %u blocks of a request that has %d", h->n_sent, n_blocks);
    uint64_t payload = 0, frame;
    if (!mul_ok((uint64_t)s->n_layer * 2 * h->n_sent, h->block_bytes, &payload) || payload != h->payload_bytes)
        return blade_error_set(err, "KV frame: payload of %llu bytes, %u blocks x %u layers x K,V x %llu bytes make %llu",
                               (unsigned long long)h->payload_bytes, h->n_sent, h->n_layer,
                               (unsigned long long)h->block_bytes, (unsigned long long)payload);
    frame = BLADE_KV_WIRE_HEADER_BYTES + tables_bytes(h->n_tokens, h->n_tokens / h->block_size, h->n_sent) +
            BLADE_CLUSTER_MAC_BYTES;
    if (!add_ok(frame, payload, &frame))
        return blade_error_set(err, "KV frame: size overflows");
    h->frame_bytes = frame;
    return 0;
}

void blade_kv_wire_received_free(blade_kv_wire_received *r)
{
    free(r->tokens);
    free(r->hashes);
    free(r->sent);
    memset(r, 0, sizeof *r);
}

int blade_kv_wire_decode(const void *frame, size_t len, const blade_kv_wire_expect *x, const blade_kv_store *s,
                         const int32_t *dst_blocks, int32_t n_dst, blade_kv_wire_received *out, blade_error *err)
{
    memset(out, 0, sizeof *out);
    blade_kv_wire_header h;
    if (blade_kv_wire_peek(frame, len, x, s, &h, err))
        return -1;
    if (len < h.frame_bytes)
        return blade_error_set(err, "KV frame truncated: %zu of its %llu bytes arrived", len,
                               (unsigned long long)h.frame_bytes);
    if (len > h.frame_bytes)
        return blade_error_set(err, "KV frame of %llu bytes followed by %llu unexpected bytes",
                               (unsigned long long)h.frame_bytes, (unsigned long long)(len - h.frame_bytes));
    if (h.n_sent > (uint32_t)n_dst)
        return blade_error_set(err, "KV frame sends %u blocks, only %d free blocks were offered for it", h.n_sent, n_dst);
    for (uint32_t j = 0; j < h.n_sent; j++)
        if (dst_blocks[j] < 0 || dst_blocks[j] >= s->n_blocks)
            return blade_error_set(err, "KV frame: destination block %d is outside the store's %d", dst_blocks[j],
                                   s->n_blocks);
    const uint8_t *p = frame;
    if (check_digest(p, len, x->key, "KV frame", err))
        return -1;

    const uint8_t *tok = p + BLADE_KV_WIRE_HEADER_BYTES;
    int32_t n_hashes = (int32_t)(h.n_tokens / h.block_size), n_blocks = blocks_for(h.n_tokens, s->block_size);
    const uint8_t *hashes = tok + 4 * (size_t)h.n_tokens;
    const uint8_t *sent = hashes + BLADE_HASH_BYTES * (size_t)n_hashes;
    for (uint32_t i = 0; i < h.n_tokens; i++) {
        uint32_t t = get32(tok + 4 * (size_t)i);
        if (t >= (uint32_t)x->n_vocab)
            return blade_error_set(err, "KV frame: token %u has id %u, outside the vocabulary of %d", i, t, x->n_vocab);
    }
    for (uint32_t j = 0; j < h.n_sent; j++) {
        uint32_t b = get32(sent + 4 * (size_t)j);
        if (b >= (uint32_t)n_blocks || (j > 0 && b <= get32(sent + 4 * (size_t)(j - 1))))
            return blade_error_set(err, "KV frame: sent block %u is logical block %u (indices must increase and stay below %d)",
                                   j, b, n_blocks);
    }
    if (x->held) {
        if (x->n_held != n_hashes)
            return blade_error_set(err, "KV frame has %d full blocks, the HAVE exchange covered %d", n_hashes, x->n_held);
        uint32_t j = 0;
        for (int32_t i = 0; i < n_blocks; i++) {
            bool want = i >= x->n_held || !x->held[i];
            bool got = j < h.n_sent && get32(sent + 4 * (size_t)j) == (uint32_t)i;
            if (want != got)
                return blade_error_set(err, "KV frame %s logical block %d, which this worker %s", got ? "sends" : "omits",
                                       i, got ? "already holds" : "lacks");
            j += got;
        }
    }

    out->tokens = malloc((size_t)h.n_tokens * sizeof *out->tokens);
    out->hashes = malloc(((size_t)n_hashes + 1) * sizeof *out->hashes);
    out->sent = malloc(((size_t)h.n_sent + 1) * sizeof *out->sent);
    if (!out->tokens || !out->hashes || !out->sent) {
        blade_kv_wire_received_free(out);
        return blade_error_set(err, "KV frame: out of memory for %u tokens", h.n_tokens);
    }
    out->transfer_id = h.transfer_id;
    out->n_tokens = (int32_t)h.n_tokens;
    out->n_hashes = n_hashes;
    out->n_blocks = n_blocks;
    out->n_sent = (int32_t)h.n_sent;
    for (uint32_t i = 0; i < h.n_tokens; i++)
        out->tokens[i] = (int32_t)get32(tok + 4 * (size_t)i);
    memcpy(out->hashes, hashes, BLADE_HASH_BYTES * (size_t)n_hashes);
    for (uint32_t j = 0; j < h.n_sent; j++)
        out->sent[j] = (int32_t)get32(sent + 4 * (size_t)j);

    const uint8_t *payload = sent + 4 * (size_t)h.n_sent;
    for (int32_t l = 0; l < s->n_layer; l++)
        for (int kv = 0; kv < 2; kv++)
            for (uint32_t j = 0; j < h.n_sent; j++, payload += s->block_stride)
                memcpy(kv ? blade_kv_store_v(s, l, dst_blocks[j], 0) : blade_kv_store_k(s, l, dst_blocks[j], 0), payload,
                       s->block_stride);
    return 0;
}

/* ---- the HAVE exchange ---- */

static int seal(uint8_t *msg, size_t len, const blade_cluster_key *key, const char *what, blade_error *err)
{
    if (blade_cluster_sign(key, msg, len - BLADE_CLUSTER_MAC_BYTES, msg + len - BLADE_CLUSTER_MAC_BYTES))
        return blade_error_set(err, "%s: libcrypto failed computing the digest", what);
    return 0;
}

int blade_kv_wire_have_query(const uint8_t *fingerprint, uint64_t transfer_id, const uint8_t (*hashes)[BLADE_HASH_BYTES],
                             int32_t n, const blade_cluster_key *key, uint8_t **msg, size_t *len, blade_error *err)
{
    *msg = NULL;
    if (n < 0 || n > BLADE_KV_WIRE_MAX_TOKENS)
        return blade_error_set(err, "HAVE query: %d hashes", n);
    *len = HAVE_QUERY_FIXED + (size_t)n * BLADE_HASH_BYTES + BLADE_CLUSTER_MAC_BYTES;
    uint8_t *m = calloc(1, *len);
    if (!m)
        return blade_error_set(err, "HAVE query: out of memory");
    put_prefix(m, BLADE_KV_WIRE_HAVE_QUERY, key, HAVE_QUERY_FIXED, transfer_id);
    memcpy(m + 24, fingerprint, BLADE_KV_WIRE_FINGERPRINT_BYTES);
    put32(m + 56, (uint32_t)n);
    if (n)
        memcpy(m + HAVE_QUERY_FIXED, hashes, (size_t)n * BLADE_HASH_BYTES);
    if (seal(m, *len, key, "HAVE query", err)) {
        free(m);
        return -1;
    }
    *msg = m;
    return 0;
}

int blade_kv_wire_have_query_parse(const void *msg, size_t len, const uint8_t *fingerprint,
                                   const blade_cluster_key *key, int32_t max_hashes, uint64_t *transfer_id,
                                   uint8_t (**hashes)[BLADE_HASH_BYTES], int32_t *n, blade_error *err)
{
    const uint8_t *m = msg;
    *hashes = NULL;
    if (check_prefix(m, len, BLADE_KV_WIRE_HAVE_QUERY, HAVE_QUERY_FIXED, key, err))
        return -1;
    uint32_t count = get32(m + 56);
    if (get32(m + 60) != 0)
        return blade_error_set(err, "HAVE query: reserved field is %u, must be 0", get32(m + 60));
    if (count > (uint32_t)max_hashes)
        return blade_error_set(err, "HAVE query of %u hashes, at most %d accepted", count, max_hashes);
    size_t want = HAVE_QUERY_FIXED + (size_t)count * BLADE_HASH_BYTES + BLADE_CLUSTER_MAC_BYTES;
    if (len != want)
        return blade_error_set(err, "HAVE query of %u hashes has %zu bytes, expected %zu", count, len, want);
    if (check_digest(m, len, key, "HAVE query", err))
        return -1;
    if (memcmp(m + 24, fingerprint, BLADE_KV_WIRE_FINGERPRINT_BYTES))
        return blade_error_set(err, "HAVE query from another model: its fingerprint differs from this worker's");
    *hashes = malloc(((size_t)count + 1) * BLADE_HASH_BYTES);
    if (!*hashes)
        return blade_error_set(err, "HAVE query: out of memory");
    memcpy(*hashes, m + HAVE_QUERY_FIXED, (size_t)count * BLADE_HASH_BYTES);
    *transfer_id = get64(m + 16);
    *n = (int32_t)count;
    return 0;
}

int blade_kv_wire_have_reply(uint64_t transfer_id, const bool *have, int32_t n, const blade_cluster_key *key,
                             uint8_t **msg, size_t *len, blade_error *err)
{
    *msg = NULL;
    if (n < 0 || n > BLADE_KV_WIRE_MAX_TOKENS)
        return blade_error_set(err, "HAVE reply: %d hashes", n);
    *len = HAVE_REPLY_FIXED + ((size_t)n + 7) / 8 + BLADE_CLUSTER_MAC_BYTES;
    uint8_t *m = calloc(1, *len);
    if (!m)
        return blade_error_set(err, "HAVE reply: out of memory");
    put_prefix(m, BLADE_KV_WIRE_HAVE_REPLY, key, HAVE_REPLY_FIXED, transfer_id);
    put32(m + 24, (uint32_t)n);
    for (int32_t i = 0; i < n; i++)
        if (have[i])
            m[HAVE_REPLY_FIXED + i / 8] |= (uint8_t)(1u << (i % 8));
    if (seal(m, *len, key, "HAVE reply", err)) {
        free(m);
        return -1;
    }
    *msg = m;
    return 0;
}

int blade_kv_wire_have_reply_parse(const void *msg, size_t len, uint64_t transfer_id, int32_t n,
                                   const blade_cluster_key *key, bool *have, blade_error *err)
{
    const uint8_t *m = msg;
    if (check_prefix(m, len, BLADE_KV_WIRE_HAVE_REPLY, HAVE_REPLY_FIXED, key, err))
        return -1;
    size_t want = HAVE_REPLY_FIXED + ((size_t)n + 7) / 8 + BLADE_CLUSTER_MAC_BYTES;
    if (get32(m + 24) != (uint32_t)n || get32(m + 28) != 0 || len != want)
        return blade_error_set(err, "HAVE reply for %u hashes in %zu bytes, the query had %d (%zu bytes)", get32(m + 24),
                               len, n, want);
    if (check_digest(m, len, key, "HAVE reply", err))
        return -1;
    if (get64(m + 16) != transfer_id)
        return blade_error_set(err, "HAVE reply for transfer %llu, expected %llu", (unsigned long long)get64(m + 16),
                               (unsigned long long)transfer_id);
    const uint8_t *bits = m + HAVE_REPLY_FIXED;
    for (int32_t i = 0; i < n; i++)
        have[i] = (bits[i / 8] >> (i % 8)) & 1;
    /* Padding bits set are a malformed reply, not a harmless one: the peer is not blade. */
    if (n % 8 && (bits[n / 8] >> (n % 8)))
        return blade_error_set(err, "HAVE reply: bits set past its %d hashes", n);
    return 0;
}

size_t blade_kv_wire_max_frame_bytes(const blade_kv_store *s, int32_t max_tokens, int32_t n_blocks)
{
    if (max_tokens <= 0 || max_tokens > BLADE_KV_WIRE_MAX_TOKENS || n_blocks < 0)
        return 0;
    int32_t n_total = blocks_for(max_tokens, s->block_size);
    uint64_t n_sent = (uint64_t)(n_blocks < n_total ? n_blocks : n_total), payload;
    if (!mul_ok((uint64_t)s->n_layer * 2 * n_sent, s->block_stride, &payload) || payload > SIZE_MAX / 2)
        return 0;
    return BLADE_KV_WIRE_HEADER_BYTES +
           tables_bytes((uint64_t)max_tokens, (uint64_t)(max_tokens / s->block_size), n_sent) + payload +
           BLADE_CLUSTER_MAC_BYTES;
}

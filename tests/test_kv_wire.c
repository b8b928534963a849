/* The KV transfer wire format: frames round-trip bit-exactly between two stores, the HAVE
 * exchange sends only missing blocks, and every kind of bad frame (wrong model, shape,
 * key, size, token ids, block counts; random corruptions and truncations of real frames)
 * is refused with its reason and leaves the destination store untouched. */

#include "testutil.h"

#include "blade/kv_wire.h"

#include <stdlib.h>
#include <string.h>

#define N_LAYER 3
#define N_HEAD 2
#define HEAD_DIM 8
#define BS 4
#define N_BLOCKS 32
#define N_TOKENS 13 /* three full blocks and one partial */
#define N_VOCAB 1000

static const uint8_t fingerprint[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
static const int32_t src_blocks[4] = {5, 9, 10, 2};
static const int32_t dst_blocks[4] = {1, 2, 3, 7};

typedef struct fixture {
    blade_kv_store *src, *dst;
    int32_t tokens[N_TOKENS];
    uint8_t hashes[N_TOKENS / BS][BLADE_HASH_BYTES];
    blade_cluster_key key;
    uint8_t *snapshot; /* dst's K then V areas before decoding */
    size_t area;
} fixture;

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static blade_kv_store *new_store(blade_kv_type type, int32_t block_size, int32_t n_layer)
{
    blade_kv_store_config cfg = {.n_layer = n_layer, .n_head_kv = N_HEAD, .head_dim = HEAD_DIM, .type = type,
                                 .block_size = block_size, .n_blocks = N_BLOCKS};
    blade_error err = {0};
    blade_kv_store *s = blade_kv_store_new(&cfg, &err);
    assert_non_null(s);
    size_t area = (size_t)s->n_layer * s->n_blocks * s->block_stride;
    for (size_t i = 0; i < area; i++) {
        s->k[i] = (uint8_t)rnd();
        s->v[i] = (uint8_t)rnd();
    }
    return s;
}

static void snapshot(fixture *f)
{
    free(f->snapshot);
    f->area = (size_t)f->dst->n_layer * f->dst->n_blocks * f->dst->block_stride;
    f->snapshot = malloc(2 * f->area);
    memcpy(f->snapshot, f->dst->k, f->area);
    memcpy(f->snapshot + f->area, f->dst->v, f->area);
}

static bool dst_untouched(const fixture *f)
{
    return !memcmp(f->snapshot, f->dst->k, f->area) && !memcmp(f->snapshot + f->area, f->dst->v, f->area);
}

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    f->src = new_store(BLADE_KV_F16, BS, N_LAYER);
    f->dst = new_store(BLADE_KV_F16, BS, N_LAYER);
    for (int i = 0; i < N_TOKENS; i++)
        f->tokens[i] = (int32_t)(rnd() % N_VOCAB);
    for (size_t i = 0; i < sizeof f->hashes; i++)
        ((uint8_t *)f->hashes)[i] = (uint8_t)rnd();
    memcpy(f->key.bytes, "a cluster secret of 32 bytes....", 32);
    f->key.len = 32;
    snapshot(f);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    blade_kv_store_free(f->src);
    blade_kv_store_free(f->dst);
    free(f->snapshot);
    free(f);
    return 0;
}

static blade_kv_wire_source source(const fixture *f, const bool *skip)
{
    return (blade_kv_wire_source){.store = f->src, .fingerprint = fingerprint, .transfer_id = 42,
                                  .tokens = f->tokens, .n_tokens = N_TOKENS,
                                  .hashes = (const uint8_t (*)[BLADE_HASH_BYTES])f->hashes, .blocks = src_blocks,
                                  .skip = skip};
}

static blade_kv_wire_expect expect(const fixture *f, bool keyed)
{
    return (blade_kv_wire_expect){.fingerprint = fingerprint, .key = keyed ? &f->key : NULL, .transfer_id = 42,
                                  .n_vocab = N_VOCAB, .max_tokens = 4096};
}

static uint8_t *encode(const fixture *f, bool keyed, const bool *skip, size_t *len)
{
    blade_kv_wire_source src = source(f, skip);
    blade_kv_wire_frame_out out;
    blade_error err = {0};
    assert_int_equal(blade_kv_wire_encode(&src, keyed ? &f->key : NULL, &out, &err), 0);
    uint8_t *frame = blade_kv_wire_flatten(&out, len);
    assert_non_null(frame);
    blade_kv_wire_frame_out_free(&out);
    return frame;
}

/* Block `from` of src equals block `to` of dst in every layer, K and V. */
static bool same_block(const fixture *f, int32_t from, int32_t to)
{
    for (int32_t l = 0; l < N_LAYER; l++)
        if (memcmp(blade_kv_store_k(f->src, l, from, 0), blade_kv_store_k(f->dst, l, to, 0), f->src->block_stride) ||
            memcmp(blade_kv_store_v(f->src, l, from, 0), blade_kv_store_v(f->dst, l, to, 0), f->src->block_stride))
            return false;
    return true;
}

static void test_round_trip(void **state)
{
    fixture *f = *state;
    for (int keyed = 0; keyed < 2; keyed++) {
        size_t len;
        uint8_t *frame = encode(f, keyed, NULL, &len);
        size_t expect_len = BLADE_KV_WIRE_HEADER_BYTES + 4 * N_TOKENS + 32 * (N_TOKENS / BS) + 4 * 4 +
                            (size_t)N_LAYER * 2 * 4 * f->src->block_stride + 32;
        assert_int_equal(len, expect_len);
        blade_kv_wire_expect x = expect(f, keyed);
        blade_kv_wire_received r;
        blade_error err = {0};
        int rc = blade_kv_wire_decode(frame, len, &x, f->dst, dst_blocks, 4, &r, &err);
        if (rc)
            fail_msg("%s", err.msg);
        assert_int_equal(r.transfer_id, 42);
        assert_int_equal(r.n_tokens, N_TOKENS);
        assert_memory_equal(r.tokens, f->tokens, sizeof f->tokens);
        assert_int_equal(r.n_hashes, N_TOKENS / BS);
        assert_memory_equal(r.hashes, f->hashes, sizeof f->hashes);
        assert_int_equal(r.n_blocks, 4);
        assert_int_equal(r.n_sent, 4);
        for (int j = 0; j < 4; j++) {
            assert_int_equal(r.sent[j], j);
            assert_true(same_block(f, src_blocks[j], dst_blocks[j]));
        }
        /* Blocks not offered are exactly as before. */
        for (int32_t b = 0; b < N_BLOCKS; b++)
            if (b != 1 && b != 2 && b != 3 && b != 7)
                for (int32_t l = 0; l < N_LAYER; l++) {
                    size_t off = ((size_t)l * N_BLOCKS + b) * f->dst->block_stride;
                    assert_memory_equal(f->dst->k + off, f->snapshot + off, f->dst->block_stride);
                }
        blade_kv_wire_received_free(&r);
        free(frame);
    }
}

/* The payload pieces point into the store: the frame is sent from the blocks themselves,
 * and physically adjacent blocks (9, 10) travel as one piece. */
static void test_zero_copy_pieces(void **state)
{
    fixture *f = *state;
    blade_kv_wire_source src = source(f, NULL);
    blade_kv_wire_frame_out out;
    assert_int_equal(blade_kv_wire_encode(&src, NULL, &out, NULL), 0);
    assert_int_equal(out.n_iov, (size_t)N_LAYER * 2 * 3);
    assert_ptr_equal(out.iov[0].iov_base, blade_kv_store_k(f->src, 0, 5, 0));
    assert_ptr_equal(out.iov[1].iov_base, blade_kv_store_k(f->src, 0, 9, 0));
    assert_int_equal(out.iov[1].iov_len, 2 * f->src->block_stride);
    assert_ptr_equal(out.iov[3].iov_base, blade_kv_store_v(f->src, 0, 5, 0));
    blade_kv_wire_frame_out_free(&out);
}

static void test_have_exchange(void **state)
{
    fixture *f = *state;
    blade_error err = {0};
    uint8_t *q;
    size_t qlen;
    int32_t n_full = N_TOKENS / BS;
    assert_int_equal(blade_kv_wire_have_query(fingerprint, 42, (const uint8_t (*)[32])f->hashes, n_full, &f->key, &q,
                                              &qlen, &err), 0);
    uint64_t id;
    uint8_t(*hashes)[BLADE_HASH_BYTES];
    int32_t n;
    assert_int_equal(blade_kv_wire_have_query_parse(q, qlen, fingerprint, &f->key, 64, &id, &hashes, &n, &err), 0);
    assert_int_equal(id, 42);
    assert_int_equal(n, n_full);
    assert_memory_equal(hashes, f->hashes, sizeof f->hashes);
    /* Another model's worker, a smaller limit, a missing key: refused. */
    uint8_t other[32] = {9};
    uint8_t(*h2)[BLADE_HASH_BYTES];
    assert_int_equal(blade_kv_wire_have_query_parse(q, qlen, other, &f->key, 64, &id, &h2, &n, &err), -1);
    assert_non_null(strstr(err.msg, "another model"));
    assert_int_equal(blade_kv_wire_have_query_parse(q, qlen, fingerprint, &f->key, 2, &id, &h2, &n, &err), -1);
    assert_non_null(strstr(err.msg, "at most 2"));
    assert_int_equal(blade_kv_wire_have_query_parse(q, qlen, fingerprint, NULL, 64, &id, &h2, &n, &err), -1);
    assert_non_null(strstr(err.msg, "no cluster key"));
    q[qlen - 40] ^= 1;
    assert_int_equal(blade_kv_wire_have_query_parse(q, qlen, fingerprint, &f->key, 64, &id, &h2, &n, &err), -1);
    assert_non_null(strstr(err.msg, "HMAC mismatch"));
    free(q);
    free(hashes);

    /* The receiver holds the first two full blocks. */
    bool have[3] = {true, true, false};
    uint8_t *rep;
    size_t rlen;
    assert_int_equal(blade_kv_wire_have_reply(42, have, n_full, &f->key, &rep, &rlen, &err), 0);
    bool got[3];
    assert_int_equal(blade_kv_wire_have_reply_parse(rep, rlen, 42, n_full, &f->key, got, &err), 0);
    assert_memory_equal(got, have, sizeof have);
    assert_int_equal(blade_kv_wire_have_reply_parse(rep, rlen, 43, n_full, &f->key, got, &err), -1);
    assert_non_null(strstr(err.msg, "expected 43"));
    assert_int_equal(blade_kv_wire_have_reply_parse(rep, rlen, 42, 2, &f->key, got, &err), -1);
    free(rep);

    bool skip[4] = {got[0], got[1], got[2], false};
    size_t len;
    uint8_t *frame = encode(f, true, skip, &len);
    blade_kv_wire_expect x = expect(f, true);
    x.held = got;
    x.n_held = n_full;
    blade_kv_wire_received r;
    /* Only two blocks travel, so two free blocks suffice. */
    int rc = blade_kv_wire_decode(frame, len, &x, f->dst, dst_blocks, 2, &r, &err);
    if (rc)
        fail_msg("%s", err.msg);
    assert_int_equal(r.n_sent, 2);
    assert_int_equal(r.sent[0], 2);
    assert_int_equal(r.sent[1], 3);
    assert_true(same_block(f, src_blocks[2], dst_blocks[0]));
    assert_true(same_block(f, src_blocks[3], dst_blocks[1]));
    blade_kv_wire_received_free(&r);

    /* A sender that ignores the reply (sends everything) is refused by a receiver that
     * checks it against its HAVE reply. */
    free(frame);
    snapshot(f);
    frame = encode(f, true, NULL, &len);
    assert_int_equal(blade_kv_wire_decode(frame, len, &x, f->dst, dst_blocks, 4, &r, &err), -1);
    assert_non_null(strstr(err.msg, "already holds"));
    assert_true(dst_untouched(f));
    free(frame);
}

/* Decoding `frame` must fail with `reason` in the message and write nothing. */
static void expect_refused(fixture *f, const uint8_t *frame, size_t len, const blade_kv_wire_expect *x,
                           const blade_kv_store *dst, int32_t n_dst, const char *reason)
{
    blade_kv_wire_received r;
    blade_error err = {0};
    int rc = blade_kv_wire_decode(frame, len, x, dst, dst_blocks, n_dst, &r, &err);
    if (rc == 0)
        fail_msg("frame accepted, expected refusal for '%s'", reason);
    if (!strstr(err.msg, reason))
        fail_msg("refused with '%s', expected '%s'", err.msg, reason);
    assert_true(dst_untouched(f));
}

static void test_refusals(void **state)
{
    fixture *f = *state;
    size_t len;
    uint8_t *frame = encode(f, true, NULL, &len);
    blade_kv_wire_expect x = expect(f, true);

    blade_kv_wire_expect other = x;
    uint8_t fp2[32] = {7};
    other.fingerprint = fp2;
    expect_refused(f, frame, len, &other, f->dst, 4, "another model");
    other = x;
    other.transfer_id = 41;
    expect_refused(f, frame, len, &other, f->dst, 4, "stale or replayed");
    other = x;
    other.key = NULL;
    expect_refused(f, frame, len, &other, f->dst, 4, "no cluster key");
    blade_cluster_key wrong = f->key;
    wrong.bytes[0] ^= 1;
    other = x;
    other.key = &wrong;
    expect_refused(f, frame, len, &other, f->dst, 4, "HMAC mismatch");
    other = x;
    other.n_vocab = 10;
    expect_refused(f, frame, len, &other, f->dst, 4, "outside the vocabulary");
    other = x;
    other.max_tokens = 12;
    expect_refused(f, frame, len, &other, f->dst, 4, "1 to 12 accepted");
    expect_refused(f, frame, len, &x, f->dst, 3, "only 3 free blocks");
    expect_refused(f, frame, len - 1, &x, f->dst, 4, "truncated");
    expect_refused(f, frame, 50, &x, f->dst, 4, "truncated");
    expect_refused(f, frame, 0, &x, f->dst, 4, "truncated");

    uint8_t *longer = malloc(len + 1);
    memcpy(longer, frame, len);
    longer[len] = 0;
    expect_refused(f, longer, len + 1, &x, f->dst, 4, "unexpected bytes");
    free(longer);

    /* Payload corruption is caught by the digest. */
    frame[len - 100] ^= 0x40;
    expect_refused(f, frame, len, &x, f->dst, 4, "HMAC mismatch");
    free(frame);

    /* An unkeyed frame to a keyed receiver. */
    frame = encode(f, false, NULL, &len);
    expect_refused(f, frame, len, &x, f->dst, 4, "carries no HMAC");
    blade_kv_wire_expect plain = expect(f, false);
    frame[len - 1] ^= 1;
    expect_refused(f, frame, len, &plain, f->dst, 4, "checksum mismatch");
    free(frame);

    /* Stores of another type, block size or depth. */
    frame = encode(f, true, NULL, &len);
    blade_kv_store *bf16 = new_store(BLADE_KV_BF16, BS, N_LAYER);
    blade_kv_store *big_blocks = new_store(BLADE_KV_F16, 2 * BS, N_LAYER);
    blade_kv_store *deeper = new_store(BLADE_KV_F16, BS, N_LAYER + 1);
    expect_refused(f, frame, len, &x, bf16, 4, "KV type 0 (f16), this store holds bf16");
    expect_refused(f, frame, len, &x, big_blocks, 4, "shape (block size 4, 3 layers");
    expect_refused(f, frame, len, &x, deeper, 4, "differs from this store's (4, 4, 2, 8)");
    blade_kv_store_free(bf16);
    blade_kv_store_free(big_blocks);
    blade_kv_store_free(deeper);
    free(frame);
}

/* Re-seals a frame after its body was changed, as a peer holding the key could. */
static void reseal(uint8_t *frame, size_t len, const blade_cluster_key *key)
{
    assert_int_equal(blade_cluster_sign(key, frame, len - 32, frame + len - 32), 0);
}

static void put32le(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Fields that only a sender with the key could forge: the digest matches, the content
 * must still be refused. */
static void test_refusals_of_sealed_lies(void **state)
{
    fixture *f = *state;
    blade_kv_wire_expect x = expect(f, true);
    size_t len;
    struct {
        size_t at;
        uint32_t value;
        const char *reason;
    } lies[] = {
        {88, 0, "KV frame of 0 tokens"},
        {92, 5, "sends 5 blocks of a request that has 4"},
        {96, 1, "payload of 1 bytes"},
        {76, 3, "reserved header field"},
        {80, 999, "999 bytes per block"},
        {BLADE_KV_WIRE_HEADER_BYTES + 4 * 2, 0xffffffffu, "token 2 has id 4294967295"},
        /* The sent-block list (after 13 tokens and 3 hashes): not increasing. */
        {BLADE_KV_WIRE_HEADER_BYTES + 4 * 13 + 32 * 3 + 4, 0, "indices must increase"},
        {BLADE_KV_WIRE_HEADER_BYTES + 4 * 13 + 32 * 3 + 12, 4, "logical block 4"},
        {4, 2, "wire version 2"},
        {6, 3, "KV frame expected, got message kind 3"},
        {8, 3, "unknown flags"},
        {12, 100, "header of 100 bytes"},
        {0, 0x4b4c4258, "bad magic"},
    };
    for (size_t i = 0; i < sizeof lies / sizeof lies[0]; i++) {
        uint8_t *frame = encode(f, true, NULL, &len);
        put32le(frame + lies[i].at, lies[i].value);
        reseal(frame, len, &f->key);
        expect_refused(f, frame, len, &x, f->dst, 4, lies[i].reason);
        free(frame);
    }
}

/* Random corruptions and truncations of real frames: every one is refused (the digest
 * covers every byte) and nothing is written. Then the same mutations re-sealed, as a peer
 * with the key could send them: each is refused or, if it still describes a valid
 * transfer, decoded into the offered blocks alone, never anywhere else. */
static void test_fuzz(void **state)
{
    fixture *f = *state;
    size_t len;
    uint8_t *good = encode(f, true, NULL, &len);
    uint8_t *frame = malloc(len + 64);
    blade_kv_wire_expect x = expect(f, true);
    int accepted = 0, sealed_refused = 0;
    for (int iter = 0; iter < 6000; iter++) {
        bool sealed = iter % 2;
        memcpy(frame, good, len);
        size_t n = len;
        switch (rnd() % 4) {
        case 0: /* a truncation */
            n = rnd() % len;
            break;
        case 1: /* bytes appended */
            n = len + 1 + rnd() % 63;
            for (size_t i = len; i < n; i++)
                frame[i] = (uint8_t)rnd();
            break;
        default: { /* 1 to 8 bytes changed, half of them in the header and tables */
            int k = 1 + (int)(rnd() % 8);
            size_t head = BLADE_KV_WIRE_HEADER_BYTES + 4 * N_TOKENS + 32 * 3 + 16;
            for (int j = 0; j < k; j++) {
                size_t at = (rnd() % 2) ? rnd() % head : rnd() % len;
                frame[at] ^= (uint8_t)(1 + rnd() % 255);
            }
        }
        }
        if (sealed && n > 32)
            reseal(frame, n, &f->key);
        blade_kv_wire_received r;
        blade_error err = {0};
        int rc = blade_kv_wire_decode(frame, n, &x, f->dst, dst_blocks, 4, &r, &err);
        if (rc == 0) {
            /* Only a re-sealed mutation of the payload or of fields that do not matter
             * (token ids within the vocabulary, hashes) can pass. */
            assert_true(sealed);
            accepted++;
            blade_kv_wire_received_free(&r);
            for (int32_t b = 0; b < N_BLOCKS; b++)
                if (b != 1 && b != 2 && b != 3 && b != 7)
                    for (int32_t l = 0; l < N_LAYER; l++) {
                        size_t off = ((size_t)l * N_BLOCKS + b) * f->dst->block_stride;
                        assert_memory_equal(f->dst->k + off, f->snapshot + off, f->dst->block_stride);
                        assert_memory_equal(f->dst->v + off, f->snapshot + f->area + off, f->dst->block_stride);
                    }
            snapshot(f);
        } else {
            assert_true(err.msg[0] != 0);
            assert_true(dst_untouched(f));
            sealed_refused += sealed;
        }
    }
    /* Both outcomes occurred, so the loop exercised the checks and the copy. */
    assert_true(accepted > 100);
    assert_true(sealed_refused > 100);
    free(frame);
    free(good);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_zero_copy_pieces, setup, teardown),
        cmocka_unit_test_setup_teardown(test_have_exchange, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refusals_of_sealed_lies, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fuzz, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* KV cache manager: prefix reuse and its n-1 rule, tenant isolation by salt, LRU eviction
 * order, pinning, all-or-nothing allocation, shared and duplicate blocks, the hash format,
 * a randomized stress run against a shadow of every block's contents, and the invariant
 * checker catching corrupted caller state. blade_kv_cache_check runs after every step. */
#include "testutil.h"

#include "blade/kv_cache.h"

#include <openssl/evp.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int32_t rand_below(uint64_t *s, int32_t n)
{
    return (int32_t)(splitmix(s) % (uint64_t)n);
}

static blade_kv_cache *new_cache(int32_t n_blocks, int32_t block_size, bool prefix_caching, uint8_t model)
{
    blade_kv_cache_config cfg = {.n_blocks = n_blocks, .block_size = block_size, .prefix_caching = prefix_caching};
    memset(cfg.model_id, model, sizeof cfg.model_id);
    blade_error err = {{0}};
    blade_kv_cache *c = blade_kv_cache_new(&cfg, &err);
    if (!c)
        fail_msg("blade_kv_cache_new: %s", err.msg);
    return c;
}

/* Typed, so va_arg reads back exactly the type that was passed. */
#define END ((blade_kv_cache_seq *)NULL)

/* Checks the cache against exactly the live sequences given (END-terminated). */
static void check_live(const blade_kv_cache *c, ...)
{
    const blade_kv_cache_seq *seqs[16];
    int32_t n = 0;
    va_list ap;
    va_start(ap, c);
    for (blade_kv_cache_seq *s; (s = va_arg(ap, blade_kv_cache_seq *)) != NULL;)
        seqs[n++] = s;
    va_end(ap);
    blade_error err = {{0}};
    if (blade_kv_cache_check(c, seqs, n, &err) != 0)
        fail_msg("invariant broken: %s", err.msg);
}

static blade_kv_cache_stats stats(const blade_kv_cache *c)
{
    blade_kv_cache_stats st;
    blade_kv_cache_stats_get(c, &st);
    return st;
}

static void fill_random(int32_t *t, int32_t n, uint64_t seed)
{
    for (int32_t i = 0; i < n; i++)
        t[i] = (int32_t)(splitmix(&seed) % 32000);
}

/* Matches, allocates for and commits a whole prompt, as the engine does for a prefill. */
static int32_t compute(blade_kv_cache *c, blade_kv_cache_seq *s, const int32_t *tokens, int32_t n)
{
    int32_t matched = blade_kv_cache_match_prefix(c, s, tokens, n);
    assert_int_equal(blade_kv_cache_allocate(c, s, n), 0);
    blade_kv_cache_commit(c, s, tokens, n);
    return matched;
}

/* How many tokens of tokens[0..n) a fresh sequence would find cached. Taking and dropping
 * the references makes the hit blocks the most recently used. */
static int32_t probe(blade_kv_cache *c, const char *salt, const int32_t *tokens, int32_t n)
{
    blade_kv_cache_seq s;
    blade_kv_cache_seq_init(&s, c, salt, salt ? strlen(salt) : 0);
    int32_t matched = blade_kv_cache_match_prefix(c, &s, tokens, n);
    blade_kv_cache_release(c, &s);
    blade_kv_cache_seq_destroy(&s);
    return matched;
}

static void sha256(const void *a, size_t na, const void *b, size_t nb, const void *d, size_t nd, uint8_t out[32])
{
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    unsigned int len = 0;
    assert_non_null(md);
    assert_int_equal(EVP_DigestInit_ex(md, EVP_sha256(), NULL), 1);
    assert_int_equal(EVP_DigestUpdate(md, a, na), 1);
    assert_int_equal(EVP_DigestUpdate(md, b, nb), 1);
    assert_int_equal(EVP_DigestUpdate(md, d, nd), 1);
    assert_int_equal(EVP_DigestFinal_ex(md, out, &len), 1);
    assert_int_equal(len, 32);
    EVP_MD_CTX_free(md);
}

/* ---- prefix reuse ---- */

static void test_prefix_reuse(void **state)
{
    (void)state;
    enum { N = 1000, SHARED = 960, BS = 16, BLOCKS = 128 };
    blade_kv_cache *c = new_cache(BLOCKS, BS, true, 1);
    int32_t a_tok[N], b_tok[N], a_table[N / BS + 1];
    fill_random(a_tok, N, 1);
    memcpy(b_tok, a_tok, sizeof b_tok);
    fill_random(b_tok + SHARED, N - SHARED, 2);
    b_tok[SHARED] = a_tok[SHARED] + 1;

    blade_kv_cache_seq a, b;
    blade_kv_cache_seq_init(&a, c, NULL, 0);
    assert_int_equal(compute(c, &a, a_tok, N), 0);
    assert_int_equal(a.n_blocks, 63);
    assert_int_equal(a.n_hashed, 62);
    check_live(c, &a, END);
    memcpy(a_table, a.blocks, sizeof a_table[0] * 63);
    blade_kv_cache_release(c, &a);
    check_live(c, END);
    blade_kv_cache_stats st = stats(c);
    assert_int_equal(st.blocks_cached, 62);
    assert_int_equal(st.blocks_free, BLOCKS - 62);
    assert_int_equal(st.blocks_used, 0);

    blade_kv_cache_seq_init(&b, c, NULL, 0);
    assert_int_equal(blade_kv_cache_match_prefix(c, &b, b_tok, N), SHARED);
    assert_int_equal(b.n_cached_tokens, SHARED);
    assert_int_equal(b.n_blocks, SHARED / BS);
    assert_int_equal(b.n_hashed, SHARED / BS);
    assert_memory_equal(b.blocks, a_table, sizeof a_table[0] * (SHARED / BS));
    check_live(c, &b, END);
    st = stats(c);
    assert_int_equal(st.blocks_used, 60);
    assert_int_equal(st.blocks_cached, 2);

    assert_int_equal(blade_kv_cache_allocate(c, &b, N), 0);
    assert_int_equal(b.n_blocks, 63);
    st = stats(c);
    assert_int_equal(st.blocks_free, BLOCKS - 62 - 3);
    assert_int_equal(st.evictions, 0);
    blade_kv_cache_commit(c, &b, b_tok, N);
    assert_int_equal(b.n_hashed, 62);
    check_live(c, &b, END);
    assert_int_equal(st.prefix_query_tokens, 2 * N);
    assert_int_equal(st.prefix_hit_tokens, SHARED);

    blade_kv_cache_release(c, &b);
    check_live(c, END);
    st = stats(c);
    assert_int_equal(st.blocks_cached, 64);
    assert_int_equal(st.blocks_free + st.blocks_cached, BLOCKS);
    /* Both continuations are now cached side by side. */
    assert_int_equal(probe(c, NULL, a_tok, N), 992);
    assert_int_equal(probe(c, NULL, b_tok, N), 992);
    blade_kv_cache_seq_destroy(&a);
    blade_kv_cache_seq_destroy(&b);
    blade_kv_cache_free(c);
}

static void test_match_leaves_one_token(void **state)
{
    (void)state;
    blade_kv_cache *c = new_cache(16, 16, true, 1);
    int32_t t[33];
    fill_random(t, 33, 3);
    blade_kv_cache_seq a;
    blade_kv_cache_seq_init(&a, c, NULL, 0);
    compute(c, &a, t, 32);
    assert_int_equal(a.n_hashed, 2);
    blade_kv_cache_release(c, &a);
    assert_int_equal(probe(c, NULL, t, 32), 16);
    assert_int_equal(probe(c, NULL, t, 33), 32);
    assert_int_equal(probe(c, NULL, t, 17), 16);
    assert_int_equal(probe(c, NULL, t, 16), 0);
    assert_int_equal(probe(c, NULL, t, 1), 0);
    assert_int_equal(probe(c, NULL, t, 0), 0);
    check_live(c, END);
    blade_kv_cache_seq_destroy(&a);
    blade_kv_cache_free(c);
}

/* ---- hashing and isolation ---- */

static void test_hash_format(void **state)
{
    (void)state;
    blade_kv_cache *c = new_cache(8, 4, true, 0x5a);
    uint8_t model[32], want[32];
    memset(model, 0x5a, sizeof model);
    blade_kv_cache_seq s;
    blade_kv_cache_seq_init(&s, c, "tenant", 6);
    assert_true(s.salt_hash_ok);
    sha256("blade-kv-root", 13, model, 32, "tenant", 6, want);
    assert_memory_equal(s.salt_hash, want, 32);

    const int32_t t[5] = {1, -2, 0x12345678, 7, 9};
    const uint8_t le[16] = {1, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff, 0x78, 0x56, 0x34, 0x12, 7, 0, 0, 0};
    compute(c, &s, t, 5);
    assert_int_equal(s.n_hashed, 1);
    sha256(s.salt_hash, 32, le, sizeof le, "", 0, want);
    assert_memory_equal(s.hashes[0], want, 32);

    /* No salt and an empty salt are the same tenant. */
    blade_kv_cache_seq u, v;
    blade_kv_cache_seq_init(&u, c, NULL, 0);
    blade_kv_cache_seq_init(&v, c, "x", 0);
    assert_memory_equal(u.salt_hash, v.salt_hash, 32);
    sha256("blade-kv-root", 13, model, 32, "", 0, want);
    assert_memory_equal(u.salt_hash, want, 32);

    blade_kv_cache_release(c, &s);
    blade_kv_cache_seq_destroy(&s);
    blade_kv_cache_seq_destroy(&u);
    blade_kv_cache_seq_destroy(&v);
    blade_kv_cache_free(c);
}

static void test_salts_isolate(void **state)
{
    (void)state;
    enum { N = 64 };
    blade_kv_cache *c = new_cache(32, 16, true, 1);
    int32_t t[N];
    fill_random(t, N, 4);
    blade_kv_cache_seq a, a2, b;
    blade_kv_cache_seq_init(&a, c, "tenant-a", 8);
    compute(c, &a, t, N);
    check_live(c, &a, END);

    /* Another tenant computes the same tokens into its own blocks, even while a's are live. */
    blade_kv_cache_seq_init(&b, c, "tenant-b", 8);
    assert_int_equal(compute(c, &b, t, N), 0);
    for (int32_t i = 0; i < b.n_blocks; i++)
        for (int32_t j = 0; j < a.n_blocks; j++)
            assert_int_not_equal(b.blocks[i], a.blocks[j]);
    for (int32_t i = 0; i < b.n_hashed; i++)
        assert_memory_not_equal(b.hashes[i], a.hashes[i], 32);
    check_live(c, &a, &b, END);
    blade_kv_cache_release(c, &a);
    blade_kv_cache_release(c, &b);
    check_live(c, END);

    assert_int_equal(probe(c, "tenant-c", t, N), 0);
    assert_int_equal(probe(c, NULL, t, N), 0);
    assert_int_equal(probe(c, "tenant-", t, N), 0);

    blade_kv_cache_seq_init(&a2, c, "tenant-a", 8);
    assert_int_equal(blade_kv_cache_match_prefix(c, &a2, t, N), 48);
    blade_kv_cache_seq_destroy(&a);
    blade_kv_cache_seq_init(&a, c, "tenant-a", 8);
    assert_int_equal(compute(c, &a, t, N), 48);
    assert_memory_equal(a.blocks, a2.blocks, 3 * sizeof a.blocks[0]);
    check_live(c, &a, &a2, END);
    blade_kv_cache_release(c, &a);
    blade_kv_cache_release(c, &a2);

    /* The model identity separates caches the same way a salt separates tenants. */
    blade_kv_cache *other = new_cache(32, 16, true, 2);
    blade_kv_cache_seq o;
    blade_kv_cache_seq_init(&o, other, "tenant-a", 8);
    assert_memory_not_equal(o.salt_hash, a.salt_hash, 32);
    blade_kv_cache_seq_destroy(&o);
    blade_kv_cache_free(other);

    blade_kv_cache_seq_destroy(&a);
    blade_kv_cache_seq_destroy(&a2);
    blade_kv_cache_seq_destroy(&b);
    blade_kv_cache_free(c);
}

static void test_prefix_caching_off(void **state)
{
    (void)state;
    enum { N = 64 };
    blade_kv_cache *c = new_cache(8, 16, false, 1);
    int32_t t[N];
    fill_random(t, N, 5);
    blade_kv_cache_seq a;
    blade_kv_cache_seq_init(&a, c, NULL, 0);
    assert_int_equal(compute(c, &a, t, N), 0);
    assert_int_equal(a.n_hashed, 0);
    check_live(c, &a, END);
    blade_kv_cache_release(c, &a);
    check_live(c, END);
    blade_kv_cache_stats st = stats(c);
    assert_int_equal(st.blocks_cached, 0);
    assert_int_equal(st.blocks_free, 8);
    assert_int_equal(probe(c, NULL, t, N), 0);
    assert_int_equal(blade_kv_cache_pin_prefix(c, t, N, NULL, 0), 0);
    st = stats(c);
    assert_int_equal(st.prefix_query_tokens, 2 * N);
    assert_int_equal(st.prefix_hit_tokens, 0);
    assert_int_equal(st.blocks_pinned, 0);
    blade_kv_cache_seq_destroy(&a);
    blade_kv_cache_free(c);
}

/* ---- eviction ---- */

enum { LRU_BS = 4, LRU_SEQS = 4 };

/* Four 2-block prompts A..D computed in order (physical blocks 0-1, 2-3, 4-5, 6-7), then
 * released in the order B, D, A, C. Each release queues the last block first, so the LRU
 * runs, oldest first: B1 B0 D1 D0 A1 A0 C1 C0. */
static blade_kv_cache *lru_scene(int32_t prompts[LRU_SEQS][2 * LRU_BS + 1])
{
    blade_kv_cache *c = new_cache(8, LRU_BS, true, 1);
    blade_kv_cache_seq s[LRU_SEQS];
    for (int i = 0; i < LRU_SEQS; i++) {
        fill_random(prompts[i], 2 * LRU_BS + 1, 100 + (uint64_t)i);
        blade_kv_cache_seq_init(&s[i], c, NULL, 0);
        compute(c, &s[i], prompts[i], 2 * LRU_BS);
        assert_int_equal(s[i].blocks[0], 2 * i);
        assert_int_equal(s[i].blocks[1], 2 * i + 1);
    }
    check_live(c, &s[0], &s[1], &s[2], &s[3], END);
    const int order[LRU_SEQS] = {1, 3, 0, 2};
    for (int i = 0; i < LRU_SEQS; i++) {
        blade_kv_cache_release(c, &s[order[i]]);
        blade_kv_cache_seq_destroy(&s[order[i]]);
    }
    check_live(c, END);
    assert_int_equal(stats(c).blocks_cached, 8);
    assert_int_equal(blade_kv_cache_available(c), 8);
    return c;
}

static void test_lru_eviction_order(void **state)
{
    (void)state;
    const int32_t evict_order[8] = {3, 2, 7, 6, 1, 0, 5, 4};
    for (int32_t k = 1; k <= 8; k++) {
        int32_t prompts[LRU_SEQS][2 * LRU_BS + 1];
        blade_kv_cache *c = lru_scene(prompts);
        blade_kv_cache_seq e;
        blade_kv_cache_seq_init(&e, c, NULL, 0);
        assert_int_equal(blade_kv_cache_allocate(c, &e, k * LRU_BS), 0);
        assert_memory_equal(e.blocks, evict_order, (size_t)k * sizeof evict_order[0]);
        assert_int_equal(stats(c).evictions, (uint64_t)k);
        check_live(c, &e, END);
        /* A prompt keeps as many tokens as its leading blocks that survived. */
        for (int i = 0; i < LRU_SEQS; i++) {
            int32_t alive = 0;
            for (int32_t blk = 0; blk < 2; blk++) {
                bool evicted = false;
                for (int32_t j = 0; j < k; j++)
                    evicted |= evict_order[j] == 2 * i + blk;
                if (evicted)
                    break;
                alive++;
            }
            assert_int_equal(probe(c, NULL, prompts[i], 2 * LRU_BS + 1), alive * LRU_BS);
        }
        check_live(c, &e, END);
        blade_kv_cache_release(c, &e);
        blade_kv_cache_seq_destroy(&e);
        blade_kv_cache_free(c);
    }
}

static void test_hit_refreshes_lru(void **state)
{
    (void)state;
    int32_t prompts[LRU_SEQS][2 * LRU_BS + 1];
    blade_kv_cache *c = lru_scene(prompts);
    /* B is the oldest; a hit makes it the newest, so D goes first instead. */
    assert_int_equal(probe(c, NULL, prompts[1], 2 * LRU_BS + 1), 2 * LRU_BS);
    check_live(c, END);
    blade_kv_cache_seq e;
    blade_kv_cache_seq_init(&e, c, NULL, 0);
    assert_int_equal(blade_kv_cache_allocate(c, &e, 2 * LRU_BS), 0);
    assert_int_equal(e.blocks[0], 7);
    assert_int_equal(e.blocks[1], 6);
    assert_int_equal(probe(c, NULL, prompts[3], 2 * LRU_BS + 1), 0);
    assert_int_equal(probe(c, NULL, prompts[1], 2 * LRU_BS + 1), 2 * LRU_BS);
    check_live(c, &e, END);
    blade_kv_cache_release(c, &e);
    blade_kv_cache_seq_destroy(&e);
    blade_kv_cache_free(c);
}

static void test_pinned_survive(void **state)
{
    (void)state;
    enum { BS = 4, BLOCKS = 16 };
    blade_kv_cache *c = new_cache(BLOCKS, BS, true, 1);
    int32_t sys[4 * BS + 1], other[6 * BS];
    fill_random(sys, 4 * BS + 1, 6);
    fill_random(other, 6 * BS, 7);
    blade_kv_cache_seq p, h, q, x;
    blade_kv_cache_seq_init(&p, c, "t", 1);
    compute(c, &p, sys, 4 * BS);
    blade_kv_cache_release(c, &p);

    /* Pinning a block someone holds keeps it off the LRU once they let go. */
    blade_kv_cache_seq_init(&h, c, "t", 1);
    assert_int_equal(blade_kv_cache_match_prefix(c, &h, sys, 4 * BS + 1), 4 * BS);
    assert_int_equal(blade_kv_cache_pin_prefix(c, sys, 4 * BS, "t", 1), 4);
    assert_int_equal(blade_kv_cache_pin_prefix(c, sys, 3 * BS + 2, "t", 1), 3);
    assert_int_equal(blade_kv_cache_pin_prefix(c, sys, 4 * BS, "u", 1), 0);
    assert_int_equal(blade_kv_cache_pin_prefix(c, sys, 4 * BS, NULL, 0), 0);
    check_live(c, &h, END);
    blade_kv_cache_release(c, &h);
    check_live(c, END);
    blade_kv_cache_stats st = stats(c);
    assert_int_equal(st.blocks_pinned, 4);
    assert_int_equal(st.blocks_cached, 4);
    assert_int_equal(blade_kv_cache_available(c), BLOCKS - 4);

    blade_kv_cache_seq_init(&q, c, "t", 1);
    compute(c, &q, other, 6 * BS);
    blade_kv_cache_release(c, &q);
    check_live(c, END);
    assert_int_equal(stats(c).blocks_cached, 10);
    assert_int_equal(blade_kv_cache_available(c), BLOCKS - 4);

    /* Everything that can go goes; the pinned prefix stays whole. */
    blade_kv_cache_seq_init(&x, c, NULL, 0);
    assert_int_equal(blade_kv_cache_allocate(c, &x, (BLOCKS - 4) * BS), 0);
    assert_int_equal(blade_kv_cache_allocate(c, &x, (BLOCKS - 4) * BS + 1), -1);
    check_live(c, &x, END);
    st = stats(c);
    assert_int_equal(st.evictions, 6);
    assert_int_equal(st.blocks_used, BLOCKS - 4);
    assert_int_equal(st.blocks_cached, 4);
    assert_int_equal(blade_kv_cache_available(c), 0);
    assert_int_equal(probe(c, "t", other, 6 * BS), 0);
    assert_int_equal(probe(c, "t", sys, 4 * BS + 1), 4 * BS);
    assert_int_equal(blade_kv_cache_available(c), 0);
    check_live(c, &x, END);
    blade_kv_cache_release(c, &x);
    check_live(c, END);

    blade_kv_cache_seq_destroy(&p);
    blade_kv_cache_seq_destroy(&h);
    blade_kv_cache_seq_destroy(&q);
    blade_kv_cache_seq_destroy(&x);
    blade_kv_cache_free(c);
}

/* ---- allocation and sharing ---- */

static void test_allocate_all_or_nothing(void **state)
{
    (void)state;
    enum { BS = 4 };
    blade_kv_cache *c = new_cache(8, BS, true, 1);
    int32_t t[2 * BS + 1];
    fill_random(t, 2 * BS + 1, 8);
    blade_kv_cache_seq a, b, k;
    blade_kv_cache_seq_init(&k, c, NULL, 0);
    compute(c, &k, t, 2 * BS);
    blade_kv_cache_release(c, &k);
    blade_kv_cache_seq_init(&a, c, NULL, 0);
    assert_int_equal(blade_kv_cache_allocate(c, &a, 3 * BS), 0);
    assert_int_equal(blade_kv_cache_available(c), 5);

    blade_kv_cache_seq_init(&b, c, NULL, 0);
    blade_kv_cache_stats before = stats(c);
    assert_int_equal(blade_kv_cache_allocate(c, &b, 5 * BS + 1), -1);
    assert_int_equal(b.n_blocks, 0);
    blade_kv_cache_stats after = stats(c);
    assert_int_equal(after.blocks_free, before.blocks_free);
    assert_int_equal(after.blocks_cached, before.blocks_cached);
    assert_int_equal(after.blocks_used, before.blocks_used);
    assert_int_equal(after.evictions, before.evictions);
    check_live(c, &a, &b, END);
    assert_int_equal(probe(c, NULL, t, 2 * BS + 1), 2 * BS);

    assert_int_equal(blade_kv_cache_allocate(c, &b, 5 * BS), 0);
    assert_int_equal(b.n_blocks, 5);
    assert_int_equal(stats(c).evictions, 2);
    check_live(c, &a, &b, END);
    /* Growing a sequence is all-or-nothing too, and covering fewer tokens is a no-op. */
    assert_int_equal(blade_kv_cache_allocate(c, &a, 3 * BS + 1), -1);
    assert_int_equal(a.n_blocks, 3);
    assert_int_equal(blade_kv_cache_allocate(c, &a, 2 * BS), 0);
    assert_int_equal(blade_kv_cache_allocate(c, &a, 0), 0);
    assert_int_equal(a.n_blocks, 3);
    check_live(c, &a, &b, END);

    blade_kv_cache_release(c, &a);
    blade_kv_cache_release(c, &b);
    check_live(c, END);
    assert_int_equal(stats(c).blocks_free, 8);
    blade_kv_cache_seq_destroy(&a);
    blade_kv_cache_seq_destroy(&b);
    blade_kv_cache_seq_destroy(&k);
    blade_kv_cache_free(c);
}

static void test_shared_prefix_refcounts(void **state)
{
    (void)state;
    enum { BS = 4, BLOCKS = 16 };
    blade_kv_cache *c = new_cache(BLOCKS, BS, true, 1);
    int32_t ta[4 * BS + 1], tb[5 * BS];
    fill_random(ta, 4 * BS + 1, 9);
    memcpy(tb, ta, 4 * BS * sizeof ta[0]);
    fill_random(tb + 4 * BS, BS, 10);

    blade_kv_cache_seq a, b, f;
    blade_kv_cache_seq_init(&a, c, NULL, 0);
    compute(c, &a, ta, 4 * BS + 1);
    check_live(c, &a, END);
    blade_kv_cache_seq_init(&b, c, NULL, 0);
    assert_int_equal(blade_kv_cache_match_prefix(c, &b, tb, 5 * BS), 4 * BS);
    assert_memory_equal(b.blocks, a.blocks, 4 * sizeof a.blocks[0]);
    check_live(c, &a, &b, END);
    assert_int_equal(stats(c).blocks_used, 5);
    assert_int_equal(blade_kv_cache_allocate(c, &b, 5 * BS), 0);
    blade_kv_cache_commit(c, &b, tb, 5 * BS);
    check_live(c, &a, &b, END);
    assert_int_equal(stats(c).blocks_used, 6);

    /* b keeps the shared blocks; only a's private partial block is freed. */
    blade_kv_cache_release(c, &a);
    check_live(c, &b, END);
    blade_kv_cache_stats st = stats(c);
    assert_int_equal(st.blocks_used, 5);
    assert_int_equal(st.blocks_free, BLOCKS - 5);
    assert_int_equal(st.blocks_cached, 0);

    /* Held blocks cannot be evicted by pressure. */
    blade_kv_cache_seq_init(&f, c, NULL, 0);
    assert_int_equal(blade_kv_cache_allocate(c, &f, (BLOCKS - 5) * BS), 0);
    assert_int_equal(blade_kv_cache_allocate(c, &f, (BLOCKS - 5) * BS + 1), -1);
    check_live(c, &b, &f, END);
    assert_int_equal(stats(c).evictions, 0);
    blade_kv_cache_release(c, &f);
    check_live(c, &b, END);
    assert_int_equal(blade_kv_cache_match_prefix(c, &a, ta, 4 * BS + 1), 4 * BS);
    check_live(c, &a, &b, END);
    blade_kv_cache_release(c, &b);
    check_live(c, &a, END);
    blade_kv_cache_release(c, &a);
    check_live(c, END);
    st = stats(c);
    assert_int_equal(st.blocks_cached, 5);
    assert_int_equal(st.blocks_free, BLOCKS - 5);
    blade_kv_cache_seq_destroy(&a);
    blade_kv_cache_seq_destroy(&b);
    blade_kv_cache_seq_destroy(&f);
    blade_kv_cache_free(c);
}

static void test_duplicate_commit(void **state)
{
    (void)state;
    enum { BS = 4, BLOCKS = 16 };
    blade_kv_cache *c = new_cache(BLOCKS, BS, true, 1);
    int32_t t[3 * BS + 1];
    fill_random(t, 3 * BS + 1, 11);

    /* Both start before either has committed, so both compute the shared blocks. */
    blade_kv_cache_seq a, b, d;
    blade_kv_cache_seq_init(&a, c, NULL, 0);
    blade_kv_cache_seq_init(&b, c, NULL, 0);
    assert_int_equal(blade_kv_cache_match_prefix(c, &a, t, 2 * BS), 0);
    assert_int_equal(blade_kv_cache_match_prefix(c, &b, t, 3 * BS), 0);
    assert_int_equal(blade_kv_cache_allocate(c, &a, 2 * BS), 0);
    assert_int_equal(blade_kv_cache_allocate(c, &b, 3 * BS), 0);
    blade_kv_cache_commit(c, &a, t, 2 * BS);
    blade_kv_cache_commit(c, &b, t, 3 * BS);
    check_live(c, &a, &b, END);
    assert_int_equal(b.n_hashed, 3);
    assert_memory_equal(b.hashes, a.hashes, 2 * sizeof a.hashes[0]);

    /* b's copies of the shared blocks were never registered, so they are freed; its third
     * block, which nobody else computed, is cached. */
    const int32_t chain[3] = {a.blocks[0], a.blocks[1], b.blocks[2]};
    blade_kv_cache_release(c, &b);
    check_live(c, &a, END);
    blade_kv_cache_stats st = stats(c);
    assert_int_equal(st.blocks_used, 2);
    assert_int_equal(st.blocks_cached, 1);
    assert_int_equal(st.blocks_free, BLOCKS - 3);
    blade_kv_cache_release(c, &a);
    check_live(c, END);

    /* The chain continues through the registered original into b's block. */
    blade_kv_cache_seq_init(&d, c, NULL, 0);
    assert_int_equal(blade_kv_cache_match_prefix(c, &d, t, 3 * BS + 1), 3 * BS);
    assert_memory_equal(d.blocks, chain, sizeof chain);
    check_live(c, &d, END);
    blade_kv_cache_release(c, &d);
    check_live(c, END);
    blade_kv_cache_seq_destroy(&a);
    blade_kv_cache_seq_destroy(&b);
    blade_kv_cache_seq_destroy(&d);
    blade_kv_cache_free(c);
}

static void test_stats_and_config(void **state)
{
    (void)state;
    blade_kv_cache_config cfg = {.n_blocks = 0, .block_size = 16};
    blade_error err = {{0}};
    assert_null(blade_kv_cache_new(&cfg, &err));
    assert_non_null(strstr(err.msg, "n_blocks"));
    cfg = (blade_kv_cache_config){.n_blocks = 4, .block_size = 0};
    assert_null(blade_kv_cache_new(&cfg, &err));
    assert_non_null(strstr(err.msg, "block_size"));

    blade_kv_cache *c = new_cache(4, 16, true, 1);
    assert_int_equal(blade_kv_cache_block_size(c), 16);
    blade_kv_cache_seq s;
    blade_kv_cache_seq_init(&s, c, NULL, 0);
    assert_int_equal(blade_kv_cache_allocate(c, &s, 20), 0);
    blade_kv_cache_sample_utilisation(c, &s, 20);
    blade_kv_cache_sample_utilisation(c, &s, 30);
    blade_kv_cache_stats st = stats(c);
    assert_int_equal(st.token_slots_used, 50);
    assert_int_equal(st.token_slots_allocated, 64);
    assert_int_equal(st.blocks_total, 4);
    assert_int_equal(st.blocks_used, 2);
    blade_kv_cache_release(c, &s);
    blade_kv_cache_seq_destroy(&s);
    blade_kv_cache_free(c);
}

/* ---- randomized stress ---- */

enum {
    ST_BLOCKS = 96,
    ST_BS = 4,
    ST_SEQS = 50,
    ST_DOCS = 4,
    ST_DOC_LEN = 96,
    ST_MAX_TOK = 120,
    ST_OPS = 20000,
};

typedef struct sim_seq {
    bool live;
    int salt;
    blade_kv_cache_seq s;
    int32_t tokens[ST_MAX_TOK];
    int32_t n_prompt, n_tokens, n_computed;
} sim_seq;

/* What the KV store would hold: the token, logical block and tenant last written to each
 * slot. A block handed out by the prefix cache must hold exactly what the new sequence
 * would have computed there. */
typedef struct shadow {
    int32_t token[ST_BLOCKS][ST_BS];
    int32_t logical[ST_BLOCKS];
    int salt[ST_BLOCKS];
} shadow;

typedef struct sim {
    blade_kv_cache *c;
    sim_seq seq[ST_SEQS];
    shadow sh;
    int32_t docs[ST_DOCS][ST_DOC_LEN];
    uint64_t rng;
    int32_t hits, failures;
} sim;

static const char *const salts[2] = {"salt-0", "salt-1"};

static int32_t owners_of(const sim *m, int32_t b)
{
    int32_t n = 0;
    for (int i = 0; i < ST_SEQS; i++)
        for (int32_t j = 0; m->seq[i].live && j < m->seq[i].s.n_blocks; j++)
            n += m->seq[i].s.blocks[j] == b;
    return n;
}

static void sim_check(const sim *m)
{
    const blade_kv_cache_seq *live[ST_SEQS];
    int32_t n = 0;
    for (int i = 0; i < ST_SEQS; i++)
        if (m->seq[i].live)
            live[n++] = &m->seq[i].s;
    blade_error err = {{0}};
    if (blade_kv_cache_check(m->c, live, n, &err) != 0)
        fail_msg("invariant broken: %s", err.msg);
    blade_kv_cache_stats st = stats(m->c);
    assert_int_equal(st.blocks_free + st.blocks_cached + st.blocks_used, ST_BLOCKS);
}

static void sim_end(sim *m, sim_seq *q)
{
    blade_kv_cache_release(m->c, &q->s);
    blade_kv_cache_seq_destroy(&q->s);
    q->live = false;
}

static void sim_start(sim *m, sim_seq *q)
{
    uint64_t *r = &m->rng;
    q->salt = rand_below(r, 2);
    const int32_t *doc = m->docs[rand_below(r, ST_DOCS)];
    int32_t shared = rand_below(r, ST_DOC_LEN);
    q->n_prompt = shared + 1 + rand_below(r, 16);
    memcpy(q->tokens, doc, (size_t)shared * sizeof *doc);
    /* A tiny alphabet makes unrelated sequences write identical blocks now and then. */
    for (int32_t i = shared; i < q->n_prompt; i++)
        q->tokens[i] = rand_below(r, 2);
    q->n_tokens = q->n_prompt;
    blade_kv_cache_seq_init(&q->s, m->c, salts[q->salt], strlen(salts[q->salt]));
    q->live = true;
    int32_t got = blade_kv_cache_match_prefix(m->c, &q->s, q->tokens, q->n_prompt);
    assert_int_equal(got % ST_BS, 0);
    assert_true(got <= q->n_prompt - 1);
    assert_int_equal(got, q->s.n_cached_tokens);
    for (int32_t i = 0; i < got / ST_BS; i++) {
        int32_t b = q->s.blocks[i];
        assert_int_equal(m->sh.logical[b], i);
        assert_int_equal(m->sh.salt[b], q->salt);
        assert_memory_equal(m->sh.token[b], q->tokens + i * ST_BS, sizeof m->sh.token[b]);
    }
    q->n_computed = got;
    m->hits += got > 0;
}

/* One prefill chunk or one decoded token; under pressure, sometimes preempts another
 * sequence as a scheduler would. */
static void sim_advance(sim *m, sim_seq *q)
{
    uint64_t *r = &m->rng;
    if (q->n_computed == q->n_tokens) {
        if (q->n_tokens == ST_MAX_TOK)
            return;
        q->tokens[q->n_tokens++] = rand_below(r, 2);
    }
    int32_t k = 1 + rand_below(r, 12);
    if (k > q->n_tokens - q->n_computed)
        k = q->n_tokens - q->n_computed;
    if (blade_kv_cache_allocate(m->c, &q->s, q->n_computed + k) != 0) {
        m->failures++;
        int victim = rand_below(r, ST_SEQS);
        if (m->seq[victim].live && &m->seq[victim] != q && rand_below(r, 2))
            sim_end(m, &m->seq[victim]);
        return;
    }
    assert_true(q->s.n_blocks * ST_BS >= q->n_computed + k);
    for (int32_t p = q->n_computed; p < q->n_computed + k; p++) {
        int32_t b = q->s.blocks[p / ST_BS];
        /* Writing into a block someone else can read would corrupt their cache. */
        assert_int_equal(owners_of(m, b), 1);
        m->sh.token[b][p % ST_BS] = q->tokens[p];
        m->sh.logical[b] = p / ST_BS;
        m->sh.salt[b] = q->salt;
    }
    q->n_computed += k;
    blade_kv_cache_commit(m->c, &q->s, q->tokens, q->n_computed);
    assert_int_equal(q->s.n_hashed, q->n_computed / ST_BS);
}

static void run_stress(uint64_t seed)
{
    sim *m = calloc(1, sizeof *m);
    assert_non_null(m);
    m->c = new_cache(ST_BLOCKS, ST_BS, true, 1);
    m->rng = seed;
    for (int d = 0; d < ST_DOCS; d++)
        fill_random(m->docs[d], ST_DOC_LEN, seed * 31 + (uint64_t)d);
    for (int op = 0; op < ST_OPS; op++) {
        sim_seq *q = &m->seq[rand_below(&m->rng, ST_SEQS)];
        int32_t roll = rand_below(&m->rng, 100);
        if (!q->live)
            sim_start(m, q);
        else if (roll < 75)
            sim_advance(m, q);
        else if (roll < 98)
            sim_end(m, q);
        else if (roll < 99) {
            const char *salt = salts[rand_below(&m->rng, 2)];
            blade_kv_cache_pin_prefix(m->c, m->docs[rand_below(&m->rng, ST_DOCS)], 2 * ST_BS, salt, strlen(salt));
        } else
            blade_kv_cache_sample_utilisation(m->c, &q->s, q->n_computed);
        sim_check(m);
    }
    for (int i = 0; i < ST_SEQS; i++)
        if (m->seq[i].live) {
            sim_end(m, &m->seq[i]);
            sim_check(m);
        }
    blade_kv_cache_stats st = stats(m->c);
    assert_int_equal(st.blocks_used, 0);
    assert_int_equal(st.blocks_free + st.blocks_cached, ST_BLOCKS);
    assert_true(st.blocks_pinned <= 2 * ST_DOCS * 2);
    /* The run has to have exercised what it is meant to. */
    assert_true(m->hits > 100);
    assert_true(m->failures > 100);
    assert_true(st.evictions > 100);
    assert_true(st.prefix_hit_tokens > 0 && st.prefix_hit_tokens < st.prefix_query_tokens);
    blade_kv_cache_free(m->c);
    free(m);
}

static void test_stress(void **state)
{
    (void)state;
    for (uint64_t seed = 1; seed <= 3; seed++)
        run_stress(seed);
}

/* ---- the checker itself ---- */

static void expect_broken(const blade_kv_cache *c, const blade_kv_cache_seq *const *seqs, int32_t n, const char *needle)
{
    blade_error err = {{0}};
    assert_int_equal(blade_kv_cache_check(c, seqs, n, &err), -1);
    if (!strstr(err.msg, needle))
        fail_msg("expected \"%s\" in: %s", needle, err.msg);
}

static void test_check_detects_corruption(void **state)
{
    (void)state;
    blade_kv_cache *c = new_cache(8, 4, true, 1);
    int32_t t[8];
    fill_random(t, 8, 12);
    blade_kv_cache_seq a;
    blade_kv_cache_seq_init(&a, c, NULL, 0);
    compute(c, &a, t, 8);
    assert_int_equal(a.blocks[0], 0);
    assert_int_equal(a.blocks[1], 1);
    check_live(c, &a, END);

    /* Claims a free block it never got. */
    int32_t table[1] = {5};
    blade_kv_cache_seq fake = {.blocks = table, .n_blocks = 1, .cap_blocks = 1};
    const blade_kv_cache_seq *with_fake[2] = {&a, &fake};
    expect_broken(c, with_fake, 2, "block 5: on the free list but owned");

    /* Claims a block another sequence holds, without having matched it. */
    table[0] = 1;
    expect_broken(c, with_fake, 2, "block 1: registered, yet sequence 1 holds it as unhashed");

    /* The owner is missing from the list. */
    expect_broken(c, NULL, 0, "block 0: reference count 1 but 0");

    /* The same sequence twice. */
    const blade_kv_cache_seq *twice[2] = {&a, &a};
    expect_broken(c, twice, 2, "block 0: reference count 1 but 2");

    table[0] = 9;
    expect_broken(c, with_fake, 2, "outside 0..7");

    /* A hashed block whose recorded hash is not the one it is registered under. */
    a.hashes[1][0] ^= 1;
    const blade_kv_cache_seq *just_a[1] = {&a};
    expect_broken(c, just_a, 1, "block 1: registered under a hash other");
    a.hashes[1][0] ^= 1;

    a.n_hashed = 1;
    expect_broken(c, just_a, 1, "block 1: registered, yet sequence 0 holds it as unhashed");
    a.n_hashed = 3;
    expect_broken(c, just_a, 1, "inconsistent");
    a.n_hashed = 2;
    check_live(c, &a, END);

    blade_kv_cache_release(c, &a);
    check_live(c, END);
    /* A released sequence listed as live claims blocks that are now cached. */
    a.n_blocks = a.n_hashed = 2;
    expect_broken(c, just_a, 1, "block 0: reference count 0 but 1");
    a.n_blocks = a.n_hashed = 0;
    blade_kv_cache_seq_destroy(&a);
    blade_kv_cache_free(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_reuse),
        cmocka_unit_test(test_match_leaves_one_token),
        cmocka_unit_test(test_hash_format),
        cmocka_unit_test(test_salts_isolate),
        cmocka_unit_test(test_prefix_caching_off),
        cmocka_unit_test(test_lru_eviction_order),
        cmocka_unit_test(test_hit_refreshes_lru),
        cmocka_unit_test(test_pinned_survive),
        cmocka_unit_test(test_allocate_all_or_nothing),
        cmocka_unit_test(test_shared_prefix_refcounts),
        cmocka_unit_test(test_duplicate_commit),
        cmocka_unit_test(test_stats_and_config),
        cmocka_unit_test(test_stress),
        cmocka_unit_test(test_check_detects_corruption),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The KV cache manager (kv_cache.h): which block of the KV store is free, held (by whom,
 * reference-counted) or cached under its prefix hash, and LRU eviction. It hands out block
 * numbers only; the memory behind them is the store's (kv_store.h). */

#include "blade/kv_cache.h"

#include <openssl/evp.h>

#include <stdlib.h>
#include <string.h>

#define NO_BLOCK (-1)

/* Tokens go to the digest little-endian through a stack buffer of this many, so digests are
 * the same on every host and hashing needs no scratch sized by the block size. */
#define HASH_CHUNK_TOKENS 64

/* A block's state is implied by its fields rather than stored, so it cannot disagree with
 * them: ref > 0 means used; ref == 0 and registered means cached (on the LRU list unless
 * pinned); ref == 0 and unregistered means on the free list. */
typedef struct kv_block {
    uint8_t hash[BLADE_HASH_BYTES]; /* meaningful while registered */
    int32_t ref;
    int32_t lru_newer, lru_older; /* neighbours on the LRU list, NO_BLOCK at the ends */
    bool registered;              /* the hash index maps hash -> this block */
    bool pinned;
} kv_block;

/* Open addressing with linear probing. The tag (the hash's first 8 bytes, uniformly
 * distributed since it is SHA-256 output) picks the home slot and rejects almost every
 * non-matching slot without touching the block array. */
typedef struct index_slot {
    uint64_t tag;
    int32_t block; /* NO_BLOCK: empty */
} index_slot;

struct blade_kv_cache {
    int32_t n_blocks, block_size;
    bool prefix_caching;
    uint8_t model_id[BLADE_HASH_BYTES];

    kv_block *blocks;
    int32_t *free_stack;
    int32_t n_free;
    int32_t lru_newest, lru_oldest; /* eviction takes lru_oldest */
    int32_t n_lru;                  /* evictable: cached and not pinned */
    int32_t n_cached;               /* unreferenced and registered, pinned or not */
    int32_t n_used;
    int32_t n_pinned;

    /* At most n_blocks entries in at least 2 * n_blocks slots, so probes stay short. */
    index_slot *index;
    size_t index_mask;

    EVP_MD *sha256;
    /* Shared by every digest, seq_init's included although it takes the cache const, so
     * the cache (seq_init too) must stay on one thread, like the scheduler that owns it. */
    EVP_MD_CTX *md;

    uint64_t prefix_query_tokens, prefix_hit_tokens, evictions;
    uint64_t token_slots_used, token_slots_allocated;
};

/* ---- hashing ---- */

/* Each returns false when libcrypto fails, which OpenSSL 3.0 can do on every digest since
 * its EVP init allocates the provider context anew each time. Callers then treat the hash
 * as unknown: a miss, or a block left unregistered, never a wrong match. */

static bool digest_tokens(EVP_MD_CTX *md, const int32_t *tokens, int32_t n)
{
    uint8_t buf[HASH_CHUNK_TOKENS * 4];
    while (n > 0) {
        int32_t k = n < HASH_CHUNK_TOKENS ? n : HASH_CHUNK_TOKENS;
        for (int32_t i = 0; i < k; i++) {
            uint32_t t = (uint32_t)tokens[i];
            buf[4 * i] = (uint8_t)t;
            buf[4 * i + 1] = (uint8_t)(t >> 8);
            buf[4 * i + 2] = (uint8_t)(t >> 16);
            buf[4 * i + 3] = (uint8_t)(t >> 24);
        }
        if (EVP_DigestUpdate(md, buf, (size_t)k * 4) != 1)
            return false;
        tokens += k;
        n -= k;
    }
    return true;
}

static bool digest_final(EVP_MD_CTX *md, uint8_t out[BLADE_HASH_BYTES])
{
    unsigned int len = 0;
    return EVP_DigestFinal_ex(md, out, &len) == 1 && len == BLADE_HASH_BYTES;
}

static bool root_hash(const blade_kv_cache *c, const void *salt, size_t salt_len,
                      uint8_t out[BLADE_HASH_BYTES])
{
    static const char domain[] = "blade-kv-root";
    if (EVP_DigestInit_ex(c->md, c->sha256, NULL) != 1 ||
        EVP_DigestUpdate(c->md, domain, sizeof domain - 1) != 1 ||
        EVP_DigestUpdate(c->md, c->model_id, BLADE_HASH_BYTES) != 1)
        return false;
    if (salt && salt_len > 0 && EVP_DigestUpdate(c->md, salt, salt_len) != 1)
        return false;
    return digest_final(c->md, out);
}

static bool block_hash(const blade_kv_cache *c, const uint8_t parent[BLADE_HASH_BYTES],
                       const int32_t *tokens, uint8_t out[BLADE_HASH_BYTES])
{
    return EVP_DigestInit_ex(c->md, c->sha256, NULL) == 1 &&
           EVP_DigestUpdate(c->md, parent, BLADE_HASH_BYTES) == 1 &&
           digest_tokens(c->md, tokens, c->block_size) && digest_final(c->md, out);
}

/* ---- hash index ---- */

static uint64_t hash_tag(const uint8_t *h)
{
    uint64_t t;
    memcpy(&t, h, sizeof t);
    return t;
}

/* Returns the block registered under h, or NO_BLOCK with *slot set to the empty slot where
 * h belongs. */
static int32_t index_find(const blade_kv_cache *c, const uint8_t *h, size_t *slot)
{
    uint64_t tag = hash_tag(h);
    size_t i = (size_t)tag & c->index_mask;
    for (;; i = (i + 1) & c->index_mask) {
        const index_slot *e = &c->index[i];
        if (e->block == NO_BLOCK)
            break;
        if (e->tag == tag && memcmp(c->blocks[e->block].hash, h, BLADE_HASH_BYTES) == 0) {
            *slot = i;
            return e->block;
        }
    }
    *slot = i;
    return NO_BLOCK;
}

static void index_insert(blade_kv_cache *c, size_t slot, int32_t b, const uint8_t *h)
{
    memcpy(c->blocks[b].hash, h, BLADE_HASH_BYTES);
    c->blocks[b].registered = true;
    c->index[slot] = (index_slot){.tag = hash_tag(h), .block = b};
}

/* Backward-shift deletion: later entries of the probe run move into the hole when their
 * home slot allows, so lookups never need tombstones and stay short after many evictions. */
static void index_remove(blade_kv_cache *c, int32_t b)
{
    size_t hole;
    index_find(c, c->blocks[b].hash, &hole);
    c->blocks[b].registered = false;
    for (size_t j = hole;;) {
        j = (j + 1) & c->index_mask;
        if (c->index[j].block == NO_BLOCK)
            break;
        size_t home = (size_t)c->index[j].tag & c->index_mask;
        /* Entry j may fill the hole unless its home lies cyclically in (hole, j]. */
        bool stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!stays) {
            c->index[hole] = c->index[j];
            hole = j;
        }
    }
    c->index[hole].block = NO_BLOCK;
}

/* ---- LRU list ---- */

static void lru_push_newest(blade_kv_cache *c, int32_t b)
{
    kv_block *k = &c->blocks[b];
    k->lru_newer = NO_BLOCK;
    k->lru_older = c->lru_newest;
    if (c->lru_newest != NO_BLOCK)
        c->blocks[c->lru_newest].lru_newer = b;
    else
        c->lru_oldest = b;
    c->lru_newest = b;
    c->n_lru++;
}

static void lru_unlink(blade_kv_cache *c, int32_t b)
{
    kv_block *k = &c->blocks[b];
    if (k->lru_newer != NO_BLOCK)
        c->blocks[k->lru_newer].lru_older = k->lru_older;
    else
        c->lru_newest = k->lru_older;
    if (k->lru_older != NO_BLOCK)
        c->blocks[k->lru_older].lru_newer = k->lru_newer;
    else
        c->lru_oldest = k->lru_newer;
    k->lru_newer = k->lru_older = NO_BLOCK;
    c->n_lru--;
}

/* ---- block ownership ---- */

/* A new reference to a registered block found in the index. */
static void acquire_cached(blade_kv_cache *c, int32_t b)
{
    kv_block *k = &c->blocks[b];
    if (k->ref == 0) {
        c->n_cached--;
        c->n_used++;
        if (!k->pinned)
            lru_unlink(c, b);
    }
    k->ref++;
}

/* A block holding nothing anyone still needs, first from the free list and only then by
 * evicting the least recently used cached block. The caller has checked availability. */
static int32_t take_block(blade_kv_cache *c)
{
    int32_t b;
    if (c->n_free > 0) {
        b = c->free_stack[--c->n_free];
    } else {
        b = c->lru_oldest;
        lru_unlink(c, b);
        index_remove(c, b);
        c->n_cached--;
        c->evictions++;
    }
    c->blocks[b].ref = 1;
    c->n_used++;
    return b;
}

static void drop_ref(blade_kv_cache *c, int32_t b)
{
    kv_block *k = &c->blocks[b];
    if (--k->ref > 0)
        return;
    c->n_used--;
    if (k->registered) {
        c->n_cached++;
        if (!k->pinned)
            lru_push_newest(c, b);
    } else {
        c->free_stack[c->n_free++] = b;
    }
}

/* Grows both caller arrays to hold want blocks, doubling so a sequence that grows a block
 * at a time reallocates O(log n) times. cap_blocks only ever counts capacity both arrays
 * have, so a failure after the first realloc leaves s consistent. */
static int seq_reserve(blade_kv_cache_seq *s, int32_t want)
{
    if (want <= s->cap_blocks)
        return 0;
    int64_t cap = s->cap_blocks > 0 ? (int64_t)s->cap_blocks * 2 : 8;
    if (cap < want)
        cap = want;
    if (cap > INT32_MAX)
        cap = INT32_MAX;
    int32_t *blocks = realloc(s->blocks, (size_t)cap * sizeof *blocks);
    if (!blocks)
        return -1;
    s->blocks = blocks;
    uint8_t(*hashes)[BLADE_HASH_BYTES] = realloc(s->hashes, (size_t)cap * sizeof *hashes);
    if (!hashes)
        return -1;
    s->hashes = hashes;
    s->cap_blocks = (int32_t)cap;
    return 0;
}

/* ---- public interface ---- */

blade_kv_cache *blade_kv_cache_new(const blade_kv_cache_config *cfg, blade_error *err)
{
    if (cfg->n_blocks < 1) {
        blade_error_set(err, "kv cache: n_blocks is %d; it must be >= 1", (int)cfg->n_blocks);
        return NULL;
    }
    if (cfg->block_size < 1) {
        blade_error_set(err, "kv cache: block_size is %d; it must be >= 1", (int)cfg->block_size);
        return NULL;
    }
    blade_kv_cache *c = calloc(1, sizeof *c);
    if (!c) {
        blade_error_set(err, "kv cache: out of memory");
        return NULL;
    }
    c->n_blocks = cfg->n_blocks;
    c->block_size = cfg->block_size;
    c->prefix_caching = cfg->prefix_caching;
    memcpy(c->model_id, cfg->model_id, BLADE_HASH_BYTES);
    c->lru_newest = c->lru_oldest = NO_BLOCK;

    size_t n = (size_t)cfg->n_blocks, slots = 1;
    while (slots < 2 * n)
        slots <<= 1;
    c->index_mask = slots - 1;
    c->blocks = calloc(n, sizeof *c->blocks);
    c->free_stack = malloc(n * sizeof *c->free_stack);
    c->index = malloc(slots * sizeof *c->index);
    if (!c->blocks || !c->free_stack || !c->index) {
        blade_error_set(err, "kv cache: out of memory for %d blocks", (int)cfg->n_blocks);
        blade_kv_cache_free(c);
        return NULL;
    }
    c->sha256 = EVP_MD_fetch(NULL, "SHA256", NULL);
    c->md = EVP_MD_CTX_new();
    if (!c->sha256 || !c->md) {
        blade_error_set(err, "kv cache: libcrypto provides no SHA-256");
        blade_kv_cache_free(c);
        return NULL;
    }
    for (size_t i = 0; i < slots; i++)
        c->index[i].block = NO_BLOCK;
    /* Stacked in reverse so blocks are handed out in ascending order, which keeps block
     * tables readable in tests and logs. */
    for (int32_t i = 0; i < cfg->n_blocks; i++) {
        c->blocks[i].lru_newer = c->blocks[i].lru_older = NO_BLOCK;
        c->free_stack[i] = cfg->n_blocks - 1 - i;
    }
    c->n_free = cfg->n_blocks;
    return c;
}

void blade_kv_cache_free(blade_kv_cache *c)
{
    if (!c)
        return;
    EVP_MD_CTX_free(c->md);
    EVP_MD_free(c->sha256);
    free(c->index);
    free(c->free_stack);
    free(c->blocks);
    free(c);
}

int32_t blade_kv_cache_block_size(const blade_kv_cache *c)
{
    return c->block_size;
}

void blade_kv_cache_seq_init(blade_kv_cache_seq *s, const blade_kv_cache *c, const void *salt, size_t salt_len)
{
    *s = (blade_kv_cache_seq){0};
    s->salt_hash_ok = root_hash(c, salt, salt_len, s->salt_hash);
}

void blade_kv_cache_seq_destroy(blade_kv_cache_seq *s)
{
    free(s->blocks);
    free(s->hashes);
    *s = (blade_kv_cache_seq){0};
}

int32_t blade_kv_cache_match_prefix(blade_kv_cache *c, blade_kv_cache_seq *s, const int32_t *tokens, int32_t n)
{
    if (n <= 0 || s->n_blocks != 0)
        return 0;
    c->prefix_query_tokens += (uint64_t)n;
    if (!c->prefix_caching || !s->salt_hash_ok)
        return 0;
    int32_t bs = c->block_size, max = (n - 1) / bs, i = 0;
    /* Running out of memory for the table or the digest just ends the match early. */
    for (; i < max; i++) {
        if (seq_reserve(s, i + 1) != 0)
            break;
        const uint8_t *parent = i > 0 ? s->hashes[i - 1] : s->salt_hash;
        if (!block_hash(c, parent, tokens + (size_t)i * (size_t)bs, s->hashes[i]))
            break;
        size_t slot;
        int32_t b = index_find(c, s->hashes[i], &slot);
        if (b == NO_BLOCK)
            break;
        acquire_cached(c, b);
        s->blocks[i] = b;
    }
    s->n_blocks = s->n_hashed = i;
    s->n_cached_tokens = i * bs;
    c->prefix_hit_tokens += (uint64_t)s->n_cached_tokens;
    return s->n_cached_tokens;
}

int blade_kv_cache_allocate(blade_kv_cache *c, blade_kv_cache_seq *s, int32_t n_tokens)
{
    if (n_tokens <= 0)
        return 0;
    int32_t need = n_tokens / c->block_size + (n_tokens % c->block_size != 0);
    if (need <= s->n_blocks)
        return 0;
    if (need - s->n_blocks > blade_kv_cache_available(c) || seq_reserve(s, need) != 0)
        return -1;
    while (s->n_blocks < need)
        s->blocks[s->n_blocks++] = take_block(c);
    return 0;
}

int32_t blade_kv_cache_available(const blade_kv_cache *c)
{
    return c->n_free + c->n_lru;
}

void blade_kv_cache_commit(blade_kv_cache *c, blade_kv_cache_seq *s, const int32_t *tokens, int32_t n_computed)
{
    if (!c->prefix_caching || !s->salt_hash_ok || n_computed <= 0)
        return;
    int32_t bs = c->block_size, full = n_computed / bs;
    if (full > s->n_blocks)
        full = s->n_blocks;
    /* Blocks past n_hashed came from allocate, so none is registered yet; stopping at a
     * digest failure leaves n_hashed where the next commit can resume. */
    for (; s->n_hashed < full; s->n_hashed++) {
        int32_t i = s->n_hashed;
        const uint8_t *parent = i > 0 ? s->hashes[i - 1] : s->salt_hash;
        if (!block_hash(c, parent, tokens + (size_t)i * (size_t)bs, s->hashes[i]))
            return;
        size_t slot;
        /* A hit means another sequence computed the same block first; that copy stays the
         * one the cache knows and this one is freed when s releases it. */
        if (index_find(c, s->hashes[i], &slot) == NO_BLOCK)
            index_insert(c, slot, s->blocks[i], s->hashes[i]);
    }
}

void blade_kv_cache_truncate(blade_kv_cache *c, blade_kv_cache_seq *s, int32_t n_tokens)
{
    int32_t keep = n_tokens <= 0 ? 0 : n_tokens / c->block_size + (n_tokens % c->block_size != 0);
    /* a hashed block holds only committed tokens; never drop one (n_tokens below what
     * was committed would be a caller's error, and the chain must stay whole) */
    if (keep < s->n_hashed)
        keep = s->n_hashed;
    while (s->n_blocks > keep)
        drop_ref(c, s->blocks[--s->n_blocks]);
}

void blade_kv_cache_release(blade_kv_cache *c, blade_kv_cache_seq *s)
{
    /* Last block first: it then sits older in the LRU than the blocks before it, and a
     * block is only reachable through its whole prefix, so the chain is evicted from its
     * tail and a partial prefix stays useful. */
    for (int32_t i = s->n_blocks - 1; i >= 0; i--)
        drop_ref(c, s->blocks[i]);
    s->n_blocks = 0;
    s->n_hashed = 0;
    s->n_cached_tokens = 0;
}

int32_t blade_kv_cache_pin_prefix(blade_kv_cache *c, const int32_t *tokens, int32_t n, const void *salt,
                                  size_t salt_len)
{
    uint8_t hash[2][BLADE_HASH_BYTES];
    if (n <= 0 || !root_hash(c, salt, salt_len, hash[0]))
        return 0;
    int32_t bs = c->block_size, full = n / bs, i = 0;
    for (; i < full; i++) {
        const uint8_t *parent = hash[i & 1];
        uint8_t *h = hash[(i + 1) & 1];
        size_t slot;
        if (!block_hash(c, parent, tokens + (size_t)i * (size_t)bs, h))
            break;
        int32_t b = index_find(c, h, &slot);
        if (b == NO_BLOCK)
            break;
        kv_block *k = &c->blocks[b];
        if (!k->pinned) {
            k->pinned = true;
            c->n_pinned++;
            if (k->ref == 0)
                lru_unlink(c, b);
        }
    }
    return i;
}

bool blade_kv_cache_hash_chain(blade_kv_cache *c, const blade_kv_cache_seq *s, const int32_t *tokens,
                               int32_t n_blocks, uint8_t (*out)[BLADE_HASH_BYTES])
{
    if (!s->salt_hash_ok)
        return false;
    for (int32_t i = 0; i < n_blocks; i++) {
        const uint8_t *parent = i > 0 ? out[i - 1] : s->salt_hash;
        if (!block_hash(c, parent, tokens + (size_t)i * (size_t)c->block_size, out[i]))
            return false;
    }
    return true;
}

void blade_kv_cache_lookup(const blade_kv_cache *c, const uint8_t (*hashes)[BLADE_HASH_BYTES], int32_t n,
                           bool *have)
{
    for (int32_t i = 0; i < n; i++) {
        size_t slot;
        have[i] = c->prefix_caching && index_find(c, hashes[i], &slot) != NO_BLOCK;
    }
}

void blade_kv_cache_stats_get(const blade_kv_cache *c, blade_kv_cache_stats *out)
{
    *out = (blade_kv_cache_stats){
        .blocks_total = c->n_blocks,
        .blocks_free = c->n_free,
        .blocks_cached = c->n_cached,
        .blocks_used = c->n_used,
        .blocks_pinned = c->n_pinned,
        .prefix_query_tokens = c->prefix_query_tokens,
        .prefix_hit_tokens = c->prefix_hit_tokens,
        .evictions = c->evictions,
        .token_slots_used = c->token_slots_used,
        .token_slots_allocated = c->token_slots_allocated,
    };
}

void blade_kv_cache_sample_utilisation(blade_kv_cache *c, const blade_kv_cache_seq *s, int32_t n_tokens)
{
    c->token_slots_used += n_tokens > 0 ? (uint64_t)n_tokens : 0;
    c->token_slots_allocated += (uint64_t)s->n_blocks * (uint64_t)c->block_size;
}

/* ---- invariant check ---- */

static int check_seqs(const blade_kv_cache *c, const blade_kv_cache_seq *const *seqs, int32_t n_seqs,
                      int32_t *owners, blade_error *err)
{
    for (int32_t q = 0; q < n_seqs; q++) {
        const blade_kv_cache_seq *s = seqs[q];
        if (s->n_blocks < 0 || s->n_blocks > s->cap_blocks || s->n_hashed < 0 || s->n_hashed > s->n_blocks)
            return blade_error_set(err, "sequence %d: n_blocks %d, n_hashed %d, cap_blocks %d are inconsistent",
                                   (int)q, (int)s->n_blocks, (int)s->n_hashed, (int)s->cap_blocks);
        if (s->n_hashed > 0 && !s->salt_hash_ok)
            return blade_error_set(err, "sequence %d: has %d hashed blocks but no root hash", (int)q,
                                   (int)s->n_hashed);
        for (int32_t i = 0; i < s->n_blocks; i++) {
            int32_t b = s->blocks[i];
            if (b < 0 || b >= c->n_blocks)
                return blade_error_set(err, "sequence %d: logical block %d maps to %d, outside 0..%d",
                                       (int)q, (int)i, (int)b, (int)c->n_blocks - 1);
            owners[b]++;
            /* Registered blocks are only ever handed out by match or registered by commit,
             * both of which leave the owner holding the block's hash. */
            const kv_block *k = &c->blocks[b];
            if (k->registered && i >= s->n_hashed)
                return blade_error_set(err, "block %d: registered, yet sequence %d holds it as unhashed logical block %d",
                                       (int)b, (int)q, (int)i);
            if (k->registered && memcmp(k->hash, s->hashes[i], BLADE_HASH_BYTES) != 0)
                return blade_error_set(err,
                                       "block %d: registered under a hash other than the one sequence %d "
                                       "holds for its logical block %d",
                                       (int)b, (int)q, (int)i);
        }
    }
    return 0;
}

static int check_free_list(const blade_kv_cache *c, const int32_t *owners, uint8_t *seen, blade_error *err)
{
    if (c->n_free < 0 || c->n_free > c->n_blocks)
        return blade_error_set(err, "free list length %d outside 0..%d", (int)c->n_free, (int)c->n_blocks);
    for (int32_t i = 0; i < c->n_free; i++) {
        int32_t b = c->free_stack[i];
        if (b < 0 || b >= c->n_blocks)
            return blade_error_set(err, "free list entry %d is %d, not a block", (int)i, (int)b);
        if (seen[b])
            return blade_error_set(err, "block %d: on the free list twice", (int)b);
        seen[b] = 1;
        const kv_block *k = &c->blocks[b];
        if (owners[b] > 0 || k->ref != 0)
            return blade_error_set(err, "block %d: on the free list but owned (%d owners, reference count %d)",
                                   (int)b, (int)owners[b], (int)k->ref);
        if (k->registered || k->pinned)
            return blade_error_set(err, "block %d: on the free list but %s", (int)b,
                                   k->registered ? "registered in the hash index" : "pinned");
    }
    return 0;
}

static int check_lru(const blade_kv_cache *c, uint8_t *seen, blade_error *err)
{
    int32_t count = 0, newer = NO_BLOCK;
    for (int32_t b = c->lru_newest; b != NO_BLOCK; newer = b, b = c->blocks[b].lru_older) {
        if (b < 0 || b >= c->n_blocks)
            return blade_error_set(err, "LRU list reaches %d, not a block", (int)b);
        if (seen[b])
            return blade_error_set(err, "block %d: on the LRU list twice or also on the free list", (int)b);
        seen[b] = 1;
        const kv_block *k = &c->blocks[b];
        if (k->lru_newer != newer)
            return blade_error_set(err, "block %d: LRU back link is %d, expected %d", (int)b, (int)k->lru_newer,
                                   (int)newer);
        if (k->ref != 0)
            return blade_error_set(err, "block %d: cached (on the LRU list) with reference count %d", (int)b,
                                   (int)k->ref);
        if (!k->registered || k->pinned)
            return blade_error_set(err, "block %d: on the LRU list but %s", (int)b,
                                   k->pinned ? "pinned" : "not in the hash index");
        size_t slot;
        if (index_find(c, k->hash, &slot) != b)
            return blade_error_set(err, "block %d: cached but its hash does not lead back to it", (int)b);
        count++;
    }
    if (newer != c->lru_oldest)
        return blade_error_set(err, "LRU list ends at block %d but its oldest end is recorded as %d", (int)newer,
                               (int)c->lru_oldest);
    if (count != c->n_lru)
        return blade_error_set(err, "LRU list holds %d blocks but its count says %d", (int)count, (int)c->n_lru);
    return 0;
}

static int check_blocks(const blade_kv_cache *c, const int32_t *owners, const uint8_t *seen, blade_error *err)
{
    int32_t n_free = 0, n_cached = 0, n_used = 0, n_pinned = 0, n_registered = 0;
    for (int32_t b = 0; b < c->n_blocks; b++) {
        const kv_block *k = &c->blocks[b];
        if (k->ref != owners[b])
            return blade_error_set(err, "block %d: reference count %d but %d live sequence(s) hold it", (int)b,
                                   (int)k->ref, (int)owners[b]);
        if (k->pinned && !k->registered)
            return blade_error_set(err, "block %d: pinned but not in the hash index", (int)b);
        n_pinned += k->pinned;
        if (k->registered) {
            n_registered++;
            size_t slot;
            if (index_find(c, k->hash, &slot) != b)
                return blade_error_set(err, "block %d: marked registered but its hash does not lead to it", (int)b);
        }
        if (k->ref > 0) {
            n_used++;
        } else if (k->registered) {
            n_cached++;
            /* Seen here means on the LRU list, since a registered block failed the free list check. */
            if (!k->pinned && !seen[b])
                return blade_error_set(err, "block %d: cached and unpinned but not on the LRU list", (int)b);
        } else {
            n_free++;
            if (!seen[b])
                return blade_error_set(err, "block %d: neither owned, cached nor on the free list (leaked)",
                                       (int)b);
        }
    }
    if (n_free != c->n_free || n_cached != c->n_cached || n_used != c->n_used || n_pinned != c->n_pinned)
        return blade_error_set(err,
                               "block counts free %d cached %d used %d pinned %d, but the cache records "
                               "%d %d %d %d",
                               (int)n_free, (int)n_cached, (int)n_used, (int)n_pinned, (int)c->n_free,
                               (int)c->n_cached, (int)c->n_used, (int)c->n_pinned);
    if (c->n_free + c->n_cached + c->n_used != c->n_blocks)
        return blade_error_set(err, "free %d + cached %d + used %d != total %d", (int)c->n_free,
                               (int)c->n_cached, (int)c->n_used, (int)c->n_blocks);

    int32_t n_entries = 0;
    for (size_t i = 0; i <= c->index_mask; i++) {
        const index_slot *e = &c->index[i];
        if (e->block == NO_BLOCK)
            continue;
        n_entries++;
        if (e->block < 0 || e->block >= c->n_blocks)
            return blade_error_set(err, "hash index slot %zu names %d, not a block", i, (int)e->block);
        const kv_block *k = &c->blocks[e->block];
        if (!k->registered || e->tag != hash_tag(k->hash))
            return blade_error_set(err, "block %d: hash index slot %zu %s", (int)e->block, i,
                                   k->registered ? "holds a tag that is not the block's hash"
                                                 : "names it but the block is not registered");
    }
    if (n_entries != n_registered)
        return blade_error_set(err, "hash index holds %d entries for %d registered blocks", (int)n_entries,
                               (int)n_registered);
    return 0;
}

int blade_kv_cache_check(const blade_kv_cache *c, const blade_kv_cache_seq *const *seqs, int32_t n_seqs,
                         blade_error *err)
{
    int32_t *owners = calloc((size_t)c->n_blocks, sizeof *owners);
    uint8_t *seen = calloc((size_t)c->n_blocks, 1);
    int rc = -1;
    if (!owners || !seen)
        blade_error_set(err, "kv cache check: out of memory");
    else if (check_seqs(c, seqs, n_seqs, owners, err) == 0 && check_free_list(c, owners, seen, err) == 0 &&
             check_lru(c, seen, err) == 0 && check_blocks(c, owners, seen, err) == 0)
        rc = 0;
    free(seen);
    free(owners);
    return rc;
}

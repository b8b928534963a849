#ifndef BLADE_KV_CACHE_H
#define BLADE_KV_CACHE_H

/* The KV cache manager owns the blocks of the paged KV store: which are free, which a
 * sequence holds (reference-counted, so sequences sharing a prefix share its blocks), and
 * which full blocks are remembered in the prefix cache by content hash.
 *
 * Prefix caching: every full block is named by a hash chained from its parent block's
 * hash, its tokens and an extra key (the model identity and a per-request cache salt, so
 * tenants never share blocks). SHA-256 makes deliberate collisions infeasible. A new
 * sequence reuses every leading block whose hash is cached and computes only the rest.
 * Blocks nobody references stay in the cache, reusable, until evicted in LRU order;
 * pinned prefixes are never evicted. */

#include "blade/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define BLADE_HASH_BYTES 32

typedef struct blade_kv_cache blade_kv_cache;

typedef struct blade_kv_cache_config {
    int32_t n_blocks;
    int32_t block_size;
    bool prefix_caching;
    /* Identity of the model (e.g. a hash of the GGUF), mixed into every block hash so two
     * models never share cached blocks. */
    uint8_t model_id[BLADE_HASH_BYTES];
} blade_kv_cache_config;

/* A sequence's view: its block table and the hashes of its full blocks. Owned by the
 * caller (one per request), managed through the functions below. */
typedef struct blade_kv_cache_seq {
    int32_t *blocks;   /* block table: physical block of logical block i */
    int32_t n_blocks;
    int32_t cap_blocks;
    uint8_t (*hashes)[BLADE_HASH_BYTES]; /* hash of each full block registered so far */
    int32_t n_hashed;  /* leading full blocks whose hash is known */
    uint8_t salt_hash[BLADE_HASH_BYTES]; /* digest of model id + cache salt: the chain's root */
    /* False when libcrypto could not compute salt_hash (out of memory): the sequence then
     * neither matches nor registers blocks, since its chain would have no sound root. */
    bool salt_hash_ok;
    int32_t n_cached_tokens; /* tokens matched in the prefix cache when the sequence started */
} blade_kv_cache_seq;

typedef struct blade_kv_cache_stats {
    int32_t blocks_total;
    int32_t blocks_free;    /* on the free list, holding nothing */
    int32_t blocks_cached;  /* unreferenced but remembered, evictable unless pinned */
    int32_t blocks_used;    /* referenced by at least one sequence */
    int32_t blocks_pinned;
    uint64_t prefix_query_tokens; /* tokens looked up in the prefix cache */
    uint64_t prefix_hit_tokens;   /* of those, found cached */
    uint64_t evictions;
    uint64_t token_slots_used;      /* tokens held by live sequences (summed when sampled) */
    uint64_t token_slots_allocated; /* slots of the blocks live sequences hold */
} blade_kv_cache_stats;

blade_kv_cache *blade_kv_cache_new(const blade_kv_cache_config *cfg, blade_error *err);
void blade_kv_cache_free(blade_kv_cache *c);
int32_t blade_kv_cache_block_size(const blade_kv_cache *c);

/* Starts a sequence with an optional cache salt (tenant isolation; NULL/0 for none). */
void blade_kv_cache_seq_init(blade_kv_cache_seq *s, const blade_kv_cache *c, const void *salt, size_t salt_len);
/* Frees the caller-side arrays; the blocks must have been released first. */
void blade_kv_cache_seq_destroy(blade_kv_cache_seq *s);

/* Finds the longest run of leading full blocks of tokens[0..n) that is cached and takes a
 * reference on each for s (which must hold no blocks yet). At most n-1 tokens are matched,
 * so at least one token is always computed (its logits are needed). Returns the number
 * of tokens covered (a multiple of the block size). */
int32_t blade_kv_cache_match_prefix(blade_kv_cache *c, blade_kv_cache_seq *s, const int32_t *tokens, int32_t n);

/* Grows s's block table to cover n_tokens positions, taking free blocks first and then
 * evicting unreferenced cached blocks in LRU order. Returns 0, or -1 (allocating nothing)
 * when not enough blocks can be had. */
int blade_kv_cache_allocate(blade_kv_cache *c, blade_kv_cache_seq *s, int32_t n_tokens);
/* Blocks obtainable right now: free + evictable. */
int32_t blade_kv_cache_available(const blade_kv_cache *c);

/* Records that tokens[0..n_computed) of s are now in the KV store: every newly completed
 * full block gets its hash and enters the prefix cache (if an identical block is already
 * cached, s's copy stays out of the index and is freed when s releases it). */
void blade_kv_cache_commit(blade_kv_cache *c, blade_kv_cache_seq *s, const int32_t *tokens, int32_t n_computed);

/* Speculative decoding's rollback: s keeps only the blocks that hold positions
 * [0, n_tokens); the blocks wholly beyond are dropped (freed unless someone else holds
 * them). A dropped block was never registered, since commit hashes only blocks of computed
 * tokens and the caller truncates to at least what it committed. */
void blade_kv_cache_truncate(blade_kv_cache *c, blade_kv_cache_seq *s, int32_t n_tokens);

/* Drops s's references; blocks no one else holds become evictable (if hashed) or free. */
void blade_kv_cache_release(blade_kv_cache *c, blade_kv_cache_seq *s);

/* Computes the given prefix's block hashes (with the salt) and pins the cached blocks
 * among them so they are never evicted; returns how many leading blocks of the prefix are
 * now pinned (by this call or an earlier one), stopping at the first block not cached.
 * The caller computes the prefix first (e.g. by running a request for it) so its blocks
 * are cached. */
int32_t blade_kv_cache_pin_prefix(blade_kv_cache *c, const int32_t *tokens, int32_t n, const void *salt,
                                  size_t salt_len);

/* The chained hashes of the first n_blocks full blocks of tokens under s's root, whether
 * prefix caching is on or not (what a KV transfer names its blocks by). False when
 * libcrypto fails. */
bool blade_kv_cache_hash_chain(blade_kv_cache *c, const blade_kv_cache_seq *s, const int32_t *tokens,
                               int32_t n_blocks, uint8_t (*out)[BLADE_HASH_BYTES]);
/* have[i]: whether a block named hashes[i] is in the prefix cache now. Takes nothing: a
 * block found here may be evicted before it is used. */
void blade_kv_cache_lookup(const blade_kv_cache *c, const uint8_t (*hashes)[BLADE_HASH_BYTES], int32_t n,
                           bool *have);

void blade_kv_cache_stats_get(const blade_kv_cache *c, blade_kv_cache_stats *out);
/* Adds n_tokens / slots of the blocks of a live sequence to the utilisation counters. */
void blade_kv_cache_sample_utilisation(blade_kv_cache *c, const blade_kv_cache_seq *s, int32_t n_tokens);

/* For tests: checks every invariant against the given live sequences (reference counts
 * equal the number of owners, no block both free and owned, cached blocks unreferenced,
 * hash index consistent). Returns 0, or -1 with the violated invariant in err. */
int blade_kv_cache_check(const blade_kv_cache *c, const blade_kv_cache_seq *const *seqs, int32_t n_seqs,
                         blade_error *err);

#endif

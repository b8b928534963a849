#ifndef BLADE_SEMANTIC_CACHE_H
#define BLADE_SEMANTIC_CACHE_H

/* The semantic cache: stored responses answered again without running the model, for the
 * same request (exact tier) or for a prompt whose embedding is close enough to a stored
 * one (semantic tier).
 *
 * Entries live in partitions, one per (tenant, model, parameters): a lookup searches its
 * own partition only, so one tenant can never be answered from another's entries, nor a
 * request from an entry made by another model or with sampling parameters that change the
 * answer. The tenant (API key or cache_salt) is kept only as a SHA-256 digest.
 *
 * Capacity is bounded in entries and in bytes, the least recently hit entry going first;
 * entries older than the TTL are never returned (removed on lookup and by a periodic
 * sweep). With a database path, entries are written to SQLite in the background and
 * loaded again at open; a database that is unreadable, of another schema, or holds a row
 * that fails validation is moved aside and the cache starts empty, with a warning.
 *
 * Every function may be called from any thread. */

#include "blade/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct blade_semcache blade_semcache;

/* How each partition finds the nearest stored embedding. */
typedef enum blade_semcache_index {
    /* Exact scan while the partition is small, an HNSW graph (hnswlib) once it holds more
     * than exact_scan_max entries (and back when it shrinks to a quarter of that). */
    BLADE_SEMCACHE_INDEX_AUTO = 0,
    BLADE_SEMCACHE_INDEX_EXACT, /* always the exact SIMD scan */
    BLADE_SEMCACHE_INDEX_HNSW,  /* always HNSW, however small */
} blade_semcache_index;

typedef struct blade_semcache_config {
    /* Embedding dimension; 0 disables the semantic tier (exact tier only). */
    int32_t dim;
    /* Names the embedding model (e.g. its file's digest); a database written with another
     * embedder or dimension is set aside, since its vectors mean nothing to this one. */
    const char *embedder;
    /* A semantic hit needs cosine similarity >= threshold, in (0, 1]. */
    float threshold;
    int64_t max_entries; /* > 0 */
    int64_t max_bytes;   /* > 0; counts each entry's blade_semcache_stats.bytes share */
    double ttl_s;        /* entries expire this long after being stored; 0: never */
    blade_semcache_index index;
    int32_t exact_scan_max; /* AUTO's switch point; 0: max(1024, 524288 / dim) entries */
    /* HNSW graph: links per node, candidate list while building and while searching;
     * 0: defaults (16, 100, 64). */
    int32_t hnsw_m, hnsw_ef_construction, hnsw_ef_search;
    /* SQLite database to persist to; NULL: memory only. */
    const char *db_path;
    /* Seconds between background sweeps of expired entries; 0: the default (60); < 0: no
     * background sweep (blade_semcache_sweep still works). */
    double sweep_interval_s;
    /* Wall-clock seconds (persisted times must survive a restart); NULL: CLOCK_REALTIME.
     * Tests inject their own. */
    double (*clock)(void *ctx);
    void *clock_ctx;
    /* Where warnings (a database set aside, failed writes) and load progress go, possibly
     * from the cache's own thread; NULL: stderr. */
    void (*log)(void *ctx, const char *msg);
    void *log_ctx;
} blade_semcache_config;

/* Defaults for an embedding dimension: threshold 0.95, 10000 entries, 256 MiB, TTL 1 day,
 * AUTO index, memory only. */
blade_semcache_config blade_semcache_config_default(int32_t dim);

/* What a request is identified by. Strings are NUL-terminated; prompt and params are bytes. */
typedef struct blade_semcache_key {
    const char *tenant; /* API key or cache_salt ("" when neither): digested, never stored */
    const char *model;  /* the served model's id */
    /* The sampling parameters that change the answer, in one canonical encoding chosen by
     * the caller (same parameters, same bytes). */
    const void *params;
    size_t params_len;
    /* The normalised request: the rendered prompt (or the prompt's token ids as bytes). */
    const void *prompt;
    size_t prompt_len;
} blade_semcache_key;

/* A stored response, replayed as it was produced. */
#define BLADE_SEMCACHE_FINISH_MAX 32
typedef struct blade_semcache_response {
    const char *text; /* the generated text, text_len bytes (need not be NUL-terminated) */
    size_t text_len;
    const char *finish_reason; /* NUL-terminated, shorter than BLADE_SEMCACHE_FINISH_MAX */
    int32_t prompt_tokens, completion_tokens;
    /* Opaque bytes the caller wants back with the text (e.g. tool calls as JSON); may be
     * NULL with extra_len 0. */
    const void *extra;
    size_t extra_len;
} blade_semcache_response;

typedef enum blade_semcache_tier {
    BLADE_SEMCACHE_MISS = 0,
    BLADE_SEMCACHE_EXACT = 1,
    BLADE_SEMCACHE_SEMANTIC = 2,
} blade_semcache_tier;

/* A hit: the response (text NUL-terminated; pointers into storage owned by the hit). */
typedef struct blade_semcache_hit {
    blade_semcache_tier tier;
    float similarity; /* cosine similarity to the stored prompt; 1 for exact hits */
    double created;   /* when the entry was stored (the config's clock) */
    blade_semcache_response response;
    void *storage;
} blade_semcache_hit;

void blade_semcache_hit_clear(blade_semcache_hit *hit);

/* NULL with err set on a bad configuration or a database that cannot be opened or created
 * at all (a corrupt one is set aside instead). */
blade_semcache *blade_semcache_open(const blade_semcache_config *cfg, blade_error *err);
/* Writes what is still queued for the database, then frees everything. NULL is ignored. */
void blade_semcache_close(blade_semcache *c);

/* The exact tier, then (when embedding is non-NULL and the semantic tier is on) the
 * nearest stored embedding of the key's partition. The embedding has cfg.dim floats and
 * need not be normalised. Returns the tier of the hit (filling *hit, to be cleared by the
 * caller) or BLADE_SEMCACHE_MISS, counting one lookup in the stats; -1 with err set when
 * the key or embedding is invalid (missing strings, non-finite or zero vector). */
int blade_semcache_lookup(blade_semcache *c, const blade_semcache_key *key, const float *embedding,
                          blade_semcache_hit *hit, blade_error *err);
/* The exact tier alone, for checking before paying for an embedding: a hit counts as an
 * exact hit, a miss is not counted (the blade_semcache_lookup that follows counts it). */
int blade_semcache_lookup_exact(blade_semcache *c, const blade_semcache_key *key, blade_semcache_hit *hit,
                                blade_error *err);

/* Stores a response under the key (replacing one stored under the same key), with the
 * prompt's embedding (NULL: exact tier only), evicting least recently hit entries to stay
 * within capacity. Returns 0 when stored, 1 when not stored because the entry alone is
 * larger than max_bytes, -1 with err set on invalid input. */
int blade_semcache_insert(blade_semcache *c, const blade_semcache_key *key, const float *embedding,
                          const blade_semcache_response *response, blade_error *err);

/* Removes every expired entry now; returns how many. */
int64_t blade_semcache_sweep(blade_semcache *c);
/* Waits until everything stored or removed so far is in the database; 0, or -1 with err
 * set when a write failed since the last flush. No-op without a database. */
int blade_semcache_flush(blade_semcache *c, blade_error *err);

/* Histogram bucket upper bounds (Prometheus "le"), the last bucket being +Inf. */
#define BLADE_SEMCACHE_LATENCY_BUCKETS 14
#define BLADE_SEMCACHE_SIMILARITY_BUCKETS 12
extern const double blade_semcache_latency_bounds_s[BLADE_SEMCACHE_LATENCY_BUCKETS - 1];
extern const double blade_semcache_similarity_bounds[BLADE_SEMCACHE_SIMILARITY_BUCKETS - 1];

typedef struct blade_semcache_histogram_lat {
    uint64_t cumulative[BLADE_SEMCACHE_LATENCY_BUCKETS]; /* observations <= bound i; last: all */
    double sum;
} blade_semcache_histogram_lat;

typedef struct blade_semcache_histogram_sim {
    uint64_t cumulative[BLADE_SEMCACHE_SIMILARITY_BUCKETS];
    double sum;
} blade_semcache_histogram_sim;

/* A snapshot for /metrics. Counters count since open. */
typedef struct blade_semcache_stats {
    uint64_t exact_hits, semantic_hits, misses;
    uint64_t inserts, evictions, expirations;
    uint64_t rejected_too_large;
    int64_t entries, partitions;
    int64_t bytes;       /* what max_bytes bounds: entries' payloads, vectors and bookkeeping */
    int64_t index_bytes; /* HNSW graphs on top of that */
    blade_semcache_histogram_lat lookup_latency; /* every lookup call, seconds */
    blade_semcache_histogram_sim hit_similarity; /* semantic hits */
    /* The nearest entry's similarity on semantic-tier misses: where the threshold cuts. */
    blade_semcache_histogram_sim miss_similarity;
    uint64_t db_writes, db_errors, db_dropped; /* rows written; failed writes; ops dropped under backlog */
} blade_semcache_stats;

void blade_semcache_get_stats(blade_semcache *c, blade_semcache_stats *out);

#endif

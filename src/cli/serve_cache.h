#ifndef BLADE_CLI_SERVE_CACHE_H
#define BLADE_CLI_SERVE_CACHE_H

/* The flags of `blade serve` for embeddings and the semantic cache (--embed-model,
 * --embed-pooling, --semantic-cache and its threshold, capacity, TTL, index and database),
 * and what they start: the embedding engine and the cache. */

#include "api/model.h"
#include "blade/engine.h"
#include "blade/semantic_cache.h"
#include "cli/engine_options.h"
#include "cli/flags.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

typedef struct cli_serve_cache {
    const char *embed_model_path;
    blade_pooling pooling;
    bool on;
    double threshold, ttl_s;
    long long max_entries;
    size_t max_bytes;
    const char *db_path;
    blade_semcache_index index;
    /* what cli_serve_cache_start made, for cli_serve_cache_stop */
    blade_model *embed_model;
    blade_engine *embed_engine;
    blade_semcache *cache;
    blade_semcache_config cfg;
    char embedder[80];
} cli_serve_cache;

/* Starts with its own sections. */
extern const cli_flag cli_serve_cache_flags[];

void cli_serve_cache_init(cli_serve_cache *o);
/* Loads --embed-model into an engine of its own (configured like the served one), points
 * am's embeddings at it, and opens the cache when --semantic-cache was given. */
int cli_serve_cache_start(cli_serve_cache *o, api_model *am, const cli_engine_options *eo, blade_error *err);
/* Prints what is on: embeddings (model, pooling, width) and the cache's settings. */
void cli_serve_cache_describe(FILE *out, const cli_serve_cache *o, const api_model *am);
/* Closes the cache (writing what is queued for its database) and frees the embedding
 * engine; call after the server has stopped. */
void cli_serve_cache_stop(cli_serve_cache *o);

#endif

#ifndef BLADE_CLI_SERVE_CACHE_H
#define BLADE_CLI_SERVE_CACHE_H

/* The flags of `blade serve` for embeddings and the semantic cache (--embed-model,
 * --embed-pooling, --semantic-cache and its capacity, TTL, threshold and database), and
 * what they start: the embedding engine and the cache. */

#include "api/model.h"
#include "blade/engine.h"
#include "blade/semantic_cache.h"
#include "cli/engine_options.h"

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>

#define CLI_SERVE_CACHE_OPT_BASE 1100
enum cli_serve_cache_opt {
    OPT_SEMCACHE = CLI_SERVE_CACHE_OPT_BASE,
    OPT_SEMCACHE_THRESHOLD,
    OPT_SEMCACHE_ENTRIES,
    OPT_SEMCACHE_MIB,
    OPT_SEMCACHE_TTL,
    OPT_SEMCACHE_DB,
    OPT_SEMCACHE_INDEX,
    OPT_EMBED_MODEL,
    OPT_EMBED_POOLING,
};

/* For a command's own long-options table. */
#define CLI_SERVE_CACHE_LONGOPTS                                                                                     \
    {"semantic-cache", no_argument, 0, OPT_SEMCACHE},                                                                \
        {"semantic-threshold", required_argument, 0, OPT_SEMCACHE_THRESHOLD},                                        \
        {"semantic-cache-entries", required_argument, 0, OPT_SEMCACHE_ENTRIES},                                      \
        {"semantic-cache-mib", required_argument, 0, OPT_SEMCACHE_MIB},                                              \
        {"semantic-cache-ttl", required_argument, 0, OPT_SEMCACHE_TTL},                                              \
        {"semantic-cache-db", required_argument, 0, OPT_SEMCACHE_DB},                                                \
        {"semantic-cache-index", required_argument, 0, OPT_SEMCACHE_INDEX},                                          \
        {"embed-model", required_argument, 0, OPT_EMBED_MODEL},                                                      \
        {"embed-pooling", required_argument, 0, OPT_EMBED_POOLING}

typedef struct cli_serve_cache {
    bool on;
    blade_semcache_config cfg; /* dim and embedder are filled once the embedding model is known */
    const char *embed_model_path;
    blade_pooling pooling;
    /* what cli_serve_cache_start made, for cli_serve_cache_stop */
    blade_model *embed_model;
    blade_engine *embed_engine;
    blade_semcache *cache;
    char embedder[80];
} cli_serve_cache;

void cli_serve_cache_init(cli_serve_cache *o);
/* 1 when code was one of these flags, 0 when not, -1 on a bad value (reported on stderr). */
int cli_serve_cache_option(cli_serve_cache *o, int code, const char *arg);
void cli_serve_cache_usage(FILE *out);
/* Loads --embed-model into an engine of its own (configured like the served one), points
 * am's embeddings at it, and opens the cache when --semantic-cache was given. */
int cli_serve_cache_start(cli_serve_cache *o, api_model *am, const cli_engine_options *eo, blade_error *err);
/* Prints what is on: embeddings (model, pooling, width) and the cache's settings. */
void cli_serve_cache_describe(FILE *out, const cli_serve_cache *o, const api_model *am);
/* Closes the cache (writing what is queued for its database) and frees the embedding
 * engine; call after the server has stopped. */
void cli_serve_cache_stop(cli_serve_cache *o);

#endif

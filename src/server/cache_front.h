#ifndef BLADE_SERVER_CACHE_FRONT_H
#define BLADE_SERVER_CACHE_FRONT_H

/* The semantic cache in front of the engine (`blade serve --semantic-cache`): which
 * requests may be answered from it and stored in it, what they are keyed by, and the
 * prompt's embedding (computed by the embedding engine as a prefill-only request).
 *
 * A request takes part when it has one prompt and one choice, asks for no logprobs or echo,
 * did not send "semantic_cache": false, and is greedy (temperature 0) or sent
 * "semantic_cache": true. Its answer is stored when it finished with "stop" (greedy), or
 * with "stop" or "length" when the request opted in. The tenant is the bearer key the
 * client presented together with its cache_salt, so entries never cross either. The
 * cache's figures for /metrics are metrics.c's. */

#include "api/api.h"
#include "blade/semantic_cache.h"

#include <stdbool.h>

typedef struct cache_ticket {
    bool active;         /* the request takes part */
    bool opted_in;       /* "semantic_cache": true */
    char *tenant;
    char *params;        /* canonical encoding of what changes the answer */
    blade_semcache_key key;
    float *embedding;    /* the prompt's, once computed; NULL: exact tier only */
} cache_ticket;

/* Fills t for req; t->active false when the request does not take part (nothing to free
 * then, but cache_ticket_free is harmless). -1 only when out of memory. */
int cache_ticket_init(cache_ticket *t, const api_model *am, const api_request *req, const char *bearer);
void cache_ticket_free(cache_ticket *t);

/* The exact tier, then, if the cache has a semantic tier, the prompt's embedding (waiting
 * at most until `deadline` on the monotonic clock, 0: no limit) and the semantic tier.
 * Returns the tier of the hit (hit filled, to be cleared) or BLADE_SEMCACHE_MISS; an
 * embedding that cannot be computed makes a miss of the semantic tier (logged once). */
int cache_lookup(blade_semcache *c, const api_model *am, const api_request *req, cache_ticket *t, double deadline,
                 blade_semcache_hit *hit);

/* Stores a finished job's answer when the rules allow it. */
void cache_store(blade_semcache *c, cache_ticket *t, const api_job *job);

/* How the stored answer finished. */
blade_finish_reason cache_hit_finish(const blade_semcache_hit *hit);
/* The header value and the response field describing a hit. */
void cache_hit_header(const blade_semcache_hit *hit, char *out, size_t cap);
json_t *cache_hit_json(const blade_semcache_hit *hit);

#endif

#ifndef BLADE_SEMANTIC_CACHE_VECTOR_INDEX_H
#define BLADE_SEMANTIC_CACHE_VECTOR_INDEX_H

/* The nearest-neighbour index of one cache partition: unit vectors, each belonging to an
 * item the caller embeds in its own record (and recovers from the item's address). Either
 * an exact scan over a contiguous matrix, or an HNSW graph (hnsw_index.h); in AUTO mode it
 * switches between the two with the partition's size, and it rebuilds a graph whose
 * deleted nodes outnumber its live ones. Searches may run concurrently with each other,
 * not with add or remove. */

#include "blade/error.h"
#include "blade/semantic_cache.h"

#include <stddef.h>
#include <stdint.h>

typedef struct sc_vindex_item {
    int32_t slot; /* the index's, while the item is in it */
} sc_vindex_item;

typedef struct sc_vindex_params {
    int32_t dim;
    blade_semcache_index kind;
    int32_t exact_scan_max;
    int32_t hnsw_m, hnsw_ef_construction, hnsw_ef_search;
} sc_vindex_params;

typedef struct sc_vindex sc_vindex;

sc_vindex *sc_vindex_new(const sc_vindex_params *p, blade_error *err);
void sc_vindex_free(sc_vindex *x);
/* Adds the unit vector v for item (copied; item must not be in the index). */
int sc_vindex_add(sc_vindex *x, const float *v, sc_vindex_item *item, blade_error *err);
/* Removes the item; -1 with err set if a rebuild this triggered failed (the item is gone
 * either way and the index still answers correctly). */
int sc_vindex_remove(sc_vindex *x, sc_vindex_item *item, blade_error *err);
/* The item with the largest similarity to the unit vector q, and that similarity; NULL
 * when the index is empty (or on an internal HNSW error). */
sc_vindex_item *sc_vindex_nearest(const sc_vindex *x, const float *q, float *similarity);
/* The stored vector of an item in the index. */
const float *sc_vindex_vector(const sc_vindex *x, const sc_vindex_item *item);
/* Calls fn on every item (which must not modify the index). */
void sc_vindex_each(const sc_vindex *x, void (*fn)(void *ctx, sc_vindex_item *item), void *ctx);
int64_t sc_vindex_count(const sc_vindex *x);
bool sc_vindex_is_graph(const sc_vindex *x);
/* Memory held beyond the live items' vectors (spare room, graph links, deleted nodes). */
size_t sc_vindex_overhead_bytes(const sc_vindex *x);

#endif

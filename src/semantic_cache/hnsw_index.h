#ifndef BLADE_SEMANTIC_CACHE_HNSW_INDEX_H
#define BLADE_SEMANTIC_CACHE_HNSW_INDEX_H

/* A C interface to one hnswlib HNSW graph over unit vectors compared by inner product
 * (cosine similarity), with blade's run-time dispatched dot product as the distance.
 * Labels are the caller's; a removed label is only marked deleted (hnswlib keeps its
 * node), so the caller rebuilds when deleted nodes pile up. Searches may run concurrently
 * with each other, not with add or remove. */

#include "blade/error.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sc_hnsw sc_hnsw;

sc_hnsw *sc_hnsw_new(int32_t dim, size_t capacity, int32_t m, int32_t ef_construction, int32_t ef_search,
                     blade_error *err);
void sc_hnsw_free(sc_hnsw *h);
/* Adds a vector under a label not present before; grows the graph as needed. */
int sc_hnsw_add(sc_hnsw *h, const float *v, uint64_t label, blade_error *err);
/* Marks the label deleted: searches no longer return it. -1 when absent. */
int sc_hnsw_remove(sc_hnsw *h, uint64_t label);
/* The nearest live vector's label and its similarity; 1 when the graph has none, -1 on an
 * internal error. Approximate: it may miss the true nearest, never report a similarity
 * other than the one of the label it returns. */
int sc_hnsw_nearest(const sc_hnsw *h, const float *q, uint64_t *label, float *similarity);
/* The stored vector of a label (live or deleted), NULL when never added. */
const float *sc_hnsw_vector(const sc_hnsw *h, uint64_t label);
/* Memory the graph holds beyond its live vectors. */
size_t sc_hnsw_overhead_bytes(const sc_hnsw *h);

#ifdef __cplusplus
}
#endif

#endif

#ifndef BLADE_SEMANTIC_CACHE_DIGEST_MAP_H
#define BLADE_SEMANTIC_CACHE_DIGEST_MAP_H

/* A hash set of items keyed by the SHA-256 digest each holds in its first 32 bytes (cache
 * entries by request key, partitions by partition key). The digest is already uniform, so
 * its first 8 bytes are the hash; open addressing with linear probing and backward-shift
 * deletion, no tombstones. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SC_DIGEST_LEN 32

typedef struct sc_digest_map {
    void **slots;
    size_t cap; /* a power of two, or 0 */
    size_t count;
} sc_digest_map;

void sc_digest_map_free(sc_digest_map *m);
void *sc_digest_map_find(const sc_digest_map *m, const uint8_t key[SC_DIGEST_LEN]);
/* The item's key must not be present. -1 when memory runs out. */
int sc_digest_map_insert(sc_digest_map *m, void *item);
/* Removes the item (by its key); false when absent. */
bool sc_digest_map_remove(sc_digest_map *m, const void *item);

#endif

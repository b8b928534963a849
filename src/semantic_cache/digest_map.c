/* The digest-keyed hash set of the semantic cache (see digest_map.h). */
#include "semantic_cache/digest_map.h"

#include <stdlib.h>
#include <string.h>

static size_t home_of(const uint8_t *key, size_t cap)
{
    uint64_t h;
    memcpy(&h, key, sizeof h);
    return (size_t)h & (cap - 1);
}

void sc_digest_map_free(sc_digest_map *m)
{
    free(m->slots);
    *m = (sc_digest_map){0};
}

static size_t find_slot(const sc_digest_map *m, const uint8_t *key)
{
    size_t i = home_of(key, m->cap);
    while (m->slots[i] && memcmp(m->slots[i], key, SC_DIGEST_LEN) != 0)
        i = (i + 1) & (m->cap - 1);
    return i;
}

void *sc_digest_map_find(const sc_digest_map *m, const uint8_t key[SC_DIGEST_LEN])
{
    if (!m->cap)
        return NULL;
    return m->slots[find_slot(m, key)];
}

static int grow(sc_digest_map *m)
{
    size_t cap = m->cap ? m->cap * 2 : 16;
    void **slots = calloc(cap, sizeof *slots);
    if (!slots)
        return -1;
    sc_digest_map bigger = {.slots = slots, .cap = cap, .count = m->count};
    for (size_t i = 0; i < m->cap; i++)
        if (m->slots[i])
            slots[find_slot(&bigger, m->slots[i])] = m->slots[i];
    free(m->slots);
    *m = bigger;
    return 0;
}

int sc_digest_map_insert(sc_digest_map *m, void *item)
{
    /* at most half full keeps probe runs short */
    if ((m->count + 1) * 2 > m->cap && grow(m))
        return -1;
    m->slots[find_slot(m, item)] = item;
    m->count++;
    return 0;
}

bool sc_digest_map_remove(sc_digest_map *m, const void *item)
{
    if (!m->cap)
        return false;
    size_t hole = find_slot(m, item);
    if (!m->slots[hole])
        return false;
    m->slots[hole] = NULL;
    m->count--;
    /* Pull back every later item of the run whose home does not lie strictly between the
     * hole and it (cyclically), so each stays reachable from its home without a gap. */
    size_t mask = m->cap - 1;
    for (size_t i = (hole + 1) & mask; m->slots[i]; i = (i + 1) & mask) {
        size_t home = home_of(m->slots[i], m->cap);
        if (((i - home) & mask) >= ((i - hole) & mask)) {
            m->slots[hole] = m->slots[i];
            m->slots[i] = NULL;
            hole = i;
        }
    }
    return true;
}

#ifndef BLADE_SEMANTIC_CACHE_BACKGROUND_H
#define BLADE_SEMANTIC_CACHE_BACKGROUND_H

/* The semantic cache's background thread: database changes, queued in the order the cache
 * made them, written in batches of one transaction each; and a timer that calls the cache
 * back to sweep expired entries. Without a database it is only the timer. The queue is
 * bounded in bytes: beyond it stores and hit times are dropped (counted), since losing one
 * only loses a cache entry; deletions are always kept. */

#include "blade/error.h"
#include "semantic_cache/store.h"

#include <stdint.h>

typedef struct sc_background sc_background;

typedef struct sc_background_counts {
    uint64_t writes;  /* changes written */
    uint64_t errors;  /* changes lost to failed writes */
    uint64_t dropped; /* changes not queued: backlog full or no memory */
} sc_background_counts;

/* A queue for store (NULL: none) and a timer calling tick every tick_interval_s (<= 0:
 * never); the thread starts with sc_background_run, so changes can be queued before. */
sc_background *sc_background_new(sc_store *store, int32_t dim, double tick_interval_s, void (*tick)(void *ctx),
                                  void *ctx, sc_log_fn log, void *log_ctx, blade_error *err);
int sc_background_run(sc_background *b, blade_error *err);
/* Writes what is queued, stops the thread and frees b (not the store). NULL is ignored. */
void sc_background_free(sc_background *b);
/* Drops every queued change unwritten. */
void sc_background_discard(sc_background *b);

/* Queue a change (no-ops without a store). The row is copied. */
void sc_background_put(sc_background *b, const sc_row *row);
void sc_background_delete(sc_background *b, const uint8_t key[SC_KEY_LEN]);
void sc_background_touch(sc_background *b, const uint8_t key[SC_KEY_LEN], double last_hit);

/* Waits until every change queued so far is written (or failed); -1 with err set when a
 * write failed since the last flush. */
int sc_background_flush(sc_background *b, blade_error *err);
sc_background_counts sc_background_get_counts(sc_background *b);

#endif

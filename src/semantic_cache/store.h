#ifndef BLADE_SEMANTIC_CACHE_STORE_H
#define BLADE_SEMANTIC_CACHE_STORE_H

/* The semantic cache's SQLite database: one row per entry, and the dimension and embedder
 * the vectors were made with. A file that is not such a database (unreadable, truncated,
 * another schema, another embedder) is moved aside to "<path>.corrupt-<time>" and a fresh
 * one created in its place, with a warning through the log function. Rows are checked for
 * shape here (types, sizes); their values are the caller's to check. One thread at a time. */

#include "blade/error.h"

#include <stddef.h>
#include <stdint.h>

#define SC_KEY_LEN 32
/* Longest model id a row may hold. */
#define SC_MODEL_MAX 256

typedef struct sc_row {
    uint8_t key[SC_KEY_LEN];    /* exact-tier key */
    uint8_t tenant[SC_KEY_LEN]; /* tenant digest */
    uint8_t params[SC_KEY_LEN]; /* parameters digest */
    const char *model;
    double created, last_hit;
    int64_t prompt_tokens, completion_tokens;
    const char *finish_reason;
    const void *text;
    size_t text_len;
    const void *extra;
    size_t extra_len;
    const float *embedding; /* NULL or dim floats */
} sc_row;

typedef void (*sc_log_fn)(void *ctx, const char *msg);
typedef struct sc_store sc_store;

/* NULL with err set only when no usable database can be had at path at all (cannot be
 * created, locked by another process, cannot be moved aside). */
sc_store *sc_store_open(const char *path, int32_t dim, const char *embedder, sc_log_fn log, void *log_ctx,
                        blade_error *err);
void sc_store_close(sc_store *s);

/* Calls fn for every row, least recently hit first, with its position and the row count.
 * 0 when all rows were read; -1 with err set when a row is malformed, fn rejected one
 * (returning -1 with err set), or the file failed while reading: the caller then discards
 * what it took and calls sc_store_set_aside. */
int sc_store_load(sc_store *s, int (*fn)(void *ctx, const sc_row *row, int64_t i, int64_t n, blade_error *err),
                  void *ctx, blade_error *err);
/* Moves the database aside (warning with why) and starts a fresh one; -1 with err set when
 * that fails, the store then being unusable. */
int sc_store_set_aside(sc_store *s, const char *why, blade_error *err);

int sc_store_begin(sc_store *s, blade_error *err);
int sc_store_commit(sc_store *s, blade_error *err);
void sc_store_rollback(sc_store *s);
int sc_store_put(sc_store *s, const sc_row *row, blade_error *err);
int sc_store_delete(sc_store *s, const uint8_t key[SC_KEY_LEN], blade_error *err);
int sc_store_touch(sc_store *s, const uint8_t key[SC_KEY_LEN], double last_hit, blade_error *err);

#endif

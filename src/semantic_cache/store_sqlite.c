/* The semantic cache's SQLite persistence (see store.h). The file is hostile: it is opened
 * in SQLite's defensive mode, checked page by page (quick_check) and against the exact
 * schema this file creates, and every row's types and sizes are checked as it is read. */
#include "semantic_cache/store.h"

#include <errno.h>
#include <inttypes.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define FORMAT_NAME "blade-semantic-cache"
#define FORMAT_VERSION "1"

static const char META_SQL[] = "CREATE TABLE meta(name TEXT PRIMARY KEY, value TEXT NOT NULL)";
static const char ENTRIES_SQL[] =
    "CREATE TABLE entries(key BLOB PRIMARY KEY, tenant BLOB NOT NULL, model TEXT NOT NULL, params BLOB NOT NULL, "
    "created REAL NOT NULL, last_hit REAL NOT NULL, prompt_tokens INTEGER NOT NULL, "
    "completion_tokens INTEGER NOT NULL, finish_reason TEXT NOT NULL, text BLOB NOT NULL, extra BLOB NOT NULL, "
    "embedding BLOB)";
static const char LAST_HIT_INDEX_SQL[] = "CREATE INDEX entries_last_hit ON entries(last_hit)";

struct sc_store {
    char *path;
    int32_t dim;
    char *embedder;
    sc_log_fn log;
    void *log_ctx;
    sqlite3 *db;
    sqlite3_stmt *put, *del, *touch;
};

static void warn(sc_store *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void warn(sc_store *s, const char *fmt, ...)
{
    char msg[BLADE_ERROR_LEN + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    s->log(s->log_ctx, msg);
}

static int db_error(sc_store *s, blade_error *err, const char *what)
{
    return blade_error_set(err, "%s: %s: %s", s->path, what, s->db ? sqlite3_errmsg(s->db) : "no database");
}

static void close_db(sc_store *s)
{
    sqlite3_finalize(s->put);
    sqlite3_finalize(s->del);
    sqlite3_finalize(s->touch);
    s->put = s->del = s->touch = NULL;
    sqlite3_close(s->db);
    s->db = NULL;
}

/* Outcome of opening the file: usable, not a usable cache database (set it aside), or a
 * failure that moving the file would not cure (permissions, another process holding it). */
typedef enum { OPEN_OK, OPEN_CORRUPT, OPEN_FAILED } open_result;

static open_result classify(int rc)
{
    switch (rc & 0xff) {
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
    case SQLITE_FORMAT:
    case SQLITE_SCHEMA:
    case SQLITE_MISMATCH:
    case SQLITE_TOOBIG:
    case SQLITE_RANGE:
        return OPEN_CORRUPT;
    default:
        return OPEN_FAILED;
    }
}

static open_result exec(sc_store *s, const char *sql, blade_error *err)
{
    int rc = sqlite3_exec(s->db, sql, NULL, NULL, NULL);
    if (rc == SQLITE_OK)
        return OPEN_OK;
    db_error(s, err, sql);
    return classify(rc);
}

/* One text value from a one-row query into out (NUL-terminated, truncated to cap). */
static int query_text(sc_store *s, const char *sql, const char *arg, char *out, size_t cap, int *rc_out)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    if (rc == SQLITE_OK && arg)
        rc = sqlite3_bind_text(st, 1, arg, -1, SQLITE_STATIC);
    int found = 0;
    if (rc == SQLITE_OK) {
        rc = sqlite3_step(st);
        if (rc == SQLITE_ROW) {
            const unsigned char *t = sqlite3_column_text(st, 0);
            snprintf(out, cap, "%s", t ? (const char *)t : "");
            found = 1;
            rc = SQLITE_OK;
        } else if (rc == SQLITE_DONE) {
            rc = SQLITE_OK;
        }
    }
    sqlite3_finalize(st);
    *rc_out = rc;
    return found;
}

static open_result check_schema(sc_store *s, bool *fresh, blade_error *err)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db,
                                "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite\\_%' ESCAPE '\\'",
                                -1, &st, NULL);
    int n = 0, good = 0;
    char odd[200] = "";
    while (rc == SQLITE_OK || rc == SQLITE_ROW) {
        if ((rc = sqlite3_step(st)) != SQLITE_ROW)
            break;
        const char *type = (const char *)sqlite3_column_text(st, 0);
        const char *name = (const char *)sqlite3_column_text(st, 1);
        const char *sql = (const char *)sqlite3_column_text(st, 2);
        n++;
        bool ours = type && name && sql &&
                    ((!strcmp(type, "table") && !strcmp(name, "meta") && !strcmp(sql, META_SQL)) ||
                     (!strcmp(type, "table") && !strcmp(name, "entries") && !strcmp(sql, ENTRIES_SQL)) ||
                     (!strcmp(type, "index") && !strcmp(name, "entries_last_hit") && !strcmp(sql, LAST_HIT_INDEX_SQL)));
        if (ours)
            good++;
        else if (!odd[0])
            snprintf(odd, sizeof odd, "%s '%s'", type ? type : "?", name ? name : "?");
    }
    if (rc != SQLITE_DONE) {
        db_error(s, err, "reading the schema");
        sqlite3_finalize(st);
        return classify(rc);
    }
    sqlite3_finalize(st);
    *fresh = n == 0;
    if (n == 0 || (n == 3 && good == 3))
        return OPEN_OK;
    blade_error_set(err, "%s: not a blade semantic cache database (%s)", s->path,
                    odd[0] ? odd : "a table or index missing");
    return OPEN_CORRUPT;
}

static open_result create_schema(sc_store *s, blade_error *err)
{
    char dim[32];
    snprintf(dim, sizeof dim, "%" PRId32, s->dim);
    open_result r = exec(s, "BEGIN", err);
    if (r == OPEN_OK)
        r = exec(s, META_SQL, err);
    if (r == OPEN_OK)
        r = exec(s, ENTRIES_SQL, err);
    if (r == OPEN_OK)
        r = exec(s, LAST_HIT_INDEX_SQL, err);
    const char *meta[][2] = {{"format", FORMAT_NAME}, {"version", FORMAT_VERSION}, {"dim", dim}, {"embedder", s->embedder}};
    for (size_t i = 0; r == OPEN_OK && i < sizeof meta / sizeof meta[0]; i++) {
        sqlite3_stmt *st = NULL;
        int rc = sqlite3_prepare_v2(s->db, "INSERT INTO meta(name, value) VALUES(?, ?)", -1, &st, NULL);
        if (rc == SQLITE_OK)
            rc = sqlite3_bind_text(st, 1, meta[i][0], -1, SQLITE_STATIC);
        if (rc == SQLITE_OK)
            rc = sqlite3_bind_text(st, 2, meta[i][1], -1, SQLITE_STATIC);
        if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_DONE)
            rc = SQLITE_OK;
        sqlite3_finalize(st);
        if (rc != SQLITE_OK) {
            db_error(s, err, "writing the schema");
            r = classify(rc);
        }
    }
    if (r == OPEN_OK)
        return exec(s, "COMMIT", err);
    sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    return r;
}

static open_result check_meta(sc_store *s, blade_error *err)
{
    static const char *const names[] = {"format", "version", "dim", "embedder"};
    char want_dim[32];
    snprintf(want_dim, sizeof want_dim, "%" PRId32, s->dim);
    const char *want[] = {FORMAT_NAME, FORMAT_VERSION, want_dim, s->embedder};
    for (int i = 0; i < 4; i++) {
        char got[SC_MODEL_MAX + 1];
        int rc;
        if (!query_text(s, "SELECT value FROM meta WHERE name = ?", names[i], got, sizeof got, &rc)) {
            if (rc != SQLITE_OK) {
                db_error(s, err, "reading the format");
                return classify(rc);
            }
            blade_error_set(err, "%s: no '%s' in its meta table", s->path, names[i]);
            return OPEN_CORRUPT;
        }
        if (strcmp(got, want[i]) != 0) {
            blade_error_set(err, "%s: written with %s '%.200s', this cache uses '%.200s'", s->path, names[i], got, want[i]);
            return OPEN_CORRUPT;
        }
    }
    return OPEN_OK;
}

static open_result prepare(sc_store *s, blade_error *err)
{
    static const char put[] = "INSERT OR REPLACE INTO entries(key, tenant, model, params, created, last_hit, "
                              "prompt_tokens, completion_tokens, finish_reason, text, extra, embedding) "
                              "VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";
    if (sqlite3_prepare_v3(s->db, put, -1, SQLITE_PREPARE_PERSISTENT, &s->put, NULL) != SQLITE_OK ||
        sqlite3_prepare_v3(s->db, "DELETE FROM entries WHERE key = ?", -1, SQLITE_PREPARE_PERSISTENT, &s->del, NULL) !=
            SQLITE_OK ||
        sqlite3_prepare_v3(s->db, "UPDATE entries SET last_hit = ? WHERE key = ?", -1, SQLITE_PREPARE_PERSISTENT,
                           &s->touch, NULL) != SQLITE_OK) {
        db_error(s, err, "preparing statements");
        return OPEN_FAILED;
    }
    return OPEN_OK;
}

static open_result open_db(sc_store *s, blade_error *err)
{
    int rc = sqlite3_open_v2(s->path, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL);
    if (rc != SQLITE_OK) {
        db_error(s, err, "cannot open");
        return classify(rc);
    }
    /* A crafted file must not be able to run SQL of its own (triggers, views) or make
     * SQLite trust its page contents. */
    sqlite3_db_config(s->db, SQLITE_DBCONFIG_DEFENSIVE, 1, NULL);
    sqlite3_db_config(s->db, SQLITE_DBCONFIG_TRUSTED_SCHEMA, 0, NULL);
    sqlite3_extended_result_codes(s->db, 1);
    open_result r = exec(s, "PRAGMA cell_size_check = ON", err);
    if (r == OPEN_OK)
        r = exec(s, "PRAGMA mmap_size = 0", err);
    /* One server per file: a second one gets "database is locked" instead of two writers
     * each believing their own view. */
    if (r == OPEN_OK)
        r = exec(s, "PRAGMA locking_mode = EXCLUSIVE", err);
    if (r == OPEN_OK)
        r = exec(s, "BEGIN EXCLUSIVE", err);
    if (r == OPEN_OK)
        r = exec(s, "COMMIT", err);
    if (r != OPEN_OK)
        return r;
    char check[256];
    if (!query_text(s, "PRAGMA quick_check", NULL, check, sizeof check, &rc) || rc != SQLITE_OK) {
        db_error(s, err, "checking the file");
        return rc == SQLITE_OK ? OPEN_CORRUPT : classify(rc);
    }
    if (strcmp(check, "ok") != 0) {
        blade_error_set(err, "%s: damaged: %s", s->path, check);
        return OPEN_CORRUPT;
    }
    bool fresh;
    r = check_schema(s, &fresh, err);
    if (r == OPEN_OK)
        r = fresh ? create_schema(s, err) : check_meta(s, err);
    if (r == OPEN_OK)
        r = prepare(s, err);
    return r;
}

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

/* Renames the file, and the journal SQLite may have left beside it, to a free
 * "<path>.corrupt-<unix time>[-<n>]". */
static int move_aside(sc_store *s, char *aside, size_t cap, blade_error *err)
{
    long long now = (long long)time(NULL);
    for (int n = 0; n < 1000; n++) {
        if (n)
            snprintf(aside, cap, "%s.corrupt-%lld-%d", s->path, now, n);
        else
            snprintf(aside, cap, "%s.corrupt-%lld", s->path, now);
        if (!exists(aside))
            break;
    }
    if (rename(s->path, aside) != 0 && errno != ENOENT)
        return blade_error_set(err, "%s: cannot move it aside to %s: %s", s->path, aside, strerror(errno));
    static const char *const sides[] = {"-journal", "-wal", "-shm"};
    for (int i = 0; i < 3; i++) {
        char from[4200], to[4200];
        snprintf(from, sizeof from, "%s%s", s->path, sides[i]);
        snprintf(to, sizeof to, "%s%s", aside, sides[i]);
        if (exists(from) && rename(from, to) != 0)
            return blade_error_set(err, "%s: cannot move it aside to %s: %s", from, to, strerror(errno));
    }
    return 0;
}

int sc_store_set_aside(sc_store *s, const char *why, blade_error *err)
{
    close_db(s);
    char aside[4200];
    if (move_aside(s, aside, sizeof aside, err))
        return -1;
    warn(s, "warning: semantic cache: %s; moved to %s, starting empty", why, aside);
    blade_error e2 = {{0}};
    if (open_db(s, &e2) != OPEN_OK) {
        close_db(s);
        return blade_error_set(err, "%s", e2.msg);
    }
    return 0;
}

sc_store *sc_store_open(const char *path, int32_t dim, const char *embedder, sc_log_fn log, void *log_ctx,
                        blade_error *err)
{
    if (strlen(path) > 4000) {
        blade_error_set(err, "semantic cache database path too long");
        return NULL;
    }
    sc_store *s = calloc(1, sizeof *s);
    if (!s || !(s->path = strdup(path)) || !(s->embedder = strdup(embedder))) {
        blade_error_set(err, "out of memory");
        sc_store_close(s);
        return NULL;
    }
    s->dim = dim;
    s->log = log;
    s->log_ctx = log_ctx;
    blade_error why = {{0}};
    open_result r = open_db(s, &why);
    if (r == OPEN_CORRUPT && sc_store_set_aside(s, why.msg, err) == 0)
        r = OPEN_OK;
    else if (r == OPEN_FAILED)
        blade_error_set(err, "%s", why.msg);
    if (r != OPEN_OK) {
        sc_store_close(s);
        return NULL;
    }
    return s;
}

void sc_store_close(sc_store *s)
{
    if (!s)
        return;
    close_db(s);
    free(s->path);
    free(s->embedder);
    free(s);
}

static int blob_column(sqlite3_stmt *st, int col, const char *name, size_t want, uint8_t *out, blade_error *err)
{
    if (sqlite3_column_type(st, col) != SQLITE_BLOB || (size_t)sqlite3_column_bytes(st, col) != want)
        return blade_error_set(err, "column %s is not a %zu-byte blob", name, want);
    memcpy(out, sqlite3_column_blob(st, col), want);
    return 0;
}

/* A text column of at most max bytes with no NUL inside. */
static int text_column(sqlite3_stmt *st, int col, const char *name, size_t max, const char **out, blade_error *err)
{
    if (sqlite3_column_type(st, col) != SQLITE_TEXT)
        return blade_error_set(err, "column %s is not text", name);
    const char *t = (const char *)sqlite3_column_text(st, col);
    size_t n = (size_t)sqlite3_column_bytes(st, col);
    if (!t || n > max || strlen(t) != n)
        return blade_error_set(err, "column %s is longer than %zu bytes or holds a NUL", name, max);
    *out = t;
    return 0;
}

static int int_column(sqlite3_stmt *st, int col, const char *name, int64_t *out, blade_error *err)
{
    if (sqlite3_column_type(st, col) != SQLITE_INTEGER)
        return blade_error_set(err, "column %s is not an integer", name);
    *out = sqlite3_column_int64(st, col);
    return 0;
}

static int real_column(sqlite3_stmt *st, int col, const char *name, double *out, blade_error *err)
{
    int type = sqlite3_column_type(st, col);
    if (type != SQLITE_FLOAT && type != SQLITE_INTEGER)
        return blade_error_set(err, "column %s is not a number", name);
    *out = sqlite3_column_double(st, col);
    return 0;
}

/* The row's shape; its values (finite times, vector norms, sizes against the capacity)
 * are the caller's to judge. */
static int read_row(sc_store *s, sqlite3_stmt *st, sc_row *row, float *vec, blade_error *err)
{
    memset(row, 0, sizeof *row);
    if (blob_column(st, 0, "key", SC_KEY_LEN, row->key, err) ||
        blob_column(st, 1, "tenant", SC_KEY_LEN, row->tenant, err) ||
        text_column(st, 2, "model", SC_MODEL_MAX, &row->model, err) ||
        blob_column(st, 3, "params", SC_KEY_LEN, row->params, err) ||
        real_column(st, 4, "created", &row->created, err) || real_column(st, 5, "last_hit", &row->last_hit, err) ||
        int_column(st, 6, "prompt_tokens", &row->prompt_tokens, err) ||
        int_column(st, 7, "completion_tokens", &row->completion_tokens, err) ||
        text_column(st, 8, "finish_reason", 64, &row->finish_reason, err))
        return -1;
    for (int col = 9; col <= 10; col++) {
        if (sqlite3_column_type(st, col) != SQLITE_BLOB)
            return blade_error_set(err, "column %s is not a blob", col == 9 ? "text" : "extra");
    }
    row->text = sqlite3_column_blob(st, 9);
    row->text_len = (size_t)sqlite3_column_bytes(st, 9);
    row->extra = sqlite3_column_blob(st, 10);
    row->extra_len = (size_t)sqlite3_column_bytes(st, 10);
    int type = sqlite3_column_type(st, 11);
    if (type == SQLITE_NULL)
        return 0;
    size_t want = (size_t)s->dim * sizeof(float);
    if (type != SQLITE_BLOB || s->dim == 0 || (size_t)sqlite3_column_bytes(st, 11) != want)
        return blade_error_set(err, "column embedding is not a blob of %" PRId32 " floats", s->dim);
    /* copied out: the blob need not be aligned for floats */
    memcpy(vec, sqlite3_column_blob(st, 11), want);
    row->embedding = vec;
    return 0;
}

int sc_store_load(sc_store *s, int (*fn)(void *ctx, const sc_row *row, int64_t i, int64_t n, blade_error *err),
                  void *ctx, blade_error *err)
{
    char count[32];
    int rc;
    if (!query_text(s, "SELECT count(*) FROM entries", NULL, count, sizeof count, &rc) || rc != SQLITE_OK)
        return db_error(s, err, "counting entries");
    int64_t n = strtoll(count, NULL, 10);
    float *vec = malloc(((size_t)s->dim + 1) * sizeof *vec);
    if (!vec)
        return blade_error_set(err, "out of memory");
    sqlite3_stmt *st = NULL;
    rc = sqlite3_prepare_v2(s->db,
                            "SELECT key, tenant, model, params, created, last_hit, prompt_tokens, completion_tokens, "
                            "finish_reason, text, extra, embedding FROM entries ORDER BY last_hit, key",
                            -1, &st, NULL);
    int status = 0;
    int64_t i = 0;
    while (rc == SQLITE_OK || rc == SQLITE_ROW) {
        if ((rc = sqlite3_step(st)) != SQLITE_ROW)
            break;
        sc_row row;
        if (read_row(s, st, &row, vec, err) || fn(ctx, &row, i, n, err)) {
            blade_error_prefix(err, "%s: entry %" PRId64, s->path, i);
            status = -1;
            break;
        }
        i++;
    }
    if (status == 0 && rc != SQLITE_DONE)
        status = db_error(s, err, "reading entries");
    sqlite3_finalize(st);
    free(vec);
    return status;
}

int sc_store_begin(sc_store *s, blade_error *err)
{
    if (!s->db)
        return blade_error_set(err, "%s: no database", s->path);
    return sqlite3_exec(s->db, "BEGIN", NULL, NULL, NULL) == SQLITE_OK ? 0 : db_error(s, err, "BEGIN");
}

int sc_store_commit(sc_store *s, blade_error *err)
{
    return sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL) == SQLITE_OK ? 0 : db_error(s, err, "COMMIT");
}

void sc_store_rollback(sc_store *s)
{
    if (s->db)
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
}

static int step_done(sc_store *s, sqlite3_stmt *st, int rc, blade_error *err, const char *what)
{
    if (rc == SQLITE_OK)
        rc = sqlite3_step(st);
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc == SQLITE_DONE ? 0 : db_error(s, err, what);
}

int sc_store_put(sc_store *s, const sc_row *row, blade_error *err)
{
    sqlite3_stmt *st = s->put;
    /* zero-length blobs need a non-NULL pointer or SQLite stores NULL */
    static const char empty[1];
    int rc = sqlite3_bind_blob(st, 1, row->key, SC_KEY_LEN, SQLITE_STATIC);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_blob(st, 2, row->tenant, SC_KEY_LEN, SQLITE_STATIC);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_text(st, 3, row->model, -1, SQLITE_STATIC);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_blob(st, 4, row->params, SC_KEY_LEN, SQLITE_STATIC);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_double(st, 5, row->created);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_double(st, 6, row->last_hit);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int64(st, 7, row->prompt_tokens);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int64(st, 8, row->completion_tokens);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_text(st, 9, row->finish_reason, -1, SQLITE_STATIC);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_blob64(st, 10, row->text_len ? row->text : empty, row->text_len, SQLITE_STATIC);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_blob64(st, 11, row->extra_len ? row->extra : empty, row->extra_len, SQLITE_STATIC);
    if (rc == SQLITE_OK)
        rc = row->embedding ? sqlite3_bind_blob64(st, 12, row->embedding, (size_t)s->dim * sizeof(float), SQLITE_STATIC)
                            : sqlite3_bind_null(st, 12);
    return step_done(s, st, rc, err, "storing an entry");
}

int sc_store_delete(sc_store *s, const uint8_t key[SC_KEY_LEN], blade_error *err)
{
    int rc = sqlite3_bind_blob(s->del, 1, key, SC_KEY_LEN, SQLITE_STATIC);
    return step_done(s, s->del, rc, err, "deleting an entry");
}

int sc_store_touch(sc_store *s, const uint8_t key[SC_KEY_LEN], double last_hit, blade_error *err)
{
    int rc = sqlite3_bind_double(s->touch, 1, last_hit);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_blob(s->touch, 2, key, SC_KEY_LEN, SQLITE_STATIC);
    return step_done(s, s->touch, rc, err, "updating an entry");
}

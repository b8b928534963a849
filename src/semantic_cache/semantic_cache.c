/* The semantic cache (see blade/semantic_cache.h): entries and their partitions, the two
 * lookup tiers, LRU eviction, TTL expiry, statistics, and loading the database (writing it,
 * and the periodic sweep, are background.c's).
 *
 * Locking: `lock` (read/write) guards the maps, partitions, indexes and which entries
 * exist; lookups hold it shared, so they run in parallel, and take `mu` for the few
 * writes a hit makes (its LRU position and last-hit time) and for the statistics.
 * Database changes are queued (background.h) while `lock` is held, in the order they were
 * made, so the file replays the memory's history. Order: lock, mu, the queue's. */
#include "blade/semantic_cache.h"

#include "blade/kernels.h"
#include "semantic_cache/background.h"
#include "semantic_cache/digest_map.h"
#include "semantic_cache/store.h"
#include "semantic_cache/vector_index.h"

#include <inttypes.h>
#include <math.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* AUTO's switch from the exact scan to an HNSW graph: a partition switches once it holds
 * more than max(SCAN_MIN_ENTRIES, SCAN_FLOATS / dim) entries, about where the graph's
 * lookups become faster than the scan's (MEASURED.md, "The semantic cache"). */
#define SCAN_MIN_ENTRIES 1024
#define SCAN_FLOATS (1 << 19)
/* While loading, progress is reported this often. */
#define LOAD_PROGRESS_S 2.0

const double blade_semcache_latency_bounds_s[BLADE_SEMCACHE_LATENCY_BUCKETS - 1] = {
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3};
const double blade_semcache_similarity_bounds[BLADE_SEMCACHE_SIMILARITY_BUCKETS - 1] = {
    0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 0.999};

typedef struct sc_partition {
    uint8_t key[SC_DIGEST_LEN]; /* first: the digest map's key */
    uint8_t tenant[SC_KEY_LEN], params[SC_KEY_LEN];
    char *model;
    int64_t n_entries;
    sc_vindex *index; /* created with the first embedding */
} sc_partition;

typedef struct sc_entry {
    uint8_t key[SC_DIGEST_LEN]; /* first: the exact-tier key */
    sc_partition *part;
    struct sc_entry *newer, *older; /* LRU list, under mu */
    double created;
    double last_hit; /* under mu */
    sc_vindex_item item;
    bool in_index;
    int64_t bytes;
    int32_t prompt_tokens, completion_tokens;
    char finish_reason[BLADE_SEMCACHE_FINISH_MAX];
    size_t text_len, extra_len;
    char data[]; /* text, NUL, extra */
} sc_entry;

typedef struct histogram {
    uint64_t count[BLADE_SEMCACHE_LATENCY_BUCKETS]; /* per bucket, not cumulative */
    double sum;
} histogram;

struct blade_semcache {
    blade_semcache_config cfg;
    char *db_path, *embedder;
    sc_vindex_params index_params;

    pthread_rwlock_t lock;
    sc_digest_map entries, partitions;
    int64_t n_entries, bytes;

    pthread_mutex_t mu;
    sc_entry *newest, *oldest;
    uint64_t exact_hits, semantic_hits, misses, inserts, evictions, expirations, rejected;
    histogram latency, hit_sim, miss_sim;

    sc_store *store; /* NULL: memory only */
    sc_background *bg;
};

/* ---- time, logging ---- */

static double monotonic_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double realtime_now(void *ctx)
{
    (void)ctx;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double now_of(const blade_semcache *c)
{
    return c->cfg.clock(c->cfg.clock_ctx);
}

static void stderr_log(void *ctx, const char *msg)
{
    (void)ctx;
    fprintf(stderr, "%s\n", msg);
}

static void logf_(blade_semcache *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void logf_(blade_semcache *c, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->cfg.log(c->cfg.log_ctx, msg);
}

/* ---- keys ---- */

typedef struct keys {
    uint8_t tenant[SC_KEY_LEN], params[SC_KEY_LEN], part[SC_KEY_LEN], exact[SC_KEY_LEN];
} keys;

/* SHA-256 over the parts, each preceded by its length so no two part lists collide. */
static void sha256_parts(uint8_t out[SC_KEY_LEN], const char *domain, int n, const void *const *parts,
                         const size_t *lens)
{
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    unsigned int len = 0;
    if (md && EVP_DigestInit_ex(md, EVP_sha256(), NULL)) {
        EVP_DigestUpdate(md, domain, strlen(domain) + 1);
        for (int i = 0; i < n; i++) {
            uint64_t l = lens[i];
            EVP_DigestUpdate(md, &l, sizeof l);
            if (l)
                EVP_DigestUpdate(md, parts[i], lens[i]);
        }
        EVP_DigestFinal_ex(md, out, &len);
    }
    EVP_MD_CTX_free(md);
    if (len != SC_KEY_LEN)
        abort(); /* only on allocation failure inside OpenSSL: no key means no isolation */
}

static void partition_key(uint8_t out[SC_KEY_LEN], const uint8_t tenant[SC_KEY_LEN], const char *model,
                          const uint8_t params[SC_KEY_LEN])
{
    const void *parts[] = {tenant, model, params};
    size_t lens[] = {SC_KEY_LEN, strlen(model), SC_KEY_LEN};
    sha256_parts(out, "blade semantic cache partition", 3, parts, lens);
}

static int make_keys(const blade_semcache_key *k, keys *out, blade_error *err)
{
    if (!k || !k->tenant || !k->model)
        return blade_error_set(err, "semantic cache: the key needs a tenant and a model");
    size_t model_len = strlen(k->model);
    if (model_len == 0 || model_len > SC_MODEL_MAX)
        return blade_error_set(err, "semantic cache: model id must be 1 to %d bytes, got %zu", SC_MODEL_MAX, model_len);
    if ((!k->params && k->params_len) || (!k->prompt && k->prompt_len))
        return blade_error_set(err, "semantic cache: key bytes missing");
    const void *tenant = k->tenant;
    size_t tenant_len = strlen(k->tenant);
    sha256_parts(out->tenant, "blade semantic cache tenant", 1, &tenant, &tenant_len);
    sha256_parts(out->params, "blade semantic cache parameters", 1, &k->params, &k->params_len);
    partition_key(out->part, out->tenant, k->model, out->params);
    const void *parts[] = {out->part, k->prompt};
    size_t lens[] = {SC_KEY_LEN, k->prompt_len};
    sha256_parts(out->exact, "blade semantic cache request", 2, parts, lens);
    return 0;
}

/* The embedding scaled to unit length, into out; -1 when it has no direction. */
static int normalise(const float *v, int32_t dim, float *out, blade_error *err)
{
    double ss = 0.0;
    for (int32_t i = 0; i < dim; i++) {
        if (!isfinite(v[i]))
            return blade_error_set(err, "semantic cache: embedding element %d is not finite", (int)i);
        ss += (double)v[i] * v[i];
    }
    if (!(ss > 0.0) || !isfinite(ss))
        return blade_error_set(err, "semantic cache: embedding has no direction (norm %g)", sqrt(ss));
    double inv = 1.0 / sqrt(ss);
    for (int32_t i = 0; i < dim; i++)
        out[i] = (float)(v[i] * inv);
    return 0;
}

static float *unit_copy(const blade_semcache *c, const float *v, blade_error *err)
{
    if (!v || c->cfg.dim == 0)
        return NULL;
    float *q = malloc((size_t)c->cfg.dim * sizeof *q);
    if (!q) {
        blade_error_set(err, "semantic cache: out of memory");
        return NULL;
    }
    if (normalise(v, c->cfg.dim, q, err)) {
        free(q);
        return NULL;
    }
    return q;
}

/* The request's keys, and its embedding at unit length (NULL when none was given or the
 * semantic tier is off). */
static int prepare(const blade_semcache *c, const blade_semcache_key *key, const float *embedding, keys *k,
                   float **vec, blade_error *err)
{
    *vec = NULL;
    if (make_keys(key, k, err))
        return -1;
    *vec = unit_copy(c, embedding, err);
    return embedding && c->cfg.dim && !*vec ? -1 : 0;
}

static bool expired_at(const blade_semcache *c, double created, double now)
{
    return c->cfg.ttl_s > 0 && now - created >= c->cfg.ttl_s;
}

static bool expired(const blade_semcache *c, const sc_entry *e, double now)
{
    return expired_at(c, e->created, now);
}

static sc_entry *entry_of(sc_vindex_item *item)
{
    return (sc_entry *)((char *)item - offsetof(sc_entry, item));
}

/* ---- entries and partitions (under the write lock) ---- */

static sc_partition *get_partition(blade_semcache *c, const keys *k, const char *model, blade_error *err)
{
    sc_partition *p = sc_digest_map_find(&c->partitions, k->part);
    if (p)
        return p;
    p = calloc(1, sizeof *p);
    if (p && (p->model = strdup(model)) != NULL) {
        memcpy(p->key, k->part, SC_KEY_LEN);
        memcpy(p->tenant, k->tenant, SC_KEY_LEN);
        memcpy(p->params, k->params, SC_KEY_LEN);
        if (sc_digest_map_insert(&c->partitions, p) == 0)
            return p;
        free(p->model);
    }
    free(p);
    blade_error_set(err, "semantic cache: out of memory");
    return NULL;
}

static void drop_partition_if_empty(blade_semcache *c, sc_partition *p)
{
    if (p->n_entries > 0)
        return;
    sc_digest_map_remove(&c->partitions, p);
    sc_vindex_free(p->index);
    free(p->model);
    free(p);
}

static void lru_unlink(blade_semcache *c, sc_entry *e)
{
    if (e->newer)
        e->newer->older = e->older;
    else
        c->newest = e->older;
    if (e->older)
        e->older->newer = e->newer;
    else
        c->oldest = e->newer;
    e->newer = e->older = NULL;
}

static void lru_push_newest(blade_semcache *c, sc_entry *e)
{
    e->older = c->newest;
    e->newer = NULL;
    if (c->newest)
        c->newest->newer = e;
    else
        c->oldest = e;
    c->newest = e;
}

typedef enum { GONE_REPLACED, GONE_EVICTED, GONE_EXPIRED } gone_reason;

static void remove_entry(blade_semcache *c, sc_entry *e, gone_reason why)
{
    sc_digest_map_remove(&c->entries, e);
    pthread_mutex_lock(&c->mu);
    lru_unlink(c, e);
    if (why == GONE_EVICTED)
        c->evictions++;
    else if (why == GONE_EXPIRED)
        c->expirations++;
    pthread_mutex_unlock(&c->mu);
    sc_partition *p = e->part;
    if (e->in_index) {
        blade_error err = {{0}};
        if (sc_vindex_remove(p->index, &e->item, &err))
            logf_(c, "warning: semantic cache: %s", err.msg);
    }
    /* a replaced entry's row is overwritten by its successor's */
    if (why != GONE_REPLACED)
        sc_background_delete(c->bg, e->key);
    c->n_entries--;
    c->bytes -= e->bytes;
    p->n_entries--;
    drop_partition_if_empty(c, p);
    free(e);
}

static int64_t entry_bytes(const blade_semcache *c, size_t text_len, size_t extra_len, bool has_vec)
{
    /* the entry and its payload, its vector, and its share of the key map (at most half full) */
    return (int64_t)(sizeof(sc_entry) + text_len + 1 + extra_len + 2 * sizeof(void *) +
                     (has_vec ? (size_t)c->cfg.dim * sizeof(float) : 0));
}

static sc_entry *new_entry(const blade_semcache *c, const blade_semcache_response *r, bool has_vec,
                           blade_error *err)
{
    if (!r || !r->finish_reason || (!r->text && r->text_len) || (!r->extra && r->extra_len))
        return blade_error_set(err, "semantic cache: response fields missing"), NULL;
    if (strlen(r->finish_reason) >= BLADE_SEMCACHE_FINISH_MAX)
        return blade_error_set(err, "semantic cache: finish reason longer than %d bytes", BLADE_SEMCACHE_FINISH_MAX - 1),
               NULL;
    if (r->prompt_tokens < 0 || r->completion_tokens < 0)
        return blade_error_set(err, "semantic cache: negative token count"), NULL;
    if (r->text_len > (size_t)INT64_MAX / 4 || r->extra_len > (size_t)INT64_MAX / 4)
        return blade_error_set(err, "semantic cache: response too large"), NULL;
    sc_entry *e = malloc(sizeof *e + r->text_len + 1 + r->extra_len);
    if (!e)
        return blade_error_set(err, "semantic cache: out of memory for a %zu-byte response", r->text_len), NULL;
    memset(e, 0, sizeof *e);
    e->item.slot = -1;
    e->bytes = entry_bytes(c, r->text_len, r->extra_len, has_vec);
    e->prompt_tokens = r->prompt_tokens;
    e->completion_tokens = r->completion_tokens;
    snprintf(e->finish_reason, sizeof e->finish_reason, "%s", r->finish_reason);
    e->text_len = r->text_len;
    e->extra_len = r->extra_len;
    if (r->text_len)
        memcpy(e->data, r->text, r->text_len);
    e->data[r->text_len] = 0;
    if (r->extra_len)
        memcpy(e->data + r->text_len + 1, r->extra, r->extra_len);
    return e;
}

/* Publishes a filled entry (key and created set), replacing one with its key, then evicts
 * the least recently hit entries beyond capacity. Takes the entry on success. */
static int insert_locked(blade_semcache *c, sc_entry *e, const keys *k, const char *model, const float *vec,
                         blade_error *err)
{
    sc_entry *old = sc_digest_map_find(&c->entries, e->key);
    if (old)
        remove_entry(c, old, GONE_REPLACED);
    sc_partition *p = get_partition(c, k, model, err);
    if (!p)
        return -1;
    if (vec) {
        if (!p->index && !(p->index = sc_vindex_new(&c->index_params, err)))
            goto undo;
        if (sc_vindex_add(p->index, vec, &e->item, err))
            goto undo;
        e->in_index = true;
    }
    if (sc_digest_map_insert(&c->entries, e)) {
        blade_error_set(err, "semantic cache: out of memory");
        if (e->in_index)
            sc_vindex_remove(p->index, &e->item, NULL);
        goto undo;
    }
    e->part = p;
    p->n_entries++;
    c->n_entries++;
    c->bytes += e->bytes;
    pthread_mutex_lock(&c->mu);
    e->last_hit = e->created;
    lru_push_newest(c, e);
    pthread_mutex_unlock(&c->mu);
    while (c->n_entries > c->cfg.max_entries || c->bytes > c->cfg.max_bytes) {
        sc_entry *victim = c->oldest;
        if (victim == e)
            break;
        remove_entry(c, victim, GONE_EVICTED);
    }
    return 0;
undo:
    drop_partition_if_empty(c, p);
    return -1;
}

/* ---- lookups ---- */

static void observe(histogram *h, const double *bounds, int n_bounds, double v)
{
    int b = 0;
    while (b < n_bounds && v > bounds[b])
        b++;
    h->count[b]++;
    h->sum += v;
}

static void fill_hit(blade_semcache_hit *hit, const sc_entry *e, blade_semcache_tier tier, float sim,
                     blade_error *err, int *rc)
{
    size_t finish_len = strlen(e->finish_reason);
    char *s = malloc(e->text_len + 1 + e->extra_len + finish_len + 1);
    if (!s) {
        *rc = blade_error_set(err, "semantic cache: out of memory copying a hit");
        return;
    }
    memcpy(s, e->data, e->text_len + 1 + e->extra_len);
    char *finish = memcpy(s + e->text_len + 1 + e->extra_len, e->finish_reason, finish_len + 1);
    *hit = (blade_semcache_hit){
        .tier = tier,
        .similarity = sim,
        .created = e->created,
        .response = {.text = s,
                     .text_len = e->text_len,
                     .finish_reason = finish,
                     .prompt_tokens = e->prompt_tokens,
                     .completion_tokens = e->completion_tokens,
                     .extra = e->extra_len ? s + e->text_len + 1 : NULL,
                     .extra_len = e->extra_len},
        .storage = s,
    };
    *rc = (int)tier;
}

static void touch(blade_semcache *c, sc_entry *e, double now)
{
    pthread_mutex_lock(&c->mu);
    e->last_hit = now;
    lru_unlink(c, e);
    lru_push_newest(c, e);
    pthread_mutex_unlock(&c->mu);
    sc_background_touch(c->bg, e->key, now);
}

typedef struct expired_list {
    const blade_semcache *c;
    double now;
    sc_entry **end;
} expired_list;

static void collect_expired(void *ctx, sc_vindex_item *item)
{
    expired_list *l = ctx;
    sc_entry *e = entry_of(item);
    if (expired(l->c, e, l->now))
        *l->end++ = e;
}

/* Removes the partition's expired entries and the exact key's if expired (write lock). */
static void purge_expired(blade_semcache *c, const keys *k, double now)
{
    sc_entry *e = sc_digest_map_find(&c->entries, k->exact);
    if (e && expired(c, e, now))
        remove_entry(c, e, GONE_EXPIRED);
    sc_partition *p = sc_digest_map_find(&c->partitions, k->part);
    if (!p || !p->index)
        return;
    sc_entry **list = malloc((size_t)(sc_vindex_count(p->index) + 1) * sizeof *list);
    if (!list)
        return;
    /* collected first: removing changes the index (and the last removal frees it) */
    expired_list l = {.c = c, .now = now, .end = list};
    sc_vindex_each(p->index, collect_expired, &l);
    for (sc_entry **it = list; it < l.end; it++)
        remove_entry(c, *it, GONE_EXPIRED);
    free(list);
}

static int lookup(blade_semcache *c, const blade_semcache_key *key, const float *embedding, bool count_miss,
                  blade_semcache_hit *hit, blade_error *err)
{
    double t0 = monotonic_now();
    memset(hit, 0, sizeof *hit);
    keys k;
    float *q;
    if (prepare(c, key, embedding, &k, &q, err))
        return -1;
    double now = now_of(c);
    int rc = BLADE_SEMCACHE_MISS;
    float nearest = NAN;
    bool exclusive = false;
    pthread_rwlock_rdlock(&c->lock);
    for (;;) {
        bool stale = false;
        sc_entry *e = sc_digest_map_find(&c->entries, k.exact);
        /* the key covers the partition; comparing it too costs nothing */
        if (e && !memcmp(e->part->key, k.part, SC_KEY_LEN)) {
            if (!expired(c, e, now)) {
                fill_hit(hit, e, BLADE_SEMCACHE_EXACT, 1.0f, err, &rc);
                if (rc > 0)
                    touch(c, e, now);
                break;
            }
            stale = true;
        }
        sc_partition *p = q ? sc_digest_map_find(&c->partitions, k.part) : NULL;
        if (p && p->index) {
            float sim;
            sc_vindex_item *item = sc_vindex_nearest(p->index, q, &sim);
            if (item) {
                e = entry_of(item);
                if (expired(c, e, now)) {
                    stale = true;
                } else if (sim >= c->cfg.threshold) {
                    fill_hit(hit, e, BLADE_SEMCACHE_SEMANTIC, sim, err, &rc);
                    if (rc > 0)
                        touch(c, e, now);
                    break;
                } else {
                    nearest = sim;
                }
            }
        }
        if (!stale || exclusive)
            break;
        /* An expired entry stood in the way, and a live one may stand behind it: remove
         * the expired ones under the write lock, then look again. */
        pthread_rwlock_unlock(&c->lock);
        pthread_rwlock_wrlock(&c->lock);
        exclusive = true;
        purge_expired(c, &k, now);
        nearest = NAN;
    }
    pthread_rwlock_unlock(&c->lock);
    free(q);
    double dt = monotonic_now() - t0;
    pthread_mutex_lock(&c->mu);
    observe(&c->latency, blade_semcache_latency_bounds_s, BLADE_SEMCACHE_LATENCY_BUCKETS - 1, dt);
    if (rc == BLADE_SEMCACHE_EXACT)
        c->exact_hits++;
    else if (rc == BLADE_SEMCACHE_SEMANTIC) {
        c->semantic_hits++;
        observe(&c->hit_sim, blade_semcache_similarity_bounds, BLADE_SEMCACHE_SIMILARITY_BUCKETS - 1, hit->similarity);
    } else if (rc == BLADE_SEMCACHE_MISS && count_miss) {
        c->misses++;
        if (!isnan(nearest))
            observe(&c->miss_sim, blade_semcache_similarity_bounds, BLADE_SEMCACHE_SIMILARITY_BUCKETS - 1, nearest);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

int blade_semcache_lookup(blade_semcache *c, const blade_semcache_key *key, const float *embedding,
                          blade_semcache_hit *hit, blade_error *err)
{
    return lookup(c, key, embedding, true, hit, err);
}

int blade_semcache_lookup_exact(blade_semcache *c, const blade_semcache_key *key, blade_semcache_hit *hit,
                                blade_error *err)
{
    return lookup(c, key, NULL, false, hit, err);
}

void blade_semcache_hit_clear(blade_semcache_hit *hit)
{
    if (!hit)
        return;
    free(hit->storage);
    memset(hit, 0, sizeof *hit);
}

/* ---- inserts ---- */

/* Queues the entry's row (under the write lock, so it lands before any later change). */
static void persist(blade_semcache *c, const sc_entry *e, const keys *k, const char *model, const float *vec)
{
    sc_row row = {.model = model,
                  .created = e->created,
                  .last_hit = e->created,
                  .prompt_tokens = e->prompt_tokens,
                  .completion_tokens = e->completion_tokens,
                  .finish_reason = e->finish_reason,
                  .text = e->data,
                  .text_len = e->text_len,
                  .extra = e->data + e->text_len + 1,
                  .extra_len = e->extra_len,
                  .embedding = vec};
    memcpy(row.key, e->key, SC_KEY_LEN);
    memcpy(row.tenant, k->tenant, SC_KEY_LEN);
    memcpy(row.params, k->params, SC_KEY_LEN);
    sc_background_put(c->bg, &row);
}

int blade_semcache_insert(blade_semcache *c, const blade_semcache_key *key, const float *embedding,
                          const blade_semcache_response *response, blade_error *err)
{
    keys k;
    float *vec;
    if (prepare(c, key, embedding, &k, &vec, err))
        return -1;
    sc_entry *e = new_entry(c, response, vec != NULL, err);
    if (!e) {
        free(vec);
        return -1;
    }
    if (e->bytes > c->cfg.max_bytes) {
        pthread_mutex_lock(&c->mu);
        c->rejected++;
        pthread_mutex_unlock(&c->mu);
        free(e);
        free(vec);
        return 1;
    }
    memcpy(e->key, k.exact, SC_KEY_LEN);
    e->created = now_of(c);
    pthread_rwlock_wrlock(&c->lock);
    int rc = insert_locked(c, e, &k, key->model, vec, err);
    if (rc == 0)
        persist(c, e, &k, key->model, vec);
    pthread_rwlock_unlock(&c->lock);
    if (rc) {
        free(e);
    } else {
        pthread_mutex_lock(&c->mu);
        c->inserts++;
        pthread_mutex_unlock(&c->mu);
    }
    free(vec);
    return rc;
}

/* ---- sweeping ---- */

int64_t blade_semcache_sweep(blade_semcache *c)
{
    if (c->cfg.ttl_s <= 0)
        return 0;
    double now = now_of(c);
    int64_t n = 0;
    pthread_rwlock_wrlock(&c->lock);
    /* lock order lets the list be walked here: only writers unlink, and we are the writer */
    for (sc_entry *e = c->oldest, *next; e; e = next) {
        next = e->newer;
        if (expired(c, e, now)) {
            remove_entry(c, e, GONE_EXPIRED);
            n++;
        }
    }
    pthread_rwlock_unlock(&c->lock);
    return n;
}

static void sweep_tick(void *ctx)
{
    blade_semcache_sweep(ctx);
}

int blade_semcache_flush(blade_semcache *c, blade_error *err)
{
    return c->store ? sc_background_flush(c->bg, err) : 0;
}

/* ---- stats ---- */

static void cumulate(const histogram *h, uint64_t *out, int n_buckets, double *sum)
{
    uint64_t total = 0;
    for (int i = 0; i < n_buckets; i++)
        out[i] = total += h->count[i];
    *sum = h->sum;
}

void blade_semcache_get_stats(blade_semcache *c, blade_semcache_stats *out)
{
    memset(out, 0, sizeof *out);
    pthread_rwlock_rdlock(&c->lock);
    out->entries = c->n_entries;
    out->bytes = c->bytes;
    out->partitions = (int64_t)c->partitions.count;
    for (size_t i = 0; i < c->partitions.cap; i++) {
        const sc_partition *p = c->partitions.slots[i];
        if (p && p->index)
            out->index_bytes += (int64_t)sc_vindex_overhead_bytes(p->index);
    }
    pthread_mutex_lock(&c->mu);
    out->exact_hits = c->exact_hits;
    out->semantic_hits = c->semantic_hits;
    out->misses = c->misses;
    out->inserts = c->inserts;
    out->evictions = c->evictions;
    out->expirations = c->expirations;
    out->rejected_too_large = c->rejected;
    cumulate(&c->latency, out->lookup_latency.cumulative, BLADE_SEMCACHE_LATENCY_BUCKETS, &out->lookup_latency.sum);
    cumulate(&c->hit_sim, out->hit_similarity.cumulative, BLADE_SEMCACHE_SIMILARITY_BUCKETS, &out->hit_similarity.sum);
    cumulate(&c->miss_sim, out->miss_similarity.cumulative, BLADE_SEMCACHE_SIMILARITY_BUCKETS,
             &out->miss_similarity.sum);
    pthread_mutex_unlock(&c->mu);
    pthread_rwlock_unlock(&c->lock);
    sc_background_counts db = sc_background_get_counts(c->bg);
    out->db_writes = db.writes;
    out->db_errors = db.errors;
    out->db_dropped = db.dropped;
}

/* ---- open, load, close ---- */

blade_semcache_config blade_semcache_config_default(int32_t dim)
{
    return (blade_semcache_config){
        .dim = dim,
        .threshold = 0.95f,
        .max_entries = 10000,
        .max_bytes = (int64_t)256 << 20,
        .ttl_s = 86400.0,
        .index = BLADE_SEMCACHE_INDEX_AUTO,
    };
}

static int check_config(const blade_semcache_config *cfg, blade_error *err)
{
    if (cfg->dim < 0 || cfg->dim > 65536)
        return blade_error_set(err, "semantic cache: dimension %d out of range [0, 65536]", (int)cfg->dim);
    if (cfg->dim > 0 && !(cfg->threshold > 0.0f && cfg->threshold <= 1.0f))
        return blade_error_set(err, "semantic cache: threshold %g is not in (0, 1]", (double)cfg->threshold);
    if (cfg->max_entries < 1 || cfg->max_bytes < 1)
        return blade_error_set(err, "semantic cache: capacity must be at least one entry and one byte");
    if (!(cfg->ttl_s >= 0.0) || !isfinite(cfg->ttl_s))
        return blade_error_set(err, "semantic cache: TTL %g is not a duration", cfg->ttl_s);
    if (!isfinite(cfg->sweep_interval_s))
        return blade_error_set(err, "semantic cache: sweep interval is not finite");
    if (cfg->index < BLADE_SEMCACHE_INDEX_AUTO || cfg->index > BLADE_SEMCACHE_INDEX_HNSW)
        return blade_error_set(err, "semantic cache: unknown index kind %d", (int)cfg->index);
    if (cfg->exact_scan_max < 0 || cfg->hnsw_m < 0 || cfg->hnsw_m > 256 || cfg->hnsw_ef_construction < 0 ||
        cfg->hnsw_ef_construction > 10000 || cfg->hnsw_ef_search < 0 || cfg->hnsw_ef_search > 10000)
        return blade_error_set(err, "semantic cache: index parameters out of range");
    if (cfg->embedder && strlen(cfg->embedder) > SC_MODEL_MAX)
        return blade_error_set(err, "semantic cache: embedder name longer than %d bytes", SC_MODEL_MAX);
    return 0;
}

typedef struct loader {
    blade_semcache *c;
    double now, started, last_report;
    int64_t dropped; /* expired or too large */
} loader;

/* One row from the database, every value checked: the file is not trusted. */
static int load_row(void *ctx, const sc_row *row, int64_t i, int64_t n, blade_error *err)
{
    loader *l = ctx;
    blade_semcache *c = l->c;
    double t = monotonic_now();
    if (t - l->last_report >= LOAD_PROGRESS_S) {
        logf_(c, "semantic cache: loading %s: %" PRId64 "/%" PRId64 " entries", c->db_path, i, n);
        l->last_report = t;
    }
    if (!isfinite(row->created) || !isfinite(row->last_hit) || row->created < 0 || row->last_hit < 0)
        return blade_error_set(err, "times negative or not finite");
    if (row->prompt_tokens > INT32_MAX || row->completion_tokens > INT32_MAX)
        return blade_error_set(err, "token count out of range");
    if (!row->model[0])
        return blade_error_set(err, "empty model id");
    if (sc_digest_map_find(&c->entries, row->key))
        return blade_error_set(err, "key stored twice");
    if (row->text_len + row->extra_len > (uint64_t)c->cfg.max_bytes || expired_at(c, row->created, l->now)) {
        /* rows this cache no longer keeps (a smaller capacity, a shorter TTL): not copied */
        l->dropped++;
        sc_background_delete(c->bg, row->key);
        return 0;
    }
    float *vec = NULL;
    if (row->embedding && !(vec = unit_copy(c, row->embedding, err)))
        return -1;
    blade_semcache_response r = {.text = row->text,
                                 .text_len = row->text_len,
                                 .finish_reason = row->finish_reason,
                                 .prompt_tokens = (int32_t)row->prompt_tokens,
                                 .completion_tokens = (int32_t)row->completion_tokens,
                                 .extra = row->extra,
                                 .extra_len = row->extra_len};
    sc_entry *e = new_entry(c, &r, vec != NULL, err);
    if (!e) {
        free(vec);
        return -1;
    }
    if (e->bytes > c->cfg.max_bytes) {
        l->dropped++;
        sc_background_delete(c->bg, row->key);
        free(e);
        free(vec);
        return 0;
    }
    memcpy(e->key, row->key, SC_KEY_LEN);
    /* a clock that went back must not make an entry live longer than its TTL from now */
    e->created = fmin(row->created, l->now);
    keys k;
    memcpy(k.tenant, row->tenant, SC_KEY_LEN);
    memcpy(k.params, row->params, SC_KEY_LEN);
    partition_key(k.part, k.tenant, row->model, k.params);
    memcpy(k.exact, row->key, SC_KEY_LEN);
    pthread_rwlock_wrlock(&c->lock);
    int rc = insert_locked(c, e, &k, row->model, vec, err);
    if (rc == 0) {
        pthread_mutex_lock(&c->mu);
        e->last_hit = fmin(row->last_hit, l->now);
        pthread_mutex_unlock(&c->mu);
    }
    pthread_rwlock_unlock(&c->lock);
    if (rc)
        free(e);
    free(vec);
    return rc;
}

static void clear_entries(blade_semcache *c)
{
    pthread_rwlock_wrlock(&c->lock);
    while (c->oldest)
        remove_entry(c, c->oldest, GONE_REPLACED);
    pthread_rwlock_unlock(&c->lock);
    pthread_mutex_lock(&c->mu);
    c->evictions = c->expirations = 0;
    pthread_mutex_unlock(&c->mu);
}

/* Loads the database; a row that fails its checks sets the whole file aside. */
static int load(blade_semcache *c, blade_error *err)
{
    loader l = {.c = c, .now = now_of(c), .started = monotonic_now()};
    l.last_report = l.started;
    blade_error why = {{0}};
    if (sc_store_load(c->store, load_row, &l, &why) == 0) {
        if (c->n_entries || l.dropped)
            logf_(c, "semantic cache: loaded %" PRId64 " entries from %s in %.1f s (%" PRId64 " expired or too large)",
                  c->n_entries, c->db_path, monotonic_now() - l.started, l.dropped);
        return 0;
    }
    clear_entries(c);
    sc_background_discard(c->bg);
    return sc_store_set_aside(c->store, why.msg, err);
}

blade_semcache *blade_semcache_open(const blade_semcache_config *cfg, blade_error *err)
{
    if (check_config(cfg, err))
        return NULL;
    blade_semcache *c = calloc(1, sizeof *c);
    if (!c) {
        blade_error_set(err, "semantic cache: out of memory");
        return NULL;
    }
    c->cfg = *cfg;
    if (!c->cfg.clock)
        c->cfg.clock = realtime_now;
    if (!c->cfg.log)
        c->cfg.log = stderr_log;
    if (c->cfg.sweep_interval_s == 0)
        c->cfg.sweep_interval_s = 60.0;
    c->embedder = strdup(cfg->embedder ? cfg->embedder : "");
    c->db_path = cfg->db_path ? strdup(cfg->db_path) : NULL;
    c->cfg.embedder = c->embedder;
    c->cfg.db_path = c->db_path;
    int32_t scan_max = SCAN_FLOATS / (cfg->dim > 0 ? cfg->dim : 1);
    if (scan_max < SCAN_MIN_ENTRIES)
        scan_max = SCAN_MIN_ENTRIES;
    c->index_params = (sc_vindex_params){
        .dim = cfg->dim,
        .kind = cfg->index,
        .exact_scan_max = cfg->exact_scan_max ? cfg->exact_scan_max : scan_max,
        .hnsw_m = cfg->hnsw_m ? cfg->hnsw_m : 16,
        .hnsw_ef_construction = cfg->hnsw_ef_construction ? cfg->hnsw_ef_construction : 100,
        .hnsw_ef_search = cfg->hnsw_ef_search ? cfg->hnsw_ef_search : 64,
    };
    pthread_rwlock_init(&c->lock, NULL);
    pthread_mutex_init(&c->mu, NULL);
    if (!c->embedder || (cfg->db_path && !c->db_path)) {
        blade_error_set(err, "semantic cache: out of memory");
        goto fail;
    }
    if (c->db_path && !(c->store = sc_store_open(c->db_path, cfg->dim, c->embedder, c->cfg.log, c->cfg.log_ctx, err)))
        goto fail;
    double tick = c->cfg.ttl_s > 0 ? c->cfg.sweep_interval_s : -1.0;
    c->bg = sc_background_new(c->store, cfg->dim, tick, sweep_tick, c, c->cfg.log, c->cfg.log_ctx, err);
    if (!c->bg || (c->store && load(c, err)) || sc_background_run(c->bg, err))
        goto fail;
    return c;
fail:
    blade_semcache_close(c);
    return NULL;
}

void blade_semcache_close(blade_semcache *c)
{
    if (!c)
        return;
    /* writes what is queued; after this nothing is written */
    sc_background_free(c->bg);
    c->bg = NULL;
    clear_entries(c);
    sc_store_close(c->store);
    sc_digest_map_free(&c->entries);
    sc_digest_map_free(&c->partitions);
    pthread_rwlock_destroy(&c->lock);
    pthread_mutex_destroy(&c->mu);
    free(c->embedder);
    free(c->db_path);
    free(c);
}

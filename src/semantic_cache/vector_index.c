/* A partition's nearest-neighbour index: exact scan or HNSW graph (see vector_index.h). */
#include "semantic_cache/vector_index.h"

#include "blade/kernels.h"
#include "semantic_cache/hnsw_index.h"

#include <stdlib.h>
#include <string.h>

/* A graph that has shrunk to a quarter of the switch point goes back to a scan: halfway
 * would let a partition hovering around the switch point rebuild over and over. */
#define SHRINK_DIVISOR 4
/* Deleted nodes are compacted away only once there are this many, so a small graph in
 * HNSW mode is not rebuilt on every other removal. */
#define MIN_DEAD_TO_COMPACT 64

struct sc_vindex {
    sc_vindex_params p;
    /* exact scan: n rows of dim floats, items[i] owning row i */
    float *rows;
    /* graph: items[label] for labels handed out so far, NULL once removed */
    sc_hnsw *graph;
    sc_vindex_item **items;
    int64_t n;    /* rows, or labels handed out */
    int64_t cap;  /* of rows and items */
    int64_t live; /* items in the index */
};

static bool wants_graph(const sc_vindex *x, int64_t live)
{
    switch (x->p.kind) {
    case BLADE_SEMCACHE_INDEX_EXACT:
        return false;
    case BLADE_SEMCACHE_INDEX_HNSW:
        return true;
    default:
        /* hysteresis: a graph is kept down to a quarter of the switch point */
        return x->graph ? live > x->p.exact_scan_max / SHRINK_DIVISOR : live > x->p.exact_scan_max;
    }
}

static int reserve(sc_vindex *x, int64_t need, bool with_rows)
{
    if (need <= x->cap)
        return 0;
    int64_t cap = x->cap ? x->cap : 16;
    while (cap < need)
        cap *= 2;
    sc_vindex_item **items = realloc(x->items, (size_t)cap * sizeof *items);
    if (!items)
        return -1;
    x->items = items;
    if (with_rows) {
        float *rows = realloc(x->rows, (size_t)cap * (size_t)x->p.dim * sizeof *rows);
        if (!rows)
            return -1;
        x->rows = rows;
    }
    x->cap = cap;
    return 0;
}

sc_vindex *sc_vindex_new(const sc_vindex_params *p, blade_error *err)
{
    sc_vindex *x = calloc(1, sizeof *x);
    if (!x) {
        blade_error_set(err, "out of memory for a vector index");
        return NULL;
    }
    x->p = *p;
    if (wants_graph(x, 0)) {
        x->graph = sc_hnsw_new(p->dim, 16, p->hnsw_m, p->hnsw_ef_construction, p->hnsw_ef_search, err);
        if (!x->graph) {
            free(x);
            return NULL;
        }
    }
    return x;
}

void sc_vindex_free(sc_vindex *x)
{
    if (!x)
        return;
    sc_hnsw_free(x->graph);
    free(x->rows);
    free(x->items);
    free(x);
}

const float *sc_vindex_vector(const sc_vindex *x, const sc_vindex_item *item)
{
    if (x->graph)
        return sc_hnsw_vector(x->graph, (uint64_t)item->slot);
    return x->rows + (size_t)item->slot * (size_t)x->p.dim;
}

/* Replaces the representation by a fresh one holding the live items: a graph when
 * to_graph, else a scan. On failure the index is left as it was. */
static int rebuild(sc_vindex *x, bool to_graph, blade_error *err)
{
    sc_vindex fresh = {.p = x->p};
    int64_t cap = x->live * 2 > 16 ? x->live * 2 : 16;
    if (reserve(&fresh, cap, !to_graph))
        goto oom;
    if (to_graph) {
        fresh.graph = sc_hnsw_new(x->p.dim, (size_t)cap, x->p.hnsw_m, x->p.hnsw_ef_construction, x->p.hnsw_ef_search,
                                  err);
        if (!fresh.graph)
            goto fail;
    }
    for (int64_t i = 0; i < x->n; i++) {
        sc_vindex_item *item = x->items[i];
        if (!item)
            continue;
        const float *v = sc_vindex_vector(x, item);
        if (to_graph) {
            if (sc_hnsw_add(fresh.graph, v, (uint64_t)fresh.n, err))
                goto fail;
        } else {
            memcpy(fresh.rows + (size_t)fresh.n * (size_t)x->p.dim, v, (size_t)x->p.dim * sizeof(float));
        }
        fresh.items[fresh.n++] = item;
    }
    fresh.live = fresh.n;
    for (int64_t i = 0; i < fresh.n; i++)
        fresh.items[i]->slot = (int32_t)i;
    sc_hnsw_free(x->graph);
    free(x->rows);
    free(x->items);
    *x = fresh;
    return 0;
oom:
    blade_error_set(err, "out of memory rebuilding a vector index of %lld entries", (long long)x->live);
fail:
    sc_hnsw_free(fresh.graph);
    free(fresh.rows);
    free(fresh.items);
    return -1;
}

int sc_vindex_add(sc_vindex *x, const float *v, sc_vindex_item *item, blade_error *err)
{
    if (x->n >= INT32_MAX)
        return blade_error_set(err, "vector index full");
    if (reserve(x, x->n + 1, !x->graph))
        return blade_error_set(err, "out of memory growing a vector index");
    if (x->graph) {
        if (sc_hnsw_add(x->graph, v, (uint64_t)x->n, err))
            return -1;
    } else {
        memcpy(x->rows + (size_t)x->n * (size_t)x->p.dim, v, (size_t)x->p.dim * sizeof(float));
    }
    item->slot = (int32_t)x->n;
    x->items[x->n++] = item;
    x->live++;
    /* The item is in either way; a graph that could not be built is tried again on the
     * next add, the scan answering meanwhile. */
    if (!x->graph && wants_graph(x, x->live))
        rebuild(x, true, NULL);
    return 0;
}

int sc_vindex_remove(sc_vindex *x, sc_vindex_item *item, blade_error *err)
{
    int64_t slot = item->slot;
    x->live--;
    item->slot = -1;
    if (!x->graph) {
        /* the last row takes the removed one's place */
        int64_t last = --x->n;
        if (slot != last) {
            memcpy(x->rows + (size_t)slot * (size_t)x->p.dim, x->rows + (size_t)last * (size_t)x->p.dim,
                   (size_t)x->p.dim * sizeof(float));
            x->items[slot] = x->items[last];
            x->items[slot]->slot = (int32_t)slot;
        }
        return 0;
    }
    sc_hnsw_remove(x->graph, (uint64_t)slot);
    x->items[slot] = NULL;
    int64_t dead = x->n - x->live;
    if (!wants_graph(x, x->live))
        return rebuild(x, false, err);
    if (dead > x->live && dead >= MIN_DEAD_TO_COMPACT)
        return rebuild(x, true, err);
    return 0;
}

sc_vindex_item *sc_vindex_nearest(const sc_vindex *x, const float *q, float *similarity)
{
    if (!x->live)
        return NULL;
    if (!x->graph) {
        int64_t row = blade_dot_best_row_f32(x->rows, x->n, x->p.dim, q, similarity);
        return row < 0 ? NULL : x->items[row];
    }
    uint64_t label;
    if (sc_hnsw_nearest(x->graph, q, &label, similarity) != 0 || label >= (uint64_t)x->n)
        return NULL;
    return x->items[label];
}

void sc_vindex_each(const sc_vindex *x, void (*fn)(void *ctx, sc_vindex_item *item), void *ctx)
{
    for (int64_t i = 0; i < x->n; i++)
        if (x->items[i])
            fn(ctx, x->items[i]);
}

int64_t sc_vindex_count(const sc_vindex *x)
{
    return x->live;
}

bool sc_vindex_is_graph(const sc_vindex *x)
{
    return x->graph != NULL;
}

size_t sc_vindex_overhead_bytes(const sc_vindex *x)
{
    size_t items = (size_t)x->cap * sizeof *x->items;
    if (x->graph)
        return items + sc_hnsw_overhead_bytes(x->graph);
    return items + (size_t)(x->cap - x->live) * (size_t)x->p.dim * sizeof(float);
}

/* The paged KV store's memory (kv_store.h): sizing, allocation, and writing a token's keys
 * and values in the store's element type. */

#include "blade/kv_store.h"

#include "kernels/kv_type_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* a * b into *out; false on overflow. */
static int mul_ok(size_t a, size_t b, size_t *out)
{
    if (b != 0 && a > SIZE_MAX / b)
        return 0;
    *out = a * b;
    return 1;
}

static int shape_valid(const blade_kv_store_config *cfg)
{
    return cfg->n_layer > 0 && cfg->n_head_kv > 0 && cfg->head_dim > 0;
}

size_t blade_kv_store_block_bytes(const blade_kv_store_config *cfg)
{
    const kv_type_traits *tt = kv_type_traits_of(cfg->type);
    if (!tt || !shape_valid(cfg) || cfg->block_size <= 0)
        return 0;
    /* K and V of every layer and head: block_size elements of head_dim, plus the scale. */
    size_t n = 2, head, scale = tt->has_scales ? sizeof(float) : 0;
    if (!mul_ok((size_t)cfg->head_dim, (size_t)cfg->block_size, &head) || !mul_ok(head, tt->elem_bytes, &head) ||
        head > SIZE_MAX - scale || !mul_ok(n, (size_t)cfg->n_layer, &n) || !mul_ok(n, (size_t)cfg->n_head_kv, &n) ||
        !mul_ok(n, head + scale, &n))
        return 0;
    return n;
}

/* Bytes of the K (or V) area: every layer's blocks. */
static size_t area_bytes(const blade_kv_store *s)
{
    return (size_t)s->n_layer * (size_t)s->n_blocks * s->block_stride;
}

/* Anonymous mappings rather than malloc: the kernel hands out zero pages on first touch,
 * so a store sized for the worst case costs only what sequences actually fill. */
static uint8_t *map_zeroed(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

blade_kv_store *blade_kv_store_new(const blade_kv_store_config *cfg, blade_error *err)
{
    const kv_type_traits *tt = kv_type_traits_of(cfg->type);
    if (!tt) {
        blade_error_set(err, "KV store: unknown element type %d", (int)cfg->type);
        return NULL;
    }
    if (!shape_valid(cfg)) {
        blade_error_set(err, "KV store: invalid shape (n_layer %d, n_head_kv %d, head_dim %d)", cfg->n_layer,
                        cfg->n_head_kv, cfg->head_dim);
        return NULL;
    }
    if (cfg->block_size <= 0 || cfg->n_blocks <= 0) {
        blade_error_set(err, "KV store: block_size (%d) and n_blocks (%d) must be positive", cfg->block_size,
                        cfg->n_blocks);
        return NULL;
    }

    size_t head_stride, block_stride, area;
    if (!mul_ok((size_t)cfg->block_size, (size_t)cfg->head_dim, &head_stride) ||
        !mul_ok(head_stride, tt->elem_bytes, &head_stride) ||
        !mul_ok(head_stride, (size_t)cfg->n_head_kv, &block_stride) ||
        !mul_ok(block_stride, (size_t)cfg->n_blocks, &area) || !mul_ok(area, (size_t)cfg->n_layer, &area) ||
        area > SIZE_MAX / 2) {
        blade_error_set(err,
                        "KV store: %d blocks x %d tokens x %d layers x %d KV heads x %d dims of %s "
                        "overflows the address space",
                        cfg->n_blocks, cfg->block_size, cfg->n_layer, cfg->n_head_kv, cfg->head_dim, tt->name);
        return NULL;
    }

    blade_kv_store *s = calloc(1, sizeof *s);
    if (!s) {
        blade_error_set(err, "KV store: out of memory");
        return NULL;
    }
    s->type = cfg->type;
    s->block_size = cfg->block_size;
    s->n_blocks = cfg->n_blocks;
    s->n_layer = cfg->n_layer;
    s->n_head_kv = cfg->n_head_kv;
    s->head_dim = cfg->head_dim;
    s->elem_bytes = tt->elem_bytes;
    s->head_stride = head_stride;
    s->block_stride = block_stride;
    s->k = map_zeroed(area);
    s->v = s->k ? map_zeroed(area) : NULL;
    bool ok = s->k && s->v;
    if (ok && tt->has_scales) {
        /* At most area / (block_size * head_dim * elem_bytes), so it cannot overflow. */
        size_t n_scales = (size_t)cfg->n_layer * (size_t)cfg->n_blocks * (size_t)cfg->n_head_kv;
        s->k_scale = calloc(n_scales, sizeof(float));
        s->v_scale = calloc(n_scales, sizeof(float));
        ok = s->k_scale && s->v_scale;
    }
    if (!ok) {
        int e = errno;
        blade_error_set(err, "KV store: cannot allocate 2 x %zu bytes (%d blocks of %d tokens, %s): %s", area,
                        cfg->n_blocks, cfg->block_size, tt->name, strerror(e));
        blade_kv_store_free(s);
        return NULL;
    }
    return s;
}

void blade_kv_store_free(blade_kv_store *s)
{
    if (!s)
        return;
    size_t area = area_bytes(s);
    if (s->k)
        munmap(s->k, area);
    if (s->v)
        munmap(s->v, area);
    free(s->k_scale);
    free(s->v_scale);
    free(s);
}

void blade_kv_store_write_head(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, int32_t head,
                               const float *k, const float *v)
{
    const kv_type_traits *tt = kv_type_traits_of(s->type);
    size_t row = (size_t)slot * (size_t)s->head_dim * s->elem_bytes;
    tt->write_row(k, blade_kv_store_k(s, layer, block, head) + row, s->head_dim,
                  blade_kv_store_k_scale(s, layer, block, head));
    tt->write_row(v, blade_kv_store_v(s, layer, block, head) + row, s->head_dim,
                  blade_kv_store_v_scale(s, layer, block, head));
}

void blade_kv_store_write(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, const float *k,
                          const float *v)
{
    for (int32_t h = 0; h < s->n_head_kv; h++) {
        size_t src = (size_t)h * (size_t)s->head_dim;
        blade_kv_store_write_head(s, layer, block, slot, h, k + src, v + src);
    }
}

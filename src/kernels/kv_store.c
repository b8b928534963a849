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

/* n rounded up to a multiple of 64; false on overflow. */
static int round64_ok(size_t n, size_t *out)
{
    if (n > SIZE_MAX - 63)
        return 0;
    *out = (n + 63) / 64 * 64;
    return 1;
}

static int shape_valid(const blade_kv_store_config *cfg)
{
    return cfg->n_layer > 0 && cfg->n_head_kv > 0 && cfg->head_dim > 0;
}

typedef struct strides {
    size_t head, head_scales, scales_at, block;
} strides;

/* The layout of one block of one layer (kv_store.h); false when a size overflows. */
static int block_strides(const blade_kv_store_config *cfg, const kv_type_traits *tt, strides *st)
{
    size_t heads;
    if (!mul_ok((size_t)cfg->block_size, (size_t)cfg->head_dim, &st->head) ||
        !mul_ok(st->head, tt->elem_bytes, &st->head) || !mul_ok(st->head, (size_t)cfg->n_head_kv, &heads))
        return 0;
    st->head_scales = 0;
    st->scales_at = heads;
    st->block = heads;
    if (!tt->scale_bytes)
        return 1;
    size_t scales;
    /* The scales are small next to the elements, so these cannot overflow once those did not. */
    return mul_ok((size_t)cfg->block_size, tt->scale_bytes, &st->head_scales) &&
           mul_ok(st->head_scales, (size_t)cfg->n_head_kv, &scales) && round64_ok(heads, &st->scales_at) &&
           st->scales_at <= SIZE_MAX - scales && round64_ok(st->scales_at + scales, &st->block);
}

size_t blade_kv_store_block_bytes(const blade_kv_store_config *cfg)
{
    const kv_type_traits *tt = kv_type_traits_of(cfg->type);
    strides st;
    if (!tt || !shape_valid(cfg) || cfg->block_size <= 0 || !block_strides(cfg, tt, &st))
        return 0;
    /* K and V of every layer. */
    size_t n;
    if (!mul_ok(2, (size_t)cfg->n_layer, &n) || !mul_ok(n, st.block, &n))
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

    strides st;
    size_t area;
    if (!block_strides(cfg, tt, &st) || !mul_ok(st.block, (size_t)cfg->n_blocks, &area) ||
        !mul_ok(area, (size_t)cfg->n_layer, &area) || area > SIZE_MAX / 2) {
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
    s->head_stride = st.head;
    s->head_scales = st.head_scales;
    s->scales_at = st.scales_at;
    s->block_stride = st.block;
    s->k = map_zeroed(area);
    s->v = s->k ? map_zeroed(area) : NULL;
    if (!s->k || !s->v) {
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
    free(s);
}

/* Byte offset of a slot's row within its head's elements. */
static size_t row_offset(const blade_kv_store *s, int32_t slot)
{
    return (size_t)slot * (size_t)s->head_dim * s->elem_bytes;
}

void blade_kv_store_write_head(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, int32_t head,
                               const float *k, const float *v)
{
    const kv_type_traits *tt = kv_type_traits_of(s->type);
    uint16_t *ks = blade_kv_store_k_scale(s, layer, block, head), *vs = blade_kv_store_v_scale(s, layer, block, head);
    tt->write_row(k, blade_kv_store_k(s, layer, block, head) + row_offset(s, slot), s->head_dim, ks ? ks + slot : NULL);
    tt->write_row(v, blade_kv_store_v(s, layer, block, head) + row_offset(s, slot), s->head_dim, vs ? vs + slot : NULL);
}

void blade_kv_store_write(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, const float *k,
                          const float *v)
{
    for (int32_t h = 0; h < s->n_head_kv; h++) {
        size_t src = (size_t)h * (size_t)s->head_dim;
        blade_kv_store_write_head(s, layer, block, slot, h, k + src, v + src);
    }
}

/* One row through the scalar tile conversion, the reference every ISA's conversion matches. */
static void read_row(const kv_type_traits *tt, const uint8_t *src, const uint16_t *scale, float *dst, int32_t n)
{
    const attn_tile_conv *conv = tt->tile[BLADE_ISA_SCALAR];
    if (conv->load_v)
        conv->load_v(src, scale, dst, 1, n);
    else
        memcpy(dst, src, (size_t)n * sizeof *dst);
}

void blade_kv_store_read_head(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, int32_t head,
                              float *k, float *v)
{
    const kv_type_traits *tt = kv_type_traits_of(s->type);
    const uint16_t *ks = blade_kv_store_k_scale(s, layer, block, head), *vs = blade_kv_store_v_scale(s, layer, block, head);
    read_row(tt, blade_kv_store_k(s, layer, block, head) + row_offset(s, slot), ks ? ks + slot : NULL, k, s->head_dim);
    read_row(tt, blade_kv_store_v(s, layer, block, head) + row_offset(s, slot), vs ? vs + slot : NULL, v, s->head_dim);
}

void blade_kv_store_copy_block(const blade_kv_store *s, int32_t from, int32_t to)
{
    blade_kv_store_copy_between(s, from, s, to);
}

void blade_kv_store_copy_between(const blade_kv_store *src, int32_t from, const blade_kv_store *dst, int32_t to)
{
    for (int32_t l = 0; l < src->n_layer; l++) {
        size_t a = ((size_t)l * src->n_blocks + (size_t)from) * src->block_stride;
        size_t b = ((size_t)l * dst->n_blocks + (size_t)to) * dst->block_stride;
        memcpy(dst->k + b, src->k + a, src->block_stride);
        memcpy(dst->v + b, src->v + a, src->block_stride);
    }
}

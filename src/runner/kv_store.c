#include "blade/kv_store.h"

#include "blade/kernels.h"
#include "blade/types.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>

static const char *const kv_type_names[] = {"f16", "f32", "bf16"};
#define N_KV_TYPES (sizeof kv_type_names / sizeof kv_type_names[0])

const char *blade_kv_type_name(blade_kv_type t)
{
    return (unsigned)t < N_KV_TYPES ? kv_type_names[t] : "unknown";
}

int blade_kv_type_from_name(const char *name)
{
    for (unsigned i = 0; i < N_KV_TYPES; i++)
        if (strcasecmp(name, kv_type_names[i]) == 0)
            return (int)i;
    return -1;
}

size_t blade_kv_type_size(blade_kv_type t)
{
    switch (t) {
    case BLADE_KV_F16:
    case BLADE_KV_BF16:
        return 2;
    case BLADE_KV_F32:
        return 4;
    }
    return 0;
}

/* a * b into *out; false on overflow. */
static int mul_ok(size_t a, size_t b, size_t *out)
{
    if (b != 0 && a > SIZE_MAX / b)
        return 0;
    *out = a * b;
    return 1;
}

static int shape_valid(const blade_hparams *hp)
{
    return hp->n_layer > 0 && hp->n_head_kv > 0 && hp->head_dim > 0;
}

size_t blade_kv_block_bytes(const blade_hparams *hp, blade_kv_type type, int32_t block_size)
{
    size_t elem = blade_kv_type_size(type), n = 2;
    if (!shape_valid(hp) || elem == 0 || block_size <= 0)
        return 0;
    if (!mul_ok(n, (size_t)hp->n_layer, &n) || !mul_ok(n, (size_t)hp->n_head_kv, &n) ||
        !mul_ok(n, (size_t)hp->head_dim, &n) || !mul_ok(n, (size_t)block_size, &n) || !mul_ok(n, elem, &n))
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

blade_kv_store *blade_kv_store_new(const blade_hparams *hp, blade_kv_type type, int32_t block_size,
                                   int32_t n_blocks, blade_error *err)
{
    size_t elem = blade_kv_type_size(type);
    if (elem == 0) {
        blade_error_set(err, "KV store: unknown element type %d", (int)type);
        return NULL;
    }
    if (!shape_valid(hp)) {
        blade_error_set(err, "KV store: invalid shape (n_layer %d, n_head_kv %d, head_dim %d)", hp->n_layer,
                        hp->n_head_kv, hp->head_dim);
        return NULL;
    }
    if (block_size <= 0 || n_blocks <= 0) {
        blade_error_set(err, "KV store: block_size (%d) and n_blocks (%d) must be positive", block_size, n_blocks);
        return NULL;
    }

    size_t head_stride, block_stride, area, n_scales;
    if (!mul_ok((size_t)block_size, (size_t)hp->head_dim, &head_stride) ||
        !mul_ok(head_stride, elem, &head_stride) ||
        !mul_ok(head_stride, (size_t)hp->n_head_kv, &block_stride) ||
        !mul_ok(block_stride, (size_t)n_blocks, &area) || !mul_ok(area, (size_t)hp->n_layer, &area) ||
        area > SIZE_MAX / 2) {
        blade_error_set(err,
                        "KV store: %d blocks x %d tokens x %d layers x %d KV heads x %d dims of %s "
                        "overflows the address space",
                        n_blocks, block_size, hp->n_layer, hp->n_head_kv, hp->head_dim, blade_kv_type_name(type));
        return NULL;
    }
    /* At most area / (block_size * head_dim * elem), so it cannot overflow. */
    n_scales = (size_t)hp->n_layer * (size_t)n_blocks * (size_t)hp->n_head_kv;

    blade_kv_store *s = calloc(1, sizeof *s);
    if (!s) {
        blade_error_set(err, "KV store: out of memory");
        return NULL;
    }
    s->type = type;
    s->block_size = block_size;
    s->n_blocks = n_blocks;
    s->n_layer = hp->n_layer;
    s->n_head_kv = hp->n_head_kv;
    s->head_dim = hp->head_dim;
    s->elem_bytes = elem;
    s->head_stride = head_stride;
    s->block_stride = block_stride;
    s->k = map_zeroed(area);
    s->v = s->k ? map_zeroed(area) : NULL;
    s->k_scale = calloc(n_scales, sizeof(float));
    s->v_scale = calloc(n_scales, sizeof(float));
    if (!s->k || !s->v || !s->k_scale || !s->v_scale) {
        int e = errno;
        blade_error_set(err, "KV store: cannot allocate 2 x %zu bytes (%d blocks of %d tokens, %s): %s", area,
                        n_blocks, block_size, blade_kv_type_name(type), strerror(e));
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

static void write_row(blade_kv_type type, uint8_t *dst, const float *src, int32_t n)
{
    switch (type) {
    case BLADE_KV_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case BLADE_KV_F16:
        blade_row_from_float(BLADE_TYPE_F16, src, dst, n);
        break;
    case BLADE_KV_BF16:
        blade_row_from_float(BLADE_TYPE_BF16, src, dst, n);
        break;
    }
}

void blade_kv_write_head(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, int32_t head,
                         const float *k, const float *v)
{
    size_t row = (size_t)slot * (size_t)s->head_dim * s->elem_bytes;
    write_row(s->type, blade_kv_k(s, layer, block, head) + row, k, s->head_dim);
    write_row(s->type, blade_kv_v(s, layer, block, head) + row, v, s->head_dim);
}

void blade_kv_write(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, const float *k,
                    const float *v)
{
    for (int32_t h = 0; h < s->n_head_kv; h++) {
        size_t src = (size_t)h * (size_t)s->head_dim;
        blade_kv_write_head(s, layer, block, slot, h, k + src, v + src);
    }
}

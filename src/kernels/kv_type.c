/* The table of KV element types (see kv_type_internal.h) and the lookups built on it. */

#include "kernels/kv_type_internal.h"

#include "blade/kernels.h"
#include "blade/types.h"

#include <string.h>
#include <strings.h>

static void write_f32(const float *src, uint8_t *dst, int32_t n, float *scale)
{
    (void)scale;
    memcpy(dst, src, (size_t)n * sizeof *src);
}

/* Round to nearest even, as blade_fp32_to_fp16 / blade_fp32_to_bf16 do. */
static void write_f16(const float *src, uint8_t *dst, int32_t n, float *scale)
{
    (void)scale;
    blade_row_from_float(BLADE_TYPE_F16, src, dst, n);
}

static void write_bf16(const float *src, uint8_t *dst, int32_t n, float *scale)
{
    (void)scale;
    blade_row_from_float(BLADE_TYPE_BF16, src, dst, n);
}

#if defined(__x86_64__)
#define TILES(type)                                                                                              \
    {[BLADE_ISA_SCALAR] = &blade_attn_tile_##type##_scalar, [BLADE_ISA_AVX2] = &blade_attn_tile_##type##_avx2,  \
     [BLADE_ISA_AVX512] = &blade_attn_tile_##type##_avx512}
#else
#define TILES(type) {[BLADE_ISA_SCALAR] = &blade_attn_tile_##type##_scalar}
#endif

static const kv_type_traits kv_types[BLADE_KV_TYPE_COUNT] = {
    [BLADE_KV_F16] = {.name = "f16", .elem_bytes = 2, .write_row = write_f16, .tile = TILES(f16)},
    [BLADE_KV_F32] = {.name = "f32", .elem_bytes = 4, .write_row = write_f32, .tile = TILES(f32)},
    [BLADE_KV_BF16] = {.name = "bf16", .elem_bytes = 2, .write_row = write_bf16, .tile = TILES(bf16)},
};

const kv_type_traits *kv_type_traits_of(blade_kv_type t)
{
    return (unsigned)t < BLADE_KV_TYPE_COUNT ? &kv_types[t] : NULL;
}

const char *blade_kv_type_name(blade_kv_type t)
{
    const kv_type_traits *tt = kv_type_traits_of(t);
    return tt ? tt->name : "unknown";
}

int blade_kv_type_from_name(const char *name)
{
    for (int t = 0; t < BLADE_KV_TYPE_COUNT; t++)
        if (strcasecmp(name, kv_types[t].name) == 0)
            return t;
    return -1;
}

size_t blade_kv_type_size(blade_kv_type t)
{
    const kv_type_traits *tt = kv_type_traits_of(t);
    return tt ? tt->elem_bytes : 0;
}

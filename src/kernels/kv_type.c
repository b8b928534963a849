/* The table of KV element types (see kv_type_internal.h) and the lookups built on it. */

#include "kernels/kv_type_internal.h"

#include "blade/kernels.h"
#include "blade/types.h"

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>
#include <strings.h>

static void write_f32(const float *src, uint8_t *dst, int32_t n, uint16_t *scale)
{
    (void)scale;
    memcpy(dst, src, (size_t)n * sizeof *src);
}

/* Round to nearest even, as blade_fp32_to_fp16 / blade_fp32_to_bf16 do. */
static void write_f16(const float *src, uint8_t *dst, int32_t n, uint16_t *scale)
{
    (void)scale;
    blade_row_from_float(BLADE_TYPE_F16, src, dst, n);
}

static void write_bf16(const float *src, uint8_t *dst, int32_t n, uint16_t *scale)
{
    (void)scale;
    blade_row_from_float(BLADE_TYPE_BF16, src, dst, n);
}

/* The largest finite magnitude of a row (0 if none), and whether the row holds a NaN. */
static float finite_amax(const float *src, int32_t n, bool *has_nan)
{
    float amax = 0.0f;
    *has_nan = false;
    for (int32_t i = 0; i < n; i++) {
        float a = fabsf(src[i]);
        if (isnan(a))
            *has_nan = true;
        else if (a <= FLT_MAX && a > amax)
            amax = a;
    }
    return amax;
}

/* The row's scale: its largest finite magnitude over the largest code, rounded to bfloat16,
 * whose 8-bit exponent covers every float a row can hold. The row is then rounded against
 * the scale as stored, so a rounded scale costs at most a quarter of a code at the top
 * (127.25, 448.9), which the codes' own rounding or saturation absorbs. */
static float choose_scale(float amax, float top, uint16_t *scale)
{
    *scale = blade_fp32_to_bf16(amax / top);
    return blade_bf16_to_fp32(*scale);
}

/* int8 codes; a NaN anywhere makes the scale NaN, so the whole row reads back as NaN. */
static void write_q8_0(const float *src, uint8_t *dst, int32_t n, uint16_t *scale)
{
    bool has_nan;
    float d = choose_scale(finite_amax(src, n, &has_nan), 127.0f, scale);
    if (has_nan)
        *scale = blade_fp32_to_bf16(NAN);
    if (has_nan || d == 0.0f) {
        memset(dst, 0, (size_t)n);
        return;
    }
    for (int32_t i = 0; i < n; i++) {
        float q = src[i] / d;
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        /* Adding and taking away 1.5 x 2^23 rounds |q| < 2^22 to an integer, ties to even,
         * in plain float arithmetic (no libm call, same bits everywhere). */
        q = (q + 0x1.8p23f) - 0x1.8p23f;
        dst[i] = (uint8_t)(int8_t)q;
    }
}

/* E4M3 codes: NaN stays NaN per element, infinities saturate to +-448 x scale. */
static void write_fp8(const float *src, uint8_t *dst, int32_t n, uint16_t *scale)
{
    bool has_nan;
    float d = choose_scale(finite_amax(src, n, &has_nan), 448.0f, scale);
    for (int32_t i = 0; i < n; i++)
        dst[i] = blade_fp32_to_e4m3(d > 0.0f ? src[i] / d : src[i]);
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
    [BLADE_KV_Q8_0] = {.name = "q8_0", .elem_bytes = 1, .scale_bytes = 2, .write_row = write_q8_0,
                       .tile = TILES(q8_0)},
    [BLADE_KV_FP8] = {.name = "fp8", .elem_bytes = 1, .scale_bytes = 2, .write_row = write_fp8,
                      .tile = TILES(fp8)},
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

const char *blade_kv_type_names(void)
{
    return "f16, f32, bf16, q8_0, fp8";
}

size_t blade_kv_type_size(blade_kv_type t)
{
    const kv_type_traits *tt = kv_type_traits_of(t);
    return tt ? tt->elem_bytes : 0;
}

size_t blade_kv_type_scale_bytes(blade_kv_type t)
{
    const kv_type_traits *tt = kv_type_traits_of(t);
    return tt ? tt->scale_bytes : 0;
}

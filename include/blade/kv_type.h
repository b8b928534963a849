#ifndef BLADE_KV_TYPE_H
#define BLADE_KV_TYPE_H

/* The element types the KV store can hold its keys and values in. Each type is one row of
 * a table (src/kernels/kv_type.c): its name, its size, whether it carries scales, how a
 * float row is rounded into it and how the attention kernels read it back on every ISA, so
 * a new type is a row plus its conversion kernels.
 *
 * The 8-bit types keep one scale per token and KV head (a bfloat16 stored beside the
 * block's elements, kv_store.h): each row of head_dim values is rounded on its own, so the
 * bytes stored for a token depend on that token's keys and values alone, never on which
 * other tokens share its step or its block. That is what keeps results batch invariant and
 * prefix-cached blocks valid. Rows are scaled to their largest finite magnitude:
 *   q8_0  int8 x scale, scale = max|x| / 127;
 *   fp8   OCP E4M3 x scale, scale = max|x| / 448;
 * each value rounded to the nearest code, ties to even, against the scale as stored.
 * Infinities saturate to the largest value the row can hold; a NaN makes an fp8 element
 * NaN and a whole q8_0 row NaN (its scale), as it would poison attention in f16 too. */

#include <stddef.h>
#include <stdint.h>

typedef enum blade_kv_type {
    BLADE_KV_F16 = 0,
    BLADE_KV_F32 = 1,
    BLADE_KV_BF16 = 2,
    BLADE_KV_Q8_0 = 3,
    BLADE_KV_FP8 = 4
} blade_kv_type;

/* One more than the last type: the size of the type table, which refuses to compile a row
 * beyond it. Outside the enum so that switches over the types need no case for it. */
#define BLADE_KV_TYPE_COUNT 5

/* "f16", "f32", "bf16", "q8_0", "fp8"; "unknown" for anything else. */
const char *blade_kv_type_name(blade_kv_type t);
/* The type a name (any case) names; -1 if none. */
int blade_kv_type_from_name(const char *name);
/* "f16, f32, bf16, q8_0, fp8": every name, for help texts and error messages. */
const char *blade_kv_type_names(void);
/* Bytes of one element; 0 for an unknown type. */
size_t blade_kv_type_size(blade_kv_type t);
/* Bytes of the scale each token's row of one KV head carries (0 for unscaled types). */
size_t blade_kv_type_scale_bytes(blade_kv_type t);

#endif

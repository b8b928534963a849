#ifndef BLADE_KV_TYPE_INTERNAL_H
#define BLADE_KV_TYPE_INTERNAL_H

/* A KV element type's row: what the store and the attention kernels need to know about it.
 * Adding a type means adding its row to kv_type.c, its write function there, and its tile
 * conversion for each ISA in attention.c, attention_avx2.c and attention_avx512.c. */

#include "blade/kernels.h"
#include "blade/kv_type.h"
#include "kernels/attention_internal.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kv_type_traits {
    const char *name; /* as --kv-type spells it */
    size_t elem_bytes;
    /* Bytes of the scale of one token's row of one KV head: a bfloat16, which write_row
     * chooses and the tile conversions multiply by; 0 for a type without scales. */
    size_t scale_bytes;
    /* Rounds one token's n floats of one KV head into the type at dst; scale is that row's
     * scale (NULL for a type without scales). */
    void (*write_row)(const float *src, uint8_t *dst, int32_t n, uint16_t *scale);
    /* The attention tile conversion for each ISA. */
    const attn_tile_conv *tile[BLADE_ISA_COUNT];
} kv_type_traits;

/* NULL for a value that is not a type. */
const kv_type_traits *kv_type_traits_of(blade_kv_type t);

#endif

#ifndef BLADE_KV_TYPE_H
#define BLADE_KV_TYPE_H

/* The element types the KV store can hold its keys and values in. Each type is one row of
 * a table (src/kernels/kv_type.c): its name, its size, whether it carries scales, how a
 * float row is rounded into it and how the attention kernels read it back on every ISA, so
 * a new type is a row plus its conversion kernels. */

#include <stddef.h>

typedef enum blade_kv_type {
    BLADE_KV_F16 = 0,
    BLADE_KV_F32 = 1,
    BLADE_KV_BF16 = 2
} blade_kv_type;

/* One more than the last type: the size of the type table, which refuses to compile a row
 * beyond it. Outside the enum so that switches over the types need no case for it. */
#define BLADE_KV_TYPE_COUNT 3

/* "f16", "f32", "bf16"; "unknown" for anything else. */
const char *blade_kv_type_name(blade_kv_type t);
/* The type a name (any case) names; -1 if none. */
int blade_kv_type_from_name(const char *name);
/* Bytes of one element; 0 for an unknown type. */
size_t blade_kv_type_size(blade_kv_type t);

#endif

#ifndef BLADE_KV_STORE_H
#define BLADE_KV_STORE_H

/* The paged KV store: for every layer, K and V live in fixed-size blocks of block_size
 * token slots. A sequence reaches its tokens through a block table (logical block i of
 * the sequence -> physical block number), so memory is allocated in blocks on demand
 * instead of reserving a maximum length per sequence. The store only holds memory; which
 * block belongs to whom is decided by the KV cache manager, never here.
 *
 * Layout of one physical block of one layer, for K and for V separately:
 *   [kv_head][slot][head_dim] elements of the store's type
 * so that one KV head's keys within a block are contiguous (block_size x head_dim), which
 * is the tile the attention kernel streams. Each (layer, block, kv_head) also has a float
 * scale slot reserved for 8-bit element types; the f32/f16/bf16 types leave it unused. */

#include "blade/error.h"
#include "blade/model.h"

#include <stddef.h>
#include <stdint.h>

typedef enum blade_kv_type {
    BLADE_KV_F16 = 0,
    BLADE_KV_F32 = 1,
    BLADE_KV_BF16 = 2
} blade_kv_type;

typedef struct blade_kv_store {
    blade_kv_type type;
    int32_t block_size;
    int32_t n_blocks;
    int32_t n_layer;
    int32_t n_head_kv;
    int32_t head_dim;
    size_t elem_bytes;
    size_t head_stride;  /* bytes of one kv head in one block: block_size * head_dim * elem_bytes */
    size_t block_stride; /* bytes of one block of one layer (K or V): n_head_kv * head_stride */
    uint8_t *k;          /* [layer][block] blocks of block_stride bytes */
    uint8_t *v;
    float *k_scale;      /* [layer][block][kv_head], reserved for 8-bit types */
    float *v_scale;
} blade_kv_store;

const char *blade_kv_type_name(blade_kv_type t);
/* "f16" / "f32" / "bf16" -> type; -1 if unknown. */
int blade_kv_type_from_name(const char *name);
size_t blade_kv_type_size(blade_kv_type t);

/* Bytes one block takes across all layers, K and V together; 0 when the shape is invalid
 * or the size does not fit in size_t. */
size_t blade_kv_block_bytes(const blade_hparams *hp, blade_kv_type type, int32_t block_size);

/* Zero-filled; pages are committed on first write, so blocks never used cost nothing. The
 * K and V areas are page-aligned. */
blade_kv_store *blade_kv_store_new(const blade_hparams *hp, blade_kv_type type, int32_t block_size,
                                   int32_t n_blocks, blade_error *err);
void blade_kv_store_free(blade_kv_store *s);

/* Stores one token's keys and values, k and v each [n_head_kv][head_dim] floats, into slot
 * `slot` of physical block `block` of `layer`, rounding to the store's type to nearest even
 * (as blade_fp32_to_fp16 / blade_fp32_to_bf16 do). */
void blade_kv_write(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, const float *k,
                    const float *v);

/* The same for one KV head: k and v are that head's head_dim floats. */
void blade_kv_write_head(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, int32_t head,
                         const float *k, const float *v);

/* Address of the first element of (layer, block, kv_head) in K or V. */
static inline uint8_t *blade_kv_k(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return s->k + ((size_t)layer * s->n_blocks + (size_t)block) * s->block_stride + (size_t)head * s->head_stride;
}
static inline uint8_t *blade_kv_v(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return s->v + ((size_t)layer * s->n_blocks + (size_t)block) * s->block_stride + (size_t)head * s->head_stride;
}

#endif

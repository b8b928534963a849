#ifndef BLADE_KV_STORE_H
#define BLADE_KV_STORE_H

/* The paged KV store: for every layer, K and V live in fixed-size blocks of block_size
 * token slots. A sequence reaches its tokens through a block table (logical block i of
 * the sequence -> physical block number), so memory is allocated in blocks on demand
 * instead of reserving a maximum length per sequence. The store only holds memory; which
 * block belongs to whom is decided by the KV cache manager (kv_cache.h), never here.
 *
 * The store knows sizes, not models: it sits with the kernels that read it (attention.h)
 * and depends on nothing above them.
 *
 * Layout of one physical block of one layer, for K and for V separately:
 *   [kv_head][slot][head_dim] elements of the store's type
 * so that one KV head's keys within a block are contiguous (block_size x head_dim), which
 * is the tile the attention kernel streams. Types with scales (kv_type.h) also have a
 * float scale per (layer, block, kv_head) for K and for V. */

#include "blade/error.h"
#include "blade/kv_type.h"

#include <stddef.h>
#include <stdint.h>

typedef struct blade_kv_store_config {
    int32_t n_layer;
    int32_t n_head_kv;
    int32_t head_dim;   /* elements of one KV head of one token */
    blade_kv_type type;
    int32_t block_size; /* token slots per block */
    int32_t n_blocks;
} blade_kv_store_config;

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
    float *k_scale;      /* [layer][block][kv_head] for types with scales, else NULL */
    float *v_scale;
} blade_kv_store;

/* Bytes one block takes across all layers, K and V together, scales included (cfg's
 * n_blocks is not read); 0 when the shape is invalid or the size does not fit in size_t. */
size_t blade_kv_store_block_bytes(const blade_kv_store_config *cfg);

/* Zero-filled; pages are committed on first write, so blocks never used cost nothing. The
 * K and V areas are page-aligned. */
blade_kv_store *blade_kv_store_new(const blade_kv_store_config *cfg, blade_error *err);
void blade_kv_store_free(blade_kv_store *s);

/* Stores one token's keys and values, k and v each [n_head_kv][head_dim] floats, into slot
 * `slot` of physical block `block` of `layer`, rounded to the store's type (f16 and bf16
 * to nearest even, as blade_fp32_to_fp16 / blade_fp32_to_bf16 do). */
void blade_kv_store_write(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, const float *k,
                          const float *v);

/* The same for one KV head: k and v are that head's head_dim floats. */
void blade_kv_store_write_head(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, int32_t head,
                               const float *k, const float *v);

/* Address of the first element of (layer, block, kv_head) in K or V. */
static inline uint8_t *blade_kv_store_k(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return s->k + ((size_t)layer * s->n_blocks + (size_t)block) * s->block_stride + (size_t)head * s->head_stride;
}
static inline uint8_t *blade_kv_store_v(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return s->v + ((size_t)layer * s->n_blocks + (size_t)block) * s->block_stride + (size_t)head * s->head_stride;
}

/* Position of (layer, block, kv_head) in k_scale and v_scale. */
static inline size_t blade_kv_store_scale_index(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return ((size_t)layer * s->n_blocks + (size_t)block) * s->n_head_kv + (size_t)head;
}
/* The scale of (layer, block, kv_head) in K or V; NULL for a type without scales. */
static inline float *blade_kv_store_k_scale(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return s->k_scale ? s->k_scale + blade_kv_store_scale_index(s, layer, block, head) : NULL;
}
static inline float *blade_kv_store_v_scale(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return s->v_scale ? s->v_scale + blade_kv_store_scale_index(s, layer, block, head) : NULL;
}

#endif

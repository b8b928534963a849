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
 * is the tile the attention kernel streams. Types with scales (kv_type.h) follow the
 * elements with [kv_head][slot] bfloat16 scales, one per token's row; both parts of such a
 * block start on a 64-byte boundary. A block thus carries everything needed to read it:
 * copying, sharing or dropping it never involves anything else. */

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
    size_t head_stride;  /* bytes of one kv head's elements in one block: block_size * head_dim * elem_bytes */
    size_t head_scales;  /* bytes of one kv head's scales in one block: block_size * 2, or 0 */
    size_t scales_at;    /* offset of the scales in a block */
    size_t block_stride; /* bytes of one block of one layer (K or V), scales included */
    uint8_t *k;          /* [layer][block] blocks of block_stride bytes */
    uint8_t *v;
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
 * to nearest even, as blade_fp32_to_fp16 / blade_fp32_to_bf16 do; q8_0 and fp8 as
 * kv_type.h says). */
void blade_kv_store_write(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, const float *k,
                          const float *v);

/* The same for one KV head: k and v are that head's head_dim floats. */
void blade_kv_store_write_head(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, int32_t head,
                               const float *k, const float *v);

/* The floats one token's keys and values of one KV head stand for, as attention reads
 * them: k and v are head_dim floats each. */
void blade_kv_store_read_head(const blade_kv_store *s, int32_t layer, int32_t block, int32_t slot, int32_t head,
                              float *k, float *v);

/* Copies physical block `from` to `to` in every layer, K and V, scales included. */
void blade_kv_store_copy_block(const blade_kv_store *s, int32_t from, int32_t to);
/* Copies block `from` of src to block `to` of dst, a store of the same shape (another
 * engine's, or a staging store a KV transfer was received into). */
void blade_kv_store_copy_between(const blade_kv_store *src, int32_t from, const blade_kv_store *dst, int32_t to);

/* Address of the first element of (layer, block, kv_head) in K or V. */
static inline uint8_t *blade_kv_store_k(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return s->k + ((size_t)layer * s->n_blocks + (size_t)block) * s->block_stride + (size_t)head * s->head_stride;
}
static inline uint8_t *blade_kv_store_v(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return s->v + ((size_t)layer * s->n_blocks + (size_t)block) * s->block_stride + (size_t)head * s->head_stride;
}

/* The block_size scales of (layer, block, kv_head) in `area` (the store's k or v); NULL for
 * a type without scales. */
static inline uint16_t *blade_kv_store_scales(const blade_kv_store *s, uint8_t *area, int32_t layer, int32_t block,
                                              int32_t head)
{
    if (!s->head_scales)
        return NULL;
    uint8_t *b = area + ((size_t)layer * s->n_blocks + (size_t)block) * s->block_stride;
    return (uint16_t *)(void *)(b + s->scales_at + (size_t)head * s->head_scales);
}
static inline uint16_t *blade_kv_store_k_scale(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return blade_kv_store_scales(s, s->k, layer, block, head);
}
static inline uint16_t *blade_kv_store_v_scale(const blade_kv_store *s, int32_t layer, int32_t block, int32_t head)
{
    return blade_kv_store_scales(s, s->v, layer, block, head);
}

#endif

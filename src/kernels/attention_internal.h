#ifndef BLADE_ATTENTION_INTERNAL_H
#define BLADE_ATTENTION_INTERNAL_H

/* What the ISA paths of blade_attention share. attention.c owns the loop order (KV head,
 * then block, then query, then query head), which is what batch invariance rests on; an
 * ISA path supplies the tile conversions and the online-softmax update of (query, query
 * head) rows by one tile.
 *
 * A tile is one store block of one KV head, converted to f32: keys transposed to
 * [head_dim][bp] (bp = block_size rounded up to 16) so that the scores of a query against
 * all keys of the tile are a lane-wise multiply-add over head_dim, never a horizontal sum
 * whose shape could depend on anything but the query; values as [slot][head_dim]. */

#include "blade/kv_type.h"
#include "exp_neg.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Rows (query, query head) are handed to the ISA path in batches of up to this many, so
 * that it can overlap their dependency chains; every row's arithmetic is the same
 * whatever batch it is in. */
#define ATTN_ROWS 8

typedef struct attn_row {
    const float *q;  /* [head_dim] */
    float *o;        /* [head_dim], unnormalized running output */
    float *m, *l;    /* running max and sum */
    int32_t n_valid; /* keys of the tile the query sees */
} attn_row;

typedef struct attn_tile {
    const float *kt; /* [head_dim][bp] */
    const float *v;  /* [slot][head_dim] */
    float *p;        /* ATTN_ROWS * bp floats: per row scores, then probabilities */
    float *acc;      /* head_dim floats, for paths that accumulate in memory */
    int32_t head_dim;
    int32_t bp;
    float scale;
    bool first; /* block 0: no running state to rescale yet */
} attn_tile;

typedef struct attn_isa {
    /* head_dim must be a multiple of this for the path to be used; load_kt additionally
     * needs block_size to be one (attention.c falls back to the scalar load otherwise). */
    int32_t lanes;
    /* All block_size keys of a block (src: [slot][head_dim] of `type`) into kt. */
    void (*load_kt)(blade_kv_type type, const uint8_t *src, float *kt, int32_t block_size, int32_t head_dim,
                    int32_t bp);
    /* n elements of `type` (f16 or bf16) to f32; n is a multiple of lanes. */
    void (*load_v)(blade_kv_type type, const uint8_t *src, float *dst, size_t n);
    /* Online-softmax update of each row by the tile's first n_valid keys. */
    void (*rows)(const attn_tile *t, const attn_row *r, int n);
} attn_isa;

#if defined(__x86_64__)
extern const attn_isa blade_attn_avx2;
extern const attn_isa blade_attn_avx512;
#endif

#endif

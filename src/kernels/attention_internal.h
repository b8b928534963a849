#ifndef BLADE_ATTENTION_INTERNAL_H
#define BLADE_ATTENTION_INTERNAL_H

/* What the ISA paths of blade_attention share. attention.c owns the loop order (KV head,
 * then tile, then query, then query head), which is what batch invariance rests on; an
 * ISA path supplies the online-softmax update of (query, query head) rows by one tile and,
 * for every KV element type, the conversion of a store block into its part of a tile. Every ISA's
 * conversion of a type must give the same floats (every type converts exactly), so which
 * ISA converted a tile never shows in the results.
 *
 * A tile is a run of consecutive store blocks of one KV head (how many depends on the
 * store's shape alone, attention.c), converted to f32: keys transposed to [head_dim][bp]
 * (bp = the tile's keys rounded up to 16) so that the scores of a query against
 * all keys of the tile are a lane-wise multiply-add over head_dim, never a horizontal sum
 * whose shape could depend on anything but the query; values as [slot][head_dim]. */

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
    bool first; /* the first tile: no running state to rescale yet */
} attn_tile;

/* Conversion of one store block of one KV head into the tile: src points at its
 * [slot][head_dim] elements, scales at its slots' bfloat16 scales (NULL for a type without
 * them), by which each slot's elements are multiplied. One conversion per (KV element type,
 * ISA), named in the type's row of kv_type.c. Every conversion is exact (an 8-bit code
 * times a bfloat16 scale fits in a float's 24-bit significand), so every ISA's tile holds
 * the same floats. */
typedef struct attn_tile_conv {
    /* All block_size keys into kt (the block's first column of the tile), rows bp floats
     * apart. The ISA's version needs block_size and head_dim to be multiples of its lanes
     * (attention.c uses the scalar one otherwise). */
    void (*load_kt)(const uint8_t *src, const uint16_t *scales, float *kt, int32_t block_size, int32_t head_dim,
                    int32_t bp);
    /* The first n_slots slots' values into dst as [slot][head_dim]; head_dim is a multiple
     * of the ISA's lanes. NULL for f32, whose values attention.c copies. */
    void (*load_v)(const uint8_t *src, const uint16_t *scales, float *dst, int32_t n_slots, int32_t head_dim);
} attn_tile_conv;

typedef struct attn_isa {
    /* head_dim must be a multiple of this for the path to be used. */
    int32_t lanes;
    /* Online-softmax update of each row by the tile's first n_valid keys. */
    void (*rows)(const attn_tile *t, const attn_row *r, int n);
} attn_isa;

extern const attn_tile_conv blade_attn_tile_f16_scalar, blade_attn_tile_f32_scalar, blade_attn_tile_bf16_scalar,
    blade_attn_tile_q8_0_scalar, blade_attn_tile_fp8_scalar;
#if defined(__x86_64__)
extern const attn_isa blade_attn_avx2;
extern const attn_isa blade_attn_avx512;
extern const attn_tile_conv blade_attn_tile_f16_avx2, blade_attn_tile_f32_avx2, blade_attn_tile_bf16_avx2,
    blade_attn_tile_q8_0_avx2, blade_attn_tile_fp8_avx2;
extern const attn_tile_conv blade_attn_tile_f16_avx512, blade_attn_tile_f32_avx512, blade_attn_tile_bf16_avx512,
    blade_attn_tile_q8_0_avx512, blade_attn_tile_fp8_avx512;
#endif

#endif

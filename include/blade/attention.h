#ifndef BLADE_ATTENTION_H
#define BLADE_ATTENTION_H

/* Attention over the paged KV store in the flash style: keys and values are visited a tile
 * (a run of consecutive blocks) at a time with an online softmax (running max and sum), so
 * the score matrix is never materialized and memory stays linear in context length.
 *
 * Batch invariance: the result for a query at absolute position p depends only on p, the
 * query vector and the cached K/V of positions 0..p: tiles, whose size depends on the
 * store's shape alone, are visited in order from position 0, with the same per-query
 * sequence of operations whatever the chunk the query arrives in and however many queries
 * share the call. */

#include "blade/kv_store.h"

#include <stdint.h>

typedef struct blade_attention_args {
    const blade_kv_store *kv;
    int32_t layer;
    const int32_t *block_table; /* physical block of each logical block of the sequence */
    int32_t pos0;               /* absolute position of the first query */
    int32_t n_q;                /* queries (new tokens) of this sequence; query i sits at pos0 + i */
    int32_t n_head;
    const float *q;             /* [n_q][n_head][head_dim] */
    int64_t q_stride;           /* floats between consecutive queries' rows */
    float *out;                 /* [n_q][n_head][head_dim] */
    int64_t out_stride;
    float scale;                /* usually 1/sqrt(head_dim) */
    int32_t kv_head_begin;      /* range of KV heads to compute (for splitting across threads) */
    int32_t kv_head_end;
    void *scratch;              /* blade_attention_scratch_bytes() bytes, any alignment; calls
                                 * running at the same time need separate buffers */
} blade_attention_args;

/* Scratch one call needs: a few K/V tiles converted to f32 plus two floats per (query,
 * query head of one KV group), so it grows with n_q but never with context length. */
size_t blade_attention_scratch_bytes(const blade_kv_store *kv, int32_t n_q, int32_t n_head);

/* Causal attention of every query over positions 0..its own position. The K/V of the new
 * tokens must already be written into the store. Each KV head is loaded once for its
 * whole group of query heads (GQA): query head h reads KV head h / (n_head / n_head_kv).
 * out must not overlap q. Results are bit-identical for a given active ISA (see
 * blade_isa_set), head_dim and block_size; different ISAs agree to a few 1e-6 relative. */
void blade_attention(const blade_attention_args *a);

#endif

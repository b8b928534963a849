#ifndef BLADE_RUNNER_H
#define BLADE_RUNNER_H

/* The model runner executes one ragged batch: any number of sequences, each contributing
 * one or more new tokens (a prefill chunk, a decode token, or draft tokens to verify) at
 * known positions, with K/V in the paged store reached through each sequence's block
 * table. Weights are streamed once per batch, not once per sequence. Logits are computed
 * only for the rows a caller asks for.
 *
 * Batch invariance: a sequence's logits are bit-identical whatever else is in the batch,
 * however its prompt was chunked, whatever the thread count and whichever physical blocks
 * hold its KV (see the determinism contracts of kernels.h and attention.h).
 *
 * The runner never allocates KV blocks: block tables come from the caller (the KV cache
 * manager), and the runner writes each new token's K/V into the slot its position names. */

#include "blade/act_stats.h"
#include "blade/error.h"
#include "blade/kernels.h"
#include "blade/kv_store.h"
#include "blade/model.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct blade_batch_seq {
    const int32_t *tokens;      /* n_tokens new tokens */
    int32_t n_tokens;
    int32_t pos0;               /* position of tokens[0]; positions 0..pos0-1 are already cached */
    const int32_t *block_table; /* physical block of each logical block; must cover pos0 + n_tokens */
    int32_t n_blocks;
    /* Logits wanted for tokens[logit_rows[i]], i < n_logits, written to
     * logits + i * n_vocab. logit_rows NULL with n_logits 1 means the last token. */
    const int32_t *logit_rows;
    int32_t n_logits;
    float *logits;
    /* When set, the final hidden state (the last block's output after the output norm) of
     * every one of the n_tokens rows is written to hidden + j * n_embd: what embeddings
     * are pooled from. Batch invariant like the logits. */
    float *hidden;
} blade_batch_seq;

typedef struct blade_runner blade_runner;

/* max_batch_tokens bounds the total new tokens of one call (scratch is sized for it). The
 * store has the model's KV shape, or more layers than the model, of which it uses the
 * first (an early-exit view sharing its target's store). */
blade_runner *blade_runner_new(const blade_model *m, blade_kv_store *kv, blade_threadpool *pool,
                               int32_t max_batch_tokens, blade_error *err);
void blade_runner_free(blade_runner *r);
int32_t blade_runner_max_batch_tokens(const blade_runner *r);

/* While s is set, every forward adds the activation rows its weight matrices read to s
 * (act_stats.h): every batch token's, and for the classifier the rows that want logits.
 * The outputs are the same bits as without. NULL stops collecting. Fails for statistics of
 * another model shape, or when the runner's row buffer (one row of the widest input per
 * batch token, allocated on first use) does not fit in memory. */
int blade_runner_set_act_stats(blade_runner *r, blade_act_stats *s, blade_error *err);

/* Where a forward's time goes: the wall time of each stage as the calling thread sees it
 * (it takes part in every pass of the pool, so a stage includes waiting for the other
 * threads' share of it), summed over the forwards run while collecting. OTHER is the rest of
 * each forward: embeddings, the classifier, what lies between the passes. */
typedef enum blade_runner_stage {
    BLADE_STAGE_NORMS,     /* residual adds, RMSNorm and the activations' conversion */
    BLADE_STAGE_QKV,
    BLADE_STAGE_ATTENTION, /* per-head biases, norms and RoPE, KV writes, attention */
    BLADE_STAGE_O,
    BLADE_STAGE_FFN_UP,    /* gate and up projections with SwiGLU */
    BLADE_STAGE_FFN_DOWN,
    BLADE_STAGE_OTHER,
    BLADE_STAGE_COUNT
} blade_runner_stage;

typedef struct blade_stage_times {
    double seconds[BLADE_STAGE_COUNT];
    int64_t forwards;
} blade_stage_times;

const char *blade_runner_stage_name(blade_runner_stage s);
/* While t is set, every forward adds its stages' times to t; NULL stops. Reading the clock
 * is all it costs (a few hundred reads a forward); the outputs are the same bits. */
void blade_runner_set_stage_times(blade_runner *r, blade_stage_times *t);

/* Runs one batch. Validates every sequence (tokens in the vocabulary, positions inside
 * the block table, block numbers inside the store, logit rows inside the chunk) before
 * touching any state, so a bad batch changes nothing. */
int blade_runner_forward(blade_runner *r, const blade_batch_seq *seqs, int32_t n_seqs, blade_error *err);

#endif

#ifndef BLADE_ENGINE_SPEC_DRAFT_H
#define BLADE_ENGINE_SPEC_DRAFT_H

/* The draft model (spec.h, BLADE_SPEC_DRAFT, and BLADE_SPEC_SELF's early-exit view of the
 * target): a second, smaller model with the target's vocabulary, its own paged KV (the
 * same store and block manager as the target's, its own budget) and its own runner. It
 * drafts for every speculating sequence at once: one ragged call catches each sequence up
 * on the tokens it has not seen (its prompt the first time, then what the target accepted
 * since) and yields each one's first draft, then one call per further draft token.
 *
 * The early-exit view has no KV of its own: its layers are the target's first ones, whose
 * KV the target's steps have already written for every computed token, so it drafts in the
 * target's store and never catches up. Catching up cost it as much as drafting: on the
 * TinyLlama-shaped stories target, 6 of 22 layers caught up 0.40 ms per decoded token
 * against 8 ms steps (MEASURED.md, stop 37). Engine thread only. */

#include "blade/error.h"
#include "blade/kernels.h"
#include "blade/kv_cache.h"
#include "blade/kv_type.h"
#include "blade/model.h"

#include <stddef.h>
#include <stdint.h>

#include "blade/spec.h"
#include "engine/spec_policy.h"

typedef struct spec_draft spec_draft;

/* One sequence's state in the draft model. Its KV holds the sequence's tokens [0,
 * n_computed) and after them the drafts it fed last time (fed[0..n_fed)); the next call
 * keeps the fed drafts the target accepted (they are then the sequence's tokens) and
 * rolls back the rest. */
typedef struct spec_draft_seq {
    blade_kv_cache_seq kv;
    int32_t n_computed;
    int32_t fed[BLADE_SPEC_MAX_K];
    int32_t n_fed;
    int32_t target_blocks; /* shared KV: the target's blocks before the drafts' */
} spec_draft_seq;

/* One sequence to draft for this step. */
typedef struct spec_draft_job {
    spec_draft_seq *seq;
    /* the sequence's KV in the target, where an early-exit view drafts (it has computed
     * all but the last of tokens) */
    blade_kv_cache_seq *target_seq;
    /* the sequence's real tokens, then room for k drafts, which are written there (prompt
     * lookup reads the tokens and the drafts before the one it proposes as one text) */
    int32_t *tokens;
    int32_t n_tokens;
    int32_t k;             /* most drafts wanted */
    /* drafting stops once the estimated chance that every draft so far is kept falls
     * below this (0: never; the drafts then run to k) */
    double stop_below;
    /* NULL, or the step's economics, by which drafting also stops where no further draft
     * could be worth verifying (spec_policy_draft_more) */
    const spec_step_econ *econ;
    int32_t n_out;         /* drafts proposed (0: none this step) */
    float conf[BLADE_SPEC_MAX_K];    /* each draft's probability under the draft model's own choice */
    uint8_t source[BLADE_SPEC_MAX_K]; /* each draft's spec_source */
    double gain[BLADE_SPEC_MAX_K];   /* each draft's rated chance that it and all before it are kept */
} spec_draft_job;

/* Refuses a draft whose vocabulary is not the target's (size, special ids, every token's
 * text), naming the first difference. */
int spec_draft_check_vocab(const blade_model *target, const blade_model *draft, blade_error *err);

/* Loads the draft model at path and checks it against the target; path NULL drafts with
 * the target's own first self_layers layers (early exit through its final norm and
 * classifier) in the target's store and KV cache, or with self_type (not
 * BLADE_SPEC_SELF_OWN) a copy of those layers and the classifier requantized to that type.
 * A drafter with KV of its own gets kv_mem_bytes of it, or with 0 as many blocks as the
 * target's store. */
spec_draft *spec_draft_new(const char *path, int32_t self_layers, uint32_t self_type, const blade_model *target,
                           blade_kv_store *target_store, blade_kv_cache *target_kv, size_t kv_mem_bytes,
                           int32_t block_size, blade_kv_type kv_type, blade_threadpool *pool,
                           int32_t max_batch_tokens, int32_t max_seqs, blade_error *err);
void spec_draft_free(spec_draft *d);

/* Seconds of a one-token draft step (for the policy's draft cost); -1 when it cannot be
 * measured. Call before any sequence holds draft KV. */
double spec_draft_step_seconds(spec_draft *d);

void spec_draft_seq_init(spec_draft *d, spec_draft_seq *s);
/* Gives the sequence's draft KV back (it is caught up again from scratch when it next
 * speculates). */
void spec_draft_seq_release(spec_draft *d, spec_draft_seq *s);
void spec_draft_seq_destroy(spec_draft_seq *s);

/* The draft KV's block accounting checked against the draft states of the live sequences
 * (blade_kv_cache_check): 0, or -1 with err naming the first violation. */
int spec_draft_check_kv(const spec_draft *d, const blade_kv_cache_seq *const *seqs, int32_t n_seqs, blade_error *err);
void spec_draft_kv_stats(const spec_draft *d, blade_kv_cache_stats *st);
/* Tokens the drafting model drafts within: its trained context. */
int32_t spec_draft_max_context(const spec_draft *d);

/* Lets prompt lookup over n-grams of n_min..n_max tokens (spec.h) compete with the draft
 * model for each draft: where the two differ, the one the calibration rates likelier to be
 * kept goes into the draft, and the model is fed it. n_min 0 turns lookup off. */
void spec_draft_set_lookup(spec_draft *d, int32_t n_min, int32_t n_max);

/* Drafts for every job in as few ragged calls as the longest k needs, with calib rating
 * each draft for the jobs' stop_below and econ. A job whose catch-up
 * does not fit in this step's token budget is caught up partly and drafts nothing; a job
 * whose draft KV cannot be had, or whose positions run past the draft's context, drafts
 * nothing. Returns 0, or -1 with err set when the runner failed (no job then drafts). */
int spec_draft_propose(spec_draft *d, spec_draft_job *jobs, int32_t n_jobs, const spec_calib *calib, blade_error *err);

#endif

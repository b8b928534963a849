#ifndef BLADE_SCHEDULER_H
#define BLADE_SCHEDULER_H

/* The scheduler decides, every step, which sequences run and how many of their tokens:
 *  - continuous batching: finished sequences leave at once, waiting ones join as soon as
 *    the step's token budget, the sequence cap and KV blocks allow;
 *  - chunked prefill: running decodes are scheduled first (one token each), prefills fill
 *    the rest of the token budget in chunks, so a long prompt never stalls the others for
 *    more than one chunk;
 *  - preemption by recompute: when a running sequence needs a block and none can be had,
 *    the lowest-priority, most recently admitted sequence gives its blocks back and waits
 *    to be recomputed (usually cheaply, from the prefix cache);
 *  - two traffic classes: batch requests use only what interactive ones leave, are
 *    preempted first, and age into the interactive queue so they are never starved.
 * Baseline modes (static batching, no chunked prefill, contiguous reservation) exist so
 * every gain can be measured against what it replaces.
 *
 * The scheduler knows token counts and KV blocks only; it never runs the model. A
 * sequence's tokens are prompt + generated so far; n_computed of them have KV. Running a
 * step computes tokens[n_computed .. n_computed + n) of each planned sequence.
 *
 * Speculative decoding rides in the plan as data: a decoding sequence may carry n_draft
 * tentative tokens stored after its last token. Every decode gets its one real token
 * first; drafts then take what the budget and the blocks allow (never preempting anyone
 * for a draft), before prefill chunks. The caller says in n_accepted how many drafts it
 * kept; commit advances past only those and gives back the blocks of the rest. */

#include "blade/kv_cache.h"

#include <stdbool.h>
#include <stdint.h>

typedef enum blade_traffic_class {
    BLADE_CLASS_INTERACTIVE = 0,
    BLADE_CLASS_BATCH = 1
} blade_traffic_class;

typedef enum blade_sched_mode {
    BLADE_SCHED_CONTINUOUS = 0,
    /* form a batch (at most max_seqs members, and no more than max_batch_tokens, since
     * every seat decodes in every step), run it to completion, then form the next; the
     * engine keeps a finished member's seat computing until the batch ends, as a
     * fixed-shape batch does */
    BLADE_SCHED_STATIC = 1
} blade_sched_mode;

typedef enum blade_seq_state {
    BLADE_SEQ_WAITING = 0,
    BLADE_SEQ_RUNNING = 1,
    BLADE_SEQ_FINISHED = 2
} blade_seq_state;

typedef struct blade_sched_seq {
    uint64_t id;
    blade_traffic_class cls;
    const int32_t *tokens; /* prompt + generated; owned by the caller, may be reallocated */
    int32_t n_tokens;
    int32_t n_prompt;
    int32_t max_total;     /* n_prompt + max new tokens: the reservation of contiguous mode */
    int32_t n_computed;
    /* Every token must be computed (a mean-pooled embedding reads each token's output), so
     * no prefix is taken from the cache; the sequence's blocks still enter it for others. */
    bool compute_all;
    /* tentative tokens at tokens[n_tokens .. n_tokens + n_draft), set by the caller before
     * schedule (0: not speculating this step); the caller's array has room for them */
    int32_t n_draft;
    blade_kv_cache_seq kv;
    /* bookkeeping of the scheduler */
    blade_seq_state state;
    uint64_t arrival;   /* submission order */
    uint64_t admitted;  /* admission order, for choosing whom to preempt */
    int64_t waited;     /* steps spent waiting, for aging */
    int32_t preemptions;
    blade_traffic_class rank; /* class it runs with: batch requests admitted after aging rank as interactive */
    bool scheduled;     /* planned in the current step */
    struct blade_sched_seq *next, *prev; /* queue links */
} blade_sched_seq;

typedef struct blade_sched_config {
    int32_t max_batch_tokens; /* token budget of one step */
    int32_t max_seqs;         /* sequences per step */
    bool chunked_prefill;
    blade_sched_mode mode;
    bool contiguous_kv;       /* reserve max_total at admission, like pre-paging engines */
    int32_t batch_aging_steps; /* batch requests waiting longer than this count as interactive */
} blade_sched_config;

void blade_sched_config_default(blade_sched_config *c);

typedef struct blade_sched_item {
    blade_sched_seq *seq;
    int32_t n_tokens;  /* tokens to compute this step, from seq->n_computed */
    bool want_logits;  /* the chunk reaches the last token: a new token will be sampled */
    /* the chunk's last n_draft tokens are drafts to verify: logits are wanted for its last
     * 1 + n_draft rows */
    int32_t n_draft;
    int32_t n_accepted; /* filled by the caller before commit: drafts kept (<= n_draft) */
} blade_sched_item;

typedef struct blade_sched_plan {
    blade_sched_item *items;
    int32_t n_items;
    int32_t n_tokens;
    /* sequences that cannot be served at all (their tokens need more blocks than the whole
     * pool); the caller finishes them with an error */
    blade_sched_seq **rejected;
    int32_t n_rejected;
    int32_t n_preempted; /* preemptions made while planning this step */
} blade_sched_plan;

typedef struct blade_scheduler blade_scheduler;

typedef struct blade_sched_stats {
    int32_t running;
    int32_t waiting;
    uint64_t preemptions;
    uint64_t steps;
} blade_sched_stats;

blade_scheduler *blade_scheduler_new(const blade_sched_config *cfg, blade_kv_cache *kv, blade_error *err);
void blade_scheduler_free(blade_scheduler *s);
const blade_sched_config *blade_scheduler_config(const blade_scheduler *s);

/* Queues a new sequence (state WAITING, kv initialised by the caller). */
void blade_scheduler_add(blade_scheduler *s, blade_sched_seq *seq);
/* Takes a sequence out (finished or aborted), returning its blocks at once. */
void blade_scheduler_remove(blade_scheduler *s, blade_sched_seq *seq);
/* Takes a sequence out keeping its blocks (a prefill exported to another engine): the
 * caller releases them with blade_kv_cache_release. */
void blade_scheduler_detach(blade_scheduler *s, blade_sched_seq *seq);

/* Plans one step. The plan's arrays stay valid until the next call. */
void blade_scheduler_schedule(blade_scheduler *s, blade_sched_plan *plan);
/* After the step ran: advances n_computed of every planned sequence (past its real tokens
 * and accepted drafts), gives back the blocks wholly beyond that (rejected drafts), and
 * registers its newly completed blocks in the prefix cache. Call before appending sampled
 * tokens. */
void blade_scheduler_commit(blade_scheduler *s, const blade_sched_plan *plan);

bool blade_scheduler_idle(const blade_scheduler *s);
void blade_scheduler_stats(const blade_scheduler *s, blade_sched_stats *out);
/* Live sequences holding blocks (for invariant checks); returns how many were written. */
int32_t blade_scheduler_live(const blade_scheduler *s, const blade_kv_cache_seq **out, int32_t cap);

#endif

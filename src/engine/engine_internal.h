#ifndef BLADE_ENGINE_INTERNAL_H
#define BLADE_ENGINE_INTERNAL_H

/* What the engine's files share: the engine itself and one request's state.
 *   engine.c          the public face: start, submit, abort, wait, stop, statistics;
 *   request.c         a request's state: validation, the tokenized prompt, its choices;
 *   step_loop.c       the engine thread: schedule, build the batch, run it, commit, emit;
 *   request_output.c  a choice's output: sampled token, logprobs, text, stop, events.
 * Fields marked "engine thread" are touched only by the step loop; the rest of the engine's
 * shared fields are guarded by mu. */

#include "blade/engine.h"
#include "blade/kernels.h"
#include "blade/kv_cache.h"
#include "blade/kv_store.h"
#include "blade/runner.h"
#include "blade/scheduler.h"
#include "engine/request_output.h"
#include "engine/spec_draft.h"
#include "engine/spec_policy.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#define ENGINE_MAX_STOP_STRINGS 64
#define ENGINE_MAX_CHOICES 16
#define ENGINE_MAX_STOP_LEN 1024

/* One choice of a request: a sequence to schedule plus the output it feeds. */
typedef struct request_state {
    blade_sched_seq seq;
    request_output out;
    struct request_state *followers; /* choices 1..n-1, started once choice 0 has the prompt cached */
    bool pin_prefix;
    bool speculative; /* the request lets the engine draft for it */
    spec_draft_seq draft; /* its state in the draft model, with --spec draft */
    spec_accept accept;   /* how often its drafts are kept */
    int32_t spec_k;       /* drafts it may carry this step (engine thread) */
    bool spec_probe;      /* this step's draft is a try after sitting out (spec_policy_probe): one */
    /* its model drafts' confidences and sources this step, for the calibration */
    float spec_conf[BLADE_SPEC_MAX_K];
    uint8_t spec_source[BLADE_SPEC_MAX_K];
    /* Static batching only: answered in full, but its seat in the batch keeps computing
     * (tokens nobody sees) until every member has finished, as in a fixed-shape batch. */
    bool padding;
    char *salt;
    bool export_kv;
    /* import: the first token and the staged blocks, until the engine thread places them */
    bool importing;
    int32_t import_first;
    blade_kv_store *import_staging;
    int32_t *import_sent;
    int32_t import_n_sent;
    /* exported: out of the schedule, its blocks held until released; export points into
     * export_blocks, export_hashes and tokens */
    bool exported;
    blade_kv_export export;
    int32_t *export_blocks;
    uint8_t (*export_hashes)[BLADE_HASH_BYTES];
    /* An embedding request: how it pools, the sum of the rows of positions 0..pooled-1 so
     * far (mean) and the last row (last; then the finished vector), n_embd each. A
     * preempted sequence recomputes rows it already pooled: they are bit-identical and
     * skipped. */
    blade_pooling pooling;
    double *pool_sum;
    float *pool_last;
    int32_t pooled;
    int32_t *tokens; /* prompt + generated, room for seq.max_total */
    int32_t cap_tokens;
    struct request_state *next_live, *prev_live;
} request_state;

struct blade_engine {
    const blade_model *m;
    blade_engine_config cfg;
    blade_threadpool *pool;
    blade_kv_store *store;
    blade_kv_cache *kv;
    blade_scheduler *sched;
    blade_runner *runner;
    int32_t max_context;
    output_vocab vocab;

    uint8_t fingerprint[BLADE_ENGINE_FINGERPRINT_BYTES];

    pthread_t thread;
    /* The block manager is the engine thread's, which holds kv_mu while it uses it (all of
     * a step but the forward pass), so other threads may look up cached blocks. */
    pthread_mutex_t kv_mu;
    pthread_mutex_t mu;
    pthread_cond_t work;
    pthread_cond_t idle;
    request_state *incoming_head, *incoming_tail; /* submitted, not yet seen by the loop */
    uint64_t *aborts;
    int32_t n_aborts, cap_aborts;
    bool stopping, drain, loop_idle;
    uint64_t next_id;
    blade_engine_stats stats;

    /* engine thread */
    bool quitting; /* finishing everything for good, no seat is kept */
    request_state *live; /* every request known to the loop */
    blade_batch_seq *batch;
    blade_pooling pooling; /* what BLADE_POOL_MODEL resolves to */
    float *hidden;   /* [runner tokens][n_embd]: final hidden states of embedding rows, on first use */
    int32_t runner_tokens;
    float *logits;   /* [max_logit_rows][n_vocab] */
    int32_t max_logit_rows; /* one per planned sequence, plus one per draft when speculating */
    /* speculative decoding (engine thread) */
    int32_t *row_ids;      /* 0, 1, 2, ...: the logit rows of a verify chunk */
    int32_t *item_row;     /* [max_seqs] first logits row of each plan item */
    int32_t *item_out;     /* [max_seqs] tokens verification produced for each item */
    int32_t *spec_out;     /* [max_logit_rows] those tokens, at the item's rows */
    bool *item_bad;        /* [max_seqs] verification met a row with no usable logits */
    float *spec_probs;     /* [n_vocab] a row's distribution, for the rejection rule */
    spec_draft *draft;     /* the draft model, with --spec draft */
    spec_draft_job *draft_jobs; /* [max_seqs] */
    struct request_state **draft_owner; /* [max_seqs] whose job each is */
    spec_cand *cands;      /* [max_seqs] the policy's candidates ... */
    spec_calib calib;      /* what a model draft's confidence says about its acceptance */
    struct request_state **cand_owner; /* ... and whose each is */
    bool adaptive;         /* the policy chooses k (the cost curve is known) */
    spec_curve curve;      /* a step of T tokens relative to one */
    bool curve_live;       /* ... measured here, and following live steps */
    double draft_cost;     /* one draft-model call relative to a one-token target step */
    uint64_t spec_verifies, spec_draft_tokens, spec_accepted_tokens;
    uint64_t spec_accept_hist[BLADE_SPEC_MAX_K + 1];
    uint64_t spec_draft_hist[BLADE_SPEC_MAX_K + 1];
    uint64_t solo_decode_steps[BLADE_SPEC_MAX_K + 2];
    double solo_decode_seconds[BLADE_SPEC_MAX_K + 2];
    double spec_draft_seconds;
    uint64_t spec_draft_calls;
    spec_accept spec_traffic; /* every sequence's drafts together: where new ones start */
    uint64_t computed_tokens, generated_tokens, finished;
    int32_t max_running;
    const blade_kv_cache_seq **live_kv; /* scratch for invariant checks */
    int32_t cap_live_kv;
    uint64_t invariant_checks;
    char invariant_error[600];
};

/* request.c: validates q and builds its first choice, the other choices hanging from it as
 * followers; the id is the caller's to assign. NULL with err set. */
request_state *engine_request_new(const blade_engine *e, const blade_request *q, blade_error *err);
/* Frees a choice and the followers it still holds; a choice that ran must have left the
 * scheduler first (its blocks released). */
void engine_request_free(request_state *r);

/* step_loop.c: the engine thread's body. */
void *engine_loop(void *arg);

#endif

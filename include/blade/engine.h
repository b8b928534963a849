#ifndef BLADE_ENGINE_H
#define BLADE_ENGINE_H

/* The serving engine: many requests share one model, one KV memory budget and one batched
 * forward pass per step. Data flows one way: a request's prompt is tokenized on submit,
 * the scheduler picks this step's work, the model runner executes it as one ragged batch,
 * each sequence's sampler picks its next token, the detokenizer and stop matcher turn it
 * into text, and the request's callback receives it.
 *
 * Submit and abort are safe from any thread; one engine thread runs the step loop and
 * calls every callback (callbacks must be quick: hand the event to your own thread). */

#include "blade/error.h"
#include "blade/kv_cache.h"
#include "blade/kv_store.h"
#include "blade/kv_type.h"
#include "blade/model.h"
#include "blade/sampler.h"
#include "blade/scheduler.h"
#include "blade/spec.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct blade_engine_config {
    int n_threads;            /* <= 0: physical cores */
    size_t kv_mem_bytes;      /* KV memory budget */
    int32_t block_size;       /* tokens per KV block (default 16) */
    blade_kv_type kv_type;
    bool prefix_caching;
    blade_sched_config sched;
    int32_t max_context;      /* longest prompt + output of one request (default: the model's) */
    bool check_invariants;    /* verify the KV block accounting after every step (tests, debugging) */
    blade_spec_config spec;   /* speculative decoding (off by default) */
} blade_engine_config;

void blade_engine_config_default(blade_engine_config *c);

typedef enum blade_finish_reason {
    BLADE_FINISH_NONE = 0, /* not finished: a token event */
    BLADE_FINISH_STOP,     /* end-of-generation token or a stop string */
    BLADE_FINISH_LENGTH,   /* max_tokens or the context limit */
    BLADE_FINISH_ABORT,    /* aborted by the caller */
    BLADE_FINISH_ERROR,    /* could not be served (e.g. needs more KV than the pool has) */
    BLADE_FINISH_EXPORTED  /* export_kv: the prompt is computed and its first token sampled;
                            * the event's kv_export describes the KV to ship */
} blade_finish_reason;

const char *blade_finish_reason_name(blade_finish_reason r);

#define BLADE_MAX_TOP_LOGPROBS 20

/* A finished prefill held for shipping to another engine (disaggregated serving). Its
 * blocks stay held, unchanged, in this engine's KV store until
 * blade_engine_export_release; the arrays are the engine's and stay valid until then. */
typedef struct blade_kv_export {
    const int32_t *tokens;      /* the prompt */
    int32_t n_tokens;
    int32_t first_token;        /* sampled from the prompt's last logits */
    const int32_t *blocks;      /* physical block of each logical block: ceil(n_tokens / block size) */
    int32_t n_blocks;
    const uint8_t (*hashes)[BLADE_HASH_BYTES]; /* chained hash of each full block (kv_cache.h) */
    int32_t n_hashes;
} blade_kv_export;

/* A prefill computed elsewhere, to continue here: the prompt (blade_request's tokens), its
 * first token, and the blocks that travelled, in a staging store of this engine's shape
 * (blade_engine_kv_store): staging block j holds logical block sent[j]. Blocks not sent
 * are found in the prefix cache (the HAVE exchange said so) or, if evicted since, computed
 * again; so is everything when the pool has no room. The output is the same either way. */
typedef struct blade_kv_import {
    int32_t n_tokens;           /* tokens the blocks hold: must be the request's whole prompt */
    int32_t first_token;
    blade_kv_store *staging;    /* the engine takes it (and frees it) when submit succeeds */
    const int32_t *sent;        /* n_sent logical block indices, strictly increasing */
    int32_t n_sent;
} blade_kv_import;
/* How an embedding request turns its tokens' final hidden states into one vector. */
typedef enum blade_pooling {
    BLADE_POOL_NONE = 0, /* not an embedding request: generate */
    BLADE_POOL_MODEL,    /* the model's own {arch}.pooling_type key (mean or last); mean without one */
    BLADE_POOL_MEAN,     /* the mean over every prompt token */
    BLADE_POOL_LAST,     /* the last prompt token's (it has attended to all of them) */
} blade_pooling;

const char *blade_pooling_name(blade_pooling p);

typedef struct blade_token_event {
    uint64_t request_id;
    int32_t choice;              /* 0..n-1 */
    void *user;
    /* the sampled token (-1 on a finish event that carries no token) */
    int32_t token;
    float logprob;               /* of the sampled token, under the raw logits */
    int32_t n_top;               /* top alternatives, when the request asked for logprobs */
    int32_t top_ids[BLADE_MAX_TOP_LOGPROBS];
    float top_logprobs[BLADE_MAX_TOP_LOGPROBS];
    const float *logits;         /* the raw logits row, when the request asked for them */
    const char *text;            /* text released by this token (stop strings held back), may be "" */
    size_t text_len;
    blade_finish_reason finish;
    const char *error;           /* message when finish == BLADE_FINISH_ERROR */
    const blade_kv_export *kv_export; /* when finish == BLADE_FINISH_EXPORTED */
    int32_t prompt_tokens;
    int32_t completion_tokens;
    int32_t cached_tokens;       /* prompt tokens served from the prefix cache */
    double queue_seconds;        /* submit to first scheduled */
    double ttft_seconds;         /* submit to first token */
    /* An embedding request's only event (finish BLADE_FINISH_STOP): the pooled final hidden
     * state, L2-normalised, n_embedding floats. NULL otherwise. */
    const float *embedding;
    int32_t n_embedding;
} blade_token_event;

typedef void (*blade_token_callback)(const blade_token_event *ev);

typedef struct blade_request {
    const int32_t *prompt_tokens; /* either tokens ... */
    int32_t n_prompt_tokens;
    const char *prompt_text;      /* ... or text, tokenized with the model's tokenizer */
    size_t prompt_text_len;
    bool add_bos;                 /* for prompt_text: prepend BOS when the vocabulary wants it */
    bool parse_special;           /* for prompt_text: special-token text becomes special tokens */
    blade_sampling_params sampling;
    int32_t max_tokens;           /* new tokens at most (> 0) */
    const char *const *stop;      /* stop strings, never emitted */
    int32_t n_stop;
    bool ignore_eos;
    int32_t logprobs;             /* -1: none; 0: the sampled token's; n: also the top n (<= 20) */
    bool want_logits;             /* hand the raw logits row to the callback (tests, tools) */
    int32_t n;                    /* choices (1..16): choice i samples with seed + i; choices after
                                   * the first start once the prompt is cached, so they share
                                   * its KV blocks instead of computing it again */
    blade_traffic_class cls;
    const char *cache_salt;       /* tenant isolation of the prefix cache; NULL for none */
    bool pin_prefix;              /* keep this prompt's full blocks cached for good (a shared
                                   * system prompt): they are never evicted */
    /* Disaggregated serving (n must be 1, no logprobs or logits): export_kv stops after the
     * first token with a BLADE_FINISH_EXPORTED event instead of decoding; import continues
     * a prefill computed by another engine, emitting its first token as the first event. */
    bool export_kv;
    const blade_kv_import *import;
    blade_pooling embed;          /* not NONE: an embedding request, prefill only: the prompt is
                                   * computed like any other (batched, chunked; prefix-cached
                                   * when pooling the last token), nothing is sampled, and one
                                   * event carries the embedding. max_tokens, sampling, stop
                                   * and logprobs do not apply; n must be 1. */
    bool speculative;             /* true (default): speculate when the engine has a drafter */
    blade_token_callback callback;
    void *user;
} blade_request;

void blade_request_default(blade_request *r);

typedef struct blade_engine blade_engine;

blade_engine *blade_engine_new(const blade_model *m, const blade_engine_config *cfg, blade_error *err);
/* Drains (finishes in-flight requests) when drain is set, otherwise aborts them; joins the
 * engine thread and frees everything. */
void blade_engine_free(blade_engine *e, bool drain);

/* Validates and queues a request; returns its id (> 0), or 0 with err set. */
uint64_t blade_engine_submit(blade_engine *e, const blade_request *r, blade_error *err);
/* Aborts a request (all its choices): its blocks return to the pool within one step (with
 * --scheduler static, when its batch ends: a fixed-shape batch keeps every seat) and its
 * callback gets a BLADE_FINISH_ABORT event per unfinished choice. Returns false for an id
 * that was never issued. */
bool blade_engine_abort(blade_engine *e, uint64_t id);
/* Blocks until no request is running or waiting. */
void blade_engine_wait_idle(blade_engine *e);

typedef struct blade_engine_stats {
    int32_t running;
    int32_t waiting;
    int32_t kv_blocks_total;
    int32_t kv_blocks_used;
    int32_t kv_blocks_cached;
    int32_t kv_blocks_free;
    int32_t kv_blocks_pinned;
    int32_t block_size;
    double prefix_hit_rate;   /* tokens found cached / tokens looked up */
    uint64_t prefix_hit_tokens;
    uint64_t prefix_query_tokens;
    double kv_utilisation;    /* token slots used / allocated, averaged over steps */
    uint64_t evictions;
    uint64_t preemptions;
    uint64_t steps;
    uint64_t computed_tokens; /* tokens the runner computed (prefill + decode + recompute) */
    uint64_t generated_tokens;
    uint64_t requests_finished;
    int32_t max_running;      /* most sequences running in one step */
    uint64_t invariant_checks;
    char invariant_error[600]; /* first violation found by check_invariants, "" if none */
    /* speculative decoding */
    uint64_t spec_verifies;        /* sequence-steps that verified at least one draft */
    uint64_t spec_draft_tokens;    /* drafts verified */
    uint64_t spec_accepted_tokens; /* of those, accepted */
    uint64_t spec_accept_hist[BLADE_SPEC_MAX_K + 1]; /* verifies by number of drafts accepted */
    uint64_t spec_draft_hist[BLADE_SPEC_MAX_K + 1];  /* verifies by number of drafts verified */
    int32_t draft_kv_blocks_total; /* the draft model's KV (0 without one) */
    int32_t draft_kv_blocks_used;  /* held by sequences' draft states */
    /* Steps that decoded one sequence alone, by the tokens they computed (1 + its drafts,
     * index 1 .. BLADE_SPEC_MAX_K + 1), and the runner's time for them: the verify-cost
     * curve as the engine met it. Drafting's own time, every step. */
    uint64_t solo_decode_steps[BLADE_SPEC_MAX_K + 2];
    double solo_decode_seconds[BLADE_SPEC_MAX_K + 2];
    double spec_draft_seconds;
    /* sequence-steps that called the drafting model (draft or self), whether or not any
     * of what it drafted was verified */
    uint64_t spec_draft_calls;
} blade_engine_stats;

void blade_engine_stats_get(blade_engine *e, blade_engine_stats *out);
const blade_model *blade_engine_model(const blade_engine *e);
/* KV capacity in tokens (blocks x block size). */
int64_t blade_engine_kv_tokens(const blade_engine *e);
int32_t blade_engine_max_context(const blade_engine *e);
/* Tokens the drafting model drafts within (its trained context): a longer sequence decodes
 * without speculation. 0 without a drafting model. */
int32_t blade_engine_draft_context(const blade_engine *e);
/* What BLADE_POOL_MODEL means for this engine's model (MEAN or LAST). */
blade_pooling blade_engine_pooling(const blade_engine *e);

/* ---- disaggregated serving ---- */

#define BLADE_ENGINE_FINGERPRINT_BYTES 32
/* What makes this engine's KV interchangeable with another's: the model's identity (its
 * metadata and tensor table), the KV type and the block size. Engines with different
 * fingerprints never exchange blocks. */
void blade_engine_fingerprint(const blade_engine *e, uint8_t out[BLADE_ENGINE_FINGERPRINT_BYTES]);
/* The same as lowercase hex (what /health and etcd registrations show). */
void blade_engine_fingerprint_hex(const blade_engine *e, char out[2 * BLADE_ENGINE_FINGERPRINT_BYTES + 1]);
/* The paged store (its shape for staging stores and wire frames; exported blocks are read
 * from it while held). */
const blade_kv_store *blade_engine_kv_store(const blade_engine *e);
/* have[i]: whether the prefix cache holds the block named hashes[i] (safe from any thread). */
void blade_engine_kv_have(blade_engine *e, const uint8_t (*hashes)[BLADE_HASH_BYTES], int32_t n, bool *have);
/* Gives an exported request's blocks back (they stay in the prefix cache); its export is
 * gone. Returns false for an id that was never issued. */
bool blade_engine_export_release(blade_engine *e, uint64_t id);

#endif

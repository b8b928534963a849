#ifndef BLADE_ENGINE_REQUEST_OUTPUT_H
#define BLADE_ENGINE_REQUEST_OUTPUT_H

/* What one choice of a request shows its client: a row of logits becomes a sampled token,
 * its logprobs, the text it releases (whole UTF-8 characters, stop strings held back) and,
 * at the end, a finish reason; each token is one event on the request's callback.
 *
 * The step loop owns the sequence (its tokens, KV blocks and seat); this module owns what
 * turns the sequence's new tokens into events. A step that yields several rows for one
 * sequence (speculative decoding) samples and emits them one at a time, stopping at the
 * first token that finishes the choice. Engine thread only. */

#include "blade/engine.h"
#include "blade/sampler.h"
#include "blade/scheduler.h"
#include "blade/stop.h"
#include "blade/tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What the outputs of one engine share: the vocabulary and one logprobs row (the engine
 * thread handles one token at a time). */
typedef struct output_vocab {
    const blade_tokenizer *tok;
    int32_t n_vocab;
    size_t piece_cap; /* longest text one token can release, plus room */
    float *logprobs;  /* [n_vocab] scratch */
} output_vocab;

typedef struct request_output {
    uint64_t id;
    int32_t choice;
    blade_token_callback callback;
    void *user;
    int32_t max_tokens;
    bool ignore_eos;
    int32_t logprobs;
    bool want_logits;
    int32_t n_generated;
    blade_sampler *sampler;
    blade_detokenizer detok;
    blade_stop_matcher stop;
    char *piece; /* detokenizer output of one token */
    char *text;  /* text of one event */
    size_t cap_text;
    double t_submit, t_scheduled, t_first_token;
} request_output;

/* Sets up choice `choice` of request q (its sampler seeded with seed + choice) after the
 * prompt: the sampler has seen the prompt, and the detokenizer is primed by it so the first
 * generated piece keeps its leading space. Returns -1 with err set. */
int request_output_init(request_output *o, const output_vocab *v, const blade_request *q, int32_t choice,
                        const int32_t *prompt, int32_t n_prompt, blade_error *err);
void request_output_destroy(request_output *o);

/* The next token under the choice's sampling parameters, recorded in the sampler's
 * history (penalties see it from the next token on), or -1 when the row has no usable
 * logits (all NaN or -inf). It counts as generated once request_output_token emits it. */
int32_t request_output_sample(request_output *o, const float *logits);

/* Emits token id, chosen from logits (by request_output_sample or speculative
 * verification, which record it in the sampler), as one event. seq already ends with it. The
 * event releases the token's text; it finishes the choice on end-of-generation (unless
 * ignored), a stop string, max_tokens or seq's max_total. Returns the finish reason,
 * BLADE_FINISH_NONE while the choice goes on. */
blade_finish_reason request_output_token(request_output *o, const output_vocab *v, const blade_sched_seq *seq,
                                         int32_t id, const float *logits);

/* The last event of an export_kv choice: its first token (sampled, not yet emitted as
 * text: the engine continuing it does that) and the KV export. */
void request_output_export(request_output *o, const blade_sched_seq *seq, int32_t id, const blade_kv_export *ex);

/* The last event of a choice that ends without a token (abort, error): token -1, no
 * text. */
/* An embedding request's one event: its vector (n floats) and finish STOP. */
void request_output_embedding(request_output *o, const blade_sched_seq *seq, const float *embedding, int32_t n);
void request_output_finish(request_output *o, const blade_sched_seq *seq, blade_finish_reason why,
                           const char *error);

#endif

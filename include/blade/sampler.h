#ifndef BLADE_SAMPLER_H
#define BLADE_SAMPLER_H

/* Token sampling over one row of logits. Each sampler owns its random stream, seeded per
 * request, so a request's choices are reproducible whatever runs beside it.
 *
 * Order of operations (fixed, documented for users):
 *   1. repetition penalty (prompt + generated tokens in the last repeat_last_n),
 *      presence and frequency penalties (generated tokens only, OpenAI semantics);
 *   2. temperature 0 => greedy argmax (ties: lowest id) and stop here;
 *   3. top-k, 4. divide by temperature and softmax, 5. top-p (nucleus), 6. min-p
 *      (relative to the most likely token), 7. draw from what is left.
 * Equal logits at a top-k or top-p cut go to the lower id; top-p and min-p always keep
 * the most likely token, so something is left whenever any logit is finite. */

#include "blade/error.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct blade_sampling_params {
    float temperature;       /* 0 = greedy */
    int32_t top_k;           /* <= 0: off */
    float top_p;             /* >= 1: off */
    float min_p;             /* <= 0: off */
    float repeat_penalty;    /* 1: off; llama.cpp semantics (divide positive logits, multiply negative) */
    int32_t repeat_last_n;   /* window for repeat_penalty; -1 = everything seen, 0 = none */
    float presence_penalty;  /* 0: off; subtracted once per distinct generated token */
    float frequency_penalty; /* 0: off; subtracted per occurrence in generated tokens */
    uint64_t seed;
} blade_sampling_params;

/* temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat_last_n 64, seed 0, every
 * penalty off: llama.cpp's defaults, so that models behave as their users expect. */
void blade_sampling_params_default(blade_sampling_params *p);
/* 0 when every field is usable, else -1 naming the field in err. Rejected: NaN or infinite
 * floats, repeat_penalty <= 0, repeat_last_n < -1. blade_sampler_new refuses them too. */
int blade_sampling_params_validate(const blade_sampling_params *p, blade_error *err);

typedef struct blade_sampler blade_sampler;

/* NULL when p is invalid, n_vocab <= 0 or memory runs out. All scratch (36 bytes per
 * vocabulary entry) is allocated here; accept and sample never allocate. */
blade_sampler *blade_sampler_new(const blade_sampling_params *p, int32_t n_vocab);
void blade_sampler_free(blade_sampler *s);
/* Records a token of the context: prompt tokens (generated = false) count only for the
 * repetition penalty; generated ones for all penalties. Tokens outside [0, n_vocab) are
 * ignored. */
void blade_sampler_accept(blade_sampler *s, int32_t token, bool generated);
/* Picks the next token. logits (n_vocab floats) are not modified. NaN logits count as -inf
 * (never chosen), +inf as FLT_MAX. Returns -1 only when every logit is -inf or NaN.
 * Every call with temperature > 0 consumes exactly one uniform from the stream, so the
 * stream's position depends only on how many tokens were sampled. */
int32_t blade_sampler_sample(blade_sampler *s, const float *logits);
/* The distribution blade_sampler_sample draws from for this row, given the history so far
 * (penalties, temperature, top-k, top-p, min-p applied; greedy: all mass on the argmax):
 * probs (n_vocab entries) gets each token's probability, 0 for the tokens cut. Consumes
 * nothing from the stream. Returns the number of tokens left, -1 when every logit is -inf
 * or NaN. Speculative decoding's rejection rule needs this p. */
int32_t blade_sampler_probs(blade_sampler *s, const float *logits, float *probs);
/* The index of the largest entry (the lowest on ties; NaN never chosen), -1 when none is
 * above -inf: greedy choice over a row of logits. */
int32_t blade_argmax(const float *logits, int32_t n);
/* One uniform in [0, 1) from the sampler's own stream. */
double blade_sampler_uniform(blade_sampler *s);
/* Draws a token with probability proportional to weights (n_vocab entries, those <= 0 or
 * NaN never chosen), consuming one uniform from the stream; -1 when no weight is positive. */
int32_t blade_sampler_draw_from(blade_sampler *s, const float *weights);
/* Advances the random stream as n calls of blade_sampler_sample would (none at temperature
 * 0): a sequence whose first tokens were sampled elsewhere (a prefill worker) continues
 * with the draws it would have had there. */
void blade_sampler_skip_draws(blade_sampler *s, int32_t n);
/* log-softmax of the raw logits (before penalties and temperature), as OpenAI's logprobs
 * report them; out has n_vocab entries. NaN and -inf logits give -inf, +inf counts as
 * FLT_MAX; if no logit is finite every entry is -inf. */
void blade_logits_to_logprobs(const float *logits, int32_t n_vocab, float *out);
/* The n highest entries of logprobs (OpenAI top_logprobs), written best first to ids and
 * values (room for n each); ties go to the lower id. -inf and NaN entries (impossible
 * tokens) are skipped. Returns how many were written: min(n, finite entries). */
int blade_top_logprobs(const float *logprobs, int32_t n_vocab, int n, int32_t *ids, float *values);

#endif

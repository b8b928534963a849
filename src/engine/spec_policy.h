#ifndef BLADE_ENGINE_SPEC_POLICY_H
#define BLADE_ENGINE_SPEC_POLICY_H

/* How many drafts each sequence verifies this step (spec.h). Speculation pays when a step
 * of T new tokens costs little more than a step of one (decode streams the weights once
 * either way) and the drafts are likely to be accepted. The policy keeps a running
 * acceptance estimate per sequence and hands out drafts one at a time to the sequence
 * whose next draft is most likely to be kept, as far as the step's expected tokens per
 * unit of cost rise; on a step that is already compute-bound (many decodes, prefill
 * chunks) every extra token costs its full share, so no draft is handed out: under load
 * speculation backs off by itself. The cost curve is measured at engine start. */

#include "blade/runner.h"

#include <stdint.h>

/* Drafts accepted / drafts that could have been, decayed so a sequence whose text stops
 * repeating itself soon stops drafting. A run stopping at its first rejection is one
 * failure after `accepted` successes: the maximum-likelihood per-draft rate. */
typedef struct spec_accept {
    double hits, trials;
} spec_accept;

void spec_accept_init(spec_accept *a);
void spec_accept_update(spec_accept *a, int32_t drafted, int32_t accepted);
double spec_accept_rate(const spec_accept *a);

typedef struct spec_cand {
    double alpha;  /* per-draft acceptance estimate */
    int32_t k_max; /* most drafts it may verify */
    int32_t k;     /* chosen */
} spec_cand;

/* cost[T] for T = 1..n_cost: a step of T new tokens relative to one (cost[1] = 1),
 * extended beyond n_cost at no less than its cost per token (step_cost). base_value: the
 * useful work of the step without drafts (decoded tokens and prefill tokens alike);
 * base_tokens: the tokens it computes without drafts; draft_cost: one draft-model call
 * relative to cost[1] (0 for prompt lookup). The drafts go out in order of likelihood and
 * the step keeps the prefix of that order with the most expected tokens per unit of cost. */
void spec_policy_choose(const double *cost, int32_t n_cost, double base_value, int32_t base_tokens, double draft_cost,
                        spec_cand *c, int32_t n);

/* Measures cost[1..n_cost] with the runner: steps of T tokens for one sequence after a
 * short context, in blocks 0.. of its store (no sequence may hold them yet), the fastest
 * of a few interleaved repetitions, made non-decreasing and relative to T = 1. *one_step_s gets
 * the one-token step's seconds. Returns -1 when the store is too small or a step fails. */
int spec_measure_cost(blade_runner *r, int32_t n_vocab, int32_t store_blocks, int32_t block_size, double *cost,
                      int32_t n_cost, double *one_step_s);

#endif

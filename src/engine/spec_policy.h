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
#include "blade/spec.h"

#include <stdbool.h>
#include <stdint.h>

/* Drafts accepted / drafts that could have been, decayed so a sequence whose text stops
 * repeating itself soon stops drafting. A run stopping at its first rejection is one
 * failure after `accepted` successes: the maximum-likelihood per-draft rate. A drafting
 * model's call whose drafts were all too doubtful to verify counts as one rejected draft:
 * the rate decides whether to call the drafter, and such a call gave nothing for its cost
 * (self-draft's drafter cost 0.42-0.54 ms a step while about 22 of 500 steps verified a
 * draft: MEASURED.md, stops 36-37). */
typedef struct spec_accept {
    double hits, trials;
    int32_t idle; /* steps since it last drafted */
} spec_accept;

void spec_accept_init(spec_accept *a);
/* A new sequence starts from the rate the engine's traffic has shown lately (an estimate
 * updated with every sequence's), weighed as the prior is: where the drafter has been
 * failing, a new request does not pay to find that out again. */
void spec_accept_start(spec_accept *a, const spec_accept *traffic);
void spec_accept_update(spec_accept *a, int32_t drafted, int32_t accepted);
double spec_accept_rate(const spec_accept *a);

/* What a model drafter's confidence says about acceptance. A drafted token comes with the
 * drafter's probability for it and where it came from (the model alone, prompt lookup
 * agreeing with the model, or lookup chosen over a model that was unsure); the calibration
 * keeps, per source and band of that probability, how often such drafts were kept,
 * decayed so it follows the traffic. On stories260K-draft against its inflated Q4_0
 * target, drafts the model gave 0.9 or more were kept 99% of the time and drafts it gave
 * 0.1-0.3 about 37% (MEASURED.md): one rate per sequence cannot tell those apart, so
 * drafting goes on while the drafts are sure and stops at the first doubtful one. */
typedef enum spec_source {
    SPEC_FROM_MODEL,  /* the draft model's choice, no lookup candidate */
    SPEC_FROM_BOTH,   /* the model's choice, which prompt lookup also proposed */
    SPEC_FROM_LOOKUP, /* prompt lookup's choice, where the model chose otherwise */
    SPEC_SOURCES
} spec_source;

#define SPEC_CONF_BANDS 10

typedef struct spec_calib {
    double hits[SPEC_SOURCES][SPEC_CONF_BANDS], trials[SPEC_SOURCES][SPEC_CONF_BANDS];
} spec_calib;

/* Priors: a model draft is kept about as often as the model believes, one prompt lookup
 * agrees with a little more often, lookup against the model's choice half the time. */
void spec_calib_init(spec_calib *c);
int32_t spec_calib_band(float conf);
/* The estimated chance that a draft of this source and confidence is kept. */
double spec_calib_rate(const spec_calib *c, spec_source s, float conf);
/* One verified draft (only drafts up to and including the first rejected one are). */
void spec_calib_update(spec_calib *c, spec_source s, float conf, bool kept);

typedef struct spec_cand {
    double alpha;  /* per-draft acceptance estimate */
    /* NULL, or the made drafts' chances that they and all before them are kept (gain[j]
     * for draft j): these then replace alpha^(j+1), and k_max is how many were made */
    const double *gain;
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

/* What a step's drafts are weighed against: the verify-cost curve (cost[1..n_cost]), the
 * step's useful work and tokens without drafts, and one draft-model call, all relative to
 * a one-token step (spec_policy_choose's arguments). */
typedef struct spec_step_econ {
    const double *cost;
    int32_t n_cost;
    double base_value;
    int32_t base_tokens;
    double draft_cost;
} spec_step_econ;

/* Whether a sequence whose n drafts so far have the chances gain[0..n) (each, that it and
 * every draft before it are kept) should draft again, up to k_max drafts: true while some
 * longer run could verify at a better ratio than the best of the drafts already made, even
 * with every further draft kept as often as the last (each rating multiplies the chance by
 * at most 1) and each costing another call. Drafts past that would be made only to be
 * trimmed: the Q4_0 target's drafter made 3.2-3.3 drafts a step of which the step verified
 * 2.1-2.2 (MEASURED.md). The sequence is weighed alone; beside others' drafts its own sit
 * further up the curve, where they pay no better. */
bool spec_policy_draft_more(const spec_step_econ *s, const double *gain, int32_t n, int32_t k_max);

/* Whether a sequence the policy gave no drafts, idle steps in a row, drafts once anyway.
 * Its rate learns only from drafts, so without a try now and then a sequence whose text
 * turns predictable after a doubtful stretch would never draft again. A try is made only
 * where a draft kept at the prior's rate would pay in this step (under load none would,
 * and nothing is tried), and so seldom that tries cost at most SPEC_PROBE_SHARE of the
 * steps between them. Arguments as spec_policy_choose's. */
#define SPEC_PROBE_SHARE 0.01
bool spec_policy_probe(const double *cost, int32_t n_cost, int32_t base_tokens, double draft_cost, int32_t idle);

/* The verify-cost curve as the machine is now. A one-token step streams the weights and is
 * memory-bound; a step of more tokens adds arithmetic that hides under that stream until
 * it outgrows it, so a step of T tokens takes about max(memory time, its compute time). On
 * a host whose memory bandwidth moves with other work a curve measured once goes wrong:
 * here a one-token Q4_0 step took 9.2 ms in one minute and 16 ms a few minutes later, when
 * steps of up to six tokens cost no more than one (MEASURED.md). So the curve follows live
 * steps: each size's usual time when arithmetic bounds it (busy), and the one-token step's
 * (memory) from one-token steps and from steps far slower than their busy time, and gives
 * cost[T] = max(1, busy[T] / memory). */
typedef struct spec_curve {
    int32_t n; /* sizes 1..n */
    double busy_ms[BLADE_SPEC_MAX_K + 2];
    double mem_ms;
    int32_t slow_run; /* steps of several tokens in a row slower than memory-bound */
    /* observed steps since each size's last; past SPEC_CURVE_STALE its time drifts down to
     * the next smaller size's until a step of it is seen again */
    int32_t age[BLADE_SPEC_MAX_K + 2];
    double cost[BLADE_SPEC_MAX_K + 2];
} spec_curve;

/* A size the policy has not run for this many observed steps is taken as no dearer than
 * the size below it, so that it gets run and measured again: a size the curve overrates
 * is otherwise never chosen, and so never corrected: a Q8_0 run verified at most two drafts
 * in all but 4 of its 219 steps (1.92x and 1.88x, where the hour's other runs read
 * 1.95-2.24x verifying mostly three and four), and engines given a curve that put 4- and
 * 5-token steps at 2x ran no 4-token step, against 56-123 of about 230 with this
 * (MEASURED.md, stop 44). Where the size really is dear, the step that finds out costs
 * its extra tokens once in this many. */
#define SPEC_CURVE_STALE 100

/* From a measured curve (cost[1..n], made by spec_measure_cost) and its one-token step. */
void spec_curve_init(spec_curve *c, const double *cost, int32_t n, double one_ms);
/* A live step of one sequence with t new tokens took ms; cost[] follows. The first step
 * of a size gone stale is taken as its time outright. */
void spec_curve_observe(spec_curve *c, int32_t t, double ms);

/* Measures cost[1..n_cost] with the runner: steps of T tokens for one sequence after a
 * short context, in blocks 0.. of its store (no sequence may hold them yet), the fastest
 * of a few interleaved repetitions, made non-decreasing and relative to T = 1. *one_step_s gets
 * the one-token step's seconds. Returns -1 when the store is too small or a step fails. */
int spec_measure_cost(blade_runner *r, int32_t n_vocab, int32_t store_blocks, int32_t block_size, double *cost,
                      int32_t n_cost, double *one_step_s);

#endif

#ifndef BLADE_ENGINE_SPEC_VERIFY_H
#define BLADE_ENGINE_SPEC_VERIFY_H

/* Acceptance of drafted tokens against the target's rows of logits (spec.h). Row j of
 * rows is the target's prediction after the sequence's last real token followed by
 * draft[0..j). Engine thread only. */

#include "blade/sampler.h"

#include <stdbool.h>
#include <stdint.h>

/* Greedy verification through the request's own sampler (so penalties see the tokens
 * accepted so far): out[j] is the sampler's choice from row j, recorded in its history;
 * drafts are accepted while they equal it, and the first choice that differs (or the one
 * after the last draft) ends the run. Returns the tokens written to out (1..n_draft+1);
 * out[0..m-1) equal draft[0..m-1). When a row has no usable logits the run ends before it
 * and *bad_row is set (the return value may then be 0). */
int32_t spec_verify_greedy(blade_sampler *s, const float *rows, int32_t n_vocab, const int32_t *draft,
                           int32_t n_draft, int32_t *out, bool *bad_row);

/* Sampled verification: the standard rejection rule, with p the request's distribution
 * after every transform it asked for (penalties seeing the tokens accepted so far,
 * temperature, top-k, top-p, min-p) and q the drafter's. Every drafter here proposes
 * deterministically (prompt lookup, the draft model's greedy choice), so q is a point mass
 * on the draft: it is accepted with probability min(1, p(d) / 1) = p(d), and on rejection
 * the token is drawn from the normalised max(0, p - q), which is p without d. The output is
 * then distributed exactly as p, draft by draft; after the last accepted draft the next
 * token is drawn from p. probs is scratch of n_vocab floats. Returns as
 * spec_verify_greedy does. */
int32_t spec_verify_sampled(blade_sampler *s, const float *rows, int32_t n_vocab, const int32_t *draft,
                            int32_t n_draft, float *probs, int32_t *out, bool *bad_row);

#endif

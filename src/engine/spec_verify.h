#ifndef BLADE_ENGINE_SPEC_VERIFY_H
#define BLADE_ENGINE_SPEC_VERIFY_H

/* Acceptance of drafted tokens against the target's rows of logits (spec.h). Row j of
 * rows is the target's prediction after the sequence's last real token followed by
 * draft[0..j). Engine thread only. */

#include "blade/sampler.h"

#include <stdbool.h>
#include <stdint.h>

/* The standard rejection rule, through the request's own sampler: p is the request's
 * distribution after every transform it asked for (penalties seeing the tokens accepted
 * so far in this run, temperature, top-k, top-p, min-p) and q the drafter's. Every drafter
 * here proposes deterministically (prompt lookup, the draft model's greedy choice), so q
 * is a point mass on the draft: it is kept with probability min(1, p(d) / 1) = p(d), and a
 * rejected position is drawn from the normalised max(0, p - q), which is p without d; after
 * the last kept draft the next token is drawn from p. The output is then distributed
 * exactly as p. For a greedy request p is a point mass on the argmax: a draft is kept iff
 * it is the argmax and the token after the run is the argmax of its row, exactly what plain
 * decoding emits.
 *
 * Each token written to out is recorded in the sampler's history. Returns the tokens
 * written (1..n_draft+1); out[0..m-1) equal draft[0..m-1). When a row has no usable logits
 * the run ends before it and *bad_row is set (the return value may then be 0). probs is
 * scratch of n_vocab floats. */
int32_t spec_verify(blade_sampler *s, const float *rows, int32_t n_vocab, const int32_t *draft, int32_t n_draft,
                    float *probs, int32_t *out, bool *bad_row);

#endif

#ifndef BLADE_FORWARD_H
#define BLADE_FORWARD_H

/* The reference forward pass: one sequence, one token at a time, f32 activations over a
 * contiguous f32 KV cache, any supported weight type (rows are dequantized as they are
 * used). It is written to be read top to bottom, and it is the ground truth that the
 * batched model runner is checked against. */

#include "blade/act_stats.h"
#include "blade/error.h"
#include "blade/model.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct blade_forward blade_forward;

blade_forward *blade_forward_new(const blade_model *m, int32_t n_ctx, blade_error *err);
void blade_forward_free(blade_forward *f);
int32_t blade_forward_n_ctx(const blade_forward *f);
/* While s is set, every token adds the activation rows its weight matrices read to s
 * (act_stats.h; the classifier's only when logits are wanted): the ground truth for the
 * runner's statistics. NULL stops collecting. Fails for statistics of another shape. */
int blade_forward_set_act_stats(blade_forward *f, blade_act_stats *s, blade_error *err);

/* Processes `token` at position `pos`. Positions must be fed in order: pos may be at most
 * the number of positions already cached, and feeding an earlier pos rewinds the sequence.
 * With want_logits the logits are computed and readable through blade_forward_logits.
 * Returns 0, or -1 for a bad token or position (err says which). */
int blade_forward_token(blade_forward *f, int32_t token, int32_t pos, bool want_logits, blade_error *err);
/* n_vocab floats from the last call with want_logits; valid until the next call. */
const float *blade_forward_logits(const blade_forward *f);

#endif

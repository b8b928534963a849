#ifndef BLADE_QUANTIZE_QUANT_INTERNAL_H
#define BLADE_QUANTIZE_QUANT_INTERNAL_H

/* Pieces the block quantizers share: the rounding rule ggml's reference quantizers use, and
 * the element weights a scale search minimizes against. */

#include "blade/types.h"

#include <stdint.h>
#include <string.h>

/* Round to nearest, ties to even, for |v| < 2^22: adding 1.5 * 2^23 leaves the integer in the
 * low mantissa bits. Bit-identical to the reference quantizers' rounding, and branch-free so
 * the search loops vectorize. */
static inline int quant_nearest(float v)
{
    float t = v + 12582912.0f;
    int32_t i;
    memcpy(&i, &t, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* quant_nearest's result as a float, without leaving float registers. */
static inline float quant_round(float v)
{
    return (v + 12582912.0f) - 12582912.0f;
}

static inline int quant_clamp(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* Mean of x^2 over the n values of a row: the spread against which importance weights are
 * set (see quant_importance_weights). */
float quant_mean_square(const float *x, int64_t n);

/* Weights for an importance-guided search: importance[i] * sqrt(sigma2 + x[i]^2). The square
 * root keeps small values from being ignored next to large ones, sigma2 keeps weights of
 * near-zero values from vanishing. */
void quant_importance_weights(const float *x, const float *importance, float sigma2, float *w, int n);

/* Sum of w[i] * (x[i] - y[i])^2 in double over n values (w NULL: all ones): the block error
 * every accept-if-better decision and the public blade_quant_weighted_error use, so a block
 * kept for having lower error has lower error by the published metric too. */
double quant_block_error(const float *x, const float *y, const float *w, int n);

/* Default weights of the K-quant searches, as the reference quantizer sets them: Q4_K and
 * Q5_K weight each value by the RMS of its 32-value sub-block plus its magnitude; Q6_K by its
 * square. */
void quant_k_affine_default_weights(const float *x, float *w);
void quant_q6_k_default_weights(const float *x, float *w, int n);

#endif

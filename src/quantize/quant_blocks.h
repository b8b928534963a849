#ifndef BLADE_QUANTIZE_QUANT_BLOCKS_H
#define BLADE_QUANTIZE_QUANT_BLOCKS_H

/* The block quantizers, one per type, with blade_quantize_row's contract (importance NULL or
 * n weights; refine), and the plain from_float conversions of the type table: the default
 * weighting with refinement, which is what blade_quantize_row(type, x, dst, n, NULL, true)
 * produces. */

#include <stdbool.h>
#include <stdint.h>

void quant_q8_0(const float *x, void *dst, int64_t n, const float *importance, bool refine);
void quant_q4_0(const float *x, void *dst, int64_t n, const float *importance, bool refine);
void quant_q4_k(const float *x, void *dst, int64_t n, const float *importance, bool refine);
void quant_q5_k(const float *x, void *dst, int64_t n, const float *importance, bool refine);
void quant_q6_k(const float *x, void *dst, int64_t n, const float *importance, bool refine);

void blade_q8_0_from_float(const float *src, void *dst, int64_t n);
void blade_q4_0_from_float(const float *src, void *dst, int64_t n);
void blade_q4_k_from_float(const float *src, void *dst, int64_t n);
void blade_q5_k_from_float(const float *src, void *dst, int64_t n);
void blade_q6_k_from_float(const float *src, void *dst, int64_t n);

#endif

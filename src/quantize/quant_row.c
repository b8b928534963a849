/* blade_quantize_row and the weighted-error metric: the per-type dispatch, and the element
 * weights the searches and the metric share. */

#include "blade/quantize.h"

#include "quantize/quant_blocks.h"
#include "quantize/quant_internal.h"
#include "tensor/quant_ref.h"

#include <math.h>

float quant_mean_square(const float *x, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    return n > 0 ? (float)(s / (double)n) : 0.0f;
}

void quant_importance_weights(const float *x, const float *importance, float sigma2, float *w, int n)
{
    for (int i = 0; i < n; i++)
        w[i] = importance[i] * sqrtf(sigma2 + x[i] * x[i]);
}

double quant_block_error(const float *x, const float *y, const float *w, int n)
{
    double sum = 0;
    for (int i = 0; i < n; i++) {
        double e = (double)x[i] - (double)y[i];
        sum += (w ? (double)w[i] : 1.0) * e * e;
    }
    return sum;
}

void quant_k_affine_default_weights(const float *x, float *w)
{
    for (int j = 0; j < K_NSUB; j++) {
        const float *xj = x + j * K_SUB;
        float sum_x2 = 0.0f;
        for (int i = 0; i < K_SUB; i++)
            sum_x2 += xj[i] * xj[i];
        float av_x = sqrtf(sum_x2 / (float)K_SUB);
        for (int i = 0; i < K_SUB; i++)
            w[j * K_SUB + i] = av_x + fabsf(xj[i]);
    }
}

void quant_q6_k_default_weights(const float *x, float *w, int n)
{
    for (int i = 0; i < n; i++)
        w[i] = x[i] * x[i];
}

bool blade_quantize_type_supported(uint32_t type)
{
    switch (type) {
    case BLADE_TYPE_F32:
    case BLADE_TYPE_F16:
    case BLADE_TYPE_BF16:
    case BLADE_TYPE_Q8_0:
    case BLADE_TYPE_Q4_0:
    case BLADE_TYPE_Q4_K:
    case BLADE_TYPE_Q5_K:
    case BLADE_TYPE_Q6_K:
        return true;
    default:
        return false;
    }
}

void blade_quantize_row(uint32_t type, const float *x, void *dst, int64_t n, const float *importance, bool refine)
{
    switch (type) {
    case BLADE_TYPE_Q8_0: quant_q8_0(x, dst, n, importance, refine); break;
    case BLADE_TYPE_Q4_0: quant_q4_0(x, dst, n, importance, refine); break;
    case BLADE_TYPE_Q4_K: quant_q4_k(x, dst, n, importance, refine); break;
    case BLADE_TYPE_Q5_K: quant_q5_k(x, dst, n, importance, refine); break;
    case BLADE_TYPE_Q6_K: quant_q6_k(x, dst, n, importance, refine); break;
    default: {
        const blade_type_traits *t = blade_type_traits_get(type);
        if (t && t->from_float)
            t->from_float(x, dst, n);
        break;
    }
    }
}

double blade_quant_weighted_error(uint32_t type, const float *x, const float *y, int64_t n, const float *importance)
{
    const blade_type_traits *t = blade_type_traits_get(type);
    int64_t block = t ? t->block_size : 1;
    bool k_affine = type == BLADE_TYPE_Q4_K || type == BLADE_TYPE_Q5_K;
    bool q6 = type == BLADE_TYPE_Q6_K;
    float sigma2 = importance ? quant_mean_square(x, n) : 0.0f;
    double total = 0;
    float w[QK_K];
    for (int64_t b = 0; b + block <= n; b += block) {
        const float *xb = x + b;
        const float *wb = NULL;
        if (importance && k_affine) {
            wb = importance + b;
        } else if (importance) {
            quant_importance_weights(xb, importance + b, sigma2, w, (int)block);
            wb = w;
        } else if (k_affine) {
            quant_k_affine_default_weights(xb, w);
            wb = w;
        } else if (q6) {
            quant_q6_k_default_weights(xb, w, QK_K);
            wb = w;
        }
        total += quant_block_error(xb, y + b, wb, (int)block);
    }
    return total;
}

#include "kernels/kernels_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Activation conversion produces the same bytes on every ISA (the vector converters are
 * checked against these portable ones), so a converted row is valid for any kernel and
 * switching ISA never invalidates buffers. */

uint32_t blade_act_form(uint32_t weight_type)
{
    switch (blade_matmul_base_type(weight_type)) {
    case BLADE_TYPE_F32:
    case BLADE_TYPE_F16:
        return BLADE_TYPE_F32;
    case BLADE_TYPE_BF16:
        return BLADE_TYPE_BF16;
    case BLADE_TYPE_Q8_0:
    case BLADE_TYPE_Q4_0:
        return BLADE_TYPE_Q8_0;
    case BLADE_TYPE_Q4_K:
    case BLADE_TYPE_Q5_K:
    case BLADE_TYPE_Q6_K:
        return BLADE_TYPE_Q8_K;
    default:
        return BLADE_ACT_FORM_NONE;
    }
}

size_t blade_act_row_bytes(uint32_t weight_type, int64_t n)
{
    size_t un = (size_t)n;
    switch (blade_act_form(weight_type)) {
    case BLADE_TYPE_F32:
        return act_pad(un * sizeof(float));
    case BLADE_TYPE_BF16:
        return act_pad(un * sizeof(uint16_t));
    case BLADE_TYPE_Q8_0:
        return act_pad(un) + 2 * act_pad(un / QK8_0 * sizeof(float));
    case BLADE_TYPE_Q8_K:
        return act_pad(un) + act_pad(un / QK_K * sizeof(float)) + act_pad(un / 16 * sizeof(int16_t));
    default:
        return 0;
    }
}

bool blade_matmul_supported(uint32_t weight_type)
{
    return blade_act_row_bytes(weight_type, QK_K) != 0;
}

/* Symmetric int8 quantization of len values against their largest magnitude; returns the
 * scale d with x ~= d*q. Rounding is to nearest (lrintf in the default mode), so each
 * element's error is at most d/2 = amax/254. Blocks too small to invert safely are
 * treated as zero: they cannot move a dot product measurably. */
static float quantize_run(const float *x, int len, int8_t *q)
{
    float amax = 0.0f;
    for (int i = 0; i < len; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    if (!(amax >= 1e-30f)) {
        memset(q, 0, (size_t)len);
        return 0.0f;
    }
    float id = 127.0f / amax;
    for (int i = 0; i < len; i++) {
        long v = lrintf(x[i] * id);
        q[i] = (int8_t)(v < -127 ? -127 : v > 127 ? 127 : v);
    }
    return amax / 127.0f;
}

static int32_t sum_q(const int8_t *q, int len)
{
    int32_t s = 0;
    for (int i = 0; i < len; i++)
        s += q[i];
    return s;
}

static void convert_q8(const float *x, uint8_t *out, int64_t n)
{
    size_t qb = act_pad((size_t)n), db = act_pad((size_t)(n / QK8_0) * sizeof(float));
    int8_t *q = (int8_t *)out;
    float *d = (float *)(out + qb);
    int32_t *sum = (int32_t *)(out + qb + db);
    for (int64_t b = 0; b < n / QK8_0; b++) {
        d[b] = quantize_run(x + b * QK8_0, QK8_0, q + b * QK8_0);
        sum[b] = sum_q(q + b * QK8_0, QK8_0);
    }
}

static void convert_k(const float *x, uint8_t *out, int64_t n)
{
    size_t qb = act_pad((size_t)n), db = act_pad((size_t)(n / QK_K) * sizeof(float));
    int8_t *q = (int8_t *)out;
    float *d = (float *)(out + qb);
    int16_t *sum16 = (int16_t *)(out + qb + db);
    for (int64_t b = 0; b < n / QK_K; b++)
        d[b] = quantize_run(x + b * QK_K, QK_K, q + b * QK_K);
    for (int64_t g = 0; g < n / 16; g++)
        sum16[g] = (int16_t)sum_q(q + g * 16, 16);
}

/* The active ISA's converter of a float row into the form, or NULL for the portable one.
 * An AVX-512 machine also runs the AVX2 converters the AVX-512 file has no better one for. */
static blade_act_fn converter_for(uint32_t form)
{
#if defined(__x86_64__)
    blade_isa isa = blade_isa_active();
    blade_act_fn fn = isa == BLADE_ISA_AVX512 ? blade_act_avx512_converter(form) : NULL;
    if (!fn && isa >= BLADE_ISA_AVX2)
        fn = blade_act_avx2_converter(form);
    return fn;
#else
    (void)form;
    return NULL;
#endif
}

void blade_act_convert(uint32_t weight_type, const float *x, void *out, int64_t n)
{
    uint32_t form = blade_act_form(weight_type);
    size_t bytes = blade_act_row_bytes(weight_type, n);
    /* Zeroing first makes every padding byte an exact zero for the kernels' whole-vector
     * loads; the cost is small next to the conversion itself. */
    memset(out, 0, bytes);
    blade_act_fn fn = converter_for(form);
    if (fn) {
        fn(x, out, n);
        return;
    }
    switch (form) {
    case BLADE_TYPE_F32:
        memcpy(out, x, (size_t)n * sizeof(float));
        break;
    case BLADE_TYPE_BF16:
        blade_bf16_from_float(x, out, n);
        break;
    case BLADE_TYPE_Q8_0:
        convert_q8(x, out, n);
        break;
    case BLADE_TYPE_Q8_K:
        convert_k(x, out, n);
        break;
    default:
        break;
    }
}

void blade_row_from_float(uint32_t type, const float *x, void *out, int64_t n)
{
    blade_act_fn fn = converter_for(type);
    if (fn)
        fn(x, out, n);
    else if (type == BLADE_TYPE_F16)
        blade_f16_from_float(x, out, n);
    else
        blade_bf16_from_float(x, out, n);
}

static blade_matmul_fn kernel_for(uint32_t type, blade_isa isa)
{
    blade_matmul_fn fn = NULL;
#if defined(__x86_64__)
    if (isa == BLADE_ISA_AVX512)
        fn = blade_matmul_avx512_kernel(type, blade_cpu_get_features());
    if (!fn && isa >= BLADE_ISA_AVX2)
        fn = blade_matmul_avx2_kernel(type, blade_cpu_get_features());
#else
    (void)isa;
#endif
    return fn ? fn : blade_matmul_scalar_kernel(type);
}

void blade_matmul(uint32_t weight_type, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n,
                  float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    if (r1 <= r0 || n_tok <= 0)
        return;
    blade_matmul_fn fn = kernel_for(weight_type, blade_isa_active());
    if (!fn) {
        /* A caller bug (blade_matmul_supported says which types work), and returning
         * garbage would be worse than stopping. */
        fprintf(stderr, "blade_matmul: unsupported weight type %u\n", weight_type);
        abort();
    }
    int64_t align = blade_matmul_row_align(weight_type);
    if (r0 % align != 0 || (r1 % align != 0)) {
        fprintf(stderr, "blade_matmul: rows %lld..%lld of a type %u matrix are not whole groups of %lld\n",
                (long long)r0, (long long)r1, weight_type, (long long)align);
        abort();
    }
    fn(W, w_stride, X, x_stride, n, Y, ldy, n_tok, r0, r1);
}

#include "kernels/kernels_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* blade_matmul and the activation conversion it reads: the entry points that pick the
 * active ISA's kernel or converter from the kernel-traits table (ktraits.c).
 *
 * Activation conversion produces the same bytes on every ISA (the vector converters are
 * checked against the portable ones), so a converted row is valid for any kernel and
 * switching ISA never invalidates buffers. */

void blade_act_convert(uint32_t weight_type, const float *x, void *out, int64_t n)
{
    uint32_t form = blade_act_form(weight_type);
    if (form == BLADE_ACT_FORM_NONE)
        return;
    /* Zeroing first makes every padding byte an exact zero for the kernels' whole-vector
     * loads; the cost is small next to the conversion itself. */
    memset(out, 0, blade_act_row_bytes(weight_type, n));
    blade_ktraits_converter(form, blade_isa_active())(x, out, n);
}

int64_t blade_act_part_align(uint32_t weight_type)
{
    switch (blade_act_form(weight_type)) {
    case BLADE_ACT_FORM_NONE:
        return 0;
    case BLADE_TYPE_Q8_0:
        return QK8_0;
    case BLADE_TYPE_Q8_K:
        return QK_K;
    default:
        return 1; /* element by element */
    }
}

/* A part of a block-scaled row is converted as a row of its own in this scratch, a chunk at
 * a time, and its arrays are copied to their places in the whole row's layout. */
#define PART_CHUNK 1024
_Static_assert(PART_CHUNK % QK_K == 0 && PART_CHUNK % QK8_0 == 0, "chunks hold whole blocks");

/* Where a block-scaled row of n elements keeps its scales and its sums (its quants start
 * the row). */
static void scaled_arrays(bool q8, uint8_t *row, int64_t n, uint8_t **d, uint8_t **sum)
{
    if (q8) {
        act_q8_view v = act_q8_at(row, n);
        *d = (uint8_t *)v.d;
        *sum = (uint8_t *)v.sum;
    } else {
        act_k_view v = act_k_at(row, n);
        *d = (uint8_t *)v.d;
        *sum = (uint8_t *)v.sum16;
    }
}

/* The row's zero padding past each array's last element: what blade_act_convert's memset
 * leaves there. */
static void zero_tail(uint8_t *array, size_t used)
{
    memset(array + used, 0, act_pad(used) - used);
}

void blade_act_convert_part(uint32_t weight_type, const float *x, void *out, int64_t n, int64_t begin, int64_t end)
{
    uint32_t form = blade_act_form(weight_type);
    if (form == BLADE_ACT_FORM_NONE || end <= begin)
        return;
    uint8_t *row = out;
    if (form != BLADE_TYPE_Q8_0 && form != BLADE_TYPE_Q8_K) {
        size_t es = form == BLADE_TYPE_F32 ? sizeof(float) : sizeof(uint16_t);
        blade_ktraits_converter(form, blade_isa_active())(x, row + (size_t)begin * es, end - begin);
        if (end == n)
            zero_tail(row, (size_t)n * es);
        return;
    }
    bool q8 = form == BLADE_TYPE_Q8_0;
    uint8_t *q = row, *d, *sum;
    scaled_arrays(q8, row, n, &d, &sum);
    int64_t per_scale = q8 ? QK8_0 : QK_K, per_sum = q8 ? QK8_0 : 16;
    size_t sum_bytes = q8 ? sizeof(int32_t) : sizeof(int16_t);
    _Alignas(64) uint8_t part[PART_CHUNK + 2 * ACT_ALIGN + PART_CHUNK / 16 * sizeof(int32_t)];
    for (int64_t b = begin; b < end; b += PART_CHUNK) {
        int64_t len = end - b < PART_CHUNK ? end - b : PART_CHUNK;
        blade_act_convert(weight_type, x + (b - begin), part, len);
        uint8_t *pd, *psum;
        scaled_arrays(q8, part, len, &pd, &psum);
        memcpy(q + b, part, (size_t)len);
        memcpy(d + (b / per_scale) * (int64_t)sizeof(float), pd, (size_t)(len / per_scale) * sizeof(float));
        memcpy(sum + (b / per_sum) * (int64_t)sum_bytes, psum, (size_t)(len / per_sum) * sum_bytes);
    }
    if (end == n) {
        zero_tail(q, (size_t)n);
        zero_tail(d, (size_t)(n / per_scale) * sizeof(float));
        zero_tail(sum, (size_t)(n / per_sum) * sum_bytes);
    }
}

void blade_row_from_float(uint32_t type, const float *x, void *out, int64_t n)
{
    bool half = type == BLADE_TYPE_F16 || type == BLADE_TYPE_BF16;
    blade_act_fn fn = half ? blade_ktraits_converter(type, blade_isa_active()) : NULL;
    if (!fn) {
        fprintf(stderr, "blade_row_from_float: type %u is neither F16 nor BF16\n", type);
        abort();
    }
    fn(x, out, n);
}

void blade_matmul(uint32_t weight_type, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n,
                  float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    if (r1 <= r0 || n_tok <= 0)
        return;
    blade_matmul_fn fn = blade_ktraits_kernel(weight_type, blade_isa_active());
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

_Thread_local input_memo blade_input_memo;

size_t blade_matmul_input_scratch_bytes(int64_t n_max, int64_t n_tok_max)
{
    /* a step of more tokens re-derives per call: its calls are long enough to pay for it */
    int64_t tokens = n_tok_max < R16_HOLD_TOKENS ? n_tok_max : R16_HOLD_TOKENS;
    return (size_t)((n_max + QK8_0 - 1) / QK8_0) * (size_t)tokens * R16_XB_BYTES;
}

void blade_matmul_input_hold(void *scratch, size_t bytes)
{
    blade_input_memo = (input_memo){.scratch = scratch, .bytes = bytes, .held = true};
}

void blade_matmul_input_release(void)
{
    blade_input_memo = (input_memo){0};
}

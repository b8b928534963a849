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

/* The small float formats blade stores values in, exactly and without the compiler's half
 * types: IEEE half, bfloat16 and OCP FP8 E4M3, to and from f32 (types.h). */

#include "blade/types.h"

#include <string.h>

/* Conversions are done on the bit patterns rather than with the compiler's _Float16 or
 * F16C instructions: results must be bit-identical on every host and compiler, and the
 * rounding mode must be round-to-nearest-even regardless of the FPU environment. */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float blade_fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;

    if (exp == 0x1f)
        return f32_from_bits(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        /* Subnormal halves are mant * 2^-24, which fp32 represents exactly, so letting
         * the FPU normalize avoids a bit-scan loop. */
        float mag = (float)mant * 0x1p-24f;
        return f32_from_bits(sign | f32_bits(mag));
    }
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* Rounds v / 2^shift to nearest, ties to even. shift is 1..31. */
static uint32_t shift_round_even(uint32_t v, unsigned shift)
{
    uint32_t r = v >> shift;
    uint32_t rem = v & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u)))
        r++;
    return r;
}

/* A finite magnitude (float bits ax, below the format's overflow threshold) rounded to
 * nearest, ties to even, into a binary format with `mant` mantissa bits whose smallest
 * normal is 2^emin: that format's bits, sign excluded. */
static uint32_t round_magnitude(uint32_t ax, int mant, int emin)
{
    const int normal_exp = 127 + emin; /* float exponent field of the smallest normal */
    if (ax >= (uint32_t)normal_exp << 23) {
        /* Normal result: rebias the exponent and round the dropped mantissa bits; a carry
         * out of the mantissa correctly bumps the exponent. */
        return shift_round_even(ax - ((uint32_t)(normal_exp - 1) << 23), (unsigned)(23 - mant));
    }
    uint32_t exp = ax >> 23;
    /* Below half the smallest subnormal everything rounds to zero; exactly half is a tie
     * that goes to the even value, zero, which the general path also yields. */
    if (exp < (uint32_t)(normal_exp - mant - 1))
        return 0;
    /* Subnormal result in units of the smallest subnormal: the full 24-bit significand
     * scaled down. Rounding up from the largest subnormal lands on the smallest normal. */
    uint32_t significand = (ax & 0x7fffffu) | 0x800000u;
    return shift_round_even(significand, (unsigned)(normal_exp + 23 - mant) - exp);
}

uint16_t blade_fp32_to_fp16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;

    if (ax > 0x7f800000u) {
        /* Keep the top payload bits and force the quiet bit so a signalling NaN whose
         * payload lives only in the low 13 bits cannot turn into infinity. */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    /* 65520 is halfway between the largest half (65504, odd mantissa) and 2^16, so it
     * and everything above rounds to infinity. */
    if (ax >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u);
    return (uint16_t)(sign | round_magnitude(ax, 10, -14));
}

float blade_bf16_to_fp32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t blade_fp32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    /* Adding 0x7fff plus the lowest kept bit rounds to nearest even; overflow of the
     * largest finite values carries into the exponent and produces infinity, as IEEE
     * rounding requires. */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* OCP 8-bit floating point, E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits. It has
 * no infinities: exponent 1111 is a normal binade except for mantissa 111, which is NaN,
 * so the largest value is 1.75 x 2^8 = 448; exponent 0000 holds subnormals m x 2^-9. */

float blade_e4m3_to_fp32(uint8_t b)
{
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t exp = (b >> 3) & 0xfu, mant = b & 0x7u;
    if ((b & 0x7fu) == 0x7fu)
        return f32_from_bits(sign | 0x7fc00000u);
    if (exp == 0)
        return f32_from_bits(sign | f32_bits((float)mant * 0x1p-9f));
    return f32_from_bits(sign | ((exp + 120u) << 23) | (mant << 20));
}

uint8_t blade_fp32_to_e4m3(float f)
{
    uint32_t x = f32_bits(f);
    uint8_t sign = (uint8_t)((x >> 24) & 0x80u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)
        return sign | 0x7fu;
    /* Saturating conversion (the OCP spec's saturation mode): 448 and everything above it,
     * infinity included, becomes 448; below 448 nearest-even rounding never reaches the
     * NaN pattern, whose value would be 480. */
    if (ax >= 0x43e00000u)
        return sign | 0x7eu;
    return (uint8_t)(sign | round_magnitude(ax, 3, -6));
}

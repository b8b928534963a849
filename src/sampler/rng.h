#ifndef BLADE_SAMPLER_RNG_H
#define BLADE_SAMPLER_RNG_H

/* The sampler's random stream and the one transcendental its draws depend on. Both are
 * built from integer and basic IEEE double operations only, so a seed yields the same
 * choices on every machine and libc. */

#include <stdint.h>
#include <string.h>

/* xoshiro256** (Blackman & Vigna), state filled from the seed by splitmix64 as its
 * authors recommend; splitmix64 never yields the all-zero state xoshiro cannot leave. */
typedef struct blade_rng {
    uint64_t s[4];
} blade_rng;

void blade_rng_seed(blade_rng *r, uint64_t seed);
uint64_t blade_rng_next(blade_rng *r);
/* Uniform in [0, 1) with 53 random bits. */
double blade_rng_uniform(blade_rng *r);

/* e^x for x <= 0 within 3e-15 relative, with results below e^-708 returned as 0.
 * libm's exp may round differently from one implementation to the next, which would move
 * a draw that lands near a bucket boundary. Inline because the sampler calls it once per
 * candidate, up to the whole vocabulary per token.
 *
 * Every multiply and add sits in its own statement: C lets a compiler fuse a*b+c written
 * as one expression into an FMA (clang does on arm64), which rounds differently. GCC
 * fuses across statements too, but only outside ISO mode (-std=gnu*); blade builds with
 * -std=c11. */
static inline double blade_exp_nonpos(double x)
{
    /* x = n ln2/32 + r with |r| <= ln2/64, e^x = 2^(n/32) e^r. ln 2 is split Cody-Waite
     * style: the high part ends in enough zero bits that n * hi is exact for every n
     * reached here, so the reduction loses nothing. */
    static const double scale_32_ln2 = 0x1.71547652b82fep+5; /* 32 / ln 2 */
    static const double ln2_32_hi = 0x1.62e42feep-6;
    static const double ln2_32_lo = 0x1.a39ef35793c76p-38;
    /* 2^(j/32), correctly rounded. */
    static const double pow2_frac[32] = {
        0x1.0000000000000p+0, 0x1.059b0d3158574p+0, 0x1.0b5586cf9890fp+0, 0x1.11301d0125b51p+0,
        0x1.172b83c7d517bp+0, 0x1.1d4873168b9aap+0, 0x1.2387a6e756238p+0, 0x1.29e9df51fdee1p+0,
        0x1.306fe0a31b715p+0, 0x1.371a7373aa9cbp+0, 0x1.3dea64c123422p+0, 0x1.44e086061892dp+0,
        0x1.4bfdad5362a27p+0, 0x1.5342b569d4f82p+0, 0x1.5ab07dd485429p+0, 0x1.6247eb03a5585p+0,
        0x1.6a09e667f3bcdp+0, 0x1.71f75e8ec5f74p+0, 0x1.7a11473eb0187p+0, 0x1.82589994cce13p+0,
        0x1.8ace5422aa0dbp+0, 0x1.93737b0cdc5e5p+0, 0x1.9c49182a3f090p+0, 0x1.a5503b23e255dp+0,
        0x1.ae89f995ad3adp+0, 0x1.b7f76f2fb5e47p+0, 0x1.c199bdd85529cp+0, 0x1.cb720dcef9069p+0,
        0x1.d5818dcfba487p+0, 0x1.dfc97337b9b5fp+0, 0x1.ea4afa2a490dap+0, 0x1.f50765b6e4540p+0,
    };
    /* Taylor coefficients of e^r: with |r| <= ln2/64 the first omitted term is < 3e-15. */
    static const double c2 = 1.0 / 2.0, c3 = 1.0 / 6.0, c4 = 1.0 / 24.0, c5 = 1.0 / 120.0;
    if (!(x >= -708.0))
        return 0.0;
    /* Nearest integer by truncating toward zero after a half-step down; a cast rather
     * than floor() keeps libm (and its call) out of the loop. */
    double t = x * scale_32_ln2;
    t = t - 0.5;
    int n = (int)t;
    double part = n * ln2_32_hi;
    double r = x - part;
    part = n * ln2_32_lo;
    r = r - part;
    double p = c5 * r;
    p = p + c4;
    p = p * r;
    p = p + c3;
    p = p * r;
    p = p + c2;
    p = p * r;
    p = p + 1.0;
    p = p * r;
    p = p + 1.0;
    /* n in [-32686, 0]: offset to make the split into 2^q * 2^(j/32) plain unsigned
     * arithmetic, then build 2^q (q >= -1022) from its bits. */
    unsigned biased = (unsigned)(n + 32 * 1024);
    int q = (int)(biased / 32) - 1024;
    uint64_t bits = (uint64_t)(q + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    p = p * pow2_frac[biased % 32];
    return p * scale;
}

#endif

#ifndef BLADE_EXP_NEG_H
#define BLADE_EXP_NEG_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* exp(x) for x <= 0 (or NaN), the exponential that softmax and SiLU need once their
 * argument is made non-positive: argument reduction to r in [-ln2/2, ln2/2] and the degree-7
 * Taylor polynomial, whose truncation error (r^8/8! < 6e-9) is below float rounding.
 * Results under e^-87 flush to 0, which the callers cannot notice. Shared constants keep
 * the ISA paths' versions the same function; they differ only where the vector paths fuse
 * a multiply with an add. */
#define EXP_NEG_MIN (-87.0f)
#define EXP_NEG_LOG2E 1.44269504088896341f
#define EXP_NEG_LN2_HI 0.693359375f /* 355/512: n * EXP_NEG_LN2_HI is exact for |n| < 2^15 */
#define EXP_NEG_LN2_LO (-2.12194440054690583e-4f)
#define EXP_NEG_C2 (1.0f / 2)
#define EXP_NEG_C3 (1.0f / 6)
#define EXP_NEG_C4 (1.0f / 24)
#define EXP_NEG_C5 (1.0f / 120)
#define EXP_NEG_C6 (1.0f / 720)
#define EXP_NEG_C7 (1.0f / 5040)

static inline float exp_neg_scalar(float x)
{
    if (x < EXP_NEG_MIN)
        return 0.0f;
    /* Converting NaN to int would be undefined. */
    if (isnan(x))
        return x;
    /* x <= 0, so truncating x * log2(e) - 0.5 toward zero rounds to nearest. */
    int n = (int)(x * EXP_NEG_LOG2E - 0.5f);
    float fn = (float)n;
    float r = x - fn * EXP_NEG_LN2_HI;
    r = r - fn * EXP_NEG_LN2_LO;
    float y = EXP_NEG_C7;
    y = y * r + EXP_NEG_C6;
    y = y * r + EXP_NEG_C5;
    y = y * r + EXP_NEG_C4;
    y = y * r + EXP_NEG_C3;
    y = y * r + EXP_NEG_C2;
    y = y * r + 1.0f;
    y = y * r + 1.0f;
    uint32_t bits = (uint32_t)(n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#if defined(__x86_64__)

static inline __attribute__((always_inline, target("avx2,fma"))) __m256 exp_neg_avx2(__m256 x)
{
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_NEG_MIN), _CMP_LT_OQ);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_NEG_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_NEG_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_NEG_LN2_LO), r);
    __m256 y = _mm256_set1_ps(EXP_NEG_C7);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_NEG_C6));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_NEG_C5));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_NEG_C4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_NEG_C3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_NEG_C2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

static inline __attribute__((always_inline, target("avx512f"))) __m512 exp_neg_avx512(__m512 x)
{
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_NEG_MIN), _CMP_LT_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_NEG_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_NEG_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_NEG_LN2_LO), r);
    __m512 y = _mm512_set1_ps(EXP_NEG_C7);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_NEG_C6));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_NEG_C5));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_NEG_C4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_NEG_C3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_NEG_C2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

#endif

#endif

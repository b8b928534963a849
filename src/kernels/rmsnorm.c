/* RMSNorm (kernels.h) with scalar, AVX2 and AVX-512 paths that give the same bits: the
 * sum of squares runs in double over a fixed partition of the row, so the vector width
 * never changes the result. */

#include "blade/kernels.h"

#include <math.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* RMSNorm: out = x / sqrt(mean(x^2) + eps) * w. The sum of squares runs in double, in
 * NORM_PARTIALS interleaved partial sums (element i goes to partial i mod 8) combined in a
 * fixed tree: a single chain of dependent additions made the norm a long serial stretch of
 * the decode step, with the other threads waiting. The vector paths hold the eight partials
 * in lanes and perform the same IEEE operations, so every ISA gives the same bits. */
#define NORM_PARTIALS 8

/* The scale from the partials of elements [0, i0), adding the rest (i0 is a multiple of
 * NORM_PARTIALS). */
static float norm_scale(const float *x, int64_t n, float eps, double part[NORM_PARTIALS], int64_t i0)
{
    for (int64_t i = i0; i < n; i++)
        part[i % NORM_PARTIALS] += (double)x[i] * x[i];
    double ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    return (float)(1.0 / sqrt(ss / (double)n + eps));
}

static void rmsnorm_scalar(float *out, const float *x, const float *w, int64_t n, float eps)
{
    double part[NORM_PARTIALS] = {0.0};
    int64_t i = 0;
    for (; i + NORM_PARTIALS <= n; i += NORM_PARTIALS)
        for (int k = 0; k < NORM_PARTIALS; k++)
            part[k] += (double)x[i + k] * x[i + k];
    float scale = norm_scale(x, n, eps, part, i);
    for (i = 0; i < n; i++)
        out[i] = x[i] * scale * w[i];
}

#if defined(__x86_64__)

__attribute__((target("avx2"))) static void rmsnorm_avx2(float *out, const float *x, const float *w, int64_t n,
                                                          float eps)
{
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + NORM_PARTIALS <= n; i += NORM_PARTIALS) {
        __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), b = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
    }
    double part[NORM_PARTIALS];
    _mm256_storeu_pd(part, lo);
    _mm256_storeu_pd(part + 4, hi);
    float scale = norm_scale(x, n, eps, part, i);
    __m256 s = _mm256_set1_ps(scale);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), _mm256_loadu_ps(w + i)));
    for (; i < n; i++)
        out[i] = x[i] * scale * w[i];
}

__attribute__((target("avx512f"))) static void rmsnorm_avx512(float *out, const float *x, const float *w, int64_t n,
                                                              float eps)
{
    __m512d acc = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + NORM_PARTIALS <= n; i += NORM_PARTIALS) {
        __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        acc = _mm512_add_pd(acc, _mm512_mul_pd(a, a));
    }
    double part[NORM_PARTIALS];
    _mm512_storeu_pd(part, acc);
    float scale = norm_scale(x, n, eps, part, i);
    __m512 s = _mm512_set1_ps(scale);
    for (i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(out + i, m,
                              _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s), _mm512_maskz_loadu_ps(m, w + i)));
    }
}

#endif

void blade_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps)
{
#if defined(__x86_64__)
    blade_isa isa = blade_isa_active();
    if (isa == BLADE_ISA_AVX512) {
        rmsnorm_avx512(out, x, w, n, eps);
        return;
    }
    if (isa == BLADE_ISA_AVX2) {
        rmsnorm_avx2(out, x, w, n, eps);
        return;
    }
#endif
    rmsnorm_scalar(out, x, w, n, eps);
}

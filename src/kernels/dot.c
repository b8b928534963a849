/* Float dot products for comparing embeddings: one pair, or a query against every row of a
 * matrix keeping the best (the exact nearest-neighbour scan of the semantic cache, and the
 * distance function its HNSW graphs call). */
#include "blade/kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* Within one ISA the pair and the scan run the same operations in the same order, so the
 * similarity a scan reports is bit for bit the one a pair gives for the same vectors. */

static float dot_scalar(const float *a, const float *b, int64_t n)
{
    float part[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            part[k] += a[i + k] * b[i + k];
    for (int k = 0; i < n; i++, k++)
        part[k] += a[i] * b[i];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/* The row with the largest product, first on ties; one instance per ISA, each with its dot
 * product inlined. */
#define BEST_ROW(name, target, dot)                                                                      \
    static target int64_t name(const float *rows, int64_t n_rows, int64_t n, const float *q, float *best) \
    {                                                                                                    \
        int64_t at = -1;                                                                                 \
        for (int64_t r = 0; r < n_rows; r++) {                                                           \
            float s = dot(rows + r * n, q, n);                                                           \
            if (at < 0 || s > *best) {                                                                   \
                *best = s;                                                                               \
                at = r;                                                                                  \
            }                                                                                            \
        }                                                                                                \
        return at;                                                                                       \
    }

#if defined(__x86_64__)

#define TGT_AVX2 __attribute__((target("avx2,fma")))
#define TGT_AVX512 __attribute__((target("avx512f")))

/* Two independent accumulators hide the FMA latency; the horizontal sum is a fixed tree. */
static inline __attribute__((always_inline)) TGT_AVX2 float dot_avx2_inline(const float *a, const float *b, int64_t n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    if (i + 8 <= n) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        i += 8;
    }
    if (i < n) {
        static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)), _mm256_loadu_si256((const __m256i *)ramp));
        s1 = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), s1);
    }
    __m256 s = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline __attribute__((always_inline)) TGT_AVX512 float dot_avx512_inline(const float *a, const float *b,
                                                                                  int64_t n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

static TGT_AVX2 float dot_avx2(const float *a, const float *b, int64_t n)
{
    return dot_avx2_inline(a, b, n);
}

static TGT_AVX512 float dot_avx512(const float *a, const float *b, int64_t n)
{
    return dot_avx512_inline(a, b, n);
}

BEST_ROW(best_row_avx2, TGT_AVX2, dot_avx2_inline)
BEST_ROW(best_row_avx512, TGT_AVX512, dot_avx512_inline)

#endif

BEST_ROW(best_row_scalar, , dot_scalar)

float blade_dot_f32(const float *a, const float *b, int64_t n)
{
#if defined(__x86_64__)
    blade_isa isa = blade_isa_active();
    if (isa == BLADE_ISA_AVX512)
        return dot_avx512(a, b, n);
    if (isa == BLADE_ISA_AVX2)
        return dot_avx2(a, b, n);
#endif
    return dot_scalar(a, b, n);
}

int64_t blade_dot_best_row_f32(const float *rows, int64_t n_rows, int64_t n, const float *q, float *best)
{
#if defined(__x86_64__)
    blade_isa isa = blade_isa_active();
    if (isa == BLADE_ISA_AVX512)
        return best_row_avx512(rows, n_rows, n, q, best);
    if (isa == BLADE_ISA_AVX2)
        return best_row_avx2(rows, n_rows, n, q, best);
#endif
    return best_row_scalar(rows, n_rows, n, q, best);
}

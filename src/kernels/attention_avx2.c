/* The AVX2 path of blade_attention (attention_internal.h): the online-softmax update of
 * rows by a tile, and the AVX2 tile conversions of every KV type. */

#if defined(__x86_64__)

#include "kernels/attention_internal.h"

#include "blade/types.h"

#include <immintrin.h>
#include <math.h>

#define A2 __attribute__((target("avx2,fma,f16c")))
#define A2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

A2_INLINE float hmax256(__m256 v)
{
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    b = _mm_max_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}

A2_INLINE float hsum256(__m256 v)
{
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}

/* 8 elements of an f16 / bf16 / f32 row as floats. */
A2_INLINE __m256 load8_f16(const uint8_t *src)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
}

/* bf16 is the top half of an f32. */
A2_INLINE __m256 load8_bf16(const uint8_t *src)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}

A2_INLINE __m256 load8_f32(const uint8_t *src)
{
    return _mm256_loadu_ps((const float *)src);
}

A2_INLINE __m256 load8_q8_0(const uint8_t *src)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
}

/* E4M3 by integer arithmetic rather than through F16C, whose conversion is the slow part of
 * the f16 tiles: a normal code's exponent and mantissa bits, moved up by 20 and rebiased
 * (+120 in the exponent), are the float of the same value; a subnormal code is its mantissa
 * times 2^-9 (exact); NaN codes become the quiet NaN the scalar path makes; the sign goes
 * on last. */
A2_INLINE __m256 load8_fp8(const uint8_t *src)
{
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
    const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(x, 24), _mm256_set1_epi32((int)0x80000000u));
    __m256 v = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    v = _mm256_blendv_ps(v, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
    v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                         _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f))));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
}

/* Recursive 8x8 transpose: for rows i and i + w, swap the off-diagonal w x w sub-blocks
 * ([[A, B], [C, D]] -> [[A, C], [B, D]]) for w = 4, 2, 1. */
A2_INLINE void transpose8(__m256 r[8])
{
    for (int i = 0; i < 4; i++) {
        const __m256 a = r[i], b = r[i + 4];
        r[i] = _mm256_permute2f128_ps(a, b, 0x20);
        r[i + 4] = _mm256_permute2f128_ps(a, b, 0x31);
    }
    for (int i = 0; i < 8; i++) {
        if (i & 2)
            continue;
        const __m256 a = r[i], b = r[i + 2];
        r[i] = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 2] = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 8; i += 2) {
        const __m256 a = r[i], b = r[i + 1];
        r[i] = _mm256_blend_ps(a, _mm256_moveldup_ps(b), 0xaa);
        r[i + 1] = _mm256_blend_ps(_mm256_movehdup_ps(a), b, 0xaa);
    }
}

/* The conversions of a type whose elements are es bytes and whose 8-element loads are
 * load8: inlined into one function per type, so each has its load built in. With scales,
 * each slot's elements are multiplied by its scale. */
A2_INLINE void load_kt_avx2(__m256 (*load8)(const uint8_t *), size_t es, const uint8_t *src, const uint16_t *scales,
                            float *kt, int32_t block_size, int32_t head_dim, int32_t bp)
{
    for (int32_t j0 = 0; j0 < block_size; j0 += 8) {
        const __m256 sv = scales ? load8_bf16((const uint8_t *)(scales + j0))
                                 : _mm256_setzero_ps();
        for (int32_t d0 = 0; d0 < head_dim; d0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = load8(src + ((size_t)(j0 + i) * (size_t)head_dim + (size_t)d0) * es);
            transpose8(r);
            for (int i = 0; i < 8; i++)
                _mm256_storeu_ps(kt + (size_t)(d0 + i) * (size_t)bp + (size_t)j0, scales ? _mm256_mul_ps(r[i], sv) : r[i]);
        }
    }
}

A2_INLINE void load_v_avx2(__m256 (*load8)(const uint8_t *), size_t es, const uint8_t *src, const uint16_t *scales,
                           float *dst, int32_t n_slots, int32_t head_dim)
{
    if (!scales) {
        for (size_t i = 0; i < (size_t)n_slots * (size_t)head_dim; i += 8)
            _mm256_storeu_ps(dst + i, load8(src + es * i));
        return;
    }
    for (int32_t j = 0; j < n_slots; j++) {
        const __m256 sj = _mm256_set1_ps(blade_bf16_to_fp32(scales[j]));
        for (int32_t d0 = 0; d0 < head_dim; d0 += 8) {
            size_t i = (size_t)j * (size_t)head_dim + (size_t)d0;
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(load8(src + es * i), sj));
        }
    }
}

/* The conversion functions of a type: scaled types pass the block's scales on, unscaled
 * ones a NULL the compiler sees, which removes the scaling. */
#define AVX2_LOAD_KT(type, es, scaled)                                                                 \
    A2 static void load_kt_##type(const uint8_t *src, const uint16_t *scales, float *kt, int32_t block_size,    \
                                  int32_t head_dim, int32_t bp)                                                  \
    {                                                                                                            \
        load_kt_avx2(load8_##type, es, src, scaled ? scales : NULL, kt, block_size, head_dim, bp);      \
    }
#define AVX2_TILE(type, es, scaled)                                                                    \
    AVX2_LOAD_KT(type, es, scaled)                                                                     \
    A2 static void load_v_##type(const uint8_t *src, const uint16_t *scales, float *dst, int32_t n_slots,       \
                                 int32_t head_dim)                                                               \
    {                                                                                                            \
        load_v_avx2(load8_##type, es, src, scaled ? scales : NULL, dst, n_slots, head_dim);             \
    }                                                                                                            \
    const attn_tile_conv blade_attn_tile_##type##_avx2 = {load_kt_##type, load_v_##type};

AVX2_TILE(f16, 2, false)
AVX2_TILE(bf16, 2, false)
AVX2_TILE(q8_0, 1, true)
AVX2_TILE(fp8, 1, true)
AVX2_LOAD_KT(f32, 4, false)
const attn_tile_conv blade_attn_tile_f32_avx2 = {load_kt_f32, NULL};

/* Rows are processed R at a time (R = 1 or PAIR) when they see the same keys, sharing
 * every key and value load between them; as in attention_avx512.c, each row's arithmetic
 * is the same for either R. Sixteen registers leave room for two rows. */
#define PAIR 2

/* Scores of R rows against the tile's first nv keys into s + x * bp (masked lanes -inf),
 * and their maxima. Four chains over d mod 4 per key, as in attention_avx512.c. */
A2_INLINE void scores256(const attn_tile *t, const attn_row *r, const int R, int32_t nv, float *s, float *m_tile)
{
    const size_t bp = (size_t)t->bp;
    __m256 vmax[PAIR];
    for (int x = 0; x < R; x++)
        vmax[x] = _mm256_set1_ps(-INFINITY);
    for (int32_t j0 = 0; j0 < nv; j0 += 8) {
        const float *k = t->kt + j0;
        __m256 c[PAIR][4];
        for (int x = 0; x < R; x++)
            for (int u = 0; u < 4; u++)
                c[x][u] = _mm256_setzero_ps();
        for (int32_t d = 0; d < t->head_dim; d += 4)
            for (int u = 0; u < 4; u++) {
                const __m256 kd = _mm256_loadu_ps(k + (size_t)(d + u) * bp);
                for (int x = 0; x < R; x++)
                    c[x][u] = _mm256_fmadd_ps(_mm256_broadcast_ss(r[x].q + d + u), kd, c[x][u]);
            }
        const int32_t valid = nv - j0;
        const __m256 keep = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        for (int x = 0; x < R; x++) {
            __m256 v = _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(c[x][0], c[x][1]), _mm256_add_ps(c[x][2], c[x][3])),
                                     _mm256_set1_ps(t->scale));
            v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, keep);
            _mm256_storeu_ps(s + (size_t)x * bp + (size_t)j0, v);
            vmax[x] = _mm256_max_ps(vmax[x], v);
        }
    }
    for (int x = 0; x < R; x++)
        m_tile[x] = hmax256(vmax[x]);
}

/* s <- exp(s - m_new) for the first nv lanes; returns their sum. */
A2_INLINE float probs256(float *s, int32_t nv, float m_new)
{
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 vsum = _mm256_setzero_ps();
    for (int32_t j0 = 0; j0 < nv; j0 += 8) {
        const __m256 e = exp_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j0), mv));
        _mm256_storeu_ps(s + j0, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    return hsum256(vsum);
}

/* Columns [d0, d0 + 8 * W) of R rows: o <- o * alpha + sum_j p[j] v[j] with a tile-local
 * sum, as in attention_avx512.c. */
A2_INLINE void accumulate256(const attn_tile *t, const attn_row *r, const int R, const int W, int32_t nv,
                             const float *p, const float *alpha, int32_t d0)
{
    const int32_t hd = t->head_dim;
    const size_t bp = (size_t)t->bp;
    __m256 a[PAIR][4];
    for (int x = 0; x < R; x++)
        for (int u = 0; u < W; u++)
            a[x][u] = _mm256_setzero_ps();
    for (int32_t j = 0; j < nv; j++) {
        const float *v = t->v + (size_t)j * (size_t)hd + (size_t)d0;
        for (int u = 0; u < W; u++) {
            const __m256 vu = _mm256_loadu_ps(v + 8 * u);
            for (int x = 0; x < R; x++)
                a[x][u] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + (size_t)x * bp + (size_t)j), vu, a[x][u]);
        }
    }
    for (int x = 0; x < R; x++)
        for (int u = 0; u < W; u++) {
            float *od = r[x].o + d0 + 8 * u;
            __m256 y = a[x][u];
            if (!t->first)
                y = _mm256_fmadd_ps(_mm256_loadu_ps(od), _mm256_set1_ps(alpha[x]), y);
            _mm256_storeu_ps(od, y);
        }
}

/* All columns, 32 at a time and then 8 at a time. */
A2_INLINE void accumulate256_rows(const attn_tile *t, const attn_row *r, const int R, const float *p,
                                  const float *alpha)
{
    const int32_t hd = t->head_dim, nv = r[0].n_valid;
    int32_t d0 = 0;
    for (; d0 + 32 <= hd; d0 += 32)
        accumulate256(t, r, R, 4, nv, p, alpha, d0);
    for (; d0 < hd; d0 += 8)
        accumulate256(t, r, R, 1, nv, p, alpha, d0);
}

/* PAIR when the next two rows see the same keys, else 1. */
static int group_size(const attn_row *r, int n)
{
    return n >= PAIR && r[1].n_valid == r[0].n_valid ? PAIR : 1;
}

/* Phase by phase over the batch, as in attention_avx512.c. */
A2 static void rows_avx2(const attn_tile *t, const attn_row *r, int n)
{
    const size_t bp = (size_t)t->bp;
    float m_new[ATTN_ROWS], alpha[ATTN_ROWS];
    for (int i = 0; i < n;) {
        const int g = group_size(r + i, n - i);
        if (g == PAIR)
            scores256(t, r + i, PAIR, r[i].n_valid, t->p + (size_t)i * bp, m_new + i);
        else
            scores256(t, r + i, 1, r[i].n_valid, t->p + (size_t)i * bp, m_new + i);
        i += g;
    }
    /* All rows' rescale factors in one vector exp; each lane's result is what the row
     * would get alone. */
    _Static_assert(ATTN_ROWS == 8, "one vector of rescale factors");
    float diff[8] = {0};
    for (int i = 0; i < n; i++) {
        const float m_tile = m_new[i];
        m_new[i] = t->first || m_tile > *r[i].m ? m_tile : *r[i].m;
        diff[i] = t->first ? 0.0f : *r[i].m - m_new[i];
    }
    _mm256_storeu_ps(alpha, exp_neg_avx2(_mm256_loadu_ps(diff)));
    for (int i = 0; i < n; i++) {
        const float sum = probs256(t->p + (size_t)i * bp, r[i].n_valid, m_new[i]);
        *r[i].l = t->first ? sum : *r[i].l * alpha[i] + sum;
        *r[i].m = m_new[i];
    }
    for (int i = 0; i < n;) {
        const int g = group_size(r + i, n - i);
        if (g == PAIR)
            accumulate256_rows(t, r + i, PAIR, t->p + (size_t)i * bp, alpha + i);
        else
            accumulate256_rows(t, r + i, 1, t->p + (size_t)i * bp, alpha + i);
        i += g;
    }
}

const attn_isa blade_attn_avx2 = {8, rows_avx2};

#endif

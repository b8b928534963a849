/* The AVX-512 path of blade_attention (attention_internal.h): the online-softmax update of
 * rows by a tile, and the AVX-512 tile conversions of every KV type. */

#if defined(__x86_64__)

#include "kernels/attention_internal.h"

#include "blade/types.h"

#include <immintrin.h>
#include <math.h>

#define A512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define A512_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,fma,f16c")))

A512_INLINE __m256 high256(__m512 v)
{
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

A512_INLINE float hmax512(__m512 v)
{
    __m256 a = _mm256_max_ps(_mm512_castps512_ps256(v), high256(v));
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    b = _mm_max_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}

A512_INLINE float hsum512(__m512 v)
{
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), high256(v));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}

/* 16 elements of an f16 / bf16 / f32 row as floats. */
A512_INLINE __m512 load16_f16(const uint8_t *src)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
}

/* bf16 is the top half of an f32. */
A512_INLINE __m512 load16_bf16(const uint8_t *src)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

A512_INLINE __m512 load16_f32(const uint8_t *src)
{
    return _mm512_loadu_ps((const float *)src);
}

A512_INLINE __m512 load16_q8_0(const uint8_t *src)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
}

/* E4M3 by integer arithmetic, as in attention_avx2.c. */
A512_INLINE __m512 load16_fp8(const uint8_t *src)
{
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_and_si512(_mm512_slli_epi32(x, 24), _mm512_set1_epi32((int)0x80000000u));
    __m512 v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    v = _mm512_mask_mul_ps(v, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), _mm512_cvtepi32_ps(mag),
                           _mm512_set1_ps(0x1p-9f));
    v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)),
                           _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

/* 16x16 transpose as four steps of a recursion: for w = 1, 2, 4, 8, rows i and i + w
 * (i & w == 0) swap their off-diagonal w x w sub-blocks, [[A, B], [C, D]] -> [[A, C],
 * [B, D]]; the steps commute, and once all four are done every element has moved from
 * (i, j) to (j, i). Each step uses the cheapest shuffle that does it. */
A512_INLINE void transpose16(__m512 r[16])
{
    for (int i = 0; i < 16; i += 2) {
        const __m512 a = r[i], b = r[i + 1];
        r[i] = _mm512_mask_moveldup_ps(a, 0xaaaa, b);
        r[i + 1] = _mm512_mask_movehdup_ps(b, 0x5555, a);
    }
    for (int i = 0; i < 16; i++) {
        if (i & 2)
            continue;
        const __m512 a = r[i], b = r[i + 2];
        r[i] = _mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 2] = _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 16; i++) {
        if (i & 4)
            continue;
        const __m512 a = r[i], b = r[i + 4];
        r[i] = _mm512_mask_shuffle_f32x4(a, 0xf0f0, b, b, _MM_SHUFFLE(2, 0, 0, 0));
        r[i + 4] = _mm512_mask_shuffle_f32x4(b, 0x0f0f, a, a, _MM_SHUFFLE(3, 3, 1, 1));
    }
    for (int i = 0; i < 8; i++) {
        const __m512 a = r[i], b = r[i + 8];
        r[i] = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 8] = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2));
    }
}

/* The conversions of a type whose elements are es bytes and whose 16-element loads are
 * load16, as in attention_avx2.c. */
A512_INLINE void load_kt_avx512(__m512 (*load16)(const uint8_t *), size_t es, const uint8_t *src,
                                const uint16_t *scales, float *kt, int32_t block_size,
                                int32_t head_dim, int32_t bp)
{
    for (int32_t j0 = 0; j0 < block_size; j0 += 16) {
        const __m512 sv = scales ? load16_bf16((const uint8_t *)(scales + j0)) : _mm512_setzero_ps();
        for (int32_t d0 = 0; d0 < head_dim; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = load16(src + ((size_t)(j0 + i) * (size_t)head_dim + (size_t)d0) * es);
            transpose16(r);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_ps(kt + (size_t)(d0 + i) * (size_t)bp + (size_t)j0,
                                 scales ? _mm512_mul_ps(r[i], sv) : r[i]);
        }
    }
}

A512_INLINE void load_v_avx512(__m512 (*load16)(const uint8_t *), size_t es, const uint8_t *src,
                               const uint16_t *scales, float *dst, int32_t n_slots, int32_t head_dim)
{
    if (!scales) {
        for (size_t i = 0; i < (size_t)n_slots * (size_t)head_dim; i += 16)
            _mm512_storeu_ps(dst + i, load16(src + es * i));
        return;
    }
    for (int32_t j = 0; j < n_slots; j++) {
        const __m512 sj = _mm512_set1_ps(blade_bf16_to_fp32(scales[j]));
        for (int32_t d0 = 0; d0 < head_dim; d0 += 16) {
            size_t i = (size_t)j * (size_t)head_dim + (size_t)d0;
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(load16(src + es * i), sj));
        }
    }
}

#define AVX512_LOAD_KT(type, es, scaled)                                                               \
    A512 static void load_kt_##type(const uint8_t *src, const uint16_t *scales, float *kt, int32_t block_size,  \
                                    int32_t head_dim, int32_t bp)                                                \
    {                                                                                                            \
        load_kt_avx512(load16_##type, es, src, scaled ? scales : NULL, kt, block_size, head_dim, bp);   \
    }
#define AVX512_TILE(type, es, scaled)                                                                  \
    AVX512_LOAD_KT(type, es, scaled)                                                                   \
    A512 static void load_v_##type(const uint8_t *src, const uint16_t *scales, float *dst, int32_t n_slots,     \
                                   int32_t head_dim)                                                             \
    {                                                                                                            \
        load_v_avx512(load16_##type, es, src, scaled ? scales : NULL, dst, n_slots, head_dim);          \
    }                                                                                                            \
    const attn_tile_conv blade_attn_tile_##type##_avx512 = {load_kt_##type, load_v_##type};

AVX512_TILE(f16, 2, false)
AVX512_TILE(bf16, 2, false)
AVX512_TILE(q8_0, 1, true)
AVX512_TILE(fp8, 1, true)
AVX512_LOAD_KT(f32, 4, false)
const attn_tile_conv blade_attn_tile_f32_avx512 = {load_kt_f32, NULL};

A512_INLINE __mmask16 first_lanes(int32_t n)
{
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

/* Rows are processed R at a time (R = 1 or QUAD) when they see the same keys, sharing
 * every key and value load between them. The arithmetic of each row is the same for
 * either R, so how rows happen to be grouped never shows in the results. */
#define QUAD 4

/* Scores of R rows against the tile's first nv keys into s + x * bp (masked lanes -inf),
 * and their maxima. Each key's dot product is four interleaved chains over d mod 4, so
 * that FMA latency is hidden within a row rather than by mixing rows. */
A512_INLINE void scores512(const attn_tile *t, const attn_row *r, const int R, int32_t nv, float *s, float *m_tile)
{
    const size_t bp = (size_t)t->bp;
    __m512 vmax[QUAD];
    for (int x = 0; x < R; x++)
        vmax[x] = _mm512_set1_ps(-INFINITY);
    for (int32_t j0 = 0; j0 < nv; j0 += 16) {
        const float *k = t->kt + j0;
        __m512 c[QUAD][4];
        for (int x = 0; x < R; x++)
            for (int u = 0; u < 4; u++)
                c[x][u] = _mm512_setzero_ps();
        for (int32_t d = 0; d < t->head_dim; d += 4)
            for (int u = 0; u < 4; u++) {
                const __m512 kd = _mm512_loadu_ps(k + (size_t)(d + u) * bp);
                for (int x = 0; x < R; x++)
                    c[x][u] = _mm512_fmadd_ps(_mm512_set1_ps(r[x].q[d + u]), kd, c[x][u]);
            }
        const __mmask16 valid = first_lanes(nv - j0);
        for (int x = 0; x < R; x++) {
            __m512 v = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(c[x][0], c[x][1]), _mm512_add_ps(c[x][2], c[x][3])),
                                     _mm512_set1_ps(t->scale));
            v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, v);
            _mm512_storeu_ps(s + (size_t)x * bp + (size_t)j0, v);
            vmax[x] = _mm512_max_ps(vmax[x], v);
        }
    }
    for (int x = 0; x < R; x++)
        m_tile[x] = hmax512(vmax[x]);
}

/* s <- exp(s - m_new) for the first nv lanes; returns their sum. */
A512_INLINE float probs512(float *s, int32_t nv, float m_new)
{
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int32_t j0 = 0; j0 < nv; j0 += 16) {
        const __m512 e = exp_neg_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + j0), mv));
        _mm512_storeu_ps(s + j0, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    return hsum512(vsum);
}

/* Columns [d0, d0 + 16 * W) of R rows: o <- o * alpha + sum_j p[j] v[j] (o <- the sum on
 * the first tile), p of row x at p + x * bp. The tile's sum starts from zero and is folded
 * in at the end: a short sum per tile loses less than adding each term into a large
 * running total. */
A512_INLINE void accumulate512(const attn_tile *t, const attn_row *r, const int R, const int W, int32_t nv,
                               const float *p, const float *alpha, int32_t d0)
{
    const int32_t hd = t->head_dim;
    const size_t bp = (size_t)t->bp;
    __m512 a[QUAD][4];
    for (int x = 0; x < R; x++)
        for (int u = 0; u < W; u++)
            a[x][u] = _mm512_setzero_ps();
    for (int32_t j = 0; j < nv; j++) {
        const float *v = t->v + (size_t)j * (size_t)hd + (size_t)d0;
        for (int u = 0; u < W; u++) {
            const __m512 vu = _mm512_loadu_ps(v + 16 * u);
            for (int x = 0; x < R; x++)
                a[x][u] = _mm512_fmadd_ps(_mm512_set1_ps(p[(size_t)x * bp + (size_t)j]), vu, a[x][u]);
        }
    }
    for (int x = 0; x < R; x++)
        for (int u = 0; u < W; u++) {
            float *od = r[x].o + d0 + 16 * u;
            __m512 y = a[x][u];
            if (!t->first)
                y = _mm512_fmadd_ps(_mm512_loadu_ps(od), _mm512_set1_ps(alpha[x]), y);
            _mm512_storeu_ps(od, y);
        }
}

/* All columns, 64 at a time and then 16 at a time. */
A512_INLINE void accumulate512_rows(const attn_tile *t, const attn_row *r, const int R, const float *p,
                                    const float *alpha)
{
    const int32_t hd = t->head_dim, nv = r[0].n_valid;
    int32_t d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64)
        accumulate512(t, r, R, 4, nv, p, alpha, d0);
    for (; d0 < hd; d0 += 16)
        accumulate512(t, r, R, 1, nv, p, alpha, d0);
}

/* How many rows from r (at most n) can go together: QUAD when they all see the same
 * keys, else 1. */
static int group_size(const attn_row *r, int n)
{
    if (n < QUAD)
        return 1;
    for (int x = 1; x < QUAD; x++)
        if (r[x].n_valid != r[0].n_valid)
            return 1;
    return QUAD;
}

/* Phase by phase over the batch, so that the rows' independent chains (dot products,
 * reductions, exp) overlap in the core instead of running back to back. */
A512 static void rows_avx512(const attn_tile *t, const attn_row *r, int n)
{
    const size_t bp = (size_t)t->bp;
    float m_new[ATTN_ROWS], alpha[16];
    for (int i = 0; i < n;) {
        const int g = group_size(r + i, n - i);
        if (g == QUAD)
            scores512(t, r + i, QUAD, r[i].n_valid, t->p + (size_t)i * bp, m_new + i);
        else
            scores512(t, r + i, 1, r[i].n_valid, t->p + (size_t)i * bp, m_new + i);
        i += g;
    }
    /* All rows' rescale factors in one vector exp; each lane's result is what the row
     * would get alone. */
    float diff[16] = {0};
    for (int i = 0; i < n; i++) {
        const float m_tile = m_new[i];
        m_new[i] = t->first || m_tile > *r[i].m ? m_tile : *r[i].m;
        diff[i] = t->first ? 0.0f : *r[i].m - m_new[i];
    }
    _Static_assert(ATTN_ROWS <= 16, "one vector of rescale factors");
    _mm512_storeu_ps(alpha, exp_neg_avx512(_mm512_loadu_ps(diff)));
    for (int i = 0; i < n; i++) {
        const float sum = probs512(t->p + (size_t)i * bp, r[i].n_valid, m_new[i]);
        *r[i].l = t->first ? sum : *r[i].l * alpha[i] + sum;
        *r[i].m = m_new[i];
    }
    for (int i = 0; i < n;) {
        const int g = group_size(r + i, n - i);
        if (g == QUAD)
            accumulate512_rows(t, r + i, QUAD, t->p + (size_t)i * bp, alpha + i);
        else
            accumulate512_rows(t, r + i, 1, t->p + (size_t)i * bp, alpha + i);
        i += g;
    }
}

const attn_isa blade_attn_avx512 = {16, rows_avx512};

#endif

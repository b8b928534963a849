#include "kernels/kernels_internal.h"

#if defined(__x86_64__)

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* AVX2 + FMA + F16C kernels, also used on AVX-512 machines for the types whose AVX-512
 * kernel needs an extension the CPU lacks (VNNI, BF16). The structure mirrors the AVX-512
 * file: a fixed per-(row, token) sequence of 8-lane float updates, one per decode unit,
 * interleaved across a tile; integer parts are exact. Only sixteen vector registers, so
 * tiles are smaller. */

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* The one-token path takes one row at a time (a single sequential weight stream, as the
 * hardware prefetchers follow best); tiles are for many tokens. */
#define TILE_R 2
#define TILE_T 4
#define TOKEN_CHUNK 64

TGT INLINE float hsum(__m256 v)
{
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

/* out holds rows x TILE_T results (row-major), as every tile below writes them. */
static void store_tile(float *Y, int64_t ldy, int64_t r, int64_t nr, int64_t t, int64_t nt, const float *out, int ld)
{
    for (int64_t j = 0; j < nt; j++)
        for (int64_t i = 0; i < nr; i++)
            Y[(t + j) * ldy + r + i] = out[i * ld + j];
}

/* Rows of a tile past r1 repeat the last row. */
static void tile_rows(const void *W, size_t w_stride, int64_t r, int64_t r1, int R, const uint8_t **rows)
{
    for (int i = 0; i < R; i++)
        rows[i] = (const uint8_t *)W + (r + i < r1 ? r + i : r1 - 1) * (int64_t)w_stride;
}

/* Scratch for decoded weights or shared token data; never zero-sized (n may be 0). */
static void *pack_alloc(size_t bytes)
{
    void *p = aligned_alloc(32, (bytes / 32 + 1) * 32);
    if (!p)
        abort();
    return p;
}

/* ---------------------------------------------------------------- Q8_0 and Q4_0 ----
 * Unit: one 32-block. vpmaddubsw needs one unsigned operand, so the signed weights give
 * their magnitude and their sign moves onto the activation (vpsignb): |w| <= 128 and
 * |x| <= 127 keep each int16 pair sum below 2^15. */

typedef struct q32_dec {
    __m256i aw, w;
    __m256 d;
} q32_dec;

TGT INLINE void q32_decode(bool q4, const uint8_t *row, int64_t b, q32_dec *o)
{
    uint16_t h;
    __m256i w;
    if (q4) {
        const uint8_t *blk = row + b * (int64_t)sizeof(block_q4_0);
        memcpy(&h, blk, 2);
        __m128i n = _mm_loadu_si128((const __m128i *)(blk + 2));
        __m128i lo = _mm_and_si128(n, _mm_set1_epi8(0x0F));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(n, 4), _mm_set1_epi8(0x0F));
        w = _mm256_sub_epi8(_mm256_setr_m128i(lo, hi), _mm256_set1_epi8(8));
    } else {
        const uint8_t *blk = row + b * (int64_t)sizeof(block_q8_0);
        memcpy(&h, blk, 2);
        w = _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
    o->w = w;
    o->aw = _mm256_abs_epi8(w);
    o->d = _mm256_set1_ps(_cvtsh_ss(h));
}

TGT INLINE __m256 q32_step(const q32_dec *w, __m256i x, __m256 dx, __m256 acc)
{
    __m256i p = _mm256_maddubs_epi16(w->aw, _mm256_sign_epi8(x, w->w));
    __m256i i = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(w->d, dx), acc);
}

TGT INLINE float q32_gemv(bool q4, const uint8_t *row, act_q8_view a, int64_t nb)
{
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        q32_dec w;
        q32_decode(q4, row, b, &w);
        acc = q32_step(&w, _mm256_loadu_si256((const __m256i *)(a.q + QK8_0 * b)), _mm256_broadcast_ss(a.d + b), acc);
    }
    return hsum(acc);
}

TGT INLINE void q32_tile(int T, const q32_dec *pk, int64_t nb, const act_q8_view *xa, float *out)
{
    __m256 acc[TILE_R][TILE_T];
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int t = 0; t < T; t++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(xa[t].q + QK8_0 * b));
            __m256 dx = _mm256_broadcast_ss(xa[t].d + b);
            for (int r = 0; r < TILE_R; r++)
                acc[r][t] = q32_step(&pk[r * nb + b], x, dx, acc[r][t]);
        }
    }
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < T; t++)
            out[r * TILE_T + t] = hsum(acc[r][t]);
}

TGT INLINE void q32_matmul(bool q4, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n,
                           float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    int64_t nb = n / QK8_0;
    const uint8_t *rows[TILE_R];
    float out[TILE_R * TILE_T];
    if (n_tok == 1) {
        act_q8_view a = act_q8_at(X, n);
        const uint8_t *end = (const uint8_t *)W + r1 * (int64_t)w_stride;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = (const uint8_t *)W + r * (int64_t)w_stride;
            touch_stream(row, w_stride, end);
            Y[r] = q32_gemv(q4, row, a, nb);
        }
        return;
    }
    q32_dec *pk = pack_alloc(sizeof(q32_dec) * TILE_R * (size_t)nb);
    act_q8_view xa[TILE_T];
    for (int64_t c = 0; c < n_tok; c += TOKEN_CHUNK) {
        int64_t c1 = c + TOKEN_CHUNK < n_tok ? c + TOKEN_CHUNK : n_tok;
        for (int64_t r = r0; r < r1; r += TILE_R) {
            tile_rows(W, w_stride, r, r1, TILE_R, rows);
            for (int i = 0; i < TILE_R; i++)
                for (int64_t b = 0; b < nb; b++)
                    q32_decode(q4, rows[i], b, &pk[i * nb + b]);
            int64_t nr = r1 - r < TILE_R ? r1 - r : TILE_R;
            for (int64_t t = c; t < c1; t += TILE_T) {
                int64_t nt = c1 - t < TILE_T ? c1 - t : TILE_T;
                for (int j = 0; j < nt; j++)
                    xa[j] = act_q8_at((const uint8_t *)X + (t + j) * (int64_t)x_stride, n);
#define Q32_TILE(T) q32_tile(T, pk, nb, xa, out)
                WITH_CONST_T(nt, TILE_T, Q32_TILE)
#undef Q32_TILE
                store_tile(Y, ldy, r, nr, t, nt, out, TILE_T);
            }
        }
    }
    free(pk);
}

BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q4_0, q32_matmul, true)
BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q8_0, q32_matmul, false)

/* ------------------------------------------------------------------- R16 ----
 * Q4_0/Q8_0 repacked at load (kernels_internal.h), eight rows per vector: each group is
 * two halves. The integer block sums are the AVX-512 kernel's (exact, however formed):
 * Q4_0's eight vpmaddubsw results add up in int16 (8 x 2 x 15 x 127 < 2^15) before one
 * widening vpmaddwd; Q8_0's unsigned q+128 goes back to signed and uses the sign trick
 * above, widening per 4-group. The float step per block is the same convert, scale
 * product and FMA, so results match the other ISAs bit for bit. */

#define R16_TILE_T 4

typedef struct r16_w {
    __m256i q[8];
    __m256 d;
} r16_w;

/* Half h (rows 8h..8h+7) of one block. Q8_0 quants come back signed. */
TGT INLINE void r16_load(bool q4, const uint8_t *blk, int h, r16_w *w)
{
    w->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
    const uint8_t *q = blk + R16_SCALES + 32 * h;
    if (q4) {
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int c = 0; c < R16_Q4_CHUNKS; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(q + 64 * c));
            w->q[c] = _mm256_and_si256(v, low);
            w->q[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
    } else {
        for (int j = 0; j < R16_Q8_CHUNKS; j++)
            w->q[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + 64 * j)),
                                       _mm256_set1_epi8((char)0x80));
    }
}

TGT INLINE __m256i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

TGT INLINE __m256 r16_step(bool q4, const r16_w *w, const int8_t *xq, float xd, int32_t start, __m256 acc)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i isum;
    if (q4) {
        __m256i s16 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w->q[j], bcast4(xq + 4 * j)));
        isum = _mm256_add_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(start));
    } else {
        isum = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w->q[j]), _mm256_sign_epi8(bcast4(xq + 4 * j), w->q[j]));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
        }
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(w->d, _mm256_set1_ps(xd)), acc);
}

/* One token against both halves of one block, chunk by chunk: each chunk's activation
 * broadcast serves all 16 rows and the weights are consumed in order. Half by half, the
 * one-token product from L2 ran at 0.94x (Q4_0) and 0.96x (Q8_0) of this (AMD Zen 1, one
 * thread, median of 10 alternating runs). */
TGT INLINE void r16_lone(bool q4, const uint8_t *blk, const int8_t *xq, float xd, int32_t start, __m256 acc[2][R16_TILE_T])
{
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    __m256i isum[2];
    if (q4) {
        __m256i s16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int c = 0; c < R16_Q4_CHUNKS; c++) {
            __m256i xl = bcast4(xq + 4 * c), xh = bcast4(xq + 16 + 4 * c);
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(blk + R16_SCALES + 64 * c + 32 * h));
                s16[h] = _mm256_add_epi16(s16[h], _mm256_maddubs_epi16(_mm256_and_si256(v, low), xl));
                s16[h] = _mm256_add_epi16(s16[h], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), xh));
            }
        }
        for (int h = 0; h < 2; h++)
            isum[h] = _mm256_add_epi32(_mm256_madd_epi16(s16[h], ones), _mm256_set1_epi32(start));
    } else {
        isum[0] = isum[1] = _mm256_setzero_si256();
        for (int j = 0; j < R16_Q8_CHUNKS; j++) {
            __m256i x = bcast4(xq + 4 * j);
            for (int h = 0; h < 2; h++) {
                __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + R16_SCALES + 64 * j + 32 * h)),
                                             _mm256_set1_epi8((char)0x80));
                __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
                isum[h] = _mm256_add_epi32(isum[h], _mm256_madd_epi16(p, ones));
            }
        }
    }
    __m256 dx = _mm256_set1_ps(xd);
    for (int h = 0; h < 2; h++) {
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        acc[h][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h]), _mm256_mul_ps(d, dx), acc[h][0]);
    }
}

/* Half h0 of one group against T tokens, or with NH = 2 a lone token against both halves;
 * end: the weight stream's end when this pass pulls the group from memory (it hints the
 * stream ahead), NULL when the group is in cache; stream: end is set, a constant at every
 * call (R16_TILE), so the hot loop carries no test of it. The side's start is the Q4_0
 * offset term (Q8_0 takes none here, its products are signed). */
TGT INLINE void r16_tile(bool q4, int T, int NH, const uint8_t *group, int h0, int64_t nb, const r16_x *xa, float *Y,
                         int64_t ldy, const uint8_t *end, bool stream)
{
    size_t bb = r16_block_bytes(q4 ? BLADE_KTYPE_Q4_0_R16 : BLADE_KTYPE_Q8_0_R16);
    __m256 acc[2][R16_TILE_T];
    for (int k = 0; k < NH; k++)
        for (int t = 0; t < T; t++)
            acc[k][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (stream) {
            prefetch_stream(group + b * bb, bb);
            touch_stream(group + b * bb, bb, end);
        }
        if (NH == 2) {
            r16_lone(q4, group + b * bb, xa[0].q + QK8_0 * b, xa[0].d[b], q4 ? xa[0].side[b] : 0, acc);
        } else {
            r16_w w;
            r16_load(q4, group + b * bb, h0, &w);
            for (int t = 0; t < T; t++)
                acc[0][t] = r16_step(q4, &w, xa[t].q + QK8_0 * b, xa[t].d[b], q4 ? xa[t].side[b] : 0, acc[0][t]);
        }
    }
    for (int k = 0; k < NH; k++)
        for (int t = 0; t < T; t++)
            _mm256_storeu_ps(Y + t * ldy + 8 * (h0 + k), acc[k][t]);
}

/* Q4_K R16: the AVX-512 kernel's sums, eight rows per vector. A sub-block's eight
 * vpmaddubsw results add up in int16 (8 x 2 x 15 x 127 < 2^15) before one widening
 * vpmaddwd, which also weights it by the scale (k16_scales); the min pairs (vpmaddwd) are
 * exact too. */

/* r16_k_unpack, 32 slots at a time: left to the scalar loop, the unpacking took most of
 * Q4_K_M decode on this path (20 tokens/s against 60 with this, tinyllama, 2 threads). */
TGT INLINE void k16_unpack(const uint8_t *blk, uint8_t sc[128], uint8_t m[128])
{
    const __m256i lo4 = _mm256_set1_epi8(0x0F), lo2 = _mm256_set1_epi8(0x03);
    for (int k = 0; k < 64; k += 32) {
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + R16_K_LOW + k));
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + R16_K_LOW + 64 + k));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + R16_K_HIGH + k));
        /* Top bit pairs are at most 3, so the 16-bit shift left by 4 keeps them in their byte. */
        _mm256_storeu_si256((__m256i *)(sc + k),
                            _mm256_or_si256(_mm256_and_si256(l0, lo4), _mm256_slli_epi16(_mm256_and_si256(hb, lo2), 4)));
        _mm256_storeu_si256((__m256i *)(sc + 64 + k),
                            _mm256_or_si256(_mm256_and_si256(l1, lo4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), lo2), 4)));
        _mm256_storeu_si256((__m256i *)(m + k),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), lo2), 4)));
        _mm256_storeu_si256((__m256i *)(m + 64 + k),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), lo2), 4)));
    }
}

/* The end of half h of one super-block for T tokens: the mins against the activation
 * pair sums, then the two FMAs per token into acc. */
TGT INLINE void k16_finish(int T, const uint8_t *blk, const uint8_t m[128], int h, int64_t b, const r16_x *xa,
                           const __m256i *isum, __m256 *acc)
{
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + R16_K_D + 16 * h)));
    __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + R16_K_DMIN + 16 * h)));
    for (int t = 0; t < T; t++) {
        __m256i msum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256i mp = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(m + 32 * i + 16 * h)));
            msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mp, _mm256_set1_epi32(xa[t].side[4 * b + i])));
        }
        __m256 dx = _mm256_set1_ps(xa[t].d[b]);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, dx), acc[t]);
        acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), acc[t]);
    }
}

/* Sub-block j's scales for half h, each twice as the two int16 of an int32 lane: vpmaddwd
 * against them sums a lane's pair of int16 sums and weights it in one exact step. It took
 * vpmaddwd by ones then vpmulld before, which on AMD Zen 1 costs twice a vpmaddwd: tiles of
 * 4 and 64 tokens measured 1.06x from L2 (one thread, medians of 4 alternating runs). */
TGT INLINE __m256i k16_scales(const uint8_t sc[128], int j, int h)
{
    int64_t eight;
    memcpy(&eight, sc + 16 * j + 8 * h, 8);
    const __m256i twice = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1, 4, -1, 4, -1, 5, -1,
                                           5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
    return _mm256_shuffle_epi8(_mm256_set1_epi64x(eight), twice);
}

/* Half h of one super-block against T tokens, into acc (one vector per token). */
TGT INLINE void k16_half(int T, const uint8_t *blk, const uint8_t sc[128], const uint8_t m[128], int h, int64_t b,
                         const r16_x *xa, __m256 *acc)
{
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256i isum[R16_TILE_T];
    for (int t = 0; t < T; t++)
        isum[t] = _mm256_setzero_si256();
    /* Unrolled, so which nibble each sub-block takes is a constant rather than a branch:
     * 1.12x faster from L2 at one token, one thread (AMD Zen 3). */
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m256i w[8];
        for (int g = 0; g < 8; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + R16_K_QS + 64 * (8 * (j / 2) + g) + 32 * h));
            w[g] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, lo4);
        }
        __m256i scj = k16_scales(sc, j, h);
        for (int t = 0; t < T; t++) {
            const int8_t *xq = xa[t].q + QK_K * b + K_SUB * j;
            __m256i s16 = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++)
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[g], bcast4(xq + 4 * g)));
            isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s16, scj));
        }
    }
    k16_finish(T, blk, m, h, b, xa, isum, acc);
}

/* One token against both halves of one super-block: each 64-byte chunk is loaded once,
 * its two nibbles feeding sub-blocks 2c and 2c+1 of both halves, so the weights are
 * consumed in order at an even rate and each activation broadcast serves 16 rows. The
 * prefetch goes out a sub-block pair at a time: issued for the whole super-block at once
 * (36 lines), it left the stream from memory at 0.6x of the kernel's speed from L2 on AMD
 * Zen 1, against 0.9-1.0x this way. Against the half-by-half loop with that prefetch, one
 * thread measured 1.28x from L2 and 1.55x from memory (medians of 6 alternating runs). */
TGT INLINE void k16_lone(const uint8_t *blk, const uint8_t sc[128], const uint8_t m[128], int64_t b, const r16_x *x,
                         __m256 acc[2][R16_TILE_T])
{
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const int8_t *xq = x->q + QK_K * b + K_SUB * 2 * c;
        prefetch_stream(blk + R16_K_QS + 8 * 64 * c, 8 * 64); /* the pair's eight chunks */
        __m256i s16[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()},
                             {_mm256_setzero_si256(), _mm256_setzero_si256()}};
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m256i xe = bcast4(xq + 4 * g), xo = bcast4(xq + K_SUB + 4 * g);
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(blk + R16_K_QS + 64 * (8 * c + g) + 32 * h));
                s16[0][h] = _mm256_add_epi16(s16[0][h], _mm256_maddubs_epi16(_mm256_and_si256(v, lo4), xe));
                s16[1][h] = _mm256_add_epi16(s16[1][h],
                                             _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), xo));
            }
        }
        for (int k = 0; k < 2; k++)
            for (int h = 0; h < 2; h++)
                isum[h] = _mm256_add_epi32(isum[h], _mm256_madd_epi16(s16[k][h], k16_scales(sc, 2 * c + k, h)));
    }
    for (int h = 0; h < 2; h++)
        k16_finish(1, blk, m, h, b, x, &isum[h], acc[h]);
}

/* Half h0 of one group against T tokens, or with NH = 2 a lone token against both halves. */
TGT INLINE void k16_tile(int T, int NH, const uint8_t *group, int h0, int64_t nsb, const r16_x *xa, float *Y,
                         int64_t ldy, const uint8_t *end, bool stream)
{
    __m256 acc[2][R16_TILE_T];
    for (int k = 0; k < NH; k++)
        for (int t = 0; t < T; t++)
            acc[k][t] = _mm256_setzero_ps();
    uint8_t sc[128], m[128];
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *blk = group + b * R16_K_BYTES;
        k16_unpack(blk, sc, m);
        if (NH == 2) {
            prefetch_stream(blk, R16_K_QS);
            touch_stream(blk, R16_K_BYTES, end);
            k16_lone(blk, sc, m, b, xa, acc);
        } else {
            if (stream) {
                prefetch_stream(blk, R16_K_BYTES);
                touch_stream(blk, R16_K_BYTES, end);
            }
            k16_half(T, blk, sc, m, h0, b, xa, acc[0]);
        }
    }
    for (int k = 0; k < NH; k++)
        for (int t = 0; t < T; t++)
            _mm256_storeu_ps(Y + t * ldy + 8 * (h0 + k), acc[k][t]);
}

/* vgf2p8affineqb on 32 bytes (the VEX form: AVX and GFNI), as gf2_affine in the AVX-512
 * file, and written as asm for the same reason. */
TGT INLINE __m256i gf2_affine256(__m256i x, uint64_t matrix)
{
    __m256i r, m = _mm256_set1_epi64x((long long)matrix);
    __asm__("vgf2p8affineqb $0, %2, %1, %0" : "=x"(r) : "x"(x), "x"(m));
    return r;
}

/* Sub-block j's quants as unsigned 6-bit values, elements 4g..4g+3 of its 8 rows (half h,
 * already in q) in vector g. With GFNI, one instruction moves each field into place and
 * clears the rest of the byte: 3 operations per vector instead of 5, which made this
 * kernel 1.07-1.35x faster from L2 (1 to 16 tokens, one thread) and Q4_K_M decode on the
 * AVX2 kernels 1.05x (switched inside one process, 7 of 8 rounds faster). */
TGT INLINE void k6_sub_quants(bool gfni, const uint8_t *q, int j, __m256i w[4])
{
    const __m256i lo4 = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const int pair = j % 4 / 2;
    for (int g = 0; g < 4; g++) { /* as k6_pair in the AVX-512 file */
        __m256i l = _mm256_loadu_si256((const __m256i *)(q + 64 * (4 * pair + g)));
        __m256i hb = _mm256_loadu_si256((const __m256i *)(q + 64 * (8 + g)));
        if (gfni) {
            __m256i t = gf2_affine256(hb, gf2_bit_move(4 * pair + 2 * (j % 2), 4, 2));
            w[g] = _mm256_or_si256(j % 2 ? gf2_affine256(l, gf2_bit_move(4, 0, 4)) : _mm256_and_si256(l, lo4), t);
        } else {
            __m256i hs = pair == 0 ? _mm256_slli_epi16(hb, 2) : _mm256_srli_epi16(hb, 2);
            w[g] = j % 2 ? _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), lo4), _mm256_and_si256(hs, top))
                         : _mm256_or_si256(_mm256_and_si256(l, lo4), _mm256_and_si256(_mm256_slli_epi16(hs, 2), top));
        }
    }
}

/* Q6_K R16: the AVX-512 kernel's sums, eight rows per vector. Two of a sub-block's four
 * vpmaddubsw results add up in int16 (2 x 2 x 63 x 127 < 2^15) before widening. Sub-blocks
 * j0..j1-1 of half h of one super-block against T tokens, added to isum. */
TGT INLINE void k6_subs(bool gfni, int T, const uint8_t *blk, int h, int j0, int j1, int64_t b, const r16_x *xa,
                        __m256i *isum)
{
    const __m256i ones = _mm256_set1_epi16(1);
    /* Unrolled, so each sub-block's bit positions are constants rather than branches:
     * 1.95-2.2x faster from L2 at one token, one thread (AMD Zen 3). */
#pragma GCC unroll 16
    for (int j = j0; j < j1; j++) {
        __m256i w[4];
        k6_sub_quants(gfni, blk + R16_K6_QS + R16_K6_QUARTER * (j / 4) + 32 * h, j, w);
        __m256i scj = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + R16_K6_SCALES + 16 * j + 8 * h)));
        for (int t = 0; t < T; t++) {
            const int8_t *xq = xa[t].q + QK_K * b + 16 * j;
            __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bcast4(xq)), _mm256_maddubs_epi16(w[1], bcast4(xq + 4)));
            __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bcast4(xq + 8)),
                                          _mm256_maddubs_epi16(w[3], bcast4(xq + 12)));
            __m256i dot = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)),
                                           _mm256_set1_epi32(xa[t].side[16 * b + j]));
            isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(dot, scj));
        }
    }
}

TGT INLINE void k6_finish(int T, const uint8_t *blk, int h, int64_t b, const r16_x *xa, const __m256i *isum, __m256 *acc)
{
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + R16_K6_D + 16 * h)));
    for (int t = 0; t < T; t++)
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, _mm256_set1_ps(xa[t].d[b])), acc[t]);
}

/* Half h of one super-block against T tokens, into acc. */
TGT INLINE void k6_half(bool gfni, int T, const uint8_t *blk, int h, int64_t b, const r16_x *xa, __m256 *acc)
{
    __m256i isum[R16_TILE_T];
    for (int t = 0; t < T; t++)
        isum[t] = _mm256_setzero_si256();
    k6_subs(gfni, T, blk, h, 0, QK_K / 16, b, xa, isum);
    k6_finish(T, blk, h, b, xa, isum, acc);
}

/* One token against both halves of one super-block, a quarter at a time (both halves of
 * a quarter's chunks before the next quarter), so the weights are consumed in order and
 * the prefetch goes out a quarter at a time, as in k16_lone. Against the half-by-half
 * loop with a whole super-block's prefetch at once, one thread on AMD Zen 1 measured
 * 1.08x from L2 and 1.73x from memory (medians of 6 alternating runs). */
TGT INLINE void k6_lone(bool gfni, const uint8_t *blk, int64_t b, const r16_x *x, __m256 acc[2][R16_TILE_T])
{
    __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        prefetch_stream(blk + R16_K6_QS + R16_K6_QUARTER * s, R16_K6_QUARTER);
        for (int h = 0; h < 2; h++)
            k6_subs(gfni, 1, blk, h, 4 * s, 4 * s + 4, b, x, &isum[h]);
    }
    for (int h = 0; h < 2; h++)
        k6_finish(1, blk, h, b, x, &isum[h], acc[h]);
}

/* Half h0 of one group against T tokens, or with NH = 2 a lone token against both halves. */
TGT INLINE void k6_tile(bool gfni, int T, int NH, const uint8_t *group, int h0, int64_t nsb, const r16_x *xa, float *Y,
                        int64_t ldy, const uint8_t *end, bool stream)
{
    __m256 acc[2][R16_TILE_T];
    for (int k = 0; k < NH; k++)
        for (int t = 0; t < T; t++)
            acc[k][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *blk = group + b * R16_K6_BYTES;
        if (NH == 2) {
            prefetch_stream(blk, R16_K6_QS);
            touch_stream(blk, R16_K6_BYTES, end);
            k6_lone(gfni, blk, b, xa, acc);
        } else {
            if (stream) {
                prefetch_stream(blk, R16_K6_BYTES);
                touch_stream(blk, R16_K6_BYTES, end);
            }
            k6_half(gfni, T, blk, h0, b, xa, acc[0]);
        }
    }
    for (int k = 0; k < NH; k++)
        for (int t = 0; t < T; t++)
            _mm256_storeu_ps(Y + t * ldy + 8 * (h0 + k), acc[k][t]);
}

/* Tokens in chunks, each chunk against every group of the range, half by half (a lone
 * token both halves at once). gfni:
 * decode Q6_K with GFNI (k6_sub_quants); only the Q6_K kernel chosen where the CPU has it
 * passes true. */
TGT INLINE void r16_matmul(uint32_t ktype, bool gfni, const void *W, size_t w_stride, const void *X, size_t x_stride,
                           int64_t n, float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    bool k4 = ktype == BLADE_KTYPE_Q4_K_R16, k6 = ktype == BLADE_KTYPE_Q6_K_R16;
    int64_t nb = n / r16_block_elems(ktype), per_token = r16_side_per_token(ktype, n);
    int32_t *side = pack_alloc(sizeof(int32_t) * (size_t)(TOKEN_CHUNK * per_token));
    r16_x xa[TOKEN_CHUNK];
    const uint8_t *end = (const uint8_t *)W + r1 * (int64_t)w_stride;
    for (int64_t c = 0; c < n_tok; c += TOKEN_CHUNK) {
        int64_t c1 = c + TOKEN_CHUNK < n_tok ? c + TOKEN_CHUNK : n_tok;
        for (int64_t t = c; t < c1; t++)
            xa[t - c] = r16_token(ktype, (const uint8_t *)X + t * (int64_t)x_stride, n, side + (t - c) * per_token);
        /* A lone token reads both halves of each block together, so its weights stream
         * through memory in order; a tile of tokens takes one half at a time. */
        bool lone = c1 - c == 1;
        for (int64_t g = r0; g < r1; g += BLADE_R16_ROWS) {
            const uint8_t *group = (const uint8_t *)W + g * (int64_t)w_stride;
            for (int h = 0; h < 2; h += lone ? 2 : 1)
                for (int64_t t = c; t < c1; t += R16_TILE_T) {
                    int64_t nt = c1 - t < R16_TILE_T ? c1 - t : R16_TILE_T;
                    float *y = Y + t * ldy + g;
                    /* The first pass over a group pulls it from memory (both halves: they
                     * share cache lines) and takes the stream's hints; later passes find
                     * it in cache. */
                    const uint8_t *hint = h == 0 && t == c ? end : NULL;
#define R16_PASS(T, NH, H, S)                                                                                   \
    do {                                                                                                       \
        if (k4)                                                                                                \
            k16_tile(T, NH, group, h, nb, xa + (t - c), y, ldy, H, S);                                         \
        else if (k6)                                                                                           \
            k6_tile(gfni, T, NH, group, h, nb, xa + (t - c), y, ldy, H, S);                                    \
        else                                                                                                   \
            r16_tile(ktype == BLADE_KTYPE_Q4_0_R16, T, NH, group, h, nb, xa + (t - c), y, ldy, H, S);          \
    } while (0)
/* stream a compile-time constant in each instance, so no hot loop tests it */
#define R16_TILE(T, NH)                                                                                         \
    do {                                                                                                       \
        if (hint)                                                                                              \
            R16_PASS(T, NH, hint, true);                                                                       \
        else                                                                                                   \
            R16_PASS(T, NH, NULL, false);                                                                      \
    } while (0)
#define R16_HALF(T) R16_TILE(T, 1)
                    if (lone) {
                        R16_TILE(1, 2);
                    } else {
                        WITH_CONST_T(nt, R16_TILE_T, R16_HALF)
                    }
#undef R16_TILE
#undef R16_PASS
#undef R16_HALF
                }
        }
    }
    free(side);
}

BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q4_0_r16, r16_matmul, BLADE_KTYPE_Q4_0_R16, false)
BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q8_0_r16, r16_matmul, BLADE_KTYPE_Q8_0_R16, false)
BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q4_k_r16, r16_matmul, BLADE_KTYPE_Q4_K_R16, false)
BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q6_k_r16, r16_matmul, BLADE_KTYPE_Q6_K_R16, false)
BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q6_k_r16_gfni, r16_matmul, BLADE_KTYPE_Q6_K_R16, true)

/* ------------------------------------------------------------ Q4_K, Q5_K, Q6_K ----
 * Unit: a 256 super-block as eight 32-byte vectors of unsigned quants in natural order;
 * vpmaddubsw then vpmaddwd by the int16 scale of each lane, summed exactly in int32. Mins
 * (Q4_K/Q5_K) meet the activation 16-sums in one vpmaddwd and a second FMA; Q6_K's -32
 * offset shares the main scale and joins the integer sum. */

typedef struct k_dec {
    __m256i q[8];
    __m256i sc[8];
    __m256i m; /* Q4_K/Q5_K: min per pair of 16-sums; Q6_K: -32*scale per 16-sum */
    float d, dmin;
} k_dec;

enum k_kind { K4, K5, K6 };

TGT INLINE void k45_decode(bool five, const uint8_t *row, int64_t b, k_dec *o)
{
    const uint8_t *blk = row + b * (int64_t)(five ? sizeof(block_q5_k) : sizeof(block_q4_k));
    const uint8_t *scales = blk + offsetof(block_q4_k, scales);
    const uint8_t *qs = blk + (five ? offsetof(block_q5_k, qs) : offsetof(block_q4_k, qs));
    uint16_t h[2];
    memcpy(h, blk, 4);
    o->d = _cvtsh_ss(h[0]);
    o->dmin = _cvtsh_ss(h[1]);
    uint8_t sc[8], m[8];
    for (int j = 0; j < 8; j++)
        blade_k_scale_min(j, scales, &sc[j], &m[j]);
    for (int j = 0; j < 8; j++)
        o->sc[j] = _mm256_set1_epi16(sc[j]);
    o->m = _mm256_setr_epi16(m[0], m[0], m[1], m[1], m[2], m[2], m[3], m[3], m[4], m[4], m[5], m[5], m[6], m[6],
                             m[7], m[7]);
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + offsetof(block_q5_k, qh))) : _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
        __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, lo4);
        if (five) {
            __m256i bit = _mm256_set1_epi8((char)(1 << j));
            __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
        o->q[j] = q;
    }
}

TGT INLINE void q6_k_decode(const uint8_t *row, int64_t b, k_dec *o)
{
    const uint8_t *blk = row + b * (int64_t)sizeof(block_q6_k);
    uint16_t h;
    memcpy(&h, blk + offsetof(block_q6_k, d), 2);
    o->d = _cvtsh_ss(h);
    o->dmin = 0.0f;
    const int8_t *s = (const int8_t *)blk + offsetof(block_q6_k, scales);
    for (int v = 0; v < 8; v++)
        o->sc[v] = _mm256_setr_m128i(_mm_set1_epi16(s[2 * v]), _mm_set1_epi16(s[2 * v + 1]));
    __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)s));
    o->m = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(s16, 5));
    const __m256i lo4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    for (int v = 0; v < 8; v++) {
        /* Vector v: half v/4, 32-run c = v%4 (see quant_ref.c); the run's two high bits
         * are bits 2c..2c+1 of qh, moved to bits 4-5. */
        int half = v / 4, c = v % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + offsetof(block_q6_k, ql) + 64 * half + 32 * (c & 1)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + offsetof(block_q6_k, qh) + 32 * half));
        __m256i lo = _mm256_and_si256(c >> 1 ? _mm256_srli_epi16(ql, 4) : ql, lo4);
        __m256i hb = c == 0 ? _mm256_slli_epi16(qh, 4) : c == 1 ? _mm256_slli_epi16(qh, 2) : c == 2 ? qh : _mm256_srli_epi16(qh, 2);
        o->q[v] = _mm256_or_si256(lo, _mm256_and_si256(hb, hi2));
    }
}

TGT INLINE void k_decode(enum k_kind kind, const uint8_t *row, int64_t b, k_dec *o)
{
    if (kind == K6)
        q6_k_decode(row, b, o);
    else
        k45_decode(kind == K5, row, b, o);
}

TGT INLINE __m256i k_dot32(__m256i acc, __m256i q, const int8_t *x, __m256i sc)
{
    __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
}

TGT INLINE __m256 k_finish(enum k_kind kind, const k_dec *w, __m256i isum, const int16_t *sum16, float dx, __m256 acc)
{
    __m256i xs = _mm256_loadu_si256((const __m256i *)sum16);
    if (kind == K6) {
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(xs, w->m));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w->d * dx), acc);
    }
    __m256i msum = _mm256_madd_epi16(xs, w->m);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(w->d * dx), acc);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(w->dmin * dx), acc);
}

TGT INLINE float k_gemv(enum k_kind kind, const uint8_t *row, act_k_view a, int64_t nsb)
{
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        k_dec w;
        k_decode(kind, row, b, &w);
        __m256i isum = _mm256_setzero_si256();
        for (int v = 0; v < 8; v++)
            isum = k_dot32(isum, w.q[v], a.q + QK_K * b + 32 * v, w.sc[v]);
        acc = k_finish(kind, &w, isum, a.sum16 + 16 * b, a.d[b], acc);
    }
    return hsum(acc);
}

TGT INLINE void k_tile(enum k_kind kind, int T, const k_dec *pk, int64_t nsb, const act_k_view *xa, float *out)
{
    __m256 acc[TILE_R][TILE_T];
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m256i isum[TILE_R][TILE_T];
        for (int r = 0; r < TILE_R; r++)
            for (int t = 0; t < T; t++)
                isum[r][t] = _mm256_setzero_si256();
        for (int v = 0; v < 8; v++) {
            for (int t = 0; t < T; t++) {
                const int8_t *x = xa[t].q + QK_K * b + 32 * v;
                for (int r = 0; r < TILE_R; r++)
                    isum[r][t] = k_dot32(isum[r][t], pk[r * nsb + b].q[v], x, pk[r * nsb + b].sc[v]);
            }
        }
        for (int t = 0; t < T; t++)
            for (int r = 0; r < TILE_R; r++)
                acc[r][t] = k_finish(kind, &pk[r * nsb + b], isum[r][t], xa[t].sum16 + 16 * b, xa[t].d[b], acc[r][t]);
    }
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < T; t++)
            out[r * TILE_T + t] = hsum(acc[r][t]);
}

TGT INLINE void k_matmul(enum k_kind kind, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n,
                         float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    int64_t nsb = n / QK_K;
    const uint8_t *rows[TILE_R];
    float out[TILE_R * TILE_T];
    if (n_tok == 1) {
        act_k_view a = act_k_at(X, n);
        const uint8_t *end = (const uint8_t *)W + r1 * (int64_t)w_stride;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = (const uint8_t *)W + r * (int64_t)w_stride;
            touch_stream(row, w_stride, end);
            Y[r] = k_gemv(kind, row, a, nsb);
        }
        return;
    }
    k_dec *pk = pack_alloc(sizeof(k_dec) * TILE_R * (size_t)nsb);
    act_k_view xa[TILE_T];
    for (int64_t c = 0; c < n_tok; c += TOKEN_CHUNK) {
        int64_t c1 = c + TOKEN_CHUNK < n_tok ? c + TOKEN_CHUNK : n_tok;
        for (int64_t r = r0; r < r1; r += TILE_R) {
            tile_rows(W, w_stride, r, r1, TILE_R, rows);
            for (int i = 0; i < TILE_R; i++)
                for (int64_t b = 0; b < nsb; b++)
                    k_decode(kind, rows[i], b, &pk[i * nsb + b]);
            int64_t nr = r1 - r < TILE_R ? r1 - r : TILE_R;
            for (int64_t t = c; t < c1; t += TILE_T) {
                int64_t nt = c1 - t < TILE_T ? c1 - t : TILE_T;
                for (int j = 0; j < nt; j++)
                    xa[j] = act_k_at((const uint8_t *)X + (t + j) * (int64_t)x_stride, n);
#define K_TILE(T) k_tile(kind, T, pk, nsb, xa, out)
                WITH_CONST_T(nt, TILE_T, K_TILE)
#undef K_TILE
                store_tile(Y, ldy, r, nr, t, nt, out, TILE_T);
            }
        }
    }
    free(pk);
}

BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q4_k, k_matmul, K4)
BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q5_k, k_matmul, K5)
BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_q6_k, k_matmul, K6)

/* ------------------------------------------------------------ F32, F16, BF16 ----
 * Unit: 8 weights (F32, F16) or 16 (BF16), one FMA per 8 weights and (row, token). A
 * row's tail past the last full unit is copied into a zeroed buffer first (the activation
 * padding is zero). */

/* Chunks of at least this many tokens convert each tile of F16 rows to floats once and
 * run the F32 tiles on them: each FMA meets the same two floats in the same order as in
 * the one-token path, so the bits are the same, and the chunk's tiles skip a conversion
 * per 8 weights (3 cycles each on AMD Zen 1). Against converting in every tile, one thread
 * measured 1.15x at 16 tokens, 1.29x at 32 and 1.36x at 64, but 0.92x at 8 (medians of 4-6
 * alternating runs, 128 rows from L2). BF16 rows gained 1.06-1.15x at 32-64 tokens only,
 * and keep their own tiles. */
#define F16_TO_F32_MIN_TOKENS 16

enum f_kind { F32, F16, BF16 };

#define F_TILE_R 3
#define F_TILE_T 4
/* One token takes four rows at a time: one row alone is a single chain of dependent FMAs,
 * which held F16 and BF16 decode at 2 multiply-adds per cycle (FMA latency, not memory). */
#define F_GEMV_R 4
#define F_ROWS_MAX (F_GEMV_R > F_TILE_R ? F_GEMV_R : F_TILE_R)
#define F_UNIT_BYTES 32 /* the most a unit's row spans: 8 f32 or 16 bf16 */

static size_t f_elem_bytes(enum f_kind kind)
{
    return kind == F32 ? 4 : 2;
}

static int64_t f_unit(enum f_kind kind)
{
    return kind == BF16 ? 16 : 8;
}

/* BF16: a 32-byte load holds 16 values, each 32-bit lane an even element in its low half
 * and an odd one in its high half, already where an f32 keeps it. The unit's even
 * elements (shifted up) go first, then its odd ones (masked): one integer operation per
 * 8 values instead of two (widen and shift), for weights and activations alike. */
TGT INLINE __m256 bf16_lanes(__m256i v, int odd)
{
    return _mm256_castsi256_ps(odd ? _mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u))
                                   : _mm256_slli_epi32(v, 16));
}

TGT INLINE void f_step(enum f_kind kind, int R, int T, const uint8_t *const *w, const void *const *xs, int64_t u,
                       __m256 acc[][F_TILE_T])
{
    __m256 wv[F_ROWS_MAX];
    if (kind == BF16) {
        for (int odd = 0; odd < 2; odd++) {
            for (int r = 0; r < R; r++)
                wv[r] = bf16_lanes(_mm256_loadu_si256((const __m256i *)w[r]), odd);
            for (int t = 0; t < T; t++) {
                __m256 x = bf16_lanes(_mm256_loadu_si256((const __m256i *)((const uint8_t *)xs[t] + F_UNIT_BYTES * u)), odd);
                for (int r = 0; r < R; r++)
                    acc[r][t] = _mm256_fmadd_ps(wv[r], x, acc[r][t]);
            }
        }
        return;
    }
    for (int r = 0; r < R; r++)
        wv[r] = kind == F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w[r])) : _mm256_loadu_ps((const float *)w[r]);
    for (int t = 0; t < T; t++) {
        __m256 x = _mm256_loadu_ps((const float *)xs[t] + 8 * u);
        for (int r = 0; r < R; r++)
            acc[r][t] = _mm256_fmadd_ps(wv[r], x, acc[r][t]);
    }
}

TGT INLINE void f_tile(enum f_kind kind, int R, int T, const uint8_t *const *rows, const void *const *xs, int64_t n,
                      float *out)
{
    int64_t unit = f_unit(kind);
    size_t eb = f_elem_bytes(kind), ub = (size_t)unit * eb;
    __m256 acc[F_ROWS_MAX][F_TILE_T];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm256_setzero_ps();
    const uint8_t *w[F_ROWS_MAX];
    for (int64_t u = 0; u < n / unit; u++) {
        for (int r = 0; r < R; r++)
            w[r] = rows[r] + ub * (size_t)u;
        f_step(kind, R, T, w, xs, u, acc);
    }
    if (n % unit) {
        uint8_t tail[F_ROWS_MAX][F_UNIT_BYTES];
        memset(tail, 0, sizeof tail);
        for (int r = 0; r < R; r++) {
            memcpy(tail[r], rows[r] + ub * (size_t)(n / unit), (size_t)(n % unit) * eb);
            w[r] = tail[r];
        }
        f_step(kind, R, T, w, xs, n / unit, acc);
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            out[r * F_TILE_T + t] = hsum(acc[r][t]);
}

/* Row of n F16 weights as floats, zero-padded to whole units. */
TGT INLINE void f16_row_to_f32(const uint8_t *row, int64_t n, float *out)
{
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k))));
    if (k < n) {
        uint16_t tail[8] = {0};
        memcpy(tail, row + 2 * k, (size_t)(n - k) * 2);
        _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tail)));
    }
}

TGT INLINE void f_matmul(enum f_kind kind, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n,
                         float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    const uint8_t *rows[F_ROWS_MAX];
    const void *xs[F_TILE_T];
    float out[F_ROWS_MAX * F_TILE_T];
    if (n_tok == 1) {
        xs[0] = X;
        const uint8_t *end = (const uint8_t *)W + r1 * (int64_t)w_stride;
        for (int64_t r = r0; r < r1; r += F_GEMV_R) {
            tile_rows(W, w_stride, r, r1, F_GEMV_R, rows);
            touch_stream(rows[0], F_GEMV_R * w_stride, end);
            f_tile(kind, F_GEMV_R, 1, rows, xs, n, out);
            for (int64_t i = 0; i < F_GEMV_R && r + i < r1; i++)
                Y[r + i] = out[i * F_TILE_T];
        }
        return;
    }
    /* BF16 keeps its mask in a register too: with four tokens' accumulators the compiler
     * spilled them, and the stores and reloads held the tile at 0.76-0.79x of three tokens'. */
    int64_t tile_t = kind == BF16 ? 3 : F_TILE_T;
    int64_t n_padded = (n + 7) / 8 * 8;
    /* Only a call with a chunk to convert needs the floats. */
    float *floats = kind == F16 && n_tok >= F16_TO_F32_MIN_TOKENS
                        ? pack_alloc(sizeof(float) * F_TILE_R * (size_t)n_padded)
                        : NULL;
    for (int64_t c = 0; c < n_tok; c += TOKEN_CHUNK) {
        int64_t c1 = c + TOKEN_CHUNK < n_tok ? c + TOKEN_CHUNK : n_tok;
        bool convert = floats && c1 - c >= F16_TO_F32_MIN_TOKENS;
        for (int64_t r = r0; r < r1; r += F_TILE_R) {
            tile_rows(W, w_stride, r, r1, F_TILE_R, rows);
            if (convert)
                for (int i = 0; i < F_TILE_R; i++) {
                    f16_row_to_f32(rows[i], n, floats + i * n_padded);
                    rows[i] = (const uint8_t *)(floats + i * n_padded);
                }
            int64_t nr = r1 - r < F_TILE_R ? r1 - r : F_TILE_R;
            for (int64_t t = c; t < c1; t += tile_t) {
                int64_t nt = c1 - t < tile_t ? c1 - t : tile_t;
                for (int j = 0; j < nt; j++)
                    xs[j] = (const uint8_t *)X + (t + j) * (int64_t)x_stride;
#define F_TILE(T) f_tile(convert ? F32 : kind, F_TILE_R, T, rows, xs, convert ? n_padded : n, out)
                WITH_CONST_T(nt, F_TILE_T, F_TILE)
#undef F_TILE
                store_tile(Y, ldy, r, nr, t, nt, out, F_TILE_T);
            }
        }
    }
    free(floats);
}

BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_f32, f_matmul, F32)
BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_f16, f_matmul, F16)
BLADE_DRIVEN_KERNEL(TGT, blade_mm_avx2_bf16, f_matmul, BF16)

/* ---------------------------------------------------------- activation rows ----
 * Same arithmetic as matmul_scalar.c's portable converters, eight elements at a time. */

/* |x| with NaNs as zero, so the block maximum skips them as the scalar comparison does. */
TGT INLINE __m256 abs_ordered(__m256 x)
{
    __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    return _mm256_and_ps(a, _mm256_cmp_ps(a, a, _CMP_ORD_Q));
}

TGT INLINE float hmax(__m256 v)
{
    __m128 q = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q));
    q = _mm_max_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

TGT INLINE int32_t hsum_i32(__m256i v)
{
    __m128i q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1));
    return _mm_cvtsi128_si32(q);
}

/* Eight values to int8 levels, as quantize_run in matmul.c. */
TGT INLINE __m256i quantize8(__m256 x, __m256 id)
{
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(x, id));
    return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}

/* Stores sixteen int32 values in [-127, 127] (two vectors) as int8. */
TGT INLINE void store16_i8(int8_t *q, __m256i a, __m256i b)
{
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    __m128i v = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128((__m128i *)q, v);
}

TGT void blade_act_avx2_q8_0(const float *x, void *out, int64_t n)
{
    act_q8_view v = act_q8_at(out, n);
    int8_t *q = (int8_t *)v.q;
    float *d = (float *)v.d;
    int32_t *sum = (int32_t *)v.sum;
    for (int64_t b = 0; b < n / QK8_0; b++) {
        const float *xb = x + QK8_0 * b;
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++)
            m = _mm256_max_ps(m, abs_ordered(_mm256_loadu_ps(xb + 8 * j)));
        float amax = hmax(m);
        if (!(amax >= 1e-30f))
            continue; /* stays zero, as blade_act_convert cleared it */
        __m256 id = _mm256_set1_ps(127.0f / amax);
        __m256i qv[4];
        for (int j = 0; j < 4; j++)
            qv[j] = quantize8(_mm256_loadu_ps(xb + 8 * j), id);
        store16_i8(q + QK8_0 * b, qv[0], qv[1]);
        store16_i8(q + QK8_0 * b + 16, qv[2], qv[3]);
        sum[b] = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(qv[0], qv[1]), _mm256_add_epi32(qv[2], qv[3])));
        d[b] = amax / 127.0f;
    }
}

TGT void blade_act_avx2_q8_k(const float *x, void *out, int64_t n)
{
    act_k_view v = act_k_at(out, n);
    int8_t *q = (int8_t *)v.q;
    float *d = (float *)v.d;
    int16_t *sum16 = (int16_t *)v.sum16;
    for (int64_t b = 0; b < n / QK_K; b++) {
        const float *xb = x + QK_K * b;
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < QK_K / 8; j++)
            m = _mm256_max_ps(m, abs_ordered(_mm256_loadu_ps(xb + 8 * j)));
        float amax = hmax(m);
        if (!(amax >= 1e-30f))
            continue;
        __m256 id = _mm256_set1_ps(127.0f / amax);
        for (int g = 0; g < QK_K / 16; g++) {
            __m256i a = quantize8(_mm256_loadu_ps(xb + 16 * g), id);
            __m256i c = quantize8(_mm256_loadu_ps(xb + 16 * g + 8), id);
            store16_i8(q + QK_K * b + 16 * g, a, c);
            sum16[16 * b + g] = (int16_t)hsum_i32(_mm256_add_epi32(a, c));
        }
        d[b] = amax / 127.0f;
    }
}

TGT void blade_act_avx2_bf16(const float *x, void *out, int64_t n)
{
    uint16_t *o = out;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h[2];
        for (int j = 0; j < 2; j++) {
            __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i + 8 * j));
            /* Round to nearest even on the bits; NaNs keep their top bits, made quiet. The
             * magnitude compare is signed, which is exact once the sign bit is cleared. */
            __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                             _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                             _mm256_set1_epi32(0x7f800000));
            h[j] = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16),
                                      _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
        }
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(o + i), p);
    }
    for (; i < n; i++)
        o[i] = blade_fp32_to_bf16(x[i]);
}

/* Not an activation form: the KV store's f16 rows (blade_row_from_float). The instruction
 * rounds to nearest even and quiets NaNs keeping their top payload bits, as
 * blade_fp32_to_fp16 does; one value at a time, that function took a sixth of a decode
 * step's attention pass. */
TGT void blade_act_avx2_f16(const float *x, void *out, int64_t n)
{
    uint16_t *o = out;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        o[i] = blade_fp32_to_fp16(x[i]);
}

#endif

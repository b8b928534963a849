#include "kernels/kernels_internal.h"

#if defined(__x86_64__)

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* AVX-512 kernels. Every function carries its own target attribute so the rest of the
 * project stays generic x86-64; blade_matmul only calls in here after CPUID checks.
 *
 * Batch invariance: for each (row, token) the float operations are a fixed sequence: one
 * 16-lane accumulator updated once per decode unit (a pair of 32-blocks, a 256
 * super-block, or 16/32 floats) in order along the row, then the same horizontal sum.
 * Integer parts are exact, so the order in which a tile gathers them is free. The
 * one-token path and the tiles call the same per-unit step functions. */

#define ISA_F "avx2,fma,f16c,avx512f,avx512bw,avx512vl"
#define TGT_F __attribute__((target(ISA_F)))
#define TGT_Q __attribute__((target(ISA_F ",avx512vnni")))
#define TGT_BF __attribute__((target(ISA_F ",avx512bf16")))
#define INLINE static inline __attribute__((always_inline))

/* Row x token tile of the many-token path. The one-token path takes one row at a time:
 * a single sequential weight stream is what the hardware prefetchers follow best (four
 * interleaved row streams measured at half the bandwidth), and the per-unit work is
 * long enough that one accumulator chain does not limit it. */
#define TILE_R 4
#define TILE_T 4
/* Tokens whose converted activations stay cache-resident while a row tile's decoded
 * weights are reused across them (a multiple of both token-tile sizes). */
#define TOKEN_CHUNK 48
/* Q4_0/Q8_0 tiles read each token's prepared side (192 bytes per pair of blocks) from a
 * buffer for this many tokens, reused by every row tile. pp512 measured faster with 32
 * than with 16 (more decode passes over the weights) or 48 (whose buffer, 811 KiB for a
 * 5632-wide row, no longer fits beside the weights in a 1 MiB L2). */
#define Q32_TOKEN_CHUNK 32

TGT_F INLINE float hsum(__m512 v)
{
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

static void store_tile(float *Y, int64_t ldy, int64_t r, int64_t nr, int64_t t, int64_t nt, const float *out)
{
    for (int64_t j = 0; j < nt; j++)
        for (int64_t i = 0; i < nr; i++)
            Y[(t + j) * ldy + r + i] = out[i * TILE_T + j];
}

/* Rows of a tile past r1 repeat the last row: wasted work only at the range's end, and
 * no kernel needs a partial-tile variant. */
static void tile_rows(const void *W, size_t w_stride, int64_t r, int64_t r1, int R, const uint8_t **rows)
{
    for (int i = 0; i < R; i++)
        rows[i] = (const uint8_t *)W + (r + i < r1 ? r + i : r1 - 1) * (int64_t)w_stride;
}

/* Scratch for decoded weights or shared token data; never zero-sized (n may be 0). */
static void *pack_alloc(size_t bytes)
{
    void *p = aligned_alloc(64, (bytes / 64 + 1) * 64);
    if (!p)
        abort();
    return p;
}

/* ---------------------------------------------------------------- Q8_0 and Q4_0 ----
 * Unit: a pair of 32-blocks in one vector (lanes 0-7 the first block, 8-15 the second).
 * Weights become unsigned bytes (Q4_0: q in 0..15; Q8_0: q+128) so vpdpbusd can take
 * them against the signed activations; the offset times the activation sum per 4-lane
 * (computed once per token and unit, shared by all rows) starts the integer sum, which
 * is then exact. One convert and one FMA per unit fold in the two blocks' scales. */

typedef struct q32_dec {
    __m512i q;
    __m512 d;
} q32_dec;

typedef struct q32_tok {
    __m512i x, start;
    __m512 d;
} q32_tok;

TGT_F INLINE __m512 pair_scales(__m128 two)
{
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castps128_ps512(two));
}

TGT_F INLINE __m512 pair_scales_fp16(uint16_t h0, uint16_t h1)
{
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)h0)), _mm_set1_epi16((short)h1), 1);
    return _mm512_cvtph_ps(h);
}

/* `two` is false only for a row's final odd block; its partner lanes get zero weight and
 * zero scale (the activation padding is zero as well). */
TGT_F INLINE __m512i q4_0_quants(const uint8_t *b0, bool two)
{
    const uint8_t *b1 = b0 + sizeof(block_q4_0);
    __m128i n0 = _mm_loadu_si128((const __m128i *)(b0 + 2));
    __m128i n1 = two ? _mm_loadu_si128((const __m128i *)(b1 + 2)) : _mm_setzero_si128();
    /* [n0 n0 n1 n1] then low nibbles in 128-bit lanes 0/2, high nibbles in 1/3. */
    __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(n0), n1, 1);
    __m512i z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(y));
    z = _mm512_srlv_epi16(z, _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0,
                                                0x0004000400040004, 0x0004000400040004));
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

TGT_F INLINE void q4_0_decode(const uint8_t *w, int64_t p, bool two, q32_dec *o)
{
    const uint8_t *b0 = w + 2 * p * (int64_t)sizeof(block_q4_0), *b1 = b0 + sizeof(block_q4_0);
    uint16_t h0, h1 = 0;
    memcpy(&h0, b0, 2);
    if (two)
        memcpy(&h1, b1, 2);
    o->q = q4_0_quants(b0, two);
    o->d = pair_scales_fp16(h0, h1);
}

TGT_F INLINE void q8_0_decode(const uint8_t *w, int64_t p, bool two, q32_dec *o)
{
    const uint8_t *b0 = w + 2 * p * (int64_t)sizeof(block_q8_0), *b1 = b0 + sizeof(block_q8_0);
    __m256i q0 = _mm256_loadu_si256((const __m256i *)(b0 + 2));
    __m256i q1 = two ? _mm256_loadu_si256((const __m256i *)(b1 + 2)) : _mm256_set1_epi8((char)0x80);
    uint16_t h0, h1 = 0;
    memcpy(&h0, b0, 2);
    if (two)
        memcpy(&h1, b1, 2);
    o->q = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1), _mm512_set1_epi8((char)0x80));
    o->d = pair_scales_fp16(h0, h1);
}

TGT_Q INLINE void q32_token(bool q4, act_q8_view a, int64_t p, q32_tok *o)
{
    const __m512i offset = _mm512_set1_epi8(q4 ? 8 : (char)0x80);
    o->x = _mm512_loadu_si512(a.q + 64 * p);
    o->start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, o->x));
    o->d = pair_scales(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(a.d + 2 * p))));
}

TGT_Q INLINE __m512 q32_step(const q32_dec *w, const q32_tok *x, __m512 acc)
{
    __m512i i = _mm512_dpbusd_epi32(x->start, w->q, x->x);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(w->d, x->d), acc);
}

TGT_Q INLINE void q32_decode(bool q4, const uint8_t *w, int64_t p, bool two, q32_dec *o)
{
    if (q4)
        q4_0_decode(w, p, two, o);
    else
        q8_0_decode(w, p, two, o);
}

/* xt: the token side of every unit, computed once per call and shared by all rows;
 * xd: the token's block scales.
 *
 * Q4_0 takes the scales of four pairs at a time: their fp16 words come out of two loads
 * with one permutation and meet the token's block scales in one multiply, and each pair's
 * lanes get theirs with one more permutation. These are the same IEEE products q32_step
 * forms one pair at a time, so the result has the same bits, at fewer operations per pair
 * (this path is otherwise compute-bound below the memory bandwidth). */
TGT_Q INLINE float q32_gemv(bool q4, const uint8_t *row, const q32_tok *xt, const float *xd, int64_t nb)
{
    __m512 acc = _mm512_setzero_ps();
    int64_t p = 0;
    if (q4) {
        const __m512i words = _mm512_setr_epi32(0x00090000, 0x001B0012, 0x002D0024, 0x003F0036, 0, 0, 0, 0, 0, 0, 0, 0,
                                                0, 0, 0, 0);
        for (; p + 4 <= nb / 2; p += 4) {
            const uint8_t *g = row + 2 * p * (int64_t)sizeof(block_q4_0);
            __m512i h = _mm512_permutex2var_epi16(_mm512_loadu_si512(g), words, _mm512_loadu_si512(g + 64));
            __m512 c = _mm512_castps256_ps512(
                _mm256_mul_ps(_mm256_cvtph_ps(_mm512_castsi512_si128(h)), _mm256_loadu_ps(xd + 2 * p)));
            for (int k = 0; k < 4; k++) {
                __m512 scale = _mm512_permutexvar_ps(
                    _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * k)), _mm256_set1_epi32(2 * k + 1), 1),
                    c);
                __m512i q = q4_0_quants(g + 2 * k * (int64_t)sizeof(block_q4_0), true);
                __m512i i = _mm512_dpbusd_epi32(xt[p + k].start, q, xt[p + k].x);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale, acc);
            }
        }
    }
    for (; p < nb / 2; p++) {
        q32_dec w;
        q32_decode(q4, row, p, true, &w);
        acc = q32_step(&w, &xt[p], acc);
    }
    if (nb & 1) {
        q32_dec w;
        q32_decode(q4, row, nb / 2, false, &w);
        acc = q32_step(&w, &xt[nb / 2], acc);
    }
    return hsum(acc);
}

/* xt[t * np + p]: token t's side of unit p, prepared once per token chunk and shared by
 * every row tile. */
TGT_Q INLINE void q32_tile(int T, const q32_dec *pk, int64_t np, const q32_tok *xt, float *out)
{
    __m512 acc[TILE_R][TILE_T];
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        for (int t = 0; t < T; t++) {
            const q32_tok *x = &xt[t * np + p];
            for (int r = 0; r < TILE_R; r++)
                acc[r][t] = q32_step(&pk[r * np + p], x, acc[r][t]);
        }
    }
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < T; t++)
            out[r * TILE_T + t] = hsum(acc[r][t]);
}

TGT_Q INLINE void q32_matmul(bool q4, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n,
                             float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    int64_t nb = n / QK8_0, np = (nb + 1) / 2;
    const uint8_t *rows[TILE_R];
    float out[TILE_R * TILE_T];
    if (n_tok == 1) {
        act_q8_view a = act_q8_at(X, n);
        q32_tok *xt = pack_alloc(sizeof(q32_tok) * (size_t)np);
        for (int64_t p = 0; p < np; p++)
            q32_token(q4, a, p, &xt[p]);
        const uint8_t *end = (const uint8_t *)W + r1 * (int64_t)w_stride;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = (const uint8_t *)W + r * (int64_t)w_stride;
            touch_stream(row, w_stride, end);
            Y[r] = q32_gemv(q4, row, xt, a.d, nb);
        }
        free(xt);
        return;
    }
    q32_dec *pk = pack_alloc(sizeof(q32_dec) * TILE_R * (size_t)np);
    q32_tok *xt = pack_alloc(sizeof(q32_tok) * Q32_TOKEN_CHUNK * (size_t)np);
    for (int64_t c = 0; c < n_tok; c += Q32_TOKEN_CHUNK) {
        int64_t c1 = c + Q32_TOKEN_CHUNK < n_tok ? c + Q32_TOKEN_CHUNK : n_tok;
        for (int64_t t = c; t < c1; t++) {
            act_q8_view a = act_q8_at((const uint8_t *)X + t * (int64_t)x_stride, n);
            for (int64_t p = 0; p < np; p++)
                q32_token(q4, a, p, &xt[(t - c) * np + p]);
        }
        for (int64_t r = r0; r < r1; r += TILE_R) {
            tile_rows(W, w_stride, r, r1, TILE_R, rows);
            for (int i = 0; i < TILE_R; i++) {
                for (int64_t p = 0; p < nb / 2; p++)
                    q32_decode(q4, rows[i], p, true, &pk[i * np + p]);
                if (nb & 1)
                    q32_decode(q4, rows[i], nb / 2, false, &pk[i * np + nb / 2]);
            }
            int64_t nr = r1 - r < TILE_R ? r1 - r : TILE_R;
            for (int64_t t = c; t < c1; t += TILE_T) {
                int64_t nt = c1 - t < TILE_T ? c1 - t : TILE_T;
#define Q32_TILE(T) q32_tile(T, pk, np, xt + (t - c) * np, out)
                WITH_CONST_T(nt, TILE_T, Q32_TILE)
#undef Q32_TILE
                store_tile(Y, ldy, r, nr, t, nt, out);
            }
        }
    }
    free(xt);
    free(pk);
}

BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q4_0, q32_matmul, true)
BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q8_0, q32_matmul, false)

/* ------------------------------------------------------------------- R16 ----
 * Q4_0/Q8_0 repacked at load (kernels_internal.h). Per block and token: the 16 rows'
 * integer sums in 16 lanes from eight vpdpbusd whose signed side is the token's 4 bytes
 * broadcast (two chains of four, summed: integers, so the split is free), then one
 * convert, one scale product and one FMA for all 16 rows. The weight side of a block is
 * decoded once per tile of up to 16 tokens for Q8_0 and 8 for Q4_0, whose weight side
 * costs more registers (eight nibble vectors unpacked from four loads): whole binaries
 * taking turns on the TinyLlama shape, 2 threads, measured Q4_0 with tiles of 8 against 16
 * at pp512 1.33-1.35x and 16 sequences' decode 1.27-1.32x, while Q8_0 decoded 9 sequences
 * 0.76-0.82x as fast with tiles of 8 and the same elsewhere (MEASURED.md, stop 30). */

#define R16_TILE_T 16
#define R16_Q4_TILE_T 8
#define R16_LOCAL_SIDE 2048
/* Q8_0 reads the tile layout (r16_xb) from two tokens on, Q4_0 from five. Q4_0's calls of
 * 2-4 tokens read straight from their rows: through the layout, its steps of 3-5 tokens
 * measured 1.6-1.9x a one-token step in some builds against 0.8-1.4x this way
 * (MEASURED.md); from five tokens on the layout is the cheaper. */
#define R16_Q4_TILED_MIN 5

typedef struct r16_w {
    __m512i q[8];
    __m512 d;
} r16_w;

/* A token's block as the Q4_0/Q8_0 tiles of several tokens read it: quants, scale and
 * start side by side, the tile's tokens next to each other block by block, so that one
 * pointer walks the tile. With a pointer per token into its converted row and its side
 * array, the compiler ran out of general registers from three tokens on, moved pointers
 * through vector registers and read each weight vector again for every token: a Q8_0
 * verify step of three tokens cost 1.56-1.72x a one-token step, four 1.78-1.92x (through
 * this layout 1.00-1.23x and 1.12-1.24x; MEASURED.md). The layout is made once per held
 * input (blade_matmul_input_hold), not in each of the many row pieces a step's threads
 * take: made per piece, it cost a two-token step 1.4x. */
typedef struct r16_xb {
    int8_t q[QK8_0];
    float d;
    int32_t start;
} r16_xb;
_Static_assert(sizeof(r16_xb) == R16_XB_BYTES, "r16_xb is what the input scratch is sized by");

/* The n_tok tokens of X into xb, tile by tile (each full but the last; a tile size divides
 * R16_TOKEN_CHUNK, so the driver's chunks start on tiles), block by block, token by token. */
TGT_F INLINE void r16_pack(uint32_t ktype, const void *X, size_t x_stride, int64_t n, int64_t n_tok, int64_t tile,
                           r16_xb *xb)
{
    for (int64_t t0 = 0; t0 < n_tok; t0 += tile) {
        int64_t nt = n_tok - t0 < tile ? n_tok - t0 : tile;
        for (int64_t tt = 0; tt < nt; tt++) {
            act_q8_view a = act_q8_at((const uint8_t *)X + (t0 + tt) * (int64_t)x_stride, n);
            r16_xb *o = xb + t0 * (n / QK8_0) + tt;
            for (int64_t b = 0; b < n / QK8_0; b++, o += nt) {
                _mm256_storeu_si256((__m256i *)o->q, _mm256_loadu_si256((const __m256i *)(a.q + QK8_0 * b)));
                o->d = a.d[b];
                o->start = r16_start(ktype, a.sum[b]);
            }
        }
    }
}

/* Q4_0's high nibbles are either shifted down here (hi16 false) or kept in place as 16
 * times their value (hi16 true), which saves the shift of every chunk at the price of one
 * shift of the high-nibble sum per token and block: the trade the one-token path takes,
 * where the weight side is decoded for a single token. */
TGT_F INLINE void r16_load(bool q4, bool hi16, bool reuse, const uint8_t *blk, r16_w *w)
{
    w->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const uint8_t *q = blk + R16_SCALES;
    if (q4) {
        const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
        for (int c = 0; c < R16_Q4_CHUNKS; c++) {
            __m512i v = _mm512_loadu_si512(q + 64 * c);
            /* in a register: left alone, compilers fold the load into both masks and read
             * every chunk twice */
            __asm__("" : "+v"(v));
            w->q[c] = _mm512_and_si512(v, low);
            w->q[c + 4] = hi16 ? _mm512_and_si512(v, high) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
    } else {
        for (int j = 0; j < R16_Q8_CHUNKS; j++) {
            w->q[j] = _mm512_loadu_si512(q + 64 * j);
            /* In a register for the 2- and 3-token tiles, whose every token gcc otherwise
             * reads each chunk again for (a 3-token tile ran 36 cycles a block from L2, 24
             * in registers). Elsewhere left to the compiler: one token ran 13-14 cycles a
             * block against 15-16 held, and tiles of 9-10 tokens spilled accumulators. */
            if (reuse)
                __asm__("" : "+v"(w->q[j]));
        }
    }
}

TGT_F INLINE __m512i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* acc + the 16 rows' 4-byte groups of w against the token's 4 bytes at x, with the
 * broadcast folded into the instruction's memory operand ({1to16}): compilers keep it a
 * separate broadcast, and the fold is worth about 3% of Q4_0 decode (with the single load
 * per chunk in r16_load above). */
TGT_Q INLINE __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t *x)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}

/* x: the token's block (32 quants, its scale, its start). Chunks 0-3 and 4-7 go to two
 * chains; with hi16 the second sums 16 times the high nibbles' products, a multiple of 16
 * that the arithmetic shift divides exactly. With four_chains each half goes to two chains
 * of two: integer sums, so the same bits. Q4_0's 4-token tile (the speculative verify of
 * three drafts) measured faster that way: the draft model's speed-up on the Q4_0 target
 * 1.82-1.99x against 1.43-1.79x in nine rounds, its 4-token steps 1.22-1.43x a one-token
 * step against 1.51-2.08x (MEASURED.md, stop 39). Only there: for every tile of several
 * tokens it made the 3-token step as much slower as the 4-token one faster. */
TGT_Q INLINE __m512 r16_step(const r16_w *w, bool hi16, bool four_chains, const int8_t *xq, float xd,
                            int32_t start, __m512 acc)
{
    __m512i s0 = _mm512_set1_epi32(start), s1 = _mm512_setzero_si512();
    if (four_chains) {
        __m512i s2 = _mm512_setzero_si512(), s3 = _mm512_setzero_si512();
        for (int j = 0; j < 4; j += 2) {
            s0 = dpbusd_bcast(s0, w->q[j], xq + 4 * j);
            s1 = dpbusd_bcast(s1, w->q[j + 1], xq + 4 * j + 4);
            s2 = dpbusd_bcast(s2, w->q[j + 4], xq + 16 + 4 * j);
            s3 = dpbusd_bcast(s3, w->q[j + 5], xq + 16 + 4 * j + 4);
        }
        s0 = _mm512_add_epi32(s0, s2);
        s1 = _mm512_add_epi32(s1, s3);
    } else
        for (int j = 0; j < 4; j++) {
            s0 = dpbusd_bcast(s0, w->q[j], xq + 4 * j);
            s1 = dpbusd_bcast(s1, w->q[j + 4], xq + 16 + 4 * j);
        }
    if (hi16)
        s1 = _mm512_srai_epi32(s1, 4);
    __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
    return _mm512_fmadd_ps(sum, _mm512_mul_ps(w->d, _mm512_set1_ps(xd)), acc);
}

/* T tokens from the tile layout x, or with direct (a constant, as stream) straight from
 * their rows: a decode step makes no layout. */
TGT_Q INLINE void r16_blocks(bool q4, int T, bool stream, bool direct, const uint8_t *group, int64_t nb,
                            const r16_xb *x, const r16_x *one, const uint8_t *end, __m512 *acc)
{
    size_t bb = r16_block_bytes(q4 ? BLADE_KTYPE_Q4_0_R16 : BLADE_KTYPE_Q8_0_R16);
    for (int64_t b = 0; b < nb; b++) {
        r16_w w;
        if (stream) {
            if (T == 1)
                prefetch_stream(group + b * bb, bb);
            else
                prefetch_stream_by(group + b * bb, bb, STREAM_AHEAD_TILE);
            touch_stream(group + b * bb, bb, end);
        }
        r16_load(q4, q4 && T == 1, T == 2 || T == 3, group + b * bb, &w);
        if (direct) {
            for (int t = 0; t < T; t++)
                acc[t] = r16_step(&w, q4 && T == 1, q4 && T == 4, one[t].q + QK8_0 * b, one[t].d[b], one[t].side[b],
                                  acc[t]);
            continue;
        }
        const r16_xb *xb = x + b * T;
        for (int t = 0; t < T; t++)
            acc[t] = r16_step(&w, q4 && T == 1, q4 && T == 4, xb[t].q, xb[t].d, xb[t].start, acc[t]);
    }
}

/* One group of 16 rows against T tokens; end: where the weight stream ends when this
 * tile is the one that pulls the group from memory (it then takes the stream's hints),
 * NULL when the group is already in cache. */
TGT_Q INLINE void r16_tile(bool q4, int T, bool direct, const uint8_t *group, int64_t nb, const r16_xb *x,
                          const r16_x *one, float *Y, int64_t ldy, const uint8_t *end)
{
    __m512 acc[R16_TILE_T];
    for (int t = 0; t < T; t++)
        acc[t] = _mm512_setzero_ps();
    /* two loops, not a test in one: the streaming loop is the decode path's hot loop, and
     * a test of `end` inside it cost Q4_0's four-sequence decode 0.86x */
    if (end)
        r16_blocks(q4, T, true, direct, group, nb, x, one, end, acc);
    else
        r16_blocks(q4, T, false, direct, group, nb, x, one, NULL, acc);
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(Y + t * ldy, acc[t]);
}

/* --------------------------------------------------------------- Q4_K R16 ----
 * Q4_K repacked at load (kernels_internal.h). Per super-block and token: each sub-block's
 * 16 row sums from eight vpdpbusd against the token's broadcast 4-byte groups, weighted by
 * the rows' sub-block scales (vpmulld) into one exact int32 sum; the mins meet the token's
 * sub-block activation sums, a pair of sub-blocks per vpdpwssd. Then the portable
 * kernel's two FMAs. Scales, mins and each sub-block's quants are decoded once per tile. */

#define K16_TILE_T 8
/* The tile that streams a group hints it like every other stream (stream_ahead.h). A
 * super-block is a long run of arithmetic per 2304 bytes: with no prefetch the stream
 * measured at about 38 GB/s on two cores against 45 with one, and the page touch without
 * it 22% slower than the prefetch alone. The K-quant streams touch two lines of each page
 * ahead (Q4_K here, Q6_K below; stream_ahead.h says why). */
#define K_TOUCH_LINES 2

/* Scale slots as int32 per sub-block, min slots as int16 pairs per pair of sub-blocks. */
TGT_F INLINE void k16_scales(const uint8_t *blk, __m512i sc[8], __m512i mp[4])
{
    const __m512i lo4 = _mm512_set1_epi8(0x0F), lo2 = _mm512_set1_epi8(0x03);
    __m512i l0 = _mm512_loadu_si512(blk + R16_K_LOW), l1 = _mm512_loadu_si512(blk + R16_K_LOW + 64);
    __m512i h = _mm512_loadu_si512(blk + R16_K_HIGH);
    uint8_t bytes[256];
    _mm512_storeu_si512(bytes, _mm512_or_si512(_mm512_and_si512(l0, lo4), _mm512_slli_epi16(_mm512_and_si512(h, lo2), 4)));
    _mm512_storeu_si512(bytes + 64, _mm512_or_si512(_mm512_and_si512(l1, lo4),
                                                    _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2), lo2), 4)));
    _mm512_storeu_si512(bytes + 128,
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), lo4),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 4), lo2), 4)));
    _mm512_storeu_si512(bytes + 192,
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), lo4),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 6), lo2), 4)));
    for (int j = 0; j < 8; j++)
        sc[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16 * j)));
    for (int i = 0; i < 4; i++)
        mp[i] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(bytes + 128 + 32 * i)));
}

/* One sub-block of 16 rows against a token's 32 quants, weighted by the rows' scales. */
TGT_Q INLINE __m512i k16_sub(const __m512i w[8], const int8_t *xq, __m512i sc)
{
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int g = 0; g < 8; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[g], bcast4(xq + 4 * g));
        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], bcast4(xq + 4 * g + 4));
    }
    return _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc);
}

TGT_Q INLINE void k16_tile(int T, const uint8_t *group, int64_t nsb, const r16_x *x, float *Y, int64_t ldy,
                          const uint8_t *end, bool stream)
{
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi4 = _mm512_set1_epi8((char)0xF0);
    __m512 acc[K16_TILE_T];
    for (int t = 0; t < T; t++)
        acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *blk = group + b * R16_K_BYTES;
        if (stream) {
            prefetch_stream(blk, R16_K_BYTES);
            touch_stream_lines(blk, R16_K_BYTES, end, K_TOUCH_LINES);
        }
        __m512i sc[8], mp[4], isum[K16_TILE_T];
        k16_scales(blk, sc, mp);
        for (int t = 0; t < T; t++)
            isum[t] = _mm512_setzero_si512();
        if (T <= 2) {
            /* one pass over each chunk for sub-blocks 2c (low nibbles) and 2c+1 (high):
             * a strictly sequential stream, which the one-token path wants. The high
             * nibbles stay in place, 16 times their value, and the shift divides their
             * weighted sum exactly: a shift less per chunk, 1.03x on Q4_K_M decode. */
            for (int c = 0; c < 4; c++) {
                __m512i lo[8], hi[8];
                for (int g = 0; g < 8; g++) {
                    __m512i v = _mm512_loadu_si512(blk + R16_K_QS + 64 * (8 * c + g));
                    __asm__("" : "+v"(v)); /* one load per chunk, as in r16_load */
                    lo[g] = _mm512_and_si512(v, lo4);
                    hi[g] = _mm512_and_si512(v, hi4);
                }
                for (int t = 0; t < T; t++) {
                    const int8_t *xq = x[t].q + QK_K * b + 2 * K_SUB * c;
                    __m512i hi16 = k16_sub(hi, xq + K_SUB, sc[2 * c + 1]);
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(k16_sub(lo, xq, sc[2 * c]),
                                                                         _mm512_srai_epi32(hi16, 4)));
                }
            }
        } else {
            /* one sub-block at a time: half the weight registers, so wider tiles fit */
            for (int j = 0; j < 8; j++) {
                __m512i w[8];
                for (int g = 0; g < 8; g++) {
                    __m512i v = _mm512_loadu_si512(blk + R16_K_QS + 64 * (8 * (j / 2) + g));
                    w[g] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, lo4);
                }
                for (int t = 0; t < T; t++)
                    isum[t] = _mm512_add_epi32(isum[t], k16_sub(w, x[t].q + QK_K * b + K_SUB * j, sc[j]));
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + R16_K_D)));
        __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + R16_K_DMIN)));
        for (int t = 0; t < T; t++) {
            __m512i msum = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++)
                msum = _mm512_dpwssd_epi32(msum, mp[i], _mm512_set1_epi32(x[t].side[4 * b + i]));
            __m512 dx = _mm512_set1_ps(x[t].d[b]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, dx), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), acc[t]);
        }
    }
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(Y + t * ldy, acc[t]);
}

/* --------------------------------------------------------------- Q6_K R16 ----
 * Q6_K repacked at load (kernels_internal.h). Per sub-block and token: the 16 rows' dot
 * products from four vpdpbusd against the token's broadcast 4-byte groups, started from
 * the side (-32 times the activation sum: the quants are q+32), weighted by the rows'
 * scales (vpmulld) into one exact int32 sum per super-block; then one FMA. The quants are
 * decoded once per tile, a pair of sub-blocks at a time. */

#define K6_TILE_T 8

/* vgf2p8affineqb: every byte of x through the 8x8 bit matrix (gf2_bit_move). Written as
 * asm so that no function here needs a GFNI target, which would let the compiler use the
 * instruction on its own in kernels that run where the CPU lacks it; this one runs only
 * where the CPU reports GFNI. */
TGT_F INLINE __m512i gf2_affine(__m512i x, uint64_t matrix)
{
    __m512i r, m = _mm512_set1_epi64((long long)matrix);
    __asm__("vgf2p8affineqb $0, %2, %1, %0" : "=v"(r) : "v"(x), "v"(m));
    return r;
}

/* Sub-blocks 4s+2i (lo) and 4s+2i+1 (hi) of the quarter at q, elements 4g..4g+3 in
 * vector g, as bytes 0..63. Their top bits sit at bits 4i..4i+1 and 4i+2..4i+3 of the
 * quarter's top-bit chunks. With GFNI, one instruction moves a field to its place and
 * clears the rest of the byte, and one ternary-logic instruction merges the low nibble:
 * 5 operations per vector pair instead of 9. That made the one-token Q6_K kernel 1.09-1.22x
 * faster from L2 on one thread (tiles of 2-16 tokens 1.02-1.06x) and Q4_K_M decode 1.09x
 * (switched inside one process, every one of 10 rounds faster). Without GFNI, one shift of
 * the chunk puts the second sub-block's top bits at 4-5 and a further left shift by 2 the
 * first's (16-bit shifts: what crosses a byte is masked). */
TGT_F INLINE void k6_pair(bool gfni, const uint8_t *q, int i, __m512i lo[4], __m512i hi[4])
{
    const __m512i lo4 = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    for (int g = 0; g < 4; g++) {
        __m512i l = _mm512_loadu_si512(q + 64 * (4 * i + g));
        __m512i h = _mm512_loadu_si512(q + 64 * (8 + g));
        if (gfni) {
            __m512i top_lo = gf2_affine(h, gf2_bit_move(4 * i, 4, 2));
            __m512i top_hi = gf2_affine(h, gf2_bit_move(4 * i + 2, 4, 2));
            lo[g] = _mm512_ternarylogic_epi32(l, top_lo, lo4, 0xEC); /* (l & lo4) | top_lo */
            hi[g] = _mm512_or_si512(gf2_affine(l, gf2_bit_move(4, 0, 4)), top_hi);
        } else {
            __m512i hs = i == 0 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
            lo[g] = _mm512_or_si512(_mm512_and_si512(l, lo4), _mm512_and_si512(_mm512_slli_epi16(hs, 2), top));
            hi[g] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), lo4), _mm512_and_si512(hs, top));
        }
    }
}

TGT_Q INLINE __m512i k6_sub(const __m512i w[4], const int8_t *xq, int32_t start, __m512i sc)
{
    __m512i s = _mm512_set1_epi32(start);
    for (int g = 0; g < 4; g++)
        s = _mm512_dpbusd_epi32(s, w[g], bcast4(xq + 4 * g));
    return _mm512_mullo_epi32(s, sc);
}

TGT_Q INLINE void k6_tile(bool gfni, int T, const uint8_t *group, int64_t nsb, const r16_x *x, float *Y, int64_t ldy,
                         const uint8_t *end, bool stream)
{
    __m512 acc[K6_TILE_T];
    for (int t = 0; t < T; t++)
        acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *blk = group + b * R16_K6_BYTES;
        if (stream) {
            prefetch_stream(blk, R16_K6_BYTES);
            touch_stream_lines(blk, R16_K6_BYTES, end, K_TOUCH_LINES);
        }
        __m512i isum[K6_TILE_T];
        for (int t = 0; t < T; t++)
            isum[t] = _mm512_setzero_si512();
        for (int s = 0; s < 4; s++)
            for (int i = 0; i < 2; i++) {
                int j = 4 * s + 2 * i;
                __m512i lo[4], hi[4];
                k6_pair(gfni, blk + R16_K6_QS + R16_K6_QUARTER * s, i, lo, hi);
                __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + R16_K6_SCALES + 16 * j)));
                __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + R16_K6_SCALES + 16 * j + 16)));
                for (int t = 0; t < T; t++) {
                    const int8_t *xq = x[t].q + QK_K * b + 16 * j;
                    const int32_t *start = x[t].side + 16 * b + j;
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(k6_sub(lo, xq, start[0], sc0),
                                                                         k6_sub(hi, xq + 16, start[1], sc1)));
                }
            }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + R16_K6_D)));
        for (int t = 0; t < T; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, _mm512_set1_ps(x[t].d[b])), acc[t]);
    }
    for (int t = 0; t < T; t++)
        _mm512_storeu_ps(Y + t * ldy, acc[t]);
}

/* ------------------------------------------------------------ R16 driver ----
 * Tokens in chunks that stay in L2 while every row group of the range passes over them;
 * within a chunk, tiles of tokens against one group at a time. */

/* gfni: decode Q6_K with GFNI (k6_pair); only the Q6_K kernel chosen where the CPU has it
 * passes true. */
TGT_Q INLINE void r16_matmul(uint32_t ktype, bool gfni, const void *W, size_t w_stride, const void *X, size_t x_stride,
                             int64_t n, float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    bool k4 = ktype == BLADE_KTYPE_Q4_K_R16, k6 = ktype == BLADE_KTYPE_Q6_K_R16;
    int64_t nb = n / r16_block_elems(ktype), per_token = r16_side_per_token(ktype, n);
    int64_t tile = k4 ? K16_TILE_T : k6 ? K6_TILE_T : ktype == BLADE_KTYPE_Q4_0_R16 ? R16_Q4_TILE_T : R16_TILE_T;
    int64_t chunk = n_tok < R16_TOKEN_CHUNK ? n_tok : R16_TOKEN_CHUNK;
    /* small calls (one token, short rows) are common in decode: no allocation for them */
    int32_t local[R16_LOCAL_SIDE];
    int32_t *side = chunk * per_token <= R16_LOCAL_SIDE ? local : pack_alloc(sizeof(int32_t) * (size_t)(chunk * per_token));
    r16_x x[R16_TOKEN_CHUNK];
    /* Q4_0/Q8_0 with several tokens: the tile layout, made once per held input when its
     * scratch holds it */
    input_memo *memo = &blade_input_memo;
    bool tiled = !k4 && !k6 && n_tok >= (ktype == BLADE_KTYPE_Q4_0_R16 ? R16_Q4_TILED_MIN : 2);
    bool keep = tiled && memo->held && (size_t)(n_tok * nb) * sizeof(r16_xb) <= memo->bytes;
    r16_xb *xb = !tiled ? NULL : keep ? memo->scratch : pack_alloc(sizeof(r16_xb) * (size_t)(chunk * nb));
    bool kept = keep && memo->filled && memo->x == X && memo->x_stride == x_stride && memo->n == n &&
                memo->n_tok == n_tok && memo->ktype == ktype;
    /* held: every token's layout at once, chunk c's tiles from xb + c * nb; otherwise one
     * chunk's at a time */
    if (keep && !kept) {
        *memo = (input_memo){.scratch = memo->scratch, .bytes = memo->bytes, .held = true, .filled = true,
                             .x = X, .x_stride = x_stride, .n = n, .n_tok = n_tok, .ktype = ktype};
        r16_pack(ktype, X, x_stride, n, n_tok, tile, xb);
    }
    const uint8_t *end = (const uint8_t *)W + r1 * (int64_t)w_stride;
    for (int64_t c = 0; c < n_tok; c += R16_TOKEN_CHUNK) {
        int64_t c1 = c + R16_TOKEN_CHUNK < n_tok ? c + R16_TOKEN_CHUNK : n_tok;
        const r16_xb *xc = keep ? xb + c * nb : xb;
        if (tiled && !keep)
            r16_pack(ktype, (const uint8_t *)X + c * (int64_t)x_stride, x_stride, n, c1 - c, tile, xb);
        else if (!tiled)
            for (int64_t t = c; t < c1; t++)
                x[t - c] = r16_token(ktype, (const uint8_t *)X + t * (int64_t)x_stride, n, side + (t - c) * per_token);
        for (int64_t g = r0; g < r1; g += BLADE_R16_ROWS) {
            const uint8_t *group = (const uint8_t *)W + g * (int64_t)w_stride;
            for (int64_t t = c; t < c1; t += tile) {
                int64_t nt = c1 - t < tile ? c1 - t : tile;
                const r16_x *xt = x + (t - c);
                float *y = Y + t * ldy + g;
                /* The chunk's first tile pulls the group from memory: a decode, a
                 * speculative verify or a chunk of prefill alike stream it once, and that
                 * stream wants the hints of stream_ahead.h. Later tiles find it in cache. */
                const uint8_t *hint = t == c ? end : NULL;
/* the K-quant tiles take `stream` (hint is set) as a constant for the same reason as
 * r16_tile's two loops */
#define K16_TILE(T) (hint ? k16_tile(T, group, nb, xt, y, ldy, hint, true) : k16_tile(T, group, nb, xt, y, ldy, NULL, false))
#define K6_TILE(T)                                                                                             \
    (hint ? k6_tile(gfni, T, group, nb, xt, y, ldy, hint, true) : k6_tile(gfni, T, group, nb, xt, y, ldy, NULL, false))
#define R16_DIRECT(T) r16_tile(ktype == BLADE_KTYPE_Q4_0_R16, T, true, group, nb, NULL, xt, y, ldy, hint)
#define R16_TILE(T) r16_tile(ktype == BLADE_KTYPE_Q4_0_R16, T, false, group, nb, xc + (t - c) * nb, NULL, y, ldy, hint)
                if (k4) {
                    WITH_CONST_T(nt, K16_TILE_T, K16_TILE)
                } else if (k6) {
                    WITH_CONST_T(nt, K6_TILE_T, K6_TILE)
                } else if (tiled) {
                    WITH_CONST_T16(nt, R16_TILE)
                } else if (ktype == BLADE_KTYPE_Q4_0_R16) {
                    WITH_CONST_T(nt, R16_Q4_TILED_MIN - 1, R16_DIRECT)
                } else {
                    R16_DIRECT(1);
                }
#undef K16_TILE
#undef K6_TILE
#undef R16_TILE
#undef R16_DIRECT
            }
        }
    }
    if (side != local)
        free(side);
    if (tiled && !keep)
        free(xb);
}

BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q4_0_r16, r16_matmul, BLADE_KTYPE_Q4_0_R16, false)
BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q8_0_r16, r16_matmul, BLADE_KTYPE_Q8_0_R16, false)
BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q4_k_r16, r16_matmul, BLADE_KTYPE_Q4_K_R16, false)
BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q6_k_r16, r16_matmul, BLADE_KTYPE_Q6_K_R16, false)
BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q6_k_r16_gfni, r16_matmul, BLADE_KTYPE_Q6_K_R16, true)

/* ------------------------------------------------------------ Q4_K, Q5_K, Q6_K ----
 * Unit: a 256 super-block as four 64-byte vectors of unsigned quants in natural element
 * order. vpmaddubsw pairs them with the int8 activations (|q| <= 63 and |x| <= 127 keep
 * the int16 pair sums below 2^15), vpdpwssd weights each pair by its sub-block scale
 * into int32, exact over the super-block. Q4_K/Q5_K mins meet the activation group sums
 * in one vpmaddwd and a second FMA (they carry their own scale dmin); Q6_K's -32 offset
 * shares the main scale and joins the integer sum. */

typedef struct k_dec {
    __m512i q[4];
    __m512i sc[4]; /* int16 scale of each maddubs lane */
    __m512i m;     /* Q4_K/Q5_K: mins per pair of 16-sums; Q6_K: -32*scale per 16-sum */
    float d, dmin;
} k_dec;

enum k_kind { K4, K5, K6 };

TGT_F INLINE __m512i nibbles_64(const uint8_t *qs32)
{
    /* Low nibbles of the 32 bytes are the first 32 elements, high nibbles the next 32. */
    __m512i z = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qs32));
    z = _mm512_srlv_epi16(z, _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004, 0x0004000400040004,
                                               0x0004000400040004, 0x0004000400040004));
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

TGT_F INLINE void k45_scales(const uint8_t *scales, k_dec *o)
{
    uint32_t w0, w1, w2;
    memcpy(&w0, scales, 4);
    memcpy(&w1, scales + 4, 4);
    memcpy(&w2, scales + 8, 4);
    /* Same unpacking as blade_k_scale_min, four sub-blocks at a time. */
    uint32_t sc_lo = w0 & 0x3F3F3F3F, m_lo = w1 & 0x3F3F3F3F;
    uint32_t sc_hi = (w2 & 0x0F0F0F0F) | ((w0 >> 2) & 0x30303030);
    uint32_t m_hi = ((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030);
    __m512i s16 = _mm512_castsi256_si512(
        _mm256_cvtepu8_epi16(_mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)m_lo, (int)m_hi)));
    for (int p = 0; p < 4; p++) {
        __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(2 * p))),
                                         _mm256_set1_epi16((short)(2 * p + 1)), 1);
        o->sc[p] = _mm512_permutexvar_epi16(idx, s16);
    }
    /* The activation sums sit in the low 16 int16 lanes (upper lanes zero), so only the
     * low half of the pattern matters: min j for 16-sums 2j and 2j+1. */
    o->m = _mm512_permutexvar_epi16(_mm512_setr_epi64(0x0009000900080008, 0x000B000B000A000A, 0x000D000D000C000C,
                                                      0x000F000F000E000E, 0, 0, 0, 0),
                                    s16);
}

TGT_F INLINE void q4_k_decode(const uint8_t *w, int64_t b, k_dec *o)
{
    const uint8_t *blk = w + b * (int64_t)sizeof(block_q4_k);
    uint16_t h[2];
    memcpy(h, blk, 4);
    o->d = _cvtsh_ss(h[0]);
    o->dmin = _cvtsh_ss(h[1]);
    k45_scales(blk + offsetof(block_q4_k, scales), o);
    for (int p = 0; p < 4; p++)
        o->q[p] = nibbles_64(blk + offsetof(block_q4_k, qs) + 32 * p);
}

TGT_F INLINE void q5_k_decode(const uint8_t *w, int64_t b, k_dec *o)
{
    const uint8_t *blk = w + b * (int64_t)sizeof(block_q5_k);
    uint16_t h[2];
    memcpy(h, blk, 4);
    o->d = _cvtsh_ss(h[0]);
    o->dmin = _cvtsh_ss(h[1]);
    k45_scales(blk + offsetof(block_q5_k, scales), o);
    __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + offsetof(block_q5_k, qh))));
    /* Sub-block j's fifth bits are bit j of qh[0..31]: bit 2p for the low half of vector
     * p, bit 2p+1 for the high half. */
    __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(1), _mm256_set1_epi8(2), 1);
    for (int p = 0; p < 4; p++) {
        __m512i q = nibbles_64(blk + offsetof(block_q5_k, qs) + 32 * p);
        o->q[p] = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh, bit), q, _mm512_set1_epi8(16));
        bit = _mm512_slli_epi16(bit, 2);
    }
}

TGT_F INLINE void q6_k_decode(const uint8_t *w, int64_t b, k_dec *o)
{
    const uint8_t *blk = w + b * (int64_t)sizeof(block_q6_k);
    uint16_t h;
    memcpy(&h, blk + offsetof(block_q6_k, d), 2);
    o->d = _cvtsh_ss(h);
    o->dmin = 0.0f;
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    for (int half = 0; half < 2; half++) {
        __m512i ql = _mm512_loadu_si512(blk + offsetof(block_q6_k, ql) + 64 * half);
        __m512i qh = _mm512_broadcast_i64x4(
            _mm256_loadu_si256((const __m256i *)(blk + offsetof(block_q6_k, qh) + 32 * half)));
        /* Elements 128h + 32c + l take bits 2c..2c+1 of qh[l]; moved to bits 4-5 by a
         * left shift of 4, 2 (runs 0, 1) or a right shift of 0, 2 (runs 2, 3). Cross-byte
         * spill from the 16-bit shifts lands outside the 0x30 mask. */
        __m512i h01 = _mm512_and_si512(_mm512_sllv_epi16(qh, _mm512_setr_epi64(
                                                                 0x0004000400040004, 0x0004000400040004,
                                                                 0x0004000400040004, 0x0004000400040004,
                                                                 0x0002000200020002, 0x0002000200020002,
                                                                 0x0002000200020002, 0x0002000200020002)),
                                       hi2);
        __m512i h23 = _mm512_and_si512(_mm512_srlv_epi16(qh, _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002,
                                                                                 0x0002000200020002,
                                                                                 0x0002000200020002,
                                                                                 0x0002000200020002)),
                                       hi2);
        o->q[2 * half] = _mm512_or_si512(_mm512_and_si512(ql, lo4), h01);
        o->q[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4), h23);
    }
    __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + offsetof(block_q6_k, scales))));
    __m512i s = _mm512_castsi256_si512(s16);
    for (int c = 0; c < 4; c++) {
        /* Vector c holds groups 4c..4c+3, eight int16 lanes each. */
        __m512i idx = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_setr_m128i(_mm_set1_epi16((short)(4 * c)), _mm_set1_epi16((short)(4 * c + 1)))),
            _mm256_setr_m128i(_mm_set1_epi16((short)(4 * c + 2)), _mm_set1_epi16((short)(4 * c + 3))), 1);
        o->sc[c] = _mm512_permutexvar_epi16(idx, s);
    }
    o->m = _mm512_zextsi256_si512(_mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(s16, 5)));
}

TGT_F INLINE void k_decode(enum k_kind kind, const uint8_t *w, int64_t b, k_dec *o)
{
    if (kind == K4)
        q4_k_decode(w, b, o);
    else if (kind == K5)
        q5_k_decode(w, b, o);
    else
        q6_k_decode(w, b, o);
}

TGT_Q INLINE __m512i k_dot64(__m512i acc, __m512i q, const int8_t *x, __m512i sc)
{
    return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q, _mm512_loadu_si512(x)), sc);
}

/* The float part of one super-block for one (row, token); isum holds the exact
 * scale-weighted quant sums. */
TGT_Q INLINE __m512 k_finish(enum k_kind kind, const k_dec *w, __m512i isum, __m512i xs, float dx, __m512 acc)
{
    if (kind == K6) {
        isum = _mm512_dpwssd_epi32(isum, xs, w->m);
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(w->d * dx), acc);
    }
    __m512i msum = _mm512_madd_epi16(xs, w->m);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(w->d * dx), acc);
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_set1_ps(w->dmin * dx), acc);
}

TGT_Q INLINE __m512i k_sums(act_k_view a, int64_t b)
{
    return _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(a.sum16 + 16 * b)));
}

TGT_Q INLINE float k_gemv(enum k_kind kind, const uint8_t *row, act_k_view a, int64_t nsb)
{
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        k_dec w;
        k_decode(kind, row, b, &w);
        __m512i isum = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++)
            isum = k_dot64(isum, w.q[p], a.q + QK_K * b + 64 * p, w.sc[p]);
        acc = k_finish(kind, &w, isum, k_sums(a, b), a.d[b], acc);
    }
    return hsum(acc);
}

TGT_Q INLINE void k_tile(enum k_kind kind, int T, const k_dec *pk, int64_t nsb, const act_k_view *xa, float *out)
{
    __m512 acc[TILE_R][TILE_T];
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m512i isum[TILE_R][TILE_T];
        for (int r = 0; r < TILE_R; r++)
            for (int t = 0; t < T; t++)
                isum[r][t] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            __m512i q[TILE_R];
            for (int r = 0; r < TILE_R; r++)
                q[r] = pk[r * nsb + b].q[p];
            for (int t = 0; t < T; t++) {
                const int8_t *x = xa[t].q + QK_K * b + 64 * p;
                for (int r = 0; r < TILE_R; r++)
                    isum[r][t] = k_dot64(isum[r][t], q[r], x, pk[r * nsb + b].sc[p]);
            }
        }
        for (int t = 0; t < T; t++) {
            __m512i xs = k_sums(xa[t], b);
            float dx = xa[t].d[b];
            for (int r = 0; r < TILE_R; r++)
                acc[r][t] = k_finish(kind, &pk[r * nsb + b], isum[r][t], xs, dx, acc[r][t]);
        }
    }
    for (int r = 0; r < TILE_R; r++)
        for (int t = 0; t < T; t++)
            out[r * TILE_T + t] = hsum(acc[r][t]);
}

TGT_Q INLINE void k_matmul(enum k_kind kind, const void *W, size_t w_stride, const void *X, size_t x_stride,
                           int64_t n, float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
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
                store_tile(Y, ldy, r, nr, t, nt, out);
            }
        }
    }
    free(pk);
}

BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q4_k, k_matmul, K4)
BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q5_k, k_matmul, K5)
BLADE_DRIVEN_KERNEL(TGT_Q, blade_mm_avx512_q6_k, k_matmul, K6)

/* ------------------------------------------------------------ F32, F16, BF16 ----
 * Unit: 16 weights (32 for vdpbf16ps) against f32 (bf16) activations, one FMA per unit
 * and (row, token). Nothing to decode once per tile beyond a conversion, so tiles read
 * the weights in place; a row's tail past the last full unit is a masked load (the
 * activation padding is zero). */

enum f_kind { F32, F16 };

/* 18 accumulators plus 3 weight vectors; a 4 x 6 tile (29 registers) measured at half
 * the throughput of this one. */
#define F_TILE_R 3
#define F_TILE_T 6

TGT_F INLINE __m512 f_load(enum f_kind kind, const uint8_t *w, int64_t u, __mmask16 m)
{
    if (kind == F32)
        return _mm512_maskz_loadu_ps(m, w + 64 * u);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w + 32 * u));
}

TGT_F INLINE void f_step(enum f_kind kind, int R, int T, const uint8_t *const *rows, const float *const *xs, int64_t u,
                         __mmask16 m, __m512 acc[][F_TILE_T])
{
    __m512 w[F_TILE_R];
    for (int r = 0; r < R; r++)
        w[r] = f_load(kind, rows[r], u, m);
    for (int t = 0; t < T; t++) {
        __m512 x = _mm512_loadu_ps(xs[t] + 16 * u);
        for (int r = 0; r < R; r++)
            acc[r][t] = _mm512_fmadd_ps(w[r], x, acc[r][t]);
    }
}

/* Each output sums its units in F_STRIPES interleaved partial sums (unit u into partial
 * u % F_STRIPES), combined as (p0 + p1) + (p2 + p3) before the horizontal sum: with one
 * chain, the one-token path would run at one unit per FMA latency, well below what memory
 * delivers. That path keeps the partials in registers over a single pass of the row (one
 * sequential stream); tiles, short of registers, make one pass per partial over their
 * cache-resident rows. Both do the same operations for every output. */
#define F_STRIPES 4

TGT_F INLINE float stripes_sum(const __m512 *p)
{
    return hsum(_mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
}

TGT_F INLINE void f_keep_part(int R, int T, __m512 acc[][F_TILE_T], __m512 part[][F_TILE_T])
{
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            part[r][t] = acc[r][t];
}

TGT_F INLINE void f_parts_sum(int R, int T, __m512 part[F_STRIPES][F_TILE_R][F_TILE_T], float *out)
{
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            __m512 p[F_STRIPES];
            for (int k = 0; k < F_STRIPES; k++)
                p[k] = part[k][r][t];
            out[r * F_TILE_T + t] = stripes_sum(p);
        }
}

/* One weight row against one token: the arithmetic of f_tile with R = T = 1, partial k
 * taking units k, k + F_STRIPES, ..., with the stream hints of the one-token paths. */
TGT_F INLINE float f_row(enum f_kind kind, const uint8_t *row, const float *x, int64_t n, const uint8_t *end)
{
    const size_t unit_bytes = kind == F16 ? 32 : 64;
    int64_t nu = n / 16;
    __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1);
    touch_stream(row, (size_t)n * (kind == F16 ? 2 : 4), end);
    __m512 p[F_STRIPES];
    for (int k = 0; k < F_STRIPES; k++)
        p[k] = _mm512_setzero_ps();
    int64_t u = 0;
    for (; u + F_STRIPES <= nu; u += F_STRIPES) {
        prefetch_stream(row + unit_bytes * (size_t)u, F_STRIPES * unit_bytes);
        for (int k = 0; k < F_STRIPES; k++)
            p[k] = _mm512_fmadd_ps(f_load(kind, row, u + k, (__mmask16)0xFFFF), _mm512_loadu_ps(x + 16 * (u + k)), p[k]);
    }
    /* u is a multiple of F_STRIPES, so unit u + k belongs to partial k: constant indices
     * keep the partials in registers (an indexed one lives on the stack). */
    for (int k = 0; k < F_STRIPES; k++) {
        __mmask16 m = u + k < nu ? (__mmask16)0xFFFF : u + k == nu ? tail : 0;
        if (m)
            p[k] = _mm512_fmadd_ps(f_load(kind, row, u + k, m), _mm512_loadu_ps(x + 16 * (u + k)), p[k]);
    }
    return stripes_sum(p);
}

TGT_F INLINE void f_tile(enum f_kind kind, int R, int T, const uint8_t *const *rows, const float *const *xs, int64_t n,
                         float *out)
{
    int64_t nu = n / 16;
    __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1);
    __m512 part[F_STRIPES][F_TILE_R][F_TILE_T];
    for (int k = 0; k < F_STRIPES; k++) {
        __m512 acc[F_TILE_R][F_TILE_T];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm512_setzero_ps();
        for (int64_t u = k; u < nu; u += F_STRIPES)
            f_step(kind, R, T, rows, xs, u, (__mmask16)0xFFFF, acc);
        if (tail && nu % F_STRIPES == k)
            f_step(kind, R, T, rows, xs, nu, tail, acc);
        f_keep_part(R, T, acc, part[k]);
    }
    f_parts_sum(R, T, part, out);
}

TGT_BF INLINE void bf16_step(int R, int T, const uint8_t *const *rows, const uint16_t *const *xs, int64_t u,
                             __mmask32 m, __m512 acc[][F_TILE_T])
{
    __m512bh w[F_TILE_R];
    for (int r = 0; r < R; r++)
        w[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, rows[r] + 64 * u);
    for (int t = 0; t < T; t++) {
        __m512bh x = (__m512bh)_mm512_loadu_si512(xs[t] + 32 * u);
        for (int r = 0; r < R; r++)
            acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w[r], x);
    }
}

/* As f_row, for BF16 weights against a BF16 token. */
TGT_BF INLINE float bf16_row(const uint8_t *row, const uint16_t *x, int64_t n, const uint8_t *end)
{
    int64_t nu = n / 32;
    __mmask32 tail = (__mmask32)((1ull << (n % 32)) - 1);
    touch_stream(row, (size_t)n * 2, end);
    __m512 p[F_STRIPES];
    for (int k = 0; k < F_STRIPES; k++)
        p[k] = _mm512_setzero_ps();
    int64_t u = 0;
    for (; u + F_STRIPES <= nu; u += F_STRIPES) {
        prefetch_stream(row + 64 * (size_t)u, F_STRIPES * 64);
        for (int k = 0; k < F_STRIPES; k++)
            p[k] = _mm512_dpbf16_ps(p[k], (__m512bh)_mm512_loadu_si512(row + 64 * (u + k)),
                                    (__m512bh)_mm512_loadu_si512(x + 32 * (u + k)));
    }
    for (int k = 0; k < F_STRIPES; k++) { /* as in f_row */
        __mmask32 m = u + k < nu ? (__mmask32)0xFFFFFFFF : u + k == nu ? tail : 0;
        if (m)
            p[k] = _mm512_dpbf16_ps(p[k], (__m512bh)_mm512_maskz_loadu_epi16(m, row + 64 * (u + k)),
                                    (__m512bh)_mm512_loadu_si512(x + 32 * (u + k)));
    }
    return stripes_sum(p);
}

TGT_BF INLINE void bf16_tile(int R, int T, const uint8_t *const *rows, const uint16_t *const *xs, int64_t n,
                             float *out)
{
    int64_t nu = n / 32;
    __mmask32 tail = (__mmask32)((1ull << (n % 32)) - 1);
    __m512 part[F_STRIPES][F_TILE_R][F_TILE_T];
    for (int k = 0; k < F_STRIPES; k++) {
        __m512 acc[F_TILE_R][F_TILE_T];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm512_setzero_ps();
        for (int64_t u = k; u < nu; u += F_STRIPES)
            bf16_step(R, T, rows, xs, u, (__mmask32)0xFFFFFFFF, acc);
        if (tail && nu % F_STRIPES == k)
            bf16_step(R, T, rows, xs, nu, tail, acc);
        f_keep_part(R, T, acc, part[k]);
    }
    f_parts_sum(R, T, part, out);
}

/* Drives either tile function over the row range and token range. */
#define F_DRIVER(TGT, name, TILE, ROW, xtype)                                                                 \
    TGT void name(const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n, float *Y,         \
                  int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)                                         \
    {                                                                                                         \
        const uint8_t *rows[F_TILE_R];                                                                        \
        const xtype *xs[F_TILE_T];                                                                            \
        float out[F_TILE_R * F_TILE_T];                                                                       \
        const uint8_t *end = (const uint8_t *)W + r1 * (int64_t)w_stride;                                     \
        if (n_tok == 1) {                                                                                     \
            for (int64_t r = r0; r < r1; r++)                                                                 \
                Y[r] = ROW((const uint8_t *)W + r * (int64_t)w_stride, X, n, end);                            \
            return;                                                                                           \
        }                                                                                                     \
        for (int64_t c = 0; c < n_tok; c += TOKEN_CHUNK) {                                                    \
            int64_t c1 = c + TOKEN_CHUNK < n_tok ? c + TOKEN_CHUNK : n_tok;                                   \
            for (int64_t r = r0; r < r1; r += F_TILE_R) {                                                     \
                tile_rows(W, w_stride, r, r1, F_TILE_R, rows);                                                \
                int64_t nr = r1 - r < F_TILE_R ? r1 - r : F_TILE_R;                                           \
                for (int64_t i = 0; i < nr; i++) {                                                            \
                    prefetch_stream(rows[i], w_stride);                                                       \
                    touch_stream(rows[i], w_stride, end);                                                     \
                }                                                                                             \
                for (int64_t t = c; t < c1; t += F_TILE_T) {                                                  \
                    int64_t nt = c1 - t < F_TILE_T ? c1 - t : F_TILE_T;                                       \
                    for (int j = 0; j < nt; j++)                                                              \
                        xs[j] = (const xtype *)((const uint8_t *)X + (t + j) * (int64_t)x_stride);            \
                    WITH_CONST_T(nt, F_TILE_T, TILE##_FULL)                                                   \
                    for (int64_t j = 0; j < nt; j++)                                                          \
                        for (int64_t i = 0; i < nr; i++)                                                      \
                            Y[(t + j) * ldy + r + i] = out[i * F_TILE_T + j];                                 \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }

/* TILE_FULL(T) for full row tiles, ROW for the one-token path. */
#define TILE_F32(R, T) f_tile(F32, R, T, rows, xs, n, out)
#define TILE_F16(R, T) f_tile(F16, R, T, rows, xs, n, out)
#define TILE_BF16(R, T) bf16_tile(R, T, rows, xs, n, out)
#define TILE_F32_FULL(T) TILE_F32(F_TILE_R, T)
#define TILE_F16_FULL(T) TILE_F16(F_TILE_R, T)
#define TILE_BF16_FULL(T) TILE_BF16(F_TILE_R, T)
#define ROW_F32(row, x, n, end) f_row(F32, row, x, n, end)
#define ROW_F16(row, x, n, end) f_row(F16, row, x, n, end)
F_DRIVER(TGT_F, blade_mm_avx512_f32, TILE_F32, ROW_F32, float)
F_DRIVER(TGT_F, blade_mm_avx512_f16, TILE_F16, ROW_F16, float)
F_DRIVER(TGT_BF, blade_mm_avx512_bf16, TILE_BF16, bf16_row, uint16_t)

/* ---------------------------------------------------------- activation rows ----
 * Same arithmetic as matmul_scalar.c's portable converters, sixteen elements at a time. */

/* |x| with NaNs as zero, so the block maximum skips them as the scalar comparison does. */
TGT_F INLINE __m512 abs_ordered(__m512 x)
{
    __m512 a = _mm512_abs_ps(x);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), a);
}

TGT_F INLINE __m512i quantize16(__m512 x, __m512 id)
{
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(x, id));
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

TGT_F void blade_act_avx512_q8_0(const float *x, void *out, int64_t n)
{
    act_q8_view v = act_q8_at(out, n);
    int8_t *q = (int8_t *)v.q;
    float *d = (float *)v.d;
    int32_t *sum = (int32_t *)v.sum;
    for (int64_t b = 0; b < n / QK8_0; b++) {
        __m512 x0 = _mm512_loadu_ps(x + QK8_0 * b), x1 = _mm512_loadu_ps(x + QK8_0 * b + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(abs_ordered(x0), abs_ordered(x1)));
        if (!(amax >= 1e-30f))
            continue; /* stays zero, as blade_act_convert cleared it */
        __m512 id = _mm512_set1_ps(127.0f / amax);
        __m512i q0 = quantize16(x0, id), q1 = quantize16(x1, id);
        _mm_storeu_si128((__m128i *)(q + QK8_0 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + QK8_0 * b + 16), _mm512_cvtepi32_epi8(q1));
        sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        d[b] = amax / 127.0f;
    }
}

TGT_F void blade_act_avx512_q8_k(const float *x, void *out, int64_t n)
{
    act_k_view v = act_k_at(out, n);
    int8_t *q = (int8_t *)v.q;
    float *d = (float *)v.d;
    int16_t *sum16 = (int16_t *)v.sum16;
    for (int64_t b = 0; b < n / QK_K; b++) {
        const float *xb = x + QK_K * b;
        __m512 m = _mm512_setzero_ps();
        for (int g = 0; g < QK_K / 16; g++)
            m = _mm512_max_ps(m, abs_ordered(_mm512_loadu_ps(xb + 16 * g)));
        float amax = _mm512_reduce_max_ps(m);
        if (!(amax >= 1e-30f))
            continue;
        __m512 id = _mm512_set1_ps(127.0f / amax);
        for (int g = 0; g < QK_K / 16; g++) {
            __m512i qg = quantize16(_mm512_loadu_ps(xb + 16 * g), id);
            _mm_storeu_si128((__m128i *)(q + QK_K * b + 16 * g), _mm512_cvtepi32_epi8(qg));
            sum16[16 * b + g] = (int16_t)_mm512_reduce_add_epi32(qg);
        }
        d[b] = amax / 127.0f;
    }
}

TGT_F void blade_act_avx512_bf16(const float *x, void *out, int64_t n)
{
    uint16_t *o = out;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(k, x + i));
        /* Round to nearest even on the bits; NaNs keep their top bits, made quiet. */
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
        r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), nan,
                                  _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        _mm256_mask_storeu_epi16(o + i, k, _mm512_cvtepi32_epi16(r));
    }
}

#endif

#ifndef BLADE_KERNELS_INTERNAL_H
#define BLADE_KERNELS_INTERNAL_H

/* Shared between the kernel files: the converted-activation and R16 layouts, and the
 * helpers the ISA files build their kernels with (ktraits.h names the kernels). */

#include "blade/kernels.h"
#include "blade/types.h"
#include "kernels/ktraits.h"
#include "kernels/stream_ahead.h"
#include "tensor/quant_ref.h"

#include <stddef.h>
#include <stdint.h>

/* Converted activation rows. Every array of a row starts on a 64-byte boundary relative to
 * the row start and is zero-padded to a multiple of 64 bytes, so a kernel may load whole
 * vectors (up to 64 bytes) past the last element without leaving the row, and padded
 * elements contribute exact zeros.
 *
 * Q8 rows (for Q8_0 and Q4_0 weights), per block of 32: int8 q (x ~= d*q, |q| <= 127),
 * an f32 d and the int32 sum of the block's q (which turns a weight offset into one
 * integer multiply per block). Arrays: q[n], d[n/32], sum[n/32].
 *
 * K rows (for Q4_K, Q5_K and Q6_K weights), per super-block of 256: int8 q, an f32 d and
 * sixteen int16 sums of q over consecutive groups of 16. Arrays: q[n], d[n/256],
 * sum16[n/16].
 *
 * BF16 weights take bf16 activations (round to nearest even), F32 and F16 weights f32. */

#define ACT_ALIGN 64

static inline size_t act_pad(size_t bytes)
{
    return (bytes + ACT_ALIGN - 1) & ~(size_t)(ACT_ALIGN - 1);
}

typedef struct act_q8_view {
    const int8_t *q;
    const float *d;
    const int32_t *sum;
} act_q8_view;

typedef struct act_k_view {
    const int8_t *q;
    const float *d;
    const int16_t *sum16;
} act_k_view;

static inline act_q8_view act_q8_at(const void *row, int64_t n)
{
    const uint8_t *p = row;
    size_t qb = act_pad((size_t)n), db = act_pad((size_t)(n / QK8_0) * sizeof(float));
    return (act_q8_view){(const int8_t *)p, (const float *)(p + qb), (const int32_t *)(p + qb + db)};
}

static inline act_k_view act_k_at(const void *row, int64_t n)
{
    const uint8_t *p = row;
    size_t qb = act_pad((size_t)n), db = act_pad((size_t)(n / QK_K) * sizeof(float));
    return (act_k_view){(const int8_t *)p, (const float *)(p + qb), (const int16_t *)(p + qb + db)};
}

/* R16 layouts (kernels.h). A group of 16 rows is n/32 blocks of r16_block_bytes, each 16
 * fp16 scales (row order) followed by the quants in 64-byte chunks of 4 bytes per row:
 * Q4_0 chunk c holds bytes qs[4c..4c+3] of every row, so its low nibbles are elements
 * 4c..4c+3 and its high nibbles 16+4c..16+4c+3 (the "4-groups" c and c+4); Q8_0 chunk j
 * holds elements 4j..4j+3 of every row as unsigned q+128. A block's integer dot product
 * with a token starts from r16_start (the weight offset times the activation sum) so that
 * unsigned-by-signed byte products give the exact signed sum. */
#define R16_SCALES 32
#define R16_Q4_CHUNKS 4
#define R16_Q8_CHUNKS 8

static inline int32_t r16_start(uint32_t ktype, int32_t act_sum)
{
    return (ktype == BLADE_KTYPE_Q4_0_R16 ? -8 : -128) * act_sum;
}

/* Q4_K R16, per group and 256 super-block (R16_K_BYTES, the bytes of 16 file blocks):
 * d and dmin of the 16 rows (fp16), the 6-bit sub-block scales and mins of all 16 rows
 * split into low nibbles and high bit pairs, then the quants in 32 chunks of 64 bytes,
 * chunk 8c+g holding bytes qs[32c+4g..32c+4g+3] of every row (low nibbles: sub-block 2c,
 * high nibbles: sub-block 2c+1, elements 4g..4g+3 of it).
 * Scales and mins are numbered in "slots", the order the kernels want them unpacked in:
 * scale of sub-block j, row r: slot 16j+r; min of sub-block 2i+k, row r: slot 32i+2r+k
 * (pairs of sub-blocks side by side, for int16 pair products). Byte k of LOW holds slot
 * k's scale (low nibble) and min (high nibble) low bits; byte k of HIGH holds the top two
 * bits of scale slots k and k+64 (bits 0-1, 2-3) and min slots k and k+64 (4-5, 6-7). */
#define R16_K_D 0
#define R16_K_DMIN 32
#define R16_K_LOW 64
#define R16_K_HIGH 192
#define R16_K_QS 256
#define R16_K_BYTES (R16_K_QS + 32 * 64)

static inline int r16_k_scale_slot(int j, int r)
{
    return 16 * j + r;
}

static inline int r16_k_min_slot(int j, int r)
{
    return 32 * (j / 2) + 2 * r + j % 2;
}

/* Q6_K R16, per group and 256 super-block (R16_K6_BYTES, the bytes of 16 file blocks): d
 * of the 16 rows (fp16), their int8 scales (sub-block j of row r at byte 16j + r), then
 * the quants (q+32, 6 bits) by quarters of the super-block, quarter s (sub-blocks 4s..4s+3)
 * in twelve 64-byte chunks of 4 bytes per row: chunk 4i+g (i = 0, 1) holds elements
 * 4g..4g+3 of sub-blocks 4s+2i (low nibbles) and 4s+2i+1 (high nibbles), their low four
 * bits; chunk 8+g holds the top two bits of elements 4g..4g+3 of sub-blocks 4s, 4s+1,
 * 4s+2, 4s+3 in bits 0-1, 2-3, 4-5, 6-7. A quarter is read front to back. */
#define R16_K6_D 0
#define R16_K6_SCALES 32
#define R16_K6_QS 288
#define R16_K6_QUARTER (12 * 64)
#define R16_K6_BYTES (R16_K6_QS + 4 * R16_K6_QUARTER)

/* Byte i of row r in the chunk holding the low bits (hi = false) or the top bits of
 * elements 4g..4g+3 of sub-block j, and the shift that brings them to bit 0. */
static inline size_t r16_k6_byte(bool top, int j, int g, int r, int i, int *shift)
{
    int quarter = j / 4, pair = j % 4 / 2, chunk = top ? 8 + g : 4 * pair + g;
    *shift = top ? 2 * (j % 4) : 4 * (j % 2);
    return R16_K6_QS + (size_t)(R16_K6_QUARTER * quarter + 64 * chunk + 4 * r + i);
}

/* The 6-bit quant of element 4g+i of sub-block j, row r. */
static inline int r16_k6_quant(const uint8_t *blk, int j, int g, int r, int i)
{
    int sl, sh;
    size_t lo = r16_k6_byte(false, j, g, r, i, &sl), hi = r16_k6_byte(true, j, g, r, i, &sh);
    return (blk[lo] >> sl & 0xF) | (blk[hi] >> sh & 3) << 4;
}

static inline size_t r16_block_bytes(uint32_t ktype)
{
    if (ktype == BLADE_KTYPE_Q4_K_R16)
        return R16_K_BYTES;
    if (ktype == BLADE_KTYPE_Q6_K_R16)
        return R16_K6_BYTES;
    return R16_SCALES + 64 * (size_t)(ktype == BLADE_KTYPE_Q4_0_R16 ? R16_Q4_CHUNKS : R16_Q8_CHUNKS);
}

/* The 128 scale and 128 min slots of one super-block. */
static inline void r16_k_unpack(const uint8_t *blk, uint8_t sc[128], uint8_t m[128])
{
    const uint8_t *low = blk + R16_K_LOW, *high = blk + R16_K_HIGH;
    for (int k = 0; k < 128; k++) {
        int shift = k < 64 ? 0 : 2;
        sc[k] = (uint8_t)((low[k] & 0xF) | ((high[k % 64] >> shift & 3) << 4));
        m[k] = (uint8_t)((low[k] >> 4) | ((high[k % 64] >> (shift + 4) & 3) << 4));
    }
}

/* What the kernels derived from a held input (blade_matmul_input_hold), on this thread. */
typedef struct input_memo {
    void *scratch;
    size_t bytes;
    bool held, filled;
    /* the call it was derived for */
    const void *x;
    size_t x_stride;
    int64_t n, n_tok;
    uint32_t ktype;
} input_memo;

extern _Thread_local input_memo blade_input_memo;

/* Tokens whose activations stay in L2 while every row group of the range passes over
 * them (64 rows of 5632 are about 400 KiB). */
#define R16_TOKEN_CHUNK 64

/* A token's 32-block as the AVX-512 Q4_0/Q8_0 R16 tiles read it (matmul.c sizes the
 * scratch from it). */
#define R16_XB_BYTES 40
/* Most tokens a held input keeps the layout of (9 MiB per thread for rows of 14336). */
#define R16_HOLD_TOKENS 512

/* A token's side of an R16 product: its quants and block scales from the converted row,
 * and per block the integers the kernels add. Q4_0/Q8_0: one per 32-block, r16_start;
 * Q4_K: four per super-block, the activation sums of sub-blocks 2i and 2i+1 as the low and
 * high int16 of one int32 (|sum| <= 32 x 127); Q6_K: sixteen per super-block, -32 times
 * each sub-block's activation sum, where its dot product starts (the quants are q+32). */
typedef struct r16_x {
    const int8_t *q;
    const float *d;
    const int32_t *side;
} r16_x;

/* Elements per block of an R16 type: a 32-block, or a K-quant super-block. */
static inline int64_t r16_block_elems(uint32_t ktype)
{
    return ktype == BLADE_KTYPE_Q4_K_R16 || ktype == BLADE_KTYPE_Q6_K_R16 ? QK_K : QK8_0;
}

/* Integers of side per token for rows of n elements. */
static inline int64_t r16_side_per_token(uint32_t ktype, int64_t n)
{
    if (ktype == BLADE_KTYPE_Q4_K_R16)
        return n / QK_K * 4;
    if (ktype == BLADE_KTYPE_Q6_K_R16)
        return n / QK_K * 16;
    return n / QK8_0;
}

/* Fills side (r16_side_per_token integers) from the converted row and returns the view. */
static inline r16_x r16_token(uint32_t ktype, const void *row, int64_t n, int32_t *side)
{
    if (ktype == BLADE_KTYPE_Q6_K_R16) {
        act_k_view a = act_k_at(row, n);
        for (int64_t k = 0; k < n / 16; k++)
            side[k] = -32 * a.sum16[k];
        return (r16_x){a.q, a.d, side};
    }
    if (ktype == BLADE_KTYPE_Q4_K_R16) {
        act_k_view a = act_k_at(row, n);
        for (int64_t k = 0; k < n / QK_K * 4; k++) {
            const int16_t *s16 = a.sum16 + 4 * k;
            uint16_t lo = (uint16_t)(s16[0] + s16[1]), hi = (uint16_t)(s16[2] + s16[3]);
            side[k] = (int32_t)((uint32_t)lo | (uint32_t)hi << 16);
        }
        return (r16_x){a.q, a.d, side};
    }
    act_q8_view a = act_q8_at(row, n);
    for (int64_t b = 0; b < n / QK8_0; b++)
        side[b] = r16_start(ktype, a.sum[b]);
    return (r16_x){a.q, a.d, side};
}

/* Calls CALL(T) with T = nt as a compile-time constant (nt <= TMAX <= 8), so each tile
 * shape is its own fully unrolled instance. */
#define WITH_CONST_T(nt, TMAX, CALL)                                                                                   \
    switch (nt) {                                                                                                      \
    case 1:                                                                                                            \
        CALL(1);                                                                                                       \
        break;                                                                                                         \
    case 2:                                                                                                            \
        CALL(2 <= (TMAX) ? 2 : (TMAX));                                                                                \
        break;                                                                                                         \
    case 3:                                                                                                            \
        CALL(3 <= (TMAX) ? 3 : (TMAX));                                                                                \
        break;                                                                                                         \
    case 4:                                                                                                            \
        CALL(4 <= (TMAX) ? 4 : (TMAX));                                                                                \
        break;                                                                                                         \
    case 5:                                                                                                            \
        CALL(5 <= (TMAX) ? 5 : (TMAX));                                                                                \
        break;                                                                                                         \
    case 6:                                                                                                            \
        CALL(6 <= (TMAX) ? 6 : (TMAX));                                                                                \
        break;                                                                                                         \
    case 7:                                                                                                            \
        CALL(7 <= (TMAX) ? 7 : (TMAX));                                                                                \
        break;                                                                                                         \
    default:                                                                                                           \
        CALL(8 <= (TMAX) ? 8 : (TMAX));                                                                                \
        break;                                                                                                         \
    }

/* The same for nt <= 16 (R16 tiles, whose accumulators are one vector per token). */
#define WITH_CONST_T16(nt, CALL)                                                                                       \
    switch (nt) {                                                                                                      \
    case 1: CALL(1); break;                                                                                            \
    case 2: CALL(2); break;                                                                                            \
    case 3: CALL(3); break;                                                                                            \
    case 4: CALL(4); break;                                                                                            \
    case 5: CALL(5); break;                                                                                            \
    case 6: CALL(6); break;                                                                                            \
    case 7: CALL(7); break;                                                                                            \
    case 8: CALL(8); break;                                                                                            \
    case 9: CALL(9); break;                                                                                            \
    case 10: CALL(10); break;                                                                                          \
    case 11: CALL(11); break;                                                                                          \
    case 12: CALL(12); break;                                                                                          \
    case 13: CALL(13); break;                                                                                          \
    case 14: CALL(14); break;                                                                                          \
    case 15: CALL(15); break;                                                                                          \
    default: CALL(16); break;                                                                                          \
    }

/* Defines the kernel `name` (a blade_matmul_kernel, ktraits.h) with the target attribute
 * TARGET, that runs driver(args..., ...) with the same arguments: one driver serves the
 * weight types (and instruction choices) it takes as its leading args (a type, a kind or
 * a flag). On a 64-byte boundary, so that the inlined tile loops keep their place within
 * cache lines whatever code comes before them in the binary: the same kernel code streamed
 * a 4-token Q4_0 tile at 1.37-1.49x or 2.10-2.16x a one-token call depending on where it was
 * linked, and 992 bytes more of other code ahead of it cost Q4_0 decode 0.935-1.005x in nine
 * rounds, 0.94-1.045x once aligned (MEASURED.md, stops 33 and 40). */
#define BLADE_DRIVEN_KERNEL(TARGET, name, driver, ...)                                                                 \
    TARGET __attribute__((aligned(64))) void name(const void *W, size_t w_stride, const void *X, size_t x_stride,     \
                                                  int64_t n, float *Y, int64_t ldy, int64_t n_tok, int64_t r0,        \
                                                  int64_t r1)                                                         \
    {                                                                                                                  \
        driver(__VA_ARGS__, W, w_stride, X, x_stride, n, Y, ldy, n_tok, r0, r1);                                       \
    }

/* The 8x8 bit matrix of vgf2p8affineqb (output bit i of a byte is the parity of the byte
 * AND byte 7-i of the matrix) that moves bits [from, from + n) of a byte to [to, to + n)
 * and clears the others. The AVX2 and AVX-512 files decode Q6_K's 6-bit quants with it. */
static inline uint64_t gf2_bit_move(int from, int to, int n)
{
    uint64_t m = 0;
    for (int k = 0; k < n; k++)
        m |= (uint64_t)(1u << (from + k)) << (8 * (7 - (to + k)));
    return m;
}

#endif

#ifndef BLADE_TENSOR_QUANT_REF_H
#define BLADE_TENSOR_QUANT_REF_H

/* ggml block layouts, the scalar dequantizers of the types blade computes with, and the
 * plain float conversions (the block quantizers are in quantize/quant_blocks.h). The
 * structs mirror the on-disk bytes exactly (little-endian fp16 fields, no padding), so
 * optimized kernels can share them; the reference code copies each block out with memcpy,
 * which keeps it correct for buffers of any alignment. */

#include <stdint.h>

#define QK4_0 32
#define QK8_0 32
#define QK_K 256
#define K_SCALE_BYTES 12
#define K_SUB 32 /* elements per Q4_K/Q5_K sub-block */
#define K_NSUB (QK_K / K_SUB)

typedef struct block_q4_0 {
    uint16_t d;             /* fp16 scale */
    uint8_t qs[QK4_0 / 2];  /* element j in the low nibble of qs[j], element j+16 in the high */
} block_q4_0;

typedef struct block_q8_0 {
    uint16_t d;             /* fp16 scale */
    int8_t qs[QK8_0];
} block_q8_0;

/* Q4_K and Q5_K: eight sub-blocks of 32, each with a 6-bit scale and a 6-bit min
 * against the super-block's d and dmin (packed as blade_k_scale_min unpacks them). */
typedef struct block_q4_k {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[K_SCALE_BYTES];
    uint8_t qs[QK_K / 2];
} block_q4_k;

typedef struct block_q5_k {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[K_SCALE_BYTES];
    uint8_t qh[QK_K / 8];   /* fifth bit: qh[l] bit 2i / 2i+1 for sub-blocks 2i / 2i+1 */
    uint8_t qs[QK_K / 2];
} block_q5_k;

/* Q6_K: sixteen groups of 16 with int8 scales; d comes last in the block. */
typedef struct block_q6_k {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_k;

_Static_assert(sizeof(block_q4_0) == 18, "Q4_0 block layout");
_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block layout");
_Static_assert(sizeof(block_q4_k) == 144, "Q4_K block layout");
_Static_assert(sizeof(block_q5_k) == 176, "Q5_K block layout");
_Static_assert(sizeof(block_q6_k) == 210, "Q6_K block layout");

/* Scale and min of sub-block j (0..7) from the 12 packed bytes of Q4_K/Q5_K: sub-blocks
 * 0..3 keep their low 6 bits in bytes 0..7, and sub-blocks 4..7 are split into a nibble
 * in bytes 8..11 and two high bits parked in the spare top bits of bytes 0..7. */
static inline void blade_k_scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* The inverse: eight 6-bit scales and mins into the 12 packed bytes. */
void blade_k_scales_pack(const uint8_t sc[K_NSUB], const uint8_t m[K_NSUB], uint8_t out[K_SCALE_BYTES]);

void blade_f32_to_float(const void *src, float *dst, int64_t n);
void blade_f32_from_float(const float *src, void *dst, int64_t n);
void blade_f16_to_float(const void *src, float *dst, int64_t n);
void blade_f16_from_float(const float *src, void *dst, int64_t n);
void blade_bf16_to_float(const void *src, float *dst, int64_t n);
void blade_bf16_from_float(const float *src, void *dst, int64_t n);
void blade_q8_0_to_float(const void *src, float *dst, int64_t n);
void blade_q4_0_to_float(const void *src, float *dst, int64_t n);
void blade_q4_k_to_float(const void *src, float *dst, int64_t n);
void blade_q5_k_to_float(const void *src, float *dst, int64_t n);
void blade_q6_k_to_float(const void *src, float *dst, int64_t n);

#endif

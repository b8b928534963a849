#ifndef BLADE_TYPES_H
#define BLADE_TYPES_H

/* Tensor element types, numbered exactly as ggml numbers them in GGUF files, and one
 * traits row per type: how it is stored (block size and bytes) and its reference
 * conversions. Code that reads or writes a type's blocks goes through this table; code
 * that computes with them goes through the kernel-traits table (src/kernels/ktraits.c).
 * A new quantization type is a row in each, its block struct and reference conversions
 * (src/tensor/quant_ref.{h,c}), and its kernels; src/kernels/ktraits.h lists the places. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum blade_type {
    BLADE_TYPE_F32 = 0,
    BLADE_TYPE_F16 = 1,
    BLADE_TYPE_Q4_0 = 2,
    BLADE_TYPE_Q4_1 = 3,
    BLADE_TYPE_Q5_0 = 6,
    BLADE_TYPE_Q5_1 = 7,
    BLADE_TYPE_Q8_0 = 8,
    BLADE_TYPE_Q8_1 = 9,
    BLADE_TYPE_Q2_K = 10,
    BLADE_TYPE_Q3_K = 11,
    BLADE_TYPE_Q4_K = 12,
    BLADE_TYPE_Q5_K = 13,
    BLADE_TYPE_Q6_K = 14,
    BLADE_TYPE_Q8_K = 15,
    BLADE_TYPE_IQ2_XXS = 16,
    BLADE_TYPE_IQ2_XS = 17,
    BLADE_TYPE_IQ3_XXS = 18,
    BLADE_TYPE_IQ1_S = 19,
    BLADE_TYPE_IQ4_NL = 20,
    BLADE_TYPE_IQ3_S = 21,
    BLADE_TYPE_IQ2_S = 22,
    BLADE_TYPE_IQ4_XS = 23,
    BLADE_TYPE_I8 = 24,
    BLADE_TYPE_I16 = 25,
    BLADE_TYPE_I32 = 26,
    BLADE_TYPE_I64 = 27,
    BLADE_TYPE_F64 = 28,
    BLADE_TYPE_IQ1_M = 29,
    BLADE_TYPE_BF16 = 30,
    BLADE_TYPE_TQ1_0 = 34,
    BLADE_TYPE_TQ2_0 = 35,
    BLADE_TYPE_MXFP4 = 39,
    BLADE_TYPE_COUNT = 40
} blade_type;

typedef struct blade_type_traits {
    const char *name;   /* ggml's spelling: "F32", "Q4_K", ... */
    int64_t block_size; /* elements per block */
    size_t block_bytes; /* bytes per block */
    /* Reference (scalar) conversions; n must be a multiple of block_size. NULL for
     * types whose layout is known (so files can be validated and described) but that
     * blade cannot compute with yet. */
    void (*to_float)(const void *src, float *dst, int64_t n);
    void (*from_float)(const float *src, void *dst, int64_t n);
} blade_type_traits;

/* NULL for ids that are not a ggml type at all. */
const blade_type_traits *blade_type_traits_get(uint32_t type_id);

/* True if blade can dequantize/quantize this type (to_float and from_float present). */
bool blade_type_supported(uint32_t type_id);

/* Bytes of n elements (n a multiple of the block size). */
size_t blade_type_row_bytes(blade_type type, int64_t n);

/* "Q4_K" -> BLADE_TYPE_Q4_K (case-insensitive); -1 if unknown. */
int blade_type_from_name(const char *name);

/* IEEE half and bfloat16 conversions (round to nearest even; NaN preserved). */
float blade_fp16_to_fp32(uint16_t h);
uint16_t blade_fp32_to_fp16(float f);
float blade_bf16_to_fp32(uint16_t h);
uint16_t blade_fp32_to_bf16(float f);
/* OCP FP8 E4M3 (largest value 448, no infinities): round to nearest even, values beyond
 * +-448 (infinities included) saturate to +-448, NaN stays NaN (0x7f / 0xff), which
 * converts back to the quiet NaN 0x7fc00000 with its sign. */
float blade_e4m3_to_fp32(uint8_t b);
uint8_t blade_fp32_to_e4m3(float f);

#endif

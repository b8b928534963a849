/* The kernel-traits table (ktraits.c): one row per kernel type, a GGUF type or the
 * load-time R16 form of one (kernels.h), holding what the kernel layer knows about
 * computing with it: the GGUF type whose values it holds, the activation form its kernels
 * read, its R16 form, and its kernels for each ISA with the CPU extensions each needs. A
 * second table does the same for the activation forms: the size of a converted row and
 * its converter on each ISA. blade_matmul, blade_act_*, blade_row_from_float and the
 * repacker look rows up; nothing else in the kernel layer switches on a type.
 *
 * Adding a quantization type:
 *   - tensor/quant_ref.{h,c}: its block struct and reference to_float/from_float;
 *     tensor/types.c: its type_traits row names them;
 *   - its kernels: at least one in matmul_scalar.c (the reference every vector kernel is
 *     tested against), and optionally in matmul_avx2.c and matmul_avx512.c, each declared
 *     in the lists below;
 *   - its row in ktraits.c's kernel_types, naming its activation form and kernels (a new
 *     activation form is a row in act_forms and converters in the ISA files).
 * An R16 form of it adds its id to the enum below, its layout (kernels_internal.h), its
 * pack/unpack pair (repack.c, declared below), its kernels, and a row naming them all. */

#ifndef BLADE_KERNELS_KTRAITS_H
#define BLADE_KERNELS_KTRAITS_H

#include "blade/kernels.h"
#include "blade/types.h"

#include <stddef.h>
#include <stdint.h>

/* Kernel type ids beyond the GGUF ones: the R16 forms, numbered 0x100 + their base type.
 * Outside the kernel layer they are opaque (blade_matmul_repacked_type hands them out). */
#define BLADE_KTYPE_R16(base) (0x100 + (base))
enum {
    BLADE_KTYPE_Q4_0_R16 = BLADE_KTYPE_R16(BLADE_TYPE_Q4_0),
    BLADE_KTYPE_Q8_0_R16 = BLADE_KTYPE_R16(BLADE_TYPE_Q8_0),
    BLADE_KTYPE_Q4_K_R16 = BLADE_KTYPE_R16(BLADE_TYPE_Q4_K),
    BLADE_KTYPE_Q6_K_R16 = BLADE_KTYPE_R16(BLADE_TYPE_Q6_K),
};

/* One weight type's kernel on one ISA: the blade_matmul contract minus the type. */
typedef void blade_matmul_kernel(const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n, float *Y,
                                 int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1);
typedef blade_matmul_kernel *blade_matmul_fn;

/* Converts n floats into one row of an activation form (or an F16/BF16 row for
 * blade_row_from_float). Vector converters give the portable ones' bytes exactly (the
 * same IEEE operations element by element; NaNs are ignored by a block maximum and
 * quantize to -127 in both) and fill the arrays of a row blade_act_convert has zeroed. */
typedef void blade_act_converter(const float *x, void *out, int64_t n);
typedef blade_act_converter *blade_act_fn;

/* CPU extensions a kernel needs beyond its ISA's baseline (blade_isa_supported). */
enum {
    KT_NEEDS_VNNI = 1 << 0, /* AVX-512 VNNI */
    KT_NEEDS_BF16 = 1 << 1, /* AVX-512 BF16 */
    KT_NEEDS_GFNI = 1 << 2,
};

typedef struct kt_kernel {
    blade_matmul_fn fn;
    unsigned needs; /* KT_NEEDS_* */
} kt_kernel;

/* The most kernels one type has on one ISA (Q6_K R16: with and without GFNI). */
#define KT_VARIANTS 2

typedef struct blade_ktraits {
    const char *name;  /* "Q4_K", "Q4_K_R16" */
    uint32_t base;     /* the GGUF type whose values it holds (itself for GGUF types) */
    uint32_t act_form; /* the activation form its kernels read: a row of act_forms */
    int64_t row_align; /* blade_matmul row ranges start and end on multiples of this */
    /* GGUF types: the R16 type a matrix of this type is repacked into at load, 0 for none. */
    uint32_t repacked;
    /* R16 types: one R16 block from block b of 16 file rows (the first row's at rows, the
     * others row_bytes apart), and row r's file block back from it. An R16 block is as
     * many bytes as the 16 file blocks, which is what lets the repacking work in place. */
    void (*pack)(const uint8_t *rows, size_t row_bytes, uint8_t *out);
    void (*unpack)(const uint8_t *in, int r, uint8_t *block);
    /* Per ISA, its kernels in order of preference: a CPU runs the first whose needs it
     * meets, and where an ISA has none it can run, the next narrower ISA's. */
    kt_kernel kernels[BLADE_ISA_COUNT][KT_VARIANTS];
} blade_ktraits;

/* The largest file block an R16 form unpacks to (tested against the table). */
#define KT_MAX_BLOCK_BYTES 256

/* The row of a kernel type; NULL for a type blade_matmul does not compute with. */
const blade_ktraits *blade_ktraits_get(uint32_t type);
/* The kernel ISA isa's own file has for type on a CPU with features f (the first variant
 * whose needs f meets); NULL where there is none. */
blade_matmul_fn blade_ktraits_isa_kernel(uint32_t type, blade_isa isa, const blade_cpu_features *f);
/* The kernel that runs for type with isa active on a CPU with features f: isa's own, or
 * failing that the next narrower ISA's; NULL for an unsupported type. */
blade_matmul_fn blade_ktraits_resolve(uint32_t type, blade_isa isa, const blade_cpu_features *f);
/* blade_ktraits_resolve for this CPU, worked out for every ISA on the first call: what
 * blade_matmul runs. */
blade_matmul_fn blade_ktraits_kernel(uint32_t type, blade_isa isa);
/* The converter into form (an activation form, or F16) that runs with isa active on this
 * CPU; NULL for a type that is not a form. */
blade_act_fn blade_ktraits_converter(uint32_t form, blade_isa isa);

/* ---- what the ISA files export to the tables ----
 * Kernels are named blade_mm_<isa>_<kernel type>[_<extension>], converters
 * blade_act_<isa>_<form>; the portable F16 and BF16 converters are the reference ones
 * (tensor/quant_ref.h). */

blade_matmul_kernel blade_mm_scalar_f32, blade_mm_scalar_f16, blade_mm_scalar_bf16, blade_mm_scalar_q8_0,
    blade_mm_scalar_q4_0, blade_mm_scalar_q4_k, blade_mm_scalar_q5_k, blade_mm_scalar_q6_k,
    blade_mm_scalar_q4_0_r16, blade_mm_scalar_q8_0_r16, blade_mm_scalar_q4_k_r16, blade_mm_scalar_q6_k_r16;
blade_act_converter blade_act_scalar_f32, blade_act_scalar_q8_0, blade_act_scalar_q8_k;

#if defined(__x86_64__)
blade_matmul_kernel blade_mm_avx2_f32, blade_mm_avx2_f16, blade_mm_avx2_bf16, blade_mm_avx2_q8_0, blade_mm_avx2_q4_0,
    blade_mm_avx2_q4_k, blade_mm_avx2_q5_k, blade_mm_avx2_q6_k, blade_mm_avx2_q4_0_r16, blade_mm_avx2_q8_0_r16,
    blade_mm_avx2_q4_k_r16, blade_mm_avx2_q6_k_r16, blade_mm_avx2_q6_k_r16_gfni;
blade_act_converter blade_act_avx2_f16, blade_act_avx2_bf16, blade_act_avx2_q8_0, blade_act_avx2_q8_k;

blade_matmul_kernel blade_mm_avx512_f32, blade_mm_avx512_f16, blade_mm_avx512_bf16, blade_mm_avx512_q8_0,
    blade_mm_avx512_q4_0, blade_mm_avx512_q4_k, blade_mm_avx512_q5_k, blade_mm_avx512_q6_k,
    blade_mm_avx512_q4_0_r16, blade_mm_avx512_q8_0_r16, blade_mm_avx512_q4_k_r16, blade_mm_avx512_q6_k_r16,
    blade_mm_avx512_q6_k_r16_gfni;
blade_act_converter blade_act_avx512_bf16, blade_act_avx512_q8_0, blade_act_avx512_q8_k;
#endif

/* What repack.c exports to the table: the R16 forms' pack/unpack pairs. */
void blade_pack_q4_0_r16(const uint8_t *rows, size_t row_bytes, uint8_t *out);
void blade_unpack_q4_0_r16(const uint8_t *in, int r, uint8_t *block);
void blade_pack_q8_0_r16(const uint8_t *rows, size_t row_bytes, uint8_t *out);
void blade_unpack_q8_0_r16(const uint8_t *in, int r, uint8_t *block);
void blade_pack_q4_k_r16(const uint8_t *rows, size_t row_bytes, uint8_t *out);
void blade_unpack_q4_k_r16(const uint8_t *in, int r, uint8_t *block);
void blade_pack_q6_k_r16(const uint8_t *rows, size_t row_bytes, uint8_t *out);
void blade_unpack_q6_k_r16(const uint8_t *in, int r, uint8_t *block);

#endif

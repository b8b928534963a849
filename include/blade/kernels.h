#ifndef BLADE_KERNELS_H
#define BLADE_KERNELS_H

/* CPU compute kernels behind run-time dispatch (AVX-512 with VNNI/BF16/GFNI where present,
 * AVX2+FMA, portable scalar), and the persistent thread pool that runs them. Which
 * kernel serves which weight type on which CPU is one table (src/kernels/ktraits.c),
 * resolved once for the CPU; the functions below look it up.
 *
 * Determinism contract (batch invariance): for every output element the sequence of
 * floating-point operations is fixed by the weight type and the ISA alone; it does not
 * depend on how many tokens are multiplied together, on the tile a token falls in, or on
 * how rows are split between threads. The one-token (GEMV) and many-token (GEMM) paths
 * therefore produce identical bits. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "blade/types.h"

typedef enum blade_isa {
    BLADE_ISA_SCALAR = 0,
    BLADE_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
    BLADE_ISA_AVX512 = 2, /* AVX-512 F/BW/VL, with VNNI and BF16 used when present */
    BLADE_ISA_COUNT
} blade_isa;

typedef struct blade_cpu_features {
    bool avx2, fma, f16c;
    bool avx512f, avx512bw, avx512vl, avx512vnni, avx512bf16;
    bool gfni; /* Galois-field byte instructions: one-instruction bit moves within bytes */
} blade_cpu_features;

const blade_cpu_features *blade_cpu_get_features(void);
const char *blade_isa_name(blade_isa isa);
bool blade_isa_supported(blade_isa isa);
/* The ISA kernels use; defaults to the best supported. Tests and benchmarks switch it. */
blade_isa blade_isa_active(void);
void blade_isa_set(blade_isa isa); /* ignored when unsupported */

/* ---- dot products (embeddings) ----
 * Same bits for the same vectors on one ISA, whether from the pair or the scan; ISAs differ
 * in summation order only (relative differences around 1e-6). */

/* sum(a[i] * b[i]) over n floats. */
float blade_dot_f32(const float *a, const float *b, int64_t n);
/* The row r < n_rows of `rows` (n floats each, contiguous) with the largest dot product
 * with q, its product in *best; the first such row on ties; -1 when n_rows is 0. */
int64_t blade_dot_best_row_f32(const float *rows, int64_t n_rows, int64_t n, const float *q, float *best);

/* ---- matrix multiply ----
 * Activations are first converted into the form the weight type's dot product wants
 * (e.g. int8 blocks with a scale for integer dot products), once per token row. */

/* True for the weight types blade_matmul computes with. */
bool blade_matmul_supported(uint32_t weight_type);
/* The form of activation row weights of this type read, named by a type (F32, BF16, Q8_0
 * or Q8_K; BLADE_ACT_FORM_NONE for an unsupported type): weights of one form can share a
 * converted row. */
#define BLADE_ACT_FORM_NONE UINT32_MAX
uint32_t blade_act_form(uint32_t weight_type);
/* Bytes of one converted activation row of n elements for weights of this type. */
size_t blade_act_row_bytes(uint32_t weight_type, int64_t n);
/* Converts one activation row (n floats) for weights of this type. */
void blade_act_convert(uint32_t weight_type, const float *x, void *out, int64_t n);
/* The elements a converted row is made of independently (a block's scale and sums come from
 * its own elements alone): parts of a row starting and ending on multiples of this may be
 * converted apart. 0 for an unsupported type. */
int64_t blade_act_part_align(uint32_t weight_type);
/* Elements [begin, end) of a row of n elements, x pointing at element begin, into their
 * places in the converted row `out`; begin and end are multiples of blade_act_part_align
 * (end may be n). Converting every part of a row, in any order and from any thread, gives
 * the bytes blade_act_convert gives, padding included: so the step that produces a row's
 * pieces can convert them while they are in its cache. */
void blade_act_convert_part(uint32_t weight_type, const float *x, void *out, int64_t n, int64_t begin, int64_t end);
/* out = x / sqrt(mean(x^2) + eps) * w over n elements, the same bits on every ISA; out may
 * be x. */
void blade_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);

/* out[k * run + i] = SiLU(gate[k * stride + i]) * up[k * stride + i] for k < n_runs,
 * i < run: runs of a fused gate/up output (gate rows, then their up rows), or one plain run.
 * out may be gate. Every ISA is within 1e-6 relative of the exact value (tested). */
void blade_swiglu(const float *gate, const float *up, float *out, int64_t n_runs, int64_t run, int64_t stride);

/* Rounds n floats to BLADE_TYPE_F16 or BLADE_TYPE_BF16 at out, to nearest even, bit for bit
 * as blade_fp32_to_fp16 / blade_fp32_to_bf16 do, with the active ISA's instructions. Any
 * other type is a caller bug and stops the process. */
void blade_row_from_float(uint32_t type, const float *x, void *out, int64_t n);

/* Y[t * ldy + r] = dot(W row r, X row t) for r in [r0, r1), t in [0, n_tok).
 * W rows are n elements of weight_type, w_stride bytes apart (blade_matmul_row_bytes; for
 * the repacked types below, r0 and r1 are multiples of blade_matmul_row_align); X rows are
 * converted activations, x_stride bytes apart. Each weight block is loaded once per tile
 * of tokens. */
void blade_matmul(uint32_t weight_type, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n,
                  float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1);

/* ---- load-time repacking ----
 * Q4_0, Q8_0, Q4_K and Q6_K matrices are rearranged once, at load, into groups of 16 rows
 * ("R16"): per block, the 16 rows' scales, then their quants in 64-byte vectors that each
 * hold the same 4 elements of all 16 rows (Q8_0 quants stored as q+128). One integer
 * dot-product instruction against the token's 4 activations, broadcast, then advances 16
 * rows at once and no horizontal sums are needed; the activations come straight from the
 * converted row. The bytes are the same in number as the file's, so the rearrangement
 * happens in place.
 *
 * Every ISA performs the same operations per output in the same order for R16 types
 * (exact integer sums per block, then acc = fma(sum, w_scale * x_scale, acc) block by
 * block, and for Q4_K a second FMA for the mins), so their results are bit-identical to
 * the portable kernel's.
 *
 * A repacked matrix has a kernel type of its own, an id beyond the GGUF types'
 * (BLADE_TYPE_COUNT) that blade_matmul_repacked_type hands out: pass it wherever a weight
 * type goes. */
#define BLADE_R16_ROWS 16

/* The repacked type for a matrix of this type and shape, or 0 when it has none. */
uint32_t blade_matmul_repacked_type(uint32_t type, int64_t n_in, int64_t n_out);
/* Rearranges n_out rows of n_in elements in place into blade_matmul_repacked_type's layout. */
void blade_matmul_repack(uint32_t type, void *data, int64_t n_in, int64_t n_out);
/* The GGUF type whose values a kernel type holds (itself for GGUF types). */
uint32_t blade_matmul_base_type(uint32_t type);
/* Row ranges given to blade_matmul must start and end on multiples of this. */
int64_t blade_matmul_row_align(uint32_t type);
/* The w_stride blade_matmul wants for rows of n elements (for R16 types: one row's share
 * of a group). */
size_t blade_matmul_row_bytes(uint32_t type, int64_t n);
/* Row r of a matrix of any kernel type as floats, exactly as the type's to_float gives it. */
void blade_matmul_row_to_float(uint32_t type, const void *W, int64_t n, int64_t r, float *out);

/* A caller that multiplies one input in many calls (the runner's threads each take row
 * pieces of several weights that read the same activations) may hold the input: between
 * blade_matmul_input_hold and blade_matmul_input_release on one thread it promises that the
 * bytes of every X it passes stay as they are, and the kernels keep what they derive from X
 * (the R16 tiles' token layout) in `scratch` instead of redoing it in every call. Without a
 * hold, or with too small a scratch, every call derives its own: the results are the same
 * bits either way. */
size_t blade_matmul_input_scratch_bytes(int64_t n_max, int64_t n_tok_max);
void blade_matmul_input_hold(void *scratch, size_t bytes);
void blade_matmul_input_release(void);

/* ---- thread pool ---- */

typedef struct blade_threadpool blade_threadpool;

/* n_threads <= 0: the number of physical cores. */
blade_threadpool *blade_threadpool_new(int n_threads);
void blade_threadpool_free(blade_threadpool *p);
int blade_threadpool_size(const blade_threadpool *p);
/* Runs fn(ctx, ith, nth) on every thread of the pool (the caller is thread 0) and returns
 * when all have finished. Cheap enough to call for each small operation of a decode step. */
void blade_threadpool_run(blade_threadpool *p, void (*fn)(void *ctx, int ith, int nth), void *ctx);
/* Runs fn(ctx) on the calling thread alone, as one run of the pool: the runs fn issues on
 * this pool execute inline, one thread each, while the other threads return at once and
 * keep spinning for the next run instead of falling asleep. For work made of many passes
 * too small to split across cores (a tiny draft model's forward), where a pool of one
 * thread would let this pool's workers sleep and each later run pay their wake-up. */
void blade_threadpool_run_alone(blade_threadpool *p, void (*fn)(void *ctx), void *ctx);
int blade_physical_cores(void);

/* ---- work sharing ----
 * A run's n units of work split into one contiguous share per pool thread, taken from
 * the front in pieces by its owner; a thread whose share is done takes pieces from the
 * back of another's. Each thread streams one contiguous range (what the prefetchers
 * want) until the end, where the faster thread finishes the slower one's rest instead of
 * waiting for it. */
typedef struct blade_work_share blade_work_share;

blade_work_share *blade_work_share_new(int n_threads);
void blade_work_share_free(blade_work_share *w);
/* Starts a new run of n_units; called before blade_threadpool_run, whose start publishes it. */
void blade_work_share_reset(blade_work_share *w, int64_t n_units);
/* The next piece [begin, end) for thread ith; false once no unit is left anywhere. */
bool blade_work_share_next(blade_work_share *w, int ith, int64_t *begin, int64_t *end);

#endif

#ifndef BLADE_QUANTIZE_H
#define BLADE_QUANTIZE_H

/* Making quantized weights: block quantizers that take an optional per-column importance,
 * the schemes `blade quantize --type` names (plain types and the "_M" mixes, whose recipe
 * `blade synth` shares), and the whole-file conversion behind `blade quantize`: prepare a
 * job (every tensor's type decided), then write it. */

#include "blade/error.h"
#include "blade/types.h"

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- rows ---- */

/* True for the types blade_quantize_row produces: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K. */
bool blade_quantize_type_supported(uint32_t type);

/* Quantizes n values (a multiple of the type's block size) into dst.
 *
 * importance: NULL, or n non-negative weights, one per value's input column (for a weight
 * row: the mean square of the activations each column multiplies, as an importance matrix
 * records). It weights the error the scale search minimizes: w[i] = importance[i] for Q4_K
 * and Q5_K, importance[i] * sqrt(sigma2 + x[i]^2) for the others, sigma2 the mean of x^2 over
 * the n values. NULL keeps the reference quantizer's weighting (blade_quant_weighted_error).
 *
 * refine: after the reference search, blade searches further (neighbouring sub-block scales
 * and mins, a least-squares refit of the super-block scales) and keeps a block only where its
 * weighted error is lower. Q4_0 and Q8_0 have no search without importance; with it, their
 * weighted scale search runs whatever refine says, as the K-quants' reference search uses
 * the importance whatever refine says.
 *
 * Without importance, Q4_0 and Q8_0 bytes are exactly ggml's reference quantizer's, and so are
 * the K-quants' when refine is false. The result depends only on the n values: quantizing a
 * tensor row by row on any number of threads gives the same bytes. */
void blade_quantize_row(uint32_t type, const float *x, void *dst, int64_t n, const float *importance, bool refine);

/* The error a type's scale search minimizes, between values x and their dequantization y:
 * the sum over elements of w[i] * (x[i] - y[i])^2, accumulated in double block by block
 * (32 values for Q4_0/Q8_0, 256 for K-quants) and the blocks added in order. Without
 * importance w is the reference quantizer's weighting: 1 for Q4_0/Q8_0 (plain squared
 * error), the RMS of the value's 32-value sub-block plus |x| for Q4_K/Q5_K, x^2 for Q6_K;
 * with importance, the weights blade_quantize_row describes. n must be a multiple of the
 * block size; F32/F16/BF16 count as blocks of one value with w = 1. */
double blade_quant_weighted_error(uint32_t type, const float *x, const float *y, int64_t n, const float *importance);

/* ---- schemes: what --type names ---- */

typedef struct blade_quant_scheme {
    const char *name;         /* as --type spells it: "Q4_K_M" */
    uint32_t type;            /* most weight matrices */
    uint32_t classifier_type; /* output.weight (token_embd.weight when tied); 0: type */
    uint32_t sensitive_type;  /* for a mix: attn_v / ffn_down in the layers
                               * blade_quant_more_bits_layer picks; 0 for a plain type */
    uint32_t file_type;       /* general.file_type: llama.cpp's LLAMA_FTYPE number */
} blade_quant_scheme;

/* Case-insensitive; NULL if unknown. */
const blade_quant_scheme *blade_quant_scheme_find(const char *name);
/* Comma-separated list of the scheme names. */
const char *blade_quant_scheme_names(void);

/* The "_M" recipe's layer choice (llama.cpp's): the first and last eighth of the layers, and
 * every third layer between. */
bool blade_quant_more_bits_layer(int layer, int n_layer);

/* The type scheme s gives the weight matrix called `name` (GGUF naming: "output.weight",
 * "blk.N.attn_v.weight", ...) in a model of n_layer blocks. tied: the model has no
 * output.weight, so token_embd.weight is also its classifier. The row length is not
 * considered (blade_quant_fit_type). */
uint32_t blade_quant_scheme_type_for(const blade_quant_scheme *s, const char *name, int n_layer, bool tied);

/* type itself when rows of row_len values are whole blocks of it; otherwise the nearest type
 * at least as precise whose blocks fit: Q8_0 for the K-quants when row_len is a multiple of
 * 32, else float_type (F16, or BF16 for a BF16 source whose range F16 lacks). */
uint32_t blade_quant_fit_type(uint32_t type, int64_t row_len, uint32_t float_type);

/* ---- files ---- */

/* --keep GLOB=TYPE: weight matrices whose name matches glob (fnmatch) get type. */
typedef struct blade_quant_keep {
    char *glob;
    uint32_t type;
} blade_quant_keep;

/* Parses "GLOB=TYPE" (split at the last '='; the glob is copied, free it with
 * blade_quant_keep_free). Returns -1 with a message naming what is wrong: no '=', an empty
 * glob, an unknown type, or a type blade cannot write. */
int blade_quant_keep_parse(const char *spec, blade_quant_keep *keep, blade_error *err);
void blade_quant_keep_free(blade_quant_keep *keep);

/* Per-column importance of a weight matrix: n_cols values for each of the n_slices matrices
 * the tensor holds (ne[2] * ne[3], 1 for a plain matrix), slice after slice. Returns NULL
 * when there is none for this tensor (it is then quantized with the default weighting), or
 * NULL with a message in err to abort. The values must stay valid until the next call. */
typedef const float *(*blade_quant_importance_fn)(void *ctx, const char *tensor, int64_t n_cols, int64_t n_slices,
                                                  blade_error *err);

struct blade_quantize_report;

typedef struct blade_quantize_params {
    const blade_quant_scheme *scheme;
    const blade_quant_keep *keep; /* first match wins */
    size_t n_keep;
    int n_threads;  /* <= 0: every physical core */
    bool no_refine; /* reference search only (blade_quantize_row's refine = false) */
    bool progress;  /* progress bar on stderr (the caller checks it is a terminal) */
    blade_quant_importance_fn importance; /* NULL: none */
    void *importance_ctx;
    /* Where the importance came from, recorded in the output as llama.cpp records it
     * (quantize.imatrix.file, .dataset, .chunks_count, .entries_count) when
     * imatrix_file is set. */
    const char *imatrix_file;
    const char *imatrix_dataset;
    int32_t imatrix_chunks;
    int32_t imatrix_entries;
    /* When it becomes non-zero (a SIGINT handler sets it), the conversion stops between row
     * chunks and no output file is left behind. */
    const volatile sig_atomic_t *cancel;
    /* When set, decides whether the converted file may become the output (a quality gate):
     * called once it is complete, under a temporary name beside out_path, with the report's
     * results (file_bytes_out, seconds) filled in. 0 accepts it; a positive value refuses it,
     * and blade_quantize_write removes the file and returns that value; a negative one is an
     * error (err set). */
    int (*accept)(void *ctx, const char *written_path, const struct blade_quantize_report *report, blade_error *err);
    void *accept_ctx;
} blade_quantize_params;

typedef struct blade_quant_tensor_plan {
    const char *name;
    uint32_t src_type;
    uint32_t type;    /* written */
    uint32_t wanted;  /* what the scheme or --keep asked for, before the row-length fallback */
    bool convert;     /* false: the bytes are copied unchanged */
    bool requantized; /* converted from an already quantized source to a block type */
    bool importance;  /* quantized with an importance vector (known once written) */
    int64_t n_elements;
    int64_t row_len;
    uint64_t bytes_in, bytes_out;
} blade_quant_tensor_plan;

typedef struct blade_quantize_report {
    const blade_quant_tensor_plan *tensors;
    size_t n_tensors;
    uint64_t count_by_type[BLADE_TYPE_COUNT]; /* tensors written per type id */
    uint64_t bytes_in, bytes_out;             /* tensor data */
    int64_t n_elements;
    size_t n_requantized;  /* tensors converted from an already quantized source */
    size_t n_fallbacks;    /* tensors whose rows did not fit the wanted type */
    const char *const *unmatched_keeps; /* --keep globs that matched no weight matrix */
    size_t n_unmatched_keeps;
    const char *const *shadowed_keeps;  /* --keep globs whose every match an earlier one took */
    size_t n_shadowed_keeps;
    uint64_t file_bytes_in, file_bytes_out; /* file_bytes_out and the rest below: once written */
    double seconds;
    int n_threads;
} blade_quantize_report;

typedef struct blade_quantize_job blade_quantize_job;

/* Opens in_path and decides every tensor's type: weight matrices get the scheme's type (or
 * the first matching --keep's), falling back per blade_quant_fit_type when their rows are not
 * whole blocks; norms, other 1-D tensors, MoE routers and RoPE frequency tables become F32;
 * integer tensors are copied. Fails, naming the tensor, for a tensor blade cannot read. */
blade_quantize_job *blade_quantize_prepare(const char *in_path, const blade_quantize_params *p, blade_error *err);
/* The plan (and, after blade_quantize_write, the results); valid until the job is freed. */
const blade_quantize_report *blade_quantize_job_report(const blade_quantize_job *job);
/* Writes the GGUF: every metadata key carried over, plus general.file_type (the scheme's)
 * and general.quantization_version = 2 (and the quantize.imatrix.* keys when the params name
 * an importance matrix); tensors in the input's order, aligned. The file is
 * written beside out_path and renamed into place once complete and synced, so out_path is
 * untouched unless this succeeds. Refuses an out_path that is the input (same inode), and
 * tensors with values that are not finite or (for every type with fp16 scales, and F16)
 * beyond +-65504. Returns 0 when written, -1 on an error, and the accept hook's positive
 * verdict when it refused the file (nothing written). */
int blade_quantize_write(blade_quantize_job *job, const char *out_path, blade_error *err);
void blade_quantize_job_free(blade_quantize_job *job);

#endif

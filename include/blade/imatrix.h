#ifndef BLADE_IMATRIX_H
#define BLADE_IMATRIX_H

/* Importance matrices: for every weight matrix, the mean square of each input column's
 * activations over calibration text. A weight that multiplies large activations matters
 * more, so `blade quantize --imatrix` weights each column's rounding error by it.
 *
 * Collected by running the text through the batched runner (blade_imatrix_collect), kept in
 * a GGUF file of blade's own layout (README, "blade imatrix"), and loaded back as hostile
 * input: every field checked, and the model it was made for compared with the one being
 * quantized, so an importance matrix of another model is refused by name. */

#include "blade/error.h"
#include "blade/gguf.h"
#include "blade/model.h"

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define BLADE_IMATRIX_FORMAT_VERSION 1

/* A model as an importance matrix knows it: its architecture and its tensor table (every
 * tensor's name and shape, sorted by name; types left out, so the F16 original and a Q8_0
 * copy of one model are the same model), and a SHA-256 of both. */
typedef struct blade_model_identity {
    char *arch;
    char *name; /* general.name; NULL when the file has none (informational only) */
    size_t n_tensors;
    char **tensor_names;
    int64_t (*tensor_ne)[GGUF_MAX_DIMS];
    char fingerprint[65]; /* hex */
} blade_model_identity;

/* One weight matrix's importance: n_cols mean squares for each of n_slices matrices the
 * tensor holds (1 for a plain matrix), slice after slice, and the activation rows averaged
 * per slice. */
typedef struct blade_imatrix_entry {
    char *name; /* the weight matrix, GGUF naming: "blk.0.attn_q.weight" */
    int64_t n_cols;
    int64_t n_slices;
    float *mean_sq;
    int64_t *rows;
} blade_imatrix_entry;

typedef struct blade_imatrix {
    blade_model_identity model;
    char *dataset;       /* the calibration text's file name, as given */
    uint32_t chunks;     /* chunks of chunk_size tokens run */
    uint32_t chunk_size;
    blade_imatrix_entry *entries; /* layer by layer, the classifier last */
    size_t n_entries;
} blade_imatrix;

/* ---- model identity ---- */

/* Fails when general.architecture is missing or not a string. */
int blade_model_identity_of(const gguf_file *f, blade_model_identity *id, blade_error *err);
void blade_model_identity_free(blade_model_identity *id);

/* ---- collecting ---- */

typedef struct blade_imatrix_params {
    const char *text; /* calibration text, text_len bytes */
    size_t text_len;
    const char *dataset; /* its name, recorded in the file */
    int32_t ctx;         /* chunk length in tokens, at least 4 */
    int32_t max_chunks;  /* <= 0: every whole chunk of the text */
    int n_threads;       /* <= 0: every physical core */
    bool progress;       /* progress bar on stderr (the caller checks it is a terminal) */
    /* When it becomes non-zero (a SIGINT handler sets it), collection stops between batches
     * and fails with "interrupted". */
    const volatile sig_atomic_t *cancel;
} blade_imatrix_params;

typedef struct blade_imatrix_report {
    size_t text_tokens; /* the whole text, BOS included */
    uint32_t chunks;
    double ppl, ppl_err; /* of the calibration text, by the llama.cpp method (as blade perplexity) */
    double seconds;
    int n_threads;
} blade_imatrix_report;

/* Runs the text through m as `blade perplexity` does (the evaluation scorer, eval.h:
 * tokenized once with BOS; chunks of ctx tokens, each from an empty context with its first
 * token replaced by BOS, positions 0 .. ctx-2 run, ctx/2 .. ctx-2 scored) with f32 KV and the
 * runner collecting activation statistics, and turns them into an importance matrix: q/k/v
 * share the normalised attention input, gate/up the normalised FFN input, attn_output reads
 * the attention output, ffn_down the SwiGLU output (all over every position run), and the
 * classifier (output.weight, or token_embd.weight when the embeddings are tied) the final
 * normalised hidden state (over the scored positions, the rows whose logits are computed).
 * report may be NULL. */
blade_imatrix *blade_imatrix_collect(const blade_model *m, const blade_imatrix_params *p, blade_imatrix_report *report,
                                     blade_error *err);

/* ---- files ---- */

/* Atomic write (gguf_writer_write): path holds its old contents unless this succeeds. */
int blade_imatrix_save(const blade_imatrix *im, const char *path, blade_error *err);
/* Reads and checks a file: its format and version, the model table and its fingerprint,
 * every entry's tensor (one the recorded model has), column and slice counts, values (finite,
 * not negative) and row counts (at least one). Every failure names the file and the field. */
blade_imatrix *blade_imatrix_load(const char *path, blade_error *err);
void blade_imatrix_free(blade_imatrix *im);

const blade_imatrix_entry *blade_imatrix_find(const blade_imatrix *im, const char *tensor);

/* 0 when im was made for the model in `model` (same architecture and tensor table);
 * otherwise -1 with a message naming the first difference, model_label naming that model. */
int blade_imatrix_check_model(const blade_imatrix *im, const gguf_file *model, const char *model_label,
                              blade_error *err);

/* The importance lookup blade_quantize_params takes (ctx: a blade_imatrix checked against
 * the input with blade_imatrix_check_model): the entry's mean squares, NULL for a tensor
 * without an entry, an error for one whose shape disagrees. */
const float *blade_imatrix_importance(void *ctx, const char *tensor, int64_t n_cols, int64_t n_slices,
                                      blade_error *err);

#endif

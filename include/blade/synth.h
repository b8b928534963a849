#ifndef BLADE_SYNTH_H
#define BLADE_SYNTH_H

/* Synthetic models of a given shape, written as ordinary GGUF files: random weights
 * (realistic benchmark subjects where real weights cannot be downloaded, and small
 * self-contained models for tests of every architecture path), or a small real model
 * inflated to a big model's shape so that it costs what the big model costs and still
 * computes the small model's function. */

#include "blade/error.h"
#include "blade/model.h"
#include "blade/quantize.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct blade_synth_spec {
    blade_arch arch;
    int32_t n_vocab;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ff;
    int32_t n_ctx;
    float rope_base;
    bool tied_embeddings;
    /* Which matrix gets which type, by blade quantize's recipe (blade_quant_scheme_type_for):
     * scheme.type for the matrices (norms and biases stay F32), and where non-zero its
     * classifier_type and a mix's sensitive_type. Only the types are read. */
    blade_quant_scheme scheme;
    uint64_t seed;
    /* Vocabulary: copied from this GGUF's tokenizer.ggml.* keys (padded with filler tokens up
     * to n_vocab) when set; otherwise a byte-fallback SentencePiece vocabulary is made up. */
    const char *vocab_path;
    int32_t n_rot;    /* rotary dims per head; 0: head_dim */
    float rms_eps;    /* 0: 1e-6 */
    float rope_scale; /* linear position scaling; 0 or 1: none */
} blade_synth_spec;

/* Real models' shapes by name ("tinyllama-1.1b", ...): fills the shape fields of spec and
 * names the shared vocabulary (relative to the shared folder) they borrow. Returns -1 for
 * an unknown name. */
int blade_synth_shape(const char *name, blade_synth_spec *spec, const char **vocab_file);
/* Comma-separated list of the known shape names. */
const char *blade_synth_shape_names(void);

int blade_synth_write(const blade_synth_spec *spec, const char *path, bool show_progress, blade_error *err);

/* The noise blade_synth_inflate's callers use unless told otherwise: measured (README,
 * `blade synth`) to keep greedy agreement with the source high while every weight block
 * carries values. */
#define BLADE_SYNTH_DEFAULT_NOISE 1e-3f

/* How blade_synth_inflate kept the source's function, for reporting. */
typedef struct blade_synth_inflation {
    blade_hparams source;
    int32_t n_rot;       /* rotary dims per head of the written model */
    float rope_base;     /* its RoPE base */
    float rms_eps;       /* its RMSNorm epsilon */
    int32_t kv_copies;   /* target KV heads holding each source KV head */
} blade_synth_inflation;

/* The target layer that source layer i of n_source becomes among n_target: spread evenly,
 * first to first and last to last, so an early exit after some target layers has run
 * only some of the source's (a realistic self-draft) rather than all of them. */
int32_t blade_synth_layer_position(int32_t i, int32_t n_source, int32_t n_target);

/* Writes a model of spec's shape, types and seed that computes the function of the llama
 * model at from_path (spec's vocabulary fields are ignored: the source's vocabulary and
 * tokenizer metadata are copied, and the classifier is always a matrix of its own). The
 * source's hidden size, heads, head size and FFN occupy the first dimensions of the
 * target's, with norms, query scale and RoPE base rescaled to compensate; its layers are
 * spread over the target's, the others made identities. Every weight the source does not
 * determine is Gaussian noise of standard deviation `noise` (0: exactly zero, and the
 * written model's logits equal the source's up to float rounding). Refuses, naming the
 * reason, a source that is not llama or a target that cannot hold it. info may be NULL. */
int blade_synth_inflate(const blade_synth_spec *spec, const char *from_path, float noise, const char *path,
                        bool show_progress, blade_synth_inflation *info, blade_error *err);

#endif

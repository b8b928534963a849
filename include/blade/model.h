#ifndef BLADE_MODEL_H
#define BLADE_MODEL_H

/* A loaded model: hyperparameters read from GGUF metadata and weight views into the
 * loaded file. blade_model_load opens it with gguf_open, which copies the file once into
 * 2 MiB-page memory (or, when that memory cannot be had, reads it through the file's own
 * mapping), and then rearranges the weights in that copy for the kernels: the quantized
 * projections that have a 16-row layout (kernels.h) are repacked into it, so a weight's
 * type may be a kernel layout rather than the file's, and a layer's gate and up
 * projections that lie back to back with one type and shape are fused into one matrix.
 * Over the file's own mapping (gguf_open_mapped handed to blade_model_from_gguf, or no
 * memory for the copy) nothing is rearranged and the weights are used as the file has
 * them. The views stay valid until blade_model_free.
 * Architectures: llama, qwen2 (QKV bias, NeoX RoPE), qwen3 (per-head Q/K RMSNorm, NeoX
 * RoPE). Anything else is refused by name. */

#include "blade/error.h"
#include "blade/gguf.h"
#include "blade/kv_store.h"
#include "blade/tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum blade_arch {
    BLADE_ARCH_LLAMA,
    BLADE_ARCH_QWEN2,
    BLADE_ARCH_QWEN3
} blade_arch;

typedef struct blade_hparams {
    blade_arch arch;
    const char *arch_name;
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim; /* per-head size of Q and K (and V) */
    int32_t n_ff;
    int32_t n_rot;    /* rotary dimensions per head (<= head_dim) */
    float rms_eps;
    float rope_base;
    float rope_scale; /* linear scaling: positions are divided by this */
    bool rope_neox;   /* rotate (x[i], x[i + n_rot/2]) instead of (x[2i], x[2i+1]) */
    bool tied_embeddings;
} blade_hparams;

/* A matrix (or vector) in the file: n_out rows of n_in elements of `type`. */
typedef struct blade_weight {
    const void *data;
    uint32_t type; /* a GGUF type, or a kernel layout the loader repacked it into (kernels.h) */
    int64_t n_in;
    int64_t n_out;
} blade_weight;

/* Rows per group in a fused gate/up matrix: its groups alternate between the gate and the
 * up projection (gate rows 0-15, up rows 0-15, gate rows 16-31, ...). */
#define BLADE_GATE_UP_GROUP 16

typedef struct blade_layer {
    blade_weight attn_norm;
    blade_weight wq, wk, wv, wo;
    blade_weight bq, bk, bv;         /* qwen2 only; data NULL otherwise */
    blade_weight q_norm, k_norm;     /* qwen3 only */
    blade_weight ffn_norm;
    /* When the loader fused gate and up (model.c), ffn_gate_up holds both as 2 x n_ff rows
     * and the two separate weights keep their type and shape but no data. */
    blade_weight ffn_gate, ffn_up, ffn_gate_up, ffn_down;
} blade_layer;

typedef struct blade_model {
    gguf_file *file;
    blade_tokenizer *tokenizer;
    blade_hparams hp;
    blade_weight tok_embd;
    blade_weight output_norm;
    blade_weight output; /* == tok_embd when tied */
    /* Llama 3.1-style RoPE frequency factors, F32, one per rotated pair: pair i turns at
     * its usual frequency divided by factor i. data NULL when the file has none. */
    blade_weight rope_freqs;
    blade_layer *layers;
    uint64_t n_params;
    size_t weight_bytes;
} blade_model;

blade_model *blade_model_load(const char *path, blade_error *err);
/* Same, over an already opened file (takes ownership of f, also on failure). */
blade_model *blade_model_from_gguf(gguf_file *f, blade_error *err);
void blade_model_free(blade_model *m);

/* A copy of m's first n_layers layers with every projection and the classifier requantized
 * to `type` (self-draft's lower-precision copy, spec.h); embeddings, norms, biases and the
 * tokenizer are m's, so m must outlive it. Free it with blade_model_lowered_free. */
blade_model *blade_model_lowered(const blade_model *m, int32_t n_layers, uint32_t type, blade_error *err);
void blade_model_lowered_free(blade_model *m);

const char *blade_arch_name(blade_arch a);

/* The KV store a model with these hyperparameters needs: its layers, KV heads and head
 * size, with the given element type and blocks. */
blade_kv_store_config blade_model_kv_config(const blade_hparams *hp, blade_kv_type type, int32_t block_size,
                                            int32_t n_blocks);

#endif

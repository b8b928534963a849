#ifndef BLADE_SYNTH_H
#define BLADE_SYNTH_H

/* Random-weight models of a given shape, written as ordinary GGUF files: realistic
 * benchmark subjects where real weights cannot be downloaded, and small self-contained
 * models for tests of every architecture path. */

#include "blade/error.h"
#include "blade/model.h"

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
    uint32_t weight_type; /* matrices; norms and biases stay F32 */
    /* When non-zero, the tensors a "_M" mix keeps at higher precision use this type, chosen
     * by blade quantize's recipe (blade_quant_scheme_type_for): the classifier, and attn_v /
     * ffn_down in the first and last eighth of the layers and every third layer between. */
    uint32_t sensitive_type;
    uint64_t seed;
    /* Vocabulary: copied from this GGUF's tokenizer.ggml.* keys (padded with filler tokens up
     * to n_vocab) when set; otherwise a byte-fallback SentencePiece vocabulary is made up. */
    const char *vocab_path;
} blade_synth_spec;

/* Real models' shapes by name ("tinyllama-1.1b", ...): fills the shape fields of spec and
 * names the shared vocabulary (relative to the shared folder) they borrow. Returns -1 for
 * an unknown name. */
int blade_synth_shape(const char *name, blade_synth_spec *spec, const char **vocab_file);
/* Comma-separated list of the known shape names. */
const char *blade_synth_shape_names(void);

int blade_synth_write(const blade_synth_spec *spec, const char *path, bool show_progress, blade_error *err);

#endif

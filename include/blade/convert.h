#ifndef BLADE_CONVERT_H
#define BLADE_CONVERT_H

/* Importers from other checkpoint formats into standard GGUF files. */

#include "blade/error.h"

#include <stdbool.h>

/* llama2.c checkpoint (header of 7 int32 + f32 tensors) plus its tokenizer.bin into a
 * `llama` GGUF with the usual tensor names and an embedded SentencePiece-style vocabulary.
 * llama2.c rotates adjacent pairs (2i, 2i+1) exactly as GGUF's llama RoPE does, so Q and K
 * are copied as they are; a tied classifier becomes a GGUF without output.weight. */
int blade_convert_llama2c(const char *checkpoint_path, const char *tokenizer_path, const char *out_path,
                          const char *name, bool show_progress, blade_error *err);

#endif

#ifndef BLADE_TOKENIZER_H
#define BLADE_TOKENIZER_H

/* Tokenizers described by GGUF metadata (tokenizer.ggml.*):
 *   "llama": SentencePiece-style BPE over scores, with byte fallback <0xNN> and a space prefix;
 *   "gpt2":  byte-level BPE over merges, with a pre-tokenizer regex chosen by tokenizer.ggml.pre.
 * Control (and unknown) tokens inside text are matched as single tokens only when the
 * caller asks to parse specials; user-defined tokens always are, as in SentencePiece,
 * HF tokenizers and llama.cpp, since they are pieces of ordinary text. */

#include "blade/error.h"
#include "blade/gguf.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct blade_tokenizer blade_tokenizer;

typedef enum blade_vocab_kind {
    BLADE_VOCAB_SPM, /* tokenizer.ggml.model = "llama" */
    BLADE_VOCAB_BPE  /* tokenizer.ggml.model = "gpt2" */
} blade_vocab_kind;

/* tokenizer.ggml.token_type values */
typedef enum blade_token_attr {
    BLADE_TOKEN_UNDEFINED = 0,
    BLADE_TOKEN_NORMAL = 1,
    BLADE_TOKEN_UNKNOWN = 2,
    BLADE_TOKEN_CONTROL = 3,
    BLADE_TOKEN_USER_DEFINED = 4,
    BLADE_TOKEN_UNUSED = 5,
    BLADE_TOKEN_BYTE = 6
} blade_token_attr;

blade_tokenizer *blade_tokenizer_load(const gguf_file *f, blade_error *err);
/* The tokenizer of a GGUF file, read from its metadata alone (gguf_open_mapped): the
 * weights are never read, so a model file costs what its vocabulary does. Errors name the
 * file. */
blade_tokenizer *blade_tokenizer_load_file(const char *path, blade_error *err);
void blade_tokenizer_free(blade_tokenizer *t);

blade_vocab_kind blade_tokenizer_kind(const blade_tokenizer *t);
int32_t blade_tokenizer_n_vocab(const blade_tokenizer *t);
int32_t blade_tokenizer_bos(const blade_tokenizer *t); /* -1 when the vocabulary has none */
int32_t blade_tokenizer_eos(const blade_tokenizer *t);
int32_t blade_tokenizer_eot(const blade_tokenizer *t);
/* Whether a prompt should start with BOS (tokenizer.ggml.add_bos_token, else the kind's default). */
bool blade_tokenizer_wants_bos(const blade_tokenizer *t);
/* Whether a prompt should end with EOS (tokenizer.ggml.add_eos_token, default false). */
bool blade_tokenizer_wants_eos(const blade_tokenizer *t);
/* End-of-generation: EOS, EOT, or any other token the metadata marks as ending a turn. */
bool blade_tokenizer_is_eog(const blade_tokenizer *t, int32_t id);
blade_token_attr blade_tokenizer_attr(const blade_tokenizer *t, int32_t id);
/* The vocabulary entry as stored (e.g. "▁the", "Ġthe", "<0x0A>"); NUL-terminated. */
const char *blade_tokenizer_token_text(const blade_tokenizer *t, int32_t id);
/* Token id of an exact vocabulary entry, or -1. */
int32_t blade_tokenizer_find(const blade_tokenizer *t, const char *text, size_t len);

/* Encodes text (len bytes, need not be NUL-terminated). *tokens is malloc'd; caller frees.
 * Invalid UTF-8 is not an error: its bytes become byte tokens (SPM) or byte-alphabet
 * characters (BPE), so the tokens' bytes always reproduce the input exactly. */
int blade_tokenizer_encode(const blade_tokenizer *t, const char *text, size_t len, bool add_bos,
                           bool parse_special, int32_t **tokens, size_t *n_tokens, blade_error *err);

/* The bytes a token contributes to output text: byte tokens become their byte, SPM's
 * U+2581 becomes a space, byte-level BPE characters map back to bytes. Control tokens
 * give "" unless render_special. Returns the full length (like snprintf, so a larger
 * result than cap means truncation); writes at most cap bytes and no NUL. */
size_t blade_tokenizer_token_bytes(const blade_tokenizer *t, int32_t id, bool render_special,
                                   char *buf, size_t cap);

/* Streaming detokenizer: text is released only in whole UTF-8 characters, so a character
 * split across tokens is never emitted half-way. With SPM vocabularies the space prefix the
 * encoder adds is removed from the first piece of a sequence that started with BOS. */
typedef struct blade_detokenizer {
    const blade_tokenizer *tok;
    bool render_special;
    bool at_start;    /* nothing emitted yet after BOS */
    unsigned char pending[8];
    size_t n_pending; /* bytes of an incomplete UTF-8 character held back */
} blade_detokenizer;

void blade_detokenizer_init(blade_detokenizer *d, const blade_tokenizer *t, bool render_special);
/* Feeds one token; writes the text now complete to out, NUL-terminated, and returns its
 * length (the text itself may contain NUL bytes, e.g. from <0x00>). Ill-formed UTF-8
 * becomes U+FFFD. A cap of blade_tokenizer_max_token_bytes() is always enough; with less,
 * the output is cut at a character boundary and the rest of that token is lost. */
size_t blade_detokenizer_push(blade_detokenizer *d, int32_t id, char *out, size_t cap);
/* End of stream: emits what is still held (an incomplete character as U+FFFD). */
size_t blade_detokenizer_flush(blade_detokenizer *d, char *out, size_t cap);
/* Longest output one push can produce, for sizing buffers. */
size_t blade_tokenizer_max_token_bytes(const blade_tokenizer *t);

#endif

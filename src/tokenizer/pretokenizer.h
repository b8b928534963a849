#ifndef BLADE_PRETOKENIZER_H
#define BLADE_PRETOKENIZER_H

/* Byte-level BPE first cuts text into pre-tokens with a regular expression (PCRE2, UTF +
 * Unicode properties); merges never cross a cut. Private to the tokenizer but declared
 * here so tests can check the splits directly. */

#include "blade/error.h"

#include <stdbool.h>
#include <stddef.h>

typedef enum blade_pretok_kind {
    BLADE_PRETOK_GPT2,   /* "default", "gpt-2" */
    BLADE_PRETOK_LLAMA3, /* "llama-bpe", "llama3", "llama-v3" */
    BLADE_PRETOK_QWEN2   /* "qwen2", "deepseek-r1-qwen" */
} blade_pretok_kind;

/* Maps a tokenizer.ggml.pre value; false for names blade does not implement, which must be
 * refused rather than guessed, since a wrong split silently changes every tokenization. */
bool blade_pretok_kind_from_name(const char *name, blade_pretok_kind *kind);

typedef struct blade_pretok blade_pretok;

blade_pretok *blade_pretok_new(blade_pretok_kind kind, blade_error *err);
void blade_pretok_free(blade_pretok *p);

/* Called once per pre-token, in order; the pieces tile the text exactly. Returns 0 to go
 * on, nonzero to stop (the split then returns -1; the callback sets err). */
typedef int (*blade_pretok_cb)(void *ctx, const char *piece, size_t len);

/* Invalid UTF-8 never reaches the regex: each maximal run of bytes that do not form
 * characters becomes a pre-token of its own, exactly as PCRE2_MATCH_INVALID_UTF would
 * treat them (no pattern item matches them, and lookaheads see them as a subject end). */
int blade_pretok_split(const blade_pretok *p, const char *text, size_t len, blade_pretok_cb cb, void *ctx,
                       blade_error *err);

#endif

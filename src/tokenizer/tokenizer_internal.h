#ifndef BLADE_TOKENIZER_INTERNAL_H
#define BLADE_TOKENIZER_INTERNAL_H

/* State shared by the tokenizer's translation units: the loaded vocabulary (vocab.c), the
 * two merge algorithms (spm.c, bpe.c), special-token splitting (special.c) and the
 * detokenizer. Token ids are int32_t everywhere because the public API uses -1 for "none". */

#include "blade/tokenizer.h"
#include "tokenizer/pretokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TOK_NONE UINT32_MAX

/* The 256 code points byte-level BPE uses to spell bytes, and the way back. */
#define BPE_CP_LIMIT 324 /* every code point of the byte alphabet is below this */

typedef struct bpe_merge {
    uint64_t key; /* left id << 32 | right id; UINT64_MAX marks an empty slot */
    int32_t rank;
    int32_t result;
} bpe_merge;

/* Special tokens are found with a byte trie so that scanning text costs O(length of the
 * match) per position, however many specials share a prefix (Llama 3 has 256 "<|...|>"). */
typedef struct special_node {
    int32_t first_child;
    int32_t next_sibling;
    int32_t token; /* token whose text ends here, or -1 */
    unsigned char byte;
} special_node;

struct blade_tokenizer {
    blade_vocab_kind kind;
    int32_t n_vocab;

    char *arena;      /* every token text, NUL-terminated, back to back */
    size_t *text_off; /* into arena */
    size_t *text_len;
    uint8_t *attr;    /* blade_token_attr */
    float *scores;    /* SPM only */
    bool spm_word_split; /* no mergeable token contains "▁" right after another character */

    int32_t *lookup; /* open-addressing table of ids keyed by text; -1 = empty */
    size_t lookup_mask;

    int32_t bos, eos, eot, eom, unk;
    bool add_bos, add_eos, add_space_prefix;

    /* SPM: the <0xNN> token of each byte. BPE: the token spelling the byte in the byte
     * alphabet. -1 where the vocabulary lacks it. */
    int32_t byte_token[256];
    uint16_t byte_cp[256];
    int16_t cp_byte[BPE_CP_LIMIT];

    bpe_merge *merges;
    size_t merge_mask;
    blade_pretok *pre;
    bool ignore_merges; /* Llama 3: a pre-token that is itself a token skips merging */

    special_node *trie;
    size_t n_trie;
    int32_t trie_root[256]; /* first byte -> node, -1 when no special starts with it */
    bool has_user_defined;

    int32_t eog[16];
    size_t n_eog;

    size_t max_piece; /* longest token_bytes() result with render_special */
};

/* Growable output of an encode call. */
typedef struct tok_list {
    int32_t *v;
    size_t n, cap;
} tok_list;

int tok_list_push(tok_list *l, int32_t id, blade_error *err);

/* Both tokenizers are "merge the best adjacent pair until none is left"; they differ only
 * in what makes a pair mergeable and how pairs rank. Symbols form a linked list over a
 * contiguous buffer, so a merged symbol is again a contiguous slice. */
typedef struct merge_sym {
    size_t start, len; /* len 0: absorbed into its left neighbour */
    uint32_t prev, next; /* TOK_NONE at the ends */
    int32_t id;          /* token of this slice, -1 if it is none */
} merge_sym;

/* Says whether l and r may merge; if so, sets the priority (lower merges first) and the
 * token of the result. */
typedef bool (*merge_pair_fn)(void *ctx, const merge_sym *l, const merge_sym *r, uint32_t *prio, int32_t *id);

typedef struct merge_cand {
    uint64_t key; /* prio << 32 | left index: equal priorities merge leftmost first */
    size_t len;   /* l.len + r.len when queued, to detect candidates made stale by a merge */
    uint32_t left, right;
    int32_t id;
} merge_cand;

typedef struct merge_queue {
    merge_cand *v;
    size_t n, cap;
} merge_queue;

/* Runs the merges over sym[0..n) (linked in order, n < TOK_NONE). q is scratch the caller
 * may reuse across calls and frees with free(q->v). O(n log n). */
int merge_run(merge_sym *sym, uint32_t n, merge_pair_fn pair, void *ctx, merge_queue *q, blade_error *err);

/* Exact lookup of a vocabulary text; -1 when absent. */
int32_t vocab_lookup(const blade_tokenizer *t, const char *s, size_t len);
/* Whether plain text may turn into this token through merging (as SentencePiece and the
 * HF tokenizers behave): control, unknown, byte and unused entries never can. */
bool vocab_mergeable(const blade_tokenizer *t, int32_t id);
/* Fills the merge table from tokenizer.ggml.merges ("left right" per entry, rank = index). */
int bpe_load_merges(blade_tokenizer *t, const gguf_kv *kv, blade_error *err);
const bpe_merge *bpe_find_merge(const blade_tokenizer *t, int32_t left, int32_t right);
void bpe_byte_alphabet(uint16_t byte_cp[256], int16_t cp_byte[BPE_CP_LIMIT]);

int spm_encode(const blade_tokenizer *t, const char *text, size_t len, bool space_prefix, tok_list *out,
               blade_error *err);
int bpe_encode(const blade_tokenizer *t, const char *text, size_t len, tok_list *out, blade_error *err);

/* Builds the special-token trie from the attributes; vocab.c calls it once loaded. */
int special_build(blade_tokenizer *t, blade_error *err);

/* Feeds the bytes a token stands for to sink, in pieces. Shared by token_bytes and the
 * streaming detokenizer so neither needs a buffer for arbitrarily long tokens. */
typedef void (*piece_sink)(void *ctx, const char *p, size_t n);
void token_decode(const blade_tokenizer *t, int32_t id, bool render_special, piece_sink sink, void *ctx);

#endif

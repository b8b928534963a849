/* Encoding (tokenizer.h): BOS when asked, special tokens found verbatim in the text with a
 * byte trie, and the text between them handed to SentencePiece or BPE. */

#include "tokenizer/tokenizer_internal.h"

#include <stdlib.h>

/* Which tokens are matched verbatim in text. User-defined tokens always are: SentencePiece
 * and the HF tokenizers treat them as atomic pieces of the text itself. Control and
 * unknown tokens are only when the caller parses specials, so untrusted text cannot smuggle
 * in "<s>" or "<|im_end|>". */
static bool special_active(const blade_tokenizer *t, int32_t id, bool parse_special)
{
    uint8_t a = t->attr[id];
    if (a == BLADE_TOKEN_USER_DEFINED)
        return true;
    return parse_special && (a == BLADE_TOKEN_CONTROL || a == BLADE_TOKEN_UNKNOWN);
}

static int trie_add(blade_tokenizer *t, size_t *cap, unsigned char byte, int32_t *link, blade_error *err)
{
    if (t->n_trie == *cap) {
        size_t nc = *cap ? *cap * 2 : 64;
        special_node *v = realloc(t->trie, nc * sizeof *v);
        if (!v)
            return blade_error_set(err, "tokenizer: out of memory for the special-token table");
        t->trie = v;
        *cap = nc;
    }
    t->trie[t->n_trie] = (special_node){.first_child = -1, .next_sibling = -1, .token = -1, .byte = byte};
    *link = (int32_t)t->n_trie++;
    return 0;
}

int special_build(blade_tokenizer *t, blade_error *err)
{
    size_t cap = 0;
    for (int b = 0; b < 256; b++)
        t->trie_root[b] = -1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        uint8_t a = t->attr[id];
        size_t len = t->text_len[id];
        if ((a != BLADE_TOKEN_CONTROL && a != BLADE_TOKEN_USER_DEFINED && a != BLADE_TOKEN_UNKNOWN) || !len)
            continue;
        if (t->n_trie + len > INT32_MAX)
            return blade_error_set(err, "tokenizer: special tokens too long");
        t->has_user_defined = t->has_user_defined || a == BLADE_TOKEN_USER_DEFINED;
        const unsigned char *s = (const unsigned char *)t->arena + t->text_off[id];
        int32_t *link = &t->trie_root[s[0]];
        if (*link < 0 && trie_add(t, &cap, s[0], link, err))
            return -1;
        int32_t node = *link;
        for (size_t i = 1; i < len; i++) {
            int32_t child = t->trie[node].first_child, last = -1;
            while (child >= 0 && t->trie[child].byte != s[i]) {
                last = child;
                child = t->trie[child].next_sibling;
            }
            if (child < 0) {
                /* trie_add may move the array, so the link is re-derived after it */
                int32_t fresh = -1;
                if (trie_add(t, &cap, s[i], &fresh, err))
                    return -1;
                if (last < 0)
                    t->trie[node].first_child = fresh;
                else
                    t->trie[last].next_sibling = fresh;
                child = fresh;
            }
            node = child;
        }
        t->trie[node].token = id; /* a repeated text keeps the last id, like the lookup table */
    }
    return 0;
}

/* Longest active special token starting at s, or -1. */
static int32_t special_match(const blade_tokenizer *t, const unsigned char *s, size_t len, bool parse_special,
                             size_t *match_len)
{
    int32_t best = -1;
    int32_t node = t->trie_root[s[0]];
    for (size_t i = 0; node >= 0;) {
        int32_t tok = t->trie[node].token;
        if (tok >= 0 && special_active(t, tok, parse_special)) {
            best = tok;
            *match_len = i + 1;
        }
        if (++i == len)
            break;
        node = t->trie[node].first_child;
        while (node >= 0 && t->trie[node].byte != s[i])
            node = t->trie[node].next_sibling;
    }
    return best;
}

/* Text segments between specials are tokenized independently. With SentencePiece every
 * segment gets the space prefix, the one at the start of the text and those after a special
 * token alike, as llama.cpp does: the model saw "<s>" followed by "▁word" in training. */
static int encode_text(const blade_tokenizer *t, const char *text, size_t len, tok_list *out, blade_error *err)
{
    if (!len)
        return 0;
    if (t->kind == BLADE_VOCAB_SPM)
        return spm_encode(t, text, len, t->add_space_prefix, out, err);
    return bpe_encode(t, text, len, out, err);
}

int blade_tokenizer_encode(const blade_tokenizer *t, const char *text, size_t len, bool add_bos,
                           bool parse_special, int32_t **tokens, size_t *n_tokens, blade_error *err)
{
    if (!t || !tokens || !n_tokens || (!text && len))
        return blade_error_set(err, "blade_tokenizer_encode: invalid arguments");
    *tokens = NULL;
    *n_tokens = 0;
    tok_list out = {0};
    if (add_bos && t->bos >= 0 && tok_list_push(&out, t->bos, err))
        return -1;

    bool scan = t->n_trie && (parse_special || t->has_user_defined);
    const unsigned char *s = (const unsigned char *)text;
    size_t seg = 0;
    for (size_t pos = 0; scan && pos < len;) {
        size_t mlen = 0;
        int32_t id = special_match(t, s + pos, len - pos, parse_special, &mlen);
        if (id < 0) {
            pos++;
            continue;
        }
        if (encode_text(t, text + seg, pos - seg, &out, err) || tok_list_push(&out, id, err)) {
            free(out.v);
            return -1;
        }
        pos += mlen;
        seg = pos;
    }
    if (encode_text(t, text + seg, len - seg, &out, err)) {
        free(out.v);
        return -1;
    }
    *tokens = out.v;
    *n_tokens = out.n;
    return 0;
}

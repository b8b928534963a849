/* Loading a vocabulary from GGUF metadata (tokenizer.h): tokens, types, scores, special
 * ids and flags, each checked against the vocabulary size; the lookup table from text to
 * id; the tokenizer kind and pre-tokenizer, refused by name when blade does not implement
 * them. */

#include "common/utf8.h"
#include "tokenizer/tokenizer_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KEY_MODEL "tokenizer.ggml.model"
#define KEY_PRE "tokenizer.ggml.pre"
#define KEY_TOKENS "tokenizer.ggml.tokens"
#define KEY_SCORES "tokenizer.ggml.scores"
#define KEY_TYPES "tokenizer.ggml.token_type"
#define KEY_MERGES "tokenizer.ggml.merges"

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
    return h;
}

static bool text_equals(const blade_tokenizer *t, int32_t id, const char *s, size_t len)
{
    return t->text_len[id] == len && (!len || !memcmp(t->arena + t->text_off[id], s, len));
}

int32_t vocab_lookup(const blade_tokenizer *t, const char *s, size_t len)
{
    for (size_t i = hash_bytes(s, len) & t->lookup_mask;; i = (i + 1) & t->lookup_mask) {
        int32_t id = t->lookup[i];
        if (id < 0 || text_equals(t, id, s, len))
            return id;
    }
}

bool vocab_mergeable(const blade_tokenizer *t, int32_t id)
{
    uint8_t a = t->attr[id];
    return a == BLADE_TOKEN_NORMAL || a == BLADE_TOKEN_USER_DEFINED || a == BLADE_TOKEN_UNDEFINED;
}

/* A file-supplied name for an error message: bounded, with anything unprintable replaced,
 * so a hostile file cannot garble the terminal. */
static void describe(char *dst, size_t cap, const char *s)
{
    size_t n = 0;
    for (; *s && n + 4 < cap; s++)
        dst[n++] = (*s >= 0x20 && *s < 0x7F) ? *s : '?';
    if (*s) {
        memcpy(dst + n, "...", 3);
        n += 3;
    }
    dst[n] = 0;
}

static int load_tokens(blade_tokenizer *t, const gguf_file *f, blade_error *err)
{
    bool present = false;
    const gguf_kv *kv = gguf_find_array(f, KEY_TOKENS, GGUF_TYPE_STRING, &present, err);
    if (!kv)
        return present ? -1 : blade_error_set(err, "%s: missing", KEY_TOKENS);
    if (kv->arr_len == 0)
        return blade_error_set(err, "%s: empty vocabulary", KEY_TOKENS);
    if (kv->arr_len > (uint64_t)INT32_MAX / 2)
        return blade_error_set(err, "%s: %llu tokens is more than blade supports", KEY_TOKENS,
                               (unsigned long long)kv->arr_len);
    size_t n = (size_t)kv->arr_len, total = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t len = kv->arr_strings[i].len;
        if (len >= SIZE_MAX - total - 1)
            return blade_error_set(err, "%s: token texts too long", KEY_TOKENS);
        total += (size_t)len + 1;
    }
    size_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    t->n_vocab = (int32_t)n;
    t->arena = malloc(total);
    t->text_off = malloc(n * sizeof *t->text_off);
    t->text_len = malloc(n * sizeof *t->text_len);
    t->attr = malloc(n);
    t->lookup = malloc(cap * sizeof *t->lookup);
    if (!t->arena || !t->text_off || !t->text_len || !t->attr || !t->lookup)
        return blade_error_set(err, "%s: out of memory for %zu tokens", KEY_TOKENS, n);
    t->lookup_mask = cap - 1;
    memset(t->lookup, 0xFF, cap * sizeof *t->lookup);
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len = (size_t)kv->arr_strings[i].len;
        if (len)
            memcpy(t->arena + off, kv->arr_strings[i].ptr, len);
        t->arena[off + len] = 0;
        t->text_off[i] = off;
        t->text_len[i] = len;
        t->attr[i] = BLADE_TOKEN_NORMAL;
        off += len + 1;
        /* A text listed twice resolves to its last id, as in llama.cpp. */
        size_t slot = hash_bytes(t->arena + t->text_off[i], len) & t->lookup_mask;
        while (t->lookup[slot] >= 0 && !text_equals(t, t->lookup[slot], t->arena + t->text_off[i], len))
            slot = (slot + 1) & t->lookup_mask;
        t->lookup[slot] = (int32_t)i;
    }
    return 0;
}

static int load_types(blade_tokenizer *t, const gguf_file *f, blade_error *err)
{
    bool present = false;
    const gguf_kv *kv = gguf_find_array(f, KEY_TYPES, GGUF_TYPE_INT32, &present, err);
    if (!kv)
        return present ? -1 : 0; /* absent: every token is normal text */
    if (kv->arr_len != (uint64_t)t->n_vocab)
        return blade_error_set(err, "%s: %llu entries but %s has %d", KEY_TYPES, (unsigned long long)kv->arr_len,
                               KEY_TOKENS, t->n_vocab);
    const unsigned char *p = kv->arr_data;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        int32_t v;
        memcpy(&v, p + (size_t)i * 4, 4);
        if (v < BLADE_TOKEN_UNDEFINED || v > BLADE_TOKEN_BYTE)
            return blade_error_set(err, "%s[%d]: unknown token type %d", KEY_TYPES, i, v);
        t->attr[i] = (uint8_t)v;
    }
    return 0;
}

static int load_scores(blade_tokenizer *t, const gguf_file *f, blade_error *err)
{
    bool present = false;
    const gguf_kv *kv = gguf_find_array(f, KEY_SCORES, GGUF_TYPE_FLOAT32, &present, err);
    if (!kv)
        return present ? -1 : blade_error_set(err, "%s: missing (a \"llama\" tokenizer needs scores)", KEY_SCORES);
    if (kv->arr_len != (uint64_t)t->n_vocab)
        return blade_error_set(err, "%s: %llu entries but %s has %d", KEY_SCORES, (unsigned long long)kv->arr_len,
                               KEY_TOKENS, t->n_vocab);
    t->scores = malloc((size_t)t->n_vocab * sizeof *t->scores);
    if (!t->scores)
        return blade_error_set(err, "%s: out of memory", KEY_SCORES);
    memcpy(t->scores, kv->arr_data, (size_t)t->n_vocab * sizeof *t->scores);
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (isnan(t->scores[i]))
            return blade_error_set(err, "%s[%d]: not a number", KEY_SCORES, i);
    return 0;
}

static int load_id(const gguf_file *f, const char *key, int32_t n_vocab, int32_t *out, blade_error *err)
{
    int64_t v;
    bool present = false;
    *out = -1;
    if (!gguf_get_i64(f, key, &v, &present, err))
        return present ? -1 : 0;
    /* converters write -1, or -1 stored as u32, for "this vocabulary has no such token" */
    if (v == -1 || v == (int64_t)UINT32_MAX)
        return 0;
    if (v < 0 || v >= n_vocab)
        return blade_error_set(err, "%s: token id %lld out of range (the vocabulary has %d tokens)", key,
                               (long long)v, n_vocab);
    *out = (int32_t)v;
    return 0;
}

static int load_flag(const gguf_file *f, const char *key, bool dflt, bool *out, blade_error *err)
{
    bool present = false;
    *out = dflt;
    if (!gguf_get_bool(f, key, out, &present, err) && present)
        return -1;
    return 0;
}

static int load_pre(blade_tokenizer *t, const gguf_file *f, blade_error *err)
{
    bool present = false;
    char *name = gguf_get_string(f, KEY_PRE, &present, err);
    if (!name && present)
        return -1;
    blade_pretok_kind kind = BLADE_PRETOK_GPT2; /* absent means the original GPT-2 split */
    if (name && !blade_pretok_kind_from_name(name, &kind)) {
        char shown[80];
        describe(shown, sizeof shown, name);
        free(name);
        return blade_error_set(err,
                               "%s: unsupported pre-tokenizer '%s' (blade knows default, gpt-2, llama-bpe, "
                               "llama3, llama-v3, qwen2, deepseek-r1-qwen)",
                               KEY_PRE, shown);
    }
    free(name);
    t->pre = blade_pretok_new(kind, err);
    if (!t->pre)
        return -1;
    /* Llama 3's tokenizer looks a whole pre-token up before merging (HF "ignore_merges"). */
    t->ignore_merges = kind == BLADE_PRETOK_LLAMA3;
    return 0;
}

static int load_kind(blade_tokenizer *t, const gguf_file *f, blade_error *err)
{
    bool present = false;
    char *model = gguf_get_string(f, KEY_MODEL, &present, err);
    if (!model)
        return present ? -1 : blade_error_set(err, "%s: missing", KEY_MODEL);
    int rc = 0;
    if (!strcmp(model, "llama")) {
        t->kind = BLADE_VOCAB_SPM;
    } else if (!strcmp(model, "gpt2")) {
        t->kind = BLADE_VOCAB_BPE;
    } else {
        char shown[80];
        describe(shown, sizeof shown, model);
        rc = blade_error_set(err, "%s: unsupported tokenizer '%s' (blade knows llama and gpt2)", KEY_MODEL, shown);
    }
    free(model);
    return rc;
}

static void find_byte_tokens(blade_tokenizer *t)
{
    bpe_byte_alphabet(t->byte_cp, t->cp_byte);
    for (int b = 0; b < 256; b++) {
        char text[8];
        size_t n;
        if (t->kind == BLADE_VOCAB_SPM)
            n = (size_t)snprintf(text, sizeof text, "<0x%02X>", b);
        else
            n = blade_utf8_encode(t->byte_cp[b], text);
        t->byte_token[b] = vocab_lookup(t, text, n);
    }
}

/* Turn-ending tokens that many GGUF files leave out of the metadata: a chat model whose
 * EOS is "<|endoftext|>" still ends its turns with "<|im_end|>". */
static void collect_eog(blade_tokenizer *t)
{
    static const char *const turn_ends[] = {
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
    };
    const int32_t ids[] = {t->eos, t->eot, t->eom};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (ids[i] >= 0)
            t->eog[t->n_eog++] = ids[i];
    for (size_t i = 0; i < sizeof turn_ends / sizeof turn_ends[0]; i++) {
        int32_t id = vocab_lookup(t, turn_ends[i], strlen(turn_ends[i]));
        if (id >= 0 && t->attr[id] == BLADE_TOKEN_CONTROL && !blade_tokenizer_is_eog(t, id))
            t->eog[t->n_eog++] = id;
    }
}

/* Whether SentencePiece text may be cut before every "▁" that follows something other than
 * "▁": true unless some token could be formed across such a cut. */
static bool spm_words_independent(const blade_tokenizer *t)
{
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (!vocab_mergeable(t, id))
            continue;
        const char *s = t->arena + t->text_off[id];
        size_t len = t->text_len[id];
        for (size_t p = 1; p + 3 <= len; p++)
            if (!memcmp(s + p, "\xE2\x96\x81", 3) && (p < 3 || memcmp(s + p - 3, "\xE2\x96\x81", 3)))
                return false;
    }
    return true;
}

static void count_piece(void *ctx, const char *p, size_t n)
{
    (void)p;
    *(size_t *)ctx += n;
}

blade_tokenizer *blade_tokenizer_load(const gguf_file *f, blade_error *err)
{
    blade_tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        blade_error_set(err, "tokenizer: out of memory");
        return NULL;
    }
    if (!f) {
        blade_error_set(err, "tokenizer: no GGUF file");
        goto fail;
    }
    if (load_kind(t, f, err) || load_tokens(t, f, err) || load_types(t, f, err))
        goto fail;
    bool spm = t->kind == BLADE_VOCAB_SPM;
    if (spm ? load_scores(t, f, err) : load_pre(t, f, err))
        goto fail;
    if (!spm) {
        bool present = false;
        const gguf_kv *merges = gguf_find_array(f, KEY_MERGES, GGUF_TYPE_STRING, &present, err);
        if (!merges) {
            if (!present)
                blade_error_set(err, "%s: missing (a \"gpt2\" tokenizer needs merges)", KEY_MERGES);
            goto fail;
        }
        if (bpe_load_merges(t, merges, err))
            goto fail;
    }
    if (load_id(f, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos, err) ||
        load_id(f, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos, err) ||
        load_id(f, "tokenizer.ggml.eot_token_id", t->n_vocab, &t->eot, err) ||
        load_id(f, "tokenizer.ggml.eom_token_id", t->n_vocab, &t->eom, err) ||
        load_id(f, "tokenizer.ggml.unknown_token_id", t->n_vocab, &t->unk, err))
        goto fail;
    /* Older files name the unknown token only through its type. */
    if (t->unk < 0 && !gguf_find_kv(f, "tokenizer.ggml.unknown_token_id"))
        for (int32_t id = 0; id < t->n_vocab && t->unk < 0; id++)
            if (t->attr[id] == BLADE_TOKEN_UNKNOWN)
                t->unk = id;
    /* Nothing in blade pads, but a padding id past the vocabulary means a broken file. */
    int32_t pad;
    if (load_id(f, "tokenizer.ggml.padding_token_id", t->n_vocab, &pad, err))
        goto fail;
    /* Defaults follow the reference implementations: SentencePiece models and Llama 3 start
     * prompts with BOS, GPT-2 style vocabularies do not. */
    bool bos_default = spm || t->ignore_merges;
    if (load_flag(f, "tokenizer.ggml.add_bos_token", bos_default, &t->add_bos, err) ||
        load_flag(f, "tokenizer.ggml.add_eos_token", false, &t->add_eos, err) ||
        (spm && load_flag(f, "tokenizer.ggml.add_space_prefix", true, &t->add_space_prefix, err)))
        goto fail;
    find_byte_tokens(t);
    t->spm_word_split = spm && spm_words_independent(t);
    if (special_build(t, err))
        goto fail;
    collect_eog(t);
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t n = 0;
        token_decode(t, id, true, count_piece, &n);
        if (n > t->max_piece)
            t->max_piece = n;
    }
    return t;
fail:
    blade_tokenizer_free(t);
    return NULL;
}

blade_tokenizer *blade_tokenizer_load_file(const char *path, blade_error *err)
{
    gguf_file *f = gguf_open_mapped(path, err);
    if (!f)
        return NULL;
    blade_tokenizer *t = blade_tokenizer_load(f, err);
    if (!t)
        blade_error_prefix(err, "%s", path);
    /* Every token text and score was copied: the mapping can go. */
    gguf_close(f);
    return t;
}

void blade_tokenizer_free(blade_tokenizer *t)
{
    if (!t)
        return;
    free(t->arena);
    free(t->text_off);
    free(t->text_len);
    free(t->attr);
    free(t->scores);
    free(t->lookup);
    free(t->merges);
    blade_pretok_free(t->pre);
    free(t->trie);
    free(t);
}

blade_vocab_kind blade_tokenizer_kind(const blade_tokenizer *t) { return t->kind; }
int32_t blade_tokenizer_n_vocab(const blade_tokenizer *t) { return t->n_vocab; }
int32_t blade_tokenizer_bos(const blade_tokenizer *t) { return t->bos; }
int32_t blade_tokenizer_eos(const blade_tokenizer *t) { return t->eos; }
int32_t blade_tokenizer_eot(const blade_tokenizer *t) { return t->eot; }
bool blade_tokenizer_wants_bos(const blade_tokenizer *t) { return t->add_bos && t->bos >= 0; }
bool blade_tokenizer_wants_eos(const blade_tokenizer *t) { return t->add_eos && t->eos >= 0; }

bool blade_tokenizer_is_eog(const blade_tokenizer *t, int32_t id)
{
    for (size_t i = 0; id >= 0 && i < t->n_eog; i++)
        if (t->eog[i] == id)
            return true;
    return false;
}

blade_token_attr blade_tokenizer_attr(const blade_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab ? (blade_token_attr)t->attr[id] : BLADE_TOKEN_UNDEFINED;
}

const char *blade_tokenizer_token_text(const blade_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab ? t->arena + t->text_off[id] : "";
}

int32_t blade_tokenizer_find(const blade_tokenizer *t, const char *text, size_t len)
{
    return text || !len ? vocab_lookup(t, text ? text : "", len) : -1;
}

/* Byte-level BPE (tokenizer_internal.h): the byte alphabet, the merge table from
 * tokenizer.ggml.merges, and encoding pre-token by pre-token with the shared merge loop,
 * lower-ranked merges first. */

#include "common/utf8.h"
#include "tokenizer/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

void bpe_byte_alphabet(uint16_t byte_cp[256], int16_t cp_byte[BPE_CP_LIMIT])
{
    /* GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for themselves, the
     * other 68 bytes take U+0100 onwards in byte order, so every byte has a visible
     * character and vocabulary entries never contain raw whitespace or control bytes. */
    unsigned extra = 0;
    for (int cp = 0; cp < BPE_CP_LIMIT; cp++)
        cp_byte[cp] = -1;
    for (unsigned b = 0; b < 256; b++) {
        bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        byte_cp[b] = (uint16_t)(printable ? b : 256 + extra++);
        cp_byte[byte_cp[b]] = (int16_t)b;
    }
}

static uint64_t merge_key(int32_t left, int32_t right)
{
    return (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
}

static size_t merge_slot(uint64_t key, size_t mask)
{
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & mask;
}

const bpe_merge *bpe_find_merge(const blade_tokenizer *t, int32_t left, int32_t right)
{
    uint64_t key = merge_key(left, right);
    for (size_t i = merge_slot(key, t->merge_mask);; i = (i + 1) & t->merge_mask) {
        const bpe_merge *m = &t->merges[i];
        if (m->key == key)
            return m;
        if (m->key == UINT64_MAX)
            return NULL;
    }
}

int bpe_load_merges(blade_tokenizer *t, const gguf_kv *kv, blade_error *err)
{
    static const char key_name[] = "tokenizer.ggml.merges";
    if (kv->arr_len > (uint64_t)INT32_MAX)
        return blade_error_set(err, "%s: %llu entries is more than blade supports", key_name,
                               (unsigned long long)kv->arr_len);
    size_t n = (size_t)kv->arr_len, cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    t->merges = malloc(cap * sizeof *t->merges);
    if (!t->merges)
        return blade_error_set(err, "%s: out of memory for %zu merges", key_name, n);
    t->merge_mask = cap - 1;
    for (size_t i = 0; i < cap; i++)
        t->merges[i].key = UINT64_MAX;

    char *joined = NULL;
    size_t joined_cap = 0;
    int rc = 0;
    for (size_t r = 0; r < n && !rc; r++) {
        const char *s = kv->arr_strings[r].ptr;
        size_t len = (size_t)kv->arr_strings[r].len;
        /* The separator is the first space after the first byte, so a left side can never
         * be empty; byte-level vocabularies spell spaces as U+0120, so none is ambiguous. */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) {
            rc = blade_error_set(err, "%s[%zu]: no space between the two sides of the merge", key_name, r);
            break;
        }
        size_t ll = (size_t)(sp - s), rl = len - ll - 1;
        int32_t left = vocab_lookup(t, s, ll), right = vocab_lookup(t, sp + 1, rl);
        if (len - 1 > joined_cap) {
            char *bigger = realloc(joined, len - 1);
            if (!bigger) {
                rc = blade_error_set(err, "%s: out of memory", key_name);
                break;
            }
            joined = bigger;
            joined_cap = len - 1;
        }
        memcpy(joined, s, ll);
        memcpy(joined + ll, sp + 1, rl);
        int32_t result = vocab_lookup(t, joined, ll + rl);
        /* Merges are applied to token ids, so one whose sides or result are not tokens can
         * never fire; such entries are skipped as inert rather than refused. */
        if (left < 0 || right < 0 || result < 0)
            continue;
        uint64_t key = merge_key(left, right);
        size_t i = merge_slot(key, t->merge_mask);
        while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key)
            i = (i + 1) & t->merge_mask;
        if (t->merges[i].key == key)
            continue; /* a repeated pair keeps its first (best) rank */
        t->merges[i] = (bpe_merge){.key = key, .rank = (int32_t)r, .result = result};
    }
    free(joined);
    return rc;
}

typedef struct bpe_ctx {
    const blade_tokenizer *t;
    tok_list *out;
    blade_error *err;
    merge_sym *sym;
    size_t sym_cap;
    char *spelled; /* a pre-token in the byte alphabet, for the ignore_merges lookup */
    size_t spelled_cap;
    merge_queue q;
} bpe_ctx;

static bool bpe_pair(void *ctx, const merge_sym *l, const merge_sym *r, uint32_t *prio, int32_t *id)
{
    const blade_tokenizer *t = ctx;
    if (l->id < 0 || r->id < 0)
        return false;
    const bpe_merge *m = bpe_find_merge(t, l->id, r->id);
    if (!m)
        return false;
    *prio = (uint32_t)m->rank;
    *id = m->result;
    return true;
}

static int grow(void **buf, size_t *cap, size_t need, size_t elem, blade_error *err)
{
    if (need <= *cap)
        return 0;
    if (need > SIZE_MAX / elem / 2)
        return blade_error_set(err, "tokenizer: pre-token of %zu bytes is too long", need);
    void *p = realloc(*buf, need * 2 * elem);
    if (!p)
        return blade_error_set(err, "tokenizer: out of memory for a pre-token of %zu bytes", need);
    *buf = p;
    *cap = need * 2;
    return 0;
}

/* A symbol no token covers: only possible when the vocabulary lacks a byte's character. */
static int emit_unknown(bpe_ctx *c, const char *word, const merge_sym *s)
{
    if (c->t->unk >= 0)
        return tok_list_push(c->out, c->t->unk, c->err);
    return blade_error_set(c->err, "tokenizer: byte 0x%02X has no token and the vocabulary has no unknown token",
                           (unsigned char)word[s->start]);
}

static int bpe_word(void *ctx, const char *word, size_t len)
{
    bpe_ctx *c = ctx;
    const blade_tokenizer *t = c->t;
    if (t->ignore_merges) {
        if (grow((void **)&c->spelled, &c->spelled_cap, 2 * len, 1, c->err))
            return -1;
        size_t n = 0;
        for (size_t i = 0; i < len; i++)
            n += blade_utf8_encode(t->byte_cp[(unsigned char)word[i]], c->spelled + n);
        int32_t id = vocab_lookup(t, c->spelled, n);
        if (id >= 0 && vocab_mergeable(t, id))
            return tok_list_push(c->out, id, c->err);
    }
    if (len >= TOK_NONE)
        return blade_error_set(c->err, "tokenizer: pre-token of %zu bytes is too long", len);
    if (grow((void **)&c->sym, &c->sym_cap, len, sizeof *c->sym, c->err))
        return -1;
    uint32_t n = (uint32_t)len;
    for (uint32_t i = 0; i < n; i++) {
        c->sym[i] = (merge_sym){
            .start = i,
            .len = 1,
            .prev = i ? i - 1 : TOK_NONE,
            .next = i + 1 < n ? i + 1 : TOK_NONE,
            .id = t->byte_token[(unsigned char)word[i]],
        };
    }
    if (merge_run(c->sym, n, bpe_pair, (void *)t, &c->q, c->err))
        return -1;
    for (uint32_t i = 0; i != TOK_NONE; i = c->sym[i].next) {
        const merge_sym *s = &c->sym[i];
        if (s->id >= 0 ? tok_list_push(c->out, s->id, c->err) : emit_unknown(c, word, s))
            return -1;
    }
    return 0;
}

int bpe_encode(const blade_tokenizer *t, const char *text, size_t len, tok_list *out, blade_error *err)
{
    bpe_ctx c = {.t = t, .out = out, .err = err};
    int rc = blade_pretok_split(t->pre, text, len, bpe_word, &c, err);
    free(c.sym);
    free(c.spelled);
    free(c.q.v);
    return rc;
}

/* SentencePiece encoding (tokenizer_internal.h): the text normalized to SentencePiece's
 * visible spaces, split into words where no token can span, merged by score with the
 * shared merge loop, and characters no token covers spelled with byte tokens. */

#include "common/utf8.h"
#include "tokenizer/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

static const char SPACE_MARK[] = "\xE2\x96\x81"; /* U+2581, SentencePiece's visible space */

typedef struct spm_ctx {
    const blade_tokenizer *t;
    const char *buf;
} spm_ctx;

/* Maps a score onto an unsigned key that sorts the other way round, so the best score
 * gets the lowest priority number. */
static uint32_t score_prio(float score)
{
    uint32_t bits;
    memcpy(&bits, &score, sizeof bits);
    bits = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
    return ~bits;
}

static bool spm_pair(void *ctx, const merge_sym *l, const merge_sym *r, uint32_t *prio, int32_t *id)
{
    const spm_ctx *c = ctx;
    int32_t tok = vocab_lookup(c->t, c->buf + l->start, l->len + r->len);
    if (tok < 0 || !vocab_mergeable(c->t, tok))
        return false;
    *prio = score_prio(c->t->scores[tok]);
    *id = tok;
    return true;
}

/* A character no token covers is spelled with byte tokens; a vocabulary without them gets
 * one unknown token per such character, as SentencePiece does. */
static int spm_fallback(const blade_tokenizer *t, const char *s, size_t len, tok_list *out, blade_error *err)
{
    bool bytes = true;
    for (size_t i = 0; i < len; i++)
        bytes = bytes && t->byte_token[(unsigned char)s[i]] >= 0;
    if (bytes) {
        for (size_t i = 0; i < len; i++)
            if (tok_list_push(out, t->byte_token[(unsigned char)s[i]], err))
                return -1;
        return 0;
    }
    if (t->unk >= 0)
        return tok_list_push(out, t->unk, err);
    return blade_error_set(err, "tokenizer: byte 0x%02X has no token and the vocabulary has no unknown token",
                           (unsigned char)s[0]);
}

typedef struct spm_scratch {
    merge_sym *sym;
    size_t cap;
    merge_queue q;
} spm_scratch;

/* Merges the normalized text buf[from, to) and emits its tokens. */
static int spm_word(const spm_ctx *c, spm_scratch *sc, size_t from, size_t to, tok_list *out, blade_error *err)
{
    const blade_tokenizer *t = c->t;
    /* One symbol per character; a byte that starts no well-formed character stands alone,
     * which later sends it to its byte token. */
    uint32_t ns = 0;
    for (size_t i = from; i < to; ns++) {
        if (ns == TOK_NONE - 1)
            return blade_error_set(err, "tokenizer: a word of %zu bytes is too long", to - from);
        if (ns == sc->cap) {
            size_t cap = sc->cap ? sc->cap * 2 : 64;
            merge_sym *sym = realloc(sc->sym, cap * sizeof *sym);
            if (!sym)
                return blade_error_set(err, "tokenizer: out of memory for a word of %zu bytes", to - from);
            sc->sym = sym;
            sc->cap = cap;
        }
        size_t cl = blade_utf8_char_len(c->buf + i, to - i);
        if (!cl)
            cl = 1;
        int32_t id = vocab_lookup(t, c->buf + i, cl);
        sc->sym[ns] = (merge_sym){
            .start = i,
            .len = cl,
            .prev = ns ? ns - 1 : TOK_NONE,
            .next = ns + 1,
            .id = id >= 0 && vocab_mergeable(t, id) ? id : -1,
        };
        i += cl;
    }
    if (!ns)
        return 0;
    sc->sym[ns - 1].next = TOK_NONE;
    if (merge_run(sc->sym, ns, spm_pair, (void *)c, &sc->q, err))
        return -1;
    for (uint32_t k = 0; k != TOK_NONE; k = sc->sym[k].next) {
        const merge_sym *s = &sc->sym[k];
        if (s->id >= 0 ? tok_list_push(out, s->id, err) : spm_fallback(t, c->buf + s->start, s->len, out, err))
            return -1;
    }
    return 0;
}

int spm_encode(const blade_tokenizer *t, const char *text, size_t len, bool space_prefix, tok_list *out,
               blade_error *err)
{
    if (len > (SIZE_MAX - 3) / 3)
        return blade_error_set(err, "tokenizer: text too long");
    size_t cap = 3 * len + 3;
    char *buf = malloc(cap);
    if (!buf)
        return blade_error_set(err, "tokenizer: out of memory for %zu bytes of text", len);
    size_t n = 0;
    if (space_prefix) {
        memcpy(buf, SPACE_MARK, 3);
        n = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(buf + n, SPACE_MARK, 3);
            n += 3;
        } else {
            buf[n++] = text[i];
        }
    }

    spm_ctx c = {.t = t, .buf = buf};
    spm_scratch sc = {0};
    int rc = 0;
    /* Where no token can span "x▁" (a space mark after anything but another space mark),
     * the text splits there into words that merge independently: the result is the same,
     * and small per-word queues are several times faster than one over the whole text. */
    size_t word = 0;
    bool prev_mark = false;
    for (size_t i = 0; i < n && !rc;) {
        size_t cl = blade_utf8_char_len(buf + i, n - i);
        bool mark = cl == 3 && !memcmp(buf + i, SPACE_MARK, 3);
        if (mark && !prev_mark && i > word && t->spm_word_split) {
            rc = spm_word(&c, &sc, word, i, out, err);
            word = i;
        }
        prev_mark = mark;
        i += cl ? cl : 1;
    }
    if (!rc && n > word)
        rc = spm_word(&c, &sc, word, n, out, err);
    free(sc.q.v);
    free(sc.sym);
    free(buf);
    return rc;
}

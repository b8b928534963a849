/* From tokens back to bytes (tokenizer.h): one token's bytes (SentencePiece's visible
 * space and <0xNN> byte tokens, byte-level BPE's alphabet spelled back) and the streaming
 * detokenizer, which releases whole UTF-8 characters only. */

#include "common/utf8.h"
#include "tokenizer/tokenizer_internal.h"

#include <string.h>

static const char REPLACEMENT[] = "\xEF\xBF\xBD"; /* U+FFFD */

/* "<0xNN>" -> NN, or -1 for any other text. */
static int byte_token_value(const char *s, size_t len)
{
    if (len != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

static void spm_unescape(const char *s, size_t len, piece_sink sink, void *ctx)
{
    size_t from = 0;
    for (size_t i = 0; i + 3 <= len;) {
        if (!memcmp(s + i, "\xE2\x96\x81", 3)) {
            if (i > from)
                sink(ctx, s + from, i - from);
            sink(ctx, " ", 1);
            i += 3;
            from = i;
        } else {
            i++;
        }
    }
    if (len > from)
        sink(ctx, s + from, len - from);
}

static void bpe_unspell(const blade_tokenizer *t, const char *s, size_t len, piece_sink sink, void *ctx)
{
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t cl = blade_utf8_decode(s + i, len - i, &cp);
        if (cp < BPE_CP_LIMIT && t->cp_byte[cp] >= 0) {
            char b = (char)t->cp_byte[cp];
            sink(ctx, &b, 1);
        } else {
            /* outside the byte alphabet (or not UTF-8 at all): the text is the output */
            sink(ctx, s + i, cl);
        }
        i += cl;
    }
}

void token_decode(const blade_tokenizer *t, int32_t id, bool render_special, piece_sink sink, void *ctx)
{
    if (!t || id < 0 || id >= t->n_vocab)
        return;
    const char *s = t->arena + t->text_off[id];
    size_t len = t->text_len[id];
    switch ((blade_token_attr)t->attr[id]) {
    case BLADE_TOKEN_BYTE: {
        int b = byte_token_value(s, len);
        if (b >= 0) {
            char c = (char)b;
            sink(ctx, &c, 1);
        } else if (len) {
            sink(ctx, s, len);
        }
        return;
    }
    case BLADE_TOKEN_CONTROL:
    case BLADE_TOKEN_UNKNOWN:
    case BLADE_TOKEN_UNUSED:
        if (render_special && len)
            sink(ctx, s, len);
        return;
    case BLADE_TOKEN_USER_DEFINED:
        /* user-defined texts are stored as written, never in the byte alphabet */
        if (t->kind == BLADE_VOCAB_SPM)
            spm_unescape(s, len, sink, ctx);
        else if (len)
            sink(ctx, s, len);
        return;
    case BLADE_TOKEN_UNDEFINED:
    case BLADE_TOKEN_NORMAL:
        break;
    }
    if (t->kind == BLADE_VOCAB_SPM)
        spm_unescape(s, len, sink, ctx);
    else
        bpe_unspell(t, s, len, sink, ctx);
}

typedef struct copy_sink {
    char *buf;
    size_t cap, n;
} copy_sink;

static void copy_piece(void *ctx, const char *p, size_t n)
{
    copy_sink *c = ctx;
    if (c->n < c->cap)
        memcpy(c->buf + c->n, p, n < c->cap - c->n ? n : c->cap - c->n);
    c->n += n;
}

size_t blade_tokenizer_token_bytes(const blade_tokenizer *t, int32_t id, bool render_special, char *buf, size_t cap)
{
    copy_sink c = {.buf = buf, .cap = buf ? cap : 0};
    token_decode(t, id, render_special, copy_piece, &c);
    return c.n;
}

size_t blade_tokenizer_max_token_bytes(const blade_tokenizer *t)
{
    /* a held-back partial character, then every byte possibly replaced by U+FFFD, + NUL */
    return t ? 3 * t->max_piece + 8 : 0;
}

/* ---- streaming ---- */

typedef struct stream {
    blade_detokenizer *d;
    char *out;
    size_t cap, n;
    bool full; /* the caller's buffer ran out: drop the rest rather than leave a hole */
} stream;

static void put(stream *st, const void *p, size_t k)
{
    if (st->full || st->n + k >= st->cap) {
        st->full = true;
        return;
    }
    memcpy(st->out + st->n, p, k);
    st->n += k;
}

/* An incremental UTF-8 decoder: whole characters pass, an unfinished one waits in
 * d->pending, and each ill-formed subsequence becomes one U+FFFD (the Unicode "maximal
 * subpart" practice, so a stray byte cannot swallow the valid character after it). */
static void stream_byte(stream *st, unsigned char b)
{
    blade_detokenizer *d = st->d;
    unsigned char lo, hi;
    if (d->n_pending) {
        size_t need = blade_utf8_lead(d->pending[0], &lo, &hi);
        bool fits = d->n_pending == 1 ? (b >= lo && b <= hi) : (b & 0xC0) == 0x80;
        if (fits) {
            d->pending[d->n_pending++] = b;
            if (d->n_pending == need) {
                put(st, d->pending, need);
                d->n_pending = 0;
            }
            return;
        }
        put(st, REPLACEMENT, 3);
        d->n_pending = 0;
    }
    size_t need = blade_utf8_lead(b, &lo, &hi);
    if (need == 1)
        put(st, &b, 1);
    else if (need == 0)
        put(st, REPLACEMENT, 3);
    else
        d->pending[d->n_pending++] = b;
}

static void stream_piece(void *ctx, const char *p, size_t n)
{
    stream *st = ctx;
    for (size_t i = 0; i < n; i++) {
        if (st->d->at_start) {
            st->d->at_start = false;
            if (p[i] == ' ')
                continue;
        }
        stream_byte(st, (unsigned char)p[i]);
    }
}

void blade_detokenizer_init(blade_detokenizer *d, const blade_tokenizer *t, bool render_special)
{
    memset(d, 0, sizeof *d);
    d->tok = t;
    d->render_special = render_special;
}

size_t blade_detokenizer_push(blade_detokenizer *d, int32_t id, char *out, size_t cap)
{
    stream st = {.d = d, .out = out, .cap = out ? cap : 0};
    token_decode(d->tok, id, d->render_special, stream_piece, &st);
    /* Set after BOS's own piece, which with render_special is "<s>" and must not count as
     * the first piece of text. */
    const blade_tokenizer *t = d->tok;
    if (t && id >= 0 && id == t->bos && t->kind == BLADE_VOCAB_SPM && t->add_space_prefix)
        d->at_start = true;
    if (st.cap)
        out[st.n] = 0;
    return st.n;
}

size_t blade_detokenizer_flush(blade_detokenizer *d, char *out, size_t cap)
{
    stream st = {.d = d, .out = out, .cap = out ? cap : 0};
    if (d->n_pending)
        put(&st, REPLACEMENT, 3);
    d->n_pending = 0;
    d->at_start = false;
    if (st.cap)
        out[st.n] = 0;
    return st.n;
}

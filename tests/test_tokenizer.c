/* Tokenizer tests: the published llama.cpp test vectors for both tokenizer families, round
 * trips through the (streaming) detokenizer, special-token parsing, the pre-tokenizer
 * regexes, metadata validation on synthetic vocabularies, hostile input, speed, and the
 * `blade tokenize` command. */
#include "testutil.h"

#include "blade/gguf.h"
#include "blade/tokenizer.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SPM_VOCAB "vocab/ggml-vocab-llama-spm.gguf"
#define BPE_VOCAB "vocab/ggml-vocab-gpt-2.gguf"
#define STORIES "models/stories260K.gguf"

typedef struct loaded {
    gguf_file *gf;
    blade_tokenizer *tok;
} loaded;

static loaded load_path(const char *path)
{
    blade_error err = {{0}};
    loaded l = {0};
    l.gf = gguf_open(path, &err);
    if (!l.gf)
        fail_msg("%s: %s", path, err.msg);
    l.tok = blade_tokenizer_load(l.gf, &err);
    if (!l.tok)
        fail_msg("%s: %s", path, err.msg);
    return l;
}

static loaded load_shared(const char *rel)
{
    char *path = require_shared(rel);
    loaded l = load_path(path);
    free(path);
    return l;
}

static void unload(loaded *l)
{
    blade_tokenizer_free(l->tok);
    gguf_close(l->gf);
}

static size_t encode(const blade_tokenizer *t, const char *text, size_t len, bool bos, bool special, int32_t **ids)
{
    blade_error err = {{0}};
    size_t n = 0;
    if (blade_tokenizer_encode(t, text, len, bos, special, ids, &n, &err))
        fail_msg("encode failed: %s", err.msg);
    return n;
}

/* The concatenated bytes of the tokens, without the detokenizer's UTF-8 handling. */
static char *raw_bytes(const blade_tokenizer *t, const int32_t *ids, size_t n, bool render_special, size_t *len)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += blade_tokenizer_token_bytes(t, ids[i], render_special, NULL, 0);
    char *out = malloc(total + 1);
    size_t at = 0;
    for (size_t i = 0; i < n; i++)
        at += blade_tokenizer_token_bytes(t, ids[i], render_special, out + at, total - at);
    assert_int_equal(at, total);
    out[at] = 0;
    *len = at;
    return out;
}

/* Text through the streaming detokenizer, flushed at the end. */
static char *stream_text(const blade_tokenizer *t, const int32_t *ids, size_t n, bool render_special, size_t *len)
{
    size_t cap = blade_tokenizer_max_token_bytes(t);
    size_t total_cap = (n + 1) * cap + 1, at = 0;
    char *out = malloc(total_cap);
    blade_detokenizer d;
    blade_detokenizer_init(&d, t, render_special);
    for (size_t i = 0; i < n; i++)
        at += blade_detokenizer_push(&d, ids[i], out + at, cap);
    at += blade_detokenizer_flush(&d, out + at, cap);
    out[at] = 0;
    *len = at;
    return out;
}

static void print_escaped(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n')
            fprintf(stderr, "\\n");
        else if (c == '\t')
            fprintf(stderr, "\\t");
        else if (c < 0x20 || c == 0x7F)
            fprintf(stderr, "\\x%02X", c);
        else
            fputc(c, stderr);
    }
}

static bool valid_utf8(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned char c = u[i];
        size_t k = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
        if (!k || i + k > n)
            return false;
        for (size_t j = 1; j < k; j++)
            if ((u[i + j] & 0xC0) != 0x80)
                return false;
        i += k;
    }
    return true;
}

/* ---- 1. conformance with the published test vectors ---- */

static void conformance(const char *vocab_rel)
{
    loaded l = load_shared(vocab_rel);
    char inp_rel[256], out_rel[256];
    snprintf(inp_rel, sizeof inp_rel, "%s.inp", vocab_rel);
    snprintf(out_rel, sizeof out_rel, "%s.out", vocab_rel);
    char *inp_path = require_shared(inp_rel), *out_path = require_shared(out_rel);
    size_t inp_len, out_len;
    char *inp = read_file(inp_path, &inp_len), *outs = read_file(out_path, &out_len);
    assert_non_null(inp);
    assert_non_null(outs);

    /* Each case is followed by "\n__ggml_vocab_test__\n": the newline before the
     * separator belongs to the separator, so "" and "\n" are distinct cases. */
    static const char sep[] = "\n__ggml_vocab_test__\n";
    const size_t sep_len = sizeof sep - 1;
    size_t pos = 0, out_pos = 0, n_cases = 0, n_bad = 0;
    while (pos < inp_len) {
        const char *end = memmem(inp + pos, inp_len - pos, sep, sep_len);
        assert_non_null(end);
        size_t case_len = (size_t)(end - (inp + pos));
        const char *line = outs + out_pos;
        const char *nl = memchr(line, '\n', out_len - out_pos);
        assert_non_null(nl);
        out_pos = (size_t)(nl - outs) + 1;

        int32_t want[1024];
        size_t n_want = 0;
        for (const char *p = line; p < nl;) {
            char *after;
            long v = strtol(p, &after, 10);
            if (after == p)
                break;
            assert_true(n_want < 1024);
            want[n_want++] = (int32_t)v;
            p = after;
        }
        int32_t *got = NULL;
        size_t n_got = encode(l.tok, inp + pos, case_len, false, false, &got);
        bool same = n_got == n_want && (!n_got || !memcmp(got, want, n_got * sizeof *got));
        if (!same) {
            n_bad++;
            fprintf(stderr, "%s case %zu mismatch for '", vocab_rel, n_cases);
            print_escaped(inp + pos, case_len);
            fprintf(stderr, "'\n  want:");
            for (size_t i = 0; i < n_want; i++)
                fprintf(stderr, " %d", want[i]);
            fprintf(stderr, "\n  got: ");
            for (size_t i = 0; i < n_got; i++)
                fprintf(stderr, " %d", got[i]);
            fprintf(stderr, "\n");
        }
        free(got);
        n_cases++;
        pos = (size_t)(end - inp) + sep_len;
    }
    assert_int_equal(out_pos, out_len); /* one expected line per case, none left over */
    fprintf(stderr, "%s: %zu/%zu cases match\n", vocab_rel, n_cases - n_bad, n_cases);
    assert_true(n_cases > 0);
    assert_int_equal(n_bad, 0);
    free(inp);
    free(outs);
    free(inp_path);
    free(out_path);
    unload(&l);
}

static void test_conformance_spm(void **state)
{
    (void)state;
    conformance(SPM_VOCAB);
}

static void test_conformance_gpt2(void **state)
{
    (void)state;
    conformance(BPE_VOCAB);
}

/* ---- 2. round trips ---- */

static const char *const ROUND_TRIP[] = {
    "Hello world",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "\n\nnewlines\tand\ttabs\r\n",
    "emoji \xF0\x9F\xA6\x99\xF0\x9F\x9A\x80\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD and ZWJ \xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9",
    "CJK \xE6\x88\x91\xE6\x83\xB3\xE5\x9C\xA8\x61pple\xE5\xB7\xA5\xE4\xBD\x9C 1314151\xE5\xA4\xA9",
    "\xCE\x95\xCE\xBB\xCE\xBB\xCE\xB7\xCE\xBD\xCE\xB9\xCE\xBA\xCE\xAC \xD0\xBF\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 \xD9\x85\xD8\xB1\xD8\xAD\xD8\xA8\xD8\xA7",
    "Don't you're I'LL 3.14159 $100,000 (parens) [brackets] {braces} <angles>",
    "code: for (int i = 0; i < n; i++) { x += a[i] * b[i]; }",
    "x",
    "",
};

static void round_trip(const char *vocab_rel)
{
    loaded l = load_shared(vocab_rel);
    bool spm = blade_tokenizer_kind(l.tok) == BLADE_VOCAB_SPM;
    for (size_t i = 0; i < sizeof ROUND_TRIP / sizeof ROUND_TRIP[0]; i++) {
        const char *text = ROUND_TRIP[i];
        int32_t *ids = NULL;
        /* With SPM the encoder's space prefix is removed again because the sequence
         * starts with BOS; GPT-2 has no prefix to remove. */
        size_t n = encode(l.tok, text, strlen(text), spm, false, &ids);
        size_t len;
        char *back = stream_text(l.tok, ids, n, false, &len);
        if (len != strlen(text) || memcmp(back, text, len))
            fail_msg("%s: '%s' came back as '%s'", vocab_rel, text, back);
        free(back);
        free(ids);
    }
    unload(&l);
}

static void test_round_trip_spm(void **state)
{
    (void)state;
    round_trip(SPM_VOCAB);
}

static void test_round_trip_gpt2(void **state)
{
    (void)state;
    round_trip(BPE_VOCAB);
}

/* Invalid UTF-8 and NUL bytes survive as byte tokens: the token bytes give back the input
 * exactly, and the detokenizer turns each ill-formed piece into U+FFFD. */
static void invalid_utf8(const char *vocab_rel)
{
    static const char text[] = "ab\xFF\xFE c\xC3\x28 d\xE2\x82 e\xED\xA0\x80 f\xC0\xAF g\0h \xF0\x9F\x98";
    const size_t len = sizeof text - 1;
    loaded l = load_shared(vocab_rel);
    bool spm = blade_tokenizer_kind(l.tok) == BLADE_VOCAB_SPM;
    int32_t *ids = NULL;
    size_t n = encode(l.tok, text, len, false, false, &ids);
    size_t got_len;
    char *got = raw_bytes(l.tok, ids, n, false, &got_len);
    size_t skip = spm ? 1 : 0; /* SPM's space prefix */
    assert_int_equal(got_len, len + skip);
    if (spm)
        assert_int_equal(got[0], ' ');
    assert_memory_equal(got + skip, text, len);
    free(got);

    char *shown = stream_text(l.tok, ids, n, false, &got_len);
    assert_true(valid_utf8(shown, got_len));
    assert_non_null(memmem(shown, got_len, "ab\xEF\xBF\xBD\xEF\xBF\xBD c\xEF\xBF\xBD(", 12));
    assert_non_null(memmem(shown, got_len, "g\0h", 3));
    /* the truncated 4-byte character at the very end is flushed as one U+FFFD */
    assert_memory_equal(shown + got_len - 4, " \xEF\xBF\xBD", 4);
    free(shown);
    free(ids);
    unload(&l);
}

static void test_invalid_utf8_spm(void **state)
{
    (void)state;
    invalid_utf8(SPM_VOCAB);
}

static void test_invalid_utf8_gpt2(void **state)
{
    (void)state;
    invalid_utf8(BPE_VOCAB);
}

/* Random bytes never crash and always come back exactly through the token bytes. */
static void test_random_bytes(void **state)
{
    (void)state;
    loaded v[2] = {load_shared(SPM_VOCAB), load_shared(BPE_VOCAB)};
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    char buf[2048];
    for (int iter = 0; iter < 300; iter++) {
        size_t len = 0;
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t want = (size_t)(rng >> 33) % sizeof buf;
        for (; len < want; len++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            unsigned r = (unsigned)(rng >> 40);
            /* mostly ASCII and UTF-8 lead/continuation bytes, so real characters form too */
            buf[len] = (char)(r % 3 == 0 ? 0x20 + r % 0x5F : r % 3 == 1 ? 0x80 + (r >> 8) % 0x40 : (r >> 8) & 0xFF);
        }
        for (int k = 0; k < 2; k++) {
            bool spm = k == 0;
            int32_t *ids = NULL;
            size_t n = encode(v[k].tok, buf, len, true, iter % 2 == 0, &ids);
            size_t got_len;
            char *shown = stream_text(v[k].tok, ids, n, false, &got_len);
            assert_true(valid_utf8(shown, got_len));
            free(shown);
            free(ids);
            if (spm && memmem(buf, len, "\xE2\x96\x81", 3))
                continue; /* a literal U+2581 reads back as a space in SentencePiece */
            n = encode(v[k].tok, buf, len, false, false, &ids);
            char *got = raw_bytes(v[k].tok, ids, n, false, &got_len);
            size_t skip = spm && len ? 1 : 0;
            assert_int_equal(got_len, len + skip);
            assert_memory_equal(got + skip, buf, len);
            free(got);
            free(ids);
        }
    }
    unload(&v[0]);
    unload(&v[1]);
}

/* SentencePiece text is merged word by word when the vocabulary allows it; that must give
 * exactly what merging the whole text at once gives. */
static void test_spm_word_split_equivalence(void **state)
{
    (void)state;
    loaded l = load_shared(SPM_VOCAB);
    assert_true(l.tok->spm_word_split);
    char *inp_path = require_shared(SPM_VOCAB ".inp");
    size_t len;
    char *text = read_file(inp_path, &len);
    assert_non_null(text);
    for (size_t cut = 0; cut < len; cut += 97) {
        size_t piece = len - cut < 300 ? len - cut : 300;
        int32_t *split = NULL, *whole = NULL;
        size_t ns = encode(l.tok, text + cut, piece, false, false, &split);
        l.tok->spm_word_split = false;
        size_t nw = encode(l.tok, text + cut, piece, false, false, &whole);
        l.tok->spm_word_split = true;
        assert_int_equal(ns, nw);
        assert_memory_equal(split, whole, ns * sizeof *split);
        free(split);
        free(whole);
    }
    free(text);
    free(inp_path);
    unload(&l);
}

/* ---- 3. streaming detokenizer ---- */

static void test_stream_partial_utf8(void **state)
{
    (void)state;
    loaded l = load_shared(STORIES); /* 512 tokens: emoji and CJK are spelled in byte tokens */
    const char text[] = "\xF0\x9F\xA6\x99\xE5\xA4\xA9";
    int32_t *ids = NULL;
    size_t n = encode(l.tok, text, strlen(text), true, false, &ids);
    assert_true(n >= 8); /* BOS, maybe a space piece, then 4 + 3 byte tokens */
    blade_detokenizer d;
    blade_detokenizer_init(&d, l.tok, false);
    char out[256], all[256];
    size_t total = 0, n_chars = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = blade_detokenizer_push(&d, ids[i], out, sizeof out);
        assert_true(k < sizeof out);
        assert_int_equal(out[k], 0);
        assert_true(valid_utf8(out, k)); /* never half a character */
        if (blade_tokenizer_attr(l.tok, ids[i]) == BLADE_TOKEN_BYTE && k)
            n_chars++;
        memcpy(all + total, out, k);
        total += k;
    }
    total += blade_detokenizer_flush(&d, all + total, sizeof all - total);
    assert_int_equal(n_chars, 2); /* only the last byte of each character releases it */
    assert_int_equal(total, strlen(text));
    assert_memory_equal(all, text, total);

    /* a character cut short: the flush emits U+FFFD, and a following token is kept */
    int32_t f0 = blade_tokenizer_find(l.tok, "<0xF0>", 6), x9f = blade_tokenizer_find(l.tok, "<0x9F>", 6);
    assert_true(f0 >= 0 && x9f >= 0);
    blade_detokenizer_init(&d, l.tok, false);
    assert_int_equal(blade_detokenizer_push(&d, f0, out, sizeof out), 0);
    assert_int_equal(blade_detokenizer_push(&d, x9f, out, sizeof out), 0);
    assert_int_equal(blade_detokenizer_flush(&d, out, sizeof out), 3);
    assert_string_equal(out, "\xEF\xBF\xBD");
    assert_int_equal(blade_detokenizer_flush(&d, out, sizeof out), 0);

    int32_t a = blade_tokenizer_find(l.tok, "a", 1);
    assert_true(a >= 0);
    blade_detokenizer_init(&d, l.tok, false);
    blade_detokenizer_push(&d, f0, out, sizeof out);
    size_t k = blade_detokenizer_push(&d, a, out, sizeof out);
    assert_int_equal(k, 4);
    assert_string_equal(out, "\xEF\xBF\xBD" "a");

    /* after BOS the first piece loses the encoder's space prefix; later pieces keep theirs */
    int32_t once = blade_tokenizer_find(l.tok, "\xE2\x96\x81Once", 7);
    assert_true(once >= 0);
    blade_detokenizer_init(&d, l.tok, false);
    assert_int_equal(blade_detokenizer_push(&d, blade_tokenizer_bos(l.tok), out, sizeof out), 0);
    blade_detokenizer_push(&d, once, out, sizeof out);
    assert_string_equal(out, "Once");
    blade_detokenizer_push(&d, once, out, sizeof out);
    assert_string_equal(out, " Once");
    /* without BOS nothing is stripped */
    blade_detokenizer_init(&d, l.tok, false);
    blade_detokenizer_push(&d, once, out, sizeof out);
    assert_string_equal(out, " Once");
    /* render_special shows BOS and still strips the prefix of the text after it */
    blade_detokenizer_init(&d, l.tok, true);
    blade_detokenizer_push(&d, blade_tokenizer_bos(l.tok), out, sizeof out);
    assert_string_equal(out, "<s>");
    blade_detokenizer_push(&d, once, out, sizeof out);
    assert_string_equal(out, "Once");
    /* a buffer too small cuts at a character boundary and never overflows */
    blade_detokenizer_init(&d, l.tok, false);
    char tiny[3] = {'x', 'x', 'x'};
    k = blade_detokenizer_push(&d, once, tiny, sizeof tiny);
    assert_int_equal(k, 2);
    assert_string_equal(tiny, " O");
    free(ids);
    unload(&l);
}

/* ---- 4. special tokens ---- */

static bool contains(const int32_t *ids, size_t n, int32_t id)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id)
            return true;
    return false;
}

static void test_special_spm(void **state)
{
    (void)state;
    loaded l = load_shared(STORIES);
    const blade_tokenizer *t = l.tok;
    assert_int_equal(blade_tokenizer_kind(t), BLADE_VOCAB_SPM);
    assert_int_equal(blade_tokenizer_n_vocab(t), 512);
    assert_int_equal(blade_tokenizer_bos(t), 1);
    assert_int_equal(blade_tokenizer_eos(t), 2);
    assert_true(blade_tokenizer_wants_bos(t));
    assert_true(blade_tokenizer_is_eog(t, 2));
    assert_false(blade_tokenizer_is_eog(t, 1));
    assert_int_equal(blade_tokenizer_attr(t, 1), BLADE_TOKEN_CONTROL);
    assert_string_equal(blade_tokenizer_token_text(t, 2), "</s>");

    const char text[] = "<s>Once upon</s> a time";
    int32_t *with = NULL, *without = NULL, *first = NULL, *second = NULL;
    size_t nw = encode(t, text, strlen(text), false, true, &with);
    /* each text segment gets its own space prefix: "<s>" "▁Once ▁upon" "</s>" "▁▁a ▁time" */
    size_t n1 = encode(t, "Once upon", 9, false, false, &first);
    size_t n2 = encode(t, " a time", 7, false, false, &second);
    assert_int_equal(nw, 1 + n1 + 1 + n2);
    assert_int_equal(with[0], 1);
    assert_memory_equal(with + 1, first, n1 * sizeof *first);
    assert_int_equal(with[1 + n1], 2);
    assert_memory_equal(with + 2 + n1, second, n2 * sizeof *second);
    free(first);
    free(second);

    size_t nn = encode(t, text, strlen(text), false, false, &without);
    assert_false(contains(without, nn, 1));
    assert_false(contains(without, nn, 2));
    size_t len;
    char *plain = stream_text(t, without, nn, false, &len);
    assert_string_equal(plain, " <s>Once upon</s> a time");
    free(plain);
    /* the sequence starts with BOS (parsed from the text), so its prefix space goes */
    char *shown = stream_text(t, with, nw, false, &len);
    assert_string_equal(shown, "Once upon  a time");
    free(shown);
    shown = stream_text(t, with, nw, true, &len);
    assert_string_equal(shown, "<s>Once upon</s>  a time");
    free(shown);
    free(with);
    free(without);

    /* add_bos adds exactly one BOS in front */
    size_t nb = encode(t, "hi", 2, true, false, &with);
    nn = encode(t, "hi", 2, false, false, &without);
    assert_int_equal(nb, nn + 1);
    assert_int_equal(with[0], 1);
    assert_memory_equal(with + 1, without, nn * sizeof *without);
    free(with);
    free(without);
    /* empty text: nothing but the optional BOS */
    assert_int_equal(encode(t, "", 0, false, true, &with), 0);
    free(with);
    assert_int_equal(encode(t, "", 0, true, true, &with), 1);
    free(with);
    unload(&l);
}

static void test_special_gpt2(void **state)
{
    (void)state;
    loaded l = load_shared(BPE_VOCAB);
    const blade_tokenizer *t = l.tok;
    assert_int_equal(blade_tokenizer_kind(t), BLADE_VOCAB_BPE);
    assert_false(blade_tokenizer_wants_bos(t));
    assert_true(blade_tokenizer_is_eog(t, 50256));
    const char text[] = "Hello<|endoftext|>World";
    int32_t *with = NULL, *without = NULL, *a = NULL, *b = NULL;
    size_t nw = encode(t, text, strlen(text), false, true, &with);
    size_t na = encode(t, "Hello", 5, false, false, &a), nb = encode(t, "World", 5, false, false, &b);
    assert_int_equal(nw, na + 1 + nb);
    assert_memory_equal(with, a, na * sizeof *a);
    assert_int_equal(with[na], 50256);
    assert_memory_equal(with + na + 1, b, nb * sizeof *b);
    size_t nn = encode(t, text, strlen(text), false, false, &without);
    assert_false(contains(without, nn, 50256));
    size_t len;
    char *plain = stream_text(t, without, nn, false, &len);
    assert_string_equal(plain, text);
    free(plain);
    char *shown = stream_text(t, with, nw, false, &len);
    assert_string_equal(shown, "HelloWorld");
    free(shown);
    shown = stream_text(t, with, nw, true, &len);
    assert_string_equal(shown, text);
    free(shown);
    /* a prefix of a special token is only text */
    free(with);
    nw = encode(t, "<|endoftext", 11, false, true, &with);
    assert_false(contains(with, nw, 50256));
    free(with);
    free(without);
    free(a);
    free(b);
    unload(&l);
}

/* ---- 5. pre-tokenizer regexes ---- */

typedef struct pieces {
    char text[64][32];
    size_t n;
} pieces;

static int collect(void *ctx, const char *piece, size_t len)
{
    pieces *p = ctx;
    assert_true(p->n < 64 && len < 32);
    memcpy(p->text[p->n], piece, len);
    p->text[p->n][len] = 0;
    p->n++;
    return 0;
}

static void expect_split(blade_pretok_kind kind, const char *text, size_t len, const char *const *want, size_t n_want)
{
    blade_error err = {{0}};
    blade_pretok *p = blade_pretok_new(kind, &err);
    if (!p)
        fail_msg("%s", err.msg);
    pieces got = {0};
    assert_int_equal(blade_pretok_split(p, text, len, collect, &got, &err), 0);
    bool same = got.n == n_want;
    for (size_t i = 0; same && i < n_want; i++)
        same = !strcmp(got.text[i], want[i]);
    if (!same) {
        fprintf(stderr, "split of '");
        print_escaped(text, len);
        fprintf(stderr, "':");
        for (size_t i = 0; i < got.n; i++) {
            fprintf(stderr, " [");
            print_escaped(got.text[i], strlen(got.text[i]));
            fprintf(stderr, "]");
        }
        fprintf(stderr, "\n");
        fail();
    }
    blade_pretok_free(p);
}

#define SPLIT(kind, text, ...)                                                                        \
    do {                                                                                              \
        static const char *const want_[] = {__VA_ARGS__};                                             \
        expect_split(kind, text, sizeof(text) - 1, want_, sizeof want_ / sizeof want_[0]);            \
    } while (0)

static void test_pretok_names(void **state)
{
    (void)state;
    blade_pretok_kind k;
    assert_true(blade_pretok_kind_from_name("default", &k) && k == BLADE_PRETOK_GPT2);
    assert_true(blade_pretok_kind_from_name("gpt-2", &k) && k == BLADE_PRETOK_GPT2);
    assert_true(blade_pretok_kind_from_name("llama-bpe", &k) && k == BLADE_PRETOK_LLAMA3);
    assert_true(blade_pretok_kind_from_name("llama3", &k) && k == BLADE_PRETOK_LLAMA3);
    assert_true(blade_pretok_kind_from_name("qwen2", &k) && k == BLADE_PRETOK_QWEN2);
    assert_false(blade_pretok_kind_from_name("falcon", &k));
    assert_false(blade_pretok_kind_from_name("", &k));
}

static void test_pretok_gpt2(void **state)
{
    (void)state;
    SPLIT(BLADE_PRETOK_GPT2, "Hello world's 123 4567  !!", "Hello", " world", "'s", " 123", " 4567", " ", " !!");
    SPLIT(BLADE_PRETOK_GPT2, "don't I'LL", "don", "'t", " I", "'", "LL"); /* GPT-2 is case-sensitive */
    SPLIT(BLADE_PRETOK_GPT2, "a\n\n b  ", "a", "\n\n", " b", "  ");
    SPLIT(BLADE_PRETOK_GPT2, "ab\xFF\xFE" "cd \xC3\xA9t\xC3\xA9", "ab", "\xFF\xFE", "cd", " \xC3\xA9t\xC3\xA9");
    SPLIT(BLADE_PRETOK_GPT2, "x\0y", "x", "\0", "y");
}

static void test_pretok_llama3(void **state)
{
    (void)state;
    SPLIT(BLADE_PRETOK_LLAMA3, "1234567 I'M here", "123", "456", "7", " I", "'M", " here");
    SPLIT(BLADE_PRETOK_LLAMA3, "we'Ve 12.5%", "we", "'Ve", " ", "12", ".", "5", "%");
    SPLIT(BLADE_PRETOK_LLAMA3, "a\n\n b", "a", "\n\n", " b");
    SPLIT(BLADE_PRETOK_LLAMA3, "!!\n\nx", "!!\n\n", "x");
    SPLIT(BLADE_PRETOK_LLAMA3, "(hello)", "(hello", ")");
    SPLIT(BLADE_PRETOK_LLAMA3, "\xE6\x88\x91\xE6\x83\xB3 \xD0\xBF\xD1\x80\xD0\xB8", "\xE6\x88\x91\xE6\x83\xB3",
          " \xD0\xBF\xD1\x80\xD0\xB8");
}

static void test_pretok_qwen2(void **state)
{
    (void)state;
    SPLIT(BLADE_PRETOK_QWEN2, "1234 x", "1", "2", "3", "4", " x");
    SPLIT(BLADE_PRETOK_QWEN2, "YOU'RE", "YOU", "'RE");
    SPLIT(BLADE_PRETOK_QWEN2, "a  \tb\r\n", "a", "  ", "\tb", "\r\n");
}

/* ---- synthetic vocabularies: exact merge behaviour and metadata validation ---- */

typedef struct synth_vocab {
    const char *model;
    const char *pre;
    const char *tokens[320];
    float scores[320];
    int32_t types[320];
    size_t n;
    const char *merges[16];
    size_t n_merges;
    bool space_prefix;
    int64_t bos; /* -1: leave the key out */
} synth_vocab;

static void add_token(synth_vocab *v, const char *text, float score, int32_t type)
{
    v->tokens[v->n] = text;
    v->scores[v->n] = score;
    v->types[v->n] = type;
    v->n++;
}

static char byte_names[256][8];

/* <unk> <s> </s>, the 256 byte tokens, then the given normal tokens. */
static void synth_spm(synth_vocab *v)
{
    memset(v, 0, sizeof *v);
    v->model = "llama";
    v->bos = 1;
    add_token(v, "<unk>", 0, BLADE_TOKEN_UNKNOWN);
    add_token(v, "<s>", 0, BLADE_TOKEN_CONTROL);
    add_token(v, "</s>", 0, BLADE_TOKEN_CONTROL);
    for (int b = 0; b < 256; b++) {
        snprintf(byte_names[b], sizeof byte_names[b], "<0x%02X>", b);
        add_token(v, byte_names[b], 0, BLADE_TOKEN_BYTE);
    }
}

static char *write_vocab(const synth_vocab *v, const char *name)
{
    gguf_writer *w = gguf_writer_new();
    gguf_writer_set_string(w, "general.architecture", "llama");
    if (v->model)
        gguf_writer_set_string(w, "tokenizer.ggml.model", v->model);
    if (v->pre)
        gguf_writer_set_string(w, "tokenizer.ggml.pre", v->pre);
    gguf_writer_set_string_array(w, "tokenizer.ggml.tokens", v->tokens, v->n);
    if (!strcmp(v->model ? v->model : "", "llama")) {
        gguf_writer_set_array(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, v->scores, v->n);
        gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", v->space_prefix);
    }
    gguf_writer_set_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, v->types, v->n);
    if (v->n_merges)
        gguf_writer_set_string_array(w, "tokenizer.ggml.merges", v->merges, v->n_merges);
    if (v->bos >= 0)
        gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)v->bos);
    char *path = temp_path(name);
    blade_error err = {{0}};
    if (gguf_writer_write(w, path, false, &err))
        fail_msg("%s", err.msg);
    gguf_writer_free(w);
    return path;
}

static loaded load_synth(const synth_vocab *v, const char *name)
{
    char *path = write_vocab(v, name);
    loaded l = load_path(path);
    free(path);
    return l;
}

static void expect_ids(const blade_tokenizer *t, const char *text, bool special, const int32_t *want, size_t n_want)
{
    int32_t *got = NULL;
    size_t n = encode(t, text, strlen(text), false, special, &got);
    if (n != n_want || (n && memcmp(got, want, n * sizeof *got))) {
        fprintf(stderr, "'%s':", text);
        for (size_t i = 0; i < n; i++)
            fprintf(stderr, " %d", got[i]);
        fprintf(stderr, "\n");
        fail();
    }
    free(got);
}

#define EXPECT_IDS(t, text, special, ...)                                                             \
    do {                                                                                              \
        const int32_t want_[] = {__VA_ARGS__};                                                        \
        expect_ids(t, text, special, want_, sizeof want_ / sizeof want_[0]);                          \
    } while (0)

static void test_spm_merges(void **state)
{
    (void)state;
    synth_vocab v;
    synth_spm(&v);
    const int32_t base = (int32_t)v.n; /* 259 */
    add_token(&v, "\xE2\x96\x81", -1, BLADE_TOKEN_NORMAL); /* base+0 */
    add_token(&v, "a", -1, BLADE_TOKEN_NORMAL);             /* +1 */
    add_token(&v, "b", -1, BLADE_TOKEN_NORMAL);             /* +2 */
    add_token(&v, "c", -1, BLADE_TOKEN_NORMAL);             /* +3 */
    add_token(&v, "ab", -2, BLADE_TOKEN_NORMAL);            /* +4 */
    add_token(&v, "bc", -1.5f, BLADE_TOKEN_NORMAL);         /* +5 */
    add_token(&v, "abc", -0.5f, BLADE_TOKEN_NORMAL);        /* +6 */
    add_token(&v, "aa", -1, BLADE_TOKEN_NORMAL);            /* +7 */
    add_token(&v, "<tag>", 0, BLADE_TOKEN_USER_DEFINED);    /* +8 */
    add_token(&v, "<s", 5, BLADE_TOKEN_NORMAL);             /* +9 */
    add_token(&v, "<s>", 9, BLADE_TOKEN_NORMAL);            /* +10: a normal twin of a control text */
    v.space_prefix = false;
    loaded l = load_synth(&v, "spm_merges.gguf");
    const blade_tokenizer *t = l.tok;
    /* "bc" (-1.5) beats "ab" (-2); then "abc" (-0.5) */
    EXPECT_IDS(t, "abc", false, base + 6);
    /* equal scores merge leftmost first */
    EXPECT_IDS(t, "aaa", false, base + 7, base + 1);
    /* a space is "▁"; characters without a token fall back to bytes */
    EXPECT_IDS(t, "ab d\xC3\xA9", false, base + 4, base + 0, 3 + 'd', 3 + 0xC3, 3 + 0xA9);
    /* user-defined tokens are atomic even without parse_special */
    EXPECT_IDS(t, "a<tag>b", false, base + 1, base + 8, base + 2);
    /* the control token's text is only text without parse_special (here it merges into
     * the normal twin, which the vocabulary lists later and so owns the text) */
    EXPECT_IDS(t, "<s>", false, base + 10);
    EXPECT_IDS(t, "<s>", true, 1);
    assert_int_equal(blade_tokenizer_find(t, "<s>", 3), base + 10);
    assert_int_equal(blade_tokenizer_find(t, "nope", 4), -1);
    unload(&l);

    /* with the space prefix, "▁" leads the text and every segment after a special */
    v.space_prefix = true;
    l = load_synth(&v, "spm_prefix.gguf");
    EXPECT_IDS(l.tok, "ab", true, base + 0, base + 4);
    EXPECT_IDS(l.tok, "</s>ab", true, 2, base + 0, base + 4);
    EXPECT_IDS(l.tok, "ab</s></s>", true, base + 0, base + 4, 2, 2);
    unload(&l);
}

static void test_spm_unknown_fallback(void **state)
{
    (void)state;
    /* no byte tokens: a character without a token becomes one <unk> */
    synth_vocab v;
    memset(&v, 0, sizeof v);
    v.model = "llama";
    v.bos = -1;
    add_token(&v, "<unk>", 0, BLADE_TOKEN_UNKNOWN);
    add_token(&v, "a", -1, BLADE_TOKEN_NORMAL);
    loaded l = load_synth(&v, "spm_unk.gguf");
    assert_int_equal(blade_tokenizer_bos(l.tok), -1);
    assert_false(blade_tokenizer_wants_bos(l.tok));
    EXPECT_IDS(l.tok, "a\xC3\xA9" "a", false, 1, 0, 1);
    /* add_bos without a BOS token adds nothing */
    int32_t *ids = NULL;
    assert_int_equal(encode(l.tok, "a", 1, true, false, &ids), 1);
    free(ids);
    unload(&l);
}

static void synth_bpe(synth_vocab *v)
{
    /* just the byte-alphabet characters the tests use, then merged tokens */
    memset(v, 0, sizeof *v);
    v->model = "gpt2";
    v->bos = -1;
    add_token(v, "a", 0, BLADE_TOKEN_NORMAL);        /* 0 */
    add_token(v, "b", 0, BLADE_TOKEN_NORMAL);        /* 1 */
    add_token(v, "c", 0, BLADE_TOKEN_NORMAL);        /* 2 */
    add_token(v, "\xC4\xA0", 0, BLADE_TOKEN_NORMAL); /* 3: Ġ, the space byte */
    add_token(v, "ab", 0, BLADE_TOKEN_NORMAL);       /* 4 */
    add_token(v, "bc", 0, BLADE_TOKEN_NORMAL);       /* 5 */
    add_token(v, "abc", 0, BLADE_TOKEN_NORMAL);      /* 6 */
    add_token(v, "\xC4\xA0" "a", 0, BLADE_TOKEN_NORMAL); /* 7: Ġa */
    add_token(v, "<|end|>", 0, BLADE_TOKEN_CONTROL); /* 8 */
    add_token(v, "<unk>", 0, BLADE_TOKEN_UNKNOWN);   /* 9 */
    v->merges[v->n_merges++] = "b c";
    v->merges[v->n_merges++] = "a b";
    v->merges[v->n_merges++] = "a bc";
    v->merges[v->n_merges++] = "\xC4\xA0 a";
    v->merges[v->n_merges++] = "x y"; /* sides not in the vocabulary: inert */
}

static void test_bpe_merges(void **state)
{
    (void)state;
    synth_vocab v;
    synth_bpe(&v);
    loaded l = load_synth(&v, "bpe_merges.gguf");
    const blade_tokenizer *t = l.tok;
    EXPECT_IDS(t, "abc", false, 6); /* b c (rank 0), then a bc (rank 2) */
    EXPECT_IDS(t, "abab", false, 4, 4);
    EXPECT_IDS(t, "ab a", false, 4, 7);
    EXPECT_IDS(t, "cab", false, 2, 4);
    /* a byte the vocabulary cannot spell becomes <unk> */
    EXPECT_IDS(t, "aza", false, 0, 9, 0);
    /* the control token needs parse_special; without it the text has no token at all */
    EXPECT_IDS(t, "a<|end|>", true, 0, 8);
    assert_true(blade_tokenizer_is_eog(t, 8)); /* "<|end|>" ends a turn though no key says so */
    size_t len;
    int32_t ids[] = {7, 8, 6};
    char *text = stream_text(t, ids, 3, false, &len);
    assert_string_equal(text, " aabc");
    free(text);
    unload(&l);

    /* "gpt2" with an unknown byte and no <unk>: an error, not a silent drop */
    v.n--;
    v.tokens[v.n] = NULL;
    l = load_synth(&v, "bpe_nounk.gguf");
    int32_t *out = NULL;
    size_t n = 0;
    blade_error err = {{0}};
    assert_int_not_equal(blade_tokenizer_encode(l.tok, "aza", 3, false, false, &out, &n, &err), 0);
    assert_non_null(strstr(err.msg, "0x7A"));
    unload(&l);

    /* llama-bpe looks a whole pre-token up before merging */
    synth_bpe(&v);
    add_token(&v, "ca", 0, BLADE_TOKEN_NORMAL); /* 10: no merge makes it */
    v.pre = "llama-bpe";
    l = load_synth(&v, "bpe_llama3.gguf");
    EXPECT_IDS(l.tok, "ca", false, 10);
    assert_true(blade_tokenizer_wants_bos(l.tok) == false); /* no BOS token in this vocabulary */
    unload(&l);
    v.pre = NULL;
    l = load_synth(&v, "bpe_default.gguf");
    EXPECT_IDS(l.tok, "ca", false, 2, 0);
    unload(&l);
}

static void expect_load_error(const synth_vocab *v, const char *name, const char *needle1, const char *needle2)
{
    char *path = write_vocab(v, name);
    blade_error err = {{0}};
    gguf_file *gf = gguf_open(path, &err);
    if (!gf)
        fail_msg("%s", err.msg);
    blade_tokenizer *t = blade_tokenizer_load(gf, &err);
    if (t)
        fail_msg("%s loaded but should not have", name);
    if (!strstr(err.msg, needle1) || (needle2 && !strstr(err.msg, needle2)))
        fail_msg("%s: message '%s' lacks '%s'", name, err.msg, needle1);
    gguf_close(gf);
    free(path);
}

static void test_load_errors(void **state)
{
    (void)state;
    synth_vocab v;
    synth_spm(&v);
    v.model = "bert";
    expect_load_error(&v, "bad_model.gguf", "tokenizer.ggml.model", "bert");
    v.model = NULL;
    expect_load_error(&v, "no_model.gguf", "tokenizer.ggml.model", "missing");
    synth_spm(&v);
    v.bos = 259;
    expect_load_error(&v, "bad_bos.gguf", "tokenizer.ggml.bos_token_id", "259");
    synth_spm(&v);
    v.types[7] = 9;
    expect_load_error(&v, "bad_type.gguf", "tokenizer.ggml.token_type[7]", NULL);

    synth_bpe(&v);
    v.pre = "falcon";
    expect_load_error(&v, "bad_pre.gguf", "tokenizer.ggml.pre", "falcon");
    synth_bpe(&v);
    v.merges[1] = "ab";
    expect_load_error(&v, "bad_merge.gguf", "tokenizer.ggml.merges[1]", NULL);
    synth_bpe(&v);
    v.n_merges = 0;
    expect_load_error(&v, "no_merges.gguf", "tokenizer.ggml.merges", "missing");

    /* array lengths must agree: write scores for fewer tokens than listed */
    synth_spm(&v);
    gguf_writer *w = gguf_writer_new();
    gguf_writer_set_string(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_string_array(w, "tokenizer.ggml.tokens", v.tokens, v.n);
    gguf_writer_set_array(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, v.scores, v.n - 1);
    char *path = temp_path("short_scores.gguf");
    blade_error err = {{0}};
    assert_int_equal(gguf_writer_write(w, path, false, &err), 0);
    gguf_writer_free(w);
    gguf_file *gf = gguf_open(path, &err);
    assert_non_null(gf);
    assert_null(blade_tokenizer_load(gf, &err));
    assert_non_null(strstr(err.msg, "tokenizer.ggml.scores"));
    gguf_close(gf);
    free(path);

    /* "none" ids as converters write them (-1 as u32) are accepted */
    w = gguf_writer_new();
    gguf_writer_set_string(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_string_array(w, "tokenizer.ggml.tokens", v.tokens, v.n);
    gguf_writer_set_array(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, v.scores, v.n);
    gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", UINT32_MAX);
    gguf_writer_set_i32(w, "tokenizer.ggml.eot_token_id", -1);
    path = temp_path("none_ids.gguf");
    assert_int_equal(gguf_writer_write(w, path, false, &err), 0);
    gguf_writer_free(w);
    gf = gguf_open(path, &err);
    assert_non_null(gf);
    blade_tokenizer *t = blade_tokenizer_load(gf, &err);
    if (!t)
        fail_msg("%s", err.msg);
    assert_int_equal(blade_tokenizer_eot(t), -1);
    blade_tokenizer_free(t);
    gguf_close(gf);
    free(path);
}

/* ---- speed: merging must be O(n log n) ---- */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void time_encode(const char *vocab_rel, const char *what, const char *text, size_t len)
{
    loaded l = load_shared(vocab_rel);
    int32_t *ids = NULL;
    double t0 = now();
    size_t n = encode(l.tok, text, len, false, true, &ids);
    double dt = now() - t0;
    fprintf(stderr, "%s: %s, %zu bytes -> %zu tokens in %.3f s\n", vocab_rel, what, len, n, dt);
    assert_true(n > 0);
    assert_true(dt < 10.0); /* a few hundred ms normally; generous for sanitizer builds */
    free(ids);
    unload(&l);
}

static void test_speed(void **state)
{
    (void)state;
    static const char para[] =
        "Once upon a time, in a land far away, there lived a little fox named Pip. "
        "Pip loved 3 things: berries, the river and \xE6\x98\x9F\xE7\xA9\xBA (the sky) \xF0\x9F\x8C\x8C!\n";
    const size_t len = 1 << 20;
    char *text = malloc(len);
    for (size_t i = 0; i < len; i++)
        text[i] = para[i % (sizeof para - 1)];
    time_encode(SPM_VOCAB, "prose", text, len);
    time_encode(BPE_VOCAB, "prose", text, len);
    /* one enormous word: SentencePiece merges it all in one symbol list */
    memset(text, 'a', len);
    time_encode(SPM_VOCAB, "1 MiB of 'a'", text, len);
    time_encode(BPE_VOCAB, "1 MiB of 'a'", text, len);
    memset(text, ' ', len);
    text[len - 1] = 'x';
    time_encode(BPE_VOCAB, "1 MiB of spaces", text, len);
    free(text);
}

/* ---- 6. the CLI ---- */

static void test_cli(void **state)
{
    (void)state;
    char *model = require_shared(STORIES);
    loaded l = load_path(model);
    int32_t *ids = NULL;
    const char prompt[] = "Once upon a time";
    size_t n = encode(l.tok, prompt, strlen(prompt), true, false, &ids);
    char want[1024] = "";
    size_t at = 0;
    for (size_t i = 0; i < n; i++)
        at += (size_t)snprintf(want + at, sizeof want - at, i ? " %d" : "%d", ids[i]);
    snprintf(want + at, sizeof want - at, "\n");

    char args[2048], *out = NULL;
    snprintf(args, sizeof args, "tokenize -m '%s' -p '%s' --ids", model, prompt);
    assert_int_equal(run_blade(args, &out, 0), 0);
    assert_string_equal(out, want);
    assert_true(!strncmp(out, "1 ", 2));
    free(out);

    snprintf(args, sizeof args, "tokenize -m '%s' -p '%s' --ids --no-bos", model, prompt);
    assert_int_equal(run_blade(args, &out, 0), 0);
    assert_string_equal(out, strchr(want, ' ') + 1);
    free(out);

    snprintf(args, sizeof args, "tokenize -m '%s' -p 'a<s>' --no-bos --parse-special", model);
    assert_int_equal(run_blade(args, &out, 0), 0);
    assert_non_null(strstr(out, "1\t'<s>'\n"));
    assert_true(out[strlen(out) - 1] == '\n');
    free(out);

    /* default output: id, tab, quoted vocabulary text, one token per line */
    char *file = temp_path("tokenize_input.txt");
    assert_int_equal(write_file(file, "Once\n", 5), 0);
    snprintf(args, sizeof args, "tokenize --model '%s' -f '%s'", model, file);
    assert_int_equal(run_blade(args, &out, 0), 0);
    int32_t *fids = NULL;
    assert_int_equal(encode(l.tok, "Once\n", 5, true, false, &fids), 3);
    char line[128];
    snprintf(line, sizeof line, "%d\t'\xE2\x96\x81Once'\n", fids[1]);
    assert_true(!strncmp(out, "1\t'<s>'\n", 8));
    assert_non_null(strstr(out, line));
    assert_non_null(strstr(out, "\t'<0x0A>'\n"));
    free(fids);
    free(out);

    assert_int_equal(run_blade("tokenize --help", &out, 0), 0);
    assert_non_null(strstr(out, "usage: blade tokenize"));
    free(out);
    assert_int_equal(run_blade("tokenize -p hi", NULL, 0), 2);
    snprintf(args, sizeof args, "tokenize -m '%s'", model);
    assert_int_equal(run_blade(args, NULL, 0), 2);
    snprintf(args, sizeof args, "tokenize -m '%s' -p a -f b", model);
    assert_int_equal(run_blade(args, NULL, 0), 2);
    assert_int_equal(run_blade("tokenize --bogus", NULL, 0), 2);
    assert_int_equal(run_blade("tokenize -m /nonexistent/model.gguf -p hi", &out, 1), 1);
    assert_non_null(strstr(out, "/nonexistent/model.gguf"));
    free(out);
    snprintf(args, sizeof args, "tokenize -m '%s' -f /nonexistent/input.txt", model);
    assert_int_equal(run_blade(args, NULL, 0), 1);

    free(file);
    free(ids);
    unload(&l);
    free(model);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conformance_spm),
        cmocka_unit_test(test_conformance_gpt2),
        cmocka_unit_test(test_round_trip_spm),
        cmocka_unit_test(test_round_trip_gpt2),
        cmocka_unit_test(test_invalid_utf8_spm),
        cmocka_unit_test(test_invalid_utf8_gpt2),
        cmocka_unit_test(test_random_bytes),
        cmocka_unit_test(test_spm_word_split_equivalence),
        cmocka_unit_test(test_stream_partial_utf8),
        cmocka_unit_test(test_special_spm),
        cmocka_unit_test(test_special_gpt2),
        cmocka_unit_test(test_pretok_names),
        cmocka_unit_test(test_pretok_gpt2),
        cmocka_unit_test(test_pretok_llama3),
        cmocka_unit_test(test_pretok_qwen2),
        cmocka_unit_test(test_spm_merges),
        cmocka_unit_test(test_spm_unknown_fallback),
        cmocka_unit_test(test_bpe_merges),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_speed),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

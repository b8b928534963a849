/* The pre-tokenizers of byte-level BPE (pretokenizer.h): each family's published pattern,
 * compiled with PCRE2, run over the well-formed UTF-8 runs of the text; a run of bytes
 * that is not UTF-8 is a pre-token of its own. */

#define PCRE2_CODE_UNIT_WIDTH 8

#include "common/utf8.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer_internal.h"

#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

/* The published patterns of each tokenizer family. */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char LLAMA3_PATTERN[] =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN2_PATTERN[] =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

struct blade_pretok {
    pcre2_code *code;
};

bool blade_pretok_kind_from_name(const char *name, blade_pretok_kind *kind)
{
    static const struct {
        const char *name;
        blade_pretok_kind kind;
    } names[] = {
        {"default", BLADE_PRETOK_GPT2},   {"gpt-2", BLADE_PRETOK_GPT2},
        {"llama-bpe", BLADE_PRETOK_LLAMA3}, {"llama3", BLADE_PRETOK_LLAMA3},
        {"llama-v3", BLADE_PRETOK_LLAMA3},  {"qwen2", BLADE_PRETOK_QWEN2},
        {"deepseek-r1-qwen", BLADE_PRETOK_QWEN2},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (!strcmp(name, names[i].name)) {
            *kind = names[i].kind;
            return true;
        }
    }
    return false;
}

blade_pretok *blade_pretok_new(blade_pretok_kind kind, blade_error *err)
{
    const char *pattern = kind == BLADE_PRETOK_LLAMA3  ? LLAMA3_PATTERN
                          : kind == BLADE_PRETOK_QWEN2 ? QWEN2_PATTERN
                                                       : GPT2_PATTERN;
    int code_err;
    PCRE2_SIZE at;
    pcre2_code *code =
        pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code_err, &at, NULL);
    if (!code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code_err, msg, sizeof msg);
        blade_error_set(err, "pre-tokenizer regex: %s at offset %zu", (const char *)msg, (size_t)at);
        return NULL;
    }
    /* JIT is an optimisation only: without it (or where the platform lacks it) the
     * interpreter gives the same matches. */
    uint32_t have_jit = 0;
    if (pcre2_config(PCRE2_CONFIG_JIT, &have_jit) >= 0 && have_jit)
        pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    blade_pretok *p = malloc(sizeof *p);
    if (!p) {
        pcre2_code_free(code);
        blade_error_set(err, "pre-tokenizer: out of memory");
        return NULL;
    }
    p->code = code;
    return p;
}

void blade_pretok_free(blade_pretok *p)
{
    if (!p)
        return;
    pcre2_code_free(p->code);
    free(p);
}

/* Splits one run of well-formed UTF-8, which is what lets the match skip PCRE2's own
 * validation of the subject on every call. */
static int split_valid(const blade_pretok *p, pcre2_match_data *md, const char *run, size_t len,
                       blade_pretok_cb cb, void *ctx, blade_error *err)
{
    size_t pos = 0;
    while (pos < len) {
        int rc = pcre2_match(p->code, (PCRE2_SPTR)run, len, pos, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH)
            return cb(ctx, run + pos, len - pos) ? -1 : 0;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return blade_error_set(err, "pre-tokenizer: regex match failed at byte %zu: %s", pos,
                                   (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t start = ov[0], end = ov[1];
        if (end <= start) {
            /* None of the patterns can match empty, but a pattern that did must not stall
             * the loop: hand over one character and search on from the next. */
            end = start + blade_utf8_char_len(run + start, len - start);
        }
        if (start > pos && cb(ctx, run + pos, start - pos))
            return -1;
        if (cb(ctx, run + start, end - start))
            return -1;
        pos = end;
    }
    return 0;
}

int blade_pretok_split(const blade_pretok *p, const char *text, size_t len, blade_pretok_cb cb, void *ctx,
                       blade_error *err)
{
    if (!len)
        return 0;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(p->code, NULL);
    if (!md)
        return blade_error_set(err, "pre-tokenizer: out of memory");
    size_t pos = 0;
    int rc = 0;
    while (pos < len && !rc) {
        size_t run = pos;
        size_t n;
        while (run < len && (n = blade_utf8_char_len(text + run, len - run)) > 0)
            run += n;
        if (run > pos) {
            rc = split_valid(p, md, text + pos, run - pos, cb, ctx, err);
            pos = run;
            continue;
        }
        while (run < len && blade_utf8_char_len(text + run, len - run) == 0)
            run++;
        rc = cb(ctx, text + pos, run - pos) ? -1 : 0;
        pos = run;
    }
    pcre2_match_data_free(md);
    return rc;
}

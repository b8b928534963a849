/* Template source -> tokens, with Jinja's whitespace rules as Hugging Face configures them:
 * trim_blocks (a block or comment tag eats the newline after it), lstrip_blocks (spaces
 * before a block or comment tag at the start of a line are dropped), `-` on either side of
 * a tag strips all whitespace on that side, `+` disables the block rules for one tag. */
#include "common/utf8.h"
#include "chat/jinja.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BRACKETS TMPL_MAX_AST_DEPTH

typedef struct lexer {
    const char *src;
    size_t len, pos;
    int line;
    bool line_starting; /* the previous tag ended at the start of a line */
    arena *a;
    token *toks;
    size_t n, cap;
    blade_error *err;
} lexer;

static int lex_fail(lexer *lx, const char *fmt, const char *arg)
{
    char msg[256];
    snprintf(msg, sizeof msg, fmt, arg);
    return blade_error_set(lx->err, "template syntax error, line %d: %s", lx->line, msg);
}

static void advance(lexer *lx, size_t to)
{
    for (size_t i = lx->pos; i < to; i++)
        lx->line += lx->src[i] == '\n';
    lx->pos = to;
}

static token *emit(lexer *lx, tok_kind kind, int line)
{
    if (lx->n == lx->cap) {
        size_t cap = lx->cap ? lx->cap * 2 : 256;
        token *t = realloc(lx->toks, cap * sizeof *t);
        if (!t)
            return NULL;
        lx->toks = t;
        lx->cap = cap;
    }
    token *t = &lx->toks[lx->n++];
    memset(t, 0, sizeof *t);
    t->kind = kind;
    t->line = line;
    return t;
}

static int emit_text(lexer *lx, size_t from, size_t to, int line)
{
    if (to <= from)
        return 0;
    token *t = emit(lx, T_TEXT, line);
    if (!t || !(t->str = tmpl_arena_strndup(lx->a, lx->src + from, to - from)))
        return blade_error_set(lx->err, "out of memory");
    t->len = to - from;
    return 0;
}

static size_t skip_py_space(const char *s, size_t pos, size_t len)
{
    size_t k;
    while (pos < len && (k = tmpl_py_space_len(s + pos, len - pos)) > 0)
        pos += k;
    return pos;
}

/* Where the text before a tag ends once the tag's whitespace control is applied. */
static size_t strip_text(lexer *lx, size_t from, size_t to, char sign, bool lstrip)
{
    if (sign == '-') {
        /* Python's rstrip: walk back over whole (possibly multi-byte) whitespace characters. */
        size_t end = to;
        while (end > from) {
            size_t i = end - 1;
            while (i > from && end - i < 4 && ((unsigned char)lx->src[i] & 0xC0) == 0x80)
                i--;
            if (tmpl_py_space_len(lx->src + i, end - i) != end - i)
                break;
            end = i;
        }
        return end;
    }
    if (sign == '+' || !lstrip)
        return to;
    size_t l = to;
    while (l > from && lx->src[l - 1] != '\n')
        l--;
    if (l == from && !lx->line_starting)
        return to;
    if (l == to)
        return to;
    size_t p = l, k;
    while (p < to && (k = tmpl_py_space_len(lx->src + p, to - p)) > 0 && lx->src[p] != '\n')
        p += k;
    return p == to ? l : to;
}

static bool starts(const lexer *lx, size_t pos, const char *s)
{
    size_t n = strlen(s);
    return pos + n <= lx->len && memcmp(lx->src + pos, s, n) == 0;
}

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

static size_t skip_ws(const lexer *lx, size_t p)
{
    while (p < lx->len && is_ws(lx->src[p]))
        p++;
    return p;
}

/* After `%}`-style tag ends: the `-` form strips what follows, the plain form eats one
 * newline (trim_blocks), `+` leaves the text alone. */
static void after_tag(lexer *lx, size_t end, char sign, bool trim)
{
    if (sign == '-')
        end = skip_py_space(lx->src, end, lx->len);
    else if (sign != '+' && trim && end < lx->len && lx->src[end] == '\n')
        end++;
    advance(lx, end);
    lx->line_starting = lx->pos > 0 && lx->src[lx->pos - 1] == '\n';
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static bool read_hex(const char *s, size_t n, size_t avail, uint32_t *out)
{
    if (avail < n)
        return false;
    uint32_t v = 0;
    for (size_t i = 0; i < n; i++) {
        int h = hexval(s[i]);
        if (h < 0)
            return false;
        v = v * 16 + (uint32_t)h;
    }
    *out = v;
    return true;
}

/* Python string-literal escapes, as Jinja decodes them. */
static int lex_string(lexer *lx)
{
    char q = lx->src[lx->pos];
    size_t p = lx->pos + 1;
    while (p < lx->len && lx->src[p] != q) {
        if (lx->src[p] == '\\')
            p++;
        p++;
    }
    if (p >= lx->len)
        return lex_fail(lx, "unterminated string literal%s", "");
    const char *s = lx->src + lx->pos + 1;
    size_t n = p - lx->pos - 1;
    char *buf = tmpl_arena_alloc(lx->a, n + 1);
    if (!buf)
        return blade_error_set(lx->err, "out of memory");
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        if (s[i] != '\\') {
            buf[o++] = s[i++];
            continue;
        }
        char c = s[i + 1];
        i += 2;
        uint32_t cp;
        switch (c) {
        case '\n': continue;
        case '\\': case '\'': case '"': buf[o++] = c; continue;
        case 'a': buf[o++] = '\a'; continue;
        case 'b': buf[o++] = '\b'; continue;
        case 'f': buf[o++] = '\f'; continue;
        case 'n': buf[o++] = '\n'; continue;
        case 'r': buf[o++] = '\r'; continue;
        case 't': buf[o++] = '\t'; continue;
        case 'v': buf[o++] = '\v'; continue;
        case 'x':
        case 'u':
        case 'U': {
            size_t digits = c == 'x' ? 2 : c == 'u' ? 4 : 8;
            if (!read_hex(s + i, digits, n - i, &cp))
                return lex_fail(lx, "truncated \\%s escape in string literal", (char[]){c, 0});
            i += digits;
            if (cp >= 0xD800 && cp < 0xDC00 && i + 6 <= n && s[i] == '\\' && s[i + 1] == 'u') {
                uint32_t lo;
                if (read_hex(s + i + 2, 4, n - i - 2, &lo) && lo >= 0xDC00 && lo < 0xE000) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    i += 6;
                }
            }
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000))
                return lex_fail(lx, "escape in string literal is not a valid character%s", "");
            o += blade_utf8_encode(cp, buf + o);
            continue;
        }
        case 'N': return lex_fail(lx, "\\N{...} escapes are not supported%s", "");
        default:
            if (c >= '0' && c <= '7') {
                cp = (uint32_t)(c - '0');
                for (int k = 0; k < 2 && i < n && s[i] >= '0' && s[i] <= '7'; k++)
                    cp = cp * 8 + (uint32_t)(s[i++] - '0');
                o += blade_utf8_encode(cp, buf + o);
                continue;
            }
            /* Python keeps unknown escapes as written. */
            buf[o++] = '\\';
            i--;
            continue;
        }
    }
    buf[o] = 0;
    token *t = emit(lx, T_STRING, lx->line);
    if (!t)
        return blade_error_set(lx->err, "out of memory");
    t->str = buf;
    t->len = o;
    advance(lx, p + 1);
    return 0;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

/* Digits with single underscores between them, as Python allows. */
static size_t scan_digits(const lexer *lx, size_t p, int base)
{
    size_t start = p;
    while (p < lx->len) {
        char c = lx->src[p];
        int v = hexval(c);
        if (v >= 0 && v < base && (base == 16 || is_digit(c))) {
            p++;
        } else if (c == '_' && p > start && p + 1 < lx->len) {
            int w = hexval(lx->src[p + 1]);
            if (w < 0 || w >= base || (base != 16 && !is_digit(lx->src[p + 1])))
                break;
            p++;
        } else {
            break;
        }
    }
    return p;
}

static int lex_number(lexer *lx)
{
    size_t p = lx->pos, end = scan_digits(lx, p, 10);
    bool is_float = false;
    bool after_dot = p > 0 && lx->src[p - 1] == '.'; /* `x.0.1` is two subscripts */
    if (!after_dot) {
        size_t q = end;
        if (q + 1 < lx->len && lx->src[q] == '.' && is_digit(lx->src[q + 1])) {
            q = scan_digits(lx, q + 1, 10);
            is_float = true;
        }
        if (q < lx->len && (lx->src[q] == 'e' || lx->src[q] == 'E')) {
            size_t r = q + 1;
            if (r < lx->len && (lx->src[r] == '+' || lx->src[r] == '-'))
                r++;
            if (r < lx->len && is_digit(lx->src[r])) {
                q = scan_digits(lx, r, 10);
                is_float = true;
            }
        }
        if (is_float)
            end = q;
    }
    char digits[128];
    size_t nd = 0;
    int base = 10;
    if (!is_float && lx->src[p] == '0' && p + 1 < lx->len) {
        char b = lx->src[p + 1];
        base = (b == 'x' || b == 'X') ? 16 : (b == 'o' || b == 'O') ? 8 : (b == 'b' || b == 'B') ? 2 : 10;
        if (base != 10) {
            size_t from = p + 2;
            if (from < lx->len && lx->src[from] == '_')
                from++;
            end = scan_digits(lx, from, base);
            if (end == from)
                return lex_fail(lx, "invalid integer literal%s", "");
            p = from;
        } else {
            /* Python allows only zeros after a leading zero. */
            end = p + 1;
            while (end < lx->len && (lx->src[end] == '0' || (lx->src[end] == '_' && end + 1 < lx->len &&
                                                             lx->src[end + 1] == '0')))
                end++;
        }
    }
    for (size_t i = p; i < end; i++) {
        if (lx->src[i] == '_')
            continue;
        if (nd + 1 >= sizeof digits)
            return lex_fail(lx, "number literal too long%s", "");
        digits[nd++] = lx->src[i];
    }
    digits[nd] = 0;
    token *t = emit(lx, is_float ? T_FLOAT : T_INT, lx->line);
    if (!t)
        return blade_error_set(lx->err, "out of memory");
    if (is_float) {
        t->fval = strtod(digits, NULL);
    } else {
        uint64_t v = 0;
        for (size_t i = 0; i < nd; i++) {
            uint64_t d = (uint64_t)hexval(digits[i]);
            if (v > (UINT64_C(0x7FFFFFFFFFFFFFFF) - d) / (uint64_t)base)
                return lex_fail(lx, "integer literal too large%s", "");
            v = v * (uint64_t)base + d;
        }
        t->ival = (int64_t)v;
    }
    advance(lx, end);
    return 0;
}

static const struct {
    const char *s;
    op_kind op;
} ops[] = {
    {"//", OP_FLOORDIV}, {"**", OP_POW}, {"==", OP_EQ}, {"!=", OP_NE}, {">=", OP_GE}, {"<=", OP_LE},
    {"+", OP_ADD}, {"-", OP_SUB}, {"/", OP_DIV}, {"*", OP_MUL}, {"%", OP_MOD}, {"~", OP_TILDE},
    {"[", OP_LBRACKET}, {"]", OP_RBRACKET}, {"(", OP_LPAREN}, {")", OP_RPAREN}, {"{", OP_LBRACE},
    {"}", OP_RBRACE}, {">", OP_GT}, {"<", OP_LT}, {"=", OP_ASSIGN}, {".", OP_DOT}, {":", OP_COLON},
    {"|", OP_PIPE}, {",", OP_COMMA}, {";", OP_SEMICOLON},
};

/* Tokens inside {{ }} or {% %} up to the closing delimiter. Brackets must balance, and a
 * closing delimiter inside open brackets is an operator, as in `{{ {'a': {'b': 1}} }}`. */
static int lex_tag(lexer *lx, bool block, int open_line)
{
    char stack[MAX_BRACKETS];
    size_t depth = 0;
    for (;;) {
        advance(lx, skip_ws(lx, lx->pos));
        if (lx->pos >= lx->len) {
            lx->line = open_line;
            return lex_fail(lx, "unexpected end of template: the %s opened here is never closed",
                            block ? "{% tag" : "{{ expression");
        }
        size_t p = lx->pos;
        if (depth == 0) {
            char sign = 0;
            size_t end = 0;
            if (block) {
                if (starts(lx, p, "-%}") || starts(lx, p, "+%}"))
                    sign = lx->src[p], end = p + 3;
                else if (starts(lx, p, "%}"))
                    end = p + 2;
            } else {
                if (starts(lx, p, "-}}"))
                    sign = '-', end = p + 3;
                else if (starts(lx, p, "}}"))
                    end = p + 2;
            }
            if (end) {
                if (!emit(lx, block ? T_BLOCK_END : T_VAR_END, lx->line))
                    return blade_error_set(lx->err, "out of memory");
                after_tag(lx, end, sign, block);
                return 0;
            }
        }
        char c = lx->src[p];
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') {
            size_t e = p + 1;
            while (e < lx->len && ((lx->src[e] >= 'a' && lx->src[e] <= 'z') || (lx->src[e] >= 'A' && lx->src[e] <= 'Z') ||
                                   is_digit(lx->src[e]) || lx->src[e] == '_'))
                e++;
            /* names become immortal strings so that assignments can use them as keys */
            token *t = emit(lx, T_NAME, lx->line);
            tv_str *ts = t ? tmpl_str_immortal(lx->a, lx->src + p, e - p) : NULL;
            if (!ts)
                return blade_error_set(lx->err, "out of memory");
            t->str = ts->s;
            t->len = e - p;
            advance(lx, e);
            continue;
        }
        if (is_digit(c)) {
            if (lex_number(lx))
                return -1;
            continue;
        }
        if (c == '\'' || c == '"') {
            if (lex_string(lx))
                return -1;
            continue;
        }
        size_t k = 0;
        while (k < sizeof ops / sizeof ops[0] && !starts(lx, p, ops[k].s))
            k++;
        if (k == sizeof ops / sizeof ops[0]) {
            char shown[8] = {0};
            uint32_t cp;
            memcpy(shown, lx->src + p, blade_utf8_decode(lx->src + p, lx->len - p, &cp));
            return lex_fail(lx, "unexpected character '%s'", shown);
        }
        op_kind op = ops[k].op;
        if (op == OP_LPAREN || op == OP_LBRACKET || op == OP_LBRACE) {
            if (depth == MAX_BRACKETS)
                return lex_fail(lx, "brackets nested too deeply%s", "");
            stack[depth++] = op == OP_LPAREN ? ')' : op == OP_LBRACKET ? ']' : '}';
        } else if (op == OP_RPAREN || op == OP_RBRACKET || op == OP_RBRACE) {
            if (depth == 0 || stack[depth - 1] != c)
                return lex_fail(lx, "unexpected '%s'", ops[k].s);
            depth--;
        }
        token *t = emit(lx, T_OP, lx->line);
        if (!t)
            return blade_error_set(lx->err, "out of memory");
        t->op = op;
        t->str = ops[k].s;
        t->len = strlen(ops[k].s);
        advance(lx, p + t->len);
    }
}

/* `{% raw %}` at p (just after `{%` and its sign)? Returns where the opening tag ends. */
static size_t raw_open(const lexer *lx, size_t p, char *sign)
{
    p = skip_ws(lx, p);
    if (!starts(lx, p, "raw"))
        return 0;
    size_t q = skip_ws(lx, p + 3);
    if (q == p + 3 && !starts(lx, q, "-%}") && !starts(lx, q, "%}"))
        return 0;
    if (starts(lx, q, "-%}")) {
        *sign = '-';
        return q + 3;
    }
    *sign = 0;
    return starts(lx, q, "%}") ? q + 2 : 0;
}

static int lex_raw(lexer *lx, size_t body, int open_line)
{
    for (size_t p = body; p + 1 < lx->len; p++) {
        if (lx->src[p] != '{' || lx->src[p + 1] != '%')
            continue;
        size_t q = p + 2;
        char sign = 0;
        if (q < lx->len && (lx->src[q] == '-' || lx->src[q] == '+'))
            sign = lx->src[q++];
        q = skip_ws(lx, q);
        if (!starts(lx, q, "endraw"))
            continue;
        q = skip_ws(lx, q + 6);
        char end_sign = 0;
        size_t end;
        if (starts(lx, q, "-%}") || starts(lx, q, "+%}"))
            end_sign = lx->src[q], end = q + 3;
        else if (starts(lx, q, "%}"))
            end = q + 2;
        else
            continue;
        size_t text_end = strip_text(lx, body, p, sign, true);
        if (emit_text(lx, body, text_end, lx->line))
            return -1;
        advance(lx, p);
        after_tag(lx, end, end_sign, true);
        return 0;
    }
    lx->line = open_line;
    return lex_fail(lx, "{%% raw %%} is never closed by {%% endraw %%}%s", "");
}

int tmpl_lex(const char *src, size_t len, arena *a, token **toks, size_t *ntoks, blade_error *err)
{
    lexer lx = {.src = src, .len = len, .line = 1, .line_starting = true, .a = a, .err = err};
    while (lx.pos < lx.len) {
        const char *hit = NULL;
        for (const char *s = lx.src + lx.pos; (s = memchr(s, '{', (size_t)(lx.src + lx.len - s))) != NULL; s++) {
            if (s + 1 < lx.src + lx.len && (s[1] == '{' || s[1] == '%' || s[1] == '#')) {
                hit = s;
                break;
            }
        }
        if (!hit) {
            if (emit_text(&lx, lx.pos, lx.len, lx.line))
                goto fail;
            advance(&lx, lx.len);
            break;
        }
        size_t q = (size_t)(hit - lx.src), p = q + 2;
        char kind = hit[1], sign = 0;
        if (p < lx.len && (lx.src[p] == '-' || lx.src[p] == '+'))
            sign = lx.src[p++];
        char raw_sign = 0;
        size_t raw_end = kind == '%' ? raw_open(&lx, p, &raw_sign) : 0;
        size_t text_end = strip_text(&lx, lx.pos, q, sign, kind != '{');
        if (emit_text(&lx, lx.pos, text_end, lx.line))
            goto fail;
        advance(&lx, q);
        int open_line = lx.line;
        if (raw_end) {
            size_t body = raw_sign == '-' ? skip_py_space(lx.src, raw_end, lx.len) : raw_end;
            advance(&lx, body);
            lx.line_starting = lx.src[body - 1] == '\n';
            if (lex_raw(&lx, body, open_line))
                goto fail;
            continue;
        }
        if (kind == '#') {
            if (p == lx.len) /* Jinja takes an opener that ends the source as an empty comment */
                break;
            const char *e = NULL;
            for (const char *s = lx.src + p; (s = memchr(s, '#', (size_t)(lx.src + lx.len - s))) != NULL; s++) {
                if (s + 1 < lx.src + lx.len && s[1] == '}') {
                    e = s;
                    break;
                }
            }
            if (!e) {
                lex_fail(&lx, "unterminated comment%s", "");
                goto fail;
            }
            size_t ep = (size_t)(e - lx.src);
            char end_sign = ep > p && (e[-1] == '-' || e[-1] == '+') ? e[-1] : 0;
            after_tag(&lx, ep + 2, end_sign, true);
            continue;
        }
        if (!emit(&lx, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN, lx.line)) {
            blade_error_set(err, "out of memory");
            goto fail;
        }
        advance(&lx, p);
        if (lex_tag(&lx, kind == '%', open_line))
            goto fail;
    }
    if (!emit(&lx, T_EOF, lx.line)) {
        blade_error_set(err, "out of memory");
        goto fail;
    }
    *toks = lx.toks;
    *ntoks = lx.n;
    return 0;
fail:
    free(lx.toks);
    return -1;
}

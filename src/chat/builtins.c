/* Jinja's builtin filters and tests, the globals chat templates call (range, namespace,
 * dict, raise_exception, strftime_now) and the Python methods of str, dict and the loop
 * object that templates use as if they were Python. Behaviour follows Jinja and CPython,
 * including their quirks, since the output must match the reference byte for byte. */
#include "common/utf8.h"
#include "chat/jinja.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- names ---- */

enum {
    F_ABS, F_ATTR, F_BATCH, F_CAPITALIZE, F_CENTER, F_DEFAULT, F_DICTSORT, F_ESCAPE, F_FIRST, F_FLOAT,
    F_FORMAT, F_INDENT, F_INT, F_ITEMS, F_JOIN, F_LAST, F_LENGTH, F_LIST, F_LOWER, F_MAP, F_MAX, F_MIN,
    F_REJECT, F_REJECTATTR, F_REPLACE, F_REVERSE, F_ROUND, F_SAFE, F_SELECT, F_SELECTATTR, F_SORT,
    F_STRING, F_SUM, F_TITLE, F_TOJSON, F_TRIM, F_UNIQUE, F_UPPER, F_WORDCOUNT
};

typedef struct named {
    const char *name;
    int id;
} named;

static const named filters[] = {
    {"abs", F_ABS}, {"attr", F_ATTR}, {"batch", F_BATCH}, {"capitalize", F_CAPITALIZE}, {"center", F_CENTER},
    {"count", F_LENGTH}, {"d", F_DEFAULT}, {"default", F_DEFAULT}, {"dictsort", F_DICTSORT}, {"e", F_ESCAPE},
    {"escape", F_ESCAPE}, {"first", F_FIRST}, {"float", F_FLOAT}, {"forceescape", F_ESCAPE}, {"format", F_FORMAT},
    {"indent", F_INDENT}, {"int", F_INT}, {"items", F_ITEMS}, {"join", F_JOIN}, {"last", F_LAST},
    {"length", F_LENGTH}, {"list", F_LIST}, {"lower", F_LOWER}, {"map", F_MAP}, {"max", F_MAX}, {"min", F_MIN},
    {"reject", F_REJECT}, {"rejectattr", F_REJECTATTR}, {"replace", F_REPLACE}, {"reverse", F_REVERSE},
    {"round", F_ROUND}, {"safe", F_SAFE}, {"select", F_SELECT}, {"selectattr", F_SELECTATTR}, {"sort", F_SORT},
    {"string", F_STRING}, {"sum", F_SUM}, {"title", F_TITLE}, {"tojson", F_TOJSON}, {"trim", F_TRIM},
    {"unique", F_UNIQUE}, {"upper", F_UPPER}, {"wordcount", F_WORDCOUNT},
};

enum {
    X_BOOLEAN, X_CALLABLE, X_DEFINED, X_DIVISIBLEBY, X_EQ, X_ESCAPED, X_EVEN, X_FALSE, X_FILTER, X_FLOAT, X_GE,
    X_GT, X_IN, X_INTEGER, X_ITERABLE, X_LE, X_LOWER, X_LT, X_MAPPING, X_NE, X_NONE, X_NUMBER, X_ODD, X_SAMEAS,
    X_SEQUENCE, X_STRING, X_TEST, X_TRUE, X_UNDEFINED, X_UPPER
};

static const named tests[] = {
    {"!=", X_NE}, {"<", X_LT}, {"<=", X_LE}, {"==", X_EQ}, {">", X_GT}, {">=", X_GE}, {"boolean", X_BOOLEAN},
    {"callable", X_CALLABLE}, {"defined", X_DEFINED}, {"divisibleby", X_DIVISIBLEBY}, {"eq", X_EQ},
    {"equalto", X_EQ}, {"escaped", X_ESCAPED}, {"even", X_EVEN}, {"false", X_FALSE}, {"filter", X_FILTER},
    {"float", X_FLOAT}, {"ge", X_GE}, {"greaterthan", X_GT}, {"gt", X_GT}, {"in", X_IN}, {"integer", X_INTEGER},
    {"iterable", X_ITERABLE}, {"le", X_LE}, {"lessthan", X_LT}, {"lower", X_LOWER}, {"lt", X_LT},
    {"mapping", X_MAPPING}, {"ne", X_NE}, {"none", X_NONE}, {"number", X_NUMBER}, {"odd", X_ODD},
    {"sameas", X_SAMEAS}, {"sequence", X_SEQUENCE}, {"string", X_STRING}, {"test", X_TEST}, {"true", X_TRUE},
    {"undefined", X_UNDEFINED}, {"upper", X_UPPER},
};

enum { G_DICT, G_NAMESPACE, G_RAISE, G_RANGE, G_STRFTIME };

static const named globals[] = {
    {"dict", G_DICT}, {"namespace", G_NAMESPACE}, {"raise_exception", G_RAISE}, {"range", G_RANGE},
    {"strftime_now", G_STRFTIME},
};

static int find_name(const named *t, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(t[i].name, name))
            return t[i].id;
    return -1;
}

int tmpl_filter_id(const char *name) { return find_name(filters, sizeof filters / sizeof filters[0], name); }
int tmpl_test_id(const char *name) { return find_name(tests, sizeof tests / sizeof tests[0], name); }
int tmpl_global_id(const char *name) { return find_name(globals, sizeof globals / sizeof globals[0], name); }

const char *tmpl_global_name(int id)
{
    for (size_t i = 0; i < sizeof globals / sizeof globals[0]; i++)
        if (globals[i].id == id)
            return globals[i].name;
    return "?";
}

/* ---- arguments ---- */

/* Positional and keyword arguments into named slots (borrowed); an absent one is
 * undefined, which every caller treats as "use the default". */
static bool bind(jrun *R, const char *fn, argv_ *a, const char *const *names, size_t n, tv *slot)
{
    for (size_t i = 0; i < n; i++)
        slot[i] = tv_undef(UNDEF_NAME, names[i], 0);
    if (a->npos > n)
        return tmpl_fail(R, "%s() takes at most %zu argument(s), %zu given", fn, n, a->npos);
    for (size_t i = 0; i < a->npos; i++)
        slot[i] = a->pos[i];
    for (size_t k = 0; k < a->nkw; k++) {
        size_t i = 0;
        while (i < n && strcmp(names[i], a->kw[k]))
            i++;
        if (i == n)
            return tmpl_fail(R, "%s() got an unexpected keyword argument '%s'", fn, a->kw[k]);
        if (i < a->npos)
            return tmpl_fail(R, "%s() got multiple values for argument '%s'", fn, a->kw[k]);
        slot[i] = a->kwv[k];
    }
    return true;
}

static bool given(tv v) { return v.kind != TV_UNDEF; }

static bool want_int(jrun *R, const char *what, tv v, int64_t *out)
{
    if (!tv_is_int(v))
        return tmpl_fail(R, "%s must be an integer, not '%s'", what, tv_type_name(v));
    *out = tv_intval(v);
    return true;
}

static bool want_str(jrun *R, const char *what, tv v)
{
    return v.kind == TV_STR || tmpl_fail(R, "%s must be a string, not '%s'", what, tv_type_name(v));
}

static tv list_val(tv_list *l) { return tv_obj_val(TV_LIST, l); }

static bool list_out(tv_list *l, tv *out)
{
    if (!l)
        return false;
    *out = list_val(l);
    return true;
}

/* ---- string helpers ---- */

static size_t prev_start(const char *s, size_t from, size_t end)
{
    size_t i = end - 1;
    while (i > from && end - i < 4 && ((unsigned char)s[i] & 0xC0) == 0x80)
        i--;
    return i;
}

static bool char_in(uint32_t cp, const tv_str *chars)
{
    if (!chars)
        return tmpl_py_isspace(cp);
    for (size_t i = 0; i < chars->len;) {
        uint32_t c;
        i += blade_utf8_decode(chars->s + i, chars->len - i, &c);
        if (c == cp)
            return true;
    }
    return false;
}

static bool strip(jrun *R, const tv_str *s, const tv_str *chars, bool left, bool right, tv *out)
{
    size_t b = 0, e = s->len;
    /* each character examined is compared with every character of `chars` */
    uint64_t per_char = 1 + (chars ? TMPL_SCAN_COST(chars->len) : 0);
    while (left && b < e && tmpl_charge(R, per_char)) {
        uint32_t cp;
        size_t n = blade_utf8_decode(s->s + b, e - b, &cp);
        if (!char_in(cp, chars))
            break;
        b += n;
    }
    while (right && e > b && tmpl_charge(R, per_char)) {
        size_t p = prev_start(s->s, b, e);
        uint32_t cp;
        blade_utf8_decode(s->s + p, e - p, &cp);
        if (!char_in(cp, chars))
            break;
        e = p;
    }
    return !R->failed && tmpl_str_val(R, s->s + b, e - b, out);
}

enum { CASE_UPPER, CASE_LOWER, CASE_TITLE, CASE_CAPITALIZE, CASE_WORDS, CASE_SWAP };

static bool word_sep(uint32_t cp) { return cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || tmpl_py_isspace(cp); }

/* CASE_TITLE is Python's str.title(); CASE_WORDS is Jinja's title filter, which starts a
 * word after whitespace or one of -({[< instead of after any uncased character. */
static bool change_case(jrun *R, const tv_str *s, int mode, tv *out)
{
    strbuf b;
    tmpl_sb_init(&b);
    tmpl_debit(R, TMPL_SCAN_COST(s->len));
    bool prev_cased = false, word_start = true, ok = true;
    for (size_t i = 0, k = 0; ok && i < s->len; k++) {
        uint32_t cp, m;
        size_t n = blade_utf8_decode(s->s + i, s->len - i, &cp);
        bool up;
        switch (mode) {
        case CASE_UPPER: up = true; break;
        case CASE_LOWER: up = false; break;
        case CASE_TITLE: up = !prev_cased; break;
        case CASE_CAPITALIZE: up = k == 0; break;
        case CASE_WORDS: up = word_start; break;
        default: up = tmpl_uni_lower(cp) != cp ? false : true; break;
        }
        if (mode == CASE_SWAP)
            up = tmpl_uni_upper(cp) == cp && tmpl_uni_lower(cp) != cp ? false : true;
        prev_cased = tmpl_uni_cased(cp);
        word_start = word_sep(cp);
        if (up && cp == 0xDF) {
            ok = tmpl_sb_put(R, &b, mode == CASE_UPPER || mode == CASE_SWAP ? "SS" : "Ss", 2);
        } else {
            m = up ? tmpl_uni_upper(cp) : tmpl_uni_lower(cp);
            if (m == cp) {
                ok = tmpl_sb_put(R, &b, s->s + i, n);
            } else {
                char enc[4];
                ok = tmpl_sb_put(R, &b, enc, blade_utf8_encode(m, enc));
            }
        }
        i += n;
    }
    if (!ok) {
        tmpl_sb_drop(&b);
        return false;
    }
    *out = tmpl_sb_finish(R, &b);
    return !R->failed;
}

static bool spaces(jrun *R, int64_t n, strbuf *b)
{
    if (n <= 0)
        return true;
    if ((uint64_t)n > TMPL_MAX_STRING)
        return tmpl_fail(R, "padding of %" PRId64 " characters exceeds the string limit", n);
    char chunk[256];
    memset(chunk, ' ', sizeof chunk);
    while (n > 0) {
        size_t k = n > (int64_t)sizeof chunk ? sizeof chunk : (size_t)n;
        if (!tmpl_sb_put(R, b, chunk, k))
            return false;
        n -= (int64_t)k;
    }
    return true;
}

/* Code point index of a byte offset. */
static int64_t cp_index(jrun *R, const tv_str *s, size_t off)
{
    tmpl_debit(R, TMPL_SCAN_COST(off));
    int64_t n = 0;
    for (size_t i = 0; i < off;) {
        uint32_t cp;
        i += blade_utf8_decode(s->s + i, off - i, &cp);
        n++;
    }
    return n;
}

/* Rightmost occurrence of n ending at or before end; a plain scan, charged for its worst
 * case of comparing the whole needle at every position. */
static const char *find_last(jrun *R, const char *h, const char *n, size_t nl, size_t end)
{
    if (nl > end)
        return NULL;
    tmpl_debit(R, TMPL_SCAN_COST(end - nl + 1) * (1 + nl / 64));
    for (size_t i = end - nl + 1; i-- > 0;)
        if (!memcmp(h + i, n, nl))
            return h + i;
    return NULL;
}

static bool split(jrun *R, const tv_str *s, const tv_str *sep, int64_t maxsplit, bool from_right, tv *out)
{
    tv_list *l = tmpl_list_new(R, 0, false);
    if (!l)
        return false;
    tv item;
    bool ok = tmpl_charge(R, TMPL_SCAN_COST(s->len));
    if (sep && !sep->len) {
        tv_release(list_val(l));
        return tmpl_fail(R, "empty separator");
    }
    if (!sep && !from_right) {
        size_t i = 0;
        while (ok) {
            while (i < s->len && tmpl_py_space_len(s->s + i, s->len - i))
                i += tmpl_py_space_len(s->s + i, s->len - i);
            if (i >= s->len)
                break;
            size_t j = i;
            if (maxsplit == 0) {
                ok = tmpl_str_val(R, s->s + i, s->len - i, &item) && tmpl_list_push(R, l, item);
                break;
            }
            while (j < s->len && !tmpl_py_space_len(s->s + j, s->len - j)) {
                uint32_t cp;
                j += blade_utf8_decode(s->s + j, s->len - j, &cp);
            }
            ok = tmpl_str_val(R, s->s + i, j - i, &item) && tmpl_list_push(R, l, item);
            i = j;
            maxsplit--;
        }
    } else if (!sep) {
        /* rsplit(): collected right to left, reversed at the end */
        size_t e = s->len;
        while (ok) {
            while (e > 0) {
                size_t p = prev_start(s->s, 0, e);
                if (!tmpl_py_space_len(s->s + p, e - p))
                    break;
                e = p;
            }
            if (e == 0)
                break;
            if (maxsplit == 0) {
                ok = tmpl_str_val(R, s->s, e, &item) && tmpl_list_push(R, l, item);
                break;
            }
            size_t b = e;
            while (b > 0) {
                size_t p = prev_start(s->s, 0, b);
                if (tmpl_py_space_len(s->s + p, b - p))
                    break;
                b = p;
            }
            ok = tmpl_str_val(R, s->s + b, e - b, &item) && tmpl_list_push(R, l, item);
            e = b;
            maxsplit--;
        }
    } else if (!from_right) {
        size_t i = 0;
        while (ok) {
            const char *hit = maxsplit != 0 && sep->len <= s->len - i ? memmem(s->s + i, s->len - i, sep->s, sep->len)
                                                                     : NULL;
            size_t end = hit ? (size_t)(hit - s->s) : s->len;
            ok = tmpl_str_val(R, s->s + i, end - i, &item) && tmpl_list_push(R, l, item);
            if (!hit)
                break;
            i = end + sep->len;
            maxsplit--;
        }
    } else {
        size_t e = s->len;
        while (ok) {
            const char *hit = maxsplit != 0 ? find_last(R, s->s, sep->s, sep->len, e) : NULL;
            size_t b = hit ? (size_t)(hit - s->s) + sep->len : 0;
            ok = tmpl_str_val(R, s->s + b, e - b, &item) && tmpl_list_push(R, l, item);
            if (!hit)
                break;
            e = (size_t)(hit - s->s);
            maxsplit--;
        }
    }
    if (ok && from_right) {
        for (size_t i = 0; i < l->n / 2; i++) {
            tv t = l->items[i];
            l->items[i] = l->items[l->n - 1 - i];
            l->items[l->n - 1 - i] = t;
        }
    }
    if (!ok) {
        tv_release(list_val(l));
        return false;
    }
    *out = list_val(l);
    return true;
}

/* Python's line boundaries: \n \r \r\n \v \f \x1c-\x1e \x85 \u2028 \u2029. */
static size_t line_break(const char *s, size_t len, size_t i)
{
    uint32_t cp;
    size_t n = blade_utf8_decode(s + i, len - i, &cp);
    if (cp == '\r' && i + 1 < len && s[i + 1] == '\n')
        return 2;
    if (cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C || (cp >= 0x1C && cp <= 0x1E) || cp == 0x85 ||
        cp == 0x2028 || cp == 0x2029)
        return n;
    return 0;
}

static bool splitlines(jrun *R, const tv_str *s, bool keepends, tv_list **out)
{
    tmpl_debit(R, TMPL_SCAN_COST(s->len));
    tv_list *l = tmpl_list_new(R, 0, false);
    size_t start = 0, i = 0;
    while (l && i < s->len) {
        size_t br = line_break(s->s, s->len, i);
        if (!br) {
            uint32_t cp;
            i += blade_utf8_decode(s->s + i, s->len - i, &cp);
            continue;
        }
        tv item;
        if (!tmpl_str_val(R, s->s + start, (keepends ? i + br : i) - start, &item) || !tmpl_list_push(R, l, item)) {
            tv_release(list_val(l));
            return false;
        }
        i += br;
        start = i;
    }
    if (l && start < s->len) {
        tv item;
        if (!tmpl_str_val(R, s->s + start, s->len - start, &item) || !tmpl_list_push(R, l, item)) {
            tv_release(list_val(l));
            return false;
        }
    }
    return (*out = l) != NULL;
}

static bool replace(jrun *R, const tv_str *s, const tv_str *old, const tv_str *with, int64_t count, tv *out)
{
    strbuf b;
    tmpl_sb_init(&b);
    bool ok = true;
    size_t i = 0;
    if (!old->len) {
        /* Python inserts the replacement between characters and at both ends */
        while (ok && i <= s->len && count != 0) {
            ok = tmpl_sb_put(R, &b, with->s, with->len);
            count--;
            if (i == s->len) {
                i++;
                break;
            }
            uint32_t cp;
            size_t n = blade_utf8_decode(s->s + i, s->len - i, &cp);
            ok = ok && tmpl_sb_put(R, &b, s->s + i, n);
            i += n;
        }
        if (ok && i < s->len)
            ok = tmpl_sb_put(R, &b, s->s + i, s->len - i);
    } else {
        while (ok) {
            const char *hit = count != 0 && old->len <= s->len - i ? memmem(s->s + i, s->len - i, old->s, old->len)
                                                                 : NULL;
            if (!hit) {
                ok = tmpl_sb_put(R, &b, s->s + i, s->len - i);
                break;
            }
            size_t at = (size_t)(hit - s->s);
            ok = tmpl_sb_put(R, &b, s->s + i, at - i) && tmpl_sb_put(R, &b, with->s, with->len);
            i = at + old->len;
            count--;
        }
    }
    if (!ok) {
        tmpl_sb_drop(&b);
        return false;
    }
    *out = tmpl_sb_finish(R, &b);
    return !R->failed;
}

static bool lower_value(jrun *R, tv v, tv *out)
{
    if (v.kind == TV_STR)
        return change_case(R, tv_s(v), CASE_LOWER, out);
    *out = tv_retain(v);
    return true;
}

/* Jinja's attribute lookup for map/select/sort: dotted path, digits index lists. */
static bool attr_path(jrun *R, tv item, tv attribute, tv *out)
{
    if (tv_is_int(attribute))
        return tmpl_getitem(R, item, attribute, out);
    if (!want_str(R, "attribute", attribute))
        return false;
    tv_str *path = tv_s(attribute);
    tv cur = tv_retain(item);
    for (size_t i = 0; i <= path->len;) {
        const char *dot = memchr(path->s + i, '.', path->len - i);
        size_t end = dot ? (size_t)(dot - path->s) : path->len;
        bool digits = end > i;
        int64_t num = 0;
        for (size_t k = i; digits && k < end; k++) {
            digits = path->s[k] >= '0' && path->s[k] <= '9' && num < INT64_MAX / 10 - 10;
            num = num * 10 + (path->s[k] - '0');
        }
        tv key, next;
        bool ok = digits ? (key = tv_int(num), true) : tmpl_str_val(R, path->s + i, end - i, &key);
        ok = ok && tmpl_getitem(R, cur, key, &next);
        if (ok || !digits)
            tv_release(key);
        tv_release(cur);
        if (!ok)
            return false;
        cur = next;
        i = end + 1;
        if (!dot)
            break;
    }
    *out = cur;
    return true;
}

/* ---- sorting (stable, like Python's) ---- */

static bool sort_indices(jrun *R, const tv *keys, size_t n, bool reverse, size_t *idx)
{
    size_t *tmp = tmpl_heap_alloc(R, (n ? n : 1) * sizeof *tmp);
    if (!tmp)
        return false;
    for (size_t i = 0; i < n; i++)
        idx[i] = i;
    bool ok = true;
    for (size_t width = 1; ok && width < n; width *= 2) {
        for (size_t lo = 0; ok && lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t i = lo, j = mid, o = lo;
            while (ok && i < mid && j < hi) {
                int c;
                ok = reverse ? tv_compare(R, keys[idx[i]], keys[idx[j]], &c) : tv_compare(R, keys[idx[j]], keys[idx[i]], &c);
                tmp[o++] = ok && c < 0 ? idx[j++] : idx[i++];
            }
            while (i < mid)
                tmp[o++] = idx[i++];
            while (j < hi)
                tmp[o++] = idx[j++];
            memcpy(idx + lo, tmp + lo, (hi - lo) * sizeof *idx);
        }
    }
    tmpl_heap_free(&R->heap, tmp, (n ? n : 1) * sizeof *tmp);
    return ok;
}

/* Sort keys of items: attribute lookup, then lower-casing unless case-sensitive. */
static bool make_keys(jrun *R, const tv_list *items, tv attribute, bool case_sensitive, tv **keys)
{
    tv *k = tmpl_heap_alloc(R, (items->n ? items->n : 1) * sizeof *k);
    if (!k)
        return false;
    size_t made = 0;
    bool ok = true;
    for (; ok && made < items->n; made++) {
        tv base;
        if (given(attribute)) {
            if (!(ok = attr_path(R, items->items[made], attribute, &base)))
                break;
        } else {
            base = tv_retain(items->items[made]);
        }
        if (case_sensitive) {
            k[made] = base;
        } else {
            ok = lower_value(R, base, &k[made]);
            tv_release(base);
            if (!ok)
                break;
        }
    }
    if (!ok) {
        for (size_t i = 0; i < made; i++)
            tv_release(k[i]);
        tmpl_heap_free(&R->heap, k, (items->n ? items->n : 1) * sizeof *k);
        return false;
    }
    *keys = k;
    return true;
}

static void free_keys(jrun *R, tv *keys, size_t n)
{
    for (size_t i = 0; i < n; i++)
        tv_release(keys[i]);
    tmpl_heap_free(&R->heap, keys, (n ? n : 1) * sizeof *keys);
}

static bool sorted(jrun *R, tv_list *items, tv attribute, bool case_sensitive, bool reverse, tv_list **out)
{
    tv *keys;
    if (!make_keys(R, items, attribute, case_sensitive, &keys))
        return false;
    size_t *idx = tmpl_heap_alloc(R, (items->n ? items->n : 1) * sizeof *idx);
    bool ok = idx && sort_indices(R, keys, items->n, reverse, idx);
    tv_list *l = ok ? tmpl_list_new(R, items->n, false) : NULL;
    for (size_t i = 0; l && i < items->n; i++)
        if (!tmpl_list_push(R, l, tv_retain(items->items[idx[i]]))) {
            tv_release(list_val(l));
            l = NULL;
        }
    tmpl_heap_free(&R->heap, idx, idx ? (items->n ? items->n : 1) * sizeof *idx : 0);
    free_keys(R, keys, items->n);
    return (*out = l) != NULL;
}

/* ---- tests ---- */

static bool str_cased_all(jrun *R, const tv_str *s, bool upper, bool *out)
{
    tmpl_debit(R, TMPL_SCAN_COST(s->len));
    bool any = false;
    for (size_t i = 0; i < s->len;) {
        uint32_t cp;
        i += blade_utf8_decode(s->s + i, s->len - i, &cp);
        if (!tmpl_uni_cased(cp))
            continue;
        any = true;
        bool is_lower = tmpl_uni_upper(cp) != cp || cp == 0xDF || cp == 0x138 || cp == 0x149;
        if (is_lower == upper) {
            *out = false;
            return true;
        }
    }
    *out = any;
    return true;
}

/* Whether v % d == want, with Python's modulo (the result takes the divisor's sign). */
static bool mod_is(jrun *R, tv v, tv d, int64_t want, bool *out)
{
    if (v.kind == TV_UNDEF)
        return tmpl_undef_error(R, v);
    if (!tv_is_num(v) || !tv_is_num(d))
        return tmpl_fail(R, "unsupported operand type(s) for %%: '%s' and '%s'", tv_type_name(v), tv_type_name(d));
    if (tv_num(d) == 0)
        return tmpl_fail(R, "integer division or modulo by zero");
    if (tv_is_int(v) && tv_is_int(d)) {
        int64_t x = tv_intval(v), y = tv_intval(d), m = y == -1 ? 0 : x % y;
        if (m != 0 && (m < 0) != (y < 0))
            m += y;
        *out = m == want;
    } else {
        double y = tv_num(d), m = fmod(tv_num(v), y);
        if (m != 0 && (m < 0) != (y < 0))
            m += y;
        *out = m == (double)want;
    }
    return true;
}

bool tmpl_apply_test(jrun *R, int id, const char *name, tv v, argv_ *a, bool *out)
{
    static const char *const one[] = {"other"};
    tv arg;
    size_t nargs = id == X_DIVISIBLEBY || id == X_EQ || id == X_NE || id == X_LT || id == X_LE || id == X_GT ||
                           id == X_GE || id == X_IN || id == X_SAMEAS
                       ? 1
                       : 0;
    if (!bind(R, name, a, one, nargs, &arg))
        return false;
    if (nargs && !given(arg) && id != X_EQ && id != X_NE)
        return tmpl_fail(R, "test '%s' needs an argument", name);
    bool eq;
    int c;
    tv s;
    switch (id) {
    case X_BOOLEAN: *out = v.kind == TV_BOOL; return true;
    case X_CALLABLE: *out = v.kind == TV_MACRO || v.kind == TV_FUNC || v.kind == TV_CALLER; return true;
    case X_DEFINED: *out = v.kind != TV_UNDEF; return true;
    case X_UNDEFINED: *out = v.kind == TV_UNDEF; return true;
    case X_DIVISIBLEBY: return mod_is(R, v, arg, 0, out);
    case X_EVEN: return mod_is(R, v, tv_int(2), 0, out);
    case X_ODD: return mod_is(R, v, tv_int(2), 1, out);
    case X_EQ:
    case X_NE:
        if (!tv_equal(R, v, arg, 0, &eq))
            return false;
        *out = id == X_EQ ? eq : !eq;
        return true;
    case X_LT:
    case X_LE:
    case X_GT:
    case X_GE:
        if (!tv_compare(R, v, arg, &c))
            return false;
        *out = id == X_LT ? c < 0 : id == X_LE ? c <= 0 : id == X_GT ? c > 0 : c >= 0;
        return true;
    case X_IN: return tv_contains(R, arg, v, out);
    case X_ESCAPED: *out = false; return true;
    case X_FALSE: *out = v.kind == TV_BOOL && !v.u.b; return true;
    case X_TRUE: *out = v.kind == TV_BOOL && v.u.b; return true;
    case X_FILTER: *out = v.kind == TV_STR && tmpl_filter_id(tv_s(v)->s) >= 0; return true;
    case X_TEST: *out = v.kind == TV_STR && tmpl_test_id(tv_s(v)->s) >= 0; return true;
    case X_FLOAT: *out = v.kind == TV_FLOAT; return true;
    case X_INTEGER: *out = v.kind == TV_INT; return true;
    case X_NUMBER: *out = tv_is_num(v); return true;
    case X_NONE: *out = v.kind == TV_NONE; return true;
    case X_STRING: *out = v.kind == TV_STR; return true;
    case X_MAPPING: *out = v.kind == TV_DICT; return true;
    case X_ITERABLE:
        *out = v.kind == TV_STR || v.kind == TV_LIST || v.kind == TV_DICT || v.kind == TV_UNDEF || v.kind == TV_LOOP;
        return true;
    case X_SEQUENCE: *out = v.kind == TV_STR || v.kind == TV_LIST || v.kind == TV_DICT || v.kind == TV_UNDEF; return true;
    case X_SAMEAS:
        if (v.kind != arg.kind)
            *out = false;
        else if (tv_has_obj(v))
            *out = v.u.o == arg.u.o;
        else if (!tv_equal(R, v, arg, 0, out))
            return false;
        return true;
    case X_LOWER:
    case X_UPPER: {
        if (!tv_to_str(R, v, &s))
            return false;
        bool ok = str_cased_all(R, tv_s(s), id == X_UPPER, out);
        tv_release(s);
        return ok;
    }
    }
    return tmpl_fail(R, "no test named '%s'", name);
}

/* ---- number parsing as Python's int() and float() ---- */

static bool parse_py_int(jrun *R, const tv_str *s, int base, int64_t *out)
{
    tmpl_debit(R, TMPL_SCAN_COST(s->len));
    const char *p = s->s, *e = s->s + s->len;
    while (p < e && tmpl_py_space_len(p, (size_t)(e - p)))
        p += tmpl_py_space_len(p, (size_t)(e - p));
    while (e > p) {
        size_t q = prev_start(s->s, (size_t)(p - s->s), (size_t)(e - s->s));
        if (!tmpl_py_space_len(s->s + q, (size_t)(e - s->s) - q))
            break;
        e = s->s + q;
    }
    bool neg = false;
    if (p < e && (*p == '+' || *p == '-'))
        neg = *p++ == '-';
    if (e - p >= 2 && p[0] == '0') {
        char x = p[1] | 0x20;
        int pb = x == 'x' ? 16 : x == 'o' ? 8 : x == 'b' ? 2 : 0;
        if (pb && (base == pb || base == 0)) {
            base = pb;
            p += 2;
            if (p < e && *p == '_')
                p++;
        }
    }
    if (base == 0)
        base = 10;
    if (p == e)
        return false;
    uint64_t v = 0;
    bool prev_us = true;
    for (; p < e; p++) {
        if (*p == '_') {
            if (prev_us)
                return false;
            prev_us = true;
            continue;
        }
        int d = *p >= '0' && *p <= '9' ? *p - '0' : (*p | 0x20) >= 'a' && (*p | 0x20) <= 'z' ? (*p | 0x20) - 'a' + 10 : 99;
        if (d >= base)
            return false;
        if (v > (UINT64_C(9223372036854775808) - (uint64_t)d) / (uint64_t)base)
            return false;
        v = v * (uint64_t)base + (uint64_t)d;
        prev_us = false;
    }
    if (prev_us || (!neg && v > INT64_MAX))
        return false;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return true;
}

static bool parse_py_float(jrun *R, const tv_str *s, double *out)
{
    tmpl_debit(R, TMPL_SCAN_COST(s->len));
    char buf[128];
    size_t o = 0;
    const char *p = s->s, *e = s->s + s->len;
    while (p < e && tmpl_py_space_len(p, (size_t)(e - p)))
        p += tmpl_py_space_len(p, (size_t)(e - p));
    while (e > p && tmpl_py_space_len(e - 1, 1))
        e--;
    if (p == e || e - p >= (ptrdiff_t)sizeof buf)
        return false;
    for (const char *q = p; q < e; q++) {
        if (*q == '_') {
            if (q == p || q + 1 == e || !(q[-1] >= '0' && q[-1] <= '9') || !(q[1] >= '0' && q[1] <= '9'))
                return false;
            continue;
        }
        buf[o++] = *q;
    }
    buf[o] = 0;
    /* strtod also reads hex floats, which Python's float() refuses */
    if (strchr(buf, 'x') || strchr(buf, 'X'))
        return false;
    char *end;
    errno = 0;
    double v = strtod(buf, &end);
    if (*end)
        return false;
    *out = v;
    return true;
}

/* ---- printf-style formatting ---- */

static bool fmt_int(jrun *R, strbuf *b, int64_t v, char conv, const char *flags, int64_t width, int64_t prec)
{
    char digits[80];
    size_t nd = 0;
    uint64_t mag = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
    int base = conv == 'x' || conv == 'X' ? 16 : conv == 'o' ? 8 : 10;
    const char *set = conv == 'X' ? "0123456789ABCDEF" : "0123456789abcdef";
    do {
        digits[nd++] = set[mag % (uint64_t)base];
        mag /= (uint64_t)base;
    } while (mag);
    char prefix[8];
    size_t np = 0;
    if (v < 0)
        prefix[np++] = '-';
    else if (strchr(flags, '+'))
        prefix[np++] = '+';
    else if (strchr(flags, ' '))
        prefix[np++] = ' ';
    if (strchr(flags, '#') && base != 10) {
        prefix[np++] = '0';
        prefix[np++] = conv == 'o' ? 'o' : conv;
    }
    int64_t zeros = prec > (int64_t)nd ? prec - (int64_t)nd : 0;
    int64_t body = (int64_t)np + zeros + (int64_t)nd;
    bool left = strchr(flags, '-') != NULL, zero_pad = !left && strchr(flags, '0') != NULL;
    if (zero_pad && width > body) {
        zeros += width - body;
        body = width;
    }
    if (!left && !spaces(R, width - body, b))
        return false;
    if (!tmpl_sb_put(R, b, prefix, np))
        return false;
    for (int64_t i = 0; i < zeros; i++)
        if (!tmpl_sb_putc(R, b, '0'))
            return false;
    for (size_t i = nd; i-- > 0;)
        if (!tmpl_sb_putc(R, b, digits[i]))
            return false;
    return !left || spaces(R, width - body, b);
}

static bool fmt_one(jrun *R, strbuf *b, tv v, char conv, const char *flags, int64_t width, int64_t prec)
{
    bool left = strchr(flags, '-') != NULL;
    switch (conv) {
    case 's':
    case 'r':
    case 'a': {
        strbuf t;
        tmpl_sb_init(&t);
        if (!(conv == 's' ? tv_write_str(R, &t, v) : tv_write_repr(R, &t, v, 0))) {
            tmpl_sb_drop(&t);
            return false;
        }
        tv s = tmpl_sb_finish(R, &t);
        if (R->failed)
            return false;
        tv_str *str = tv_s(s);
        size_t len = str->len, ncp = tmpl_str_ncp(R, str);
        if (prec >= 0 && (size_t)prec < ncp) {
            size_t off = 0;
            for (int64_t i = 0; i < prec; i++) {
                uint32_t cp;
                off += blade_utf8_decode(str->s + off, str->len - off, &cp);
            }
            len = off;
            ncp = (size_t)prec;
        }
        int64_t pad = width - (int64_t)ncp;
        bool ok = (left || spaces(R, pad, b)) && tmpl_sb_put(R, b, str->s, len) && (!left || spaces(R, pad, b));
        tv_release(s);
        return ok;
    }
    case 'd':
    case 'i':
    case 'u':
    case 'x':
    case 'X':
    case 'o':
        if (v.kind == TV_FLOAT && (conv == 'd' || conv == 'i' || conv == 'u')) {
            if (!isfinite(v.u.f) || fabs(v.u.f) >= 9.2e18)
                return tmpl_fail(R, "cannot convert float %s to integer", isnan(v.u.f) ? "NaN" : "infinity or huge");
            return fmt_int(R, b, (int64_t)v.u.f, conv, flags, width, prec);
        }
        if (!tv_is_int(v))
            return tmpl_fail(R, "%%%c format: %s is required, not %s", conv,
                             conv == 'x' || conv == 'X' || conv == 'o' ? "an integer" : "a real number",
                             tv_type_name(v));
        return fmt_int(R, b, tv_intval(v), conv, flags, width, prec);
    case 'e':
    case 'E':
    case 'f':
    case 'F':
    case 'g':
    case 'G': {
        if (!tv_is_num(v))
            return tmpl_fail(R, "must be real number, not %s", tv_type_name(v));
        char spec[32], *buf;
        snprintf(spec, sizeof spec, "%%%s*.*%c", flags, conv);
        int n = snprintf(NULL, 0, spec, (int)width, (int)(prec < 0 ? 6 : prec), tv_num(v));
        if (n < 0)
            return tmpl_fail(R, "cannot format number");
        if (!(buf = tmpl_heap_alloc(R, (size_t)n + 1)))
            return false;
        snprintf(buf, (size_t)n + 1, spec, (int)width, (int)(prec < 0 ? 6 : prec), tv_num(v));
        bool ok = tmpl_sb_put(R, b, buf, (size_t)n);
        tmpl_heap_free(&R->heap, buf, (size_t)n + 1);
        return ok;
    }
    case 'c': {
        char enc[4];
        size_t n;
        if (tv_is_int(v)) {
            int64_t cp = tv_intval(v);
            if (cp < 0 || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000))
                return tmpl_fail(R, "%%c arg not in range(0x110000)");
            n = blade_utf8_encode((uint32_t)cp, enc);
        } else if (v.kind == TV_STR && tmpl_str_ncp(R, tv_s(v)) == 1) {
            n = tv_s(v)->len;
            memcpy(enc, tv_s(v)->s, n);
        } else {
            return tmpl_fail(R, "%%c requires int or char");
        }
        return (left || spaces(R, width - 1, b)) && tmpl_sb_put(R, b, enc, n) && (!left || spaces(R, width - 1, b));
    }
    default: return tmpl_fail(R, "unsupported format character '%c'", conv);
    }
}

bool tmpl_percent_format(jrun *R, tv_str *fmt, tv args, tv *out)
{
    const tv *items = &args;
    size_t nitems = 1, next = 0;
    const tv_dict *map = args.kind == TV_DICT ? tv_d(args) : NULL;
    if (args.kind == TV_LIST && tv_l(args)->tuple) {
        items = tv_l(args)->items;
        nitems = tv_l(args)->n;
    }
    strbuf b;
    tmpl_sb_init(&b);
    const char *s = fmt->s;
    size_t len = fmt->len;
    bool ok = true;
    for (size_t i = 0; ok && i < len;) {
        if (s[i] != '%') {
            const char *pc = memchr(s + i, '%', len - i);
            size_t e = pc ? (size_t)(pc - s) : len;
            ok = tmpl_sb_put(R, &b, s + i, e - i);
            i = e;
            continue;
        }
        i++;
        tv v = tv_none();
        bool have = false;
        if (i < len && s[i] == '(') {
            const char *close = memchr(s + i, ')', len - i);
            if (!map || !close) {
                ok = tmpl_fail(R, map ? "incomplete format key" : "format requires a mapping");
                break;
            }
            tv key;
            size_t kstart = i + 1, kend = (size_t)(close - s);
            if (!(ok = tmpl_str_val(R, s + kstart, kend - kstart, &key)))
                break;
            have = tmpl_dict_get(map, key, &v);
            if (!have)
                ok = tmpl_fail(R, "format key '%s' not found", tv_s(key)->s);
            tv_release(key);
            i = kend + 1;
            if (!ok)
                break;
        }
        char flags[8] = {0};
        size_t nf = 0;
        while (i < len && strchr("-+ #0", s[i]) && s[i]) {
            if (nf < sizeof flags - 1 && !strchr(flags, s[i]))
                flags[nf++] = s[i];
            i++;
        }
        int64_t width = 0, prec = -1;
        for (int part = 0; part < 2 && ok; part++) {
            if (part == 1) {
                if (i >= len || s[i] != '.')
                    break;
                i++;
                prec = 0;
            }
            int64_t *dst = part ? &prec : &width;
            if (i < len && s[i] == '*') {
                i++;
                if (next >= nitems || map)
                    ok = tmpl_fail(R, "not enough arguments for format string");
                else
                    ok = want_int(R, "* width", items[next++], dst);
            } else {
                while (i < len && s[i] >= '0' && s[i] <= '9' && *dst < 100000)
                    *dst = *dst * 10 + (s[i++] - '0');
            }
        }
        if (!ok)
            break;
        if (width < 0) {
            width = -width;
            if (nf < sizeof flags - 1 && !strchr(flags, '-'))
                flags[nf++] = '-';
        }
        if (width > 100000 || prec > 100000) {
            ok = tmpl_fail(R, "format width or precision too large");
            break;
        }
        while (i < len && (s[i] == 'h' || s[i] == 'l' || s[i] == 'L'))
            i++;
        if (i >= len) {
            ok = tmpl_fail(R, "incomplete format");
            break;
        }
        char conv = s[i++];
        if (conv == '%') {
            ok = tmpl_sb_putc(R, &b, '%');
            continue;
        }
        if (!have) {
            if (next >= nitems) {
                ok = tmpl_fail(R, "not enough arguments for format string");
                break;
            }
            v = items[next++];
        }
        ok = fmt_one(R, &b, v, conv, flags, width, prec);
    }
    if (ok && !map && next < nitems)
        ok = tmpl_fail(R, "not all arguments converted during string formatting");
    if (!ok) {
        tmpl_sb_drop(&b);
        return false;
    }
    *out = tmpl_sb_finish(R, &b);
    return !R->failed;
}

/* str.format() with automatic or explicit field numbers and keyword fields; format specs
 * and conversions (`{:>10}`, `{!r}`) are refused rather than misrendered. */
static bool str_format(jrun *R, const tv_str *f, argv_ *a, tv *out)
{
    strbuf b;
    tmpl_sb_init(&b);
    size_t auto_idx = 0;
    bool ok = true;
    for (size_t i = 0; ok && i < f->len;) {
        char c = f->s[i];
        if ((c == '{' || c == '}') && i + 1 < f->len && f->s[i + 1] == c) {
            ok = tmpl_sb_putc(R, &b, c);
            i += 2;
            continue;
        }
        if (c == '}') {
            ok = tmpl_fail(R, "single '}' encountered in format string");
            break;
        }
        if (c != '{') {
            ok = tmpl_sb_putc(R, &b, c);
            i++;
            continue;
        }
        const char *close = memchr(f->s + i, '}', f->len - i);
        if (!close) {
            ok = tmpl_fail(R, "single '{' encountered in format string");
            break;
        }
        size_t fs = i + 1, fe = (size_t)(close - f->s);
        i = fe + 1;
        tv v;
        if (memchr(f->s + fs, ':', fe - fs) || memchr(f->s + fs, '!', fe - fs) || memchr(f->s + fs, '.', fe - fs) ||
            memchr(f->s + fs, '[', fe - fs)) {
            ok = tmpl_fail(R, "format fields with specs, conversions or lookups are not supported");
            break;
        }
        if (fs == fe || (f->s[fs] >= '0' && f->s[fs] <= '9')) {
            size_t idx = auto_idx++;
            if (fs != fe) {
                idx = 0;
                for (size_t k = fs; k < fe && idx < 1000000; k++)
                    idx = idx * 10 + (size_t)(f->s[k] - '0');
            }
            if (idx >= a->npos) {
                ok = tmpl_fail(R, "Replacement index %zu out of range for positional args tuple", idx);
                break;
            }
            v = a->pos[idx];
        } else {
            size_t k = 0;
            while (k < a->nkw && (strlen(a->kw[k]) != fe - fs || memcmp(a->kw[k], f->s + fs, fe - fs)))
                k++;
            if (k == a->nkw) {
                ok = tmpl_fail(R, "format field '%.*s' not given", (int)(fe - fs), f->s + fs);
                break;
            }
            v = a->kwv[k];
        }
        ok = tv_write_str(R, &b, v);
    }
    if (!ok) {
        tmpl_sb_drop(&b);
        return false;
    }
    *out = tmpl_sb_finish(R, &b);
    return !R->failed;
}

/* ---- filters ---- */

static bool join(jrun *R, tv seq, const tv_str *sep, tv attribute, tv *out)
{
    tv_list *items;
    if (!tmpl_iterate(R, seq, &items))
        return false;
    strbuf b;
    tmpl_sb_init(&b);
    bool ok = true;
    for (size_t i = 0; ok && i < items->n; i++) {
        tv v = items->items[i], picked;
        if (i && sep)
            ok = tmpl_sb_put(R, &b, sep->s, sep->len);
        if (ok && given(attribute)) {
            ok = attr_path(R, v, attribute, &picked) && tv_write_str(R, &b, picked);
            if (ok)
                tv_release(picked);
        } else if (ok) {
            ok = tv_write_str(R, &b, v);
        }
    }
    tv_release(list_val(items));
    if (!ok) {
        tmpl_sb_drop(&b);
        return false;
    }
    *out = tmpl_sb_finish(R, &b);
    return !R->failed;
}

/* select/reject/selectattr/rejectattr: args hold the attribute (for *attr), then the test
 * name and its arguments; without a test the item's truth decides. */
static bool select_items(jrun *R, const char *fn, tv seq, argv_ *a, bool by_attr, bool keep_when, tv *out)
{
    size_t first = by_attr ? 1 : 0;
    if (a->nkw)
        return tmpl_fail(R, "%s() takes no keyword arguments", fn);
    if (by_attr && a->npos < 1)
        return tmpl_fail(R, "%s() needs an attribute name", fn);
    int test = -1;
    const char *test_name = NULL;
    if (a->npos > first) {
        if (!want_str(R, "test name", a->pos[first]))
            return false;
        test_name = tv_s(a->pos[first])->s;
        if ((test = tmpl_test_id(test_name)) < 0)
            return tmpl_fail(R, "no test named '%s'", test_name);
    }
    argv_ targs = {a->npos > first + 1 ? a->pos + first + 1 : NULL, a->npos > first ? a->npos - first - 1 : 0, NULL,
                   NULL, 0};
    tv_list *items, *kept;
    if (!tmpl_iterate(R, seq, &items))
        return false;
    bool ok = (kept = tmpl_list_new(R, 0, false)) != NULL;
    for (size_t i = 0; ok && i < items->n; i++) {
        tv v = items->items[i], subject = v;
        bool pass;
        if (by_attr && !(ok = attr_path(R, v, a->pos[0], &subject)))
            break;
        if (test >= 0)
            ok = tmpl_apply_test(R, test, test_name, subject, &targs, &pass);
        else
            pass = tv_truthy(subject);
        if (by_attr)
            tv_release(subject);
        if (ok && pass == keep_when)
            ok = tmpl_list_push(R, kept, tv_retain(v));
    }
    tv_release(list_val(items));
    if (!ok) {
        if (kept)
            tv_release(list_val(kept));
        return false;
    }
    *out = list_val(kept);
    return true;
}

static bool map_items(jrun *R, tv seq, argv_ *a, tv *out)
{
    tv attribute = tv_undef(UNDEF_NAME, NULL, 0), deflt = tv_undef(UNDEF_NAME, NULL, 0);
    int filter = -1;
    const char *fname = NULL;
    argv_ fargs = {0};
    if (a->npos) {
        if (!want_str(R, "filter name", a->pos[0]))
            return false;
        fname = tv_s(a->pos[0])->s;
        if ((filter = tmpl_filter_id(fname)) < 0)
            return tmpl_fail(R, "no filter named '%s'", fname);
        fargs = (argv_){a->pos + 1, a->npos - 1, a->kw, a->kwv, a->nkw};
    } else {
        for (size_t k = 0; k < a->nkw; k++) {
            if (!strcmp(a->kw[k], "attribute"))
                attribute = a->kwv[k];
            else if (!strcmp(a->kw[k], "default"))
                deflt = a->kwv[k];
            else
                return tmpl_fail(R, "map() got an unexpected keyword argument '%s'", a->kw[k]);
        }
        if (!given(attribute))
            return tmpl_fail(R, "map() needs a filter name or attribute=");
    }
    tv_list *items, *res;
    if (!tmpl_iterate(R, seq, &items))
        return false;
    bool ok = (res = tmpl_list_new(R, items->n, false)) != NULL;
    for (size_t i = 0; ok && i < items->n; i++) {
        tv v;
        if (filter >= 0) {
            ok = tmpl_apply_filter(R, filter, fname, items->items[i], &fargs, &v);
        } else {
            ok = attr_path(R, items->items[i], attribute, &v);
            if (ok && v.kind == TV_UNDEF && given(deflt))
                v = tv_retain(deflt);
        }
        ok = ok && tmpl_list_push(R, res, v);
    }
    tv_release(list_val(items));
    if (!ok) {
        if (res)
            tv_release(list_val(res));
        return false;
    }
    *out = list_val(res);
    return true;
}

static bool tojson(jrun *R, tv v, argv_ *a, tv *out)
{
    static const char *const names[] = {"ensure_ascii", "indent", "separators", "sort_keys"};
    tv p[4];
    if (!bind(R, "tojson", a, names, 4, p))
        return false;
    json_opts o = {NULL, ", ", ": ", given(p[3]) && tv_truthy(p[3]), given(p[0]) && tv_truthy(p[0])};
    char indent[1025];
    if (given(p[1]) && p[1].kind != TV_NONE) {
        if (tv_is_int(p[1])) {
            int64_t n = tv_intval(p[1]);
            if (n > 1024)
                return tmpl_fail(R, "tojson indent larger than 1024");
            n = n < 0 ? 0 : n;
            memset(indent, ' ', (size_t)n);
            indent[n] = 0;
            o.indent = indent;
        } else if (p[1].kind == TV_STR) {
            o.indent = tv_s(p[1])->s;
        } else {
            return tmpl_fail(R, "tojson indent must be an integer or a string");
        }
        o.item_sep = ",";
    }
    if (given(p[2]) && p[2].kind != TV_NONE) {
        tv_list *l = p[2].kind == TV_LIST ? tv_l(p[2]) : NULL;
        if (!l || l->n != 2 || l->items[0].kind != TV_STR || l->items[1].kind != TV_STR)
            return tmpl_fail(R, "tojson separators must be a pair of strings");
        o.item_sep = tv_s(l->items[0])->s;
        o.key_sep = tv_s(l->items[1])->s;
    }
    strbuf b;
    tmpl_sb_init(&b);
    if (!tv_write_json(R, &b, v, &o, 0)) {
        tmpl_sb_drop(&b);
        return false;
    }
    *out = tmpl_sb_finish(R, &b);
    return !R->failed;
}

static bool indent(jrun *R, const tv_str *s, tv width, bool first, bool blank, tv *out)
{
    strbuf pad, b;
    tmpl_sb_init(&pad);
    tmpl_sb_init(&b);
    tv_list *lines = NULL;
    bool ok;
    if (!given(width))
        ok = spaces(R, 4, &pad);
    else if (width.kind == TV_STR)
        ok = tmpl_sb_put(R, &pad, tv_s(width)->s, tv_s(width)->len);
    else if (tv_is_int(width))
        ok = spaces(R, tv_intval(width), &pad);
    else
        ok = tmpl_fail(R, "indent width must be an integer or a string");
    const char *ind = pad.s ? pad.s->s : "";
    size_t nind = tmpl_sb_len(&pad);
    /* Jinja appends a newline before splitting so that a trailing newline survives */
    tv_str *text = ok ? tmpl_str_alloc(R, s->len + 1) : NULL;
    if (text) {
        memcpy(text->s, s->s, s->len);
        text->s[s->len] = '\n';
        text->s[s->len + 1] = 0;
        ok = splitlines(R, text, false, &lines);
        tv_release(tv_obj_val(TV_STR, text));
    } else {
        ok = false;
    }
    for (size_t i = 0; ok && i < lines->n; i++) {
        tv_str *line = tv_s(lines->items[i]);
        if (i)
            ok = tmpl_sb_putc(R, &b, '\n');
        if (ok && (i ? (blank || line->len) : first))
            ok = tmpl_sb_put(R, &b, ind, nind);
        ok = ok && tmpl_sb_put(R, &b, line->s, line->len);
    }
    if (lines)
        tv_release(list_val(lines));
    tmpl_sb_drop(&pad);
    if (!ok) {
        tmpl_sb_drop(&b);
        return false;
    }
    *out = tmpl_sb_finish(R, &b);
    return !R->failed;
}

static bool round_value(jrun *R, tv v, tv precision, tv method, tv *out)
{
    int64_t p = 0;
    if (given(precision) && !want_int(R, "round precision", precision, &p))
        return false;
    const char *m = "common";
    if (given(method)) {
        if (!want_str(R, "round method", method))
            return false;
        m = tv_s(method)->s;
    }
    if (strcmp(m, "common") && strcmp(m, "ceil") && strcmp(m, "floor"))
        return tmpl_fail(R, "method must be common, ceil or floor");
    if (!tv_is_num(v))
        return tmpl_fail(R, "type %s doesn't define __round__ method", tv_type_name(v));
    if (!strcmp(m, "common") && tv_is_int(v)) {
        /* Python's round(int, n) keeps an int */
        *out = tv_int(tv_intval(v));
        return true;
    }
    double x = tv_num(v), r;
    if (p > 300 || p < -300) {
        r = p > 0 ? x : 0.0 * x;
    } else if (strcmp(m, "common")) {
        double scale = pow(10.0, (double)p);
        r = (!strcmp(m, "ceil") ? ceil(x * scale) : floor(x * scale)) / scale;
    } else if (p >= 0) {
        /* printf rounds the exact binary value half-to-even, as Python's round() does */
        char buf[512];
        snprintf(buf, sizeof buf, "%.*f", (int)p, x);
        r = strtod(buf, NULL);
    } else {
        double scale = pow(10.0, (double)-p);
        r = nearbyint(x / scale) * scale;
    }
    *out = tv_float(r);
    return true;
}

static bool minmax(jrun *R, tv seq, argv_ *a, bool want_max, tv *out)
{
    static const char *const names[] = {"case_sensitive", "attribute"};
    tv p[2];
    tv_list *items;
    if (!bind(R, want_max ? "max" : "min", a, names, 2, p) || !tmpl_iterate(R, seq, &items))
        return false;
    if (!items->n) {
        tv_release(list_val(items));
        *out = tv_undef(UNDEF_EMPTY, "aggregated", 0);
        return true;
    }
    tv *keys;
    bool ok = make_keys(R, items, p[1], given(p[0]) && tv_truthy(p[0]), &keys);
    if (!ok) {
        tv_release(list_val(items));
        return false;
    }
    size_t best = 0;
    for (size_t i = 1; ok && i < items->n; i++) {
        int c;
        ok = tv_compare(R, keys[i], keys[best], &c);
        if (ok && (want_max ? c > 0 : c < 0))
            best = i;
    }
    if (ok)
        *out = tv_retain(items->items[best]);
    free_keys(R, keys, items->n);
    tv_release(list_val(items));
    return ok;
}

static bool unique(jrun *R, tv seq, argv_ *a, tv *out)
{
    static const char *const names[] = {"case_sensitive", "attribute"};
    tv p[2];
    tv_list *items, *res = NULL;
    if (!bind(R, "unique", a, names, 2, p) || !tmpl_iterate(R, seq, &items))
        return false;
    tv *keys;
    bool ok = make_keys(R, items, p[1], given(p[0]) && tv_truthy(p[0]), &keys);
    if (!ok) {
        tv_release(list_val(items));
        return false;
    }
    ok = (res = tmpl_list_new(R, 0, false)) != NULL;
    for (size_t i = 0; ok && i < items->n; i++) {
        bool dup = false;
        if (!tv_hashable(keys[i])) {
            ok = tmpl_fail(R, "unhashable type: '%s'", tv_type_name(keys[i]));
            break;
        }
        for (size_t k = 0; ok && !dup && k < i; k++)
            ok = tv_equal(R, keys[k], keys[i], 0, &dup);
        if (ok && !dup)
            ok = tmpl_list_push(R, res, tv_retain(items->items[i]));
    }
    free_keys(R, keys, items->n);
    tv_release(list_val(items));
    if (!ok) {
        if (res)
            tv_release(list_val(res));
        return false;
    }
    *out = list_val(res);
    return true;
}

static bool dictsort(jrun *R, tv v, argv_ *a, tv *out)
{
    static const char *const names[] = {"case_sensitive", "by", "reverse"};
    tv p[3];
    if (!bind(R, "dictsort", a, names, 3, p))
        return false;
    if (v.kind != TV_DICT)
        return tmpl_fail(R, "dictsort needs a mapping, not '%s'", tv_type_name(v));
    bool by_value = false;
    if (given(p[1])) {
        if (!want_str(R, "by", p[1]))
            return false;
        if (!strcmp(tv_s(p[1])->s, "value"))
            by_value = true;
        else if (strcmp(tv_s(p[1])->s, "key"))
            return tmpl_fail(R, "You can only sort by either \"key\" or \"value\"");
    }
    tv_dict *d = tv_d(v);
    tv_list *pairs = tmpl_list_new(R, d->n, false), *res;
    for (size_t i = 0; pairs && i < d->n; i++) {
        tv_list *pair = tmpl_list_new(R, 2, true);
        if (!pair || !tmpl_list_push(R, pair, tv_retain(d->keys[i])) || !tmpl_list_push(R, pair, tv_retain(d->vals[i])) ||
            !tmpl_list_push(R, pairs, list_val(pair))) {
            if (pair && pairs->n <= i)
                tv_release(list_val(pair));
            tv_release(list_val(pairs));
            return false;
        }
    }
    if (!pairs)
        return false;
    tv attr = tv_int(by_value ? 1 : 0);
    bool ok = sorted(R, pairs, attr, given(p[0]) && tv_truthy(p[0]), given(p[2]) && tv_truthy(p[2]), &res);
    tv_release(list_val(pairs));
    return ok && list_out(res, out);
}

static bool batch(jrun *R, tv seq, argv_ *a, tv *out)
{
    static const char *const names[] = {"linecount", "fill_with"};
    tv p[2];
    int64_t n = 0;
    tv_list *items, *res, *row = NULL;
    if (!bind(R, "batch", a, names, 2, p) || !want_int(R, "linecount", p[0], &n))
        return false;
    if (n <= 0)
        return tmpl_fail(R, "batch linecount must be positive");
    if (!tmpl_iterate(R, seq, &items))
        return false;
    bool ok = (res = tmpl_list_new(R, 0, false)) != NULL;
    for (size_t i = 0; ok && i < items->n; i++) {
        if (!row && !(ok = (row = tmpl_list_new(R, 0, false)) != NULL))
            break;
        ok = tmpl_list_push(R, row, tv_retain(items->items[i]));
        if (ok && (int64_t)row->n == n) {
            ok = tmpl_list_push(R, res, list_val(row));
            row = NULL;
        }
    }
    if (ok && row) {
        while (ok && given(p[1]) && (int64_t)row->n < n)
            ok = tmpl_list_push(R, row, tv_retain(p[1]));
        ok = ok && tmpl_list_push(R, res, list_val(row));
        row = NULL;
    }
    if (row)
        tv_release(list_val(row));
    tv_release(list_val(items));
    if (!ok) {
        if (res)
            tv_release(list_val(res));
        return false;
    }
    *out = list_val(res);
    return true;
}

static bool no_args(jrun *R, const char *name, argv_ *a)
{
    return (!a->npos && !a->nkw) || tmpl_fail(R, "%s() takes no arguments", name);
}

/* Filters on a string view of the value: Jinja applies str() first. */
static bool string_filter(jrun *R, int id, const char *name, tv v, argv_ *a, tv *out)
{
    tv s, p[3];
    if (!tv_to_str(R, v, &s))
        return false;
    tv_str *str = tv_s(s);
    bool ok = false;
    switch (id) {
    case F_UPPER:
    case F_LOWER:
    case F_CAPITALIZE:
    case F_TITLE:
        ok = no_args(R, name, a) && change_case(R, str,
                                                id == F_UPPER   ? CASE_UPPER
                                                : id == F_LOWER ? CASE_LOWER
                                                : id == F_TITLE ? CASE_WORDS
                                                                : CASE_CAPITALIZE,
                                                out);
        break;
    case F_TRIM: {
        static const char *const names[] = {"chars"};
        ok = bind(R, name, a, names, 1, p);
        if (ok && given(p[0]) && p[0].kind != TV_NONE && !want_str(R, "chars", p[0]))
            ok = false;
        ok = ok && strip(R, str, given(p[0]) && p[0].kind == TV_STR ? tv_s(p[0]) : NULL, true, true, out);
        break;
    }
    case F_REPLACE: {
        static const char *const names[] = {"old", "new", "count"};
        int64_t count = -1;
        tv old, with;
        ok = bind(R, name, a, names, 3, p) && (!given(p[2]) || p[2].kind == TV_NONE || want_int(R, "count", p[2], &count));
        if (ok && (!given(p[0]) || !given(p[1])))
            ok = tmpl_fail(R, "replace() needs old and new strings");
        if (ok && tv_to_str(R, p[0], &old)) {
            if (tv_to_str(R, p[1], &with)) {
                ok = replace(R, str, tv_s(old), tv_s(with), count, out);
                tv_release(with);
            } else {
                ok = false;
            }
            tv_release(old);
        } else {
            ok = false;
        }
        break;
    }
    case F_CENTER: {
        static const char *const names[] = {"width"};
        int64_t width = 80;
        ok = bind(R, name, a, names, 1, p) && (!given(p[0]) || want_int(R, "width", p[0], &width));
        if (ok) {
            strbuf b;
            tmpl_sb_init(&b);
            int64_t marg = width - (int64_t)tmpl_str_ncp(R, str);
            int64_t left = marg > 0 ? marg / 2 + (marg & width & 1) : 0;
            ok = spaces(R, left, &b) && tmpl_sb_put(R, &b, str->s, str->len) && spaces(R, marg - left, &b);
            if (ok)
                *out = tmpl_sb_finish(R, &b);
            else
                tmpl_sb_drop(&b);
            ok = ok && !R->failed;
        }
        break;
    }
    case F_INDENT: {
        static const char *const names[] = {"width", "first", "blank"};
        ok = bind(R, name, a, names, 3, p) &&
             indent(R, str, p[0], given(p[1]) && tv_truthy(p[1]), given(p[2]) && tv_truthy(p[2]), out);
        break;
    }
    case F_ESCAPE: {
        strbuf b;
        tmpl_sb_init(&b);
        ok = no_args(R, name, a);
        for (size_t i = 0; ok && i < str->len; i++) {
            char c = str->s[i];
            const char *rep = c == '&' ? "&amp;" : c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '"' ? "&#34;"
                              : c == '\'' ? "&#39;" : NULL;
            ok = rep ? tmpl_sb_put(R, &b, rep, strlen(rep)) : tmpl_sb_putc(R, &b, c);
        }
        if (ok)
            *out = tmpl_sb_finish(R, &b);
        else
            tmpl_sb_drop(&b);
        ok = ok && !R->failed;
        break;
    }
    case F_WORDCOUNT: {
        int64_t n = 0;
        bool in_word = false;
        ok = no_args(R, name, a) && tmpl_charge(R, TMPL_SCAN_COST(str->len));
        for (size_t i = 0; ok && i < str->len;) {
            uint32_t cp;
            i += blade_utf8_decode(str->s + i, str->len - i, &cp);
            bool w = cp == '_' || (cp >= '0' && cp <= '9') || tmpl_uni_cased(cp) || (cp >= 0x80 && !tmpl_py_isspace(cp) &&
                                                                                 !(cp >= 0x2000 && cp <= 0x206F) &&
                                                                                 !(cp >= 0x3000 && cp <= 0x303F));
            n += w && !in_word;
            in_word = w;
        }
        if (ok)
            *out = tv_int(n);
        break;
    }
    case F_FORMAT: {
        if (a->npos && a->nkw) {
            ok = tmpl_fail(R, "can't handle positional and keyword arguments at the same time");
            break;
        }
        tv args;
        if (a->nkw) {
            tv_dict *d = tmpl_dict_new(R);
            ok = d != NULL;
            for (size_t k = 0; ok && k < a->nkw; k++) {
                tv key;
                ok = tmpl_str_cstr(R, a->kw[k], &key) && tmpl_dict_set(R, d, key, tv_retain(a->kwv[k]));
            }
            if (!ok) {
                if (d)
                    tv_release(tv_obj_val(TV_DICT, d));
                break;
            }
            args = tv_obj_val(TV_DICT, d);
        } else {
            tv_list *l = tmpl_list_new(R, a->npos, true);
            ok = l != NULL;
            for (size_t i = 0; ok && i < a->npos; i++)
                ok = tmpl_list_push(R, l, tv_retain(a->pos[i]));
            if (!ok) {
                if (l)
                    tv_release(list_val(l));
                break;
            }
            args = list_val(l);
        }
        ok = tmpl_percent_format(R, str, args, out);
        tv_release(args);
        break;
    }
    default: ok = tmpl_fail(R, "no filter named '%s'", name); break;
    }
    tv_release(s);
    return ok;
}

bool tmpl_apply_filter(jrun *R, int id, const char *name, tv v, argv_ *a, tv *out)
{
    tv p[4];
    tv_list *items, *res;
    switch (id) {
    case F_SAFE:
    case F_STRING: return no_args(R, name, a) && tv_to_str(R, v, out);
    case F_DEFAULT: {
        static const char *const names[] = {"default_value", "boolean"};
        if (!bind(R, name, a, names, 2, p))
            return false;
        bool use_default = v.kind == TV_UNDEF || (given(p[1]) && tv_truthy(p[1]) && !tv_truthy(v));
        if (!use_default)
            *out = tv_retain(v);
        else if (given(p[0]))
            *out = tv_retain(p[0]);
        else
            return tmpl_str_val(R, "", 0, out);
        return true;
    }
    case F_LENGTH:
        if (!no_args(R, name, a))
            return false;
        switch (v.kind) {
        case TV_UNDEF: *out = tv_int(0); return true;
        case TV_STR: *out = tv_int((int64_t)tmpl_str_ncp(R, tv_s(v))); return true;
        case TV_LIST: *out = tv_int((int64_t)tv_l(v)->n); return true;
        case TV_DICT: *out = tv_int((int64_t)tv_d(v)->n); return true;
        default: return tmpl_fail(R, "object of type '%s' has no len()", tv_type_name(v));
        }
    case F_LIST:
        if (!no_args(R, name, a) || !tmpl_iterate(R, v, &items))
            return false;
        if (!items->tuple)
            return list_out(items, out);
        res = tmpl_list_new(R, items->n, false);
        for (size_t i = 0; res && i < items->n; i++)
            if (!tmpl_list_push(R, res, tv_retain(items->items[i]))) {
                tv_release(list_val(res));
                res = NULL;
            }
        tv_release(list_val(items));
        return list_out(res, out);
    case F_FIRST:
    case F_LAST:
        if (!no_args(R, name, a) || !tmpl_iterate(R, v, &items))
            return false;
        if (items->n)
            *out = tv_retain(items->items[id == F_FIRST ? 0 : items->n - 1]);
        else
            *out = tv_undef(UNDEF_EMPTY, id == F_FIRST ? "first" : "last", 0);
        tv_release(list_val(items));
        return true;
    case F_ITEMS:
        if (!no_args(R, name, a))
            return false;
        if (v.kind == TV_UNDEF)
            return list_out(tmpl_list_new(R, 0, false), out);
        if (v.kind != TV_DICT)
            return tmpl_fail(R, "Can only get item pairs from a mapping.");
        return tmpl_call_method(R, v, "items", a, out, &(bool){false});
    case F_JOIN: {
        static const char *const names[] = {"d", "attribute"};
        tv sep;
        if (!bind(R, name, a, names, 2, p))
            return false;
        if (!given(p[0]))
            return join(R, v, NULL, p[1], out);
        if (!tv_to_str(R, p[0], &sep))
            return false;
        bool ok = join(R, v, tv_s(sep), p[1], out);
        tv_release(sep);
        return ok;
    }
    case F_INT: {
        static const char *const names[] = {"default", "base"};
        int64_t base = 10, n;
        double f;
        if (!bind(R, name, a, names, 2, p) || (given(p[1]) && !want_int(R, "base", p[1], &base)))
            return false;
        if (base != 0 && (base < 2 || base > 36))
            return tmpl_fail(R, "int() base must be >= 2 and <= 36, or 0");
        if (v.kind == TV_UNDEF)
            return tmpl_undef_error(R, v);
        if (tv_is_int(v)) {
            *out = tv_int(tv_intval(v));
        } else if (v.kind == TV_FLOAT && isfinite(v.u.f) && fabs(v.u.f) < 9.2e18) {
            *out = tv_int((int64_t)v.u.f);
        } else if (v.kind == TV_STR && parse_py_int(R, tv_s(v), (int)base, &n)) {
            *out = tv_int(n);
        } else if (v.kind == TV_STR && parse_py_float(R, tv_s(v), &f) && isfinite(f) && fabs(f) < 9.2e18) {
            *out = tv_int((int64_t)f);
        } else {
            *out = given(p[0]) ? tv_retain(p[0]) : tv_int(0);
        }
        return true;
    }
    case F_FLOAT: {
        static const char *const names[] = {"default"};
        double f;
        if (!bind(R, name, a, names, 1, p))
            return false;
        if (v.kind == TV_UNDEF)
            return tmpl_undef_error(R, v);
        if (tv_is_num(v))
            *out = tv_float(tv_num(v));
        else if (v.kind == TV_STR && parse_py_float(R, tv_s(v), &f))
            *out = tv_float(f);
        else
            *out = given(p[0]) ? tv_retain(p[0]) : tv_float(0.0);
        return true;
    }
    case F_ABS:
        if (!no_args(R, name, a))
            return false;
        if (v.kind == TV_FLOAT) {
            *out = tv_float(fabs(v.u.f));
            return true;
        }
        if (!tv_is_int(v))
            return tmpl_fail(R, "bad operand type for abs(): '%s'", tv_type_name(v));
        if (tv_intval(v) == INT64_MIN)
            return tmpl_fail(R, "integer overflow in abs()");
        *out = tv_int(tv_intval(v) < 0 ? -tv_intval(v) : tv_intval(v));
        return true;
    case F_ATTR: {
        static const char *const names[] = {"name"};
        if (!bind(R, name, a, names, 1, p) || !want_str(R, "attribute name", p[0]))
            return false;
        if (v.kind == TV_NS || v.kind == TV_LOOP)
            return tmpl_getitem(R, v, p[0], out);
        if (v.kind == TV_UNDEF)
            return tmpl_undef_error(R, v);
        *out = tv_undef(UNDEF_ITEM, NULL, v.kind);
        return true;
    }
    case F_ROUND: {
        static const char *const names[] = {"precision", "method"};
        return bind(R, name, a, names, 2, p) && round_value(R, v, p[0], p[1], out);
    }
    case F_REVERSE:
        if (!no_args(R, name, a))
            return false;
        if (v.kind == TV_STR) {
            if (!tmpl_iterate(R, v, &items))
                return false;
            strbuf b;
            tmpl_sb_init(&b);
            bool ok = true;
            for (size_t i = items->n; ok && i-- > 0;)
                ok = tmpl_sb_put(R, &b, tv_s(items->items[i])->s, tv_s(items->items[i])->len);
            tv_release(list_val(items));
            if (!ok) {
                tmpl_sb_drop(&b);
                return false;
            }
            *out = tmpl_sb_finish(R, &b);
            return !R->failed;
        }
        if (!tmpl_iterate(R, v, &items))
            return false;
        res = tmpl_list_new(R, items->n, false);
        for (size_t i = items->n; res && i-- > 0;)
            if (!tmpl_list_push(R, res, tv_retain(items->items[i]))) {
                tv_release(list_val(res));
                res = NULL;
            }
        tv_release(list_val(items));
        return list_out(res, out);
    case F_SORT: {
        static const char *const names[] = {"reverse", "case_sensitive", "attribute"};
        if (!bind(R, name, a, names, 3, p) || !tmpl_iterate(R, v, &items))
            return false;
        bool ok = sorted(R, items, p[2], given(p[1]) && tv_truthy(p[1]), given(p[0]) && tv_truthy(p[0]), &res);
        tv_release(list_val(items));
        return ok && list_out(res, out);
    }
    case F_DICTSORT: return dictsort(R, v, a, out);
    case F_UNIQUE: return unique(R, v, a, out);
    case F_MIN:
    case F_MAX: return minmax(R, v, a, id == F_MAX, out);
    case F_SUM: {
        static const char *const names[] = {"attribute", "start"};
        if (!bind(R, name, a, names, 2, p) || !tmpl_iterate(R, v, &items))
            return false;
        tv total = given(p[1]) ? p[1] : tv_int(0);
        bool ok = tv_is_num(total) || tmpl_fail(R, "sum() start must be a number");
        bool is_float = total.kind == TV_FLOAT;
        int64_t isum = is_float ? 0 : tv_intval(total);
        double fsum = tv_num(total);
        for (size_t i = 0; ok && i < items->n; i++) {
            tv x = items->items[i], picked = x;
            if (given(p[0]) && !(ok = attr_path(R, x, p[0], &picked)))
                break;
            if (picked.kind == TV_UNDEF)
                ok = tmpl_undef_error(R, picked);
            else if (!tv_is_num(picked))
                ok = tmpl_fail(R, "unsupported operand type(s) for +: 'int' and '%s'", tv_type_name(picked));
            else if (picked.kind == TV_FLOAT || is_float) {
                if (!is_float)
                    fsum = (double)isum;
                is_float = true;
                fsum += tv_num(picked);
            } else if (__builtin_add_overflow(isum, tv_intval(picked), &isum)) {
                ok = tmpl_fail(R, "integer overflow in sum()");
            }
            if (given(p[0]))
                tv_release(picked);
        }
        tv_release(list_val(items));
        if (ok)
            *out = is_float ? tv_float(fsum) : tv_int(isum);
        return ok;
    }
    case F_MAP: return map_items(R, v, a, out);
    case F_SELECT:
    case F_REJECT: return select_items(R, name, v, a, false, id == F_SELECT, out);
    case F_SELECTATTR:
    case F_REJECTATTR: return select_items(R, name, v, a, true, id == F_SELECTATTR, out);
    case F_TOJSON: return tojson(R, v, a, out);
    case F_INDENT:
        /* Jinja appends "\n" to the value itself before splitting, so only text works */
        if (v.kind == TV_UNDEF)
            return tmpl_undef_error(R, v);
        if (v.kind != TV_STR)
            return tmpl_fail(R, "unsupported operand type(s) for +=: '%s' and 'str'", tv_type_name(v));
        return string_filter(R, id, name, v, a, out);
    case F_BATCH: return batch(R, v, a, out);
    default: return string_filter(R, id, name, v, a, out);
    }
}

/* ---- globals ---- */

static bool make_mapping(jrun *R, const char *fn, argv_ *a, tv_dict *d)
{
    if (a->npos > 1)
        return tmpl_fail(R, "%s() takes at most one positional argument", fn);
    if (a->npos) {
        tv src = a->pos[0];
        if (src.kind != TV_DICT)
            return tmpl_fail(R, "%s() positional argument must be a mapping", fn);
        for (size_t i = 0; i < tv_d(src)->n; i++)
            if (!tmpl_dict_set(R, d, tv_retain(tv_d(src)->keys[i]), tv_retain(tv_d(src)->vals[i])))
                return false;
    }
    for (size_t k = 0; k < a->nkw; k++) {
        tv key;
        if (!tmpl_str_cstr(R, a->kw[k], &key) || !tmpl_dict_set(R, d, key, tv_retain(a->kwv[k])))
            return false;
    }
    return true;
}

static bool range(jrun *R, argv_ *a, tv *out)
{
    int64_t v[3] = {0, 0, 1};
    if (a->nkw || a->npos < 1 || a->npos > 3)
        return tmpl_fail(R, "range() takes 1 to 3 integer arguments");
    for (size_t i = 0; i < a->npos; i++)
        if (!want_int(R, "range() argument", a->pos[i], &v[i + (a->npos == 1)]))
            return false;
    int64_t start = v[0], stop = v[1], step = v[2];
    if (step == 0)
        return tmpl_fail(R, "range() arg 3 must not be zero");
    /* computed in floating point: the int64 difference may overflow, and only the
     * comparison with the sandbox limit matters */
    double count = step > 0 ? ceil(((double)stop - (double)start) / (double)step)
                            : ceil(((double)start - (double)stop) / -(double)step);
    if (count > TMPL_MAX_RANGE)
        return tmpl_fail(R, "range too big: at most %d items are allowed", TMPL_MAX_RANGE);
    size_t n = count > 0 ? (size_t)count : 0;
    tv_list *l = tmpl_list_new(R, n, false);
    for (size_t i = 0; l && i < n; i++)
        if (!tmpl_list_push(R, l, tv_int(start + (int64_t)i * step))) {
            tv_release(list_val(l));
            l = NULL;
        }
    return list_out(l, out);
}

static bool strftime_now(jrun *R, argv_ *a, tv *out)
{
    if (a->nkw || a->npos != 1 || a->pos[0].kind != TV_STR)
        return tmpl_fail(R, "strftime_now() takes one format string");
    const tv_str *fmt = tv_s(a->pos[0]);
    if (fmt->len > 1024)
        return tmpl_fail(R, "strftime_now() format longer than 1024 bytes");
    if (memchr(fmt->s, 0, fmt->len))
        return tmpl_fail(R, "strftime_now() format contains a NUL byte");
    time_t now = R->t->now_pinned ? (time_t)R->t->now : time(NULL);
    struct tm tm;
    if (!(R->t->now_pinned ? gmtime_r(&now, &tm) : localtime_r(&now, &tm)))
        return tmpl_fail(R, "strftime_now(): the time cannot be represented");
    if (!fmt->len)
        return tmpl_str_val(R, "", 0, out);
    /* a directive expands to at most a few dozen bytes */
    size_t cap = fmt->len * 64 + 64;
    char *buf = tmpl_heap_alloc(R, cap);
    if (!buf)
        return false;
    size_t n = strftime(buf, cap, fmt->s, &tm);
    bool ok = n > 0 ? tmpl_str_val(R, buf, n, out) : tmpl_fail(R, "strftime_now(): format produced no output");
    tmpl_heap_free(&R->heap, buf, cap);
    return ok;
}

bool tmpl_call_global(jrun *R, int id, argv_ *a, tv *out)
{
    switch (id) {
    case G_RANGE: return range(R, a, out);
    case G_DICT:
    case G_NAMESPACE: {
        tv_ns *ns = id == G_NAMESPACE ? tmpl_ns_new(R) : NULL;
        tv_dict *d = ns ? ns->attrs : id == G_DICT ? tmpl_dict_new(R) : NULL;
        if (!d)
            return false;
        tv v = ns ? tv_obj_val(TV_NS, ns) : tv_obj_val(TV_DICT, d);
        if (!make_mapping(R, id == G_DICT ? "dict" : "namespace", a, d)) {
            tv_release(v);
            return false;
        }
        *out = v;
        return true;
    }
    case G_RAISE: {
        tv msg;
        if (a->npos != 1 || a->nkw)
            return tmpl_fail(R, "raise_exception() takes one message");
        if (!tv_to_str(R, a->pos[0], &msg))
            return false;
        if (!R->failed) {
            /* the template's own words, for whoever sent the conversation */
            R->failed = true;
            blade_error_set(R->err, "%s", tv_s(msg)->s);
        }
        tv_release(msg);
        return false;
    }
    case G_STRFTIME: return strftime_now(R, a, out);
    }
    return tmpl_fail(R, "unknown function");
}

/* ---- methods ---- */

static bool str_method(jrun *R, const tv_str *s, const char *name, argv_ *a, tv *out, bool *found)
{
    tv p[3];
    *found = true;
    if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip")) {
        static const char *const names[] = {"chars"};
        if (!bind(R, name, a, names, 1, p))
            return false;
        if (given(p[0]) && p[0].kind != TV_NONE && !want_str(R, "chars", p[0]))
            return false;
        return strip(R, s, p[0].kind == TV_STR ? tv_s(p[0]) : NULL, name[0] != 'r', name[0] != 'l', out);
    }
    if (!strcmp(name, "split") || !strcmp(name, "rsplit")) {
        static const char *const names[] = {"sep", "maxsplit"};
        int64_t maxsplit = -1;
        if (!bind(R, name, a, names, 2, p) || (given(p[1]) && !want_int(R, "maxsplit", p[1], &maxsplit)))
            return false;
        if (given(p[0]) && p[0].kind != TV_NONE && !want_str(R, "sep", p[0]))
            return false;
        return split(R, s, p[0].kind == TV_STR ? tv_s(p[0]) : NULL, maxsplit, name[0] == 'r', out);
    }
    if (!strcmp(name, "splitlines")) {
        static const char *const names[] = {"keepends"};
        tv_list *l;
        return bind(R, name, a, names, 1, p) && splitlines(R, s, given(p[0]) && tv_truthy(p[0]), &l) &&
               list_out(l, out);
    }
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
        static const char *const names[] = {"prefix"};
        if (!bind(R, name, a, names, 1, p))
            return false;
        bool ends = name[0] == 'e';
        const tv *cands = &p[0];
        size_t n = 1;
        if (p[0].kind == TV_LIST && tv_l(p[0])->tuple) {
            cands = tv_l(p[0])->items;
            n = tv_l(p[0])->n;
        }
        bool hit = false;
        for (size_t i = 0; i < n && !hit; i++) {
            if (!want_str(R, ends ? "endswith() argument" : "startswith() argument", cands[i]))
                return false;
            const tv_str *x = tv_s(cands[i]);
            tmpl_debit(R, 1 + x->len / 64);
            hit = x->len <= s->len && !memcmp(ends ? s->s + s->len - x->len : s->s, x->s, x->len);
        }
        *out = tv_bool(hit);
        return true;
    }
    if (!strcmp(name, "replace")) {
        static const char *const names[] = {"old", "new", "count"};
        int64_t count = -1;
        if (!bind(R, name, a, names, 3, p) || !want_str(R, "old", p[0]) || !want_str(R, "new", p[1]) ||
            (given(p[2]) && !want_int(R, "count", p[2], &count)))
            return false;
        return replace(R, s, tv_s(p[0]), tv_s(p[1]), count, out);
    }
    int mode = !strcmp(name, "upper")        ? CASE_UPPER
               : !strcmp(name, "lower")      ? CASE_LOWER
               : !strcmp(name, "title")      ? CASE_TITLE
               : !strcmp(name, "capitalize") ? CASE_CAPITALIZE
               : !strcmp(name, "swapcase")   ? CASE_SWAP
                                             : -1;
    if (mode >= 0)
        return no_args(R, name, a) && change_case(R, s, mode, out);
    if (!strcmp(name, "find") || !strcmp(name, "rfind") || !strcmp(name, "count") || !strcmp(name, "index") ||
        !strcmp(name, "rindex")) {
        static const char *const names[] = {"sub"};
        if (!bind(R, name, a, names, 1, p) || !want_str(R, "substring", p[0]) || !tmpl_charge(R, s->len / 16))
            return false;
        const tv_str *sub = tv_s(p[0]);
        if (!strcmp(name, "count")) {
            int64_t n = 0;
            if (!sub->len) {
                n = (int64_t)tmpl_str_ncp(R, (tv_str *)s) + 1;
            } else {
                for (size_t i = 0; sub->len <= s->len - i;) {
                    const char *hit = memmem(s->s + i, s->len - i, sub->s, sub->len);
                    if (!hit)
                        break;
                    n++;
                    i = (size_t)(hit - s->s) + sub->len;
                    if (i > s->len)
                        break;
                }
            }
            *out = tv_int(n);
            return true;
        }
        bool rev = name[0] == 'r';
        const char *hit = rev ? find_last(R, s->s, sub->s, sub->len, s->len)
                              : sub->len <= s->len ? memmem(s->s, s->len, sub->s, sub->len) : NULL;
        if (!sub->len)
            hit = rev ? s->s + s->len : s->s;
        if (!hit && strstr(name, "index"))
            return tmpl_fail(R, "substring not found");
        *out = tv_int(hit ? cp_index(R, s, (size_t)(hit - s->s)) : -1);
        return true;
    }
    if (!strcmp(name, "join")) {
        static const char *const names[] = {"iterable"};
        tv_list *items;
        if (!bind(R, name, a, names, 1, p) || !tmpl_iterate(R, p[0], &items))
            return false;
        bool ok = true;
        for (size_t i = 0; ok && i < items->n; i++)
            if (items->items[i].kind != TV_STR)
                ok = tmpl_fail(R, "sequence item %zu: expected str instance, %s found", i,
                               tv_type_name(items->items[i]));
        if (ok)
            ok = join(R, list_val(items), s, tv_undef(UNDEF_NAME, NULL, 0), out);
        tv_release(list_val(items));
        return ok;
    }
    if (!strcmp(name, "format"))
        return str_format(R, s, a, out);
    if (!strncmp(name, "is", 2)) {
        bool all = s->len > 0, ok = true;
        tmpl_debit(R, TMPL_SCAN_COST(s->len));
        if (!strcmp(name, "islower") || !strcmp(name, "isupper")) {
            ok = str_cased_all(R, s, name[2] == 'u', &all);
        } else if (!strcmp(name, "isdigit") || !strcmp(name, "isspace") || !strcmp(name, "isalpha") ||
                   !strcmp(name, "isalnum")) {
            for (size_t i = 0; i < s->len && all;) {
                uint32_t cp;
                i += blade_utf8_decode(s->s + i, s->len - i, &cp);
                bool digit = cp >= '0' && cp <= '9';
                bool alpha = tmpl_uni_cased(cp) || (cp >= 0x3040 && cp <= 0x30FF) || (cp >= 0x4E00 && cp <= 0x9FFF) ||
                             (cp >= 0xAC00 && cp <= 0xD7AF);
                all = name[2] == 'd' ? digit : name[2] == 's' ? tmpl_py_isspace(cp) : name[4] == 'h' ? alpha : alpha || digit;
            }
        } else {
            *found = false;
            return true;
        }
        if (!no_args(R, name, a))
            return false;
        *out = tv_bool(ok && all);
        return ok;
    }
    *found = false;
    return true;
}

bool tmpl_call_method(jrun *R, tv obj, const char *name, argv_ *a, tv *out, bool *found)
{
    *found = false;
    if (obj.kind == TV_STR)
        return str_method(R, tv_s(obj), name, a, out, found);
    if (obj.kind == TV_DICT) {
        tv_dict *d = tv_d(obj);
        bool items = !strcmp(name, "items"), keys = !strcmp(name, "keys"), values = !strcmp(name, "values");
        if (items || keys || values) {
            *found = true;
            if (!no_args(R, name, a))
                return false;
            tv_list *l = tmpl_list_new(R, d->n, false);
            for (size_t i = 0; l && i < d->n; i++) {
                tv v;
                if (items) {
                    tv_list *pair = tmpl_list_new(R, 2, true);
                    if (!pair || !tmpl_list_push(R, pair, tv_retain(d->keys[i])) ||
                        !tmpl_list_push(R, pair, tv_retain(d->vals[i]))) {
                        if (pair)
                            tv_release(list_val(pair));
                        tv_release(list_val(l));
                        return false;
                    }
                    v = list_val(pair);
                } else {
                    v = tv_retain(keys ? d->keys[i] : d->vals[i]);
                }
                if (!tmpl_list_push(R, l, v)) {
                    tv_release(list_val(l));
                    return false;
                }
            }
            return list_out(l, out);
        }
        if (!strcmp(name, "get")) {
            static const char *const names[] = {"key", "default"};
            tv p[2], v;
            *found = true;
            if (!bind(R, name, a, names, 2, p))
                return false;
            if (!tv_hashable(p[0]))
                return tmpl_fail(R, "unhashable type: '%s'", tv_type_name(p[0]));
            if (tmpl_dict_get(d, p[0], &v))
                *out = tv_retain(v);
            else
                *out = given(p[1]) ? tv_retain(p[1]) : tv_none();
            return true;
        }
        return true;
    }
    if (obj.kind == TV_LIST && (!strcmp(name, "count") || !strcmp(name, "index"))) {
        static const char *const names[] = {"value"};
        tv p[1];
        tv_list *l = tv_l(obj);
        int64_t count = 0, at = -1;
        *found = true;
        if (!bind(R, name, a, names, 1, p))
            return false;
        for (size_t i = 0; i < l->n && (name[0] == 'c' || at < 0); i++) {
            bool eq;
            if (!tv_equal(R, l->items[i], p[0], 0, &eq))
                return false;
            count += eq;
            if (eq && at < 0)
                at = (int64_t)i;
        }
        if (name[0] == 'i' && at < 0)
            return tmpl_fail(R, "value is not in list");
        *out = tv_int(name[0] == 'c' ? count : at);
        return true;
    }
    if (obj.kind == TV_LOOP && !strcmp(name, "changed")) {
        tv_loop *lp = (tv_loop *)obj.u.o;
        tv_list *now = tmpl_list_new(R, a->npos, true);
        bool same = false;
        *found = true;
        if (a->nkw)
            return tmpl_fail(R, "loop.changed() takes no keyword arguments");
        for (size_t i = 0; now && i < a->npos; i++)
            if (!tmpl_list_push(R, now, tv_retain(a->pos[i]))) {
                tv_release(list_val(now));
                now = NULL;
            }
        if (!now || !tv_equal(R, lp->changed, list_val(now), 0, &same)) {
            if (now)
                tv_release(list_val(now));
            return false;
        }
        if (same) {
            tv_release(list_val(now));
        } else {
            tv_release(lp->changed);
            lp->changed = list_val(now);
        }
        *out = tv_bool(!same);
        return true;
    }
    if (obj.kind == TV_LOOP && !strcmp(name, "cycle")) {
        *found = true;
        if (!a->npos || a->nkw)
            return tmpl_fail(R, "loop.cycle() needs at least one positional argument");
        *out = tv_retain(a->pos[((tv_loop *)obj.u.o)->i % a->npos]);
        return true;
    }
    return true;
}

/* Template values: Python's types as Jinja sees them (str, int, float, bool, None, list,
 * tuple, dict, Namespace, Undefined), with Python's equality, ordering, str() and repr()
 * and json.dumps, on a heap that charges every byte to the render's memory budget. */
#include "chat/jinja.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool tmpl_fail(jrun *R, const char *fmt, ...)
{
    if (!R->failed) {
        R->failed = true;
        char msg[BLADE_ERROR_LEN];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        blade_error_set(R->err, "template error, line %d: %s", R->line, msg);
    }
    return false;
}

bool tmpl_charge(jrun *R, uint64_t units)
{
    R->cost += units;
    if (R->cost > TMPL_MAX_COST)
        return tmpl_fail(R, "template exceeded its work budget (%llu steps); it loops too long",
                         (unsigned long long)TMPL_MAX_COST);
    return true;
}

/* ---- heap ---- */

void tmpl_heap_init(tv_heap *h, size_t limit)
{
    memset(h, 0, sizeof *h);
    h->limit = limit;
}

void *tmpl_heap_alloc(jrun *R, size_t n) { return tmpl_heap_realloc(R, NULL, 0, n); }

void *tmpl_heap_realloc(jrun *R, void *p, size_t old, size_t n)
{
    tv_heap *h = &R->heap;
    if (n > old && n - old > h->limit - h->live) {
        tmpl_fail(R, "template exceeded its memory budget of %zu MiB", h->limit >> 20);
        return NULL;
    }
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        tmpl_fail(R, "out of memory");
        return NULL;
    }
    h->live = h->live - old + n;
    return q;
}

void tmpl_heap_free(tv_heap *h, void *p, size_t n)
{
    if (!p)
        return;
    free(p);
    h->live -= n;
}

static void obj_release(tv_obj *o);

static void ns_unregister(tv_ns *ns)
{
    tv_heap *h = ns->h.heap;
    if (!ns->registered)
        return;
    if (ns->reg_prev)
        ns->reg_prev->reg_next = ns->reg_next;
    else
        h->namespaces = ns->reg_next;
    if (ns->reg_next)
        ns->reg_next->reg_prev = ns->reg_prev;
    ns->registered = false;
}

static void obj_destroy(tv_obj *o)
{
    tv_heap *h = o->heap;
    switch (o->kind) {
    case TV_LIST: {
        tv_list *l = (tv_list *)o;
        for (size_t i = 0; i < l->n; i++)
            tv_release(l->items[i]);
        tmpl_heap_free(h, l->items, l->cap * sizeof(tv));
        break;
    }
    case TV_DICT: {
        tv_dict *d = (tv_dict *)o;
        for (size_t i = 0; i < d->n; i++) {
            tv_release(d->keys[i]);
            tv_release(d->vals[i]);
        }
        tmpl_heap_free(h, d->keys, d->cap * sizeof(tv));
        tmpl_heap_free(h, d->vals, d->cap * sizeof(tv));
        tmpl_heap_free(h, d->index, d->index_cap * sizeof(uint32_t));
        break;
    }
    case TV_NS: {
        tv_ns *ns = (tv_ns *)o;
        ns_unregister(ns);
        if (ns->attrs)
            obj_release(&ns->attrs->h);
        break;
    }
    case TV_LOOP:
        obj_release(&((tv_loop *)o)->items->h);
        tv_release(((tv_loop *)o)->changed);
        break;
    default: break;
    }
    tmpl_heap_free(h, o, o->size);
}

static void obj_release(tv_obj *o)
{
    if (!o->heap || --o->rc > 0)
        return;
    tv_heap *h = o->heap;
    o->next_free = h->pending;
    h->pending = o;
    if (h->draining)
        return;
    h->draining = true;
    while ((o = h->pending) != NULL) {
        h->pending = o->next_free;
        obj_destroy(o);
    }
    h->draining = false;
}

tv tv_retain(tv v)
{
    if (tv_has_obj(v) && v.u.o->heap)
        v.u.o->rc++;
    return v;
}

void tv_release(tv v)
{
    if (tv_has_obj(v))
        obj_release(v.u.o);
}

void tmpl_heap_break_cycles(tv_heap *h)
{
    while (h->namespaces) {
        tv_ns *ns = h->namespaces;
        ns_unregister(ns);
        ns->h.rc++;
        tv_dict *attrs = ns->attrs;
        ns->attrs = NULL;
        if (attrs)
            obj_release(&attrs->h);
        obj_release(&ns->h);
    }
}

static void *obj_new(jrun *R, tv_kind kind, size_t size)
{
    tv_obj *o = tmpl_heap_alloc(R, size);
    if (!o)
        return NULL;
    memset(o, 0, size);
    o->rc = 1;
    o->kind = (uint8_t)kind;
    o->heap = &R->heap;
    o->size = size;
    return o;
}

/* ---- strings ---- */

static size_t count_cp(const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        i += blade_utf8_decode(s + i, len - i, &cp);
        n++;
    }
    return n;
}

tv_str *tmpl_str_new(jrun *R, const char *s, size_t len)
{
    tv_str *o = tmpl_str_alloc(R, len);
    if (o && len)
        memcpy(o->s, s, len);
    return o;
}

tv_str *tmpl_str_alloc(jrun *R, size_t len)
{
    if (len > TMPL_MAX_STRING) {
        tmpl_fail(R, "string of %zu bytes exceeds the %u MiB limit", len, TMPL_MAX_STRING >> 20);
        return NULL;
    }
    if (!tmpl_charge(R, 1 + len / 64))
        return NULL;
    tv_str *o = obj_new(R, TV_STR, sizeof(tv_str) + len + 1);
    if (!o)
        return NULL;
    o->len = len;
    o->ncp = SIZE_MAX;
    o->s[len] = 0;
    return o;
}

bool tmpl_str_val(jrun *R, const char *s, size_t len, tv *out)
{
    tv_str *o = tmpl_str_new(R, s, len);
    if (!o)
        return false;
    *out = tv_obj_val(TV_STR, o);
    return true;
}

bool tmpl_str_cstr(jrun *R, const char *s, tv *out) { return tmpl_str_val(R, s, strlen(s), out); }

size_t tmpl_str_ncp(jrun *R, tv_str *s)
{
    if (s->ncp == SIZE_MAX) {
        tmpl_debit(R, TMPL_SCAN_COST(s->len));
        s->ncp = count_cp(s->s, s->len);
    }
    return s->ncp;
}

tv_str *tmpl_str_immortal(arena *a, const char *s, size_t len)
{
    tv_str *o = tmpl_arena_alloc(a, sizeof(tv_str) + len + 1);
    if (!o)
        return NULL;
    o->h.rc = 1;
    o->h.kind = TV_STR;
    o->len = len;
    memcpy(o->s, s, len);
    o->s[len] = 0;
    /* counted now: shared constants are never written while rendering */
    o->ncp = count_cp(o->s, len);
    return o;
}

/* ---- lists ---- */

tv_list *tmpl_list_new(jrun *R, size_t cap, bool tuple)
{
    tv_list *l = obj_new(R, TV_LIST, sizeof *l);
    if (!l)
        return NULL;
    l->tuple = tuple;
    if (cap) {
        if (!(l->items = tmpl_heap_alloc(R, cap * sizeof(tv)))) {
            obj_release(&l->h);
            return NULL;
        }
        l->cap = cap;
    }
    return l;
}

bool tmpl_list_push(jrun *R, tv_list *l, tv v)
{
    if (!tmpl_charge(R, 1)) {
        tv_release(v);
        return false;
    }
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        tv *items = tmpl_heap_realloc(R, l->items, l->cap * sizeof(tv), cap * sizeof(tv));
        if (!items) {
            tv_release(v);
            return false;
        }
        l->items = items;
        l->cap = cap;
    }
    l->items[l->n++] = v;
    return true;
}

/* ---- dicts ---- */

bool tv_hashable(tv v)
{
    return v.kind == TV_STR || v.kind == TV_INT || v.kind == TV_FLOAT || v.kind == TV_BOOL || v.kind == TV_NONE;
}

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* Equal keys hash equally across types, as 1, 1.0 and True are one key in Python. */
static uint64_t hash_key(tv k)
{
    switch (k.kind) {
    case TV_STR: return hash_bytes(tv_s(k)->s, tv_s(k)->len);
    case TV_INT:
    case TV_BOOL: return (uint64_t)tv_intval(k) * 0x9E3779B97F4A7C15ull;
    case TV_FLOAT: {
        double f = k.u.f;
        if (f == floor(f) && fabs(f) < 9.2e18)
            return (uint64_t)(int64_t)f * 0x9E3779B97F4A7C15ull;
        uint64_t bits;
        memcpy(&bits, &f, sizeof bits);
        return bits * 0x9E3779B97F4A7C15ull;
    }
    default: return 0x12345;
    }
}

static bool key_eq(tv a, tv b)
{
    if (a.kind == TV_STR && b.kind == TV_STR)
        return tv_s(a)->len == tv_s(b)->len && !memcmp(tv_s(a)->s, tv_s(b)->s, tv_s(a)->len);
    if (tv_is_num(a) && tv_is_num(b)) {
        if (tv_is_int(a) && tv_is_int(b))
            return tv_intval(a) == tv_intval(b);
        return tv_num(a) == tv_num(b);
    }
    return a.kind == TV_NONE && b.kind == TV_NONE;
}

tv_dict *tmpl_dict_new(jrun *R) { return obj_new(R, TV_DICT, sizeof(tv_dict)); }

static bool dict_reindex(jrun *R, tv_dict *d, size_t cap)
{
    uint32_t *idx = tmpl_heap_alloc(R, cap * sizeof *idx);
    if (!idx)
        return false;
    memset(idx, 0, cap * sizeof *idx);
    for (size_t i = 0; i < d->n; i++) {
        size_t slot = hash_key(d->keys[i]) & (cap - 1);
        while (idx[slot])
            slot = (slot + 1) & (cap - 1);
        idx[slot] = (uint32_t)(i + 1);
    }
    tmpl_heap_free(&R->heap, d->index, d->index_cap * sizeof(uint32_t));
    d->index = idx;
    d->index_cap = cap;
    return true;
}

static size_t dict_find(const tv_dict *d, tv key)
{
    if (!d->index) {
        for (size_t i = 0; i < d->n; i++)
            if (key_eq(d->keys[i], key))
                return i;
        return SIZE_MAX;
    }
    size_t slot = hash_key(key) & (d->index_cap - 1);
    while (d->index[slot]) {
        size_t i = d->index[slot] - 1;
        if (key_eq(d->keys[i], key))
            return i;
        slot = (slot + 1) & (d->index_cap - 1);
    }
    return SIZE_MAX;
}

bool tmpl_dict_set(jrun *R, tv_dict *d, tv key, tv val)
{
    size_t i = dict_find(d, key);
    if (i != SIZE_MAX) {
        tv_release(key);
        tv_release(d->vals[i]);
        d->vals[i] = val;
        return true;
    }
    if (!tmpl_charge(R, 1) || d->n >= UINT32_MAX - 1)
        goto fail;
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        tv *keys = tmpl_heap_alloc(R, cap * sizeof(tv));
        tv *vals = keys ? tmpl_heap_alloc(R, cap * sizeof(tv)) : NULL;
        if (!vals) {
            tmpl_heap_free(&R->heap, keys, keys ? cap * sizeof(tv) : 0);
            goto fail;
        }
        if (d->n) {
            memcpy(keys, d->keys, d->n * sizeof(tv));
            memcpy(vals, d->vals, d->n * sizeof(tv));
        }
        tmpl_heap_free(&R->heap, d->keys, d->cap * sizeof(tv));
        tmpl_heap_free(&R->heap, d->vals, d->cap * sizeof(tv));
        d->keys = keys;
        d->vals = vals;
        d->cap = cap;
    }
    d->keys[d->n] = key;
    d->vals[d->n] = val;
    d->n++;
    if (d->n > 8 && d->n * 2 > d->index_cap) {
        size_t cap = 32;
        while (cap < d->n * 4)
            cap *= 2;
        if (!dict_reindex(R, d, cap))
            return false;
    } else if (d->index) {
        size_t slot = hash_key(key) & (d->index_cap - 1);
        while (d->index[slot])
            slot = (slot + 1) & (d->index_cap - 1);
        d->index[slot] = (uint32_t)d->n;
    }
    return true;
fail:
    tv_release(key);
    tv_release(val);
    return false;
}

void tmpl_dict_clear(tv_dict *d)
{
    for (size_t i = 0; i < d->n; i++) {
        tv_release(d->keys[i]);
        tv_release(d->vals[i]);
    }
    d->n = 0;
    if (d->index)
        memset(d->index, 0, d->index_cap * sizeof *d->index);
}

bool tmpl_dict_get(const tv_dict *d, tv key, tv *out)
{
    size_t i = dict_find(d, key);
    if (i == SIZE_MAX)
        return false;
    *out = d->vals[i];
    return true;
}

bool tmpl_dict_get_cstr(const tv_dict *d, const char *key, tv *out)
{
    size_t len = strlen(key);
    if (!d->index) {
        for (size_t i = 0; i < d->n; i++) {
            tv k = d->keys[i];
            if (k.kind == TV_STR && tv_s(k)->len == len && !memcmp(tv_s(k)->s, key, len)) {
                *out = d->vals[i];
                return true;
            }
        }
        return false;
    }
    size_t slot = hash_bytes(key, len) & (d->index_cap - 1);
    while (d->index[slot]) {
        size_t i = d->index[slot] - 1;
        tv k = d->keys[i];
        if (k.kind == TV_STR && tv_s(k)->len == len && !memcmp(tv_s(k)->s, key, len)) {
            *out = d->vals[i];
            return true;
        }
        slot = (slot + 1) & (d->index_cap - 1);
    }
    return false;
}

tv_loop *tmpl_loop_new(jrun *R, tv_list *items)
{
    tv_loop *l = obj_new(R, TV_LOOP, sizeof *l);
    if (!l)
        return NULL;
    l->items = items;
    l->changed = tv_undef(UNDEF_NAME, NULL, 0);
    items->h.rc += items->h.heap != NULL;
    return l;
}

tv_caller *tmpl_caller_new(jrun *R, const struct stmt *block, struct frame *fr)
{
    tv_caller *c = obj_new(R, TV_CALLER, sizeof *c);
    if (!c)
        return NULL;
    c->block = block;
    c->frame = fr;
    c->alive = true;
    return c;
}

tv_ns *tmpl_ns_new(jrun *R)
{
    tv_ns *ns = obj_new(R, TV_NS, sizeof *ns);
    if (!ns)
        return NULL;
    if (!(ns->attrs = tmpl_dict_new(R))) {
        obj_release(&ns->h);
        return NULL;
    }
    tv_heap *h = &R->heap;
    ns->reg_next = h->namespaces;
    if (h->namespaces)
        h->namespaces->reg_prev = ns;
    h->namespaces = ns;
    ns->registered = true;
    return ns;
}

/* ---- string builder ---- */

void tmpl_sb_init(strbuf *b)
{
    b->s = NULL;
    b->cap = 0;
}

bool tmpl_sb_put(jrun *R, strbuf *b, const char *s, size_t n)
{
    if (!n)
        return true;
    size_t len = tmpl_sb_len(b);
    if (n > TMPL_MAX_STRING - len)
        return tmpl_fail(R, "text longer than the %u MiB limit", TMPL_MAX_STRING >> 20);
    if (!tmpl_charge(R, 1 + n / 64))
        return false;
    if (len + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 64;
        while (cap < len + n)
            cap *= 2;
        if (cap > TMPL_MAX_STRING)
            cap = TMPL_MAX_STRING;
        size_t old = b->s ? sizeof(tv_str) + b->cap + 1 : 0;
        tv_str *ns = tmpl_heap_realloc(R, b->s, old, sizeof(tv_str) + cap + 1);
        if (!ns)
            return false;
        if (!b->s) {
            memset(ns, 0, sizeof *ns);
            ns->h.heap = &R->heap;
        }
        b->s = ns;
        b->cap = cap;
    }
    memcpy(b->s->s + len, s, n);
    b->s->len = len + n;
    return true;
}

bool tmpl_sb_putc(jrun *R, strbuf *b, char c) { return tmpl_sb_put(R, b, &c, 1); }

tv tmpl_sb_finish(jrun *R, strbuf *b)
{
    tv out = tv_none();
    if (!b->s) {
        if (!tmpl_str_val(R, "", 0, &out))
            out = tv_undef(UNDEF_NAME, NULL, 0);
        return out;
    }
    /* no shrinking: the slack is at most half, and a shrinking realloc of a large block
     * makes glibc map and unmap memory on every string built */
    size_t len = b->s->len;
    tv_str *s = b->s;
    s->h.rc = 1;
    s->h.kind = TV_STR;
    s->h.heap = &R->heap;
    s->h.size = sizeof(tv_str) + b->cap + 1;
    s->ncp = SIZE_MAX;
    s->s[len] = 0;
    b->s = NULL;
    b->cap = 0;
    return tv_obj_val(TV_STR, s);
}

void tmpl_sb_drop(strbuf *b)
{
    if (b->s)
        tmpl_heap_free(b->s->h.heap, b->s, sizeof(tv_str) + b->cap + 1);
    b->s = NULL;
    b->cap = 0;
}

/* ---- type names, truth, undefined ---- */

static const char *kind_name(int kind, bool tuple)
{
    switch (kind) {
    case TV_UNDEF: return "Undefined";
    case TV_NONE: return "NoneType";
    case TV_BOOL: return "bool";
    case TV_INT: return "int";
    case TV_FLOAT: return "float";
    case TV_STR: return "str";
    case TV_LIST: return tuple ? "tuple" : "list";
    case TV_DICT: return "dict";
    case TV_NS: return "Namespace";
    case TV_LOOP: return "LoopContext";
    case TV_CALLER:
    case TV_MACRO: return "Macro";
    default: return "function";
    }
}

const char *tv_type_name(tv v) { return kind_name(v.kind, v.kind == TV_LIST && tv_l(v)->tuple); }

bool tv_truthy(tv v)
{
    switch (v.kind) {
    case TV_UNDEF:
    case TV_NONE: return false;
    case TV_BOOL: return v.u.b;
    case TV_INT: return v.u.i != 0;
    case TV_FLOAT: return v.u.f != 0.0;
    case TV_STR: return tv_s(v)->len != 0;
    case TV_LIST: return tv_l(v)->n != 0;
    case TV_DICT: return tv_d(v)->n != 0;
    default: return true;
    }
}

bool tmpl_undef_error(jrun *R, tv v)
{
    const char *name = v.u.name ? v.u.name : "?";
    switch (v.why) {
    case UNDEF_NAME: return tmpl_fail(R, "'%s' is undefined", name);
    case UNDEF_ATTR: return tmpl_fail(R, "'%s object' has no attribute '%s'", kind_name(v.owner, false), name);
    case UNDEF_ITEM: return tmpl_fail(R, "'%s object' has no such element", kind_name(v.owner, false));
    case UNDEF_EMPTY: return tmpl_fail(R, "no %s item, sequence was empty", name);
    default:
        return tmpl_fail(R, "the inline if expression evaluated to false and no else section was defined");
    }
}

/* ---- str() and repr() ---- */

/* Python's repr(float): the shortest digits that read back exactly, in fixed notation
 * for exponents -4 < e <= 16 and scientific beyond. */
void tmpl_fmt_float(double f, char *buf, size_t cap)
{
    if (isnan(f)) {
        snprintf(buf, cap, "nan");
        return;
    }
    if (isinf(f)) {
        snprintf(buf, cap, f > 0 ? "inf" : "-inf");
        return;
    }
    if (f == 0) {
        snprintf(buf, cap, signbit(f) ? "-0.0" : "0.0");
        return;
    }
    char tmp[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f)
            break;
    }
    char digits[24];
    size_t nd = 0;
    const char *p = tmp;
    bool neg = *p == '-';
    if (neg)
        p++;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9' && nd < sizeof digits - 1)
            digits[nd++] = *p;
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    int exp10 = *p == 'e' ? atoi(p + 1) : 0;
    int decpt = exp10 + 1;
    char out[64];
    size_t o = 0;
    if (neg)
        out[o++] = '-';
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int i = 0; i < -decpt; i++)
                out[o++] = '0';
            memcpy(out + o, digits, nd);
            o += nd;
        } else if ((size_t)decpt >= nd) {
            memcpy(out + o, digits, nd);
            o += nd;
            for (size_t i = nd; i < (size_t)decpt; i++)
                out[o++] = '0';
            out[o++] = '.';
            out[o++] = '0';
        } else {
            memcpy(out + o, digits, (size_t)decpt);
            o += (size_t)decpt;
            out[o++] = '.';
            memcpy(out + o, digits + decpt, nd - (size_t)decpt);
            o += nd - (size_t)decpt;
        }
        out[o] = 0;
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            memcpy(out + o, digits + 1, nd - 1);
            o += nd - 1;
        }
        snprintf(out + o, sizeof out - o, "e%c%02d", decpt - 1 < 0 ? '-' : '+', abs(decpt - 1));
    }
    snprintf(buf, cap, "%s", out);
}

static bool put_s(jrun *R, strbuf *b, const char *s) { return tmpl_sb_put(R, b, s, strlen(s)); }

/* Characters Python's repr() escapes beyond ASCII controls (str.isprintable() is false). */
static bool py_unprintable(uint32_t c)
{
    return (c >= 0x80 && c <= 0xA0) || c == 0xAD || (c >= 0x600 && c <= 0x605) || c == 0x61C || c == 0x6DD ||
           c == 0x70F || c == 0x180E || c == 0x1680 || (c >= 0x2000 && c <= 0x200F) ||
           (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x206F) || c == 0x3000 ||
           (c >= 0xD800 && c <= 0xF8FF) || c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFB) || c >= 0xFFFE;
}

static bool write_str_repr(jrun *R, strbuf *b, const tv_str *s)
{
    bool has_single = memchr(s->s, '\'', s->len) != NULL, has_double = memchr(s->s, '"', s->len) != NULL;
    char q = has_single && !has_double ? '"' : '\'';
    tmpl_debit(R, TMPL_SCAN_COST(s->len));
    if (!tmpl_sb_putc(R, b, q))
        return false;
    for (size_t i = 0; i < s->len;) {
        uint32_t c;
        size_t n = blade_utf8_decode(s->s + i, s->len - i, &c);
        char esc[16];
        const char *rep = NULL;
        if (c == (uint32_t)q || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            esc[2] = 0;
            rep = esc;
        } else if (c == '\n') {
            rep = "\\n";
        } else if (c == '\r') {
            rep = "\\r";
        } else if (c == '\t') {
            rep = "\\t";
        } else if (c < 0x20 || c == 0x7F || (n == 1 && c >= 0x80)) {
            snprintf(esc, sizeof esc, "\\x%02x", n == 1 ? (unsigned char)s->s[i] : c);
            rep = esc;
        } else if (py_unprintable(c)) {
            snprintf(esc, sizeof esc, c < 0x100 ? "\\x%02x" : c < 0x10000 ? "\\u%04x" : "\\U%08x", c);
            rep = esc;
        }
        if (!(rep ? put_s(R, b, rep) : tmpl_sb_put(R, b, s->s + i, n)))
            return false;
        i += n;
    }
    return tmpl_sb_putc(R, b, q);
}

bool tv_write_repr(jrun *R, strbuf *b, tv v, int depth)
{
    if (depth > TMPL_MAX_VALUE_DEPTH)
        return tmpl_fail(R, "value nested more than %d levels deep", TMPL_MAX_VALUE_DEPTH);
    if (!tmpl_charge(R, 1))
        return false;
    switch (v.kind) {
    case TV_UNDEF: return put_s(R, b, "Undefined");
    case TV_STR: return write_str_repr(R, b, tv_s(v));
    case TV_LIST: {
        tv_list *l = tv_l(v);
        if (!tmpl_sb_putc(R, b, l->tuple ? '(' : '['))
            return false;
        for (size_t i = 0; i < l->n; i++)
            if ((i && !put_s(R, b, ", ")) || !tv_write_repr(R, b, l->items[i], depth + 1))
                return false;
        if (l->tuple && l->n == 1 && !tmpl_sb_putc(R, b, ','))
            return false;
        return tmpl_sb_putc(R, b, l->tuple ? ')' : ']');
    }
    case TV_DICT: {
        tv_dict *d = tv_d(v);
        if (!tmpl_sb_putc(R, b, '{'))
            return false;
        for (size_t i = 0; i < d->n; i++)
            if ((i && !put_s(R, b, ", ")) || !tv_write_repr(R, b, d->keys[i], depth + 1) || !put_s(R, b, ": ") ||
                !tv_write_repr(R, b, d->vals[i], depth + 1))
                return false;
        return tmpl_sb_putc(R, b, '}');
    }
    case TV_NS: {
        tv_ns *ns = (tv_ns *)v.u.o;
        if (!put_s(R, b, "<Namespace "))
            return false;
        if (ns->attrs && !tv_write_repr(R, b, tv_obj_val(TV_DICT, ns->attrs), depth + 1))
            return false;
        return tmpl_sb_putc(R, b, '>');
    }
    default: return tv_write_str(R, b, v);
    }
}

bool tv_write_str(jrun *R, strbuf *b, tv v)
{
    char buf[64];
    switch (v.kind) {
    case TV_UNDEF: return true;
    case TV_NONE: return put_s(R, b, "None");
    case TV_BOOL: return put_s(R, b, v.u.b ? "True" : "False");
    case TV_INT:
        snprintf(buf, sizeof buf, "%" PRId64, v.u.i);
        return put_s(R, b, buf);
    case TV_FLOAT:
        tmpl_fmt_float(v.u.f, buf, sizeof buf);
        return put_s(R, b, buf);
    case TV_STR: return tmpl_sb_put(R, b, tv_s(v)->s, tv_s(v)->len);
    case TV_LIST:
    case TV_DICT:
    case TV_NS: return tv_write_repr(R, b, v, 0);
    case TV_LOOP: {
        tv_loop *l = (tv_loop *)v.u.o;
        snprintf(buf, sizeof buf, "<LoopContext %zu/%zu>", l->i + 1, l->items->n);
        return put_s(R, b, buf);
    }
    case TV_CALLER: return put_s(R, b, "<Macro 'caller'>");
    case TV_MACRO:
        return put_s(R, b, "<Macro '") && put_s(R, b, v.u.macro->name) && put_s(R, b, "'>");
    default: return put_s(R, b, "<function ") && put_s(R, b, tmpl_global_name(v.u.func)) && put_s(R, b, ">");
    }
}

bool tv_to_str(jrun *R, tv v, tv *out)
{
    if (v.kind == TV_STR) {
        *out = tv_retain(v);
        return true;
    }
    strbuf b;
    tmpl_sb_init(&b);
    if (!tv_write_str(R, &b, v)) {
        tmpl_sb_drop(&b);
        return false;
    }
    *out = tmpl_sb_finish(R, &b);
    return !R->failed;
}

/* ---- comparison ---- */

bool tv_equal(jrun *R, tv a, tv b, int depth, bool *eq)
{
    if (depth > TMPL_MAX_VALUE_DEPTH)
        return tmpl_fail(R, "value nested more than %d levels deep", TMPL_MAX_VALUE_DEPTH);
    if (!tmpl_charge(R, 1))
        return false;
    if (tv_is_num(a) && tv_is_num(b)) {
        *eq = tv_is_int(a) && tv_is_int(b) ? tv_intval(a) == tv_intval(b) : tv_num(a) == tv_num(b);
        return true;
    }
    *eq = false;
    if (a.kind != b.kind)
        return true;
    switch (a.kind) {
    case TV_UNDEF:
    case TV_NONE: *eq = true; return true;
    case TV_STR:
        *eq = tv_s(a)->len == tv_s(b)->len && !memcmp(tv_s(a)->s, tv_s(b)->s, tv_s(a)->len);
        return tmpl_charge(R, tv_s(a)->len / 64);
    case TV_LIST: {
        tv_list *x = tv_l(a), *y = tv_l(b);
        if (x->tuple != y->tuple || x->n != y->n)
            return true;
        for (size_t i = 0; i < x->n; i++) {
            if (!tv_equal(R, x->items[i], y->items[i], depth + 1, eq))
                return false;
            if (!*eq)
                return true;
        }
        *eq = true;
        return true;
    }
    case TV_DICT: {
        tv_dict *x = tv_d(a), *y = tv_d(b);
        if (x->n != y->n)
            return true;
        for (size_t i = 0; i < x->n; i++) {
            tv other;
            if (!tmpl_dict_get(y, x->keys[i], &other))
                return true;
            if (!tv_equal(R, x->vals[i], other, depth + 1, eq))
                return false;
            if (!*eq)
                return true;
        }
        *eq = true;
        return true;
    }
    case TV_MACRO: *eq = a.u.macro == b.u.macro; return true;
    case TV_FUNC: *eq = a.u.func == b.u.func; return true;
    default: *eq = a.u.o == b.u.o; return true;
    }
}

static bool compare_at(jrun *R, tv a, tv b, int *cmp, int depth)
{
    if (depth > TMPL_MAX_VALUE_DEPTH)
        return tmpl_fail(R, "value nested more than %d levels deep", TMPL_MAX_VALUE_DEPTH);
    if (a.kind == TV_UNDEF)
        return tmpl_undef_error(R, a);
    if (b.kind == TV_UNDEF)
        return tmpl_undef_error(R, b);
    if (!tmpl_charge(R, 1))
        return false;
    if (tv_is_num(a) && tv_is_num(b)) {
        if (tv_is_int(a) && tv_is_int(b))
            *cmp = (tv_intval(a) > tv_intval(b)) - (tv_intval(a) < tv_intval(b));
        else
            *cmp = (tv_num(a) > tv_num(b)) - (tv_num(a) < tv_num(b));
        return true;
    }
    if (a.kind == TV_STR && b.kind == TV_STR) {
        tv_str *x = tv_s(a), *y = tv_s(b);
        size_t n = x->len < y->len ? x->len : y->len;
        int c = memcmp(x->s, y->s, n);
        *cmp = c ? (c > 0) - (c < 0) : (x->len > y->len) - (x->len < y->len);
        return tmpl_charge(R, n / 64);
    }
    if (a.kind == TV_LIST && b.kind == TV_LIST && tv_l(a)->tuple == tv_l(b)->tuple) {
        tv_list *x = tv_l(a), *y = tv_l(b);
        for (size_t i = 0; i < x->n && i < y->n; i++) {
            bool eq;
            if (!tv_equal(R, x->items[i], y->items[i], depth + 1, &eq))
                return false;
            if (!eq)
                return compare_at(R, x->items[i], y->items[i], cmp, depth + 1);
        }
        *cmp = (x->n > y->n) - (x->n < y->n);
        return true;
    }
    return tmpl_fail(R, "'<' not supported between instances of '%s' and '%s'", tv_type_name(a), tv_type_name(b));
}

bool tv_compare(jrun *R, tv a, tv b, int *cmp) { return compare_at(R, a, b, cmp, 0); }

bool tv_contains(jrun *R, tv container, tv item, bool *in)
{
    *in = false;
    switch (container.kind) {
    case TV_UNDEF: return true;
    case TV_STR: {
        if (item.kind != TV_STR)
            return tmpl_fail(R, "'in <string>' requires string as left operand, not %s", tv_type_name(item));
        tv_str *h = tv_s(container), *n = tv_s(item);
        *in = n->len == 0 || (n->len <= h->len && memmem(h->s, h->len, n->s, n->len) != NULL);
        return tmpl_charge(R, h->len / 64);
    }
    case TV_LIST: {
        tv_list *l = tv_l(container);
        for (size_t i = 0; i < l->n && !*in; i++)
            if (!tv_equal(R, l->items[i], item, 0, in))
                return false;
        return true;
    }
    case TV_DICT: {
        if (item.kind == TV_UNDEF)
            return true;
        if (!tv_hashable(item))
            return tmpl_fail(R, "unhashable type: '%s'", tv_type_name(item));
        tv unused;
        *in = tmpl_dict_get(tv_d(container), item, &unused);
        return true;
    }
    default: return tmpl_fail(R, "argument of type '%s' is not iterable", tv_type_name(container));
    }
}

/* ---- json.dumps ---- */

static bool json_write_string(jrun *R, strbuf *b, const char *s, size_t len, bool ensure_ascii)
{
    if (!tmpl_sb_putc(R, b, '"'))
        return false;
    tmpl_debit(R, TMPL_SCAN_COST(len));
    size_t run = 0; /* bytes copied verbatim, flushed in one piece */
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)s[i];
        char esc[16];
        const char *rep = NULL;
        size_t n = 1;
        if (c == '"')
            rep = "\\\"";
        else if (c == '\\')
            rep = "\\\\";
        else if (c == '\n')
            rep = "\\n";
        else if (c == '\r')
            rep = "\\r";
        else if (c == '\t')
            rep = "\\t";
        else if (c == '\b')
            rep = "\\b";
        else if (c == '\f')
            rep = "\\f";
        else if (c < 0x20 || (ensure_ascii && c == 0x7F)) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            rep = esc;
        } else if (ensure_ascii && c >= 0x80) {
            uint32_t cp;
            n = blade_utf8_decode(s + i, len - i, &cp);
            if (cp >= 0x10000)
                snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xD800 + ((cp - 0x10000) >> 10),
                         0xDC00 + ((cp - 0x10000) & 0x3FF));
            else
                snprintf(esc, sizeof esc, "\\u%04x", cp);
            rep = esc;
        }
        if (rep) {
            if (!tmpl_sb_put(R, b, s + i - run, run) || !put_s(R, b, rep))
                return false;
            run = 0;
        } else {
            run += n;
        }
        i += n;
    }
    return tmpl_sb_put(R, b, s + len - run, run) && tmpl_sb_putc(R, b, '"');
}

static bool json_newline(jrun *R, strbuf *b, const json_opts *o, int level)
{
    if (!o->indent)
        return true;
    if (!tmpl_sb_putc(R, b, '\n'))
        return false;
    for (int i = 0; i < level; i++)
        if (!put_s(R, b, o->indent))
            return false;
    return true;
}

static bool json_key(jrun *R, tv k, tv *out)
{
    switch (k.kind) {
    case TV_STR: *out = tv_retain(k); return true;
    case TV_NONE: return tmpl_str_cstr(R, "null", out);
    case TV_BOOL: return tmpl_str_cstr(R, k.u.b ? "true" : "false", out);
    case TV_INT:
    case TV_FLOAT: return tv_to_str(R, k, out);
    default: return tmpl_fail(R, "keys must be str, int, float, bool or None, not %s", tv_type_name(k));
    }
}

bool tv_write_json(jrun *R, strbuf *b, tv v, const json_opts *o, int level)
{
    if (level > TMPL_MAX_VALUE_DEPTH)
        return tmpl_fail(R, "value nested more than %d levels deep", TMPL_MAX_VALUE_DEPTH);
    if (!tmpl_charge(R, 1))
        return false;
    char buf[64];
    switch (v.kind) {
    case TV_NONE: return put_s(R, b, "null");
    case TV_BOOL: return put_s(R, b, v.u.b ? "true" : "false");
    case TV_INT:
        snprintf(buf, sizeof buf, "%" PRId64, v.u.i);
        return put_s(R, b, buf);
    case TV_FLOAT:
        if (isnan(v.u.f))
            return put_s(R, b, "NaN");
        if (isinf(v.u.f))
            return put_s(R, b, v.u.f > 0 ? "Infinity" : "-Infinity");
        tmpl_fmt_float(v.u.f, buf, sizeof buf);
        return put_s(R, b, buf);
    case TV_STR: return json_write_string(R, b, tv_s(v)->s, tv_s(v)->len, o->ensure_ascii);
    case TV_LIST: {
        tv_list *l = tv_l(v);
        if (!l->n)
            return put_s(R, b, "[]");
        if (!tmpl_sb_putc(R, b, '[') || !json_newline(R, b, o, level + 1))
            return false;
        for (size_t i = 0; i < l->n; i++) {
            if (i && (!put_s(R, b, o->item_sep) || !json_newline(R, b, o, level + 1)))
                return false;
            if (!tv_write_json(R, b, l->items[i], o, level + 1))
                return false;
        }
        return json_newline(R, b, o, level) && tmpl_sb_putc(R, b, ']');
    }
    case TV_DICT: {
        tv_dict *d = tv_d(v);
        if (!d->n)
            return put_s(R, b, "{}");
        size_t *order = tmpl_heap_alloc(R, d->n * sizeof *order);
        tv *keys = tmpl_heap_alloc(R, d->n * sizeof *keys);
        size_t nkeys = 0;
        bool ok = order && keys;
        for (size_t i = 0; ok && i < d->n; i++) {
            order[i] = i;
            ok = json_key(R, d->keys[i], &keys[i]);
            nkeys += ok;
        }
        if (ok && o->sort_keys) {
            /* insertion sort keeps equal keys stable; dicts have unique keys anyway */
            for (size_t i = 1; i < d->n; i++) {
                size_t k = order[i], j = i;
                for (; j > 0; j--) {
                    tv_str *x = tv_s(keys[order[j - 1]]), *y = tv_s(keys[k]);
                    size_t m = x->len < y->len ? x->len : y->len;
                    int c = memcmp(x->s, y->s, m);
                    if (c < 0 || (c == 0 && x->len <= y->len))
                        break;
                    order[j] = order[j - 1];
                }
                order[j] = k;
                if (!(ok = tmpl_charge(R, i)))
                    break;
            }
        }
        ok = ok && tmpl_sb_putc(R, b, '{') && json_newline(R, b, o, level + 1);
        for (size_t i = 0; ok && i < d->n; i++) {
            size_t k = order[i];
            if (i && (!put_s(R, b, o->item_sep) || !json_newline(R, b, o, level + 1)))
                ok = false;
            else
                ok = json_write_string(R, b, tv_s(keys[k])->s, tv_s(keys[k])->len, o->ensure_ascii) &&
                     put_s(R, b, o->key_sep) && tv_write_json(R, b, d->vals[k], o, level + 1);
        }
        ok = ok && json_newline(R, b, o, level) && tmpl_sb_putc(R, b, '}');
        for (size_t i = 0; i < nkeys; i++)
            tv_release(keys[i]);
        tmpl_heap_free(&R->heap, order, order ? d->n * sizeof *order : 0);
        tmpl_heap_free(&R->heap, keys, keys ? d->n * sizeof *keys : 0);
        return ok;
    }
    default: return tmpl_fail(R, "Object of type %s is not JSON serializable", tv_type_name(v));
    }
}

/* ---- character classes ---- */

bool tmpl_py_isspace(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

size_t tmpl_py_space_len(const char *s, size_t len)
{
    if (!len)
        return 0;
    uint32_t cp;
    size_t n = blade_utf8_decode(s, len, &cp);
    return (cp != 0xFFFD || n != 1) && tmpl_py_isspace(cp) ? n : 0;
}

/* Case pairs of the scripts chat text commonly uses (Latin, Greek, Cyrillic, Armenian,
 * full-width Latin); other characters have no case here. */
static bool pair_even_upper(uint32_t c)
{
    return (c >= 0x100 && c <= 0x137) || (c >= 0x14A && c <= 0x177) || (c >= 0x460 && c <= 0x481) ||
           (c >= 0x48A && c <= 0x4BF) || (c >= 0x4D0 && c <= 0x52F) || (c >= 0x1E00 && c <= 0x1E95) ||
           (c >= 0x1EA0 && c <= 0x1EFF);
}

static bool pair_odd_upper(uint32_t c) { return (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E); }

uint32_t tmpl_uni_lower(uint32_t c)
{
    if (c < 0x80)
        return c >= 'A' && c <= 'Z' ? c + 32 : c;
    if (c >= 0xC0 && c <= 0xDE && c != 0xD7)
        return c + 32;
    if (c == 0x130)
        return 'i';
    if (c == 0x178)
        return 0xFF;
    if (pair_even_upper(c))
        return c & 1 ? c : c + 1;
    if (pair_odd_upper(c))
        return c & 1 ? c + 1 : c;
    if ((c >= 0x391 && c <= 0x3AB && c != 0x3A2) || (c >= 0x410 && c <= 0x42F) || (c >= 0xFF21 && c <= 0xFF3A))
        return c + 32;
    if (c == 0x386)
        return 0x3AC;
    if (c >= 0x388 && c <= 0x38A)
        return c + 37;
    if (c == 0x38C)
        return 0x3CC;
    if (c == 0x38E || c == 0x38F)
        return c + 63;
    if (c >= 0x400 && c <= 0x40F)
        return c + 80;
    if (c >= 0x531 && c <= 0x556)
        return c + 48;
    if (c == 0x1E9E)
        return 0xDF;
    return c;
}

uint32_t tmpl_uni_upper(uint32_t c)
{
    if (c < 0x80)
        return c >= 'a' && c <= 'z' ? c - 32 : c;
    if (c >= 0xE0 && c <= 0xFE && c != 0xF7)
        return c - 32;
    if (c == 0xFF)
        return 0x178;
    if (c == 0xB5)
        return 0x39C;
    if (c == 0x131)
        return 'I';
    if (c == 0x17F)
        return 'S';
    if (pair_even_upper(c))
        return c & 1 ? c - 1 : c;
    if (pair_odd_upper(c))
        return c & 1 ? c : c - 1;
    if (c == 0x3C2)
        return 0x3A3;
    if ((c >= 0x3B1 && c <= 0x3CB) || (c >= 0x430 && c <= 0x44F) || (c >= 0xFF41 && c <= 0xFF5A))
        return c - 32;
    if (c == 0x3AC)
        return 0x386;
    if (c >= 0x3AD && c <= 0x3AF)
        return c - 37;
    if (c == 0x3CC)
        return 0x38C;
    if (c == 0x3CD || c == 0x3CE)
        return c - 63;
    if (c >= 0x450 && c <= 0x45F)
        return c - 80;
    if (c >= 0x561 && c <= 0x586)
        return c - 48;
    return c;
}

bool tmpl_uni_cased(uint32_t c) { return tmpl_uni_upper(c) != c || tmpl_uni_lower(c) != c || c == 0xDF || c == 0x138 || c == 0x149; }

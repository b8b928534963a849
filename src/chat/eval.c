/* Evaluation of expressions and execution of statements, with Jinja's scoping: a for-loop
 * iteration, a macro call, a block set, a filter block and a with block each get a fresh
 * frame, `if` does not, and a macro sees the template's top-level names at call time.
 * Every node evaluated is charged to the work budget and counted against the depth limit. */
#include "chat/jinja.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { ST_OK, ST_BREAK, ST_CONTINUE, ST_ERR };

static bool eval(jrun *R, frame *fr, const expr *e, tv *out);

static void frame_release(frame *f)
{
    if (f->vars)
        tv_release(tv_obj_val(TV_DICT, f->vars));
    f->vars = NULL;
}

/* Takes ownership of v; key is an immortal string. */
static bool frame_set(jrun *R, frame *f, tv key, tv v)
{
    if (!f->vars && !(f->vars = tmpl_dict_new(R))) {
        tv_release(v);
        return false;
    }
    return tmpl_dict_set(R, f->vars, key, v);
}

/* Borrowed reference. */
static bool lookup(jrun *R, frame *fr, const char *name, tv *out)
{
    for (frame *f = fr; f; f = f->parent)
        if (f->vars && tmpl_dict_get_cstr(f->vars, name, out))
            return true;
    if (R->ctx && tmpl_dict_get_cstr(R->ctx, name, out))
        return true;
    int g = tmpl_global_id(name);
    if (g >= 0) {
        *out = (tv){TV_FUNC, 0, 0, {.func = g}};
        return true;
    }
    return false;
}

/* ---- attribute and item access ---- */

static bool loop_attr(tv_loop *l, const char *name, tv *out)
{
    size_t n = l->items->n, i = l->i;
    if (!strcmp(name, "index"))
        *out = tv_int((int64_t)i + 1);
    else if (!strcmp(name, "index0"))
        *out = tv_int((int64_t)i);
    else if (!strcmp(name, "revindex"))
        *out = tv_int((int64_t)(n - i));
    else if (!strcmp(name, "revindex0"))
        *out = tv_int((int64_t)(n - i - 1));
    else if (!strcmp(name, "first"))
        *out = tv_bool(i == 0);
    else if (!strcmp(name, "last"))
        *out = tv_bool(i + 1 == n);
    else if (!strcmp(name, "length"))
        *out = tv_int((int64_t)n);
    else if (!strcmp(name, "depth"))
        *out = tv_int(1);
    else if (!strcmp(name, "depth0"))
        *out = tv_int(0);
    else if (!strcmp(name, "previtem"))
        *out = i > 0 ? tv_retain(l->items->items[i - 1]) : tv_undef(UNDEF_NAME, "previtem", 0);
    else if (!strcmp(name, "nextitem"))
        *out = i + 1 < n ? tv_retain(l->items->items[i + 1]) : tv_undef(UNDEF_NAME, "nextitem", 0);
    else
        return false;
    return true;
}

/* `durable`: name outlives the render (template text), so an undefined result may point
 * at it for its error message. */
static bool getattr_ex(jrun *R, tv obj, const char *name, bool durable, tv *out)
{
    tv v;
    switch (obj.kind) {
    case TV_UNDEF: return tmpl_undef_error(R, obj);
    case TV_DICT:
        if (tmpl_dict_get_cstr(tv_d(obj), name, &v)) {
            *out = tv_retain(v);
            return true;
        }
        break;
    case TV_NS: {
        tv_ns *ns = (tv_ns *)obj.u.o;
        if (ns->attrs && tmpl_dict_get_cstr(ns->attrs, name, &v)) {
            *out = tv_retain(v);
            return true;
        }
        break;
    }
    case TV_LOOP:
        if (loop_attr((tv_loop *)obj.u.o, name, out))
            return true;
        break;
    default: break;
    }
    *out = durable ? tv_undef(UNDEF_ATTR, name, obj.kind) : tv_undef(UNDEF_ITEM, NULL, obj.kind);
    return true;
}

bool tmpl_getattr(jrun *R, tv obj, const char *name, tv *out) { return getattr_ex(R, obj, name, true, out); }

/* Byte offset of code point `index` (which must be <= the count). */
static size_t cp_offset(jrun *R, const tv_str *s, size_t ncp, size_t index)
{
    if (ncp == s->len)
        return index;
    size_t off = 0;
    for (size_t i = 0; i < index; i++) {
        uint32_t cp;
        off += blade_utf8_decode(s->s + off, s->len - off, &cp);
    }
    tmpl_debit(R, TMPL_SCAN_COST(off));
    return off;
}

bool tmpl_getitem(jrun *R, tv obj, tv key, tv *out)
{
    if (obj.kind == TV_UNDEF)
        return tmpl_undef_error(R, obj);
    if ((obj.kind == TV_LIST || obj.kind == TV_STR) && tv_is_int(key)) {
        int64_t i = tv_intval(key);
        size_t n = obj.kind == TV_LIST ? tv_l(obj)->n : tmpl_str_ncp(R, tv_s(obj));
        if (i < 0)
            i += (int64_t)n;
        if (i < 0 || (uint64_t)i >= n) {
            *out = tv_undef(UNDEF_ITEM, NULL, obj.kind);
            return true;
        }
        if (obj.kind == TV_LIST) {
            *out = tv_retain(tv_l(obj)->items[i]);
            return true;
        }
        tv_str *s = tv_s(obj);
        size_t off = cp_offset(R, s, n, (size_t)i);
        uint32_t cp;
        size_t len = blade_utf8_decode(s->s + off, s->len - off, &cp);
        return tmpl_str_val(R, s->s + off, len, out);
    }
    if (obj.kind == TV_DICT) {
        tv v;
        if (tv_hashable(key) && tmpl_dict_get(tv_d(obj), key, &v)) {
            *out = tv_retain(v);
            return true;
        }
        bool durable = key.kind == TV_STR && !key.u.o->heap;
        *out = durable ? tv_undef(UNDEF_ATTR, tv_s(key)->s, TV_DICT) : tv_undef(UNDEF_ITEM, NULL, TV_DICT);
        return true;
    }
    if (key.kind == TV_STR)
        return getattr_ex(R, obj, tv_s(key)->s, !key.u.o->heap, out);
    *out = tv_undef(UNDEF_ITEM, NULL, obj.kind);
    return true;
}

static bool slice_bound(jrun *R, frame *fr, const expr *e, bool *has, int64_t *v)
{
    *has = false;
    if (!e)
        return true;
    tv x;
    if (!eval(R, fr, e, &x))
        return false;
    if (x.kind == TV_NONE)
        return true;
    if (!tv_is_int(x)) {
        tv_release(x);
        return tmpl_fail(R, "slice indices must be integers or None");
    }
    *has = true;
    *v = tv_intval(x);
    return true;
}

static int64_t adjust(int64_t i, int64_t len, int64_t step)
{
    if (i < 0) {
        i += len;
        if (i < 0)
            i = step < 0 ? -1 : 0;
    } else if (i >= len) {
        i = step < 0 ? len - 1 : len;
    }
    return i;
}

static bool eval_slice(jrun *R, frame *fr, const expr *e, tv *out)
{
    tv obj;
    bool hs, he, hp;
    int64_t start = 0, stop = 0, step = 1;
    if (!eval(R, fr, e->u.slice.obj, &obj))
        return false;
    bool ok = slice_bound(R, fr, e->u.slice.start, &hs, &start) && slice_bound(R, fr, e->u.slice.stop, &he, &stop) &&
              slice_bound(R, fr, e->u.slice.step, &hp, &step);
    if (ok && obj.kind == TV_UNDEF)
        ok = tmpl_undef_error(R, obj);
    if (!ok) {
        tv_release(obj);
        return false;
    }
    if (obj.kind != TV_LIST && obj.kind != TV_STR) {
        /* Jinja slices with Python's own [a:b], bypassing its lenient item lookup */
        ok = obj.kind == TV_DICT ? tmpl_fail(R, "unhashable type: 'slice'")
                                 : tmpl_fail(R, "'%s' object is not subscriptable", tv_type_name(obj));
        tv_release(obj);
        return ok;
    }
    if (!hp)
        step = 1;
    if (step == 0) {
        tv_release(obj);
        return tmpl_fail(R, "slice step cannot be zero");
    }
    if (step == INT64_MIN)
        step = -INT64_MAX;
    int64_t len = obj.kind == TV_LIST ? (int64_t)tv_l(obj)->n : (int64_t)tmpl_str_ncp(R, tv_s(obj));
    start = hs ? adjust(start, len, step) : step < 0 ? len - 1 : 0;
    stop = he ? adjust(stop, len, step) : step < 0 ? -1 : len;
    int64_t count = 0;
    if (step < 0 && stop < start)
        count = (start - stop - 1) / -step + 1;
    else if (step > 0 && start < stop)
        count = (stop - start - 1) / step + 1;
    if (obj.kind == TV_LIST) {
        tv_list *src = tv_l(obj), *l = tmpl_list_new(R, (size_t)count, src->tuple);
        for (int64_t k = 0; l && k < count; k++)
            if (!tmpl_list_push(R, l, tv_retain(src->items[start + k * step]))) {
                tv_release(tv_obj_val(TV_LIST, l));
                l = NULL;
            }
        tv_release(obj);
        if (!l)
            return false;
        *out = tv_obj_val(TV_LIST, l);
        return true;
    }
    tv_str *s = tv_s(obj);
    size_t ncp = (size_t)len;
    strbuf b;
    tmpl_sb_init(&b);
    if (step == 1 || ncp == s->len) {
        size_t from = count ? cp_offset(R, s, ncp, (size_t)start) : 0;
        if (step == 1) {
            size_t to = count ? cp_offset(R, s, ncp, (size_t)(start + count)) : 0;
            ok = tmpl_sb_put(R, &b, s->s + from, to - from);
        } else {
            for (int64_t k = 0; ok && k < count; k++)
                ok = tmpl_sb_putc(R, &b, s->s[start + k * step]);
        }
    } else {
        /* arbitrary steps over multi-byte text: index the code points once */
        size_t *offs = tmpl_heap_alloc(R, (ncp + 1) * sizeof *offs);
        ok = offs != NULL && tmpl_charge(R, ncp);
        if (ok) {
            size_t off = 0;
            for (size_t i = 0; i < ncp; i++) {
                uint32_t cp;
                offs[i] = off;
                off += blade_utf8_decode(s->s + off, s->len - off, &cp);
            }
            offs[ncp] = off;
            for (int64_t k = 0; ok && k < count; k++) {
                size_t i = (size_t)(start + k * step);
                ok = tmpl_sb_put(R, &b, s->s + offs[i], offs[i + 1] - offs[i]);
            }
        }
        tmpl_heap_free(&R->heap, offs, offs ? (ncp + 1) * sizeof *offs : 0);
    }
    tv_release(obj);
    if (!ok) {
        tmpl_sb_drop(&b);
        return false;
    }
    *out = tmpl_sb_finish(R, &b);
    return !R->failed;
}

bool tmpl_iterate(jrun *R, tv v, tv_list **out)
{
    switch (v.kind) {
    case TV_LIST:
        /* callers walk the items: charged here once for all of them */
        if (!tmpl_charge(R, tv_l(v)->n))
            return false;
        *out = tv_l(tv_retain(v));
        return true;
    case TV_UNDEF: return (*out = tmpl_list_new(R, 0, false)) != NULL;
    case TV_DICT: {
        tv_dict *d = tv_d(v);
        tv_list *l = tmpl_list_new(R, d->n, false);
        for (size_t i = 0; l && i < d->n; i++)
            if (!tmpl_list_push(R, l, tv_retain(d->keys[i]))) {
                tv_release(tv_obj_val(TV_LIST, l));
                l = NULL;
            }
        return (*out = l) != NULL;
    }
    case TV_STR: {
        tv_str *s = tv_s(v);
        tv_list *l = tmpl_list_new(R, tmpl_str_ncp(R, s), false);
        for (size_t i = 0; l && i < s->len;) {
            uint32_t cp;
            size_t n = blade_utf8_decode(s->s + i, s->len - i, &cp);
            tv c;
            if (!tmpl_str_val(R, s->s + i, n, &c) || !tmpl_list_push(R, l, c)) {
                tv_release(tv_obj_val(TV_LIST, l));
                l = NULL;
            }
            i += n;
        }
        return (*out = l) != NULL;
    }
    default: return tmpl_fail(R, "'%s' object is not iterable", tv_type_name(v));
    }
}

/* ---- operators ---- */

static bool repeat(jrun *R, tv seq, int64_t count, tv *out)
{
    if (count < 0)
        count = 0;
    if (seq.kind == TV_STR) {
        tv_str *s = tv_s(seq);
        if (s->len && (uint64_t)count > TMPL_MAX_STRING / s->len)
            return tmpl_fail(R, "string repetition longer than the %u MiB limit", TMPL_MAX_STRING >> 20);
        size_t total = s->len * (size_t)count;
        tv_str *o = tmpl_str_alloc(R, total);
        if (!o)
            return false;
        /* doubling copies: log(count) memcpys instead of count */
        for (size_t done = 0; done < total;) {
            size_t n = done ? (done < total - done ? done : total - done) : s->len;
            memcpy(o->s + done, done ? o->s : s->s, n);
            done += n;
        }
        *out = tv_obj_val(TV_STR, o);
        return true;
    }
    tv_list *src = tv_l(seq);
    if (src->n && (uint64_t)count > (TMPL_MAX_MEMORY / sizeof(tv)) / src->n)
        return tmpl_fail(R, "list repetition larger than the memory budget");
    tv_list *l = tmpl_list_new(R, (size_t)count * src->n, src->tuple);
    for (int64_t i = 0; l && i < count; i++)
        for (size_t k = 0; l && k < src->n; k++)
            if (!tmpl_list_push(R, l, tv_retain(src->items[k]))) {
                tv_release(tv_obj_val(TV_LIST, l));
                l = NULL;
            }
    if (!l)
        return false;
    *out = tv_obj_val(TV_LIST, l);
    return true;
}

static bool type_error(jrun *R, const char *op, tv a, tv b)
{
    return tmpl_fail(R, "unsupported operand type(s) for %s: '%s' and '%s'", op, tv_type_name(a), tv_type_name(b));
}

static bool int_pow(jrun *R, int64_t base, int64_t exp, tv *out)
{
    int64_t result = 1;
    while (exp > 0) {
        if (exp & 1 && __builtin_mul_overflow(result, base, &result))
            return tmpl_fail(R, "integer result of ** is too large");
        exp >>= 1;
        if (exp && __builtin_mul_overflow(base, base, &base))
            return tmpl_fail(R, "integer result of ** is too large");
    }
    *out = tv_int(result);
    return true;
}

/* Python's float floor division and modulo: the result takes the divisor's sign. */
static void float_divmod(double x, double y, double *floordiv, double *mod)
{
    double m = fmod(x, y), div = (x - m) / y;
    if (m != 0) {
        if ((y < 0) != (m < 0)) {
            m += y;
            div -= 1.0;
        }
    } else {
        m = copysign(0.0, y);
    }
    double fd;
    if (div != 0) {
        fd = floor(div);
        if (div - fd > 0.5)
            fd += 1.0;
    } else {
        fd = copysign(0.0, x / y);
    }
    *floordiv = fd;
    *mod = m;
}

static bool concat(jrun *R, const tv_str *a, const tv_str *b, tv *out)
{
    if (b->len > TMPL_MAX_STRING - a->len)
        return tmpl_fail(R, "string concatenation longer than the %u MiB limit", TMPL_MAX_STRING >> 20);
    tv_str *s = tmpl_str_alloc(R, a->len + b->len);
    if (!s)
        return false;
    memcpy(s->s, a->s, a->len);
    memcpy(s->s + a->len, b->s, b->len);
    *out = tv_obj_val(TV_STR, s);
    return true;
}

static bool binop(jrun *R, op_kind op, tv a, tv b, tv *out)
{
    if (op == OP_TILDE) {
        if (a.kind == TV_STR && b.kind == TV_STR)
            return concat(R, tv_s(a), tv_s(b), out);
        strbuf s;
        tmpl_sb_init(&s);
        if (!tv_write_str(R, &s, a) || !tv_write_str(R, &s, b)) {
            tmpl_sb_drop(&s);
            return false;
        }
        *out = tmpl_sb_finish(R, &s);
        return !R->failed;
    }
    if (a.kind == TV_UNDEF)
        return tmpl_undef_error(R, a);
    if (b.kind == TV_UNDEF)
        return tmpl_undef_error(R, b);
    bool ints = tv_is_int(a) && tv_is_int(b), nums = tv_is_num(a) && tv_is_num(b);
    int64_t x = ints ? tv_intval(a) : 0, y = ints ? tv_intval(b) : 0, r;
    switch (op) {
    case OP_ADD:
        if (ints) {
            if (__builtin_add_overflow(x, y, &r))
                return tmpl_fail(R, "integer overflow in +");
            *out = tv_int(r);
        } else if (nums) {
            *out = tv_float(tv_num(a) + tv_num(b));
        } else if (a.kind == TV_STR && b.kind == TV_STR) {
            return concat(R, tv_s(a), tv_s(b), out);
        } else if (a.kind == TV_LIST && b.kind == TV_LIST && tv_l(a)->tuple == tv_l(b)->tuple) {
            tv_list *l = tmpl_list_new(R, tv_l(a)->n + tv_l(b)->n, tv_l(a)->tuple);
            for (size_t i = 0; l && i < tv_l(a)->n + tv_l(b)->n; i++) {
                tv item = i < tv_l(a)->n ? tv_l(a)->items[i] : tv_l(b)->items[i - tv_l(a)->n];
                if (!tmpl_list_push(R, l, tv_retain(item))) {
                    tv_release(tv_obj_val(TV_LIST, l));
                    l = NULL;
                }
            }
            if (!l)
                return false;
            *out = tv_obj_val(TV_LIST, l);
        } else if (a.kind == TV_STR || a.kind == TV_LIST) {
            return tmpl_fail(R, "can only concatenate %s (not \"%s\") to %s", tv_type_name(a), tv_type_name(b),
                             tv_type_name(a));
        } else {
            return type_error(R, "+", a, b);
        }
        return true;
    case OP_SUB:
        if (ints) {
            if (__builtin_sub_overflow(x, y, &r))
                return tmpl_fail(R, "integer overflow in -");
            *out = tv_int(r);
        } else if (nums) {
            *out = tv_float(tv_num(a) - tv_num(b));
        } else {
            return type_error(R, "-", a, b);
        }
        return true;
    case OP_MUL:
        if (ints) {
            if (__builtin_mul_overflow(x, y, &r))
                return tmpl_fail(R, "integer overflow in *");
            *out = tv_int(r);
            return true;
        }
        if (nums) {
            *out = tv_float(tv_num(a) * tv_num(b));
            return true;
        }
        if ((a.kind == TV_STR || a.kind == TV_LIST) && tv_is_int(b))
            return repeat(R, a, tv_intval(b), out);
        if ((b.kind == TV_STR || b.kind == TV_LIST) && tv_is_int(a))
            return repeat(R, b, tv_intval(a), out);
        return type_error(R, "*", a, b);
    case OP_DIV:
        if (!nums)
            return type_error(R, "/", a, b);
        if (tv_num(b) == 0)
            return tmpl_fail(R, "division by zero");
        *out = tv_float(tv_num(a) / tv_num(b));
        return true;
    case OP_FLOORDIV:
    case OP_MOD:
        if (op == OP_MOD && a.kind == TV_STR)
            return tmpl_percent_format(R, tv_s(a), b, out);
        if (!nums)
            return type_error(R, op == OP_MOD ? "%" : "//", a, b);
        if (ints) {
            if (y == 0)
                return tmpl_fail(R, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) {
                if (op == OP_FLOORDIV)
                    return tmpl_fail(R, "integer overflow in //");
                *out = tv_int(0);
                return true;
            }
            int64_t q = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) {
                q -= 1;
                m += y;
            }
            *out = tv_int(op == OP_FLOORDIV ? q : m);
        } else {
            if (tv_num(b) == 0)
                return tmpl_fail(R, "float division by zero");
            double fd, m;
            float_divmod(tv_num(a), tv_num(b), &fd, &m);
            *out = tv_float(op == OP_FLOORDIV ? fd : m);
        }
        return true;
    case OP_POW:
        if (!nums)
            return type_error(R, "**", a, b);
        if (ints && y >= 0)
            return int_pow(R, x, y, out);
        if (tv_num(a) == 0 && tv_num(b) < 0)
            return tmpl_fail(R, "0.0 cannot be raised to a negative power");
        if (tv_num(a) < 0 && tv_num(b) != floor(tv_num(b)))
            return tmpl_fail(R, "negative number cannot be raised to a fractional power");
        *out = tv_float(pow(tv_num(a), tv_num(b)));
        return true;
    default: return tmpl_fail(R, "unknown operator");
    }
}

static bool compare_op(jrun *R, op_kind op, tv a, tv b, bool *res)
{
    bool eq;
    int c;
    switch (op) {
    case OP_EQ:
    case OP_NE:
        if (!tv_equal(R, a, b, 0, &eq))
            return false;
        *res = op == OP_EQ ? eq : !eq;
        return true;
    case OP_IN:
    case OP_NOTIN:
        if (!tv_contains(R, b, a, &eq))
            return false;
        *res = op == OP_IN ? eq : !eq;
        return true;
    default:
        if (!tv_compare(R, a, b, &c))
            return false;
        *res = op == OP_LT ? c < 0 : op == OP_LE ? c <= 0 : op == OP_GT ? c > 0 : c >= 0;
        return true;
    }
}

/* ---- calls ---- */

static void free_args(jrun *R, argv_ *a)
{
    for (size_t i = 0; i < a->npos + a->nkw; i++)
        tv_release(a->pos[i]);
    tmpl_heap_free(&R->heap, a->pos, (a->npos + a->nkw) * sizeof(tv));
    a->pos = NULL;
}

static bool eval_args(jrun *R, frame *fr, const call_args *ca, argv_ *a)
{
    size_t total = ca->npos + ca->nkw;
    memset(a, 0, sizeof *a);
    if (!total)
        return true;
    tv *vals = tmpl_heap_alloc(R, total * sizeof(tv));
    if (!vals)
        return false;
    for (size_t i = 0; i < total; i++) {
        if (!eval(R, fr, i < ca->npos ? ca->pos[i] : ca->kwv[i - ca->npos], &vals[i])) {
            for (size_t k = 0; k < i; k++)
                tv_release(vals[k]);
            tmpl_heap_free(&R->heap, vals, total * sizeof(tv));
            return false;
        }
    }
    a->pos = vals;
    a->npos = ca->npos;
    a->kw = ca->kw;
    a->kwv = vals + ca->npos;
    a->nkw = ca->nkw;
    return true;
}

static int exec_body(jrun *R, frame *fr, const body *b);

/* Runs body in fr with output captured into a string. */
static int capture(jrun *R, frame *fr, const body *b, tv *out)
{
    strbuf buf;
    tmpl_sb_init(&buf);
    strbuf *saved = R->out;
    R->out = &buf;
    int st = exec_body(R, fr, b);
    R->out = saved;
    if (st != ST_OK) {
        /* an error, or break/continue leaving a block set inside a loop */
        tmpl_sb_drop(&buf);
        return st;
    }
    *out = tmpl_sb_finish(R, &buf);
    return R->failed ? ST_ERR : ST_OK;
}

static bool bind_params(jrun *R, const macro *m, frame *f, argv_ *a)
{
    if (a->npos > m->nparams)
        return tmpl_fail(R, "macro '%s' takes not more than %zu argument(s)", m->name, m->nparams);
    for (size_t k = 0; k < a->nkw; k++) {
        size_t p = 0;
        while (p < m->nparams && strcmp(m->params[p], a->kw[k]))
            p++;
        if (p == m->nparams)
            return tmpl_fail(R, "macro '%s' takes no keyword argument '%s'", m->name, a->kw[k]);
        if (p < a->npos)
            return tmpl_fail(R, "macro '%s' got multiple values for argument '%s'", m->name, a->kw[k]);
    }
    for (size_t p = 0; p < m->nparams; p++) {
        tv v = tv_undef(UNDEF_NAME, m->params[p], 0);
        bool given = p < a->npos;
        if (given)
            v = tv_retain(a->pos[p]);
        for (size_t k = 0; !given && k < a->nkw; k++) {
            if (!strcmp(m->params[p], a->kw[k])) {
                v = tv_retain(a->kwv[k]);
                given = true;
            }
        }
        if (!given && m->defaults && m->defaults[p] && !eval(R, f, m->defaults[p], &v))
            return false;
        if (!frame_set(R, f, tmpl_name_key(m->params[p]), v))
            return false;
    }
    return true;
}

static bool call_macro(jrun *R, const macro *m, frame *parent, argv_ *a, tv caller, tv *out)
{
    if (R->macro_depth >= TMPL_MAX_MACRO_DEPTH)
        return tmpl_fail(R, "macro calls nested more than %d deep (runaway recursion?)", TMPL_MAX_MACRO_DEPTH);
    frame f = {parent, NULL};
    bool ok = bind_params(R, m, &f, a);
    if (ok && caller.kind == TV_CALLER)
        ok = frame_set(R, &f, tv_obj_val(TV_STR, R->t->caller_key), tv_retain(caller));
    if (ok) {
        int line = R->line;
        R->macro_depth++;
        ok = capture(R, &f, &m->body, out) != ST_ERR;
        R->macro_depth--;
        R->line = line;
    }
    frame_release(&f);
    return ok;
}

bool tmpl_call(jrun *R, tv callee, const char *what, argv_ *a, tv *out)
{
    switch (callee.kind) {
    case TV_MACRO: return call_macro(R, callee.u.macro, R->root, a, tv_none(), out);
    case TV_CALLER: {
        tv_caller *c = (tv_caller *)callee.u.o;
        if (!c->alive)
            return tmpl_fail(R, "caller() used after its call block has finished");
        return call_macro(R, c->block->u.call_block.caller, c->frame, a, tv_none(), out);
    }
    case TV_FUNC: return tmpl_call_global(R, callee.u.func, a, out);
    case TV_UNDEF: return tmpl_undef_error(R, callee);
    default:
        return tmpl_fail(R, "'%s' object is not callable%s%s", tv_type_name(callee), what ? ": " : "",
                         what ? what : "");
    }
}

static bool eval_call(jrun *R, frame *fr, const expr *e, tv *out)
{
    const expr *callee = e->u.call.callee;
    argv_ a;
    tv fn, obj = tv_none();
    bool ok;
    if (callee->kind == E_ATTR) {
        /* obj.method(...): Python methods of the object come first */
        if (!eval(R, fr, callee->u.attr.obj, &obj))
            return false;
        if (obj.kind == TV_UNDEF) {
            ok = tmpl_undef_error(R, obj);
            tv_release(obj);
            return ok;
        }
        if (!eval_args(R, fr, &e->u.call.args, &a)) {
            tv_release(obj);
            return false;
        }
        R->line = e->line;
        bool found = false;
        ok = tmpl_call_method(R, obj, callee->u.attr.name, &a, out, &found);
        if (ok && !found) {
            ok = tmpl_getattr(R, obj, callee->u.attr.name, &fn);
            if (ok) {
                ok = tmpl_call(R, fn, callee->u.attr.name, &a, out);
                tv_release(fn);
            }
        }
        free_args(R, &a);
        tv_release(obj);
        return ok;
    }
    if (!eval(R, fr, callee, &fn))
        return false;
    if (!eval_args(R, fr, &e->u.call.args, &a)) {
        tv_release(fn);
        return false;
    }
    R->line = e->line;
    ok = tmpl_call(R, fn, callee->kind == E_NAME ? callee->u.name : NULL, &a, out);
    free_args(R, &a);
    tv_release(fn);
    return ok;
}

static bool apply_filter_expr(jrun *R, frame *fr, const expr *f, tv input, tv *out)
{
    argv_ a;
    if (!eval_args(R, fr, &f->u.filter.args, &a))
        return false;
    R->line = f->line;
    bool ok = tmpl_apply_filter(R, f->u.filter.id, f->u.filter.name, input, &a, out);
    free_args(R, &a);
    return ok;
}

/* Takes ownership of v. */
static bool apply_filters(jrun *R, frame *fr, expr *const *filters, size_t n, tv v, tv *out)
{
    for (size_t i = 0; i < n; i++) {
        tv next;
        bool ok = apply_filter_expr(R, fr, filters[i], v, &next);
        tv_release(v);
        if (!ok)
            return false;
        v = next;
    }
    *out = v;
    return true;
}

/* ---- expressions ---- */

static bool eval_seq(jrun *R, frame *fr, const expr *e, tv *out)
{
    if (e->kind == E_DICT) {
        tv_dict *d = tmpl_dict_new(R);
        for (size_t i = 0; d && i < e->u.dict.n; i++) {
            tv k, v;
            if (!eval(R, fr, e->u.dict.keys[i], &k))
                goto dict_fail;
            if (!tv_hashable(k)) {
                tmpl_fail(R, "unhashable type: '%s'", tv_type_name(k));
                tv_release(k);
                goto dict_fail;
            }
            if (!eval(R, fr, e->u.dict.vals[i], &v)) {
                tv_release(k);
                goto dict_fail;
            }
            if (!tmpl_dict_set(R, d, k, v))
                goto dict_fail;
        }
        if (!d)
            return false;
        *out = tv_obj_val(TV_DICT, d);
        return true;
    dict_fail:
        tv_release(tv_obj_val(TV_DICT, d));
        return false;
    }
    tv_list *l = tmpl_list_new(R, e->u.list.n, e->kind == E_TUPLE);
    for (size_t i = 0; l && i < e->u.list.n; i++) {
        tv v;
        if (!eval(R, fr, e->u.list.items[i], &v) || !tmpl_list_push(R, l, v)) {
            tv_release(tv_obj_val(TV_LIST, l));
            return false;
        }
    }
    if (!l)
        return false;
    *out = tv_obj_val(TV_LIST, l);
    return true;
}

static bool eval_inner(jrun *R, frame *fr, const expr *e, tv *out)
{
    tv a, b;
    bool ok, res;
    switch (e->kind) {
    case E_CONST: *out = tv_retain(e->u.constant); return true;
    case E_NAME:
        if (lookup(R, fr, e->u.name, &a))
            *out = tv_retain(a);
        else
            *out = tv_undef(UNDEF_NAME, e->u.name, 0);
        return true;
    case E_LIST:
    case E_TUPLE:
    case E_DICT: return eval_seq(R, fr, e, out);
    case E_ATTR:
        if (!eval(R, fr, e->u.attr.obj, &a))
            return false;
        R->line = e->line;
        ok = tmpl_getattr(R, a, e->u.attr.name, out);
        tv_release(a);
        return ok;
    case E_ITEM:
        if (!eval(R, fr, e->u.item.obj, &a))
            return false;
        if (!eval(R, fr, e->u.item.index, &b)) {
            tv_release(a);
            return false;
        }
        R->line = e->line;
        ok = tmpl_getitem(R, a, b, out);
        tv_release(a);
        tv_release(b);
        return ok;
    case E_SLICE: return eval_slice(R, fr, e, out);
    case E_CALL: return eval_call(R, fr, e, out);
    case E_FILTER:
        if (!eval(R, fr, e->u.filter.operand, &a))
            return false;
        ok = apply_filter_expr(R, fr, e, a, out);
        tv_release(a);
        return ok;
    case E_TEST: {
        argv_ args;
        if (!eval(R, fr, e->u.test.operand, &a))
            return false;
        if (!eval_args(R, fr, &e->u.test.args, &args)) {
            tv_release(a);
            return false;
        }
        R->line = e->line;
        ok = tmpl_apply_test(R, e->u.test.id, e->u.test.name, a, &args, &res);
        free_args(R, &args);
        tv_release(a);
        if (ok)
            *out = tv_bool(res != e->u.test.negated);
        return ok;
    }
    case E_NEG:
    case E_POS:
        if (!eval(R, fr, e->u.bin.l, &a))
            return false;
        R->line = e->line;
        if (a.kind == TV_UNDEF) {
            tmpl_undef_error(R, a);
            return false;
        }
        if (!tv_is_num(a)) {
            tmpl_fail(R, "bad operand type for unary %c: '%s'", e->kind == E_NEG ? '-' : '+', tv_type_name(a));
            tv_release(a);
            return false;
        }
        if (e->kind == E_POS)
            *out = a.kind == TV_BOOL ? tv_int(a.u.b) : a;
        else if (a.kind == TV_FLOAT)
            *out = tv_float(-a.u.f);
        else if (tv_intval(a) == INT64_MIN)
            return tmpl_fail(R, "integer overflow in unary -");
        else
            *out = tv_int(-tv_intval(a));
        return true;
    case E_NOT:
        if (!eval(R, fr, e->u.bin.l, &a))
            return false;
        *out = tv_bool(!tv_truthy(a));
        tv_release(a);
        return true;
    case E_AND:
    case E_OR:
        if (!eval(R, fr, e->u.bin.l, &a))
            return false;
        if (tv_truthy(a) == (e->kind == E_OR)) {
            *out = a;
            return true;
        }
        tv_release(a);
        return eval(R, fr, e->u.bin.r, out);
    case E_BINOP:
        if (!eval(R, fr, e->u.bin.l, &a))
            return false;
        if (!eval(R, fr, e->u.bin.r, &b)) {
            tv_release(a);
            return false;
        }
        R->line = e->line;
        ok = binop(R, e->u.bin.op, a, b, out);
        tv_release(a);
        tv_release(b);
        return ok;
    case E_COMPARE:
        if (!eval(R, fr, e->u.cmp.first, &a))
            return false;
        res = true;
        for (size_t i = 0; res && i < e->u.cmp.n; i++) {
            if (!eval(R, fr, e->u.cmp.rhs[i], &b)) {
                tv_release(a);
                return false;
            }
            R->line = e->line;
            ok = compare_op(R, e->u.cmp.ops[i], a, b, &res);
            tv_release(a);
            a = b;
            if (!ok) {
                tv_release(a);
                return false;
            }
        }
        tv_release(a);
        *out = tv_bool(res);
        return true;
    case E_COND:
        if (!eval(R, fr, e->u.cond.cond, &a))
            return false;
        res = tv_truthy(a);
        tv_release(a);
        if (res)
            return eval(R, fr, e->u.cond.then, out);
        if (e->u.cond.otherwise)
            return eval(R, fr, e->u.cond.otherwise, out);
        *out = tv_undef(UNDEF_NO_ELSE, NULL, 0);
        return true;
    }
    return tmpl_fail(R, "unknown expression");
}

static bool eval(jrun *R, frame *fr, const expr *e, tv *out)
{
    R->line = e->line;
    if (R->depth >= TMPL_MAX_EVAL_DEPTH)
        return tmpl_fail(R, "template recursion deeper than %d levels", TMPL_MAX_EVAL_DEPTH);
    if (!tmpl_charge(R, 1))
        return false;
    R->depth++;
    bool ok = eval_inner(R, fr, e, out);
    R->depth--;
    return ok;
}

/* ---- statements ---- */

/* Takes ownership of v. */
static bool bind_target(jrun *R, frame *f, const target *t, tv v)
{
    if (t->name)
        return frame_set(R, f, tmpl_name_key(t->name), v);
    tv_list *parts;
    bool ok = tmpl_iterate(R, v, &parts);
    tv_release(v);
    if (!ok)
        return false;
    if (parts->n != t->n) {
        ok = parts->n > t->n ? tmpl_fail(R, "too many values to unpack (expected %zu)", t->n)
                             : tmpl_fail(R, "not enough values to unpack (expected %zu, got %zu)", t->n, parts->n);
    }
    for (size_t i = 0; ok && i < t->n; i++)
        ok = bind_target(R, f, &t->items[i], tv_retain(parts->items[i]));
    tv_release(tv_obj_val(TV_LIST, parts));
    return ok;
}

static int exec_for(jrun *R, frame *fr, const stmt *s)
{
    tv it;
    tv_list *items;
    if (!eval(R, fr, s->u.for_.iter, &it))
        return ST_ERR;
    bool ok = tmpl_iterate(R, it, &items);
    tv_release(it);
    if (!ok)
        return ST_ERR;
    if (s->u.for_.filter) {
        tv_list *kept = tmpl_list_new(R, 0, false);
        for (size_t i = 0; kept && i < items->n; i++) {
            frame f = {fr, NULL};
            tv cond;
            ok = bind_target(R, &f, &s->u.for_.tgt, tv_retain(items->items[i])) && eval(R, &f, s->u.for_.filter, &cond);
            frame_release(&f);
            if (ok) {
                bool keep = tv_truthy(cond);
                tv_release(cond);
                ok = !keep || tmpl_list_push(R, kept, tv_retain(items->items[i]));
            }
            if (!ok) {
                tv_release(tv_obj_val(TV_LIST, kept));
                kept = NULL;
            }
        }
        tv_release(tv_obj_val(TV_LIST, items));
        if (!kept)
            return ST_ERR;
        items = kept;
    }
    int st = ST_OK;
    if (!items->n) {
        if (s->u.for_.otherwise.n) {
            frame f = {fr, NULL};
            st = exec_body(R, &f, &s->u.for_.otherwise);
            frame_release(&f);
        }
        tv_release(tv_obj_val(TV_LIST, items));
        return st;
    }
    tv_loop *lp = tmpl_loop_new(R, items);
    tv_release(tv_obj_val(TV_LIST, items));
    if (!lp)
        return ST_ERR;
    /* one frame for all iterations, emptied between them: each iteration starts afresh */
    frame f = {fr, NULL};
    for (size_t i = 0; i < lp->items->n; i++) {
        lp->i = i;
        R->line = s->line;
        if (f.vars)
            tmpl_dict_clear(f.vars);
        if (!tmpl_charge(R, 1) || !bind_target(R, &f, &s->u.for_.tgt, tv_retain(lp->items->items[i])) ||
            !frame_set(R, &f, tv_obj_val(TV_STR, R->t->loop_key), tv_retain(tv_obj_val(TV_LOOP, lp))))
            st = ST_ERR;
        else
            st = exec_body(R, &f, &s->u.for_.body);
        if (st == ST_ERR || st == ST_BREAK)
            break;
    }
    frame_release(&f);
    tv_release(tv_obj_val(TV_LOOP, lp));
    return st == ST_ERR ? ST_ERR : ST_OK;
}

static bool set_ns_attr(jrun *R, frame *fr, const char *ns_name, const char *attr, tv v)
{
    tv ns;
    if (!lookup(R, fr, ns_name, &ns) || ns.kind != TV_NS) {
        tv_release(v);
        return tmpl_fail(R, "cannot assign attribute '%s' on '%s': not a namespace", attr, ns_name);
    }
    return tmpl_dict_set(R, ((tv_ns *)ns.u.o)->attrs, tmpl_name_key(attr), v);
}

static bool emit_value(jrun *R, tv v)
{
    bool ok = tv_write_str(R, R->out, v);
    tv_release(v);
    return ok;
}

static int exec_stmt(jrun *R, frame *fr, const stmt *s)
{
    tv v;
    int st;
    R->line = s->line;
    switch (s->kind) {
    case S_TEXT: return tmpl_sb_put(R, R->out, s->u.text.s, s->u.text.len) ? ST_OK : ST_ERR;
    case S_OUTPUT: return eval(R, fr, s->u.output, &v) && emit_value(R, v) ? ST_OK : ST_ERR;
    case S_IF:
        for (size_t i = 0; i < s->u.if_.n; i++) {
            if (!eval(R, fr, s->u.if_.conds[i], &v))
                return ST_ERR;
            bool t = tv_truthy(v);
            tv_release(v);
            if (t)
                return exec_body(R, fr, &s->u.if_.bodies[i]);
        }
        return exec_body(R, fr, &s->u.if_.otherwise);
    case S_FOR: return exec_for(R, fr, s);
    case S_SET: return eval(R, fr, s->u.set.value, &v) && bind_target(R, fr, &s->u.set.tgt, v) ? ST_OK : ST_ERR;
    case S_SET_NS:
        return eval(R, fr, s->u.set_ns.value, &v) && set_ns_attr(R, fr, s->u.set_ns.ns, s->u.set_ns.attr, v)
                   ? ST_OK
                   : ST_ERR;
    case S_SET_BLOCK: {
        frame f = {fr, NULL};
        st = capture(R, &f, &s->u.set_block.body, &v);
        frame_release(&f);
        if (st != ST_OK)
            return st;
        if (!apply_filters(R, fr, s->u.set_block.filters, s->u.set_block.nfilters, v, &v))
            return ST_ERR;
        if (s->u.set_block.ns)
            return set_ns_attr(R, fr, s->u.set_block.ns, s->u.set_block.attr, v) ? ST_OK : ST_ERR;
        return bind_target(R, fr, &s->u.set_block.tgt, v) ? ST_OK : ST_ERR;
    }
    case S_MACRO:
        return frame_set(R, fr, tmpl_name_key(s->u.macro->name), (tv){TV_MACRO, 0, 0, {.macro = s->u.macro}})
                   ? ST_OK
                   : ST_ERR;
    case S_CALL_BLOCK: {
        const expr *call = s->u.call_block.call;
        tv fn;
        argv_ a;
        if (!eval(R, fr, call->u.call.callee, &fn))
            return ST_ERR;
        if (fn.kind != TV_MACRO) {
            tmpl_fail(R, "{%% call %%} needs a macro, got '%s'", tv_type_name(fn));
            tv_release(fn);
            return ST_ERR;
        }
        if (!eval_args(R, fr, &call->u.call.args, &a))
            return ST_ERR;
        tv_caller *c = tmpl_caller_new(R, s, fr);
        bool ok = c && call_macro(R, fn.u.macro, R->root, &a, tv_obj_val(TV_CALLER, c), &v);
        if (c) {
            c->alive = false;
            tv_release(tv_obj_val(TV_CALLER, c));
        }
        free_args(R, &a);
        return ok && emit_value(R, v) ? ST_OK : ST_ERR;
    }
    case S_FILTER_BLOCK: {
        frame f = {fr, NULL};
        st = capture(R, &f, &s->u.filter_block.body, &v);
        frame_release(&f);
        if (st != ST_OK)
            return st;
        return apply_filters(R, fr, s->u.filter_block.filters, s->u.filter_block.nfilters, v, &v) && emit_value(R, v)
                   ? ST_OK
                   : ST_ERR;
    }
    case S_WITH: {
        frame f = {fr, NULL};
        bool ok = true;
        for (size_t i = 0; ok && i < s->u.with.n; i++)
            ok = eval(R, fr, s->u.with.vals[i], &v) && frame_set(R, &f, tmpl_name_key(s->u.with.names[i]), v);
        st = ok ? exec_body(R, &f, &s->u.with.body) : ST_ERR;
        frame_release(&f);
        return st;
    }
    case S_SCOPE: {
        frame f = {fr, NULL};
        st = exec_body(R, &f, &s->u.scope);
        frame_release(&f);
        return st;
    }
    case S_BREAK: return ST_BREAK;
    case S_CONTINUE: return ST_CONTINUE;
    }
    tmpl_fail(R, "unknown statement");
    return ST_ERR;
}

static int exec_body(jrun *R, frame *fr, const body *b)
{
    if (R->depth >= TMPL_MAX_EVAL_DEPTH) {
        tmpl_fail(R, "template recursion deeper than %d levels", TMPL_MAX_EVAL_DEPTH);
        return ST_ERR;
    }
    R->depth++;
    int st = ST_OK;
    for (size_t i = 0; st == ST_OK && i < b->n; i++) {
        if (!tmpl_charge(R, 1)) {
            st = ST_ERR;
            break;
        }
        st = exec_stmt(R, fr, b->items[i]);
    }
    R->depth--;
    return st;
}

int tmpl_exec(jrun *R, frame *fr, const body *b) { return exec_body(R, fr, b) == ST_ERR ? -1 : 0; }

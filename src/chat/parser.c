/* Tokens -> syntax tree, following the grammar of Jinja's reference parser (its operator
 * precedence, where filters and tests bind, which tags exist). Depth is bounded twice:
 * the parser's own recursion, and the depth of the finished tree (a long chain like
 * a+a+a+... is built by a loop but evaluated recursively). */
#include "chat/jinja.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct parser {
    const token *t;
    size_t pos, n;
    arena *a;
    blade_error *err;
    int depth;
    int loop_depth;
    bool failed;
} parser;

typedef struct vec {
    void **items;
    size_t n, cap;
} vec;

static void fail(parser *P, int line, const char *fmt, ...) BLADE_PRINTF(3, 4);
static void fail(parser *P, int line, const char *fmt, ...)
{
    if (P->failed)
        return;
    P->failed = true;
    char msg[BLADE_ERROR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    blade_error_set(P->err, "template syntax error, line %d: %s", line, msg);
}

static bool push(parser *P, vec *v, void *item)
{
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 8;
        void **items = realloc(v->items, cap * sizeof *items);
        if (!items) {
            fail(P, 0, "out of memory");
            return false;
        }
        v->items = items;
        v->cap = cap;
    }
    v->items[v->n++] = item;
    return true;
}

/* Moves the collected pointers into the arena; the vector is freed either way. */
static void **settle(parser *P, vec *v)
{
    void **out = NULL;
    if (!P->failed && v->n) {
        out = tmpl_arena_alloc(P->a, v->n * sizeof *out);
        if (out)
            memcpy(out, v->items, v->n * sizeof *out);
        else
            fail(P, 0, "out of memory");
    }
    free(v->items);
    v->items = NULL;
    return out;
}

static const token *cur(const parser *P) { return &P->t[P->pos]; }
static const token *look(const parser *P) { return P->pos + 1 < P->n ? &P->t[P->pos + 1] : &P->t[P->n - 1]; }
static void next(parser *P)
{
    if (P->pos + 1 < P->n)
        P->pos++;
}
static bool is_op(const token *t, op_kind op) { return t->kind == T_OP && t->op == op; }
static bool is_name(const token *t, const char *name) { return t->kind == T_NAME && !strcmp(t->str, name); }

static const char *describe(const token *t)
{
    switch (t->kind) {
    case T_EOF: return "end of template";
    case T_TEXT: return "template text";
    case T_VAR_BEGIN: return "'{{'";
    case T_VAR_END: return "end of print statement";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "end of statement block";
    case T_NAME: return t->str;
    case T_STRING: return "string";
    case T_INT: return "integer";
    case T_FLOAT: return "float";
    case T_OP: return t->str;
    }
    return "token";
}

static bool expect_op(parser *P, op_kind op, const char *what)
{
    if (P->failed)
        return false;
    if (!is_op(cur(P), op)) {
        fail(P, cur(P)->line, "expected '%s', got '%s'", what, describe(cur(P)));
        return false;
    }
    next(P);
    return true;
}

static const char *expect_name(parser *P)
{
    if (P->failed)
        return NULL;
    if (cur(P)->kind != T_NAME) {
        fail(P, cur(P)->line, "expected a name, got '%s'", describe(cur(P)));
        return NULL;
    }
    const char *s = cur(P)->str;
    next(P);
    return s;
}

static bool expect_kind(parser *P, tok_kind kind)
{
    if (P->failed)
        return false;
    if (cur(P)->kind != kind) {
        fail(P, cur(P)->line, "expected %s, got '%s'", kind == T_BLOCK_END ? "end of statement block ('%}')"
                                                                         : "end of print statement ('}}')",
             describe(cur(P)));
        return false;
    }
    next(P);
    return true;
}

static bool enter(parser *P)
{
    if (++P->depth > TMPL_MAX_AST_DEPTH) {
        fail(P, cur(P)->line, "template nested too deeply (limit %d levels)", TMPL_MAX_AST_DEPTH);
        return false;
    }
    return true;
}

static expr *new_expr(parser *P, expr_kind kind, int line)
{
    if (P->failed)
        return NULL;
    expr *e = tmpl_arena_alloc(P->a, sizeof *e);
    if (!e) {
        fail(P, line, "out of memory");
        return NULL;
    }
    e->kind = kind;
    e->line = line;
    e->depth = 1;
    return e;
}

/* Records that child hangs below e; the tree's depth is what evaluation will recurse. */
static bool below(parser *P, expr *e, const expr *child)
{
    if (!child)
        return true;
    if (child->depth + 1 > e->depth)
        e->depth = child->depth + 1;
    if (e->depth > TMPL_MAX_AST_DEPTH) {
        fail(P, e->line, "expression nested too deeply (limit %d levels)", TMPL_MAX_AST_DEPTH);
        return false;
    }
    return true;
}

static bool below_args(parser *P, expr *e, const call_args *a)
{
    for (size_t i = 0; i < a->npos; i++)
        if (!below(P, e, a->pos[i]))
            return false;
    for (size_t i = 0; i < a->nkw; i++)
        if (!below(P, e, a->kwv[i]))
            return false;
    return true;
}

static expr *parse_expression(parser *P, bool with_condexpr);
static expr *parse_tuple(parser *P, bool simplified, bool with_condexpr, const char *extra_end, bool explicit_parens);
static expr *parse_primary(parser *P);
static expr *parse_postfix(parser *P, expr *node);
static expr *parse_unary(parser *P, bool with_filter);

static bool parse_call_args(parser *P, call_args *out)
{
    int line = cur(P)->line;
    if (!expect_op(P, OP_LPAREN, "("))
        return false;
    vec pos = {0}, kw = {0}, kwv = {0};
    bool comma = false;
    while (!P->failed && !is_op(cur(P), OP_RPAREN)) {
        if (comma) {
            if (!expect_op(P, OP_COMMA, ","))
                break;
            if (is_op(cur(P), OP_RPAREN))
                break;
        }
        if (is_op(cur(P), OP_MUL) || is_op(cur(P), OP_POW)) {
            fail(P, cur(P)->line, "*args and **kwargs in calls are not supported");
            break;
        }
        if (cur(P)->kind == T_NAME && is_op(look(P), OP_ASSIGN)) {
            const char *name = cur(P)->str;
            next(P);
            next(P);
            expr *v = parse_expression(P, true);
            if (!v || !push(P, &kw, (void *)name) || !push(P, &kwv, v))
                break;
        } else {
            if (kw.n) {
                fail(P, line, "invalid syntax for function call expression");
                break;
            }
            expr *v = parse_expression(P, true);
            if (!v || !push(P, &pos, v))
                break;
        }
        comma = true;
    }
    out->npos = pos.n;
    out->nkw = kw.n;
    out->pos = (expr **)settle(P, &pos);
    out->kw = (const char **)settle(P, &kw);
    out->kwv = (expr **)settle(P, &kwv);
    return expect_op(P, OP_RPAREN, ")");
}

static const char *dotted_name(parser *P)
{
    const char *name = expect_name(P);
    while (name && is_op(cur(P), OP_DOT)) {
        next(P);
        const char *part = expect_name(P);
        if (!part)
            return NULL;
        size_t a = strlen(name), b = strlen(part);
        char *joined = tmpl_arena_alloc(P->a, a + b + 2);
        if (!joined) {
            fail(P, cur(P)->line, "out of memory");
            return NULL;
        }
        memcpy(joined, name, a);
        joined[a] = '.';
        memcpy(joined + a + 1, part, b + 1);
        name = joined;
    }
    return name;
}

/* One `|name(args)`; operand may be NULL for filter blocks. */
static expr *parse_one_filter(parser *P, expr *operand)
{
    int line = cur(P)->line;
    const char *name = dotted_name(P);
    if (!name)
        return NULL;
    int id = tmpl_filter_id(name);
    if (id < 0) {
        fail(P, line, "no filter named '%s'", name);
        return NULL;
    }
    expr *e = new_expr(P, E_FILTER, line);
    if (!e)
        return NULL;
    e->u.filter.operand = operand;
    e->u.filter.id = id;
    e->u.filter.name = name;
    if (is_op(cur(P), OP_LPAREN) && !parse_call_args(P, &e->u.filter.args))
        return NULL;
    if (!below(P, e, operand) || !below_args(P, e, &e->u.filter.args))
        return NULL;
    return e;
}

static expr *parse_test(parser *P, expr *operand)
{
    int line = cur(P)->line;
    next(P); /* is */
    bool negated = false;
    if (is_name(cur(P), "not")) {
        negated = true;
        next(P);
    }
    const char *name = dotted_name(P);
    if (!name)
        return NULL;
    int id = tmpl_test_id(name);
    if (id < 0) {
        fail(P, line, "no test named '%s'", name);
        return NULL;
    }
    expr *e = new_expr(P, E_TEST, line);
    if (!e)
        return NULL;
    e->u.test.operand = operand;
    e->u.test.id = id;
    e->u.test.name = name;
    e->u.test.negated = negated;
    const token *t = cur(P);
    if (is_op(t, OP_LPAREN)) {
        if (!parse_call_args(P, &e->u.test.args))
            return NULL;
    } else if ((t->kind == T_NAME || t->kind == T_STRING || t->kind == T_INT || t->kind == T_FLOAT ||
                is_op(t, OP_LBRACKET) || is_op(t, OP_LBRACE)) &&
               !is_name(t, "else") && !is_name(t, "or") && !is_name(t, "and")) {
        if (is_name(t, "is")) {
            fail(P, t->line, "you cannot chain multiple tests with is");
            return NULL;
        }
        /* `x is divisibleby 3`, `x is equalto 'user'`: one argument without parentheses */
        expr *arg = parse_primary(P);
        if (!arg || !(arg = parse_postfix(P, arg)))
            return NULL;
        expr **args = tmpl_arena_alloc(P->a, sizeof *args);
        if (!args) {
            fail(P, line, "out of memory");
            return NULL;
        }
        args[0] = arg;
        e->u.test.args.pos = args;
        e->u.test.args.npos = 1;
    }
    if (!below(P, e, operand) || !below_args(P, e, &e->u.test.args))
        return NULL;
    return e;
}

static expr *parse_call(parser *P, expr *callee)
{
    expr *e = new_expr(P, E_CALL, cur(P)->line);
    if (!e)
        return NULL;
    e->u.call.callee = callee;
    if (!parse_call_args(P, &e->u.call.args) || !below(P, e, callee) || !below_args(P, e, &e->u.call.args))
        return NULL;
    return e;
}

static expr *parse_subscripted(parser *P)
{
    int line = cur(P)->line;
    expr *parts[3] = {0};
    if (!is_op(cur(P), OP_COLON)) {
        expr *first = parse_expression(P, true);
        if (!first || !is_op(cur(P), OP_COLON))
            return first;
        parts[0] = first;
    }
    next(P); /* the first colon */
    if (!is_op(cur(P), OP_COLON) && !is_op(cur(P), OP_RBRACKET) && !is_op(cur(P), OP_COMMA))
        if (!(parts[1] = parse_expression(P, true)))
            return NULL;
    if (is_op(cur(P), OP_COLON)) {
        next(P);
        if (!is_op(cur(P), OP_RBRACKET) && !is_op(cur(P), OP_COMMA))
            if (!(parts[2] = parse_expression(P, true)))
                return NULL;
    }
    expr *e = new_expr(P, E_SLICE, line);
    if (!e)
        return NULL;
    e->u.slice.start = parts[0];
    e->u.slice.stop = parts[1];
    e->u.slice.step = parts[2];
    for (int i = 0; i < 3; i++)
        if (!below(P, e, parts[i]))
            return NULL;
    return e;
}

static expr *parse_subscript(parser *P, expr *node)
{
    const token *t = cur(P);
    int line = t->line;
    next(P);
    if (t->op == OP_DOT) {
        const token *a = cur(P);
        next(P);
        if (a->kind == T_NAME) {
            expr *e = new_expr(P, E_ATTR, line);
            if (!e)
                return NULL;
            e->u.attr.obj = node;
            e->u.attr.name = a->str;
            return below(P, e, node) ? e : NULL;
        }
        if (a->kind != T_INT) {
            fail(P, a->line, "expected a name or number after '.', got '%s'", describe(a));
            return NULL;
        }
        expr *idx = new_expr(P, E_CONST, line), *e = new_expr(P, E_ITEM, line);
        if (!idx || !e)
            return NULL;
        idx->u.constant = tv_int(a->ival);
        e->u.item.obj = node;
        e->u.item.index = idx;
        return below(P, e, node) ? e : NULL;
    }
    if (is_op(cur(P), OP_RBRACKET)) {
        fail(P, line, "expected an index inside '[]'");
        return NULL;
    }
    expr *sub = parse_subscripted(P);
    if (!sub)
        return NULL;
    if (is_op(cur(P), OP_COMMA)) {
        fail(P, line, "subscripts with several indices are not supported");
        return NULL;
    }
    if (!expect_op(P, OP_RBRACKET, "]"))
        return NULL;
    if (sub->kind == E_SLICE) {
        sub->u.slice.obj = node;
        return below(P, sub, node) ? sub : NULL;
    }
    expr *e = new_expr(P, E_ITEM, line);
    if (!e)
        return NULL;
    e->u.item.obj = node;
    e->u.item.index = sub;
    return below(P, e, node) && below(P, e, sub) ? e : NULL;
}

static expr *parse_postfix(parser *P, expr *node)
{
    while (node) {
        if (is_op(cur(P), OP_DOT) || is_op(cur(P), OP_LBRACKET))
            node = parse_subscript(P, node);
        else if (is_op(cur(P), OP_LPAREN))
            node = parse_call(P, node);
        else
            break;
    }
    return node;
}

static expr *parse_filter_expr(parser *P, expr *node)
{
    while (node) {
        if (is_op(cur(P), OP_PIPE)) {
            next(P);
            node = parse_one_filter(P, node);
        } else if (is_name(cur(P), "is")) {
            node = parse_test(P, node);
        } else if (is_op(cur(P), OP_LPAREN)) {
            node = parse_call(P, node);
        } else {
            break;
        }
    }
    return node;
}

static expr *parse_seq(parser *P, expr_kind kind, op_kind close, const char *close_s)
{
    int line = cur(P)->line;
    next(P);
    vec keys = {0}, vals = {0};
    while (!P->failed && !is_op(cur(P), close)) {
        if (vals.n && (!expect_op(P, OP_COMMA, ",") || is_op(cur(P), close)))
            break;
        if (kind == E_DICT) {
            expr *k = parse_expression(P, true);
            if (!k || !expect_op(P, OP_COLON, ":") || !push(P, &keys, k))
                break;
        }
        expr *v = parse_expression(P, true);
        if (!v || !push(P, &vals, v))
            break;
    }
    expr *e = new_expr(P, kind, line);
    size_t n = vals.n;
    expr **k = (expr **)settle(P, &keys), **v = (expr **)settle(P, &vals);
    if (!e || !expect_op(P, close, close_s))
        return NULL;
    if (kind == E_DICT) {
        e->u.dict.keys = k;
        e->u.dict.vals = v;
        e->u.dict.n = n;
    } else {
        e->u.list.items = v;
        e->u.list.n = n;
    }
    for (size_t i = 0; i < n; i++)
        if (!below(P, e, v[i]) || (k && !below(P, e, k[i])))
            return NULL;
    return e;
}

static expr *parse_primary(parser *P)
{
    if (P->failed)
        return NULL;
    const token *t = cur(P);
    expr *e;
    switch (t->kind) {
    case T_NAME:
        next(P);
        if (!strcmp(t->str, "true") || !strcmp(t->str, "True") || !strcmp(t->str, "false") ||
            !strcmp(t->str, "False")) {
            if ((e = new_expr(P, E_CONST, t->line)))
                e->u.constant = tv_bool(t->str[0] == 't' || t->str[0] == 'T');
        } else if (!strcmp(t->str, "none") || !strcmp(t->str, "None")) {
            if ((e = new_expr(P, E_CONST, t->line)))
                e->u.constant = tv_none();
        } else if ((e = new_expr(P, E_NAME, t->line))) {
            e->u.name = t->str;
        }
        return e;
    case T_STRING: {
        /* adjacent literals concatenate, as in Python */
        size_t total = 0, first = P->pos;
        while (cur(P)->kind == T_STRING) {
            total += cur(P)->len;
            next(P);
        }
        char *buf = tmpl_arena_alloc(P->a, total + 1);
        if (!buf || !(e = new_expr(P, E_CONST, t->line))) {
            fail(P, t->line, "out of memory");
            return NULL;
        }
        size_t o = 0;
        for (size_t i = first; i < P->pos; i++) {
            memcpy(buf + o, P->t[i].str, P->t[i].len);
            o += P->t[i].len;
        }
        tv_str *s = tmpl_str_immortal(P->a, buf, total);
        if (!s) {
            fail(P, t->line, "out of memory");
            return NULL;
        }
        e->u.constant = tv_obj_val(TV_STR, s);
        return e;
    }
    case T_INT:
    case T_FLOAT:
        next(P);
        if ((e = new_expr(P, E_CONST, t->line)))
            e->u.constant = t->kind == T_INT ? tv_int(t->ival) : tv_float(t->fval);
        return e;
    case T_OP:
        if (t->op == OP_LPAREN) {
            next(P);
            e = parse_tuple(P, false, true, NULL, true);
            return expect_op(P, OP_RPAREN, ")") ? e : NULL;
        }
        if (t->op == OP_LBRACKET)
            return parse_seq(P, E_LIST, OP_RBRACKET, "]");
        if (t->op == OP_LBRACE)
            return parse_seq(P, E_DICT, OP_RBRACE, "}");
        break;
    default: break;
    }
    fail(P, t->line, "unexpected '%s'", describe(t));
    return NULL;
}

static expr *parse_unary(parser *P, bool with_filter)
{
    const token *t = cur(P);
    expr *node;
    if (is_op(t, OP_SUB) || is_op(t, OP_ADD)) {
        if (!enter(P))
            return NULL;
        next(P);
        expr *operand = parse_unary(P, false);
        P->depth--;
        node = new_expr(P, t->op == OP_SUB ? E_NEG : E_POS, t->line);
        if (!operand || !node)
            return NULL;
        node->u.bin.l = operand;
        if (!below(P, node, operand))
            return NULL;
    } else {
        node = parse_primary(P);
    }
    node = parse_postfix(P, node);
    return with_filter ? parse_filter_expr(P, node) : node;
}

static expr *binop(parser *P, op_kind op, int line, expr *l, expr *r)
{
    if (!l || !r)
        return NULL;
    expr *e = new_expr(P, E_BINOP, line);
    if (!e)
        return NULL;
    e->u.bin.op = op;
    e->u.bin.l = l;
    e->u.bin.r = r;
    return below(P, e, l) && below(P, e, r) ? e : NULL;
}

static expr *parse_pow(parser *P)
{
    expr *l = parse_unary(P, true);
    while (l && is_op(cur(P), OP_POW)) {
        int line = cur(P)->line;
        next(P);
        l = binop(P, OP_POW, line, l, parse_unary(P, true));
    }
    return l;
}

static expr *parse_math2(parser *P)
{
    expr *l = parse_pow(P);
    while (l && (is_op(cur(P), OP_MUL) || is_op(cur(P), OP_DIV) || is_op(cur(P), OP_FLOORDIV) ||
                 is_op(cur(P), OP_MOD))) {
        op_kind op = cur(P)->op;
        int line = cur(P)->line;
        next(P);
        l = binop(P, op, line, l, parse_pow(P));
    }
    return l;
}

static expr *parse_concat(parser *P)
{
    expr *l = parse_math2(P);
    while (l && is_op(cur(P), OP_TILDE)) {
        int line = cur(P)->line;
        next(P);
        l = binop(P, OP_TILDE, line, l, parse_math2(P));
    }
    return l;
}

static expr *parse_math1(parser *P)
{
    expr *l = parse_concat(P);
    while (l && (is_op(cur(P), OP_ADD) || is_op(cur(P), OP_SUB))) {
        op_kind op = cur(P)->op;
        int line = cur(P)->line;
        next(P);
        l = binop(P, op, line, l, parse_concat(P));
    }
    return l;
}

static expr *parse_compare(parser *P)
{
    int line = cur(P)->line;
    expr *first = parse_math1(P);
    vec ops = {0}, rhs = {0};
    while (first && !P->failed) {
        const token *t = cur(P);
        op_kind op;
        if (t->kind == T_OP && (t->op == OP_EQ || t->op == OP_NE || t->op == OP_LT || t->op == OP_LE ||
                                t->op == OP_GT || t->op == OP_GE)) {
            op = t->op;
            next(P);
        } else if (is_name(t, "in")) {
            op = OP_IN;
            next(P);
        } else if (is_name(t, "not") && is_name(look(P), "in")) {
            op = OP_NOTIN;
            next(P);
            next(P);
        } else {
            break;
        }
        expr *r = parse_math1(P);
        if (!r || !push(P, &ops, (void *)(uintptr_t)op) || !push(P, &rhs, r))
            break;
    }
    if (!ops.n || P->failed || !first) {
        free(ops.items);
        free(rhs.items);
        return P->failed ? NULL : first;
    }
    expr *e = new_expr(P, E_COMPARE, line);
    size_t n = ops.n;
    op_kind *kinds = e ? tmpl_arena_alloc(P->a, n * sizeof *kinds) : NULL;
    for (size_t i = 0; kinds && i < n; i++)
        kinds[i] = (op_kind)(uintptr_t)ops.items[i];
    free(ops.items);
    expr **r = (expr **)settle(P, &rhs);
    if (!e || !kinds || !r) {
        fail(P, line, "out of memory");
        return NULL;
    }
    e->u.cmp.first = first;
    e->u.cmp.n = n;
    e->u.cmp.ops = kinds;
    e->u.cmp.rhs = r;
    if (!below(P, e, first))
        return NULL;
    for (size_t i = 0; i < n; i++)
        if (!below(P, e, r[i]))
            return NULL;
    return e;
}

static expr *parse_not(parser *P)
{
    if (is_name(cur(P), "not")) {
        int line = cur(P)->line;
        if (!enter(P))
            return NULL;
        next(P);
        expr *operand = parse_not(P);
        P->depth--;
        expr *e = new_expr(P, E_NOT, line);
        if (!operand || !e)
            return NULL;
        e->u.bin.l = operand;
        return below(P, e, operand) ? e : NULL;
    }
    return parse_compare(P);
}

static expr *logic(parser *P, expr_kind kind, int line, expr *l, expr *r)
{
    if (!l || !r)
        return NULL;
    expr *e = new_expr(P, kind, line);
    if (!e)
        return NULL;
    e->u.bin.l = l;
    e->u.bin.r = r;
    return below(P, e, l) && below(P, e, r) ? e : NULL;
}

static expr *parse_and(parser *P)
{
    expr *l = parse_not(P);
    while (l && is_name(cur(P), "and")) {
        int line = cur(P)->line;
        next(P);
        l = logic(P, E_AND, line, l, parse_not(P));
    }
    return l;
}

static expr *parse_or(parser *P)
{
    expr *l = parse_and(P);
    while (l && is_name(cur(P), "or")) {
        int line = cur(P)->line;
        next(P);
        l = logic(P, E_OR, line, l, parse_and(P));
    }
    return l;
}

static expr *parse_condexpr(parser *P)
{
    expr *then = parse_or(P);
    while (then && is_name(cur(P), "if")) {
        int line = cur(P)->line;
        next(P);
        expr *cond = parse_or(P), *otherwise = NULL;
        if (!cond)
            return NULL;
        if (is_name(cur(P), "else")) {
            next(P);
            if (!(otherwise = parse_condexpr(P)))
                return NULL;
        }
        expr *e = new_expr(P, E_COND, line);
        if (!e)
            return NULL;
        e->u.cond.cond = cond;
        e->u.cond.then = then;
        e->u.cond.otherwise = otherwise;
        if (!below(P, e, cond) || !below(P, e, then) || !below(P, e, otherwise))
            return NULL;
        then = e;
    }
    return then;
}

static expr *parse_expression(parser *P, bool with_condexpr)
{
    if (!enter(P))
        return NULL;
    expr *e = with_condexpr ? parse_condexpr(P) : parse_or(P);
    P->depth--;
    return P->failed ? NULL : e;
}

static bool is_tuple_end(parser *P, const char *extra_end)
{
    const token *t = cur(P);
    return t->kind == T_VAR_END || t->kind == T_BLOCK_END || is_op(t, OP_RPAREN) || t->kind == T_EOF ||
           (extra_end && is_name(t, extra_end));
}

static expr *parse_tuple(parser *P, bool simplified, bool with_condexpr, const char *extra_end, bool explicit_parens)
{
    int line = cur(P)->line;
    vec items = {0};
    bool is_tuple = false;
    while (!P->failed) {
        if (items.n && !expect_op(P, OP_COMMA, ","))
            break;
        if (is_tuple_end(P, extra_end))
            break;
        expr *e;
        if (simplified) {
            if (!enter(P))
                break;
            e = parse_primary(P);
            P->depth--;
        } else {
            e = parse_expression(P, with_condexpr);
        }
        if (!e || !push(P, &items, e))
            break;
        if (!is_op(cur(P), OP_COMMA))
            break;
        is_tuple = true;
    }
    if (P->failed) {
        free(items.items);
        return NULL;
    }
    if (!is_tuple && items.n == 1) {
        expr *only = items.items[0];
        free(items.items);
        return only;
    }
    if (!is_tuple && !explicit_parens) {
        free(items.items);
        fail(P, cur(P)->line, "expected an expression, got '%s'", describe(cur(P)));
        return NULL;
    }
    expr *e = new_expr(P, E_TUPLE, line);
    size_t n = items.n;
    expr **v = (expr **)settle(P, &items);
    if (!e)
        return NULL;
    e->u.list.items = v;
    e->u.list.n = n;
    for (size_t i = 0; i < n; i++)
        if (!below(P, e, v[i]))
            return NULL;
    return e;
}

/* ---- statements ---- */

static bool to_target(parser *P, const expr *e, target *out)
{
    if (e->kind == E_NAME) {
        out->name = e->u.name;
        return true;
    }
    if (e->kind == E_TUPLE) {
        out->n = e->u.list.n;
        out->items = tmpl_arena_alloc(P->a, (out->n ? out->n : 1) * sizeof *out->items);
        if (!out->items) {
            fail(P, e->line, "out of memory");
            return false;
        }
        for (size_t i = 0; i < out->n; i++)
            if (!to_target(P, e->u.list.items[i], &out->items[i]))
                return false;
        return true;
    }
    fail(P, e->line, "cannot assign to this expression");
    return false;
}

static bool parse_target(parser *P, const char *extra_end, target *out)
{
    expr *e = parse_tuple(P, true, false, extra_end, false);
    return e && to_target(P, e, out);
}

static bool subparse(parser *P, const char *const *ends, body *out);

static stmt *new_stmt(parser *P, stmt_kind kind, int line)
{
    if (P->failed)
        return NULL;
    stmt *s = tmpl_arena_alloc(P->a, sizeof *s);
    if (!s) {
        fail(P, line, "out of memory");
        return NULL;
    }
    s->kind = kind;
    s->line = line;
    return s;
}

/* After a nested body: `{% endNAME %}`. */
static bool expect_end(parser *P, const char *name)
{
    if (!is_name(cur(P), name)) {
        fail(P, cur(P)->line, "expected '%s'", name);
        return false;
    }
    next(P);
    return expect_kind(P, T_BLOCK_END);
}

static stmt *parse_if(parser *P, int line)
{
    static const char *const ends[] = {"endif", "elif", "else", NULL};
    static const char *const end_only[] = {"endif", NULL};
    stmt *s = new_stmt(P, S_IF, line);
    vec conds = {0}, bodies = {0};
    while (s && !P->failed) {
        next(P); /* if / elif */
        expr *cond = parse_tuple(P, false, false, NULL, false);
        body *b = tmpl_arena_alloc(P->a, sizeof *b);
        if (!cond || !b || !expect_kind(P, T_BLOCK_END) || !subparse(P, ends, b) || !push(P, &conds, cond) ||
            !push(P, &bodies, b))
            break;
        if (is_name(cur(P), "elif"))
            continue;
        if (is_name(cur(P), "else")) {
            next(P);
            if (expect_kind(P, T_BLOCK_END) && subparse(P, end_only, &s->u.if_.otherwise))
                expect_end(P, "endif");
        } else {
            expect_end(P, "endif");
        }
        break;
    }
    size_t n = conds.n;
    expr **c = (expr **)settle(P, &conds);
    body **b = (body **)settle(P, &bodies);
    if (P->failed)
        return NULL;
    s->u.if_.n = n;
    s->u.if_.conds = c;
    s->u.if_.bodies = tmpl_arena_alloc(P->a, n * sizeof(body));
    if (!s->u.if_.bodies) {
        fail(P, line, "out of memory");
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        s->u.if_.bodies[i] = *b[i];
    return s;
}

static stmt *parse_for(parser *P, int line)
{
    static const char *const ends[] = {"endfor", "else", NULL};
    static const char *const end_only[] = {"endfor", NULL};
    stmt *s = new_stmt(P, S_FOR, line);
    next(P);
    if (!s || !parse_target(P, "in", &s->u.for_.tgt))
        return NULL;
    if (!is_name(cur(P), "in")) {
        fail(P, cur(P)->line, "expected 'in', got '%s'", describe(cur(P)));
        return NULL;
    }
    next(P);
    if (!(s->u.for_.iter = parse_tuple(P, false, false, "recursive", false)))
        return NULL;
    if (is_name(cur(P), "if")) {
        next(P);
        if (!(s->u.for_.filter = parse_expression(P, true)))
            return NULL;
    }
    if (is_name(cur(P), "recursive")) {
        fail(P, cur(P)->line, "recursive loops are not supported");
        return NULL;
    }
    if (!expect_kind(P, T_BLOCK_END))
        return NULL;
    P->loop_depth++;
    bool ok = subparse(P, ends, &s->u.for_.body);
    P->loop_depth--;
    if (!ok)
        return NULL;
    if (is_name(cur(P), "else")) {
        next(P);
        if (!expect_kind(P, T_BLOCK_END) || !subparse(P, end_only, &s->u.for_.otherwise))
            return NULL;
    }
    return expect_end(P, "endfor") ? s : NULL;
}

static bool parse_filter_chain(parser *P, bool start_inline, expr ***filters, size_t *n)
{
    vec v = {0};
    while (!P->failed && (start_inline || is_op(cur(P), OP_PIPE))) {
        if (!start_inline)
            next(P);
        start_inline = false;
        expr *f = parse_one_filter(P, NULL);
        if (!f || !push(P, &v, f))
            break;
    }
    *n = v.n;
    *filters = (expr **)settle(P, &v);
    return !P->failed;
}

static stmt *parse_set(parser *P, int line)
{
    static const char *const ends[] = {"endset", NULL};
    next(P);
    const char *ns = NULL, *attr = NULL;
    target tgt = {0};
    if (cur(P)->kind == T_NAME && is_op(look(P), OP_DOT)) {
        ns = cur(P)->str;
        next(P);
        next(P);
        if (!(attr = expect_name(P)))
            return NULL;
    } else if (!parse_target(P, NULL, &tgt)) {
        return NULL;
    }
    if (is_op(cur(P), OP_ASSIGN)) {
        next(P);
        stmt *s = new_stmt(P, ns ? S_SET_NS : S_SET, line);
        expr *value = parse_tuple(P, false, true, NULL, false);
        if (!s || !value || !expect_kind(P, T_BLOCK_END))
            return NULL;
        if (ns) {
            s->u.set_ns.ns = ns;
            s->u.set_ns.attr = attr;
            s->u.set_ns.value = value;
        } else {
            s->u.set.tgt = tgt;
            s->u.set.value = value;
        }
        return s;
    }
    stmt *s = new_stmt(P, S_SET_BLOCK, line);
    if (!s || !parse_filter_chain(P, false, &s->u.set_block.filters, &s->u.set_block.nfilters) ||
        !expect_kind(P, T_BLOCK_END) || !subparse(P, ends, &s->u.set_block.body) || !expect_end(P, "endset"))
        return NULL;
    s->u.set_block.tgt = tgt;
    s->u.set_block.ns = ns;
    s->u.set_block.attr = attr;
    return s;
}

static bool parse_signature(parser *P, macro *m)
{
    if (!expect_op(P, OP_LPAREN, "("))
        return false;
    vec names = {0}, defaults = {0};
    bool any_default = false;
    while (!P->failed && !is_op(cur(P), OP_RPAREN)) {
        if (names.n && !expect_op(P, OP_COMMA, ","))
            break;
        int line = cur(P)->line;
        const char *name = expect_name(P);
        expr *def = NULL;
        if (!name)
            break;
        if (is_op(cur(P), OP_ASSIGN)) {
            next(P);
            if (!(def = parse_expression(P, true)))
                break;
            any_default = true;
        } else if (any_default) {
            fail(P, line, "non-default argument follows default argument");
            break;
        }
        if (!push(P, &names, (void *)name) || !push(P, &defaults, def))
            break;
    }
    m->nparams = names.n;
    m->params = (const char **)settle(P, &names);
    m->defaults = (expr **)settle(P, &defaults);
    return expect_op(P, OP_RPAREN, ")");
}

static stmt *parse_macro(parser *P, int line)
{
    static const char *const ends[] = {"endmacro", NULL};
    next(P);
    stmt *s = new_stmt(P, S_MACRO, line);
    macro *m = tmpl_arena_alloc(P->a, sizeof *m);
    if (!s || !m || !(m->name = expect_name(P)) || !parse_signature(P, m) || !expect_kind(P, T_BLOCK_END))
        return NULL;
    int saved = P->loop_depth;
    P->loop_depth = 0;
    bool ok = subparse(P, ends, &m->body);
    P->loop_depth = saved;
    if (!ok || !expect_end(P, "endmacro"))
        return NULL;
    s->u.macro = m;
    return s;
}

static stmt *parse_call_block(parser *P, int line)
{
    static const char *const ends[] = {"endcall", NULL};
    next(P);
    stmt *s = new_stmt(P, S_CALL_BLOCK, line);
    macro *m = tmpl_arena_alloc(P->a, sizeof *m);
    if (!s || !m)
        return NULL;
    m->name = "caller";
    if (is_op(cur(P), OP_LPAREN) && !parse_signature(P, m))
        return NULL;
    expr *call = parse_expression(P, true);
    if (!call)
        return NULL;
    if (call->kind != E_CALL) {
        fail(P, line, "expected a call after 'call'");
        return NULL;
    }
    if (!expect_kind(P, T_BLOCK_END))
        return NULL;
    int saved = P->loop_depth;
    P->loop_depth = 0;
    bool ok = subparse(P, ends, &m->body);
    P->loop_depth = saved;
    if (!ok || !expect_end(P, "endcall"))
        return NULL;
    s->u.call_block.caller = m;
    s->u.call_block.call = call;
    return s;
}

static stmt *parse_filter_block(parser *P, int line)
{
    static const char *const ends[] = {"endfilter", NULL};
    next(P);
    stmt *s = new_stmt(P, S_FILTER_BLOCK, line);
    if (!s || !parse_filter_chain(P, true, &s->u.filter_block.filters, &s->u.filter_block.nfilters) ||
        !expect_kind(P, T_BLOCK_END) || !subparse(P, ends, &s->u.filter_block.body) || !expect_end(P, "endfilter"))
        return NULL;
    return s;
}

static stmt *parse_with(parser *P, int line)
{
    static const char *const ends[] = {"endwith", NULL};
    next(P);
    stmt *s = new_stmt(P, S_WITH, line);
    vec names = {0}, vals = {0};
    while (s && !P->failed && cur(P)->kind != T_BLOCK_END) {
        if (names.n && !expect_op(P, OP_COMMA, ","))
            break;
        const char *name = expect_name(P);
        expr *v = NULL;
        if (!name || !expect_op(P, OP_ASSIGN, "=") || !(v = parse_expression(P, true)) ||
            !push(P, &names, (void *)name) || !push(P, &vals, v))
            break;
    }
    size_t n = names.n;
    const char **nm = (const char **)settle(P, &names);
    expr **v = (expr **)settle(P, &vals);
    if (!s || P->failed || !expect_kind(P, T_BLOCK_END) || !subparse(P, ends, &s->u.with.body) ||
        !expect_end(P, "endwith"))
        return NULL;
    s->u.with.names = nm;
    s->u.with.vals = v;
    s->u.with.n = n;
    return s;
}

static stmt *parse_statement(parser *P)
{
    const token *t = cur(P);
    int line = t->line;
    if (t->kind != T_NAME) {
        fail(P, line, "expected a tag name after '{%%', got '%s'", describe(t));
        return NULL;
    }
    if (!enter(P))
        return NULL;
    stmt *s = NULL;
    const char *name = t->str;
    if (!strcmp(name, "if")) {
        s = parse_if(P, line);
    } else if (!strcmp(name, "for")) {
        s = parse_for(P, line);
    } else if (!strcmp(name, "set")) {
        s = parse_set(P, line);
    } else if (!strcmp(name, "macro")) {
        s = parse_macro(P, line);
    } else if (!strcmp(name, "call")) {
        s = parse_call_block(P, line);
    } else if (!strcmp(name, "filter")) {
        s = parse_filter_block(P, line);
    } else if (!strcmp(name, "with")) {
        s = parse_with(P, line);
    } else if (!strcmp(name, "generation")) {
        /* Hugging Face's marker around assistant text: renders its body unchanged. */
        static const char *const ends[] = {"endgeneration", NULL};
        next(P);
        s = new_stmt(P, S_SCOPE, line);
        if (s && !(expect_kind(P, T_BLOCK_END) && subparse(P, ends, &s->u.scope) && expect_end(P, "endgeneration")))
            s = NULL;
    } else if (!strcmp(name, "break") || !strcmp(name, "continue")) {
        if (!P->loop_depth) {
            fail(P, line, "'%s' outside of a loop", name);
        } else {
            next(P);
            s = new_stmt(P, name[0] == 'b' ? S_BREAK : S_CONTINUE, line);
            if (s && !expect_kind(P, T_BLOCK_END))
                s = NULL;
        }
    } else if (!strncmp(name, "end", 3) || !strcmp(name, "else") || !strcmp(name, "elif")) {
        fail(P, line, "unexpected '{%% %s %%}'", name);
    } else {
        fail(P, line, "unknown tag '%s'", name);
    }
    P->depth--;
    return P->failed ? NULL : s;
}

static bool is_end(const token *t, const char *const *ends)
{
    for (size_t i = 0; ends && ends[i]; i++)
        if (is_name(t, ends[i]))
            return true;
    return false;
}

/* Statements until one of `ends` opens a tag (left as the current token) or the template
 * ends (an error when an end tag was expected). */
static bool subparse(parser *P, const char *const *ends, body *out)
{
    vec items = {0};
    int open_line = cur(P)->line;
    while (!P->failed) {
        const token *t = cur(P);
        stmt *s = NULL;
        if (t->kind == T_EOF) {
            if (ends)
                fail(P, open_line, "unexpected end of template: this block is never closed by '{%% %s %%}'",
                     ends[0]);
            break;
        }
        if (t->kind == T_TEXT) {
            if ((s = new_stmt(P, S_TEXT, t->line))) {
                s->u.text.s = t->str;
                s->u.text.len = t->len;
            }
            next(P);
        } else if (t->kind == T_VAR_BEGIN) {
            next(P);
            s = new_stmt(P, S_OUTPUT, t->line);
            if (s && (!(s->u.output = parse_tuple(P, false, true, NULL, false)) || !expect_kind(P, T_VAR_END)))
                s = NULL;
        } else if (t->kind == T_BLOCK_BEGIN) {
            next(P);
            if (is_end(cur(P), ends))
                break;
            s = parse_statement(P);
        } else {
            fail(P, t->line, "unexpected '%s'", describe(t));
        }
        if (!s || !push(P, &items, s))
            break;
    }
    out->n = items.n;
    out->items = (stmt **)settle(P, &items);
    return !P->failed;
}

int tmpl_parse(const token *toks, size_t ntoks, arena *a, body *root, blade_error *err)
{
    parser P = {.t = toks, .n = ntoks, .a = a, .err = err};
    if (!subparse(&P, NULL, root))
        return -1;
    return 0;
}

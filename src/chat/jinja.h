#ifndef BLADE_CHAT_JINJA_H
#define BLADE_CHAT_JINJA_H

/* Internals of the chat template engine: tokens, syntax tree, values and the render state
 * shared by lexer.c, parser.c, value.c, eval.c, builtins.c and template.c.
 *
 * Templates come from downloaded model files, so every resource a template can spend is
 * capped: the limits below are what a hostile template runs into, each with its own error. */

#include "blade/chat_template.h"
#include "common/utf8.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TMPL_MAX_SOURCE (1u << 20)      /* bytes of template source */
#define TMPL_MAX_AST_DEPTH 256          /* nesting of statements and expressions */
#define TMPL_MAX_EVAL_DEPTH 1024        /* evaluation recursion, macro calls included */
#define TMPL_MAX_MACRO_DEPTH 64         /* nested macro calls */
#define TMPL_MAX_VALUE_DEPTH 512        /* nesting of lists/dicts walked by str, tojson, == */
#define TMPL_MAX_STRING (32u << 20)     /* bytes of one string, the output included */
#define TMPL_MAX_MEMORY (256u << 20)    /* bytes of live values during one render */
#define TMPL_MAX_COST 20000000ull       /* work units per render (one per node, element, 64 bytes) */
#define TMPL_MAX_RANGE 100000           /* items of range(), as Jinja's sandbox */

/* ---- arena (template lifetime) ---- */

typedef struct arena_chunk arena_chunk;
typedef struct arena {
    arena_chunk *head;
    size_t used, cap; /* within head */
} arena;

void *tmpl_arena_alloc(arena *a, size_t n); /* zeroed; NULL when out of memory */
char *tmpl_arena_strndup(arena *a, const char *s, size_t n);
void tmpl_arena_free(arena *a);

/* ---- lexer ---- */

typedef enum tok_kind {
    T_EOF,
    T_TEXT,
    T_VAR_BEGIN,
    T_VAR_END,
    T_BLOCK_BEGIN,
    T_BLOCK_END,
    T_NAME,
    T_STRING,
    T_INT,
    T_FLOAT,
    T_OP
} tok_kind;

typedef enum op_kind {
    OP_ADD,
    OP_SUB,
    OP_MUL,
    OP_DIV,
    OP_FLOORDIV,
    OP_MOD,
    OP_POW,
    OP_TILDE,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_LE,
    OP_GT,
    OP_GE,
    OP_IN,
    OP_NOTIN,
    OP_LBRACKET,
    OP_RBRACKET,
    OP_LPAREN,
    OP_RPAREN,
    OP_LBRACE,
    OP_RBRACE,
    OP_ASSIGN,
    OP_DOT,
    OP_COLON,
    OP_PIPE,
    OP_COMMA,
    OP_SEMICOLON
} op_kind;

typedef struct token {
    tok_kind kind;
    op_kind op;
    int line;
    const char *str; /* T_TEXT, T_NAME, T_STRING: NUL-terminated, in the arena */
    size_t len;
    int64_t ival;
    double fval;
} token;

int tmpl_lex(const char *src, size_t len, arena *a, token **toks, size_t *ntoks, blade_error *err);

/* ---- values ---- */

typedef enum tv_kind {
    TV_UNDEF,
    TV_NONE,
    TV_BOOL,
    TV_INT,
    TV_FLOAT,
    TV_STR,
    TV_LIST, /* list or tuple */
    TV_DICT,
    TV_NS,
    TV_LOOP,
    TV_CALLER,
    TV_MACRO,
    TV_FUNC
} tv_kind;

/* Why a value is undefined, for the message an operation on it raises. */
typedef enum undef_why {
    UNDEF_NAME,    /* 'name' is undefined */
    UNDEF_ATTR,    /* 'dict object' has no attribute 'name' */
    UNDEF_ITEM,    /* 'list object' has no such element */
    UNDEF_EMPTY,   /* no first/last item */
    UNDEF_NO_ELSE  /* `a if cond` without else */
} undef_why;

typedef struct tv_obj tv_obj;
struct macro;

typedef struct tv {
    uint8_t kind;
    uint8_t why;   /* TV_UNDEF: undef_why */
    uint8_t owner; /* TV_UNDEF: kind of the value the attribute was missing from */
    union {
        bool b;
        int64_t i;
        double f;
        tv_obj *o;
        const char *name; /* TV_UNDEF: template-owned name, or NULL */
        const struct macro *macro;
        int func;
    } u;
} tv;

typedef struct tv_heap tv_heap;

/* Reference-counted heap objects. heap == NULL marks the template's own constants, which
 * are never counted so that threads may render one template at once. */
struct tv_obj {
    int32_t rc;
    uint8_t kind;
    tv_heap *heap;
    tv_obj *next_free;
    size_t size; /* bytes charged to the heap for the header and owned arrays */
};

typedef struct tv_str {
    tv_obj h;
    size_t len;
    size_t ncp; /* code points, or SIZE_MAX until counted */
    char s[];   /* NUL-terminated */
} tv_str;

typedef struct tv_list {
    tv_obj h;
    size_t n, cap;
    bool tuple;
    tv *items;
} tv_list;

/* Insertion-ordered, like Python's dict; an open-addressing index once it grows. */
typedef struct tv_dict {
    tv_obj h;
    size_t n, cap;
    tv *keys, *vals;
    uint32_t *index; /* slot -> entry + 1; 0 is empty */
    size_t index_cap;
} tv_dict;

typedef struct tv_ns tv_ns;
struct tv_ns {
    tv_obj h;
    tv_dict *attrs;
    tv_ns *reg_prev, *reg_next; /* the heap's list of live namespaces */
    bool registered;
};

typedef struct tv_loop {
    tv_obj h;
    tv_list *items;
    size_t i;
    tv changed; /* the arguments of the last loop.changed() call, as a tuple */
} tv_loop;

struct frame;
struct stmt;

/* What `caller` inside a macro refers to; dead once its call block has finished, since
 * the frame it points to lives on the C stack. */
typedef struct tv_caller {
    tv_obj h;
    const struct stmt *block;
    struct frame *frame;
    bool alive;
} tv_caller;

/* Namespaces are the only mutable containers, so every reference cycle passes through
 * one: the heap keeps a list of them to break cycles when the render ends. Objects whose
 * count drops to zero are queued and destroyed iteratively, so freeing a deep value never
 * recurses. */
struct tv_heap {
    size_t live, limit;
    tv_obj *pending;
    bool draining;
    tv_ns *namespaces;
};

/* ---- syntax tree ---- */

typedef struct expr expr;
typedef struct stmt stmt;

typedef struct call_args {
    expr **pos;
    size_t npos;
    const char **kw;
    expr **kwv;
    size_t nkw;
} call_args;

typedef enum expr_kind {
    E_CONST,
    E_NAME,
    E_LIST,
    E_TUPLE,
    E_DICT,
    E_ATTR,
    E_ITEM,
    E_SLICE,
    E_CALL,
    E_FILTER,
    E_TEST,
    E_NEG,
    E_POS,
    E_NOT,
    E_AND,
    E_OR,
    E_BINOP,
    E_COMPARE,
    E_COND
} expr_kind;

struct expr {
    expr_kind kind;
    int line;
    int depth;
    union {
        tv constant;
        const char *name;
        struct {
            expr **items;
            size_t n;
        } list;
        struct {
            expr **keys, **vals;
            size_t n;
        } dict;
        struct {
            expr *obj;
            const char *name;
        } attr;
        struct {
            expr *obj, *index;
        } item;
        struct {
            expr *obj, *start, *stop, *step;
        } slice;
        struct {
            expr *callee;
            call_args args;
        } call;
        struct {
            expr *operand; /* NULL in filter blocks and block sets: applied to the body */
            int id;
            const char *name;
            call_args args;
        } filter;
        struct {
            expr *operand;
            int id;
            const char *name;
            call_args args;
            bool negated;
        } test;
        struct {
            op_kind op;
            expr *l, *r;
        } bin;
        struct {
            expr *first;
            size_t n;
            op_kind *ops;
            expr **rhs;
        } cmp;
        struct {
            expr *cond, *then, *otherwise;
        } cond;
    } u;
};

typedef struct body {
    stmt **items;
    size_t n;
} body;

/* An assignment target: a name, or a (possibly nested) tuple of targets. */
typedef struct target {
    const char *name;
    struct target *items;
    size_t n;
} target;

typedef struct macro {
    const char *name;
    const char **params;
    expr **defaults; /* NULL where a parameter has none */
    size_t nparams;
    body body;
} macro;

typedef enum stmt_kind {
    S_TEXT,
    S_OUTPUT,
    S_IF,
    S_FOR,
    S_SET,
    S_SET_NS,
    S_SET_BLOCK,
    S_MACRO,
    S_CALL_BLOCK,
    S_FILTER_BLOCK,
    S_WITH,
    S_SCOPE,
    S_BREAK,
    S_CONTINUE
} stmt_kind;

struct stmt {
    stmt_kind kind;
    int line;
    union {
        struct {
            const char *s;
            size_t len;
        } text;
        expr *output;
        struct {
            expr **conds;
            body *bodies;
            size_t n;
            body otherwise;
        } if_;
        struct {
            target tgt;
            expr *iter, *filter;
            body body, otherwise;
        } for_;
        struct {
            target tgt;
            expr *value;
        } set;
        struct {
            const char *ns, *attr;
            expr *value;
        } set_ns;
        struct {
            target tgt;
            const char *ns, *attr; /* `{% set ns.attr %}` instead of tgt */
            expr **filters;
            size_t nfilters;
            body body;
        } set_block;
        macro *macro;
        struct {
            macro *caller; /* the block's parameters and body */
            expr *call;
        } call_block;
        struct {
            expr **filters;
            size_t nfilters;
            body body;
        } filter_block;
        struct {
            const char **names;
            expr **vals;
            size_t n;
            body body;
        } with;
        body scope;
    } u;
};

int tmpl_parse(const token *toks, size_t ntoks, arena *a, body *root, blade_error *err);

/* ---- builtin names (resolved at parse time) ---- */

int tmpl_filter_id(const char *name); /* -1 when unknown */
int tmpl_test_id(const char *name);
int tmpl_global_id(const char *name);
const char *tmpl_global_name(int id);

/* ---- render state ---- */

typedef struct frame {
    struct frame *parent;
    tv_dict *vars; /* created on the first assignment */
} frame;

typedef struct strbuf {
    tv_str *s; /* capacity in cap; converted in place into a string value */
    size_t cap;
} strbuf;

typedef struct jrun {
    const struct blade_template *t;
    blade_error *err;
    tv_heap heap;
    tv_dict *ctx;
    frame *root;
    strbuf *out;
    uint64_t cost;
    int depth;
    int macro_depth;
    int line;
    bool failed;
} jrun;

struct blade_template {
    arena arena;
    body root;
    tv_str *loop_key, *caller_key;
    long long now;
    bool now_pinned;
};

/* ---- value helpers (value.c) ---- */

bool tmpl_fail(jrun *R, const char *fmt, ...) BLADE_PRINTF(2, 3);
bool tmpl_charge(jrun *R, uint64_t units);
/* Charges work that cannot fail where it happens; the next tmpl_charge() reports it. Used
 * for scans over one string, so the overdraft is bounded by one string's length. */
static inline void tmpl_debit(jrun *R, uint64_t units) { R->cost += units; }
/* Work units for walking n bytes character by character (decoding, case mapping). */
#define TMPL_SCAN_COST(n) ((uint64_t)(n) / 4)

static inline tv tv_undef(undef_why why, const char *name, uint8_t owner)
{
    tv v = {TV_UNDEF, (uint8_t)why, owner, {.name = name}};
    return v;
}
static inline tv tv_none(void) { return (tv){TV_NONE, 0, 0, {.i = 0}}; }
static inline tv tv_bool(bool b) { return (tv){TV_BOOL, 0, 0, {.b = b}}; }
static inline tv tv_int(int64_t i) { return (tv){TV_INT, 0, 0, {.i = i}}; }
static inline tv tv_float(double f) { return (tv){TV_FLOAT, 0, 0, {.f = f}}; }
static inline tv tv_obj_val(tv_kind k, void *o) { return (tv){(uint8_t)k, 0, 0, {.o = (tv_obj *)o}}; }
static inline bool tv_has_obj(tv v)
{
    return v.kind == TV_STR || v.kind == TV_LIST || v.kind == TV_DICT || v.kind == TV_NS || v.kind == TV_LOOP ||
           v.kind == TV_CALLER;
}
static inline tv_str *tv_s(tv v) { return (tv_str *)v.u.o; }
static inline tv_list *tv_l(tv v) { return (tv_list *)v.u.o; }
static inline tv_dict *tv_d(tv v) { return (tv_dict *)v.u.o; }
static inline bool tv_is_num(tv v) { return v.kind == TV_INT || v.kind == TV_FLOAT || v.kind == TV_BOOL; }
static inline double tv_num(tv v)
{
    return v.kind == TV_FLOAT ? v.u.f : v.kind == TV_BOOL ? (double)v.u.b : (double)v.u.i;
}
static inline int64_t tv_intval(tv v) { return v.kind == TV_BOOL ? (int64_t)v.u.b : v.u.i; }
static inline bool tv_is_int(tv v) { return v.kind == TV_INT || v.kind == TV_BOOL; }

tv tv_retain(tv v);
void tv_release(tv v);
void tmpl_heap_init(tv_heap *h, size_t limit);
void tmpl_heap_break_cycles(tv_heap *h);
void *tmpl_heap_alloc(jrun *R, size_t n);
void *tmpl_heap_realloc(jrun *R, void *p, size_t old, size_t n);
void tmpl_heap_free(tv_heap *h, void *p, size_t n);

tv_str *tmpl_str_new(jrun *R, const char *s, size_t len);
tv_str *tmpl_str_alloc(jrun *R, size_t len); /* contents uninitialized, NUL-terminated */
bool tmpl_str_val(jrun *R, const char *s, size_t len, tv *out);
bool tmpl_str_cstr(jrun *R, const char *s, tv *out);
size_t tmpl_str_ncp(jrun *R, tv_str *s); /* code points (cached) */
tv_str *tmpl_str_immortal(arena *a, const char *s, size_t len);
/* Names in the syntax tree (from T_NAME tokens) are the text of immortal strings, so a
 * name is also a ready-made dictionary key. */
static inline tv tmpl_name_key(const char *name)
{
    return tv_obj_val(TV_STR, (void *)(name - offsetof(tv_str, s)));
}

tv_list *tmpl_list_new(jrun *R, size_t cap, bool tuple);
bool tmpl_list_push(jrun *R, tv_list *l, tv v); /* takes ownership of v, also on failure */
tv_dict *tmpl_dict_new(jrun *R);
bool tmpl_dict_set(jrun *R, tv_dict *d, tv key, tv val); /* takes ownership of key and val */
void tmpl_dict_clear(tv_dict *d);
bool tmpl_dict_get(const tv_dict *d, tv key, tv *out);   /* borrowed */
bool tmpl_dict_get_cstr(const tv_dict *d, const char *key, tv *out);
bool tv_hashable(tv v);
tv_ns *tmpl_ns_new(jrun *R);
tv_loop *tmpl_loop_new(jrun *R, tv_list *items); /* retains items */
tv_caller *tmpl_caller_new(jrun *R, const struct stmt *block, struct frame *fr);

void tmpl_sb_init(strbuf *b);
bool tmpl_sb_put(jrun *R, strbuf *b, const char *s, size_t n);
bool tmpl_sb_putc(jrun *R, strbuf *b, char c);
tv tmpl_sb_finish(jrun *R, strbuf *b); /* the buffer becomes a string value */
void tmpl_sb_drop(strbuf *b);
static inline size_t tmpl_sb_len(const strbuf *b) { return b->s ? b->s->len : 0; }

const char *tv_type_name(tv v);
bool tv_truthy(tv v);
bool tv_write_str(jrun *R, strbuf *b, tv v);
bool tv_write_repr(jrun *R, strbuf *b, tv v, int depth);
bool tv_to_str(jrun *R, tv v, tv *out); /* str(v) as a new reference */
void tmpl_fmt_float(double f, char *buf, size_t cap);
bool tv_equal(jrun *R, tv a, tv b, int depth, bool *eq);
bool tv_compare(jrun *R, tv a, tv b, int *cmp); /* Python's <, with its TypeError */
bool tv_contains(jrun *R, tv container, tv item, bool *in);
bool tmpl_undef_error(jrun *R, tv v);

typedef struct json_opts {
    const char *indent; /* NULL: one line */
    const char *item_sep, *key_sep;
    bool sort_keys, ensure_ascii;
} json_opts;
bool tv_write_json(jrun *R, strbuf *b, tv v, const json_opts *o, int level);

/* Python character classes (UTF-8 itself: common/utf8.h) */
bool tmpl_py_isspace(uint32_t cp);
uint32_t tmpl_uni_upper(uint32_t cp);
uint32_t tmpl_uni_lower(uint32_t cp);
bool tmpl_uni_cased(uint32_t cp);
size_t tmpl_py_space_len(const char *s, size_t len); /* length of the whitespace char at s, or 0 */

/* ---- evaluation (eval.c) and builtins (builtins.c) ---- */

typedef struct argv_ {
    tv *pos;
    size_t npos;
    const char **kw;
    tv *kwv;
    size_t nkw;
} argv_;

int tmpl_exec(jrun *R, frame *fr, const body *b);
bool tmpl_call(jrun *R, tv callee, const char *what, argv_ *a, tv *out);
bool tmpl_apply_filter(jrun *R, int id, const char *name, tv v, argv_ *a, tv *out);
bool tmpl_apply_test(jrun *R, int id, const char *name, tv v, argv_ *a, bool *out);
bool tmpl_call_global(jrun *R, int id, argv_ *a, tv *out);
/* Python's `fmt % args` (printf-style), also the `format` filter. */
bool tmpl_percent_format(jrun *R, tv_str *fmt, tv args, tv *out);
/* Python methods of strings, dicts and loop objects; *found false when there is none. */
bool tmpl_call_method(jrun *R, tv obj, const char *name, argv_ *a, tv *out, bool *found);
bool tmpl_getattr(jrun *R, tv obj, const char *name, tv *out);
bool tmpl_getitem(jrun *R, tv obj, tv key, tv *out);
/* Items of an iterable as a list (dict: keys; string: characters). */
bool tmpl_iterate(jrun *R, tv v, tv_list **out);

#endif

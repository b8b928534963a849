/* The public chat-template API: parsing into a template that owns its syntax tree (one
 * arena, freed at once), and rendering against a JSON context converted into template
 * values on the render's own budgeted heap. */
#include "chat/jinja.h"

#include <stdalign.h>
#include <stdlib.h>
#include <string.h>

struct arena_chunk {
    arena_chunk *next;
    alignas(16) unsigned char data[];
};

#define ARENA_CHUNK (64u << 10)

void *tmpl_arena_alloc(arena *a, size_t n)
{
    if (n > SIZE_MAX - 32)
        return NULL;
    n = (n + 15) & ~(size_t)15;
    if (!a->head || n > a->cap - a->used) {
        size_t cap = n > ARENA_CHUNK ? n : ARENA_CHUNK;
        arena_chunk *c = malloc(sizeof *c + cap);
        if (!c)
            return NULL;
        c->next = a->head;
        a->head = c;
        a->used = 0;
        a->cap = cap;
    }
    void *p = a->head->data + a->used;
    a->used += n;
    memset(p, 0, n);
    return p;
}

char *tmpl_arena_strndup(arena *a, const char *s, size_t n)
{
    char *p = tmpl_arena_alloc(a, n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}

void tmpl_arena_free(arena *a)
{
    while (a->head) {
        arena_chunk *next = a->head->next;
        free(a->head);
        a->head = next;
    }
}

/* Messages quote template text and are cut to the error buffer's size; whoever shows them
 * (a JSON response) needs valid UTF-8, so stray or cut-off bytes become '?'. */
static void clean_message(blade_error *err)
{
    if (!err)
        return;
    size_t len = strlen(err->msg);
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t n = blade_utf8_decode(err->msg + i, len - i, &cp);
        if (n == 1 && (unsigned char)err->msg[i] >= 0x80)
            err->msg[i] = '?';
        i += n;
    }
}

blade_template *blade_template_parse(const char *source, size_t len, blade_error *err)
{
    if (len > TMPL_MAX_SOURCE) {
        blade_error_set(err, "template of %zu bytes exceeds the %u KiB limit", len, TMPL_MAX_SOURCE >> 10);
        return NULL;
    }
    blade_template *t = calloc(1, sizeof *t);
    char *src = malloc(len + 1);
    token *toks = NULL;
    size_t ntoks = 0, n = 0;
    if (!t || !src) {
        blade_error_set(err, "out of memory");
        goto fail;
    }
    /* Jinja reads \r\n and \r as \n, and drops one newline that ends the source */
    for (size_t i = 0; i < len; i++) {
        if (source[i] == '\r') {
            src[n++] = '\n';
            if (i + 1 < len && source[i + 1] == '\n')
                i++;
        } else {
            src[n++] = source[i];
        }
    }
    if (n && src[n - 1] == '\n')
        n--;
    src[n] = 0;
    t->loop_key = tmpl_str_immortal(&t->arena, "loop", 4);
    t->caller_key = tmpl_str_immortal(&t->arena, "caller", 6);
    if (!t->loop_key || !t->caller_key) {
        blade_error_set(err, "out of memory");
        goto fail;
    }
    if (tmpl_lex(src, n, &t->arena, &toks, &ntoks, err) || tmpl_parse(toks, ntoks, &t->arena, &t->root, err))
        goto fail;
    free(toks);
    free(src);
    return t;
fail:
    free(toks);
    free(src);
    blade_template_free(t);
    clean_message(err);
    return NULL;
}

void blade_template_free(blade_template *t)
{
    if (!t)
        return;
    tmpl_arena_free(&t->arena);
    free(t);
}

void blade_template_set_time(blade_template *t, long long unix_seconds)
{
    t->now = unix_seconds;
    t->now_pinned = true;
}

static bool from_json(jrun *R, json_t *j, int depth, tv *out)
{
    if (depth > TMPL_MAX_VALUE_DEPTH)
        return tmpl_fail(R, "context nested more than %d levels deep", TMPL_MAX_VALUE_DEPTH);
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        tv_dict *d = tmpl_dict_new(R);
        const char *key;
        json_t *val;
        if (!d)
            return false;
        json_object_foreach(j, key, val)
        {
            tv k, v;
            if (!tmpl_str_cstr(R, key, &k))
                goto obj_fail;
            if (!from_json(R, val, depth + 1, &v)) {
                tv_release(k);
                goto obj_fail;
            }
            if (!tmpl_dict_set(R, d, k, v))
                goto obj_fail;
        }
        *out = tv_obj_val(TV_DICT, d);
        return true;
    obj_fail:
        tv_release(tv_obj_val(TV_DICT, d));
        return false;
    }
    case JSON_ARRAY: {
        tv_list *l = tmpl_list_new(R, json_array_size(j), false);
        for (size_t i = 0; l && i < json_array_size(j); i++) {
            tv v;
            if (!from_json(R, json_array_get(j, i), depth + 1, &v) || !tmpl_list_push(R, l, v)) {
                tv_release(tv_obj_val(TV_LIST, l));
                return false;
            }
        }
        if (!l)
            return false;
        *out = tv_obj_val(TV_LIST, l);
        return true;
    }
    case JSON_STRING: return tmpl_str_val(R, json_string_value(j), json_string_length(j), out);
    case JSON_INTEGER: *out = tv_int((int64_t)json_integer_value(j)); return true;
    case JSON_REAL: *out = tv_float(json_real_value(j)); return true;
    case JSON_TRUE: *out = tv_bool(true); return true;
    case JSON_FALSE: *out = tv_bool(false); return true;
    default: *out = tv_none(); return true;
    }
}

int blade_template_render(const blade_template *t, json_t *context, char **out, size_t *out_len, blade_error *err)
{
    *out = NULL;
    if (out_len)
        *out_len = 0;
    if (!json_is_object(context))
        return blade_error_set(err, "template context must be a JSON object");
    jrun R = {.t = t, .err = err};
    tmpl_heap_init(&R.heap, TMPL_MAX_MEMORY);
    frame root = {NULL, NULL};
    strbuf buf;
    tv ctx = tv_none();
    int rc = -1;
    tmpl_sb_init(&buf);
    R.root = &root;
    R.out = &buf;
    if (from_json(&R, context, 0, &ctx)) {
        R.ctx = tv_d(ctx);
        rc = tmpl_exec(&R, &root, &t->root);
    }
    if (rc == 0) {
        size_t n = tmpl_sb_len(&buf);
        if ((*out = malloc(n + 1)) != NULL) {
            if (n)
                memcpy(*out, buf.s->s, n);
            (*out)[n] = 0;
            if (out_len)
                *out_len = n;
        } else {
            rc = blade_error_set(err, "out of memory");
        }
    }
    tmpl_sb_drop(&buf);
    if (root.vars)
        tv_release(tv_obj_val(TV_DICT, root.vars));
    tv_release(ctx);
    tmpl_heap_break_cycles(&R.heap);
    if (rc)
        clean_message(err);
    return rc;
}

int blade_template_render_chat(const blade_template *t, json_t *messages, bool add_generation_prompt,
                               const char *bos_token, const char *eos_token, char **out, size_t *out_len,
                               blade_error *err)
{
    *out = NULL;
    json_t *ctx = json_pack("{s:O,s:b}", "messages", messages ? messages : json_null(), "add_generation_prompt",
                            (int)add_generation_prompt);
    if (!ctx)
        return blade_error_set(err, "out of memory");
    int rc = -1;
    /* json_string refuses text that is not UTF-8, and set_new then fails without leaking */
    if ((bos_token && json_object_set_new(ctx, "bos_token", json_string(bos_token))) ||
        (eos_token && json_object_set_new(ctx, "eos_token", json_string(eos_token)))) {
        blade_error_set(err, "bos/eos token is not valid UTF-8");
        goto done;
    }
    rc = blade_template_render(t, ctx, out, out_len, err);
done:
    json_decref(ctx);
    return rc;
}

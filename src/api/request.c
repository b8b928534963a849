/* Request bodies as clients send them, checked into an api_request (request.h): every
 * parameter's type and range, prompts as text, token arrays or lists of either, chat
 * messages rendered through the template, and the lengths against the context and the KV
 * pool. Each refusal is a 400 naming the parameter, in OpenAI's words where it has some;
 * parameters blade knows but does not implement are refused rather than ignored. */

#include "api/request.h"

#include "api/buf.h"

#include "blade/model.h"
#include "blade/tokenizer.h"

#include <math.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *kind_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* The parameter as given, or NULL when absent or null (OpenAI treats null as absent). */
static json_t *field(json_t *body, const char *key)
{
    json_t *v = json_object_get(body, key);
    return v && !json_is_null(v) ? v : NULL;
}

static int get_bool(json_t *body, const char *key, bool *out, api_error *err)
{
    json_t *v = field(body, key);
    if (!v)
        return 0;
    if (!json_is_boolean(v))
        return api_bad_request(err, key, "'%s' must be a boolean, got %s", key, kind_name(v)), -1;
    *out = json_is_true(v);
    return 0;
}

static int get_number(json_t *body, const char *key, double min, double max, double *out, api_error *err)
{
    json_t *v = field(body, key);
    if (!v)
        return 0;
    if (!json_is_number(v))
        return api_bad_request(err, key, "'%s' must be a number, got %s", key, kind_name(v)), -1;
    double x = json_number_value(v);
    if (!(x >= min && x <= max))
        return api_bad_request(err, key, "'%s' must be between %g and %g, got %g", key, min, max, x), -1;
    *out = x;
    return 0;
}

/* Integers may arrive as whole reals (1.0), as Python clients sometimes send them. */
static int int_value(const json_t *v, const char *name, long long min, long long max, long long *out,
                     api_error *err)
{
    if (json_is_integer(v)) {
        long long x = json_integer_value(v);
        if (x < min || x > max)
            return api_bad_request(err, name, "'%s' must be between %lld and %lld, got %lld", name, min, max, x), -1;
        *out = x;
        return 0;
    }
    if (json_is_real(v)) {
        double x = json_real_value(v);
        if (x != floor(x))
            return api_bad_request(err, name, "'%s' must be an integer, got %g", name, x), -1;
        if (!(x >= (double)min && x <= (double)max))
            return api_bad_request(err, name, "'%s' must be between %lld and %lld, got %g", name, min, max, x), -1;
        *out = (long long)x;
        return 0;
    }
    return api_bad_request(err, name, "'%s' must be an integer, got %s", name, kind_name(v)), -1;
}

static int get_int(json_t *body, const char *key, long long min, long long max, long long *out, bool *present,
                   api_error *err)
{
    json_t *v = field(body, key);
    if (present)
        *present = v != NULL;
    if (!v)
        return 0;
    return int_value(v, key, min, max, out, err);
}

static uint64_t random_seed(void)
{
    uint64_t s;
    if (RAND_bytes((unsigned char *)&s, sizeof s) == 1)
        return s;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000007u ^ (uint64_t)ts.tv_nsec;
}

/* ---- prompts ---- */

static int add_prompt(api_request *r)
{
    api_prompt *grown = realloc(r->prompts, (size_t)(r->n_prompts + 1) * sizeof *grown);
    if (!grown)
        return -1;
    r->prompts = grown;
    memset(&r->prompts[r->n_prompts++], 0, sizeof *grown);
    return 0;
}

/* No token is longer than max_token_bytes, so a text longer than that many bytes per
 * context slot cannot fit; refusing it before tokenizing bounds the work a hostile
 * multi-megabyte prompt can cause. */
static int tokenize_text(blade_engine *e, const char *what, const char *text, size_t len, bool add_bos,
                         api_prompt *p, api_error *err)
{
    const blade_tokenizer *tok = blade_engine_model(e)->tokenizer;
    int32_t ctx = blade_engine_max_context(e);
    size_t per_token = blade_tokenizer_max_token_bytes(tok);
    if (len / (per_token ? per_token : 1) > (size_t)ctx)
        return api_bad_request(err, what,
                               "This model's maximum context length is %d tokens, but the %s is %zu bytes long, "
                               "which is more than %d tokens even at the longest token (%zu bytes)",
                               ctx, what, len, ctx, per_token),
               -1;
    size_t n = 0;
    blade_error terr = {{0}};
    bool bos = add_bos && blade_tokenizer_wants_bos(tok);
    if (blade_tokenizer_encode(tok, text, len, bos, true, &p->tokens, &n, &terr))
        return api_error_set(err, 500, "server_error", NULL, what, "tokenizing the %s failed: %s", what, terr.msg),
               -1;
    p->n_tokens = (int32_t)n;
    return 0;
}

static int copy_text(api_prompt *p, const char *text, size_t len)
{
    if (!(p->text = malloc(len + 1)))
        return -1;
    memcpy(p->text, text, len);
    p->text[len] = 0;
    p->text_len = len;
    return 0;
}

/* The text of a token prompt, for echo. */
static int detokenize(const api_model *am, api_prompt *p)
{
    const blade_tokenizer *tok = am->model->tokenizer;
    size_t cap = blade_tokenizer_max_token_bytes(tok) + 16;
    char *piece = malloc(cap);
    api_buf b = {0};
    if (!piece)
        return -1;
    blade_detokenizer d;
    blade_detokenizer_init(&d, tok, false);
    for (int32_t i = 0; i < p->n_tokens; i++) {
        size_t n = blade_detokenizer_push(&d, p->tokens[i], piece, cap);
        api_buf_append(&b, piece, n);
    }
    size_t n = blade_detokenizer_flush(&d, piece, cap);
    api_buf_append(&b, piece, n);
    free(piece);
    if (b.failed)
        return api_buf_free(&b), -1;
    p->text = b.data ? b.data : strdup("");
    p->text_len = b.len;
    return p->text ? 0 : -1;
}

/* param: the parameter errors name ("prompt" or "input"); an embedding input may fill the
 * whole context, a prompt must leave room for the completion. */
static int token_array(blade_engine *e, json_t *arr, const char *param, const char *name, api_prompt *p,
                       api_error *err)
{
    size_t n = json_array_size(arr);
    int32_t ctx = blade_engine_max_context(e);
    int32_t n_vocab = blade_engine_model(e)->hp.n_vocab;
    bool embed = !strcmp(param, "input");
    if (n == 0)
        return api_bad_request(err, param, "'%s' is an empty token array", name), -1;
    if (n > (size_t)ctx || (!embed && n == (size_t)ctx))
        return api_bad_request(err, param, "This model's maximum context length is %d tokens, but %s has %zu tokens%s",
                               ctx, name, n, embed ? "" : ", leaving no room for the completion"),
               -1;
    if (!(p->tokens = malloc(n * sizeof *p->tokens)))
        return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        char elem[96];
        snprintf(elem, sizeof elem, "%s[%zu]", name, i);
        long long id;
        if (!json_is_integer(v))
            return api_bad_request(err, param, "'%s' must be a token id (an integer), got %s", elem, kind_name(v)), -1;
        if (int_value(v, elem, 0, n_vocab - 1, &id, err)) {
            snprintf(err->param, sizeof err->param, "%s", param);
            return -1;
        }
        p->tokens[i] = (int32_t)id;
    }
    p->n_tokens = (int32_t)n;
    return 0;
}

static int parse_prompt(const api_model *am, json_t *body, api_request *r, api_error *err)
{
    json_t *prompt = field(body, "prompt");
    if (!prompt)
        return api_bad_request(err, "prompt", "'prompt' is required"), -1;
    if (json_is_string(prompt)) {
        if (add_prompt(r))
            return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
        api_prompt *p = &r->prompts[0];
        if (copy_text(p, json_string_value(prompt), json_string_length(prompt)))
            return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
        return tokenize_text(am->engine, "prompt", p->text, p->text_len, true, p, err);
    }
    if (!json_is_array(prompt))
        return api_bad_request(err, "prompt",
                               "'prompt' must be a string, an array of strings, an array of token ids or an array "
                               "of token id arrays, got %s",
                               kind_name(prompt)),
               -1;
    size_t n = json_array_size(prompt);
    if (n == 0)
        return api_bad_request(err, "prompt", "'prompt' is an empty array"), -1;
    json_t *first = json_array_get(prompt, 0);
    if (json_is_integer(first)) {
        if (add_prompt(r))
            return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
        return token_array(am->engine, prompt, "prompt", "prompt", &r->prompts[0], err);
    }
    if (!json_is_string(first) && !json_is_array(first))
        return api_bad_request(err, "prompt",
                               "'prompt[0]' must be a string, a token id or an array of token ids, got %s",
                               kind_name(first)),
               -1;
    if (n > API_MAX_PROMPTS)
        return api_bad_request(err, "prompt", "'prompt' holds %zu prompts; at most %d are allowed in one request", n,
                               API_MAX_PROMPTS),
               -1;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(prompt, i);
        char name[32];
        snprintf(name, sizeof name, "prompt[%zu]", i);
        if (json_typeof(v) != json_typeof(first))
            return api_bad_request(err, "prompt", "'%s' must be %s like 'prompt[0]', got %s", name, kind_name(first),
                                   kind_name(v)),
                   -1;
        if (add_prompt(r))
            return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
        api_prompt *p = &r->prompts[r->n_prompts - 1];
        if (json_is_string(v)) {
            if (copy_text(p, json_string_value(v), json_string_length(v)))
                return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
            if (tokenize_text(am->engine, name, p->text, p->text_len, true, p, err))
                return -1;
        } else if (token_array(am->engine, v, "prompt", name, p, err)) {
            return -1;
        }
    }
    return 0;
}

/* 'user' is only recorded by OpenAI; here it must merely be a string. */
static int check_user(json_t *body, api_error *err)
{
    json_t *user = field(body, "user");
    if (user && !json_is_string(user))
        return api_bad_request(err, "user", "'user' must be a string, got %s", kind_name(user)), -1;
    return 0;
}

/* ---- embedding inputs ---- */

/* 'input' as OpenAI takes it: a string, an array of strings, an array of token ids, or an
 * array of token id arrays. Empty strings are refused, as OpenAI does. */
static int parse_input(const api_model *am, json_t *body, api_request *r, api_error *err)
{
    json_t *input = field(body, "input");
    if (!input)
        return api_bad_request(err, "input", "'input' is required"), -1;
    json_t *one = json_array();
    if (!one)
        return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
    json_t *list = input;
    bool tokens_list = json_is_array(input) && json_array_size(input) > 0 && json_is_integer(json_array_get(input, 0));
    if (json_is_string(input) || tokens_list) {
        json_array_append(one, input);
        list = one;
    }
    int rc = -1;
    size_t n = json_is_array(list) ? json_array_size(list) : 0;
    if (!json_is_array(list))
        api_bad_request(err, "input",
                        "'input' must be a string, an array of strings, an array of token ids or an array of token "
                        "id arrays, got %s",
                        kind_name(input));
    else if (n == 0)
        api_bad_request(err, "input", "'input' is an empty array");
    else if (n > API_MAX_EMBED_INPUTS)
        api_bad_request(err, "input", "'input' holds %zu inputs; at most %d are allowed in one request", n,
                        API_MAX_EMBED_INPUTS);
    else
        rc = 0;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        json_t *v = json_array_get(list, i);
        char name[32];
        snprintf(name, sizeof name, list == one ? "input" : "input[%zu]", i);
        rc = -1;
        if (add_prompt(r)) {
            api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
            break;
        }
        api_prompt *p = &r->prompts[r->n_prompts - 1];
        if (json_is_string(v)) {
            if (json_string_length(v) == 0)
                api_bad_request(err, "input", "'%s' is an empty string", name);
            else if (copy_text(p, json_string_value(v), json_string_length(v)))
                api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
            else
                rc = tokenize_text(am->embed_engine, name, p->text, p->text_len, true, p, err);
        } else if (json_is_array(v)) {
            rc = token_array(am->embed_engine, v, "input", name, p, err);
        } else {
            api_bad_request(err, "input", "'%s' must be a string or an array of token ids, got %s", name,
                            kind_name(v));
        }
    }
    json_decref(one);
    return rc;
}

/* The rest of an embeddings request: the model, the encoding and the dimensions. Each
 * input must fit the context and the KV pool (it is computed like a prompt). */
static int parse_embeddings(const api_model *am, json_t *body, api_request *r, api_error *err)
{
    json_t *fmt = field(body, "encoding_format");
    if (fmt) {
        const char *f = json_is_string(fmt) ? json_string_value(fmt) : "";
        if (strcmp(f, "float") && strcmp(f, "base64"))
            return api_bad_request(err, "encoding_format", "'encoding_format' must be \"float\" or \"base64\""), -1;
        r->base64 = !strcmp(f, "base64");
    }
    long long dims = 0;
    int32_t n_embd = am->embed_model->hp.n_embd;
    if (get_int(body, "dimensions", 1, n_embd, &dims, NULL, err))
        return -1;
    r->dimensions = (int32_t)dims;
    if (parse_input(am, body, r, err))
        return -1;
    int64_t kv = blade_engine_kv_tokens(am->embed_engine);
    for (int32_t i = 0; i < r->n_prompts; i++) {
        if (r->prompts[i].n_tokens == 0)
            return api_bad_request(err, "input", "input %d has no tokens", i), -1;
        if (r->prompts[i].n_tokens > kv)
            return api_bad_request(err, "input", "input %d has %d tokens but the server's KV cache holds %lld tokens",
                                   i, r->prompts[i].n_tokens, (long long)kv),
                   -1;
    }
    return 0;
}

/* ---- chat messages ---- */

static int message_content(json_t *content, size_t index, const char *role, api_buf *out, api_error *err)
{
    char name[64];
    snprintf(name, sizeof name, "messages[%zu].content", index);
    if (!content) {
        if (strcmp(role, "assistant"))
            return api_bad_request(err, "messages", "'%s' is required for a %s message", name, role), -1;
        return 0;
    }
    if (json_is_string(content)) {
        api_buf_append(out, json_string_value(content), json_string_length(content));
        return 0;
    }
    if (!json_is_array(content))
        return api_bad_request(err, "messages", "'%s' must be a string or an array of content parts, got %s", name,
                               kind_name(content)),
               -1;
    /* Text parts are joined by newlines, as vLLM joins them. */
    for (size_t i = 0; i < json_array_size(content); i++) {
        json_t *part = json_array_get(content, i);
        if (!json_is_object(part))
            return api_bad_request(err, "messages", "'%s[%zu]' must be an object, got %s", name, i, kind_name(part)),
                   -1;
        json_t *type = json_object_get(part, "type");
        if (!json_is_string(type))
            return api_bad_request(err, "messages", "'%s[%zu].type' must be a string", name, i), -1;
        if (strcmp(json_string_value(type), "text"))
            return api_bad_request(err, "messages",
                                   "'%s[%zu]' has type '%s'; only text parts are supported by this model", name, i,
                                   json_string_value(type)),
                   -1;
        json_t *text = json_object_get(part, "text");
        if (!json_is_string(text))
            return api_bad_request(err, "messages", "'%s[%zu].text' must be a string, got %s", name, i,
                                   text ? kind_name(text) : "nothing"),
                   -1;
        if (i > 0)
            api_buf_append(out, "\n", 1);
        api_buf_append(out, json_string_value(text), json_string_length(text));
    }
    return 0;
}

/* Checks the messages and rebuilds them in the shape templates expect: role and content
 * as strings (content parts joined), plus name when given. */
static json_t *normalize_messages(json_t *messages, api_error *err)
{
    static const char *const roles[] = {"system", "developer", "user", "assistant", "tool"};
    if (!messages)
        return api_bad_request(err, "messages", "'messages' is required"), NULL;
    if (!json_is_array(messages))
        return api_bad_request(err, "messages", "'messages' must be an array, got %s", kind_name(messages)), NULL;
    if (json_array_size(messages) == 0)
        return api_bad_request(err, "messages", "'messages' must hold at least one message"), NULL;
    json_t *out = json_array();
    for (size_t i = 0; i < json_array_size(messages); i++) {
        json_t *m = json_array_get(messages, i);
        if (!json_is_object(m)) {
            api_bad_request(err, "messages", "'messages[%zu]' must be an object, got %s", i, kind_name(m));
            goto fail;
        }
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) {
            api_bad_request(err, "messages", "'messages[%zu].role' must be a string, got %s", i,
                            role ? kind_name(role) : "nothing");
            goto fail;
        }
        const char *rs = json_string_value(role);
        size_t k = 0;
        while (k < sizeof roles / sizeof roles[0] && strcmp(rs, roles[k]))
            k++;
        if (k == sizeof roles / sizeof roles[0]) {
            api_bad_request(err, "messages",
                            "'messages[%zu].role' is '%.64s'; expected system, developer, user, assistant or tool", i,
                            rs);
            goto fail;
        }
        /* Chat templates predate the developer role; it is OpenAI's new name for system. */
        if (!strcmp(rs, "developer"))
            rs = "system";
        api_buf content = {0};
        if (message_content(field(m, "content"), i, rs, &content, err)) {
            api_buf_free(&content);
            goto fail;
        }
        if (content.failed) {
            api_buf_free(&content);
            api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
            goto fail;
        }
        json_t *nm = json_object();
        json_object_set_new(nm, "role", json_string(rs));
        json_object_set_new(nm, "content", json_stringn(content.data ? content.data : "", content.len));
        api_buf_free(&content);
        json_t *name = field(m, "name");
        if (name && !json_is_string(name)) {
            json_decref(nm);
            api_bad_request(err, "messages", "'messages[%zu].name' must be a string, got %s", i, kind_name(name));
            goto fail;
        }
        if (name)
            json_object_set(nm, "name", name);
        json_array_append_new(out, nm);
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

static int parse_messages(const api_model *am, json_t *body, api_request *r, api_error *err)
{
    json_t *messages = normalize_messages(field(body, "messages"), err);
    if (!messages)
        return -1;
    if (!am->chat_template) {
        json_decref(messages);
        return api_bad_request(err, "messages", "%s", am->chat_template_error), -1;
    }
    const blade_tokenizer *tok = am->model->tokenizer;
    int32_t bos = blade_tokenizer_bos(tok), eos = blade_tokenizer_eos(tok);
    char *text = NULL;
    size_t len = 0;
    blade_error terr = {{0}};
    int rc = blade_template_render_chat(am->chat_template, messages, true, bos >= 0 ? blade_tokenizer_token_text(tok, bos) : "",
                                        eos >= 0 ? blade_tokenizer_token_text(tok, eos) : "", &text, &len, &terr);
    json_decref(messages);
    if (rc)
        return api_bad_request(err, "messages", "the chat template cannot render these messages: %s", terr.msg), -1;
    if (add_prompt(r)) {
        free(text);
        return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
    }
    api_prompt *p = &r->prompts[0];
    p->text = text;
    p->text_len = len;
    /* The template writes BOS and other special tokens itself. */
    return tokenize_text(am->engine, "messages", text, len, false, p, err);
}

/* ---- the rest of the body ---- */

static int parse_stop(json_t *body, api_request *r, api_error *err)
{
    json_t *stop = field(body, "stop");
    if (!stop)
        return 0;
    json_t *one = json_is_string(stop) ? stop : NULL;
    if (!one && !json_is_array(stop))
        return api_bad_request(err, "stop", "'stop' must be a string or an array of strings, got %s", kind_name(stop)),
               -1;
    size_t n = one ? 1 : json_array_size(stop);
    if (n > API_MAX_STOP)
        return api_bad_request(err, "stop", "'stop' holds %zu strings; at most %d are allowed", n, API_MAX_STOP), -1;
    if (n && !(r->stop = calloc(n, sizeof *r->stop)))
        return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
    for (size_t i = 0; i < n; i++) {
        json_t *s = one ? one : json_array_get(stop, i);
        if (!json_is_string(s))
            return api_bad_request(err, "stop", "'stop[%zu]' must be a string, got %s", i, kind_name(s)), -1;
        size_t len = json_string_length(s);
        if (len == 0 || len > API_MAX_STOP_BYTES)
            return api_bad_request(err, "stop", "stop string %zu is %zu bytes; each must be 1 to %d bytes", i, len,
                                   API_MAX_STOP_BYTES),
                   -1;
        /* The engine takes C strings: a NUL inside would cut the stop string short. */
        if (memchr(json_string_value(s), 0, len))
            return api_bad_request(err, "stop", "stop string %zu contains a NUL character", i), -1;
        if (!(r->stop[i] = strdup(json_string_value(s))))
            return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), -1;
        r->n_stop++;
    }
    return 0;
}

static int parse_logprobs(json_t *body, api_request *r, api_error *err)
{
    long long k;
    bool present;
    if (r->ep == API_COMPLETIONS) {
        json_t *v = field(body, "logprobs");
        if (v && json_is_boolean(v))
            return api_bad_request(err, "logprobs",
                                   "'logprobs' of /v1/completions is the number of top alternatives (0 to %d), not a "
                                   "boolean",
                                   API_MAX_LOGPROBS),
                   -1;
        if (get_int(body, "logprobs", 0, API_MAX_LOGPROBS, &k, &present, err))
            return -1;
        if (present)
            r->logprobs = (int32_t)k;
        return 0;
    }
    bool want = false;
    if (get_bool(body, "logprobs", &want, err))
        return -1;
    if (get_int(body, "top_logprobs", 0, API_MAX_TOP_LOGPROBS, &k, &present, err))
        return -1;
    if (present && !want)
        return api_bad_request(err, "top_logprobs", "'top_logprobs' needs 'logprobs': true"), -1;
    if (want)
        r->logprobs = present ? (int32_t)k : 0;
    return 0;
}

/* Parameters blade knows but does not implement: ignoring them would silently change the
 * result, so they are refused. */
static int refuse_unsupported(json_t *body, const api_request *r, api_error *err)
{
    json_t *v;
    if (r->ep == API_COMPLETIONS && (v = field(body, "suffix")) && !(json_is_string(v) && !json_string_length(v)))
        return api_bad_request(err, "suffix", "'suffix' (insertion) is not supported"), -1;
    if ((v = field(body, "logit_bias")) && !(json_is_object(v) && json_object_size(v) == 0))
        return api_bad_request(err, "logit_bias", "'logit_bias' is not supported"), -1;
    if ((v = field(body, "best_of"))) {
        long long b;
        if (int_value(v, "best_of", 1, API_MAX_N, &b, err))
            return -1;
        if (b != r->n)
            return api_bad_request(err, "best_of", "'best_of' other than n is not supported (got %lld, n is %d)", b,
                                   r->n),
                   -1;
    }
    if ((v = field(body, "tools")) && !(json_is_array(v) && json_array_size(v) == 0))
        return api_bad_request(err, "tools", "tool calling ('tools') is not supported"), -1;
    if ((v = field(body, "functions")) && !(json_is_array(v) && json_array_size(v) == 0))
        return api_bad_request(err, "functions", "function calling ('functions') is not supported"), -1;
    if ((v = field(body, "response_format"))) {
        json_t *type = json_is_object(v) ? json_object_get(v, "type") : NULL;
        if (!json_is_string(type))
            return api_bad_request(err, "response_format", "'response_format' must be an object with a string 'type'"),
                   -1;
        if (strcmp(json_string_value(type), "text"))
            return api_bad_request(err, "response_format", "response_format type '%.40s' is not supported; only 'text' is",
                                   json_string_value(type)),
                   -1;
    }
    return 0;
}

static int parse_sampling(json_t *body, api_request *r, api_error *err)
{
    blade_sampling_params *s = &r->sampling;
    blade_sampling_params_default(s);
    /* OpenAI's defaults, not llama.cpp's: a client that sends nothing gets plain sampling. */
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->top_k = 0;
    s->min_p = 0.0f;
    double x;
    long long k;
    bool present;
    x = s->temperature;
    if (get_number(body, "temperature", 0, 2, &x, err))
        return -1;
    s->temperature = (float)x;
    x = s->top_p;
    if (get_number(body, "top_p", 0, 1, &x, err))
        return -1;
    s->top_p = (float)x;
    x = s->min_p;
    if (get_number(body, "min_p", 0, 1, &x, err))
        return -1;
    s->min_p = (float)x;
    if (get_int(body, "top_k", -1, INT32_MAX, &k, &present, err))
        return -1;
    if (present)
        s->top_k = k < 0 ? 0 : (int32_t)k;
    x = s->presence_penalty;
    if (get_number(body, "presence_penalty", -2, 2, &x, err))
        return -1;
    s->presence_penalty = (float)x;
    x = s->frequency_penalty;
    if (get_number(body, "frequency_penalty", -2, 2, &x, err))
        return -1;
    s->frequency_penalty = (float)x;
    x = s->repeat_penalty;
    if (get_number(body, "repetition_penalty", 0, 10, &x, err))
        return -1;
    if (x <= 0)
        return api_bad_request(err, "repetition_penalty", "'repetition_penalty' must be greater than 0, got %g", x), -1;
    s->repeat_penalty = (float)x;
    /* The repetition penalty looks at the whole context, as vLLM's does. */
    s->repeat_last_n = -1;
    if (get_int(body, "seed", INT64_MIN, INT64_MAX, &k, &present, err))
        return -1;
    s->seed = present ? (uint64_t)k : random_seed();
    blade_error serr = {{0}};
    if (blade_sampling_params_validate(s, &serr))
        return api_bad_request(err, NULL, "invalid sampling parameters: %s", serr.msg), -1;
    return 0;
}

/* Lengths against the context and the KV pool, with OpenAI's wording. */
static int check_lengths(const api_model *am, json_t *body, api_request *r, api_error *err)
{
    const char *key = "max_tokens";
    if (r->ep == API_CHAT && field(body, "max_completion_tokens"))
        key = "max_completion_tokens";
    long long max_tokens = 0;
    bool given;
    if (get_int(body, key, 1, INT32_MAX, &max_tokens, &given, err))
        return -1;
    int32_t ctx = blade_engine_max_context(am->engine);
    int64_t kv = blade_engine_kv_tokens(am->engine);
    int32_t longest = 0;
    int32_t which = 0;
    for (int32_t i = 0; i < r->n_prompts; i++)
        if (r->prompts[i].n_tokens > longest) {
            longest = r->prompts[i].n_tokens;
            which = i;
        }
    const char *what = r->ep == API_CHAT ? "messages" : "prompt";
    char name[48];
    if (r->n_prompts > 1)
        snprintf(name, sizeof name, "prompt %d", which);
    else
        snprintf(name, sizeof name, "%s", what);
    if (longest == 0)
        return api_bad_request(err, what, "the %s is empty: it has no tokens", name), -1;
    if (longest >= ctx)
        return api_bad_request(err, what,
                               "This model's maximum context length is %d tokens, but the %s has %d tokens, leaving no "
                               "room for the completion. Please shorten it.",
                               ctx, name, longest),
               -1;
    int64_t limit = ctx < kv ? ctx : kv;
    if (given) {
        if (longest + max_tokens > ctx)
            return api_bad_request(err, key,
                                   "This model's maximum context length is %d tokens. However, you requested %lld "
                                   "tokens (%d in the %s, %lld for the completion). Please reduce the length of the "
                                   "%s or the completion.",
                                   ctx, longest + max_tokens, longest, name, max_tokens, what),
                   -1;
        if (longest + max_tokens > kv)
            return api_bad_request(err, key,
                                   "the request needs %lld tokens of KV cache (%d in the %s, %lld for the completion) "
                                   "but the server's KV cache holds %lld tokens",
                                   longest + max_tokens, longest, name, max_tokens, (long long)kv),
                   -1;
        r->max_tokens = (int32_t)max_tokens;
        return 0;
    }
    if (longest >= limit)
        return api_bad_request(err, what, "the %s has %d tokens but the server's KV cache holds %lld tokens", name,
                               longest, (long long)kv),
               -1;
    /* Without max_tokens, completions default to 16 tokens (as OpenAI) and chat runs until
     * the context is full; either way capped by what the context and the KV pool hold. */
    int64_t room = limit - longest;
    int64_t want = r->ep == API_COMPLETIONS ? 16 : room;
    r->max_tokens = (int32_t)(want < room ? want : room);
    return 0;
}

int api_parse(const api_model *am, api_endpoint ep, json_t *body, api_request *r, api_error *err)
{
    memset(r, 0, sizeof *r);
    r->ep = ep;
    r->n = 1;
    r->logprobs = -1;
    r->cls = am->batch_class ? BLADE_CLASS_BATCH : BLADE_CLASS_INTERACTIVE;
    if (!json_is_object(body)) {
        api_bad_request(err, NULL, "the request body must be a JSON object, got %s", kind_name(body));
        goto fail;
    }
    json_t *model = field(body, "model");
    if (model && !json_is_string(model)) {
        api_bad_request(err, "model", "'model' must be a string, got %s", kind_name(model));
        goto fail;
    }
    if (model && !api_model_matches(am, json_string_value(model))) {
        api_error_set(err, 404, "invalid_request_error", "model_not_found", "model",
                      "The model '%.200s' does not exist; this server serves '%s'", json_string_value(model),
                      am->names[0]);
        goto fail;
    }
    if (ep == API_EMBEDDINGS) {
        if (check_user(body, err) || parse_embeddings(am, body, r, err))
            goto fail;
        return 0;
    }
    long long n = 1;
    if (get_int(body, "n", 1, API_MAX_N, &n, NULL, err))
        goto fail;
    r->n = (int32_t)n;
    if (get_bool(body, "stream", &r->stream, err))
        goto fail;
    json_t *so = field(body, "stream_options");
    if (so) {
        if (!json_is_object(so)) {
            api_bad_request(err, "stream_options", "'stream_options' must be an object, got %s", kind_name(so));
            goto fail;
        }
        if (!r->stream) {
            api_bad_request(err, "stream_options", "'stream_options' is only allowed when 'stream' is true");
            goto fail;
        }
        if (get_bool(so, "include_usage", &r->include_usage, err))
            goto fail;
    }
    if (ep == API_COMPLETIONS && get_bool(body, "echo", &r->echo, err))
        goto fail;
    if (get_bool(body, "ignore_eos", &r->ignore_eos, err))
        goto fail;
    json_t *sc = field(body, "semantic_cache");
    if (sc && !json_is_boolean(sc)) {
        api_bad_request(err, "semantic_cache", "'semantic_cache' must be a boolean, got %s", kind_name(sc));
        goto fail;
    }
    r->semantic_cache = sc ? json_is_true(sc) : -1;
    if (check_user(body, err))
        goto fail;
    json_t *prio = field(body, "priority");
    if (prio) {
        const char *p = json_is_string(prio) ? json_string_value(prio) : NULL;
        if (!p || (strcmp(p, "interactive") && strcmp(p, "batch"))) {
            api_bad_request(err, "priority", "'priority' must be \"interactive\" or \"batch\"");
            goto fail;
        }
        if (!am->batch_class)
            r->cls = strcmp(p, "batch") ? BLADE_CLASS_INTERACTIVE : BLADE_CLASS_BATCH;
    }
    json_t *salt = field(body, "cache_salt");
    if (salt) {
        if (!json_is_string(salt) || json_string_length(salt) == 0 || json_string_length(salt) > API_MAX_CACHE_SALT ||
            memchr(json_string_value(salt), 0, json_string_length(salt))) {
            api_bad_request(err, "cache_salt", "'cache_salt' must be a string of 1 to %d bytes without NUL",
                            API_MAX_CACHE_SALT);
            goto fail;
        }
        if (!(r->cache_salt = strdup(json_string_value(salt)))) {
            api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
            goto fail;
        }
    }
    if (parse_sampling(body, r, err) || parse_stop(body, r, err) || parse_logprobs(body, r, err) ||
        refuse_unsupported(body, r, err))
        goto fail;
    if (r->echo && r->logprobs >= 0) {
        api_bad_request(err, "echo", "'echo' together with 'logprobs' is not supported (prompt logprobs are not "
                                     "computed)");
        goto fail;
    }
    if (ep == API_CHAT ? parse_messages(am, body, r, err) : parse_prompt(am, body, r, err))
        goto fail;
    if ((int64_t)r->n_prompts * r->n > API_MAX_CHOICES) {
        api_bad_request(err, "n", "%d prompts x n = %d make %lld choices; at most %d are allowed", r->n_prompts, r->n,
                        (long long)r->n_prompts * r->n, API_MAX_CHOICES);
        goto fail;
    }
    if (check_lengths(am, body, r, err))
        goto fail;
    if (r->echo) {
        for (int32_t i = 0; i < r->n_prompts; i++)
            if (!r->prompts[i].text && detokenize(am, &r->prompts[i])) {
                api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
                goto fail;
            }
    }
    return 0;
fail:
    api_request_free(r);
    return -1;
}

int api_parse_body(const api_model *am, api_endpoint ep, const char *body, size_t len, api_request *out,
                   api_error *err)
{
    memset(out, 0, sizeof *out);
    json_error_t jerr;
    /* jansson itself refuses invalid UTF-8, NUL characters in strings, integers beyond
     * 64 bits and nesting deeper than its limit, each with its own message. */
    json_t *j = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (!j) {
        if (len == 0)
            api_bad_request(err, NULL, "the request body is empty; expected a JSON object");
        else
            api_bad_request(err, NULL, "the request body is not valid JSON: %s at line %d, column %d (byte %d)",
                            jerr.text, jerr.line, jerr.column, jerr.position);
        return -1;
    }
    int rc = api_parse(am, ep, j, out, err);
    json_decref(j);
    return rc;
}

void api_request_free(api_request *r)
{
    for (int32_t i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].tokens);
        free(r->prompts[i].text);
    }
    free(r->prompts);
    for (int32_t i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->cache_salt);
    memset(r, 0, sizeof *r);
}

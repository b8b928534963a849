/* A request as the engine holds it (engine_internal.h): checked on submit, its prompt
 * tokenized on the caller's thread, one state per choice sharing the prompt, and freed in
 * one place. Its sequence's KV state is set up on the engine thread (the cache is
 * single-threaded), so nothing here touches blocks. */

#include "engine/engine_internal.h"

#include "common/clock.h"

#include <stdlib.h>
#include <string.h>

void blade_request_default(blade_request *r)
{
    memset(r, 0, sizeof *r);
    r->add_bos = true;
    blade_sampling_params_default(&r->sampling);
    r->max_tokens = 16;
    r->logprobs = -1;
    r->n = 1;
    r->cls = BLADE_CLASS_INTERACTIVE;
    r->speculative = true;
}

void engine_request_free(request_state *r)
{
    if (!r)
        return;
    while (r->followers) {
        request_state *f = r->followers;
        r->followers = f->next_live;
        engine_request_free(f);
    }
    free(r->tokens);
    blade_kv_store_free(r->import_staging);
    free(r->import_sent);
    free(r->export_blocks);
    free(r->export_hashes);
    request_output_destroy(&r->out);
    free(r->salt);
    free(r->pool_sum);
    free(r->pool_last);
    blade_kv_cache_seq_destroy(&r->seq.kv);
    spec_draft_seq_destroy(&r->draft);
    free(r);
}

static int validate_request(const blade_request *q, blade_error *err)
{
    if (!q->callback)
        return blade_error_set(err, "a request needs a callback");
    if (q->n < 1 || q->n > ENGINE_MAX_CHOICES)
        return blade_error_set(err, "n must be between 1 and %d, got %d", ENGINE_MAX_CHOICES, q->n);
    if (q->embed < BLADE_POOL_NONE || q->embed > BLADE_POOL_LAST)
        return blade_error_set(err, "unknown pooling %d", (int)q->embed);
    if (q->embed != BLADE_POOL_NONE && q->n != 1)
        return blade_error_set(err, "an embedding request has one choice, got n = %d", q->n);
    if (q->max_tokens <= 0 && q->embed == BLADE_POOL_NONE)
        return blade_error_set(err, "max_tokens must be at least 1, got %d", q->max_tokens);
    if (q->logprobs < -1 || q->logprobs > BLADE_MAX_TOP_LOGPROBS)
        return blade_error_set(err, "logprobs must be between 0 and %d, got %d", BLADE_MAX_TOP_LOGPROBS,
                               q->logprobs);
    if (q->n_stop < 0 || q->n_stop > ENGINE_MAX_STOP_STRINGS)
        return blade_error_set(err, "at most %d stop strings are allowed, got %d", ENGINE_MAX_STOP_STRINGS,
                               q->n_stop);
    for (int32_t i = 0; i < q->n_stop; i++)
        if (!q->stop[i] || strnlen(q->stop[i], ENGINE_MAX_STOP_LEN + 1) > ENGINE_MAX_STOP_LEN)
            return blade_error_set(err, "stop string %d is missing or longer than %d bytes", i, ENGINE_MAX_STOP_LEN);
    if (q->cls != BLADE_CLASS_INTERACTIVE && q->cls != BLADE_CLASS_BATCH)
        return blade_error_set(err, "unknown traffic class %d", (int)q->cls);
    if ((q->export_kv || q->import) && (q->n != 1 || q->logprobs >= 0 || q->want_logits || q->pin_prefix))
        return blade_error_set(err, "a KV export or import takes one choice without logprobs, logits or pinning");
    if (q->export_kv && q->import)
        return blade_error_set(err, "a request cannot both export and import its KV");
    return blade_sampling_params_validate(&q->sampling, err);
}

static bool same_shape(const blade_kv_store *a, const blade_kv_store *b)
{
    return a->type == b->type && a->block_size == b->block_size && a->n_layer == b->n_layer &&
           a->n_head_kv == b->n_head_kv && a->head_dim == b->head_dim && a->block_stride == b->block_stride;
}

/* Checks an import against the prompt and the engine's store, and keeps its blocks. */
static int take_import(const blade_engine *e, const blade_kv_import *im, request_state *r, blade_error *err)
{
    int32_t bs = e->cfg.block_size, n_blocks = (r->seq.n_prompt + bs - 1) / bs;
    if (im->n_tokens != r->seq.n_prompt)
        return blade_error_set(err, "the imported KV holds %d tokens, the prompt has %d", im->n_tokens,
                               r->seq.n_prompt);
    if (im->first_token < 0 || im->first_token >= e->m->hp.n_vocab)
        return blade_error_set(err, "the imported first token (%d) is outside the vocabulary of %d", im->first_token,
                               e->m->hp.n_vocab);
    if (!im->staging || !same_shape(im->staging, e->store))
        return blade_error_set(err, "the imported blocks' staging store does not have this engine's KV shape");
    if (im->n_sent < 0 || im->n_sent > im->staging->n_blocks || (im->n_sent && !im->sent))
        return blade_error_set(err, "the import names %d blocks; its staging store holds %d", im->n_sent,
                               im->staging->n_blocks);
    for (int32_t j = 0; j < im->n_sent; j++)
        if (im->sent[j] < 0 || im->sent[j] >= n_blocks || (j > 0 && im->sent[j] <= im->sent[j - 1]))
            return blade_error_set(err, "imported block %d names logical block %d (of %d, increasing)", j,
                                   im->sent[j], n_blocks);
    r->import_sent = malloc((size_t)(im->n_sent ? im->n_sent : 1) * sizeof *r->import_sent);
    if (!r->import_sent)
        return blade_error_set(err, "out of memory");
    memcpy(r->import_sent, im->sent, (size_t)im->n_sent * sizeof *r->import_sent);
    r->import_n_sent = im->n_sent;
    r->import_first = im->first_token;
    r->importing = true;
    return 0;
}

/* The prompt as tokens, with room for every token the request may generate. */
static int tokenize_prompt(const blade_engine *e, const blade_request *q, request_state *r, blade_error *err)
{
    int32_t *toks = NULL;
    size_t n = 0;
    if (q->prompt_text) {
        bool bos = q->add_bos && blade_tokenizer_wants_bos(e->m->tokenizer);
        if (blade_tokenizer_encode(e->m->tokenizer, q->prompt_text, q->prompt_text_len, bos, q->parse_special, &toks,
                                   &n, err))
            return -1;
    } else {
        if (q->n_prompt_tokens < 0 || (q->n_prompt_tokens && !q->prompt_tokens))
            return blade_error_set(err, "bad prompt token array");
        n = (size_t)q->n_prompt_tokens;
        toks = malloc((n ? n : 1) * sizeof *toks);
        if (!toks)
            return blade_error_set(err, "out of memory");
        for (size_t i = 0; i < n; i++) {
            if (q->prompt_tokens[i] < 0 || q->prompt_tokens[i] >= e->m->hp.n_vocab) {
                free(toks);
                return blade_error_set(err, "prompt token %zu (%d) is outside the vocabulary of %d", i,
                                       q->prompt_tokens[i], e->m->hp.n_vocab);
            }
            toks[i] = q->prompt_tokens[i];
        }
    }
    if (n == 0) {
        free(toks);
        return blade_error_set(err, "the prompt is empty");
    }
    bool embed = q->embed != BLADE_POOL_NONE;
    if (embed && n > (size_t)e->max_context) {
        free(toks);
        return blade_error_set(err, "the input has %zu tokens; the context limit is %d", n, e->max_context);
    }
    if (!embed && n >= (size_t)e->max_context) {
        free(toks);
        return blade_error_set(err, "the prompt has %zu tokens; the context limit is %d, leaving no room to generate",
                               n, e->max_context);
    }
    int64_t total = (int64_t)n + (embed ? 0 : q->max_tokens);
    if (total > e->max_context)
        total = e->max_context;
    int32_t *grown = realloc(toks, (size_t)total * sizeof *toks);
    if (!grown) {
        free(toks);
        return blade_error_set(err, "out of memory");
    }
    r->tokens = grown;
    r->cap_tokens = (int32_t)total;
    r->seq.n_tokens = (int32_t)n;
    r->seq.n_prompt = (int32_t)n;
    r->seq.max_total = (int32_t)total;
    return 0;
}

/* An embedding request pools every row (mean: no prefix is reused, each row is needed) or
 * the last one (last: a cached prefix is fine); pool_last also holds the finished vector. */
static int embedding_init(const blade_engine *e, const blade_request *q, request_state *r, blade_error *err)
{
    r->pooling = q->embed == BLADE_POOL_MODEL ? e->pooling : q->embed;
    size_t d = (size_t)e->m->hp.n_embd;
    r->pool_last = calloc(d, sizeof *r->pool_last);
    if (r->pooling == BLADE_POOL_MEAN) {
        r->seq.compute_all = true;
        r->pool_sum = calloc(d, sizeof *r->pool_sum);
    }
    if (!r->pool_last || (r->pooling == BLADE_POOL_MEAN && !r->pool_sum))
        return blade_error_set(err, "out of memory");
    return 0;
}

/* One choice of a request; the choices after the first copy its prompt. */
static request_state *new_choice(const blade_engine *e, const blade_request *q, int32_t choice,
                                 const request_state *first, blade_error *err)
{
    double t_submit = blade_clock_seconds(); /* tokenizing counts towards the time to first token */
    request_state *r = calloc(1, sizeof *r);
    if (!r)
        return blade_error_set(err, "out of memory"), NULL;
    r->pin_prefix = q->pin_prefix;
    r->speculative = q->speculative;
    r->seq.cls = q->cls;
    if (first) {
        r->tokens = malloc((size_t)first->cap_tokens * sizeof *r->tokens);
        if (!r->tokens) {
            engine_request_free(r);
            return blade_error_set(err, "out of memory"), NULL;
        }
        memcpy(r->tokens, first->tokens, (size_t)first->seq.n_prompt * sizeof *r->tokens);
        r->cap_tokens = first->cap_tokens;
        r->seq.n_tokens = r->seq.n_prompt = first->seq.n_prompt;
        r->seq.max_total = first->seq.max_total;
    } else if (tokenize_prompt(e, q, r, err)) {
        engine_request_free(r);
        return NULL;
    }
    r->seq.tokens = r->tokens;
    if (q->embed != BLADE_POOL_NONE && embedding_init(e, q, r, err)) {
        engine_request_free(r);
        return NULL;
    }
    if (request_output_init(&r->out, &e->vocab, q, choice, r->tokens, r->seq.n_prompt, err)) {
        engine_request_free(r);
        return NULL;
    }
    r->out.t_submit = t_submit;
    if (q->cache_salt && !(r->salt = strdup(q->cache_salt))) {
        engine_request_free(r);
        return blade_error_set(err, "out of memory"), NULL;
    }
    return r;
}

request_state *engine_request_new(const blade_engine *e, const blade_request *q, blade_error *err)
{
    if (validate_request(q, err))
        return NULL;
    request_state *r = new_choice(e, q, 0, NULL, err);
    if (!r)
        return NULL;
    r->export_kv = q->export_kv;
    if (q->import && take_import(e, q->import, r, err)) {
        engine_request_free(r);
        return NULL;
    }
    request_state **tail = &r->followers;
    for (int32_t i = 1; i < q->n; i++) {
        request_state *f = new_choice(e, q, i, r, err);
        if (!f) {
            engine_request_free(r);
            return NULL;
        }
        *tail = f;
        tail = &f->next_live;
    }
    return r;
}

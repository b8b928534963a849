/* The evaluation text and its chunks (eval.h): the config every evaluation shares, and the
 * text tokenized once and cut into the llama.cpp method's chunks. */

#include "blade/eval.h"

#include <stdlib.h>
#include <string.h>

void blade_eval_config_default(blade_eval_config *c)
{
    memset(c, 0, sizeof *c);
    c->n_ctx = 512;
    c->max_chunks = 0;
    c->batch_tokens = 512;
    c->n_threads = 0;
    c->kv_type = BLADE_KV_F16;
}

int blade_eval_config_validate(const blade_eval_config *c, blade_error *err)
{
    if (c->n_ctx < 4)
        return blade_error_set(err, "chunk length %d is too short: at least 4 tokens", c->n_ctx);
    if (c->max_chunks < 0)
        return blade_error_set(err, "chunk limit %d is negative", c->max_chunks);
    if (c->batch_tokens < 1)
        return blade_error_set(err, "tokens per forward call %d must be positive", c->batch_tokens);
    if (blade_kv_type_size(c->kv_type) == 0)
        return blade_error_set(err, "unknown KV type %d", (int)c->kv_type);
    return 0;
}

int32_t blade_eval_scored_per_chunk(int32_t n_ctx)
{
    return n_ctx - 1 - n_ctx / 2;
}

int blade_eval_text_init(blade_eval_text *t, const blade_model *m, const char *text, size_t len,
                         const blade_eval_config *cfg, blade_error *err)
{
    memset(t, 0, sizeof *t);
    if (blade_eval_config_validate(cfg, err))
        return -1;
    if (blade_tokenizer_bos(m->tokenizer) < 0)
        return blade_error_set(err, "the model's vocabulary has no BOS token, which the perplexity method needs");
    if (blade_tokenizer_encode(m->tokenizer, text, len, true, false, &t->tokens, &t->n_tokens, err))
        return -1;
    size_t n_chunks = t->n_tokens / (size_t)cfg->n_ctx;
    if (n_chunks == 0) {
        blade_error_set(err, "the text has %zu tokens, fewer than one chunk of %d", t->n_tokens, cfg->n_ctx);
        blade_eval_text_free(t);
        return -1;
    }
    if (cfg->max_chunks > 0 && n_chunks > (size_t)cfg->max_chunks)
        n_chunks = (size_t)cfg->max_chunks;
    if (n_chunks > INT32_MAX)
        n_chunks = INT32_MAX;
    t->n_ctx = cfg->n_ctx;
    t->n_chunks = (int32_t)n_chunks;
    return 0;
}

void blade_eval_text_free(blade_eval_text *t)
{
    free(t->tokens);
    memset(t, 0, sizeof *t);
}

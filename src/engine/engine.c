#include "blade/engine.h"

#include "blade/kernels.h"
#include "blade/kv_cache.h"
#include "blade/runner.h"
#include "blade/stop.h"
#include "blade/tokenizer.h"

#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_STOP_STRINGS 64
#define MAX_CHOICES 16
#define MAX_STOP_LEN 1024

typedef struct request_state {
    blade_sched_seq seq;
    uint64_t id;
    int32_t choice;
    struct request_state *followers; /* choices 1..n-1, started once choice 0 has the prompt cached */
    blade_token_callback callback;
    void *user;
    int32_t max_tokens;
    bool ignore_eos;
    int32_t logprobs;
    bool want_logits;
    bool pin_prefix;
    /* Static batching only: answered in full, but its seat in the batch keeps computing
     * (tokens nobody sees) until every member has finished, as in a fixed-shape batch. */
    bool padding;
    char *salt;
    int32_t *tokens;
    int32_t cap_tokens;
    int32_t n_generated;
    blade_sampler *sampler;
    blade_detokenizer detok;
    blade_stop_matcher stop;
    char *piece; /* detokenizer output of one token */
    char *text;  /* text of one event */
    size_t cap_text;
    double t_submit, t_scheduled, t_first_token;
    struct request_state *next_live, *prev_live;
} request_state;

struct blade_engine {
    const blade_model *m;
    blade_engine_config cfg;
    blade_threadpool *pool;
    blade_kv_store *store;
    blade_kv_cache *kv;
    blade_scheduler *sched;
    blade_runner *runner;
    int32_t max_context;
    size_t piece_cap;

    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work;
    pthread_cond_t idle;
    request_state *incoming_head, *incoming_tail; /* submitted, not yet seen by the loop */
    uint64_t *aborts;
    int32_t n_aborts, cap_aborts;
    bool stopping, drain, loop_idle;
    bool quitting; /* engine thread: finishing everything for good, no seat is kept */
    uint64_t next_id;
    blade_engine_stats stats; /* guarded by mu */

    /* engine-thread state */
    request_state *live; /* every request known to the loop */
    blade_batch_seq *batch;
    float *logits;   /* [max_seqs][n_vocab] */
    float *logprobs; /* [n_vocab] */
    uint64_t computed_tokens, generated_tokens, finished;
    int32_t max_running;
    const blade_kv_cache_seq **live_kv; /* scratch for invariant checks */
    int32_t cap_live_kv;
    uint64_t invariant_checks;
    char invariant_error[600];
};

const char *blade_finish_reason_name(blade_finish_reason r)
{
    static const char *const names[] = {"none", "stop", "length", "abort", "error"};
    return names[r];
}

void blade_engine_config_default(blade_engine_config *c)
{
    memset(c, 0, sizeof *c);
    c->n_threads = 0;
    c->kv_mem_bytes = (size_t)1 << 30;
    c->block_size = 16;
    c->kv_type = BLADE_KV_F16;
    c->prefix_caching = true;
    blade_sched_config_default(&c->sched);
    c->max_context = 0;
}

void blade_request_default(blade_request *r)
{
    memset(r, 0, sizeof *r);
    r->add_bos = true;
    blade_sampling_params_default(&r->sampling);
    r->max_tokens = 16;
    r->logprobs = -1;
    r->n = 1;
    r->cls = BLADE_CLASS_INTERACTIVE;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The prefix cache must never hand one model's KV to another: the model's identity is
 * the digest of its metadata and tensor table. */
static void model_identity(const blade_model *m, uint8_t out[BLADE_HASH_BYTES])
{
    unsigned int len = 0;
    memset(out, 0, BLADE_HASH_BYTES);
    EVP_Digest(m->file->map, m->file->data_offset, out, &len, EVP_sha256(), NULL);
}

static void *engine_loop(void *arg);

blade_engine *blade_engine_new(const blade_model *m, const blade_engine_config *cfg, blade_error *err)
{
    blade_engine *e = calloc(1, sizeof *e);
    if (!e)
        return blade_error_set(err, "out of memory"), NULL;
    e->m = m;
    e->cfg = *cfg;
    e->next_id = 1;
    e->max_context = cfg->max_context > 0 ? cfg->max_context : m->hp.n_ctx_train;
    if (cfg->block_size <= 0 || cfg->block_size > 1024) {
        free(e);
        return blade_error_set(err, "block size %d is out of range (1..1024)", cfg->block_size), NULL;
    }
    blade_kv_store_config store_cfg = blade_model_kv_config(&m->hp, cfg->kv_type, cfg->block_size, 0);
    size_t block_bytes = blade_kv_store_block_bytes(&store_cfg);
    int64_t n_blocks = (int64_t)(cfg->kv_mem_bytes / block_bytes);
    if (n_blocks < 1 || n_blocks > INT32_MAX / cfg->block_size) {
        free(e);
        return blade_error_set(err, "a KV budget of %zu bytes gives %lld blocks of %zu bytes; need 1..%d",
                               cfg->kv_mem_bytes, (long long)n_blocks, block_bytes, INT32_MAX / cfg->block_size),
               NULL;
    }
    store_cfg.n_blocks = (int32_t)n_blocks;
    blade_kv_cache_config kc = {.n_blocks = (int32_t)n_blocks, .block_size = cfg->block_size,
                                .prefix_caching = cfg->prefix_caching};
    model_identity(m, kc.model_id);
    /* Without chunked prefill a whole prompt runs in one step, so the runner must take the
     * longest one. */
    int32_t runner_tokens = cfg->sched.max_batch_tokens;
    if (!cfg->sched.chunked_prefill && e->max_context > runner_tokens)
        runner_tokens = e->max_context;
    if (cfg->sched.max_seqs > runner_tokens)
        runner_tokens = cfg->sched.max_seqs;
    e->piece_cap = blade_tokenizer_max_token_bytes(m->tokenizer) + 16;
    e->pool = blade_threadpool_new(cfg->n_threads);
    e->store = e->pool ? blade_kv_store_new(&store_cfg, err) : NULL;
    e->kv = e->store ? blade_kv_cache_new(&kc, err) : NULL;
    e->sched = e->kv ? blade_scheduler_new(&cfg->sched, e->kv, err) : NULL;
    e->runner = e->sched ? blade_runner_new(m, e->store, e->pool, runner_tokens, err) : NULL;
    e->batch = calloc((size_t)cfg->sched.max_seqs, sizeof *e->batch);
    e->logits = malloc((size_t)cfg->sched.max_seqs * m->hp.n_vocab * sizeof(float));
    e->logprobs = malloc((size_t)m->hp.n_vocab * sizeof(float));
    if (!e->runner || !e->batch || !e->logits || !e->logprobs) {
        if (e->runner)
            blade_error_set(err, "out of memory");
        else if (!e->pool)
            blade_error_set(err, "cannot start the thread pool");
        blade_engine_free(e, false);
        return NULL;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->idle, NULL);
    e->loop_idle = true;
    if (pthread_create(&e->thread, NULL, engine_loop, e) != 0) {
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->work);
        pthread_cond_destroy(&e->idle);
        e->thread = 0;
        blade_error_set(err, "cannot start the engine thread");
        blade_engine_free(e, false);
        return NULL;
    }
    return e;
}

/* ---- request lifetime ---- */

static void request_free(request_state *r)
{
    if (!r)
        return;
    while (r->followers) {
        request_state *f = r->followers;
        r->followers = f->next_live;
        request_free(f);
    }
    free(r->tokens);
    blade_sampler_free(r->sampler);
    blade_stop_destroy(&r->stop);
    free(r->piece);
    free(r->text);
    free(r->salt);
    blade_kv_cache_seq_destroy(&r->seq.kv);
    free(r);
}

static int validate_request(const blade_request *q, blade_error *err)
{
    if (!q->callback)
        return blade_error_set(err, "a request needs a callback");
    if (q->n < 1 || q->n > MAX_CHOICES)
        return blade_error_set(err, "n must be between 1 and %d, got %d", MAX_CHOICES, q->n);
    if (q->max_tokens <= 0)
        return blade_error_set(err, "max_tokens must be at least 1, got %d", q->max_tokens);
    if (q->logprobs < -1 || q->logprobs > BLADE_MAX_TOP_LOGPROBS)
        return blade_error_set(err, "logprobs must be between 0 and %d, got %d", BLADE_MAX_TOP_LOGPROBS,
                               q->logprobs);
    if (q->n_stop < 0 || q->n_stop > MAX_STOP_STRINGS)
        return blade_error_set(err, "at most %d stop strings are allowed, got %d", MAX_STOP_STRINGS, q->n_stop);
    for (int32_t i = 0; i < q->n_stop; i++)
        if (!q->stop[i] || strnlen(q->stop[i], MAX_STOP_LEN + 1) > MAX_STOP_LEN)
            return blade_error_set(err, "stop string %d is missing or longer than %d bytes", i, MAX_STOP_LEN);
    if (q->cls != BLADE_CLASS_INTERACTIVE && q->cls != BLADE_CLASS_BATCH)
        return blade_error_set(err, "unknown traffic class %d", (int)q->cls);
    return blade_sampling_params_validate(&q->sampling, err);
}

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
    if (n >= (size_t)e->max_context) {
        free(toks);
        return blade_error_set(err, "the prompt has %zu tokens; the context limit is %d, leaving no room to generate",
                               n, e->max_context);
    }
    int64_t total = (int64_t)n + q->max_tokens;
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

/* One choice of a request, with everything but its id. */
static request_state *new_choice(blade_engine *e, const blade_request *q, int32_t choice, const request_state *first,
                                 blade_error *err)
{
    request_state *r = calloc(1, sizeof *r);
    if (!r)
        return blade_error_set(err, "out of memory"), NULL;
    r->t_submit = now();
    r->choice = choice;
    r->callback = q->callback;
    r->user = q->user;
    r->max_tokens = q->max_tokens;
    r->ignore_eos = q->ignore_eos;
    r->logprobs = q->logprobs;
    r->want_logits = q->want_logits;
    r->pin_prefix = q->pin_prefix;
    r->seq.cls = q->cls;
    blade_sampling_params sp = q->sampling;
    sp.seed += (uint64_t)choice;
    r->piece = malloc(e->piece_cap);
    r->sampler = blade_sampler_new(&sp, e->m->hp.n_vocab);
    if (!r->piece || !r->sampler || blade_stop_init(&r->stop, q->stop, q->n_stop)) {
        request_free(r);
        return blade_error_set(err, "out of memory"), NULL;
    }
    if (first) {
        r->tokens = malloc((size_t)first->cap_tokens * sizeof *r->tokens);
        if (!r->tokens) {
            request_free(r);
            return blade_error_set(err, "out of memory"), NULL;
        }
        memcpy(r->tokens, first->tokens, (size_t)first->seq.n_prompt * sizeof *r->tokens);
        r->cap_tokens = first->cap_tokens;
        r->seq.n_tokens = r->seq.n_prompt = first->seq.n_prompt;
        r->seq.max_total = first->seq.max_total;
    } else if (tokenize_prompt(e, q, r, err)) {
        request_free(r);
        return NULL;
    }
    r->seq.tokens = r->tokens;
    for (int32_t i = 0; i < r->seq.n_prompt; i++)
        blade_sampler_accept(r->sampler, r->tokens[i], false);
    blade_detokenizer_init(&r->detok, e->m->tokenizer, false);
    /* The prompt's text is not emitted, but it primes the detokenizer so the first
     * generated piece keeps its leading space. */
    r->detok.at_start = false;
    /* the sequence's KV state is set up on the engine thread: the cache is single-threaded */
    if (q->cache_salt && !(r->salt = strdup(q->cache_salt))) {
        request_free(r);
        return blade_error_set(err, "out of memory"), NULL;
    }
    return r;
}

uint64_t blade_engine_submit(blade_engine *e, const blade_request *q, blade_error *err)
{
    if (validate_request(q, err))
        return 0;
    request_state *r = new_choice(e, q, 0, NULL, err);
    if (!r)
        return 0;
    request_state **tail = &r->followers;
    for (int32_t i = 1; i < q->n; i++) {
        request_state *f = new_choice(e, q, i, r, err);
        if (!f) {
            request_free(r);
            return 0;
        }
        *tail = f;
        tail = &f->next_live;
    }

    pthread_mutex_lock(&e->mu);
    if (e->stopping) {
        pthread_mutex_unlock(&e->mu);
        request_free(r);
        return blade_error_set(err, "the engine is shutting down"), 0;
    }
    r->id = r->seq.id = e->next_id++;
    for (request_state *f = r->followers; f; f = f->next_live)
        f->id = f->seq.id = r->id;
    if (e->incoming_tail)
        e->incoming_tail->next_live = r;
    else
        e->incoming_head = r;
    e->incoming_tail = r;
    e->loop_idle = false;
    uint64_t id = r->id;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->mu);
    return id;
}

bool blade_engine_abort(blade_engine *e, uint64_t id)
{
    pthread_mutex_lock(&e->mu);
    bool known = id > 0 && id < e->next_id;
    if (known && e->n_aborts == e->cap_aborts) {
        int32_t cap = e->cap_aborts ? e->cap_aborts * 2 : 16;
        uint64_t *grown = realloc(e->aborts, (size_t)cap * sizeof *grown);
        if (grown) {
            e->aborts = grown;
            e->cap_aborts = cap;
        } else {
            known = false;
        }
    }
    if (known) {
        e->aborts[e->n_aborts++] = id;
        pthread_cond_signal(&e->work);
    }
    pthread_mutex_unlock(&e->mu);
    return known;
}

void blade_engine_wait_idle(blade_engine *e)
{
    pthread_mutex_lock(&e->mu);
    while (!e->loop_idle)
        pthread_cond_wait(&e->idle, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

/* ---- the step loop (engine thread only below) ---- */

static void live_unlink(blade_engine *e, request_state *r)
{
    if (r->prev_live)
        r->prev_live->next_live = r->next_live;
    else
        e->live = r->next_live;
    if (r->next_live)
        r->next_live->prev_live = r->prev_live;
}

static void live_add(blade_engine *e, request_state *r)
{
    blade_kv_cache_seq_init(&r->seq.kv, e->kv, r->salt, r->salt ? strlen(r->salt) : 0);
    r->prev_live = NULL;
    r->next_live = e->live;
    if (e->live)
        e->live->prev_live = r;
    e->live = r;
    blade_scheduler_add(e->sched, &r->seq);
}

/* The other choices start once the first has its prompt in the cache (its first token),
 * so they find every full prompt block there. */
static void release_followers(blade_engine *e, request_state *r)
{
    while (r->followers) {
        request_state *f = r->followers;
        r->followers = f->next_live;
        f->t_submit = r->t_submit;
        live_add(e, f);
    }
}

static bool append_text(request_state *r, const char *s, size_t n, size_t *len)
{
    if (*len + n + 1 > r->cap_text) {
        size_t cap = r->cap_text ? r->cap_text : 256;
        while (cap < *len + n + 1)
            cap *= 2;
        char *grown = realloc(r->text, cap);
        if (!grown)
            return false;
        r->text = grown;
        r->cap_text = cap;
    }
    memcpy(r->text + *len, s, n);
    *len += n;
    r->text[*len] = 0;
    return true;
}

/* End of the stream: the text the detokenizer and the stop matcher still hold is released
 * (a stop string that it completes still wins). Returns true when a stop string matched. */
static bool drain_text(request_state *r, size_t *len)
{
    char tail[16];
    size_t t = blade_detokenizer_flush(&r->detok, tail, sizeof tail);
    const char *out;
    size_t n;
    bool stopped = blade_stop_push(&r->stop, tail, t, &out, &n);
    append_text(r, out ? out : "", n, len);
    if (!stopped) {
        blade_stop_flush(&r->stop, &out, &n);
        append_text(r, out ? out : "", n, len);
    }
    return stopped;
}

static void fill_usage(const request_state *r, blade_token_event *ev)
{
    ev->request_id = r->id;
    ev->choice = r->choice;
    ev->user = r->user;
    ev->prompt_tokens = r->seq.n_prompt;
    ev->completion_tokens = r->n_generated;
    ev->cached_tokens = r->seq.kv.n_cached_tokens;
    ev->queue_seconds = r->t_scheduled > 0 ? r->t_scheduled - r->t_submit : 0;
    ev->ttft_seconds = r->t_first_token > 0 ? r->t_first_token - r->t_submit : 0;
}

/* Takes a finished choice out of the step loop; a pinned prompt's blocks are pinned while
 * the sequence still holds them. */
static void retire(blade_engine *e, request_state *r)
{
    if (r->pin_prefix && r->seq.n_computed >= r->seq.n_prompt)
        blade_kv_cache_pin_prefix(e->kv, r->tokens, r->seq.n_prompt, r->salt, r->salt ? strlen(r->salt) : 0);
    if (r->seq.state != BLADE_SEQ_FINISHED)
        blade_scheduler_remove(e->sched, &r->seq);
    live_unlink(e, r);
}

/* A fixed-shape batch sizes every seat for its longest member, so a padding seat may run
 * past its own request's length: as many more steps as the member with the most left can
 * take (what --kv-alloc contiguous then reserves for it), up to the context limit. False
 * when no member is left, the batch ending with this one, or when it cannot grow. */
static bool become_padding(blade_engine *e, request_state *r)
{
    int64_t rest = 0;
    for (const request_state *q = e->live; q; q = q->next_live)
        if (q != r && !q->padding && q->seq.state == BLADE_SEQ_RUNNING && q->seq.max_total - q->seq.n_tokens > rest)
            rest = q->seq.max_total - q->seq.n_tokens;
    int64_t total = r->seq.n_tokens + rest;
    total = total < e->max_context ? total : e->max_context;
    if (rest == 0 || total <= r->seq.n_tokens)
        return false;
    int32_t *grown = realloc(r->tokens, (size_t)total * sizeof *grown);
    if (!grown)
        return false;
    r->tokens = grown;
    r->seq.tokens = grown;
    r->cap_tokens = r->seq.max_total = (int32_t)total;
    r->padding = true;
    return true;
}

/* After a request's last event: static batching keeps a running member's seat computing
 * until its batch ends (also when the client stopped reading: a fixed-shape batch cannot
 * drop a row); otherwise its blocks go back to the pool and its memory is freed. */
static void end_request(blade_engine *e, request_state *r, blade_finish_reason why)
{
    if (e->cfg.sched.mode == BLADE_SCHED_STATIC && why != BLADE_FINISH_ERROR && !e->quitting && !r->padding &&
        r->seq.state == BLADE_SEQ_RUNNING && become_padding(e, r))
        return;
    retire(e, r);
    request_free(r);
}

/* Ends a request: one last event (a padding seat has had it already), then end_request. */
static void finish(blade_engine *e, request_state *r, blade_finish_reason why, const char *error)
{
    if (r->padding) {
        end_request(e, r, why);
        return;
    }
    blade_token_event ev = {0};
    fill_usage(r, &ev);
    ev.token = -1;
    ev.finish = why;
    ev.error = error;
    ev.text = "";
    release_followers(e, r);
    r->callback(&ev);
    e->finished++;
    end_request(e, r, why);
}

static void take_incoming(blade_engine *e)
{
    pthread_mutex_lock(&e->mu);
    request_state *in = e->incoming_head;
    e->incoming_head = e->incoming_tail = NULL;
    int32_t n_aborts = e->n_aborts;
    uint64_t aborts[64];
    int32_t take = n_aborts < 64 ? n_aborts : 64;
    if (take) {
        memcpy(aborts, e->aborts, (size_t)take * sizeof *aborts);
        memmove(e->aborts, e->aborts + take, (size_t)(n_aborts - take) * sizeof *aborts);
        e->n_aborts -= take;
    }
    pthread_mutex_unlock(&e->mu);

    while (in) {
        request_state *next = in->next_live;
        live_add(e, in);
        in = next;
    }
    /* finishing a first choice starts its followers, so rescan until none is left */
    for (int32_t i = 0; i < take; i++) {
        request_state *r = e->live;
        while (r) {
            if (r->id == aborts[i] && !r->padding) {
                finish(e, r, BLADE_FINISH_ABORT, NULL);
                r = e->live;
            } else {
                r = r->next_live;
            }
        }
    }
}

/* Samples the next token of a sequence whose chunk reached its end, and emits it. */
static void emit_token(blade_engine *e, request_state *r, const float *logits)
{
    const blade_tokenizer *tok = e->m->tokenizer;
    int32_t id = blade_sampler_sample(r->sampler, logits);
    if (id < 0) {
        finish(e, r, BLADE_FINISH_ERROR, "the model produced no usable logits (all NaN or -inf)");
        return;
    }
    if (r->padding) {
        r->tokens[r->seq.n_tokens++] = id;
        if (r->seq.n_tokens >= r->seq.max_total)
            finish(e, r, BLADE_FINISH_LENGTH, NULL); /* its fixed-shape buffer is full */
        return;
    }
    if (r->t_first_token == 0)
        r->t_first_token = now();
    release_followers(e, r);
    blade_sampler_accept(r->sampler, id, true);
    r->tokens[r->seq.n_tokens++] = id;
    r->n_generated++;
    e->generated_tokens++;

    blade_token_event ev = {0};
    ev.token = id;
    if (r->logprobs >= 0) {
        blade_logits_to_logprobs(logits, e->m->hp.n_vocab, e->logprobs);
        ev.logprob = e->logprobs[id];
        ev.n_top = r->logprobs ? blade_top_logprobs(e->logprobs, e->m->hp.n_vocab, r->logprobs, ev.top_ids,
                                                    ev.top_logprobs)
                               : 0;
    }
    if (r->want_logits)
        ev.logits = logits;

    blade_finish_reason why = BLADE_FINISH_NONE;
    size_t len = 0;
    if (!r->ignore_eos && blade_tokenizer_is_eog(tok, id)) {
        drain_text(r, &len);
        why = BLADE_FINISH_STOP;
    } else {
        const char *released;
        size_t n_released;
        size_t n = blade_detokenizer_push(&r->detok, id, r->piece, e->piece_cap);
        if (blade_stop_push(&r->stop, r->piece, n, &released, &n_released))
            why = BLADE_FINISH_STOP;
        append_text(r, released ? released : "", n_released, &len);
        if (why == BLADE_FINISH_NONE && (r->n_generated >= r->max_tokens || r->seq.n_tokens >= r->seq.max_total))
            why = drain_text(r, &len) ? BLADE_FINISH_STOP : BLADE_FINISH_LENGTH;
    }
    fill_usage(r, &ev);
    ev.text = r->text ? r->text : "";
    ev.text_len = len;
    ev.finish = why;
    if (why == BLADE_FINISH_NONE) {
        r->callback(&ev);
        return;
    }
    r->callback(&ev);
    e->finished++;
    end_request(e, r, why);
}

/* Static batching: the batch ends when its last real member does; a padding seat that was
 * preempted is dropped at once (a request-level engine never reruns a finished request). */
static void end_padding(blade_engine *e)
{
    if (e->cfg.sched.mode != BLADE_SCHED_STATIC)
        return;
    bool members_left = false;
    for (request_state *r = e->live; r; r = r->next_live)
        members_left |= !r->padding && r->seq.state == BLADE_SEQ_RUNNING;
    for (request_state *r = e->live, *next; r; r = next) {
        next = r->next_live;
        if (r->padding && (!members_left || r->seq.state != BLADE_SEQ_RUNNING))
            finish(e, r, BLADE_FINISH_NONE, NULL);
    }
}

static void run_step(blade_engine *e)
{
    end_padding(e);
    blade_sched_plan plan;
    blade_scheduler_schedule(e->sched, &plan);
    for (int32_t i = 0; i < plan.n_rejected; i++)
        finish(e, (request_state *)plan.rejected[i], BLADE_FINISH_ERROR,
               "the request needs more KV cache blocks than the whole pool holds");
    if (plan.n_items == 0)
        return;
    double t = now();
    for (int32_t i = 0; i < plan.n_items; i++) {
        blade_sched_item *it = &plan.items[i];
        request_state *r = (request_state *)it->seq;
        if (r->t_scheduled == 0)
            r->t_scheduled = t;
        e->batch[i] = (blade_batch_seq){
            .tokens = r->tokens + r->seq.n_computed,
            .n_tokens = it->n_tokens,
            .pos0 = r->seq.n_computed,
            .block_table = r->seq.kv.blocks,
            .n_blocks = r->seq.kv.n_blocks,
            .n_logits = it->want_logits ? 1 : 0,
            .logits = e->logits + (size_t)i * e->m->hp.n_vocab,
        };
    }
    blade_error err = {{0}};
    if (blade_runner_forward(e->runner, e->batch, plan.n_items, &err)) {
        for (int32_t i = 0; i < plan.n_items; i++)
            finish(e, (request_state *)plan.items[i].seq, BLADE_FINISH_ERROR, err.msg);
        return;
    }
    blade_scheduler_commit(e->sched, &plan);
    e->computed_tokens += (uint64_t)plan.n_tokens;
    if (plan.n_items > e->max_running)
        e->max_running = plan.n_items;
    for (int32_t i = 0; i < plan.n_items; i++)
        if (plan.items[i].want_logits)
            emit_token(e, (request_state *)plan.items[i].seq, e->logits + (size_t)i * e->m->hp.n_vocab);
    end_padding(e);
}

static void check_invariants(blade_engine *e)
{
    int32_t n = 0;
    for (request_state *r = e->live; r; r = r->next_live)
        n++;
    if (n > e->cap_live_kv) {
        const blade_kv_cache_seq **grown = realloc(e->live_kv, (size_t)n * 2 * sizeof *grown);
        if (!grown)
            return;
        e->live_kv = grown;
        e->cap_live_kv = n * 2;
    }
    n = 0;
    for (request_state *r = e->live; r; r = r->next_live)
        e->live_kv[n++] = &r->seq.kv;
    blade_error err = {{0}};
    e->invariant_checks++;
    if (blade_kv_cache_check(e->kv, e->live_kv, n, &err) && !e->invariant_error[0])
        snprintf(e->invariant_error, sizeof e->invariant_error, "after step %llu: %s",
                 (unsigned long long)e->invariant_checks, err.msg);
}

static void publish_stats(blade_engine *e)
{
    if (e->cfg.check_invariants)
        check_invariants(e);
    blade_sched_stats ss;
    blade_kv_cache_stats ks;
    blade_scheduler_stats(e->sched, &ss);
    blade_kv_cache_stats_get(e->kv, &ks);
    blade_engine_stats *s = &e->stats;
    pthread_mutex_lock(&e->mu);
    s->running = ss.running;
    s->waiting = ss.waiting;
    s->kv_blocks_total = ks.blocks_total;
    s->kv_blocks_used = ks.blocks_used;
    s->kv_blocks_cached = ks.blocks_cached;
    s->kv_blocks_free = ks.blocks_free;
    s->kv_blocks_pinned = ks.blocks_pinned;
    s->block_size = e->cfg.block_size;
    s->prefix_hit_tokens = ks.prefix_hit_tokens;
    s->prefix_query_tokens = ks.prefix_query_tokens;
    s->prefix_hit_rate = ks.prefix_query_tokens ? (double)ks.prefix_hit_tokens / (double)ks.prefix_query_tokens : 0;
    s->kv_utilisation =
        ks.token_slots_allocated ? (double)ks.token_slots_used / (double)ks.token_slots_allocated : 0;
    s->evictions = ks.evictions;
    s->preemptions = ss.preemptions;
    s->steps = ss.steps;
    s->computed_tokens = e->computed_tokens;
    s->generated_tokens = e->generated_tokens;
    s->requests_finished = e->finished;
    s->max_running = e->max_running;
    s->invariant_checks = e->invariant_checks;
    memcpy(s->invariant_error, e->invariant_error, sizeof s->invariant_error);
    pthread_mutex_unlock(&e->mu);
}

static void *engine_loop(void *arg)
{
    blade_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        for (;;) {
            bool pending = e->incoming_head || e->n_aborts;
            bool busy = pending || !blade_scheduler_idle(e->sched);
            if (!busy && !e->loop_idle) {
                e->loop_idle = true;
                pthread_cond_broadcast(&e->idle);
            }
            if (e->stopping && (!e->drain || !busy))
                break;
            if (busy)
                break;
            pthread_cond_wait(&e->work, &e->mu);
        }
        bool quit = e->stopping && (!e->drain || (!e->incoming_head && !e->n_aborts && blade_scheduler_idle(e->sched)));
        bool abort_all = e->stopping && !e->drain;
        pthread_mutex_unlock(&e->mu);
        if (quit) {
            e->quitting = true;
            take_incoming(e);
            if (abort_all)
                while (e->live)
                    finish(e, e->live, BLADE_FINISH_ABORT, NULL);
            publish_stats(e);
            pthread_mutex_lock(&e->mu);
            e->loop_idle = true;
            pthread_cond_broadcast(&e->idle);
            pthread_mutex_unlock(&e->mu);
            return NULL;
        }
        take_incoming(e);
        run_step(e);
        publish_stats(e);
    }
}

void blade_engine_free(blade_engine *e, bool drain)
{
    if (!e)
        return;
    if (e->thread) {
        pthread_mutex_lock(&e->mu);
        e->stopping = true;
        e->drain = drain;
        pthread_cond_signal(&e->work);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->thread, NULL);
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->work);
        pthread_cond_destroy(&e->idle);
    }
    while (e->live) {
        request_state *r = e->live;
        e->live = r->next_live;
        request_free(r);
    }
    free(e->aborts);
    free(e->live_kv);
    free(e->batch);
    free(e->logits);
    free(e->logprobs);
    blade_runner_free(e->runner);
    blade_scheduler_free(e->sched);
    blade_kv_cache_free(e->kv);
    blade_kv_store_free(e->store);
    blade_threadpool_free(e->pool);
    free(e);
}

void blade_engine_stats_get(blade_engine *e, blade_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
}

const blade_model *blade_engine_model(const blade_engine *e)
{
    return e->m;
}

int64_t blade_engine_kv_tokens(const blade_engine *e)
{
    return (int64_t)e->store->n_blocks * e->cfg.block_size;
}

int32_t blade_engine_max_context(const blade_engine *e)
{
    return e->max_context;
}

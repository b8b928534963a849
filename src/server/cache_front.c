/* The semantic cache in front of the engine (cache_front.h): eligibility, the key, the
 * prompt's embedding as a prefill-only engine request, storing finished answers. */

#include "server/cache_front.h"

#include "blade/model.h"
#include "blade/tokenizer.h"
#include "common/clock.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- who takes part, and under which key ---- */

static bool takes_part(const api_request *r)
{
    if (r->ep == API_EMBEDDINGS || r->semantic_cache == 0 || r->n_prompts != 1 || r->n != 1 || r->logprobs >= 0 ||
        r->echo)
        return false;
    return r->sampling.temperature == 0 || r->semantic_cache == 1;
}

/* Everything of the request that changes its answer besides the prompt, one way only: the
 * same parameters give the same bytes. The seed matters only when sampling. */
static char *encode_params(const api_request *r)
{
    const blade_sampling_params *s = &r->sampling;
    api_buf b = {0};
    char line[512];
    int n = snprintf(line, sizeof line, "ep=%d max=%d eos=%d T=%a k=%d p=%a minp=%a rp=%a rln=%d pp=%a fp=%a seed=%llu",
                     (int)r->ep, r->max_tokens, (int)r->ignore_eos, (double)s->temperature, s->top_k,
                     (double)s->top_p, (double)s->min_p, (double)s->repeat_penalty, s->repeat_last_n,
                     (double)s->presence_penalty, (double)s->frequency_penalty,
                     s->temperature == 0 ? 0ull : (unsigned long long)s->seed);
    api_buf_append(&b, line, (size_t)n);
    for (int32_t i = 0; i < r->n_stop; i++) {
        n = snprintf(line, sizeof line, " stop=%zu:", strlen(r->stop[i]));
        api_buf_append(&b, line, (size_t)n);
        api_buf_append(&b, r->stop[i], strlen(r->stop[i]));
    }
    api_buf_append(&b, "", 1);
    if (b.failed) {
        api_buf_free(&b);
        return NULL;
    }
    return b.data;
}

int cache_ticket_init(cache_ticket *t, const api_model *am, const api_request *req, const char *bearer)
{
    memset(t, 0, sizeof *t);
    if (!takes_part(req))
        return 0;
    const char *salt = req->cache_salt ? req->cache_salt : "";
    bearer = bearer ? bearer : "";
    /* a newline can be in neither a header value nor (checked) the salt */
    size_t len = strlen(bearer) + 1 + strlen(salt) + 1;
    t->tenant = malloc(len);
    t->params = encode_params(req);
    if (!t->tenant || !t->params) {
        cache_ticket_free(t);
        return -1;
    }
    snprintf(t->tenant, len, "%s\n%s", bearer, salt);
    t->active = true;
    t->opted_in = req->semantic_cache == 1;
    t->key = (blade_semcache_key){
        .tenant = t->tenant,
        .model = am->names[0],
        .params = t->params,
        .params_len = strlen(t->params),
        .prompt = req->prompts[0].tokens,
        .prompt_len = (size_t)req->prompts[0].n_tokens * sizeof(int32_t),
    };
    return 0;
}

void cache_ticket_free(cache_ticket *t)
{
    free(t->tenant);
    free(t->params);
    free(t->embedding);
    memset(t, 0, sizeof *t);
}

/* ---- the prompt's embedding ---- */

typedef struct embed_wait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    float *v;
    int32_t n;
    blade_finish_reason finish;
} embed_wait;

/* On the embedding engine's thread. */
static void on_embedding(const blade_token_event *ev)
{
    embed_wait *w = ev->user;
    if (ev->finish == BLADE_FINISH_NONE)
        return;
    pthread_mutex_lock(&w->mu);
    if (ev->embedding && (w->v = malloc((size_t)ev->n_embedding * sizeof *w->v))) {
        memcpy(w->v, ev->embedding, (size_t)ev->n_embedding * sizeof *w->v);
        w->n = ev->n_embedding;
    }
    w->finish = ev->finish;
    w->done = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* The prompt in the embedding model's tokens: the same tokens when it is the served model,
 * else the prompt's text tokenized again; cut to the embedding engine's context. */
static int32_t *embedding_tokens(const api_model *am, const api_prompt *p, int32_t *n_out)
{
    int32_t *toks = NULL;
    size_t n = 0;
    if (am->embed_model == am->model) {
        n = (size_t)p->n_tokens;
        if (!(toks = malloc(n * sizeof *toks)))
            return NULL;
        memcpy(toks, p->tokens, n * sizeof *toks);
    } else {
        const blade_tokenizer *from = am->model->tokenizer, *to = am->embed_model->tokenizer;
        size_t cap = blade_tokenizer_max_token_bytes(from) + 16;
        char *piece = malloc(cap);
        api_buf text = {0};
        if (!piece)
            return NULL;
        blade_detokenizer d;
        blade_detokenizer_init(&d, from, false);
        for (int32_t i = 0; i < p->n_tokens; i++)
            api_buf_append(&text, piece, blade_detokenizer_push(&d, p->tokens[i], piece, cap));
        api_buf_append(&text, piece, blade_detokenizer_flush(&d, piece, cap));
        free(piece);
        blade_error err = {{0}};
        if (text.failed || blade_tokenizer_encode(to, text.data ? text.data : "", text.len,
                                                  blade_tokenizer_wants_bos(to), false, &toks, &n, &err)) {
            api_buf_free(&text);
            return NULL;
        }
        api_buf_free(&text);
    }
    int32_t ctx = blade_engine_max_context(am->embed_engine);
    *n_out = n > (size_t)ctx ? ctx : (int32_t)n;
    return toks;
}

static void deadline_timespec(double deadline, struct timespec *ts)
{
    double left = deadline - blade_clock_seconds();
    clock_gettime(CLOCK_REALTIME, ts);
    if (left < 0)
        left = 0;
    ts->tv_sec += (time_t)left;
    ts->tv_nsec += (long)((left - (double)(time_t)left) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* Runs the embedding request and waits for it; NULL when it failed or the deadline came
 * first (the request is then aborted, and its last event awaited: w lives on this stack). */
static float *embed_prompt(const api_model *am, const api_request *req, double deadline)
{
    int32_t n = 0;
    int32_t *toks = embedding_tokens(am, &req->prompts[0], &n);
    if (!toks || n == 0) {
        free(toks);
        return NULL;
    }
    embed_wait w = {.finish = BLADE_FINISH_NONE};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    blade_request q;
    blade_request_default(&q);
    q.prompt_tokens = toks;
    q.n_prompt_tokens = n;
    q.embed = am->pooling;
    q.cls = req->cls;
    /* the generation that may follow finds these blocks in the prefix cache (same tenant
     * salt, same engine when the served model embeds) */
    q.cache_salt = req->cache_salt;
    q.callback = on_embedding;
    q.user = &w;
    blade_error err = {{0}};
    uint64_t id = blade_engine_submit(am->embed_engine, &q, &err);
    free(toks);
    if (id) {
        pthread_mutex_lock(&w.mu);
        bool aborted = false;
        while (!w.done) {
            if (deadline > 0 && !aborted) {
                struct timespec ts;
                deadline_timespec(deadline, &ts);
                if (pthread_cond_timedwait(&w.cv, &w.mu, &ts) == ETIMEDOUT && !w.done) {
                    aborted = true;
                    blade_engine_abort(am->embed_engine, id);
                }
            } else {
                pthread_cond_wait(&w.cv, &w.mu);
            }
        }
        pthread_mutex_unlock(&w.mu);
    }
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    if (w.finish != BLADE_FINISH_STOP) {
        free(w.v);
        return NULL;
    }
    return w.v;
}

/* ---- lookups and stores ---- */

int cache_lookup(blade_semcache *c, const api_model *am, const api_request *req, cache_ticket *t, double deadline,
                 blade_semcache_hit *hit)
{
    blade_error err = {{0}};
    int tier = blade_semcache_lookup_exact(c, &t->key, hit, &err);
    if (tier != BLADE_SEMCACHE_MISS)
        return tier > 0 ? tier : BLADE_SEMCACHE_MISS;
    if (am->embed_model->hp.n_embd > 0)
        t->embedding = embed_prompt(am, req, deadline);
    tier = blade_semcache_lookup(c, &t->key, t->embedding, hit, &err);
    return tier > 0 ? tier : BLADE_SEMCACHE_MISS;
}

void cache_store(blade_semcache *c, cache_ticket *t, const api_job *job)
{
    if (!t->active || api_job_status(job) != 200)
        return;
    const char *text;
    size_t len;
    blade_finish_reason finish;
    api_job_result(job, &text, &len, &finish);
    bool ok = finish == BLADE_FINISH_STOP || (t->opted_in && finish == BLADE_FINISH_LENGTH);
    if (!ok)
        return;
    int64_t prompt, completion, cached;
    api_job_usage(job, &prompt, &completion, &cached);
    blade_semcache_response resp = {
        .text = text,
        .text_len = len,
        .finish_reason = blade_finish_reason_name(finish),
        .prompt_tokens = (int32_t)prompt,
        .completion_tokens = (int32_t)completion,
    };
    blade_error err = {{0}};
    blade_semcache_insert(c, &t->key, t->embedding, &resp, &err);
}

/* ---- how a hit shows ---- */

blade_finish_reason cache_hit_finish(const blade_semcache_hit *hit)
{
    return strcmp(hit->response.finish_reason, "length") ? BLADE_FINISH_STOP : BLADE_FINISH_LENGTH;
}

static const char *tier_name(const blade_semcache_hit *hit)
{
    return hit->tier == BLADE_SEMCACHE_EXACT ? "exact" : "semantic";
}

void cache_hit_header(const blade_semcache_hit *hit, char *out, size_t cap)
{
    snprintf(out, cap, "hit; tier=%s; similarity=%.4f", tier_name(hit), (double)hit->similarity);
}

json_t *cache_hit_json(const blade_semcache_hit *hit)
{
    return json_pack("{s:b, s:s, s:f}", "hit", 1, "tier", tier_name(hit), "similarity", (double)hit->similarity);
}

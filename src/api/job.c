/* A job's life (job.h): its prompts submitted to the engine, the engine callback that
 * copies each event to the sink (the one part that runs on the engine thread), the events
 * applied to their choices as the consumer takes them, and the job's status and usage.
 * The shapes of what the client reads are response.c's. */

#include "api/job_internal.h"

#include "blade/model.h"
#include "blade/tokenizer.h"
#include "common/clock.h"

#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Runs on the engine thread: copy and hand over, nothing else. */
static void on_event(const blade_token_event *ev)
{
    job_prompt *jp = ev->user;
    api_job *job = jp->job;
    int32_t index = jp->index * job->req.n + ev->choice;
    size_t el = ev->error ? strlen(ev->error) : 0;
    /* the vector goes first in storage, where a float is aligned */
    size_t vec = ev->embedding ? (size_t)ev->n_embedding * sizeof(float) : 0;
    api_event *e = malloc(sizeof *e + vec + ev->text_len + el + 2);
    bool pre = false;
    if (!e) {
        atomic_store(&job->lost, true);
        if (ev->finish == BLADE_FINISH_NONE)
            return;
        /* job_destroy frees it; consumers leave preallocated events alone */
        e = job->choices[index].spare;
        pre = true;
    }
    memset(e, 0, sizeof *e);
    e->preallocated = pre;
    e->job = job;
    e->prompt = jp->index;
    e->choice = ev->choice;
    e->token = ev->token;
    e->logprob = ev->logprob;
    e->n_top = ev->n_top;
    memcpy(e->top_ids, ev->top_ids, sizeof e->top_ids);
    memcpy(e->top_logprobs, ev->top_logprobs, sizeof e->top_logprobs);
    e->finish = ev->finish;
    e->prompt_tokens = ev->prompt_tokens;
    e->completion_tokens = ev->completion_tokens;
    e->cached_tokens = ev->cached_tokens;
    e->queue_seconds = ev->queue_seconds;
    e->ttft_seconds = ev->ttft_seconds;
    e->t = blade_clock_seconds();
    e->text = e->storage;
    if (!pre) {
        if (vec) {
            e->embedding = (float *)(void *)e->storage;
            memcpy(e->embedding, ev->embedding, vec);
            e->n_embedding = ev->n_embedding;
        }
        e->text = e->storage + vec;
        memcpy(e->text, ev->text, ev->text_len);
        e->text[ev->text_len] = 0;
        e->text_len = ev->text_len;
        if (ev->error) {
            memcpy(e->text + ev->text_len + 1, ev->error, el + 1);
            e->error = e->text + ev->text_len + 1;
        }
    }
    api_sink_push(job->sink, e);
}

static void random_id(char *out, size_t cap, const char *prefix)
{
    unsigned char r[12];
    if (RAND_bytes(r, sizeof r) != 1) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ (uint64_t)(uintptr_t)out;
        for (size_t i = 0; i < sizeof r; i++, x = x * 6364136223846793005u + 1442695040888963407u)
            r[i] = (unsigned char)(x >> 56);
    }
    size_t n = (size_t)snprintf(out, cap, "%s", prefix);
    for (size_t i = 0; i < sizeof r && n + 2 < cap; i++)
        n += (size_t)snprintf(out + n, cap - n, "%02x", r[i]);
}

static void job_destroy(api_job *job)
{
    if (!job)
        return;
    for (int32_t i = 0; job->choices && i < job->n_choices; i++) {
        api_buf_free(&job->choices[i].text);
        json_decref(job->choices[i].logprobs);
        free(job->choices[i].embedding);
        free(job->choices[i].spare);
    }
    free(job->choices);
    free(job->prompts);
    free(job->prompt_tokens);
    free(job->cached_tokens);
    free(job->piece);
    json_decref(job->note);
    api_request_free(&job->req);
    free(job);
}

/* A job for req (taken over) with its choices, nothing submitted yet. */
static api_job *job_new(const api_model *am, api_request *req, api_sink *sink, double t_start, api_error *err)
{
    api_job *job = calloc(1, sizeof *job);
    if (!job) {
        api_request_free(req);
        return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), NULL;
    }
    job->am = am;
    job->req = *req;
    memset(req, 0, sizeof *req);
    job->sink = sink;
    job->t_start = t_start;
    atomic_init(&job->lost, false);
    api_error_set(&job->lost_error, 500, "server_error", NULL, NULL,
                  "the server ran out of memory while generating; the output is incomplete");
    job->created = (long long)time(NULL);
    static const char *const id_prefix[] = {[API_COMPLETIONS] = "cmpl-", [API_CHAT] = "chatcmpl-",
                                            [API_EMBEDDINGS] = "embd-"};
    random_id(job->id, sizeof job->id, id_prefix[job->req.ep]);
    int32_t np = job->req.n_prompts;
    job->n_choices = np * job->req.n;
    job->piece_cap = blade_tokenizer_max_token_bytes(am->model->tokenizer) + 16;
    job->prompts = calloc((size_t)np, sizeof *job->prompts);
    job->choices = calloc((size_t)job->n_choices, sizeof *job->choices);
    job->prompt_tokens = calloc((size_t)np, sizeof *job->prompt_tokens);
    job->cached_tokens = calloc((size_t)np, sizeof *job->cached_tokens);
    job->piece = malloc(job->piece_cap);
    bool ok = job->prompts && job->choices && job->prompt_tokens && job->cached_tokens && job->piece;
    for (int32_t i = 0; ok && i < job->n_choices; i++) {
        api_event *spare = calloc(1, sizeof *spare + 2);
        if (!spare)
            ok = false;
        else
            spare->preallocated = true;
        job->choices[i].spare = spare;
    }
    if (!ok) {
        job_destroy(job);
        return api_error_set(err, 500, "server_error", NULL, NULL, "out of memory"), NULL;
    }
    for (int32_t p = 0; p < np; p++) {
        job->prompts[p].job = job;
        job->prompts[p].index = p;
    }
    return job;
}

api_job *api_job_replay(const api_model *am, api_request *req, const char *text, size_t len,
                        blade_finish_reason finish, const char *note_key, json_t *note, api_buf *sse, api_error *err)
{
    if (req->n_prompts != 1 || req->n != 1) {
        json_decref(note);
        api_request_free(req);
        return api_error_set(err, 500, "server_error", NULL, NULL, "only a single-choice request can be replayed"),
               NULL;
    }
    api_job *job = job_new(am, req, NULL, 0, err);
    if (!job) {
        json_decref(note);
        return NULL;
    }
    job->note_key = note_key;
    job->note = note;
    api_event ev = {.job = job, .token = -1, .finish = finish, .prompt_tokens = job->req.prompts[0].n_tokens,
                    .text = (char *)text, .text_len = len};
    job->running = 1;
    api_timing t;
    if (sse)
        api_job_stream_start(job, sse);
    api_job_apply(job, &ev, sse, &t);
    if (sse)
        api_job_stream_end(job, sse);
    return job;
}

void api_job_result(const api_job *job, const char **text, size_t *len, blade_finish_reason *finish)
{
    const api_choice *c = &job->choices[0];
    *text = c->text.data ? c->text.data : "";
    *len = c->text.len;
    *finish = c->finish;
}

const api_request *api_job_request(const api_job *job)
{
    return &job->req;
}

api_job *api_job_submit(const api_model *am, api_request *req, api_sink *sink, double t_start, api_error *err)
{
    api_job *job = job_new(am, req, sink, t_start, err);
    if (!job)
        return NULL;
    blade_engine *engine = job->req.ep == API_EMBEDDINGS ? am->embed_engine : am->engine;
    int32_t np = job->req.n_prompts;
    for (int32_t p = 0; p < np; p++) {
        const api_prompt *pr = &job->req.prompts[p];
        blade_request q;
        blade_request_default(&q);
        q.prompt_tokens = pr->tokens;
        q.n_prompt_tokens = pr->n_tokens;
        q.cls = job->req.cls;
        q.cache_salt = job->req.cache_salt;
        q.import = p == 0 ? job->req.import : NULL;
        if (job->req.ep == API_EMBEDDINGS) {
            q.embed = am->pooling;
        } else {
            q.sampling = job->req.sampling;
            q.max_tokens = job->req.max_tokens;
            q.stop = (const char *const *)job->req.stop;
            q.n_stop = job->req.n_stop;
            q.ignore_eos = job->req.ignore_eos;
            q.speculative = job->req.speculative;
            q.logprobs = job->req.logprobs;
            q.n = job->req.n;
        }
        q.callback = on_event;
        q.user = &job->prompts[p];
        blade_error berr = {{0}};
        uint64_t id = blade_engine_submit(engine, &q, &berr);
        if (!id) {
            bool shutting = strstr(berr.msg, "shutting down") != NULL;
            api_error e;
            api_error_set(&e, shutting ? 503 : 400, shutting ? "server_error" : "invalid_request_error", NULL, NULL,
                          "%s%s", np > 1 ? "a prompt was refused: " : "", berr.msg);
            if (p == 0) {
                *err = e;
                job_destroy(job);
                return NULL;
            }
            /* The prompts already running are stopped; the job ends with this error. */
            for (int32_t i = p * job->req.n; i < job->n_choices; i++)
                job->choices[i].finished = true;
            api_job_abort(job, e.status, e.type, e.message);
            return job;
        }
        if (q.import)
            job->req.import->staging = NULL; /* the engine's now */
        job->prompts[p].id = id;
        job->running += job->req.n;
    }
    job->req.import = NULL; /* the caller's, used only here */
    return job;
}

void api_job_abort(api_job *job, int status, const char *type, const char *message)
{
    if (!job->error.status)
        api_error_set(&job->error, status, type, NULL, NULL, "%s", message);
    for (int32_t p = 0; p < job->req.n_prompts; p++)
        if (job->prompts[p].id)
            blade_engine_abort(job->req.ep == API_EMBEDDINGS ? job->am->embed_engine : job->am->engine,
                               job->prompts[p].id);
}

void api_job_free(api_job *job)
{
    job_destroy(job);
}

bool api_job_done(const api_job *job)
{
    return job->running == 0;
}

int api_job_status(const api_job *job)
{
    if (job->error.status)
        return job->error.status;
    return atomic_load(&job->lost) ? 500 : 200;
}

const api_error *api_job_error(const api_job *job)
{
    return job->error.status ? &job->error : &job->lost_error;
}

const char *api_job_id(const api_job *job)
{
    return job->id;
}

void api_job_set_user(api_job *job, void *user)
{
    job->user = user;
}

void *api_job_user(const api_job *job)
{
    return job->user;
}

void api_job_usage(const api_job *job, int64_t *prompt, int64_t *completion, int64_t *cached)
{
    int64_t p = 0, c = 0, k = 0;
    for (int32_t i = 0; i < job->req.n_prompts; i++) {
        p += job->req.prompts[i].n_tokens;
        k += job->cached_tokens[i];
    }
    for (int32_t i = 0; i < job->n_choices; i++)
        c += job->choices[i].completion_tokens;
    *prompt = p;
    *completion = c;
    *cached = k;
}

void api_job_apply(api_job *job, const api_event *ev, api_buf *sse, api_timing *timing)
{
    int32_t index = ev->prompt * job->req.n + ev->choice;
    api_choice *c = &job->choices[index];
    const blade_tokenizer *tok = job->am->model->tokenizer;
    memset(timing, 0, sizeof *timing);
    timing->itl = -1;
    timing->tpot = -1;
    if (c->finished)
        return;

    json_t *lp = NULL;
    if (ev->token >= 0) {
        timing->token = true;
        timing->itl = c->t_last > 0 ? ev->t - c->t_last : -1;
        if (c->t_first == 0)
            c->t_first = ev->t;
        c->t_last = ev->t;
        /* An end-of-generation token has no text of its own: it shows only as the finish. */
        bool eog = ev->finish == BLADE_FINISH_STOP && blade_tokenizer_is_eog(tok, ev->token);
        if (job->req.logprobs >= 0 && !eog) {
            if (sse) {
                lp = job_logprobs_new(job);
                job_logprobs_add(job, c, ev, lp);
            } else {
                if (!c->logprobs)
                    c->logprobs = job_logprobs_new(job);
                job_logprobs_add(job, c, ev, c->logprobs);
            }
        }
    }
    if (sse)
        job_stream_event(job, sse, index, ev, lp);
    /* kept when streaming too: a finished answer may go into the semantic cache */
    api_buf_append(&c->text, ev->text, ev->text_len);
    if (ev->embedding && !c->embedding) {
        if ((c->embedding = malloc((size_t)ev->n_embedding * sizeof *c->embedding))) {
            memcpy(c->embedding, ev->embedding, (size_t)ev->n_embedding * sizeof *c->embedding);
            c->n_embedding = ev->n_embedding;
        } else {
            atomic_store(&job->lost, true);
        }
    }
    if (ev->finish == BLADE_FINISH_NONE)
        return;

    c->finished = true;
    c->finish = ev->finish;
    c->completion_tokens = ev->completion_tokens;
    job->running--;
    if (ev->choice == 0) {
        job->prompt_tokens[ev->prompt] = ev->prompt_tokens;
        job->cached_tokens[ev->prompt] = ev->cached_tokens;
    }
    if (ev->finish == BLADE_FINISH_ERROR && !job->error.status)
        api_error_set(&job->error, 500, "server_error", NULL, NULL, "the request failed: %s",
                      ev->error ? ev->error : "unknown engine error");
    if (ev->finish == BLADE_FINISH_ABORT && !job->error.status)
        api_error_set(&job->error, 500, "server_error", NULL, NULL, "the request was aborted");
    if (c->text.failed)
        atomic_store(&job->lost, true);
    timing->choice_finished = true;
    timing->finish = ev->finish;
    timing->completion_tokens = ev->completion_tokens;
    timing->ttft = ev->ttft_seconds;
    timing->queue = ev->queue_seconds;
    if (ev->completion_tokens > 1 && c->t_last > c->t_first)
        timing->tpot = (c->t_last - c->t_first) / (ev->completion_tokens - 1);
    timing->first_of_prompt = ev->choice == 0;
    timing->prompt_tokens = ev->prompt_tokens;
    timing->cached_tokens = ev->cached_tokens;
}

#include "api/api.h"

#include "blade/model.h"
#include "blade/tokenizer.h"
#include "common/utf8.h"

#include <math.h>
#include <openssl/rand.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

/* ---- the sink ---- */

int api_sink_init(api_sink *s, blade_error *err)
{
    memset(s, 0, sizeof *s);
    s->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->fd < 0)
        return blade_error_set(err, "cannot create an eventfd");
    pthread_mutex_init(&s->mu, NULL);
    return 0;
}

void api_sink_destroy(api_sink *s)
{
    api_event *ev = s->head;
    while (ev) {
        api_event *next = ev->next;
        api_event_free(ev);
        ev = next;
    }
    if (s->fd >= 0) {
        close(s->fd);
        pthread_mutex_destroy(&s->mu);
    }
    s->fd = -1;
}

static void sink_push(api_sink *s, api_event *ev)
{
    ev->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->tail)
        s->tail->next = ev;
    else
        s->head = ev;
    s->tail = ev;
    pthread_mutex_unlock(&s->mu);
    uint64_t one = 1;
    /* The counter cannot overflow in practice, and a full counter is still readable, which
     * is all a consumer waits for. */
    ssize_t w = write(s->fd, &one, sizeof one);
    (void)w;
}

api_event *api_sink_take(api_sink *s)
{
    uint64_t count;
    ssize_t r = read(s->fd, &count, sizeof count);
    (void)r;
    pthread_mutex_lock(&s->mu);
    api_event *list = s->head;
    s->head = s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    return list;
}

void api_event_free(api_event *ev)
{
    if (ev && !ev->preallocated)
        free(ev);
}

/* ---- jobs ---- */

typedef struct job_prompt {
    api_job *job;
    int32_t index;
    uint64_t id; /* 0: not submitted */
} job_prompt;

typedef struct api_choice {
    api_buf text;
    json_t *logprobs; /* the non-streaming response's logprobs, built as tokens arrive */
    size_t offset;    /* text_offset of the next token */
    int32_t completion_tokens;
    blade_finish_reason finish;
    bool finished;
    double t_first, t_last;
    api_event *spare; /* the finish event, should memory run out on the engine thread */
} api_choice;

struct api_job {
    const api_model *am;
    api_request req;
    job_prompt *prompts;
    api_choice *choices;
    int32_t n_choices;
    int32_t running;
    int32_t *prompt_tokens;
    int32_t *cached_tokens;
    atomic_bool lost; /* a token event could not be copied */
    api_sink *sink;
    api_error error; /* status 0 while the job is fine */
    api_error lost_error;
    char id[48];
    long long created;
    double t_start;
    char *piece;
    size_t piece_cap;
    void *user;
};

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Runs on the engine thread: copy and hand over, nothing else. */
static void on_event(const blade_token_event *ev)
{
    job_prompt *jp = ev->user;
    api_job *job = jp->job;
    int32_t index = jp->index * job->req.n + ev->choice;
    size_t el = ev->error ? strlen(ev->error) : 0;
    api_event *e = malloc(sizeof *e + ev->text_len + el + 2);
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
    e->t = mono_now();
    e->text = e->storage;
    if (!pre) {
        memcpy(e->storage, ev->text, ev->text_len);
        e->storage[ev->text_len] = 0;
        e->text_len = ev->text_len;
        if (ev->error) {
            memcpy(e->storage + ev->text_len + 1, ev->error, el + 1);
            e->error = e->storage + ev->text_len + 1;
        }
    }
    sink_push(job->sink, e);
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
        free(job->choices[i].spare);
    }
    free(job->choices);
    free(job->prompts);
    free(job->prompt_tokens);
    free(job->cached_tokens);
    free(job->piece);
    api_request_free(&job->req);
    free(job);
}

api_job *api_job_submit(const api_model *am, api_request *req, api_sink *sink, double t_start, api_error *err)
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
    random_id(job->id, sizeof job->id, job->req.ep == API_CHAT ? "chatcmpl-" : "cmpl-");
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
        const api_prompt *pr = &job->req.prompts[p];
        blade_request q;
        blade_request_default(&q);
        q.prompt_tokens = pr->tokens;
        q.n_prompt_tokens = pr->n_tokens;
        q.sampling = job->req.sampling;
        q.max_tokens = job->req.max_tokens;
        q.stop = (const char *const *)job->req.stop;
        q.n_stop = job->req.n_stop;
        q.ignore_eos = job->req.ignore_eos;
        q.logprobs = job->req.logprobs;
        q.n = job->req.n;
        q.cls = job->req.cls;
        q.cache_salt = job->req.cache_salt;
        q.callback = on_event;
        q.user = &job->prompts[p];
        job->prompts[p].job = job;
        job->prompts[p].index = p;
        blade_error berr = {{0}};
        uint64_t id = blade_engine_submit(am->engine, &q, &berr);
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
        job->prompts[p].id = id;
        job->running += job->req.n;
    }
    return job;
}

void api_job_abort(api_job *job, int status, const char *type, const char *message)
{
    if (!job->error.status)
        api_error_set(&job->error, status, type, NULL, NULL, "%s", message);
    for (int32_t p = 0; p < job->req.n_prompts; p++)
        if (job->prompts[p].id)
            blade_engine_abort(job->am->engine, job->prompts[p].id);
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

/* ---- JSON pieces ---- */

/* A JSON string of arbitrary bytes: a token can be part of a character (byte-fallback
 * tokens), which becomes U+FFFD, as OpenAI shows it. */
static json_t *text_json(const char *s, size_t n)
{
    json_t *v = json_stringn(s, n);
    if (v)
        return v;
    api_buf b = {0};
    for (size_t i = 0; i < n;) {
        size_t k = blade_utf8_char_len(s + i, n - i);
        if (k) {
            api_buf_append(&b, s + i, k);
            i += k;
        } else {
            api_buf_append(&b, "\xEF\xBF\xBD", 3);
            i++;
        }
    }
    v = json_stringn(b.data ? b.data : "", b.len);
    api_buf_free(&b);
    return v ? v : json_string("");
}

/* OpenAI reports impossible tokens as -9999; JSON has no -Infinity. */
static json_t *logprob_json(float lp)
{
    return json_real(isfinite(lp) ? (double)lp : -9999.0);
}

static size_t token_piece(api_job *job, int32_t id)
{
    size_t n = blade_tokenizer_token_bytes(job->am->model->tokenizer, id, false, job->piece, job->piece_cap);
    return n < job->piece_cap ? n : job->piece_cap;
}

static json_t *bytes_json(const char *s, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_integer((unsigned char)s[i]));
    return a;
}

/* Chat: one entry of logprobs.content. */
static json_t *chat_logprob(api_job *job, const api_event *ev)
{
    size_t n = token_piece(job, ev->token);
    json_t *entry = json_object();
    json_object_set_new(entry, "token", text_json(job->piece, n));
    json_object_set_new(entry, "logprob", logprob_json(ev->logprob));
    json_object_set_new(entry, "bytes", bytes_json(job->piece, n));
    json_t *top = json_array();
    for (int32_t i = 0; i < ev->n_top; i++) {
        size_t k = token_piece(job, ev->top_ids[i]);
        json_t *alt = json_object();
        json_object_set_new(alt, "token", text_json(job->piece, k));
        json_object_set_new(alt, "logprob", logprob_json(ev->top_logprobs[i]));
        json_object_set_new(alt, "bytes", bytes_json(job->piece, k));
        json_array_append_new(top, alt);
    }
    json_object_set_new(entry, "top_logprobs", top);
    return entry;
}

static json_t *completion_logprobs_new(void)
{
    json_t *o = json_object();
    json_object_set_new(o, "tokens", json_array());
    json_object_set_new(o, "token_logprobs", json_array());
    json_object_set_new(o, "top_logprobs", json_array());
    json_object_set_new(o, "text_offset", json_array());
    return o;
}

/* Completions: appends one token to the four parallel arrays. As OpenAI does, the top
 * alternatives always include the sampled token, so there may be logprobs + 1 of them. */
static void completion_logprob_add(api_job *job, api_choice *c, const api_event *ev, json_t *lp)
{
    size_t n = token_piece(job, ev->token);
    json_array_append_new(json_object_get(lp, "tokens"), text_json(job->piece, n));
    json_array_append_new(json_object_get(lp, "token_logprobs"), logprob_json(ev->logprob));
    json_array_append_new(json_object_get(lp, "text_offset"), json_integer((json_int_t)c->offset));
    c->offset += n;
    json_t *top = json_object();
    for (int32_t i = 0; i < ev->n_top; i++) {
        size_t k = token_piece(job, ev->top_ids[i]);
        json_t *key = text_json(job->piece, k);
        json_object_set_new(top, json_string_value(key), logprob_json(ev->top_logprobs[i]));
        json_decref(key);
    }
    n = token_piece(job, ev->token);
    json_t *key = text_json(job->piece, n);
    if (!json_object_get(top, json_string_value(key)))
        json_object_set_new(top, json_string_value(key), logprob_json(ev->logprob));
    json_decref(key);
    json_array_append_new(json_object_get(lp, "top_logprobs"), top);
}

static const char *finish_name(blade_finish_reason r)
{
    return r == BLADE_FINISH_LENGTH ? "length" : "stop";
}

static json_t *usage_json(const api_job *job)
{
    int64_t p, c, k;
    api_job_usage(job, &p, &c, &k);
    return json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", (json_int_t)p, "completion_tokens", (json_int_t)c,
                     "total_tokens", (json_int_t)(p + c), "prompt_tokens_details", "cached_tokens", (json_int_t)k);
}

static json_t *envelope(const api_job *job, const char *object)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", job->id, "object", object, "created",
                     (json_int_t)job->created, "model", job->am->names[0], "system_fingerprint",
                     job->am->fingerprint);
}

/* ---- streaming ---- */

static void sse_json(api_buf *sse, json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT);
    if (!s) {
        sse->failed = true;
        return;
    }
    api_buf_append(sse, "data: ", 6);
    api_buf_append(sse, s, strlen(s));
    api_buf_append(sse, "\n\n", 2);
    free(s);
}

/* One chunk carrying one choice's update. */
static void sse_chunk(api_job *job, api_buf *sse, int32_t index, const char *text, size_t len, bool role,
                      json_t *logprobs, const char *finish)
{
    bool chat = job->req.ep == API_CHAT;
    json_t *chunk = envelope(job, chat ? "chat.completion.chunk" : "text_completion");
    json_t *choice = json_object();
    json_object_set_new(choice, "index", json_integer(index));
    if (chat) {
        json_t *delta = json_object();
        if (role)
            json_object_set_new(delta, "role", json_string("assistant"));
        if (text)
            json_object_set_new(delta, "content", text_json(text, len));
        json_object_set_new(choice, "delta", delta);
    } else {
        json_object_set_new(choice, "text", text_json(text ? text : "", text ? len : 0));
    }
    json_object_set_new(choice, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(choice, "finish_reason", finish ? json_string(finish) : json_null());
    json_t *choices = json_array();
    json_array_append_new(choices, choice);
    json_object_set_new(chunk, "choices", choices);
    if (job->req.include_usage)
        json_object_set_new(chunk, "usage", json_null());
    sse_json(sse, chunk);
    json_decref(chunk);
}

void api_job_stream_start(api_job *job, api_buf *sse)
{
    for (int32_t i = 0; i < job->n_choices; i++) {
        if (job->req.ep == API_CHAT) {
            sse_chunk(job, sse, i, "", 0, true, NULL, NULL);
        } else if (job->req.echo) {
            const api_prompt *p = &job->req.prompts[i / job->req.n];
            sse_chunk(job, sse, i, p->text, p->text_len, false, NULL, NULL);
        }
    }
}

void api_job_stream_end(const api_job *job, api_buf *sse)
{
    int status = api_job_status(job);
    if (status != 200) {
        json_t *e = api_error_json(api_job_error(job));
        sse_json(sse, e);
        json_decref(e);
    } else if (job->req.include_usage) {
        bool chat = job->req.ep == API_CHAT;
        json_t *chunk = envelope(job, chat ? "chat.completion.chunk" : "text_completion");
        json_object_set_new(chunk, "choices", json_array());
        json_object_set_new(chunk, "usage", usage_json(job));
        sse_json(sse, chunk);
        json_decref(chunk);
    }
    api_buf_append(sse, "data: [DONE]\n\n", 14);
}

/* ---- applying events ---- */

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
    bool chat = job->req.ep == API_CHAT;

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
                if (chat) {
                    lp = json_pack("{s:[], s:n}", "content", "refusal");
                    json_array_append_new(json_object_get(lp, "content"), chat_logprob(job, ev));
                } else {
                    lp = completion_logprobs_new();
                    completion_logprob_add(job, c, ev, lp);
                }
            } else {
                if (!c->logprobs)
                    c->logprobs = chat ? json_pack("{s:[], s:n}", "content", "refusal") : completion_logprobs_new();
                if (chat)
                    json_array_append_new(json_object_get(c->logprobs, "content"), chat_logprob(job, ev));
                else
                    completion_logprob_add(job, c, ev, c->logprobs);
            }
        }
    }
    bool ends = ev->finish == BLADE_FINISH_STOP || ev->finish == BLADE_FINISH_LENGTH;
    if (sse) {
        if (ev->text_len || lp)
            sse_chunk(job, sse, index, ev->text, ev->text_len, false, lp, NULL);
        else
            json_decref(lp);
        if (ends)
            sse_chunk(job, sse, index, chat ? NULL : "", 0, false, NULL, finish_name(ev->finish));
    } else {
        api_buf_append(&c->text, ev->text, ev->text_len);
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

json_t *api_job_response(const api_job *job)
{
    if (api_job_status(job) != 200)
        return api_error_json(api_job_error(job));
    bool chat = job->req.ep == API_CHAT;
    json_t *resp = envelope(job, chat ? "chat.completion" : "text_completion");
    json_t *choices = json_array();
    for (int32_t i = 0; i < job->n_choices; i++) {
        const api_choice *c = &job->choices[i];
        json_t *choice = json_object();
        json_object_set_new(choice, "index", json_integer(i));
        const char *text = c->text.data ? c->text.data : "";
        if (chat) {
            json_t *msg = json_object();
            json_object_set_new(msg, "role", json_string("assistant"));
            json_object_set_new(msg, "content", text_json(text, c->text.len));
            json_object_set_new(msg, "refusal", json_null());
            json_object_set_new(choice, "message", msg);
        } else if (job->req.echo) {
            const api_prompt *p = &job->req.prompts[i / job->req.n];
            api_buf b = {0};
            api_buf_append(&b, p->text, p->text_len);
            api_buf_append(&b, text, c->text.len);
            json_object_set_new(choice, "text", text_json(b.data ? b.data : "", b.len));
            api_buf_free(&b);
        } else {
            json_object_set_new(choice, "text", text_json(text, c->text.len));
        }
        json_t *lp = c->logprobs;
        if (!lp && job->req.logprobs >= 0)
            lp = chat ? json_pack("{s:[], s:n}", "content", "refusal") : completion_logprobs_new();
        else
            json_incref(lp);
        json_object_set_new(choice, "logprobs", lp ? lp : json_null());
        json_object_set_new(choice, "finish_reason", json_string(finish_name(c->finish)));
        json_array_append_new(choices, choice);
    }
    json_object_set_new(resp, "choices", choices);
    json_object_set_new(resp, "usage", usage_json(job));
    return resp;
}

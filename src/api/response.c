/* What a job's client reads, in OpenAI's shapes (job.h): the response object, the stream
 * chunks, logprobs (chat's content entries, completions' parallel arrays), usage, and token
 * text as JSON strings, where bytes that are not UTF-8 (a token can be part of a
 * character) become U+FFFD as OpenAI shows them. */

#include "api/job_internal.h"

#include "blade/model.h"
#include "blade/tokenizer.h"
#include "common/utf8.h"

#include <math.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

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

json_t *job_logprobs_new(const api_job *job)
{
    return job->req.ep == API_CHAT ? json_pack("{s:[], s:n}", "content", "refusal") : completion_logprobs_new();
}

void job_logprobs_add(api_job *job, api_choice *c, const api_event *ev, json_t *lp)
{
    if (job->req.ep == API_CHAT)
        json_array_append_new(json_object_get(lp, "content"), chat_logprob(job, ev));
    else
        completion_logprob_add(job, c, ev, lp);
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
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", job->id, "object", object, "created",
                          (json_int_t)job->created, "model", job->am->names[0], "system_fingerprint",
                          job->am->fingerprint);
    if (o && job->note)
        json_object_set(o, job->note_key, job->note);
    return o;
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

void job_stream_event(api_job *job, api_buf *sse, int32_t index, const api_event *ev, json_t *lp)
{
    if (ev->text_len || lp)
        sse_chunk(job, sse, index, ev->text, ev->text_len, false, lp, NULL);
    else
        json_decref(lp);
    if (ev->finish == BLADE_FINISH_STOP || ev->finish == BLADE_FINISH_LENGTH)
        sse_chunk(job, sse, index, job->req.ep == API_CHAT ? NULL : "", 0, false, NULL, finish_name(ev->finish));
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

/* ---- embeddings ---- */

/* The first `dims` values renormalised to unit length (all of them, already unit, when
 * dims is 0), as floats or as base64 of their little-endian bytes (OpenAI's encoding). */
static json_t *embedding_json(const api_choice *c, int32_t dims, bool base64)
{
    int32_t n = dims > 0 && dims < c->n_embedding ? dims : c->n_embedding;
    float *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    if (!v)
        return NULL;
    double norm = 0;
    for (int32_t i = 0; i < n; i++)
        norm += (double)c->embedding[i] * c->embedding[i];
    norm = sqrt(norm);
    for (int32_t i = 0; i < n; i++)
        v[i] = n == c->n_embedding || norm == 0 ? c->embedding[i] : (float)(c->embedding[i] / norm);
    json_t *out = NULL;
    if (base64) {
        size_t bytes = (size_t)n * sizeof *v;
        unsigned char *text = malloc(4 * ((bytes + 2) / 3) + 1);
        if (text) {
            unsigned char *le = (unsigned char *)v; /* blade runs on little-endian x86-64 only */
            int len = EVP_EncodeBlock(text, le, (int)bytes);
            out = json_stringn((const char *)text, (size_t)len);
            free(text);
        }
    } else {
        out = json_array();
        for (int32_t i = 0; out && i < n; i++)
            json_array_append_new(out, json_real(v[i]));
    }
    free(v);
    return out;
}

static json_t *embeddings_response(const api_job *job)
{
    json_t *data = json_array();
    for (int32_t i = 0; i < job->n_choices; i++) {
        json_t *e = embedding_json(&job->choices[i], job->req.dimensions, job->req.base64);
        if (!e) {
            json_decref(data);
            return api_error_json(&job->lost_error);
        }
        json_array_append_new(data, json_pack("{s:s, s:I, s:o}", "object", "embedding", "index", (json_int_t)i,
                                              "embedding", e));
    }
    int64_t p, c, k;
    api_job_usage(job, &p, &c, &k);
    return json_pack("{s:s, s:o, s:s, s:{s:I, s:I}}", "object", "list", "data", data, "model", job->am->names[0],
                     "usage", "prompt_tokens", (json_int_t)p, "total_tokens", (json_int_t)p);
}

/* ---- the whole response ---- */

json_t *api_job_response(const api_job *job)
{
    if (api_job_status(job) != 200)
        return api_error_json(api_job_error(job));
    if (job->req.ep == API_EMBEDDINGS)
        return embeddings_response(job);
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
            lp = job_logprobs_new(job);
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

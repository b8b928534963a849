#ifndef BLADE_API_API_H
#define BLADE_API_API_H

/* The OpenAI protocol, shared by `blade serve` and `blade batch`: request bodies of
 * /v1/completions and /v1/chat/completions are validated into engine requests (every
 * refusal names the parameter and what was wrong), engine events are gathered per choice,
 * and the response objects, stream chunks, usage and error objects are built in OpenAI's
 * shapes.
 *
 * Limits (documented in `blade serve --help`): at most API_MAX_STOP stop strings of 1 to
 * API_MAX_STOP_BYTES bytes each (the stop matcher runs on the engine thread for every
 * token, so its cost must stay small); n at most API_MAX_N; at most API_MAX_PROMPTS
 * prompts per completions request and API_MAX_CHOICES choices in all. */

#include "blade/chat_template.h"
#include "blade/engine.h"

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define API_MAX_STOP 16
#define API_MAX_STOP_BYTES 256
#define API_MAX_N 16
#define API_MAX_PROMPTS 64
#define API_MAX_CHOICES 128
#define API_MAX_LOGPROBS 5      /* completions: logprobs 0..5, as OpenAI */
#define API_MAX_TOP_LOGPROBS 20 /* chat: top_logprobs 0..20, as OpenAI */
#define API_MAX_CACHE_SALT 256

/* A growable byte buffer (response bodies, SSE output). */
typedef struct api_buf {
    char *data;
    size_t len, cap;
    bool failed; /* an allocation failed: the content is incomplete */
} api_buf;

void api_buf_append(api_buf *b, const void *data, size_t n);
void api_buf_free(api_buf *b);

/* What a refusal becomes on the wire: OpenAI's {"error": {message, type, param, code}}. */
typedef struct api_error {
    int status;
    const char *type;
    const char *code; /* NULL: null */
    char param[64];   /* "": null */
    char message[1024];
} api_error;

void api_error_set(api_error *e, int status, const char *type, const char *code, const char *param,
                   const char *fmt, ...) BLADE_PRINTF(6, 7);
/* The usual 400 naming the offending parameter. */
void api_bad_request(api_error *e, const char *param, const char *fmt, ...) BLADE_PRINTF(3, 4);
json_t *api_error_json(const api_error *e);
/* The serialized error object, malloc'd. */
char *api_error_body(const api_error *e, size_t *len);

typedef enum api_endpoint {
    API_COMPLETIONS,
    API_CHAT
} api_endpoint;

/* The served model, as the protocol sees it. */
typedef struct api_model {
    blade_engine *engine;
    const blade_model *model;
    blade_template *chat_template; /* NULL: chat requests are refused with chat_template_error */
    char chat_template_error[1024];
    char *names[3];                /* accepted in `model`; names[0] is the id /v1/models lists */
    int n_names;
    char fingerprint[32];          /* system_fingerprint */
    long long created;             /* when the server started, for /v1/models */
    bool batch_class;              /* every request runs in the batch traffic class */
} api_model;

/* Names the model after alias (if any), the path as given and its file name; reads the chat
 * template from template_file or, without one, from the model's tokenizer.chat_template. A
 * template file that cannot be read or parsed is an error; a model's own template that
 * cannot be parsed only disables chat (the reason is kept for the 400). */
int api_model_init(api_model *am, blade_engine *e, const char *model_path, const char *alias,
                   const char *template_file, blade_error *err);
void api_model_destroy(api_model *am);
/* Whether `name` is one of the model's names. */
bool api_model_matches(const api_model *am, const char *name);
/* The /v1/models list, or one model object when id is non-NULL (NULL when unknown). */
json_t *api_models_json(const api_model *am, const char *id);

typedef struct api_prompt {
    int32_t *tokens;
    int32_t n_tokens;
    char *text; /* the prompt as text, for echo */
    size_t text_len;
} api_prompt;

typedef struct api_request {
    api_endpoint ep;
    api_prompt *prompts;
    int32_t n_prompts;
    int32_t n;
    int32_t max_tokens;
    blade_sampling_params sampling;
    char **stop;
    int32_t n_stop;
    int32_t logprobs; /* -1: none; else the number of top alternatives */
    bool stream;
    bool include_usage;
    bool echo;
    bool ignore_eos;
    blade_traffic_class cls;
    char *cache_salt;
} api_request;

/* Parses and validates a request body (bytes as received): 0, or -1 with err set (400 for
 * malformed or invalid input, 404 for an unknown model). */
int api_parse_body(const api_model *am, api_endpoint ep, const char *body, size_t len, api_request *out,
                   api_error *err);
/* The same from an already decoded body. */
int api_parse(const api_model *am, api_endpoint ep, json_t *body, api_request *out, api_error *err);
void api_request_free(api_request *r);

/* ---- running a request ---- */

typedef struct api_job api_job;

/* One engine event, copied off the engine thread. */
typedef struct api_event {
    struct api_event *next;
    api_job *job;
    int32_t prompt;
    int32_t choice;
    int32_t token;
    float logprob;
    int32_t n_top;
    int32_t top_ids[BLADE_MAX_TOP_LOGPROBS];
    float top_logprobs[BLADE_MAX_TOP_LOGPROBS];
    blade_finish_reason finish;
    int32_t prompt_tokens;
    int32_t completion_tokens;
    int32_t cached_tokens;
    double queue_seconds;
    double ttft_seconds;
    double t; /* when the engine emitted it (CLOCK_MONOTONIC seconds) */
    const char *error;
    size_t text_len;
    char *text;
    bool preallocated;
    char storage[]; /* text, then error */
} api_event;

/* Where a job's engine callbacks deliver their events: a queue plus an eventfd that is
 * readable while the queue is not empty, so a consumer can poll it beside a socket. */
typedef struct api_sink {
    pthread_mutex_t mu;
    api_event *head, *tail;
    int fd;
} api_sink;

int api_sink_init(api_sink *s, blade_error *err);
void api_sink_destroy(api_sink *s);
/* Takes every queued event (oldest first), or NULL; never blocks. */
api_event *api_sink_take(api_sink *s);
void api_event_free(api_event *ev);

/* Submits every prompt of req (taking ownership of it) to the engine with events going to
 * sink. NULL with err set when nothing could be submitted; once anything was submitted
 * the job is returned, and a later failure shows in its error. */
api_job *api_job_submit(const api_model *am, api_request *req, api_sink *sink, double t_start, api_error *err);
/* Ends every unfinished choice (abort events follow) and records why: the error the job
 * will report. */
void api_job_abort(api_job *job, int status, const char *type, const char *message);
/* Frees a job; it must be done (no event of it can still arrive). */
void api_job_free(api_job *job);

/* What one applied event meant, for metrics. */
typedef struct api_timing {
    bool token;            /* a generated token */
    double itl;            /* seconds since the choice's previous token; < 0 for its first */
    bool choice_finished;
    blade_finish_reason finish;
    int32_t completion_tokens;
    double ttft;           /* of the finished choice */
    double queue;
    double tpot;           /* (last token - first token) / (tokens - 1); < 0 with fewer than 2 */
    bool first_of_prompt;  /* the finished choice is choice 0: count its prompt once */
    int32_t prompt_tokens;
    int32_t cached_tokens;
} api_timing;

/* Applies an event; with sse non-NULL also appends its stream chunks. */
void api_job_apply(api_job *job, const api_event *ev, api_buf *sse, api_timing *timing);
bool api_job_done(const api_job *job);
/* 200, or the status of the error that ends the job. */
int api_job_status(const api_job *job);
const api_error *api_job_error(const api_job *job);
/* The completion id (cmpl-... or chatcmpl-...). */
const char *api_job_id(const api_job *job);
/* A pointer of the caller's, for finding its own record from an event's job. */
void api_job_set_user(api_job *job, void *user);
void *api_job_user(const api_job *job);
/* The whole response object of a finished job (the error object when it failed). */
json_t *api_job_response(const api_job *job);
/* Streaming: the chunks that open the stream (chat: the assistant role of each choice;
 * completions with echo: the prompt). */
void api_job_stream_start(api_job *job, api_buf *sse);
/* Streaming: after the last event, the error (if any), the usage chunk when asked for,
 * and the [DONE] terminator. */
void api_job_stream_end(const api_job *job, api_buf *sse);
/* Token totals of the job so far. */
void api_job_usage(const api_job *job, int64_t *prompt, int64_t *completion, int64_t *cached);

#endif

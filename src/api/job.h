#ifndef BLADE_API_JOB_H
#define BLADE_API_JOB_H

/* A job is one API request running on the engine: every prompt submitted (n choices each),
 * the events its choices produce applied as they arrive from the sink, and the result read
 * back as one response object or as the chunks of a stream, in OpenAI's shapes. A job lives
 * on its consumer's thread; only the engine callback, which copies an event to the sink,
 * runs elsewhere. */

#include "api/buf.h"
#include "api/error.h"
#include "api/model.h"
#include "api/request.h"
#include "api/sink.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

/* Submits every prompt of req (taking ownership of it) to the engine with events going to
 * sink. NULL with err set when nothing could be submitted; once anything was submitted
 * the job is returned, and a later failure shows in its error. */
api_job *api_job_submit(const api_model *am, api_request *req, api_sink *sink, double t_start, api_error *err);
/* A job answered without the engine (a semantic cache hit): req's one prompt (taken over)
 * has one choice that finished with `finish` after `text`, no token generated. Every object
 * of the answer carries the field note_key: note (taken over; a static key). With sse
 * non-NULL, the whole stream (opening chunks, the text, the end) is appended to it;
 * api_job_response reads it like any finished job. NULL with err set. */
api_job *api_job_replay(const api_model *am, api_request *req, const char *text, size_t len,
                        blade_finish_reason finish, const char *note_key, json_t *note, api_buf *sse,
                        api_error *err);
/* A finished single-choice job's answer: its text (not NUL-terminated) and finish reason. */
void api_job_result(const api_job *job, const char **text, size_t *len, blade_finish_reason *finish);
/* The job's request as parsed. */
const api_request *api_job_request(const api_job *job);
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
/* Token totals of the job so far. */
void api_job_usage(const api_job *job, int64_t *prompt, int64_t *completion, int64_t *cached);

/* The whole response object of a finished job (the error object when it failed). */
json_t *api_job_response(const api_job *job);
/* Streaming: the chunks that open the stream (chat: the assistant role of each choice;
 * completions with echo: the prompt). */
void api_job_stream_start(api_job *job, api_buf *sse);
/* Streaming: after the last event, the error (if any), the usage chunk when asked for,
 * and the [DONE] terminator. */
void api_job_stream_end(const api_job *job, api_buf *sse);

#endif

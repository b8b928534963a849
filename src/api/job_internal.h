#ifndef BLADE_API_JOB_INTERNAL_H
#define BLADE_API_JOB_INTERNAL_H

/* What the job's two files share: a job's state (job.c runs it) and the pieces of OpenAI's
 * response shapes (response.c builds them). */

#include "api/job.h"

#include <jansson.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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
    float *embedding; /* an embedding request's result, n_embedding floats */
    int32_t n_embedding;
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
    /* A field every object of the answer carries (the response, each stream chunk): a
     * replayed job's semantic cache hit. NULL: none. */
    const char *note_key;
    json_t *note;
};

/* response.c: a job's logprobs object, empty (chat: {"content": [], "refusal": null};
 * completions: the four parallel arrays). */
json_t *job_logprobs_new(const api_job *job);
/* Appends one token event's logprobs to lp (built by job_logprobs_new); completions advance
 * the choice's text_offset. */
void job_logprobs_add(api_job *job, api_choice *c, const api_event *ev, json_t *lp);
/* Streaming: the chunks of one applied event, taking ownership of lp (its logprobs, or
 * NULL): the text it released, then the finish reason when it ends the choice. */
void job_stream_event(api_job *job, api_buf *sse, int32_t index, const api_event *ev, json_t *lp);

#endif

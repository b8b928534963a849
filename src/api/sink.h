#ifndef BLADE_API_SINK_H
#define BLADE_API_SINK_H

/* Where engine events go to leave the engine thread: each is copied into an api_event and
 * queued on a sink, whose eventfd is readable while the queue is not empty, so a consumer
 * can poll it beside its sockets. Pushing never blocks the engine for longer than a list
 * append. */

#include "blade/engine.h"
#include "blade/error.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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
    float *embedding; /* an embedding request's vector, n_embedding floats (in storage) */
    int32_t n_embedding;
    bool preallocated; /* the job's spare, kept for running out of memory: the job frees it */
    char storage[];    /* text, then error */
} api_event;

typedef struct api_sink {
    pthread_mutex_t mu;
    api_event *head, *tail;
    int fd;
} api_sink;

int api_sink_init(api_sink *s, blade_error *err);
void api_sink_destroy(api_sink *s);
/* Queues an event (any thread) and wakes the consumer. */
void api_sink_push(api_sink *s, api_event *ev);
/* Takes every queued event (oldest first), or NULL; never blocks. */
api_event *api_sink_take(api_sink *s);
void api_event_free(api_event *ev);

#endif

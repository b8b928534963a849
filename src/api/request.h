#ifndef BLADE_API_REQUEST_H
#define BLADE_API_REQUEST_H

/* Request bodies of /v1/completions, /v1/chat/completions and /v1/embeddings, validated
 * into what the engine runs: every refusal names the parameter and what was wrong.
 *
 * Limits (documented in `blade serve --help`): at most API_MAX_STOP stop strings of 1 to
 * API_MAX_STOP_BYTES bytes each (the stop matcher runs on the engine thread for every
 * token, so its cost must stay small); n at most API_MAX_N; at most API_MAX_PROMPTS
 * prompts per completions request and API_MAX_CHOICES choices in all. */

#include "api/error.h"
#include "api/model.h"
#include "blade/engine.h"

#include <jansson.h>
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
#define API_MAX_EMBED_INPUTS 2048 /* inputs of one embeddings request, as OpenAI */

typedef enum api_endpoint {
    API_COMPLETIONS,
    API_CHAT,
    API_EMBEDDINGS
} api_endpoint;

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
    bool speculative; /* extension "speculative": false opts out of speculative decoding */
    blade_traffic_class cls;
    char *cache_salt;
    /* Disaggregated serving: the first prompt's KV, computed by a prefill worker (not owned;
     * its staging store passes to the engine when the job is submitted). */
    blade_kv_import *import;
    /* embeddings: base64 instead of float arrays; the first `dimensions` values,
     * renormalised (0: all) */
    bool base64;
    int32_t dimensions;
    /* "semantic_cache": -1 absent, 0 false (bypass the cache), 1 true (store the answer
     * even when sampled) */
    int semantic_cache;
} api_request;

/* Parses and validates a request body (bytes as received): 0, or -1 with err set (400 for
 * malformed or invalid input, 404 for an unknown model). */
int api_parse_body(const api_model *am, api_endpoint ep, const char *body, size_t len, api_request *out,
                   api_error *err);
/* The same from an already decoded body. */
int api_parse(const api_model *am, api_endpoint ep, json_t *body, api_request *out, api_error *err);
void api_request_free(api_request *r);

#endif

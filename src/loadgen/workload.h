#ifndef BLADE_LOADGEN_WORKLOAD_H
#define BLADE_LOADGEN_WORKLOAD_H

/* Seeded synthetic traffic for `blade bench serve`: what each request asks (its prompt as
 * token ids, of an exact length, and how many tokens it wants back) and when it arrives.
 *
 * Request contents are a pure function of (seed, session index): session i is the same on
 * every run and every server, whatever order requests finish in, so two runs of one seed
 * send identical traffic and a regression is the engine's, never the workload's. Prompt
 * content is cut from a text's tokens (--text, so the engine sees real language) or drawn
 * from the tokenizer's ordinary vocabulary entries.
 *
 * Lengths count every prompt token, BOS included, because that is what the server
 * computes and caches. */

#include "blade/error.h"
#include "blade/tokenizer.h"
#include "sampler/rng.h"

#include <stdbool.h>
#include <stdint.h>

typedef enum lg_workload_kind {
    LG_WORKLOAD_RANDOM,            /* independent prompts of --input-len, outputs of --output-len */
    LG_WORKLOAD_SHARED_PREFIX,     /* --groups prefixes of --prefix-len, each + a unique suffix */
    LG_WORKLOAD_MULTI_TURN,        /* conversations of --turns turns, each extending the last */
    LG_WORKLOAD_LONG_INTERFERENCE, /* short prompts with long outputs, one in --long-every very long */
    LG_WORKLOAD_FILE,              /* ShareGPT-style conversations from --dataset */
    /* for the semantic cache: --pool base prompts (text of --input-len words), then exact
     * repeats, reworded variants (a word swap, casing, punctuation), near misses (one word
     * replaced: alike, but asking something else) and fresh prompts in the given shares */
    LG_WORKLOAD_SEMANTIC,
    LG_WORKLOAD_COUNT
} lg_workload_kind;

const char *lg_workload_name(lg_workload_kind k);
/* -1 for an unknown name. */
int lg_workload_from_name(const char *name);

typedef struct lg_range {
    int32_t lo, hi; /* inclusive; drawn uniformly */
} lg_range;

/* Zero fields take the kind's defaults (see lg_workload_resolve). */
typedef struct lg_workload_config {
    lg_workload_kind kind;
    uint64_t seed;
    /* random: the prompt; shared-prefix: the unique suffix; multi-turn: each user message
     * (the first one's BOS included); long-interference: the short prompts. */
    lg_range input_len;
    lg_range output_len; /* file: ignored, the recorded answer's length is used */
    int32_t groups, prompts_per_group, prefix_len;
    int32_t turns;
    int32_t long_len, long_every;
    const char *text_path;    /* prompt content; NULL: the vocabulary */
    const char *dataset_path; /* file workload */
    int64_t dataset_limit;    /* file: usable conversations to prepare; 0: all */
    /* semantic: base prompts, and the shares of requests after them that repeat one
     * exactly, reword one, or nearly miss one (the rest are fresh); < 0: the default */
    int32_t pool;
    double exact_share, reword_share, near_miss_share;
} lg_workload_config;

/* Fills the zero fields with the kind's defaults. */
void lg_workload_resolve(lg_workload_config *c);
/* The number of requests a run makes when neither a count nor a duration is given (c
 * resolved): groups x prompts-per-group for shared-prefix, 100 otherwise. */
int64_t lg_workload_default_requests(const lg_workload_config *c);

/* What a semantic-workload request is, for judging the cache's answer to it. */
typedef enum lg_label {
    LG_LABEL_NONE = 0, /* other workloads */
    LG_LABEL_BASE,     /* a base prompt's first asking: a hit is a false hit */
    LG_LABEL_EXACT,    /* a base prompt again, byte for byte: should hit */
    LG_LABEL_REWORD,   /* the same question reworded: may hit */
    LG_LABEL_NEAR_MISS,/* looks like a base prompt, asks something else: a hit is a false hit */
    LG_LABEL_FRESH,    /* unlike anything before: a hit is a false hit */
    LG_LABEL_COUNT
} lg_label;

const char *lg_label_name(lg_label l);

typedef struct lg_turn {
    int32_t *tokens;
    int32_t n_tokens;
    int32_t output_len;
    lg_label label;
} lg_turn;

/* What one simulated user sends: one request, or for multi-turn a conversation whose turn
 * k+1 is sent when turn k has been answered. */
typedef struct lg_session {
    lg_turn *turns;
    int32_t n_turns;
} lg_session;

typedef struct lg_workload lg_workload;

/* Reads --text / --dataset and checks that the longest request fits max_context tokens
 * (prompt + output; 0: not checked; file conversations that do not fit are skipped).
 * The tokenizer must outlive the workload. */
lg_workload *lg_workload_new(const lg_workload_config *cfg, const blade_tokenizer *tok, int32_t max_context,
                             blade_error *err);
void lg_workload_free(lg_workload *w);
/* The resolved configuration. */
const lg_workload_config *lg_workload_config_of(const lg_workload *w);
/* File workload: the conversations in use and those skipped (malformed, under 4 tokens
 * either way, as vLLM's benchmark rules, or over the context). */
size_t lg_workload_dataset_size(const lg_workload *w, size_t *skipped);
/* Turns per session (1 except multi-turn). */
int32_t lg_workload_turns(const lg_workload *w);
/* Fills s; -1 only when memory runs out. */
int lg_workload_session(const lg_workload *w, int64_t index, lg_session *s, blade_error *err);
/* A short request unlike any in the run, to open connections and warm the server up
 * without warming its prefix cache for the measured requests. */
int lg_workload_warmup(const lg_workload *w, lg_session *s, blade_error *err);
void lg_session_free(lg_session *s);

/* Arrival times: all at once (rate infinite), Poisson (burstiness 1) or gamma-distributed
 * gaps of mean 1/rate whose shape is the burstiness (below 1: burstier than Poisson, above:
 * more regular). The first arrival is at 0. */
typedef struct lg_arrivals {
    double rate, shape, t;
    blade_rng rng;
} lg_arrivals;

void lg_arrivals_init(lg_arrivals *a, double rate, double burstiness, uint64_t seed);
/* Seconds from the start of the run. */
double lg_arrivals_next(lg_arrivals *a);

#endif

#ifndef BLADE_SPEC_H
#define BLADE_SPEC_H

/* Speculative decoding: a cheap drafter proposes up to k tokens after a decoding
 * sequence's last one, the target model computes all of them plus one in the same ragged
 * step as everyone else's work, and the longest prefix the target agrees with is kept,
 * followed by the target's own next token. Since the runner is chunk- and batch-invariant,
 * a greedy request's tokens and logits are bit-identical to decoding without speculation;
 * only the number of steps changes. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Most drafts one sequence verifies in one step. */
#define BLADE_SPEC_MAX_K 16
#define BLADE_SPEC_SELF_OWN UINT32_MAX

typedef enum blade_spec_mode {
    BLADE_SPEC_NONE = 0,
    /* prompt lookup: the tokens that followed an earlier occurrence of the sequence's
     * longest recent n-gram (no model; wins where the output copies its context) */
    BLADE_SPEC_NGRAM = 1,
    /* a smaller model with the same vocabulary drafts, batched across all speculating
     * sequences, with its own paged KV */
    BLADE_SPEC_DRAFT = 2,
    /* self-draft: the target's own first self_layers layers, then its final norm and
     * classifier (early exit), drafting in the target's own KV; with self_type, those
     * layers and the classifier as a lower-precision copy made at load, with a KV of its own */
    BLADE_SPEC_SELF = 3,
} blade_spec_mode;

typedef struct blade_spec_config {
    blade_spec_mode mode;
    int32_t k;          /* most drafts per sequence and step (1..BLADE_SPEC_MAX_K) */
    int32_t ngram_min;  /* shortest suffix the n-gram drafter looks up (>= 1) */
    int32_t ngram_max;  /* longest (>= ngram_min) */
    const char *draft_model_path; /* BLADE_SPEC_DRAFT: the draft's GGUF, loaded by the engine */
    size_t draft_kv_mem_bytes;    /* its KV budget; 0: as many tokens as the target's KV holds */
    int32_t self_layers; /* BLADE_SPEC_SELF: layers the draft runs; 0: a quarter of the model's, or all of
                          * them with a self_type */
    /* BLADE_SPEC_SELF: BLADE_SPEC_SELF_OWN drafts with the target's own weights; a GGUF type
     * (e.g. Q4_0) drafts with the drafting layers' projections and the classifier requantized
     * to it at load, a copy that streams fewer bytes per drafted token */
    uint32_t self_type;
    /* BLADE_SPEC_DRAFT and BLADE_SPEC_SELF: prompt lookup (n-grams of ngram_min..ngram_max)
     * competes with the drafting model for each draft, and where they differ the one more
     * likely to be kept, by what verification has shown so far, is drafted (default). */
    bool draft_lookup;
    /* Choose each sequence's k per step (at most k) from its acceptance so far and what a
     * step of T tokens costs on this machine, backing off when the step is compute-bound
     * (default); a model drafter then stops at the first draft it is unsure of, and the
     * step verifies as many of the drafts as their confidences make worth it. False:
     * always draft k (tests, benchmarks of a fixed k). */
    bool adaptive;
    /* The cost of a step of T new tokens relative to one, T = 1..k+1 (index T); all zero:
     * measured when the engine starts. */
    double verify_cost[BLADE_SPEC_MAX_K + 2];
    /* With verify_cost given: one call of the drafting model relative to a one-token step of
     * the target; 0: measured when the engine starts. */
    double draft_cost;
} blade_spec_config;

/* Off; k 4, adaptive, n-grams of 2..4 tokens, lookup beside a drafting model, when turned on. */
void blade_spec_config_default(blade_spec_config *c);
const char *blade_spec_mode_name(blade_spec_mode m);
/* "none", "ngram", "draft", "self" -> mode; -1 for anything else. */
int blade_spec_mode_parse(const char *s);

/* Prompt lookup over tokens[0..n): for suffix lengths from n_max down to n_min, finds the
 * most recent earlier occurrence of the last `len` tokens and copies up to k of the tokens
 * that followed it into out. Returns how many were proposed (0 when no suffix recurs). */
int32_t blade_ngram_propose(const int32_t *tokens, int32_t n, int32_t n_min, int32_t n_max, int32_t k,
                            int32_t *out);

#endif

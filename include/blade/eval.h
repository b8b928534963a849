#ifndef BLADE_EVAL_H
#define BLADE_EVAL_H

/* Quality measurements run through the batched model runner, the same forward pass users
 * get from run, serve and batch (the reference pass, forward.h, stays the tests' oracle).
 *
 * Text is scored by the llama.cpp perplexity method: tokenized once with BOS first, cut
 * into non-overlapping chunks of n_ctx tokens (the remainder dropped); each chunk runs from
 * an empty context with its first token replaced by BOS, and the next-token distributions
 * at positions n_ctx/2 .. n_ctx-2 are scored against the token that follows each.
 *
 * Three layers, each usable alone:
 *   - the scorer: runs the chunks through the runner, several chunks to a forward call
 *     (a chunk longer than a call's token budget is split across calls), and hands back
 *     every scored position's full next-token log-probability distribution;
 *   - blade_perplexity (one model) and blade_eval_compare (a candidate against a base:
 *     perplexity of both, the change in perplexity, KL divergence, top-1 agreement, overall
 *     and per chunk);
 *   - the gate: a parsed list of conditions ("kld<=0.02,ppl<=+1.5%,top1>=0.95") checked
 *     against a comparison, for tools that must refuse a model that costs too much. */

#include "blade/act_stats.h"
#include "blade/error.h"
#include "blade/kernels.h"
#include "blade/kv_type.h"
#include "blade/model.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- configuration ---- */

typedef struct blade_eval_progress {
    int32_t chunks_done;
    int32_t n_chunks;
    int64_t tokens_run; /* tokens through the model(s) so far: both models' for a comparison */
    double seconds;
    double ppl;         /* running perplexity of the (base) model over the rows scored so far */
    double kld;         /* running mean KL divergence; NaN for a single model */
} blade_eval_progress;

typedef void (*blade_eval_progress_fn)(const blade_eval_progress *p, void *user);

typedef struct blade_eval_config {
    int32_t n_ctx;        /* chunk length in tokens, >= 4 (default 512); read by blade_eval_text_init,
                           * the scorer takes it from the text */
    int32_t max_chunks;   /* score at most this many chunks; 0: all whole chunks of the text */
    int32_t batch_tokens; /* tokens per forward call (default 512) */
    int n_threads;        /* <= 0: physical cores */
    blade_kv_type kv_type; /* blade_perplexity: the model's KV type; blade_eval_compare: the
                            * candidate's (the base always runs with f16 KV) */
    blade_eval_progress_fn progress; /* called after every forward call; may be NULL */
    void *progress_user;
    /* When set, a scorer's runner adds the activation rows it runs to these statistics
     * (act_stats.h; blade imatrix): positions 0 .. n_ctx-2 of every chunk, and for the
     * classifier the scored positions. */
    blade_act_stats *act_stats;
} blade_eval_config;

void blade_eval_config_default(blade_eval_config *c);
/* Checks the numbers of a config (err names the bad field). */
int blade_eval_config_validate(const blade_eval_config *c, blade_error *err);

/* ---- the text, cut into chunks ---- */

typedef struct blade_eval_text {
    int32_t *tokens;   /* the whole text's tokens, BOS first */
    size_t n_tokens;
    int32_t n_ctx;
    int32_t n_chunks;  /* whole chunks scored (at most cfg->max_chunks) */
} blade_eval_text;

/* Tokenizes text with m's tokenizer and counts its chunks. Fails when the vocabulary has
 * no BOS token or the text is shorter than one chunk. */
int blade_eval_text_init(blade_eval_text *t, const blade_model *m, const char *text, size_t len,
                         const blade_eval_config *cfg, blade_error *err);
void blade_eval_text_free(blade_eval_text *t);
/* Next-token predictions scored per chunk: n_ctx/2 - 1. */
int32_t blade_eval_scored_per_chunk(int32_t n_ctx);

/* ---- the scorer ---- */

/* What one forward call produced: its scored positions in chunk order, then position order
 * (two scorers over the same text and config produce the same rows in the same order). */
typedef struct blade_scored_rows {
    int32_t n;             /* rows; 0 when the call only ran unscored positions */
    int32_t n_vocab;
    const int32_t *chunk;  /* [n] chunk of each row */
    const int32_t *pos;    /* [n] position in the chunk of the token whose successor is predicted */
    const int32_t *target; /* [n] that successor */
    const float *logits;   /* [n][n_vocab] as the model computed them */
    const double *log_norm; /* [n] log(sum(exp(logits))): log p(v) = logits[v] - log_norm */
    int64_t tokens_run;    /* tokens this call ran */
    int32_t chunks_done;   /* chunks whose every row has been handed out, after this call */
} blade_scored_rows;

typedef struct blade_scorer blade_scorer;

/* A runner, a KV store sized for the chunks one call can touch (cfg->kv_type) and the
 * buffers for one call's rows. The pool is the caller's and may be shared between scorers
 * that run one after the other; text must outlive the scorer. */
blade_scorer *blade_scorer_new(const blade_model *m, const blade_eval_config *cfg, const blade_eval_text *text,
                               blade_threadpool *pool, blade_error *err);
void blade_scorer_free(blade_scorer *s);
/* Runs the next forward call. Returns 1 with rows filled (valid until the next call), 0
 * once every chunk is done, -1 on error (a non-finite logit is one: err names its chunk,
 * counted from 1, and position). */
int blade_scorer_next(blade_scorer *s, blade_scored_rows *rows, blade_error *err);

/* log p(v) of row i. */
static inline double blade_scored_logprob(const blade_scored_rows *r, int32_t i, int32_t v)
{
    return (double)r->logits[(size_t)i * (size_t)r->n_vocab + (size_t)v] - r->log_norm[i];
}

/* ---- perplexity of one model ---- */

typedef struct blade_perplexity_result {
    double ppl;       /* exp(mean negative log-likelihood) */
    double ppl_se;    /* ppl times the standard error of the mean NLL */
    double mean_nll;
    int64_t n_scored;
    int32_t n_chunks;
    int64_t tokens_run;
    double seconds;
} blade_perplexity_result;

int blade_perplexity(const blade_model *m, const blade_eval_text *text, const blade_eval_config *cfg,
                     blade_perplexity_result *out, blade_error *err);

/* ---- a candidate against a base ---- */

typedef struct blade_eval_chunk {
    double ppl_base, ppl_cand;
    double dppl_pct; /* 100 * (ppl_cand / ppl_base - 1) */
    double kld_mean, kld_max;
    double top1;     /* fraction of rows whose most likely token is the same */
} blade_eval_chunk;

/* Uncertainties (the _se fields) are standard errors of a mean over the scored tokens,
 * treating tokens as independent (tokens of one chunk are not, so read them as lower
 * bounds):
 *   ppl_se     ppl * SE(NLL), as llama.cpp reports it;
 *   dppl_pct   100 * (exp(mean(d)) - 1) with d = NLL_cand - NLL_base per token, which is
 *              exactly 100 * (ppl_cand / ppl_base - 1); dppl_pct_se = 100 * exp(mean(d)) *
 *              SE(d), the delta method. Pairing the tokens cancels the text's own spread,
 *              so this is far tighter than the two PPLs' separate errors;
 *   kld_se     SE of the per-token KL divergence;
 *   top1_se    sqrt(top1 * (1 - top1) / (n - 1)).
 * KL divergence per token: sum over the vocabulary of p_base * (log p_base - log p_cand),
 * in nats. Quantiles interpolate linearly between the sorted per-token values. */
typedef struct blade_eval_result {
    int32_t n_ctx;
    int32_t n_chunks;
    int64_t n_text_tokens;
    int64_t n_scored;
    double ppl_base, ppl_base_se;
    double ppl_cand, ppl_cand_se;
    double dppl_pct, dppl_pct_se;
    double kld_mean, kld_se, kld_median, kld_p90, kld_p99, kld_max;
    double top1, top1_se;
    blade_eval_chunk *chunks; /* [n_chunks] */
    int64_t tokens_run;       /* both models */
    double seconds;
} blade_eval_result;

/* The two models must share the vocabulary token for token (err names the first token
 * that differs). Both run with cfg's chunks and batch budget on one pool; the base with
 * f16 KV, the candidate with cfg->kv_type. Both may be the same loaded model. */
int blade_eval_compare(const blade_model *base, const blade_model *cand, const blade_eval_text *text,
                       const blade_eval_config *cfg, blade_eval_result *out, blade_error *err);
void blade_eval_result_free(blade_eval_result *r);
/* 0 when the vocabularies are identical (size, every token's text, BOS); -1 with err
 * naming the first difference. */
int blade_eval_check_vocab(const blade_model *base, const blade_model *cand, blade_error *err);

/* ---- the gate ---- */

typedef enum blade_gate_metric {
    BLADE_GATE_KLD,        /* "kld": mean KL divergence, nats */
    BLADE_GATE_KLD_MEDIAN, /* "kld_median" */
    BLADE_GATE_KLD_P90,    /* "kld_p90" */
    BLADE_GATE_KLD_P99,    /* "kld_p99" */
    BLADE_GATE_KLD_MAX,    /* "kld_max" */
    BLADE_GATE_PPL,        /* "ppl": the change in perplexity, percent ("ppl<=+1.5%") */
    BLADE_GATE_TOP1        /* "top1": top-1 agreement, a fraction ("top1>=0.95" or "top1>=95%") */
} blade_gate_metric;
#define BLADE_GATE_METRIC_COUNT 7

typedef enum blade_gate_op {
    BLADE_GATE_LE,
    BLADE_GATE_LT,
    BLADE_GATE_GE,
    BLADE_GATE_GT
} blade_gate_op;

typedef struct blade_gate_term {
    blade_gate_metric metric;
    blade_gate_op op;
    double limit; /* in the metric's unit: nats, percent (ppl) or a fraction (top1) */
} blade_gate_term;

#define BLADE_GATE_MAX_TERMS 16

typedef struct blade_gate {
    int n_terms;
    blade_gate_term terms[BLADE_GATE_MAX_TERMS];
} blade_gate;

/* Parses "TERM[,TERM...]", TERM = METRIC OP NUMBER[%], spaces allowed between the parts.
 * Every malformed term is refused with a message quoting it and saying what is wrong. */
int blade_gate_parse(const char *expr, blade_gate *out, blade_error *err);
const char *blade_gate_metric_name(blade_gate_metric m);
/* The measured value a term is compared with, in the term's unit. */
double blade_gate_measure(blade_gate_metric m, const blade_eval_result *r);
/* False also when the measured value is NaN. */
bool blade_gate_term_holds(const blade_gate_term *t, const blade_eval_result *r);
/* Number of terms that do not hold (0: the gate passes). */
int blade_gate_failures(const blade_gate *g, const blade_eval_result *r);
/* "kld <= 0.02: 0.0143 (holds)" — the term, the measured value and the verdict. */
void blade_gate_term_describe(const blade_gate_term *t, const blade_eval_result *r, char *buf, size_t cap);

#endif

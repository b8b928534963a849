/* The scorer (eval.h): runs the evaluation text's chunks through the batched model runner
 * and hands back the log-probability distributions of the scored positions.
 *
 * Each forward call takes up to batch_tokens tokens: the rest of the current chunk, then
 * the following chunks, the last of them possibly cut short and continued by the next
 * call from its cached KV. A chunk never needs its last token run (nothing follows it to
 * score), so a chunk of n_ctx tokens runs n_ctx - 1. Every chunk that one call can touch
 * owns a slot: its token copy (BOS first) and its KV blocks; chunks take the slots in turn,
 * and a slot is reused only by a chunk that starts after its previous owner finished,
 * whose own writes come before its reads. The runner is batch invariant, so how chunks are
 * packed into calls never changes a bit of the results. */

#include "blade/eval.h"

#include "blade/kv_store.h"
#include "blade/runner.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define SCORER_BLOCK_SIZE 16

struct blade_scorer {
    const blade_model *m;
    const blade_eval_text *text;
    blade_threadpool *pool;
    blade_kv_store *kv;
    blade_runner *runner;
    int32_t n_vocab;
    int32_t run_len;      /* tokens run per chunk: n_ctx - 1 */
    int32_t first_scored; /* n_ctx / 2 */
    int32_t budget;       /* tokens per call */
    int32_t n_slots;
    int32_t blocks_per_slot;
    int32_t *block_tables; /* [n_slots][blocks_per_slot] */
    int32_t *slot_tokens;  /* [n_slots][run_len] */
    blade_batch_seq *seqs; /* [n_slots] */
    int32_t *logit_rows;   /* [budget]: each sequence's rows, one after the other */
    int32_t *row_chunk, *row_pos, *row_target; /* [budget] */
    float *logits;         /* [cap_rows][n_vocab], grown to the most rows one call has scored */
    int32_t cap_rows;
    double *log_norm;      /* [budget] */
    int32_t next_chunk;    /* where the next call starts */
    int32_t next_pos;
    /* for the normalisation task */
    int32_t n_rows;
    int32_t *bad_row; /* [pool threads]: first row with a non-finite logit, or -1 */
};

void blade_scorer_free(blade_scorer *s)
{
    if (!s)
        return;
    blade_runner_free(s->runner);
    blade_kv_store_free(s->kv);
    free(s->block_tables);
    free(s->slot_tokens);
    free(s->seqs);
    free(s->logit_rows);
    free(s->row_chunk);
    free(s->row_pos);
    free(s->row_target);
    free(s->logits);
    free(s->log_norm);
    free(s->bad_row);
    free(s);
}

blade_scorer *blade_scorer_new(const blade_model *m, const blade_eval_config *cfg, const blade_eval_text *text,
                               blade_threadpool *pool, blade_error *err)
{
    if (blade_eval_config_validate(cfg, err))
        return NULL;
    if (text->n_chunks < 1 || text->n_ctx < 4 || text->n_tokens < (size_t)text->n_chunks * (size_t)text->n_ctx)
        return blade_error_set(err, "the evaluation text holds no whole chunk"), NULL;
    blade_scorer *s = calloc(1, sizeof *s);
    if (!s)
        return blade_error_set(err, "out of memory"), NULL;
    s->m = m;
    s->text = text;
    s->pool = pool;
    s->n_vocab = m->hp.n_vocab;
    s->run_len = text->n_ctx - 1;
    s->first_scored = text->n_ctx / 2;
    int64_t all_tokens = (int64_t)text->n_chunks * s->run_len;
    s->budget = all_tokens < cfg->batch_tokens ? (int32_t)all_tokens : cfg->batch_tokens;
    /* A call touches its first chunk's rest (at least one token), then at most
     * ceil((budget - 1) / run_len) more. */
    int64_t slots = 2 + (int64_t)(s->budget - 1) / s->run_len;
    s->n_slots = (int32_t)(slots < text->n_chunks ? slots : text->n_chunks);
    s->blocks_per_slot = (s->run_len + SCORER_BLOCK_SIZE - 1) / SCORER_BLOCK_SIZE;
    if ((int64_t)s->n_slots * s->blocks_per_slot > INT32_MAX) {
        blade_scorer_free(s);
        return blade_error_set(err, "chunks of %d tokens need too many KV blocks", text->n_ctx), NULL;
    }
    int32_t n_blocks = s->n_slots * s->blocks_per_slot;

    blade_kv_store_config kc = blade_model_kv_config(&m->hp, cfg->kv_type, SCORER_BLOCK_SIZE, n_blocks);
    s->kv = blade_kv_store_new(&kc, err);
    s->runner = s->kv ? blade_runner_new(m, s->kv, pool, s->budget, err) : NULL;
    if (!s->runner || blade_runner_set_act_stats(s->runner, cfg->act_stats, err)) {
        blade_scorer_free(s);
        return NULL;
    }
    size_t budget = (size_t)s->budget;
    s->block_tables = malloc((size_t)n_blocks * sizeof *s->block_tables);
    s->slot_tokens = malloc((size_t)s->n_slots * (size_t)s->run_len * sizeof *s->slot_tokens);
    s->seqs = calloc((size_t)s->n_slots, sizeof *s->seqs);
    s->logit_rows = malloc(budget * sizeof *s->logit_rows);
    s->row_chunk = malloc(budget * sizeof *s->row_chunk);
    s->row_pos = malloc(budget * sizeof *s->row_pos);
    s->row_target = malloc(budget * sizeof *s->row_target);
    s->log_norm = malloc(budget * sizeof *s->log_norm);
    s->bad_row = malloc((size_t)blade_threadpool_size(pool) * sizeof *s->bad_row);
    if (!s->block_tables || !s->slot_tokens || !s->seqs || !s->logit_rows || !s->row_chunk || !s->row_pos ||
        !s->row_target || !s->log_norm || !s->bad_row) {
        blade_scorer_free(s);
        return blade_error_set(err, "out of memory for a scorer of %d tokens per call", (int)budget), NULL;
    }
    for (int32_t b = 0; b < n_blocks; b++)
        s->block_tables[b] = b;
    return s;
}

/* Room for n rows of logits. Sized by use rather than by the call budget: a call scores
 * at most about half its tokens, and a large vocabulary makes each row big. */
static int reserve_rows(blade_scorer *s, int32_t n, blade_error *err)
{
    if (n <= s->cap_rows)
        return 0;
    float *grown = (size_t)n <= SIZE_MAX / sizeof(float) / (size_t)s->n_vocab
                       ? realloc(s->logits, (size_t)n * (size_t)s->n_vocab * sizeof *s->logits)
                       : NULL;
    if (!grown)
        return blade_error_set(err, "out of memory for %d rows of %d logits", n, s->n_vocab);
    s->logits = grown;
    s->cap_rows = n;
    return 0;
}

/* Each row's log normaliser, log(sum(exp(logits))), in double so that log-probabilities
 * taken from it are exact to the logits' own precision; rows split between the pool's
 * threads. A non-finite logit (a broken model) is reported rather than scored. */
static void task_log_norm(void *ctx, int ith, int nth)
{
    blade_scorer *s = ctx;
    int64_t b = (int64_t)s->n_rows * ith / nth, e = (int64_t)s->n_rows * (ith + 1) / nth;
    s->bad_row[ith] = -1;
    for (int64_t i = b; i < e; i++) {
        const float *row = s->logits + i * s->n_vocab;
        float max = row[0];
        bool finite = true;
        for (int32_t v = 0; v < s->n_vocab; v++) {
            finite = finite && isfinite(row[v]);
            max = row[v] > max ? row[v] : max;
        }
        if (!finite) {
            s->bad_row[ith] = (int32_t)i;
            return;
        }
        double sum = 0.0;
        for (int32_t v = 0; v < s->n_vocab; v++)
            sum += exp((double)row[v] - max);
        s->log_norm[i] = max + log(sum);
    }
}

int blade_scorer_next(blade_scorer *s, blade_scored_rows *rows, blade_error *err)
{
    const blade_eval_text *t = s->text;
    if (s->next_chunk >= t->n_chunks)
        return 0;
    int32_t bos = blade_tokenizer_bos(s->m->tokenizer);
    int32_t budget = s->budget, n_seqs = 0, n_rows = 0;
    int32_t chunk = s->next_chunk, pos = s->next_pos;
    while (budget > 0 && chunk < t->n_chunks) {
        int32_t slot = chunk % s->n_slots;
        int32_t *tokens = s->slot_tokens + (size_t)slot * s->run_len;
        const int32_t *src = t->tokens + (size_t)chunk * t->n_ctx;
        if (pos == 0) {
            memcpy(tokens, src, (size_t)s->run_len * sizeof *tokens);
            tokens[0] = bos;
        }
        int32_t n = s->run_len - pos < budget ? s->run_len - pos : budget;
        blade_batch_seq *q = &s->seqs[n_seqs++];
        *q = (blade_batch_seq){
            .tokens = tokens + pos,
            .n_tokens = n,
            .pos0 = pos,
            .block_table = s->block_tables + (size_t)slot * s->blocks_per_slot,
            .n_blocks = s->blocks_per_slot,
            .logit_rows = s->logit_rows + n_rows,
        };
        for (int32_t p = pos > s->first_scored ? pos : s->first_scored; p < pos + n; p++) {
            s->logit_rows[n_rows] = p - pos;
            s->row_chunk[n_rows] = chunk;
            s->row_pos[n_rows] = p;
            s->row_target[n_rows] = src[p + 1];
            n_rows++;
            q->n_logits++;
        }
        budget -= n;
        pos += n;
        if (pos == s->run_len) {
            chunk++;
            pos = 0;
        }
    }
    if (reserve_rows(s, n_rows, err))
        return -1;
    for (int32_t i = 0, row = 0; i < n_seqs; row += s->seqs[i].n_logits, i++)
        s->seqs[i].logits = s->seqs[i].n_logits ? s->logits + (size_t)row * s->n_vocab : NULL;
    if (blade_runner_forward(s->runner, s->seqs, n_seqs, err))
        return -1;
    s->n_rows = n_rows;
    if (n_rows > 0) {
        blade_threadpool_run(s->pool, task_log_norm, s);
        for (int i = 0; i < blade_threadpool_size(s->pool); i++)
            if (s->bad_row[i] >= 0)
                return blade_error_set(err,
                                       "the model's logits are not finite (NaN or infinite) at chunk %d, position %d",
                                       s->row_chunk[s->bad_row[i]] + 1, s->row_pos[s->bad_row[i]]);
    }
    s->next_chunk = chunk;
    s->next_pos = pos;
    *rows = (blade_scored_rows){
        .n = n_rows,
        .n_vocab = s->n_vocab,
        .chunk = s->row_chunk,
        .pos = s->row_pos,
        .target = s->row_target,
        .logits = s->logits,
        .log_norm = s->log_norm,
        .tokens_run = s->budget - budget,
        .chunks_done = chunk,
    };
    return 1;
}

/* A candidate model against a base (eval.h): both score the same chunks through their own
 * scorer, one forward call of each after the other on one thread pool, and every scored
 * position is compared as it comes: the two models' NLLs of the true next token, the KL
 * divergence of the candidate's distribution from the base's, and whether their most
 * likely tokens agree. */

#include "blade/eval.h"

#include "eval/eval_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- vocabulary ---- */

/* A token's text for a message: quoted, control bytes and quotes escaped, cut at a length
 * that keeps the message readable. */
static void quote_token(const char *text, char *out, size_t cap)
{
    size_t o = 0;
    out[o++] = '"';
    for (const unsigned char *p = (const unsigned char *)text; *p && o + 8 < cap; p++) {
        if (*p < 0x20 || *p == 0x7f)
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", *p);
        else if (*p == '"' || *p == '\\')
            o += (size_t)snprintf(out + o, cap - o, "\\%c", *p);
        else
            out[o++] = (char)*p;
    }
    out[o++] = '"';
    out[o] = '\0';
}

int blade_eval_check_vocab(const blade_model *base, const blade_model *cand, blade_error *err)
{
    const blade_tokenizer *tb = base->tokenizer, *tc = cand->tokenizer;
    int32_t nb = blade_tokenizer_n_vocab(tb), nc = blade_tokenizer_n_vocab(tc);
    int32_t n = nb < nc ? nb : nc;
    for (int32_t i = 0; i < n; i++) {
        const char *a = blade_tokenizer_token_text(tb, i), *b = blade_tokenizer_token_text(tc, i);
        if (strcmp(a, b) != 0) {
            char qa[80], qb[80];
            quote_token(a, qa, sizeof qa);
            quote_token(b, qb, sizeof qb);
            return blade_error_set(err,
                                   "the candidate's vocabulary differs from the base's at token %d: %s in the base, "
                                   "%s in the candidate",
                                   i, qa, qb);
        }
    }
    if (nb != nc)
        return blade_error_set(err,
                               "the candidate's vocabulary has %d tokens, the base's %d (the first %d agree): token %d "
                               "is in one only",
                               nc, nb, n, n);
    if (base->hp.n_vocab != cand->hp.n_vocab)
        return blade_error_set(err, "the base scores %d tokens, the candidate %d", base->hp.n_vocab,
                               cand->hp.n_vocab);
    if (blade_tokenizer_bos(tb) != blade_tokenizer_bos(tc))
        return blade_error_set(err, "the base's BOS is token %d, the candidate's %d", blade_tokenizer_bos(tb),
                               blade_tokenizer_bos(tc));
    return 0;
}

/* ---- per-row comparison ---- */

typedef struct row_cmp {
    double nll_base, nll_cand, kld;
    bool same_top1;
} row_cmp;

typedef struct compare_task {
    const blade_scored_rows *base, *cand;
    row_cmp *out;
} compare_task;

static int32_t argmax(const float *x, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

static void task_compare(void *ctx, int ith, int nth)
{
    const compare_task *t = ctx;
    const blade_scored_rows *b = t->base, *c = t->cand;
    int32_t nv = b->n_vocab;
    int64_t begin = (int64_t)b->n * ith / nth, end = (int64_t)b->n * (ith + 1) / nth;
    for (int64_t i = begin; i < end; i++) {
        const float *lb = b->logits + i * nv, *lc = c->logits + i * nv;
        double kld = 0.0;
        for (int32_t v = 0; v < nv; v++) {
            double pb = (double)lb[v] - b->log_norm[i], pc = (double)lc[v] - c->log_norm[i];
            kld += exp(pb) * (pb - pc);
        }
        int32_t target = b->target[i];
        t->out[i] = (row_cmp){
            .nll_base = b->log_norm[i] - (double)lb[target],
            .nll_cand = c->log_norm[i] - (double)lc[target],
            .kld = kld,
            .same_top1 = argmax(lb, nv) == argmax(lc, nv),
        };
    }
}

/* ---- accumulation ---- */

typedef struct chunk_acc {
    double nll_base, nll_cand, kld, kld_max;
    int64_t top1, n;
} chunk_acc;

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    if (isnan(x) || isnan(y))
        return isnan(x) - isnan(y); /* NaN last */
    return (x > y) - (x < y);
}

/* The q-quantile of n sorted values, interpolating between the neighbours of q (n - 1). */
static double quantile(const double *sorted, int64_t n, double q)
{
    double at = q * (double)(n - 1);
    int64_t lo = (int64_t)floor(at);
    if (lo >= n - 1)
        return sorted[n - 1];
    double frac = at - (double)lo;
    return sorted[lo] + frac * (sorted[lo + 1] - sorted[lo]);
}

/* Both scorers ran the same plan; a difference means a bug, which must not pass as data. */
static int same_rows(const blade_scored_rows *b, const blade_scored_rows *c, blade_error *err)
{
    if (b->n != c->n || b->n_vocab != c->n_vocab || b->chunks_done != c->chunks_done)
        return blade_error_set(err, "internal error: the base and the candidate scored different rows");
    for (int32_t i = 0; i < b->n; i++)
        if (b->chunk[i] != c->chunk[i] || b->pos[i] != c->pos[i] || b->target[i] != c->target[i])
            return blade_error_set(err, "internal error: the base and the candidate scored different rows");
    return 0;
}

static void finish(blade_eval_result *r, const eval_mean *nll_b, const eval_mean *nll_c, const eval_mean *diff,
                   const eval_mean *kld, const eval_mean *top1, double *klds, const chunk_acc *acc)
{
    r->n_scored = kld->n;
    r->ppl_base = exp(nll_b->mean);
    r->ppl_base_se = r->ppl_base * eval_mean_se(nll_b);
    r->ppl_cand = exp(nll_c->mean);
    r->ppl_cand_se = r->ppl_cand * eval_mean_se(nll_c);
    r->dppl_pct = 100.0 * expm1(diff->mean);
    r->dppl_pct_se = 100.0 * exp(diff->mean) * eval_mean_se(diff);
    r->kld_mean = kld->mean;
    r->kld_se = eval_mean_se(kld);
    qsort(klds, (size_t)kld->n, sizeof *klds, compare_doubles);
    r->kld_median = quantile(klds, kld->n, 0.5);
    r->kld_p90 = quantile(klds, kld->n, 0.9);
    r->kld_p99 = quantile(klds, kld->n, 0.99);
    r->kld_max = klds[kld->n - 1];
    r->top1 = top1->mean;
    r->top1_se = eval_mean_se(top1);
    for (int32_t c = 0; c < r->n_chunks; c++) {
        const chunk_acc *a = &acc[c];
        double n = (double)a->n;
        r->chunks[c] = (blade_eval_chunk){
            .ppl_base = exp(a->nll_base / n),
            .ppl_cand = exp(a->nll_cand / n),
            .dppl_pct = 100.0 * expm1((a->nll_cand - a->nll_base) / n),
            .kld_mean = a->kld / n,
            .kld_max = a->kld_max,
            .top1 = (double)a->top1 / n,
        };
    }
}

int blade_eval_compare(const blade_model *base, const blade_model *cand, const blade_eval_text *text,
                       const blade_eval_config *cfg, blade_eval_result *out, blade_error *err)
{
    memset(out, 0, sizeof *out);
    if (blade_eval_config_validate(cfg, err) || blade_eval_check_vocab(base, cand, err))
        return -1;
    int64_t per_chunk = blade_eval_scored_per_chunk(text->n_ctx);
    int64_t total = (int64_t)text->n_chunks * per_chunk;
    blade_eval_config base_cfg = *cfg;
    base_cfg.kv_type = BLADE_KV_F16;
    blade_threadpool *pool = blade_threadpool_new(cfg->n_threads);
    blade_scorer *sb = pool ? blade_scorer_new(base, &base_cfg, text, pool, err) : NULL;
    blade_scorer *sc = sb ? blade_scorer_new(cand, cfg, text, pool, err) : NULL;
    double *klds = malloc((size_t)total * sizeof *klds);
    chunk_acc *acc = calloc((size_t)text->n_chunks, sizeof *acc);
    row_cmp *cmp = malloc((size_t)cfg->batch_tokens * sizeof *cmp);
    out->chunks = calloc((size_t)text->n_chunks, sizeof *out->chunks);
    int rc = -1;
    if (!pool)
        blade_error_set(err, "cannot start the thread pool");
    else if (sc && (!klds || !acc || !cmp || !out->chunks))
        blade_error_set(err, "out of memory for %lld scored tokens", (long long)total);
    if (!sc || !klds || !acc || !cmp || !out->chunks)
        goto done;

    out->n_ctx = text->n_ctx;
    out->n_chunks = text->n_chunks;
    out->n_text_tokens = (int64_t)text->n_tokens;
    eval_mean nll_b = {0}, nll_c = {0}, diff = {0}, kld = {0}, top1 = {0};
    double t0 = eval_now();
    for (;;) {
        blade_scored_rows rb, rcand;
        int more = blade_scorer_next(sb, &rb, err);
        if (more < 0 || (more == 1 && blade_scorer_next(sc, &rcand, err) != 1))
            goto done;
        if (more == 0)
            break;
        if (same_rows(&rb, &rcand, err))
            goto done;
        if (rb.n > total - kld.n) {
            blade_error_set(err, "internal error: more scored rows than the chunks hold");
            goto done;
        }
        compare_task task = {.base = &rb, .cand = &rcand, .out = cmp};
        if (rb.n > 0)
            blade_threadpool_run(pool, task_compare, &task);
        for (int32_t i = 0; i < rb.n; i++) {
            const row_cmp *x = &cmp[i];
            eval_mean_add(&nll_b, x->nll_base);
            eval_mean_add(&nll_c, x->nll_cand);
            eval_mean_add(&diff, x->nll_cand - x->nll_base);
            klds[kld.n] = x->kld;
            eval_mean_add(&kld, x->kld);
            eval_mean_add(&top1, x->same_top1 ? 1.0 : 0.0);
            chunk_acc *a = &acc[rb.chunk[i]];
            a->nll_base += x->nll_base;
            a->nll_cand += x->nll_cand;
            a->kld += x->kld;
            a->kld_max = a->n == 0 || x->kld > a->kld_max ? x->kld : a->kld_max;
            a->top1 += x->same_top1;
            a->n++;
        }
        out->tokens_run += rb.tokens_run + rcand.tokens_run;
        if (cfg->progress) {
            blade_eval_progress p = {
                .chunks_done = rb.chunks_done, .n_chunks = text->n_chunks, .tokens_run = out->tokens_run,
                .seconds = eval_now() - t0, .ppl = exp(nll_b.mean), .kld = kld.mean,
            };
            cfg->progress(&p, cfg->progress_user);
        }
    }
    if (blade_scorer_next(sc, &(blade_scored_rows){0}, err) != 0) {
        blade_error_set(err, "internal error: the candidate has rows left after the base finished");
        goto done;
    }
    out->seconds = eval_now() - t0;
    finish(out, &nll_b, &nll_c, &diff, &kld, &top1, klds, acc);
    rc = 0;
done:
    free(cmp);
    free(acc);
    free(klds);
    blade_scorer_free(sc);
    blade_scorer_free(sb);
    blade_threadpool_free(pool);
    if (rc)
        blade_eval_result_free(out);
    return rc;
}

void blade_eval_result_free(blade_eval_result *r)
{
    free(r->chunks);
    memset(r, 0, sizeof *r);
}

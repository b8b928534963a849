/* Perplexity of one model over the evaluation text (eval.h), through the scorer. */

#include "blade/eval.h"

#include "eval/eval_internal.h"

#include <math.h>
#include <string.h>

int blade_perplexity(const blade_model *m, const blade_eval_text *text, const blade_eval_config *cfg,
                     blade_perplexity_result *out, blade_error *err)
{
    memset(out, 0, sizeof *out);
    blade_threadpool *pool = blade_threadpool_new(cfg->n_threads);
    if (!pool)
        return blade_error_set(err, "cannot start the thread pool");
    blade_scorer *s = blade_scorer_new(m, cfg, text, pool, err);
    if (!s) {
        blade_threadpool_free(pool);
        return -1;
    }
    eval_mean nll = {0};
    double t0 = eval_now();
    blade_scored_rows rows;
    int rc;
    while ((rc = blade_scorer_next(s, &rows, err)) == 1) {
        for (int32_t i = 0; i < rows.n; i++)
            eval_mean_add(&nll, -blade_scored_logprob(&rows, i, rows.target[i]));
        out->tokens_run += rows.tokens_run;
        if (cfg->progress) {
            blade_eval_progress p = {
                .chunks_done = rows.chunks_done, .n_chunks = text->n_chunks, .tokens_run = out->tokens_run,
                .seconds = eval_now() - t0, .ppl = exp(nll.mean), .kld = NAN,
            };
            cfg->progress(&p, cfg->progress_user);
        }
    }
    out->seconds = eval_now() - t0;
    blade_scorer_free(s);
    blade_threadpool_free(pool);
    if (rc < 0)
        return -1;
    out->mean_nll = nll.mean;
    out->ppl = exp(nll.mean);
    out->ppl_se = out->ppl * eval_mean_se(&nll);
    out->n_scored = nll.n;
    out->n_chunks = text->n_chunks;
    return 0;
}

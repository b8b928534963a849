/* Collecting an importance matrix: calibration text through the evaluation scorer (the
 * batched runner, chunks as blade perplexity cuts them) with the runner keeping activation
 * statistics; then each input site's mean squares under the name of every weight matrix
 * that reads it. */

#include "blade/imatrix.h"

#include "blade/act_stats.h"
#include "blade/eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PROGRESS_INTERVAL_S 0.2
#define PROGRESS_BAR_WIDTH 24

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- from statistics to entries ---- */

/* The weight matrices that read each input of a layer (GGUF names, %d the layer). */
static const char *const site_readers[BLADE_ACT_INPUTS_PER_LAYER][3] = {
    [BLADE_ACT_ATTN_IN] = {"blk.%d.attn_q.weight", "blk.%d.attn_k.weight", "blk.%d.attn_v.weight"},
    [BLADE_ACT_ATTN_OUT] = {"blk.%d.attn_output.weight"},
    [BLADE_ACT_FFN_IN] = {"blk.%d.ffn_gate.weight", "blk.%d.ffn_up.weight"},
    [BLADE_ACT_FFN_ACT] = {"blk.%d.ffn_down.weight"},
};

static int add_entry(blade_imatrix *im, const char *name, blade_act_site_stats st, blade_error *err)
{
    blade_imatrix_entry *e = &im->entries[im->n_entries];
    e->name = strdup(name);
    e->mean_sq = malloc((size_t)st.width * sizeof *e->mean_sq);
    e->rows = malloc(sizeof *e->rows);
    im->n_entries++;
    if (!e->name || !e->mean_sq || !e->rows)
        return blade_error_set(err, "out of memory");
    e->n_cols = st.width;
    e->n_slices = 1;
    e->rows[0] = (int64_t)st.rows;
    for (int64_t j = 0; j < st.width; j++)
        e->mean_sq[j] = (float)(st.sum_sq[j] / (double)st.rows);
    return 0;
}

static int entries_from_stats(blade_imatrix *im, const blade_model *m, const blade_act_stats *s, blade_error *err)
{
    const blade_hparams *hp = &m->hp;
    size_t most = (size_t)hp->n_layer * 7 + 1;
    if (!(im->entries = calloc(most, sizeof *im->entries)))
        return blade_error_set(err, "out of memory");
    for (int l = 0; l < hp->n_layer; l++) {
        for (int in = 0; in < BLADE_ACT_INPUTS_PER_LAYER; in++) {
            blade_act_site_stats st = blade_act_stats_get(s, blade_act_site(l, (blade_act_input)in));
            for (int k = 0; k < 3 && site_readers[in][k]; k++) {
                char name[64];
                snprintf(name, sizeof name, site_readers[in][k], l);
                if (add_entry(im, name, st, err))
                    return -1;
            }
        }
    }
    blade_act_site_stats cls = blade_act_stats_get(s, blade_act_classifier_site(hp->n_layer));
    return add_entry(im, hp->tied_embeddings ? "token_embd.weight" : "output.weight", cls, err);
}

/* ---- the calibration run ---- */

typedef struct calibration {
    const blade_imatrix_params *p;
    double nll, nll2;
    int64_t scored;
    double t0, last_shown;
} calibration;

static void show_progress(calibration *c, int32_t done, int32_t total, bool force)
{
    if (!c->p->progress)
        return;
    double t = now_s();
    if (!force && t - c->last_shown < PROGRESS_INTERVAL_S)
        return;
    c->last_shown = t;
    double frac = total ? (double)done / (double)total : 1.0, elapsed = t - c->t0;
    int filled = (int)(frac * PROGRESS_BAR_WIDTH);
    char bar[PROGRESS_BAR_WIDTH + 1];
    for (int i = 0; i < PROGRESS_BAR_WIDTH; i++)
        bar[i] = i < filled ? '#' : '.';
    bar[PROGRESS_BAR_WIDTH] = '\0';
    double rate = elapsed > 0 ? (double)done * c->p->ctx / elapsed : 0.0;
    char ppl[32] = "-", left[32] = "-";
    if (c->scored)
        snprintf(ppl, sizeof ppl, "%.4f", exp(c->nll / (double)c->scored));
    if (done)
        snprintf(left, sizeof left, "%.0f s", elapsed / (double)done * (double)(total - done));
    fprintf(stderr, "\r[%s] chunk %d/%d  %8.0f tokens/s  PPL %-8s  ETA %-8s", bar, done, total, rate, ppl, left);
    fflush(stderr);
}

/* Every chunk through the scorer, whose runner keeps the statistics; the scored rows give
 * the text's perplexity on the way. */
static int run_text(calibration *c, const blade_model *m, const blade_eval_text *text, const blade_eval_config *cfg,
                    blade_threadpool *pool, blade_error *err)
{
    blade_scorer *scorer = blade_scorer_new(m, cfg, text, pool, err);
    if (!scorer)
        return -1;
    blade_scored_rows rows;
    int rc;
    show_progress(c, 0, text->n_chunks, true);
    while ((rc = blade_scorer_next(scorer, &rows, err)) == 1) {
        for (int32_t i = 0; i < rows.n; i++) {
            double v = -blade_scored_logprob(&rows, i, rows.target[i]);
            c->nll += v;
            c->nll2 += v * v;
            c->scored++;
        }
        show_progress(c, rows.chunks_done, text->n_chunks, rows.chunks_done == text->n_chunks);
        if (c->p->cancel && *c->p->cancel) {
            rc = blade_error_set(err, "interrupted");
            break;
        }
    }
    if (c->p->progress)
        fputc('\n', stderr);
    blade_scorer_free(scorer);
    return rc;
}

blade_imatrix *blade_imatrix_collect(const blade_model *m, const blade_imatrix_params *p, blade_imatrix_report *report,
                                     blade_error *err)
{
    blade_eval_config cfg;
    blade_eval_config_default(&cfg);
    cfg.n_ctx = p->ctx;
    cfg.max_chunks = p->max_chunks > 0 ? p->max_chunks : 0;
    cfg.n_threads = p->n_threads;
    cfg.kv_type = BLADE_KV_F32; /* the statistics of the unquantized model */
    calibration c = {.p = p};
    blade_eval_text text = {0};
    blade_threadpool *pool = NULL;
    blade_imatrix *im = calloc(1, sizeof *im);
    if (!im) {
        blade_error_set(err, "out of memory");
        goto fail;
    }
    if (!(cfg.act_stats = blade_act_stats_new(&m->hp, err)))
        goto fail;
    if (blade_eval_text_init(&text, m, p->text, p->text_len, &cfg, err)) {
        blade_error_prefix(err, "%s", p->dataset ? p->dataset : "calibration text");
        goto fail;
    }
    if (!(pool = blade_threadpool_new(p->n_threads))) {
        blade_error_set(err, "cannot start the threads");
        goto fail;
    }
    c.t0 = c.last_shown = now_s();
    if (run_text(&c, m, &text, &cfg, pool, err) || blade_model_identity_of(m->file, &im->model, err) ||
        entries_from_stats(im, m, cfg.act_stats, err))
        goto fail;
    if (!(im->dataset = strdup(p->dataset ? p->dataset : ""))) {
        blade_error_set(err, "out of memory");
        goto fail;
    }
    im->chunks = (uint32_t)text.n_chunks;
    im->chunk_size = (uint32_t)p->ctx;
    if (report) {
        double mean = c.nll / (double)c.scored, var = c.nll2 / (double)c.scored - mean * mean;
        *report = (blade_imatrix_report){
            .text_tokens = text.n_tokens, .chunks = (uint32_t)text.n_chunks, .ppl = exp(mean),
            .ppl_err = c.scored > 1 && var > 0 ? exp(mean) * sqrt(var / (double)(c.scored - 1)) : 0.0,
            .seconds = now_s() - c.t0, .n_threads = blade_threadpool_size(pool),
        };
    }
    blade_threadpool_free(pool);
    blade_eval_text_free(&text);
    blade_act_stats_free(cfg.act_stats);
    return im;
fail:
    blade_threadpool_free(pool);
    blade_eval_text_free(&text);
    blade_act_stats_free(cfg.act_stats);
    blade_imatrix_free(im);
    return NULL;
}

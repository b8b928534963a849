/* Collecting an importance matrix: calibration text through the batched runner, chunk by
 * chunk as blade perplexity cuts it, with the runner keeping activation statistics; then
 * each input site's mean squares under the name of every weight matrix that reads it. */

#include "blade/imatrix.h"

#include "blade/act_stats.h"
#include "blade/runner.h"
#include "blade/sampler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Tokens per runner call: a chunk longer than this goes through in pieces (batch
 * invariance makes that the same computation), which bounds the logits buffer. */
#define MAX_BATCH 512
#define KV_BLOCK 16
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
    const blade_model *m;
    blade_kv_store *kv;
    blade_threadpool *pool;
    blade_runner *runner;
    blade_act_stats *stats;
    int32_t *blocks, *rows;
    float *logits, *logprobs;
    int32_t batch;
    double nll, nll2;
    size_t scored;
    double t0, last_shown;
} calibration;

static void show_progress(calibration *c, uint32_t done, uint32_t total, bool force)
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
    double eta = done ? elapsed / (double)done * (double)(total - done) : 0.0;
    char ppl[32] = "-", left[32] = "-";
    if (c->scored)
        snprintf(ppl, sizeof ppl, "%.4f", exp(c->nll / (double)c->scored));
    if (done)
        snprintf(left, sizeof left, "%.0f s", eta);
    fprintf(stderr, "\r[%s] chunk %u/%u  %8.0f tokens/s  PPL %-8s  ETA %-8s", bar, done, total, rate, ppl, left);
    fflush(stderr);
}

static int setup(calibration *c, blade_error *err)
{
    const blade_hparams *hp = &c->m->hp;
    int32_t n_blocks = (c->p->ctx + KV_BLOCK - 1) / KV_BLOCK;
    /* f32 keys and values: the statistics are those of the unquantized model */
    blade_kv_store_config cfg = blade_model_kv_config(hp, BLADE_KV_F32, KV_BLOCK, n_blocks);
    c->batch = c->p->ctx < MAX_BATCH ? c->p->ctx : MAX_BATCH;
    if (!(c->kv = blade_kv_store_new(&cfg, err)))
        return -1;
    if (!(c->pool = blade_threadpool_new(c->p->n_threads)))
        return blade_error_set(err, "cannot start the threads");
    if (!(c->runner = blade_runner_new(c->m, c->kv, c->pool, c->batch, err)) ||
        !(c->stats = blade_act_stats_new(hp, err)) || blade_runner_set_act_stats(c->runner, c->stats, err))
        return -1;
    c->blocks = malloc((size_t)n_blocks * sizeof *c->blocks);
    c->rows = malloc((size_t)c->batch * sizeof *c->rows);
    c->logits = malloc((size_t)c->batch * (size_t)hp->n_vocab * sizeof *c->logits);
    c->logprobs = malloc((size_t)hp->n_vocab * sizeof *c->logprobs);
    if (!c->blocks || !c->rows || !c->logits || !c->logprobs)
        return blade_error_set(err, "out of memory for %d tokens of logits", c->batch);
    for (int32_t i = 0; i < n_blocks; i++)
        c->blocks[i] = i;
    for (int32_t i = 0; i < c->batch; i++)
        c->rows[i] = i;
    return 0;
}

static void teardown(calibration *c)
{
    blade_runner_free(c->runner);
    blade_act_stats_free(c->stats);
    blade_threadpool_free(c->pool);
    blade_kv_store_free(c->kv);
    free(c->blocks);
    free(c->rows);
    free(c->logits);
    free(c->logprobs);
}

/* One chunk from an empty context, every row's logits wanted (the classifier's statistics
 * count every token); the second half's predictions are scored as blade perplexity does. */
static int run_chunk(calibration *c, int32_t *chunk, int32_t bos, blade_error *err)
{
    const blade_hparams *hp = &c->m->hp;
    int32_t ctx = c->p->ctx, first_scored = ctx / 2, saved = chunk[0];
    chunk[0] = bos;
    int rc = 0;
    for (int32_t pos = 0; pos < ctx && rc == 0; pos += c->batch) {
        if (c->p->cancel && *c->p->cancel) {
            rc = blade_error_set(err, "interrupted");
            break;
        }
        int32_t n = ctx - pos < c->batch ? ctx - pos : c->batch;
        blade_batch_seq seq = {
            .tokens = chunk + pos, .n_tokens = n, .pos0 = pos, .block_table = c->blocks,
            .n_blocks = (pos + n + KV_BLOCK - 1) / KV_BLOCK, .logit_rows = c->rows, .n_logits = n, .logits = c->logits,
        };
        if ((rc = blade_runner_forward(c->runner, &seq, 1, err)) != 0)
            break;
        for (int32_t j = 0; j < n; j++) {
            int32_t at = pos + j;
            if (at < first_scored || at > ctx - 2)
                continue;
            blade_logits_to_logprobs(c->logits + (size_t)j * hp->n_vocab, hp->n_vocab, c->logprobs);
            double v = -(double)c->logprobs[chunk[at + 1]];
            c->nll += v;
            c->nll2 += v * v;
            c->scored++;
        }
    }
    chunk[0] = saved;
    return rc;
}

blade_imatrix *blade_imatrix_collect(const blade_model *m, const blade_imatrix_params *p, blade_imatrix_report *report,
                                     blade_error *err)
{
    if (p->ctx < 2)
        return blade_error_set(err, "chunks of %d tokens are too short (at least 2)", p->ctx), NULL;
    int32_t bos = blade_tokenizer_bos(m->tokenizer);
    if (bos < 0)
        return blade_error_set(err, "the model's vocabulary has no BOS token, which each chunk starts with"), NULL;
    calibration c = {.p = p, .m = m};
    blade_imatrix *im = calloc(1, sizeof *im);
    int32_t *tokens = NULL;
    size_t n_tokens = 0;
    if (!im) {
        blade_error_set(err, "out of memory");
        goto fail;
    }
    if (blade_tokenizer_encode(m->tokenizer, p->text, p->text_len, true, false, &tokens, &n_tokens, err))
        goto fail;
    size_t n_chunks = n_tokens / (size_t)p->ctx;
    if (p->max_chunks > 0 && n_chunks > (size_t)p->max_chunks)
        n_chunks = (size_t)p->max_chunks;
    if (n_chunks == 0) {
        blade_error_set(err, "%s has %zu tokens, fewer than one chunk of %d", p->dataset, n_tokens, p->ctx);
        goto fail;
    }
    if (n_chunks > UINT32_MAX) {
        blade_error_set(err, "%zu chunks are more than a file records", n_chunks);
        goto fail;
    }
    if (setup(&c, err))
        goto fail;
    c.t0 = c.last_shown = now_s();
    show_progress(&c, 0, (uint32_t)n_chunks, true);
    for (size_t ch = 0; ch < n_chunks; ch++) {
        if (run_chunk(&c, tokens + ch * (size_t)p->ctx, bos, err))
            goto fail;
        show_progress(&c, (uint32_t)(ch + 1), (uint32_t)n_chunks, ch + 1 == n_chunks);
    }
    if (p->progress)
        fputc('\n', stderr);
    if (blade_model_identity_of(m->file, &im->model, err) || entries_from_stats(im, m, c.stats, err))
        goto fail;
    if (!(im->dataset = strdup(p->dataset ? p->dataset : ""))) {
        blade_error_set(err, "out of memory");
        goto fail;
    }
    im->chunks = (uint32_t)n_chunks;
    im->chunk_size = (uint32_t)p->ctx;
    if (report) {
        double mean = c.scored ? c.nll / (double)c.scored : 0.0, var = c.scored ? c.nll2 / (double)c.scored - mean * mean : 0.0;
        *report = (blade_imatrix_report){
            .text_tokens = n_tokens, .chunks = (uint32_t)n_chunks, .ppl = exp(mean),
            .ppl_err = c.scored > 1 && var > 0 ? exp(mean) * sqrt(var / (double)(c.scored - 1)) : 0.0,
            .seconds = now_s() - c.t0, .n_threads = blade_threadpool_size(c.pool),
        };
    }
    teardown(&c);
    free(tokens);
    return im;
fail:
    if (p->progress && c.t0 > 0)
        fputc('\n', stderr);
    teardown(&c);
    free(tokens);
    blade_imatrix_free(im);
    return NULL;
}

/* The draft model (spec_draft.h). Drafts are the draft model's greedy choices: for greedy
 * requests the target accepts exactly the drafts it would have produced itself, so what
 * matters is how often the two models agree, and argmax is the draft's best guess. */

#include "engine/spec_draft.h"
#include "engine/spec_policy.h"

#include "blade/kv_store.h"
#include "blade/runner.h"
#include "blade/sampler.h"
#include "blade/tokenizer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct spec_draft {
    blade_model *m;
    /* m is a view of the target's first layers (self-draft), not a model of its own. The view
     * drafts in the target's own KV: the target's step has already put there, for every
     * computed token, what the view's layers would compute, so it never catches up; a
     * drafting model of its own keeps its own KV. */
    bool view;
    bool lowered; /* m is a lower-precision copy of the target's first layers (self-draft) */
    blade_kv_store *store; /* the target's for a view */
    blade_kv_cache *kv;    /* the target's for a view */
    blade_runner *runner;
    int32_t max_batch_tokens;
    int32_t max_seqs;
    int32_t max_context;
    blade_batch_seq *batch; /* [max_seqs] */
    int32_t *job_of;        /* [max_seqs] job of each batch entry */
    int32_t *pos_token;     /* [max_seqs] the one token each later call feeds */
    float *logits;          /* [max_seqs][n_vocab] */
    int32_t lookup_min, lookup_max; /* prompt lookup's n-gram lengths; lookup_min 0: off */
    blade_threadpool *pool;
    bool one_thread; /* few-token forwards run on the calling thread alone (draft_forward) */
};

/* A draft model this small makes its few-token calls on the calling thread alone. Its
 * forward is some fifty passes of a few microseconds' work each, and split over the pool
 * each pass pays the handoff between cores (a cache line takes about 215 ns one way on a
 * Zen 5 host), so that a forward of stories260K-draft (1 MiB) took 60-92 us in the engine
 * against 27.5 us alone (MEASURED.md, stop 41). Bigger models (the self-draft view streams a quarter of the
 * target's weights) want every core's share of the memory bandwidth. */
#define ONE_THREAD_BYTES ((size_t)8 << 20)

typedef struct draft_call {
    spec_draft *d;
    int32_t n;        /* forward: the batch's sequences */
    blade_error *err; /* forward */
    double *one_s;    /* else: measure the one-token step into it */
    int rc;
} draft_call;

static int measure_step(spec_draft *d, double *one_s)
{
    double cost[2];
    return spec_measure_cost(d->runner, d->m->hp.n_vocab, d->store->n_blocks, blade_kv_cache_block_size(d->kv), cost,
                             1, one_s);
}

static void draft_call_task(void *ctx)
{
    draft_call *c = ctx;
    c->rc = c->one_s ? measure_step(c->d, c->one_s) : blade_runner_forward(c->d->runner, c->d->batch, c->n, c->err);
}

/* A forward (or the measurement of one), for a small model on the calling thread alone
 * while the pool's workers keep spinning: a pool of one thread for the drafter let the
 * target's workers fall asleep during drafting, and 17-21 forwards per run then stalled 4-5
 * ms waiting for them to wake (stop 41). */
static int draft_call_run(spec_draft *d, draft_call *c, bool alone)
{
    if (alone)
        blade_threadpool_run_alone(d->pool, draft_call_task, c);
    else
        draft_call_task(c);
    return c->rc;
}

/* A call of this many tokens (a prompt the draft model catches up on) has enough work in
 * each pass to pay for splitting it across the pool, even for a model that drafts alone:
 * stories260K-draft read 400 tokens in 4.8 ms on two threads against 9.1 ms on one, 16 in
 * 0.14 against 0.25 ms (MEASURED.md, stop 43). */
#define POOL_TOKENS 16

static int draft_forward(spec_draft *d, int32_t n, blade_error *err)
{
    int32_t tokens = 0;
    for (int32_t i = 0; i < n; i++)
        tokens += d->batch[i].n_tokens;
    return draft_call_run(d, &(draft_call){.d = d, .n = n, .err = err}, d->one_thread && tokens < POOL_TOKENS);
}

int spec_draft_check_vocab(const blade_model *target, const blade_model *draft, blade_error *err)
{
    const blade_tokenizer *a = target->tokenizer, *b = draft->tokenizer;
    int32_t na = blade_tokenizer_n_vocab(a), nb = blade_tokenizer_n_vocab(b);
    if (na != nb || target->hp.n_vocab != draft->hp.n_vocab)
        return blade_error_set(err, "the draft model's vocabulary has %d tokens, the target's %d", nb, na);
    static const char *const names[] = {"BOS", "EOS", "EOT"};
    int32_t ids[2][3] = {{blade_tokenizer_bos(a), blade_tokenizer_eos(a), blade_tokenizer_eot(a)},
                         {blade_tokenizer_bos(b), blade_tokenizer_eos(b), blade_tokenizer_eot(b)}};
    for (int i = 0; i < 3; i++)
        if (ids[0][i] != ids[1][i])
            return blade_error_set(err, "the draft model's %s token is %d, the target's %d", names[i], ids[1][i],
                                   ids[0][i]);
    for (int32_t t = 0; t < na; t++) {
        const char *x = blade_tokenizer_token_text(a, t), *y = blade_tokenizer_token_text(b, t);
        if (strcmp(x ? x : "", y ? y : "") != 0 || blade_tokenizer_attr(a, t) != blade_tokenizer_attr(b, t))
            return blade_error_set(err, "the draft model's vocabulary differs from the target's at token %d: '%s' vs "
                                        "'%s'",
                                   t, y ? y : "", x ? x : "");
    }
    return 0;
}

spec_draft *spec_draft_new(const char *path, int32_t self_layers, uint32_t self_type, const blade_model *target,
                           blade_kv_store *target_store, blade_kv_cache *target_kv, size_t kv_mem_bytes,
                           int32_t block_size, blade_kv_type kv_type, blade_threadpool *pool,
                           int32_t max_batch_tokens, int32_t max_seqs, blade_error *err)
{
    spec_draft *d = calloc(1, sizeof *d);
    if (!d)
        return blade_error_set(err, "out of memory"), NULL;
    blade_error lerr = {{0}};
    bool own = self_type == BLADE_SPEC_SELF_OWN;
    /* a lower-precision copy computes nearly the target's function for fewer bytes, so all
     * its layers may draft; the target's own weights only through fewer layers than it has */
    int32_t most_layers = own ? target->hp.n_layer - 1 : target->hp.n_layer;
    if (!path && (self_layers < 1 || self_layers > most_layers)) {
        blade_error_set(err, "--self-layers must be between 1 and %d (the model has %d layers), got %d", most_layers,
                        target->hp.n_layer, self_layers);
        goto fail;
    }
    if (!path && !own) {
        /* a lower-precision copy of the target's first layers and classifier */
        if (!(d->m = blade_model_lowered(target, self_layers, self_type, &lerr))) {
            blade_error_set(err, "self-draft copy: %s", lerr.msg);
            goto fail;
        }
        d->lowered = true;
    } else if (!path) {
        /* early exit: the target's first layers, then its final norm and classifier; the
         * weights are the target's, so the view costs no memory but its KV */
        if (!(d->m = malloc(sizeof *d->m))) {
            blade_error_set(err, "out of memory");
            goto fail;
        }
        *d->m = *target;
        d->m->hp.n_layer = self_layers;
        d->view = true;
    } else if (!(d->m = blade_model_load(path, &lerr))) {
        blade_error_set(err, "draft model %s: %s", path, lerr.msg);
        goto fail;
    } else if (spec_draft_check_vocab(target, d->m, &lerr)) {
        blade_error_set(err, "draft model %s cannot draft for this model: %s", path, lerr.msg);
        goto fail;
    }
    d->max_batch_tokens = max_batch_tokens;
    d->max_seqs = max_seqs;
    d->max_context = d->m->hp.n_ctx_train;
    if (d->view) {
        d->store = target_store;
        d->kv = target_kv;
    } else {
        blade_kv_store_config sc = blade_model_kv_config(&d->m->hp, kv_type, block_size, 0);
        size_t block_bytes = blade_kv_store_block_bytes(&sc);
        int64_t n_blocks = kv_mem_bytes ? (int64_t)(kv_mem_bytes / (block_bytes ? block_bytes : 1))
                                        : (int64_t)target_store->n_blocks;
        if (block_bytes == 0 || n_blocks < 1 || n_blocks > INT32_MAX / block_size) {
            blade_error_set(err, "--draft-kv-mem of %zu bytes gives %lld draft KV blocks of %zu bytes; need 1..%d",
                            kv_mem_bytes, (long long)n_blocks, block_bytes, INT32_MAX / block_size);
            goto fail;
        }
        sc.n_blocks = (int32_t)n_blocks;
        blade_kv_cache_config kc = {.n_blocks = (int32_t)n_blocks, .block_size = block_size, .prefix_caching = false};
        if (!(d->store = blade_kv_store_new(&sc, err)) || !(d->kv = blade_kv_cache_new(&kc, err)))
            goto fail;
    }
    if (!(d->runner = blade_runner_new(d->m, d->store, pool, max_batch_tokens, err)))
        goto fail;
    d->pool = pool;
    d->one_thread = !d->view && d->m->weight_bytes <= ONE_THREAD_BYTES;
    d->batch = calloc((size_t)max_seqs, sizeof *d->batch);
    d->job_of = calloc((size_t)max_seqs, sizeof *d->job_of);
    d->pos_token = calloc((size_t)max_seqs, sizeof *d->pos_token);
    d->logits = malloc((size_t)max_seqs * (size_t)d->m->hp.n_vocab * sizeof(float));
    if (!d->batch || !d->job_of || !d->pos_token || !d->logits) {
        blade_error_set(err, "out of memory");
        goto fail;
    }
    return d;
fail:
    spec_draft_free(d);
    return NULL;
}

void spec_draft_free(spec_draft *d)
{
    if (!d)
        return;
    free(d->batch);
    free(d->job_of);
    free(d->pos_token);
    free(d->logits);
    blade_runner_free(d->runner);
    if (d->view) {
        free(d->m);
    } else {
        blade_kv_cache_free(d->kv);
        blade_kv_store_free(d->store);
        if (d->lowered)
            blade_model_lowered_free(d->m);
        else
            blade_model_free(d->m);
    }
    free(d);
}

void spec_draft_set_lookup(spec_draft *d, int32_t n_min, int32_t n_max)
{
    d->lookup_min = n_min;
    d->lookup_max = n_max;
}

double spec_draft_step_seconds(spec_draft *d)
{
    double one;
    if (draft_call_run(d, &(draft_call){.d = d, .one_s = &one}, d->one_thread))
        return -1;
    return one;
}

void spec_draft_seq_init(spec_draft *d, spec_draft_seq *s)
{
    memset(s, 0, sizeof *s);
    if (!d->view)
        blade_kv_cache_seq_init(&s->kv, d->kv, NULL, 0);
}

void spec_draft_seq_release(spec_draft *d, spec_draft_seq *s)
{
    if (!d->view)
        blade_kv_cache_release(d->kv, &s->kv);
    s->n_computed = 0;
    s->n_fed = 0;
}

void spec_draft_seq_destroy(spec_draft_seq *s)
{
    blade_kv_cache_seq_destroy(&s->kv);
}

int spec_draft_check_kv(const spec_draft *d, const blade_kv_cache_seq *const *seqs, int32_t n_seqs, blade_error *err)
{
    return d->view ? 0 : blade_kv_cache_check(d->kv, seqs, n_seqs, err);
}

void spec_draft_kv_stats(const spec_draft *d, blade_kv_cache_stats *st)
{
    if (d->view)
        memset(st, 0, sizeof *st);
    else
        blade_kv_cache_stats_get(d->kv, st);
}

int32_t spec_draft_max_context(const spec_draft *d)
{
    return d->max_context;
}

/* Keeps the fed drafts that became the sequence's tokens; the rest of the draft KV is
 * rolled back. */
static void catch_up_state(spec_draft *d, spec_draft_job *j)
{
    spec_draft_seq *s = j->seq;
    int32_t kept = 0;
    while (kept < s->n_fed && s->n_computed + kept < j->n_tokens && j->tokens[s->n_computed + kept] == s->fed[kept])
        kept++;
    s->n_computed += kept;
    s->n_fed = 0;
    blade_kv_cache_truncate(d->kv, &s->kv, s->n_computed);
}

/* Where job j's drafting KV lives: its own, or (a view) the target sequence's. */
static blade_kv_cache_seq *job_kv(const spec_draft *d, spec_draft_job *j)
{
    return d->view ? j->target_seq : &j->seq->kv;
}

/* In the target's KV the view reads every computed token and writes only its drafts'
 * positions, which the verify step computes again (the runner is chunk invariant, so
 * alike): the target gets back the blocks it held before (a scheduler reserving whole
 * lengths keeps its reservation), and the view's state is empty again. */
static void end_shared(spec_draft *d, spec_draft_job *jobs, int32_t n_jobs)
{
    if (!d->view)
        return;
    int32_t bs = blade_kv_cache_block_size(d->kv);
    for (int32_t i = 0; i < n_jobs; i++) {
        spec_draft_seq *s = jobs[i].seq;
        blade_kv_cache_truncate(d->kv, jobs[i].target_seq, s->target_blocks * bs);
        s->n_computed = s->n_fed = 0;
    }
}

/* After a failed call nothing is known about what the draft KV holds: every job drafts
 * nothing and starts again from scratch. */
static void fail_all(spec_draft *d, spec_draft_job *jobs, int32_t n_jobs)
{
    end_shared(d, jobs, n_jobs);
    for (int32_t i = 0; i < n_jobs; i++) {
        jobs[i].n_out = 0;
        spec_draft_seq_release(d, jobs[i].seq);
    }
}

/* Logits this far below the top add less than e^-16 each to the softmax sum: skipping them
 * saves an exp per vocabulary entry and moves a confidence by at most vocabulary size times
 * 1e-7. */
#define CONF_CUT 16.0f

/* The draft model's probability for its choice `top`. */
static float choice_prob(const float *logits, int32_t n, int32_t top)
{
    float max = logits[top], cut = max - CONF_CUT;
    double sum = 0;
    for (int32_t i = 0; i < n; i++)
        if (logits[i] > cut)
            sum += expf(logits[i] - max);
    return sum > 0 ? (float)(1.0 / sum) : 0.0f;
}

/* Appends job i's next draft: the draft model's choice from its logits, or prompt
 * lookup's candidate where the two differ and the calibration rates lookup likelier to be
 * kept. A row with no usable logits ends the job's drafting. */
static void push_draft(spec_draft *d, spec_draft_job *j, const float *logits, const spec_calib *calib)
{
    int32_t top = blade_argmax(logits, d->m->hp.n_vocab);
    if (top < 0) {
        j->k = j->n_out;
        return;
    }
    float conf = choice_prob(logits, d->m->hp.n_vocab, top);
    int32_t tok = top, look;
    spec_source src = SPEC_FROM_MODEL;
    if (d->lookup_min > 0 &&
        blade_ngram_propose(j->tokens, j->n_tokens + j->n_out, d->lookup_min, d->lookup_max, 1, &look) == 1) {
        if (look == top)
            src = SPEC_FROM_BOTH;
        else if (spec_calib_rate(calib, SPEC_FROM_LOOKUP, conf) > spec_calib_rate(calib, SPEC_FROM_MODEL, conf)) {
            tok = look;
            src = SPEC_FROM_LOOKUP;
        }
    }
    j->tokens[j->n_tokens + j->n_out] = tok;
    j->conf[j->n_out] = conf;
    j->source[j->n_out] = (uint8_t)src;
    j->gain[j->n_out] = (j->n_out ? j->gain[j->n_out - 1] : 1.0) * spec_calib_rate(calib, src, conf);
    j->n_out++;
}

/* Whether job j, having made its drafts so far, feeds the last for another. */
static bool drafts_more(const spec_draft_job *j)
{
    if (j->n_out >= j->k || j->gain[j->n_out - 1] < j->stop_below)
        return false;
    return !j->econ || spec_policy_draft_more(j->econ, j->gain, j->n_out, j->k);
}

int spec_draft_propose(spec_draft *d, spec_draft_job *jobs, int32_t n_jobs, const spec_calib *calib, blade_error *err)
{
    const int32_t n_vocab = d->m->hp.n_vocab;
    int32_t budget = d->max_batch_tokens, n = 0, k_max = 0;
    for (int32_t i = 0; i < n_jobs; i++)
        jobs[i].n_out = 0;
    /* call 1: catch up, and the first draft of each sequence that caught up fully */
    for (int32_t i = 0; i < n_jobs && n < d->max_seqs; i++) {
        spec_draft_job *j = &jobs[i];
        spec_draft_seq *s = j->seq;
        if (d->view) {
            s->n_computed = j->n_tokens - 1;
            s->target_blocks = j->target_seq->n_blocks;
        } else {
            catch_up_state(d, j);
        }
        int32_t k = j->k;
        if (j->n_tokens + k - 1 > d->max_context)
            k = d->max_context - j->n_tokens + 1;
        int32_t catch = j->n_tokens - s->n_computed;
        if (catch <= 0 || budget <= 0)
            continue;
        int32_t take = catch <= budget ? catch : budget;
        bool drafts = take == catch && k > 0;
        int32_t need = s->n_computed + take + (drafts ? k - 1 : 0);
        blade_kv_cache_seq *kv = job_kv(d, j);
        if (blade_kv_cache_allocate(d->kv, kv, need) != 0)
            continue;
        budget -= take;
        j->k = drafts ? k : 0;
        d->job_of[n] = i;
        d->batch[n] = (blade_batch_seq){
            .tokens = j->tokens + s->n_computed,
            .n_tokens = take,
            .pos0 = s->n_computed,
            .block_table = kv->blocks,
            .n_blocks = kv->n_blocks,
            .n_logits = drafts ? 1 : 0,
            .logits = d->logits + (size_t)n * n_vocab,
        };
        n++;
    }
    if (n == 0) {
        end_shared(d, jobs, n_jobs);
        return 0;
    }
    if (draft_forward(d, n, err)) {
        fail_all(d, jobs, n_jobs);
        return -1;
    }
    for (int32_t b = 0; b < n; b++) {
        spec_draft_job *j = &jobs[d->job_of[b]];
        j->seq->n_computed += d->batch[b].n_tokens;
        if (d->batch[b].n_logits) {
            push_draft(d, j, d->logits + (size_t)b * n_vocab, calib);
            if (j->k > k_max)
                k_max = j->k;
        }
    }
    /* calls 2..k: every sequence still drafting feeds its last draft */
    for (int32_t step = 1; step < k_max; step++) {
        n = 0;
        for (int32_t i = 0; i < n_jobs; i++) {
            spec_draft_job *j = &jobs[i];
            spec_draft_seq *s = j->seq;
            if (j->n_out != step || !drafts_more(j))
                continue;
            int32_t last = j->tokens[j->n_tokens + step - 1];
            const blade_kv_cache_seq *kv = job_kv(d, j);
            d->pos_token[n] = last;
            d->job_of[n] = i;
            d->batch[n] = (blade_batch_seq){
                .tokens = &d->pos_token[n],
                .n_tokens = 1,
                .pos0 = s->n_computed + s->n_fed,
                .block_table = kv->blocks,
                .n_blocks = kv->n_blocks,
                .n_logits = 1,
                .logits = d->logits + (size_t)n * n_vocab,
            };
            s->fed[s->n_fed++] = last;
            n++;
        }
        if (n == 0)
            break;
        if (draft_forward(d, n, err)) {
            fail_all(d, jobs, n_jobs);
            return -1;
        }
        for (int32_t b = 0; b < n; b++)
            push_draft(d, &jobs[d->job_of[b]], d->logits + (size_t)b * n_vocab, calib);
    }
    end_shared(d, jobs, n_jobs);
    return 0;
}

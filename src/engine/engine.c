/* The engine's public face (engine.h): it builds the KV store, the block manager, the
 * scheduler and the runner for one model, starts the engine thread (step_loop.c), and is
 * the only way in from the callers' threads: submit and abort leave work in a mailbox the
 * loop empties once per step, statistics come out as the loop last published them. */

#include "engine/engine_internal.h"

#include "blade/gguf.h"

#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void blade_engine_config_default(blade_engine_config *c)
{
    memset(c, 0, sizeof *c);
    c->n_threads = 0;
    c->kv_mem_bytes = (size_t)1 << 30;
    c->block_size = 16;
    c->kv_type = BLADE_KV_F16;
    c->prefix_caching = true;
    blade_sched_config_default(&c->sched);
    c->max_context = 0;
    blade_spec_config_default(&c->spec);
}

static int validate_spec(const blade_spec_config *sc, blade_error *err)
{
    if (sc->mode != BLADE_SPEC_NONE && sc->mode != BLADE_SPEC_NGRAM && sc->mode != BLADE_SPEC_DRAFT &&
        sc->mode != BLADE_SPEC_SELF)
        return blade_error_set(err, "unknown speculative decoding mode %d", (int)sc->mode);
    if (sc->mode == BLADE_SPEC_DRAFT && (!sc->draft_model_path || !*sc->draft_model_path))
        return blade_error_set(err, "speculative decoding with a draft model needs --draft-model FILE.gguf");
    if (sc->mode == BLADE_SPEC_NONE)
        return 0;
    if (sc->k < 1 || sc->k > BLADE_SPEC_MAX_K)
        return blade_error_set(err, "--spec-k must be between 1 and %d, got %d", BLADE_SPEC_MAX_K, sc->k);
    if (sc->ngram_min < 1 || sc->ngram_max < sc->ngram_min)
        return blade_error_set(err, "n-gram lengths must satisfy 1 <= --ngram-min (%d) <= --ngram-max (%d)",
                               sc->ngram_min, sc->ngram_max);
    if (!(sc->draft_cost >= 0 && sc->draft_cost < 1e6))
        return blade_error_set(err, "a given draft cost must be a finite number >= 0, got %g", sc->draft_cost);
    return 0;
}

/* The prefix cache must never hand one model's KV to another: the model's identity is
 * the digest of its metadata and tensor table. */
static void model_identity(const blade_model *m, uint8_t out[BLADE_HASH_BYTES])
{
    unsigned int len = 0;
    memset(out, 0, BLADE_HASH_BYTES);
    EVP_Digest(m->file->map, m->file->data_offset, out, &len, EVP_sha256(), NULL);
}

/* Two engines can exchange blocks when the model, the KV type and the block size agree. */
static void kv_fingerprint(const uint8_t model_id[BLADE_HASH_BYTES], const blade_engine_config *cfg,
                           uint8_t out[BLADE_ENGINE_FINGERPRINT_BYTES])
{
    uint8_t buf[64] = "blade kv fingerprint v1";
    memcpy(buf + 24, model_id, BLADE_HASH_BYTES);
    uint32_t type = (uint32_t)cfg->kv_type, bs = (uint32_t)cfg->block_size;
    for (int i = 0; i < 4; i++) {
        buf[56 + i] = (uint8_t)(type >> (8 * i));
        buf[60 + i] = (uint8_t)(bs >> (8 * i));
    }
    unsigned int len = 0;
    EVP_Digest(buf, sizeof buf, out, &len, EVP_sha256(), NULL);
}

const char *blade_pooling_name(blade_pooling p)
{
    static const char *const names[] = {"none", "model", "mean", "last"};
    return p >= BLADE_POOL_NONE && p <= BLADE_POOL_LAST ? names[p] : "?";
}

/* The GGUF key {arch}.pooling_type (llama.cpp's numbering: 1 mean, 2 cls, 3 last). cls
 * pools the first token, which a causal model computes from that token alone, so it means
 * nothing here: such a file, like one without the key, is pooled by the mean. */
static blade_pooling model_pooling(const blade_model *m)
{
    char key[96];
    snprintf(key, sizeof key, "%s.pooling_type", blade_arch_name(m->hp.arch));
    uint32_t type = 0;
    bool present = false;
    blade_error err = {{0}};
    if (!gguf_get_u32(m->file, key, &type, &present, &err) || !present)
        return BLADE_POOL_MEAN;
    return type == 3 ? BLADE_POOL_LAST : BLADE_POOL_MEAN;
}

/* The policy's cost curve: given, or measured now on this machine (before any request,
 * in blocks nobody holds). Without it the engine drafts a fixed k. */
static void calibrate_policy(blade_engine *e)
{
    const blade_spec_config *sc = &e->cfg.spec;
    int32_t n = sc->k + 1;
    double one = 0, cost[BLADE_SPEC_MAX_K + 2];
    if (sc->verify_cost[1] > 0) {
        spec_curve_init(&e->curve, sc->verify_cost, n, 1);
    } else if (spec_measure_cost(e->runner, e->m->hp.n_vocab, e->store->n_blocks, e->cfg.block_size, cost, n,
                                 &one)) {
        return;
    } else {
        spec_curve_init(&e->curve, cost, n, one * 1e3);
        e->curve_live = true;
    }
    e->draft_cost = 0;
    if (e->draft && sc->verify_cost[1] > 0 && sc->draft_cost > 0) {
        e->draft_cost = sc->draft_cost;
    } else if (e->draft) {
        double d = spec_draft_step_seconds(e->draft);
        if (d < 0)
            return;
        /* a given curve is in units of the target's step, which is then measured alone */
        if (sc->verify_cost[1] > 0) {
            double c[2];
            if (spec_measure_cost(e->runner, e->m->hp.n_vocab, e->store->n_blocks, e->cfg.block_size, c, 1, &one))
                return;
        }
        e->draft_cost = d / one;
    }
    e->adaptive = true;
}

blade_engine *blade_engine_new(const blade_model *m, const blade_engine_config *cfg, blade_error *err)
{
    if (validate_spec(&cfg->spec, err))
        return NULL;
    blade_engine *e = calloc(1, sizeof *e);
    if (!e)
        return blade_error_set(err, "out of memory"), NULL;
    e->m = m;
    e->cfg = *cfg;
    e->next_id = 1;
    e->max_context = cfg->max_context > 0 ? cfg->max_context : m->hp.n_ctx_train;
    if (cfg->block_size <= 0 || cfg->block_size > 1024) {
        free(e);
        return blade_error_set(err, "block size %d is out of range (1..1024)", cfg->block_size), NULL;
    }
    blade_kv_store_config store_cfg = blade_model_kv_config(&m->hp, cfg->kv_type, cfg->block_size, 0);
    size_t block_bytes = blade_kv_store_block_bytes(&store_cfg);
    int64_t n_blocks = (int64_t)(cfg->kv_mem_bytes / block_bytes);
    if (n_blocks < 1 || n_blocks > INT32_MAX / cfg->block_size) {
        free(e);
        return blade_error_set(err, "a KV budget of %zu bytes gives %lld blocks of %zu bytes; need 1..%d",
                               cfg->kv_mem_bytes, (long long)n_blocks, block_bytes, INT32_MAX / cfg->block_size),
               NULL;
    }
    store_cfg.n_blocks = (int32_t)n_blocks;
    blade_kv_cache_config kc = {.n_blocks = (int32_t)n_blocks, .block_size = cfg->block_size,
                                .prefix_caching = cfg->prefix_caching};
    model_identity(m, kc.model_id);
    kv_fingerprint(kc.model_id, cfg, e->fingerprint);
    /* Without chunked prefill a whole prompt runs in one step, so the runner must take the
     * longest one. */
    int32_t runner_tokens = cfg->sched.max_batch_tokens;
    if (!cfg->sched.chunked_prefill && e->max_context > runner_tokens)
        runner_tokens = e->max_context;
    if (cfg->sched.max_seqs > runner_tokens)
        runner_tokens = cfg->sched.max_seqs;
    e->runner_tokens = runner_tokens;
    e->pooling = model_pooling(m);
    e->vocab.tok = m->tokenizer;
    e->vocab.n_vocab = m->hp.n_vocab;
    e->vocab.piece_cap = blade_tokenizer_max_token_bytes(m->tokenizer) + 16;
    e->pool = blade_threadpool_new(cfg->n_threads);
    e->store = e->pool ? blade_kv_store_new(&store_cfg, err) : NULL;
    e->kv = e->store ? blade_kv_cache_new(&kc, err) : NULL;
    e->sched = e->kv ? blade_scheduler_new(&cfg->sched, e->kv, err) : NULL;
    e->runner = e->sched ? blade_runner_new(m, e->store, e->pool, runner_tokens, err) : NULL;
    /* every draft in a step is one more row of logits, and drafts count against the budget */
    bool spec = cfg->spec.mode != BLADE_SPEC_NONE;
    e->max_logit_rows = cfg->sched.max_seqs + (spec ? runner_tokens : 0);
    size_t seqs = (size_t)cfg->sched.max_seqs, rows = (size_t)e->max_logit_rows;
    e->batch = calloc(seqs, sizeof *e->batch);
    e->logits = malloc(rows * (size_t)m->hp.n_vocab * sizeof(float));
    e->vocab.logprobs = malloc((size_t)m->hp.n_vocab * sizeof(float));
    e->row_ids = malloc(rows * sizeof *e->row_ids);
    e->item_row = malloc(seqs * sizeof *e->item_row);
    e->item_out = malloc(seqs * sizeof *e->item_out);
    e->item_bad = malloc(seqs * sizeof *e->item_bad);
    e->spec_out = malloc(rows * sizeof *e->spec_out);
    e->draft_jobs = malloc(seqs * sizeof *e->draft_jobs);
    e->draft_owner = malloc(seqs * sizeof *e->draft_owner);
    e->spec_probs = malloc((size_t)m->hp.n_vocab * sizeof *e->spec_probs);
    e->cands = malloc(seqs * sizeof *e->cands);
    spec_calib_init(&e->calib);
    spec_accept_init(&e->spec_traffic);
    e->cand_owner = malloc(seqs * sizeof *e->cand_owner);
    bool scratch = e->row_ids && e->item_row && e->item_out && e->item_bad && e->spec_out && e->draft_jobs &&
                   e->draft_owner && e->spec_probs && e->cands && e->cand_owner;
    if (scratch && e->runner && (cfg->spec.mode == BLADE_SPEC_DRAFT || cfg->spec.mode == BLADE_SPEC_SELF)) {
        bool self = cfg->spec.mode == BLADE_SPEC_SELF;
        bool own = cfg->spec.self_type == BLADE_SPEC_SELF_OWN;
        int32_t layers = cfg->spec.self_layers > 0 ? cfg->spec.self_layers : own ? (m->hp.n_layer + 3) / 4 : m->hp.n_layer;
        e->draft = spec_draft_new(self ? NULL : cfg->spec.draft_model_path, layers, cfg->spec.self_type, m, e->store,
                                  e->kv, cfg->spec.draft_kv_mem_bytes, cfg->block_size, cfg->kv_type, e->pool,
                                  runner_tokens, cfg->sched.max_seqs, err);
        if (!e->draft) {
            blade_engine_free(e, false);
            return NULL;
        }
        if (cfg->spec.draft_lookup)
            spec_draft_set_lookup(e->draft, cfg->spec.ngram_min, cfg->spec.ngram_max);
    }
    if (e->row_ids)
        for (size_t i = 0; i < rows; i++)
            e->row_ids[i] = (int32_t)i;
    if (!e->runner || !e->batch || !e->logits || !e->vocab.logprobs || !scratch) {
        if (e->runner)
            blade_error_set(err, "out of memory");
        else if (!e->pool)
            blade_error_set(err, "cannot start the thread pool");
        blade_engine_free(e, false);
        return NULL;
    }
    if (cfg->spec.mode != BLADE_SPEC_NONE && cfg->spec.adaptive)
        calibrate_policy(e);
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->kv_mu, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->idle, NULL);
    e->loop_idle = true;
    if (pthread_create(&e->thread, NULL, engine_loop, e) != 0) {
        pthread_mutex_destroy(&e->mu);
        pthread_mutex_destroy(&e->kv_mu);
        pthread_cond_destroy(&e->work);
        pthread_cond_destroy(&e->idle);
        e->thread = 0;
        blade_error_set(err, "cannot start the engine thread");
        blade_engine_free(e, false);
        return NULL;
    }
    return e;
}

uint64_t blade_engine_submit(blade_engine *e, const blade_request *q, blade_error *err)
{
    request_state *r = engine_request_new(e, q, err);
    if (!r)
        return 0;

    pthread_mutex_lock(&e->mu);
    if (e->stopping) {
        pthread_mutex_unlock(&e->mu);
        engine_request_free(r);
        return blade_error_set(err, "the engine is shutting down"), 0;
    }
    r->out.id = r->seq.id = e->next_id++;
    if (q->import)
        r->import_staging = q->import->staging;
    for (request_state *f = r->followers; f; f = f->next_live)
        f->out.id = f->seq.id = r->seq.id;
    if (e->incoming_tail)
        e->incoming_tail->next_live = r;
    else
        e->incoming_head = r;
    e->incoming_tail = r;
    e->loop_idle = false;
    uint64_t id = r->seq.id;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->mu);
    return id;
}

bool blade_engine_abort(blade_engine *e, uint64_t id)
{
    pthread_mutex_lock(&e->mu);
    bool known = id > 0 && id < e->next_id;
    if (known && e->n_aborts == e->cap_aborts) {
        int32_t cap = e->cap_aborts ? e->cap_aborts * 2 : 16;
        uint64_t *grown = realloc(e->aborts, (size_t)cap * sizeof *grown);
        if (grown) {
            e->aborts = grown;
            e->cap_aborts = cap;
        } else {
            known = false;
        }
    }
    if (known) {
        e->aborts[e->n_aborts++] = id;
        e->loop_idle = false; /* wait_idle returns once the abort is carried out */
        pthread_cond_signal(&e->work);
    }
    pthread_mutex_unlock(&e->mu);
    return known;
}

void blade_engine_wait_idle(blade_engine *e)
{
    pthread_mutex_lock(&e->mu);
    while (!e->loop_idle)
        pthread_cond_wait(&e->idle, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

void blade_engine_free(blade_engine *e, bool drain)
{
    if (!e)
        return;
    if (e->thread) {
        pthread_mutex_lock(&e->mu);
        e->stopping = true;
        e->drain = drain;
        pthread_cond_signal(&e->work);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->thread, NULL);
        pthread_mutex_destroy(&e->mu);
        pthread_mutex_destroy(&e->kv_mu);
        pthread_cond_destroy(&e->work);
        pthread_cond_destroy(&e->idle);
    }
    while (e->live) {
        request_state *r = e->live;
        e->live = r->next_live;
        engine_request_free(r);
    }
    free(e->aborts);
    free(e->live_kv);
    free(e->batch);
    free(e->logits);
    free(e->hidden);
    free(e->vocab.logprobs);
    free(e->row_ids);
    free(e->item_row);
    free(e->item_out);
    free(e->item_bad);
    free(e->spec_out);
    free(e->draft_jobs);
    free(e->draft_owner);
    free(e->spec_probs);
    free(e->cands);
    free(e->cand_owner);
    spec_draft_free(e->draft);
    blade_runner_free(e->runner);
    blade_scheduler_free(e->sched);
    blade_kv_cache_free(e->kv);
    blade_kv_store_free(e->store);
    blade_threadpool_free(e->pool);
    free(e);
}

void blade_engine_stats_get(blade_engine *e, blade_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
}

const blade_model *blade_engine_model(const blade_engine *e)
{
    return e->m;
}

int64_t blade_engine_kv_tokens(const blade_engine *e)
{
    return (int64_t)e->store->n_blocks * e->cfg.block_size;
}

int32_t blade_engine_max_context(const blade_engine *e)
{
    return e->max_context;
}

int32_t blade_engine_draft_context(const blade_engine *e)
{
    return e->draft ? spec_draft_max_context(e->draft) : 0;
}

void blade_engine_fingerprint(const blade_engine *e, uint8_t out[BLADE_ENGINE_FINGERPRINT_BYTES])
{
    memcpy(out, e->fingerprint, BLADE_ENGINE_FINGERPRINT_BYTES);
}

void blade_engine_fingerprint_hex(const blade_engine *e, char out[2 * BLADE_ENGINE_FINGERPRINT_BYTES + 1])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < BLADE_ENGINE_FINGERPRINT_BYTES; i++) {
        out[2 * i] = digits[e->fingerprint[i] >> 4];
        out[2 * i + 1] = digits[e->fingerprint[i] & 15];
    }
    out[2 * BLADE_ENGINE_FINGERPRINT_BYTES] = 0;
}

const blade_kv_store *blade_engine_kv_store(const blade_engine *e)
{
    return e->store;
}

void blade_engine_kv_have(blade_engine *e, const uint8_t (*hashes)[BLADE_HASH_BYTES], int32_t n, bool *have)
{
    pthread_mutex_lock(&e->kv_mu);
    blade_kv_cache_lookup(e->kv, hashes, n, have);
    pthread_mutex_unlock(&e->kv_mu);
}

bool blade_engine_export_release(blade_engine *e, uint64_t id)
{
    return blade_engine_abort(e, id);
}

blade_pooling blade_engine_pooling(const blade_engine *e)
{
    return e->pooling;
}

/* Speculative decoding: the n-gram drafter, KV rollback, and the promise that speculation
 * never changes a greedy token, logit or logprob. Every speculative run is compared with
 * memcmp against the same request decoded without speculation, with speculating,
 * opted-out, sampled and prefilling sequences sharing steps, small budgets that trim drafts,
 * small KV pools that preempt, and 1-3 threads. */
#include "testutil.h"

#include "blade/engine.h"
#include "blade/kv_cache.h"
#include "blade/model.h"
#include "blade/spec.h"
#include "blade/synth.h"
#include "blade/types.h"
#include "blade/runner.h"
#include "blade/sampler.h"
#include "engine/spec_draft.h"
#include "engine/spec_policy.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_GEN 64
#define N_PROMPTS 10

/* Each request's events, as the engine delivered them. */
typedef test_record result;

static void result_init(result *r, int32_t n_vocab)
{
    test_record_init(r, MAX_GEN + 1, n_vocab);
}

typedef struct job {
    int32_t prompt[600];
    int32_t n_prompt;
    int32_t max_tokens;
    float temperature;
    bool speculative;
    const char *const *stop;
    int32_t n_stop;
} job;

/* ---- the drafter ---- */

static void test_ngram_propose(void **state)
{
    (void)state;
    int32_t out[8];
    /* "5 6 7" recurs: the tokens after its most recent earlier occurrence are proposed */
    const int32_t a[] = {1, 5, 6, 7, 8, 9, 2, 5, 6, 7, 3, 4, 5, 6, 7};
    assert_int_equal(blade_ngram_propose(a, 15, 2, 3, 4, out), 4);
    assert_int_equal(out[0], 3);
    assert_int_equal(out[3], 6);
    /* k bounds the proposal, and what follows the match may be short */
    assert_int_equal(blade_ngram_propose(a, 15, 2, 3, 1, out), 1);
    assert_int_equal(out[0], 3);
    const int32_t b[] = {1, 2, 3, 9, 2, 3};
    assert_int_equal(blade_ngram_propose(b, 6, 2, 2, 5, out), 3);
    assert_int_equal(out[0], 9);
    assert_int_equal(out[2], 3);
    /* the longest suffix wins over a more recent shorter one */
    const int32_t c[] = {4, 2, 3, 10, 7, 3, 11, 4, 2, 3};
    assert_int_equal(blade_ngram_propose(c, 10, 1, 3, 1, out), 1);
    assert_int_equal(out[0], 10);
    assert_int_equal(blade_ngram_propose(c, 10, 1, 1, 1, out), 1);
    assert_int_equal(out[0], 11);
    /* nothing recurs, nothing to look in, nothing asked */
    const int32_t d[] = {1, 2, 3, 4};
    assert_int_equal(blade_ngram_propose(d, 4, 1, 3, 4, out), 0);
    assert_int_equal(blade_ngram_propose(d, 1, 1, 3, 4, out), 0);
    assert_int_equal(blade_ngram_propose(a, 15, 2, 3, 0, out), 0);
    /* a run of one token predicts more of it */
    const int32_t e[] = {7, 7, 7};
    assert_int_equal(blade_ngram_propose(e, 3, 2, 2, 4, out), 1);
    assert_int_equal(out[0], 7);
}

/* ---- rollback in the block manager ---- */

static void test_kv_truncate(void **state)
{
    (void)state;
    blade_kv_cache_config cfg = {.n_blocks = 8, .block_size = 4, .prefix_caching = true};
    blade_error err = {{0}};
    blade_kv_cache *c = blade_kv_cache_new(&cfg, &err);
    assert_non_null(c);
    blade_kv_cache_seq s;
    blade_kv_cache_seq_init(&s, c, NULL, 0);
    int32_t toks[20];
    for (int i = 0; i < 20; i++)
        toks[i] = 100 + i;
    /* 9 tokens computed, 7 drafts verified: 4 blocks */
    assert_int_equal(blade_kv_cache_allocate(c, &s, 16), 0);
    assert_int_equal(s.n_blocks, 4);
    /* one draft kept: 10 tokens, 3 blocks; the 4th block, all rejected drafts, is free */
    blade_kv_cache_truncate(c, &s, 10);
    blade_kv_cache_commit(c, &s, toks, 10);
    assert_int_equal(s.n_blocks, 3);
    assert_int_equal(s.n_hashed, 2);
    blade_kv_cache_stats st;
    blade_kv_cache_stats_get(c, &st);
    assert_int_equal(st.blocks_used, 3);
    assert_int_equal(st.blocks_free, 5);
    /* a hashed block is never dropped, whatever the caller asks */
    blade_kv_cache_truncate(c, &s, 3);
    assert_int_equal(s.n_blocks, 2);
    const blade_kv_cache_seq *live[] = {&s};
    assert_int_equal(blade_kv_cache_check(c, live, 1, &err), 0);
    blade_kv_cache_release(c, &s);
    blade_kv_cache_stats_get(c, &st);
    assert_int_equal(st.blocks_cached, 2);
    assert_int_equal(st.blocks_free, 6);
    blade_kv_cache_seq_destroy(&s);
    blade_kv_cache_free(c);
}

/* ---- the engine ---- */

typedef struct engine_shape {
    int32_t kv_blocks, budget, threads;
    blade_spec_mode mode;
    int32_t k;
    const char *draft;       /* draft model path */
    int32_t draft_kv_blocks; /* 0: the default */
    bool contiguous;         /* --kv-alloc contiguous */
    const char *self_type;   /* self-draft's lower-precision copy (all layers); NULL: early exit */
    bool no_lookup;          /* --no-draft-lookup: the drafting model alone */
} engine_shape;

static blade_engine *engine_try(const blade_model *m, const engine_shape *sh, blade_error *err)
{
    blade_engine_config cfg;
    blade_engine_config_default(&cfg);
    cfg.n_threads = sh->threads;
    blade_kv_store_config sc = blade_model_kv_config(&m->hp, cfg.kv_type, cfg.block_size, 0);
    cfg.kv_mem_bytes = (size_t)sh->kv_blocks * blade_kv_store_block_bytes(&sc);
    cfg.sched.max_batch_tokens = sh->budget;
    cfg.sched.max_seqs = 16;
    cfg.sched.contiguous_kv = sh->contiguous;
    cfg.check_invariants = true;
    cfg.spec.mode = sh->mode;
    cfg.spec.k = sh->k;
    cfg.spec.ngram_min = 1;
    cfg.spec.ngram_max = 4;
    cfg.spec.draft_model_path = sh->draft;
    cfg.spec.self_layers = sh->self_type ? m->hp.n_layer : 4;
    cfg.spec.self_type = sh->self_type ? (uint32_t)blade_type_from_name(sh->self_type) : BLADE_SPEC_SELF_OWN;
    cfg.spec.draft_lookup = !sh->no_lookup;
    /* every k is tried as given; the policy has tests of its own */
    cfg.spec.adaptive = false;
    /* the draft has the target's shape here */
    cfg.spec.draft_kv_mem_bytes = (size_t)sh->draft_kv_blocks * blade_kv_store_block_bytes(&sc);
    return blade_engine_new(m, &cfg, err);
}

static blade_engine *engine_new(const blade_model *m, int32_t kv_blocks, int32_t budget, int32_t threads,
                                blade_spec_mode mode, int32_t k)
{
    engine_shape sh = {kv_blocks, budget, threads, mode, k, NULL, 0, false, NULL, false};
    blade_error err = {{0}};
    blade_engine *e = engine_try(m, &sh, &err);
    if (!e)
        fail_msg("%s", err.msg);
    return e;
}

/* stories260K-draft converted to GGUF once per test run */
static const char *draft_path(void)
{
    static char *path;
    if (path)
        return path;
    char *bin = require_shared("models/stories260K-draft.bin");
    char *tok = require_shared("models/tok512.bin");
    char *out = temp_path("spec-draft.gguf");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "convert '%s' --tokenizer '%s' -o '%s'", bin, tok, out);
    char *log = NULL;
    if (run_blade(cmd, &log, 1) != 0)
        fail_msg("blade %s failed: %s", cmd, log ? log : "");
    free(log);
    free(bin);
    free(tok);
    path = out;
    return path;
}

static uint64_t submit(blade_engine *e, const job *j, result *r)
{
    blade_request q;
    blade_request_default(&q);
    q.prompt_tokens = j->prompt;
    q.n_prompt_tokens = j->n_prompt;
    q.max_tokens = j->max_tokens;
    q.sampling.temperature = j->temperature;
    q.sampling.seed = 42;
    q.speculative = j->speculative;
    q.stop = j->stop;
    q.n_stop = j->n_stop;
    q.logprobs = 3;
    q.want_logits = true;
    q.callback = test_record_event;
    q.user = r;
    blade_error err = {{0}};
    uint64_t id = blade_engine_submit(e, &q, &err);
    if (!id)
        fail_msg("%s", err.msg);
    return id;
}

static void assert_same(const result *a, const result *b, int i, const char *what)
{
    if (a->n != b->n || memcmp(a->tokens, b->tokens, (size_t)a->n * sizeof(int32_t)) != 0)
        fail_msg("%s: request %d generated different tokens (%d vs %d)", what, i, a->n, b->n);
    if (memcmp(a->logits, b->logits, (size_t)a->n * a->n_vocab * sizeof(float)) != 0)
        fail_msg("%s: request %d saw different logits", what, i);
    if (memcmp(a->logprob, b->logprob, (size_t)a->n * sizeof(float)) != 0 ||
        memcmp(a->top_ids, b->top_ids, (size_t)a->n * sizeof a->top_ids[0]) != 0 ||
        memcmp(a->top_lp, b->top_lp, (size_t)a->n * sizeof a->top_lp[0]) != 0)
        fail_msg("%s: request %d reported different logprobs", what, i);
    if (a->finish != b->finish || strcmp(a->text, b->text) != 0)
        fail_msg("%s: request %d finished differently (%s / %s)", what, i, a->text, b->text);
}

static void assert_clean(blade_engine *e, const char *what)
{
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    if (st.invariant_error[0])
        fail_msg("%s: %s", what, st.invariant_error);
    assert_true(st.invariant_checks > 0);
    assert_int_equal(st.kv_blocks_used, 0);
    assert_int_equal(st.kv_blocks_free + st.kv_blocks_cached, st.kv_blocks_total);
    /* every finished sequence gave its draft KV back */
    assert_int_equal(st.draft_kv_blocks_used, 0);
}

/* Prompts cut from the story corpus at line starts (stories repeat their names and
 * phrases, so prompt lookup finds drafts, some right, some wrong), one long enough to be
 * prefilled in several chunks while others decode. */
static job *make_jobs(const blade_model *m)
{
    size_t len;
    char *text = read_shared("eval/stories-corpus.txt", &len);
    job *jobs = calloc(N_PROMPTS, sizeof *jobs);
    const char *p = text;
    for (int i = 0; i < N_PROMPTS; i++) {
        int32_t want = i == 3 ? 400 : 20 + 17 * i;
        int32_t *toks = NULL;
        size_t n = 0;
        blade_error err = {{0}};
        size_t take = strlen(p) < 4000 ? strlen(p) : 4000;
        if (blade_tokenizer_encode(m->tokenizer, p, take, true, false, &toks, &n, &err))
            fail_msg("%s", err.msg);
        jobs[i].n_prompt = (int32_t)(n < (size_t)want ? n : (size_t)want);
        memcpy(jobs[i].prompt, toks, (size_t)jobs[i].n_prompt * sizeof *toks);
        free(toks);
        jobs[i].max_tokens = 24 + 4 * i;
        jobs[i].speculative = true;
        /* two opt out, two sample: they share the steps without speculating */
        jobs[i].speculative = i != 4 && i != 7;
        jobs[i].temperature = i == 5 || i == 8 ? 0.9f : 0.0f;
        const char *next = strstr(p + 1, "\n\n");
        p = next ? next + 2 : text;
    }
    free(text);
    return jobs;
}

static void run_all(blade_engine *e, const job *jobs, int n, result *out, int32_t n_vocab, bool one_by_one);

/* The reference: each job alone in an engine without speculation. */
static void run_plain(const blade_model *m, const job *jobs, int n, result *out)
{
    blade_engine *plain = engine_new(m, 512, 256, 2, BLADE_SPEC_NONE, 4);
    run_all(plain, jobs, n, out, m->hp.n_vocab, true);
    blade_engine_free(plain, true);
}

static void free_results(result *r, int n)
{
    for (int i = 0; i < n; i++)
        test_record_free(&r[i]);
}

static void run_all(blade_engine *e, const job *jobs, int n, result *out, int32_t n_vocab, bool one_by_one)
{
    for (int i = 0; i < n; i++) {
        result_init(&out[i], n_vocab);
        submit(e, &jobs[i], &out[i]);
        if (one_by_one)
            blade_engine_wait_idle(e);
    }
    blade_engine_wait_idle(e);
    for (int i = 0; i < n; i++)
        assert_true(out[i].done);
}

/* Runs the jobs through each engine shape and compares every greedy request with plain
 * decoding; the sampled ones only have to finish. */
static void check_bit_identical(const engine_shape *shapes, size_t n_shapes)
{
    blade_model *m = load_stories();
    int32_t nv = m->hp.n_vocab;
    job *jobs = make_jobs(m);

    result ref[N_PROMPTS];
    run_plain(m, jobs, N_PROMPTS, ref);

    for (size_t c = 0; c < n_shapes; c++) {
        const engine_shape *sh = &shapes[c];
        blade_error err = {{0}};
        blade_engine *e = engine_try(m, sh, &err);
        if (!e)
            fail_msg("%s", err.msg);
        result got[N_PROMPTS];
        run_all(e, jobs, N_PROMPTS, got, nv, false);
        char what[128];
        snprintf(what, sizeof what, "%s k %d, budget %d, %d blocks, %d threads%s%s%s%s%s",
                 blade_spec_mode_name(sh->mode), sh->k, sh->budget, sh->kv_blocks, sh->threads,
                 sh->draft_kv_blocks ? ", small draft KV" : "", sh->contiguous ? ", contiguous KV" : "",
                 sh->self_type ? ", a copy in " : "", sh->self_type ? sh->self_type : "",
                 sh->no_lookup ? ", no lookup" : "");
        for (int i = 0; i < N_PROMPTS; i++) {
            if (jobs[i].temperature == 0)
                assert_same(&ref[i], &got[i], i, what);
            else
                assert_int_equal(got[i].n, jobs[i].max_tokens);
            test_record_free(&got[i]);
        }
        blade_engine_stats st;
        blade_engine_stats_get(e, &st);
        print_message("%s: %llu steps, %llu verifies, %llu/%llu drafts accepted, %llu preemptions\n", what,
                      (unsigned long long)st.steps, (unsigned long long)st.spec_verifies,
                      (unsigned long long)st.spec_accepted_tokens, (unsigned long long)st.spec_draft_tokens,
                      (unsigned long long)st.preemptions);
        /* drafts were both accepted and rejected, so both paths ran */
        assert_true(st.spec_accepted_tokens > 0);
        assert_true(st.spec_accepted_tokens < st.spec_draft_tokens);
        if (sh->kv_blocks < 100)
            assert_true(st.preemptions > 0);
        uint64_t accepted = 0, drafted = 0, verifies = 0;
        for (int j = 0; j <= BLADE_SPEC_MAX_K; j++) {
            accepted += st.spec_accept_hist[j] * (uint64_t)j;
            drafted += st.spec_draft_hist[j] * (uint64_t)j;
            verifies += st.spec_draft_hist[j];
        }
        assert_int_equal(accepted, st.spec_accepted_tokens);
        assert_int_equal(drafted, st.spec_draft_tokens);
        assert_int_equal(verifies, st.spec_verifies);
        assert_int_equal(st.spec_draft_hist[0], 0);
        assert_clean(e, what);
        blade_engine_free(e, true);
    }
    free_results(ref, N_PROMPTS);
    free(jobs);
    blade_model_free(m);
}

/* budgets of 9 and 24 trim drafts and chunk the long prompt; 40 blocks of 16 tokens cannot
 * hold every sequence at once, so the scheduler preempts sequences with drafts */
static void test_ngram_bit_identical(void **state)
{
    (void)state;
    static const engine_shape shapes[] = {
        {256, 256, 2, BLADE_SPEC_NGRAM, 1, NULL, 0, false, NULL, false}, {256, 24, 1, BLADE_SPEC_NGRAM, 3, NULL, 0, false, NULL, false},
        {256, 9, 3, BLADE_SPEC_NGRAM, 4, NULL, 0, false, NULL, false},   {40, 64, 2, BLADE_SPEC_NGRAM, 8, NULL, 0, false, NULL, false},
        {256, 256, 2, BLADE_SPEC_NGRAM, 16, NULL, 0, false, NULL, false},
        {256, 64, 2, BLADE_SPEC_NGRAM, 4, NULL, 0, true, NULL, false},
    };
    check_bit_identical(shapes, sizeof shapes / sizeof shapes[0]);
}

/* The same with the draft model, prompt lookup beside it (the default) and without; the
 * fifth shape's draft KV (12 blocks) holds only a few sequences, so the others go without
 * drafts and get them back as blocks free up. */
static void test_draft_model_bit_identical(void **state)
{
    (void)state;
    const char *d = draft_path();
    engine_shape shapes[] = {
        {256, 256, 2, BLADE_SPEC_DRAFT, 1, d, 0, false, NULL, false},
        {256, 24, 1, BLADE_SPEC_DRAFT, 3, d, 0, false, NULL, false},
        {256, 9, 3, BLADE_SPEC_DRAFT, 5, d, 0, false, NULL, false},
        {40, 64, 2, BLADE_SPEC_DRAFT, 8, d, 0, false, NULL, false},
        {256, 256, 2, BLADE_SPEC_DRAFT, 4, d, 12, false, NULL, false},
        {256, 24, 2, BLADE_SPEC_DRAFT, 4, d, 0, false, NULL, true},
        {40, 9, 3, BLADE_SPEC_DRAFT, 6, d, 0, false, NULL, true},
    };
    check_bit_identical(shapes, sizeof shapes / sizeof shapes[0]);
}

/* Self-draft: the target's own first layers draft (stories260K was not trained for early
 * exit, so many drafts are rejected: both paths run), or all its layers as a copy
 * requantized at load (Q4_0 agrees with the target on about 60% of drafts, Q8_0 on 97%;
 * the FFN's rows of 172 do not split into blocks and stay the target's). */
static void test_self_draft_bit_identical(void **state)
{
    (void)state;
    static const engine_shape shapes[] = {
        {256, 256, 2, BLADE_SPEC_SELF, 4, NULL, 0, false, NULL, false},
        {40, 24, 3, BLADE_SPEC_SELF, 6, NULL, 0, false, NULL, false},
        {256, 256, 2, BLADE_SPEC_SELF, 4, NULL, 0, false, "q4_0", false},
        {40, 24, 3, BLADE_SPEC_SELF, 6, NULL, 0, false, "q8_0", false},
        {256, 9, 1, BLADE_SPEC_SELF, 3, NULL, 0, true, "q4_0", false},
        {256, 9, 2, BLADE_SPEC_SELF, 5, NULL, 0, true, NULL, false},
    };
    check_bit_identical(shapes, sizeof shapes / sizeof shapes[0]);
}

/* A draft that cannot draft for the target is refused with the reason; nothing crashes. */
/* The early-exit view drafts in the target's own KV: its drafts are what the same layers
 * make with a KV of their own, computed from scratch (exactly: the runner is chunk
 * invariant), and the target's
 * sequence gets back exactly the blocks it held. */
static void test_self_draft_shares_target_kv(void **state)
{
    (void)state;
    enum { L = 3, N = 33, K = 5, BS = 16 };
    blade_model *m = load_stories();
    blade_error err = {{0}};
    blade_threadpool *pool = blade_threadpool_new(2);
    blade_kv_store_config sc = blade_model_kv_config(&m->hp, BLADE_KV_F16, BS, 0);
    sc.n_blocks = 16;
    blade_kv_store *store = blade_kv_store_new(&sc, &err);
    blade_kv_cache_config kc = {.n_blocks = 16, .block_size = BS, .prefix_caching = true};
    blade_kv_cache *kv = blade_kv_cache_new(&kc, &err);
    blade_runner *target = blade_runner_new(m, store, pool, 64, &err);
    assert_non_null(target);
    int32_t tokens[N + K];
    for (int32_t i = 0; i < N; i++)
        tokens[i] = 1 + (i * 37 + 11) % (m->hp.n_vocab - 1);
    /* the target has computed all but the last token, as for a decode; its blocks end
     * there, so the drafts need a block more */
    blade_kv_cache_seq seq;
    blade_kv_cache_seq_init(&seq, kv, NULL, 0);
    assert_int_equal(blade_kv_cache_allocate(kv, &seq, N - 1), 0);
    blade_batch_seq b = {.tokens = tokens, .n_tokens = N - 1, .pos0 = 0, .block_table = seq.blocks,
                         .n_blocks = seq.n_blocks};
    assert_int_equal(blade_runner_forward(target, &b, 1, &err), 0);
    int32_t held = seq.n_blocks;

    spec_draft *d = spec_draft_new(NULL, L, BLADE_SPEC_SELF_OWN, m, store, kv, 0, BS, BLADE_KV_F16, pool, 64, 4, &err);
    assert_non_null(d);
    spec_draft_seq ds;
    spec_draft_seq_init(d, &ds);
    spec_draft_job job = {.seq = &ds, .target_seq = &seq, .tokens = tokens, .n_tokens = N, .k = K};
    spec_calib calib;
    spec_calib_init(&calib);
    assert_int_equal(spec_draft_propose(d, &job, 1, &calib, &err), 0);
    assert_int_equal(job.n_out, K);
    assert_int_equal(seq.n_blocks, held);
    blade_kv_cache_stats st;
    blade_kv_cache_stats_get(kv, &st);
    assert_int_equal(st.blocks_used, held);

    /* the same layers with a store of their own, from scratch: the prompt, then each draft */
    blade_model view = *m;
    view.hp.n_layer = L;
    blade_kv_store_config vc = blade_model_kv_config(&view.hp, BLADE_KV_F16, BS, 0);
    vc.n_blocks = 4;
    blade_kv_store *own = blade_kv_store_new(&vc, &err);
    blade_runner *ref = blade_runner_new(&view, own, pool, 64, &err);
    assert_non_null(ref);
    int32_t table[4] = {0, 1, 2, 3};
    float *logits = malloc(sizeof(float) * (size_t)m->hp.n_vocab);
    int32_t want[N + K];
    memcpy(want, tokens, sizeof(int32_t) * N);
    for (int32_t i = 0; i < K; i++) {
        int32_t from = i == 0 ? 0 : N + i - 1;
        blade_batch_seq r = {.tokens = want + from, .n_tokens = N + i - from, .pos0 = from, .block_table = table,
                             .n_blocks = 4, .n_logits = 1, .logits = logits};
        assert_int_equal(blade_runner_forward(ref, &r, 1, &err), 0);
        want[N + i] = blade_argmax(logits, m->hp.n_vocab);
        assert_int_equal(tokens[N + i], want[N + i]);
    }

    free(logits);
    blade_runner_free(ref);
    blade_kv_store_free(own);
    spec_draft_seq_destroy(&ds);
    spec_draft_free(d);
    blade_kv_cache_release(kv, &seq);
    blade_kv_cache_seq_destroy(&seq);
    blade_runner_free(target);
    blade_kv_cache_free(kv);
    blade_kv_store_free(store);
    blade_threadpool_free(pool);
    blade_model_free(m);
}

static void test_draft_model_refused(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    blade_error err = {{0}};
    engine_shape sh = {64, 64, 1, BLADE_SPEC_DRAFT, 4, NULL, 0, false, NULL, false};
    assert_null(engine_try(m, &sh, &err));
    assert_non_null(strstr(err.msg, "--draft-model"));

    char *missing = temp_path("no-such-draft.gguf");
    sh.draft = missing;
    assert_null(engine_try(m, &sh, &err));
    assert_non_null(strstr(err.msg, "no-such-draft.gguf"));

    /* same size, made-up token texts: the first differing token is named */
    char *other = temp_path("spec-other-vocab.gguf");
    blade_synth_spec s = {
        .arch = BLADE_ARCH_LLAMA, .n_vocab = 512, .n_embd = 64, .n_layer = 1, .n_head = 4, .n_head_kv = 2,
        .head_dim = 16, .n_ff = 128, .n_ctx = 512, .rope_base = 10000.0f, .scheme = {.type = BLADE_TYPE_F32}, .seed = 3,
    };
    if (blade_synth_write(&s, other, false, &err))
        fail_msg("%s", err.msg);
    sh.draft = other;
    assert_null(engine_try(m, &sh, &err));
    print_message("%s\n", err.msg);
    assert_non_null(strstr(err.msg, "differs from the target's at token"));

    /* another size */
    s.n_vocab = 400;
    if (blade_synth_write(&s, other, false, &err))
        fail_msg("%s", err.msg);
    assert_null(engine_try(m, &sh, &err));
    assert_non_null(strstr(err.msg, "400 tokens"));

    /* self-draft needs fewer layers than the model has */
    blade_engine_config cfg;
    blade_engine_config_default(&cfg);
    cfg.kv_mem_bytes = 1 << 20;
    cfg.spec.mode = BLADE_SPEC_SELF;
    cfg.spec.self_layers = m->hp.n_layer;
    assert_null(blade_engine_new(m, &cfg, &err));
    assert_non_null(strstr(err.msg, "--self-layers"));
    /* a lower-precision copy may draft with every layer, but not with more */
    cfg.spec.self_type = BLADE_TYPE_Q4_0;
    cfg.spec.self_layers = m->hp.n_layer + 1;
    assert_null(blade_engine_new(m, &cfg, &err));
    assert_non_null(strstr(err.msg, "--self-layers"));
    /* a type with no blocks that fit any row of this model */
    cfg.spec.self_type = BLADE_TYPE_Q4_K;
    cfg.spec.self_layers = m->hp.n_layer;
    assert_null(blade_engine_new(m, &cfg, &err));
    assert_non_null(strstr(err.msg, "no weight of the model splits into Q4_K blocks"));

    /* and the right one loads */
    sh.draft = draft_path();
    blade_engine *e = engine_try(m, &sh, &err);
    if (!e)
        fail_msg("%s", err.msg);
    blade_engine_free(e, false);
    free(missing);
    free(other);
    blade_model_free(m);
}

/* After speculative runs, the prefix cache holds their blocks; new requests whose prompts
 * are those runs' prompt + output reuse them. A block registered while holding a rejected
 * draft would hand these requests wrong KV; their logits match a fresh plain engine's. */
static void test_prefix_cache_holds_no_rejected_token(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    int32_t nv = m->hp.n_vocab;
    job *jobs = make_jobs(m);
    blade_engine *e = engine_new(m, 512, 64, 2, BLADE_SPEC_NGRAM, 6);
    result first[N_PROMPTS];
    run_all(e, jobs, N_PROMPTS, first, nv, false);

    job *again = calloc(N_PROMPTS, sizeof *again);
    for (int i = 0; i < N_PROMPTS; i++) {
        again[i] = jobs[i];
        memcpy(again[i].prompt + jobs[i].n_prompt, first[i].tokens, (size_t)first[i].n * sizeof(int32_t));
        again[i].n_prompt += first[i].n;
        again[i].max_tokens = 16;
        again[i].temperature = 0;
        again[i].speculative = true;
    }
    result got[N_PROMPTS], ref[N_PROMPTS];
    run_all(e, again, N_PROMPTS, got, nv, false);
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    assert_true(st.prefix_hit_tokens > 0);
    assert_true(st.spec_accepted_tokens > 0);
    assert_clean(e, "second round");
    blade_engine_free(e, true);

    run_plain(m, again, N_PROMPTS, ref);
    for (int i = 0; i < N_PROMPTS; i++) {
        assert_same(&ref[i], &got[i], i, "prompt + speculative output, from the prefix cache");
        test_record_free(&got[i]);
        test_record_free(&ref[i]);
        test_record_free(&first[i]);
    }
    free(again);
    free(jobs);
    blade_model_free(m);
}

/* Stop strings and max_tokens end a choice inside an accepted run: nothing after them is
 * emitted, and the text is what plain decoding gives. */
static void test_stop_inside_accepted_run(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    int32_t nv = m->hp.n_vocab;
    job *jobs = make_jobs(m);
    result ref[N_PROMPTS];
    run_plain(m, jobs, N_PROMPTS, ref);

    /* each stop string is a piece of the plain output's middle; each max_tokens is odd */
    char stops[N_PROMPTS][16];
    const char *stop_list[N_PROMPTS][1];
    job *cut = calloc(N_PROMPTS, sizeof *cut);
    for (int i = 0; i < N_PROMPTS; i++) {
        cut[i] = jobs[i];
        cut[i].temperature = 0;
        cut[i].speculative = true;
        size_t at = ref[i].text_len / 2;
        snprintf(stops[i], sizeof stops[i], "%.5s", ref[i].text + at);
        stop_list[i][0] = stops[i];
        if (i % 2) {
            cut[i].stop = stop_list[i];
            cut[i].n_stop = 1;
        } else {
            cut[i].max_tokens = 7 + i;
        }
    }
    result plain_cut[N_PROMPTS], got[N_PROMPTS];
    run_plain(m, cut, N_PROMPTS, plain_cut);
    blade_engine *e = engine_new(m, 256, 256, 2, BLADE_SPEC_NGRAM, 8);
    run_all(e, cut, N_PROMPTS, got, nv, false);
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    assert_true(st.spec_accepted_tokens > 0);
    assert_clean(e, "stops");
    blade_engine_free(e, true);
    for (int i = 0; i < N_PROMPTS; i++) {
        assert_same(&plain_cut[i], &got[i], i, "stop string / max_tokens inside a run");
        if (i % 2 == 0)
            assert_int_equal(got[i].n, cut[i].max_tokens);
        test_record_free(&got[i]);
        test_record_free(&plain_cut[i]);
        test_record_free(&ref[i]);
    }
    free(cut);
    free(jobs);
    blade_model_free(m);
}

/* ---- sampling: the rejection rule keeps the distribution ---- */

#define N_DRAWS 1500
#define DRAW_LEN 5

typedef struct draws {
    int32_t tokens[N_DRAWS][DRAW_LEN];
    int32_t n[N_DRAWS];
    int32_t done;
    pthread_mutex_t mu;
} draws;

typedef struct draw_slot {
    draws *d;
    int32_t i;
} draw_slot;

static void on_draw(const blade_token_event *ev)
{
    draw_slot *slot = ev->user;
    draws *d = slot->d;
    pthread_mutex_lock(&d->mu);
    if (ev->token >= 0 && d->n[slot->i] < DRAW_LEN)
        d->tokens[slot->i][d->n[slot->i]++] = ev->token;
    if (ev->finish != BLADE_FINISH_NONE)
        d->done++;
    pthread_mutex_unlock(&d->mu);
}

/* N_DRAWS sampled continuations of one prompt, seeds from seed0 on. */
static void sample_many(blade_engine *e, const blade_model *m, uint64_t seed0, draws *d, draw_slot *slots)
{
    memset(d->tokens, 0, sizeof d->tokens);
    memset(d->n, 0, sizeof d->n);
    d->done = 0;
    const char *prompt = "Once upon a time, there was a little";
    for (int32_t i = 0; i < N_DRAWS; i++) {
        blade_request q;
        blade_request_default(&q);
        q.prompt_text = prompt;
        q.prompt_text_len = strlen(prompt);
        q.max_tokens = DRAW_LEN;
        q.ignore_eos = true;
        /* every transform the sampler has, penalties included, so p depends on the tokens
         * accepted before it in the same verify run */
        q.sampling.temperature = 1.5f;
        q.sampling.top_k = 60;
        q.sampling.top_p = 0.97f;
        q.sampling.min_p = 0.01f;
        q.sampling.repeat_penalty = 1.3f;
        q.sampling.presence_penalty = 0.4f;
        q.sampling.frequency_penalty = 0.2f;
        q.sampling.seed = seed0 + (uint64_t)i;
        slots[i] = (draw_slot){d, i};
        q.callback = on_draw;
        q.user = &slots[i];
        blade_error err = {{0}};
        if (!blade_engine_submit(e, &q, &err))
            fail_msg("%s", err.msg);
    }
    blade_engine_wait_idle(e);
    assert_int_equal(d->done, N_DRAWS);
    (void)m;
}

/* Two-sample chi-square test of homogeneity on the token at position pos: categories with
 * fewer than 10 draws in both samples together are pooled. Returns statistic / critical
 * value at significance 0.001 (Wilson-Hilferty), so < 1 passes. */
static double chi_square_ratio(const draws *a, const draws *b, int pos, int32_t n_vocab, int *df_out)
{
    int32_t *ca = calloc((size_t)n_vocab, sizeof *ca), *cb = calloc((size_t)n_vocab, sizeof *cb);
    for (int i = 0; i < N_DRAWS; i++) {
        ca[a->tokens[i][pos]]++;
        cb[b->tokens[i][pos]]++;
    }
    double stat = 0;
    int df = -1;
    int32_t pa = 0, pb = 0;
    for (int32_t t = 0; t < n_vocab; t++) {
        if (ca[t] + cb[t] < 10) {
            pa += ca[t];
            pb += cb[t];
            continue;
        }
        stat += (double)(ca[t] - cb[t]) * (ca[t] - cb[t]) / (ca[t] + cb[t]);
        df++;
    }
    if (pa + pb >= 10) {
        stat += (double)(pa - pb) * (pa - pb) / (pa + pb);
        df++;
    }
    free(ca);
    free(cb);
    *df_out = df;
    if (df < 1)
        return 0;
    double z = 3.0902, h = 2.0 / (9.0 * df);
    double crit = df * pow(1.0 - h + z * sqrt(h), 3);
    return stat / crit;
}

/* The distribution of each of the first sampled tokens after the first (the first comes
 * from the prompt's step, the rest from verify steps) is the same with and without
 * speculation: a chi-square test per position at significance 0.001, seeded, so the
 * verdict is deterministic. The draft model proposes its greedy choice, which a sampled
 * target rejects often, so both branches of the rule run many times. */
static void test_sampled_distribution(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    draws *plain = calloc(1, sizeof *plain), *spec = calloc(1, sizeof *spec);
    pthread_mutex_init(&plain->mu, NULL);
    pthread_mutex_init(&spec->mu, NULL);
    draw_slot *slots = calloc(N_DRAWS, sizeof *slots);

    engine_shape sh = {512, 256, 2, BLADE_SPEC_NONE, 3, NULL, 0, false, NULL, false};
    blade_error err = {{0}};
    blade_engine *e = engine_try(m, &sh, &err);
    assert_non_null(e);
    sample_many(e, m, 1, plain, slots);
    blade_engine_free(e, true);

    sh.mode = BLADE_SPEC_DRAFT;
    sh.draft = draft_path();
    e = engine_try(m, &sh, &err);
    if (!e)
        fail_msg("%s", err.msg);
    sample_many(e, m, 1000001, spec, slots);
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    print_message("sampled: %llu/%llu drafts accepted in %llu verifies\n", (unsigned long long)st.spec_accepted_tokens,
                  (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_verifies);
    assert_true(st.spec_accepted_tokens > 500);
    assert_true(st.spec_draft_tokens - st.spec_accepted_tokens > 300);
    assert_clean(e, "sampled");
    blade_engine_free(e, true);

    for (int pos = 1; pos < DRAW_LEN; pos++) {
        int df;
        double r = chi_square_ratio(plain, spec, pos, m->hp.n_vocab, &df);
        print_message("token %d: chi-square / critical value (df %d, alpha 0.001) = %.3f\n", pos, df, r);
        assert_true(df >= 5);
        assert_true(r < 1.0);
    }
    /* the test tells distributions apart: a sampler that keeps a rejected draft in the
     * distribution it redraws from fails it at token 2 (checked when it was written), and
     * here the draws of token 2 pass for token 1's only if the test were blind */
    draws *shifted = calloc(1, sizeof *shifted);
    for (int i = 0; i < N_DRAWS; i++)
        shifted->tokens[i][1] = plain->tokens[i][2];
    int df;
    assert_true(chi_square_ratio(plain, shifted, 1, m->hp.n_vocab, &df) > 1.0);
    free(shifted);
    pthread_mutex_destroy(&plain->mu);
    pthread_mutex_destroy(&spec->mu);
    free(plain);
    free(spec);
    free(slots);
    blade_model_free(m);
}

/* ---- the policy ---- */

static void choose(const double *cost, int32_t n_cost, double value, int32_t tokens, double draft_cost,
                   spec_cand *c, int32_t n)
{
    spec_policy_choose(cost, n_cost, value, tokens, draft_cost, c, n);
}

static void test_policy(void **state)
{
    (void)state;
    double flat[18], linear[18], knee8[18], knee4[18];
    for (int t = 0; t < 18; t++) {
        flat[t] = 1;
        linear[t] = t;
        knee8[t] = t > 8 ? t / 8.0 : 1;
        knee4[t] = t > 4 ? t / 4.0 : 1;
    }
    spec_cand c[16];
    /* a light step: a free verify takes every draft allowed */
    c[0] = (spec_cand){.alpha = 0.8, .k_max = 4};
    choose(flat, 17, 1, 1, 0, c, 1);
    assert_int_equal(c[0].k, 4);
    choose(knee8, 17, 1, 1, 0, c, 1);
    assert_int_equal(c[0].k, 4);
    /* a verify that costs a full step per token never pays */
    choose(linear, 17, 1, 1, 0, c, 1);
    assert_int_equal(c[0].k, 0);
    /* 16 decodes already make the step compute-bound: no drafts at all (back-off) */
    for (int i = 0; i < 16; i++)
        c[i] = (spec_cand){.alpha = 0.8, .k_max = 4};
    choose(knee8, 17, 16, 16, 0, c, 16);
    for (int i = 0; i < 16; i++)
        assert_int_equal(c[i].k, 0);
    /* the room before the knee goes to the likeliest drafts */
    c[0] = (spec_cand){.alpha = 0.9, .k_max = 4};
    c[1] = (spec_cand){.alpha = 0.3, .k_max = 4};
    choose(knee4, 17, 2, 2, 0, c, 2);
    assert_int_equal(c[0].k, 2);
    assert_int_equal(c[1].k, 0);
    /* a draft model's own calls count: a 50% draft costing half a step never pays, a 90%
     * one pays for three drafts but not a fourth */
    c[0] = (spec_cand){.alpha = 0.5, .k_max = 8};
    choose(flat, 17, 1, 1, 0.5, c, 1);
    assert_int_equal(c[0].k, 0);
    c[0] = (spec_cand){.alpha = 0.9, .k_max = 8};
    choose(flat, 17, 1, 1, 0.5, c, 1);
    assert_int_equal(c[0].k, 3);
    /* a curve with a step (a third token fills a new tile): the first draft past the step
     * lowers the ratio, the ones after it are free and raise it beyond the one-draft
     * step's, so the policy takes them all */
    double stepped[6] = {0, 1, 1, 1.5, 1.5, 1.5};
    c[0] = (spec_cand){.alpha = 0.8, .k_max = 4};
    choose(stepped, 5, 1, 1, 0, c, 1);
    assert_int_equal(c[0].k, 4);
    c[0] = (spec_cand){.alpha = 0.8, .k_max = 2};
    choose(stepped, 5, 1, 1, 0, c, 1);
    assert_int_equal(c[0].k, 1);
    /* past the measured curve, the last slope goes on */
    c[0] = (spec_cand){.alpha = 0.99, .k_max = 16};
    choose(knee4, 5, 1, 1, 0, c, 1);
    assert_true(c[0].k <= 4);

    /* made drafts rated one by one: a weak second draft is not worth a new tile, four
     * sure ones are */
    double weak[2] = {0.9, 0.3}, sure[4] = {0.95, 0.9, 0.85, 0.8};
    c[0] = (spec_cand){.gain = weak, .k_max = 2};
    choose(stepped, 5, 1, 1, 0, c, 1);
    assert_int_equal(c[0].k, 1);
    c[0] = (spec_cand){.gain = sure, .k_max = 4};
    choose(stepped, 5, 1, 1, 0, c, 1);
    assert_int_equal(c[0].k, 4);
    /* and the likelier of two sequences' drafts go first */
    double poor[4] = {0.2, 0.05, 0.01, 0.001};
    c[0] = (spec_cand){.gain = poor, .k_max = 4};
    c[1] = (spec_cand){.gain = sure, .k_max = 4};
    choose(knee4, 17, 2, 2, 0, c, 2);
    assert_int_equal(c[0].k, 0);
    assert_int_equal(c[1].k, 2);

    spec_accept a;
    spec_accept_init(&a);
    assert_true(fabs(spec_accept_rate(&a) - 0.5) < 1e-12);
    spec_accept_update(&a, 4, 4);
    assert_true(fabs(spec_accept_rate(&a) - 4.9 / 5.8) < 1e-12);
    spec_accept_update(&a, 4, 0);
    assert_true(fabs(spec_accept_rate(&a) - 4.41 / 6.22) < 1e-12);
    spec_accept_update(&a, 0, 0);
    assert_true(fabs(spec_accept_rate(&a) - 4.41 / 6.22) < 1e-12);

    /* a new sequence starts where the traffic is, weighing as the prior */
    spec_accept traffic, fresh;
    spec_accept_init(&traffic);
    for (int i = 0; i < 30; i++)
        spec_accept_update(&traffic, 2, 0);
    spec_accept_start(&fresh, &traffic);
    assert_true(fabs(spec_accept_rate(&fresh) - spec_accept_rate(&traffic)) < 1e-12);
    assert_true(spec_accept_rate(&fresh) < 0.05);
    assert_true(fabs(fresh.trials - 2) < 1e-12);
    assert_int_equal(fresh.idle, 0);

    /* a sequence left without drafts tries again once the steps it sat out pay for the
     * try at SPEC_PROBE_SHARE: one token more (0.05) and a call of 0.2 of a step */
    double gentle[6] = {0, 1, 1.05, 1.1, 1.15, 1.2};
    int32_t wait = (int32_t)ceil(0.25 / SPEC_PROBE_SHARE - 1e-9);
    assert_false(spec_policy_probe(gentle, 5, 1, 0.2, wait - 1));
    assert_true(spec_policy_probe(gentle, 5, 1, 0.2, wait));
    /* never where a draft at the prior's rate would not pay: a compute-bound step, or a
     * call dearer than the token it may save */
    assert_false(spec_policy_probe(linear, 17, 16, 0, 1000000));
    assert_false(spec_policy_probe(gentle, 5, 1, 0.5, 1000000));
}

/* splitmix64, as a uniform number in [0, 1) */
static double uniform01(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}

/* Drafting goes on only while some longer run could be verified: where it stops, the
 * policy given any further drafts (each no likelier than the last made) keeps none of them. */
static void test_policy_draft_more(void **state)
{
    (void)state;
    double flat[6] = {0, 1, 1, 1, 1, 1}, q4[6] = {0, 1, 1.05, 1.12, 1.35, 1.55};
    double strong[2] = {0.9, 0.75}, weak[2] = {0.9, 0.4};
    spec_step_econ e = {q4, 5, 1, 1, 0};
    /* before the first draft, and while a free verify awaits */
    assert_true(spec_policy_draft_more(&e, strong, 0, 4));
    spec_step_econ free_verify = {flat, 5, 1, 1, 0};
    assert_true(spec_policy_draft_more(&free_verify, weak, 2, 4));
    /* a third draft kept at 0.75 would raise 2.65 / 1.12 to 3.4 / 1.35; at 0.4 nothing
     * beats 2.3 / 1.12 */
    assert_true(spec_policy_draft_more(&e, strong, 2, 4));
    assert_false(spec_policy_draft_more(&e, weak, 2, 4));
    /* nor once its call costs a fifth of a step */
    e.draft_cost = 0.2;
    assert_false(spec_policy_draft_more(&e, strong, 2, 4));
    /* never past k_max */
    assert_false(spec_policy_draft_more(&free_verify, strong, 2, 2));

    /* the promise, on random curves and ratings */
    uint64_t seed = 12345;
    for (int trial = 0; trial < 20000; trial++) {
        double cost[10] = {0, 1}, gain[8];
        for (int t = 2; t < 10; t++)
            cost[t] = cost[t - 1] + 0.4 * uniform01(&seed) * uniform01(&seed);
        int32_t k_max = 1 + (int32_t)(uniform01(&seed) * 8), base = 1 + (int32_t)(uniform01(&seed) * 3);
        double alive = 1;
        for (int32_t d = 0; d < k_max; d++)
            gain[d] = alive *= uniform01(&seed);
        spec_step_econ s = {cost, 9, base, base, 0};
        for (int32_t n = 1; n < k_max; n++) {
            if (spec_policy_draft_more(&s, gain, n, k_max))
                continue;
            spec_cand c = {.gain = gain, .k_max = k_max};
            spec_policy_choose(cost, 9, base, base, 0, &c, 1);
            assert_true(c.k <= n);
            break;
        }
    }
}

/* The calibration starts from its priors and follows what verification shows, band by
 * band; confidences outside [0, 1) land in the end bands. */
static void test_calibration(void **state)
{
    (void)state;
    spec_calib c;
    spec_calib_init(&c);
    assert_true(fabs(spec_calib_rate(&c, SPEC_FROM_MODEL, 0.25f) - 0.25) < 1e-12);
    assert_true(fabs(spec_calib_rate(&c, SPEC_FROM_LOOKUP, 0.25f) - 0.5) < 1e-12);
    assert_true(spec_calib_rate(&c, SPEC_FROM_BOTH, 0.25f) > spec_calib_rate(&c, SPEC_FROM_MODEL, 0.25f));
    assert_int_equal(spec_calib_band(1.0f), SPEC_CONF_BANDS - 1);
    assert_int_equal(spec_calib_band(-0.5f), 0);
    assert_int_equal(spec_calib_band(NAN), 0);
    assert_int_equal(spec_calib_band(1e30f), SPEC_CONF_BANDS - 1);
    assert_int_equal(spec_calib_band(0.999f), SPEC_CONF_BANDS - 1);
    assert_int_equal(spec_calib_band(0.35f), 3);
    /* drafts of 0.2-0.3 kept every time: their band climbs past lookup's prior, the band
     * next to it does not move */
    for (int i = 0; i < 50; i++)
        spec_calib_update(&c, SPEC_FROM_MODEL, 0.22f, true);
    assert_true(spec_calib_rate(&c, SPEC_FROM_MODEL, 0.29f) > 0.9);
    assert_true(fabs(spec_calib_rate(&c, SPEC_FROM_MODEL, 0.35f) - 0.35) < 1e-12);
    for (int i = 0; i < 500; i++)
        spec_calib_update(&c, SPEC_FROM_MODEL, 0.22f, false);
    assert_true(spec_calib_rate(&c, SPEC_FROM_MODEL, 0.22f) < 0.01);
}

/* The live curve: a step of T tokens costs max(memory time, its busy time). */
static void test_live_curve(void **state)
{
    (void)state;
    double measured[6] = {0, 1, 1.02, 1.1, 1.3, 1.5};
    spec_curve c;
    spec_curve_init(&c, measured, 5, 10);
    for (int t = 1; t <= 5; t++)
        assert_true(fabs(c.cost[t] - measured[t]) < 1e-12);
    /* memory slows to 16 ms a token: one-token steps show it, and the curve flattens */
    for (int i = 0; i < 20; i++)
        spec_curve_observe(&c, 1, 16);
    assert_true(fabs(c.mem_ms - 16) < 0.01);
    for (int t = 2; t <= 5; t++)
        assert_true(fabs(c.cost[t] - 1) < 1e-12);
    /* a five-token step far slower than its busy time also tells the memory time */
    for (int i = 0; i < 20; i++)
        spec_curve_observe(&c, 5, 20);
    assert_true(fabs(c.mem_ms - 20) < 0.01);
    assert_true(fabs(c.busy_ms[5] - 15) < 1e-12);
    /* memory fast again, five-token steps compute-bound at 13.5 ms */
    for (int i = 0; i < 20; i++) {
        spec_curve_observe(&c, 1, 9);
        spec_curve_observe(&c, 5, 13.5);
    }
    assert_true(fabs(c.cost[5] - 1.5) < 0.01);
    assert_true(c.cost[4] <= c.cost[5] && c.cost[3] <= c.cost[4]);
    /* lone slow steps (the host pausing the process) among them are not the memory time */
    double mem = c.mem_ms;
    for (int i = 0; i < 40; i++) {
        spec_curve_observe(&c, 5, i % 3 == 2 ? 30 : 13.5);
        spec_curve_observe(&c, 1, 9);
    }
    assert_true(fabs(c.mem_ms - mem) < 0.01);
    assert_true(fabs(c.cost[5] - 1.5) < 0.01);
    /* a slow spell of five-token steps, then memory fast again with no one-token step at all:
     * three-token steps faster than the spell's memory time bring it down */
    for (int i = 0; i < 20; i++)
        spec_curve_observe(&c, 5, 20);
    assert_true(c.mem_ms > 19.9 && c.cost[5] < 1.01);
    for (int i = 0; i < 40; i++)
        spec_curve_observe(&c, 3, 9.5);
    assert_true(c.mem_ms < 9.51);
    assert_true(fabs(c.busy_ms[5] - 13.5) < 0.01);
    assert_true(fabs(c.cost[5] - 13.5 / c.mem_ms) < 0.01);
    /* sizes beyond the curve and nonsense times change nothing */
    spec_curve before = c;
    spec_curve_observe(&c, 6, 1);
    spec_curve_observe(&c, 0, 1);
    spec_curve_observe(&c, 2, NAN);
    spec_curve_observe(&c, 2, -1);
    assert_memory_equal(&before, &c, sizeof c);
}

/* A size the curve overrates and the policy therefore never runs drifts down to the size
 * below it once stale, and its next step measures it afresh, cheap or dear; sizes that
 * keep running keep their times. */
static void test_live_curve_stale(void **state)
{
    (void)state;
    double measured[6] = {0, 1, 1.02, 1.1, 2.0, 2.2};
    spec_curve c;
    spec_curve_init(&c, measured, 5, 10);
    const double ms[4] = {10, 10.2, 11, 10.5};
    for (int i = 0; i < SPEC_CURVE_STALE; i++)
        spec_curve_observe(&c, 1 + i % 3, ms[i % 3]);
    assert_true(fabs(c.cost[4] - 2.0) < 1e-12); /* not stale yet */
    for (int i = 0; i < 60; i++)
        spec_curve_observe(&c, 1 + i % 3, ms[i % 3]);
    assert_true(c.cost[4] < 1.11 && c.cost[5] < 1.11);
    assert_true(fabs(c.busy_ms[2] - 10.2) < 1e-9 && fabs(c.busy_ms[3] - 11) < 1e-9);
    /* four tokens turn out to cost what three do */
    spec_curve_observe(&c, 4, 10.5);
    assert_true(fabs(c.busy_ms[4] - 10.5) < 1e-9);
    assert_int_equal(c.age[4], 0);
    /* five stay dear: the first step at that size says so at once */
    spec_curve_observe(&c, 5, 22);
    assert_true(fabs(c.cost[5] - 2.2) < 1e-9);
    for (int i = 0; i < 3 * SPEC_CURVE_STALE; i++)
        spec_curve_observe(&c, 1 + i % 4, ms[i % 4]);
    for (int t = 2; t <= 4; t++)
        assert_true(fabs(c.busy_ms[t] - ms[t - 1]) < 1e-9);
    assert_true(c.cost[5] < 1.11);
}

/* The adaptive engine: with prompt lookup and a given curve, where a verify costs a step
 * per token it drafts nothing and where it is free it drafts; with the draft model, drafts
 * stop at a doubtful one and each step verifies what their ratings make worth it, with a
 * given free verify and with the curve measured at start and followed through the run.
 * The output is plain decoding's whatever the policy does. */
static void test_adaptive_engine(void **state)
{
    (void)state;
    static const struct {
        blade_spec_mode mode;
        double verify_per_token; /* given curve: cost[T] = 1 + this * (T - 1); < 0: measured */
        const char *what;
    } runs[] = {
        {BLADE_SPEC_NGRAM, 1, "n-gram, dear verify"},
        {BLADE_SPEC_NGRAM, 0, "n-gram, free verify"},
        {BLADE_SPEC_DRAFT, 0, "draft model, free verify"},
        {BLADE_SPEC_DRAFT, -1, "draft model, measured curve"},
    };
    blade_model *m = load_stories();
    int32_t nv = m->hp.n_vocab;
    job *jobs = make_jobs(m);
    result ref[N_PROMPTS];
    run_plain(m, jobs, N_PROMPTS, ref);
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        blade_engine_config cfg;
        blade_engine_config_default(&cfg);
        cfg.n_threads = 2;
        cfg.kv_mem_bytes = 8 << 20;
        cfg.check_invariants = true;
        cfg.spec.mode = runs[r].mode;
        cfg.spec.ngram_min = 1;
        cfg.spec.k = 6;
        if (runs[r].mode == BLADE_SPEC_DRAFT)
            cfg.spec.draft_model_path = draft_path();
        for (int t = 1; t <= cfg.spec.k + 1 && runs[r].verify_per_token >= 0; t++)
            cfg.spec.verify_cost[t] = 1 + runs[r].verify_per_token * (t - 1);
        /* the draft has the target's size here: with a given curve, as if it were as cheap as
         * a real one */
        if (runs[r].mode == BLADE_SPEC_DRAFT && runs[r].verify_per_token >= 0)
            cfg.spec.draft_cost = 0.02;
        blade_error err = {{0}};
        blade_engine *e = blade_engine_new(m, &cfg, &err);
        if (!e)
            fail_msg("%s", err.msg);
        result got[N_PROMPTS];
        run_all(e, jobs, N_PROMPTS, got, nv, false);
        for (int i = 0; i < N_PROMPTS; i++) {
            if (jobs[i].temperature == 0)
                assert_same(&ref[i], &got[i], i, runs[r].what);
            test_record_free(&got[i]);
        }
        blade_engine_stats st;
        blade_engine_stats_get(e, &st);
        print_message("adaptive, %s: %llu drafts, %llu accepted\n", runs[r].what,
                      (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted_tokens);
        if (runs[r].verify_per_token == 1) {
            assert_int_equal(st.spec_draft_tokens, 0);
        } else if (runs[r].verify_per_token == 0) {
            assert_true(st.spec_accepted_tokens > 0);
            assert_true(st.spec_accepted_tokens < st.spec_draft_tokens);
        }
        assert_clean(e, runs[r].what);
        blade_engine_free(e, true);
    }
    free_results(ref, N_PROMPTS);
    free(jobs);
    blade_model_free(m);
}

/* A drafter that does not pay is seldom called: stories260K's first layer alone drafts for
 * it (rarely agreeing), each call costing a quarter of a step against a cheap verify. Calls
 * whose drafts are all too doubtful to verify count against the request, new requests start
 * from what earlier ones saw, and idle requests only try now and then; the output is plain
 * decoding's. The run is deterministic (a given curve and draft cost): 7 calls for 420
 * tokens, against 26 without the first two rules. */
static void test_useless_drafter_seldom_called(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    job *jobs = make_jobs(m);
    result ref[N_PROMPTS], got[N_PROMPTS];
    run_plain(m, jobs, N_PROMPTS, ref);
    blade_engine_config cfg;
    blade_engine_config_default(&cfg);
    cfg.n_threads = 2;
    cfg.kv_mem_bytes = 8 << 20;
    cfg.check_invariants = true;
    cfg.spec.mode = BLADE_SPEC_SELF;
    cfg.spec.self_layers = 1;
    cfg.spec.k = 4;
    for (int t = 1; t <= cfg.spec.k + 1; t++)
        cfg.spec.verify_cost[t] = 1 + 0.05 * (t - 1);
    cfg.spec.draft_cost = 0.25;
    blade_error err = {{0}};
    blade_engine *e = blade_engine_new(m, &cfg, &err);
    if (!e)
        fail_msg("%s", err.msg);
    /* one request after another, as the traffic prior assumes */
    run_all(e, jobs, N_PROMPTS, got, m->hp.n_vocab, true);
    for (int i = 0; i < N_PROMPTS; i++) {
        if (jobs[i].temperature == 0)
            assert_same(&ref[i], &got[i], i, "self-draft from one layer");
        test_record_free(&got[i]);
    }
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    print_message("one-layer self-draft: called at %llu of %llu decoded tokens, %llu drafts verified, %llu "
                  "accepted\n",
                  (unsigned long long)st.spec_draft_calls, (unsigned long long)st.generated_tokens,
                  (unsigned long long)st.spec_draft_tokens, (unsigned long long)st.spec_accepted_tokens);
    assert_true(st.spec_draft_calls > 0);
    assert_true(st.spec_draft_calls * 20 < st.generated_tokens);
    assert_clean(e, "one-layer self-draft");
    blade_engine_free(e, true);
    free_results(ref, N_PROMPTS);
    free(jobs);
    blade_model_free(m);
}

/* The steps a request decodes alone are counted by their tokens: every verify of k drafts is
 * one step of 1 + k tokens, the rest are one-token steps, each with the runner's time; and
 * drafting's time is counted. */
static void test_solo_step_stats(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    job *jobs = make_jobs(m);
    engine_shape sh = {512, 256, 2, BLADE_SPEC_DRAFT, 4, draft_path(), 0, false, NULL, false};
    blade_error err = {{0}};
    blade_engine *e = engine_try(m, &sh, &err);
    if (!e)
        fail_msg("%s", err.msg);
    result got[N_PROMPTS];
    run_all(e, jobs, N_PROMPTS, got, m->hp.n_vocab, true);
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    uint64_t multi = 0;
    for (int t = 2; t <= BLADE_SPEC_MAX_K + 1; t++) {
        assert_int_equal(st.solo_decode_steps[t], st.spec_draft_hist[t - 1]);
        multi += st.solo_decode_steps[t];
    }
    assert_int_equal(multi, st.spec_verifies);
    assert_true(st.spec_verifies > 0);
    assert_true(st.solo_decode_steps[1] > 0);
    for (int t = 1; t <= BLADE_SPEC_MAX_K + 1; t++)
        assert_int_equal(st.solo_decode_seconds[t] > 0, st.solo_decode_steps[t] > 0);
    assert_true(st.spec_draft_seconds > 0);
    print_message("solo steps: %llu of one token, %llu verifies\n", (unsigned long long)st.solo_decode_steps[1],
                  (unsigned long long)multi);
    blade_engine_free(e, true);
    free_results(got, N_PROMPTS);
    free(jobs);
    blade_model_free(m);
}

/* Aborts requests while the draft model speculates for them: a third right after they are
 * submitted (most are still in prefill), a third once they have three tokens. */
typedef struct abort_plan {
    blade_engine *e;
    result *got;
    const uint64_t *ids;
    bool refused; /* an abort the engine did not know; cmocka's asserts belong on the test's thread */
} abort_plan;

static void *abort_after_three(void *arg)
{
    abort_plan *p = arg;
    bool sent[N_PROMPTS] = {false};
    for (int left = 1, rounds = 0; left && rounds < 200000; rounds++) {
        left = 0;
        for (int i = 1; i < N_PROMPTS; i += 3) {
            pthread_mutex_lock(&p->got[i].mu);
            int32_t n = p->got[i].n;
            bool done = p->got[i].done;
            pthread_mutex_unlock(&p->got[i].mu);
            if (!sent[i] && !done && n >= 3) {
                p->refused |= !blade_engine_abort(p->e, p->ids[i]);
                sent[i] = true;
            }
            left += !sent[i] && !done;
        }
        usleep(100);
    }
    return NULL;
}

/* An aborted request gives back its blocks in both KV caches, drafts included, and emits
 * nothing plain decoding would not have; the requests left alone stay bit-identical. */
static void test_abort_while_speculating(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    int32_t nv = m->hp.n_vocab;
    job *jobs = make_jobs(m);
    result ref[N_PROMPTS], got[N_PROMPTS];
    run_plain(m, jobs, N_PROMPTS, ref);
    /* 40 blocks of 16 tokens cannot hold every sequence: some are preempted with drafts */
    engine_shape sh = {40, 24, 2, BLADE_SPEC_DRAFT, 4, draft_path(), 0, false, NULL, false};
    blade_error err = {{0}};
    blade_engine *e = engine_try(m, &sh, &err);
    if (!e)
        fail_msg("%s", err.msg);
    /* stories260K-draft was trained on 512 positions, the model on 2048 */
    assert_int_equal(blade_engine_draft_context(e), 512);
    assert_int_equal(blade_engine_max_context(e), 2048);
    uint64_t ids[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++)
        result_init(&got[i], nv);
    abort_plan plan = {e, got, ids, false};
    pthread_t watcher;
    for (int i = 0; i < N_PROMPTS; i++) {
        ids[i] = submit(e, &jobs[i], &got[i]);
        if (i % 3 == 2)
            assert_true(blade_engine_abort(e, ids[i]));
        if (i == 0)
            assert_int_equal(pthread_create(&watcher, NULL, abort_after_three, &plan), 0);
    }
    pthread_join(watcher, NULL);
    assert_false(plan.refused);
    blade_engine_wait_idle(e);
    int aborted = 0;
    for (int i = 0; i < N_PROMPTS; i++) {
        assert_true(got[i].done);
        if (i % 3 == 0) {
            if (jobs[i].temperature == 0)
                assert_same(&ref[i], &got[i], i, "left alone beside aborts");
            continue;
        }
        aborted += got[i].finish == BLADE_FINISH_ABORT;
        if (jobs[i].temperature != 0)
            continue;
        /* what an aborted greedy request emitted is the start of its plain output */
        assert_true(got[i].n <= ref[i].n);
        assert_memory_equal(got[i].tokens, ref[i].tokens, (size_t)got[i].n * sizeof(int32_t));
        assert_memory_equal(got[i].logits, ref[i].logits, (size_t)got[i].n * nv * sizeof(float));
    }
    assert_true(aborted >= 3);
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    print_message("aborts: %d of %d requests aborted, %llu verifies, %llu preemptions\n", aborted, N_PROMPTS,
                  (unsigned long long)st.spec_verifies, (unsigned long long)st.preemptions);
    assert_true(st.spec_verifies > 0);
    assert_clean(e, "aborts");
    blade_engine_free(e, true);
    for (int i = 0; i < N_PROMPTS; i++) {
        test_record_free(&got[i]);
        test_record_free(&ref[i]);
    }
    free(jobs);
    blade_model_free(m);
}

static void test_rejects_bad_config(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    blade_engine_config cfg;
    blade_engine_config_default(&cfg);
    cfg.kv_mem_bytes = 1 << 20;
    blade_error err = {{0}};
    cfg.spec.mode = BLADE_SPEC_NGRAM;
    cfg.spec.k = 0;
    assert_null(blade_engine_new(m, &cfg, &err));
    assert_non_null(strstr(err.msg, "spec-k"));
    cfg.spec.k = BLADE_SPEC_MAX_K + 1;
    assert_null(blade_engine_new(m, &cfg, &err));
    cfg.spec.k = 4;
    cfg.spec.ngram_min = 3;
    cfg.spec.ngram_max = 2;
    assert_null(blade_engine_new(m, &cfg, &err));
    assert_non_null(strstr(err.msg, "ngram"));
    cfg.spec.ngram_max = 4;
    cfg.spec.draft_cost = NAN;
    assert_null(blade_engine_new(m, &cfg, &err));
    assert_non_null(strstr(err.msg, "draft cost"));
    cfg.spec.draft_cost = -1;
    assert_null(blade_engine_new(m, &cfg, &err));
    assert_int_equal(blade_spec_mode_parse("ngram"), BLADE_SPEC_NGRAM);
    assert_int_equal(blade_spec_mode_parse("self"), BLADE_SPEC_SELF);
    assert_int_equal(blade_spec_mode_parse("draft"), BLADE_SPEC_DRAFT);
    assert_int_equal(blade_spec_mode_parse("none"), BLADE_SPEC_NONE);
    assert_int_equal(blade_spec_mode_parse("bogus"), -1);
    blade_model_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ngram_propose),
        cmocka_unit_test(test_kv_truncate),
        cmocka_unit_test(test_ngram_bit_identical),
        cmocka_unit_test(test_draft_model_bit_identical),
        cmocka_unit_test(test_self_draft_bit_identical),
        cmocka_unit_test(test_self_draft_shares_target_kv),
        cmocka_unit_test(test_draft_model_refused),
        cmocka_unit_test(test_sampled_distribution),
        cmocka_unit_test(test_policy),
        cmocka_unit_test(test_policy_draft_more),
        cmocka_unit_test(test_calibration),
        cmocka_unit_test(test_live_curve),
        cmocka_unit_test(test_live_curve_stale),
        cmocka_unit_test(test_adaptive_engine),
        cmocka_unit_test(test_useless_drafter_seldom_called),
        cmocka_unit_test(test_solo_step_stats),
        cmocka_unit_test(test_prefix_cache_holds_no_rejected_token),
        cmocka_unit_test(test_stop_inside_accepted_run),
        cmocka_unit_test(test_abort_while_speculating),
        cmocka_unit_test(test_rejects_bad_config),
    };
    /* BLADE_TEST_FILTER=pattern runs only the matching tests (while developing) */
    if (getenv("BLADE_TEST_FILTER"))
        cmocka_set_test_filter(getenv("BLADE_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}

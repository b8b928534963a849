/* The serving engine end to end: invariance under continuous batching, chunking and
 * preemption; block accounting after every step; prefix reuse counted in computed tokens;
 * cache-salt isolation; abort; stop strings. */
#include "testutil.h"

#include "blade/engine.h"
#include "blade/model.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N_REQ 32
#define MAX_GEN 40

/* Each request's events, as the engine delivered them. */
typedef test_record result;

static void result_init(result *r, int32_t n_vocab)
{
    test_record_init(r, MAX_GEN + 1, n_vocab);
}

typedef struct spec {
    int32_t prompt[1100];
    int32_t n_prompt;
    int32_t max_tokens;
    float temperature;
    uint64_t seed;
    const char *salt;
    bool ignore_eos;
} spec;

static char *small_model(void)
{
    return synth_small_model("engine-model.gguf", 5);
}

static blade_engine *engine_of_type(const blade_model *m, size_t kv_blocks, int32_t budget, int32_t max_seqs,
                                    blade_sched_mode mode, blade_kv_type kv_type)
{
    blade_engine_config cfg;
    blade_engine_config_default(&cfg);
    cfg.sched.mode = mode;
    cfg.kv_type = kv_type;
    cfg.n_threads = 2;
    blade_kv_store_config store_cfg = blade_model_kv_config(&m->hp, cfg.kv_type, cfg.block_size, 0);
    cfg.kv_mem_bytes = kv_blocks * blade_kv_store_block_bytes(&store_cfg);
    cfg.sched.max_batch_tokens = budget;
    cfg.sched.max_seqs = max_seqs;
    cfg.check_invariants = true;
    blade_error err = {{0}};
    blade_engine *e = blade_engine_new(m, &cfg, &err);
    if (!e)
        fail_msg("%s", err.msg);
    return e;
}

static blade_engine *engine_in_mode(const blade_model *m, size_t kv_blocks, int32_t budget, int32_t max_seqs,
                                    blade_sched_mode mode)
{
    return engine_of_type(m, kv_blocks, budget, max_seqs, mode, BLADE_KV_F16);
}

static blade_engine *engine_with(const blade_model *m, size_t kv_blocks, int32_t budget, int32_t max_seqs)
{
    return engine_in_mode(m, kv_blocks, budget, max_seqs, BLADE_SCHED_CONTINUOUS);
}

static uint64_t submit(blade_engine *e, const spec *s, result *r, bool logits)
{
    blade_request q;
    blade_request_default(&q);
    q.prompt_tokens = s->prompt;
    q.n_prompt_tokens = s->n_prompt;
    q.max_tokens = s->max_tokens;
    q.sampling.temperature = s->temperature;
    q.sampling.seed = s->seed;
    q.cache_salt = s->salt;
    q.ignore_eos = s->ignore_eos;
    q.want_logits = logits;
    q.callback = test_record_event;
    q.user = r;
    blade_error err = {{0}};
    uint64_t id = blade_engine_submit(e, &q, &err);
    if (!id)
        fail_msg("%s", err.msg);
    return id;
}

static uint64_t rng = 777;
static uint32_t rnd(void)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 33);
}

static void make_specs(spec *specs, int n)
{
    int32_t shared[3][150];
    for (int g = 0; g < 3; g++)
        for (int i = 0; i < 150; i++)
            shared[g][i] = 3 + (int32_t)(rnd() % 390);
    for (int i = 0; i < n; i++) {
        spec *s = &specs[i];
        memset(s, 0, sizeof *s);
        s->n_prompt = 1 + (int32_t)(rnd() % 200);
        int group = (int)(rnd() % 4);
        int32_t shared_len = group < 3 ? 40 + (int32_t)(rnd() % 110) : 0;
        for (int32_t t = 0; t < s->n_prompt; t++)
            s->prompt[t] = t < shared_len ? shared[group][t] : 3 + (int32_t)(rnd() % 390);
        s->max_tokens = 1 + (int32_t)(rnd() % MAX_GEN);
        s->temperature = rnd() % 2 ? 0.0f : 0.9f;
        s->seed = rnd();
    }
}

static void assert_same(const result *a, const result *b, int i, const char *what)
{
    if (a->n != b->n || memcmp(a->tokens, b->tokens, (size_t)a->n * sizeof(int32_t)) != 0)
        fail_msg("%s: request %d generated different tokens (%d vs %d)", what, i, a->n, b->n);
    if (memcmp(a->logits, b->logits, (size_t)a->n * a->n_vocab * sizeof(float)) != 0)
        fail_msg("%s: request %d saw different logits", what, i);
    if (a->finish != b->finish)
        fail_msg("%s: request %d finished differently", what, i);
}

static void assert_clean(blade_engine *e, const char *what)
{
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    if (st.invariant_error[0])
        fail_msg("%s: %s", what, st.invariant_error);
    assert_true(st.invariant_checks > 0);
    /* every block is free or cached once nothing runs */
    assert_int_equal(st.kv_blocks_used, 0);
    assert_int_equal(st.kv_blocks_free + st.kv_blocks_cached, st.kv_blocks_total);
}

/* 32 requests with random prompt lengths, shared and unshared prefixes, greedy and seeded
 * sampling, arriving at random moments into engines with small token budgets and KV pools
 * small enough to force preemption: every request's tokens and logits are bit-identical
 * to the same request run alone, with each KV type. */
static void check_invariance_under_load(blade_kv_type kv_type)
{
    char *path = small_model();
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    assert_non_null(m);
    int32_t nv = m->hp.n_vocab;
    spec *specs = malloc(N_REQ * sizeof *specs);
    make_specs(specs, N_REQ);

    result *alone = malloc(N_REQ * sizeof *alone);
    blade_engine *solo = engine_of_type(m, 512, 512, 8, BLADE_SCHED_CONTINUOUS, kv_type);
    for (int i = 0; i < N_REQ; i++) {
        result_init(&alone[i], nv);
        submit(solo, &specs[i], &alone[i], true);
        blade_engine_wait_idle(solo);
        assert_true(alone[i].done);
    }
    blade_engine_free(solo, true);

    /* The last one batches statically: finished members keep their seats (and blocks)
     * until the batch ends, under the same small pool. */
    static const struct {
        size_t blocks;
        int32_t budget, max_seqs;
        blade_sched_mode mode;
    } configs[] = {{40, 64, 8, BLADE_SCHED_CONTINUOUS},
                   {24, 7, 16, BLADE_SCHED_CONTINUOUS},
                   {64, 33, 32, BLADE_SCHED_CONTINUOUS},
                   {40, 64, 8, BLADE_SCHED_STATIC}};
    for (size_t c = 0; c < sizeof configs / sizeof configs[0]; c++) {
        blade_engine *e = engine_of_type(m, configs[c].blocks, configs[c].budget, configs[c].max_seqs,
                                         configs[c].mode, kv_type);
        result *got = malloc(N_REQ * sizeof *got);
        for (int i = 0; i < N_REQ; i++) {
            result_init(&got[i], nv);
            submit(e, &specs[i], &got[i], true);
            /* the first and the static engine get a burst, so their small pools must
             * preempt; the others see requests arriving while earlier ones run */
            if (c > 0 && configs[c].mode != BLADE_SCHED_STATIC && rnd() % 2)
                usleep(rnd() % 3000);
        }
        blade_engine_wait_idle(e);
        char what[64];
        snprintf(what, sizeof what, "%s KV, %zu blocks, budget %d%s", blade_kv_type_name(kv_type), configs[c].blocks,
                 configs[c].budget, configs[c].mode == BLADE_SCHED_STATIC ? ", static" : "");
        for (int i = 0; i < N_REQ; i++) {
            assert_true(got[i].done);
            assert_same(&alone[i], &got[i], i, what);
            test_record_free(&got[i]);
        }
        blade_engine_stats st;
        blade_engine_stats_get(e, &st);
        print_message("%s: %llu steps, %llu preemptions, max %d running, prefix hit rate %.2f\n", what,
                      (unsigned long long)st.steps, (unsigned long long)st.preemptions, st.max_running,
                      st.prefix_hit_rate);
        if (c == 0 || configs[c].mode == BLADE_SCHED_STATIC)
            assert_true(st.preemptions > 0);
        assert_true(st.prefix_hit_tokens > 0);
        assert_clean(e, what);
        blade_engine_free(e, true);
        free(got);
    }
    for (int i = 0; i < N_REQ; i++)
        test_record_free(&alone[i]);
    free(alone);
    free(specs);
    blade_model_free(m);
    free(path);
}

static void test_invariance_under_load(void **state)
{
    (void)state;
    check_invariance_under_load(BLADE_KV_F16);
}

static void test_invariance_under_load_q8_0(void **state)
{
    (void)state;
    check_invariance_under_load(BLADE_KV_Q8_0);
}

static void test_invariance_under_load_fp8(void **state)
{
    (void)state;
    check_invariance_under_load(BLADE_KV_FP8);
}

static uint64_t computed(blade_engine *e)
{
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    return st.computed_tokens;
}

/* Static batching is a fixed-shape batch: a member that finishes is answered at once, but
 * its seat keeps computing until the longest member ends, and requests arriving meanwhile
 * wait for the next batch. Counted in computed tokens, not timed. */
static void test_static_batch_pads_finished_seats(void **state)
{
    (void)state;
    char *path = small_model();
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    assert_non_null(m);
    spec *specs = calloc(3, sizeof *specs);
    const int32_t max_tokens[3] = {300, 3, 10};
    for (int i = 0; i < 3; i++) {
        specs[i].n_prompt = 20;
        for (int t = 0; t < 20; t++)
            specs[i].prompt[t] = 3 + (int32_t)(rnd() % 390);
        specs[i].max_tokens = max_tokens[i];
        specs[i].ignore_eos = true;
    }
    result alone[3], got[3];
    blade_engine *solo = engine_with(m, 512, 512, 8);
    for (int i = 1; i < 3; i++) {
        result_init(&alone[i], m->hp.n_vocab);
        submit(solo, &specs[i], &alone[i], true);
        blade_engine_wait_idle(solo);
    }
    blade_engine_free(solo, true);

    blade_engine *e = engine_in_mode(m, 512, 512, 8, BLADE_SCHED_STATIC);
    for (int i = 0; i < 3; i++) {
        result_init(&got[i], m->hp.n_vocab);
        submit(e, &specs[i], &got[i], true);
        /* the long first request makes a batch of its own; the two others arrive while it
         * runs and form the next one together */
        for (int spin = 0; i == 0 && spin < 10000; spin++) {
            pthread_mutex_lock(&got[0].mu);
            int n = got[0].n;
            pthread_mutex_unlock(&got[0].mu);
            if (n >= 1)
                break;
            usleep(100);
        }
    }
    blade_engine_wait_idle(e);
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    for (int i = 0; i < 3; i++) {
        assert_true(got[i].done);
        assert_int_equal(got[i].n, max_tokens[i] < MAX_GEN + 1 ? max_tokens[i] : MAX_GEN + 1);
    }
    for (int i = 1; i < 3; i++)
        assert_same(&alone[i], &got[i], i, "static batch");
    /* prompts, then one token per decode step per seat: the 3-token request's seat runs for
     * all 9 decode steps of its 10-token partner */
    assert_int_equal(st.computed_tokens, (20 + 299) + (40 + 2 * 9));
    assert_int_equal(st.generated_tokens, 300 + 3 + 10);
    assert_int_equal(st.requests_finished, 3);
    assert_clean(e, "static batch");
    blade_engine_free(e, true);
    for (int i = 0; i < 3; i++) {
        if (i)
            test_record_free(&alone[i]);
        test_record_free(&got[i]);
    }
    free(specs);
    blade_model_free(m);
    free(path);
}

/* A request sharing 960 of its 1000 prompt tokens with a finished one computes only the
 * last 40; a different cache salt shares nothing. */
static void test_prefix_reuse_and_salt(void **state)
{
    (void)state;
    char *path = small_model();
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    assert_non_null(m);
    blade_engine *e = engine_with(m, 256, 256, 8);
    spec *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    a->n_prompt = b->n_prompt = 1000;
    for (int i = 0; i < 1000; i++)
        a->prompt[i] = b->prompt[i] = 3 + (int32_t)(rnd() % 390);
    for (int i = 960; i < 1000; i++)
        b->prompt[i] = 3 + (a->prompt[i] + 1) % 390;
    a->max_tokens = b->max_tokens = 1;
    result ra, rb, rc;
    result_init(&ra, m->hp.n_vocab);
    result_init(&rb, m->hp.n_vocab);
    result_init(&rc, m->hp.n_vocab);
    submit(e, a, &ra, false);
    blade_engine_wait_idle(e);
    assert_int_equal(computed(e), 1000);
    submit(e, b, &rb, false);
    blade_engine_wait_idle(e);
    assert_int_equal(rb.cached, 960);
    assert_int_equal(computed(e), 1000 + 40);

    b->salt = "tenant-b";
    submit(e, b, &rc, false);
    blade_engine_wait_idle(e);
    assert_int_equal(rc.cached, 0);
    assert_int_equal(computed(e), 1000 + 40 + 1000);
    assert_clean(e, "prefix reuse");
    test_record_free(&ra);
    test_record_free(&rb);
    test_record_free(&rc);
    free(a);
    free(b);
    blade_engine_free(e, true);
    blade_model_free(m);
    free(path);
}

static void on_choice(const blade_token_event *ev)
{
    result *choices = ev->user;
    blade_token_event copy = *ev;
    copy.user = &choices[ev->choice];
    test_record_event(&copy);
}

/* n = 3 choices: the later ones start from the first one's cached prompt blocks and
 * sample with their own seeds. */
static void test_choices_share_prompt(void **state)
{
    (void)state;
    char *path = small_model();
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    blade_engine *e = engine_with(m, 64, 64, 8);
    int32_t prompt[100];
    for (int i = 0; i < 100; i++)
        prompt[i] = 3 + (i * 13) % 390;
    result choices[3];
    for (int i = 0; i < 3; i++)
        result_init(&choices[i], m->hp.n_vocab);
    blade_request q;
    blade_request_default(&q);
    q.prompt_tokens = prompt;
    q.n_prompt_tokens = 100;
    q.max_tokens = 5;
    q.ignore_eos = true;
    q.n = 3;
    q.sampling.temperature = 1.0f;
    q.sampling.top_k = 0;
    q.sampling.top_p = 1.0f;
    q.sampling.min_p = 0.0f;
    q.sampling.seed = 11;
    q.callback = on_choice;
    q.user = choices;
    assert_true(blade_engine_submit(e, &q, &err) > 0);
    blade_engine_wait_idle(e);
    for (int i = 0; i < 3; i++) {
        assert_true(choices[i].done);
        assert_int_equal(choices[i].n, 5);
        assert_int_equal(choices[i].cached, i == 0 ? 0 : 96);
    }
    /* prompt once, the 4-token tail twice more, 4 decode steps per choice */
    assert_int_equal(computed(e), 100 + 4 + 4 + 3 * 4);
    assert_true(memcmp(choices[0].tokens, choices[1].tokens, (size_t)choices[0].n * sizeof *choices[0].tokens) != 0 ||
                memcmp(choices[1].tokens, choices[2].tokens, (size_t)choices[0].n * sizeof *choices[0].tokens) != 0);
    assert_clean(e, "choices");
    for (int i = 0; i < 3; i++)
        test_record_free(&choices[i]);
    blade_engine_free(e, true);
    blade_model_free(m);
    free(path);
}

/* Abort frees a request's blocks at once; a full pool still completes every request. */
static void test_abort_frees_blocks(void **state)
{
    (void)state;
    char *path = small_model();
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    blade_engine *e = engine_with(m, 64, 64, 8);
    spec *s = calloc(1, sizeof *s);
    s->n_prompt = 300;
    for (int i = 0; i < 300; i++)
        s->prompt[i] = 3 + i % 300;
    s->max_tokens = 100000;
    s->ignore_eos = true;
    result r;
    result_init(&r, m->hp.n_vocab);
    uint64_t id = submit(e, s, &r, false);
    for (int spin = 0; spin < 10000; spin++) {
        pthread_mutex_lock(&r.mu);
        int n = r.n;
        pthread_mutex_unlock(&r.mu);
        if (n >= 3)
            break;
        usleep(1000);
    }
    assert_true(blade_engine_abort(e, id));
    blade_engine_wait_idle(e);
    assert_true(r.done);
    assert_int_equal(r.finish, BLADE_FINISH_ABORT);
    assert_clean(e, "abort");
    assert_false(blade_engine_abort(e, 999999));
    test_record_free(&r);
    free(s);
    blade_engine_free(e, true);
    blade_model_free(m);
    free(path);
}

static void test_rejects_bad_requests(void **state)
{
    (void)state;
    char *path = small_model();
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    blade_engine *e = engine_with(m, 64, 64, 8);
    blade_request q;
    blade_request_default(&q);
    int32_t toks[2] = {5, 400};
    q.prompt_tokens = toks;
    q.n_prompt_tokens = 2;
    q.callback = test_record_event;
    assert_int_equal(blade_engine_submit(e, &q, &err), 0);
    assert_non_null(strstr(err.msg, "outside the vocabulary"));
    toks[1] = 6;
    q.max_tokens = 0;
    assert_int_equal(blade_engine_submit(e, &q, &err), 0);
    assert_non_null(strstr(err.msg, "max_tokens"));
    q.max_tokens = 4;
    q.n_prompt_tokens = 0;
    assert_int_equal(blade_engine_submit(e, &q, &err), 0);
    assert_non_null(strstr(err.msg, "empty"));
    blade_engine_free(e, true);
    blade_model_free(m);
    free(path);
}

/* Stop strings match across token boundaries and are never emitted. */
static void test_stop_strings_real_model(void **state)
{
    (void)state;
    char *path = require_shared("models/stories260K.gguf");
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    blade_engine *e = engine_with(m, 64, 64, 8);
    const char *stops[] = {"l named Li", "never appears"};
    result r;
    result_init(&r, m->hp.n_vocab);
    blade_request q;
    blade_request_default(&q);
    q.prompt_text = "Once upon a time";
    q.prompt_text_len = strlen(q.prompt_text);
    q.sampling.temperature = 0;
    q.max_tokens = 100;
    q.stop = stops;
    q.n_stop = 2;
    q.callback = test_record_event;
    q.user = &r;
    assert_true(blade_engine_submit(e, &q, &err) > 0);
    blade_engine_wait_idle(e);
    assert_int_equal(r.finish, BLADE_FINISH_STOP);
    assert_string_equal(r.text, ", there was a little gir");

    result r2;
    result_init(&r2, m->hp.n_vocab);
    q.user = &r2;
    q.n_stop = 0;
    q.max_tokens = 12;
    assert_true(blade_engine_submit(e, &q, &err) > 0);
    blade_engine_wait_idle(e);
    assert_int_equal(r2.finish, BLADE_FINISH_LENGTH);
    assert_int_equal(r2.n, 12);
    assert_string_equal(r2.text, ", there was a little girl named Lily. She");
    test_record_free(&r);
    test_record_free(&r2);
    blade_engine_free(e, true);
    blade_model_free(m);
    free(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invariance_under_load), cmocka_unit_test(test_invariance_under_load_q8_0),
        cmocka_unit_test(test_invariance_under_load_fp8), cmocka_unit_test(test_prefix_reuse_and_salt),
        cmocka_unit_test(test_abort_frees_blocks),    cmocka_unit_test(test_static_batch_pads_finished_seats),    cmocka_unit_test(test_rejects_bad_requests),
        cmocka_unit_test(test_stop_strings_real_model), cmocka_unit_test(test_choices_share_prompt),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

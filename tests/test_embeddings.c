/* Embedding requests in the engine: prefill-only sequences whose pooled final hidden state
 * is the answer. A batch of them, chunked and preempted under a small budget and mixed with
 * generations, gives every vector bit-identical to the same input embedded alone; mean
 * pooling ignores the prefix cache and last pooling uses it without changing a bit; vectors
 * are unit length; bad embedding requests are refused. */
#include "testutil.h"

#include "blade/engine.h"
#include "blade/gguf.h"
#include "blade/model.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_INPUTS 12
#define MAX_DIM 64

typedef struct vec_result {
    pthread_mutex_t mu;
    float v[MAX_DIM];
    int32_t n;
    int32_t events;
    int32_t prompt_tokens, completion_tokens, cached_tokens;
    blade_finish_reason finish;
    int32_t tokens[64];
    int32_t n_tokens;
} vec_result;

static void on_event(const blade_token_event *ev)
{
    vec_result *r = ev->user;
    pthread_mutex_lock(&r->mu);
    if (ev->token >= 0 && r->n_tokens < 64)
        r->tokens[r->n_tokens++] = ev->token;
    if (ev->finish != BLADE_FINISH_NONE) {
        r->events++;
        r->finish = ev->finish;
        r->prompt_tokens = ev->prompt_tokens;
        r->completion_tokens = ev->completion_tokens;
        r->cached_tokens = ev->cached_tokens;
        if (ev->embedding && ev->n_embedding <= MAX_DIM) {
            memcpy(r->v, ev->embedding, (size_t)ev->n_embedding * sizeof(float));
            r->n = ev->n_embedding;
        }
    }
    pthread_mutex_unlock(&r->mu);
}

static char *small_model(void)
{
    return synth_small_model("embed-model.gguf", 11);
}

static blade_engine *engine_with(const blade_model *m, int32_t kv_blocks, int32_t budget, int32_t max_seqs,
                                 bool prefix_caching)
{
    blade_engine_config cfg;
    blade_engine_config_default(&cfg);
    cfg.n_threads = 2;
    blade_kv_store_config sc = blade_model_kv_config(&m->hp, cfg.kv_type, cfg.block_size, 0);
    cfg.kv_mem_bytes = (size_t)kv_blocks * blade_kv_store_block_bytes(&sc);
    cfg.sched.max_batch_tokens = budget;
    cfg.sched.max_seqs = max_seqs;
    cfg.prefix_caching = prefix_caching;
    cfg.check_invariants = true;
    blade_error err = {{0}};
    blade_engine *e = blade_engine_new(m, &cfg, &err);
    if (!e)
        fail_msg("%s", err.msg);
    return e;
}

typedef struct input {
    int32_t tokens[300];
    int32_t n;
} input;

static void make_inputs(input *in, int n)
{
    uint64_t x = 99;
    int32_t shared[120];
    for (int i = 0; i < 120; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        shared[i] = 3 + (int32_t)((x >> 33) % 390);
    }
    for (int i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        in[i].n = 1 + (int32_t)((x >> 33) % 290);
        int32_t common = i % 3 == 0 ? (in[i].n < 120 ? in[i].n : 120) : 0; /* a third share a prefix */
        for (int32_t t = 0; t < in[i].n; t++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            in[i].tokens[t] = t < common ? shared[t] : 3 + (int32_t)((x >> 33) % 390);
        }
    }
}

static uint64_t submit_embed(blade_engine *e, const input *in, blade_pooling pooling, vec_result *r)
{
    blade_request q;
    blade_request_default(&q);
    q.prompt_tokens = in->tokens;
    q.n_prompt_tokens = in->n;
    q.embed = pooling;
    q.callback = on_event;
    q.user = r;
    blade_error err = {{0}};
    uint64_t id = blade_engine_submit(e, &q, &err);
    if (!id)
        fail_msg("%s", err.msg);
    return id;
}

static void submit_generate(blade_engine *e, const input *in, vec_result *r)
{
    blade_request q;
    blade_request_default(&q);
    q.prompt_tokens = in->tokens;
    q.n_prompt_tokens = in->n;
    q.max_tokens = 20;
    q.ignore_eos = true;
    q.sampling.temperature = 0;
    q.callback = on_event;
    q.user = r;
    blade_error err = {{0}};
    if (!blade_engine_submit(e, &q, &err))
        fail_msg("%s", err.msg);
}

static void results_init(vec_result *r, int n)
{
    memset(r, 0, (size_t)n * sizeof *r);
    for (int i = 0; i < n; i++)
        pthread_mutex_init(&r[i].mu, NULL);
}

static void assert_clean(blade_engine *e)
{
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    if (st.invariant_error[0])
        fail_msg("%s", st.invariant_error);
    assert_int_equal(st.kv_blocks_used, 0);
}

/* One by one in a roomy engine, then all at once (and among generations) in an engine whose
 * 64-token budget chunks every long input and whose small pool preempts. */
static void check_batch_equals_alone(blade_pooling pooling)
{
    char *path = small_model();
    blade_model *m = load_model(path);
    static input in[N_INPUTS];
    make_inputs(in, N_INPUTS);
    static vec_result alone[N_INPUTS], batch[N_INPUTS], gen_alone[N_INPUTS], gen_batch[N_INPUTS];
    results_init(alone, N_INPUTS);
    results_init(batch, N_INPUTS);
    results_init(gen_alone, N_INPUTS);
    results_init(gen_batch, N_INPUTS);

    blade_engine *e = engine_with(m, 256, 2048, 16, true);
    for (int i = 0; i < N_INPUTS; i++) {
        submit_embed(e, &in[i], pooling, &alone[i]);
        blade_engine_wait_idle(e);
        submit_generate(e, &in[i], &gen_alone[i]);
        blade_engine_wait_idle(e);
    }
    assert_clean(e);
    blade_engine_free(e, true);

    e = engine_with(m, 40, 64, 8, true);
    for (int i = 0; i < N_INPUTS; i++) {
        submit_embed(e, &in[i], pooling, &batch[i]);
        submit_generate(e, &in[i], &gen_batch[i]);
    }
    blade_engine_wait_idle(e);
    assert_clean(e);
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    blade_engine_free(e, true);
    assert_true(st.preemptions > 0); /* the pool is small enough to preempt */

    for (int i = 0; i < N_INPUTS; i++) {
        assert_int_equal(alone[i].events, 1);
        assert_int_equal(batch[i].events, 1);
        assert_int_equal(alone[i].finish, BLADE_FINISH_STOP);
        assert_int_equal(alone[i].n, m->hp.n_embd);
        assert_int_equal(batch[i].n, m->hp.n_embd);
        assert_int_equal(alone[i].prompt_tokens, in[i].n);
        assert_int_equal(alone[i].completion_tokens, 0);
        assert_int_equal(alone[i].n_tokens, 0);
        if (memcmp(alone[i].v, batch[i].v, sizeof alone[i].v))
            fail_msg("%s pooling: input %d (%d tokens) embedded differently in a batch", blade_pooling_name(pooling),
                     i, in[i].n);
        double norm = 0;
        for (int k = 0; k < alone[i].n; k++)
            norm += (double)alone[i].v[k] * alone[i].v[k];
        assert_true(fabs(norm - 1.0) < 1e-5);
        /* the generations beside them are untouched */
        assert_int_equal(gen_alone[i].n_tokens, gen_batch[i].n_tokens);
        assert_memory_equal(gen_alone[i].tokens, gen_batch[i].tokens, (size_t)gen_alone[i].n_tokens * sizeof(int32_t));
    }
    for (int i = 1; i < N_INPUTS; i++)
        assert_true(memcmp(alone[0].v, alone[i].v, sizeof alone[0].v) != 0);
    blade_model_free(m);
    remove(path);
    free(path);
}

static void test_batch_equals_alone_mean(void **state)
{
    (void)state;
    check_batch_equals_alone(BLADE_POOL_MEAN);
}

static void test_batch_equals_alone_last(void **state)
{
    (void)state;
    check_batch_equals_alone(BLADE_POOL_LAST);
}

/* The same input after a generation has cached its prompt: mean pooling computes every
 * token anyway (nothing taken from the cache), last pooling takes the cached prefix; both
 * give the same bits as in an engine without a prefix cache. */
static void test_prefix_cache(void **state)
{
    (void)state;
    char *path = small_model();
    blade_model *m = load_model(path);
    static input in[1];
    make_inputs(in, 1);
    in[0].n = 200;
    for (int32_t t = 0; t < in[0].n; t++)
        in[0].tokens[t] = 3 + (t * 37) % 390;
    blade_pooling kinds[2] = {BLADE_POOL_MEAN, BLADE_POOL_LAST};
    for (int k = 0; k < 2; k++) {
        vec_result cold, gen, warm;
        results_init(&cold, 1);
        results_init(&gen, 1);
        results_init(&warm, 1);
        blade_engine *e = engine_with(m, 64, 2048, 4, false);
        submit_embed(e, &in[0], kinds[k], &cold);
        blade_engine_wait_idle(e);
        blade_engine_free(e, true);
        e = engine_with(m, 64, 2048, 4, true);
        submit_generate(e, &in[0], &gen);
        blade_engine_wait_idle(e);
        submit_embed(e, &in[0], kinds[k], &warm);
        blade_engine_wait_idle(e);
        assert_clean(e);
        blade_engine_free(e, true);
        if (kinds[k] == BLADE_POOL_MEAN)
            assert_int_equal(warm.cached_tokens, 0);
        else
            assert_true(warm.cached_tokens >= 192);
        assert_memory_equal(cold.v, warm.v, sizeof cold.v);
    }
    blade_model_free(m);
    remove(path);
    free(path);
}

/* A model without a pooling key pools by the mean; an input as long as the context is
 * accepted (nothing is generated), one more token is not; n other than 1 is refused. */
static void test_model_pooling_and_limits(void **state)
{
    (void)state;
    char *path = small_model();
    blade_model *m = load_model(path);
    blade_engine *e = engine_with(m, 200, 2048, 4, true);
    assert_int_equal(blade_engine_pooling(e), BLADE_POOL_MEAN);
    static input in[1];
    make_inputs(in, 1);
    vec_result by_model, by_mean;
    results_init(&by_model, 1);
    results_init(&by_mean, 1);
    submit_embed(e, &in[0], BLADE_POOL_MODEL, &by_model);
    submit_embed(e, &in[0], BLADE_POOL_MEAN, &by_mean);
    blade_engine_wait_idle(e);
    assert_memory_equal(by_model.v, by_mean.v, sizeof by_mean.v);

    int32_t ctx = blade_engine_max_context(e);
    int32_t *full = malloc((size_t)(ctx + 1) * sizeof *full);
    for (int32_t i = 0; i <= ctx; i++)
        full[i] = 3 + i % 390;
    blade_request q;
    blade_request_default(&q);
    q.prompt_tokens = full;
    q.n_prompt_tokens = ctx;
    q.embed = BLADE_POOL_LAST;
    q.max_tokens = 0;
    vec_result r;
    results_init(&r, 1);
    q.callback = on_event;
    q.user = &r;
    blade_error err = {{0}};
    assert_true(blade_engine_submit(e, &q, &err) > 0);
    blade_engine_wait_idle(e);
    assert_int_equal(r.finish, BLADE_FINISH_STOP);
    assert_int_equal(r.n, m->hp.n_embd);
    q.n_prompt_tokens = ctx + 1;
    assert_int_equal(blade_engine_submit(e, &q, &err), 0);
    assert_non_null(strstr(err.msg, "context limit"));
    q.n_prompt_tokens = 10;
    q.n = 2;
    assert_int_equal(blade_engine_submit(e, &q, &err), 0);
    assert_non_null(strstr(err.msg, "one choice"));
    free(full);
    assert_clean(e);
    blade_engine_free(e, true);
    blade_model_free(m);
    remove(path);
    free(path);
}

/* The model's file with {arch}.pooling_type set to `type` (llama.cpp's numbering). */
static char *with_pooling_key(const char *src, uint32_t type)
{
    blade_error err = {{0}};
    gguf_file *f = gguf_open(src, &err);
    if (!f)
        fail_msg("%s", err.msg);
    gguf_writer *w = gguf_writer_new();
    gguf_writer_copy_kv(w, f);
    gguf_writer_remove_kv(w, "general.alignment");
    gguf_writer_set_u32(w, "llama.pooling_type", type);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, t->nbytes, &err))
            fail_msg("%s", err.msg);
    }
    char *path = temp_path("embed-pooling-key.gguf");
    if (gguf_writer_write(w, path, false, &err))
        fail_msg("%s", err.msg);
    gguf_writer_free(w);
    gguf_close(f);
    return path;
}

/* A GGUF whose pooling_type key says last (3) is pooled by the last token when a request
 * asks for the model's pooling; one that says cls (2), which means nothing for a causal
 * model, by the mean. */
static void test_gguf_pooling_key(void **state)
{
    (void)state;
    char *plain = small_model();
    static input in[1];
    make_inputs(in, 1);
    uint32_t types[2] = {3, 2};
    blade_pooling want[2] = {BLADE_POOL_LAST, BLADE_POOL_MEAN};
    for (int k = 0; k < 2; k++) {
        char *keyed = with_pooling_key(plain, types[k]);
        blade_model *m = load_model(keyed);
        blade_engine *e = engine_with(m, 200, 2048, 4, true);
        assert_int_equal(blade_engine_pooling(e), want[k]);
        vec_result by_model, explicit;
        results_init(&by_model, 1);
        results_init(&explicit, 1);
        submit_embed(e, &in[0], BLADE_POOL_MODEL, &by_model);
        submit_embed(e, &in[0], want[k], &explicit);
        blade_engine_wait_idle(e);
        assert_memory_equal(by_model.v, explicit.v, sizeof explicit.v);
        blade_engine_free(e, true);
        blade_model_free(m);
        remove(keyed);
        free(keyed);
    }
    remove(plain);
    free(plain);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_equals_alone_mean),
        cmocka_unit_test(test_batch_equals_alone_last),
        cmocka_unit_test(test_prefix_cache),
        cmocka_unit_test(test_model_pooling_and_limits),
        cmocka_unit_test(test_gguf_pooling_key),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

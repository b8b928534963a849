/* Disaggregated serving inside one process: a prompt prefilled on engine A, its KV shipped
 * through the KV wire format (and the HAVE exchange) and decoded on engine B gives exactly
 * the tokens one engine doing both gives, greedy and with seeded sampling; blocks the
 * decode side already holds do not travel; a missing block is computed again with the same
 * result; frames of another model or KV layout, and bad imports, are refused. */
#include "testutil.h"

#include "blade/engine.h"
#include "blade/disagg.h"
#include "blade/kv_handoff.h"
#include "blade/kv_transport.h"
#include "blade/model.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GEN 48

typedef struct result {
    int32_t tokens[MAX_GEN + 2];
    int32_t n;
    blade_finish_reason finish;
    int32_t cached;
    const blade_kv_export *ex; /* the engine's, valid until released */
    char error[256];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
} result;

static void on_token(const blade_token_event *ev)
{
    result *r = ev->user;
    pthread_mutex_lock(&r->mu);
    if (ev->token >= 0 && r->n < MAX_GEN + 2)
        r->tokens[r->n++] = ev->token;
    if (ev->finish != BLADE_FINISH_NONE) {
        r->finish = ev->finish;
        r->cached = ev->cached_tokens;
        r->ex = ev->kv_export;
        if (ev->error)
            snprintf(r->error, sizeof r->error, "%s", ev->error);
        r->done = true;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
}

static void result_init(result *r)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
}

static void result_wait(result *r)
{
    pthread_mutex_lock(&r->mu);
    while (!r->done)
        pthread_cond_wait(&r->cv, &r->mu);
    pthread_mutex_unlock(&r->mu);
}

static void result_free(result *r)
{
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
}

static blade_engine_config config_of(const blade_model *m, blade_kv_type type, int32_t block_size, int32_t n_blocks)
{
    blade_engine_config cfg;
    blade_engine_config_default(&cfg);
    cfg.n_threads = 2;
    cfg.kv_type = type;
    cfg.block_size = block_size;
    blade_kv_store_config sc = blade_model_kv_config(&m->hp, type, block_size, 0);
    cfg.kv_mem_bytes = (size_t)n_blocks * blade_kv_store_block_bytes(&sc);
    cfg.sched.max_batch_tokens = 64; /* chunked: a prompt takes several steps */
    cfg.check_invariants = true;
    return cfg;
}

static blade_engine *engine_new_or_fail(const blade_model *m, const blade_engine_config *cfg)
{
    blade_error err = {{0}};
    blade_engine *e = blade_engine_new(m, cfg, &err);
    if (!e)
        fail_msg("%s", err.msg);
    return e;
}

static blade_engine *engine_of(const blade_model *m, blade_kv_type type, int32_t block_size, int32_t n_blocks)
{
    blade_engine_config cfg = config_of(m, type, block_size, n_blocks);
    return engine_new_or_fail(m, &cfg);
}

/* One engine doing both, a prefill engine and a decode engine, all f16 with blocks of 16. */
typedef struct trio {
    blade_model *m;
    blade_engine *one, *a, *b;
} trio;

static trio trio_open(void)
{
    trio t = {.m = load_stories()};
    t.one = engine_of(t.m, BLADE_KV_F16, 16, 256);
    t.a = engine_of(t.m, BLADE_KV_F16, 16, 256);
    t.b = engine_of(t.m, BLADE_KV_F16, 16, 256);
    return t;
}

static void trio_close(trio *t)
{
    blade_engine_free(t->one, false);
    blade_engine_free(t->a, false);
    blade_engine_free(t->b, false);
    blade_model_free(t->m);
}

typedef struct spec {
    int32_t prompt[400];
    int32_t n_prompt;
    int32_t max_tokens;
    float temperature;
    uint64_t seed;
} spec;

static void request_of(const spec *s, result *r, blade_request *q)
{
    blade_request_default(q);
    q->prompt_tokens = s->prompt;
    q->n_prompt_tokens = s->n_prompt;
    q->max_tokens = s->max_tokens;
    q->sampling.temperature = s->temperature;
    q->sampling.seed = s->seed;
    /* penalties read the history, which must hold the first token the prefill engine chose */
    if (s->temperature > 0) {
        q->sampling.presence_penalty = 1.5f;
        q->sampling.repeat_penalty = 1.3f;
    }
    q->ignore_eos = true;
    q->callback = on_token;
    q->user = r;
}

static void run_whole(blade_engine *e, const spec *s, result *r)
{
    blade_request q;
    request_of(s, r, &q);
    blade_error err = {{0}};
    if (!blade_engine_submit(e, &q, &err))
        fail_msg("%s", err.msg);
    result_wait(r);
}

/* Prefill of s on a (result pre), exported. */
static uint64_t prefill(blade_engine *a, const spec *s, result *pre)
{
    blade_request q;
    request_of(s, pre, &q);
    q.export_kv = true;
    blade_error err = {{0}};
    uint64_t id = blade_engine_submit(a, &q, &err);
    if (!id)
        fail_msg("%s", err.msg);
    result_wait(pre);
    if (pre->finish != BLADE_FINISH_EXPORTED || !pre->ex)
        fail_msg("prefill finished with %s (%s), not exported", blade_finish_reason_name(pre->finish), pre->error);
    return id;
}

typedef struct transfer_stats {
    int32_t blocks_sent;
    int32_t blocks_total;
} transfer_stats;

/* The whole handoff: HAVE query and reply, frame, checks, staging, import on b. The
 * decode side's tokens (its first event is the imported first token) land in dec. */
static void handoff(blade_engine *a, blade_engine *b, const spec *s, result *dec, const blade_cluster_key *key,
                    transfer_stats *ts)
{
    result pre;
    result_init(&pre);
    uint64_t id = prefill(a, s, &pre);
    const blade_kv_export *ex = pre.ex;
    const uint64_t tid = 0x5eed0000u + (uint64_t)s->n_prompt;
    blade_error err = {{0}};

    /* HAVE exchange through its wire messages */
    uint8_t fp[BLADE_ENGINE_FINGERPRINT_BYTES];
    blade_engine_fingerprint(a, fp);
    uint8_t *qmsg, *rmsg;
    size_t qlen, rlen;
    if (blade_kv_wire_have_query(fp, tid, ex->hashes, ex->n_hashes, key, &qmsg, &qlen, &err))
        fail_msg("%s", err.msg);
    uint64_t got_tid;
    uint8_t(*hashes)[BLADE_HASH_BYTES] = NULL;
    int32_t n_hashes;
    uint8_t fp_b[BLADE_ENGINE_FINGERPRINT_BYTES];
    blade_engine_fingerprint(b, fp_b);
    if (blade_kv_wire_have_query_parse(qmsg, qlen, fp_b, key, 4096, &got_tid, &hashes, &n_hashes, &err))
        fail_msg("%s", err.msg);
    bool *have = calloc((size_t)n_hashes + 1, sizeof *have);
    blade_kv_handoff_have(b, (const uint8_t(*)[BLADE_HASH_BYTES])hashes, n_hashes, have);
    if (blade_kv_wire_have_reply(got_tid, have, n_hashes, key, &rmsg, &rlen, &err))
        fail_msg("%s", err.msg);
    bool *have_a = calloc((size_t)ex->n_hashes + 1, sizeof *have_a);
    if (blade_kv_wire_have_reply_parse(rmsg, rlen, tid, ex->n_hashes, key, have_a, &err))
        fail_msg("%s", err.msg);

    /* the frame, flattened as a transport delivers it */
    blade_kv_wire_frame_out fo;
    if (blade_kv_handoff_encode(a, ex, tid, have_a, key, &fo, &err))
        fail_msg("%s", err.msg);
    size_t len;
    uint8_t *frame = blade_kv_wire_flatten(&fo, &len);
    assert_non_null(frame);
    if (ts) {
        ts->blocks_sent = fo.n_sent;
        ts->blocks_total = ex->n_blocks;
    }
    int32_t first = ex->first_token;
    blade_kv_wire_frame_out_free(&fo);
    assert_true(blade_engine_export_release(a, id));

    blade_kv_handoff_in in;
    if (blade_kv_handoff_receive(b, frame, len, tid, have, n_hashes, key, &in, &err))
        fail_msg("%s", err.msg);
    assert_int_equal(in.frame.n_tokens, s->n_prompt);
    assert_memory_equal(in.frame.tokens, s->prompt, (size_t)s->n_prompt * sizeof(int32_t));
    in.import.first_token = first;

    blade_request q;
    request_of(s, dec, &q);
    q.prompt_tokens = in.frame.tokens;
    q.import = &in.import;
    if (!blade_engine_submit(b, &q, &err))
        fail_msg("%s", err.msg);
    in.import.staging = NULL; /* the engine's now */
    result_wait(dec);
    blade_kv_handoff_in_free(&in);
    free(frame);
    free(have);
    free(have_a);
    free(hashes);
    free(qmsg);
    free(rmsg);
    result_free(&pre);
}

static uint64_t rng_state = 4242;
static int32_t rnd_token(const blade_model *m)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return 3 + (int32_t)((rng_state >> 33) % (uint64_t)(m->hp.n_vocab - 3));
}

static void assert_same(const result *want, const result *got, const char *what)
{
    int32_t at = 0;
    while (at < want->n && at < got->n && want->tokens[at] == got->tokens[at])
        at++;
    if (got->finish != want->finish || got->n != want->n || at != want->n)
        fail_msg("%s: %d tokens (%s) vs %d (%s) from one engine; first difference at token %d", what, got->n,
                 blade_finish_reason_name(got->finish), want->n, blade_finish_reason_name(want->finish), at);
}

static void assert_clean(blade_engine *e)
{
    blade_engine_wait_idle(e);
    blade_engine_stats st;
    blade_engine_stats_get(e, &st);
    if (st.invariant_error[0])
        fail_msg("%s", st.invariant_error);
    assert_int_equal(st.kv_blocks_used, 0);
}

static void make_spec(const blade_model *m, spec *s, int32_t n_prompt, int32_t max_tokens, float temperature,
                      uint64_t seed)
{
    memset(s, 0, sizeof *s);
    s->n_prompt = n_prompt;
    for (int32_t i = 0; i < n_prompt; i++)
        s->prompt[i] = rnd_token(m);
    s->max_tokens = max_tokens;
    s->temperature = temperature;
    s->seed = seed;
}

/* Prompts shorter than a block, exactly blocks, and with a partial last block; one token
 * to generate and many; greedy and seeded sampling (with top-k/top-p): the decode
 * engine's tokens equal one engine's, and the decode engine computed no prompt token. */
static void test_disagg_identical(void **state)
{
    (void)state;
    trio t = trio_open();
    blade_model *m = t.m;
    blade_engine *one = t.one, *a = t.a, *b = t.b;
    const int32_t lengths[] = {1, 5, 16, 33, 64, 150, 301};
    const int32_t gens[] = {1, 2, MAX_GEN};
    int k = 0;
    for (size_t li = 0; li < sizeof lengths / sizeof *lengths; li++)
        for (size_t gi = 0; gi < sizeof gens / sizeof *gens; gi++)
            for (int sampled = 0; sampled < 2; sampled++, k++) {
                spec s;
                make_spec(m, &s, lengths[li], gens[gi], sampled ? 0.9f : 0.0f, 1000 + (uint64_t)k);
                result want, got;
                result_init(&want);
                result_init(&got);
                run_whole(one, &s, &want);
                blade_engine_stats before;
                blade_engine_wait_idle(b);
                blade_engine_stats_get(b, &before);
                handoff(a, b, &s, &got, NULL, NULL);
                char what[96];
                snprintf(what, sizeof what, "prompt %d, %d new tokens, %s", s.n_prompt, s.max_tokens,
                         sampled ? "sampled" : "greedy");
                assert_same(&want, &got, what);
                blade_engine_stats after;
                blade_engine_wait_idle(b);
                blade_engine_stats_get(b, &after);
                /* only the generated tokens after the first were computed on b */
                assert_int_equal(after.computed_tokens - before.computed_tokens, (uint64_t)(s.max_tokens - 1));
                result_free(&want);
                result_free(&got);
            }
    assert_clean(a);
    assert_clean(b);
    trio_close(&t);
}

/* A decode engine that speculates (its first two layers drafting four tokens a step)
 * continues imported prompts: the early-exit view drafts from the imported KV itself, a
 * Q8_0 copy with a KV of its own catches up on the prompt the target did not compute;
 * greedy tokens equal one engine's without speculation, and every KV cache is clean
 * afterwards. */
static void speculating_decoder(trio *t, uint32_t self_type)
{
    blade_engine_config cfg = config_of(t->m, BLADE_KV_F16, 16, 256);
    cfg.spec.mode = BLADE_SPEC_SELF;
    cfg.spec.self_layers = 2;
    cfg.spec.self_type = self_type;
    cfg.spec.k = 4;
    cfg.spec.adaptive = false;
    blade_engine *c = engine_new_or_fail(t->m, &cfg);
    const int32_t lengths[] = {1, 16, 33, 150};
    for (size_t li = 0; li < sizeof lengths / sizeof *lengths; li++) {
        spec s;
        make_spec(t->m, &s, lengths[li], MAX_GEN, 0.0f, 77);
        result want, got;
        result_init(&want);
        result_init(&got);
        run_whole(t->one, &s, &want);
        handoff(t->a, c, &s, &got, NULL, NULL);
        char what[80];
        snprintf(what, sizeof what, "speculating decoder (%s), prompt %d",
                 self_type == BLADE_SPEC_SELF_OWN ? "early exit" : "Q8_0 copy", s.n_prompt);
        assert_same(&want, &got, what);
        result_free(&want);
        result_free(&got);
    }
    assert_clean(t->a);
    assert_clean(c);
    blade_engine_stats st;
    blade_engine_stats_get(c, &st);
    assert_true(st.spec_verifies > 0);
    /* the view has no KV of its own */
    if (self_type == BLADE_SPEC_SELF_OWN)
        assert_int_equal(st.draft_kv_blocks_total, 0);
    else
        assert_true(st.draft_kv_blocks_total > 0);
    assert_int_equal(st.draft_kv_blocks_used, 0);
    blade_engine_free(c, false);
}

static void test_disagg_speculating_decoder(void **state)
{
    (void)state;
    trio t = trio_open();
    speculating_decoder(&t, BLADE_SPEC_SELF_OWN);
    speculating_decoder(&t, BLADE_TYPE_Q8_0);
    trio_close(&t);
}

/* The decode side already holds a shared prefix: the HAVE reply names it, those blocks do
 * not travel, and the answer is unchanged; under a cluster key as well. */
static void test_disagg_have_exchange(void **state)
{
    (void)state;
    trio t = trio_open();
    blade_model *m = t.m;
    blade_engine *one = t.one, *a = t.a, *b = t.b;
    blade_cluster_key key = {0};
    memset(key.bytes, 0x5a, 32);
    key.len = 32;
    spec warm, s;
    make_spec(m, &warm, 200, 4, 0.0f, 1);
    s = warm;
    for (int32_t i = 96; i < 200; i++)
        s.prompt[i] = rnd_token(m); /* 6 blocks shared, the rest new */
    s.max_tokens = 20;
    s.temperature = 0.7f;
    s.seed = 99;
    result r0, want, got;
    result_init(&r0);
    result_init(&want);
    result_init(&got);
    run_whole(b, &warm, &r0);
    run_whole(one, &s, &want);
    transfer_stats ts;
    handoff(a, b, &s, &got, &key, &ts);
    assert_same(&want, &got, "with a shared prefix held by the decode side");
    assert_int_equal(ts.blocks_total, 13);
    assert_int_equal(ts.blocks_sent, 13 - 6);
    assert_int_equal(got.cached, 96);
    assert_clean(a);
    assert_clean(b);
    result_free(&r0);
    result_free(&want);
    result_free(&got);
    trio_close(&t);
}

/* Blocks that did not arrive (evicted on the decode side after its HAVE reply, or left
 * out) are computed again from the first gap: same tokens. */
static void test_disagg_gap_recomputed(void **state)
{
    (void)state;
    trio t = trio_open();
    blade_model *m = t.m;
    blade_engine *one = t.one, *a = t.a, *b = t.b;
    spec s;
    make_spec(m, &s, 100, 12, 0.8f, 7);
    result want, pre, got;
    result_init(&want);
    result_init(&pre);
    result_init(&got);
    run_whole(one, &s, &want);
    uint64_t id = prefill(a, &s, &pre);
    blade_error err = {{0}};
    blade_kv_wire_frame_out fo;
    if (blade_kv_handoff_encode(a, pre.ex, 1, NULL, NULL, &fo, &err))
        fail_msg("%s", err.msg);
    size_t len;
    uint8_t *frame = blade_kv_wire_flatten(&fo, &len);
    blade_kv_wire_frame_out_free(&fo);
    blade_kv_handoff_in in;
    if (blade_kv_handoff_receive(b, frame, len, 1, NULL, 0, NULL, &in, &err))
        fail_msg("%s", err.msg);
    in.import.first_token = pre.ex->first_token;
    assert_true(blade_engine_export_release(a, id));
    /* blocks 0..2 arrive, block 3 is missing: blocks 3.. are computed (and block 4's
     * copy is not used) */
    const int32_t sent[] = {0, 1, 2, 4};
    in.import.sent = sent;
    in.import.n_sent = 4;
    blade_request q;
    request_of(&s, &got, &q);
    q.import = &in.import;
    if (!blade_engine_submit(b, &q, &err))
        fail_msg("%s", err.msg);
    in.import.staging = NULL;
    result_wait(&got);
    assert_same(&want, &got, "a gap in the imported blocks");
    blade_engine_stats st;
    blade_engine_wait_idle(b);
    blade_engine_stats_get(b, &st);
    assert_int_equal(st.computed_tokens, (uint64_t)(100 - 48 + 1 + 10));
    blade_kv_handoff_in_free(&in);
    free(frame);
    assert_clean(a);
    assert_clean(b);
    result_free(&want);
    result_free(&pre);
    result_free(&got);
    trio_close(&t);
}

static void expect_refused(blade_engine *a, blade_engine *b, const spec *s, const char *needle)
{
    result pre;
    result_init(&pre);
    uint64_t id = prefill(a, s, &pre);
    blade_error err = {{0}};
    blade_kv_wire_frame_out fo;
    if (blade_kv_handoff_encode(a, pre.ex, 3, NULL, NULL, &fo, &err))
        fail_msg("%s", err.msg);
    size_t len;
    uint8_t *frame = blade_kv_wire_flatten(&fo, &len);
    blade_kv_wire_frame_out_free(&fo);
    blade_engine_export_release(a, id);
    blade_kv_handoff_in in;
    err.msg[0] = 0;
    assert_int_equal(blade_kv_handoff_receive(b, frame, len, 3, NULL, 0, NULL, &in, &err), -1);
    if (!strstr(err.msg, needle))
        fail_msg("refused with \"%s\", expected it to mention \"%s\"", err.msg, needle);
    free(frame);
    result_free(&pre);
}

/* Frames from an engine with another KV type or block size are refused by fingerprint;
 * a corrupted frame by its digest; imports whose first token or block list is wrong, or
 * that ask for logprobs, by submit. Nothing reaches the decode engine's store. */
static void test_disagg_refusals(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    blade_engine *a = engine_of(m, BLADE_KV_F16, 16, 64);
    blade_engine *b_q8 = engine_of(m, BLADE_KV_Q8_0, 16, 64);
    blade_engine *b_bs = engine_of(m, BLADE_KV_F16, 32, 64);
    blade_engine *b = engine_of(m, BLADE_KV_F16, 16, 64);
    uint8_t f1[32], f2[32], f3[32];
    blade_engine_fingerprint(a, f1);
    blade_engine_fingerprint(b_q8, f2);
    blade_engine_fingerprint(b_bs, f3);
    assert_memory_not_equal(f1, f2, 32);
    assert_memory_not_equal(f1, f3, 32);
    spec s;
    make_spec(m, &s, 40, 4, 0.0f, 0);
    expect_refused(a, b_q8, &s, "fingerprint");
    expect_refused(a, b_bs, &s, "fingerprint");

    result pre;
    result_init(&pre);
    uint64_t id = prefill(a, &s, &pre);
    blade_error err = {{0}};
    blade_kv_wire_frame_out fo;
    assert_int_equal(blade_kv_handoff_encode(a, pre.ex, 9, NULL, NULL, &fo, &err), 0);
    size_t len;
    uint8_t *frame = blade_kv_wire_flatten(&fo, &len);
    blade_kv_wire_frame_out_free(&fo);
    int32_t first = pre.ex->first_token;
    blade_engine_export_release(a, id);
    blade_kv_handoff_in in;
    frame[len / 2] ^= 1;
    assert_int_equal(blade_kv_handoff_receive(b, frame, len, 9, NULL, 0, NULL, &in, &err), -1);
    if (!strstr(err.msg, "digest") && !strstr(err.msg, "checksum"))
        fail_msg("a flipped payload bit refused with \"%s\"", err.msg);
    frame[len / 2] ^= 1;
    assert_int_equal(blade_kv_handoff_receive(b, frame, len - 1, 9, NULL, 0, NULL, &in, &err), -1);
    assert_int_equal(blade_kv_handoff_receive(b, frame, len, 10, NULL, 0, NULL, &in, &err), -1);
    assert_non_null(strstr(err.msg, "transfer"));
    assert_int_equal(blade_kv_handoff_receive(b, frame, len, 9, NULL, 0, NULL, &in, &err), 0);

    result got;
    result_init(&got);
    blade_request q;
    request_of(&s, &got, &q);
    q.import = &in.import;
    in.import.first_token = m->hp.n_vocab;
    assert_int_equal(blade_engine_submit(b, &q, &err), 0);
    assert_non_null(strstr(err.msg, "first token"));
    in.import.first_token = first;
    q.logprobs = 0;
    assert_int_equal(blade_engine_submit(b, &q, &err), 0);
    q.logprobs = -1;
    const int32_t bad_sent[] = {2, 1};
    const int32_t *sent = in.import.sent;
    in.import.sent = bad_sent;
    in.import.n_sent = 2;
    assert_int_equal(blade_engine_submit(b, &q, &err), 0);
    in.import.sent = sent;
    in.import.n_sent = in.frame.n_sent;
    int32_t longer[80]; /* blocks of another prompt do not line up with this one's */
    memcpy(longer, s.prompt, 40 * sizeof(int32_t));
    memcpy(longer + 40, s.prompt, 40 * sizeof(int32_t));
    q.prompt_tokens = longer;
    q.n_prompt_tokens = 80;
    assert_int_equal(blade_engine_submit(b, &q, &err), 0);
    assert_non_null(strstr(err.msg, "prompt has 80"));
    q.prompt_tokens = s.prompt;
    q.n_prompt_tokens = s.n_prompt;
    assert_true(blade_engine_submit(b, &q, &err) > 0);
    in.import.staging = NULL;
    result_wait(&got);
    assert_int_equal(got.finish, BLADE_FINISH_LENGTH);
    assert_int_equal(got.n, 4);
    blade_kv_handoff_in_free(&in);
    free(frame);
    assert_clean(a);
    assert_clean(b);
    result_free(&pre);
    result_free(&got);
    blade_engine_free(a, false);
    blade_engine_free(b_q8, false);
    blade_engine_free(b_bs, false);
    blade_engine_free(b, false);
    blade_model_free(m);
}

/* An exported prefill holds its blocks until released, and the engine frees it on
 * shutdown when the caller never does. */
static void test_disagg_export_lifetime(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    blade_engine *a = engine_of(m, BLADE_KV_F16, 16, 64);
    spec s;
    make_spec(m, &s, 70, 3, 0.0f, 0);
    result pre;
    result_init(&pre);
    uint64_t id = prefill(a, &s, &pre);
    assert_int_equal(pre.ex->n_tokens, 70);
    assert_int_equal(pre.ex->n_blocks, 5);
    assert_int_equal(pre.ex->n_hashes, 4);
    blade_engine_wait_idle(a);
    blade_engine_stats st;
    blade_engine_stats_get(a, &st);
    assert_int_equal(st.kv_blocks_used, 5);
    assert_true(blade_engine_export_release(a, id));
    assert_clean(a);
    result pre2;
    result_init(&pre2);
    prefill(a, &s, &pre2); /* never released */
    blade_engine_free(a, false);
    result_free(&pre);
    result_free(&pre2);
    blade_model_free(m);
}

/* The decode side's half of a remote prefill: run, import, decode. */
static blade_disagg_cause remote(blade_engine *b, const blade_disagg_config *cfg, uint16_t port, const spec *s,
                                 result *dec, blade_remote_prefill *rp, blade_error *err)
{
    blade_request q;
    request_of(s, dec, &q);
    blade_disagg_cause cause = blade_remote_prefill_run(b, cfg, "127.0.0.1", port, &q, rp, err);
    if (cause != BLADE_DISAGG_OK)
        return cause;
    q.import = &rp->in.import;
    if (!blade_engine_submit(b, &q, err))
        fail_msg("%s", err->msg);
    rp->in.import.staging = NULL;
    result_wait(dec);
    blade_remote_prefill_free(rp);
    return cause;
}

/* Over UCX on loopback, with and without a cluster key: the prefill service of engine A
 * serves engine B's requests; tokens equal one engine's; a second request sharing a
 * prefix sends only the blocks B lacks. A decode side with the wrong key is dropped at the
 * handshake, a missing prefill worker gives a connect failure, both within the timeout. */
static void test_disagg_over_ucx(void **state)
{
    (void)state;
    trio t = trio_open();
    blade_model *m = t.m;
    blade_engine *one = t.one, *a = t.a, *b = t.b;
    blade_cluster_key key = {0}, wrong = {0};
    memset(key.bytes, 0x33, 32);
    key.len = 32;
    memset(wrong.bytes, 0x34, 32);
    wrong.len = 32;
    for (int keyed = 0; keyed < 2; keyed++) {
        blade_disagg_config cfg = {.key = keyed ? &key : NULL, .timeout_ms = 5000, .transports = "tcp"};
        blade_error err = {{0}};
        blade_prefill_service *ps = blade_prefill_service_start(a, &cfg, "127.0.0.1", 0, &err);
        if (!ps)
            fail_msg("%s", err.msg);
        uint16_t port = blade_prefill_service_port(ps);
        for (int k = 0; k < 3; k++) {
            spec s;
            make_spec(m, &s, 90 + 40 * k, 16, k == 1 ? 0.0f : 0.8f, 50 + (uint64_t)k);
            if (k == 2)
                for (int32_t i = 0; i < 80; i++) /* five blocks b holds from k = 0 */
                    s.prompt[i] = 0;
            result want, got;
            result_init(&want);
            result_init(&got);
            run_whole(one, &s, &want);
            blade_remote_prefill rp;
            if (k == 1) {
                spec zero = s;
                for (int32_t i = 0; i < 80; i++)
                    zero.prompt[i] = 0;
                s = zero;
                result_free(&want);
                result_init(&want);
                run_whole(one, &s, &want);
            }
            blade_disagg_cause cause = remote(b, &cfg, port, &s, &got, &rp, &err);
            if (cause != BLADE_DISAGG_OK)
                fail_msg("remote prefill: %s: %s", blade_disagg_cause_name(cause), err.msg);
            assert_same(&want, &got, keyed ? "over UCX with a key" : "over UCX on loopback");
            if (k == 2)
                assert_int_equal(rp.blocks_held, 5);
            result_free(&want);
            result_free(&got);
        }
        blade_prefill_service_stats st;
        blade_prefill_service_stats_get(ps, &st);
        assert_int_equal(st.served, 3);
        assert_int_equal(st.failed, 0);
        assert_true(st.blocks_skipped >= 5);
        if (keyed) {
            blade_disagg_config bad = cfg;
            bad.key = &wrong;
            spec s;
            make_spec(m, &s, 20, 2, 0.0f, 0);
            result got;
            result_init(&got);
            blade_remote_prefill rp;
            assert_int_equal(remote(b, &bad, port, &s, &got, &rp, &err), BLADE_DISAGG_CONNECT);
            result_free(&got);
        }
        blade_prefill_service_stop(ps);
        spec s;
        make_spec(m, &s, 20, 2, 0.0f, 0);
        result got;
        result_init(&got);
        blade_remote_prefill rp;
        assert_int_equal(remote(b, &cfg, port, &s, &got, &rp, &err), BLADE_DISAGG_CONNECT);
        result_free(&got);
    }
    blade_error err = {{0}};
    blade_disagg_config open_cfg = {.timeout_ms = 1000};
    assert_null(blade_prefill_service_start(a, &open_cfg, "0.0.0.0", 0, &err));
    assert_non_null(strstr(err.msg, "key"));
    assert_clean(a);
    assert_clean(b);
    trio_close(&t);
}

/* Several decode requests at once against one prefill service (the engine batches their
 * prompts: long and short, shared blocks and not): each answer equals one engine's, each
 * prefill is served, and neither engine keeps a block. */
typedef struct concurrent_call {
    blade_engine *b;
    const blade_disagg_config *cfg;
    uint16_t port;
    spec s;
    result got;
    blade_disagg_cause cause;
    blade_error err;
} concurrent_call;

static void *concurrent_thread(void *arg)
{
    concurrent_call *k = arg;
    blade_remote_prefill rp;
    k->cause = remote(k->b, k->cfg, k->port, &k->s, &k->got, &rp, &k->err);
    return NULL;
}

static void test_disagg_concurrent_prefills(void **state)
{
    (void)state;
    enum { CALLS = 6 };
    trio t = trio_open();
    blade_disagg_config cfg = {.timeout_ms = 20000, .transports = "tcp"};
    blade_error err = {{0}};
    blade_prefill_service *ps = blade_prefill_service_start(t.a, &cfg, "127.0.0.1", 0, &err);
    if (!ps)
        fail_msg("%s", err.msg);
    concurrent_call calls[CALLS];
    result want[CALLS];
    pthread_t th[CALLS];
    for (int i = 0; i < CALLS; i++) {
        memset(&calls[i], 0, sizeof calls[i]);
        calls[i].b = t.b;
        calls[i].cfg = &cfg;
        calls[i].port = blade_prefill_service_port(ps);
        make_spec(t.m, &calls[i].s, i % 3 == 0 ? 380 : 12 + 7 * i, 12, i % 2 ? 0.7f : 0.0f, 90 + (uint64_t)i);
        if (i == 3) /* the first 256 tokens of call 0's prompt: blocks in flight elsewhere */
            memcpy(calls[i].s.prompt, calls[0].s.prompt, 256 * sizeof *calls[i].s.prompt);
        result_init(&want[i]);
        run_whole(t.one, &calls[i].s, &want[i]);
        result_init(&calls[i].got);
    }
    for (int i = 0; i < CALLS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, concurrent_thread, &calls[i]), 0);
    for (int i = 0; i < CALLS; i++) {
        pthread_join(th[i], NULL);
        if (calls[i].cause != BLADE_DISAGG_OK)
            fail_msg("call %d: %s: %s", i, blade_disagg_cause_name(calls[i].cause), calls[i].err.msg);
        assert_same(&want[i], &calls[i].got, "concurrent remote prefills");
        result_free(&want[i]);
        result_free(&calls[i].got);
    }
    blade_prefill_service_stats st;
    blade_prefill_service_stats_get(ps, &st);
    assert_int_equal(st.served, CALLS);
    assert_int_equal(st.failed, 0);
    blade_prefill_service_stop(ps);
    assert_clean(t.a);
    assert_clean(t.b);
    trio_close(&t);
}

/* A prefill peer that answers with a corrupted frame: the decode side refuses it with the
 * reason, keeps nothing, and the request computed locally gives the same tokens. */
typedef struct evil_peer {
    blade_engine *a;
    blade_kv_transport *t;
    int corrupt; /* 0: flip a payload bit, 1: wrong fingerprint (another model), 2: truncate */
} evil_peer;

static void *evil_thread(void *arg)
{
    evil_peer *ev = arg;
    blade_error err = {{0}};
    blade_kv_conn *c = blade_kv_transport_accept(ev->t, 10000, &err);
    if (!c)
        return NULL;
    void *buf;
    size_t len;
    if (blade_kv_recv(c, 1 << 20, &buf, &len, &err) == 0) {
        /* the prompt, from the PREFILL message's JSON */
        json_error_t je;
        json_t *msg = json_loadb(buf, len - 32, 0, &je);
        free(buf);
        json_t *toks = json_object_get(msg, "tokens");
        spec s = {0};
        s.n_prompt = (int32_t)json_array_size(toks);
        for (int32_t i = 0; i < s.n_prompt; i++)
            s.prompt[i] = (int32_t)json_integer_value(json_array_get(toks, (size_t)i));
        s.max_tokens = 1;
        const char *tid_text = json_string_value(json_object_get(json_object_get(msg, "sampling"), "seed"));
        (void)tid_text;
        uint64_t tid = strtoull(json_string_value(json_object_get(msg, "transfer")), NULL, 16);
        result pre;
        result_init(&pre);
        uint64_t id = prefill(ev->a, &s, &pre);
        uint8_t fp[32], *q;
        size_t ql;
        blade_engine_fingerprint(ev->a, fp);
        if (ev->corrupt == 1)
            fp[0] ^= 1;
        blade_kv_wire_have_query(fp, tid, pre.ex->hashes, pre.ex->n_hashes, NULL, &q, &ql, &err);
        blade_kv_send(c, &(struct iovec){q, ql}, 1, &err);
        free(q);
        if (blade_kv_recv(c, 1 << 20, &buf, &len, &err) == 0) {
            free(buf);
            char first[128];
            int n = snprintf(first, sizeof first, "{\"transfer\":\"%016llx\",\"first_token\":%d}",
                             (unsigned long long)tid, pre.ex->first_token);
            uint8_t mac[32];
            blade_cluster_sign(NULL, first, (size_t)n, mac);
            blade_kv_send(c, (struct iovec[]){{first, (size_t)n}, {mac, 32}}, 2, &err);
            blade_kv_wire_frame_out fo;
            blade_kv_handoff_encode(ev->a, pre.ex, tid, NULL, NULL, &fo, &err);
            size_t fl;
            uint8_t *frame = blade_kv_wire_flatten(&fo, &fl);
            frame[fl / 2] ^= 4;
            blade_kv_send(c, &(struct iovec){frame, ev->corrupt == 2 ? fl - 100 : fl}, 1, &err);
            free(frame);
            if (blade_kv_recv(c, 1 << 20, &buf, &len, &err) == 0) /* DONE, with the refusal */
                free(buf);
            blade_kv_wire_frame_out_free(&fo);
        }
        blade_engine_export_release(ev->a, id);
        result_free(&pre);
        json_decref(msg);
    }
    blade_kv_conn_close(c);
    return NULL;
}

static void test_disagg_bad_frames_refused(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    blade_engine *a = engine_of(m, BLADE_KV_F16, 16, 64);
    blade_engine *b = engine_of(m, BLADE_KV_F16, 16, 64);
    const char *expect[] = {"checksum", "fingerprint", "KV frame"};
    for (int corrupt = 0; corrupt < 3; corrupt++) {
        blade_error err = {{0}};
        blade_kv_transport_config tc = {.timeout_ms = 5000, .transports = "tcp"};
        evil_peer ev = {.a = a, .corrupt = corrupt};
        ev.t = blade_kv_transport_new(&tc, &err);
        assert_non_null(ev.t);
        assert_int_equal(blade_kv_transport_listen(ev.t, "127.0.0.1", 0, &err), 0);
        pthread_t th;
        pthread_create(&th, NULL, evil_thread, &ev);
        spec s;
        make_spec(m, &s, 50, 3, 0.0f, 0);
        result got;
        result_init(&got);
        blade_remote_prefill rp;
        blade_disagg_config cfg = {.timeout_ms = 5000, .transports = "tcp"};
        blade_disagg_cause cause = remote(b, &cfg, blade_kv_transport_port(ev.t), &s, &got, &rp, &err);
        pthread_join(th, NULL);
        blade_kv_transport_free(ev.t);
        if (cause == BLADE_DISAGG_OK || !strstr(err.msg, expect[corrupt]))
            fail_msg("corruption %d: %s: %s", corrupt, blade_disagg_cause_name(cause), err.msg);
        assert_true(cause == BLADE_DISAGG_REFUSED || (corrupt == 2 && cause == BLADE_DISAGG_PEER));
        result_free(&got);
    }
    assert_clean(a);
    assert_clean(b);
    blade_engine_free(a, false);
    blade_engine_free(b, false);
    blade_model_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_disagg_identical),
        cmocka_unit_test(test_disagg_speculating_decoder),
        cmocka_unit_test(test_disagg_have_exchange),
        cmocka_unit_test(test_disagg_gap_recomputed),
        cmocka_unit_test(test_disagg_refusals),
        cmocka_unit_test(test_disagg_export_lifetime),
        cmocka_unit_test(test_disagg_over_ucx),
        cmocka_unit_test(test_disagg_concurrent_prefills),
        cmocka_unit_test(test_disagg_bad_frames_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

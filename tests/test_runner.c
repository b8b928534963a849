/* The batched model runner: bit-for-bit batch invariance (alone vs inside batches of
 * 2..16 other sequences, whole prefill vs chunks of 1, 7 and 64, scrambled block tables,
 * 1..3 threads, every ISA, every KV type), and agreement with the reference forward pass. */
#include "testutil.h"

#include "blade/forward.h"
#include "blade/kernels.h"
#include "blade/kv_store.h"
#include "blade/model.h"
#include "blade/runner.h"
#include "blade/synth.h"
#include "blade/types.h"
#include "common/clock.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SEQ_LEN 100
#define BLOCK 16
#define N_BLOCKS 256

typedef struct rig {
    blade_model *m;
    blade_kv_store *kv;
    blade_threadpool *pool;
    blade_runner *r;
    int32_t n_vocab;
} rig;

static uint64_t rng_state = 12345;
static uint32_t rnd(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}

/* sensitive: 0, or the type of a "_M" mix's sensitive tensors (synth.h); such a model gets
 * a third layer, the first that the mix keeps at higher precision. */
static char *model_path(uint32_t type, uint32_t sensitive, blade_arch arch)
{
    char name[80];
    snprintf(name, sizeof name, "runner-%s-%s-%s.gguf", blade_type_traits_get(type)->name,
             sensitive ? blade_type_traits_get(sensitive)->name : "uniform", blade_arch_name(arch));
    char *path = temp_path(name);
    blade_synth_spec spec = {
        .arch = arch, .n_vocab = 320, .n_embd = 256, .n_layer = sensitive ? 3 : 2, .n_head = 8, .n_head_kv = 2,
        .head_dim = 32, .n_ff = 512, .n_ctx = 1024, .rope_base = 10000.0f, .tied_embeddings = false,
        .scheme = {.type = type, .classifier_type = sensitive, .sensitive_type = sensitive}, .seed = 99, .vocab_path = NULL,
    };
    blade_error err = {{0}};
    if (blade_synth_write(&spec, path, false, &err))
        fail_msg("%s", err.msg);
    return path;
}

static rig rig_of(blade_model *m, int threads, blade_kv_type kv_type)
{
    rig g;
    blade_error err = {{0}};
    g.m = m;
    blade_kv_store_config cfg = blade_model_kv_config(&g.m->hp, kv_type, BLOCK, N_BLOCKS);
    g.kv = blade_kv_store_new(&cfg, &err);
    assert_non_null(g.kv);
    g.pool = blade_threadpool_new(threads);
    g.r = blade_runner_new(g.m, g.kv, g.pool, 1024, &err);
    if (!g.r)
        fail_msg("%s", err.msg);
    g.n_vocab = g.m->hp.n_vocab;
    return g;
}

static rig rig_new(const char *path, int threads, blade_kv_type kv_type)
{
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    if (!m)
        fail_msg("%s", err.msg);
    return rig_of(m, threads, kv_type);
}

static void rig_free(rig *g)
{
    blade_runner_free(g->r);
    blade_threadpool_free(g->pool);
    blade_kv_store_free(g->kv);
    blade_model_free(g->m);
}

/* A sequence being prefilled/decoded teacher-forced: all of its tokens are known, it
 * advances by chunks and collects the logits of every position. */
typedef struct seq {
    int32_t tokens[SEQ_LEN];
    int32_t len;
    int32_t done;
    int32_t blocks[SEQ_LEN / BLOCK + 1];
    float *logits; /* [len][n_vocab] */
    int32_t rows[SEQ_LEN];
} seq;

static void seq_init(seq *s, int32_t len, const int32_t *tokens, const int32_t *blocks, int32_t n_vocab)
{
    memset(s, 0, sizeof *s);
    s->len = len;
    memcpy(s->tokens, tokens, (size_t)len * sizeof(int32_t));
    memcpy(s->blocks, blocks, sizeof s->blocks);
    s->logits = calloc((size_t)len * n_vocab, sizeof(float));
    for (int i = 0; i < SEQ_LEN; i++)
        s->rows[i] = i;
}

static blade_batch_seq seq_chunk(seq *s, int32_t n, int32_t n_vocab)
{
    if (n > s->len - s->done)
        n = s->len - s->done;
    blade_batch_seq b = {
        .tokens = s->tokens + s->done, .n_tokens = n, .pos0 = s->done, .block_table = s->blocks,
        .n_blocks = (s->done + n + BLOCK - 1) / BLOCK, .logit_rows = s->rows, .n_logits = n,
        .logits = s->logits + (size_t)s->done * n_vocab,
    };
    s->done += n;
    return b;
}

static int32_t target_tokens[SEQ_LEN];

/* Runs the target sequence to the end with the given chunk size, alongside `n_others`
 * other sequences of random lengths that start, run and finish in between. */
static float *run_target(rig *g, int32_t chunk, int n_others, bool scramble)
{
    int32_t order[N_BLOCKS];
    for (int i = 0; i < N_BLOCKS; i++)
        order[i] = i;
    if (scramble)
        for (int i = N_BLOCKS - 1; i > 0; i--) {
            int j = (int)(rnd() % (uint32_t)(i + 1));
            int32_t t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
    int per_seq = SEQ_LEN / BLOCK + 1;
    seq *target = malloc(sizeof *target);
    seq_init(target, SEQ_LEN, target_tokens, order, g->n_vocab);
    seq *others = calloc((size_t)(n_others ? n_others : 1), sizeof *others);
    for (int o = 0; o < n_others; o++) {
        int32_t toks[SEQ_LEN];
        int32_t len = 1 + (int32_t)(rnd() % 60);
        for (int i = 0; i < len; i++)
            toks[i] = (int32_t)(rnd() % (uint32_t)g->n_vocab);
        seq_init(&others[o], len, toks, order + (o + 1) * per_seq, g->n_vocab);
    }
    blade_batch_seq batch[17];
    blade_error err = {{0}};
    while (target->done < target->len) {
        int n = 0;
        /* others join in random order: decode steps (1 token) and prefill chunks mixed */
        for (int o = 0; o < n_others; o++)
            if (others[o].done < others[o].len && rnd() % 3)
                batch[n++] = seq_chunk(&others[o], rnd() % 2 ? 1 : 1 + (int32_t)(rnd() % 40), g->n_vocab);
        int at = n ? (int)(rnd() % (uint32_t)(n + 1)) : 0;
        memmove(&batch[at + 1], &batch[at], (size_t)(n - at) * sizeof batch[0]);
        batch[at] = seq_chunk(target, chunk, g->n_vocab);
        n++;
        if (blade_runner_forward(g->r, batch, n, &err))
            fail_msg("%s", err.msg);
    }
    float *out = target->logits;
    for (int o = 0; o < n_others; o++)
        free(others[o].logits);
    free(others);
    free(target);
    return out;
}

static void assert_same_bits(const float *a, const float *b, int32_t n_vocab, const char *what)
{
    for (int p = 0; p < SEQ_LEN; p++)
        if (memcmp(a + (size_t)p * n_vocab, b + (size_t)p * n_vocab, (size_t)n_vocab * sizeof(float)) != 0)
            fail_msg("%s: logits at position %d differ from the reference run", what, p);
}

/* The full matrix runs on the ISA the machine would use; every other supported ISA gets
 * one mixed run (chunks of 7 among 5 other sequences) against its own lone reference, since
 * bits are only promised within one ISA. */
static void check_invariance(uint32_t type, uint32_t sensitive, blade_arch arch, blade_kv_type kv_type)
{
    char *path = model_path(type, sensitive, arch);
    for (int i = 0; i < SEQ_LEN; i++)
        target_tokens[i] = (int32_t)(3 + (i * 7919) % 300);
    blade_isa best = blade_isa_active();
    for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
        if (!isa_tested((blade_isa)isa, "the runner's batch invariance"))
            continue;
        blade_isa_set((blade_isa)isa);
        bool full = (blade_isa)isa == best;
        const char *tname = blade_type_traits_get(type)->name, *iname = blade_isa_name((blade_isa)isa);
        char what[96];
        rig g1 = rig_new(path, 1, kv_type);
        float *ref = run_target(&g1, SEQ_LEN, 0, false);
        static const int32_t chunks[] = {1, 7, 64};
        for (size_t c = 0; full && c < 3; c++) {
            float *got = run_target(&g1, chunks[c], 0, true);
            snprintf(what, sizeof what, "%s %s: chunks of %d", tname, iname, chunks[c]);
            assert_same_bits(ref, got, g1.n_vocab, what);
            free(got);
        }
        static const int n_others[] = {2, 5, 16};
        for (size_t o = full ? 0 : 1; o < (full ? 3u : 2u); o++) {
            float *got = run_target(&g1, 7, n_others[o], true);
            snprintf(what, sizeof what, "%s %s: with %d other sequences", tname, iname, n_others[o]);
            assert_same_bits(ref, got, g1.n_vocab, what);
            free(got);
        }
        for (int threads = 2; full && threads <= 3; threads++) {
            rig gt = rig_new(path, threads, kv_type);
            float *got = run_target(&gt, 64, 4, true);
            snprintf(what, sizeof what, "%s %s: %d threads", tname, iname, threads);
            assert_same_bits(ref, got, gt.n_vocab, what);
            free(got);
            /* steps of a few tokens, whose passes convert their own heads and pieces */
            got = run_target(&gt, 3, 0, true);
            snprintf(what, sizeof what, "%s %s: %d threads, chunks of 3", tname, iname, threads);
            assert_same_bits(ref, got, gt.n_vocab, what);
            free(got);
            rig_free(&gt);
        }
        free(ref);
        rig_free(&g1);
    }
    blade_isa_set(best);
    free(path);
}

#define INVARIANCE_TEST(name, type, sensitive, arch, kv)                                                               \
    static void name(void **state)                                                                                     \
    {                                                                                                                  \
        (void)state;                                                                                                   \
        check_invariance(type, sensitive, arch, kv);                                                                   \
    }

INVARIANCE_TEST(test_invariance_q4_0, BLADE_TYPE_Q4_0, 0, BLADE_ARCH_LLAMA, BLADE_KV_F16)
INVARIANCE_TEST(test_invariance_q8_0, BLADE_TYPE_Q8_0, 0, BLADE_ARCH_QWEN2, BLADE_KV_F16)
INVARIANCE_TEST(test_invariance_q4_k, BLADE_TYPE_Q4_K, 0, BLADE_ARCH_QWEN3, BLADE_KV_BF16)
INVARIANCE_TEST(test_invariance_q4_k_m, BLADE_TYPE_Q4_K, BLADE_TYPE_Q6_K, BLADE_ARCH_LLAMA, BLADE_KV_F16)
INVARIANCE_TEST(test_invariance_q5_k, BLADE_TYPE_Q5_K, 0, BLADE_ARCH_LLAMA, BLADE_KV_F16)
INVARIANCE_TEST(test_invariance_q6_k, BLADE_TYPE_Q6_K, 0, BLADE_ARCH_LLAMA, BLADE_KV_F32)
INVARIANCE_TEST(test_invariance_f16, BLADE_TYPE_F16, 0, BLADE_ARCH_LLAMA, BLADE_KV_F16)
INVARIANCE_TEST(test_invariance_bf16, BLADE_TYPE_BF16, 0, BLADE_ARCH_LLAMA, BLADE_KV_F16)
INVARIANCE_TEST(test_invariance_f32, BLADE_TYPE_F32, 0, BLADE_ARCH_LLAMA, BLADE_KV_F32)
/* The 8-bit KV types: each token's row is rounded on its own, so they are as invariant. */
INVARIANCE_TEST(test_invariance_kv_q8_0, BLADE_TYPE_Q4_K, 0, BLADE_ARCH_QWEN3, BLADE_KV_Q8_0)
INVARIANCE_TEST(test_invariance_kv_fp8, BLADE_TYPE_Q8_0, 0, BLADE_ARCH_QWEN2, BLADE_KV_FP8)

/* The loader's fused gate/up matrix (model.h) moves rows, not arithmetic: a model fused at
 * load gives the same bits as the same file read from caller memory, which keeps the two
 * matrices apart (and takes the runner's path for them). F16 is multiplied in the file
 * layout either way, so the same kernel computes every row in both. */
static void test_fused_gate_up_same_bits(void **state)
{
    (void)state;
    char *path = model_path(BLADE_TYPE_F16, 0, BLADE_ARCH_LLAMA);
    for (int i = 0; i < SEQ_LEN; i++)
        target_tokens[i] = (int32_t)(3 + (i * 7919) % 300);
    size_t size;
    char *bytes = read_file(path, &size);
    assert_non_null(bytes);
    blade_error err = {{0}};
    blade_model *in_memory = blade_model_from_gguf(gguf_open_memory(bytes, size, &err), &err);
    assert_non_null(in_memory);
    rig fused = rig_new(path, 2, BLADE_KV_F16), apart = rig_of(in_memory, 2, BLADE_KV_F16);
    for (int l = 0; l < fused.m->hp.n_layer; l++) {
        assert_non_null(fused.m->layers[l].ffn_gate_up.data);
        assert_null(fused.m->layers[l].ffn_gate.data);
        assert_null(apart.m->layers[l].ffn_gate_up.data);
        assert_non_null(apart.m->layers[l].ffn_gate.data);
    }
    float *a = run_target(&fused, 7, 5, true), *b = run_target(&apart, 7, 5, true);
    assert_same_bits(a, b, fused.n_vocab, "fused gate/up against separate gate and up");
    free(a);
    free(b);
    rig_free(&fused);
    rig_free(&apart);
    free(bytes);
    free(path);
}

/* Timing the stages reads the clock and nothing else: the logits keep their bits, every
 * stage of a forward is seen, and the stages and OTHER add up to the forwards' wall time. */
static void test_stage_times(void **state)
{
    (void)state;
    char *path = model_path(BLADE_TYPE_Q4_0, 0, BLADE_ARCH_LLAMA);
    for (int i = 0; i < SEQ_LEN; i++)
        target_tokens[i] = (int32_t)(3 + (i * 7919) % 300);
    rig g = rig_new(path, 2, BLADE_KV_F16);
    float *plain = run_target(&g, 7, 0, false);
    blade_stage_times t;
    memset(&t, 0, sizeof t);
    blade_runner_set_stage_times(g.r, &t);
    double t0 = blade_clock_seconds();
    float *timed = run_target(&g, 7, 0, false);
    double wall = blade_clock_seconds() - t0;
    blade_runner_set_stage_times(g.r, NULL);
    assert_same_bits(plain, timed, g.n_vocab, "logits with the stages timed");
    assert_int_equal(t.forwards, (SEQ_LEN + 6) / 7);
    double sum = 0;
    for (int i = 0; i < BLADE_STAGE_COUNT; i++) {
        print_message("%s %.3f ms\n", blade_runner_stage_name((blade_runner_stage)i), t.seconds[i] * 1e3);
        assert_true(t.seconds[i] > 0);
        sum += t.seconds[i];
    }
    assert_true(sum <= wall);
    assert_string_equal(blade_runner_stage_name(BLADE_STAGE_FFN_DOWN), "ffn_down");
    /* no longer collecting: the totals stay */
    float *after = run_target(&g, 7, 0, false);
    assert_int_equal(t.forwards, (SEQ_LEN + 6) / 7);
    free(after);
    free(plain);
    free(timed);
    rig_free(&g);
    free(path);
}

/* The runner agrees with the reference forward pass: with f32 weights and an f32 KV store
 * the only differences are summation order, so logits match to float rounding. */
static void test_matches_reference_forward(void **state)
{
    (void)state;
    char *path = model_path(BLADE_TYPE_F32, 0, BLADE_ARCH_QWEN2);
    for (int i = 0; i < SEQ_LEN; i++)
        target_tokens[i] = (int32_t)(3 + (i * 31) % 300);
    rig g = rig_new(path, 2, BLADE_KV_F32);
    float *got = run_target(&g, 64, 3, true);
    blade_error err = {{0}};
    blade_forward *fw = blade_forward_new(g.m, SEQ_LEN, &err);
    double max_err = 0, max_ref = 0;
    for (int p = 0; p < SEQ_LEN; p++) {
        assert_int_equal(blade_forward_token(fw, target_tokens[p], p, true, &err), 0);
        const float *ref = blade_forward_logits(fw);
        for (int i = 0; i < g.n_vocab; i++) {
            double d = fabs(ref[i] - got[(size_t)p * g.n_vocab + i]);
            max_err = d > max_err ? d : max_err;
            max_ref = fabs(ref[i]) > max_ref ? fabs(ref[i]) : max_ref;
        }
    }
    print_message("runner vs reference forward: max |diff| %.3g, max |logit| %.3g\n", max_err, max_ref);
    assert_true(max_err <= 1e-4 * max_ref);
    blade_forward_free(fw);
    free(got);
    rig_free(&g);
    free(path);
}

/* Quantized weights: the runner quantizes activations for integer dot products, the
 * reference does not; the logits still agree to well under the weight quantization error.
 * On the Q4_K_M mix, whose third layer's Q6_K V projection shares one activation row and
 * one pass of the pool with the Q4_K Q and K ones. */
static void test_quantized_close_to_reference(void **state)
{
    (void)state;
    char *path = model_path(BLADE_TYPE_Q4_K, BLADE_TYPE_Q6_K, BLADE_ARCH_LLAMA);
    rig g = rig_new(path, 2, BLADE_KV_F16);
    float *got = run_target(&g, 64, 0, false);
    blade_error err = {{0}};
    blade_forward *fw = blade_forward_new(g.m, SEQ_LEN, &err);
    double se = 0, ss = 0;
    for (int p = 0; p < SEQ_LEN; p++) {
        assert_int_equal(blade_forward_token(fw, target_tokens[p], p, true, &err), 0);
        const float *ref = blade_forward_logits(fw);
        for (int i = 0; i < g.n_vocab; i++) {
            double d = ref[i] - got[(size_t)p * g.n_vocab + i];
            se += d * d;
            ss += (double)ref[i] * ref[i];
        }
    }
    double rel = sqrt(se / ss);
    print_message("runner (Q8 activations, f16 KV) vs reference forward on Q4_K_M weights: relative RMS %.5f\n", rel);
    assert_true(rel < 0.02);
    blade_forward_free(fw);
    free(got);
    rig_free(&g);
    free(path);
}

static void test_rejects_bad_batches(void **state)
{
    (void)state;
    char *path = model_path(BLADE_TYPE_F32, 0, BLADE_ARCH_LLAMA);
    rig g = rig_new(path, 1, BLADE_KV_F16);
    blade_error err = {{0}};
    int32_t toks[4] = {5, 6, 7, 8}, blocks[1] = {0}, bad_blocks[1] = {N_BLOCKS};
    float logits[320];
    blade_batch_seq b = {.tokens = toks, .n_tokens = 4, .pos0 = 0, .block_table = blocks, .n_blocks = 1,
                         .n_logits = 1, .logits = logits};
    assert_int_equal(blade_runner_forward(g.r, &b, 1, &err), 0);
    blade_batch_seq bad = b;
    bad.pos0 = 14;
    assert_int_equal(blade_runner_forward(g.r, &bad, 1, &err), -1);
    assert_non_null(strstr(err.msg, "not covered"));
    bad = b;
    bad.block_table = bad_blocks;
    assert_int_equal(blade_runner_forward(g.r, &bad, 1, &err), -1);
    assert_non_null(strstr(err.msg, "outside the store"));
    int32_t bad_tok[1] = {320};
    bad = b;
    bad.tokens = bad_tok;
    bad.n_tokens = 1;
    assert_int_equal(blade_runner_forward(g.r, &bad, 1, &err), -1);
    assert_non_null(strstr(err.msg, "vocabulary"));
    rig_free(&g);
    free(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invariance_q4_0),      cmocka_unit_test(test_invariance_q8_0),
        cmocka_unit_test(test_invariance_q4_k),      cmocka_unit_test(test_invariance_q4_k_m),
        cmocka_unit_test(test_invariance_q5_k),      cmocka_unit_test(test_invariance_q6_k),
        cmocka_unit_test(test_invariance_f16),       cmocka_unit_test(test_invariance_bf16),
        cmocka_unit_test(test_invariance_f32),       cmocka_unit_test(test_invariance_kv_q8_0),
        cmocka_unit_test(test_invariance_kv_fp8),
        cmocka_unit_test(test_matches_reference_forward), cmocka_unit_test(test_quantized_close_to_reference),
        cmocka_unit_test(test_rejects_bad_batches),  cmocka_unit_test(test_fused_gate_up_same_bits),
        cmocka_unit_test(test_stage_times),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* What an 8-bit KV cache costs in quality, on a real model: stories260K over
 * ../shared/eval/stories-corpus.txt, perplexity by the llama.cpp method (shared/README.md)
 * through the batched runner with each KV type, and the KL divergence of every scored
 * next-token distribution from the f16 cache's. The bounds hold the measured figures
 * (MEASURED.md) with room to spare, so a broken scale or rounding fails here. */
#include "testutil.h"

#include "blade/kv_store.h"
#include "blade/model.h"
#include "blade/runner.h"
#include "blade/sampler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CTX 256
#define BLOCK 16

typedef struct scored {
    double nll;        /* summed over the scored predictions */
    double *logprobs;  /* [n_scored][n_vocab], kept for the f16 run */
    double kld_sum, kld_max;
    int64_t top1_same;
    int64_t n;
} scored;

/* Every chunk of the corpus through the runner with a store of the given type: the
 * predictions at CTX/2 .. CTX-2 of each chunk, against f16's when `base` is given. */
static void score(const blade_model *m, const int32_t *tokens, int32_t n_chunks, blade_kv_type type,
                  const scored *base, scored *out)
{
    const int32_t nv = m->hp.n_vocab, first = CTX / 2, n_rows = CTX - 1 - first;
    blade_error err = {{0}};
    blade_kv_store_config cfg = blade_model_kv_config(&m->hp, type, BLOCK, CTX / BLOCK);
    blade_kv_store *kv = blade_kv_store_new(&cfg, &err);
    assert_non_null(kv);
    blade_threadpool *pool = blade_threadpool_new(2);
    blade_runner *r = blade_runner_new(m, kv, pool, CTX, &err);
    assert_non_null(r);
    int32_t blocks[CTX / BLOCK], rows[CTX], chunk[CTX];
    for (int32_t i = 0; i < CTX / BLOCK; i++)
        blocks[i] = i;
    for (int32_t i = 0; i < n_rows; i++)
        rows[i] = first + i;
    float *logits = malloc((size_t)n_rows * nv * sizeof *logits), *lp = malloc((size_t)nv * sizeof *lp);
    memset(out, 0, sizeof *out);
    if (!base)
        out->logprobs = malloc((size_t)n_chunks * n_rows * nv * sizeof *out->logprobs);
    for (int32_t c = 0; c < n_chunks; c++) {
        memcpy(chunk, tokens + (size_t)c * CTX, sizeof chunk);
        chunk[0] = tokens[0]; /* BOS */
        blade_batch_seq s = {.tokens = chunk, .n_tokens = CTX - 1, .pos0 = 0, .block_table = blocks,
                             .n_blocks = CTX / BLOCK, .logit_rows = rows, .n_logits = n_rows, .logits = logits};
        if (blade_runner_forward(r, &s, 1, &err))
            fail_msg("%s", err.msg);
        for (int32_t i = 0; i < n_rows; i++) {
            blade_logits_to_logprobs(logits + (size_t)i * nv, nv, lp);
            out->nll -= lp[chunk[first + i + 1]];
            int32_t top = 0;
            for (int32_t t = 1; t < nv; t++)
                top = lp[t] > lp[top] ? t : top;
            size_t at = ((size_t)c * n_rows + (size_t)i) * nv;
            if (!base) {
                for (int32_t t = 0; t < nv; t++)
                    out->logprobs[at + t] = lp[t];
                continue;
            }
            double kld = 0;
            int32_t base_top = 0;
            for (int32_t t = 0; t < nv; t++) {
                double p = exp(base->logprobs[at + t]);
                kld += p * (base->logprobs[at + t] - lp[t]);
                base_top = base->logprobs[at + t] > base->logprobs[at + base_top] ? t : base_top;
            }
            out->kld_sum += kld;
            out->kld_max = kld > out->kld_max ? kld : out->kld_max;
            out->top1_same += top == base_top;
        }
        out->n += n_rows;
    }
    free(logits);
    free(lp);
    blade_runner_free(r);
    blade_threadpool_free(pool);
    blade_kv_store_free(kv);
}

static void test_kv_types_quality(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf");
    char *corpus = require_shared("eval/stories-corpus.txt");
    blade_error err = {{0}};
    blade_model *m = blade_model_load(model, &err);
    assert_non_null(m);
    size_t len, n_tokens;
    char *text = read_file(corpus, &len);
    assert_non_null(text);
    int32_t *tokens = NULL;
    assert_int_equal(blade_tokenizer_encode(m->tokenizer, text, len, true, false, &tokens, &n_tokens, &err), 0);
    int32_t n_chunks = (int32_t)(n_tokens / CTX);

    scored f16;
    score(m, tokens, n_chunks, BLADE_KV_F16, NULL, &f16);
    double ppl16 = exp(f16.nll / (double)f16.n);
    /* shared/README.md's reference perplexity at ctx 256 (f32 reference forward pass) */
    print_message("f16 KV: PPL %.4f over %lld predictions (reference 3.1577)\n", ppl16, (long long)f16.n);
    assert_true(fabs(ppl16 / 3.1577 - 1) < 0.002);

    static const struct {
        blade_kv_type type;
        double max_dppl, max_kld, min_top1; /* |dPPL| relative, mean KLD, top-1 agreement */
    } cases[] = {
        {BLADE_KV_F32, 0.001, 0.0001, 0.995},
        {BLADE_KV_BF16, 0.005, 0.001, 0.98},
        {BLADE_KV_Q8_0, 0.005, 0.005, 0.96},
        {BLADE_KV_FP8, 0.03, 0.025, 0.92},
    };
    print_message("%-5s %9s %9s %10s %10s %8s\n", "KV", "PPL", "dPPL", "mean KLD", "max KLD", "top-1");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        scored q;
        score(m, tokens, n_chunks, cases[i].type, &f16, &q);
        double ppl = exp(q.nll / (double)q.n), dppl = ppl / ppl16 - 1, kld = q.kld_sum / (double)q.n,
               top1 = (double)q.top1_same / (double)q.n;
        print_message("%-5s %9.4f %+8.3f%% %10.6f %10.6f %7.2f%%\n", blade_kv_type_name(cases[i].type), ppl,
                      100 * dppl, kld, q.kld_max, 100 * top1);
        if (fabs(dppl) > cases[i].max_dppl || kld > cases[i].max_kld || top1 < cases[i].min_top1)
            fail_msg("%s KV: dPPL %+.3f%%, mean KLD %.6f, top-1 %.2f%% outside the bounds (%.1f%%, %.4f, %.0f%%)",
                     blade_kv_type_name(cases[i].type), 100 * dppl, kld, 100 * top1, 100 * cases[i].max_dppl,
                     cases[i].max_kld, 100 * cases[i].min_top1);
    }
    free(f16.logprobs);
    free(tokens);
    free(text);
    blade_model_free(m);
    free(model);
    free(corpus);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_types_quality),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

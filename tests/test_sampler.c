/* Sampling: the random stream against its reference outputs, parameter validation,
 * greedy argmax with ties to the lower id, each penalty's semantics and their order,
 * masked tokens staying masked, the filters (top-k, top-p, min-p) and temperature against
 * exact distributions, reproducibility and golden sequences per seed, one uniform draw per
 * call, NaN and infinite logits, a large vocabulary, and logprobs with their top
 * alternatives. */
#include "testutil.h"

#include "blade/sampler.h"
#include "sampler/rng.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define N_DRAWS 20000

/* Chi-square critical values at p = 0.001, by degrees of freedom: a correct sampler fails
 * one of these only once in a thousand seeds, and the seeds here are fixed. */
static const double chi2_crit[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52};

static blade_sampling_params plain(float temperature, uint64_t seed)
{
    blade_sampling_params p;
    blade_sampling_params_default(&p);
    p.temperature = temperature;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.seed = seed;
    return p;
}

static blade_sampler *make(const blade_sampling_params *p, int32_t n_vocab)
{
    blade_sampler *s = blade_sampler_new(p, n_vocab);
    assert_non_null(s);
    return s;
}

static int32_t sample_once(const blade_sampling_params *p, const float *logits, int32_t n)
{
    blade_sampler *s = make(p, n);
    int32_t t = blade_sampler_sample(s, logits);
    blade_sampler_free(s);
    return t;
}

/* Histogram of N_DRAWS draws from one sampler (no history, so every draw sees the same
 * distribution). */
static void histogram(const blade_sampling_params *p, const float *logits, int32_t n, int *counts)
{
    blade_sampler *s = make(p, n);
    memset(counts, 0, (size_t)n * sizeof *counts);
    for (int i = 0; i < N_DRAWS; i++) {
        int32_t t = blade_sampler_sample(s, logits);
        assert_true(t >= 0 && t < n);
        counts[t]++;
    }
    blade_sampler_free(s);
}

/* Pearson's statistic over the tokens with expected > 0; a draw of an expected-zero token
 * fails outright. */
static double chi2(const int *counts, const double *expected, int n)
{
    double x = 0.0;
    for (int i = 0; i < n; i++) {
        if (expected[i] == 0.0) {
            assert_int_equal(counts[i], 0);
            continue;
        }
        double e = expected[i] * N_DRAWS, d = counts[i] - e;
        x += d * d / e;
    }
    return x;
}

static void softmax_ref(const float *logits, int n, double temperature, double *out)
{
    double max = -INFINITY, sum = 0.0;
    for (int i = 0; i < n; i++)
        if (logits[i] > max)
            max = logits[i];
    for (int i = 0; i < n; i++) {
        out[i] = exp((logits[i] - max) / temperature);
        sum += out[i];
    }
    for (int i = 0; i < n; i++)
        out[i] /= sum;
}

/* The reference distribution of the statistical tests, as logits shifted by 3 to show
 * that only differences matter. */
#define N_REF 5
static const double ref_p[N_REF] = {0.5, 0.25, 0.15, 0.07, 0.03};

static void ref_logits(float *logits)
{
    for (int i = 0; i < N_REF; i++)
        logits[i] = (float)(log(ref_p[i]) + 3.0);
}

/* Expected frequencies when only the tokens in keep[] survive, renormalised. */
static void ref_restricted(const int *keep, int n_keep, double *expected)
{
    double total = 0.0;
    memset(expected, 0, N_REF * sizeof *expected);
    for (int i = 0; i < n_keep; i++)
        total += ref_p[keep[i]];
    for (int i = 0; i < n_keep; i++)
        expected[keep[i]] = ref_p[keep[i]] / total;
}

static void test_rng_reference(void **state)
{
    (void)state;
    /* Outputs of the published splitmix64 / xoshiro256** algorithms, computed with an
     * independent implementation; a mismatch means draws differ from other builds. */
    static const uint64_t seed0[] = {0x99ec5f36cb75f2b4u, 0xbf6e1f784956452au,
                                     0x1a5f849d4933e6e0u, 0x6aa594f1262d2d2cu};
    static const uint64_t seed42[] = {0x15780b2e0c2ec716u, 0x6104d9866d113a7eu,
                                      0xae17533239e499a1u, 0xecb8ad4703b360a1u};
    blade_rng r;
    blade_rng_seed(&r, 0);
    for (int i = 0; i < 4; i++)
        assert_true(blade_rng_next(&r) == seed0[i]);
    blade_rng_seed(&r, 42);
    for (int i = 0; i < 4; i++)
        assert_true(blade_rng_next(&r) == seed42[i]);

    double sum = 0.0;
    for (int i = 0; i < 100000; i++) {
        double u = blade_rng_uniform(&r);
        assert_true(u >= 0.0 && u < 1.0);
        sum += u;
    }
    assert_true(fabs(sum / 100000 - 0.5) < 0.005);
}

static void test_exp_matches_libm(void **state)
{
    (void)state;
    assert_true(blade_exp_nonpos(0.0) == 1.0);
    assert_true(blade_exp_nonpos(-0.0) == 1.0);
    for (double x = 0.0; x > -708.0; x -= 0.0137) {
        double want = exp(x), got = blade_exp_nonpos(x);
        assert_true(fabs(got - want) <= 1e-14 * want);
    }
    assert_true(blade_exp_nonpos(-709.0) == 0.0);
    assert_true(blade_exp_nonpos(-INFINITY) == 0.0);
    assert_true(blade_exp_nonpos(NAN) == 0.0);
}

static void test_validate(void **state)
{
    (void)state;
    blade_sampling_params p;
    blade_sampling_params_default(&p);
    blade_error err;
    assert_int_equal(blade_sampling_params_validate(&p, &err), 0);

    blade_sampling_params bad = p;
    bad.temperature = NAN;
    assert_int_equal(blade_sampling_params_validate(&bad, &err), -1);
    assert_non_null(strstr(err.msg, "temperature"));
    assert_null(blade_sampler_new(&bad, 10));

    bad = p;
    bad.top_p = INFINITY;
    assert_int_equal(blade_sampling_params_validate(&bad, &err), -1);
    assert_non_null(strstr(err.msg, "top_p"));

    bad = p;
    bad.repeat_penalty = 0.0f;
    assert_int_equal(blade_sampling_params_validate(&bad, &err), -1);
    assert_non_null(strstr(err.msg, "repeat_penalty"));
    assert_null(blade_sampler_new(&bad, 10));

    bad = p;
    bad.repeat_last_n = -2;
    assert_int_equal(blade_sampling_params_validate(&bad, NULL), -1);

    assert_null(blade_sampler_new(&p, 0));
    assert_null(blade_sampler_new(NULL, 10));
}

static void test_greedy_argmax_lowest_id(void **state)
{
    (void)state;
    blade_sampling_params p;
    blade_sampling_params_default(&p);
    p.temperature = 0.0f;
    const float logits[] = {1.0f, 3.0f, 2.0f, 3.0f, -5.0f};
    assert_int_equal(sample_once(&p, logits, 5), 1);

    const float tied[] = {-2.0f, -2.0f, -2.0f};
    assert_int_equal(sample_once(&p, tied, 3), 0);

    /* Negative temperature is greedy too, and greedy ignores the filters entirely. */
    p.temperature = -1.0f;
    p.top_p = 0.0f;
    p.min_p = 5.0f;
    assert_int_equal(sample_once(&p, logits, 5), 1);
}

/* Greedy with a penalty and a context, for reading off which way a penalty tipped. */
static int32_t greedy_after(blade_sampling_params p, const float *logits, int32_t n,
                            const int32_t *ctx, const bool *generated, int n_ctx)
{
    p.temperature = 0.0f;
    blade_sampler *s = make(&p, n);
    for (int i = 0; i < n_ctx; i++)
        blade_sampler_accept(s, ctx[i], generated ? generated[i] : true);
    int32_t t = blade_sampler_sample(s, logits);
    blade_sampler_free(s);
    return t;
}

static void test_repeat_penalty_positive(void **state)
{
    (void)state;
    blade_sampling_params p = plain(0.0f, 1);
    p.repeat_penalty = 2.0f;
    const int32_t ctx[] = {0};
    /* 3.0 / 2 = 1.5: beats 1.49, loses to 1.51. */
    const float below[] = {3.0f, 1.49f};
    const float above[] = {3.0f, 1.51f};
    assert_int_equal(greedy_after(p, below, 2, ctx, NULL, 1), 0);
    assert_int_equal(greedy_after(p, above, 2, ctx, NULL, 1), 1);
    /* Without the penalty the same context changes nothing. */
    p.repeat_penalty = 1.0f;
    assert_int_equal(greedy_after(p, above, 2, ctx, NULL, 1), 0);
}

static void test_repeat_penalty_negative(void **state)
{
    (void)state;
    blade_sampling_params p = plain(0.0f, 1);
    const int32_t ctx[] = {0};
    const float logits[] = {-1.0f, -1.9f};
    /* -1.0 * 2 = -2.0 < -1.9; -1.0 * 1.8 = -1.8 > -1.9. */
    p.repeat_penalty = 2.0f;
    assert_int_equal(greedy_after(p, logits, 2, ctx, NULL, 1), 1);
    p.repeat_penalty = 1.8f;
    assert_int_equal(greedy_after(p, logits, 2, ctx, NULL, 1), 0);
}

static void test_repeat_penalty_once_per_distinct_token(void **state)
{
    (void)state;
    blade_sampling_params p = plain(0.0f, 1);
    p.repeat_penalty = 1.5f;
    /* Once: 2.0 / 1.5 = 1.33 > 1.2. Twice would give 0.89 < 1.2. */
    const int32_t ctx[] = {0, 0, 0};
    const float logits[] = {2.0f, 1.2f};
    assert_int_equal(greedy_after(p, logits, 2, ctx, NULL, 3), 0);
}

static void test_repeat_penalty_window_and_prompt(void **state)
{
    (void)state;
    blade_sampling_params p = plain(0.0f, 1);
    p.repeat_penalty = 2.0f;
    const float logits[] = {3.0f, 1.6f, 0.0f, 0.0f};
    const int32_t ctx[] = {0, 2, 3};
    const bool prompt[] = {false, false, false};

    p.repeat_last_n = 2; /* window {2, 3}: token 0 has left it */
    assert_int_equal(greedy_after(p, logits, 4, ctx, prompt, 3), 0);
    p.repeat_last_n = 3; /* 3.0 / 2 = 1.5 < 1.6 */
    assert_int_equal(greedy_after(p, logits, 4, ctx, prompt, 3), 1);
    p.repeat_last_n = -1;
    assert_int_equal(greedy_after(p, logits, 4, ctx, prompt, 3), 1);
    p.repeat_last_n = 0;
    assert_int_equal(greedy_after(p, logits, 4, ctx, prompt, 3), 0);
}

static void test_presence_frequency(void **state)
{
    (void)state;
    blade_sampling_params p = plain(0.0f, 1);
    const float logits[] = {1.0f, 0.0f};
    const int32_t ctx[] = {0, 0};

    /* 1.0 - 0.3 - 2 * 0.2 = 0.3 > 0; with frequency 0.4: 1.0 - 0.3 - 0.8 = -0.1 < 0. */
    p.presence_penalty = 0.3f;
    p.frequency_penalty = 0.2f;
    assert_int_equal(greedy_after(p, logits, 2, ctx, NULL, 2), 0);
    p.frequency_penalty = 0.4f;
    assert_int_equal(greedy_after(p, logits, 2, ctx, NULL, 2), 1);

    /* Presence counts once: 1.0 - 0.6 = 0.4 > 0 however often the token came. */
    p.presence_penalty = 0.6f;
    p.frequency_penalty = 0.0f;
    const int32_t many[] = {0, 0, 0, 0, 0};
    assert_int_equal(greedy_after(p, logits, 2, many, NULL, 5), 0);
    p.presence_penalty = 1.1f;
    assert_int_equal(greedy_after(p, logits, 2, many, NULL, 5), 1);

    /* Prompt tokens do not count for either. */
    const bool prompt[] = {false, false, false, false, false};
    p.presence_penalty = 5.0f;
    p.frequency_penalty = 5.0f;
    assert_int_equal(greedy_after(p, logits, 2, many, prompt, 5), 0);

    /* They shift the sampled distribution too: presence ln 3 turns an even pair into
     * 1 : 3. */
    const float even[] = {0.0f, 0.0f};
    blade_sampling_params warm = plain(1.0f, 70);
    warm.presence_penalty = (float)log(3.0);
    blade_sampler *s = make(&warm, 2);
    blade_sampler_accept(s, 0, true);
    int counts[2] = {0, 0};
    for (int i = 0; i < N_DRAWS; i++)
        counts[blade_sampler_sample(s, even)]++;
    blade_sampler_free(s);
    const double quarter[] = {0.25, 0.75};
    assert_true(chi2(counts, quarter, 2) < chi2_crit[1]);

    /* Negative penalties (OpenAI allows them) encourage repetition. */
    const float other[] = {0.0f, 1.0f};
    const int32_t once[] = {0};
    p.presence_penalty = -1.5f;
    p.frequency_penalty = 0.0f;
    assert_int_equal(greedy_after(p, other, 2, once, NULL, 1), 0);
}

static void test_penalty_order(void **state)
{
    (void)state;
    /* Repetition first: 1.0 / 2 - 0.45 = 0.05 < 0.1. Presence first would give
     * (1.0 - 0.45) / 2 = 0.275 > 0.1. */
    blade_sampling_params p = plain(0.0f, 1);
    p.repeat_penalty = 2.0f;
    p.presence_penalty = 0.45f;
    const float logits[] = {1.0f, 0.1f};
    const int32_t ctx[] = {0};
    assert_int_equal(greedy_after(p, logits, 2, ctx, NULL, 1), 1);
}

static void test_penalty_keeps_masked_tokens_masked(void **state)
{
    (void)state;
    blade_sampling_params p = plain(1.0f, 3);
    p.repeat_penalty = 0.5f;
    p.presence_penalty = -10.0f;
    p.frequency_penalty = -10.0f;
    const float logits[] = {-INFINITY, -5.0f, -6.0f};
    blade_sampler *s = make(&p, 3);
    for (int i = 0; i < 3; i++)
        blade_sampler_accept(s, 0, true);
    for (int i = 0; i < 2000; i++)
        assert_int_not_equal(blade_sampler_sample(s, logits), 0);
    blade_sampler_free(s);
}

static void test_accept_out_of_range_ignored(void **state)
{
    (void)state;
    blade_sampling_params p = plain(0.0f, 1);
    p.repeat_penalty = 100.0f;
    p.presence_penalty = 100.0f;
    blade_sampler *s = make(&p, 3);
    blade_sampler_accept(s, -1, true);
    blade_sampler_accept(s, 3, true);
    blade_sampler_accept(s, INT32_MAX, false);
    blade_sampler_accept(NULL, 0, true);
    const float logits[] = {1.0f, 0.0f, 0.0f};
    assert_int_equal(blade_sampler_sample(s, logits), 0);
    assert_int_equal(blade_sampler_sample(NULL, logits), -1);
    blade_sampler_free(s);
    blade_sampler_free(NULL);
}

/* Logits from the test's own stream, with the maximum duplicated at a random later id
 * half of the time so that ties are exercised. */
static int32_t random_logits(blade_rng *r, float *logits, int32_t n)
{
    int32_t best = 0;
    for (int32_t i = 0; i < n; i++) {
        logits[i] = (float)(blade_rng_uniform(r) * 8.0 - 4.0);
        if (logits[i] > logits[best])
            best = i;
    }
    if (blade_rng_next(r) & 1) {
        int32_t twin = best + 1 + (int32_t)(blade_rng_next(r) % (uint64_t)(n - best));
        if (twin < n)
            logits[twin] = logits[best];
    }
    return best;
}

static void test_filters_that_keep_one_equal_greedy(void **state)
{
    (void)state;
    enum { N = 1000 };
    float *logits = malloc(N * sizeof *logits);
    blade_rng r;
    blade_rng_seed(&r, 99);
    blade_sampling_params k1 = plain(1.3f, 5), tiny_p = plain(1.3f, 6), zero_p = plain(5.0f, 7);
    k1.top_k = 1;
    tiny_p.top_p = 1e-6f;
    zero_p.top_p = 0.0f;
    blade_sampler *s[] = {make(&k1, N), make(&tiny_p, N), make(&zero_p, N)};
    for (int round = 0; round < 200; round++) {
        int32_t best = random_logits(&r, logits, N);
        for (size_t i = 0; i < sizeof s / sizeof s[0]; i++)
            assert_int_equal(blade_sampler_sample(s[i], logits), best);
    }
    for (size_t i = 0; i < sizeof s / sizeof s[0]; i++)
        blade_sampler_free(s[i]);
    free(logits);

    /* min-p above 1 keeps only what ties with the most likely token. */
    blade_sampling_params big_min_p = plain(2.0f, 8);
    big_min_p.min_p = 1.5f;
    const float single_best[] = {0.0f, 2.0f, 1.9f};
    int counts[3];
    histogram(&big_min_p, single_best, 3, counts);
    assert_int_equal(counts[1], N_DRAWS);
    const float tied_best[] = {2.0f, 0.0f, 2.0f};
    const double half[] = {0.5, 0.0, 0.5};
    histogram(&big_min_p, tied_best, 3, counts);
    assert_true(chi2(counts, half, 3) < chi2_crit[1]);
}

static void test_distribution_temperature_1(void **state)
{
    (void)state;
    float logits[N_REF];
    int counts[N_REF];
    ref_logits(logits);
    blade_sampling_params p = plain(1.0f, 11);
    histogram(&p, logits, N_REF, counts);
    for (int i = 0; i < N_REF; i++)
        assert_true(fabs((double)counts[i] / N_DRAWS - ref_p[i]) < 0.015);
    assert_true(chi2(counts, ref_p, N_REF) < chi2_crit[N_REF - 1]);
}

static void test_top_k_top_p_min_p_exclude(void **state)
{
    (void)state;
    float logits[N_REF];
    int counts[N_REF];
    double expected[N_REF];
    ref_logits(logits);
    static const int keep2[] = {0, 1}, keep3[] = {0, 1, 2};
    const struct {
        int32_t top_k;
        float top_p, min_p;
        const int *keep;
        int n_keep;
    } cases[] = {
        {2, 1.0f, 0.0f, keep2, 2},
        {3, 1.0f, 0.0f, keep3, 3},
        /* cumulative 0.5, 0.75, 0.9: 0.8 is first reached with the third token */
        {0, 0.8f, 0.0f, keep3, 3},
        {0, 0.7f, 0.0f, keep2, 2},
        /* min-p relative to p_max = 0.5: thresholds 0.1 and 0.175 */
        {0, 1.0f, 0.2f, keep3, 3},
        {0, 1.0f, 0.35f, keep2, 2},
        /* top-k 4 renormalises to 0.515, 0.258, 0.155, 0.072: top-p 0.95 keeps all four,
         * then min-p 0.2 (threshold 0.103) drops the fourth */
        {4, 0.95f, 0.2f, keep3, 3},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        blade_sampling_params p = plain(1.0f, 20 + c);
        p.top_k = cases[c].top_k;
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        histogram(&p, logits, N_REF, counts);
        ref_restricted(cases[c].keep, cases[c].n_keep, expected);
        assert_true(chi2(counts, expected, N_REF) < chi2_crit[cases[c].n_keep - 1]);
    }

    /* top-p sees the probabilities renormalised after top-k: 2/3 >= 0.6 keeps one token,
     * where the raw 0.5 would have kept two. */
    blade_sampling_params p = plain(1.0f, 40);
    p.top_k = 2;
    p.top_p = 0.6f;
    histogram(&p, logits, N_REF, counts);
    assert_int_equal(counts[0], N_DRAWS);
}

static void test_temperature_scaling(void **state)
{
    (void)state;
    enum { N = 4 };
    const float logits[N] = {0.0f, 1.0f, 2.0f, 3.0f};
    const float temps[] = {0.5f, 1.0f, 2.0f};
    double at_t1[N];
    softmax_ref(logits, N, 1.0, at_t1);
    double prev_top = 1.0;
    for (size_t i = 0; i < sizeof temps / sizeof temps[0]; i++) {
        double expected[N];
        int counts[N];
        softmax_ref(logits, N, temps[i], expected);
        blade_sampling_params p = plain(temps[i], 50 + i);
        histogram(&p, logits, N, counts);
        assert_true(chi2(counts, expected, N) < chi2_crit[N - 1]);
        if (temps[i] != 1.0f)
            assert_true(chi2(counts, at_t1, N) > 100.0);
        double top = (double)counts[N - 1] / N_DRAWS;
        assert_true(top < prev_top);
        prev_top = top;
    }
}

static void test_same_seed_same_sequence(void **state)
{
    (void)state;
    enum { N = 64, DRAWS = 1000 };
    float logits[N];
    blade_rng r;
    blade_rng_seed(&r, 5);
    random_logits(&r, logits, N);
    blade_sampling_params p;
    blade_sampling_params_default(&p);
    p.top_k = 20;
    p.presence_penalty = 0.5f;
    p.repeat_penalty = 1.1f;
    p.seed = 1234;
    blade_sampler *a = make(&p, N), *b = make(&p, N);
    p.seed = 1235;
    blade_sampler *c = make(&p, N);
    int differ = 0;
    for (int i = 0; i < DRAWS; i++) {
        int32_t ta = blade_sampler_sample(a, logits);
        int32_t tb = blade_sampler_sample(b, logits);
        int32_t tc = blade_sampler_sample(c, logits);
        assert_int_equal(ta, tb);
        differ += ta != tc;
        blade_sampler_accept(a, ta, true);
        blade_sampler_accept(b, tb, true);
        blade_sampler_accept(c, tc, true);
    }
    assert_true(differ > DRAWS / 2);
    blade_sampler_free(a);
    blade_sampler_free(b);
    blade_sampler_free(c);
}

static void test_golden_sequences(void **state)
{
    (void)state;
    /* Pinned outputs: the same on every machine and compiler (the draws use no libm and
     * no reduction of varying order), so a change here means users' seeded requests
     * would change. Covers each path: top-k, unsorted, nucleus sort, min-p. */
    const float small[] = {0.3f, -1.2f, 2.5f, 0.0f, 1.1f, -0.7f, 1.9f, 0.8f};
    static const int32_t want_small[] = {2, 2, 3, 0, 6, 2, 6, 2, 6, 0, 2, 2,
                                         2, 2, 2, 2, 3, 6, 6, 7, 2, 4, 0, 7};
    blade_sampling_params p = plain(0.9f, 20240611);
    p.top_k = 6;
    p.top_p = 0.97f;
    p.min_p = 0.02f;
    blade_sampler *s = make(&p, 8);
    for (size_t i = 0; i < sizeof want_small / sizeof want_small[0]; i++)
        assert_int_equal(blade_sampler_sample(s, small), want_small[i]);
    blade_sampler_free(s);

    enum { N = 5000 };
    float *logits = malloc(N * sizeof *logits);
    blade_rng r;
    blade_rng_seed(&r, 31337);
    for (int i = 0; i < N; i++)
        logits[i] = (float)(blade_rng_uniform(&r) * 12.0 - 6.0);
    static const int32_t want[3][8] = {
        {3943, 385, 3363, 2262, 1066, 2138, 2196, 3739},
        {1389, 1233, 4572, 2049, 4875, 26, 3864, 3823},
        {4818, 3572, 1409, 907, 4477, 590, 4968, 3404},
    };
    for (int c = 0; c < 3; c++) {
        p = plain(c == 2 ? 0.8f : 1.0f, 1000 + c);
        if (c == 1)
            p.top_p = 0.9f;
        if (c == 2)
            p.min_p = 0.05f;
        s = make(&p, N);
        for (int i = 0; i < 8; i++)
            assert_int_equal(blade_sampler_sample(s, logits), want[c][i]);
        blade_sampler_free(s);
    }
    free(logits);
}

static void test_ties_break_to_lower_id(void **state)
{
    (void)state;
    /* Equal weights: top-k 2 and top-p 0.5 (cumulative 0.25, 0.5) both keep ids 0 and 1,
     * whatever order a heap or sort visits them in. */
    const float flat[] = {1.0f, 1.0f, 1.0f, 1.0f};
    const double first_two[] = {0.5, 0.5, 0.0, 0.0};
    int counts[4];
    blade_sampling_params p = plain(1.0f, 90);
    p.top_k = 2;
    histogram(&p, flat, 4, counts);
    assert_true(chi2(counts, first_two, 4) < chi2_crit[1]);
    p = plain(1.0f, 91);
    p.top_p = 0.5f;
    histogram(&p, flat, 4, counts);
    assert_true(chi2(counts, first_two, 4) < chi2_crit[1]);

    /* -0 and +0 are the same logit. */
    const float zeros[] = {-1.0f, -0.0f, 0.0f};
    p = plain(1.0f, 92);
    p.top_k = 1;
    assert_int_equal(sample_once(&p, zeros, 3), 1);
    const float zeros_swapped[] = {-1.0f, 0.0f, -0.0f};
    assert_int_equal(sample_once(&p, zeros_swapped, 3), 1);
}

static void test_one_uniform_per_call(void **state)
{
    (void)state;
    float logits[N_REF];
    ref_logits(logits);
    const float single[N_REF] = {-INFINITY, -INFINITY, 0.0f, -INFINITY, -INFINITY};
    blade_sampling_params p = plain(1.0f, 77);
    blade_sampler *a = make(&p, N_REF), *b = make(&p, N_REF);
    assert_int_equal(blade_sampler_sample(a, single), 2);
    blade_sampler_sample(b, logits);
    for (int i = 0; i < 200; i++)
        assert_int_equal(blade_sampler_sample(a, logits), blade_sampler_sample(b, logits));
    blade_sampler_free(a);
    blade_sampler_free(b);
}

static void test_inf_and_nan(void **state)
{
    (void)state;
    blade_sampling_params greedy = plain(0.0f, 1), warm = plain(1.0f, 60);
    warm.top_k = 3;
    warm.top_p = 0.99f;
    warm.min_p = 0.01f;

    const float nan_first[] = {NAN, 1.0f, NAN, 2.0f, NAN};
    assert_int_equal(sample_once(&greedy, nan_first, 5), 3);

    const float all_nan[] = {NAN, NAN};
    const float all_masked[] = {-INFINITY, -INFINITY, -INFINITY};
    assert_int_equal(sample_once(&greedy, all_nan, 2), -1);
    assert_int_equal(sample_once(&greedy, all_masked, 3), -1);
    assert_int_equal(sample_once(&warm, all_nan, 2), -1);
    assert_int_equal(sample_once(&warm, all_masked, 3), -1);

    /* Only the two finite, equal tokens can come out, about equally often. */
    const float mixed[] = {NAN, 0.0f, -INFINITY, 0.0f, NAN, -INFINITY};
    int counts[6];
    blade_sampling_params p = plain(1.0f, 61);
    histogram(&p, mixed, 6, counts);
    const double half[] = {0, 0.5, 0, 0.5, 0, 0};
    assert_true(chi2(counts, half, 6) < chi2_crit[1]);
    histogram(&warm, mixed, 6, counts);
    assert_true(chi2(counts, half, 6) < chi2_crit[1]);

    /* NaN beside a known distribution does not disturb it. */
    float with_nan[N_REF + 2];
    ref_logits(with_nan + 1);
    with_nan[0] = NAN;
    with_nan[N_REF + 1] = NAN;
    int counts7[N_REF + 2];
    double expected7[N_REF + 2] = {0};
    memcpy(expected7 + 1, ref_p, sizeof ref_p);
    p.seed = 62;
    histogram(&p, with_nan, N_REF + 2, counts7);
    assert_true(chi2(counts7, expected7, N_REF + 2) < chi2_crit[N_REF - 1]);

    /* +inf dominates; two of them share. */
    const float one_inf[] = {0.0f, INFINITY, 5.0f};
    histogram(&p, one_inf, 3, counts);
    assert_int_equal(counts[1], N_DRAWS);
    assert_int_equal(sample_once(&greedy, one_inf, 3), 1);
    const float two_inf[] = {INFINITY, 0.0f, INFINITY};
    histogram(&p, two_inf, 3, counts);
    const double split[] = {0.5, 0, 0.5};
    assert_true(chi2(counts, split, 3) < chi2_crit[1]);

    /* Extreme but finite logits at a small temperature stay finite inside. */
    const float huge[] = {FLT_MAX, -FLT_MAX, FLT_MAX / 2};
    p.temperature = 1e-30f;
    histogram(&p, huge, 3, counts);
    assert_int_equal(counts[0], N_DRAWS);
}

/* qsort has no context argument in ISO C, hence the file-level key array. */
static const float *sort_keys;

/* The sampler's order: higher first, lower id on ties. */
static int by_key_desc(const void *a, const void *b)
{
    const float *l = sort_keys;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (l[x] != l[y])
        return l[x] > l[y] ? -1 : 1;
    return (x > y) - (x < y);
}

static void test_large_vocab(void **state)
{
    (void)state;
    enum { N = 262144, DRAWS = 64 };
    float *logits = malloc(N * sizeof *logits), *keys = malloc(N * sizeof *keys);
    int32_t *order = malloc(N * sizeof *order);
    bool *allowed = malloc(N);
    blade_rng r;
    blade_rng_seed(&r, 123);
    /* A long tail with a few standouts, like a real vocabulary row. */
    for (int32_t i = 0; i < N; i++)
        logits[i] = (float)(blade_rng_uniform(&r) * 10.0 - 5.0);
    for (int i = 0; i < 50; i++)
        logits[blade_rng_next(&r) % N] = (float)(8.0 + blade_rng_uniform(&r) * 4.0);
    logits[17] = -INFINITY;
    logits[18] = NAN;
    /* The reference reads NaN as the sampler does (-inf), which also keeps qsort's
     * comparisons consistent. */
    for (int32_t i = 0; i < N; i++) {
        keys[i] = isnan(logits[i]) ? -INFINITY : logits[i];
        order[i] = i;
    }
    sort_keys = keys;
    qsort(order, N, sizeof *order, by_key_desc);
    double probs_sum = 0.0, max = keys[order[0]];
    for (int32_t i = 0; i < N; i++)
        probs_sum += exp(keys[i] - max);

    const float temperature = 1.0f;
    for (int mode = 0; mode < 3; mode++) {
        blade_sampling_params p = plain(temperature, 300 + mode);
        memset(allowed, 0, N);
        if (mode == 0) {
            p.top_k = 40;
            for (int i = 0; i < 40; i++)
                allowed[order[i]] = true;
        } else if (mode == 1) {
            p.top_p = 0.9f;
            double cum = 0.0;
            for (int32_t i = 0; i < N; i++) {
                allowed[order[i]] = true;
                cum += exp(keys[order[i]] - max) / probs_sum;
                if (cum >= 0.9)
                    break;
            }
        } else {
            p.min_p = 0.3f;
            for (int32_t i = 0; i < N; i++)
                allowed[i] = exp(keys[i] - max) >= 0.3;
        }
        blade_sampler *s = make(&p, N);
        for (int d = 0; d < DRAWS; d++) {
            int32_t t = blade_sampler_sample(s, logits);
            assert_true(t >= 0 && t < N);
            assert_true(allowed[t]);
        }
        blade_sampler_free(s);
    }

    /* A flat row puts about half the vocabulary in a 0.5 nucleus: the sort then handles
     * a large set and must still cut exactly where the reference does. */
    for (int32_t i = 0; i < N; i++) {
        keys[i] = (float)(blade_rng_uniform(&r) * 2.0 - 1.0);
        order[i] = i;
    }
    sort_keys = keys;
    qsort(order, N, sizeof *order, by_key_desc);
    max = keys[order[0]];
    probs_sum = 0.0;
    for (int32_t i = 0; i < N; i++)
        probs_sum += exp(keys[i] - max);
    memset(allowed, 0, N);
    double cum = 0.0;
    int32_t nucleus = 0;
    while (cum < 0.5) {
        allowed[order[nucleus]] = true;
        cum += exp(keys[order[nucleus++]] - max) / probs_sum;
    }
    assert_true(nucleus > N / 4);
    blade_sampling_params flat = plain(temperature, 305);
    flat.top_p = 0.5f;
    blade_sampler *fs = make(&flat, N);
    int near_cut = 0;
    for (int d = 0; d < DRAWS; d++) {
        int32_t t = blade_sampler_sample(fs, keys);
        assert_true(t >= 0 && t < N && allowed[t]);
        near_cut += keys[t] < keys[order[nucleus * 9 / 10]];
    }
    /* The lightest tenth of the nucleus is drawn too, so the cut is not too early. */
    assert_true(near_cut > 0);
    blade_sampler_free(fs);

    /* With no filter the tail carries most of the mass, and draws land there. */
    blade_sampling_params p = plain(temperature, 310);
    blade_sampler *s = make(&p, N);
    int in_tail = 0;
    for (int d = 0; d < DRAWS; d++) {
        int32_t t = blade_sampler_sample(s, logits);
        assert_true(t != 17 && t != 18);
        in_tail += logits[t] < 8.0f;
    }
    assert_true(in_tail > DRAWS / 2);
    blade_sampler_free(s);
    free(allowed);
    free(order);
    free(keys);
    free(logits);
}

static void test_logprobs(void **state)
{
    (void)state;
    const float logits[] = {1.0f, 2.0f, 3.0f, -INFINITY, NAN, 0.5f};
    float out[6];
    blade_logits_to_logprobs(logits, 6, out);
    double ref[6], sum = 0.0;
    const float finite[] = {1.0f, 2.0f, 3.0f, 0.5f};
    softmax_ref(finite, 4, 1.0, ref);
    const int finite_ids[] = {0, 1, 2, 5};
    for (int i = 0; i < 4; i++) {
        assert_true(fabs(out[finite_ids[i]] - log(ref[i])) < 1e-6);
        sum += exp(out[finite_ids[i]]);
    }
    assert_true(fabs(sum - 1.0) < 1e-6);
    assert_true(out[3] == -INFINITY);
    assert_true(out[4] == -INFINITY);

    /* Max-subtraction: neither overflow nor total underflow. */
    const float big[] = {1e30f, 1e30f, 1000.0f};
    blade_logits_to_logprobs(big, 3, out);
    assert_true(fabs(out[0] - log(0.5)) < 1e-6);
    assert_true(fabs(out[1] - log(0.5)) < 1e-6);
    assert_true(isinf(out[2]) || out[2] < -1e29f);
    const float spread[] = {1000.0f, 0.0f};
    blade_logits_to_logprobs(spread, 2, out);
    assert_true(out[0] == 0.0f);
    assert_true(fabs(out[1] + 1000.0f) < 1e-3);

    const float none[] = {-INFINITY, NAN};
    blade_logits_to_logprobs(none, 2, out);
    assert_true(out[0] == -INFINITY && out[1] == -INFINITY);

    enum { N = 50000 };
    float *row = malloc(N * sizeof *row), *lp = malloc(N * sizeof *lp);
    blade_rng r;
    blade_rng_seed(&r, 8);
    for (int i = 0; i < N; i++)
        row[i] = (float)(blade_rng_uniform(&r) * 30.0 - 10.0);
    blade_logits_to_logprobs(row, N, lp);
    sum = 0.0;
    for (int i = 0; i < N; i++) {
        assert_true(lp[i] <= 0.0f);
        sum += exp(lp[i]);
    }
    assert_true(fabs(sum - 1.0) < 1e-5);
    free(row);
    free(lp);
}

static void test_top_logprobs(void **state)
{
    (void)state;
    const float lp[] = {-1.0f, -0.5f, -3.0f, -0.5f, -INFINITY, NAN, -2.0f};
    int32_t ids[10];
    float values[10];
    assert_int_equal(blade_top_logprobs(lp, 7, 3, ids, values), 3);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 3);
    assert_int_equal(ids[2], 0);
    assert_true(values[0] == -0.5f && values[1] == -0.5f && values[2] == -1.0f);

    static const int32_t all[] = {1, 3, 0, 6, 2};
    assert_int_equal(blade_top_logprobs(lp, 7, 10, ids, values), 5);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(ids[i], all[i]);
        assert_true(values[i] == lp[all[i]]);
    }
    assert_int_equal(blade_top_logprobs(lp, 7, 0, ids, values), 0);

    /* Against a full sort, on values with many ties. */
    enum { N = 10000, K = 20 };
    float *row = malloc(N * sizeof *row);
    int32_t *order = malloc(N * sizeof *order);
    blade_rng r;
    blade_rng_seed(&r, 9);
    for (int32_t i = 0; i < N; i++) {
        row[i] = -(float)(blade_rng_next(&r) % 500) / 16.0f;
        order[i] = i;
    }
    sort_keys = row;
    qsort(order, N, sizeof *order, by_key_desc);
    int32_t top_ids[K];
    float top_values[K];
    assert_int_equal(blade_top_logprobs(row, N, K, top_ids, top_values), K);
    for (int i = 0; i < K; i++) {
        assert_int_equal(top_ids[i], order[i]);
        assert_true(top_values[i] == row[order[i]]);
    }
    free(row);
    free(order);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rng_reference),
        cmocka_unit_test(test_exp_matches_libm),
        cmocka_unit_test(test_validate),
        cmocka_unit_test(test_greedy_argmax_lowest_id),
        cmocka_unit_test(test_repeat_penalty_positive),
        cmocka_unit_test(test_repeat_penalty_negative),
        cmocka_unit_test(test_repeat_penalty_once_per_distinct_token),
        cmocka_unit_test(test_repeat_penalty_window_and_prompt),
        cmocka_unit_test(test_presence_frequency),
        cmocka_unit_test(test_penalty_order),
        cmocka_unit_test(test_penalty_keeps_masked_tokens_masked),
        cmocka_unit_test(test_accept_out_of_range_ignored),
        cmocka_unit_test(test_filters_that_keep_one_equal_greedy),
        cmocka_unit_test(test_distribution_temperature_1),
        cmocka_unit_test(test_top_k_top_p_min_p_exclude),
        cmocka_unit_test(test_temperature_scaling),
        cmocka_unit_test(test_same_seed_same_sequence),
        cmocka_unit_test(test_golden_sequences),
        cmocka_unit_test(test_ties_break_to_lower_id),
        cmocka_unit_test(test_one_uniform_per_call),
        cmocka_unit_test(test_inf_and_nan),
        cmocka_unit_test(test_large_vocab),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_top_logprobs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

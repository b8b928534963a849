/* The load generator behind `blade bench serve`: the metric arithmetic against hand-computed
 * values, the real streaming client against a scripted SSE endpoint on 127.0.0.1 (known
 * delays, failures of every kind), the workloads' and arrivals' determinism, and `compare`'s
 * exit statuses. */
#include "testutil.h"

#include "blade/gguf.h"
#include "blade/synth.h"
#include "blade/tokenizer.h"
#include "blade/types.h"
#include "loadgen/client.h"
#include "loadgen/compare.h"
#include "loadgen/stats.h"
#include "loadgen/summary.h"
#include "loadgen/workload.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define EPS 1e-9

/* cmocka 1.1.5 (Debian 12) has no floating-point assertion. */
#define assert_near(a, b, eps) near((a), (b), (eps), #a, __FILE__, __LINE__)

static void near(double a, double b, double eps, const char *expr, const char *file, int line)
{
    if (!(fabs(a - b) <= eps))
        fail_msg("%s:%d: %s = %.17g, expected %.17g (+- %g)", file, line, expr, a, b, eps);
}

static char *g_tok_path;
static gguf_file *g_gguf;
static blade_tokenizer *g_tok;

/* A tiny made-up SentencePiece vocabulary: enough to build prompts and count tokens. */
static int setup_all(void **state)
{
    (void)state;
    curl_global_init(CURL_GLOBAL_DEFAULT);
    blade_synth_spec spec = {
        .arch = BLADE_ARCH_LLAMA, .n_vocab = 400, .n_embd = 16, .n_layer = 1, .n_head = 2, .n_head_kv = 1,
        .head_dim = 8, .n_ff = 32, .n_ctx = 2048, .rope_base = 10000.0f, .scheme = {.type = BLADE_TYPE_F32}, .seed = 3,
    };
    g_tok_path = temp_path("loadgen-tokenizer.gguf");
    blade_error err = {{0}};
    if (blade_synth_write(&spec, g_tok_path, false, &err) || !(g_gguf = gguf_open(g_tok_path, &err)) ||
        !(g_tok = blade_tokenizer_load(g_gguf, &err))) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown_all(void **state)
{
    (void)state;
    blade_tokenizer_free(g_tok);
    gguf_close(g_gguf);
    free(g_tok_path);
    curl_global_cleanup();
    return 0;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- pure arithmetic ---- */

static void test_percentile(void **state)
{
    (void)state;
    const double a[] = {1, 2, 3, 4};
    assert_near(lg_percentile(a, 4, 0), 1, EPS);
    assert_near(lg_percentile(a, 4, 50), 2.5, EPS);
    assert_near(lg_percentile(a, 4, 90), 3.7, EPS);  /* rank 2.7 */
    assert_near(lg_percentile(a, 4, 99), 3.97, EPS); /* rank 2.97 */
    assert_near(lg_percentile(a, 4, 100), 4, EPS);
    /* numpy.percentile([15, 20, 35, 40, 50], 40) == 29.0 */
    const double b[] = {15, 20, 35, 40, 50};
    assert_near(lg_percentile(b, 5, 40), 29, EPS);
    const double one[] = {7};
    assert_near(lg_percentile(one, 1, 99), 7, EPS);
    assert_true(isnan(lg_percentile(a, 0, 50)));

    double v[] = {4, 1, 3, 2};
    lg_dist d;
    lg_dist_compute(v, 4, &d);
    assert_int_equal(d.n, 4);
    assert_near(d.mean, 2.5, EPS);
    assert_near(d.median, 2.5, EPS);
    assert_near(d.p90, 3.7, EPS);
    assert_near(d.min, 1, EPS);
    assert_near(d.max, 4, EPS);
    lg_dist_compute(v, 0, &d);
    assert_true(isnan(d.mean) && isnan(d.p99));
}

static void test_cost(void **state)
{
    (void)state;
    /* $2/hour for an hour making a million tokens: $2 per million. */
    assert_near(lg_cost_per_million(2.0, 3600, 1e6), 2.0, EPS);
    /* 3.6 x 100 / 3600 / 5000 x 1e6 = 20 */
    assert_near(lg_cost_per_million(3.6, 100, 5000), 20.0, EPS);
    assert_true(isnan(lg_cost_per_million(2.0, 10, 0)));
}

static void test_slo_parse(void **state)
{
    (void)state;
    lg_slo s;
    char msg[256];
    assert_int_equal(lg_slo_parse("ttft=200,tpot=50", &s, msg, sizeof msg), 0);
    assert_near(s.ttft_ms, 200, EPS);
    assert_near(s.tpot_ms, 50, EPS);
    assert_near(s.e2e_ms, 0, EPS);
    assert_int_equal(lg_slo_parse("e2e=1500.5", &s, msg, sizeof msg), 0);
    assert_near(s.e2e_ms, 1500.5, EPS);
    assert_int_equal(lg_slo_parse("ttft=abc", &s, msg, sizeof msg), -1);
    assert_int_equal(lg_slo_parse("ttft=-3", &s, msg, sizeof msg), -1);
    assert_int_equal(lg_slo_parse("latency=3", &s, msg, sizeof msg), -1);
    assert_int_equal(lg_slo_parse("", &s, msg, sizeof msg), -1);
    /* A request with one token has no TPOT and meets a TPOT objective. */
    lg_slo t = {.ttft_ms = 100, .tpot_ms = 20};
    assert_true(lg_slo_met(&t, 100, NAN, 500));
    assert_false(lg_slo_met(&t, 100.5, 10, 500));
    assert_false(lg_slo_met(&t, NAN, 10, 500));
}

static lg_record ok_record(double start, const double *chunks, int32_t n, int64_t out)
{
    lg_record r = {.start = start, .end = chunks[n - 1], .n_chunks = n, .input_tokens = 10, .output_tokens = out,
                   .usage_reported = true, .http_status = 200};
    r.chunks = malloc((size_t)n * sizeof *r.chunks);
    memcpy(r.chunks, chunks, (size_t)n * sizeof *r.chunks);
    return r;
}

static lg_record failed_record(lg_failure f, int status, const char *msg)
{
    lg_record r = {.failure = f, .http_status = status, .error = strdup(msg)};
    return r;
}

/* Seven hand-made records, every figure worked out by hand. */
static void test_summary_by_hand(void **state)
{
    (void)state;
    lg_record recs[7];
    /* A: TTFT 50, E2E 70, TPOT (70-50)/2 = 10: meets the SLO */
    recs[0] = ok_record(0, (const double[]){0.05, 0.06, 0.07}, 3, 3);
    /* B: TTFT 150 misses; TPOT (160-150)/1 = 10 */
    recs[1] = ok_record(0, (const double[]){0.15, 0.16}, 2, 2);
    /* C: TTFT 50, TPOT (250-50)/2 = 100 misses */
    recs[2] = ok_record(0.1, (const double[]){0.15, 0.25, 0.35}, 3, 3);
    /* D: one token: TTFT 50, no TPOT: meets */
    recs[3] = ok_record(0.2, (const double[]){0.25}, 1, 1);
    recs[4] = failed_record(LG_FAIL_HTTP, 503, "overloaded");
    recs[5] = failed_record(LG_FAIL_HTTP, 503, "still overloaded");
    recs[6] = failed_record(LG_FAIL_TIMEOUT, 0, "timed out");
    lg_sample samples[2] = {
        {.t = 0, .kv_used = 20, .kv_total = 100, .kv_usage = 0.2, .hit_tokens = 100, .query_tokens = 200,
         .kv_utilisation = NAN},
        {.t = 1, .kv_used = 40, .kv_total = 100, .kv_usage = 0.4, .hit_tokens = 160, .query_tokens = 300,
         .kv_utilisation = 0.93},
    };
    lg_run_result r = {.records = recs, .n_records = 7, .duration = 1.0, .samples = samples, .n_samples = 2,
                       .scraped = true, .client_cpu = 0.3, .client_wall = 2.0, .client_peak_rss = 12 << 20};
    lg_slo slo = {.ttft_ms = 100, .tpot_ms = 20};
    lg_summary s;
    assert_int_equal(lg_summarize(&r, 3.6, &slo, &s), 0);
    assert_int_equal(s.completed, 4);
    assert_int_equal(s.failed, 3);
    assert_int_equal(s.input_tokens, 40);
    assert_int_equal(s.output_tokens, 9);
    assert_near(s.request_throughput, 4.0, EPS);
    assert_near(s.output_throughput, 9.0, EPS);
    assert_near(s.total_throughput, 49.0, EPS);
    assert_int_equal(s.good, 2);
    assert_near(s.goodput, 2.0, EPS);
    /* TTFT [50, 50, 50, 150]: p90 at rank 2.7 = 50 + 0.7 x 100 */
    assert_near(s.ttft.mean, 75, 1e-6);
    assert_near(s.ttft.median, 50, 1e-6);
    assert_near(s.ttft.p90, 120, 1e-6);
    /* TPOT [10, 10, 100] */
    assert_int_equal(s.tpot.n, 3);
    assert_near(s.tpot.mean, 40, 1e-6);
    assert_near(s.tpot.median, 10, 1e-6);
    /* ITL [10, 10, 10, 100, 100] */
    assert_int_equal(s.itl.n, 5);
    assert_near(s.itl.mean, 46, 1e-6);
    assert_near(s.itl.median, 10, 1e-6);
    /* E2E [70, 160, 250, 50] */
    assert_near(s.e2e.mean, 132.5, 1e-6);
    /* $3.6/hour for 1 s: 0.001 $ over 9 and 49 tokens */
    assert_near(s.cost_output, 0.001 / 9 * 1e6, 1e-6);
    assert_near(s.cost_total, 0.001 / 49 * 1e6, 1e-6);
    assert_near(s.hours_output, 1.0 / 3600 / 9 * 1e6, 1e-6);
    assert_int_equal(s.n_causes, 2);
    assert_string_equal(s.causes[0].cause, "HTTP 503");
    assert_int_equal(s.causes[0].count, 2);
    assert_string_equal(s.causes[0].example, "overloaded");
    assert_string_equal(s.causes[1].cause, "timeout");
    assert_int_equal(s.causes[1].count, 1);
    assert_near(s.kv_usage_mean, 0.3, EPS);
    assert_near(s.kv_usage_peak, 0.4, EPS);
    assert_near(s.prefix_hit_rate, 0.6, EPS);
    assert_near(s.kv_utilisation, 0.93, EPS);
    /* The client's own cost: 0.3 s of CPU in 2 s is 15% of a core, over the 10% it warns at. */
    assert_near(s.client_cpu_share, 0.15, EPS);
    assert_int_equal(s.client_peak_rss, 12 << 20);
    FILE *sink = fopen("/dev/null", "w");
    assert_true(lg_summary_warn_client(sink, &s));
    json_t *doc = json_object();
    lg_summary_to_json(&s, doc);
    json_t *client = json_object_get(doc, "client");
    assert_near(json_real_value(json_object_get(client, "cpu_s")), 0.3, EPS);
    assert_near(json_real_value(json_object_get(client, "wall_s")), 2.0, EPS);
    assert_near(json_real_value(json_object_get(client, "cpu_share")), 0.15, EPS);
    assert_int_equal(json_integer_value(json_object_get(client, "peak_rss_bytes")), 12 << 20);
    json_decref(doc);
    r.client_cpu = 0.1;

    assert_int_equal(lg_summarize(&r, 0, NULL, &s), 0);
    assert_false(lg_summary_warn_client(sink, &s));
    fclose(sink);
    assert_false(s.have_slo);
    assert_true(isnan(s.goodput) && isnan(s.cost_output));
    for (int i = 0; i < 7; i++) {
        free(recs[i].chunks);
        free(recs[i].error);
    }
}

static void test_prom_value(void **state)
{
    (void)state;
    const char *text = "# HELP blade:kv_blocks_used x\n# TYPE blade:kv_blocks_used gauge\n"
                       "blade:kv_blocks_used 12\nblade:kv_blocks_used_total 99\n"
                       "blade:http_requests_total{status=\"200\"} 5\nblade:prefix_cache_hit_rate 0.25\n";
    double v = -1;
    assert_true(lg_prom_value(text, "blade:kv_blocks_used", &v));
    assert_near(v, 12, EPS);
    assert_true(lg_prom_value(text, "blade:prefix_cache_hit_rate", &v));
    assert_near(v, 0.25, EPS);
    assert_false(lg_prom_value(text, "blade:http_requests_total", &v));
    assert_false(lg_prom_value(text, "blade:kv_blocks", &v));
}

/* ---- arrivals and workloads ---- */

static void test_arrivals(void **state)
{
    (void)state;
    lg_arrivals a, b, c;
    lg_arrivals_init(&a, INFINITY, 1, 5);
    for (int i = 0; i < 10; i++)
        assert_near(lg_arrivals_next(&a), 0, 0);
    const double shapes[] = {1.0, 0.5, 2.0};
    for (size_t k = 0; k < 3; k++) {
        lg_arrivals_init(&a, 10, shapes[k], 5);
        lg_arrivals_init(&b, 10, shapes[k], 5);
        lg_arrivals_init(&c, 10, shapes[k], 6);
        bool differ = false;
        double prev = lg_arrivals_next(&a), sum = 0, sum2 = 0;
        assert_near(prev, 0, 0);
        lg_arrivals_next(&b);
        lg_arrivals_next(&c);
        enum { N = 20000 };
        for (int i = 0; i < N; i++) {
            double t = lg_arrivals_next(&a);
            assert_near(t, lg_arrivals_next(&b), 0);
            differ |= t != lg_arrivals_next(&c);
            double gap = t - prev;
            sum += gap;
            sum2 += gap * gap;
            prev = t;
        }
        assert_true(differ);
        /* gaps of mean 1/rate, squared coefficient of variation 1/shape */
        double mean = sum / N, var = sum2 / N - mean * mean;
        assert_true(fabs(mean - 0.1) < 0.004);
        assert_true(fabs(var / (mean * mean) - 1 / shapes[k]) < 0.15 / shapes[k]);
    }
}

static lg_workload *workload(lg_workload_config c)
{
    blade_error err = {{0}};
    lg_workload *w = lg_workload_new(&c, g_tok, 2048, &err);
    if (!w)
        fail_msg("%s", err.msg);
    return w;
}

static bool same_session(const lg_session *a, const lg_session *b)
{
    if (a->n_turns != b->n_turns)
        return false;
    for (int32_t k = 0; k < a->n_turns; k++) {
        const lg_turn *x = &a->turns[k], *y = &b->turns[k];
        if (x->n_tokens != y->n_tokens || x->output_len != y->output_len ||
            memcmp(x->tokens, y->tokens, (size_t)x->n_tokens * sizeof *x->tokens))
            return false;
    }
    return true;
}

/* Same seed, same sessions (asked in any order); another seed, other sessions. */
static void check_deterministic(lg_workload_config c, int64_t n)
{
    lg_workload *a = workload(c), *b = workload(c);
    c.seed += 1;
    lg_workload *other = workload(c);
    blade_error err = {{0}};
    bool any_differs = false;
    for (int64_t i = 0; i < n; i++) {
        lg_session x, y, z;
        assert_int_equal(lg_workload_session(a, i, &x, &err), 0);
        assert_int_equal(lg_workload_session(b, n - 1 - i, &y, &err), 0);
        lg_session_free(&y);
        assert_int_equal(lg_workload_session(b, i, &y, &err), 0);
        assert_int_equal(lg_workload_session(other, i, &z, &err), 0);
        assert_true(same_session(&x, &y));
        any_differs |= !same_session(&x, &z);
        lg_session_free(&x);
        lg_session_free(&y);
        lg_session_free(&z);
    }
    assert_true(any_differs);
    lg_workload_free(a);
    lg_workload_free(b);
    lg_workload_free(other);
}

static void test_workload_random(void **state)
{
    (void)state;
    lg_workload_config c = {.kind = LG_WORKLOAD_RANDOM, .seed = 11, .input_len = {5, 40}, .output_len = {3, 9}};
    check_deterministic(c, 30);
    lg_workload *w = workload(c);
    blade_error err = {{0}};
    bool bos = blade_tokenizer_wants_bos(g_tok);
    for (int64_t i = 0; i < 50; i++) {
        lg_session s;
        assert_int_equal(lg_workload_session(w, i, &s, &err), 0);
        assert_int_equal(s.n_turns, 1);
        assert_in_range(s.turns[0].n_tokens, 5, 40);
        assert_in_range(s.turns[0].output_len, 3, 9);
        if (bos)
            assert_int_equal(s.turns[0].tokens[0], blade_tokenizer_bos(g_tok));
        for (int32_t k = bos; k < s.turns[0].n_tokens; k++)
            assert_int_equal(blade_tokenizer_attr(g_tok, s.turns[0].tokens[k]), BLADE_TOKEN_NORMAL);
        lg_session_free(&s);
    }
    lg_workload_free(w);
    /* The longest request must fit the server's context. */
    c.input_len = (lg_range){2000, 2000};
    c.output_len = (lg_range){100, 100};
    assert_null(lg_workload_new(&c, g_tok, 2048, &err));
    assert_non_null(strstr(err.msg, "context of 2048"));
}

static void test_workload_shared_prefix(void **state)
{
    (void)state;
    lg_workload_config c = {.kind = LG_WORKLOAD_SHARED_PREFIX, .seed = 3, .groups = 3, .prefix_len = 24,
                            .input_len = {4, 8}};
    check_deterministic(c, 12);
    lg_workload *w = workload(c);
    blade_error err = {{0}};
    lg_session s[6];
    for (int i = 0; i < 6; i++)
        assert_int_equal(lg_workload_session(w, i, &s[i], &err), 0);
    for (int i = 0; i < 3; i++) {
        const lg_turn *a = &s[i].turns[0], *b = &s[i + 3].turns[0], *other = &s[(i + 1) % 3].turns[0];
        assert_in_range(a->n_tokens, 28, 32);
        /* request i and i + G share the prefix, not the rest; other groups share nothing */
        assert_memory_equal(a->tokens, b->tokens, 24 * sizeof(int32_t));
        assert_true(a->n_tokens != b->n_tokens || memcmp(a->tokens + 24, b->tokens + 24,
                                                         (size_t)(a->n_tokens - 24) * sizeof(int32_t)));
        assert_memory_not_equal(a->tokens, other->tokens, 24 * sizeof(int32_t));
    }
    for (int i = 0; i < 6; i++)
        lg_session_free(&s[i]);
    lg_workload_free(w);
}

static void test_workload_multi_turn(void **state)
{
    (void)state;
    lg_workload_config c = {.kind = LG_WORKLOAD_MULTI_TURN, .seed = 9, .turns = 3, .input_len = {6, 10},
                            .output_len = {4, 7}};
    check_deterministic(c, 8);
    lg_workload *w = workload(c);
    assert_int_equal(lg_workload_turns(w), 3);
    blade_error err = {{0}};
    lg_session s;
    assert_int_equal(lg_workload_session(w, 2, &s, &err), 0);
    assert_int_equal(s.n_turns, 3);
    for (int k = 1; k < 3; k++) {
        const lg_turn *prev = &s.turns[k - 1], *t = &s.turns[k];
        /* the whole conversation so far: the previous prompt, its answer and a new message */
        int32_t grown = t->n_tokens - prev->n_tokens - prev->output_len;
        assert_in_range(grown, 6, 10);
        assert_memory_equal(t->tokens, prev->tokens, (size_t)prev->n_tokens * sizeof(int32_t));
    }
    lg_session_free(&s);
    lg_workload_free(w);
}

static void test_workload_long_interference(void **state)
{
    (void)state;
    lg_workload_config c = {.kind = LG_WORKLOAD_LONG_INTERFERENCE, .seed = 4, .long_len = 300, .long_every = 5,
                            .input_len = {8, 8}, .output_len = {16, 16}};
    check_deterministic(c, 20);
    lg_workload *w = workload(c);
    blade_error err = {{0}};
    for (int64_t block = 0; block < 6; block++) {
        int longs = 0;
        for (int64_t i = block * 5; i < block * 5 + 5; i++) {
            lg_session s;
            assert_int_equal(lg_workload_session(w, i, &s, &err), 0);
            assert_true(s.turns[0].n_tokens == 300 || s.turns[0].n_tokens == 8);
            longs += s.turns[0].n_tokens == 300;
            lg_session_free(&s);
        }
        assert_int_equal(longs, 1);
    }
    lg_workload_free(w);
}

/* Prompts cut from a text are windows of its tokens. */
static void test_workload_text(void **state)
{
    (void)state;
    const char *text = "abc abd abe abf the cat sat on the mat and then it ran away quickly";
    char *path = temp_path("loadgen-text.txt");
    assert_int_equal(write_file(path, text, strlen(text)), 0);
    int32_t *ids = NULL;
    size_t n = 0;
    blade_error err = {{0}};
    assert_int_equal(blade_tokenizer_encode(g_tok, text, strlen(text), false, false, &ids, &n, &err), 0);
    lg_workload_config c = {.kind = LG_WORKLOAD_RANDOM, .seed = 1, .input_len = {10, 10}, .output_len = {2, 2},
                            .text_path = path};
    check_deterministic(c, 10);
    lg_workload *w = workload(c);
    lg_session s;
    assert_int_equal(lg_workload_session(w, 0, &s, &err), 0);
    int32_t b = blade_tokenizer_wants_bos(g_tok) ? 1 : 0;
    bool found = false;
    for (size_t at = 0; at < n && !found; at++) {
        bool match = true;
        for (int32_t k = b; k < 10 && match; k++)
            match = s.turns[0].tokens[k] == ids[(at + (size_t)(k - b)) % n];
        found = match;
    }
    assert_true(found);
    lg_session_free(&s);
    lg_workload_free(w);
    free(ids);
    free(path);
}

static void test_workload_file(void **state)
{
    (void)state;
    const char *json =
        "[{\"conversations\": [{\"from\": \"human\", \"value\": \"tell me about the cat on the mat\"},"
        "                      {\"from\": \"gpt\", \"value\": \"the cat sat on the mat all day long\"}]},"
        " {\"conversations\": [{\"from\": \"gpt\", \"value\": \"answer first is malformed\"},"
        "                      {\"from\": \"human\", \"value\": \"question\"}]},"
        " {\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}, {\"from\": \"gpt\", \"value\": \"x\"}]},"
        " {\"id\": \"no conversations\"},"
        " {\"conversations\": [{\"from\": \"human\", \"value\": \"why is the sky blue at noon\"},"
        "                      {\"from\": \"gpt\", \"value\": \"because of rayleigh scattering of light\"}]},"
        " {\"conversations\": [{\"from\": \"human\", \"value\": \"write a poem about rain\"},"
        "                      {\"from\": \"gpt\", \"value\": \"rain falls soft on quiet roofs tonight\"}]},"
        " {\"conversations\": [{\"from\": \"human\", \"value\": \"count from one to five\"},"
        "                      {\"from\": \"gpt\", \"value\": \"one two three four five\"}]}]";
    char *path = temp_path("loadgen-sharegpt.json");
    assert_int_equal(write_file(path, json, strlen(json)), 0);
    lg_workload_config c = {.kind = LG_WORKLOAD_FILE, .seed = 2, .dataset_path = path};
    check_deterministic(c, 8);
    lg_workload *w = workload(c);
    blade_error err = {{0}};
    size_t skipped;
    assert_int_equal(lg_workload_dataset_size(w, &skipped), 4);
    assert_int_equal(skipped, 3);
    /* Four usable conversations, each once per cycle of four requests. */
    const char *humans[] = {"tell me about the cat on the mat", "why is the sky blue at noon",
                            "write a poem about rain", "count from one to five"};
    const char *gpts[] = {"the cat sat on the mat all day long", "because of rayleigh scattering of light",
                          "rain falls soft on quiet roofs tonight", "one two three four five"};
    int seen[4] = {0};
    for (int64_t i = 0; i < 8; i++) {
        lg_session s;
        assert_int_equal(lg_workload_session(w, i, &s, &err), 0);
        int match = -1;
        for (int k = 0; k < 4; k++) {
            int32_t *ids = NULL, *ans = NULL;
            size_t n = 0, m = 0;
            assert_int_equal(blade_tokenizer_encode(g_tok, humans[k], strlen(humans[k]),
                                                    blade_tokenizer_wants_bos(g_tok), false, &ids, &n, &err),
                             0);
            assert_int_equal(blade_tokenizer_encode(g_tok, gpts[k], strlen(gpts[k]), false, false, &ans, &m, &err), 0);
            if ((size_t)s.turns[0].n_tokens == n && !memcmp(ids, s.turns[0].tokens, n * sizeof *ids)) {
                match = k;
                assert_int_equal(s.turns[0].output_len, (int32_t)m);
            }
            free(ids);
            free(ans);
        }
        assert_true(match >= 0);
        seen[match]++;
        lg_session_free(&s);
    }
    for (int k = 0; k < 4; k++)
        assert_int_equal(seen[k], 2);
    lg_workload_free(w);
    lg_workload_config bad = {.kind = LG_WORKLOAD_FILE, .dataset_path = "/nonexistent/sharegpt.json"};
    assert_null(lg_workload_new(&bad, g_tok, 0, &err));
    free(path);
}

/* ---- a scripted SSE endpoint ---- */

enum fake_mode {
    FAKE_NORMAL,
    FAKE_EVERY_OTHER_503, /* even-numbered completions get 503 */
    FAKE_NO_USAGE,        /* no usage chunk: the client counts with the tokenizer */
    FAKE_TRUNCATED,       /* two tokens, then the connection closes without [DONE] */
    FAKE_SLOW,            /* nothing for 1 s */
};

typedef struct fake {
    int fd, port;
    pthread_t thread;
    enum fake_mode mode;
    bool blade_metrics; /* /metrics answers with blade: figures */
    int token_ms;       /* between tokens; 0: 20 */
    int busy_metrics_ms; /* /metrics answers this late while a completion streams */
    atomic_int completions, scrapes, handlers, streaming;
} fake;

static fake g_fake;

/* Pieces of every token of the scripted stream. */
static const char *const PIECES[] = {"Once", " upon", " a", " time", " there", " was", " a", " cat"};

static void send_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return;
        p += w;
        n -= (size_t)w;
    }
}

static void send_str(int fd, const char *s)
{
    send_all(fd, s, strlen(s));
}

static void respond(int fd, const char *status, const char *type, const char *body)
{
    char head[256];
    snprintf(head, sizeof head, "HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
             status, type, strlen(body));
    send_str(fd, head);
    send_str(fd, body);
}

static void sse(int fd, const char *json)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "data: %s\n\n", json);
    send_str(fd, buf);
}

/* First token after 100 ms, then one every token_ms (20 ms); the usage chunk last. One event
 * is sent in two writes, split mid-JSON, and the stream uses CRLF line ends once. */
static void stream_tokens(fake *f, int fd, json_t *body)
{
    int n = (int)json_integer_value(json_object_get(body, "max_tokens"));
    size_t prompt = json_array_size(json_object_get(body, "prompt"));
    int index = atomic_fetch_add(&f->completions, 1);
    if (f->mode == FAKE_EVERY_OTHER_503 && index % 2 == 0) {
        respond(fd, "503 Service Unavailable", "application/json",
                "{\"error\": {\"message\": \"server overloaded\", \"type\": \"server_error\"}}");
        return;
    }
    if (f->mode == FAKE_SLOW)
        sleep_ms(1000);
    send_str(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n");
    for (int i = 0; i < n; i++) {
        sleep_ms(i == 0 ? 100 : f->token_ms ? f->token_ms : 20);
        if (f->mode == FAKE_TRUNCATED && i == 2)
            return;
        char chunk[256];
        snprintf(chunk, sizeof chunk,
                 "{\"object\": \"text_completion\", \"choices\": [{\"index\": 0, \"text\": \"%s\", "
                 "\"finish_reason\": %s}]}",
                 PIECES[i % 8], i == n - 1 ? "\"length\"" : "null");
        if (i == 1) {
            char first[16];
            snprintf(first, sizeof first, "%.10s", chunk);
            send_str(fd, "data: ");
            send_str(fd, first);
            sleep_ms(2);
            send_str(fd, chunk + strlen(first));
            send_str(fd, "\r\n\r\n");
        } else {
            sse(fd, chunk);
        }
    }
    if (f->mode != FAKE_NO_USAGE) {
        char usage[256];
        snprintf(usage, sizeof usage,
                 "{\"choices\": [], \"usage\": {\"prompt_tokens\": %zu, \"completion_tokens\": %d, "
                 "\"total_tokens\": %zu}}",
                 prompt, n, prompt + (size_t)n);
        sse(fd, usage);
    }
    send_str(fd, "data: [DONE]\n\n");
}

static void stream_completion(fake *f, int fd, json_t *body)
{
    atomic_fetch_add(&f->streaming, 1);
    stream_tokens(f, fd, body);
    atomic_fetch_sub(&f->streaming, 1);
}

static void metrics(fake *f, int fd)
{
    if (f->busy_metrics_ms && atomic_load(&f->streaming) > 0)
        sleep_ms(f->busy_metrics_ms);
    if (!f->blade_metrics) {
        respond(fd, "404 Not Found", "text/plain", "not found");
        return;
    }
    int k = atomic_fetch_add(&f->scrapes, 1);
    char body[512];
    snprintf(body, sizeof body,
             "# TYPE blade:kv_blocks_used gauge\nblade:kv_blocks_used %d\nblade:kv_blocks_total 100\n"
             "blade:kv_cache_usage_perc %g\nblade:prefix_cache_hits_total %d\nblade:prefix_cache_queries_total %d\n"
             "blade:num_requests_running 1\nblade:num_requests_waiting 0\n",
             10 + k, (10 + k) / 100.0, 5 * k, 10 * k);
    respond(fd, "200 OK", "text/plain; version=0.0.4", body);
}

static void *handle(void *arg)
{
    int fd = (int)(intptr_t)arg;
    char req[16384];
    size_t n = 0;
    char *body = NULL;
    while (n < sizeof req - 1) {
        ssize_t r = recv(fd, req + n, sizeof req - 1 - n, 0);
        if (r <= 0)
            break;
        n += (size_t)r;
        req[n] = 0;
        char *end = strstr(req, "\r\n\r\n");
        if (!end)
            continue;
        const char *cl = strstr(req, "Content-Length: ");
        size_t want = cl ? (size_t)atoi(cl + 16) : 0;
        if (n - (size_t)(end + 4 - req) >= want) {
            body = end + 4;
            break;
        }
    }
    if (body && !strncmp(req, "POST /v1/completions ", 21)) {
        json_t *j = json_loads(body, 0, NULL);
        stream_completion(&g_fake, fd, j);
        json_decref(j);
    } else if (body && !strncmp(req, "GET /metrics ", 13)) {
        metrics(&g_fake, fd);
    } else if (body && !strncmp(req, "GET /v1/models ", 15)) {
        respond(fd, "200 OK", "application/json",
                "{\"object\": \"list\", \"data\": [{\"id\": \"fake-model\", \"max_model_len\": 2048}]}");
    } else if (body) {
        respond(fd, "404 Not Found", "application/json", "{\"error\": {\"message\": \"no such route\"}}");
    }
    close(fd);
    atomic_fetch_sub(&g_fake.handlers, 1);
    return NULL;
}

static void *accept_loop(void *arg)
{
    fake *f = arg;
    for (;;) {
        int c = accept(f->fd, NULL, NULL);
        if (c < 0)
            return NULL;
        atomic_fetch_add(&f->handlers, 1);
        pthread_t t;
        if (pthread_create(&t, NULL, handle, (void *)(intptr_t)c) != 0) {
            close(c);
            atomic_fetch_sub(&f->handlers, 1);
            continue;
        }
        pthread_detach(t);
    }
}

static int fake_start(void **state)
{
    (void)state;
    fake *f = &g_fake;
    memset(f, 0, sizeof *f);
    f->fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (f->fd < 0 || bind(f->fd, (struct sockaddr *)&a, sizeof a) || listen(f->fd, 64) ||
        getsockname(f->fd, (struct sockaddr *)&a, &len))
        return -1;
    f->port = ntohs(a.sin_port);
    return pthread_create(&f->thread, NULL, accept_loop, f) ? -1 : 0;
}

static int fake_stop(void **state)
{
    (void)state;
    shutdown(g_fake.fd, SHUT_RDWR);
    close(g_fake.fd);
    pthread_join(g_fake.thread, NULL);
    for (int i = 0; i < 300 && atomic_load(&g_fake.handlers) > 0; i++)
        sleep_ms(10);
    return 0;
}

static void fake_url(char *buf, size_t cap)
{
    snprintf(buf, cap, "http://127.0.0.1:%d", g_fake.port);
}

static lg_run_config run_config(const char *url, const lg_workload *w, int64_t n)
{
    lg_run_config c = {.url = url, .model = "fake-model", .workload = w, .tok = g_tok, .num_requests = n,
                       .request_rate = INFINITY, .burstiness = 1, .timeout = 10, .warmup = true,
                       .scrape_interval = 0.05};
    return c;
}

static lg_workload *fixed_workload(int32_t in, int32_t out)
{
    lg_workload_config c = {.kind = LG_WORKLOAD_RANDOM, .input_len = {in, in}, .output_len = {out, out}};
    return workload(c);
}

/* TTFT ~100 ms, then 5 gaps of ~20 ms: TPOT ~20 ms, E2E ~200 ms; counts from usage. The
 * lower bounds are hard (the endpoint sleeps that long); the upper ones leave room for a
 * loaded machine, and single gaps are not checked, since a client that is scheduled late
 * reads two chunks at once. */
static void test_client_timing(void **state)
{
    (void)state;
    g_fake.mode = FAKE_NORMAL;
    g_fake.blade_metrics = true;
    char url[64];
    fake_url(url, sizeof url);
    lg_workload *w = fixed_workload(8, 6);
    lg_run_config c = run_config(url, w, 3);
    lg_run_result r;
    blade_error err = {{0}};
    assert_int_equal(lg_run(&c, &r, &err), 0);
    assert_int_equal(r.n_records, 3);
    for (size_t i = 0; i < r.n_records; i++) {
        const lg_record *q = &r.records[i];
        assert_int_equal(q->failure, LG_OK);
        assert_true(q->usage_reported);
        assert_int_equal(q->input_tokens, 8);
        assert_int_equal(q->output_tokens, 6);
        assert_int_equal(q->n_chunks, 6);
        double ttft = lg_record_ttft(q) * 1e3, tpot = lg_record_tpot(q) * 1e3, e2e = lg_record_e2e(q) * 1e3;
        assert_true(ttft >= 99 && ttft < 1000);
        assert_true(e2e >= 199 && e2e < 1500);
        assert_true(tpot > 0 && tpot < 300);
        assert_near(tpot, (e2e - ttft) / 5, 1e-9);
    }
    lg_summary s;
    lg_slo slo = {.ttft_ms = 1000, .tpot_ms = 100};
    assert_int_equal(lg_summarize(&r, 1.0, &slo, &s), 0);
    assert_int_equal(s.completed, 3);
    assert_int_equal(s.itl.n, 15);
    assert_true(s.itl.median >= 15 && s.itl.median < 100);
    assert_true(s.tpot.mean >= 15 && s.tpot.mean < 100);
    assert_int_equal(s.good, 3);
    assert_near(s.goodput, 3 / r.duration, EPS);
    assert_near(s.cost_output, r.duration / 3600 / 18 * 1e6, 1e-9);
    /* blade-style /metrics, sampled at the start, every 50 ms and at the end */
    assert_true(r.scraped);
    assert_true(r.n_samples >= 3);
    assert_near(s.prefix_hit_rate, 0.5, EPS);
    assert_near(s.kv_blocks_total, 100, EPS);
    lg_run_result_free(&r);
    lg_workload_free(w);
    g_fake.blade_metrics = false;
}

static void test_client_failures(void **state)
{
    (void)state;
    char url[64];
    fake_url(url, sizeof url);
    lg_workload *w = fixed_workload(8, 4);
    blade_error err = {{0}};
    lg_run_result r;
    lg_summary s;

    /* The warm-up is request 0 and gets a 503: the run cannot start, and says why. */
    g_fake.mode = FAKE_EVERY_OTHER_503;
    atomic_store(&g_fake.completions, 0);
    lg_run_config c = run_config(url, w, 4);
    assert_int_equal(lg_run(&c, &r, &err), -1);
    assert_non_null(strstr(err.msg, "HTTP 503"));
    assert_non_null(strstr(err.msg, "server overloaded"));

    /* Without a warm-up, half the requests fail with 503 and the rest succeed. */
    atomic_store(&g_fake.completions, 0);
    c.warmup = false;
    c.max_concurrency = 1;
    assert_int_equal(lg_run(&c, &r, &err), 0);
    assert_int_equal(lg_summarize(&r, 0, NULL, &s), 0);
    assert_int_equal(s.completed, 2);
    assert_int_equal(s.failed, 2);
    assert_int_equal(s.n_causes, 1);
    assert_string_equal(s.causes[0].cause, "HTTP 503");
    assert_string_equal(s.causes[0].example, "server overloaded");
    assert_false(r.scraped);
    lg_run_result_free(&r);

    /* No usage: the output is counted with the tokenizer. */
    g_fake.mode = FAKE_NO_USAGE;
    c.num_requests = 1;
    assert_int_equal(lg_run(&c, &r, &err), 0);
    assert_int_equal(r.n_records, 1);
    assert_false(r.records[0].usage_reported);
    int32_t *ids = NULL;
    size_t n = 0;
    const char *text = "Once upon a time";
    assert_int_equal(blade_tokenizer_encode(g_tok, text, strlen(text), false, false, &ids, &n, &err), 0);
    assert_int_equal(r.records[0].output_tokens, (int64_t)n);
    assert_int_equal(r.records[0].input_tokens, 8);
    free(ids);
    lg_run_result_free(&r);

    /* A stream that breaks off before [DONE]. */
    g_fake.mode = FAKE_TRUNCATED;
    assert_int_equal(lg_run(&c, &r, &err), 0);
    assert_int_equal(r.records[0].failure, LG_FAIL_STREAM);
    lg_run_result_free(&r);

    /* Over the time limit. */
    g_fake.mode = FAKE_SLOW;
    c.timeout = 0.3;
    assert_int_equal(lg_run(&c, &r, &err), 0);
    assert_int_equal(r.records[0].failure, LG_FAIL_TIMEOUT);
    lg_run_result_free(&r);

    /* Nothing listening. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    char dead[64];
    snprintf(dead, sizeof dead, "http://127.0.0.1:%d", ntohs(a.sin_port));
    c.url = dead;
    c.num_requests = 3;
    c.max_concurrency = 0;
    assert_int_equal(lg_run(&c, &r, &err), 0);
    assert_int_equal(lg_summarize(&r, 0, NULL, &s), 0);
    assert_int_equal(s.failed, 3);
    assert_string_equal(s.causes[0].cause, "connection error");
    lg_run_result_free(&r);
    g_fake.mode = FAKE_NORMAL;
    lg_workload_free(w);
}

/* Multi-turn: turn k+1 leaves only after turn k is answered. */
static void test_client_multi_turn_order(void **state)
{
    (void)state;
    g_fake.mode = FAKE_NORMAL;
    char url[64];
    fake_url(url, sizeof url);
    lg_workload_config wc = {.kind = LG_WORKLOAD_MULTI_TURN, .turns = 3, .input_len = {4, 4}, .output_len = {2, 2}};
    lg_workload *w = workload(wc);
    lg_run_config c = run_config(url, w, 5); /* two sessions: 3 turns and 2 */
    c.warmup = false;
    c.scrape_interval = 0;
    lg_run_result r;
    blade_error err = {{0}};
    assert_int_equal(lg_run(&c, &r, &err), 0);
    assert_int_equal(r.n_records, 5);
    for (size_t i = 0; i < r.n_records; i++)
        for (size_t j = 0; j < r.n_records; j++) {
            const lg_record *a = &r.records[i], *b = &r.records[j];
            if (a->session == b->session && b->turn == a->turn + 1)
                assert_true(b->start >= a->end);
        }
    lg_run_result_free(&r);
    lg_workload_free(w);
}

/* User + system seconds. */
static double rusage_cpu(const struct rusage *ru)
{
    return (double)ru->ru_utime.tv_sec + (double)ru->ru_utime.tv_usec * 1e-6 + (double)ru->ru_stime.tv_sec +
           (double)ru->ru_stime.tv_usec * 1e-6;
}

/* CPU seconds of the calling thread: lg_run's alone, since the endpoint has threads of its
 * own in this process. */
static double thread_cpu(void)
{
    struct rusage ru;
    getrusage(RUSAGE_THREAD, &ru);
    return rusage_cpu(&ru);
}

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A run bounded by time: after 0.1 s nothing new starts and the four requests in flight
 * (380 ms each) are waited for on their sockets. A client that polled for them would spend
 * most of the run's wall time on the CPU; this one must stay under 5%. */
static void test_client_sleeps_after_duration(void **state)
{
    (void)state;
    g_fake.mode = FAKE_NORMAL;
    g_fake.token_ms = 40;
    char url[64];
    fake_url(url, sizeof url);
    lg_workload *w = fixed_workload(8, 8); /* 100 ms + 7 x 40 ms */
    lg_run_config c = run_config(url, w, 0);
    c.duration = 0.1;
    c.max_concurrency = 4;
    c.scrape_interval = 0;
    lg_run_result r;
    blade_error err = {{0}};
    double cpu0 = thread_cpu(), t0 = wall_now();
    assert_int_equal(lg_run(&c, &r, &err), 0);
    double cpu = thread_cpu() - cpu0, wall = wall_now() - t0;
    fprintf(stderr, "client: %.1f ms of CPU in %.0f ms\n", cpu * 1e3, wall * 1e3);
    assert_int_equal(r.n_records, 4);
    assert_true(cpu < 0.05 * wall);
    /* What the run reports of itself: this process (the endpoint too), over the same span. */
    assert_true(r.client_wall > 0.3 && r.client_wall <= wall);
    assert_true(r.client_cpu > 0 && r.client_peak_rss > 0);
    lg_run_result_free(&r);
    lg_workload_free(w);
}

/* ---- the command line ---- */

static void test_cli_serve(void **state)
{
    (void)state;
    g_fake.mode = FAKE_NORMAL;
    char *json = temp_path("loadgen-serve.json"), *html = temp_path("loadgen-serve.html");
    unlink(json);
    unlink(html);
    char args[2048];
    snprintf(args, sizeof args,
             "bench serve --url http://127.0.0.1:%d --tokenizer '%s' --workload random --num-requests 4 "
             "--input-len 8 --output-len 3 --price-per-hour 2 --slo ttft=1000,tpot=200 --json '%s' --report '%s'",
             g_fake.port, g_tok_path, json, html);
    char *out = NULL;
    assert_int_equal(run_blade(args, &out, 1), 0);
    assert_non_null(strstr(out, "4 completed, 0 failed"));
    assert_non_null(strstr(out, "per 1M output tokens"));
    free(out);
    json_t *doc = json_load_file(json, 0, NULL);
    assert_non_null(doc);
    json_t *res = json_object_get(doc, "results");
    assert_int_equal(json_integer_value(json_object_get(res, "completed")), 4);
    assert_int_equal(json_integer_value(json_object_get(res, "output_tokens")), 12);
    assert_int_equal(json_integer_value(json_object_get(res, "good_requests")), 4);
    assert_string_equal(json_string_value(json_object_get(json_object_get(json_object_get(doc, "config"), "workload"),
                                                          "name")),
                        "random");
    assert_int_equal(json_array_size(json_object_get(doc, "requests")), 4);
    json_decref(doc);
    size_t len;
    char *page = read_file(html, &len);
    assert_non_null(page);
    assert_non_null(strstr(page, "<svg"));
    assert_non_null(strstr(page, "TTFT: cumulative distribution"));
    assert_null(strstr(page, "<script"));
    free(page);

    /* The ablation varies the scheduling flags and the KV type itself. */
    assert_int_equal(run_blade("bench ablation --workload random --scheduler static", &out, 1), 2);
    assert_non_null(strstr(out, "what the ablation varies"));
    free(out);
    assert_int_equal(run_blade("bench ablation --workload random --kv-type q8_0", &out, 1), 2);
    assert_non_null(strstr(out, "--kv-type is what the ablation varies"));
    free(out);

    /* The fake's model id is no file: without --tokenizer the command says what to do. */
    snprintf(args, sizeof args, "bench serve --url http://127.0.0.1:%d --workload random --num-requests 1",
             g_fake.port);
    assert_int_equal(run_blade(args, &out, 1), 1);
    assert_non_null(strstr(out, "--tokenizer"));
    free(out);
    free(json);
    free(html);
}

/* The client must not take the CPU from the server it measures: 16 requests of slow tokens
 * (80 ms apart, 500 ms each), all due at once, at most 4 in flight, and a /metrics that
 * answers 0.9 s late while completions stream (a busy server), so the next sample falls due
 * while one is in flight. Over the run (warm-up to last answer, as the client measures itself
 * with getrusage) it uses under 5% of one core; a client that polls in those waits uses
 * ~100%. Its figure agrees with what wait4 sees of the whole process (start-up included,
 * which under ASan alone is a few tenths of a second, hence the looser 25% there), and
 * appears in the summary, the JSON and the HTML report. */
static void test_cli_client_cpu(void **state)
{
    (void)state;
    g_fake.mode = FAKE_NORMAL;
    g_fake.token_ms = 80;
    g_fake.blade_metrics = true;
    g_fake.busy_metrics_ms = 900;
    char *json = temp_path("loadgen-cpu.json"), *html = temp_path("loadgen-cpu.html");
    char args[2048];
    snprintf(args, sizeof args,
             "bench serve --url http://127.0.0.1:%d --tokenizer '%s' --workload random --num-requests 16 "
             "--max-concurrency 4 --input-len 8 --output-len 6 --json '%s' --report '%s'",
             g_fake.port, g_tok_path, json, html);
    char *out = NULL;
    struct rusage ru;
    double wall;
    assert_int_equal(run_blade_usage(args, &out, 1, &ru, &wall), 0);
    json_t *doc = json_load_file(json, 0, NULL);
    assert_non_null(doc);
    json_t *client = json_object_get(doc, "client");
    double cpu_s = json_real_value(json_object_get(client, "cpu_s"));
    double wall_s = json_real_value(json_object_get(client, "wall_s"));
    double share = json_real_value(json_object_get(client, "cpu_share"));
    json_int_t rss = json_integer_value(json_object_get(client, "peak_rss_bytes"));
    json_decref(doc);
    double cpu = rusage_cpu(&ru);
    fprintf(stderr, "client: %.1f ms of CPU in %.0f ms over the run (%.1f%%); the process: %.1f ms in %.0f ms\n",
            cpu_s * 1e3, wall_s * 1e3, share * 100, cpu * 1e3, wall * 1e3);
    assert_non_null(strstr(out, "16 completed, 0 failed"));
    assert_true(atomic_load(&g_fake.scrapes) >= 3);
    assert_non_null(strstr(out, "\nclient              CPU "));
    assert_null(strstr(out, "warning: the benchmark client"));
    free(out);
    assert_true(wall_s > 2.0 && wall_s <= wall);
    assert_near(share, cpu_s / wall_s, 1e-9);
    assert_true(share < 0.05);
    assert_true(cpu_s > 0 && cpu_s <= cpu);
    assert_true(cpu < 0.25 * wall);
    assert_true(rss > 0 && rss <= (json_int_t)ru.ru_maxrss * 1024);
    size_t len;
    char *page = read_file(html, &len);
    assert_non_null(page);
    assert_non_null(strstr(page, "client CPU (% of one core)"));
    assert_non_null(strstr(page, "client peak RSS (MiB)"));
    free(page);
    unlink(json);
    unlink(html);
    free(json);
    free(html);
}

/* Where the 4-byte n_dims and first dimension of tensor name follow its name in the tensor
 * table of a GGUF image. */
static size_t tensor_dims_at(const char *image, size_t len, const char *name)
{
    const char *p = memmem(image, len, name, strlen(name));
    assert_non_null(p);
    return (size_t)(p - image) + strlen(name);
}

/* --tokenizer reads the vocabulary, not the model: a GGUF with a 32000-token vocabulary and
 * 512 MiB of weights (a sparse file: the tail is a hole, no disk written) costs the client
 * no more resident memory than the same vocabulary with 256 bytes of weights, give or take
 * 32 MiB. A client that loads or copies the model grows by the 512 MiB. */
static void test_cli_tokenizer_rss(void **state)
{
    (void)state;
    g_fake.mode = FAKE_NORMAL;
    blade_synth_spec spec = {
        .arch = BLADE_ARCH_LLAMA, .n_vocab = 32000, .n_embd = 16, .n_layer = 1, .n_head = 2, .n_head_kv = 1,
        .head_dim = 8, .n_ff = 32, .n_ctx = 2048, .rope_base = 10000.0f, .scheme = {.type = BLADE_TYPE_F32}, .seed = 5,
    };
    char *model = temp_path("loadgen-vocab-model.gguf"), *small = temp_path("loadgen-vocab-small.gguf"),
         *big = temp_path("loadgen-vocab-big.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_synth_write(&spec, model, false, &err), 0);
    size_t model_len;
    char *model_image = read_file(model, &model_len);
    gguf_file *src = gguf_open_memory(model_image, model_len, &err);
    assert_non_null(src);
    /* The vocabulary alone and one small tensor, which the big file then declares 512 MiB. */
    static const char filler[] = "blade.test.weights";
    float weights[64] = {0};
    gguf_writer *gw = gguf_writer_new();
    gguf_writer_copy_kv(gw, src);
    assert_int_equal(gguf_writer_add_tensor(gw, filler, BLADE_TYPE_F32, 1, (const int64_t[]){64}, weights,
                                            sizeof weights, &err),
                     0);
    assert_int_equal(gguf_writer_write(gw, small, false, &err), 0);
    gguf_writer_free(gw);
    gguf_close(src);
    free(model_image);
    unlink(model);

    size_t len;
    char *image = read_file(small, &len);
    gguf_file *g = gguf_open_memory(image, len, &err);
    assert_non_null(g);
    const gguf_tensor *t = gguf_find_tensor(g, filler);
    size_t data_end = g->data_offset + (size_t)t->offset, metadata = g->data_offset;
    gguf_close(g);
    const uint64_t big_elems = (uint64_t)1 << 27; /* 512 MiB of F32 */
    size_t dims = tensor_dims_at(image, len, filler);
    uint32_t n_dims;
    memcpy(&n_dims, image + dims, 4);
    assert_int_equal(n_dims, 1);
    memcpy(image + dims + 4, &big_elems, 8);
    assert_int_equal(write_file(big, image, data_end), 0);
    assert_int_equal(truncate(big, (off_t)(data_end + big_elems * 4)), 0);
    free(image);
    g = gguf_open_mapped(big, &err);
    assert_non_null(g);
    assert_int_equal(gguf_find_tensor(g, filler)->nbytes, big_elems * 4);
    gguf_close(g);

    long rss_kib[2];
    const char *paths[2] = {small, big};
    for (int i = 0; i < 2; i++) {
        char args[2048], *out = NULL;
        snprintf(args, sizeof args,
                 "bench serve --url http://127.0.0.1:%d --tokenizer '%s' --workload random --num-requests 1 "
                 "--input-len 8 --output-len 2 --no-warmup",
                 g_fake.port, paths[i]);
        struct rusage ru;
        double wall;
        assert_int_equal(run_blade_usage(args, &out, 1, &ru, &wall), 0);
        assert_non_null(strstr(out, "1 completed, 0 failed"));
        free(out);
        rss_kib[i] = ru.ru_maxrss;
    }
    fprintf(stderr, "peak RSS with %zu KiB of metadata: %ld KiB (256 B of weights), %ld KiB (512 MiB)\n",
            metadata >> 10, rss_kib[0], rss_kib[1]);
    assert_true(rss_kib[1] < rss_kib[0] + 32 * 1024);
    unlink(small);
    unlink(big);
    free(model);
    free(small);
    free(big);
}

/* ---- compare ---- */

static char *bench_file(const char *name, double throughput, double ttft_p99, int seed)
{
    char *path = temp_path(name);
    char text[1024];
    snprintf(text, sizeof text,
             "{\"blade_bench_serve\": 1, \"config\": {\"workload\": {\"name\": \"random\", \"seed\": %d}, "
             "\"load\": {\"num_requests\": 100}}, \"results\": {\"request_throughput\": %g, "
             "\"output_token_throughput\": %g, \"ttft_ms\": {\"mean\": 50, \"median\": 40, \"p90\": 80, "
             "\"p99\": %g}, \"goodput\": null}}",
             seed, throughput / 10, throughput, ttft_p99);
    assert_int_equal(write_file(path, text, strlen(text)), 0);
    return path;
}

static void test_compare(void **state)
{
    (void)state;
    char *base = bench_file("loadgen-base.json", 1000, 100, 0);
    char *slower = bench_file("loadgen-slower.json", 900, 100, 0);   /* throughput -10% */
    char *latency = bench_file("loadgen-latency.json", 1000, 103, 0); /* p99 +3% */
    char *worse = bench_file("loadgen-worse.json", 1000, 110, 0);     /* p99 +10% */
    char *other = bench_file("loadgen-other.json", 1000, 100, 1);     /* another seed */
    FILE *out = fopen("/dev/null", "w");
    assert_int_equal(lg_compare_files(base, slower, 5, out, out), LG_COMPARE_REGRESSION);
    assert_int_equal(lg_compare_files(base, latency, 5, out, out), LG_COMPARE_OK);
    assert_int_equal(lg_compare_files(base, worse, 5, out, out), LG_COMPARE_REGRESSION);
    assert_int_equal(lg_compare_files(base, worse, 15, out, out), LG_COMPARE_OK);
    assert_int_equal(lg_compare_files(base, base, 0, out, out), LG_COMPARE_OK);
    assert_int_equal(lg_compare_files(base, "/nonexistent.json", 5, out, out), LG_COMPARE_UNUSABLE);
    assert_int_equal(lg_compare_files(base, other, 5, out, out), LG_COMPARE_UNUSABLE);
    fclose(out);

    char args[1024], *text = NULL;
    snprintf(args, sizeof args, "bench compare '%s' '%s' --max-regression 5%%", base, slower);
    assert_int_equal(run_blade(args, &text, 1), 1);
    assert_non_null(strstr(text, "-10.0%  REGRESSION"));
    free(text);
    snprintf(args, sizeof args, "bench compare '%s' '%s' --max-regression 5%%", base, latency);
    assert_int_equal(run_blade(args, &text, 1), 0);
    assert_non_null(strstr(text, "+3.0%"));
    free(text);
    snprintf(args, sizeof args, "bench compare '%s' /nonexistent.json", base);
    assert_int_equal(run_blade(args, NULL, 0), 2);
    free(base);
    free(slower);
    free(latency);
    free(worse);
    free(other);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_percentile),
        cmocka_unit_test(test_cost),
        cmocka_unit_test(test_slo_parse),
        cmocka_unit_test(test_summary_by_hand),
        cmocka_unit_test(test_prom_value),
        cmocka_unit_test(test_arrivals),
        cmocka_unit_test(test_workload_random),
        cmocka_unit_test(test_workload_shared_prefix),
        cmocka_unit_test(test_workload_multi_turn),
        cmocka_unit_test(test_workload_long_interference),
        cmocka_unit_test(test_workload_text),
        cmocka_unit_test(test_workload_file),
        cmocka_unit_test_setup_teardown(test_client_timing, fake_start, fake_stop),
        cmocka_unit_test_setup_teardown(test_client_failures, fake_start, fake_stop),
        cmocka_unit_test_setup_teardown(test_client_multi_turn_order, fake_start, fake_stop),
        cmocka_unit_test_setup_teardown(test_client_sleeps_after_duration, fake_start, fake_stop),
        cmocka_unit_test_setup_teardown(test_cli_serve, fake_start, fake_stop),
        cmocka_unit_test_setup_teardown(test_cli_client_cpu, fake_start, fake_stop),
        cmocka_unit_test_setup_teardown(test_cli_tokenizer_rss, fake_start, fake_stop),
        cmocka_unit_test(test_compare),
    };
    return cmocka_run_group_tests(tests, setup_all, teardown_all);
}

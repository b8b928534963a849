/* The semantic cache: the exact and semantic tiers and the threshold, tenant/model/parameter
 * isolation under every index kind, TTL expiry on an injected clock (lazy and swept, and an
 * expired entry hiding a live one), LRU eviction by entries and by bytes, the AUTO index
 * switching to HNSW and back and compacting, persistence across a restart (LRU order, TTL,
 * evictions), a database that is corrupt in many ways set aside rather than trusted,
 * concurrent use from threads, and the dot-product kernels behind it on every ISA. */
#include "testutil.h"

#include "blade/kernels.h"
#include "blade/semantic_cache.h"

#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers ---- */

typedef struct fake_clock {
    double now;
} fake_clock;

static double read_clock(void *ctx)
{
    return ((fake_clock *)ctx)->now;
}

typedef struct log_capture {
    char text[8192];
    pthread_mutex_t mu;
} log_capture;

static void capture_log(void *ctx, const char *msg)
{
    log_capture *l = ctx;
    pthread_mutex_lock(&l->mu);
    size_t n = strlen(l->text);
    snprintf(l->text + n, sizeof l->text - n, "%s\n", msg);
    pthread_mutex_unlock(&l->mu);
}

static log_capture logs = {.mu = PTHREAD_MUTEX_INITIALIZER};
static fake_clock clk;

static blade_semcache_config config(int32_t dim)
{
    blade_semcache_config cfg = blade_semcache_config_default(dim);
    cfg.embedder = "test-embedder";
    cfg.clock = read_clock;
    cfg.clock_ctx = &clk;
    cfg.log = capture_log;
    cfg.log_ctx = &logs;
    cfg.sweep_interval_s = -1;
    return cfg;
}

static blade_semcache *open_cache(const blade_semcache_config *cfg)
{
    blade_error err = {{0}};
    blade_semcache *c = blade_semcache_open(cfg, &err);
    if (!c)
        fail_msg("open: %s", err.msg);
    return c;
}

static blade_semcache_key key(const char *tenant, const char *model, const char *params, const char *prompt)
{
    return (blade_semcache_key){.tenant = tenant, .model = model, .params = params, .params_len = strlen(params),
                                .prompt = prompt, .prompt_len = strlen(prompt)};
}

static blade_semcache_key kp(const char *prompt)
{
    return key("tenant-a", "model-x", "temperature=0", prompt);
}

static void put(blade_semcache *c, blade_semcache_key k, const float *vec, const char *text)
{
    blade_semcache_response r = {.text = text, .text_len = strlen(text), .finish_reason = "stop",
                                 .prompt_tokens = 7, .completion_tokens = 3};
    blade_error err = {{0}};
    int rc = blade_semcache_insert(c, &k, vec, &r, &err);
    if (rc != 0)
        fail_msg("insert '%s': %d %s", text, rc, err.msg);
}

/* The lookup's tier, and that a hit's text is want (NULL: expect a miss). */
static void expect(blade_semcache *c, blade_semcache_key k, const float *vec, const char *want, int want_tier)
{
    blade_semcache_hit hit;
    blade_error err = {{0}};
    int rc = blade_semcache_lookup(c, &k, vec, &hit, &err);
    if (rc < 0)
        fail_msg("lookup: %s", err.msg);
    if (rc != want_tier || (want && strcmp(hit.response.text, want) != 0))
        fail_msg("lookup '%.*s': tier %d text '%s', want tier %d '%s'", (int)k.prompt_len, (const char *)k.prompt, rc,
                 rc > 0 ? hit.response.text : "", want_tier, want ? want : "");
    blade_semcache_hit_clear(&hit);
}

static blade_semcache_stats stats_of(blade_semcache *c)
{
    blade_semcache_stats s;
    blade_semcache_get_stats(c, &s);
    return s;
}

/* A unit-ish vector: axis a with a small share of axis b. */
static void near_axis(float *v, int dim, int a, int b, float share)
{
    memset(v, 0, (size_t)dim * sizeof *v);
    v[a] = 1.0f;
    v[b] += share;
}

static uint64_t rng_state = 12345;
static float gauss(void)
{
    double u[2];
    for (int i = 0; i < 2; i++) {
        rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
        u[i] = ((rng_state >> 11) + 0.5) / 9007199254740992.0;
    }
    return (float)(sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]));
}

static void random_vec(float *v, int dim)
{
    for (int i = 0; i < dim; i++)
        v[i] = gauss();
}

/* A fresh, empty directory for one test's database files. */
static char *fresh_dir(const char *name)
{
    char *dir = temp_path(name);
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d))) {
            if (de->d_name[0] == '.')
                continue;
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
            unlink(p);
        }
        closedir(d);
    }
    mkdir(dir, 0755);
    return dir;
}

static int count_files_with(const char *dir, const char *part)
{
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d)))
        n += strstr(de->d_name, part) != NULL;
    if (d)
        closedir(d);
    return n;
}

static char *path_in(const char *dir, const char *file)
{
    size_t n = strlen(dir) + strlen(file) + 2;
    char *p = malloc(n);
    snprintf(p, n, "%s/%s", dir, file);
    return p;
}

static void reset_logs(void)
{
    logs.text[0] = 0;
}

/* ---- the tiers ---- */

static void test_exact_tier(void **state)
{
    (void)state;
    clk.now = 1000;
    blade_semcache_config cfg = config(4);
    blade_semcache *c = open_cache(&cfg);
    float v[4] = {1, 0, 0, 0};
    static const char extra[] = {'{', 0, '}'};
    blade_semcache_response r = {.text = "Paris.", .text_len = 6, .finish_reason = "stop", .prompt_tokens = 12,
                                 .completion_tokens = 2, .extra = extra, .extra_len = sizeof extra};
    blade_semcache_key k = kp("capital of France?");
    assert_int_equal(blade_semcache_insert(c, &k, v, &r, NULL), 0);

    /* no embedding needed for the exact tier; every field comes back */
    blade_semcache_hit hit;
    assert_int_equal(blade_semcache_lookup_exact(c, &k, &hit, NULL), BLADE_SEMCACHE_EXACT);
    assert_string_equal(hit.response.text, "Paris.");
    assert_int_equal(hit.response.text_len, 6);
    assert_string_equal(hit.response.finish_reason, "stop");
    assert_int_equal(hit.response.prompt_tokens, 12);
    assert_int_equal(hit.response.completion_tokens, 2);
    assert_int_equal(hit.response.extra_len, sizeof extra);
    assert_memory_equal(hit.response.extra, extra, sizeof extra);
    assert_true(hit.similarity == 1.0f);
    assert_true(hit.created == 1000);
    blade_semcache_hit_clear(&hit);

    /* the exact tier wins even when the embedding given points elsewhere */
    float other[4] = {0, 1, 0, 0};
    expect(c, k, other, "Paris.", BLADE_SEMCACHE_EXACT);
    /* one byte different is another request */
    blade_semcache_key k2 = kp("capital of France?!");
    assert_int_equal(blade_semcache_lookup_exact(c, &k2, &hit, NULL), BLADE_SEMCACHE_MISS);
    /* an exact-tier miss is not counted (a full lookup follows it); a full one is */
    blade_semcache_stats s = stats_of(c);
    assert_int_equal(s.exact_hits, 2);
    assert_int_equal(s.misses, 0);
    expect(c, kp("capital of Spain?"), NULL, NULL, BLADE_SEMCACHE_MISS);
    s = stats_of(c);
    assert_int_equal(s.misses, 1);
    assert_int_equal(s.entries, 1);
    assert_int_equal(s.lookup_latency.cumulative[BLADE_SEMCACHE_LATENCY_BUCKETS - 1], 4);

    /* an entry stored without an embedding answers the exact tier only */
    put(c, kp("no vector"), NULL, "exact only");
    expect(c, kp("no vector"), NULL, "exact only", BLADE_SEMCACHE_EXACT);
    float w[4] = {0, 0, 1, 0};
    expect(c, kp("no vector, reworded"), w, NULL, BLADE_SEMCACHE_MISS);

    /* storing under the same key replaces */
    put(c, kp("capital of France?"), v, "Paris!");
    expect(c, kp("capital of France?"), NULL, "Paris!", BLADE_SEMCACHE_EXACT);
    assert_int_equal(stats_of(c).entries, 2);
    blade_semcache_close(c);
}

static void test_semantic_threshold(void **state)
{
    (void)state;
    clk.now = 0;
    blade_semcache_config cfg = config(4);
    cfg.threshold = 0.5f;
    blade_semcache *c = open_cache(&cfg);
    float axis[4] = {1, 0, 0, 0};
    put(c, kp("stored"), axis, "answer");
    /* (1,1,1,1)/2 . (1,0,0,0) = 0.5 exactly: at the threshold is a hit */
    float diag[4] = {3, 3, 3, 3};
    blade_semcache_hit hit;
    blade_semcache_key other = kp("other words");
    assert_int_equal(blade_semcache_lookup(c, &other, diag, &hit, NULL), BLADE_SEMCACHE_SEMANTIC);
    assert_true(hit.similarity == 0.5f);
    assert_string_equal(hit.response.text, "answer");
    blade_semcache_hit_clear(&hit);
    blade_semcache_close(c);

    /* just above it is a miss, and the near miss is seen in the miss histogram */
    cfg.threshold = nextafterf(0.5f, 1.0f);
    c = open_cache(&cfg);
    put(c, kp("stored"), axis, "answer");
    expect(c, kp("other words"), diag, NULL, BLADE_SEMCACHE_MISS);
    blade_semcache_stats s = stats_of(c);
    assert_int_equal(s.misses, 1);
    assert_int_equal(s.semantic_hits, 0);
    assert_int_equal(s.miss_similarity.cumulative[0], 1); /* 0.5 is in the first bucket (<= 0.5) */
    blade_semcache_close(c);

    /* the nearest of several wins, whatever the scale of the query */
    cfg = config(8);
    cfg.threshold = 0.9f;
    c = open_cache(&cfg);
    const char *names[] = {"zero", "one", "two", "three"};
    for (int i = 0; i < 4; i++) {
        float v[8];
        near_axis(v, 8, i, 7, 0.1f);
        put(c, kp(names[i]), v, names[i]);
    }
    for (int i = 0; i < 4; i++) {
        float q[8];
        near_axis(q, 8, i, (i + 1) % 4, 0.2f);
        for (int d = 0; d < 8; d++)
            q[d] *= 1000.0f;
        expect(c, kp("a reworded question"), q, names[i], BLADE_SEMCACHE_SEMANTIC);
    }
    /* far from everything */
    float far[8] = {0, 0, 0, 0, 0, 1, 0, 0};
    expect(c, kp("unrelated"), far, NULL, BLADE_SEMCACHE_MISS);
    s = stats_of(c);
    assert_int_equal(s.semantic_hits, 4);
    assert_int_equal(s.hit_similarity.cumulative[BLADE_SEMCACHE_SIMILARITY_BUCKETS - 1], 4);
    blade_semcache_close(c);
}

static void test_invalid_input(void **state)
{
    (void)state;
    blade_semcache_config cfg = config(4);
    blade_semcache *c = open_cache(&cfg);
    blade_error err = {{0}};
    blade_semcache_hit hit;
    blade_semcache_key k = kp("q");
    float nan_vec[4] = {1, NAN, 0, 0}, zero[4] = {0}, inf_vec[4] = {INFINITY, 0, 0, 0};
    assert_int_equal(blade_semcache_lookup(c, &k, nan_vec, &hit, &err), -1);
    assert_non_null(strstr(err.msg, "not finite"));
    assert_int_equal(blade_semcache_lookup(c, &k, zero, &hit, &err), -1);
    assert_non_null(strstr(err.msg, "no direction"));
    blade_semcache_response r = {.text = "t", .text_len = 1, .finish_reason = "stop"};
    assert_int_equal(blade_semcache_insert(c, &k, inf_vec, &r, &err), -1);
    blade_semcache_key no_tenant = k;
    no_tenant.tenant = NULL;
    assert_int_equal(blade_semcache_lookup(c, &no_tenant, NULL, &hit, &err), -1);
    blade_semcache_key no_model = key("t", "", "", "q");
    assert_int_equal(blade_semcache_insert(c, &no_model, NULL, &r, &err), -1);
    blade_semcache_response long_finish = r;
    long_finish.finish_reason = "a finish reason far longer than thirty-one bytes";
    assert_int_equal(blade_semcache_insert(c, &k, NULL, &long_finish, &err), -1);
    blade_semcache_response negative = r;
    negative.completion_tokens = -1;
    assert_int_equal(blade_semcache_insert(c, &k, NULL, &negative, &err), -1);
    assert_int_equal(stats_of(c).entries, 0);
    blade_semcache_close(c);

    blade_semcache_config bad = config(4);
    bad.threshold = 0;
    assert_null(blade_semcache_open(&bad, &err));
    bad = config(4);
    bad.max_entries = 0;
    assert_null(blade_semcache_open(&bad, &err));
    bad = config(-1);
    assert_null(blade_semcache_open(&bad, &err));
    bad = config(4);
    bad.ttl_s = NAN;
    assert_null(blade_semcache_open(&bad, &err));
}

/* ---- isolation ---- */

static void test_tenant_isolation(void **state)
{
    (void)state;
    static const blade_semcache_index kinds[] = {BLADE_SEMCACHE_INDEX_EXACT, BLADE_SEMCACHE_INDEX_HNSW,
                                                 BLADE_SEMCACHE_INDEX_AUTO};
    for (int kind = 0; kind < 3; kind++) {
        blade_semcache_config cfg = config(16);
        cfg.index = kinds[kind];
        cfg.exact_scan_max = 8; /* AUTO: past this a graph */
        blade_semcache *c = open_cache(&cfg);
        float v[16];
        random_vec(v, 16);
        /* the same prompt, parameters, model and embedding under tenant A only */
        for (int i = 0; i < 20; i++) {
            char prompt[32], text[32];
            snprintf(prompt, sizeof prompt, "filler %d", i);
            snprintf(text, sizeof text, "A's filler %d", i);
            float f[16];
            random_vec(f, 16);
            put(c, key("key-A", "m", "t0", prompt), f, text);
        }
        put(c, key("key-A", "m", "t0", "what is my balance?"), v, "A's balance: 100");
        /* tenant B sees nothing of it, by either tier, and neither does a tenant whose
         * name is a prefix, nor another model or other parameters */
        expect(c, key("key-B", "m", "t0", "what is my balance?"), v, NULL, BLADE_SEMCACHE_MISS);
        expect(c, key("key-", "m", "t0", "what is my balance?"), v, NULL, BLADE_SEMCACHE_MISS);
        expect(c, key("", "m", "t0", "what is my balance?"), v, NULL, BLADE_SEMCACHE_MISS);
        expect(c, key("key-A", "m2", "t0", "what is my balance?"), v, NULL, BLADE_SEMCACHE_MISS);
        expect(c, key("key-A", "m", "t0.7", "what is my balance?"), v, NULL, BLADE_SEMCACHE_MISS);
        /* B's own entry for the identical request is B's */
        put(c, key("key-B", "m", "t0", "what is my balance?"), v, "B's balance: 5");
        expect(c, key("key-B", "m", "t0", "what is my balance?"), NULL, "B's balance: 5", BLADE_SEMCACHE_EXACT);
        expect(c, key("key-A", "m", "t0", "what is my balance?"), NULL, "A's balance: 100", BLADE_SEMCACHE_EXACT);
        expect(c, key("key-B", "m", "t0", "balance please"), v, "B's balance: 5", BLADE_SEMCACHE_SEMANTIC);
        expect(c, key("key-A", "m", "t0", "balance please"), v, "A's balance: 100", BLADE_SEMCACHE_SEMANTIC);
        assert_int_equal(stats_of(c).partitions, 2);
        blade_semcache_close(c);
    }
}

/* ---- expiry ---- */

static void test_ttl(void **state)
{
    (void)state;
    clk.now = 100;
    blade_semcache_config cfg = config(4);
    cfg.ttl_s = 10;
    cfg.threshold = 0.8f;
    blade_semcache *c = open_cache(&cfg);
    float a[4] = {1, 0, 0, 0}, b[4] = {1, 0.3f, 0, 0}, q[4] = {1, 0.05f, 0, 0};
    put(c, kp("first"), a, "old answer");
    clk.now = 105;
    put(c, kp("second"), b, "newer answer");
    clk.now = 109.9;
    expect(c, kp("first"), NULL, "old answer", BLADE_SEMCACHE_EXACT);
    expect(c, kp("reworded"), q, "old answer", BLADE_SEMCACHE_SEMANTIC);
    /* at 10 s the first is gone for both tiers, even though a hit refreshed its LRU place;
     * the nearer but expired entry must not hide the live one behind it */
    clk.now = 110;
    expect(c, kp("reworded"), q, "newer answer", BLADE_SEMCACHE_SEMANTIC);
    expect(c, kp("first"), NULL, NULL, BLADE_SEMCACHE_MISS);
    blade_semcache_stats s = stats_of(c);
    assert_int_equal(s.entries, 1);
    assert_int_equal(s.expirations, 1);
    /* the exact tier removes lazily too */
    clk.now = 115;
    expect(c, kp("second"), NULL, NULL, BLADE_SEMCACHE_MISS);
    assert_int_equal(stats_of(c).entries, 0);

    /* a sweep removes what nobody looks up */
    for (int i = 0; i < 5; i++) {
        char p[16];
        snprintf(p, sizeof p, "p%d", i);
        clk.now = 200 + i;
        put(c, kp(p), i % 2 ? a : NULL, "x");
    }
    clk.now = 212.5; /* p0..p2 are 10 s old or more */
    assert_int_equal(blade_semcache_sweep(c), 3);
    s = stats_of(c);
    assert_int_equal(s.entries, 2);
    assert_int_equal(s.expirations, 5);
    assert_int_equal(blade_semcache_sweep(c), 0);
    blade_semcache_close(c);

    /* TTL 0: never */
    cfg.ttl_s = 0;
    c = open_cache(&cfg);
    put(c, kp("forever"), NULL, "x");
    clk.now = 1e9;
    expect(c, kp("forever"), NULL, "x", BLADE_SEMCACHE_EXACT);
    assert_int_equal(blade_semcache_sweep(c), 0);
    blade_semcache_close(c);
}

/* The background thread sweeps on its own (real time, a short interval). */
static void test_background_sweep(void **state)
{
    (void)state;
    clk.now = 0;
    blade_semcache_config cfg = config(0);
    cfg.ttl_s = 5;
    cfg.sweep_interval_s = 0.01;
    blade_semcache *c = open_cache(&cfg);
    put(c, kp("a"), NULL, "x");
    put(c, kp("b"), NULL, "x");
    clk.now = 6;
    for (int i = 0; i < 500 && stats_of(c).entries > 0; i++)
        usleep(10000);
    assert_int_equal(stats_of(c).entries, 0);
    assert_int_equal(stats_of(c).expirations, 2);
    blade_semcache_close(c);
}

/* ---- capacity ---- */

static void test_evict_by_entries(void **state)
{
    (void)state;
    clk.now = 0;
    blade_semcache_config cfg = config(4);
    cfg.max_entries = 3;
    blade_semcache *c = open_cache(&cfg);
    float v[4][4] = {{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}, {0, 0, 0, 1}};
    put(c, kp("one"), v[0], "1");
    clk.now = 1;
    put(c, kp("two"), v[1], "2");
    clk.now = 2;
    put(c, kp("three"), v[2], "3");
    /* a hit on "one" makes "two" the least recently hit */
    clk.now = 3;
    expect(c, kp("one"), NULL, "1", BLADE_SEMCACHE_EXACT);
    clk.now = 4;
    put(c, kp("four"), v[3], "4");
    expect(c, kp("two"), NULL, NULL, BLADE_SEMCACHE_MISS);
    expect(c, kp("reworded two"), v[1], NULL, BLADE_SEMCACHE_MISS); /* gone from the index too */
    expect(c, kp("one"), NULL, "1", BLADE_SEMCACHE_EXACT);
    expect(c, kp("three"), NULL, "3", BLADE_SEMCACHE_EXACT);
    expect(c, kp("reworded four"), v[3], "4", BLADE_SEMCACHE_SEMANTIC);
    blade_semcache_stats s = stats_of(c);
    assert_int_equal(s.entries, 3);
    assert_int_equal(s.evictions, 1);
    /* a semantic hit refreshes too: "three" (hit above before "four") is now oldest */
    expect(c, kp("reworded one"), v[0], "1", BLADE_SEMCACHE_SEMANTIC);
    put(c, kp("five"), NULL, "5");
    expect(c, kp("three"), NULL, NULL, BLADE_SEMCACHE_MISS);
    assert_int_equal(stats_of(c).entries, 3);
    blade_semcache_close(c);
}

static void test_evict_by_bytes(void **state)
{
    (void)state;
    clk.now = 0;
    blade_semcache_config cfg = config(4);
    char big[4000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    /* room for two of these entries, not three */
    cfg.max_bytes = 2 * (int64_t)sizeof big + 2000;
    blade_semcache *c = open_cache(&cfg);
    float v[4] = {1, 0, 0, 0};
    put(c, kp("a"), v, big);
    int64_t one = stats_of(c).bytes;
    assert_true(one > (int64_t)sizeof big && one < (int64_t)sizeof big + 1000);
    clk.now = 1;
    put(c, kp("b"), v, big);
    clk.now = 2;
    put(c, kp("c"), v, big);
    blade_semcache_stats s = stats_of(c);
    assert_int_equal(s.entries, 2);
    assert_int_equal(s.evictions, 1);
    assert_true(s.bytes <= cfg.max_bytes);
    expect(c, kp("a"), NULL, NULL, BLADE_SEMCACHE_MISS);
    expect(c, kp("c"), NULL, big, BLADE_SEMCACHE_EXACT);
    /* many small ones push out a big one */
    for (int i = 0; i < 200; i++) {
        char p[16];
        snprintf(p, sizeof p, "small %d", i);
        put(c, kp(p), NULL, "s");
    }
    s = stats_of(c);
    assert_true(s.bytes <= cfg.max_bytes);
    expect(c, kp("b"), NULL, NULL, BLADE_SEMCACHE_MISS);
    /* an entry larger than the whole cache is refused, evicting nothing */
    int64_t before = s.entries;
    static char huge[12000];
    memset(huge, 'y', sizeof huge - 1);
    blade_semcache_response r = {.text = huge, .text_len = sizeof huge - 1, .finish_reason = "stop"};
    blade_semcache_key k = kp("huge");
    assert_int_equal(blade_semcache_insert(c, &k, v, &r, NULL), 1);
    s = stats_of(c);
    assert_int_equal(s.entries, before);
    assert_int_equal(s.rejected_too_large, 1);
    blade_semcache_close(c);
}

/* ---- the index kinds ---- */

#define IDX_DIM 24
#define IDX_N 400

/* Every kind finds the stored entry for a slightly perturbed query: all of them for the
 * exact scan, nearly all for the approximate graph, never another entry's answer. */
static void check_index_finds(blade_semcache *c, float (*vecs)[IDX_DIM], int first, int last, int min_found)
{
    int found = 0;
    for (int i = first; i < last; i++) {
        float q[IDX_DIM];
        for (int d = 0; d < IDX_DIM; d++)
            q[d] = vecs[i][d] + 0.02f * gauss();
        char want[32];
        snprintf(want, sizeof want, "answer %d", i);
        blade_semcache_hit hit;
        blade_semcache_key k = kp("query");
        int rc = blade_semcache_lookup(c, &k, q, &hit, NULL);
        assert_true(rc == BLADE_SEMCACHE_MISS || rc == BLADE_SEMCACHE_SEMANTIC);
        if (rc == BLADE_SEMCACHE_SEMANTIC) {
            assert_string_equal(hit.response.text, want);
            assert_true(hit.similarity >= 0.97f);
            found++;
        }
        blade_semcache_hit_clear(&hit);
    }
    if (found < min_found)
        fail_msg("found %d of %d, want at least %d", found, last - first, min_found);
}

static void test_index_kinds(void **state)
{
    (void)state;
    static float vecs[IDX_N][IDX_DIM];
    for (int i = 0; i < IDX_N; i++)
        random_vec(vecs[i], IDX_DIM);
    static const blade_semcache_index kinds[] = {BLADE_SEMCACHE_INDEX_EXACT, BLADE_SEMCACHE_INDEX_HNSW,
                                                 BLADE_SEMCACHE_INDEX_AUTO};
    for (int kind = 0; kind < 3; kind++) {
        clk.now = 0;
        blade_semcache_config cfg = config(IDX_DIM);
        cfg.index = kinds[kind];
        cfg.threshold = 0.97f;
        cfg.exact_scan_max = 100; /* AUTO: a graph past 100 entries, a scan again below 25 */
        cfg.ttl_s = 1000;
        blade_semcache *c = open_cache(&cfg);
        for (int i = 0; i < IDX_N; i++) {
            char p[32], t[32];
            snprintf(p, sizeof p, "prompt %d", i);
            snprintf(t, sizeof t, "answer %d", i);
            clk.now = i < IDX_N - 20 ? 0 : 500;
            put(c, kp(p), vecs[i], t);
        }
        bool exact = kinds[kind] == BLADE_SEMCACHE_INDEX_EXACT;
        check_index_finds(c, vecs, 0, IDX_N, exact ? IDX_N : IDX_N * 95 / 100);
        int64_t graph_bytes = stats_of(c).index_bytes;
        /* all but the last 20 expire: the graph is compacted (HNSW) or becomes a scan again
         * (AUTO), and still finds every survivor, and nothing of the rest */
        clk.now = 1000;
        assert_int_equal(blade_semcache_sweep(c), IDX_N - 20);
        check_index_finds(c, vecs, IDX_N - 20, IDX_N, exact ? 20 : 19);
        check_index_finds(c, vecs, 0, IDX_N - 20, 0);
        blade_semcache_stats s = stats_of(c);
        assert_int_equal(s.semantic_hits + s.misses, 2 * IDX_N);
        assert_int_equal(s.entries, 20);
        if (kinds[kind] != BLADE_SEMCACHE_INDEX_EXACT)
            assert_true(s.index_bytes < graph_bytes);
        /* and keeps working as it grows again */
        for (int i = 0; i < IDX_N - 20; i++) {
            char p[32], t[32];
            snprintf(p, sizeof p, "prompt %d", i);
            snprintf(t, sizeof t, "answer %d", i);
            put(c, kp(p), vecs[i], t);
        }
        check_index_finds(c, vecs, 0, IDX_N, exact ? IDX_N : IDX_N * 95 / 100);
        blade_semcache_close(c);
    }
}

/* In HNSW mode eviction marks graph nodes deleted; many more inserts than the capacity make
 * the graph compact itself over and over, and evicted answers never come back. */
static void test_hnsw_churn(void **state)
{
    (void)state;
    clk.now = 0;
    blade_semcache_config cfg = config(IDX_DIM);
    cfg.index = BLADE_SEMCACHE_INDEX_HNSW;
    cfg.max_entries = 50;
    cfg.threshold = 0.97f;
    blade_semcache *c = open_cache(&cfg);
    static float vecs[IDX_N][IDX_DIM];
    for (int i = 0; i < IDX_N; i++) {
        random_vec(vecs[i], IDX_DIM);
        char p[32], t[32];
        snprintf(p, sizeof p, "prompt %d", i);
        snprintf(t, sizeof t, "answer %d", i);
        put(c, kp(p), vecs[i], t);
    }
    assert_int_equal(stats_of(c).entries, 50);
    assert_int_equal(stats_of(c).evictions, IDX_N - 50);
    check_index_finds(c, vecs, 0, IDX_N - 50, 0);
    check_index_finds(c, vecs, IDX_N - 50, IDX_N, 48);
    blade_semcache_close(c);
}

/* ---- persistence ---- */

static void test_persistence_roundtrip(void **state)
{
    (void)state;
    char *dir = fresh_dir("semcache-roundtrip");
    char *db = path_in(dir, "cache.db");
    clk.now = 5000;
    blade_semcache_config cfg = config(4);
    cfg.db_path = db;
    cfg.ttl_s = 100;
    reset_logs();
    blade_semcache *c = open_cache(&cfg);
    float a[4] = {1, 0, 0, 0}, b[4] = {0, 1, 0, 0}, q[4] = {1, 0.1f, 0, 0};
    static const char extra[] = {'t', 0, 'c'};
    blade_semcache_response r = {.text = "with extra", .text_len = 10, .finish_reason = "stop",
                                 .prompt_tokens = 31, .completion_tokens = 4, .extra = extra, .extra_len = 3};
    blade_semcache_key k1 = kp("one");
    assert_int_equal(blade_semcache_insert(c, &k1, a, &r, NULL), 0);
    clk.now = 5001;
    put(c, kp("two"), b, "second");
    clk.now = 5002;
    put(c, key("tenant-b", "model-x", "temperature=0", "one"), a, "b's own");
    clk.now = 5003;
    put(c, kp("exact only"), NULL, "");
    clk.now = 5004;
    put(c, kp("evicted soon"), NULL, "gone");
    put(c, kp("replaced"), NULL, "first version");
    put(c, kp("replaced"), NULL, "second version");
    /* a hit: "one" becomes the most recently hit */
    clk.now = 5010;
    expect(c, kp("one"), NULL, "with extra", BLADE_SEMCACHE_EXACT);
    blade_error err = {{0}};
    assert_int_equal(blade_semcache_flush(c, &err), 0);
    blade_semcache_close(c);

    /* a restart sees everything, with its vectors, times and fields */
    c = open_cache(&cfg);
    blade_semcache_stats s = stats_of(c);
    assert_int_equal(s.entries, 6);
    assert_int_equal(s.partitions, 2);
    clk.now = 5020;
    expect(c, key("tenant-b", "model-x", "temperature=0", "one"), NULL, "b's own", BLADE_SEMCACHE_EXACT);
    clk.now = 5021;
    expect(c, kp("exact only"), NULL, "", BLADE_SEMCACHE_EXACT);
    clk.now = 5022;
    expect(c, kp("replaced"), NULL, "second version", BLADE_SEMCACHE_EXACT);
    clk.now = 5023;
    blade_semcache_hit hit;
    blade_semcache_key reworded = kp("one, reworded");
    assert_int_equal(blade_semcache_lookup(c, &reworded, q, &hit, NULL), BLADE_SEMCACHE_SEMANTIC);
    assert_string_equal(hit.response.text, "with extra");
    assert_int_equal(hit.response.prompt_tokens, 31);
    assert_int_equal(hit.response.completion_tokens, 4);
    assert_int_equal(hit.response.extra_len, 3);
    assert_memory_equal(hit.response.extra, extra, 3);
    assert_true(hit.created == 5000);
    blade_semcache_hit_clear(&hit);
    clk.now = 5024;
    float qb[4] = {0.1f, 1, 0, 0};
    expect(c, kp("two, reworded"), qb, "second", BLADE_SEMCACHE_SEMANTIC);
    assert_int_equal(blade_semcache_flush(c, &err), 0);
    blade_semcache_close(c);

    /* a smaller capacity keeps the most recently hit at load, and the evicted rows leave
     * the file: "one" and "two", hit last, stay */
    cfg.max_entries = 2;
    c = open_cache(&cfg);
    expect(c, kp("one"), NULL, "with extra", BLADE_SEMCACHE_EXACT);
    expect(c, kp("two"), NULL, "second", BLADE_SEMCACHE_EXACT);
    assert_int_equal(stats_of(c).entries, 2);
    assert_int_equal(blade_semcache_flush(c, &err), 0);
    blade_semcache_close(c);
    cfg.max_entries = 100;
    c = open_cache(&cfg);
    assert_int_equal(stats_of(c).entries, 2);
    blade_semcache_close(c);

    /* past the TTL nothing is loaded, and the rows are deleted */
    clk.now = 5200;
    c = open_cache(&cfg);
    assert_int_equal(stats_of(c).entries, 0);
    assert_int_equal(blade_semcache_flush(c, &err), 0);
    blade_semcache_close(c);
    clk.now = 0; /* the clock went back: still nothing, the rows are gone */
    c = open_cache(&cfg);
    assert_int_equal(stats_of(c).entries, 0);
    blade_semcache_close(c);
    assert_null(strstr(logs.text, "warning"));
    assert_int_equal(count_files_with(dir, "corrupt"), 0);
    free(db);
    free(dir);
}

/* Writes a database with two entries through the cache itself. */
static void write_good_db(const char *db)
{
    unlink(db);
    clk.now = 100;
    blade_semcache_config cfg = config(4);
    cfg.db_path = db;
    blade_semcache *c = open_cache(&cfg);
    float a[4] = {1, 0, 0, 0};
    put(c, kp("one"), a, "first");
    put(c, kp("two"), NULL, "second");
    assert_int_equal(blade_semcache_flush(c, NULL), 0);
    blade_semcache_close(c);
}

static void sql(const char *db, const char *stmt)
{
    sqlite3 *h;
    assert_int_equal(sqlite3_open(db, &h), SQLITE_OK);
    char *msg = NULL;
    if (sqlite3_exec(h, stmt, NULL, NULL, &msg) != SQLITE_OK)
        fail_msg("%s: %s", stmt, msg);
    sqlite3_close(h);
}

/* After the damage, open must succeed empty, say so, keep the damaged file aside, and work
 * normally (and persist) from then on. */
static void expect_set_aside(const char *dir, const char *db, int32_t dim, const char *embedder, const char *why,
                             const char *reason)
{
    reset_logs();
    int before = count_files_with(dir, "corrupt");
    clk.now = 200;
    blade_semcache_config cfg = config(dim);
    cfg.db_path = db;
    cfg.embedder = embedder;
    blade_error err = {{0}};
    blade_semcache *c = blade_semcache_open(&cfg, &err);
    if (!c)
        fail_msg("%s: open failed: %s", why, err.msg);
    if (stats_of(c).entries != 0 || !strstr(logs.text, "moved to") || !strstr(logs.text, reason))
        fail_msg("%s: %" PRId64 " entries, log: %s", why, stats_of(c).entries, logs.text);
    if (count_files_with(dir, "corrupt") != before + 1)
        fail_msg("%s: the damaged file was not kept aside", why);
    put(c, kp("after"), NULL, "fresh");
    assert_int_equal(blade_semcache_flush(c, NULL), 0);
    blade_semcache_close(c);
    reset_logs();
    c = open_cache(&cfg);
    expect(c, kp("after"), NULL, "fresh", BLADE_SEMCACHE_EXACT);
    assert_int_equal(stats_of(c).entries, 1);
    blade_semcache_close(c);
    if (strstr(logs.text, "warning"))
        fail_msg("%s: the fresh database was not accepted: %s", why, logs.text);
}

static void test_corrupt_database(void **state)
{
    (void)state;
    char *dir = fresh_dir("semcache-corrupt");
    char *db = path_in(dir, "cache.db");

    /* garbage bytes */
    unsigned char junk[8192];
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (unsigned char)(i * 7919u >> 3);
    assert_int_equal(write_file(db, junk, sizeof junk), 0);
    expect_set_aside(dir, db, 4, "test-embedder", "garbage", "not a database");

    /* a good file cut short */
    write_good_db(db);
    size_t len;
    char *whole = read_file(db, &len);
    assert_int_equal(write_file(db, whole, len / 2 + 100), 0);
    free(whole);
    expect_set_aside(dir, db, 4, "test-embedder", "truncated", "moved to");

    /* a b-tree page of an unknown type (page 2, of 4096 bytes) */
    write_good_db(db);
    whole = read_file(db, &len);
    assert_true(len > 3 * 4096);
    whole[4096] = 0x42;
    assert_int_equal(write_file(db, whole, len), 0);
    free(whole);
    expect_set_aside(dir, db, 4, "test-embedder", "damaged page", "moved to");

    /* damage only loading never reads: the key index, which later writes would trust */
    write_good_db(db);
    sqlite3 *h;
    sqlite3_stmt *st;
    assert_int_equal(sqlite3_open(db, &h), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(h, "SELECT rootpage FROM sqlite_master WHERE name = 'sqlite_autoindex_entries_1'",
                                        -1, &st, NULL),
                     SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    int page = sqlite3_column_int(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(h);
    whole = read_file(db, &len);
    assert_true(page > 1 && (size_t)page * 4096 <= len);
    whole[(size_t)(page - 1) * 4096] = 0x42;
    assert_int_equal(write_file(db, whole, len), 0);
    free(whole);
    expect_set_aside(dir, db, 4, "test-embedder", "damaged index", "damaged");

    /* somebody else's SQLite database */
    unlink(db);
    sql(db, "CREATE TABLE entries(id INTEGER PRIMARY KEY, payload TEXT); INSERT INTO entries VALUES(1, 'x')");
    expect_set_aside(dir, db, 4, "test-embedder", "other schema", "not a blade semantic cache database");

    /* our schema plus a trigger that would run on our writes */
    write_good_db(db);
    sql(db, "CREATE TRIGGER t AFTER INSERT ON entries BEGIN DELETE FROM entries; END");
    expect_set_aside(dir, db, 4, "test-embedder", "trigger", "trigger 't'");

    /* another dimension or embedder: the vectors mean nothing here */
    write_good_db(db);
    expect_set_aside(dir, db, 8, "test-embedder", "dimension", "written with dim '4'");
    write_good_db(db);
    expect_set_aside(dir, db, 4, "another-embedder", "embedder", "written with embedder 'test-embedder'");

    /* rows that fail their checks */
    static const struct {
        const char *stmt, *why, *reason;
    } rows[] = {
        {"UPDATE entries SET embedding = x'0000803f' WHERE embedding IS NOT NULL", "short vector", "column embedding"},
        {"UPDATE entries SET embedding = x'0000c07f000000000000000000000000' WHERE embedding IS NOT NULL", "NaN vector",
         "not finite"},
        {"UPDATE entries SET embedding = zeroblob(16) WHERE embedding IS NOT NULL", "zero vector", "no direction"},
        {"UPDATE entries SET embedding = 'text' WHERE embedding IS NOT NULL", "vector as text", "column embedding"},
        {"UPDATE entries SET key = x'00' WHERE text = x'7365636f6e64'", "short key", "column key"},
        {"UPDATE entries SET tenant = 'abc'", "tenant as text", "column tenant"},
        {"UPDATE entries SET created = 'yesterday'", "time as text", "column created"},
        {"UPDATE entries SET created = -5", "negative time", "times"},
        {"UPDATE entries SET prompt_tokens = -1", "negative tokens", "negative token count"},
        {"UPDATE entries SET completion_tokens = 4294967296", "huge tokens", "token count"},
        {"UPDATE entries SET finish_reason = 'a finish reason longer than thirty-one bytes'", "long finish",
         "finish reason"},
        {"UPDATE entries SET model = ''", "empty model", "empty model"},
        {"UPDATE entries SET text = 'as text'", "text as text", "column text"},
        {"UPDATE meta SET value = '2' WHERE name = 'version'", "version", "written with version '2'"},
        {"DELETE FROM meta WHERE name = 'dim'", "meta missing", "no 'dim'"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        write_good_db(db);
        sql(db, rows[i].stmt);
        expect_set_aside(dir, db, 4, "test-embedder", rows[i].why, rows[i].reason);
    }

    /* an empty file is an empty database, not damage */
    unlink(db);
    assert_int_equal(write_file(db, "", 0), 0);
    reset_logs();
    blade_semcache_config cfg = config(4);
    cfg.db_path = db;
    blade_semcache *c = open_cache(&cfg);
    blade_semcache_close(c);
    assert_null(strstr(logs.text, "warning"));

    /* a path that cannot hold a database is an error, not a crash */
    cfg.db_path = dir;
    blade_error err = {{0}};
    assert_null(blade_semcache_open(&cfg, &err));
    assert_true(err.msg[0] != 0);
    /* nor can two caches share one file */
    cfg.db_path = db;
    c = open_cache(&cfg);
    assert_null(blade_semcache_open(&cfg, &err));
    assert_non_null(strstr(err.msg, "locked"));
    blade_semcache_close(c);
    free(db);
    free(dir);
}

/* ---- threads ---- */

#define THREADS 4
#define THREAD_OPS 1500
#define THREAD_DIM 16

typedef struct worker {
    blade_semcache *c;
    int id;
    int bad;
} worker;

static void *work(void *arg)
{
    worker *w = arg;
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(w->id + 1);
    char tenant[16];
    snprintf(tenant, sizeof tenant, "tenant-%d", w->id % 2);
    for (int i = 0; i < THREAD_OPS; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        int topic = (int)((rng >> 33) % 64);
        char prompt[32], text[64];
        snprintf(prompt, sizeof prompt, "topic %d", topic);
        snprintf(text, sizeof text, "%s says %d", tenant, topic);
        float v[THREAD_DIM] = {0};
        v[topic % THREAD_DIM] = 1.0f;
        v[(topic / THREAD_DIM + 3) % THREAD_DIM] += 0.5f;
        blade_semcache_key k = key(tenant, "m", "p", prompt);
        int op = (int)((rng >> 20) % 10);
        if (op < 4) {
            blade_semcache_response r = {.text = text, .text_len = strlen(text), .finish_reason = "stop"};
            if (blade_semcache_insert(w->c, &k, v, &r, NULL) != 0)
                w->bad++;
        } else if (op < 9) {
            blade_semcache_hit hit;
            int rc = blade_semcache_lookup(w->c, &k, op == 8 ? v : NULL, &hit, NULL);
            /* a hit must be this tenant's, for this topic */
            if (rc < 0 || (rc > 0 && strcmp(hit.response.text, text) != 0))
                w->bad++;
            blade_semcache_hit_clear(&hit);
        } else {
            blade_semcache_sweep(w->c);
            blade_semcache_stats s;
            blade_semcache_get_stats(w->c, &s);
            if (s.entries > 40)
                w->bad++;
        }
    }
    return NULL;
}

static void test_concurrent(void **state)
{
    (void)state;
    static const blade_semcache_index kinds[] = {BLADE_SEMCACHE_INDEX_AUTO, BLADE_SEMCACHE_INDEX_HNSW};
    char *dir = fresh_dir("semcache-threads");
    char *db = path_in(dir, "cache.db");
    for (int kind = 0; kind < 2; kind++) {
        unlink(db);
        clk.now = 0;
        blade_semcache_config cfg = config(THREAD_DIM);
        cfg.index = kinds[kind];
        cfg.max_entries = 40;
        cfg.exact_scan_max = 8;
        cfg.threshold = 0.999f;
        cfg.db_path = db;
        cfg.ttl_s = 1e6;
        cfg.sweep_interval_s = 0.001;
        blade_semcache *c = open_cache(&cfg);
        pthread_t t[THREADS];
        worker w[THREADS];
        for (int i = 0; i < THREADS; i++) {
            w[i] = (worker){.c = c, .id = i};
            pthread_create(&t[i], NULL, work, &w[i]);
        }
        for (int i = 0; i < THREADS; i++) {
            pthread_join(t[i], NULL);
            assert_int_equal(w[i].bad, 0);
        }
        blade_semcache_stats s = stats_of(c);
        assert_true(s.entries <= 40);
        assert_true(s.exact_hits + s.semantic_hits > 0);
        assert_int_equal(blade_semcache_flush(c, NULL), 0);
        blade_semcache_close(c);
        /* what the file holds is what memory held */
        c = open_cache(&cfg);
        assert_int_equal(stats_of(c).entries, s.entries);
        blade_semcache_close(c);
    }
    free(db);
    free(dir);
}

/* ---- the dot-product kernels ---- */

static void test_dot_kernels(void **state)
{
    (void)state;
    blade_isa saved = blade_isa_active();
    static const int sizes[] = {1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100, 2048, 2051};
    float *a = malloc(2051 * sizeof *a), *rows = malloc(5 * 2051 * sizeof *rows);
    for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
        if (!isa_tested((blade_isa)isa, "dot products"))
            continue;
        blade_isa_set((blade_isa)isa);
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            int n = sizes[si];
            random_vec(a, n);
            random_vec(rows, 5 * n);
            double best_ref = -INFINITY;
            int best_at = -1;
            float pair[5];
            for (int r = 0; r < 5; r++) {
                double ref = 0, mag = 0;
                for (int i = 0; i < n; i++) {
                    ref += (double)a[i] * rows[r * n + i];
                    mag += fabs((double)a[i] * rows[r * n + i]);
                }
                pair[r] = blade_dot_f32(a, rows + r * n, n);
                if (fabs(pair[r] - ref) > 1e-5 * mag + 1e-6)
                    fail_msg("%s n=%d: %g, want %g", blade_isa_name((blade_isa)isa), n, (double)pair[r], ref);
                if (ref > best_ref) {
                    best_ref = ref;
                    best_at = r;
                }
            }
            float best;
            int64_t at = blade_dot_best_row_f32(rows, 5, n, a, &best);
            assert_int_equal(at, best_at);
            /* the scan reports the very bits the pair gives */
            assert_memory_equal(&best, &pair[at], sizeof best);
        }
        float unused;
        assert_int_equal(blade_dot_best_row_f32(rows, 0, 8, a, &unused), -1);
    }
    blade_isa_set(saved);
    free(a);
    free(rows);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exact_tier),
        cmocka_unit_test(test_semantic_threshold),
        cmocka_unit_test(test_invalid_input),
        cmocka_unit_test(test_tenant_isolation),
        cmocka_unit_test(test_ttl),
        cmocka_unit_test(test_background_sweep),
        cmocka_unit_test(test_evict_by_entries),
        cmocka_unit_test(test_evict_by_bytes),
        cmocka_unit_test(test_index_kinds),
        cmocka_unit_test(test_hnsw_churn),
        cmocka_unit_test(test_persistence_roundtrip),
        cmocka_unit_test(test_corrupt_database),
        cmocka_unit_test(test_concurrent),
        cmocka_unit_test(test_dot_kernels),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

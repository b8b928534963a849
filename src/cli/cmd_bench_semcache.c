/* `blade bench semantic-cache`: the semantic cache's lookup latency and memory per entry
 * at a given size and embedding dimension, for each index kind (exact scan, HNSW graph,
 * AUTO), measured in one run through the public API the server calls (keys hashed, locks
 * taken, the hit copied out). Embeddings are synthetic but clustered like real ones:
 * entries are noisy copies of cluster centres, near-duplicate queries are slightly noisier
 * copies of stored entries (similarity about 0.98), fresh queries new members of a
 * cluster (about 0.74 to its nearest entry). */
#include "blade/kernels.h"
#include "blade/semantic_cache.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <malloc.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_LIST 8
/* Entries per cluster centre, and the spread of entries and queries around what they copy. */
#define CLUSTER_SIZE 20
#define ENTRY_NOISE 0.6
#define QUERY_NOISE 0.2

/* A comma-separated list of whole numbers in [1, max]: --entries, --dim. */
typedef struct num_list {
    long long v[MAX_LIST];
    int n;
} num_list;

static bool parse_nums(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    num_list *l = dest;
    l->n = 0;
    char *copy = strdup(value), *save = NULL;
    bool ok = copy != NULL;
    for (char *tok = ok ? strtok_r(copy, ",", &save) : NULL; ok && tok; tok = strtok_r(NULL, ",", &save))
        ok = l->n < MAX_LIST && cli_int_in(tok, 1, (long long)f->max, &l->v[l->n++]);
    free(copy);
    if (!ok || l->n == 0)
        snprintf(why, cap, "--%s expects up to %d comma-separated numbers from 1 to %.0f, got '%s'", f->name, MAX_LIST,
                 f->max, value);
    return ok && l->n > 0;
}

typedef struct kind_list {
    blade_semcache_index v[MAX_LIST];
    int n;
} kind_list;

static bool parse_kinds(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    static const char *const names[] = {"auto", "exact", "hnsw"};
    kind_list *l = dest;
    l->n = 0;
    char *copy = strdup(value), *save = NULL;
    bool ok = copy != NULL;
    for (char *tok = ok ? strtok_r(copy, ",", &save) : NULL; ok && tok; tok = strtok_r(NULL, ",", &save)) {
        int k = -1;
        for (int i = 0; i < 3; i++)
            if (!strcmp(tok, names[i]))
                k = i;
        ok = k >= 0 && l->n < MAX_LIST;
        if (ok)
            l->v[l->n++] = (blade_semcache_index)k;
    }
    free(copy);
    if (!ok || l->n == 0)
        snprintf(why, cap, "--%s expects a comma-separated list of exact, hnsw and auto, got '%s'", f->name, value);
    return ok && l->n > 0;
}

static const char *kind_name(blade_semcache_index k)
{
    return k == BLADE_SEMCACHE_INDEX_EXACT ? "exact" : k == BLADE_SEMCACHE_INDEX_HNSW ? "hnsw" : "auto";
}

/* Deterministic Gaussian noise per (stream, index). */
static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void gaussians(uint64_t seed, float *out, int n, double scale)
{
    uint64_t s = seed;
    for (int i = 0; i < n; i += 2) {
        double u1 = ((splitmix(&s) >> 11) + 0.5) / 9007199254740992.0;
        double u2 = ((splitmix(&s) >> 11) + 0.5) / 9007199254740992.0;
        double r = sqrt(-2.0 * log(u1)) * scale;
        out[i] = (float)(r * cos(6.283185307179586 * u2));
        if (i + 1 < n)
            out[i + 1] = (float)(r * sin(6.283185307179586 * u2));
    }
}

static void normalise(float *v, int n)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += (double)v[i] * v[i];
    double inv = 1.0 / sqrt(ss);
    for (int i = 0; i < n; i++)
        v[i] = (float)(v[i] * inv);
}

typedef struct data {
    int dim;
    int64_t n_centres;
    float *centres;
} data;

/* Entry i: a noisy copy of centre i mod n_centres, unit length. */
static void entry_vec(const data *d, int64_t i, float *out)
{
    gaussians(0x5eed0000ull + (uint64_t)i, out, d->dim, ENTRY_NOISE / sqrt(d->dim));
    const float *c = d->centres + (size_t)(i % d->n_centres) * (size_t)d->dim;
    for (int k = 0; k < d->dim; k++)
        out[k] += c[k];
    normalise(out, d->dim);
}

static void near_query(const data *d, int64_t i, int64_t q, float *out)
{
    float *noise = malloc((size_t)d->dim * sizeof *noise);
    entry_vec(d, i, out);
    gaussians(0xabcd0000ull + (uint64_t)q, noise, d->dim, QUERY_NOISE / sqrt(d->dim));
    for (int k = 0; k < d->dim; k++)
        out[k] += noise[k];
    free(noise);
}

/* A member of a cluster that was never stored: an entry number past the end. */
static void fresh_query(const data *d, int64_t n_entries, int64_t q, float *out)
{
    entry_vec(d, n_entries + q, out);
}

static double resident_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long long size = 0, resident = 0;
    if (f) {
        if (fscanf(f, "%lld %lld", &size, &resident) != 2)
            resident = 0;
        fclose(f);
    }
    return (double)resident * (double)sysconf(_SC_PAGESIZE);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of sorted values. */
static double percentile(const double *sorted, int n, double p)
{
    int i = (int)ceil(p * n) - 1;
    return sorted[i < 0 ? 0 : i >= n ? n - 1 : i];
}

typedef struct options {
    int queries, partitions, response_bytes;
    double threshold;
    blade_semcache_config base;
} options;

typedef struct result {
    double insert_us;
    double near_p50, near_p99, fresh_p50, fresh_p99, exact_p50; /* microseconds */
    double recall;
    double rss_per_entry, accounted_per_entry;
} result;

static void key_for(blade_semcache_key *k, char *tenant, char *prompt, int64_t i, int partitions, bool query)
{
    snprintf(tenant, 32, "tenant-%d", (int)(i % partitions));
    snprintf(prompt, 64, "%s number %lld", query ? "a query" : "a stored prompt", (long long)i);
    *k = (blade_semcache_key){.tenant = tenant, .model = "bench-model", .params = "temperature=0", .params_len = 13,
                              .prompt = prompt, .prompt_len = strlen(prompt)};
}

/* Times one lookup in microseconds; counts hits into *hits. */
static double timed_lookup(blade_semcache *c, const blade_semcache_key *k, const float *v, int *hits)
{
    blade_semcache_hit hit;
    double t0 = cli_now();
    int rc = blade_semcache_lookup(c, k, v, &hit, NULL);
    double dt = (cli_now() - t0) * 1e6;
    if (rc > 0)
        (*hits)++;
    blade_semcache_hit_clear(&hit);
    return dt;
}

static int run_one(const options *o, const data *d, int64_t n, blade_semcache_index kind, result *r)
{
    bool tty = isatty(STDERR_FILENO);
    malloc_trim(0);
    double rss0 = resident_bytes();
    blade_semcache_config cfg = o->base;
    cfg.dim = d->dim;
    cfg.index = kind;
    cfg.threshold = (float)o->threshold;
    cfg.max_entries = n;
    cfg.max_bytes = INT64_MAX;
    cfg.ttl_s = 0;
    cfg.sweep_interval_s = -1;
    blade_error err = {{0}};
    blade_semcache *c = blade_semcache_open(&cfg, &err);
    if (!c) {
        fprintf(stderr, "error: %s\n", err.msg);
        return -1;
    }
    char *text = malloc((size_t)o->response_bytes + 1);
    memset(text, 'a', (size_t)o->response_bytes);
    blade_semcache_response resp = {.text = text, .text_len = (size_t)o->response_bytes, .finish_reason = "stop",
                                    .prompt_tokens = 100, .completion_tokens = 200};
    float *v = malloc((size_t)d->dim * sizeof *v);
    char tenant[32], prompt[64];
    blade_semcache_key k;
    double t0 = cli_now(), last_report = t0;
    int rc = 0;
    for (int64_t i = 0; i < n && !rc; i++) {
        entry_vec(d, i, v);
        key_for(&k, tenant, prompt, i, o->partitions, false);
        if (blade_semcache_insert(c, &k, v, &resp, &err) != 0) {
            fprintf(stderr, "error: insert: %s\n", err.msg);
            rc = -1;
        }
        if (tty && cli_now() - last_report > 0.5) {
            fprintf(stderr, "\r%-6s dim %d: storing %lld/%lld   ", kind_name(kind), d->dim, (long long)i, (long long)n);
            last_report = cli_now();
        }
    }
    r->insert_us = (cli_now() - t0) / (double)n * 1e6;
    blade_semcache_stats s;
    blade_semcache_get_stats(c, &s);
    /* the arrays that growing left behind are free, not held: return them first */
    malloc_trim(0);
    r->rss_per_entry = (resident_bytes() - rss0) / (double)n;
    r->accounted_per_entry = (double)(s.bytes + s.index_bytes) / (double)n;

    double *near = malloc((size_t)o->queries * sizeof *near), *fresh = malloc((size_t)o->queries * sizeof *fresh),
           *exact = malloc((size_t)o->queries * sizeof *exact);
    int near_hits = 0, fresh_hits = 0, exact_hits = 0;
    uint64_t pick = 7;
    for (int q = 0; q < o->queries && !rc; q++) {
        if (tty && cli_now() - last_report > 0.5) {
            fprintf(stderr, "\r%-6s dim %d: query %d/%d          ", kind_name(kind), d->dim, q, o->queries);
            last_report = cli_now();
        }
        int64_t i = (int64_t)(splitmix(&pick) % (uint64_t)n);
        near_query(d, i, q, v);
        key_for(&k, tenant, prompt, i, o->partitions, true);
        near[q] = timed_lookup(c, &k, v, &near_hits);
        fresh_query(d, n, q, v);
        key_for(&k, tenant, prompt, n + q, o->partitions, true);
        fresh[q] = timed_lookup(c, &k, v, &fresh_hits);
        key_for(&k, tenant, prompt, i, o->partitions, false);
        entry_vec(d, i, v);
        exact[q] = timed_lookup(c, &k, v, &exact_hits);
    }
    if (tty)
        fprintf(stderr, "\r%60s\r", "");
    qsort(near, (size_t)o->queries, sizeof *near, cmp_double);
    qsort(fresh, (size_t)o->queries, sizeof *fresh, cmp_double);
    qsort(exact, (size_t)o->queries, sizeof *exact, cmp_double);
    r->near_p50 = percentile(near, o->queries, 0.50);
    r->near_p99 = percentile(near, o->queries, 0.99);
    r->fresh_p50 = percentile(fresh, o->queries, 0.50);
    r->fresh_p99 = percentile(fresh, o->queries, 0.99);
    r->exact_p50 = percentile(exact, o->queries, 0.50);
    r->recall = (double)near_hits / o->queries;
    if (!rc && (exact_hits != o->queries || fresh_hits != 0)) {
        fprintf(stderr, "error: %d of %d repeated requests hit the exact tier, %d fresh queries hit\n", exact_hits,
                o->queries, fresh_hits);
        rc = -1;
    }
    free(near);
    free(fresh);
    free(exact);
    free(v);
    free(text);
    blade_semcache_close(c);
    return rc;
}

typedef struct semcache_options {
    num_list entries, dims;
    kind_list kinds;
    long long queries, partitions, response_bytes, exact_scan_max, hnsw_m, ef_construction, ef_search;
    double threshold;
    bool json;
} semcache_options;

static void semcache_init(void *opts)
{
    semcache_options *o = opts;
    o->entries = (num_list){{1000, 10000, 100000}, 3};
    o->dims = (num_list){{64, 2048}, 2};
    o->kinds = (kind_list){{BLADE_SEMCACHE_INDEX_EXACT, BLADE_SEMCACHE_INDEX_HNSW, BLADE_SEMCACHE_INDEX_AUTO}, 3};
    o->queries = 1000;
    o->partitions = 1;
    o->response_bytes = 1000;
    o->threshold = 0.95;
}

#define O semcache_options
static const cli_flag semcache_flags[] = {
    {.name = "entries", .kind = CLI_CUSTOM, CLI_AT(O, entries), .parse = parse_nums, .max = 10000000,
     .metavar = "LIST", .dflt = "1000,10000,100000", .help = "cache sizes"},
    {.name = "dim", .kind = CLI_CUSTOM, CLI_AT(O, dims), .parse = parse_nums, .max = 65536, .metavar = "LIST",
     .dflt = "64,2048", .help = "embedding dimensions"},
    {.name = "index", .kind = CLI_CUSTOM, CLI_AT(O, kinds), .parse = parse_kinds, .metavar = "LIST",
     .dflt = "exact,hnsw,auto", .help = "index kinds: exact, hnsw, auto"},
    {.name = "queries", .kind = CLI_INT, CLI_AT(O, queries), .min = 1, .max = 1000000, .metavar = "N",
     .help = "queries of each kind"},
    {.name = "partitions", .kind = CLI_INT, CLI_AT(O, partitions), .min = 1, .max = 1000000, .metavar = "P",
     .help = "spread the entries over P tenants"},
    {.name = "response-bytes", .kind = CLI_INT, CLI_AT(O, response_bytes), .min = 0, .max = 1 << 24,
     .metavar = "B", .help = "stored response size"},
    {.name = "threshold", .kind = CLI_DOUBLE, CLI_AT(O, threshold), .min = 1e-6, .max = 1, .metavar = "T",
     .help = "similarity threshold"},
    {.name = "exact-scan-max", .kind = CLI_INT, CLI_AT(O, exact_scan_max), .min = 1, .max = INT32_MAX,
     .metavar = "N", .dflt = "the cache's", .help = "AUTO's switch point in entries"},
    {.name = "hnsw-m", .kind = CLI_INT, CLI_AT(O, hnsw_m), .min = 2, .max = 256, .metavar = "M",
     .dflt = "the cache's", .help = "links per graph node"},
    {.name = "ef-construction", .kind = CLI_INT, CLI_AT(O, ef_construction), .min = 1, .max = 10000,
     .metavar = "E", .dflt = "the cache's", .help = "candidate list while building"},
    {.name = "ef-search", .kind = CLI_INT, CLI_AT(O, ef_search), .min = 1, .max = 10000, .metavar = "E",
     .dflt = "the cache's", .help = "candidate list while searching"},
    {.name = "json", .kind = CLI_BOOL, CLI_AT(O, json), .help = "one JSON object instead of the table"},
    {0},
};
#undef O

static int semcache_main(int argc, char **argv);

const cli_command cli_cmd_bench_semcache = {
    .name = "bench semantic-cache",
    .summary = "the semantic cache's lookup latency and memory per entry",
    .synopsis = "[--entries LIST] [--dim LIST] [--index LIST] [options]",
    .about = "Fills a semantic cache with synthetic clustered embeddings and measures, per index kind:\n"
             "  insert     mean time to store one entry (graph building included)\n"
             "  near p50/p99   lookup latency of near-duplicate queries (the semantic-hit path)\n"
             "  fresh p50/p99  lookup latency of fresh queries (the miss path)\n"
             "  exact p50  lookup latency of a repeated request (the exact tier)\n"
             "  recall     near-duplicate queries answered, against the exact scan's 100%\n"
             "  RSS/entry  resident memory added per entry; accounted: the cache's own count\n"
             "Hold the benchmark lock on a shared machine (flock /tmp/blade-bench.lock ...).\n",
    .tables = (const cli_table[]){{semcache_flags, 0}, {0}},
    .opts_size = sizeof(semcache_options),
    .init = semcache_init,
    .main = semcache_main,
};

static int semcache_main(int argc, char **argv)
{
    semcache_options so;
    int prc = cli_parse(&cli_cmd_bench_semcache, argc, argv, &so);
    if (prc != CLI_RUN)
        return prc;
    const long long *entries = so.entries.v, *dims = so.dims.v;
    const blade_semcache_index *kinds = so.kinds.v;
    int n_entries = so.entries.n, n_dims = so.dims.n, n_kinds = so.kinds.n;
    options o = {.queries = (int)so.queries, .partitions = (int)so.partitions, .response_bytes = (int)so.response_bytes,
                 .threshold = so.threshold, .base = blade_semcache_config_default(0)};
    o.base.exact_scan_max = (int32_t)so.exact_scan_max;
    o.base.hnsw_m = (int32_t)so.hnsw_m;
    o.base.hnsw_ef_construction = (int32_t)so.ef_construction;
    o.base.hnsw_ef_search = (int32_t)so.ef_search;
    bool json = so.json;
    const char *isa = blade_isa_name(blade_isa_active());
    if (json)
        printf("{\"isa\": \"%s\", \"queries\": %d, \"partitions\": %d, \"response_bytes\": %d, \"results\": [", isa,
               o.queries, o.partitions, o.response_bytes);
    else
        printf("semantic cache lookups: kernels %s, %d queries of each kind, %d partition(s), %d-byte responses\n\n"
               "| %5s | %7s | %-5s | %9s | %9s | %9s | %9s | %9s | %9s | %6s | %9s | %10s |\n"
               "|------:|--------:|-------|----------:|----------:|----------:|----------:|----------:|----------:|"
               "-------:|----------:|-----------:|\n",
               isa, o.queries, o.partitions, o.response_bytes, "dim", "entries", "index", "insert us", "near p50",
               "near p99", "fresh p50", "fresh p99", "exact p50", "recall", "RSS/entry", "accounted");
    int rc = 0, printed = 0;
    for (int di = 0; di < n_dims && !rc; di++) {
        data d = {.dim = (int)dims[di]};
        int64_t most = 0;
        for (int ei = 0; ei < n_entries; ei++)
            most = entries[ei] > most ? entries[ei] : most;
        d.n_centres = most / CLUSTER_SIZE > 0 ? most / CLUSTER_SIZE : 1;
        d.centres = malloc((size_t)d.n_centres * (size_t)d.dim * sizeof *d.centres);
        if (!d.centres) {
            fprintf(stderr, "error: out of memory for %lld cluster centres\n", (long long)d.n_centres);
            return 1;
        }
        for (int64_t i = 0; i < d.n_centres; i++) {
            gaussians(0xce0000ull + (uint64_t)i, d.centres + (size_t)i * (size_t)d.dim, d.dim, 1.0);
            normalise(d.centres + (size_t)i * (size_t)d.dim, d.dim);
        }
        for (int ei = 0; ei < n_entries && !rc; ei++) {
            for (int ki = 0; ki < n_kinds && !rc; ki++) {
                result r;
                if ((rc = run_one(&o, &d, entries[ei], kinds[ki], &r)))
                    break;
                if (json)
                    printf("%s{\"dim\": %d, \"entries\": %lld, \"index\": \"%s\", \"insert_us\": %.2f, "
                           "\"near_p50_us\": %.2f, \"near_p99_us\": %.2f, \"fresh_p50_us\": %.2f, \"fresh_p99_us\": %.2f, "
                           "\"exact_p50_us\": %.2f, \"recall\": %.4f, \"rss_bytes_per_entry\": %.0f, "
                           "\"accounted_bytes_per_entry\": %.0f}",
                           printed++ ? ", " : "", d.dim, entries[ei], kind_name(kinds[ki]), r.insert_us, r.near_p50,
                           r.near_p99, r.fresh_p50, r.fresh_p99, r.exact_p50, r.recall, r.rss_per_entry,
                           r.accounted_per_entry);
                else
                    printf("| %5d | %7lld | %-5s | %9.1f | %9.1f | %9.1f | %9.1f | %9.1f | %9.1f | %5.1f%% | %9.0f | %10.0f |\n",
                           d.dim, entries[ei], kind_name(kinds[ki]), r.insert_us, r.near_p50, r.near_p99, r.fresh_p50,
                           r.fresh_p99, r.exact_p50, r.recall * 100, r.rss_per_entry, r.accounted_per_entry);
                fflush(stdout);
            }
        }
        free(d.centres);
    }
    if (json)
        printf("]}\n");
    return rc ? 1 : 0;
}

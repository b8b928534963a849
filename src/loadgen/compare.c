/* `blade bench compare` (compare.h): two --json results of `blade bench serve` side by
 * side, and a regression beyond the allowed percentage as a failing exit status. */

#include "loadgen/compare.h"

#include "common/file.h"

#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    HIGHER_IS_BETTER, /* throughputs: a drop is a regression */
    LOWER_IS_BETTER,  /* latencies: a rise is a regression */
    SHOWN_ONLY        /* follows from the others (cost) or from the run's length */
} direction;

/* Adding a figure to the comparison is one line here. */
static const struct {
    const char *path; /* inside "results", dotted */
    const char *label;
    direction dir;
} figures[] = {
    {"request_throughput", "request throughput (req/s)", HIGHER_IS_BETTER},
    {"input_token_throughput", "input throughput (tok/s)", HIGHER_IS_BETTER},
    {"output_token_throughput", "output throughput (tok/s)", HIGHER_IS_BETTER},
    {"total_token_throughput", "total throughput (tok/s)", HIGHER_IS_BETTER},
    {"goodput", "goodput (req/s)", HIGHER_IS_BETTER},
    {"ttft_ms.mean", "TTFT mean (ms)", LOWER_IS_BETTER},
    {"ttft_ms.median", "TTFT median (ms)", LOWER_IS_BETTER},
    {"ttft_ms.p90", "TTFT p90 (ms)", LOWER_IS_BETTER},
    {"ttft_ms.p99", "TTFT p99 (ms)", LOWER_IS_BETTER},
    {"tpot_ms.mean", "TPOT mean (ms)", LOWER_IS_BETTER},
    {"tpot_ms.median", "TPOT median (ms)", LOWER_IS_BETTER},
    {"tpot_ms.p90", "TPOT p90 (ms)", LOWER_IS_BETTER},
    {"tpot_ms.p99", "TPOT p99 (ms)", LOWER_IS_BETTER},
    {"itl_ms.mean", "ITL mean (ms)", LOWER_IS_BETTER},
    {"itl_ms.median", "ITL median (ms)", LOWER_IS_BETTER},
    {"itl_ms.p90", "ITL p90 (ms)", LOWER_IS_BETTER},
    {"itl_ms.p99", "ITL p99 (ms)", LOWER_IS_BETTER},
    {"e2e_ms.mean", "E2E mean (ms)", LOWER_IS_BETTER},
    {"e2e_ms.median", "E2E median (ms)", LOWER_IS_BETTER},
    {"e2e_ms.p90", "E2E p90 (ms)", LOWER_IS_BETTER},
    {"e2e_ms.p99", "E2E p99 (ms)", LOWER_IS_BETTER},
    {"cost_per_million_output_tokens", "$ per 1M output tokens", SHOWN_ONLY},
    {"cost_per_million_total_tokens", "$ per 1M total tokens", SHOWN_ONLY},
    {"failed", "failed requests", SHOWN_ONLY},
};

static json_t *load(const char *path, FILE *errout)
{
    blade_error err = {{0}};
    json_t *j = blade_read_json(path, &err);
    if (!j) {
        fprintf(errout, "error: %s\n", err.msg);
        return NULL;
    }
    if (json_integer_value(json_object_get(j, "blade_bench_serve")) != 1 ||
        !json_is_object(json_object_get(j, "results"))) {
        fprintf(errout, "error: %s is not a `blade bench serve --json` result\n", path);
        json_decref(j);
        return NULL;
    }
    return j;
}

static double lookup(json_t *results, const char *path)
{
    char key[64];
    json_t *v = results;
    while (v && *path) {
        size_t n = strcspn(path, ".");
        snprintf(key, sizeof key, "%.*s", (int)n, path);
        v = json_object_get(v, key);
        path += n + (path[n] == '.');
    }
    return json_is_number(v) ? json_number_value(v) : NAN;
}

/* Results of different traffic are not comparable, whatever the numbers say. */
static bool same_traffic(json_t *a, json_t *b, FILE *errout)
{
    static const char *const keys[] = {"workload", "load"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        json_t *x = json_object_get(json_object_get(a, "config"), keys[i]);
        json_t *y = json_object_get(json_object_get(b, "config"), keys[i]);
        if (!json_equal(x, y)) {
            char *sx = json_dumps(x, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY);
            char *sy = json_dumps(y, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY);
            fprintf(errout, "error: the files measured different %s:\n  base: %s\n  new:  %s\n", keys[i],
                    sx ? sx : "null", sy ? sy : "null");
            free(sx);
            free(sy);
            return false;
        }
    }
    return true;
}

int lg_compare_files(const char *base_path, const char *new_path, double max_regression_pct, FILE *out,
                     FILE *errout)
{
    json_t *base = load(base_path, errout);
    json_t *cur = base ? load(new_path, errout) : NULL;
    if (!cur || !same_traffic(base, cur, errout)) {
        json_decref(base);
        json_decref(cur);
        return LG_COMPARE_UNUSABLE;
    }
    json_t *rb = json_object_get(base, "results"), *rn = json_object_get(cur, "results");
    int regressions = 0;
    fprintf(out, "%-28s %14s %14s %9s\n", "figure", "base", "new", "change");
    for (size_t i = 0; i < sizeof figures / sizeof figures[0]; i++) {
        double b = lookup(rb, figures[i].path), n = lookup(rn, figures[i].path);
        if (isnan(b) && isnan(n))
            continue;
        double change = b != 0 && !isnan(b) && !isnan(n) ? (n - b) / fabs(b) * 100 : NAN;
        bool worse = (figures[i].dir == HIGHER_IS_BETTER && change < -max_regression_pct) ||
                     (figures[i].dir == LOWER_IS_BETTER && change > max_regression_pct);
        regressions += worse;
        char bs[32] = "-", ns[32] = "-", cs[32] = "-";
        if (!isnan(b))
            snprintf(bs, sizeof bs, "%.4g", b);
        if (!isnan(n))
            snprintf(ns, sizeof ns, "%.4g", n);
        if (!isnan(change))
            snprintf(cs, sizeof cs, "%+.1f%%", change);
        fprintf(out, "%-28s %14s %14s %9s%s\n", figures[i].label, bs, ns, cs, worse ? "  REGRESSION" : "");
    }
    if (regressions)
        fprintf(out, "%d figure%s regressed by more than %g%%\n", regressions, regressions == 1 ? "" : "s",
                max_regression_pct);
    else
        fprintf(out, "no figure regressed by more than %g%%\n", max_regression_pct);
    json_decref(base);
    json_decref(cur);
    return regressions ? LG_COMPARE_REGRESSION : LG_COMPARE_OK;
}

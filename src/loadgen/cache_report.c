/* The semantic cache's effect on a semantic-workload run (cache_report.h). */

#include "loadgen/cache_report.h"

#include <math.h>
#include <string.h>

/* A request no earlier one asked: a base prompt's first asking, a near miss, a fresh
 * prompt. Any answer from the cache is another question's. */
static bool false_hit_label(lg_label l)
{
    return l == LG_LABEL_BASE || l == LG_LABEL_NEAR_MISS || l == LG_LABEL_FRESH;
}

void lg_cache_report_make(const lg_run_result *res, lg_cache_report *out)
{
    memset(out, 0, sizeof *out);
    out->max_false_similarity = -1;
    out->min_true_similarity = 2;
    for (size_t i = 0; i < res->n_records; i++) {
        const lg_record *r = &res->records[i];
        if (r->failure != LG_OK || r->label >= LG_LABEL_COUNT)
            continue;
        out->n++;
        out->requests[r->label]++;
        if (!r->cache_tier)
            continue;
        out->hits++;
        if (r->cache_tier == 1)
            out->exact_hits[r->label]++;
        else
            out->semantic_hits[r->label]++;
        bool wrong = false_hit_label(r->label);
        if (wrong) {
            out->false_hits++;
            if (r->cache_similarity > out->max_false_similarity)
                out->max_false_similarity = r->cache_similarity;
        } else if (r->cache_tier == 2 && r->cache_similarity < out->min_true_similarity) {
            out->min_true_similarity = r->cache_similarity;
        }
    }
    /* the next float above the worst false hit (the cache compares floats) */
    out->zero_false_threshold =
        out->max_false_similarity < 0 ? 0 : nextafterf((float)out->max_false_similarity, 2.0f);
    int64_t kept = 0;
    for (size_t i = 0; i < res->n_records; i++) {
        const lg_record *r = &res->records[i];
        bool wrong = false_hit_label(r->label);
        if (r->failure == LG_OK && r->cache_tier && !wrong &&
            (r->cache_tier == 1 || r->cache_similarity >= out->zero_false_threshold))
            kept++;
    }
    out->hit_rate_at_zero_false = out->n ? (double)kept / (double)out->n : 0;
}

void lg_cache_report_print(FILE *out, const lg_cache_report *r)
{
    fprintf(out, "semantic cache: %lld hits of %lld requests (%.1f%%), %lld false hits\n", (long long)r->hits,
            (long long)r->n, r->n ? 100.0 * (double)r->hits / (double)r->n : 0.0, (long long)r->false_hits);
    fprintf(out, "  %-10s %9s %11s %14s\n", "kind", "requests", "exact hits", "semantic hits");
    for (int l = LG_LABEL_BASE; l < LG_LABEL_COUNT; l++)
        fprintf(out, "  %-10s %9lld %11lld %14lld\n", lg_label_name((lg_label)l), (long long)r->requests[l],
                (long long)r->exact_hits[l], (long long)r->semantic_hits[l]);
    if (r->min_true_similarity <= 1)
        fprintf(out, "  reworded hits' lowest similarity: %.4f\n", r->min_true_similarity);
    if (r->false_hits)
        fprintf(out, "  false hits' highest similarity: %.4f: a threshold of %.6f would have avoided all of them, "
                     "keeping a hit rate of %.1f%%\n",
                r->max_false_similarity, r->zero_false_threshold, 100.0 * r->hit_rate_at_zero_false);
    else
        fprintf(out, "  no false hit at the server's threshold\n");
}

json_t *lg_cache_report_json(const lg_cache_report *r)
{
    json_t *kinds = json_object();
    for (int l = LG_LABEL_BASE; l < LG_LABEL_COUNT; l++)
        json_object_set_new(kinds, lg_label_name((lg_label)l),
                            json_pack("{s:I, s:I, s:I}", "requests", (json_int_t)r->requests[l], "exact_hits",
                                      (json_int_t)r->exact_hits[l], "semantic_hits", (json_int_t)r->semantic_hits[l]));
    return json_pack("{s:I, s:I, s:I, s:o, s:f, s:f, s:f, s:f}", "requests", (json_int_t)r->n, "hits",
                     (json_int_t)r->hits, "false_hits", (json_int_t)r->false_hits, "by_kind", kinds,
                     "max_false_similarity", r->max_false_similarity, "min_true_similarity",
                     r->min_true_similarity > 1 ? -1.0 : r->min_true_similarity, "zero_false_threshold",
                     r->zero_false_threshold, "hit_rate_at_zero_false", r->hit_rate_at_zero_false);
}

#ifndef BLADE_LOADGEN_CACHE_REPORT_H
#define BLADE_LOADGEN_CACHE_REPORT_H

/* What a semantic cache did to a semantic-workload run: hits per kind of request (the
 * workload labels each), false hits (a base prompt's first asking, a near miss or a fresh
 * prompt answered from the cache) and, from the similarity each semantic hit reported, the lowest threshold at which
 * none of this run's false hits would have happened and the hit rate left there. */

#include "loadgen/client.h"

#include <jansson.h>
#include <stdio.h>

typedef struct lg_cache_report {
    int64_t requests[LG_LABEL_COUNT];
    int64_t exact_hits[LG_LABEL_COUNT];
    int64_t semantic_hits[LG_LABEL_COUNT];
    int64_t hits, false_hits, n;
    double max_false_similarity;     /* -1 without false hits */
    double min_true_similarity;      /* lowest similarity of a reworded request's semantic hit; 2: none */
    double zero_false_threshold;     /* the lowest threshold above every false hit's similarity */
    double hit_rate_at_zero_false;   /* hits that keep their similarity >= that threshold, over all */
} lg_cache_report;

/* From the run's successful records. */
void lg_cache_report_make(const lg_run_result *res, lg_cache_report *out);
void lg_cache_report_print(FILE *out, const lg_cache_report *r);
json_t *lg_cache_report_json(const lg_cache_report *r);

#endif

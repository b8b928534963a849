#ifndef BLADE_LOADGEN_COMPARE_H
#define BLADE_LOADGEN_COMPARE_H

/* `blade bench compare`: two --json files of `blade bench serve`, figure by figure, as a
 * guard in CI that performance does not rot quietly. */

#include <stdio.h>

enum {
    LG_COMPARE_OK = 0,         /* no figure moved the wrong way by more than the threshold */
    LG_COMPARE_REGRESSION = 1, /* a throughput fell, or a latency rose, by more than it */
    LG_COMPARE_UNUSABLE = 2    /* a file could not be read, is not a bench serve result, or
                                * the two measured different workloads */
};

/* Prints the side-by-side table to out and problems to errout; max_regression_pct is in
 * percent (5 = 5%). */
int lg_compare_files(const char *base_path, const char *new_path, double max_regression_pct, FILE *out,
                     FILE *errout);

#endif

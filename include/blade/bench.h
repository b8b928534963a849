#ifndef BLADE_BENCH_H
#define BLADE_BENCH_H

/* Measurement helpers for `blade bench`: the machine's memory read bandwidth (the roofline
 * that single-sequence decode is judged against) and simple statistics. */

#include "blade/kernels.h"

#include <stddef.h>

/* Best of `repeats` passes reading a buffer of `bytes` with every thread of the pool;
 * bytes per second. */
double blade_measure_read_bandwidth(blade_threadpool *pool, size_t bytes, int repeats);

typedef struct blade_stats {
    double mean;
    double stddev;
} blade_stats;

blade_stats blade_stats_of(const double *values, int n);

#endif

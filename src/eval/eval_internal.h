#ifndef BLADE_EVAL_INTERNAL_H
#define BLADE_EVAL_INTERNAL_H

/* What the evaluation modules share: a running mean with its standard error, and the
 * clock their timings read. */

#include <math.h>
#include <stdint.h>
#include <time.h>

/* Welford's running mean: stable when the values' spread is tiny next to their size
 * (per-token NLL differences of a good quantization). */
typedef struct eval_mean {
    int64_t n;
    double mean;
    double m2; /* sum of squared deviations from the mean */
} eval_mean;

static inline void eval_mean_add(eval_mean *a, double x)
{
    a->n++;
    double d = x - a->mean;
    a->mean += d / (double)a->n;
    a->m2 += d * (x - a->mean);
}

/* Standard error of the mean: the sample standard deviation over sqrt(n). */
static inline double eval_mean_se(const eval_mean *a)
{
    return a->n > 1 ? sqrt(a->m2 / (double)(a->n - 1) / (double)a->n) : 0.0;
}

static inline double eval_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif

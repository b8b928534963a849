#ifndef BLADE_COMMON_CLOCK_H
#define BLADE_COMMON_CLOCK_H

/* The one clock every latency figure reads: monotonic seconds, so a wall-clock step (NTP,
 * a suspended laptop) never makes a duration negative. Only differences mean anything. */

#include <time.h>

static inline double blade_clock_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif

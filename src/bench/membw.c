/* The memory read bandwidth of the machine and simple statistics for `blade bench`
 * (bench.h): the roofline single-sequence decode is measured against, read with every
 * thread of the pool the way the matrix kernels stream weights. */

#include "blade/bench.h"

#include "kernels/stream_ahead.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef struct read_job {
    const uint8_t *buf;
    size_t bytes;
    uint64_t sink[64];
} read_job;

/* Wide loads OR-ed together: the loop issues nothing but loads, so it runs at the
 * memory system's read limit rather than at an arithmetic limit. It hints its stream as
 * the kernels do (stream_ahead.h): the page touch measured about 20% above plain loads on
 * two cores, and the prefetch ahead 5-15% more. The roofline is what the memory system
 * can deliver, not what a plain loop gets from it. */
#if defined(__x86_64__)
__attribute__((target("avx2"))) static uint64_t read_avx2(const uint8_t *p, size_t n)
{
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        prefetch_stream(p + i, 128);
        touch_stream(p + i, 128, p + n);
        a = _mm256_or_si256(a, _mm256_load_si256((const __m256i *)(p + i)));
        b = _mm256_or_si256(b, _mm256_load_si256((const __m256i *)(p + i + 32)));
        c = _mm256_or_si256(c, _mm256_load_si256((const __m256i *)(p + i + 64)));
        d = _mm256_or_si256(d, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    a = _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d));
    return (uint64_t)_mm256_extract_epi64(a, 0) | (uint64_t)_mm256_extract_epi64(a, 3);
}
#endif

static uint64_t read_scalar(const uint8_t *p, size_t n)
{
    uint64_t a = 0, b = 0, v0, v1;
    for (size_t i = 0; i + 16 <= n; i += 16) {
        prefetch_stream(p + i, 16);
        touch_stream(p + i, 16, p + n);
        memcpy(&v0, p + i, 8);
        memcpy(&v1, p + i + 8, 8);
        a |= v0;
        b |= v1;
    }
    return a | b;
}

static void read_task(void *ctx, int ith, int nth)
{
    read_job *j = ctx;
    size_t per = (j->bytes / (size_t)nth) & ~(size_t)127;
    const uint8_t *p = j->buf + per * (size_t)ith;
#if defined(__x86_64__)
    if (blade_cpu_get_features()->avx2) {
        j->sink[ith % 64] = read_avx2(p, per);
        return;
    }
#endif
    j->sink[ith % 64] = read_scalar(p, per);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double blade_measure_read_bandwidth(blade_threadpool *pool, size_t bytes, int repeats)
{
    /* Backed by 2 MiB pages where the kernel grants them, as the model's weights are
     * (gguf_open): the probe must not be held back by TLB misses the weights never see. */
    const size_t huge = (size_t)2 << 20;
    bytes = (bytes + huge - 1) / huge * huge;
    uint8_t *buf = aligned_alloc(huge, bytes);
    if (!buf)
        return 0.0;
    madvise(buf, bytes, MADV_HUGEPAGE);
    memset(buf, 1, bytes); /* fault every page in before timing */
    read_job job = {buf, bytes, {0}};
    int nth = blade_threadpool_size(pool);
    size_t read_bytes = ((bytes / (size_t)nth) & ~(size_t)127) * (size_t)nth;
    double best = 0.0;
    for (int r = 0; r < repeats; r++) {
        double t0 = now();
        blade_threadpool_run(pool, read_task, &job);
        double bw = (double)read_bytes / (now() - t0);
        if (bw > best)
            best = bw;
    }
    free(buf);
    return best;
}

blade_stats blade_stats_of(const double *values, int n)
{
    blade_stats s = {0.0, 0.0};
    if (n <= 0)
        return s;
    for (int i = 0; i < n; i++)
        s.mean += values[i];
    s.mean /= n;
    if (n > 1) {
        double ss = 0.0;
        for (int i = 0; i < n; i++)
            ss += (values[i] - s.mean) * (values[i] - s.mean);
        s.stddev = sqrt(ss / (n - 1));
    }
    return s;
}

/* Work sharing for uneven loops (kernels.h): each thread owns a share of the units and
 * takes pieces from its front, and a thread that runs out steals half of what is left at
 * the back of another's, with one atomic word per share. */

#include "blade/kernels.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An owner takes this fraction of what is left of its share at a time: large pieces
 * while much is left (a claim costs next to nothing), then smaller ones down to a single
 * unit, so the last piece, which nobody can take over, is a short wait. Fixed eighths of
 * the share left the two threads of a decode step waiting on each other about half
 * again as long. */
#define OWNER_TAKES_ONE_IN 8

/* The unclaimed units of one share: front in the low half, back (exclusive) in the high
 * half, so owner and thief agree through one compare-and-swap. A cache line each: the
 * owner claims without disturbing the others. */
typedef struct share {
    _Alignas(64) _Atomic uint64_t range;
} share;

struct blade_work_share {
    int n;
    share *shares;
};

static uint64_t pack(int64_t front, int64_t back)
{
    return (uint64_t)back << 32 | (uint64_t)front;
}

blade_work_share *blade_work_share_new(int n_threads)
{
    if (n_threads < 1)
        n_threads = 1;
    blade_work_share *w = malloc(sizeof *w);
    if (!w)
        return NULL;
    w->n = n_threads;
    w->shares = aligned_alloc(_Alignof(share), sizeof(share) * (size_t)n_threads);
    if (!w->shares) {
        free(w);
        return NULL;
    }
    memset(w->shares, 0, sizeof(share) * (size_t)n_threads);
    return w;
}

void blade_work_share_free(blade_work_share *w)
{
    if (!w)
        return;
    free(w->shares);
    free(w);
}

void blade_work_share_reset(blade_work_share *w, int64_t n_units)
{
    if (n_units < 0 || n_units > (int64_t)UINT32_MAX) {
        fprintf(stderr, "blade: work share of %lld units is out of range\n", (long long)n_units);
        abort();
    }
    for (int i = 0; i < w->n; i++) {
        int64_t b = n_units * i / w->n, e = n_units * (i + 1) / w->n;
        atomic_store_explicit(&w->shares[i].range, pack(b, e), memory_order_relaxed);
    }
}

/* The owner takes a piece from the front; a thief takes half of what is left from the
 * back, so the two meet in the middle of the rest. */
static bool take(share *s, bool owner, int64_t *begin, int64_t *end)
{
    uint64_t seen = atomic_load_explicit(&s->range, memory_order_relaxed);
    for (;;) {
        int64_t front = (int64_t)(seen & UINT32_MAX), back = (int64_t)(seen >> 32), left = back - front;
        if (left <= 0)
            return false;
        int64_t n = owner ? (left + OWNER_TAKES_ONE_IN - 1) / OWNER_TAKES_ONE_IN : (left + 1) / 2;
        uint64_t next = owner ? pack(front + n, back) : pack(front, back - n);
        if (atomic_compare_exchange_weak_explicit(&s->range, &seen, next, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *begin = owner ? front : back - n;
            *end = owner ? front + n : back;
            return true;
        }
    }
}

bool blade_work_share_next(blade_work_share *w, int ith, int64_t *begin, int64_t *end)
{
    int own = ith % w->n;
    if (take(&w->shares[own], true, begin, end))
        return true;
    for (int k = 1; k < w->n; k++)
        if (take(&w->shares[(own + k) % w->n], false, begin, end))
            return true;
    return false;
}

#ifndef BLADE_STREAM_AHEAD_H
#define BLADE_STREAM_AHEAD_H

#include <stddef.h>
#include <stdint.h>

/* What a one-token product does ahead of its weight stream, which it reads once per
 * decode step. Two hints, each measured on decode and on the bandwidth probe (which
 * takes the same hints, so that the roofline stays what the memory system can deliver).
 *
 * Page touch. The hardware prefetchers that keep such a stream at full speed start over
 * at every 4 KiB page (they do not cross into a page the core has not touched yet). As
 * the stream enters a page, a demand load of one byte in the page after it gets that
 * page going before the kernel reaches it: decode measured 25% (Q4_0) and 44% (Q8_0)
 * faster with it. Loads into several pages at once measured slower.
 *
 * Prefetch ahead. On two cores the stream is held back by how many lines each core keeps
 * in flight, and the hardware prefetchers keep fewer while the core computes. A
 * non-temporal software prefetch STREAM_AHEAD bytes ahead of the loads, every line once,
 * made decode 1.05-1.08x faster for Q4_0, F16 and BF16 (whole binaries taking turns) and
 * the plain read loop 1.05-1.15x; Q8_0 and Q4_K_M (which had a T0 prefetch) came out
 * even, though inside one process Q8_0 read anywhere from 0.88x to 1.17x with it as other
 * tenants came and went (MEASURED.md). Non-temporal, because these lines are used once:
 * the T0 hint measured slower on Q4_0, Q8_0 and Q4_K_M. About one page ahead: 2.3-5.8 KB
 * measured alike, 7 KB and more slower. */
#define TOUCH_PAGE ((uintptr_t)4096)
#define STREAM_AHEAD ((uintptr_t)4608)
/* A tile of several tokens (a speculative verify, a few sequences' decode) spends longer
 * on each line and wants its prefetch twice as far ahead: Q4_0 tiles with it decoded 16
 * sequences 1.10-1.19x as fast in each of eight rounds of whole binaries taking turns, Q8_0
 * four sequences 1.04-1.09x in eight, the rest within what moving the code alone changes
 * (MEASURED.md, stop 34). Three and four times as far measured no better. */
#define STREAM_AHEAD_TILE (2 * STREAM_AHEAD)

/* For the part [at, at + bytes) of a stream the caller is about to consume: for each page
 * that begins inside it, loads of its first `lines` cache lines in the page after that
 * one, those below end (the last byte the caller may read). One line suits a plain
 * stream; two consecutive lines measured 0.98x there, but 1.01-1.05x on Q4_K_M decode
 * (with the T0 prefetch they had then; with this file's prefetch, one line measured 0.90x
 * of two as whole binaries, though 1.05x inside one process). */
static inline void touch_stream_lines(const uint8_t *at, size_t bytes, const uint8_t *end, int lines)
{
    uintptr_t a = (uintptr_t)at;
    for (uintptr_t page = (a + TOUCH_PAGE - 1) & ~(TOUCH_PAGE - 1); page < a + bytes; page += TOUCH_PAGE) {
        const uint8_t *t = at + (page - a) + TOUCH_PAGE;
        for (int l = 0; l < lines && t + 64 * l < end; l++)
            (void)*(const volatile uint8_t *)(t + 64 * l);
    }
}

static inline void touch_stream(const uint8_t *at, size_t bytes, const uint8_t *end)
{
    touch_stream_lines(at, bytes, end, 1);
}

/* Non-temporal prefetch of the cache lines that begin in [at, at + bytes) moved `ahead`
 * bytes on (STREAM_AHEAD, or STREAM_AHEAD_TILE for a tile of several tokens). Called for
 * consecutive parts of a stream, it asks for every line once. It runs on past the rows of
 * the call: a product hands a thread consecutive pieces of its share (work_share.c), so
 * the next piece usually starts where this one ends, and stopping at the end of each piece
 * made every piece start cold (decode's output projection measured 3-5% slower that way,
 * timed inside one process). A prefetch never faults, so running past the end of the
 * matrix costs at most `ahead` bytes of reading. */
static inline void prefetch_stream_by(const uint8_t *at, size_t bytes, uintptr_t ahead)
{
    uintptr_t from = ((uintptr_t)at + ahead + 63) & ~(uintptr_t)63;
    uintptr_t to = (uintptr_t)at + ahead + bytes;
    for (uintptr_t line = from; line < to; line += 64)
        __builtin_prefetch((const void *)line, 0, 0);
}

/* Its own loop rather than a call of prefetch_stream_by: written as that call, gcc 12
 * inlined the other kernels differently, and the placement of code alone moved Q4_0's
 * 4-sequence decode to 0.90-0.93x (MEASURED.md, stop 34). */
static inline void prefetch_stream(const uint8_t *at, size_t bytes)
{
    uintptr_t from = ((uintptr_t)at + STREAM_AHEAD + 63) & ~(uintptr_t)63;
    uintptr_t to = (uintptr_t)at + STREAM_AHEAD + bytes;
    for (uintptr_t line = from; line < to; line += 64)
        __builtin_prefetch((const void *)line, 0, 0);
}

#endif

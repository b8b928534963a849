/* Stop strings (stop.h): the text held back while it could still be the start of a stop
 * string, released as soon as the next piece shows it is not, and dropped from the match
 * on. */

#include "blade/stop.h"

#include <stdlib.h>
#include <string.h>

int blade_stop_init(blade_stop_matcher *m, const char *const *stops, int n)
{
    memset(m, 0, sizeof *m);
    if (n <= 0)
        return 0;
    m->stops = calloc((size_t)n, sizeof *m->stops);
    m->lens = calloc((size_t)n, sizeof *m->lens);
    if (!m->stops || !m->lens)
        return blade_stop_destroy(m), -1;
    for (int i = 0; i < n; i++) {
        size_t len = strlen(stops[i]);
        if (!len)
            continue;
        if (!(m->stops[m->n] = malloc(len + 1)))
            return blade_stop_destroy(m), -1;
        memcpy(m->stops[m->n], stops[i], len + 1);
        m->lens[m->n++] = len;
    }
    return 0;
}

void blade_stop_destroy(blade_stop_matcher *m)
{
    for (int i = 0; m->stops && i < m->n; i++)
        free(m->stops[i]);
    free(m->stops);
    free(m->lens);
    free(m->pending);
    free(m->out);
    memset(m, 0, sizeof *m);
}

static bool reserve(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return true;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    char *grown = realloc(*buf, c);
    if (!grown)
        return false;
    *buf = grown;
    *cap = c;
    return true;
}

/* Longest suffix of text that is a proper prefix of some stop string. */
static size_t held_suffix(const blade_stop_matcher *m, const char *text, size_t n)
{
    size_t best = 0;
    for (int i = 0; i < m->n; i++) {
        size_t k = m->lens[i] - 1 < n ? m->lens[i] - 1 : n;
        for (; k > best; k--)
            if (!memcmp(text + n - k, m->stops[i], k)) {
                best = k;
                break;
            }
    }
    return best;
}

static bool release(blade_stop_matcher *m, size_t n, const char **out, size_t *out_len)
{
    if (!reserve(&m->out, &m->cap_out, n + 1))
        return false;
    memcpy(m->out, m->pending, n);
    m->out[n] = 0;
    memmove(m->pending, m->pending + n, m->n_pending - n);
    m->n_pending -= n;
    *out = m->out;
    *out_len = n;
    return true;
}

bool blade_stop_push(blade_stop_matcher *m, const char *text, size_t len, const char **out, size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    if (!reserve(&m->pending, &m->cap_pending, m->n_pending + len + 1))
        return true;
    memcpy(m->pending + m->n_pending, text, len);
    m->n_pending += len;
    if (m->n == 0)
        return !release(m, m->n_pending, out, out_len);

    /* the earliest match wins: it ends the text soonest */
    size_t first = m->n_pending;
    for (int i = 0; i < m->n; i++) {
        const char *hit = memmem(m->pending, m->n_pending, m->stops[i], m->lens[i]);
        if (hit && (size_t)(hit - m->pending) < first)
            first = (size_t)(hit - m->pending);
    }
    if (first < m->n_pending) {
        release(m, first, out, out_len);
        m->n_pending = 0;
        return true;
    }
    size_t hold = held_suffix(m, m->pending, m->n_pending);
    return !release(m, m->n_pending - hold, out, out_len);
}

void blade_stop_flush(blade_stop_matcher *m, const char **out, size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    /* before any text the buffers are NULL, which memcpy may not be given even for 0 bytes */
    if (m->n_pending)
        release(m, m->n_pending, out, out_len);
}

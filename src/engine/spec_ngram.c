/* The n-gram prompt-lookup drafter (spec.h): a pure function of the sequence's tokens.
 * Longer suffixes are tried first because a longer match predicts its continuation
 * better; the most recent occurrence wins because text that repeats itself usually
 * repeats what it said last. */

#include "blade/spec.h"

#include <string.h>

int32_t blade_ngram_propose(const int32_t *tokens, int32_t n, int32_t n_min, int32_t n_max, int32_t k,
                            int32_t *out)
{
    if (n_min < 1)
        n_min = 1;
    if (k <= 0 || n_max < n_min)
        return 0;
    for (int32_t len = n_max < n - 1 ? n_max : n - 1; len >= n_min; len--) {
        const int32_t *suffix = tokens + n - len;
        /* a match must end before the suffix starts, so something follows it */
        for (int32_t at = n - len - 1; at >= 0; at--) {
            if (tokens[at] != suffix[0] || memcmp(tokens + at, suffix, (size_t)len * sizeof *tokens) != 0)
                continue;
            int32_t from = at + len, m = n - from < k ? n - from : k;
            memcpy(out, tokens + from, (size_t)m * sizeof *out);
            return m;
        }
    }
    return 0;
}

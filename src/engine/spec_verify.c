/* Draft acceptance (spec_verify.h): one rule for greedy and sampled requests, since a
 * greedy request's distribution is a point mass and the rule then keeps exactly the drafts
 * plain decoding would have produced. */

#include "engine/spec_verify.h"

int32_t spec_verify(blade_sampler *s, const float *rows, int32_t n_vocab, const int32_t *draft, int32_t n_draft,
                    float *probs, int32_t *out, bool *bad_row)
{
    *bad_row = false;
    for (int32_t j = 0; j <= n_draft; j++) {
        if (blade_sampler_probs(s, rows + (size_t)j * (size_t)n_vocab, probs) < 0) {
            *bad_row = true;
            return j;
        }
        int32_t t;
        if (j < n_draft && blade_sampler_uniform(s) < (double)probs[draft[j]]) {
            t = draft[j];
        } else {
            if (j < n_draft)
                probs[draft[j]] = 0.0f; /* max(0, p - q) with q the point mass on the draft */
            t = blade_sampler_draw_from(s, probs);
            if (t < 0) {
                *bad_row = true;
                return j;
            }
        }
        out[j] = t;
        blade_sampler_accept(s, t, true);
        if (j == n_draft || t != draft[j])
            return j + 1;
    }
    return n_draft + 1;
}

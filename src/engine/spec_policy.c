/* The speculation policy (spec_policy.h) and the speculative-decoding configuration. */

#include "engine/spec_policy.h"

#include "blade/spec.h"
#include "common/clock.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void blade_spec_config_default(blade_spec_config *c)
{
    memset(c, 0, sizeof *c);
    c->mode = BLADE_SPEC_NONE;
    c->k = 4;
    c->ngram_min = 2;
    c->ngram_max = 4;
    c->self_type = BLADE_SPEC_SELF_OWN;
    c->draft_lookup = true;
    c->adaptive = true;
}

const char *blade_spec_mode_name(blade_spec_mode m)
{
    switch (m) {
    case BLADE_SPEC_NONE: return "none";
    case BLADE_SPEC_NGRAM: return "ngram";
    case BLADE_SPEC_DRAFT: return "draft";
    case BLADE_SPEC_SELF: return "self";
    }
    return "?";
}

int blade_spec_mode_parse(const char *s)
{
    if (!strcmp(s, "none") || !strcmp(s, "off"))
        return BLADE_SPEC_NONE;
    if (!strcmp(s, "ngram"))
        return BLADE_SPEC_NGRAM;
    if (!strcmp(s, "draft"))
        return BLADE_SPEC_DRAFT;
    if (!strcmp(s, "self"))
        return BLADE_SPEC_SELF;
    return -1;
}

/* Decay per verify: about the last ten verify steps count. The prior (one hit in two
 * trials) lets an engine's first sequences try drafting; later ones start from the
 * traffic's rate with the prior's weight (spec_accept_start). */
#define ACCEPT_DECAY 0.9
#define ACCEPT_PRIOR_RATE 0.5

void spec_accept_init(spec_accept *a)
{
    a->hits = 2.0 * ACCEPT_PRIOR_RATE;
    a->trials = 2.0;
    a->idle = 0;
}

void spec_accept_start(spec_accept *a, const spec_accept *traffic)
{
    spec_accept_init(a);
    a->hits = spec_accept_rate(traffic) * a->trials;
}

void spec_accept_update(spec_accept *a, int32_t drafted, int32_t accepted)
{
    if (drafted <= 0)
        return;
    a->hits = ACCEPT_DECAY * a->hits + accepted;
    a->trials = ACCEPT_DECAY * a->trials + accepted + (accepted < drafted);
}

double spec_accept_rate(const spec_accept *a)
{
    return a->trials > 0 ? a->hits / a->trials : 0;
}

/* Decay per verified draft of a band: about the last hundred count. The prior weighs as
 * four drafts. */
#define CALIB_DECAY 0.99
#define CALIB_PRIOR_TRIALS 4.0

void spec_calib_init(spec_calib *c)
{
    for (int s = 0; s < SPEC_SOURCES; s++)
        for (int b = 0; b < SPEC_CONF_BANDS; b++) {
            double mid = (b + 0.5) / SPEC_CONF_BANDS;
            double prior = s == SPEC_FROM_MODEL ? mid : s == SPEC_FROM_BOTH ? 0.5 + 0.5 * mid : 0.5;
            c->hits[s][b] = prior * CALIB_PRIOR_TRIALS;
            c->trials[s][b] = CALIB_PRIOR_TRIALS;
        }
}

int32_t spec_calib_band(float conf)
{
    /* checked as a float: NaN or a huge value converted to an integer is undefined */
    if (!(conf > 0))
        return 0;
    return conf >= 1 ? SPEC_CONF_BANDS - 1 : (int32_t)(conf * SPEC_CONF_BANDS);
}

double spec_calib_rate(const spec_calib *c, spec_source s, float conf)
{
    int32_t b = spec_calib_band(conf);
    return c->hits[s][b] / c->trials[s][b];
}

void spec_calib_update(spec_calib *c, spec_source s, float conf, bool kept)
{
    int32_t b = spec_calib_band(conf);
    c->hits[s][b] = CALIB_DECAY * c->hits[s][b] + kept;
    c->trials[s][b] = CALIB_DECAY * c->trials[s][b] + 1;
}

static double step_cost(const double *cost, int32_t n_cost, int32_t t)
{
    if (t <= n_cost)
        return cost[t];
    /* Beyond the measured range a token costs at least what the last stretch did, and at
     * least the measured step's cost per token: a curve still flat at its end (a few tokens
     * are as memory-bound as one) must not promise that many sequences' drafts are free,
     * and a step is never cheaper per token than a smaller one once compute binds. */
    double last = n_cost > 1 ? cost[n_cost] - cost[n_cost - 1] : 1.0;
    double per_token = cost[n_cost] / n_cost;
    return cost[n_cost] + (last > per_token ? last : per_token) * (t - n_cost);
}

/* The draft most likely to be kept next: the next of the sequence whose drafts so far are
 * the likeliest to have all been accepted; -1 when every sequence has its k_max. */
static int32_t likeliest_next(const spec_cand *c, int32_t n, double *gain)
{
    int32_t best = -1;
    *gain = 0;
    for (int32_t i = 0; i < n; i++) {
        if (c[i].k >= c[i].k_max)
            continue;
        double g = c[i].gain ? c[i].gain[c[i].k] : pow(c[i].alpha, c[i].k + 1);
        if (g > *gain) {
            *gain = g;
            best = i;
        }
    }
    return best;
}

void spec_policy_choose(const double *cost, int32_t n_cost, double base_value, int32_t base_tokens, double draft_cost,
                        spec_cand *c, int32_t n)
{
    for (int32_t i = 0; i < n; i++)
        c[i].k = 0;
    /* The whole order is walked, not stopped at the first draft that does not pay: a
     * measured curve has steps (a tile of tokens filling up), so a draft that lowers the
     * ratio can be followed by several nearly free ones that raise it past where it was. */
    double value = base_value, best_ratio = 0;
    int32_t tokens = base_tokens > 0 ? base_tokens : 1, k_top = 0, handed = 0, best_handed = 0;
    for (;;) {
        double ratio = value / (step_cost(cost, n_cost, tokens) + draft_cost * k_top);
        if (ratio > best_ratio) {
            best_ratio = ratio;
            best_handed = handed;
        }
        double gain;
        int32_t next = likeliest_next(c, n, &gain);
        if (next < 0 || gain <= 0)
            break;
        c[next].k++;
        k_top = c[next].k > k_top ? c[next].k : k_top;
        value += gain;
        tokens++;
        handed++;
    }
    for (int32_t i = 0; i < n; i++)
        c[i].k = 0;
    for (int32_t h = 0; h < best_handed; h++) {
        double gain;
        c[likeliest_next(c, n, &gain)].k++;
    }
}

bool spec_policy_draft_more(const spec_step_econ *s, const double *gain, int32_t n, int32_t k_max)
{
    if (n <= 0 || n >= k_max)
        return n < k_max;
    int32_t tokens = s->base_tokens > 0 ? s->base_tokens : 1;
    double value = s->base_value, best = value / step_cost(s->cost, s->n_cost, tokens);
    for (int32_t m = 1; m <= n; m++) {
        value += gain[m - 1];
        double ratio = value / step_cost(s->cost, s->n_cost, tokens + m);
        best = ratio > best ? ratio : best;
    }
    for (int32_t m = n + 1; m <= k_max; m++) {
        double more = m - n;
        if ((value + more * gain[n - 1]) / (step_cost(s->cost, s->n_cost, tokens + m) + more * s->draft_cost) > best)
            return true;
    }
    return false;
}

bool spec_policy_probe(const double *cost, int32_t n_cost, int32_t base_tokens, double draft_cost, int32_t idle)
{
    int32_t tokens = base_tokens > 0 ? base_tokens : 1;
    double base = step_cost(cost, n_cost, tokens), more = step_cost(cost, n_cost, tokens + 1) + draft_cost;
    if ((tokens + ACCEPT_PRIOR_RATE) / more <= tokens / base)
        return false;
    return idle * SPEC_PROBE_SHARE * base >= more - base;
}

/* A step this much slower than its size's usual compute-bound time waited on memory: far
 * above the few percent steps of one size vary by while memory holds still, and below
 * the 1.4x by which a slow spell of memory stretched five-token Q4_0 steps here. */
#define MEMORY_BOUND_MARGIN 1.3
/* ...when it is one of this many in a row. A lone slow step is the host pausing the
 * process, not memory: taken as the memory time, such steps (8.5-12 ms among 7.2 ms ones,
 * Q4_0 target, Zen 5) raised it to 10.3 ms, which put every size's cost at 1.0-1.1 while
 * the steps cost 1.4-1.6x a one-token one, and the policy, trusting it, drafted as deep as
 * it could for the rest of the run. */
#define SLOW_RUN_STEPS 3
/* Both times follow the last few steps that show them. */
#define CURVE_DECAY 0.7
/* cost[2..n] from each size's measured ratio to one token (in place): at least 1, and
 * non-decreasing, made so from the right, since a step of more tokens never costs less:
 * one slow point must not raise every point after it (that hid k = 3 and 4 behind a T = 3
 * outlier on a shared machine); the lowest later point bounds it. */
static void settle_curve(double *cost, int32_t n)
{
    cost[0] = 0;
    cost[1] = 1;
    for (int32_t t = n; t >= 2; t--) {
        double x = cost[t] > 1 ? cost[t] : 1;
        cost[t] = t < n && cost[t + 1] < x ? cost[t + 1] : x;
    }
}

/* cost[T] = max(1, busy[T] / memory time), settled as spec_measure_cost's curve is. */
static void curve_update(spec_curve *c)
{
    for (int32_t t = 2; t <= c->n; t++)
        c->cost[t] = c->busy_ms[t] / c->mem_ms;
    settle_curve(c->cost, c->n);
}

void spec_curve_init(spec_curve *c, const double *cost, int32_t n, double one_ms)
{
    memset(c, 0, sizeof *c);
    c->n = n;
    c->mem_ms = one_ms;
    for (int32_t t = 1; t <= n; t++)
        c->busy_ms[t] = cost[t] * one_ms;
    curve_update(c);
}

/* The memory time is what streaming the weights costs, so no step is faster: a step that
 * is shows it lower. Without this, a memory time left high by a slow spell would never come
 * down while the policy, seeing every size as free, runs no one-token steps. */
void spec_curve_observe(spec_curve *c, int32_t t, double ms)
{
    if (t < 1 || t > c->n || !(ms > 0))
        return;
    /* a stale size's first step measures it afresh; it is no sign of slow memory, since
     * its time had drifted down */
    bool fresh = t > 1 && c->age[t] > SPEC_CURVE_STALE;
    bool slow = t > 1 && !fresh && ms > MEMORY_BOUND_MARGIN * c->busy_ms[t];
    c->slow_run = slow ? c->slow_run + 1 : 0;
    if (t == 1 || ms < c->mem_ms || c->slow_run >= SLOW_RUN_STEPS)
        c->mem_ms = CURVE_DECAY * c->mem_ms + (1 - CURVE_DECAY) * ms;
    if (fresh)
        c->busy_ms[t] = ms;
    else if (t > 1 && !slow)
        c->busy_ms[t] = CURVE_DECAY * c->busy_ms[t] + (1 - CURVE_DECAY) * ms;
    for (int32_t s = 2; s <= c->n; s++) {
        c->age[s] = s == t ? 0 : c->age[s] < INT32_MAX ? c->age[s] + 1 : INT32_MAX;
        if (c->age[s] > SPEC_CURVE_STALE) {
            double below = s == 2 ? c->mem_ms : c->busy_ms[s - 1];
            if (below < c->busy_ms[s])
                c->busy_ms[s] = CURVE_DECAY * c->busy_ms[s] + (1 - CURVE_DECAY) * below;
        }
    }
    curve_update(c);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define MEASURE_CTX 32
/* Each size's fastest of fifteen: other work on the machine only ever slows a timed step.
 * A median of five let a slow spell through (a Q8_0 run whose startup curve had a 4-token
 * step at 1.76x, against 1.08-1.14x measured apart, drafted less all run and ended at 1.80x
 * against 1.90-2.01x; MEASURED.md), and the fastest of seven still read Q4_0's 3-token step
 * at 1.39-1.55x in engines started a minute apart, where the same measurement run on its own
 * read 1.19-1.27x. */
#define MEASURE_REPS 15

int spec_measure_cost(blade_runner *r, int32_t n_vocab, int32_t store_blocks, int32_t block_size, double *cost,
                      int32_t n_cost, double *one_step_s)
{
    int32_t n_pos = MEASURE_CTX + n_cost, n_blocks = (n_pos + block_size - 1) / block_size;
    if (n_blocks > store_blocks || n_cost < 1)
        return -1;
    int32_t *blocks = malloc((size_t)n_blocks * sizeof *blocks);
    int32_t *toks = malloc((size_t)n_pos * sizeof *toks);
    int32_t *rows = malloc((size_t)n_pos * sizeof *rows);
    float *logits = malloc((size_t)n_cost * (size_t)n_vocab * sizeof *logits);
    double *t = malloc((size_t)MEASURE_REPS * (size_t)(n_cost + 1) * sizeof *t);
    int rc = -1;
    if (!blocks || !toks || !rows || !logits || !t)
        goto out;
    for (int32_t i = 0; i < n_blocks; i++)
        blocks[i] = i;
    for (int32_t i = 0; i < n_pos; i++) {
        toks[i] = (1 + i * 7) % n_vocab;
        rows[i] = i;
    }
    blade_error err = {{0}};
    blade_batch_seq ctx = {.tokens = toks, .n_tokens = MEASURE_CTX, .pos0 = 0, .block_table = blocks,
                           .n_blocks = n_blocks, .n_logits = 0, .logits = logits};
    if (blade_runner_forward(r, &ctx, 1, &err))
        goto out;
    for (int rep = 0; rep < MEASURE_REPS; rep++)
        for (int32_t n = 1; n <= n_cost; n++) {
            blade_batch_seq b = {.tokens = toks + MEASURE_CTX, .n_tokens = n, .pos0 = MEASURE_CTX,
                                 .block_table = blocks, .n_blocks = n_blocks, .logit_rows = rows, .n_logits = n,
                                 .logits = logits};
            double t0 = blade_clock_seconds();
            if (blade_runner_forward(r, &b, 1, &err))
                goto out;
            t[(size_t)n * MEASURE_REPS + rep] = blade_clock_seconds() - t0;
        }
    for (int32_t n = 1; n <= n_cost; n++)
        qsort(t + (size_t)n * MEASURE_REPS, MEASURE_REPS, sizeof *t, cmp_double);
    double one = t[MEASURE_REPS];
    *one_step_s = one;
    for (int32_t n = 2; n <= n_cost; n++)
        cost[n] = t[(size_t)n * MEASURE_REPS] / (one > 0 ? one : 1);
    settle_curve(cost, n_cost);
    rc = 0;
out:
    free(blocks);
    free(toks);
    free(rows);
    free(logits);
    free(t);
    return rc;
}

/* Token sampling (sampler.h): penalties, greedy or top-k / temperature / top-p / min-p,
 * and the draw, in the documented order, with ties broken by the lower id. All scratch is
 * allocated with the sampler, so sampling a token never allocates. */

#include "blade/sampler.h"

#include "sampler/rng.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Candidates travel as 64-bit keys: the high half is the logit mapped so that a larger
 * logit gives a smaller unsigned value, the low half the token id. Ascending keys are
 * then the sampler's single order (higher logit first, lower id on ties), so every cut
 * (top-k, top-p) and therefore every draw is independent of how a heap or sort happened
 * to arrange equal logits, and each comparison is one integer compare. */
typedef uint64_t cand_key;

/* Scratch whose two uses never overlap in time: the second buffer of the radix sort, then
 * each candidate's weight (probability relative to the most likely candidate, which has
 * exactly 1, so min-p needs no division). */
typedef union aux_slot {
    cand_key key;
    double w;
} aux_slot;

struct blade_sampler {
    blade_sampling_params p;
    int32_t n_vocab;
    blade_rng rng;
    /* Position (1-based) of each token's latest acceptance, 0 if never seen: a token is
     * in the repetition window iff that position is among the last repeat_last_n, which
     * makes the window O(1) to test without keeping the tokens themselves. */
    uint64_t *last_seen;
    uint32_t *generated_count;
    /* Distinct tokens ever accepted, so penalties cost O(distinct) rather than O(vocab). */
    int32_t *seen;
    int32_t n_seen;
    uint64_t n_accepted;
    float *logits; /* the row after sanitizing and penalties */
    cand_key *keys;
    aux_slot *aux;
};

void blade_sampling_params_default(blade_sampling_params *p)
{
    *p = (blade_sampling_params){
        .temperature = 0.8f,
        .top_k = 40,
        .top_p = 0.95f,
        .min_p = 0.05f,
        .repeat_penalty = 1.0f,
        .repeat_last_n = 64,
        .presence_penalty = 0.0f,
        .frequency_penalty = 0.0f,
        .seed = 0,
    };
}

int blade_sampling_params_validate(const blade_sampling_params *p, blade_error *err)
{
    const struct {
        const char *name;
        float value;
    } floats[] = {
        {"temperature", p->temperature},
        {"top_p", p->top_p},
        {"min_p", p->min_p},
        {"repeat_penalty", p->repeat_penalty},
        {"presence_penalty", p->presence_penalty},
        {"frequency_penalty", p->frequency_penalty},
    };
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++)
        if (!isfinite(floats[i].value))
            return blade_error_set(err, "sampling parameter %s is %g; it must be finite",
                                   floats[i].name, (double)floats[i].value);
    if (!(p->repeat_penalty > 0.0f))
        return blade_error_set(err, "repeat_penalty is %g; it must be > 0 (1 = off)",
                               (double)p->repeat_penalty);
    if (p->repeat_last_n < -1)
        return blade_error_set(err, "repeat_last_n is %d; it must be >= -1 (-1 = everything seen)",
                               (int)p->repeat_last_n);
    return 0;
}

blade_sampler *blade_sampler_new(const blade_sampling_params *p, int32_t n_vocab)
{
    if (!p || n_vocab <= 0 || blade_sampling_params_validate(p, NULL) != 0)
        return NULL;
    blade_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    size_t n = (size_t)n_vocab;
    s->p = *p;
    s->n_vocab = n_vocab;
    blade_rng_seed(&s->rng, p->seed);
    s->last_seen = calloc(n, sizeof *s->last_seen);
    s->generated_count = calloc(n, sizeof *s->generated_count);
    s->seen = malloc(n * sizeof *s->seen);
    s->logits = malloc(n * sizeof *s->logits);
    s->keys = malloc(n * sizeof *s->keys);
    s->aux = malloc(n * sizeof *s->aux);
    if (!s->last_seen || !s->generated_count || !s->seen || !s->logits || !s->keys || !s->aux) {
        blade_sampler_free(s);
        return NULL;
    }
    return s;
}

void blade_sampler_free(blade_sampler *s)
{
    if (!s)
        return;
    free(s->last_seen);
    free(s->generated_count);
    free(s->seen);
    free(s->logits);
    free(s->keys);
    free(s->aux);
    free(s);
}

void blade_sampler_accept(blade_sampler *s, int32_t token, bool generated)
{
    if (!s || token < 0 || token >= s->n_vocab)
        return;
    if (s->last_seen[token] == 0)
        s->seen[s->n_seen++] = token;
    s->last_seen[token] = ++s->n_accepted;
    if (generated && s->generated_count[token] < UINT32_MAX)
        s->generated_count[token]++;
}

/* NaN becomes -inf so a broken row can never win; +inf becomes FLT_MAX so that the
 * max-subtraction in the softmax stays finite, and several +inf tokens tie. */
static float sanitize(float x)
{
    if (isnan(x))
        return -INFINITY;
    return x > FLT_MAX ? FLT_MAX : x;
}

/* Penalties must not mask a token that was possible, nor revive a masked one. */
static float clamp_finite(double x)
{
    if (x > FLT_MAX)
        return FLT_MAX;
    if (x < -FLT_MAX)
        return -FLT_MAX;
    return (float)x;
}

static bool in_window(const blade_sampler *s, int32_t token)
{
    int32_t n = s->p.repeat_last_n;
    if (n < 0)
        return true;
    return s->last_seen[token] + (uint64_t)n > s->n_accepted;
}

static void penalise(blade_sampler *s, const float *logits)
{
    float *l = s->logits;
    for (int32_t i = 0; i < s->n_vocab; i++)
        l[i] = sanitize(logits[i]);
    const blade_sampling_params *p = &s->p;
    for (int32_t j = 0; j < s->n_seen; j++) {
        int32_t t = s->seen[j];
        if (l[t] == -INFINITY)
            continue;
        double v = l[t];
        if (p->repeat_penalty != 1.0f && in_window(s, t))
            v = v > 0.0 ? v / p->repeat_penalty : v * p->repeat_penalty;
        uint32_t count = s->generated_count[t];
        if (count > 0) {
            /* Separate statements keep the compiler from fusing these into an FMA, whose
             * different rounding would make results depend on the machine. */
            double sub = (double)p->frequency_penalty * count;
            sub = sub + p->presence_penalty;
            v = v - sub;
        }
        l[t] = clamp_finite(v);
    }
}

int32_t blade_argmax(const float *l, int32_t n)
{
    int32_t best = -1;
    float best_logit = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (l[i] > best_logit) {
            best_logit = l[i];
            best = i;
        }
    return best;
}

static cand_key make_key(float logit, int32_t id)
{
    /* -0 and +0 compare equal as floats, so they must share a key to tie on id. */
    if (logit == 0.0f)
        logit = 0.0f;
    uint32_t u;
    memcpy(&u, &logit, sizeof u);
    /* The usual order-preserving map from IEEE bits to unsigned (flip all bits of a
     * negative, only the sign of a positive), then inverted; branch-free because signs
     * are unpredictable. */
    uint32_t flip = (uint32_t)-(int32_t)(u >> 31) | 0x80000000u;
    u ^= flip;
    return (cand_key)~u << 32 | (uint32_t)id;
}

static int32_t key_id(cand_key k)
{
    return (int32_t)(uint32_t)k;
}

/* Max-heap: the root is the worst of the kept candidates, the first to be displaced. */
static void sift_down(cand_key *h, size_t n, size_t i)
{
    for (;;) {
        size_t top = i, l = 2 * i + 1, r = l + 1;
        if (l < n && h[l] > h[top])
            top = l;
        if (r < n && h[r] > h[top])
            top = r;
        if (top == i)
            return;
        cand_key tmp = h[i];
        h[i] = h[top];
        h[top] = tmp;
        i = top;
    }
}

/* The k best finite logits into keys, best first, in one streaming pass of O(V log k):
 * once the heap is full, most tokens fall below the root's logit and cost one compare. */
static size_t select_top_k(const float *logits, int32_t n_vocab, size_t k, cand_key *h)
{
    size_t n = 0;
    float bar = -INFINITY;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (logits[i] < bar || logits[i] == -INFINITY)
            continue;
        cand_key key = make_key(logits[i], i);
        if (n < k) {
            size_t j = n++;
            h[j] = key;
            while (j > 0 && h[(j - 1) / 2] < h[j]) {
                cand_key tmp = h[j];
                h[j] = h[(j - 1) / 2];
                h[(j - 1) / 2] = tmp;
                j = (j - 1) / 2;
            }
        } else if (key < h[0]) {
            h[0] = key;
            sift_down(h, n, 0);
        } else {
            continue;
        }
        if (n == k)
            bar = logits[key_id(h[0])];
    }
    for (size_t end = n; end > 1; end--) {
        cand_key tmp = h[0];
        h[0] = h[end - 1];
        h[end - 1] = tmp;
        sift_down(h, end - 1, 0);
    }
    return n;
}

static size_t gather_finite(const float *logits, int32_t n_vocab, cand_key *keys)
{
    size_t m = 0;
    for (int32_t i = 0; i < n_vocab; i++)
        if (logits[i] > -INFINITY)
            keys[m++] = make_key(logits[i], i);
    return m;
}

/* Stable LSD radix sort on the high halves (the logit order), O(m) whatever the
 * distribution. The ids need no pass of their own: keys arrive in ascending id order and
 * stability keeps equal logits that way. */
static void sort_keys(cand_key *keys, aux_slot *spare, size_t m)
{
    uint32_t count[4][256] = {{0}};
    for (size_t i = 0; i < m; i++)
        for (int b = 0; b < 4; b++)
            count[b][(keys[i] >> (32 + 8 * b)) & 0xff]++;
    /* A byte that every key shares (typically the sign and top exponent bits) would
     * only copy the array; the first key's byte tells, as the counts cover all keys. */
    const cand_key first = keys[0];
    bool in_keys = true;
    for (int b = 0; b < 4; b++) {
        int shift = 32 + 8 * b;
        uint32_t *c = count[b];
        if (c[(first >> shift) & 0xff] == m)
            continue;
        uint32_t pos = 0;
        for (int v = 0; v < 256; v++) {
            uint32_t n = c[v];
            c[v] = pos;
            pos += n;
        }
        if (in_keys)
            for (size_t i = 0; i < m; i++)
                spare[c[(keys[i] >> shift) & 0xff]++].key = keys[i];
        else
            for (size_t i = 0; i < m; i++)
                keys[c[(spare[i].key >> shift) & 0xff]++] = spare[i].key;
        in_keys = !in_keys;
    }
    if (!in_keys)
        for (size_t i = 0; i < m; i++)
            keys[i] = spare[i].key;
}

/* Weights relative to the most likely candidate into aux[i].w, their sum into *total.
 * Candidates whose weight underflows to zero are dropped (order kept): they could
 * otherwise be picked when rounding pushes a draw past the last bucket. Returns the new
 * count.
 *
 * Every total in this file is summed in array order, the order the draw walks, so the
 * same candidates give the same total on every machine. */
static size_t softmax(const float *logits, cand_key *keys, aux_slot *aux, size_t m, double temperature,
                      double *total)
{
    float max = -INFINITY;
    for (size_t i = 0; i < m; i++)
        if (logits[key_id(keys[i])] > max)
            max = logits[key_id(keys[i])];
    size_t kept = 0;
    double sum = 0.0;
    for (size_t i = 0; i < m; i++) {
        double x = ((double)logits[key_id(keys[i])] - max) / temperature;
        double w = blade_exp_nonpos(x);
        if (w > 0.0) {
            keys[kept] = keys[i];
            aux[kept].w = w;
            sum += w;
            kept++;
        }
    }
    *total = sum;
    return kept;
}

/* The smallest best-first prefix whose weight reaches top_p of the total; at least one.
 * Unsorted candidates are sorted first, but only those that can be in the nucleus: if
 * candidate i is, the ones before it hold less than top_p of the mass, so i and the ones
 * after it (at most m, none heavier than i) hold more than 1 - top_p, hence
 * w_i > (1 - top_p) total / m. Halving that bound absorbs rounding. In a real logit row
 * this leaves a few hundred candidates of a whole vocabulary to sort. */
static size_t cut_top_p(blade_sampler *s, size_t m, bool sorted, double top_p, double *total)
{
    cand_key *keys = s->keys;
    aux_slot *aux = s->aux;
    double target = top_p * *total;
    if (!sorted) {
        double bound = 0.5 * (1.0 - top_p) * *total / (double)m;
        size_t kept = 0;
        for (size_t i = 0; i < m; i++)
            if (aux[i].w >= bound)
                keys[kept++] = keys[i];
        sort_keys(keys, aux, kept);
        /* The sort used aux as its buffer; the same inputs give the same weights back.
         * Their new sum is not wanted: top_p refers to the total before pruning. */
        double pruned_total;
        m = softmax(s->logits, keys, aux, kept, s->p.temperature, &pruned_total);
    }
    double cum = 0.0;
    size_t j = 0;
    while (j < m) {
        cum += aux[j++].w;
        if (cum >= target)
            break;
    }
    *total = cum;
    return j;
}

/* The best candidate has w = 1 exactly, so capping the threshold at 1 always keeps it. */
static size_t cut_min_p(cand_key *keys, aux_slot *aux, size_t m, double min_p, double *total)
{
    double threshold = min_p < 1.0 ? min_p : 1.0, sum = 0.0;
    size_t kept = 0;
    for (size_t i = 0; i < m; i++)
        if (aux[i].w >= threshold) {
            keys[kept] = keys[i];
            aux[kept].w = aux[i].w;
            sum += aux[i].w;
            kept++;
        }
    *total = sum;
    return kept;
}

/* Inverse CDF over the candidates in their current order. The walk adds in the same order
 * as the total, so it can only run off the end through the rounding of u * total; the
 * last candidate (weight > 0) takes that case. */
static int32_t draw(const cand_key *keys, const aux_slot *aux, size_t m, double total, double u)
{
    double target = u * total, cum = 0.0;
    for (size_t i = 0; i + 1 < m; i++) {
        cum += aux[i].w;
        if (target < cum)
            return key_id(keys[i]);
    }
    return key_id(keys[m - 1]);
}

void blade_sampler_skip_draws(blade_sampler *s, int32_t n)
{
    if (s->p.temperature <= 0.0f)
        return;
    for (int32_t i = 0; i < n; i++)
        blade_rng_uniform(&s->rng);
}

/* The candidates a draw chooses from, after top-k, temperature, top-p and min-p: their
 * keys and weights in s->keys and s->aux, the count returned (0: none), their weights'
 * sum in *total. s->logits holds the penalised row. */
static size_t candidates(blade_sampler *s, double *total)
{
    const blade_sampling_params *p = &s->p;
    size_t m;
    bool sorted;
    if (p->top_k > 0 && p->top_k < s->n_vocab) {
        m = select_top_k(s->logits, s->n_vocab, (size_t)p->top_k, s->keys);
        sorted = true;
    } else {
        m = gather_finite(s->logits, s->n_vocab, s->keys);
        sorted = false;
    }
    if (m == 0)
        return 0;
    m = softmax(s->logits, s->keys, s->aux, m, p->temperature, total);
    if (p->top_p < 1.0f)
        m = cut_top_p(s, m, sorted, p->top_p > 0.0f ? p->top_p : 0.0, total);
    if (p->min_p > 0.0f)
        m = cut_min_p(s->keys, s->aux, m, p->min_p, total);
    return m;
}

int32_t blade_sampler_sample(blade_sampler *s, const float *logits)
{
    if (!s || !logits)
        return -1;
    penalise(s, logits);
    if (s->p.temperature <= 0.0f)
        return blade_argmax(s->logits, s->n_vocab);
    double u = blade_rng_uniform(&s->rng), total;
    size_t m = candidates(s, &total);
    return m ? draw(s->keys, s->aux, m, total, u) : -1;
}

int32_t blade_sampler_probs(blade_sampler *s, const float *logits, float *probs)
{
    if (!s || !logits)
        return -1;
    penalise(s, logits);
    memset(probs, 0, (size_t)s->n_vocab * sizeof *probs);
    if (s->p.temperature <= 0.0f) {
        int32_t best = blade_argmax(s->logits, s->n_vocab);
        if (best < 0)
            return -1;
        probs[best] = 1.0f;
        return 1;
    }
    double total;
    size_t m = candidates(s, &total);
    if (m == 0)
        return -1;
    for (size_t i = 0; i < m; i++)
        probs[key_id(s->keys[i])] = (float)(s->aux[i].w / total);
    return (int32_t)m;
}

double blade_sampler_uniform(blade_sampler *s)
{
    return blade_rng_uniform(&s->rng);
}

int32_t blade_sampler_draw_from(blade_sampler *s, const float *weights)
{
    double total = 0.0;
    int32_t last = -1;
    for (int32_t i = 0; i < s->n_vocab; i++)
        if (weights[i] > 0.0f) {
            total += weights[i];
            last = i;
        }
    if (last < 0)
        return -1;
    double target = blade_rng_uniform(&s->rng) * total, cum = 0.0;
    for (int32_t i = 0; i < last; i++) {
        if (!(weights[i] > 0.0f))
            continue;
        cum += weights[i];
        if (target < cum)
            return i;
    }
    return last;
}

void blade_logits_to_logprobs(const float *logits, int32_t n_vocab, float *out)
{
    float max = -INFINITY;
    for (int32_t i = 0; i < n_vocab; i++) {
        float l = sanitize(logits[i]);
        if (l > max)
            max = l;
    }
    if (max == -INFINITY) {
        for (int32_t i = 0; i < n_vocab; i++)
            out[i] = -INFINITY;
        return;
    }
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; i++)
        sum += exp((double)sanitize(logits[i]) - max);
    double log_sum = log(sum);
    for (int32_t i = 0; i < n_vocab; i++)
        out[i] = (float)((double)sanitize(logits[i]) - max - log_sum);
}

/* ids/values as a heap whose root is the entry that would leave first: lower value, or
 * higher id on equal values. */
static bool leaves_first(const int32_t *ids, const float *values, int a, int b)
{
    return values[a] < values[b] || (values[a] == values[b] && ids[a] > ids[b]);
}

static void swap_entries(int32_t *ids, float *values, int a, int b)
{
    int32_t id = ids[a];
    float v = values[a];
    ids[a] = ids[b];
    values[a] = values[b];
    ids[b] = id;
    values[b] = v;
}

static void sift_down_worst(int32_t *ids, float *values, int n, int i)
{
    for (;;) {
        int w = i, l = 2 * i + 1, r = l + 1;
        if (l < n && leaves_first(ids, values, l, w))
            w = l;
        if (r < n && leaves_first(ids, values, r, w))
            w = r;
        if (w == i)
            return;
        swap_entries(ids, values, i, w);
        i = w;
    }
}

int blade_top_logprobs(const float *logprobs, int32_t n_vocab, int n, int32_t *ids, float *values)
{
    if (n <= 0 || n_vocab <= 0)
        return 0;
    int count = 0;
    for (int32_t t = 0; t < n_vocab; t++) {
        float v = logprobs[t];
        if (!(v > -INFINITY))
            continue;
        if (count < n) {
            int i = count++;
            ids[i] = t;
            values[i] = v;
            while (i > 0 && leaves_first(ids, values, i, (i - 1) / 2)) {
                swap_entries(ids, values, i, (i - 1) / 2);
                i = (i - 1) / 2;
            }
        } else if (v > values[0]) {
            /* Scanning ids upward, an equal value never displaces: the lower id stays. */
            ids[0] = t;
            values[0] = v;
            sift_down_worst(ids, values, count, 0);
        }
    }
    /* Heap sort: the entry that leaves first goes to the back, so the front ends best. */
    for (int end = count - 1; end > 0; end--) {
        swap_entries(ids, values, 0, end);
        sift_down_worst(ids, values, end, 0);
    }
    return count;
}

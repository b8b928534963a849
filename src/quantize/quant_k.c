/* Q4_K, Q5_K and Q6_K: super-blocks of 256 values whose sub-block scales are themselves
 * quantized against one fp16 scale (and, for Q4_K/Q5_K, sub-block mins against an fp16 dmin).
 *
 * Each super-block starts from the reference quantizer's search, reproduced operation for
 * operation (so with refinement off the bytes are ggml's). Refinement then searches what the
 * reference leaves fixed: neighbouring integer sub-block scales (and mins) under the stored
 * super-block scales, and a weighted least-squares refit of those super-block scales, in
 * alternation. A refined block is kept only if its weighted error, measured on the values
 * the dequantizer will produce, is lower than the reference block's. */

#include "quantize/quant_blocks.h"
#include "quantize/quant_internal.h"
#include "tensor/quant_ref.h"

#include <math.h>

/* Groups whose largest magnitude is below this are all zero, as in the reference. */
#define GROUP_MAX_EPS 1e-15f
/* Refinement: how far from the current integer scale (and min) to look, and how many rounds
 * of neighbourhood search plus super-block refit to run at most. Mean weighted error against
 * the reference's on tiny256, Q4_K/Q5_K: neighbourhood 1 and one round 0.973/0.927; 2 and two
 * rounds 0.967/0.902 (Q4_K_M of the TinyLlama shape: 1.37x the reference search's CPU time);
 * 3 and three rounds 0.964/0.892 at several times the cost. Q6_K's scales are one-dimensional,
 * so a wider look is cheap: 4 gives 0.879, with the plain squared error lowest too (0.989;
 * wider trades it away). */
#define NEIGHBOURHOOD 2
#define Q6_NEIGHBOURHOOD 4
#define REFINE_ROUNDS 2
#define COST_LANES 8

/* ---- Q4_K / Q5_K: affine sub-blocks x ~= d*sc*q - dmin*m ---- */

typedef struct affine_search {
    int nmax;
    float rmin, rdelta;
    int nstep;
} affine_search;

static const affine_search q4_k_search = {15, -1.0f, 0.1f, 20};
static const affine_search q5_k_search = {31, -0.5f, 0.1f, 15};

typedef struct affine_block {
    uint16_t d, dmin;
    uint8_t sc[K_NSUB], m[K_NSUB];
    uint8_t q[QK_K];
} affine_block;

/* Levels of x on the grid lo + q/iscale, q in [0, nmax], as floats. Clamping before rounding
 * gives the level the reference's round-then-clamp gives, and keeps the loop vectorizable. */
static void affine_trial_levels(const float *x, float iscale, float lo, float top, float *l)
{
    for (int i = 0; i < K_SUB; i++) {
        float v = iscale * (x[i] - lo);
        v = v > 0.0f ? v : 0.0f;
        v = v < top ? v : top;
        l[i] = quant_round(v);
    }
}

/* sum w[i] * (scale*l[i] + min - x[i])^2, terms formed in vector lanes and added in index
 * order, as the reference adds them. */
static float affine_fit_error(const float *x, const float *w, const float *l, float scale, float min)
{
    float term[K_SUB], err = 0.0f;
    for (int i = 0; i < K_SUB; i++) {
        float diff = scale * l[i] + min - x[i];
        term[i] = w[i] * (diff * diff);
    }
    for (int i = 0; i < K_SUB; i++)
        err += term[i];
    return err;
}

/* The reference's sub-block fit: x ~= scale*q + min with min <= 0, starting from the full
 * range and trying nstep+1 other steps, each refitted by weighted least squares; the fit
 * with the lowest weighted error wins, and later steps start from its min. Returns the scale
 * and stores -min. The sums are formed exactly as the reference forms them (products, then
 * added in index order), which is what makes the result bit-identical. */
static float fit_sub_block(const float *x, const float *w, const affine_search *s, uint8_t *q, float *neg_min)
{
    float lo = x[0], hi = x[0], sum_w = w[0], sum_x = w[0] * x[0];
    for (int i = 1; i < K_SUB; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (lo > 0.0f)
        lo = 0.0f;
    if (hi == lo) {
        memset(q, 0, K_SUB);
        *neg_min = -lo;
        return 0.0f;
    }
    float top = (float)s->nmax, iscale = top / (hi - lo);
    float scale = 1.0f / iscale, best_l[K_SUB], l[K_SUB];
    affine_trial_levels(x, iscale, lo, top, best_l);
    float best = affine_fit_error(x, w, best_l, scale, lo);
    for (int step = 0; step <= s->nstep; step++) {
        iscale = (s->rmin + s->rdelta * (float)step + top) / (hi - lo);
        affine_trial_levels(x, iscale, lo, top, l);
        float wl[K_SUB], wl2[K_SUB], wlx[K_SUB];
        for (int i = 0; i < K_SUB; i++) {
            wl[i] = w[i] * l[i];
            wl2[i] = wl[i] * l[i];
            wlx[i] = wl[i] * x[i];
        }
        float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
        for (int i = 0; i < K_SUB; i++) {
            sum_l += wl[i];
            sum_l2 += wl2[i];
            sum_xl += wlx[i];
        }
        float det = sum_w * sum_l2 - sum_l * sum_l;
        if (!(det > 0.0f))
            continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if (this_min > 0.0f) {
            this_min = 0.0f;
            this_scale = sum_xl / sum_l2;
        }
        float err = affine_fit_error(x, w, l, this_scale, this_min);
        if (err < best) {
            memcpy(best_l, l, sizeof l);
            best = err;
            scale = this_scale;
            lo = this_min;
        }
    }
    for (int i = 0; i < K_SUB; i++)
        q[i] = (uint8_t)best_l[i];
    *neg_min = -lo;
    return scale;
}

/* 6-bit integer as the reference stores it: the rounding result taken modulo 256, then
 * capped at 63. */
static uint8_t six_bits(float v)
{
    uint8_t u = (uint8_t)quant_nearest(v);
    return u < 63 ? u : 63;
}

static void affine_reference(const float *x, const float *w, const affine_search *s, affine_block *b)
{
    float scales[K_NSUB], mins[K_NSUB], max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < K_NSUB; j++) {
        scales[j] = fit_sub_block(x + j * K_SUB, w + j * K_SUB, s, b->q + j * K_SUB, &mins[j]);
        max_scale = scales[j] > max_scale ? scales[j] : max_scale;
        max_min = mins[j] > max_min ? mins[j] : max_min;
    }
    float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
    float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
    for (int j = 0; j < K_NSUB; j++) {
        b->sc[j] = six_bits(inv_scale * scales[j]);
        b->m[j] = six_bits(inv_min * mins[j]);
    }
    b->d = blade_fp32_to_fp16(max_scale / 63.0f);
    b->dmin = blade_fp32_to_fp16(max_min / 63.0f);
    float d = blade_fp16_to_fp32(b->d), dmin = blade_fp16_to_fp32(b->dmin);
    for (int j = 0; j < K_NSUB; j++) {
        float ds = d * (float)b->sc[j];
        if (ds == 0.0f)
            continue; /* the levels of the fit stand; they all decode to -min */
        float dm = dmin * (float)b->m[j];
        for (int i = 0; i < K_SUB; i++)
            b->q[j * K_SUB + i] = (uint8_t)quant_clamp(quant_nearest((x[j * K_SUB + i] + dm) / ds), 0, s->nmax);
    }
}

/* Weighted squared error of one sub-block at scale ds and min dm with the nearest levels.
 * Written for the vectorizer: the clamp is done in floats before rounding (the same level as
 * rounding then clamping), and the sum runs in fixed lanes, so it is the same on every run. */
static float affine_cost(const float *x, const float *w, float ds, float dm, int nmax)
{
    float lane[COST_LANES] = {0};
    float inv = ds != 0.0f ? 1.0f / ds : 0.0f, top = (float)nmax;
    for (int base = 0; base < K_SUB; base += COST_LANES) {
        for (int l = 0; l < COST_LANES; l++) {
            float v = (x[base + l] + dm) * inv;
            v = v > 0.0f ? v : 0.0f;
            v = v < top ? v : top;
            float e = ds * quant_round(v) - dm - x[base + l];
            lane[l] += w[base + l] * e * e;
        }
    }
    float sum = 0.0f;
    for (int l = 0; l < COST_LANES; l++)
        sum += lane[l];
    return sum;
}

static void affine_levels(const float *x, float ds, float dm, int nmax, uint8_t *q)
{
    if (ds == 0.0f)
        return;
    float inv = 1.0f / ds;
    for (int i = 0; i < K_SUB; i++)
        q[i] = (uint8_t)quant_clamp(quant_nearest((x[i] + dm) * inv), 0, nmax);
}

static void affine_all_levels(const float *x, affine_block *b, float d, float dmin, int nmax)
{
    for (int j = 0; j < K_NSUB; j++)
        affine_levels(x + j * K_SUB, d * (float)b->sc[j], dmin * (float)b->m[j], nmax, b->q + j * K_SUB);
}

static float affine_total_cost(const float *x, const float *w, const affine_block *b, float d, float dmin, int nmax)
{
    float sum = 0.0f;
    for (int j = 0; j < K_NSUB; j++)
        sum += affine_cost(x + j * K_SUB, w + j * K_SUB, d * (float)b->sc[j], dmin * (float)b->m[j], nmax);
    return sum;
}

/* Best integer scale and min within NEIGHBOURHOOD of the current ones, per sub-block. */
static void affine_neighbourhood(const float *x, const float *w, affine_block *b, float d, float dmin, int nmax)
{
    for (int j = 0; j < K_NSUB; j++) {
        const float *xj = x + j * K_SUB, *wj = w + j * K_SUB;
        int sc0 = b->sc[j], m0 = b->m[j];
        float best = affine_cost(xj, wj, d * (float)sc0, dmin * (float)m0, nmax);
        for (int sc = sc0 - NEIGHBOURHOOD; sc <= sc0 + NEIGHBOURHOOD; sc++) {
            for (int m = m0 - NEIGHBOURHOOD; m <= m0 + NEIGHBOURHOOD; m++) {
                if (sc < 0 || sc > 63 || m < 0 || m > 63 || (sc == sc0 && m == m0))
                    continue;
                float c = affine_cost(xj, wj, d * (float)sc, dmin * (float)m, nmax);
                if (c < best) {
                    best = c;
                    b->sc[j] = (uint8_t)sc;
                    b->m[j] = (uint8_t)m;
                }
            }
        }
    }
}

/* Least-squares d and dmin for the current integer scales, mins and levels:
 * x ~= d*(sc*q) - dmin*m. False when the system is degenerate. */
static bool affine_refit(const float *x, const float *w, const affine_block *b, float *d, float *dmin)
{
    double aa = 0, ab = 0, bb = 0, ax = 0, bx = 0;
    for (int i = 0; i < QK_K; i++) {
        int j = i / K_SUB;
        double a = (double)b->sc[j] * b->q[i], m = b->m[j], wi = w[i];
        aa += wi * a * a;
        ab += wi * a * m;
        bb += wi * m * m;
        ax += wi * a * x[i];
        bx += wi * m * x[i];
    }
    double det = aa * bb - ab * ab;
    double nd, nmin;
    if (det > 1e-12 * aa * bb && bb > 0) {
        nd = (ax * bb - ab * bx) / det;
        nmin = (ab * ax - aa * bx) / det;
    } else {
        nd = aa > 0 ? ax / aa : 0;
        nmin = 0;
    }
    if (nmin < 0) {
        nmin = 0;
        nd = aa > 0 ? ax / aa : 0;
    }
    if (!(nd > 0) || !isfinite(nd) || !isfinite(nmin))
        return false;
    *d = (float)nd;
    *dmin = (float)nmin;
    return true;
}

static void affine_refine(const float *x, const float *w, int nmax, affine_block *b)
{
    float d = blade_fp16_to_fp32(b->d), dmin = blade_fp16_to_fp32(b->dmin);
    if (d == 0.0f && dmin == 0.0f)
        return;
    for (int round = 0; round < REFINE_ROUNDS; round++) {
        affine_neighbourhood(x, w, b, d, dmin, nmax);
        float cost = affine_total_cost(x, w, b, d, dmin, nmax);
        affine_all_levels(x, b, d, dmin, nmax);
        float nd, nmin;
        if (!affine_refit(x, w, b, &nd, &nmin))
            break;
        uint16_t nd16 = blade_fp32_to_fp16(nd), nmin16 = blade_fp32_to_fp16(nmin);
        if (nd16 == b->d && nmin16 == b->dmin)
            break;
        float rd = blade_fp16_to_fp32(nd16), rmin = blade_fp16_to_fp32(nmin16);
        if (!isfinite(rd) || !isfinite(rmin) || !(affine_total_cost(x, w, b, rd, rmin, nmax) < cost))
            break;
        b->d = nd16;
        b->dmin = nmin16;
        d = rd;
        dmin = rmin;
        affine_all_levels(x, b, d, dmin, nmax);
    }
}

static void pack_q4_k(const affine_block *b, block_q4_k *out)
{
    out->d = b->d;
    out->dmin = b->dmin;
    blade_k_scales_pack(b->sc, b->m, out->scales);
    for (int pair = 0; pair < K_NSUB / 2; pair++)
        for (int l = 0; l < K_SUB; l++)
            out->qs[pair * K_SUB + l] = (uint8_t)(b->q[pair * 64 + l] | (b->q[pair * 64 + K_SUB + l] << 4));
}

static void pack_q5_k(const affine_block *b, block_q5_k *out)
{
    out->d = b->d;
    out->dmin = b->dmin;
    blade_k_scales_pack(b->sc, b->m, out->scales);
    memset(out->qh, 0, sizeof out->qh);
    for (int pair = 0; pair < K_NSUB / 2; pair++) {
        for (int l = 0; l < K_SUB; l++) {
            int q1 = b->q[pair * 64 + l], q2 = b->q[pair * 64 + K_SUB + l];
            out->qs[pair * K_SUB + l] = (uint8_t)((q1 & 0xF) | ((q2 & 0xF) << 4));
            out->qh[l] |= (uint8_t)(((q1 >> 4) << (2 * pair)) | ((q2 >> 4) << (2 * pair + 1)));
        }
    }
}

/* Weights of one super-block: the reference's, or importance-derived. Q4_K and Q5_K take
 * the importance alone: the output error a weight's rounding causes is its squared error
 * times the mean square of the activation it multiplies, which is what the importance is.
 * The |x| factor the other types keep made the affine fit favour large values the sub-block
 * scale and min already fit well; on the TinyLlama-shaped model it left the
 * importance-weighted error of Q4_K 1-7% below the plain search's, where the importance
 * alone gives 8-15% (Q5_K: +1% to -6%, against -3% to -12%). */
static void k_weights(const float *x, const float *importance, float sigma2, bool affine, float *w)
{
    if (importance && affine)
        memcpy(w, importance, QK_K * sizeof *w);
    else if (importance)
        quant_importance_weights(x, importance, sigma2, w, QK_K);
    else if (affine)
        quant_k_affine_default_weights(x, w);
    else
        quant_q6_k_default_weights(x, w, QK_K);
}

/* The block with the lower weighted error on the dequantized values; the reference on ties. */
static const void *better_block(const float *x, const float *w, const void *ref, const void *cand,
                                void (*to_float)(const void *, float *, int64_t))
{
    float y[QK_K];
    to_float(ref, y, QK_K);
    double e_ref = quant_block_error(x, y, w, QK_K);
    to_float(cand, y, QK_K);
    return quant_block_error(x, y, w, QK_K) < e_ref ? cand : ref;
}

static void quantize_affine(const affine_search *s, const float *x, void *dst, int64_t n, const float *importance,
                            bool refine)
{
    bool q5 = s == &q5_k_search;
    size_t bytes = q5 ? sizeof(block_q5_k) : sizeof(block_q4_k);
    float sigma2 = importance ? quant_mean_square(x, n) : 0.0f;
    uint8_t *out = dst;
    for (int64_t sb = 0; sb < n / QK_K; sb++, out += bytes) {
        const float *xb = x + sb * QK_K;
        float w[QK_K];
        k_weights(xb, importance ? importance + sb * QK_K : NULL, sigma2, true, w);
        affine_block b;
        affine_reference(xb, w, s, &b);
        union {
            block_q4_k q4;
            block_q5_k q5;
        } ref, cand;
        if (q5)
            pack_q5_k(&b, &ref.q5);
        else
            pack_q4_k(&b, &ref.q4);
        if (!refine) {
            memcpy(out, &ref, bytes);
            continue;
        }
        affine_refine(xb, w, s->nmax, &b);
        if (q5)
            pack_q5_k(&b, &cand.q5);
        else
            pack_q4_k(&b, &cand.q4);
        memcpy(out, better_block(xb, w, &ref, &cand, q5 ? blade_q5_k_to_float : blade_q4_k_to_float), bytes);
    }
}

void quant_q4_k(const float *x, void *dst, int64_t n, const float *importance, bool refine)
{
    quantize_affine(&q4_k_search, x, dst, n, importance, refine);
}

void quant_q5_k(const float *x, void *dst, int64_t n, const float *importance, bool refine)
{
    quantize_affine(&q5_k_search, x, dst, n, importance, refine);
}

/* ---- Q6_K: symmetric groups of 16, x ~= d*sc*q, sc int8, q in [-32, 31] ---- */

#define Q6_GROUP 16
#define Q6_NGROUP (QK_K / Q6_GROUP)

typedef struct q6_block {
    uint16_t d;
    int8_t sc[Q6_NGROUP];
    uint8_t q[QK_K]; /* level + 32 */
} q6_block;

/* Levels of x at inverse scale iscale, q in [-32, 31], as floats (clamped before rounding,
 * which gives the reference's levels and vectorizes). */
static void q6_trial_levels(const float *x, float iscale, float *l)
{
    for (int i = 0; i < Q6_GROUP; i++) {
        float v = iscale * x[i];
        v = v > -32.0f ? v : -32.0f;
        v = v < 31.0f ? v : 31.0f;
        l[i] = quant_round(v);
    }
}

/* The weighted least-squares sums for levels l, each product formed as the reference forms
 * it and the products added in index order. */
static void q6_fit_sums(const float *x, const float *w, const float *l, float *sumlx, float *suml2)
{
    float lx[Q6_GROUP], l2[Q6_GROUP];
    for (int i = 0; i < Q6_GROUP; i++) {
        lx[i] = w[i] * x[i] * l[i];
        l2[i] = w[i] * l[i] * l[i];
    }
    float a = 0.0f, b = 0.0f;
    for (int i = 0; i < Q6_GROUP; i++) {
        a += lx[i];
        b += l2[i];
    }
    *sumlx = a;
    *suml2 = b;
}

/* The reference's group fit: the value of largest magnitude at level -32, then 18 other
 * steps around it, each with its weighted least-squares scale; the best kept. */
static float fit_group(const float *x, const float *w, uint8_t *q)
{
    float amax = 0.0f, vmax = 0.0f;
    for (int i = 0; i < Q6_GROUP; i++) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            vmax = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        memset(q, 0, Q6_GROUP);
        return 0.0f;
    }
    float best_l[Q6_GROUP], l[Q6_GROUP], sumlx, suml2;
    q6_trial_levels(x, -32.0f / vmax, best_l);
    q6_fit_sums(x, w, best_l, &sumlx, &suml2);
    float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int step = -9; step <= 9; step++) {
        if (step == 0)
            continue;
        q6_trial_levels(x, -(32.0f + 0.1f * (float)step) / vmax, l);
        q6_fit_sums(x, w, l, &sumlx, &suml2);
        if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
            memcpy(best_l, l, sizeof l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    for (int i = 0; i < Q6_GROUP; i++)
        q[i] = (uint8_t)(best_l[i] + 32.0f);
    return scale;
}

/* False for a block of (near) zeros, which is stored all zero. */
static bool q6_reference(const float *x, const float *w, q6_block *b)
{
    float scales[Q6_NGROUP], max_scale = 0.0f, max_abs = 0.0f;
    for (int g = 0; g < Q6_NGROUP; g++) {
        scales[g] = fit_group(x + g * Q6_GROUP, w + g * Q6_GROUP, b->q + g * Q6_GROUP);
        if (fabsf(scales[g]) > max_abs) {
            max_abs = fabsf(scales[g]);
            max_scale = scales[g];
        }
    }
    if (max_abs < GROUP_MAX_EPS)
        return false;
    float iscale = -128.0f / max_scale;
    b->d = blade_fp32_to_fp16(1.0f / iscale);
    for (int g = 0; g < Q6_NGROUP; g++) {
        int v = quant_nearest(iscale * scales[g]);
        b->sc[g] = (int8_t)(v < 127 ? v : 127);
    }
    float d = blade_fp16_to_fp32(b->d);
    for (int g = 0; g < Q6_NGROUP; g++) {
        float ds = d * (float)b->sc[g];
        if (ds == 0.0f)
            continue;
        for (int i = 0; i < Q6_GROUP; i++)
            b->q[g * Q6_GROUP + i] = (uint8_t)(quant_clamp(quant_nearest(x[g * Q6_GROUP + i] / ds), -32, 31) + 32);
    }
    return true;
}

static float q6_cost(const float *x, const float *w, float ds)
{
    float lane[COST_LANES] = {0};
    float inv = ds != 0.0f ? 1.0f / ds : 0.0f;
    for (int base = 0; base < Q6_GROUP; base += COST_LANES) {
        for (int l = 0; l < COST_LANES; l++) {
            float v = x[base + l] * inv;
            v = v > -32.0f ? v : -32.0f;
            v = v < 31.0f ? v : 31.0f;
            float e = ds * quant_round(v) - x[base + l];
            lane[l] += w[base + l] * e * e;
        }
    }
    float sum = 0.0f;
    for (int l = 0; l < COST_LANES; l++)
        sum += lane[l];
    return sum;
}

static float q6_total_cost(const float *x, const float *w, const q6_block *b, float d)
{
    float sum = 0.0f;
    for (int g = 0; g < Q6_NGROUP; g++)
        sum += q6_cost(x + g * Q6_GROUP, w + g * Q6_GROUP, d * (float)b->sc[g]);
    return sum;
}

static void q6_levels(const float *x, const q6_block *b, float d, uint8_t *q)
{
    for (int g = 0; g < Q6_NGROUP; g++) {
        float ds = d * (float)b->sc[g];
        if (ds == 0.0f)
            continue;
        float inv = 1.0f / ds;
        for (int i = 0; i < Q6_GROUP; i++)
            q[g * Q6_GROUP + i] = (uint8_t)(quant_clamp(quant_nearest(x[g * Q6_GROUP + i] * inv), -32, 31) + 32);
    }
}

static void q6_refine(const float *x, const float *w, q6_block *b)
{
    float d = blade_fp16_to_fp32(b->d);
    for (int round = 0; round < REFINE_ROUNDS; round++) {
        for (int g = 0; g < Q6_NGROUP; g++) {
            const float *xg = x + g * Q6_GROUP, *wg = w + g * Q6_GROUP;
            int s0 = b->sc[g];
            float best = q6_cost(xg, wg, d * (float)s0);
            for (int s = s0 - Q6_NEIGHBOURHOOD; s <= s0 + Q6_NEIGHBOURHOOD; s++) {
                if (s < -128 || s > 127 || s == s0)
                    continue;
                float c = q6_cost(xg, wg, d * (float)s);
                if (c < best) {
                    best = c;
                    b->sc[g] = (int8_t)s;
                }
            }
        }
        q6_levels(x, b, d, b->q);
        float cost = q6_total_cost(x, w, b, d);
        double aa = 0, ax = 0;
        for (int i = 0; i < QK_K; i++) {
            double a = (double)b->sc[i / Q6_GROUP] * ((int)b->q[i] - 32);
            aa += (double)w[i] * a * a;
            ax += (double)w[i] * a * x[i];
        }
        if (!(aa > 0))
            break;
        uint16_t nd16 = blade_fp32_to_fp16((float)(ax / aa));
        float nd = blade_fp16_to_fp32(nd16);
        if (nd16 == b->d || !isfinite(nd) || nd == 0.0f || !(q6_total_cost(x, w, b, nd) < cost))
            break;
        b->d = nd16;
        d = nd;
        q6_levels(x, b, d, b->q);
    }
}

static void pack_q6_k(const q6_block *b, block_q6_k *out)
{
    out->d = b->d;
    memcpy(out->scales, b->sc, sizeof out->scales);
    /* Groups in natural order (scales[g] covers values 16g..16g+15); the bit planes
     * interleave four 32-value runs per half. */
    for (int half = 0; half < 2; half++) {
        uint8_t *ql = out->ql + 64 * half, *qh = out->qh + 32 * half;
        const uint8_t *qq = b->q + 128 * half;
        for (int l = 0; l < 32; l++) {
            int q1 = qq[l], q2 = qq[l + 32], q3 = qq[l + 64], q4 = qq[l + 96];
            ql[l] = (uint8_t)((q1 & 0xF) | ((q3 & 0xF) << 4));
            ql[l + 32] = (uint8_t)((q2 & 0xF) | ((q4 & 0xF) << 4));
            qh[l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
        }
    }
}

void quant_q6_k(const float *x, void *dst, int64_t n, const float *importance, bool refine)
{
    float sigma2 = importance ? quant_mean_square(x, n) : 0.0f;
    uint8_t *out = dst;
    for (int64_t sb = 0; sb < n / QK_K; sb++, out += sizeof(block_q6_k)) {
        const float *xb = x + sb * QK_K;
        float w[QK_K];
        k_weights(xb, importance ? importance + sb * QK_K : NULL, sigma2, false, w);
        q6_block b;
        block_q6_k ref, cand;
        if (!q6_reference(xb, w, &b)) {
            memset(out, 0, sizeof ref);
            continue;
        }
        pack_q6_k(&b, &ref);
        if (!refine) {
            memcpy(out, &ref, sizeof ref);
            continue;
        }
        q6_refine(xb, w, &b);
        pack_q6_k(&b, &cand);
        memcpy(out, better_block(xb, w, &ref, &cand, blade_q6_k_to_float), sizeof ref);
    }
}

void blade_q4_k_from_float(const float *src, void *dst, int64_t n)
{
    quant_q4_k(src, dst, n, NULL, true);
}

void blade_q5_k_from_float(const float *src, void *dst, int64_t n)
{
    quant_q5_k(src, dst, n, NULL, true);
}

void blade_q6_k_from_float(const float *src, void *dst, int64_t n)
{
    quant_q6_k(src, dst, n, NULL, true);
}

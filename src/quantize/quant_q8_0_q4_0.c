/* Q8_0 and Q4_0: one fp16 scale per 32 values. Without importance these are exactly ggml's
 * reference quantizers (so blade's files match llama.cpp's byte for byte); with importance a
 * weighted scale search replaces the fixed max-abs rule wherever it lowers the error. */

#include "quantize/quant_blocks.h"
#include "quantize/quant_internal.h"
#include "tensor/quant_ref.h"

#include <math.h>

/* ---- the reference rules ---- */

/* d = amax / 127 and q = round-half-away(x / d), both against the unrounded d. */
static void q8_0_reference(const float *x, block_q8_0 *b)
{
    float amax = 0.0f;
    for (int j = 0; j < QK8_0; j++)
        amax = amax > fabsf(x[j]) ? amax : fabsf(x[j]);
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    b->d = blade_fp32_to_fp16(d);
    for (int j = 0; j < QK8_0; j++)
        b->qs[j] = (int8_t)roundf(x[j] * id);
}

/* The value of largest magnitude, sign kept, maps to -8 (the level without a positive twin):
 * d = max / -8; q = min(15, trunc(x / d + 8.5)), rounding half up. */
static void q4_0_reference(const float *x, block_q4_0 *b)
{
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < QK4_0; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            vmax = x[j];
        }
    }
    float d = vmax / -8.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    b->d = blade_fp32_to_fp16(d);
    for (int j = 0; j < QK4_0 / 2; j++) {
        int lo = (int)(x[j] * id + 8.5f), hi = (int)(x[j + QK4_0 / 2] * id + 8.5f);
        lo = lo < 15 ? lo : 15;
        hi = hi < 15 ? hi : 15;
        b->qs[j] = (uint8_t)(lo | (hi << 4));
    }
}

/* ---- the importance-weighted search ---- */

#define SYM_STEPS 8      /* candidate extreme levels each side of the nominal one */
#define SYM_STEP 0.125f  /* in units of one level */

static float symmetric_error(const float *x, const float *w, int n, float d, int qmin, int qmax)
{
    float id = 1.0f / d, err = 0.0f;
    for (int i = 0; i < n; i++) {
        float e = d * (float)quant_clamp(quant_nearest(x[i] * id), qmin, qmax) - x[i];
        err += w[i] * e * e;
    }
    return err;
}

/* Weighted least-squares step for x ~= d*q with the levels fixed by d; d itself when the
 * levels are all zero. */
static float symmetric_refit(const float *x, const float *w, int n, float d, int qmin, int qmax)
{
    float id = 1.0f / d, sxq = 0.0f, sqq = 0.0f;
    for (int i = 0; i < n; i++) {
        float q = (float)quant_clamp(quant_nearest(x[i] * id), qmin, qmax);
        sxq += w[i] * x[i] * q;
        sqq += w[i] * q * q;
    }
    return sqq > 0.0f && sxq != 0.0f ? sxq / sqq : d;
}

/* Scale d for x ~= d*q, q in [qmin, qmax], minimizing sum w (x - d q)^2: the extreme value is
 * tried at levels near qmin and near qmax (either sign of d), each start refined once by
 * least squares. 0 when every value is 0. */
static float symmetric_search(const float *x, const float *w, int n, int qmin, int qmax)
{
    float amax = 0.0f, vmax = 0.0f;
    for (int i = 0; i < n; i++) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            vmax = x[i];
        }
    }
    if (amax == 0.0f)
        return 0.0f;
    float best_d = vmax / (float)qmin, best_err = INFINITY;
    for (int side = 0; side < 2; side++) {
        float level = side ? (float)qmax : (float)qmin;
        for (int k = -SYM_STEPS; k <= SYM_STEPS; k++) {
            float lk = level + (level < 0.0f ? -SYM_STEP : SYM_STEP) * (float)k;
            float d = vmax / lk;
            for (int r = 0; r < 2; r++) {
                float err = symmetric_error(x, w, n, d, qmin, qmax);
                if (err < best_err) {
                    best_err = err;
                    best_d = d;
                }
                d = symmetric_refit(x, w, n, d, qmin, qmax);
            }
        }
    }
    return best_d;
}

/* Levels for the fp16 scale actually stored. */
static void symmetric_levels(const float *x, int n, float d, int qmin, int qmax, int *q)
{
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++)
        q[i] = quant_clamp(quant_nearest(x[i] * id), qmin, qmax);
}

/* ---- rows ---- */

typedef struct simple_type {
    int qmin, qmax;
    size_t block_bytes;
    void (*reference)(const float *x, void *blk);
    void (*pack)(uint16_t d, const int *q, void *blk);
    void (*to_float)(const void *src, float *dst, int64_t n);
} simple_type;

static void q8_0_ref_block(const float *x, void *blk)
{
    q8_0_reference(x, blk);
}

static void q4_0_ref_block(const float *x, void *blk)
{
    q4_0_reference(x, blk);
}

static void q8_0_pack(uint16_t d, const int *q, void *blk)
{
    block_q8_0 *b = blk;
    b->d = d;
    for (int j = 0; j < QK8_0; j++)
        b->qs[j] = (int8_t)q[j];
}

static void q4_0_pack(uint16_t d, const int *q, void *blk)
{
    block_q4_0 *b = blk;
    b->d = d;
    for (int j = 0; j < QK4_0 / 2; j++)
        b->qs[j] = (uint8_t)((q[j] + 8) | ((q[j + QK4_0 / 2] + 8) << 4));
}

static const simple_type q8_0_type = {-128, 127, sizeof(block_q8_0), q8_0_ref_block, q8_0_pack, blade_q8_0_to_float};
static const simple_type q4_0_type = {-8, 7, sizeof(block_q4_0), q4_0_ref_block, q4_0_pack, blade_q4_0_to_float};

/* Blocks are built in aligned locals and copied out, so dst may have any alignment. */
/* The importance-weighted search is these types' counterpart of the K-quants' weighted
 * reference search, so it runs whenever there is importance: refine changes nothing here. */
static void quantize_simple(const simple_type *t, const float *x, void *dst, int64_t n, const float *importance)
{
    uint8_t *out = dst;
    bool search = importance != NULL;
    float sigma2 = search ? quant_mean_square(x, n) : 0.0f;
    for (int64_t b = 0; b < n / 32; b++, out += t->block_bytes) {
        const float *xb = x + b * 32;
        _Alignas(16) uint8_t ref[sizeof(block_q8_0)];
        t->reference(xb, ref);
        if (!search) {
            memcpy(out, ref, t->block_bytes);
            continue;
        }
        float w[32], y[32];
        quant_importance_weights(xb, importance + b * 32, sigma2, w, 32);
        t->to_float(ref, y, 32);
        double ref_err = quant_block_error(xb, y, w, 32);

        uint16_t d16 = blade_fp32_to_fp16(symmetric_search(xb, w, 32, t->qmin, t->qmax));
        int q[32];
        symmetric_levels(xb, 32, blade_fp16_to_fp32(d16), t->qmin, t->qmax, q);
        _Alignas(16) uint8_t cand[sizeof(block_q8_0)];
        t->pack(d16, q, cand);
        t->to_float(cand, y, 32);
        memcpy(out, quant_block_error(xb, y, w, 32) < ref_err ? cand : ref, t->block_bytes);
    }
}

void quant_q8_0(const float *x, void *dst, int64_t n, const float *importance, bool refine)
{
    (void)refine;
    quantize_simple(&q8_0_type, x, dst, n, importance);
}

void quant_q4_0(const float *x, void *dst, int64_t n, const float *importance, bool refine)
{
    (void)refine;
    quantize_simple(&q4_0_type, x, dst, n, importance);
}

void blade_q8_0_from_float(const float *src, void *dst, int64_t n)
{
    quant_q8_0(src, dst, n, NULL, true);
}

void blade_q4_0_from_float(const float *src, void *dst, int64_t n)
{
    quant_q4_0(src, dst, n, NULL, true);
}

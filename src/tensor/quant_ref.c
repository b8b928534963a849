#include "tensor/quant_ref.h"

#include "blade/types.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

/* Scalar reference conversions. Dequantizers follow ggml's arithmetic order (scale
 * products first, then times the quant) so results match other readers to the last bit
 * where the compiler does not contract into FMAs. Quantizers aim for low error with
 * plain, auditable searches rather than bit-identity with any other tool. */

/* ---- plain float formats ---- */

void blade_f32_to_float(const void *src, float *dst, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}

void blade_f32_from_float(const float *src, void *dst, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}

void blade_f16_to_float(const void *src, float *dst, int64_t n)
{
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, sizeof h);
        dst[i] = blade_fp16_to_fp32(h);
    }
}

void blade_f16_from_float(const float *src, void *dst, int64_t n)
{
    uint8_t *p = dst;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h = blade_fp32_to_fp16(src[i]);
        memcpy(p + 2 * i, &h, sizeof h);
    }
}

void blade_bf16_to_float(const void *src, float *dst, int64_t n)
{
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, sizeof h);
        dst[i] = blade_bf16_to_fp32(h);
    }
}

void blade_bf16_from_float(const float *src, void *dst, int64_t n)
{
    uint8_t *p = dst;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h = blade_fp32_to_bf16(src[i]);
        memcpy(p + 2 * i, &h, sizeof h);
    }
}

/* ---- shared quantizer helpers ---- */

static int clampi(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

/* The scale is stored as fp16, so quantizing against the rounded value (not the exact
 * one) keeps the quants consistent with what the dequantizer will multiply by. */
static float round_trip_fp16(float v, uint16_t *bits)
{
    *bits = blade_fp32_to_fp16(v);
    return blade_fp16_to_fp32(*bits);
}

/* Quant level of x on the grid off + s*q, q in [0, nmax]. */
static int affine_level(float x, float inv_s, float off, int nmax)
{
    return clampi((int)lrintf((x - off) * inv_s), 0, nmax);
}

static float affine_error(const float *x, int n, int nmax, float s, float off)
{
    float inv = 1.0f / s, err = 0.0f;
    for (int i = 0; i < n; i++) {
        float e = s * (float)affine_level(x[i], inv, off, nmax) + off - x[i];
        err += e * e;
    }
    return err;
}

/* One Lloyd-style step: with the levels fixed by the current grid, the least-squares
 * scale and offset have a closed form. The offset is kept <= 0 because the format stores
 * it as a non-negative min subtracted from every value. Returns false when the levels
 * are degenerate and the grid should stay as it is. */
static bool affine_refit(const float *x, int n, int nmax, float *s, float *off)
{
    float inv = 1.0f / *s;
    double sq = 0, sq2 = 0, sx = 0, sxq = 0;
    for (int i = 0; i < n; i++) {
        double q = affine_level(x[i], inv, *off, nmax);
        sq += q;
        sq2 += q * q;
        sx += x[i];
        sxq += x[i] * q;
    }
    double det = n * sq2 - sq * sq;
    if (det <= 0)
        return false;
    double ns = (n * sxq - sq * sx) / det;
    double noff = (sx - ns * sq) / n;
    if (noff > 0) {
        noff = 0;
        ns = sxq / sq2;
    }
    if (!(ns > 0))
        return false;
    *s = (float)ns;
    *off = (float)noff;
    return true;
}

/* Candidate steps shrink from the full range: clipping the few largest values of a
 * heavy-tailed sub-block often buys a finer grid for all the others. */
#define FIT_TRIALS 8
#define FIT_SHRINK 0.03f
#define FIT_REFITS 2

/* Fits x ~= s*q - m with q in [0, nmax], s >= 0, m >= 0, minimizing squared error over
 * a few starting grids each refined by least squares. */
static void fit_affine(const float *x, int n, int nmax, float *scale, float *min)
{
    float lo = 0.0f, hi = x[0];
    for (int i = 0; i < n; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    if (!(hi > lo)) {
        /* Every value equals lo (<= 0): the min alone represents it exactly. */
        *scale = 0.0f;
        *min = -lo;
        return;
    }
    float best_s = 0.0f, best_off = lo, best_err = INFINITY;
    for (int t = 0; t < FIT_TRIALS; t++) {
        float s = (hi - lo) / (float)nmax * (1.0f - FIT_SHRINK * (float)t), off = lo;
        for (int r = 0; r <= FIT_REFITS; r++) {
            float err = affine_error(x, n, nmax, s, off);
            if (err < best_err) {
                best_err = err;
                best_s = s;
                best_off = off;
            }
            if (r == FIT_REFITS || !affine_refit(x, n, nmax, &s, &off))
                break;
        }
    }
    *scale = best_s;
    *min = -best_off;
}

/* Level of x on the symmetric grid s*q, q in [-nmax, nmax-1]. */
static int symmetric_level(float x, float inv_s, int nmax)
{
    return clampi((int)lrintf(x * inv_s), -nmax, nmax - 1);
}

static float symmetric_error(const float *x, int n, int nmax, float s)
{
    float inv = 1.0f / s, err = 0.0f;
    for (int i = 0; i < n; i++) {
        float e = s * (float)symmetric_level(x[i], inv, nmax) - x[i];
        err += e * e;
    }
    return err;
}

/* Scale for x ~= s*q, q in [-nmax, nmax-1]. The value of largest magnitude is mapped to
 * -nmax (the side with the extra level); its sign decides the sign of s. Shrunken
 * candidates are refined by the closed-form least-squares scale for fixed levels. */
static float fit_symmetric(const float *x, int n, int nmax)
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
    float best_s = 0.0f, best_err = INFINITY;
    for (int t = 0; t < FIT_TRIALS; t++) {
        float s = vmax / (float)-nmax * (1.0f - FIT_SHRINK * (float)t);
        for (int r = 0; r <= FIT_REFITS; r++) {
            float err = symmetric_error(x, n, nmax, s);
            if (err < best_err) {
                best_err = err;
                best_s = s;
            }
            if (r == FIT_REFITS)
                break;
            float inv = 1.0f / s;
            double sxq = 0, sq2 = 0;
            for (int i = 0; i < n; i++) {
                double q = symmetric_level(x[i], inv, nmax);
                sxq += x[i] * q;
                sq2 += q * q;
            }
            if (sq2 == 0 || sxq == 0)
                break;
            s = (float)(sxq / sq2);
        }
    }
    return best_s;
}

/* ---- Q8_0 ---- */

void blade_q8_0_to_float(const void *src, float *dst, int64_t n)
{
    const uint8_t *p = src;
    for (int64_t b = 0; b < n / QK8_0; b++) {
        block_q8_0 blk;
        memcpy(&blk, p + b * (int64_t)sizeof blk, sizeof blk);
        float d = blade_fp16_to_fp32(blk.d);
        for (int j = 0; j < QK8_0; j++)
            dst[b * QK8_0 + j] = d * (float)blk.qs[j];
    }
}

void blade_q8_0_from_float(const float *src, void *dst, int64_t n)
{
    uint8_t *p = dst;
    for (int64_t b = 0; b < n / QK8_0; b++) {
        const float *x = src + b * QK8_0;
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++)
            amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        block_q8_0 blk;
        float d = round_trip_fp16(amax / 127.0f, &blk.d);
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < QK8_0; j++)
            blk.qs[j] = (int8_t)clampi((int)lrintf(x[j] * id), -127, 127);
        memcpy(p + b * (int64_t)sizeof blk, &blk, sizeof blk);
    }
}

/* ---- Q4_0 ---- */

void blade_q4_0_to_float(const void *src, float *dst, int64_t n)
{
    const uint8_t *p = src;
    for (int64_t b = 0; b < n / QK4_0; b++) {
        block_q4_0 blk;
        memcpy(&blk, p + b * (int64_t)sizeof blk, sizeof blk);
        float d = blade_fp16_to_fp32(blk.d);
        float *y = dst + b * QK4_0;
        for (int j = 0; j < QK4_0 / 2; j++) {
            y[j] = d * (float)((blk.qs[j] & 0xF) - 8);
            y[j + QK4_0 / 2] = d * (float)((blk.qs[j] >> 4) - 8);
        }
    }
}

void blade_q4_0_from_float(const float *src, void *dst, int64_t n)
{
    uint8_t *p = dst;
    for (int64_t b = 0; b < n / QK4_0; b++) {
        const float *x = src + b * QK4_0;
        /* Signed extreme maps to -8, the level without a positive twin, so the range
         * [-8, 7] is used fully on the side that needs it. */
        float amax = 0.0f, vmax = 0.0f;
        for (int j = 0; j < QK4_0; j++) {
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                vmax = x[j];
            }
        }
        block_q4_0 blk;
        float d = round_trip_fp16(vmax / -8.0f, &blk.d);
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < QK4_0 / 2; j++) {
            int lo = clampi((int)lrintf(x[j] * id) + 8, 0, 15);
            int hi = clampi((int)lrintf(x[j + QK4_0 / 2] * id) + 8, 0, 15);
            blk.qs[j] = (uint8_t)(lo | (hi << 4));
        }
        memcpy(p + b * (int64_t)sizeof blk, &blk, sizeof blk);
    }
}

/* ---- Q4_K / Q5_K shared parts ---- */

void blade_k_scales_pack(const uint8_t sc[K_NSUB], const uint8_t m[K_NSUB], uint8_t out[K_SCALE_BYTES])
{
    for (int j = 0; j < 4; j++) {
        out[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        out[j + 4] = (uint8_t)(m[j] | ((m[j + 4] >> 4) << 6));
        out[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
    }
}

/* Chooses d, dmin and the 6-bit per-sub-block scales and mins for one super-block, then
 * the quant levels (0..nmax) of all 256 values against the values the dequantizer will
 * actually reconstruct. */
static void quantize_k_affine(const float *x, int nmax, uint16_t *d_bits, uint16_t *dmin_bits,
                              uint8_t scales[K_SCALE_BYTES], uint8_t q[QK_K])
{
    float sub_scale[K_NSUB], sub_min[K_NSUB], max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < K_NSUB; j++) {
        fit_affine(x + j * K_SUB, K_SUB, nmax, &sub_scale[j], &sub_min[j]);
        max_scale = sub_scale[j] > max_scale ? sub_scale[j] : max_scale;
        max_min = sub_min[j] > max_min ? sub_min[j] : max_min;
    }
    float d = round_trip_fp16(max_scale / 63.0f, d_bits);
    float dmin = round_trip_fp16(max_min / 63.0f, dmin_bits);
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    float idmin = dmin != 0.0f ? 1.0f / dmin : 0.0f;
    uint8_t sc[K_NSUB], m[K_NSUB];
    for (int j = 0; j < K_NSUB; j++) {
        sc[j] = (uint8_t)clampi((int)lrintf(sub_scale[j] * id), 0, 63);
        m[j] = (uint8_t)clampi((int)lrintf(sub_min[j] * idmin), 0, 63);
        float ds = d * (float)sc[j], dm = dmin * (float)m[j];
        float inv = ds != 0.0f ? 1.0f / ds : 0.0f;
        for (int i = 0; i < K_SUB; i++)
            q[j * K_SUB + i] = (uint8_t)affine_level(x[j * K_SUB + i], inv, -dm, nmax);
    }
    blade_k_scales_pack(sc, m, scales);
}

/* ---- Q4_K ---- */

void blade_q4_k_to_float(const void *src, float *dst, int64_t n)
{
    const uint8_t *p = src;
    for (int64_t b = 0; b < n / QK_K; b++) {
        block_q4_k blk;
        memcpy(&blk, p + b * (int64_t)sizeof blk, sizeof blk);
        float d = blade_fp16_to_fp32(blk.d), dmin = blade_fp16_to_fp32(blk.dmin);
        float *y = dst + b * QK_K;
        for (int pair = 0; pair < K_NSUB / 2; pair++) {
            const uint8_t *qs = blk.qs + pair * K_SUB;
            uint8_t sc, m;
            blade_k_scale_min(2 * pair, blk.scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            blade_k_scale_min(2 * pair + 1, blk.scales, &sc, &m);
            float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < K_SUB; l++) {
                y[pair * 64 + l] = d1 * (float)(qs[l] & 0xF) - m1;
                y[pair * 64 + K_SUB + l] = d2 * (float)(qs[l] >> 4) - m2;
            }
        }
    }
}

void blade_q4_k_from_float(const float *src, void *dst, int64_t n)
{
    uint8_t *p = dst;
    for (int64_t b = 0; b < n / QK_K; b++) {
        block_q4_k blk;
        uint8_t q[QK_K];
        quantize_k_affine(src + b * QK_K, 15, &blk.d, &blk.dmin, blk.scales, q);
        for (int pair = 0; pair < K_NSUB / 2; pair++)
            for (int l = 0; l < K_SUB; l++)
                blk.qs[pair * K_SUB + l] = (uint8_t)(q[pair * 64 + l] | (q[pair * 64 + K_SUB + l] << 4));
        memcpy(p + b * (int64_t)sizeof blk, &blk, sizeof blk);
    }
}

/* ---- Q5_K ---- */

void blade_q5_k_to_float(const void *src, float *dst, int64_t n)
{
    const uint8_t *p = src;
    for (int64_t b = 0; b < n / QK_K; b++) {
        block_q5_k blk;
        memcpy(&blk, p + b * (int64_t)sizeof blk, sizeof blk);
        float d = blade_fp16_to_fp32(blk.d), dmin = blade_fp16_to_fp32(blk.dmin);
        float *y = dst + b * QK_K;
        for (int pair = 0; pair < K_NSUB / 2; pair++) {
            const uint8_t *qs = blk.qs + pair * K_SUB;
            uint8_t sc, m;
            blade_k_scale_min(2 * pair, blk.scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            blade_k_scale_min(2 * pair + 1, blk.scales, &sc, &m);
            float d2 = d * (float)sc, m2 = dmin * (float)m;
            unsigned bit1 = 1u << (2 * pair), bit2 = 1u << (2 * pair + 1);
            for (int l = 0; l < K_SUB; l++) {
                int q1 = (qs[l] & 0xF) + ((blk.qh[l] & bit1) ? 16 : 0);
                int q2 = (qs[l] >> 4) + ((blk.qh[l] & bit2) ? 16 : 0);
                y[pair * 64 + l] = d1 * (float)q1 - m1;
                y[pair * 64 + K_SUB + l] = d2 * (float)q2 - m2;
            }
        }
    }
}

void blade_q5_k_from_float(const float *src, void *dst, int64_t n)
{
    uint8_t *p = dst;
    for (int64_t b = 0; b < n / QK_K; b++) {
        block_q5_k blk;
        uint8_t q[QK_K];
        quantize_k_affine(src + b * QK_K, 31, &blk.d, &blk.dmin, blk.scales, q);
        memset(blk.qh, 0, sizeof blk.qh);
        for (int pair = 0; pair < K_NSUB / 2; pair++) {
            for (int l = 0; l < K_SUB; l++) {
                int q1 = q[pair * 64 + l], q2 = q[pair * 64 + K_SUB + l];
                blk.qs[pair * K_SUB + l] = (uint8_t)((q1 & 0xF) | ((q2 & 0xF) << 4));
                blk.qh[l] |= (uint8_t)(((q1 >> 4) << (2 * pair)) | ((q2 >> 4) << (2 * pair + 1)));
            }
        }
        memcpy(p + b * (int64_t)sizeof blk, &blk, sizeof blk);
    }
}

/* ---- Q6_K ---- */

#define Q6_GROUP 16
#define Q6_NGROUP (QK_K / Q6_GROUP)

void blade_q6_k_to_float(const void *src, float *dst, int64_t n)
{
    const uint8_t *p = src;
    for (int64_t b = 0; b < n / QK_K; b++) {
        block_q6_k blk;
        memcpy(&blk, p + b * (int64_t)sizeof blk, sizeof blk);
        float d = blade_fp16_to_fp32(blk.d);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk.ql + 64 * half;
            const uint8_t *qh = blk.qh + 32 * half;
            const int8_t *sc = blk.scales + 8 * half;
            float *y = dst + b * QK_K + 128 * half;
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is + 0] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
    }
}

void blade_q6_k_from_float(const float *src, void *dst, int64_t n)
{
    uint8_t *p = dst;
    for (int64_t b = 0; b < n / QK_K; b++) {
        const float *x = src + b * QK_K;
        float gscale[Q6_NGROUP], smax = 0.0f;
        for (int g = 0; g < Q6_NGROUP; g++) {
            gscale[g] = fit_symmetric(x + g * Q6_GROUP, Q6_GROUP, 32);
            smax = fabsf(gscale[g]) > fabsf(smax) ? gscale[g] : smax;
        }
        block_q6_k blk;
        /* As in Q4_0, the largest group scale takes the unpaired int8 level -128. */
        float d = round_trip_fp16(smax / -128.0f, &blk.d);
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[QK_K];
        for (int g = 0; g < Q6_NGROUP; g++) {
            blk.scales[g] = (int8_t)clampi((int)lrintf(gscale[g] * id), -128, 127);
            float ds = d * (float)blk.scales[g];
            float inv = ds != 0.0f ? 1.0f / ds : 0.0f;
            for (int i = 0; i < Q6_GROUP; i++)
                q[g * Q6_GROUP + i] = (uint8_t)(symmetric_level(x[g * Q6_GROUP + i], inv, 32) + 32);
        }
        /* Groups are stored in natural order (scales[8*half + e/16] covers element
         * 128*half + e); the bit planes interleave four 32-element runs per half. */
        for (int half = 0; half < 2; half++) {
            uint8_t *ql = blk.ql + 64 * half, *qh = blk.qh + 32 * half;
            const uint8_t *qq = q + 128 * half;
            for (int l = 0; l < 32; l++) {
                int q1 = qq[l], q2 = qq[l + 32], q3 = qq[l + 64], q4 = qq[l + 96];
                ql[l] = (uint8_t)((q1 & 0xF) | ((q3 & 0xF) << 4));
                ql[l + 32] = (uint8_t)((q2 & 0xF) | ((q4 & 0xF) << 4));
                qh[l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
            }
        }
        memcpy(p + b * (int64_t)sizeof blk, &blk, sizeof blk);
    }
}

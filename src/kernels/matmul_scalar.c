#include "kernels/kernels_internal.h"

#include <math.h>
#include <string.h>

/* Portable kernels: one dot product per (row, token), written for clarity. Integer sums
 * per block are exact and the float accumulation runs block by block in order, so
 * the result depends on nothing but the two rows. Also the portable activation
 * converters, whose bytes the vector ones reproduce. */

typedef float (*dot_fn)(const uint8_t *w, const void *x, int64_t n);

static float dot_f32(const uint8_t *w, const void *x, int64_t n)
{
    const float *xf = x;
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        float v;
        memcpy(&v, w + 4 * i, sizeof v);
        acc += (double)v * xf[i];
    }
    return (float)acc;
}

static float dot_f16(const uint8_t *w, const void *x, int64_t n)
{
    const float *xf = x;
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, w + 2 * i, sizeof h);
        acc += (double)blade_fp16_to_fp32(h) * xf[i];
    }
    return (float)acc;
}

static float dot_bf16(const uint8_t *w, const void *x, int64_t n)
{
    const uint16_t *xb = x;
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, w + 2 * i, sizeof h);
        acc += (double)blade_bf16_to_fp32(h) * blade_bf16_to_fp32(xb[i]);
    }
    return (float)acc;
}

static float dot_q8_0(const uint8_t *w, const void *x, int64_t n)
{
    act_q8_view a = act_q8_at(x, n);
    float acc = 0.0f;
    for (int64_t b = 0; b < n / QK8_0; b++) {
        block_q8_0 blk;
        memcpy(&blk, w + b * (int64_t)sizeof blk, sizeof blk);
        const int8_t *xq = a.q + b * QK8_0;
        int32_t isum = 0;
        for (int j = 0; j < QK8_0; j++)
            isum += blk.qs[j] * xq[j];
        acc += blade_fp16_to_fp32(blk.d) * a.d[b] * (float)isum;
    }
    return acc;
}

static float dot_q4_0(const uint8_t *w, const void *x, int64_t n)
{
    act_q8_view a = act_q8_at(x, n);
    float acc = 0.0f;
    for (int64_t b = 0; b < n / QK4_0; b++) {
        block_q4_0 blk;
        memcpy(&blk, w + b * (int64_t)sizeof blk, sizeof blk);
        const int8_t *xq = a.q + b * QK4_0;
        int32_t isum = 0;
        for (int j = 0; j < QK4_0 / 2; j++)
            isum += (blk.qs[j] & 0xF) * xq[j] + (blk.qs[j] >> 4) * xq[j + QK4_0 / 2];
        /* Weights are stored as q+8; the offset comes back out through the block sum. */
        isum -= 8 * a.sum[b];
        acc += blade_fp16_to_fp32(blk.d) * a.d[b] * (float)isum;
    }
    return acc;
}

/* Q4_K and Q5_K share everything but the fifth bit. */
static float dot_q45_k(const uint8_t *w, const void *x, int64_t n, bool five)
{
    act_k_view a = act_k_at(x, n);
    float acc = 0.0f;
    for (int64_t b = 0; b < n / QK_K; b++) {
        const uint8_t *scales, *qs, *qh = NULL;
        uint16_t dh, dminh;
        block_q4_k b4;
        block_q5_k b5;
        if (five) {
            memcpy(&b5, w + b * (int64_t)sizeof b5, sizeof b5);
            dh = b5.d, dminh = b5.dmin, scales = b5.scales, qs = b5.qs, qh = b5.qh;
        } else {
            memcpy(&b4, w + b * (int64_t)sizeof b4, sizeof b4);
            dh = b4.d, dminh = b4.dmin, scales = b4.scales, qs = b4.qs;
        }
        const int8_t *xq = a.q + b * QK_K;
        const int16_t *xs = a.sum16 + b * (QK_K / 16);
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < QK_K / 32; j++) {
            uint8_t sc, m;
            blade_k_scale_min(j, scales, &sc, &m);
            int shift = 4 * (j & 1);
            int32_t s = 0;
            for (int l = 0; l < 32; l++) {
                int q = (qs[32 * (j / 2) + l] >> shift) & 0xF;
                if (qh && (qh[l] >> j) & 1)
                    q += 16;
                s += q * xq[32 * j + l];
            }
            isum += sc * s;
            msum += m * (xs[2 * j] + xs[2 * j + 1]);
        }
        float dx = a.d[b];
        float d = blade_fp16_to_fp32(dh), dmin = blade_fp16_to_fp32(dminh);
        acc += d * dx * (float)isum - dmin * dx * (float)msum;
    }
    return acc;
}

static float dot_q4_k(const uint8_t *w, const void *x, int64_t n)
{
    return dot_q45_k(w, x, n, false);
}

static float dot_q5_k(const uint8_t *w, const void *x, int64_t n)
{
    return dot_q45_k(w, x, n, true);
}

static float dot_q6_k(const uint8_t *w, const void *x, int64_t n)
{
    act_k_view a = act_k_at(x, n);
    float acc = 0.0f;
    for (int64_t b = 0; b < n / QK_K; b++) {
        block_q6_k blk;
        memcpy(&blk, w + b * (int64_t)sizeof blk, sizeof blk);
        const int8_t *xq = a.q + b * QK_K;
        const int16_t *xs = a.sum16 + b * (QK_K / 16);
        int32_t isum = 0;
        for (int g = 0; g < QK_K / 16; g++) {
            int32_t s = 0;
            for (int i = 0; i < 16; i++) {
                /* Element e: half h, 32-run c within the half, position l in the run. */
                int e = 16 * g + i, h = e / 128, c = (e % 128) / 32, l = e % 32;
                int lo = blk.ql[64 * h + 32 * (c & 1) + l] >> (4 * (c >> 1)) & 0xF;
                int hi = blk.qh[32 * h + l] >> (2 * c) & 3;
                s += (lo | hi << 4) * xq[e];
            }
            /* Quants are stored as q+32; the block sums remove the offset exactly. */
            isum += blk.scales[g] * (s - 32 * xs[g]);
        }
        acc += blade_fp16_to_fp32(blk.d) * a.d[b] * (float)isum;
    }
    return acc;
}

/* R16 (kernels_internal.h): the same exact block sums as dot_q4_0/dot_q8_0, gathered from
 * the group's chunks and folded in with one fused multiply-add per block, the operation
 * the vector kernels apply to 16 rows at once. */
static void mm_r16(uint32_t ktype, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n, float *Y,
                   int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    bool q4 = ktype == BLADE_KTYPE_Q4_0_R16;
    size_t blk_bytes = r16_block_bytes(ktype);
    for (int64_t t = 0; t < n_tok; t++) {
        act_q8_view a = act_q8_at((const uint8_t *)X + t * x_stride, n);
        for (int64_t r = r0; r < r1; r++) {
            int64_t rr = r % BLADE_R16_ROWS;
            const uint8_t *group = (const uint8_t *)W + (r - rr) * w_stride;
            float acc = 0.0f;
            for (int64_t b = 0; b < n / QK8_0; b++) {
                const uint8_t *blk = group + b * blk_bytes;
                const int8_t *xq = a.q + b * QK8_0;
                int32_t isum = r16_start(ktype, a.sum[b]);
                for (int c = 0; c < (q4 ? R16_Q4_CHUNKS : R16_Q8_CHUNKS); c++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t v = blk[R16_SCALES + 64 * c + 4 * rr + i];
                        if (q4)
                            isum += (v & 0xF) * xq[4 * c + i] + (v >> 4) * xq[16 + 4 * c + i];
                        else
                            isum += v * xq[4 * c + i];
                    }
                uint16_t h;
                memcpy(&h, blk + 2 * rr, 2);
                acc = fmaf((float)isum, blade_fp16_to_fp32(h) * a.d[b], acc);
            }
            Y[t * ldy + r] = acc;
        }
    }
}

/* Q4_K R16, one super-block of row rr: the exact scale-weighted quant sum and
 * min-weighted activation sum, then one FMA for each (the vector kernels' order, 16 rows
 * at a time). */
static float q4_k_r16_block(const uint8_t *blk, int rr, act_k_view a, int64_t b, float acc)
{
    uint8_t sc[128], m[128];
    const int8_t *xq = a.q + b * QK_K;
    const int16_t *xs = a.sum16 + b * (QK_K / 16);
    r16_k_unpack(blk, sc, m);
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < K_NSUB; j++) {
        int32_t dot = 0;
        for (int g = 0; g < 8; g++)
            for (int i = 0; i < 4; i++) {
                uint8_t v = blk[R16_K_QS + 64 * (8 * (j / 2) + g) + 4 * rr + i];
                dot += (j % 2 ? v >> 4 : v & 0xF) * xq[K_SUB * j + 4 * g + i];
            }
        isum += sc[r16_k_scale_slot(j, rr)] * dot;
        msum += m[r16_k_min_slot(j, rr)] * (xs[2 * j] + xs[2 * j + 1]);
    }
    uint16_t hd, hm;
    memcpy(&hd, blk + R16_K_D + 2 * rr, 2);
    memcpy(&hm, blk + R16_K_DMIN + 2 * rr, 2);
    acc = fmaf((float)isum, blade_fp16_to_fp32(hd) * a.d[b], acc);
    return fmaf(-(float)msum, blade_fp16_to_fp32(hm) * a.d[b], acc);
}

/* Q6_K R16, one super-block of row rr: per sub-block the dot product of the 6-bit quants
 * from -32 times the activation sum (the side), weighted by the row's scale, all exact;
 * then one FMA. */
static float q6_k_r16_block(const uint8_t *blk, int rr, act_k_view a, int64_t b, float acc)
{
    const int8_t *xq = a.q + b * QK_K;
    int32_t isum = 0;
    for (int j = 0; j < QK_K / 16; j++) {
        int32_t dot = -32 * a.sum16[b * (QK_K / 16) + j];
        for (int g = 0; g < 4; g++)
            for (int i = 0; i < 4; i++)
                dot += r16_k6_quant(blk, j, g, rr, i) * xq[16 * j + 4 * g + i];
        isum += (int8_t)blk[R16_K6_SCALES + 16 * j + rr] * dot;
    }
    uint16_t hd;
    memcpy(&hd, blk + R16_K6_D + 2 * rr, 2);
    return fmaf((float)isum, blade_fp16_to_fp32(hd) * a.d[b], acc);
}

/* The K-quant R16 types, row by row and super-block by super-block. */
static void mm_k_r16(uint32_t ktype, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n,
                     float *Y, int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    float (*block)(const uint8_t *, int, act_k_view, int64_t, float) =
        ktype == BLADE_KTYPE_Q4_K_R16 ? q4_k_r16_block : q6_k_r16_block;
    size_t block_bytes = r16_block_bytes(ktype);
    for (int64_t t = 0; t < n_tok; t++) {
        act_k_view a = act_k_at((const uint8_t *)X + t * x_stride, n);
        for (int64_t r = r0; r < r1; r++) {
            int rr = (int)(r % BLADE_R16_ROWS);
            const uint8_t *group = (const uint8_t *)W + (r - rr) * w_stride;
            float acc = 0.0f;
            for (int64_t b = 0; b < n / QK_K; b++)
                acc = block(group + b * (int64_t)block_bytes, rr, a, b, acc);
            Y[t * ldy + r] = acc;
        }
    }
}

BLADE_DRIVEN_KERNEL(, blade_mm_scalar_q4_k_r16, mm_k_r16, BLADE_KTYPE_Q4_K_R16)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_q6_k_r16, mm_k_r16, BLADE_KTYPE_Q6_K_R16)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_q4_0_r16, mm_r16, BLADE_KTYPE_Q4_0_R16)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_q8_0_r16, mm_r16, BLADE_KTYPE_Q8_0_R16)

static void run(dot_fn dot, const void *W, size_t w_stride, const void *X, size_t x_stride, int64_t n, float *Y,
                int64_t ldy, int64_t n_tok, int64_t r0, int64_t r1)
{
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t r = r0; r < r1; r++)
            Y[t * ldy + r] = dot((const uint8_t *)W + r * w_stride, (const uint8_t *)X + t * x_stride, n);
}

BLADE_DRIVEN_KERNEL(, blade_mm_scalar_f32, run, dot_f32)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_f16, run, dot_f16)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_bf16, run, dot_bf16)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_q8_0, run, dot_q8_0)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_q4_0, run, dot_q4_0)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_q4_k, run, dot_q4_k)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_q5_k, run, dot_q5_k)
BLADE_DRIVEN_KERNEL(, blade_mm_scalar_q6_k, run, dot_q6_k)

/* ---- activation rows (kernels_internal.h) ---- */

void blade_act_scalar_f32(const float *x, void *out, int64_t n)
{
    memcpy(out, x, (size_t)n * sizeof(float));
}

/* Symmetric int8 quantization of len values against their largest magnitude; returns the
 * scale d with x ~= d*q. Rounding is to nearest (lrintf in the default mode), so each
 * element's error is at most d/2 = amax/254. Blocks too small to invert safely are
 * treated as zero: they cannot move a dot product measurably. */
static float quantize_run(const float *x, int len, int8_t *q)
{
    float amax = 0.0f;
    for (int i = 0; i < len; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    if (!(amax >= 1e-30f)) {
        memset(q, 0, (size_t)len);
        return 0.0f;
    }
    float id = 127.0f / amax;
    for (int i = 0; i < len; i++) {
        long v = lrintf(x[i] * id);
        q[i] = (int8_t)(v < -127 ? -127 : v > 127 ? 127 : v);
    }
    return amax / 127.0f;
}

static int32_t sum_q(const int8_t *q, int len)
{
    int32_t s = 0;
    for (int i = 0; i < len; i++)
        s += q[i];
    return s;
}

void blade_act_scalar_q8_0(const float *x, void *out, int64_t n)
{
    act_q8_view v = act_q8_at(out, n);
    int8_t *q = (int8_t *)v.q;
    float *d = (float *)v.d;
    int32_t *sum = (int32_t *)v.sum;
    for (int64_t b = 0; b < n / QK8_0; b++) {
        d[b] = quantize_run(x + b * QK8_0, QK8_0, q + b * QK8_0);
        sum[b] = sum_q(q + b * QK8_0, QK8_0);
    }
}

void blade_act_scalar_q8_k(const float *x, void *out, int64_t n)
{
    act_k_view v = act_k_at(out, n);
    int8_t *q = (int8_t *)v.q;
    float *d = (float *)v.d;
    int16_t *sum16 = (int16_t *)v.sum16;
    for (int64_t b = 0; b < n / QK_K; b++)
        d[b] = quantize_run(x + b * QK_K, QK_K, q + b * QK_K);
    for (int64_t g = 0; g < n / 16; g++)
        sum16[g] = (int16_t)sum_q(q + g * 16, 16);
}

/* The reference conversions of every weight type (quant_ref.h): blocks to floats in
 * ggml's arithmetic order, and the plain float formats both ways. The kernels and the
 * quantizers are tested against them. */

#include "tensor/quant_ref.h"

#include "blade/types.h"

#include <string.h>

/* Scalar reference conversions. Dequantizers follow ggml's arithmetic order (scale
 * products first, then times the quant) so results match other readers to the last bit
 * where the compiler does not contract into FMAs. The block quantizers live in
 * src/quantize. */

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

/* ---- Q4_K / Q5_K shared parts ---- */

void blade_k_scales_pack(const uint8_t sc[K_NSUB], const uint8_t m[K_NSUB], uint8_t out[K_SCALE_BYTES])
{
    for (int j = 0; j < 4; j++) {
        out[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        out[j + 4] = (uint8_t)(m[j] | ((m[j + 4] >> 4) << 6));
        out[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
    }
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


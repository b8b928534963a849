#include "kernels/kernels_internal.h"

#include <stdlib.h>
#include <string.h>

/* Load-time repacking of Q4_0/Q8_0/Q4_K/Q6_K matrices into the R16 layouts (kernels.h,
 * kernels_internal.h), and the way back for code that reads single rows. */

uint32_t blade_matmul_repacked_type(uint32_t type, int64_t n_in, int64_t n_out)
{
    if (n_in <= 0 || n_in % QK8_0 != 0 || n_out <= 0 || n_out % BLADE_R16_ROWS != 0)
        return 0;
    switch (type) {
    case BLADE_TYPE_Q4_0:
        return BLADE_KTYPE_Q4_0_R16;
    case BLADE_TYPE_Q8_0:
        return BLADE_KTYPE_Q8_0_R16;
    case BLADE_TYPE_Q4_K:
        return n_in % QK_K == 0 ? BLADE_KTYPE_Q4_K_R16 : 0;
    case BLADE_TYPE_Q6_K:
        return n_in % QK_K == 0 ? BLADE_KTYPE_Q6_K_R16 : 0;
    default:
        return 0;
    }
}

uint32_t blade_matmul_base_type(uint32_t type)
{
    switch (type) {
    case BLADE_KTYPE_Q4_0_R16:
        return BLADE_TYPE_Q4_0;
    case BLADE_KTYPE_Q8_0_R16:
        return BLADE_TYPE_Q8_0;
    case BLADE_KTYPE_Q4_K_R16:
        return BLADE_TYPE_Q4_K;
    case BLADE_KTYPE_Q6_K_R16:
        return BLADE_TYPE_Q6_K;
    default:
        return type;
    }
}

int64_t blade_matmul_row_align(uint32_t type)
{
    return blade_matmul_base_type(type) == type ? 1 : BLADE_R16_ROWS;
}

size_t blade_matmul_row_bytes(uint32_t type, int64_t n)
{
    return blade_type_row_bytes((blade_type)blade_matmul_base_type(type), n);
}

/* One group of 16 rows, file layout (rows one after another) to R16. */
static void group_to_r16(uint32_t ktype, const uint8_t *rows, size_t row_bytes, int64_t nb, uint8_t *out)
{
    bool q4 = ktype == BLADE_KTYPE_Q4_0_R16;
    size_t blk_bytes = q4 ? sizeof(block_q4_0) : sizeof(block_q8_0), out_bytes = r16_block_bytes(ktype);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = out + b * out_bytes;
        for (int r = 0; r < BLADE_R16_ROWS; r++) {
            const uint8_t *blk = rows + r * row_bytes + b * blk_bytes;
            memcpy(o + 2 * r, blk, 2);
            const uint8_t *qs = blk + 2;
            int chunks = q4 ? R16_Q4_CHUNKS : R16_Q8_CHUNKS;
            for (int c = 0; c < chunks; c++)
                for (int i = 0; i < 4; i++)
                    o[R16_SCALES + 64 * c + 4 * r + i] = q4 ? qs[4 * c + i] : (uint8_t)(qs[4 * c + i] ^ 0x80);
        }
    }
}

static void group_to_r16_k(const uint8_t *rows, size_t row_bytes, int64_t nsb, uint8_t *out)
{
    for (int64_t b = 0; b < nsb; b++) {
        uint8_t *o = out + b * R16_K_BYTES;
        memset(o + R16_K_LOW, 0, R16_K_QS - R16_K_LOW);
        for (int r = 0; r < BLADE_R16_ROWS; r++) {
            block_q4_k blk;
            memcpy(&blk, rows + r * row_bytes + b * (int64_t)sizeof blk, sizeof blk);
            memcpy(o + R16_K_D + 2 * r, &blk.d, 2);
            memcpy(o + R16_K_DMIN + 2 * r, &blk.dmin, 2);
            for (int j = 0; j < K_NSUB; j++) {
                uint8_t sc, m;
                blade_k_scale_min(j, blk.scales, &sc, &m);
                int ks = r16_k_scale_slot(j, r), km = r16_k_min_slot(j, r);
                o[R16_K_LOW + ks] |= (uint8_t)(sc & 0xF);
                o[R16_K_LOW + km] |= (uint8_t)((m & 0xF) << 4);
                o[R16_K_HIGH + ks % 64] |= (uint8_t)((sc >> 4) << (ks < 64 ? 0 : 2));
                o[R16_K_HIGH + km % 64] |= (uint8_t)((m >> 4) << (km < 64 ? 4 : 6));
            }
            for (int c = 0; c < 32; c++)
                memcpy(o + R16_K_QS + 64 * c + 4 * r, blk.qs + 4 * c, 4);
        }
    }
}

/* Where the file's Q6_K block keeps element e (sub-block e / 16): its low four bits in
 * ql[*lo] at bit *lo_shift, its top two in qh[*hi] at bit *hi_shift. */
static void q6_k_place(int e, int *lo, int *lo_shift, int *hi, int *hi_shift)
{
    int half = e / 128, run = e % 128 / 32, l = e % 32;
    *lo = 64 * half + 32 * (run & 1) + l;
    *lo_shift = 4 * (run >> 1);
    *hi = 32 * half + l;
    *hi_shift = 2 * run;
}

static void group_to_r16_k6(const uint8_t *rows, size_t row_bytes, int64_t nsb, uint8_t *out)
{
    for (int64_t b = 0; b < nsb; b++) {
        uint8_t *o = out + b * R16_K6_BYTES;
        memset(o + R16_K6_QS, 0, R16_K6_BYTES - R16_K6_QS);
        for (int r = 0; r < BLADE_R16_ROWS; r++) {
            block_q6_k blk;
            memcpy(&blk, rows + r * row_bytes + b * (int64_t)sizeof blk, sizeof blk);
            memcpy(o + R16_K6_D + 2 * r, &blk.d, 2);
            for (int j = 0; j < QK_K / 16; j++) {
                o[R16_K6_SCALES + 16 * j + r] = (uint8_t)blk.scales[j];
                for (int g = 0; g < 4; g++)
                    for (int i = 0; i < 4; i++) {
                        int lo, ls, hi, hs, sl, sh;
                        q6_k_place(16 * j + 4 * g + i, &lo, &ls, &hi, &hs);
                        size_t at_lo = r16_k6_byte(false, j, g, r, i, &sl), at_hi = r16_k6_byte(true, j, g, r, i, &sh);
                        o[at_lo] |= (uint8_t)((blk.ql[lo] >> ls & 0xF) << sl);
                        o[at_hi] |= (uint8_t)((blk.qh[hi] >> hs & 3) << sh);
                    }
            }
        }
    }
}

void blade_matmul_repack(uint32_t type, void *data, int64_t n_in, int64_t n_out)
{
    uint32_t ktype = blade_matmul_repacked_type(type, n_in, n_out);
    if (!ktype)
        return;
    size_t row_bytes = blade_type_row_bytes((blade_type)type, n_in), group_bytes = BLADE_R16_ROWS * row_bytes;
    uint8_t *tmp = malloc(group_bytes);
    if (!tmp)
        abort();
    for (int64_t g = 0; g < n_out / BLADE_R16_ROWS; g++) {
        uint8_t *p = (uint8_t *)data + g * group_bytes;
        memcpy(tmp, p, group_bytes);
        if (ktype == BLADE_KTYPE_Q4_K_R16)
            group_to_r16_k(tmp, row_bytes, n_in / QK_K, p);
        else if (ktype == BLADE_KTYPE_Q6_K_R16)
            group_to_r16_k6(tmp, row_bytes, n_in / QK_K, p);
        else
            group_to_r16(ktype, tmp, row_bytes, n_in / QK8_0, p);
    }
    free(tmp);
}

void blade_matmul_row_to_float(uint32_t type, const void *W, int64_t n, int64_t r, float *out)
{
    uint32_t base = blade_matmul_base_type(type);
    const blade_type_traits *tr = blade_type_traits_get(base);
    size_t row_bytes = blade_type_row_bytes((blade_type)base, n);
    if (base == type) {
        tr->to_float((const uint8_t *)W + r * row_bytes, out, n);
        return;
    }
    int64_t rr = r % BLADE_R16_ROWS;
    const uint8_t *group = (const uint8_t *)W + (r - rr) * row_bytes;
    size_t in_bytes = r16_block_bytes(type);
    if (type == BLADE_KTYPE_Q4_K_R16) {
        for (int64_t b = 0; b < n / QK_K; b++) {
            const uint8_t *in = group + b * (int64_t)in_bytes;
            block_q4_k blk;
            memcpy(&blk.d, in + R16_K_D + 2 * rr, 2);
            memcpy(&blk.dmin, in + R16_K_DMIN + 2 * rr, 2);
            uint8_t sc_slots[128], m_slots[128], sc[K_NSUB], m[K_NSUB];
            r16_k_unpack(in, sc_slots, m_slots);
            for (int j = 0; j < K_NSUB; j++) {
                sc[j] = sc_slots[r16_k_scale_slot(j, (int)rr)];
                m[j] = m_slots[r16_k_min_slot(j, (int)rr)];
            }
            blade_k_scales_pack(sc, m, blk.scales);
            for (int c = 0; c < 32; c++)
                memcpy(blk.qs + 4 * c, in + R16_K_QS + 64 * c + 4 * rr, 4);
            tr->to_float(&blk, out + b * QK_K, QK_K);
        }
        return;
    }
    if (type == BLADE_KTYPE_Q6_K_R16) {
        for (int64_t b = 0; b < n / QK_K; b++) {
            const uint8_t *in = group + b * (int64_t)in_bytes;
            block_q6_k blk;
            memset(&blk, 0, sizeof blk);
            memcpy(&blk.d, in + R16_K6_D + 2 * rr, 2);
            for (int j = 0; j < QK_K / 16; j++) {
                blk.scales[j] = (int8_t)in[R16_K6_SCALES + 16 * j + rr];
                for (int g = 0; g < 4; g++)
                    for (int i = 0; i < 4; i++) {
                        int lo, ls, hi, hs, q = r16_k6_quant(in, j, g, (int)rr, i);
                        q6_k_place(16 * j + 4 * g + i, &lo, &ls, &hi, &hs);
                        blk.ql[lo] |= (uint8_t)((q & 0xF) << ls);
                        blk.qh[hi] |= (uint8_t)((q >> 4) << hs);
                    }
            }
            tr->to_float(&blk, out + b * QK_K, QK_K);
        }
        return;
    }
    bool q4 = type == BLADE_KTYPE_Q4_0_R16;
    int chunks = q4 ? R16_Q4_CHUNKS : R16_Q8_CHUNKS;
    for (int64_t b = 0; b < n / QK8_0; b++) {
        const uint8_t *in = group + b * in_bytes;
        uint8_t blk[sizeof(block_q8_0)];
        memcpy(blk, in + 2 * rr, 2);
        for (int c = 0; c < chunks; c++)
            for (int i = 0; i < 4; i++) {
                uint8_t v = in[R16_SCALES + 64 * c + 4 * rr + i];
                blk[2 + 4 * c + i] = q4 ? v : (uint8_t)(v ^ 0x80);
            }
        tr->to_float(blk, out + b * QK8_0, QK8_0);
    }
}

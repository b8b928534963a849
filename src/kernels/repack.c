#include "kernels/kernels_internal.h"

#include <stdlib.h>
#include <string.h>

/* Load-time repacking into the R16 layouts (kernels.h, kernels_internal.h) and the way
 * back for code that reads single rows: the loops over groups and blocks, and per R16
 * form the pack/unpack pair of one block that the kernel-traits table names. */

/* ---- Q4_0 and Q8_0 ---- */

static void pack_q32(bool q4, const uint8_t *rows, size_t row_bytes, uint8_t *out)
{
    int chunks = q4 ? R16_Q4_CHUNKS : R16_Q8_CHUNKS;
    for (int r = 0; r < BLADE_R16_ROWS; r++) {
        const uint8_t *blk = rows + r * row_bytes;
        memcpy(out + 2 * r, blk, 2);
        const uint8_t *qs = blk + 2;
        for (int c = 0; c < chunks; c++)
            for (int i = 0; i < 4; i++)
                out[R16_SCALES + 64 * c + 4 * r + i] = q4 ? qs[4 * c + i] : (uint8_t)(qs[4 * c + i] ^ 0x80);
    }
}

static void unpack_q32(bool q4, const uint8_t *in, int r, uint8_t *block)
{
    int chunks = q4 ? R16_Q4_CHUNKS : R16_Q8_CHUNKS;
    memcpy(block, in + 2 * r, 2);
    for (int c = 0; c < chunks; c++)
        for (int i = 0; i < 4; i++) {
            uint8_t v = in[R16_SCALES + 64 * c + 4 * r + i];
            block[2 + 4 * c + i] = q4 ? v : (uint8_t)(v ^ 0x80);
        }
}

void blade_pack_q4_0_r16(const uint8_t *rows, size_t row_bytes, uint8_t *out)
{
    pack_q32(true, rows, row_bytes, out);
}

void blade_unpack_q4_0_r16(const uint8_t *in, int r, uint8_t *block)
{
    unpack_q32(true, in, r, block);
}

void blade_pack_q8_0_r16(const uint8_t *rows, size_t row_bytes, uint8_t *out)
{
    pack_q32(false, rows, row_bytes, out);
}

void blade_unpack_q8_0_r16(const uint8_t *in, int r, uint8_t *block)
{
    unpack_q32(false, in, r, block);
}

/* ---- Q4_K ---- */

void blade_pack_q4_k_r16(const uint8_t *rows, size_t row_bytes, uint8_t *out)
{
    memset(out + R16_K_LOW, 0, R16_K_QS - R16_K_LOW);
    for (int r = 0; r < BLADE_R16_ROWS; r++) {
        block_q4_k blk;
        memcpy(&blk, rows + r * row_bytes, sizeof blk);
        memcpy(out + R16_K_D + 2 * r, &blk.d, 2);
        memcpy(out + R16_K_DMIN + 2 * r, &blk.dmin, 2);
        for (int j = 0; j < K_NSUB; j++) {
            uint8_t sc, m;
            blade_k_scale_min(j, blk.scales, &sc, &m);
            int ks = r16_k_scale_slot(j, r), km = r16_k_min_slot(j, r);
            out[R16_K_LOW + ks] |= (uint8_t)(sc & 0xF);
            out[R16_K_LOW + km] |= (uint8_t)((m & 0xF) << 4);
            out[R16_K_HIGH + ks % 64] |= (uint8_t)((sc >> 4) << (ks < 64 ? 0 : 2));
            out[R16_K_HIGH + km % 64] |= (uint8_t)((m >> 4) << (km < 64 ? 4 : 6));
        }
        for (int c = 0; c < 32; c++)
            memcpy(out + R16_K_QS + 64 * c + 4 * r, blk.qs + 4 * c, 4);
    }
}

void blade_unpack_q4_k_r16(const uint8_t *in, int r, uint8_t *block)
{
    block_q4_k blk;
    memcpy(&blk.d, in + R16_K_D + 2 * r, 2);
    memcpy(&blk.dmin, in + R16_K_DMIN + 2 * r, 2);
    uint8_t sc_slots[128], m_slots[128], sc[K_NSUB], m[K_NSUB];
    r16_k_unpack(in, sc_slots, m_slots);
    for (int j = 0; j < K_NSUB; j++) {
        sc[j] = sc_slots[r16_k_scale_slot(j, r)];
        m[j] = m_slots[r16_k_min_slot(j, r)];
    }
    blade_k_scales_pack(sc, m, blk.scales);
    for (int c = 0; c < 32; c++)
        memcpy(blk.qs + 4 * c, in + R16_K_QS + 64 * c + 4 * r, 4);
    memcpy(block, &blk, sizeof blk);
}

/* ---- Q6_K ---- */

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

void blade_pack_q6_k_r16(const uint8_t *rows, size_t row_bytes, uint8_t *out)
{
    memset(out + R16_K6_QS, 0, R16_K6_BYTES - R16_K6_QS);
    for (int r = 0; r < BLADE_R16_ROWS; r++) {
        block_q6_k blk;
        memcpy(&blk, rows + r * row_bytes, sizeof blk);
        memcpy(out + R16_K6_D + 2 * r, &blk.d, 2);
        for (int j = 0; j < QK_K / 16; j++) {
            out[R16_K6_SCALES + 16 * j + r] = (uint8_t)blk.scales[j];
            for (int g = 0; g < 4; g++)
                for (int i = 0; i < 4; i++) {
                    int lo, ls, hi, hs, sl, sh;
                    q6_k_place(16 * j + 4 * g + i, &lo, &ls, &hi, &hs);
                    size_t at_lo = r16_k6_byte(false, j, g, r, i, &sl), at_hi = r16_k6_byte(true, j, g, r, i, &sh);
                    out[at_lo] |= (uint8_t)((blk.ql[lo] >> ls & 0xF) << sl);
                    out[at_hi] |= (uint8_t)((blk.qh[hi] >> hs & 3) << sh);
                }
        }
    }
}

void blade_unpack_q6_k_r16(const uint8_t *in, int r, uint8_t *block)
{
    block_q6_k blk;
    memset(&blk, 0, sizeof blk);
    memcpy(&blk.d, in + R16_K6_D + 2 * r, 2);
    for (int j = 0; j < QK_K / 16; j++) {
        blk.scales[j] = (int8_t)in[R16_K6_SCALES + 16 * j + r];
        for (int g = 0; g < 4; g++)
            for (int i = 0; i < 4; i++) {
                int lo, ls, hi, hs, q = r16_k6_quant(in, j, g, r, i);
                q6_k_place(16 * j + 4 * g + i, &lo, &ls, &hi, &hs);
                blk.ql[lo] |= (uint8_t)((q & 0xF) << ls);
                blk.qh[hi] |= (uint8_t)((q >> 4) << hs);
            }
    }
    memcpy(block, &blk, sizeof blk);
}

/* ---- the loops ----
 * A group of 16 rows is, block after block, one R16 block per 16 file blocks of the same
 * size, so a group repacks within its own bytes. */

void blade_matmul_repack(uint32_t type, void *data, int64_t n_in, int64_t n_out)
{
    const blade_ktraits *kt = blade_ktraits_get(blade_matmul_repacked_type(type, n_in, n_out));
    if (!kt)
        return;
    const blade_type_traits *tr = blade_type_traits_get(type);
    size_t row_bytes = blade_type_row_bytes((blade_type)type, n_in), group_bytes = BLADE_R16_ROWS * row_bytes;
    size_t out_block = BLADE_R16_ROWS * tr->block_bytes;
    uint8_t *tmp = malloc(group_bytes);
    if (!tmp)
        abort();
    for (int64_t g = 0; g < n_out / BLADE_R16_ROWS; g++) {
        uint8_t *p = (uint8_t *)data + g * group_bytes;
        memcpy(tmp, p, group_bytes);
        for (int64_t b = 0; b < n_in / tr->block_size; b++)
            kt->pack(tmp + b * tr->block_bytes, row_bytes, p + b * out_block);
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
    const blade_ktraits *kt = blade_ktraits_get(type);
    int64_t rr = r % BLADE_R16_ROWS;
    const uint8_t *group = (const uint8_t *)W + (r - rr) * row_bytes;
    size_t in_block = BLADE_R16_ROWS * tr->block_bytes;
    uint8_t block[KT_MAX_BLOCK_BYTES];
    for (int64_t b = 0; b < n / tr->block_size; b++) {
        kt->unpack(group + b * in_block, (int)rr, block);
        tr->to_float(block, out + b * tr->block_size, tr->block_size);
    }
}

/* blade_attention (attention.h): the driver that owns the loop order, the scalar path the
 * SIMD paths are tested against, and the scalar tile conversions of every KV type. */

#include "blade/attention.h"

#include "blade/kernels.h"
#include "blade/types.h"

#include "kernels/attention_internal.h"
#include "kernels/kv_type_internal.h"

#include <assert.h>
#include <math.h>
#include <string.h>

/* ---- scalar path ----
 * Also the reference the SIMD paths are tested against. Its inner loops run lane-wise
 * over keys or over head_dim, so a vectorizing compiler speeds them up without changing
 * any result. */

static float f16_at(const uint8_t *src, size_t i)
{
    return blade_fp16_to_fp32(((const uint16_t *)src)[i]);
}

static float bf16_at(const uint8_t *src, size_t i)
{
    return blade_bf16_to_fp32(((const uint16_t *)src)[i]);
}

static float f32_at(const uint8_t *src, size_t i)
{
    return ((const float *)src)[i];
}

static float q8_0_at(const uint8_t *src, size_t i)
{
    return (float)(int8_t)src[i];
}

static float fp8_at(const uint8_t *src, size_t i)
{
    return blade_e4m3_to_fp32(src[i]);
}

/* Slot j's element d of a block, times the slot's scale when the type has scales. */
static inline float element(float (*at)(const uint8_t *, size_t), const uint8_t *src, const uint16_t *scales,
                            int32_t j, int32_t d, int32_t head_dim)
{
    float x = at(src, (size_t)j * (size_t)head_dim + (size_t)d);
    return scales ? x * blade_bf16_to_fp32(scales[j]) : x;
}

static inline void load_kt_scalar(float (*at)(const uint8_t *, size_t), const uint8_t *src, const uint16_t *scales,
                                  float *kt, int32_t block_size, int32_t head_dim, int32_t bp)
{
    for (int32_t j = 0; j < block_size; j++)
        for (int32_t d = 0; d < head_dim; d++)
            kt[(size_t)d * (size_t)bp + (size_t)j] = element(at, src, scales, j, d, head_dim);
}

static inline void load_v_scalar(float (*at)(const uint8_t *, size_t), const uint8_t *src, const uint16_t *scales,
                                 float *dst, int32_t n_slots, int32_t head_dim)
{
    for (int32_t j = 0; j < n_slots; j++)
        for (int32_t d = 0; d < head_dim; d++)
            dst[(size_t)j * (size_t)head_dim + (size_t)d] = element(at, src, scales, j, d, head_dim);
}

#define SCALAR_LOAD_KT(type)                                                                                     \
    static void load_kt_##type(const uint8_t *src, const uint16_t *scales, float *kt, int32_t block_size,       \
                               int32_t head_dim, int32_t bp)                                                      \
    {                                                                                                            \
        load_kt_scalar(type##_at, src, scales, kt, block_size, head_dim, bp);                                    \
    }
#define SCALAR_TILE(type)                                                                                        \
    SCALAR_LOAD_KT(type)                                                                                         \
    static void load_v_##type(const uint8_t *src, const uint16_t *scales, float *dst, int32_t n_slots,          \
                              int32_t head_dim)                                                                  \
    {                                                                                                            \
        load_v_scalar(type##_at, src, scales, dst, n_slots, head_dim);                                           \
    }                                                                                                            \
    const attn_tile_conv blade_attn_tile_##type##_scalar = {load_kt_##type, load_v_##type};

SCALAR_TILE(f16)
SCALAR_TILE(bf16)
SCALAR_TILE(q8_0)
SCALAR_TILE(fp8)
SCALAR_LOAD_KT(f32)
const attn_tile_conv blade_attn_tile_f32_scalar = {load_kt_f32, NULL};

static void row_scalar(const attn_tile *t, const float *q, float *o, int32_t nv, float *m, float *l)
{
    _Static_assert(ATTN_ROWS >= 4, "the scalar path keeps four score chains in the rows' p space");
    const int32_t hd = t->head_dim;
    const size_t bp = (size_t)t->bp;
    float *p = t->p, *acc = t->acc;

    /* The same four chains over d mod 4 as the SIMD paths, so that all paths round the
     * scores alike; p holds the chains side by side. */
    for (size_t j = 0; j < 4 * bp; j++)
        p[j] = 0.0f;
    for (int32_t d = 0; d < hd; d++) {
        const float qd = q[d], *k = t->kt + (size_t)d * bp;
        float *c = p + (size_t)(d & 3) * bp;
        for (int32_t j = 0; j < nv; j++)
            c[j] += qd * k[j];
    }
    for (int32_t j = 0; j < nv; j++)
        p[j] = ((p[j] + p[bp + j]) + (p[2 * bp + j] + p[3 * bp + j])) * t->scale;
    float m_tile = -INFINITY;
    for (int32_t j = 0; j < nv; j++)
        m_tile = p[j] > m_tile ? p[j] : m_tile;
    const float m_new = t->first || m_tile > *m ? m_tile : *m;
    float sum = 0.0f;
    for (int32_t j = 0; j < nv; j++) {
        p[j] = exp_neg_scalar(p[j] - m_new);
        sum += p[j];
    }

    for (int32_t d = 0; d < hd; d++)
        acc[d] = 0.0f;
    for (int32_t j = 0; j < nv; j++) {
        const float pj = p[j], *v = t->v + (size_t)j * (size_t)hd;
        for (int32_t d = 0; d < hd; d++)
            acc[d] += pj * v[d];
    }
    if (t->first) {
        memcpy(o, acc, (size_t)hd * sizeof *o);
        *l = sum;
    } else {
        const float alpha = exp_neg_scalar(*m - m_new);
        for (int32_t d = 0; d < hd; d++)
            o[d] = o[d] * alpha + acc[d];
        *l = *l * alpha + sum;
    }
    *m = m_new;
}

static void rows_scalar(const attn_tile *t, const attn_row *r, int n)
{
    for (int i = 0; i < n; i++)
        row_scalar(t, r[i].q, r[i].o, r[i].n_valid, r[i].m, r[i].l);
}

static const attn_isa attn_scalar = {1, rows_scalar};

/* ---- driver ---- */

static size_t round16(size_t n)
{
    return (n + 15) / 16 * 16;
}

/* Keys per tile: whole blocks, about 3072 / head_dim of them, so that a tile's keys and
 * values (f32) take about 24 KiB and stay within a 32 KiB L1 with the scores beside them
 * (Zen 1 and Zen 4 have 32 KiB, Zen 5 48). A tile is the unit of the online softmax: each
 * row's running max, rescale, sums and output update happen once per tile, and so do the
 * tile's conversion calls, prefetches and row batches, which 16-key tiles paid often
 * (head_dim 8: 275 cycles a tile, for 512 multiply-adds). One thread, one KV head of 8
 * query heads, f16 (MEASURED.md, stop 43): 48-key tiles of head_dim 64 made a call 9-16%
 * faster for 1 to 5 queries at position 1000 and 9-15% at position 64 (64-key tiles: 2-3%
 * faster at 1000, 2.5% slower at 64); head_dim 8 (2 query heads), 15-25% at positions 32
 * and 400 with 128-key tiles, where 64 to 256 keys measured alike. The count depends on
 * the store's shape alone, so every query meets the same tiles whatever call it comes in,
 * which is what batch invariance rests on. */
#define TILE_BYTES_F32 12288
#define TILE_BLOCKS_MAX 8

static int32_t tile_blocks(const blade_kv_store *kv)
{
    int32_t keys = TILE_BYTES_F32 / (int32_t)sizeof(float) / kv->head_dim, blocks = keys / kv->block_size;
    return blocks < 1 ? 1 : blocks > TILE_BLOCKS_MAX ? TILE_BLOCKS_MAX : blocks;
}

/* Scratch regions, in floats; each rounded to 16 floats so every region stays 64-byte
 * aligned once the base is. */
typedef struct scratch_layout {
    size_t kt, v, p, acc, ml;
} scratch_layout;

static scratch_layout layout(const blade_kv_store *kv, int32_t n_q, int32_t n_head)
{
    size_t keys = (size_t)kv->block_size * (size_t)tile_blocks(kv);
    size_t hd = (size_t)kv->head_dim, bp = round16(keys);
    size_t group = (size_t)(n_head / kv->n_head_kv);
    return (scratch_layout){
        .kt = round16(hd * bp),
        .v = round16(keys * hd),
        .p = ATTN_ROWS * bp,
        .acc = round16(hd),
        .ml = round16((size_t)n_q * group),
    };
}

size_t blade_attention_scratch_bytes(const blade_kv_store *kv, int32_t n_q, int32_t n_head)
{
    scratch_layout s = layout(kv, n_q, n_head);
    return (s.kt + s.v + s.p + s.acc + 2 * s.ml) * sizeof(float) + 64;
}

static void prefetch_block(const blade_kv_store *kv, int32_t layer, int32_t block, int32_t head)
{
    const uint8_t *k = blade_kv_store_k(kv, layer, block, head), *v = blade_kv_store_v(kv, layer, block, head);
    for (size_t off = 0; off < kv->head_stride; off += 64) {
        __builtin_prefetch(k + off);
        __builtin_prefetch(v + off);
    }
    if (kv->head_scales) {
        __builtin_prefetch(blade_kv_store_k_scale(kv, layer, block, head));
        __builtin_prefetch(blade_kv_store_v_scale(kv, layer, block, head));
    }
}

static const attn_isa *const isas[BLADE_ISA_COUNT] = {
    [BLADE_ISA_SCALAR] = &attn_scalar,
#if defined(__x86_64__)
    [BLADE_ISA_AVX2] = &blade_attn_avx2,
    [BLADE_ISA_AVX512] = &blade_attn_avx512,
#endif
};

/* The active ISA, or the best one below it whose vectors head_dim fills. */
static blade_isa pick_isa(int32_t head_dim)
{
    blade_isa isa = blade_isa_active();
    while (isa > BLADE_ISA_SCALAR && (!isas[isa] || head_dim % isas[isa]->lanes != 0))
        isa--;
    return isa;
}

void blade_attention(const blade_attention_args *a)
{
    const blade_kv_store *kv = a->kv;
    assert(a->n_head > 0 && a->n_head % kv->n_head_kv == 0);
    assert(a->kv_head_begin >= 0 && a->kv_head_end <= kv->n_head_kv && a->pos0 >= 0);
    if (a->n_q <= 0 || a->kv_head_begin >= a->kv_head_end)
        return;

    const int32_t hd = kv->head_dim, bs = kv->block_size, group = a->n_head / kv->n_head_kv;
    const blade_isa isa_id = pick_isa(hd);
    const attn_isa *isa = isas[isa_id];
    const kv_type_traits *tt = kv_type_traits_of(kv->type);
    const attn_tile_conv *conv = tt->tile[isa_id];
    const attn_tile_conv *kt_conv = bs % isa->lanes == 0 ? conv : tt->tile[BLADE_ISA_SCALAR];

    scratch_layout sl = layout(kv, a->n_q, a->n_head);
    const int32_t tile_n = tile_blocks(kv), keys = tile_n * bs;
    float *base = (float *)(((uintptr_t)a->scratch + 63) & ~(uintptr_t)63);
    float *kt = base, *vbuf = kt + sl.kt;
    float *m = vbuf + sl.v + sl.p + sl.acc, *l = m + sl.ml;
    attn_tile tile = {
        .kt = kt,
        .v = vbuf,
        .p = vbuf + sl.v,
        .acc = vbuf + sl.v + sl.p,
        .head_dim = hd,
        .bp = (int32_t)round16((size_t)keys),
        .scale = a->scale,
    };
    /* Score vectors read 16 key lanes at a time; with blocks of a size that is no multiple
     * of 16, lanes no block fills are read (and masked off), so they must not be
     * uninitialized memory. */
    if (bs % 16 != 0)
        memset(kt, 0, sl.kt * sizeof *kt);

    const int32_t last = a->pos0 + a->n_q - 1;
    const int32_t n_tiles = last / keys + 1;
    for (int32_t kvh = a->kv_head_begin; kvh < a->kv_head_end; kvh++) {
        const int32_t h0 = kvh * group;
        for (int32_t ti = 0; ti < n_tiles; ti++) {
            const int32_t t0 = ti * keys;
            for (int32_t j = 0; j < tile_n && t0 + j * bs <= last; j++) {
                const int32_t first = t0 + j * bs, phys = a->block_table[first / bs];
                const int32_t n_slots = last + 1 - first < bs ? last + 1 - first : bs;
                /* All keys of the block, including slots no query of this call may see: it
                 * keeps the converted tile independent of the call, and those lanes are
                 * masked out of every score. */
                kt_conv->load_kt(blade_kv_store_k(kv, a->layer, phys, kvh),
                                 blade_kv_store_k_scale(kv, a->layer, phys, kvh), kt + j * bs, bs, hd, tile.bp);
                const uint8_t *v = blade_kv_store_v(kv, a->layer, phys, kvh);
                float *dst = vbuf + (size_t)j * (size_t)bs * (size_t)hd;
                if (conv->load_v)
                    conv->load_v(v, blade_kv_store_v_scale(kv, a->layer, phys, kvh), dst, n_slots, hd);
                else
                    memcpy(dst, v, (size_t)n_slots * (size_t)hd * sizeof *dst);
            }
            tile.first = ti == 0;
            /* Blocks are scattered, so the hardware prefetcher cannot guess the next ones;
             * asking for them now hides the memory latency behind this tile's work. */
            for (int32_t j = 0; j < tile_n && t0 + keys + j * bs <= last; j++)
                prefetch_block(kv, a->layer, a->block_table[(t0 + keys) / bs + j], kvh);

            /* Queries before this tile have finished; the rest see it up to their own
             * position, so each one's sequence of tiles depends on its position alone. */
            attn_row batch[ATTN_ROWS];
            int n_batch = 0;
            for (int32_t i = t0 > a->pos0 ? t0 - a->pos0 : 0; i < a->n_q; i++) {
                const int32_t seen = a->pos0 + i - t0 + 1;
                const float *q = a->q + (size_t)i * (size_t)a->q_stride + (size_t)h0 * (size_t)hd;
                float *o = a->out + (size_t)i * (size_t)a->out_stride + (size_t)h0 * (size_t)hd;
                for (int32_t g = 0; g < group; g++) {
                    size_t st = (size_t)i * (size_t)group + (size_t)g;
                    batch[n_batch++] = (attn_row){
                        .q = q + (size_t)g * (size_t)hd,
                        .o = o + (size_t)g * (size_t)hd,
                        .m = &m[st],
                        .l = &l[st],
                        .n_valid = seen < keys ? seen : keys,
                    };
                    if (n_batch == ATTN_ROWS) {
                        isa->rows(&tile, batch, n_batch);
                        n_batch = 0;
                    }
                }
            }
            if (n_batch > 0)
                isa->rows(&tile, batch, n_batch);
        }
        for (int32_t i = 0; i < a->n_q; i++) {
            float *o = a->out + (size_t)i * (size_t)a->out_stride + (size_t)h0 * (size_t)hd;
            for (int32_t g = 0; g < group; g++) {
                const float sum = l[(size_t)i * (size_t)group + (size_t)g];
                for (int32_t d = 0; d < hd; d++)
                    o[(size_t)g * (size_t)hd + (size_t)d] /= sum;
            }
        }
    }
}

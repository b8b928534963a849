#include "testutil.h"

#include "blade/attention.h"
#include "blade/kernels.h"
#include "blade/kv_store.h"
#include "blade/types.h"
#include "kernels/kv_type_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- fixtures ---- */

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static float uniform(uint64_t *s)
{
    return (float)((double)(splitmix(s) >> 40) * 0x1p-23 - 1.0);
}

typedef struct shape {
    blade_kv_type type;
    int32_t n_head_kv, group, head_dim, block_size;
} shape;

/* One sequence of n_ctx tokens in layer 1 of a two-layer store (layer 0 stays zero, so a
 * wrong layer offset shows), reached through a scrambled block table. */
typedef struct scene {
    shape sh;
    blade_kv_store *kv;
    int32_t n_head, n_ctx;
    uint64_t seed;
    int32_t *table;
    float *q; /* [n_ctx][n_head][head_dim] */
} scene;

#define LAYER 1

static int32_t kv_dim(const scene *s)
{
    return s->sh.n_head_kv * s->sh.head_dim;
}

/* K/V of one position depend on (seed, pos) only, so scenes with the same seed hold
 * the same sequence whatever their block tables. Key magnitudes vary with position so that
 * the running maximum moves up and down across tiles. */
static void write_pos(const scene *s, int32_t pos)
{
    int32_t n = kv_dim(s);
    float *k = malloc(2 * (size_t)n * sizeof *k), *v = k + n;
    uint64_t st = s->seed ^ ((uint64_t)pos * 0x2545f4914f6cdd1dull);
    float gain = 0.5f + 3.0f * (float)((pos * 37) % 101) / 101.0f;
    for (int32_t i = 0; i < n; i++) {
        k[i] = gain * uniform(&st);
        v[i] = uniform(&st);
    }
    int32_t bs = s->sh.block_size;
    blade_kv_store_write(s->kv, LAYER, s->table[pos / bs], pos % bs, k, v);
    free(k);
}

/* Every slot of every block of the test layer set to NaN, as stale data from an earlier
 * sequence could be. */
static void poison(const scene *s)
{
    int32_t n = kv_dim(s);
    float *nan_row = malloc((size_t)n * sizeof *nan_row);
    for (int32_t i = 0; i < n; i++)
        nan_row[i] = NAN;
    for (int32_t b = 0; b < s->kv->n_blocks; b++)
        for (int32_t slot = 0; slot < s->sh.block_size; slot++)
            blade_kv_store_write(s->kv, LAYER, b, slot, nan_row, nan_row);
    free(nan_row);
}

/* write_all false leaves the K/V of the test layer unwritten, for incremental decoding. */
static void scene_init(scene *s, shape sh, int32_t n_ctx, uint64_t seed, uint64_t table_seed, bool poisoned,
                       bool write_all)
{
    memset(s, 0, sizeof *s);
    s->sh = sh;
    s->n_ctx = n_ctx;
    s->seed = seed;
    s->n_head = sh.n_head_kv * sh.group;

    int32_t needed = (n_ctx + sh.block_size - 1) / sh.block_size;
    int32_t n_blocks = needed + 3;
    blade_error err;
    blade_kv_store_config cfg = {.n_layer = 2, .n_head_kv = sh.n_head_kv, .head_dim = sh.head_dim, .type = sh.type,
                                 .block_size = sh.block_size, .n_blocks = n_blocks};
    s->kv = blade_kv_store_new(&cfg, &err);
    assert_non_null(s->kv);

    s->table = malloc((size_t)n_blocks * sizeof *s->table);
    for (int32_t i = 0; i < n_blocks; i++)
        s->table[i] = i;
    uint64_t ts = table_seed;
    for (int32_t i = n_blocks - 1; i > 0; i--) {
        int32_t j = (int32_t)(splitmix(&ts) % (uint64_t)(i + 1));
        int32_t t = s->table[i];
        s->table[i] = s->table[j];
        s->table[j] = t;
    }

    if (poisoned)
        poison(s);
    for (int32_t p = 0; write_all && p < n_ctx; p++)
        write_pos(s, p);

    size_t nq = (size_t)n_ctx * (size_t)s->n_head * (size_t)sh.head_dim;
    s->q = malloc(nq * sizeof *s->q);
    uint64_t qs = seed * 31 + 7;
    for (size_t i = 0; i < nq; i++)
        s->q[i] = 2.0f * uniform(&qs);
}

static void scene_free(scene *s)
{
    blade_kv_store_free(s->kv);
    free(s->table);
    free(s->q);
}

static size_t row_floats(const scene *s)
{
    return (size_t)s->n_head * (size_t)s->sh.head_dim;
}

/* Attention of queries pos0 .. pos0 + n_q - 1 over KV heads [kvb, kve) into out, whose
 * row i belongs to query pos0 + i. */
static void run_range(const scene *s, int32_t pos0, int32_t n_q, int32_t kvb, int32_t kve, float *out)
{
    void *scratch = malloc(blade_attention_scratch_bytes(s->kv, n_q, s->n_head));
    blade_attention_args a = {
        .kv = s->kv,
        .layer = LAYER,
        .block_table = s->table,
        .pos0 = pos0,
        .n_q = n_q,
        .n_head = s->n_head,
        .q = s->q + (size_t)pos0 * row_floats(s),
        .q_stride = (int64_t)row_floats(s),
        .out = out,
        .out_stride = (int64_t)row_floats(s),
        .scale = 1.0f / sqrtf((float)s->sh.head_dim),
        .kv_head_begin = kvb,
        .kv_head_end = kve,
        .scratch = scratch,
    };
    blade_attention(&a);
    free(scratch);
}

static void run(const scene *s, int32_t pos0, int32_t n_q, float *out)
{
    run_range(s, pos0, n_q, 0, s->sh.n_head_kv, out);
}

/* The definition, in double: scores of every visible key, softmax, weighted sum, on the
 * K/V values as the store holds them. */
static void reference(const scene *s, int32_t pos, int32_t h, double *out)
{
    int32_t hd = s->sh.head_dim, bs = s->sh.block_size, kvh = h / s->sh.group;
    const float *q = s->q + (size_t)pos * row_floats(s) + (size_t)h * (size_t)hd;
    double *w = malloc((size_t)(pos + 1) * sizeof *w);
    float *k = malloc(2 * (size_t)hd * sizeof *k), *v = k + hd;
    double mx = -INFINITY, scale = 1.0 / sqrt((double)hd);
    for (int32_t j = 0; j <= pos; j++) {
        blade_kv_store_read_head(s->kv, LAYER, s->table[j / bs], j % bs, kvh, k, v);
        double dot = 0;
        for (int32_t d = 0; d < hd; d++)
            dot += (double)q[d] * k[d];
        w[j] = dot * scale;
        mx = w[j] > mx ? w[j] : mx;
    }
    double sum = 0;
    for (int32_t j = 0; j <= pos; j++)
        sum += (w[j] = exp(w[j] - mx));
    for (int32_t d = 0; d < hd; d++)
        out[d] = 0;
    for (int32_t j = 0; j <= pos; j++) {
        blade_kv_store_read_head(s->kv, LAYER, s->table[j / bs], j % bs, kvh, k, v);
        for (int32_t d = 0; d < hd; d++)
            out[d] += w[j] / sum * v[d];
    }
    free(k);
    free(w);
}

/* max |a - b| / max |b| over one head's output. */
static double rel_err(const float *a, const double *b, int32_t n)
{
    double diff = 0, mag = 0;
    for (int32_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)a[i] - b[i]));
        mag = fmax(mag, fabs(b[i]));
    }
    return diff / mag;
}

/* ---- ISA iteration ---- */

typedef struct isa_list {
    blade_isa isa[BLADE_ISA_COUNT];
    int n;
} isa_list;

/* The ISAs this CPU runs; the others are reported as not tested by `what`. */
static isa_list supported_isas(const char *what)
{
    isa_list l = {.n = 0};
    for (int i = 0; i < BLADE_ISA_COUNT; i++)
        if (isa_tested((blade_isa)i, what))
            l.isa[l.n++] = (blade_isa)i;
    return l;
}

/* ---- KV store ---- */

static void test_kv_types(void **state)
{
    (void)state;
    const blade_kv_type types[] = {BLADE_KV_F16, BLADE_KV_F32, BLADE_KV_BF16, BLADE_KV_Q8_0, BLADE_KV_FP8};
    const size_t sizes[] = {2, 4, 2, 1, 1}, scales[] = {0, 0, 0, 2, 2};
    assert_int_equal(sizeof types / sizeof types[0], BLADE_KV_TYPE_COUNT);
    for (int i = 0; i < BLADE_KV_TYPE_COUNT; i++) {
        assert_int_equal(blade_kv_type_from_name(blade_kv_type_name(types[i])), types[i]);
        assert_int_equal(blade_kv_type_size(types[i]), sizes[i]);
        assert_int_equal(blade_kv_type_scale_bytes(types[i]), scales[i]);
        assert_non_null(strstr(blade_kv_type_names(), blade_kv_type_name(types[i])));
    }
    assert_string_equal(blade_kv_type_name(BLADE_KV_F16), "f16");
    assert_string_equal(blade_kv_type_name((blade_kv_type)BLADE_KV_TYPE_COUNT), "unknown");
    assert_int_equal(blade_kv_type_from_name("BF16"), BLADE_KV_BF16);
    assert_int_equal(blade_kv_type_from_name("Q8_0"), BLADE_KV_Q8_0);
    assert_int_equal(blade_kv_type_from_name("fp8"), BLADE_KV_FP8);
    assert_int_equal(blade_kv_type_from_name("q4_0"), -1);

    blade_kv_store_config cfg = {
        .n_layer = 32, .n_head_kv = 8, .head_dim = 128, .type = BLADE_KV_F16, .block_size = 16};
    /* 2 x 32 layers x 8 heads x 128 dims x 16 tokens x 2 bytes. */
    assert_int_equal(blade_kv_store_block_bytes(&cfg), 2097152);
    cfg.type = BLADE_KV_F32;
    assert_int_equal(blade_kv_store_block_bytes(&cfg), 4194304);
    /* 2 x 32 layers x (8 heads x 16 tokens x (128 dims + a 2-byte scale)): 1.97x fewer bytes
     * than f16, and whole cache lines (16384 + 256). */
    cfg.type = BLADE_KV_Q8_0;
    assert_int_equal(blade_kv_store_block_bytes(&cfg), 1064960);
    cfg.type = BLADE_KV_FP8;
    assert_int_equal(blade_kv_store_block_bytes(&cfg), 1064960);
    /* TinyLlama's shape (22 layers, 4 KV heads, head_dim 64): 1.94x the tokens of f16. */
    cfg = (blade_kv_store_config){.n_layer = 22, .n_head_kv = 4, .head_dim = 64, .type = BLADE_KV_F16, .block_size = 16};
    size_t f16 = blade_kv_store_block_bytes(&cfg);
    cfg.type = BLADE_KV_Q8_0;
    size_t q8 = blade_kv_store_block_bytes(&cfg);
    assert_int_equal(q8, 2 * 22 * (4 * 16 * 64 + 4 * 16 * 2));
    assert_true((double)f16 / (double)q8 >= 1.9);
    /* Elements and scales each start a cache line: 5 x 3 one-byte elements, then 3 scales. */
    cfg = (blade_kv_store_config){.n_layer = 1, .n_head_kv = 1, .head_dim = 5, .type = BLADE_KV_FP8, .block_size = 3};
    assert_int_equal(blade_kv_store_block_bytes(&cfg), 2 * 128);
    cfg.block_size = 0;
    assert_int_equal(blade_kv_store_block_bytes(&cfg), 0);
    cfg = (blade_kv_store_config){.n_layer = INT32_MAX, .n_head_kv = INT32_MAX, .head_dim = INT32_MAX,
                                  .type = BLADE_KV_F32, .block_size = INT32_MAX};
    assert_int_equal(blade_kv_store_block_bytes(&cfg), 0);
    cfg.type = BLADE_KV_Q8_0;
    assert_int_equal(blade_kv_store_block_bytes(&cfg), 0);
    cfg = (blade_kv_store_config){.n_layer = 1, .n_head_kv = 1 << 30, .head_dim = 1 << 30,
                                  .type = BLADE_KV_Q8_0, .block_size = 1 << 30};
    assert_int_equal(blade_kv_store_block_bytes(&cfg), 0);
}

static void test_kv_store_errors(void **state)
{
    (void)state;
    blade_error err;
    blade_kv_store_config cfg = {
        .n_layer = 2, .n_head_kv = 2, .head_dim = 64, .type = BLADE_KV_F16, .block_size = 0, .n_blocks = 10};
    assert_null(blade_kv_store_new(&cfg, &err));
    assert_non_null(strstr(err.msg, "block_size"));
    cfg.block_size = 16;
    cfg.type = (blade_kv_type)7;
    assert_null(blade_kv_store_new(&cfg, &err));
    assert_non_null(strstr(err.msg, "type"));
    cfg.type = BLADE_KV_F16;
    cfg.head_dim = 0;
    assert_null(blade_kv_store_new(&cfg, &err));
    assert_non_null(strstr(err.msg, "head_dim 0"));

    cfg = (blade_kv_store_config){.n_layer = 4096, .n_head_kv = 1 << 20, .head_dim = 1 << 20, .type = BLADE_KV_F32,
                                  .block_size = 1 << 20, .n_blocks = 1 << 20};
    assert_null(blade_kv_store_new(&cfg, &err));
    assert_non_null(strstr(err.msg, "overflows"));

    /* 2 x 2^46 bytes: refused by any machine that does not overcommit without limit. */
    cfg = (blade_kv_store_config){.n_layer = 1, .n_head_kv = 1, .head_dim = 1 << 15, .type = BLADE_KV_F32,
                                  .block_size = 1 << 14, .n_blocks = 1 << 15};
    blade_kv_store *s = blade_kv_store_new(&cfg, &err);
    if (s)
        blade_kv_store_free(s);
    else
        assert_non_null(strstr(err.msg, "70368744177664 bytes"));
}

static void test_kv_write_layout(void **state)
{
    (void)state;
    const blade_kv_type types[] = {BLADE_KV_F16, BLADE_KV_F32, BLADE_KV_BF16};
    for (int t = 0; t < 3; t++) {
        blade_error err;
        blade_kv_store_config cfg = {
            .n_layer = 3, .n_head_kv = 2, .head_dim = 5, .type = types[t], .block_size = 4, .n_blocks = 6};
        blade_kv_store *s = blade_kv_store_new(&cfg, &err);
        assert_non_null(s);
        assert_int_equal(s->head_stride, 4 * 5 * s->elem_bytes);
        assert_int_equal(s->block_stride, 2 * s->head_stride);
        /* Values that need rounding, including a tie, a subnormal and overflow for f16. */
        float k[10] = {1.0f / 3, -2.5e-6f, 65519.0f, 70000.0f, 1.00048828125f, 3.14159f, -0.0f, 1e-8f, -7.75f, 0.1f};
        float v[10];
        for (int i = 0; i < 10; i++)
            v[i] = -k[i] * 1.5f;
        blade_kv_store_write(s, 2, 5, 3, k, v);
        for (int h = 0; h < 2; h++)
            for (int d = 0; d < 5; d++) {
                const uint8_t *kp = blade_kv_store_k(s, 2, 5, h) + (size_t)(3 * 5 + d) * s->elem_bytes;
                const uint8_t *vp = blade_kv_store_v(s, 2, 5, h) + (size_t)(3 * 5 + d) * s->elem_bytes;
                float kx = k[h * 5 + d], vx = v[h * 5 + d];
                if (types[t] == BLADE_KV_F32) {
                    assert_memory_equal(kp, &kx, 4);
                    assert_memory_equal(vp, &vx, 4);
                } else {
                    uint16_t ke = types[t] == BLADE_KV_F16 ? blade_fp32_to_fp16(kx) : blade_fp32_to_bf16(kx);
                    uint16_t ve = types[t] == BLADE_KV_F16 ? blade_fp32_to_fp16(vx) : blade_fp32_to_bf16(vx);
                    assert_memory_equal(kp, &ke, 2);
                    assert_memory_equal(vp, &ve, 2);
                }
            }
        /* The last slot of the last block of the last layer is the end of the area. */
        assert_ptr_equal(blade_kv_store_k(s, 2, 5, 1) + s->head_stride, s->k + 3 * 6 * s->block_stride);
        blade_kv_store_free(s);
    }
}

/* The reference rounding of one row of an 8-bit type, from kv_type.h's definition: the
 * bfloat16 scale max|x| / top, each value rounded to the nearest code (rintf: ties to even)
 * against it. Codes into out, scale returned. */
static uint16_t expected_row(blade_kv_type t, const float *x, int n, uint8_t *out)
{
    float top = t == BLADE_KV_Q8_0 ? 127.0f : 448.0f, amax = 0;
    for (int i = 0; i < n; i++)
        if (isfinite(x[i]))
            amax = fmaxf(amax, fabsf(x[i]));
    uint16_t scale = blade_fp32_to_bf16(amax / top);
    float d = blade_bf16_to_fp32(scale);
    for (int i = 0; i < n; i++) {
        float v = d > 0 ? x[i] / d : x[i];
        out[i] = t == BLADE_KV_Q8_0 ? (uint8_t)(int8_t)rintf(fmaxf(-127.0f, fminf(127.0f, v)))
                                    : blade_fp32_to_e4m3(v);
    }
    return scale;
}

/* A row read back is within the type's rounding of what was written: q8_0 half a step of
 * max|x| / 127 (and a little for the scale's rounding), fp8 2^-4 relative (or half its
 * smallest step). */
static void assert_row_close(blade_kv_type type, const float *x, const float *back, int n)
{
    float amax = 0;
    for (int i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    for (int d = 0; d < n; d++) {
        float bound = type == BLADE_KV_Q8_0 ? amax / 127 * 0.5f * 1.01f
                                            : fmaxf(fabsf(x[d]) * 0x1p-4f, amax / 448 * 0x1p-10f);
        if (!(fabsf(back[d] - x[d]) <= bound))
            fail_msg("%s: element %d: wrote %g, read %g", blade_kv_type_name(type), d, (double)x[d], (double)back[d]);
    }
}

/* q8_0 and fp8 rows: codes and scale as kv_type.h defines them, at the documented place;
 * reading back gives code x scale; a row's bytes never depend on its neighbours; zero,
 * NaN, infinite and tiny rows. */
static void test_kv_write_scaled(void **state)
{
    (void)state;
    enum { HD = 24 };
    const blade_kv_type types[] = {BLADE_KV_Q8_0, BLADE_KV_FP8};
    for (int t = 0; t < 2; t++) {
        blade_kv_type type = types[t];
        blade_error err;
        blade_kv_store_config cfg = {
            .n_layer = 3, .n_head_kv = 2, .head_dim = HD, .type = type, .block_size = 4, .n_blocks = 6};
        blade_kv_store *s = blade_kv_store_new(&cfg, &err);
        assert_non_null(s);
        assert_int_equal(s->head_stride, 4 * HD);
        assert_int_equal(s->scales_at, 2 * 4 * HD);
        assert_int_equal(s->head_scales, 4 * 2);
        assert_int_equal(s->block_stride, 256);
        assert_ptr_equal((uint8_t *)blade_kv_store_k_scale(s, 2, 5, 1), s->k + (2 * 6 + 5) * 256 + 192 + 8);
        assert_ptr_equal((uint8_t *)blade_kv_store_v_scale(s, 0, 1, 0), s->v + 256 + 192);

        float k[2 * HD], v[2 * HD], kr[HD], vr[HD];
        uint64_t st = 5;
        for (int i = 0; i < 2 * HD; i++) {
            k[i] = 3.0f * uniform(&st) * (i % 7 == 0 ? 10.0f : 1.0f);
            v[i] = uniform(&st) * 0.01f;
        }
        blade_kv_store_write(s, 2, 5, 3, k, v);
        uint8_t before_k[2][HD], before_v[2][HD];
        for (int h = 0; h < 2; h++) {
            const uint8_t *kp = blade_kv_store_k(s, 2, 5, h) + 3 * HD, *vp = blade_kv_store_v(s, 2, 5, h) + 3 * HD;
            uint8_t want[HD];
            uint16_t ks = expected_row(type, k + h * HD, HD, want);
            assert_memory_equal(kp, want, HD);
            assert_int_equal(blade_kv_store_k_scale(s, 2, 5, h)[3], ks);
            uint16_t vs = expected_row(type, v + h * HD, HD, want);
            assert_memory_equal(vp, want, HD);
            assert_int_equal(blade_kv_store_v_scale(s, 2, 5, h)[3], vs);
            memcpy(before_k[h], kp, HD);
            memcpy(before_v[h], vp, HD);
            /* read back: code x scale, close to what was written */
            blade_kv_store_read_head(s, 2, 5, 3, h, kr, vr);
            for (int d = 0; d < HD; d++) {
                float code = type == BLADE_KV_Q8_0 ? (float)(int8_t)kp[d] : blade_e4m3_to_fp32(kp[d]);
                assert_true(kr[d] == code * blade_bf16_to_fp32(ks));
            }
            assert_row_close(type, k + h * HD, kr, HD);
            assert_row_close(type, v + h * HD, vr, HD);
        }
        /* neighbours with far larger and far smaller values leave the row's bytes alone */
        float big[2 * HD], small[2 * HD];
        for (int i = 0; i < 2 * HD; i++) {
            big[i] = 1e4f * uniform(&st);
            small[i] = 1e-6f * uniform(&st);
        }
        blade_kv_store_write(s, 2, 5, 2, big, small);
        blade_kv_store_write(s, 2, 5, 0, small, big);
        for (int h = 0; h < 2; h++) {
            assert_memory_equal(blade_kv_store_k(s, 2, 5, h) + 3 * HD, before_k[h], HD);
            assert_memory_equal(blade_kv_store_v(s, 2, 5, h) + 3 * HD, before_v[h], HD);
        }

        /* an all-zero head: scale 0, codes 0, zeros back */
        float zero[2 * HD] = {0};
        blade_kv_store_write(s, 1, 0, 0, zero, zero);
        blade_kv_store_read_head(s, 1, 0, 0, 1, kr, vr);
        assert_int_equal(blade_kv_store_k_scale(s, 1, 0, 1)[0], 0);
        for (int d = 0; d < HD; d++)
            assert_true(kr[d] == 0.0f && vr[d] == 0.0f);

        /* exact rows: multiples of a power of two up to 127 or 448 of it come back exactly */
        float exact[2 * HD];
        for (int i = 0; i < 2 * HD; i++)
            exact[i] = type == BLADE_KV_Q8_0 ? (float)((i * 37) % 255 - 127) * 0.25f
                                             : blade_e4m3_to_fp32((uint8_t)((i * 37) % 0x7f)) * 0.25f;
        exact[5] = type == BLADE_KV_Q8_0 ? 127 * 0.25f : 448 * 0.25f;
        blade_kv_store_write(s, 0, 2, 1, exact, exact);
        blade_kv_store_read_head(s, 0, 2, 1, 0, kr, vr);
        assert_int_equal(blade_kv_store_k_scale(s, 0, 2, 0)[1], blade_fp32_to_bf16(0.25f));
        assert_memory_equal(kr, exact, sizeof kr);

        /* tiny rows keep their precision: the bfloat16 scale has the range of a float */
        float tiny[2 * HD];
        for (int i = 0; i < 2 * HD; i++)
            tiny[i] = 1e-30f * (1.0f + uniform(&st));
        blade_kv_store_write(s, 0, 3, 0, tiny, tiny);
        blade_kv_store_read_head(s, 0, 3, 0, 0, kr, vr);
        assert_row_close(type, tiny, kr, HD);

        /* NaN: an fp8 element stays NaN alone, a q8_0 row turns NaN whole; infinities
         * saturate to the largest value the row's finite values give it */
        float odd[2 * HD];
        for (int i = 0; i < 2 * HD; i++)
            odd[i] = (float)(i % 5) - 2.0f;
        odd[3] = NAN;
        odd[HD + 4] = INFINITY;
        odd[HD + 6] = -INFINITY;
        blade_kv_store_write(s, 0, 4, 2, odd, odd);
        blade_kv_store_read_head(s, 0, 4, 2, 0, kr, vr);
        for (int d = 0; d < HD; d++)
            assert_true(type == BLADE_KV_Q8_0 || d == 3 ? isnan(kr[d]) : fabsf(kr[d] - odd[d]) <= 2 * 0x1p-4f);
        blade_kv_store_read_head(s, 0, 4, 2, 1, kr, vr);
        assert_true(fabsf(kr[4] - 2.0f) < 0.01f && fabsf(kr[6] + 2.0f) < 0.01f);
        assert_true(kr[4] == -kr[6] && kr[0] == kr[4]);
        blade_kv_store_free(s);
    }
}

/* Same bits, or both NaN: a NaN code under a NaN scale may come out with either one's
 * payload, as the compiler orders a multiplication's operands. */
static bool same_floats(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, sizeof *a) != 0 && !(isnan(a[i]) && isnan(b[i])))
            return false;
    return true;
}

/* Every ISA's tile conversion of every type gives the scalar one's floats, bit for bit:
 * random bytes (every code, NaN codes included) under random scales (zero, subnormal,
 * huge and NaN among them), for keys and values. */
static void test_tile_conversions_identical(void **state)
{
    (void)state;
    isa_list isas = supported_isas("KV tile conversions against the scalar ones");
    enum { BS = 32, HD = 64, BP = 32 };
    uint64_t st = 11;
    uint8_t *src = malloc(BS * HD * 4);
    uint16_t scales[BS];
    float *want = malloc(BS * HD * sizeof(float)), *want_v = malloc(BS * HD * sizeof(float));
    float *got = malloc(BS * HD * sizeof(float));
    for (int t = 0; t < BLADE_KV_TYPE_COUNT; t++) {
        const kv_type_traits *tt = kv_type_traits_of((blade_kv_type)t);
        for (int round = 0; round < 20; round++) {
            for (size_t i = 0; i < BS * HD * tt->elem_bytes; i++)
                src[i] = (uint8_t)splitmix(&st);
            if (t == BLADE_KV_F16 || t == BLADE_KV_BF16)
                for (size_t i = 0; i < BS * HD; i++)
                    if ((((uint16_t *)src)[i] & 0x7c00) == 0x7c00 || (((uint16_t *)src)[i] & 0x7f80) == 0x7f80)
                        ((uint16_t *)src)[i] &= 0xbfff; /* leave NaN payloads out of the unscaled types */
            if (t == BLADE_KV_F32)
                for (size_t i = 0; i < BS * HD; i++)
                    ((uint32_t *)src)[i] &= 0xbfffffffu;
            for (int j = 0; j < BS; j++) {
                float sc = ldexpf(uniform(&st), (int)(splitmix(&st) % 200) - 140);
                scales[j] = j == 0 ? 0 : j == 1 ? 0x7fc0 : j == 2 ? 0x0001 : j == 3 ? 0x7f7f : blade_fp32_to_bf16(sc);
            }
            const uint16_t *sp = tt->scale_bytes ? scales : NULL;
            for (int k = 0; k < isas.n; k++) {
                const attn_tile_conv *conv = tt->tile[isas.isa[k]];
                memset(got, 0xa5, BS * HD * sizeof(float));
                conv->load_kt(src, sp, got, BS, HD, BP);
                if (k == 0)
                    memcpy(want, got, BS * HD * sizeof(float));
                else if (!same_floats(want, got, BS * HD))
                    fail_msg("%s keys: %s differs from scalar", tt->name, blade_isa_name(isas.isa[k]));
                if (!conv->load_v)
                    continue;
                memset(got, 0xa5, BS * HD * sizeof(float));
                conv->load_v(src, sp, got, BS - 3, HD);
                if (k == 0)
                    memcpy(want_v, got, BS * HD * sizeof(float));
                else if (!same_floats(want_v, got, (BS - 3) * HD))
                    fail_msg("%s values: %s differs from scalar", tt->name, blade_isa_name(isas.isa[k]));
            }
        }
    }
    free(src);
    free(want);
    free(want_v);
    free(got);
}

/* ---- accuracy ---- */

typedef struct chunk {
    int32_t pos0, n_q;
} chunk;

/* Runs the chunks on every supported ISA: each against the double reference (tol) and,
 * for SIMD paths, against the scalar path (isa_tol). Scores here reach ~10, where one f32
 * ulp is ~1e-6, so every path's probabilities carry independent relative errors of that
 * order; averaged over thousands of random values (an output far smaller than the values
 * themselves) they show as up to ~2e-6 at 8192 tokens, against the reference and between
 * paths alike. */
static void check_accuracy(shape sh, int32_t n_ctx, const chunk *chunks, int n_chunks, double tol, double isa_tol)
{
    scene s;
    scene_init(&s, sh, n_ctx, 1000 + (uint64_t)n_ctx, 77, false, true);
    size_t rf = row_floats(&s);
    int32_t hd = sh.head_dim;
    isa_list isas = supported_isas("attention accuracy against the reference");
    blade_isa saved = blade_isa_active();
    double *ref = malloc((size_t)hd * sizeof *ref);
    double worst = 0, worst_isa = 0;

    for (int c = 0; c < n_chunks; c++) {
        int32_t n_q = chunks[c].n_q;
        float *outs[BLADE_ISA_COUNT];
        for (int k = 0; k < isas.n; k++) {
            blade_isa_set(isas.isa[k]);
            outs[k] = malloc((size_t)n_q * rf * sizeof(float));
            run(&s, chunks[c].pos0, n_q, outs[k]);
        }
        for (int32_t i = 0; i < n_q; i++)
            for (int32_t h = 0; h < s.n_head; h++) {
                size_t off = (size_t)i * rf + (size_t)h * (size_t)hd;
                reference(&s, chunks[c].pos0 + i, h, ref);
                for (int k = 0; k < isas.n; k++) {
                    double e = rel_err(outs[k] + off, ref, hd);
                    worst = fmax(worst, e);
                    if (e > tol)
                        fail_msg("%s store, head_dim %d, group %d, %s: query %d head %d: relative error %.3g > %.3g",
                                 blade_kv_type_name(sh.type), hd, sh.group, blade_isa_name(isas.isa[k]),
                                 chunks[c].pos0 + i, h, e, tol);
                    if (isas.isa[k] == BLADE_ISA_SCALAR)
                        continue;
                    double scalar[512];
                    for (int32_t d = 0; d < hd; d++)
                        scalar[d] = outs[0][off + (size_t)d];
                    e = rel_err(outs[k] + off, scalar, hd);
                    worst_isa = fmax(worst_isa, e);
                    if (e > isa_tol)
                        fail_msg("%s vs scalar, head_dim %d: query %d head %d: relative difference %.3g > %.3g",
                                 blade_isa_name(isas.isa[k]), hd, chunks[c].pos0 + i, h, e, isa_tol);
                }
            }
        for (int k = 0; k < isas.n; k++)
            free(outs[k]);
    }
    printf("  %s hd %3d group %d ctx %5d: max rel err %.2e vs reference, %.2e between ISAs\n",
           blade_kv_type_name(sh.type), hd, sh.group, n_ctx, worst, worst_isa);
    blade_isa_set(saved);
    free(ref);
    scene_free(&s);
}

/* Chunks covering the start, the middle and the end of n_ctx, of assorted sizes. */
static int chunks_for(int32_t n_ctx, chunk *out)
{
    if (n_ctx <= 17) {
        /* Everything, as 1 + 5 + the rest. */
        int n = 0;
        int32_t sizes[] = {1, 5, n_ctx};
        for (int32_t p = 0, k = 0; p < n_ctx; k++) {
            int32_t len = sizes[k] < n_ctx - p ? sizes[k] : n_ctx - p;
            out[n++] = (chunk){p, len};
            p += len;
        }
        return n;
    }
    out[0] = (chunk){0, 3};
    out[1] = (chunk){n_ctx / 2 - 5, 11};
    out[2] = (chunk){n_ctx - 4, 4};
    return 3;
}

static void test_reference_f32(void **state)
{
    (void)state;
    const int32_t ctxs[] = {1, 17, 1000, 8192};
    const int32_t hds[] = {64, 128};
    const int32_t groups[] = {1, 4, 8};
    for (int c = 0; c < 4; c++)
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 3; g++) {
                chunk ch[3];
                int n = chunks_for(ctxs[c], ch);
                shape sh = {BLADE_KV_F32, 2, groups[g], hds[h], 16};
                check_accuracy(sh, ctxs[c], ch, n, 1e-5, 3e-6);
            }
}

/* Every narrower type against the definition computed on the values it stores. */
static void test_reference_narrow_types(void **state)
{
    (void)state;
    const blade_kv_type types[] = {BLADE_KV_F16, BLADE_KV_BF16, BLADE_KV_Q8_0, BLADE_KV_FP8};
    const int32_t ctxs[] = {17, 1000, 8192};
    for (int t = 0; t < 4; t++)
        for (int c = 0; c < 3; c++) {
            chunk ch[3];
            int n = chunks_for(ctxs[c], ch);
            shape sh = {types[t], 2, 4, c == 1 ? 64 : 128, 16};
            check_accuracy(sh, ctxs[c], ch, n, 1e-5, 3e-6);
        }
}

/* Head dims and block sizes that are not multiples of the vector width take the generic
 * tile loads and the narrower paths; they must be just as right. */
static void test_reference_odd_shapes(void **state)
{
    (void)state;
    const int32_t hds[] = {8, 24, 40, 80};
    const int32_t bss[] = {1, 5, 8, 24, 32};
    for (int h = 0; h < 4; h++)
        for (int b = 0; b < 5; b++) {
            chunk ch[3];
            int n = chunks_for(100, ch);
            shape sh = {(h + b) % 2 ? BLADE_KV_Q8_0 : BLADE_KV_F16, 1, 2, hds[h], bss[b]};
            check_accuracy(sh, 100, ch, n, 1e-5, 3e-6);
        }
}

/* ---- batch invariance ---- */

static void assert_rows_equal(const float *a, const float *b, size_t n, const char *what, int32_t pos)
{
    if (memcmp(a, b, n * sizeof *a) != 0)
        fail_msg("%s: output of query %d differs from the one-call result", what, pos);
}

/* The same query must come out bit-identical however it is batched: alone (decode), in
 * chunks of assorted sizes, with the KV heads split over calls, through another block
 * table, and with stale NaN data in the slots after it. */
static void check_invariance(shape sh, int32_t n_ctx)
{
    scene s, t;
    scene_init(&s, sh, n_ctx, 4242, 1, false, true);
    /* Same sequence, other physical blocks, written one token at a time into a store
     * full of NaN. */
    scene_init(&t, sh, n_ctx, 4242, 2, true, false);
    size_t rf = row_floats(&s);
    float *all = malloc((size_t)n_ctx * rf * sizeof *all);
    float *other = malloc((size_t)n_ctx * rf * sizeof *other);
    char what[128];
    const char *isa = blade_isa_name(blade_isa_active());

    run(&s, 0, n_ctx, all);

    snprintf(what, sizeof what, "%s, %s, decode into NaN-poisoned store", isa, blade_kv_type_name(sh.type));
    for (int32_t p = 0; p < n_ctx; p++) {
        write_pos(&t, p);
        run(&t, p, 1, other + (size_t)p * rf);
        assert_rows_equal(other + (size_t)p * rf, all + (size_t)p * rf, rf, what, p);
    }

    snprintf(what, sizeof what, "%s, %s, assorted chunks", isa, blade_kv_type_name(sh.type));
    uint64_t rs = 99;
    for (int32_t p = 0; p < n_ctx;) {
        int32_t len = 1 + (int32_t)(splitmix(&rs) % 40);
        len = len < n_ctx - p ? len : n_ctx - p;
        run(&t, p, len, other + (size_t)p * rf);
        p += len;
    }
    for (int32_t p = 0; p < n_ctx; p++)
        assert_rows_equal(other + (size_t)p * rf, all + (size_t)p * rf, rf, what, p);

    snprintf(what, sizeof what, "%s, %s, one KV head per call", isa, blade_kv_type_name(sh.type));
    memset(other, 0, (size_t)n_ctx * rf * sizeof *other);
    for (int32_t p = 0; p < n_ctx; p += 64) {
        int32_t len = 64 < n_ctx - p ? 64 : n_ctx - p;
        for (int32_t h = sh.n_head_kv - 1; h >= 0; h--)
            run_range(&s, p, len, h, h + 1, other + (size_t)p * rf);
    }
    for (int32_t p = 0; p < n_ctx; p++)
        assert_rows_equal(other + (size_t)p * rf, all + (size_t)p * rf, rf, what, p);

    free(all);
    free(other);
    scene_free(&s);
    scene_free(&t);
}

static void test_batch_invariance(void **state)
{
    (void)state;
    const shape shapes[] = {
        {BLADE_KV_F16, 2, 4, 64, 16},
        {BLADE_KV_BF16, 2, 8, 128, 32},
        {BLADE_KV_F32, 3, 1, 80, 16},
        {BLADE_KV_F16, 2, 2, 24, 5}, /* generic loads, narrower paths */
        {BLADE_KV_Q8_0, 2, 4, 64, 16},
        {BLADE_KV_FP8, 2, 8, 128, 32},
        {BLADE_KV_FP8, 2, 2, 24, 5},
    };
    isa_list isas = supported_isas("attention batch invariance");
    blade_isa saved = blade_isa_active();
    for (int k = 0; k < isas.n; k++) {
        blade_isa_set(isas.isa[k]);
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            check_invariance(shapes[i], 300);
    }
    blade_isa_set(saved);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_types),
        cmocka_unit_test(test_kv_store_errors),
        cmocka_unit_test(test_kv_write_layout),
        cmocka_unit_test(test_kv_write_scaled),
        cmocka_unit_test(test_tile_conversions_identical),
        cmocka_unit_test(test_reference_f32),
        cmocka_unit_test(test_reference_narrow_types),
        cmocka_unit_test(test_reference_odd_shapes),
        cmocka_unit_test(test_batch_invariance),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

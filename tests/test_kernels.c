#include "testutil.h"

#include "blade/kernels.h"
#include "blade/types.h"
#include "kernels/kernels_internal.h"
#include "kernels/ktraits.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- data ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t next_u64(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static float uniform(void)
{
    return (float)(next_u64() >> 40) * 0x1p-24f;
}

/* Roughly normal, with an occasional outlier so block scales vary a lot. */
static float sample(void)
{
    float s = uniform() + uniform() + uniform() + uniform() - 2.0f;
    return (next_u64() % 61 == 0) ? 8.0f * s : s;
}

static const uint32_t all_types[] = {BLADE_TYPE_F32,  BLADE_TYPE_F16,  BLADE_TYPE_BF16, BLADE_TYPE_Q8_0,
                                     BLADE_TYPE_Q4_0, BLADE_TYPE_Q4_K, BLADE_TYPE_Q5_K, BLADE_TYPE_Q6_K};
#define N_TYPES (sizeof all_types / sizeof all_types[0])
/* The layouts blade_matmul_repack makes at load; every ISA must give the same bits. */
static const uint32_t r16_types[] = {BLADE_KTYPE_Q8_0_R16, BLADE_KTYPE_Q4_0_R16, BLADE_KTYPE_Q4_K_R16,
                                     BLADE_KTYPE_Q6_K_R16};
#define N_R16_TYPES (sizeof r16_types / sizeof r16_types[0])

static const char *type_name(uint32_t type)
{
    switch (type) {
    case BLADE_KTYPE_Q8_0_R16:
        return "Q8_0_R16";
    case BLADE_KTYPE_Q4_0_R16:
        return "Q4_0_R16";
    case BLADE_KTYPE_Q4_K_R16:
        return "Q4_K_R16";
    case BLADE_KTYPE_Q6_K_R16:
        return "Q6_K_R16";
    default:
        return blade_type_traits_get(type)->name;
    }
}

typedef struct mm_case {
    uint32_t type;
    int64_t n, rows, ntok;
    uint8_t *W;
    size_t w_stride;
    float *wf; /* dequantized weights, rows x n */
    float *x;  /* activations, ntok x n */
    uint8_t *X;
    size_t x_stride;
} mm_case;

/* Offsets of the fp16 scale fields in each quantized block; every other byte is
 * random, so all quant and sub-scale bit patterns occur (Q8_0's -128 included). */
static void fix_scales(uint32_t type, uint8_t *blk)
{
    static const int q_d[][3] = {{BLADE_TYPE_Q8_0, 0, -1}, {BLADE_TYPE_Q4_0, 0, -1}, {BLADE_TYPE_Q4_K, 0, 2},
                                 {BLADE_TYPE_Q5_K, 0, 2},  {BLADE_TYPE_Q6_K, 208, -1}};
    for (size_t i = 0; i < sizeof q_d / sizeof q_d[0]; i++) {
        if ((uint32_t)q_d[i][0] != type)
            continue;
        for (int k = 1; k < 3; k++) {
            if (q_d[i][k] < 0)
                continue;
            uint16_t h = blade_fp32_to_fp16((0.002f + 0.01f * uniform()));
            memcpy(blk + q_d[i][k], &h, 2);
        }
    }
}

/* For a repacked kernel type the weights are made in the base type's file layout and then
 * repacked, as the model loader does. */
static mm_case make_case(uint32_t ktype, int64_t n, int64_t rows, int64_t ntok)
{
    uint32_t type = blade_matmul_base_type(ktype);
    const blade_type_traits *tr = blade_type_traits_get(type);
    mm_case c = {.type = type, .n = n, .rows = rows, .ntok = ntok};
    c.w_stride = blade_type_row_bytes(type, n);
    c.W = malloc(c.w_stride * (size_t)rows);
    c.wf = malloc(sizeof(float) * (size_t)(n * rows));
    if (tr->block_size == 1) {
        for (int64_t i = 0; i < n * rows; i++)
            c.wf[i] = sample() * 0.1f;
        for (int64_t r = 0; r < rows; r++)
            tr->from_float(c.wf + r * n, c.W + r * c.w_stride, n);
    } else {
        for (size_t i = 0; i < c.w_stride * (size_t)rows; i++)
            c.W[i] = (uint8_t)next_u64();
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < n / tr->block_size; b++)
                fix_scales(type, c.W + r * c.w_stride + b * tr->block_bytes);
    }
    for (int64_t r = 0; r < rows; r++)
        tr->to_float(c.W + r * c.w_stride, c.wf + r * n, n);
    if (ktype != type) {
        assert_int_equal(blade_matmul_repacked_type(type, n, rows), ktype);
        blade_matmul_repack(type, c.W, n, rows);
        c.type = ktype;
        c.w_stride = blade_matmul_row_bytes(ktype, n);
    }
    c.x = malloc(sizeof(float) * (size_t)(n * ntok));
    for (int64_t i = 0; i < n * ntok; i++)
        c.x[i] = sample();
    c.x_stride = blade_act_row_bytes(type, n);
    c.X = aligned_alloc(64, c.x_stride * (size_t)ntok);
    for (int64_t t = 0; t < ntok; t++)
        blade_act_convert(type, c.x + t * n, c.X + t * c.x_stride, n);
    return c;
}

static void free_case(mm_case *c)
{
    free(c->W);
    free(c->wf);
    free(c->x);
    free(c->X);
}

/* Y[t * rows + r] for tokens [t0, t1) and rows [r0, r1) in one call. */
static void mm(const mm_case *c, float *Y, int64_t t0, int64_t t1, int64_t r0, int64_t r1)
{
    blade_matmul(c->type, c->W, c->w_stride, c->X + t0 * c->x_stride, c->x_stride, c->n, Y + t0 * c->rows, c->rows,
                 t1 - t0, r0, r1);
}

/* An AVX-512 CPU without VNNI or BF16 has no AVX-512 kernel for the types that need them,
 * so blade_matmul runs their AVX2 kernel in the AVX-512 pass: a run there must say so. */
static void note_avx512_fallback(uint32_t type)
{
#if defined(__x86_64__)
    if (blade_isa_active() == BLADE_ISA_AVX512 && !blade_ktraits_isa_kernel(type, BLADE_ISA_AVX512, blade_cpu_get_features()))
        note_skipped("AVX-512 %s not supported by this CPU: the AVX-512 %s kernel not tested (AVX2's ran instead)",
                     type == BLADE_TYPE_BF16 ? "BF16" : "VNNI", type_name(type));
#else
    (void)type;
#endif
}

/* ---- batch invariance ---- */

static void check_invariance(uint32_t type, int64_t n)
{
    /* more tokens than one of the kernels' token chunks (64), so a chunk boundary is crossed */
    const int64_t align = blade_matmul_row_align(type), rows = align > 1 ? 3 * align : 37, ntok = 70;
    mm_case c = make_case(type, n, rows, ntok);
    size_t ybytes = sizeof(float) * (size_t)(rows * ntok);
    float *one = malloc(ybytes), *y = malloc(ybytes);
    blade_isa saved = blade_isa_active();
    for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
        if (!isa_tested((blade_isa)isa, "matmul batch invariance"))
            continue;
        blade_isa_set((blade_isa)isa);
        note_avx512_fallback(type);
        for (int64_t t = 0; t < ntok; t++)
            mm(&c, one, t, t + 1, 0, rows);
        /* Every batch size, so every partial tile shape is covered. */
        for (int64_t nt = 1; nt <= ntok; nt++) {
            memset(y, 0xff, ybytes);
            mm(&c, y, 0, nt, 0, rows);
            if (memcmp(y, one, sizeof(float) * (size_t)(rows * nt)) != 0)
                fail_msg("%s on %s: %ld-token batch differs from single tokens", type_name(type),
                         blade_isa_name((blade_isa)isa), (long)nt);
        }
        /* Arbitrary row and token splits, as threads and callers would make them. */
        for (int trial = 0; trial < 6; trial++) {
            memset(y, 0xff, ybytes);
            for (int64_t t0 = 0; t0 < ntok;) {
                int64_t t1 = t0 + 1 + (int64_t)(next_u64() % 11);
                t1 = t1 > ntok ? ntok : t1;
                for (int64_t r0 = 0; r0 < rows;) {
                    int64_t r1 = r0 + align * (1 + (int64_t)(next_u64() % 9));
                    r1 = r1 > rows ? rows : r1;
                    mm(&c, y, t0, t1, r0, r1);
                    r0 = r1;
                }
                t0 = t1;
            }
            if (memcmp(y, one, ybytes) != 0)
                fail_msg("%s on %s: split call differs from single tokens", type_name(type),
                         blade_isa_name((blade_isa)isa));
        }
        /* A held input (blade_matmul_input_hold): row pieces of all the tokens, as the
         * runner's threads take them, the first piece deriving what the others reuse; then
         * a scratch too small to keep anything. */
        size_t scratch_bytes = blade_matmul_input_scratch_bytes(n, ntok);
        uint8_t *scratch = malloc(scratch_bytes);
        for (int pass = 0; pass < 2; pass++) {
            memset(y, 0xff, ybytes);
            blade_matmul_input_hold(scratch, pass ? 64 : scratch_bytes);
            for (int64_t r0 = 0; r0 < rows;) {
                int64_t r1 = r0 + align * (1 + (int64_t)(next_u64() % 3));
                r1 = r1 > rows ? rows : r1;
                mm(&c, y, 0, ntok, r0, r1);
                r0 = r1;
            }
            blade_matmul_input_release();
            if (memcmp(y, one, ybytes) != 0)
                fail_msg("%s on %s: pieces of a held input differ from single tokens (scratch %s)", type_name(type),
                         blade_isa_name((blade_isa)isa), pass ? "too small" : "large enough");
        }
        free(scratch);
    }
    blade_isa_set(saved);
    free(one);
    free(y);
    free_case(&c);
}

/* n is chosen so every tail path runs: an odd number of 32-blocks (the AVX-512 pair
 * kernels' half-empty last unit) and float rows that are not whole vectors. */
static void test_invariance_float(void **state)
{
    (void)state;
    check_invariance(BLADE_TYPE_F32, 300);
    check_invariance(BLADE_TYPE_F16, 300);
    check_invariance(BLADE_TYPE_BF16, 300);
    /* short rows (a small draft model's): whole vectors, a ragged tail, less than one */
    const int64_t short_n[] = {64, 172, 256, 8};
    for (size_t i = 0; i < sizeof short_n / sizeof *short_n; i++) {
        check_invariance(BLADE_TYPE_F32, short_n[i]);
        check_invariance(BLADE_TYPE_F16, short_n[i]);
    }
}

static void test_invariance_q32(void **state)
{
    (void)state;
    check_invariance(BLADE_TYPE_Q8_0, 13 * 32);
    check_invariance(BLADE_TYPE_Q4_0, 13 * 32);
    check_invariance(BLADE_TYPE_Q8_0, 8 * 32);
    check_invariance(BLADE_TYPE_Q4_0, 8 * 32);
    for (size_t i = 0; i < 2; i++) {
        check_invariance(r16_types[i], 13 * 32);
        check_invariance(r16_types[i], 8 * 32);
    }
}

static void test_invariance_k(void **state)
{
    (void)state;
    check_invariance(BLADE_TYPE_Q4_K, 3 * 256);
    check_invariance(BLADE_TYPE_Q5_K, 3 * 256);
    check_invariance(BLADE_TYPE_Q6_K, 3 * 256);
    check_invariance(BLADE_KTYPE_Q4_K_R16, 3 * 256);
    check_invariance(BLADE_KTYPE_Q6_K_R16, 3 * 256);
}

/* ---- accuracy ----
 *
 * Against the scalar kernel, an ISA sees the same converted activations and the same
 * exact integer block sums; only float rounding differs: the order and grouping of at
 * most n/8 per-lane additions (plus the horizontal sum, FMA vs separate rounding, and
 * vdpbf16ps's internal roundings), each contributing at most 2^-24 of the running
 * magnitude. The standard recursive-summation bound gives
 *     |y_isa - y_scalar| <= (n/8 + 16) * 2^-24 * S,   S = sum |w_i| |x_i|.
 *
 * Against a double-precision dot of the dequantized weights and the original float
 * activations, the scalar kernel also carries the activation conversion error e_i:
 *   int8 blocks: |e_i| <= amax_block / 254 (round to nearest with step amax/127), so
 *     |sum w_i e_i| <= B = sum_i |w_i| * amax_block(i) / 254   (worst case, per output);
 *   bf16: |e_i| <= 2^-8 |x_i|, so B = 2^-8 * S;   f32 activations: B = 0.
 * The tolerance is B plus the rounding term above. Since the e_i are rounding errors of
 * effectively random sign, their weighted sum is ~sqrt(n) times smaller than the
 * worst case, so the mean error over all outputs must also stay under B/4: a systematic
 * error of that size (a wrong scale, a dropped sub-block) would fail even when each
 * output alone slips under the worst-case bound. */

static double act_bound(uint32_t type, const float *w, const float *x, int64_t n)
{
    type = blade_matmul_base_type(type);
    int64_t block = type == BLADE_TYPE_Q8_0 || type == BLADE_TYPE_Q4_0                           ? 32
                    : type == BLADE_TYPE_Q4_K || type == BLADE_TYPE_Q5_K || type == BLADE_TYPE_Q6_K ? 256
                                                                                                    : 0;
    double b = 0.0;
    if (block) {
        for (int64_t s = 0; s < n; s += block) {
            double amax = 0.0, sw = 0.0;
            for (int64_t i = s; i < s + block; i++) {
                amax = fabs(x[i]) > amax ? fabs(x[i]) : amax;
                sw += fabs(w[i]);
            }
            b += sw * amax / 254.0;
        }
    } else if (type == BLADE_TYPE_BF16) {
        for (int64_t i = 0; i < n; i++)
            b += fabs((double)w[i] * x[i]) * 0x1p-8;
    }
    return b;
}

/* Repacked types promise more than the bound: the same bits on every ISA. */
static void check_accuracy(uint32_t type, int64_t n)
{
    bool same_bits = blade_matmul_base_type(type) != type;
    const int64_t rows = same_bits ? 2 * BLADE_R16_ROWS : 19, ntok = 7;
    mm_case c = make_case(type, n, rows, ntok);
    size_t ybytes = sizeof(float) * (size_t)(rows * ntok);
    float *ys = malloc(ybytes), *y = malloc(ybytes);
    blade_isa saved = blade_isa_active();
    blade_isa_set(BLADE_ISA_SCALAR);
    mm(&c, ys, 0, ntok, 0, rows);
    double round_k = ((double)n / 8 + 16) * 0x1p-24;
    double sum_err = 0.0, sum_bound = 0.0;
    for (int64_t t = 0; t < ntok; t++) {
        for (int64_t r = 0; r < rows; r++) {
            const float *w = c.wf + r * n, *x = c.x + t * n;
            double ref = 0.0, s = 0.0;
            for (int64_t i = 0; i < n; i++) {
                ref += (double)w[i] * x[i];
                s += fabs((double)w[i] * x[i]);
            }
            double b = act_bound(type, w, x, n);
            double err = fabs(ys[t * rows + r] - ref);
            if (err > b + round_k * (s + b))
                fail_msg("%s scalar: row %ld token %ld: %g vs %g (bound %g)", type_name(type),
                         (long)r, (long)t, ys[t * rows + r], ref, b + round_k * (s + b));
            sum_err += err;
            sum_bound += b;
        }
    }
    if (sum_bound > 0.0 && sum_err > 0.25 * sum_bound)
        fail_msg("%s scalar: mean error %g exceeds a quarter of the worst-case bound %g", type_name(type), sum_err,
                 sum_bound);
    for (int isa = 1; isa < BLADE_ISA_COUNT; isa++) {
        if (!isa_tested((blade_isa)isa, "matmul accuracy"))
            continue;
        blade_isa_set((blade_isa)isa);
        note_avx512_fallback(type);
        mm(&c, y, 0, ntok, 0, rows);
        if (same_bits && memcmp(y, ys, ybytes) != 0)
            fail_msg("%s on %s: not the scalar kernel's bits", type_name(type), blade_isa_name((blade_isa)isa));
        for (int64_t t = 0; t < ntok; t++) {
            for (int64_t r = 0; r < rows; r++) {
                const float *w = c.wf + r * n, *x = c.x + t * n;
                double s = 0.0;
                for (int64_t i = 0; i < n; i++)
                    s += fabs((double)w[i] * x[i]);
                double b = act_bound(type, w, x, n);
                double tol = round_k * (s + b);
                double err = fabs((double)y[t * rows + r] - ys[t * rows + r]);
                if (!(err <= tol))
                    fail_msg("%s %s: row %ld token %ld: %.9g vs scalar %.9g (tol %g)",
                             type_name(type), blade_isa_name((blade_isa)isa), (long)r, (long)t,
                             y[t * rows + r], ys[t * rows + r], tol);
            }
        }
    }
    blade_isa_set(saved);
    free(ys);
    free(y);
    free_case(&c);
}

static void test_accuracy(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_TYPES; i++) {
        int64_t n = all_types[i] == BLADE_TYPE_Q4_K || all_types[i] == BLADE_TYPE_Q5_K || all_types[i] == BLADE_TYPE_Q6_K
                        ? 2048
                        : 1056;
        check_accuracy(all_types[i], n);
    }
    for (size_t i = 0; i < N_R16_TYPES; i++)
        check_accuracy(r16_types[i], blade_matmul_base_type(r16_types[i]) >= BLADE_TYPE_Q4_K ? 2048 : 1056);
}

/* ---- repacking ---- */

static void test_repack(void **state)
{
    (void)state;
    const uint32_t bases[] = {BLADE_TYPE_Q8_0, BLADE_TYPE_Q4_0, BLADE_TYPE_Q4_K, BLADE_TYPE_Q6_K};
    const int64_t rows = 3 * BLADE_R16_ROWS;
    for (size_t i = 0; i < N_R16_TYPES; i++) {
        int64_t n = bases[i] >= BLADE_TYPE_Q4_K ? 3 * 256 : 5 * 32;
        uint32_t ktype = blade_matmul_repacked_type(bases[i], n, rows);
        assert_int_equal(ktype, r16_types[i]);
        assert_int_equal(blade_matmul_base_type(ktype), bases[i]);
        assert_int_equal(blade_matmul_row_align(ktype), BLADE_R16_ROWS);
        assert_int_equal(blade_matmul_row_bytes(ktype, n), blade_type_row_bytes((blade_type)bases[i], n));
        /* Every row reads back as the file layout's row, bit for bit. */
        mm_case c = make_case(ktype, n, rows, 1);
        float *row = malloc(sizeof(float) * (size_t)n);
        for (int64_t r = 0; r < rows; r++) {
            blade_matmul_row_to_float(ktype, c.W, n, r, row);
            if (memcmp(row, c.wf + r * n, sizeof(float) * (size_t)n) != 0)
                fail_msg("%s row %ld does not read back as its file row", type_name(ktype), (long)r);
        }
        free(row);
        free_case(&c);
    }
    /* Shapes without whole groups of rows, and other types, keep the file layout. */
    assert_int_equal(blade_matmul_repacked_type(BLADE_TYPE_Q4_0, 64, rows + 1), 0);
    assert_int_equal(blade_matmul_repacked_type(BLADE_TYPE_Q6_K, 160, rows), 0);
    assert_int_equal(blade_matmul_repacked_type(BLADE_TYPE_Q5_K, 256, rows), 0);
    assert_int_equal(blade_matmul_base_type(BLADE_TYPE_Q6_K), BLADE_TYPE_Q6_K);
    assert_int_equal(blade_matmul_row_align(BLADE_TYPE_Q4_0), 1);
}

/* ---- activation conversion ---- */

static void test_act_convert(void **state)
{
    (void)state;
    const int64_t n = 13 * 32;
    float x[13 * 32];
    for (int64_t i = 0; i < n; i++)
        x[i] = sample();
    x[5] = 0.0f;
    for (int i = 64; i < 96; i++)
        x[i] = 0.0f; /* an all-zero block gets d = 0 */
    size_t bytes = blade_act_row_bytes(BLADE_TYPE_Q4_0, n);
    assert_int_equal(bytes % 64, 0);
    uint8_t *buf = malloc(bytes);
    memset(buf, 0xAB, bytes);
    blade_act_convert(BLADE_TYPE_Q4_0, x, buf, n);
    act_q8_view a = act_q8_at(buf, n);
    for (int64_t b = 0; b < n / 32; b++) {
        int32_t s = 0;
        for (int j = 0; j < 32; j++) {
            int8_t q = a.q[b * 32 + j];
            assert_true(q != -128);
            assert_true(fabsf(x[b * 32 + j] - a.d[b] * q) <= a.d[b] * 0.5f * 1.0001f + 1e-30f);
            s += q;
        }
        assert_int_equal(s, a.sum[b]);
    }
    assert_true(a.d[2] == 0.0f);
    /* Padding past the last block is zero, as the whole-vector loads rely on. */
    for (size_t i = (size_t)n; i < act_pad((size_t)n); i++)
        assert_int_equal(a.q[i], 0);
    assert_true(a.d[n / 32] == 0.0f);
    free(buf);

    const int64_t nk = 512;
    float xk[512];
    for (int64_t i = 0; i < nk; i++)
        xk[i] = sample();
    bytes = blade_act_row_bytes(BLADE_TYPE_Q6_K, nk);
    buf = malloc(bytes);
    blade_act_convert(BLADE_TYPE_Q6_K, xk, buf, nk);
    act_k_view k = act_k_at(buf, nk);
    for (int64_t g = 0; g < nk / 16; g++) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++)
            s += k.q[g * 16 + j];
        assert_int_equal(s, k.sum16[g]);
    }
    for (int64_t i = 0; i < nk; i++)
        assert_true(fabsf(xk[i] - k.d[i / 256] * k.q[i]) <= k.d[i / 256] * 0.5f * 1.0001f);
    free(buf);

    assert_false(blade_matmul_supported(BLADE_TYPE_Q2_K));
    assert_int_equal(blade_act_row_bytes(BLADE_TYPE_Q2_K, 256), 0);
    for (size_t i = 0; i < N_TYPES; i++)
        assert_true(blade_matmul_supported(all_types[i]));
}

/* Weights of one activation form share a converted row (the runner multiplies them in one
 * pass): that holds only if their converters write the same bytes, on every ISA. */
static void test_act_forms(void **state)
{
    (void)state;
    enum { N = 512 };
    float x[N];
    for (int i = 0; i < N; i++)
        x[i] = sample();
    uint32_t types[N_TYPES + N_R16_TYPES];
    size_t nt = 0;
    for (size_t i = 0; i < N_TYPES; i++)
        types[nt++] = all_types[i];
    for (size_t i = 0; i < N_R16_TYPES; i++)
        types[nt++] = r16_types[i];
    blade_isa saved = blade_isa_active();
    for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
        if (!isa_tested((blade_isa)isa, "shared activation rows"))
            continue;
        blade_isa_set((blade_isa)isa);
        for (size_t a = 0; a < nt; a++) {
            assert_int_equal(blade_act_form(types[a]), blade_act_form(blade_matmul_base_type(types[a])));
            for (size_t b = 0; b < nt; b++) {
                if (blade_act_form(types[a]) != blade_act_form(types[b]))
                    continue;
                size_t bytes = blade_act_row_bytes(types[a], N);
                assert_int_equal(bytes, blade_act_row_bytes(types[b], N));
                uint8_t *ra = malloc(bytes), *rb = malloc(bytes);
                blade_act_convert(types[a], x, ra, N);
                blade_act_convert(types[b], x, rb, N);
                assert_memory_equal(ra, rb, bytes);
                free(ra);
                free(rb);
            }
        }
    }
    blade_isa_set(saved);
    assert_int_equal(blade_act_form(BLADE_TYPE_Q4_K), blade_act_form(BLADE_TYPE_Q6_K));
    assert_int_equal(blade_act_form(BLADE_TYPE_Q4_0), blade_act_form(BLADE_TYPE_Q8_0));
    assert_true(blade_act_form(BLADE_TYPE_Q4_0) != blade_act_form(BLADE_TYPE_Q4_K));
    assert_true(blade_act_form(BLADE_TYPE_F16) != blade_act_form(BLADE_TYPE_BF16));
    assert_int_equal(blade_act_form(BLADE_TYPE_Q2_K), BLADE_ACT_FORM_NONE);
    assert_int_equal(blade_act_form(BLADE_TYPE_Q8_K), BLADE_ACT_FORM_NONE);
}

/* A row converted in parts, the parts in a scrambled order into a buffer full of garbage,
 * is the row blade_act_convert makes, byte for byte with its padding: the runner converts
 * attention heads and SwiGLU pieces where they are computed. Rows with padding after every
 * array, a block of zeros (which the converters skip), every activation form, every ISA. */
static void test_act_convert_part(void **state)
{
    (void)state;
    const uint32_t types[] = {BLADE_TYPE_F32, BLADE_TYPE_F16, BLADE_TYPE_BF16, BLADE_TYPE_Q4_0, BLADE_TYPE_Q4_K};
    enum { N = 1280 + 32 * 3, MAX_PARTS = 64 };
    float x[N];
    for (int i = 0; i < N; i++)
        x[i] = i >= 64 && i < 96 ? 0.0f : sample();
    uint64_t seed = 7;
    blade_isa saved = blade_isa_active();
    for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
        if (!isa_tested((blade_isa)isa, "activation rows in parts"))
            continue;
        blade_isa_set((blade_isa)isa);
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
            int64_t align = blade_act_part_align(types[ti]);
            assert_true(align > 0);
            int64_t n = N / align * align;
            size_t bytes = blade_act_row_bytes(types[ti], n);
            uint8_t *whole = malloc(bytes), *parts = malloc(bytes);
            blade_act_convert(types[ti], x, whole, n);
            for (int round = 0; round < 8; round++) {
                /* cut points at random multiples of align; round 0 is one part */
                int64_t cut[MAX_PARTS + 1];
                int n_parts = 0;
                cut[0] = 0;
                while (cut[n_parts] < n && n_parts < MAX_PARTS - 1) {
                    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                    int64_t step = round == 0 ? n : align * (int64_t)(1 + (seed >> 33) % 40);
                    cut[n_parts + 1] = cut[n_parts] + step < n ? cut[n_parts] + step : n;
                    n_parts++;
                }
                if (cut[n_parts] < n)
                    cut[++n_parts] = n;
                memset(parts, 0xA5, bytes);
                /* even rounds backwards, odd ones the odd parts and then the even ones */
                for (int i = 0; i < n_parts; i++) {
                    int odd = n_parts / 2, p = round % 2 ? (i < odd ? 2 * i + 1 : 2 * (i - odd)) : n_parts - 1 - i;
                    blade_act_convert_part(types[ti], x + cut[p], parts, n, cut[p], cut[p + 1]);
                }
                assert_memory_equal(whole, parts, bytes);
            }
            free(whole);
            free(parts);
        }
    }
    blade_isa_set(saved);
    assert_int_equal(blade_act_part_align(BLADE_TYPE_Q8_0), 32);
    assert_int_equal(blade_act_part_align(BLADE_TYPE_BF16), 1);
    assert_int_equal(blade_act_part_align(BLADE_TYPE_Q6_K), 256);
    assert_int_equal(blade_act_part_align(BLADE_TYPE_Q2_K), 0);
}

/* RMSNorm: the same bits on every ISA for lengths with and without a tail (the runner's
 * batch invariance and its agreement across machines rest on it), in place too, and
 * within float rounding of a plain double computation. */
static void test_rmsnorm(void **state)
{
    (void)state;
    enum { N = 2053 };
    static float x[N], w[N], want[N], got[N];
    for (int i = 0; i < N; i++) {
        x[i] = 3.0f * sample();
        w[i] = 1.0f + sample();
    }
    const int64_t lengths[] = {1, 7, 8, 61, 64, 2048, N};
    for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        int64_t n = lengths[li];
        blade_isa saved = blade_isa_active();
        blade_isa_set(BLADE_ISA_SCALAR);
        blade_rmsnorm(want, x, w, n, 1e-6f);
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++)
            ss += (double)x[i] * x[i];
        double scale = 1.0 / sqrt(ss / (double)n + 1e-6f);
        for (int64_t i = 0; i < n; i++)
            assert_true(fabs(want[i] - x[i] * scale * w[i]) <= 1e-6 * fabs(x[i] * scale * w[i]) + 1e-12);
        for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
            if (!isa_tested((blade_isa)isa, "RMSNorm"))
                continue;
            blade_isa_set((blade_isa)isa);
            blade_rmsnorm(got, x, w, n, 1e-6f);
            if (memcmp(got, want, sizeof(float) * (size_t)n) != 0)
                fail_msg("%s: RMSNorm of %lld elements differs from the scalar path", blade_isa_name((blade_isa)isa),
                         (long long)n);
            memcpy(got, x, sizeof(float) * (size_t)n);
            blade_rmsnorm(got, got, w, n, 1e-6f);
            assert_memory_equal(got, want, sizeof(float) * (size_t)n);
        }
        blade_isa_set(saved);
    }
}

/* SwiGLU against double precision on every ISA, special values included; the runs layout
 * of a fused gate/up output; and an element's bits independent of where a call's range
 * starts or ends (threads split rows at any point). */
static void test_swiglu(void **state)
{
    (void)state;
    enum { N = 203 };
    float g[N], u[N], out[N], part[N];
    const float special[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 30.0f, -30.0f, 87.5f, -87.5f, 100.0f, -100.0f, 1e30f, -1e30f};
    const int n_special = (int)(sizeof special / sizeof special[0]);
    for (int i = 0; i < N; i++) {
        g[i] = i < n_special ? special[i] : 12.0f * sample();
        u[i] = sample();
    }
    blade_isa saved = blade_isa_active();
    for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
        if (!isa_tested((blade_isa)isa, "SwiGLU"))
            continue;
        blade_isa_set((blade_isa)isa);
        blade_swiglu(g, u, out, 1, N, 0);
        for (int i = 0; i < N; i++) {
            double want = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
            if (!(fabs(out[i] - want) <= 1e-6 * fabs(want) + 1e-30)) /* below e^-87 the exponential is 0 */
                fail_msg("%s: element %d, gate %g: %.9g, want %.9g", blade_isa_name((blade_isa)isa), i, g[i], out[i],
                         want);
        }
        for (int cut = 1; cut < 40; cut += 3) {
            blade_swiglu(g, u, part, 1, cut, 0);
            blade_swiglu(g + cut, u + cut, part + cut, 1, N - cut, 0);
            assert_memory_equal(part, out, sizeof out);
        }
        /* three runs of 5 pairs, 11 floats apart: gate at 0..4, up at 5..9 */
        float runs[3 * 11], got[15], want[15];
        for (int i = 0; i < 33; i++)
            runs[i] = 4.0f * sample();
        blade_swiglu(runs, runs + 5, got, 3, 5, 11);
        for (int k = 0; k < 3; k++)
            blade_swiglu(runs + 11 * k, runs + 11 * k + 5, want + 5 * k, 1, 5, 0);
        assert_memory_equal(got, want, sizeof got);
        memcpy(part, g, sizeof g);
        blade_swiglu(part, u, part, 1, N, 0);
        assert_memory_equal(part, out, sizeof out);
    }
    blade_isa_set(saved);
}

/* F16 and BF16 rows (the KV store's) round as the one-value functions do on every ISA:
 * ties, subnormal results, overflow, signed zeros, infinities and NaNs with payloads,
 * then random bit patterns over the whole range; n leaves a tail after the vectors. */
static void test_row_from_float(void **state)
{
    (void)state;
    enum { N = 1003 };
    const uint32_t bits[] = {
        0x00000000, 0x80000000, 0x3f801000, /* 1 + 2^-11: a tie, to even 1.0 in f16 */
        0x3f803000, /* 1 + 3 * 2^-11: a tie, up */
        0x33000000, /* 2^-25: half the smallest f16 subnormal, ties to zero */
        0x33000001, 0x33c00000, 0x387fc000, /* subnormal results */
        0x477fe000, 0x477fefff, 0x477ff000, /* 65504, just below 65520, 65520 (to inf) */
        0x7f7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00123, 0x7f800001, 0x7fbfe000,
        0x3f808000, 0x3f818000, /* bf16 ties */
        0x00000001, 0x807fffff, /* f32 subnormals */
    };
    const size_t n_fixed = sizeof bits / sizeof bits[0];
    float x[N];
    for (int i = 0; i < N; i++) {
        uint32_t b = i < (int)n_fixed ? bits[i] : (uint32_t)next_u64();
        memcpy(&x[i], &b, sizeof b);
    }
    const uint32_t types[] = {BLADE_TYPE_F16, BLADE_TYPE_BF16};
    blade_isa saved = blade_isa_active();
    for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
        if (!isa_tested((blade_isa)isa, "F16/BF16 row rounding"))
            continue;
        blade_isa_set((blade_isa)isa);
        for (int t = 0; t < 2; t++) {
            uint16_t out[N];
            blade_row_from_float(types[t], x, out, N);
            for (int i = 0; i < N; i++) {
                uint16_t want = types[t] == BLADE_TYPE_F16 ? blade_fp32_to_fp16(x[i]) : blade_fp32_to_bf16(x[i]);
                if (out[i] != want)
                    fail_msg("%s, %s, element %d (bits %08x): %04x, want %04x", blade_isa_name((blade_isa)isa),
                             types[t] == BLADE_TYPE_F16 ? "f16" : "bf16", i, i < (int)n_fixed ? bits[i] : 0u,
                             out[i], want);
            }
        }
    }
    blade_isa_set(saved);
}

/* The vector converters must write exactly the portable converter's bytes, special
 * values included, since rows are shared across ISAs. */
static void test_act_convert_isas(void **state)
{
    (void)state;
    const int64_t n = 3 * 256 + 64; /* 3 super-blocks for K types; a ragged tail for BF16 */
    float *x = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++)
        x[i] = sample() * (next_u64() % 5 == 0 ? 1e4f : 1.0f);
    x[3] = NAN;
    x[40] = -INFINITY;
    x[100] = 1e-40f; /* subnormal */
    x[101] = -0.0f;
    x[300] = 0x1p127f;
    for (int i = 512; i < 544; i++)
        x[i] = 1e-35f; /* a block below the quantizer's zero threshold */
    x[700] = -NAN;
    blade_isa saved = blade_isa_active();
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        uint32_t type = all_types[ti];
        int64_t len = type == BLADE_TYPE_Q8_0 || type == BLADE_TYPE_Q4_0 || type == BLADE_TYPE_BF16 ? n : 3 * 256;
        size_t bytes = blade_act_row_bytes(type, len);
        uint8_t *ref = malloc(bytes), *got = malloc(bytes);
        blade_isa_set(BLADE_ISA_SCALAR);
        blade_act_convert(type, x, ref, len);
        for (int isa = 1; isa < BLADE_ISA_COUNT; isa++) {
            if (!isa_tested((blade_isa)isa, "activation conversion"))
                continue;
            blade_isa_set((blade_isa)isa);
            memset(got, 0x5A, bytes);
            blade_act_convert(type, x, got, len);
            if (memcmp(ref, got, bytes) != 0)
                fail_msg("%s activations on %s differ from the portable converter", blade_type_traits_get(type)->name,
                         blade_isa_name((blade_isa)isa));
        }
        free(ref);
        free(got);
    }
    blade_isa_set(saved);
    free(x);
}

/* ---- GFNI ----
 * Where the CPU has GFNI, the AVX-512 and AVX2 Q6_K R16 kernels decode with it; the
 * decodings without it still serve CPUs that lack it. All four must give the scalar
 * kernel's bits, for one token (the decode path) and for tiles of several. */

static void test_q6_k_gfni(void **state)
{
    (void)state;
#if defined(__x86_64__)
    const blade_cpu_features *f = blade_cpu_get_features();
    if (!isa_tested(BLADE_ISA_AVX2, "the Q6_K_R16 GFNI decodings"))
        skip();
    if (!f->gfni) {
        note_skipped("GFNI not supported by this CPU: the Q6_K_R16 GFNI decodings not tested on it");
        skip();
    }
    blade_cpu_features without = *f;
    without.gfni = false;
    bool avx512 = isa_tested(BLADE_ISA_AVX512, "the AVX-512 Q6_K_R16 decodings") && f->avx512vnni;
    if (blade_isa_supported(BLADE_ISA_AVX512) && !avx512)
        note_skipped("AVX-512 VNNI not supported by this CPU: the AVX-512 Q6_K_R16 decodings not tested on it");
    struct {
        const char *name;
        blade_matmul_fn fn;
    } kernels[4] = {
        {"AVX2 with GFNI", blade_ktraits_isa_kernel(BLADE_KTYPE_Q6_K_R16, BLADE_ISA_AVX2, f)},
        {"AVX2 without GFNI", blade_ktraits_isa_kernel(BLADE_KTYPE_Q6_K_R16, BLADE_ISA_AVX2, &without)},
        {"AVX-512 with GFNI", avx512 ? blade_ktraits_isa_kernel(BLADE_KTYPE_Q6_K_R16, BLADE_ISA_AVX512, f) : NULL},
        {"AVX-512 without GFNI",
         avx512 ? blade_ktraits_isa_kernel(BLADE_KTYPE_Q6_K_R16, BLADE_ISA_AVX512, &without) : NULL},
    };
    const int n_kernels = avx512 ? 4 : 2;
    for (int k = 0; k < n_kernels; k += 2)
        assert_true(kernels[k].fn && kernels[k + 1].fn && kernels[k].fn != kernels[k + 1].fn);
    blade_matmul_fn scalar = blade_ktraits_isa_kernel(BLADE_KTYPE_Q6_K_R16, BLADE_ISA_SCALAR, f);
    const int64_t n = 3 * 256, rows = 3 * BLADE_R16_ROWS, ntok = 11;
    mm_case c = make_case(BLADE_KTYPE_Q6_K_R16, n, rows, ntok);
    size_t ybytes = sizeof(float) * (size_t)(rows * ntok);
    float *ref = malloc(ybytes), *got = malloc(ybytes);
    static const int64_t widths[] = {1, 2, 3, 8, 9, 11};
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
        scalar(c.W, c.w_stride, c.X, c.x_stride, n, ref, rows, widths[w], 0, rows);
        for (int k = 0; k < n_kernels; k++) {
            memset(got, 0xff, ybytes);
            kernels[k].fn(c.W, c.w_stride, c.X, c.x_stride, n, got, rows, widths[w], 0, rows);
            if (memcmp(ref, got, sizeof(float) * (size_t)(rows * widths[w])) != 0)
                fail_msg("Q6_K_R16 %s, %lld tokens: differs from the scalar kernel", kernels[k].name,
                         (long long)widths[w]);
        }
    }
    free(ref);
    free(got);
    free_case(&c);
#else
    note_skipped("not an x86-64 build: the Q6_K_R16 GFNI decodings not tested");
    skip();
#endif
}

/* ---- ISA selection ---- */

static void test_isa(void **state)
{
    (void)state;
    assert_true(blade_isa_supported(BLADE_ISA_SCALAR));
    const blade_cpu_features *f = blade_cpu_get_features();
    assert_true(!blade_isa_supported(BLADE_ISA_AVX512) || (f->avx512f && f->avx512bw && f->avx512vl && f->avx2));
    assert_true(!blade_isa_supported(BLADE_ISA_AVX2) || (f->avx2 && f->fma && f->f16c));
    blade_isa best = blade_isa_active();
    assert_true(blade_isa_supported(best));
    blade_isa_set(BLADE_ISA_SCALAR);
    assert_int_equal(blade_isa_active(), BLADE_ISA_SCALAR);
    blade_isa_set(best);
    assert_int_equal(blade_isa_active(), best);
    assert_string_equal(blade_isa_name(BLADE_ISA_AVX2), "avx2");
#if defined(__x86_64__)
    /* An AVX-512 CPU without VNNI or BF16 gets no AVX-512 kernel for the types that need
     * them, so blade_matmul falls back to the AVX2 kernel for those. */
    blade_cpu_features plain = *f;
    plain.avx512vnni = plain.avx512bf16 = false;
    for (size_t i = 0; i < N_TYPES; i++) {
        uint32_t t = all_types[i];
        bool needs_ext = t != BLADE_TYPE_F32 && t != BLADE_TYPE_F16;
        assert_true((blade_ktraits_isa_kernel(t, BLADE_ISA_AVX512, &plain) == NULL) == needs_ext);
        assert_non_null(blade_ktraits_isa_kernel(t, BLADE_ISA_AVX2, f));
        assert_non_null(blade_ktraits_isa_kernel(t, BLADE_ISA_SCALAR, f));
    }
    for (size_t i = 0; i < sizeof r16_types / sizeof r16_types[0]; i++) {
        assert_null(blade_ktraits_isa_kernel(r16_types[i], BLADE_ISA_AVX512, &plain));
        assert_non_null(blade_ktraits_isa_kernel(r16_types[i], BLADE_ISA_AVX2, f));
        assert_non_null(blade_ktraits_isa_kernel(r16_types[i], BLADE_ISA_SCALAR, f));
    }
#endif
    fprintf(stderr, "active ISA: %s (vnni %d, bf16 %d)\n", blade_isa_name(best), f->avx512vnni, f->avx512bf16);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_isa),
        cmocka_unit_test(test_act_convert),
        cmocka_unit_test(test_act_convert_isas),
        cmocka_unit_test(test_act_forms),
        cmocka_unit_test(test_act_convert_part),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_swiglu),
        cmocka_unit_test(test_row_from_float),
        cmocka_unit_test(test_repack),
        cmocka_unit_test(test_q6_k_gfni),
        cmocka_unit_test(test_invariance_float),
        cmocka_unit_test(test_invariance_q32),
        cmocka_unit_test(test_invariance_k),
        cmocka_unit_test(test_accuracy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The kernel-traits table (src/kernels/ktraits.c): its rows agree with each other and
 * with the GGUF type table, and each (type, ISA, CPU extensions) gets the kernel named
 * here: the AVX-512 kernel only where the CPU has the extension it needs, the AVX2 one
 * otherwise, the GFNI variants only with GFNI. */

#include "testutil.h"

#include "blade/kernels.h"
#include "blade/types.h"
#include "kernels/kernels_internal.h"

#include <stdio.h>
#include <string.h>

/* Every kernel type and the kernels it must get. */
typedef struct expected {
    uint32_t type;
    blade_matmul_fn scalar, avx2, avx2_gfni, avx512, avx512_gfni;
    unsigned avx512_needs; /* without these the AVX2 kernel runs */
} expected;

#if defined(__x86_64__)
#define X86(fn) fn
#else
#define X86(fn) NULL
#endif

#define PLAIN(type, k, needs)                                                                                          \
    {type, blade_mm_scalar_##k, X86(blade_mm_avx2_##k), X86(blade_mm_avx2_##k), X86(blade_mm_avx512_##k),              \
     X86(blade_mm_avx512_##k), needs}

static const expected kernel_types[] = {
    PLAIN(BLADE_TYPE_F32, f32, 0),
    PLAIN(BLADE_TYPE_F16, f16, 0),
    PLAIN(BLADE_TYPE_BF16, bf16, KT_NEEDS_BF16),
    PLAIN(BLADE_TYPE_Q8_0, q8_0, KT_NEEDS_VNNI),
    PLAIN(BLADE_TYPE_Q4_0, q4_0, KT_NEEDS_VNNI),
    PLAIN(BLADE_TYPE_Q4_K, q4_k, KT_NEEDS_VNNI),
    PLAIN(BLADE_TYPE_Q5_K, q5_k, KT_NEEDS_VNNI),
    PLAIN(BLADE_TYPE_Q6_K, q6_k, KT_NEEDS_VNNI),
    PLAIN(BLADE_KTYPE_Q4_0_R16, q4_0_r16, KT_NEEDS_VNNI),
    PLAIN(BLADE_KTYPE_Q8_0_R16, q8_0_r16, KT_NEEDS_VNNI),
    PLAIN(BLADE_KTYPE_Q4_K_R16, q4_k_r16, KT_NEEDS_VNNI),
    {BLADE_KTYPE_Q6_K_R16, blade_mm_scalar_q6_k_r16, X86(blade_mm_avx2_q6_k_r16), X86(blade_mm_avx2_q6_k_r16_gfni),
     X86(blade_mm_avx512_q6_k_r16), X86(blade_mm_avx512_q6_k_r16_gfni), KT_NEEDS_VNNI},
};
#define N_KERNEL_TYPES (sizeof kernel_types / sizeof kernel_types[0])

/* Every id a kernel type can have: the GGUF ids and their R16 counterparts. */
static uint32_t candidate(int i)
{
    return i < BLADE_TYPE_COUNT ? (uint32_t)i : (uint32_t)BLADE_KTYPE_R16(i - BLADE_TYPE_COUNT);
}

static void test_rows(void **state)
{
    (void)state;
    size_t rows = 0;
    for (int i = 0; i < 2 * BLADE_TYPE_COUNT; i++) {
        uint32_t type = candidate(i);
        const blade_ktraits *kt = blade_ktraits_get(type);
        if (!kt)
            continue;
        rows++;
        const blade_ktraits *base = blade_ktraits_get(kt->base);
        const blade_type_traits *tr = blade_type_traits_get(kt->base);
        assert_non_null(base);
        assert_true(blade_type_supported(kt->base));
        assert_int_equal(kt->act_form, base->act_form);
        assert_true(blade_act_row_bytes(type, QK_K) > 0);
        assert_non_null(blade_ktraits_converter(kt->act_form, BLADE_ISA_SCALAR));
        assert_non_null(kt->kernels[BLADE_ISA_SCALAR][0].fn);
        assert_int_equal(kt->kernels[BLADE_ISA_SCALAR][0].needs, 0);
        if (kt->base == type) {
            assert_string_equal(kt->name, tr->name);
            assert_int_equal(kt->row_align, 1);
            assert_true(!kt->pack && !kt->unpack);
            if (kt->repacked)
                assert_int_equal(blade_ktraits_get(kt->repacked)->base, type);
        } else {
            char name[32];
            snprintf(name, sizeof name, "%s_R16", tr->name);
            assert_string_equal(kt->name, name);
            assert_int_equal(base->repacked, type);
            assert_int_equal(kt->row_align, BLADE_R16_ROWS);
            assert_true(kt->pack && kt->unpack && !kt->repacked);
            /* Repacking is in place: an R16 block is the 16 file blocks' bytes. */
            assert_int_equal(r16_block_bytes(type), BLADE_R16_ROWS * tr->block_bytes);
            assert_int_equal(r16_block_elems(type), tr->block_size);
            assert_true(tr->block_bytes <= KT_MAX_BLOCK_BYTES);
        }
    }
    assert_int_equal(rows, N_KERNEL_TYPES);
}

static void test_selection(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_KERNEL_TYPES; i++) {
        const expected *e = &kernel_types[i];
        assert_non_null(blade_ktraits_get(e->type));
        for (int m = 0; m < 8; m++) {
            blade_cpu_features f = {.avx2 = true, .fma = true, .f16c = true, .avx512f = true, .avx512bw = true,
                                    .avx512vl = true, .avx512vnni = m & 1, .avx512bf16 = m & 2, .gfni = m & 4};
            bool ext = (!(e->avx512_needs & KT_NEEDS_VNNI) || f.avx512vnni) &&
                       (!(e->avx512_needs & KT_NEEDS_BF16) || f.avx512bf16);
            blade_matmul_fn avx2 = f.gfni ? e->avx2_gfni : e->avx2, avx512 = f.gfni ? e->avx512_gfni : e->avx512;
#if defined(__x86_64__)
            if (blade_ktraits_resolve(e->type, BLADE_ISA_AVX2, &f) != avx2 ||
                blade_ktraits_resolve(e->type, BLADE_ISA_AVX512, &f) != (ext ? avx512 : avx2))
                fail_msg("%s, vnni %d bf16 %d gfni %d: not the expected kernel", blade_ktraits_get(e->type)->name,
                         f.avx512vnni, f.avx512bf16, f.gfni);
            assert_ptr_equal(blade_ktraits_isa_kernel(e->type, BLADE_ISA_AVX512, &f), ext ? avx512 : NULL);
#else
            (void)ext, (void)avx2, (void)avx512;
#endif
            assert_ptr_equal(blade_ktraits_resolve(e->type, BLADE_ISA_SCALAR, &f), e->scalar);
        }
    }
}

/* What blade_matmul and blade_act_convert run is the resolution for this CPU; an ISA the
 * CPU lacks gets the widest one it has. */
static void test_resolved(void **state)
{
    (void)state;
    const blade_cpu_features *f = blade_cpu_get_features();
    for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
        blade_isa usable = (blade_isa)isa;
        while (!blade_isa_supported(usable))
            usable--;
        if ((int)usable != isa)
            fprintf(stderr, "this CPU lacks %s: its kernels resolve as %s's\n", blade_isa_name((blade_isa)isa),
                    blade_isa_name(usable));
        for (size_t i = 0; i < N_KERNEL_TYPES; i++)
            assert_ptr_equal(blade_ktraits_kernel(kernel_types[i].type, (blade_isa)isa),
                             blade_ktraits_resolve(kernel_types[i].type, usable, f));
        static const uint32_t forms[] = {BLADE_TYPE_F32, BLADE_TYPE_F16, BLADE_TYPE_BF16, BLADE_TYPE_Q8_0,
                                         BLADE_TYPE_Q8_K};
        for (size_t k = 0; k < sizeof forms / sizeof forms[0]; k++)
            assert_non_null(blade_ktraits_converter(forms[k], (blade_isa)isa));
    }
#if defined(__x86_64__)
    if (blade_isa_supported(BLADE_ISA_AVX512)) {
        /* The AVX-512 file has no F16 rounding of its own: AVX2's runs. */
        assert_ptr_equal(blade_ktraits_converter(BLADE_TYPE_F16, BLADE_ISA_AVX512), blade_act_avx2_f16);
        assert_ptr_equal(blade_ktraits_converter(BLADE_TYPE_Q8_0, BLADE_ISA_AVX512), blade_act_avx512_q8_0);
        assert_ptr_equal(blade_ktraits_converter(BLADE_TYPE_F32, BLADE_ISA_AVX512), blade_act_scalar_f32);
    }
#endif
    assert_ptr_equal(blade_ktraits_converter(BLADE_TYPE_Q8_K, BLADE_ISA_SCALAR), blade_act_scalar_q8_k);
    assert_ptr_equal(blade_ktraits_converter(BLADE_TYPE_BF16, BLADE_ISA_SCALAR), blade_bf16_from_float);
}

static void test_unknown_types(void **state)
{
    (void)state;
    static const uint32_t unknown[] = {BLADE_TYPE_Q2_K,
                                       BLADE_TYPE_Q8_K,
                                       BLADE_TYPE_IQ4_NL,
                                       4,
                                       BLADE_TYPE_COUNT,
                                       BLADE_KTYPE_R16(BLADE_TYPE_Q5_K),
                                       BLADE_KTYPE_R16(BLADE_TYPE_COUNT),
                                       UINT32_MAX};
    const blade_cpu_features *f = blade_cpu_get_features();
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        uint32_t t = unknown[i];
        assert_null(blade_ktraits_get(t));
        assert_false(blade_matmul_supported(t));
        assert_null(blade_ktraits_kernel(t, blade_isa_active()));
        assert_null(blade_ktraits_resolve(t, BLADE_ISA_AVX512, f));
        assert_int_equal(blade_act_form(t), BLADE_ACT_FORM_NONE);
        assert_int_equal(blade_act_row_bytes(t, 256), 0);
        assert_int_equal(blade_matmul_base_type(t), t);
        assert_int_equal(blade_matmul_row_align(t), 1);
        assert_int_equal(blade_matmul_repacked_type(t, 256, 64), 0);
    }
    assert_null(blade_ktraits_converter(BLADE_TYPE_Q4_0, BLADE_ISA_SCALAR));
    assert_null(blade_ktraits_kernel(BLADE_TYPE_F32, BLADE_ISA_COUNT));
    /* Shapes the R16 layouts cannot hold keep the file layout. */
    assert_int_equal(blade_matmul_repacked_type(BLADE_TYPE_Q4_K, 128, 64), 0);
    assert_int_equal(blade_matmul_repacked_type(BLADE_TYPE_Q4_K, 256, 24), 0);
    assert_int_equal(blade_matmul_repacked_type(BLADE_TYPE_Q4_K, 0, 16), 0);
    assert_int_equal(blade_matmul_repacked_type(BLADE_TYPE_Q4_K, 256, 16), BLADE_KTYPE_Q4_K_R16);
    assert_int_equal(blade_matmul_repacked_type(BLADE_TYPE_Q8_0, 32, 16), BLADE_KTYPE_Q8_0_R16);
    assert_int_equal(blade_matmul_repacked_type(BLADE_KTYPE_Q8_0_R16, 32, 16), 0);
    assert_int_equal(blade_matmul_repacked_type(BLADE_TYPE_F16, 32, 16), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows),
        cmocka_unit_test(test_selection),
        cmocka_unit_test(test_resolved),
        cmocka_unit_test(test_unknown_types),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The kernel-traits and activation-form tables (ktraits.h), their resolution for this CPU,
 * and the public lookups of kernels.h that read them. */

#include "kernels/ktraits.h"

#include "kernels/kernels_internal.h"

#include <pthread.h>

#if defined(__x86_64__)
#define X86(fn) fn
#else
#define X86(fn) NULL
#endif

/* ---- activation forms ----
 * Indexed by the type naming the form (kernels_internal.h describes the layouts). F16 is
 * no weight's form: blade_row_from_float rounds the KV store's rows with its converter. */

typedef struct act_traits {
    size_t (*row_bytes)(int64_t n); /* one converted row of n elements */
    /* NULL where an ISA has no converter of its own: the next narrower ISA's runs. */
    blade_act_fn convert[BLADE_ISA_COUNT];
} act_traits;

static size_t f32_row_bytes(int64_t n)
{
    return act_pad((size_t)n * sizeof(float));
}

static size_t half_row_bytes(int64_t n)
{
    return act_pad((size_t)n * sizeof(uint16_t));
}

static size_t q8_row_bytes(int64_t n)
{
    return act_pad((size_t)n) + 2 * act_pad((size_t)n / QK8_0 * sizeof(float));
}

static size_t k_row_bytes(int64_t n)
{
    return act_pad((size_t)n) + act_pad((size_t)n / QK_K * sizeof(float)) + act_pad((size_t)n / 16 * sizeof(int16_t));
}

static const act_traits act_forms[BLADE_TYPE_COUNT] = {
    [BLADE_TYPE_F32] = {f32_row_bytes, {[BLADE_ISA_SCALAR] = blade_act_scalar_f32}},
    [BLADE_TYPE_F16] = {half_row_bytes,
                        {[BLADE_ISA_SCALAR] = blade_f16_from_float, [BLADE_ISA_AVX2] = X86(blade_act_avx2_f16)}},
    [BLADE_TYPE_BF16] = {half_row_bytes,
                         {[BLADE_ISA_SCALAR] = blade_bf16_from_float, [BLADE_ISA_AVX2] = X86(blade_act_avx2_bf16),
                          [BLADE_ISA_AVX512] = X86(blade_act_avx512_bf16)}},
    [BLADE_TYPE_Q8_0] = {q8_row_bytes,
                         {[BLADE_ISA_SCALAR] = blade_act_scalar_q8_0, [BLADE_ISA_AVX2] = X86(blade_act_avx2_q8_0),
                          [BLADE_ISA_AVX512] = X86(blade_act_avx512_q8_0)}},
    [BLADE_TYPE_Q8_K] = {k_row_bytes,
                         {[BLADE_ISA_SCALAR] = blade_act_scalar_q8_k, [BLADE_ISA_AVX2] = X86(blade_act_avx2_q8_k),
                          [BLADE_ISA_AVX512] = X86(blade_act_avx512_q8_k)}},
};

/* ---- kernel types ----
 * Indexed by slot: GGUF types at their id, R16 forms after them. */

#define KT_SLOTS (2 * BLADE_TYPE_COUNT)
#define SLOT(type) ((int)(type) < BLADE_TYPE_COUNT ? (int)(type) : BLADE_TYPE_COUNT + (int)(type) - BLADE_KTYPE_R16(0))

static int slot_of(uint32_t type)
{
    if (type < BLADE_TYPE_COUNT)
        return (int)type;
    if (type >= BLADE_KTYPE_R16(0) && type < BLADE_KTYPE_R16(BLADE_TYPE_COUNT))
        return (int)SLOT(type);
    return -1;
}

/* A kernel each ISA file has for the type and that needs nothing beyond the ISA. */
#define KERNELS(scalar, avx2, avx512)                                                                                  \
    {                                                                                                                  \
        [BLADE_ISA_SCALAR] = {{scalar, 0}}, [BLADE_ISA_AVX2] = {{X86(avx2), 0}},                                       \
        [BLADE_ISA_AVX512] = {{X86(avx512), 0}},                                                                       \
    }

/* The integer types' AVX-512 kernels use VNNI's vpdpbusd/vpdpwssd; a CPU without it runs
 * the AVX2 kernel. */
#define VNNI_KERNELS(scalar, avx2, avx512)                                                                             \
    {                                                                                                                  \
        [BLADE_ISA_SCALAR] = {{scalar, 0}}, [BLADE_ISA_AVX2] = {{X86(avx2), 0}},                                       \
        [BLADE_ISA_AVX512] = {{X86(avx512), KT_NEEDS_VNNI}},                                                           \
    }

static const blade_ktraits kernel_types[KT_SLOTS] = {
    [SLOT(BLADE_TYPE_F32)] =
        {
            .name = "F32",
            .base = BLADE_TYPE_F32,
            .act_form = BLADE_TYPE_F32,
            .row_align = 1,
            .kernels = KERNELS(blade_mm_scalar_f32, blade_mm_avx2_f32, blade_mm_avx512_f32),
        },
    [SLOT(BLADE_TYPE_F16)] =
        {
            .name = "F16",
            .base = BLADE_TYPE_F16,
            .act_form = BLADE_TYPE_F32,
            .row_align = 1,
            .kernels = KERNELS(blade_mm_scalar_f16, blade_mm_avx2_f16, blade_mm_avx512_f16),
        },
    [SLOT(BLADE_TYPE_BF16)] =
        {
            .name = "BF16",
            .base = BLADE_TYPE_BF16,
            .act_form = BLADE_TYPE_BF16,
            .row_align = 1,
            /* The AVX-512 kernel multiplies with AVX-512 BF16's vdpbf16ps. */
            .kernels =
                {
                    [BLADE_ISA_SCALAR] = {{blade_mm_scalar_bf16, 0}},
                    [BLADE_ISA_AVX2] = {{X86(blade_mm_avx2_bf16), 0}},
                    [BLADE_ISA_AVX512] = {{X86(blade_mm_avx512_bf16), KT_NEEDS_BF16}},
                },
        },
    [SLOT(BLADE_TYPE_Q8_0)] =
        {
            .name = "Q8_0",
            .base = BLADE_TYPE_Q8_0,
            .act_form = BLADE_TYPE_Q8_0,
            .row_align = 1,
            .repacked = BLADE_KTYPE_Q8_0_R16,
            .kernels = VNNI_KERNELS(blade_mm_scalar_q8_0, blade_mm_avx2_q8_0, blade_mm_avx512_q8_0),
        },
    [SLOT(BLADE_TYPE_Q4_0)] =
        {
            .name = "Q4_0",
            .base = BLADE_TYPE_Q4_0,
            .act_form = BLADE_TYPE_Q8_0,
            .row_align = 1,
            .repacked = BLADE_KTYPE_Q4_0_R16,
            .kernels = VNNI_KERNELS(blade_mm_scalar_q4_0, blade_mm_avx2_q4_0, blade_mm_avx512_q4_0),
        },
    [SLOT(BLADE_TYPE_Q4_K)] =
        {
            .name = "Q4_K",
            .base = BLADE_TYPE_Q4_K,
            .act_form = BLADE_TYPE_Q8_K,
            .row_align = 1,
            .repacked = BLADE_KTYPE_Q4_K_R16,
            .kernels = VNNI_KERNELS(blade_mm_scalar_q4_k, blade_mm_avx2_q4_k, blade_mm_avx512_q4_k),
        },
    [SLOT(BLADE_TYPE_Q5_K)] =
        {
            .name = "Q5_K",
            .base = BLADE_TYPE_Q5_K,
            .act_form = BLADE_TYPE_Q8_K,
            .row_align = 1,
            .kernels = VNNI_KERNELS(blade_mm_scalar_q5_k, blade_mm_avx2_q5_k, blade_mm_avx512_q5_k),
        },
    [SLOT(BLADE_TYPE_Q6_K)] =
        {
            .name = "Q6_K",
            .base = BLADE_TYPE_Q6_K,
            .act_form = BLADE_TYPE_Q8_K,
            .row_align = 1,
            .repacked = BLADE_KTYPE_Q6_K_R16,
            .kernels = VNNI_KERNELS(blade_mm_scalar_q6_k, blade_mm_avx2_q6_k, blade_mm_avx512_q6_k),
        },
    [SLOT(BLADE_KTYPE_Q4_0_R16)] =
        {
            .name = "Q4_0_R16",
            .base = BLADE_TYPE_Q4_0,
            .act_form = BLADE_TYPE_Q8_0,
            .row_align = BLADE_R16_ROWS,
            .pack = blade_pack_q4_0_r16,
            .unpack = blade_unpack_q4_0_r16,
            .kernels = VNNI_KERNELS(blade_mm_scalar_q4_0_r16, blade_mm_avx2_q4_0_r16, blade_mm_avx512_q4_0_r16),
        },
    [SLOT(BLADE_KTYPE_Q8_0_R16)] =
        {
            .name = "Q8_0_R16",
            .base = BLADE_TYPE_Q8_0,
            .act_form = BLADE_TYPE_Q8_0,
            .row_align = BLADE_R16_ROWS,
            .pack = blade_pack_q8_0_r16,
            .unpack = blade_unpack_q8_0_r16,
            .kernels = VNNI_KERNELS(blade_mm_scalar_q8_0_r16, blade_mm_avx2_q8_0_r16, blade_mm_avx512_q8_0_r16),
        },
    [SLOT(BLADE_KTYPE_Q4_K_R16)] =
        {
            .name = "Q4_K_R16",
            .base = BLADE_TYPE_Q4_K,
            .act_form = BLADE_TYPE_Q8_K,
            .row_align = BLADE_R16_ROWS,
            .pack = blade_pack_q4_k_r16,
            .unpack = blade_unpack_q4_k_r16,
            .kernels = VNNI_KERNELS(blade_mm_scalar_q4_k_r16, blade_mm_avx2_q4_k_r16, blade_mm_avx512_q4_k_r16),
        },
    [SLOT(BLADE_KTYPE_Q6_K_R16)] =
        {
            .name = "Q6_K_R16",
            .base = BLADE_TYPE_Q6_K,
            .act_form = BLADE_TYPE_Q8_K,
            .row_align = BLADE_R16_ROWS,
            .pack = blade_pack_q6_k_r16,
            .unpack = blade_unpack_q6_k_r16,
            /* GFNI's vgf2p8affineqb moves the 6-bit quants' top bits in one instruction. */
            .kernels =
                {
                    [BLADE_ISA_SCALAR] = {{blade_mm_scalar_q6_k_r16, 0}},
                    [BLADE_ISA_AVX2] = {{X86(blade_mm_avx2_q6_k_r16_gfni), KT_NEEDS_GFNI},
                                        {X86(blade_mm_avx2_q6_k_r16), 0}},
                    [BLADE_ISA_AVX512] = {{X86(blade_mm_avx512_q6_k_r16_gfni), KT_NEEDS_VNNI | KT_NEEDS_GFNI},
                                          {X86(blade_mm_avx512_q6_k_r16), KT_NEEDS_VNNI}},
                },
        },
};

const blade_ktraits *blade_ktraits_get(uint32_t type)
{
    int s = slot_of(type);
    return s >= 0 && kernel_types[s].name ? &kernel_types[s] : NULL;
}

static bool has_extensions(const blade_cpu_features *f, unsigned needs)
{
    return (!(needs & KT_NEEDS_VNNI) || f->avx512vnni) && (!(needs & KT_NEEDS_BF16) || f->avx512bf16) &&
           (!(needs & KT_NEEDS_GFNI) || f->gfni);
}

static blade_matmul_fn isa_kernel(const blade_ktraits *kt, blade_isa isa, const blade_cpu_features *f)
{
    for (int v = 0; v < KT_VARIANTS; v++) {
        const kt_kernel *k = &kt->kernels[isa][v];
        if (k->fn && has_extensions(f, k->needs))
            return k->fn;
    }
    return NULL;
}

static blade_matmul_fn resolve(const blade_ktraits *kt, blade_isa isa, const blade_cpu_features *f)
{
    for (int i = (int)isa; i >= 0; i--) {
        blade_matmul_fn fn = isa_kernel(kt, (blade_isa)i, f);
        if (fn)
            return fn;
    }
    return NULL;
}

blade_matmul_fn blade_ktraits_isa_kernel(uint32_t type, blade_isa isa, const blade_cpu_features *f)
{
    const blade_ktraits *kt = blade_ktraits_get(type);
    return kt && (unsigned)isa < BLADE_ISA_COUNT ? isa_kernel(kt, isa, f) : NULL;
}

blade_matmul_fn blade_ktraits_resolve(uint32_t type, blade_isa isa, const blade_cpu_features *f)
{
    const blade_ktraits *kt = blade_ktraits_get(type);
    return kt && (unsigned)isa < BLADE_ISA_COUNT ? resolve(kt, isa, f) : NULL;
}

/* ---- resolution for this CPU ----
 * Both tables resolved for every ISA at once, so that switching the active ISA (tests and
 * benchmarks do) is only a different column. */

static blade_matmul_fn resolved_kernels[BLADE_ISA_COUNT][KT_SLOTS];
static blade_act_fn resolved_converters[BLADE_ISA_COUNT][BLADE_TYPE_COUNT];
static pthread_once_t resolved_once = PTHREAD_ONCE_INIT;

static void resolve_all(void)
{
    const blade_cpu_features *f = blade_cpu_get_features();
    for (int isa = 0; isa < BLADE_ISA_COUNT; isa++) {
        /* An ISA this CPU lacks never becomes active; its column repeats the widest
         * narrower one the CPU has, so that every entry is safe to call. */
        int usable = isa;
        while (!blade_isa_supported((blade_isa)usable))
            usable--;
        for (int s = 0; s < KT_SLOTS; s++)
            if (kernel_types[s].name)
                resolved_kernels[isa][s] = resolve(&kernel_types[s], (blade_isa)usable, f);
        for (int form = 0; form < BLADE_TYPE_COUNT; form++)
            for (int i = usable; i >= 0 && !resolved_converters[isa][form]; i--)
                resolved_converters[isa][form] = act_forms[form].convert[i];
    }
}

blade_matmul_fn blade_ktraits_kernel(uint32_t type, blade_isa isa)
{
    int s = slot_of(type);
    if (s < 0 || (unsigned)isa >= BLADE_ISA_COUNT)
        return NULL;
    pthread_once(&resolved_once, resolve_all);
    return resolved_kernels[isa][s];
}

blade_act_fn blade_ktraits_converter(uint32_t form, blade_isa isa)
{
    if (form >= BLADE_TYPE_COUNT || (unsigned)isa >= BLADE_ISA_COUNT)
        return NULL;
    pthread_once(&resolved_once, resolve_all);
    return resolved_converters[isa][form];
}

/* ---- kernels.h's lookups ---- */

bool blade_matmul_supported(uint32_t weight_type)
{
    return blade_ktraits_get(weight_type) != NULL;
}

uint32_t blade_act_form(uint32_t weight_type)
{
    const blade_ktraits *kt = blade_ktraits_get(weight_type);
    return kt ? kt->act_form : BLADE_ACT_FORM_NONE;
}

size_t blade_act_row_bytes(uint32_t weight_type, int64_t n)
{
    const blade_ktraits *kt = blade_ktraits_get(weight_type);
    return kt ? act_forms[kt->act_form].row_bytes(n) : 0;
}

uint32_t blade_matmul_repacked_type(uint32_t type, int64_t n_in, int64_t n_out)
{
    const blade_ktraits *kt = blade_ktraits_get(type);
    if (!kt || !kt->repacked || n_in <= 0 || n_out <= 0)
        return 0;
    const blade_ktraits *packed = blade_ktraits_get(kt->repacked);
    if (n_in % blade_type_traits_get(type)->block_size != 0 || n_out % packed->row_align != 0)
        return 0;
    return kt->repacked;
}

uint32_t blade_matmul_base_type(uint32_t type)
{
    const blade_ktraits *kt = blade_ktraits_get(type);
    return kt ? kt->base : type;
}

int64_t blade_matmul_row_align(uint32_t type)
{
    const blade_ktraits *kt = blade_ktraits_get(type);
    return kt ? kt->row_align : 1;
}

size_t blade_matmul_row_bytes(uint32_t type, int64_t n)
{
    return blade_type_row_bytes((blade_type)blade_matmul_base_type(type), n);
}

/* The type traits table (types.h): one row per GGUF type id with its name, block size and
 * bytes, and its reference conversions; names parsed case-insensitively. */

#include "blade/types.h"

#include "quantize/quant_blocks.h"
#include "tensor/quant_ref.h"

#include <ctype.h>

#define LAYOUT(id, nm, bs, bb) [id] = {.name = nm, .block_size = bs, .block_bytes = bb}
#define CONVERTIBLE(id, nm, bs, bb, to, from) \
    [id] = {.name = nm, .block_size = bs, .block_bytes = bb, .to_float = to, .from_float = from}

/* Indexed by ggml type id. Ids 4 and 5 (Q4_2, Q4_3) and 31-33, 36-38 (the interleaved
 * Q4_0/IQ4_NL repack formats) were removed from ggml; their rows stay zeroed (name NULL)
 * so a file that uses them is rejected instead of being read with a guessed layout. */
static const blade_type_traits type_traits[BLADE_TYPE_COUNT] = {
    CONVERTIBLE(BLADE_TYPE_F32, "F32", 1, 4, blade_f32_to_float, blade_f32_from_float),
    CONVERTIBLE(BLADE_TYPE_F16, "F16", 1, 2, blade_f16_to_float, blade_f16_from_float),
    CONVERTIBLE(BLADE_TYPE_Q4_0, "Q4_0", 32, 18, blade_q4_0_to_float, blade_q4_0_from_float),
    LAYOUT(BLADE_TYPE_Q4_1, "Q4_1", 32, 20),
    LAYOUT(BLADE_TYPE_Q5_0, "Q5_0", 32, 22),
    LAYOUT(BLADE_TYPE_Q5_1, "Q5_1", 32, 24),
    CONVERTIBLE(BLADE_TYPE_Q8_0, "Q8_0", 32, 34, blade_q8_0_to_float, blade_q8_0_from_float),
    LAYOUT(BLADE_TYPE_Q8_1, "Q8_1", 32, 36),
    LAYOUT(BLADE_TYPE_Q2_K, "Q2_K", 256, 84),
    LAYOUT(BLADE_TYPE_Q3_K, "Q3_K", 256, 110),
    CONVERTIBLE(BLADE_TYPE_Q4_K, "Q4_K", 256, 144, blade_q4_k_to_float, blade_q4_k_from_float),
    CONVERTIBLE(BLADE_TYPE_Q5_K, "Q5_K", 256, 176, blade_q5_k_to_float, blade_q5_k_from_float),
    CONVERTIBLE(BLADE_TYPE_Q6_K, "Q6_K", 256, 210, blade_q6_k_to_float, blade_q6_k_from_float),
    LAYOUT(BLADE_TYPE_Q8_K, "Q8_K", 256, 292),
    LAYOUT(BLADE_TYPE_IQ2_XXS, "IQ2_XXS", 256, 66),
    LAYOUT(BLADE_TYPE_IQ2_XS, "IQ2_XS", 256, 74),
    LAYOUT(BLADE_TYPE_IQ3_XXS, "IQ3_XXS", 256, 98),
    LAYOUT(BLADE_TYPE_IQ1_S, "IQ1_S", 256, 50),
    LAYOUT(BLADE_TYPE_IQ4_NL, "IQ4_NL", 32, 18),
    LAYOUT(BLADE_TYPE_IQ3_S, "IQ3_S", 256, 110),
    LAYOUT(BLADE_TYPE_IQ2_S, "IQ2_S", 256, 82),
    LAYOUT(BLADE_TYPE_IQ4_XS, "IQ4_XS", 256, 136),
    LAYOUT(BLADE_TYPE_I8, "I8", 1, 1),
    LAYOUT(BLADE_TYPE_I16, "I16", 1, 2),
    LAYOUT(BLADE_TYPE_I32, "I32", 1, 4),
    LAYOUT(BLADE_TYPE_I64, "I64", 1, 8),
    LAYOUT(BLADE_TYPE_F64, "F64", 1, 8),
    LAYOUT(BLADE_TYPE_IQ1_M, "IQ1_M", 256, 56),
    CONVERTIBLE(BLADE_TYPE_BF16, "BF16", 1, 2, blade_bf16_to_float, blade_bf16_from_float),
    LAYOUT(BLADE_TYPE_TQ1_0, "TQ1_0", 256, 54),
    LAYOUT(BLADE_TYPE_TQ2_0, "TQ2_0", 256, 66),
    LAYOUT(BLADE_TYPE_MXFP4, "MXFP4", 32, 17),
};

const blade_type_traits *blade_type_traits_get(uint32_t type_id)
{
    if (type_id >= BLADE_TYPE_COUNT || !type_traits[type_id].name)
        return NULL;
    return &type_traits[type_id];
}

bool blade_type_supported(uint32_t type_id)
{
    const blade_type_traits *t = blade_type_traits_get(type_id);
    return t && t->to_float && t->from_float;
}

size_t blade_type_row_bytes(blade_type type, int64_t n)
{
    const blade_type_traits *t = blade_type_traits_get((uint32_t)type);
    if (!t || n < 0)
        return 0;
    return (size_t)(n / t->block_size) * t->block_bytes;
}

static bool name_equal_nocase(const char *a, const char *b)
{
    for (; *a && *b; a++, b++)
        if (tolower((unsigned char)*a) != tolower((unsigned char)*b))
            return false;
    return *a == *b;
}

int blade_type_from_name(const char *name)
{
    if (!name)
        return -1;
    for (int id = 0; id < BLADE_TYPE_COUNT; id++)
        if (type_traits[id].name && name_equal_nocase(type_traits[id].name, name))
            return id;
    return -1;
}

/* What `--type` names: plain types and the "_M" mixes, the mix recipe (which tensors a mix
 * keeps at higher precision, as llama.cpp's quantizer chooses them, shared with blade synth),
 * the fallback for rows that are not whole blocks, and --keep overrides. */

#include "blade/quantize.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* general.file_type values are llama.cpp's LLAMA_FTYPE numbers. A plain K type gets the
 * number llama.cpp's quantizer writes for it (its "Q4_K" means Q4_K_M), so metadata matches
 * what that tool produces for the same request. Q4_0 keeps the classifier in Q6_K as
 * llama.cpp's Q4_0 files do: in Q4_0 it costs stories260K 2.5 points of top-1 agreement with
 * the F32 model (83.4% against 85.9%, mean KL divergence 0.101 against 0.075; `blade eval`
 * on stories-corpus.txt, the classifier falling back to Q8_0 there), for a matrix that is a
 * few percent of a large model's bytes. The plain K types stay uniform: their _M mixes are
 * the recipe. */
static const blade_quant_scheme schemes[] = {
    {"F32", BLADE_TYPE_F32, 0, 0, 0},
    {"F16", BLADE_TYPE_F16, 0, 0, 1},
    {"BF16", BLADE_TYPE_BF16, 0, 0, 32},
    {"Q8_0", BLADE_TYPE_Q8_0, 0, 0, 7},
    {"Q6_K", BLADE_TYPE_Q6_K, 0, 0, 18},
    {"Q5_K", BLADE_TYPE_Q5_K, 0, 0, 17},
    {"Q5_K_M", BLADE_TYPE_Q5_K, BLADE_TYPE_Q6_K, BLADE_TYPE_Q6_K, 17},
    {"Q4_K", BLADE_TYPE_Q4_K, 0, 0, 15},
    {"Q4_K_M", BLADE_TYPE_Q4_K, BLADE_TYPE_Q6_K, BLADE_TYPE_Q6_K, 15},
    {"Q4_0", BLADE_TYPE_Q4_0, BLADE_TYPE_Q6_K, 0, 2},
};

const blade_quant_scheme *blade_quant_scheme_find(const char *name)
{
    if (!name)
        return NULL;
    for (size_t i = 0; i < sizeof schemes / sizeof schemes[0]; i++)
        if (!strcasecmp(schemes[i].name, name))
            return &schemes[i];
    return NULL;
}

const char *blade_quant_scheme_names(void)
{
    return "Q8_0, Q6_K, Q5_K, Q5_K_M, Q4_K, Q4_K_M, Q4_0, F16, BF16, F32";
}

bool blade_quant_more_bits_layer(int layer, int n_layer)
{
    int eighth = n_layer / 8;
    return layer < eighth || layer >= 7 * n_layer / 8 || (layer - eighth) % 3 == 2;
}

/* The block index of "blk.N.<rest>" and a pointer to <rest>; -1 for other names. */
static int block_index(const char *name, const char **rest)
{
    if (strncmp(name, "blk.", 4) != 0)
        return -1;
    char *end;
    long n = strtol(name + 4, &end, 10);
    if (end == name + 4 || *end != '.' || n < 0 || n > 1000000)
        return -1;
    *rest = end + 1;
    return (int)n;
}

uint32_t blade_quant_scheme_type_for(const blade_quant_scheme *s, const char *name, int n_layer, bool tied)
{
    if (!strcmp(name, "output.weight") || (tied && !strcmp(name, "token_embd.weight")))
        return s->classifier_type ? s->classifier_type : s->type;
    if (!s->sensitive_type)
        return s->type;
    const char *rest;
    int layer = block_index(name, &rest);
    if (layer >= 0 && (!strncmp(rest, "attn_v.", 7) || !strncmp(rest, "ffn_down", 8)) &&
        blade_quant_more_bits_layer(layer, n_layer))
        return s->sensitive_type;
    return s->type;
}

uint32_t blade_quant_fit_type(uint32_t type, int64_t row_len, uint32_t float_type)
{
    const blade_type_traits *t = blade_type_traits_get(type);
    if (t && row_len % t->block_size == 0)
        return type;
    if (t && t->block_size > 32 && row_len % 32 == 0)
        return BLADE_TYPE_Q8_0;
    return float_type;
}

int blade_quant_keep_parse(const char *spec, blade_quant_keep *keep, blade_error *err)
{
    const char *eq = spec ? strrchr(spec, '=') : NULL;
    if (!eq)
        return blade_error_set(err, "bad --keep '%s': expected GLOB=TYPE, e.g. 'output.weight=Q8_0'",
                               spec ? spec : "");
    if (eq == spec)
        return blade_error_set(err, "bad --keep '%s': the tensor-name pattern before '=' is empty", spec);
    int type = blade_type_from_name(eq + 1);
    if (type < 0)
        return blade_error_set(err, "bad --keep '%s': unknown type '%s'", spec, eq + 1);
    if (!blade_quantize_type_supported((uint32_t)type))
        return blade_error_set(err, "bad --keep '%s': blade cannot write %s (it writes F32, F16, BF16, Q8_0, "
                               "Q6_K, Q5_K, Q4_K, Q4_0)", spec, eq + 1);
    if (!(keep->glob = strndup(spec, (size_t)(eq - spec))))
        return blade_error_set(err, "out of memory");
    keep->type = (uint32_t)type;
    return 0;
}

void blade_quant_keep_free(blade_quant_keep *keep)
{
    if (keep) {
        free(keep->glob);
        keep->glob = NULL;
    }
}

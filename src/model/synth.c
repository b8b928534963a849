/* Random-weight models of a real model's shape (synth.h), and the pieces every synthetic
 * writer shares (synth_internal.h). */
#include "model/synth_internal.h"

#include "blade/gguf.h"
#include "blade/tokenizer.h"
#include "blade/types.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float synth_gaussian(synth *s)
{
    double u1 = ((double)(splitmix64(&s->rng) >> 11) + 0.5) / 9007199254740992.0;
    double u2 = (double)(splitmix64(&s->rng) >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

int synth_check_types(const blade_synth_spec *spec, blade_error *err)
{
    const uint32_t types[] = {spec->scheme.type, spec->scheme.classifier_type, spec->scheme.sensitive_type};
    for (int i = 0; i < 3; i++)
        if ((i == 0 || types[i]) && !blade_type_supported(types[i]))
            return blade_error_set(err, "weight type %u is not supported", types[i]);
    return 0;
}

void synth_init(synth *s, const blade_synth_spec *spec, blade_error *err)
{
    *s = (synth){.w = gguf_writer_new(),
                 .scheme = spec->scheme,
                 .n_layer = spec->n_layer,
                 .tied = spec->tied_embeddings,
                 .rng = spec->seed ^ 0x626c616465ull,
                 .err = err};
}

int synth_finish(synth *s, int rc, const char *path, bool show_progress)
{
    if (!rc)
        rc = gguf_writer_write(s->w, path, show_progress, s->err);
    gguf_writer_free(s->w);
    for (size_t i = 0; i < s->n_buffers; i++)
        free(s->buffers[i]);
    free(s->buffers);
    return rc ? -1 : 0;
}

static void *keep(synth *s, size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    void **grown = realloc(s->buffers, (s->n_buffers + 1) * sizeof *grown);
    if (!p || !grown) {
        free(p);
        if (grown)
            s->buffers = grown;
        return NULL;
    }
    s->buffers = grown;
    s->buffers[s->n_buffers++] = p;
    return p;
}

int synth_add_values(synth *s, const char *name, int64_t n_in, int64_t n_out, const float *values)
{
    int64_t rows = n_out ? n_out : 1;
    uint32_t type = BLADE_TYPE_F32;
    if (n_out)
        type = blade_quant_fit_type(blade_quant_scheme_type_for(&s->scheme, name, s->n_layer, s->tied), n_in,
                                    BLADE_TYPE_F16);
    size_t bytes = blade_type_row_bytes(type, n_in) * (size_t)rows;
    void *data = keep(s, bytes);
    if (!data)
        return blade_error_set(s->err, "out of memory for tensor %s", name);
    blade_type_traits_get(type)->from_float(values, data, n_in * rows);
    int64_t ne[2] = {n_in, rows};
    return gguf_writer_add_tensor(s->w, name, type, n_out ? 2 : 1, ne, data, bytes, s->err);
}

/* A matrix of Gaussian values with standard deviation `scale`, stored in the type blade
 * quantize's recipe gives it (synth_add_values); vectors
 * (n_out == 0) are F32 filled with `fill` plus small noise so norms stay near one. */
static int add(synth *s, const char *name, int64_t n_in, int64_t n_out, float scale, float fill)
{
    size_t n = (size_t)n_in * (size_t)(n_out ? n_out : 1);
    float *values = malloc(n * sizeof *values);
    if (!values)
        return blade_error_set(s->err, "out of memory for tensor %s", name);
    for (size_t i = 0; i < n; i++)
        values[i] = fill + scale * synth_gaussian(s);
    int rc = synth_add_values(s, name, n_in, n_out, values);
    free(values);
    return rc;
}

static int add_layer_tensor(synth *s, int layer, const char *suffix, int64_t n_in, int64_t n_out, float scale,
                            float fill)
{
    char name[96];
    snprintf(name, sizeof name, "blk.%d.%s", layer, suffix);
    return add(s, name, n_in, n_out, scale, fill);
}

/* Byte-fallback SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, then
 * single printable characters with a word-start marker, then unused fillers. */
static int made_up_vocab(synth *s, int32_t n_vocab)
{
    if (n_vocab < 3 + 256)
        return blade_error_set(s->err, "a made-up vocabulary needs at least 259 tokens, not %d", n_vocab);
    char **tokens = calloc((size_t)n_vocab, sizeof *tokens);
    float *scores = calloc((size_t)n_vocab, sizeof *scores);
    int32_t *types = calloc((size_t)n_vocab, sizeof *types);
    int rc = -1;
    if (!tokens || !scores || !types) {
        blade_error_set(s->err, "out of memory");
        goto done;
    }
    for (int32_t i = 0; i < n_vocab; i++) {
        char buf[32];
        if (i == 0)
            snprintf(buf, sizeof buf, "<unk>");
        else if (i < 3)
            snprintf(buf, sizeof buf, i == 1 ? "<s>" : "</s>");
        else if (i < 259)
            snprintf(buf, sizeof buf, "<0x%02X>", i - 3);
        else if (i < 259 + 95)
            snprintf(buf, sizeof buf, "\xe2\x96\x81%c", ' ' + (i - 259));
        else
            snprintf(buf, sizeof buf, "<unused_%d>", i);
        tokens[i] = strdup(buf);
        if (!tokens[i]) {
            blade_error_set(s->err, "out of memory");
            goto done;
        }
        types[i] = i == 0      ? BLADE_TOKEN_UNKNOWN
                   : i < 3     ? BLADE_TOKEN_CONTROL
                   : i < 259   ? BLADE_TOKEN_BYTE
                   : i < 354   ? BLADE_TOKEN_NORMAL
                               : BLADE_TOKEN_UNUSED;
        scores[i] = i < 259 ? 0.0f : -(float)i;
    }
    gguf_writer_set_string(s->w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_string_array(s->w, "tokenizer.ggml.tokens", (const char *const *)tokens, (uint64_t)n_vocab);
    gguf_writer_set_array(s->w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores, (uint64_t)n_vocab);
    gguf_writer_set_array(s->w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, (uint64_t)n_vocab);
    gguf_writer_set_u32(s->w, "tokenizer.ggml.unknown_token_id", 0);
    gguf_writer_set_u32(s->w, "tokenizer.ggml.bos_token_id", 1);
    gguf_writer_set_u32(s->w, "tokenizer.ggml.eos_token_id", 2);
    rc = 0;
done:
    if (tokens)
        for (int32_t i = 0; i < n_vocab; i++)
            free(tokens[i]);
    free(tokens);
    free(scores);
    free(types);
    return rc;
}

/* Replaces the copied tokens, scores and types with the same padded by unused filler
 * tokens up to n_vocab. */
static int pad_vocab(synth *s, const gguf_file *src, const gguf_kv *tok, int32_t n_vocab)
{
    int32_t n_real = (int32_t)tok->arr_len;
    char **tokens = calloc((size_t)n_vocab, sizeof *tokens);
    float *scores = malloc((size_t)n_vocab * sizeof *scores);
    int32_t *types = malloc((size_t)n_vocab * sizeof *types);
    int rc = -1;
    if (!tokens || !scores || !types)
        goto done;
    const gguf_kv *sc = gguf_find_array(src, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, NULL, NULL);
    const gguf_kv *ty = gguf_find_array(src, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, NULL, NULL);
    for (int32_t i = 0; i < n_vocab; i++) {
        if (i < n_real) {
            tokens[i] = strndup(tok->arr_strings[i].ptr, (size_t)tok->arr_strings[i].len);
            scores[i] = 0.0f;
            types[i] = BLADE_TOKEN_NORMAL;
            if (sc && (uint64_t)i < sc->arr_len)
                memcpy(&scores[i], (const char *)sc->arr_data + (size_t)i * sizeof(float), sizeof(float));
            if (ty && (uint64_t)i < ty->arr_len)
                memcpy(&types[i], (const char *)ty->arr_data + (size_t)i * sizeof(int32_t), sizeof(int32_t));
        } else {
            char buf[32];
            snprintf(buf, sizeof buf, "<filler_%d>", i);
            tokens[i] = strdup(buf);
            scores[i] = -1e9f;
            types[i] = BLADE_TOKEN_UNUSED;
        }
        if (!tokens[i])
            goto done;
    }
    gguf_writer_set_string_array(s->w, "tokenizer.ggml.tokens", (const char *const *)tokens, (uint64_t)n_vocab);
    gguf_writer_set_array(s->w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores, (uint64_t)n_vocab);
    gguf_writer_set_array(s->w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, (uint64_t)n_vocab);
    rc = 0;
done:
    if (tokens)
        for (int32_t i = 0; i < n_vocab; i++)
            free(tokens[i]);
    free(tokens);
    free(scores);
    free(types);
    return rc ? blade_error_set(s->err, "out of memory") : 0;
}

/* Copies a real vocabulary with all of its tokenizer metadata, padded with unused filler
 * tokens to n_vocab so the embedding and output matrices have the real model's size. */
static int copied_vocab(synth *s, const char *path, int32_t n_vocab)
{
    gguf_file *src = gguf_open_mapped(path, s->err);
    if (!src)
        return -1;
    int rc = -1;
    const gguf_kv *tok = gguf_find_array(src, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, NULL, s->err);
    if (!tok)
        blade_error_set(s->err, "%s has no tokenizer.ggml.tokens", path);
    else if (tok->arr_len > (uint64_t)n_vocab)
        blade_error_set(s->err, "%s has %llu tokens, more than the %d the shape asks for", path,
                        (unsigned long long)tok->arr_len, n_vocab);
    else {
        gguf_writer_copy_kv_prefix(s->w, src, "tokenizer.");
        rc = tok->arr_len < (uint64_t)n_vocab ? pad_vocab(s, src, tok, n_vocab) : 0;
    }
    gguf_close(src);
    return rc;
}

void synth_set_hparams(gguf_writer *w, const blade_synth_spec *sp)
{
    const char *a = blade_arch_name(sp->arch);
    char key[128];
#define SET_U32(suffix, value)                                                                                         \
    do {                                                                                                               \
        snprintf(key, sizeof key, "%s.%s", a, suffix);                                                                 \
        gguf_writer_set_u32(w, key, (uint32_t)(value));                                                                \
    } while (0)
    gguf_writer_set_string(w, "general.architecture", a);
    gguf_writer_set_string(w, "general.name", "blade synthetic");
    SET_U32("context_length", sp->n_ctx);
    SET_U32("embedding_length", sp->n_embd);
    SET_U32("block_count", sp->n_layer);
    SET_U32("feed_forward_length", sp->n_ff);
    SET_U32("attention.head_count", sp->n_head);
    SET_U32("attention.head_count_kv", sp->n_head_kv);
    SET_U32("attention.key_length", sp->head_dim);
    SET_U32("attention.value_length", sp->head_dim);
    SET_U32("rope.dimension_count", sp->n_rot ? sp->n_rot : sp->head_dim);
#undef SET_U32
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    gguf_writer_set_f32(w, key, sp->rms_eps > 0 ? sp->rms_eps : 1e-6f);
    snprintf(key, sizeof key, "%s.rope.freq_base", a);
    gguf_writer_set_f32(w, key, sp->rope_base > 0 ? sp->rope_base : 10000.0f);
    if (sp->rope_scale > 1.0f) {
        snprintf(key, sizeof key, "%s.rope.scaling.type", a);
        gguf_writer_set_string(w, key, "linear");
        snprintf(key, sizeof key, "%s.rope.scaling.factor", a);
        gguf_writer_set_f32(w, key, sp->rope_scale);
    }
}

int blade_synth_write(const blade_synth_spec *sp, const char *path, bool show_progress, blade_error *err)
{
    if (synth_check_types(sp, err))
        return -1;
    synth s;
    synth_init(&s, sp, err);
    synth_set_hparams(s.w, sp);
    int rc = sp->vocab_path ? copied_vocab(&s, sp->vocab_path, sp->n_vocab) : made_up_vocab(&s, sp->n_vocab);
    int64_t d = sp->n_embd, q_dim = (int64_t)sp->n_head * sp->head_dim, kv_dim = (int64_t)sp->n_head_kv * sp->head_dim;
    /* Scales keep activations O(1) through the layers: 1/sqrt(fan-in). */
    float s_d = 1.0f / sqrtf((float)d), s_q = 1.0f / sqrtf((float)q_dim), s_ff = 1.0f / sqrtf((float)sp->n_ff);
    if (!rc)
        rc = add(&s, "token_embd.weight", d, sp->n_vocab, 1.0f, 0.0f);
    for (int l = 0; !rc && l < sp->n_layer; l++) {
        if (show_progress)
            fprintf(stderr, "\rgenerating layer %d/%d ", l + 1, sp->n_layer);
        rc = add_layer_tensor(&s, l, "attn_norm.weight", d, 0, 0.1f, 1.0f) ||
             add_layer_tensor(&s, l, "attn_q.weight", d, q_dim, s_d, 0.0f) ||
             add_layer_tensor(&s, l, "attn_k.weight", d, kv_dim, s_d, 0.0f) ||
             add_layer_tensor(&s, l, "attn_v.weight", d, kv_dim, s_d, 0.0f) ||
             add_layer_tensor(&s, l, "attn_output.weight", q_dim, d, s_q, 0.0f) ||
             add_layer_tensor(&s, l, "ffn_norm.weight", d, 0, 0.1f, 1.0f) ||
             add_layer_tensor(&s, l, "ffn_gate.weight", d, sp->n_ff, s_d, 0.0f) ||
             add_layer_tensor(&s, l, "ffn_up.weight", d, sp->n_ff, s_d, 0.0f) ||
             add_layer_tensor(&s, l, "ffn_down.weight", sp->n_ff, d, s_ff, 0.0f);
        if (!rc && sp->arch == BLADE_ARCH_QWEN2)
            rc = add_layer_tensor(&s, l, "attn_q.bias", q_dim, 0, 0.5f, 0.0f) ||
                 add_layer_tensor(&s, l, "attn_k.bias", kv_dim, 0, 0.5f, 0.0f) ||
                 add_layer_tensor(&s, l, "attn_v.bias", kv_dim, 0, 0.5f, 0.0f);
        if (!rc && sp->arch == BLADE_ARCH_QWEN3)
            rc = add_layer_tensor(&s, l, "attn_q_norm.weight", sp->head_dim, 0, 0.1f, 1.0f) ||
                 add_layer_tensor(&s, l, "attn_k_norm.weight", sp->head_dim, 0, 0.1f, 1.0f);
    }
    if (!rc)
        rc = add(&s, "output_norm.weight", d, 0, 0.1f, 1.0f);
    if (!rc && !sp->tied_embeddings)
        rc = add(&s, "output.weight", d, sp->n_vocab, s_d, 0.0f);
    if (show_progress)
        fputc('\n', stderr);
    return synth_finish(&s, rc, path, show_progress);
}

typedef struct shape {
    const char *name;
    blade_arch arch;
    int32_t n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_ctx;
    float rope_base;
    bool tied;
    const char *vocab;
} shape;

/* Published configurations of the real models. */
static const shape shapes[] = {
    {"tinyllama-1.1b", BLADE_ARCH_LLAMA, 32000, 2048, 22, 32, 4, 64, 5632, 2048, 10000.0f, false,
     "vocab/ggml-vocab-llama-spm.gguf"},
    {"llama-3.2-1b", BLADE_ARCH_LLAMA, 128256, 2048, 16, 32, 8, 64, 8192, 131072, 500000.0f, true,
     "vocab/ggml-vocab-gpt-2.gguf"},
    {"qwen2.5-0.5b", BLADE_ARCH_QWEN2, 151936, 896, 24, 14, 2, 64, 4864, 32768, 1000000.0f, true,
     "vocab/ggml-vocab-gpt-2.gguf"},
    /* SmolLM2's own BPE vocabulary (49152) is smaller than GPT-2's, so it borrows Llama's. */
    {"smollm2-135m", BLADE_ARCH_LLAMA, 49152, 576, 30, 9, 3, 64, 1536, 8192, 100000.0f, true,
     "vocab/ggml-vocab-llama-spm.gguf"},
    {"llama-2-7b", BLADE_ARCH_LLAMA, 32000, 4096, 32, 32, 32, 128, 11008, 4096, 10000.0f, false,
     "vocab/ggml-vocab-llama-spm.gguf"},
};

int blade_synth_shape(const char *name, blade_synth_spec *spec, const char **vocab_file)
{
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const shape *s = &shapes[i];
        if (strcmp(name, s->name) != 0)
            continue;
        spec->arch = s->arch;
        spec->n_vocab = s->n_vocab;
        spec->n_embd = s->n_embd;
        spec->n_layer = s->n_layer;
        spec->n_head = s->n_head;
        spec->n_head_kv = s->n_head_kv;
        spec->head_dim = s->head_dim;
        spec->n_ff = s->n_ff;
        spec->n_ctx = s->n_ctx;
        spec->rope_base = s->rope_base;
        spec->tied_embeddings = s->tied;
        *vocab_file = s->vocab;
        return 0;
    }
    return -1;
}

const char *blade_synth_shape_names(void)
{
    return "tinyllama-1.1b, llama-3.2-1b, qwen2.5-0.5b, smollm2-135m, llama-2-7b";
}

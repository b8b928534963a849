/* Loading a model (model.h): hyperparameters from the GGUF metadata with limits that keep
 * hostile values from sizing allocations, every tensor bound to the architecture by name
 * and shape (a tensor nothing binds is an error, not ignored), then the weights prepared
 * for the kernels in gguf_open's copy: projections repacked into the 16-row layouts and
 * gate and up fused into one matrix. */

#include "blade/model.h"

#include "blade/kernels.h"
#include "blade/types.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Limits far above any real model; they exist so that hostile metadata cannot drive size
 * arithmetic into overflow before the tensor shapes are cross-checked. */
#define MAX_DIM (1 << 20)
#define MAX_LAYERS 4096

static const char *const arch_names[] = {"llama", "qwen2", "qwen3"};

const char *blade_arch_name(blade_arch a)
{
    return arch_names[a];
}

blade_kv_store_config blade_model_kv_config(const blade_hparams *hp, blade_kv_type type, int32_t block_size,
                                            int32_t n_blocks)
{
    return (blade_kv_store_config){
        .n_layer = hp->n_layer,
        .n_head_kv = hp->n_head_kv,
        .head_dim = hp->head_dim,
        .type = type,
        .block_size = block_size,
        .n_blocks = n_blocks,
    };
}

static int get_dim(const gguf_file *f, const char *arch, const char *suffix, bool required,
                   int32_t fallback, int32_t *out, blade_error *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    uint64_t v;
    bool present = false;
    if (!gguf_get_u64(f, key, &v, &present, err)) {
        if (present)
            return -1;
        if (required)
            return blade_error_set(err, "missing metadata key %s", key);
        *out = fallback;
        return 0;
    }
    if (v == 0 || v > MAX_DIM)
        return blade_error_set(err, "metadata %s = %llu is out of range (1..%d)", key,
                               (unsigned long long)v, MAX_DIM);
    *out = (int32_t)v;
    return 0;
}

static int get_float(const gguf_file *f, const char *arch, const char *suffix, float fallback,
                     float *out, blade_error *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    bool present = false;
    if (!gguf_get_f32(f, key, out, &present, err)) {
        if (present)
            return -1;
        *out = fallback;
    }
    return 0;
}

static int read_hparams(const gguf_file *f, blade_hparams *hp, blade_error *err)
{
    bool present = false;
    char *arch = gguf_get_string(f, "general.architecture", &present, err);
    if (!arch)
        return present ? -1 : blade_error_set(err, "missing metadata key general.architecture");
    int found = -1;
    for (int i = 0; i < (int)(sizeof arch_names / sizeof arch_names[0]); i++)
        if (!strcmp(arch, arch_names[i]))
            found = i;
    if (found < 0) {
        blade_error_set(err, "architecture '%s' is not supported (supported: llama, qwen2, qwen3)", arch);
        free(arch);
        return -1;
    }
    free(arch);
    hp->arch = (blade_arch)found;
    hp->arch_name = arch_names[found];
    const char *a = hp->arch_name;

    if (get_dim(f, a, "embedding_length", true, 0, &hp->n_embd, err) ||
        get_dim(f, a, "block_count", true, 0, &hp->n_layer, err) ||
        get_dim(f, a, "feed_forward_length", true, 0, &hp->n_ff, err) ||
        get_dim(f, a, "attention.head_count", true, 0, &hp->n_head, err) ||
        get_dim(f, a, "attention.head_count_kv", false, hp->n_head, &hp->n_head_kv, err) ||
        get_dim(f, a, "context_length", false, 2048, &hp->n_ctx_train, err))
        return -1;
    if (hp->n_layer > MAX_LAYERS)
        return blade_error_set(err, "%s.block_count = %d exceeds %d", a, hp->n_layer, MAX_LAYERS);
    if (hp->n_head % hp->n_head_kv != 0)
        return blade_error_set(err, "%s.attention.head_count (%d) is not a multiple of head_count_kv (%d)",
                               a, hp->n_head, hp->n_head_kv);
    int32_t default_head_dim = hp->n_embd % hp->n_head == 0 ? hp->n_embd / hp->n_head : 0;
    if (get_dim(f, a, "attention.key_length", default_head_dim == 0, default_head_dim, &hp->head_dim, err))
        return -1;
    int32_t v_len = 0;
    if (get_dim(f, a, "attention.value_length", false, hp->head_dim, &v_len, err))
        return -1;
    if (v_len != hp->head_dim)
        return blade_error_set(err, "%s.attention.value_length (%d) differs from key_length (%d); not supported",
                               a, v_len, hp->head_dim);
    if (get_dim(f, a, "rope.dimension_count", false, hp->head_dim, &hp->n_rot, err))
        return -1;
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2 != 0)
        return blade_error_set(err, "%s.rope.dimension_count = %d must be even and at most the head size %d",
                               a, hp->n_rot, hp->head_dim);
    if (get_float(f, a, "attention.layer_norm_rms_epsilon", 1e-5f, &hp->rms_eps, err) ||
        get_float(f, a, "rope.freq_base", 10000.0f, &hp->rope_base, err))
        return -1;
    if (!(hp->rms_eps > 0.0f && hp->rms_eps < 1.0f))
        return blade_error_set(err, "%s.attention.layer_norm_rms_epsilon = %g is out of range", a, hp->rms_eps);
    /* Any finite base above 1 turns every pair by a well-defined angle; bases far above
     * real models' come from inflated models (synth.h). */
    if (!(hp->rope_base > 1.0f && hp->rope_base <= FLT_MAX))
        return blade_error_set(err, "%s.rope.freq_base = %g is out of range", a, hp->rope_base);

    hp->rope_scale = 1.0f;
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    char *scaling = gguf_get_string(f, key, &present, err);
    if (!scaling && present)
        return -1;
    float factor = 1.0f;
    if (get_float(f, a, "rope.scaling.factor", 1.0f, &factor, err))
        return -1;
    if (scaling && strcmp(scaling, "none") != 0 && strcmp(scaling, "linear") != 0) {
        blade_error_set(err, "%s = '%s' is not supported (supported: none, linear)", key, scaling);
        free(scaling);
        return -1;
    }
    bool linear = scaling ? !strcmp(scaling, "linear") : factor != 1.0f;
    free(scaling);
    if (linear) {
        if (!(factor >= 1.0f && factor <= 1024.0f))
            return blade_error_set(err, "%s.rope.scaling.factor = %g is out of range (1..1024)", a, factor);
        hp->rope_scale = factor;
    }
    hp->rope_neox = hp->arch != BLADE_ARCH_LLAMA;
    return 0;
}

/* Binding the file's tensors to the architecture's weights. Every tensor bound is marked
 * claimed; one the architecture has no use for would be silently ignored, so after binding
 * any unclaimed tensor is an error. */
typedef struct binder {
    const gguf_file *f;
    blade_model *m;
    bool *claimed; /* per tensor of f */
    blade_error *err;
} binder;

/* Binds a weight by name and checks its shape. n_out == 0 marks a vector. */
static int bind(binder *b, blade_weight *w, bool required, int64_t n_in, int64_t n_out, const char *fmt, int layer)
{
    blade_error *err = b->err;
    char name[128];
    snprintf(name, sizeof name, fmt, layer);
    const gguf_tensor *t = gguf_find_tensor(b->f, name);
    memset(w, 0, sizeof *w);
    if (!t)
        return required ? blade_error_set(err, "missing tensor %s", name) : 0;
    b->claimed[t - b->f->tensors] = true;
    int64_t want_out = n_out ? n_out : 1;
    uint32_t want_dims = n_out ? 2 : 1;
    if (t->n_dims > want_dims || t->ne[0] != n_in || t->ne[1] != want_out || t->ne[2] != 1 || t->ne[3] != 1)
        return blade_error_set(err, "tensor %s has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]",
                               name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                               (long long)t->ne[3], (long long)n_in, (long long)want_out);
    if (!n_out && t->type != BLADE_TYPE_F32)
        return blade_error_set(err, "tensor %s is a %s vector; norms and biases must be F32", name,
                               blade_type_traits_get(t->type) ? blade_type_traits_get(t->type)->name : "?");
    /* A legal file may choose an alignment below 4; the kernels read F32 vectors and
     * rows in place, so such data is refused rather than read misaligned. */
    if ((uintptr_t)t->data % 4 != 0)
        return blade_error_set(err, "tensor %s data is not 4-byte aligned (general.alignment %u)", name,
                               b->f->alignment);
    if (!blade_type_supported(t->type)) {
        const blade_type_traits *tr = blade_type_traits_get(t->type);
        return blade_error_set(err, "tensor %s has type %s, which blade cannot compute with yet", name,
                               tr ? tr->name : "?");
    }
    w->data = t->data;
    w->type = t->type;
    w->n_in = n_in;
    w->n_out = want_out;
    b->m->n_params += t->n_elements;
    b->m->weight_bytes += t->nbytes;
    return 0;
}

/* The layer a "blk.N.*" name is for, or -1 for any other name. */
static long layer_of(const char *name)
{
    if (strncmp(name, "blk.", 4) != 0)
        return -1;
    long n = 0;
    const char *p = name + 4;
    for (; *p >= '0' && *p <= '9' && n <= MAX_LAYERS; p++)
        n = n * 10 + (*p - '0');
    return p > name + 4 && *p == '.' ? n : -1;
}

/* The first tensor (in file order) nothing bound: a layer beyond block_count means the
 * metadata describes fewer layers than the file holds, which would run a truncated model. */
static int refuse_unclaimed(const binder *b)
{
    const blade_hparams *hp = &b->m->hp;
    for (uint64_t i = 0; i < b->f->n_tensors; i++) {
        if (b->claimed[i])
            continue;
        const char *name = b->f->tensors[i].name;
        long layer = layer_of(name);
        if (layer >= hp->n_layer)
            return blade_error_set(b->err,
                                   "unexpected tensor %s: it is for layer %ld, but %s.block_count is %d (layers 0..%d); "
                                   "the metadata does not describe the tensors the file holds",
                                   name, layer, hp->arch_name, hp->n_layer, hp->n_layer - 1);
        return blade_error_set(b->err, "unexpected tensor %s: the %s architecture has no such tensor", name,
                               hp->arch_name);
    }
    return 0;
}

/* The factors divide rotation frequencies: each must be a positive, finite number. */
static int check_rope_freqs(const blade_weight *w, blade_error *err)
{
    const float *f = w->data;
    for (int64_t i = 0; f && i < w->n_in; i++)
        if (!(f[i] > 0.0f && isfinite(f[i])))
            return blade_error_set(err, "rope_freqs.weight[%lld] = %g is not a positive finite factor", (long long)i,
                                   (double)f[i]);
    return 0;
}

static int bind_weights(blade_model *m, blade_error *err)
{
    const gguf_file *f = m->file;
    const blade_hparams *hp = &m->hp;
    int64_t d = hp->n_embd, q_dim = (int64_t)hp->n_head * hp->head_dim,
            kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    binder b = {f, m, calloc(f->n_tensors ? f->n_tensors : 1, sizeof(bool)), err};
    if (!b.claimed)
        return blade_error_set(err, "out of memory");
    int rc = -1;
    if (bind(&b, &m->tok_embd, true, d, hp->n_vocab, "token_embd.weight", 0) ||
        bind(&b, &m->output_norm, true, d, 0, "output_norm.weight", 0) ||
        bind(&b, &m->output, false, d, hp->n_vocab, "output.weight", 0) ||
        bind(&b, &m->rope_freqs, false, hp->n_rot / 2, 0, "rope_freqs.weight", 0) ||
        check_rope_freqs(&m->rope_freqs, err))
        goto out;
    m->hp.tied_embeddings = m->output.data == NULL;
    if (m->hp.tied_embeddings)
        m->output = m->tok_embd;

    bool bias = hp->arch == BLADE_ARCH_QWEN2;
    bool qk_norm = hp->arch == BLADE_ARCH_QWEN3;
    for (int i = 0; i < hp->n_layer; i++) {
        blade_layer *l = &m->layers[i];
        if (bind(&b, &l->attn_norm, true, d, 0, "blk.%d.attn_norm.weight", i) ||
            bind(&b, &l->wq, true, d, q_dim, "blk.%d.attn_q.weight", i) ||
            bind(&b, &l->wk, true, d, kv_dim, "blk.%d.attn_k.weight", i) ||
            bind(&b, &l->wv, true, d, kv_dim, "blk.%d.attn_v.weight", i) ||
            bind(&b, &l->wo, true, q_dim, d, "blk.%d.attn_output.weight", i) ||
            bind(&b, &l->bq, bias, q_dim, 0, "blk.%d.attn_q.bias", i) ||
            bind(&b, &l->bk, bias, kv_dim, 0, "blk.%d.attn_k.bias", i) ||
            bind(&b, &l->bv, bias, kv_dim, 0, "blk.%d.attn_v.bias", i) ||
            bind(&b, &l->q_norm, qk_norm, hp->head_dim, 0, "blk.%d.attn_q_norm.weight", i) ||
            bind(&b, &l->k_norm, qk_norm, hp->head_dim, 0, "blk.%d.attn_k_norm.weight", i) ||
            bind(&b, &l->ffn_norm, true, d, 0, "blk.%d.ffn_norm.weight", i) ||
            bind(&b, &l->ffn_gate, true, d, hp->n_ff, "blk.%d.ffn_gate.weight", i) ||
            bind(&b, &l->ffn_up, true, d, hp->n_ff, "blk.%d.ffn_up.weight", i) ||
            bind(&b, &l->ffn_down, true, hp->n_ff, d, "blk.%d.ffn_down.weight", i))
            goto out;
    }
    rc = refuse_unclaimed(&b);
out:
    free(b.claimed);
    return rc;
}

/* Q4_0/Q8_0/Q4_K/Q6_K projections are rearranged in place into the kernels' 16-row layout
 * (kernels.h, R16), which multiplies about twice as fast as the file's. The token
 * embedding is read a row at a time and keeps the file layout, and so does an output
 * matrix tied to it. Only gguf_open's in-memory copy is rearranged: a file too large to
 * copy, or memory the caller owns, keeps the file layout and the kernels for it. */
static void repack(blade_model *m, uint8_t *base, blade_weight *w)
{
    uint32_t packed = blade_matmul_repacked_type(w->type, w->n_in, w->n_out);
    if (!packed)
        return;
    blade_matmul_repack(w->type, base + ((const uint8_t *)w->data - m->file->map), w->n_in, w->n_out);
    w->type = packed;
}

/* The gate and up projections read the same input and a decode step streams both. Side by
 * side, a thread working through pieces of each reads from two places at once, which
 * measured about 7% slower than one stream. Where the two sit back to back in the copy,
 * with one type and shape, they are interleaved in place into one matrix whose row groups
 * alternate (model.h): a piece of it is one stream and holds both inputs of SwiGLU for
 * its rows. `scratch` keeps the copy of both between layers. */
static int fuse_gate_up(const blade_model *m, uint8_t *base, blade_layer *L, uint8_t **scratch, size_t *scratch_bytes)
{
    blade_weight *g = &L->ffn_gate, *u = &L->ffn_up;
    const int64_t G = BLADE_GATE_UP_GROUP;
    size_t row = blade_matmul_row_bytes(g->type, g->n_in), bytes = row * (size_t)g->n_out;
    if (g->type != u->type || g->n_in != u->n_in || g->n_out != u->n_out || g->n_out % G ||
        G % blade_matmul_row_align(g->type) || (const uint8_t *)u->data != (const uint8_t *)g->data + bytes)
        return 0;
    if (*scratch_bytes < 2 * bytes) {
        uint8_t *grown = realloc(*scratch, 2 * bytes);
        if (!grown)
            return -1;
        *scratch = grown;
        *scratch_bytes = 2 * bytes;
    }
    uint8_t *dst = base + ((const uint8_t *)g->data - m->file->map);
    memcpy(*scratch, dst, 2 * bytes);
    size_t group = row * (size_t)G;
    for (int64_t k = 0; k < g->n_out / G; k++) {
        memcpy(dst + 2 * k * group, *scratch + k * group, group);
        memcpy(dst + (2 * k + 1) * group, *scratch + bytes + k * group, group);
    }
    L->ffn_gate_up = (blade_weight){g->data, g->type, g->n_in, 2 * g->n_out};
    g->data = u->data = NULL;
    return 0;
}

static int prepare_weights(blade_model *m, blade_error *err)
{
    uint8_t *base = gguf_set_writable(m->file, true);
    if (!base)
        return 0;
    if (!m->hp.tied_embeddings)
        repack(m, base, &m->output);
    uint8_t *scratch = NULL;
    size_t scratch_bytes = 0;
    int rc = 0;
    for (int l = 0; l < m->hp.n_layer && rc == 0; l++) {
        blade_layer *L = &m->layers[l];
        blade_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->ffn_gate, &L->ffn_up, &L->ffn_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            repack(m, base, ws[i]);
        rc = fuse_gate_up(m, base, L, &scratch, &scratch_bytes);
    }
    free(scratch);
    gguf_set_writable(m->file, false);
    return rc ? blade_error_set(err, "out of memory while fusing the gate and up projections") : 0;
}

blade_model *blade_model_from_gguf(gguf_file *f, blade_error *err)
{
    blade_model *m = calloc(1, sizeof *m);
    if (!m) {
        gguf_close(f);
        blade_error_set(err, "out of memory");
        return NULL;
    }
    m->file = f;
    if (read_hparams(f, &m->hp, err))
        goto fail;
    m->tokenizer = blade_tokenizer_load(f, err);
    if (!m->tokenizer)
        goto fail;
    m->hp.n_vocab = blade_tokenizer_n_vocab(m->tokenizer);
    m->layers = calloc((size_t)m->hp.n_layer, sizeof *m->layers);
    if (!m->layers) {
        blade_error_set(err, "out of memory");
        goto fail;
    }
    if (bind_weights(m, err) || prepare_weights(m, err))
        goto fail;
    return m;
fail:
    blade_model_free(m);
    return NULL;
}

blade_model *blade_model_load(const char *path, blade_error *err)
{
    gguf_file *f = gguf_open(path, err);
    if (!f)
        return NULL;
    blade_model *m = blade_model_from_gguf(f, err);
    if (!m)
        blade_error_prefix(err, "%s", path);
    return m;
}

void blade_model_free(blade_model *m)
{
    if (!m)
        return;
    blade_tokenizer_free(m->tokenizer);
    free(m->layers);
    gguf_close(m->file);
    free(m);
}

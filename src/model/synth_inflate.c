/* A small real llama model inflated to a big model's shape (synth.h): the file costs what
 * the big model costs per token and computes the small model's function.
 *
 * Source sizes are d (hidden), hd (head), H/KV heads, F (FFN), target sizes D, HD, H'/KV', F'.
 * Every source value lands in the first dimensions of the target's, every other weight is
 * noise (zero at noise 0), and at noise 0 each step below leaves the source's numbers as
 * they were:
 * - Residual stream: embedding, attention output and FFN down rows >= d are zero, so dims
 *   >= d of the residual stay exactly zero and dims < d equal the source's.
 * - RMSNorm: over D dims, sum(x^2) is the source's (the rest is zero), so the mean square is
 *   (d/D) times the source's. With eps' = eps * d/D the denominator is sqrt(d/D) times the
 *   source's, and norm weights scaled by sqrt(d/D) give the source's outputs on dims < d
 *   (and zeros elsewhere).
 * - Attention: source query head h goes to a target head that reads a target KV head holding
 *   h's KV head (several copies of a KV head when the target's groups are smaller). Q rows
 *   are scaled by sqrt(HD/hd), so q.k / sqrt(HD) is the source's q.k / sqrt(hd); K and V
 *   rows outside the source's dims are zero, so scores, softmax and the used dims of each
 *   head's output are the source's; attention output columns of unused heads and dims are
 *   zero.
 * - RoPE: source pair i, dims (2i, 2i+1), turns by base^(-2i/r) (r rotary dims). It goes to
 *   target pair i (dims 2i, 2i+1, or i and i+R/2 for NeoX-style targets) with the target
 *   rotating R = HD dims at base' = base^(HD/r), so base'^(-2i/HD) = base^(-2i/r). Where
 *   base' would overflow a float (e.g. hd 8 -> HD 128), the target rotates only its first r
 *   dims at the source's base instead.
 * - FFN: gate and up rows >= F are zero, so those units are silu(0) * 0 = 0, and down
 *   columns >= F do not matter.
 * - Layers: source layers are spread over the target's; the others have zero attention
 *   output and FFN down matrices (and zero norms), so they add nothing to the residual.
 * The classifier always gets a matrix of its own, so a tied target stays exact. */
#include "model/synth_internal.h"

#include "blade/kernels.h"
#include "blade/model.h"
#include "blade/types.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct inflation {
    synth s;
    const blade_synth_spec *t;
    const blade_hparams *hs;
    float noise;
    bool failed; /* out of memory: set where it happened, reported by emit */
    int64_t q_dim, kv_dim;     /* target */
    int32_t group_s, group_t;  /* query heads per KV head */
    int32_t kv_copies, kv_stride;
    float norm_scale, q_scale;
    int32_t qk_dim[256];       /* target head dim of each source Q/K head dim */
} inflation;

int32_t blade_synth_layer_position(int32_t i, int32_t n_source, int32_t n_target)
{
    if (n_source <= 1)
        return 0;
    return (int32_t)(((int64_t)i * (n_target - 1) + (n_source - 1) / 2) / (n_source - 1));
}

/* The target KV head holding copy c of source KV head j, spread over the target's. */
static int32_t target_kv_head(const inflation *f, int32_t j, int32_t c)
{
    return (j * f->kv_copies + c) * f->kv_stride;
}

static int32_t target_q_head(const inflation *f, int32_t h)
{
    int32_t j = h / f->group_s, r = h % f->group_s;
    return target_kv_head(f, j, r / f->group_t) * f->group_t + r % f->group_t;
}

/* n_out rows of n_in noise values (n_out == 0: a vector). */
static float *noise_values(inflation *f, int64_t n_in, int64_t n_out)
{
    size_t n = (size_t)n_in * (size_t)(n_out ? n_out : 1);
    float *v = malloc(n * sizeof *v);
    if (!v) {
        f->failed = true;
        return NULL;
    }
    if (f->noise == 0.0f)
        memset(v, 0, n * sizeof *v);
    else
        for (size_t i = 0; i < n; i++)
            v[i] = f->noise * synth_gaussian(&f->s);
    return v;
}

/* The source weight as floats, n_out rows of n_in. */
static float *source_values(inflation *f, const blade_weight *w)
{
    float *v = malloc((size_t)w->n_in * (size_t)w->n_out * sizeof *v);
    if (!v) {
        f->failed = true;
        return NULL;
    }
    for (int64_t r = 0; r < w->n_out; r++)
        blade_matmul_row_to_float(w->type, w->data, w->n_in, r, v + r * w->n_in);
    return v;
}

/* The source's gate (up == false) or up projection, also where the loader fused them. */
static float *source_ffn_in(inflation *f, const blade_layer *L, bool up)
{
    const blade_weight *gu = &L->ffn_gate_up;
    if (!gu->data)
        return source_values(f, up ? &L->ffn_up : &L->ffn_gate);
    int64_t n = gu->n_in, n_ff = gu->n_out / 2, G = BLADE_GATE_UP_GROUP;
    float *v = malloc((size_t)n * (size_t)n_ff * sizeof *v);
    if (!v) {
        f->failed = true;
        return NULL;
    }
    for (int64_t i = 0; i < n_ff; i++)
        blade_matmul_row_to_float(gu->type, gu->data, n, i / G * 2 * G + (up ? G : 0) + i % G, v + i * n);
    return v;
}

/* dst[dr + i][dc + j] = scale * src[sr + i][sc + j] for i < rows, j < cols; rows are
 * dst_in and src_in values long. */
static void place(float *dst, int64_t dst_in, int64_t dr, int64_t dc, const float *src, int64_t src_in, int64_t sr,
                  int64_t sc, int64_t rows, int64_t cols, float scale)
{
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            dst[(dr + i) * dst_in + dc + j] = scale * src[(sr + i) * src_in + sc + j];
}

/* Stores values (freed here) as tensor blk.<layer>.<suffix>, or <suffix> for layer < 0. */
static int emit(inflation *f, int layer, const char *suffix, int64_t n_in, int64_t n_out,
                float *values)
{
    if (!values || f->failed) {
        free(values);
        return blade_error_set(f->s.err, "out of memory for tensor %s", suffix);
    }
    char name[96];
    if (layer < 0)
        snprintf(name, sizeof name, "%s", suffix);
    else
        snprintf(name, sizeof name, "blk.%d.%s", layer, suffix);
    int rc = synth_add_values(&f->s, name, n_in, n_out, values);
    free(values);
    return rc;
}

/* A norm vector: the source's weights scaled for the wider mean (src NULL: all noise). */
static float *norm_values(inflation *f, const blade_weight *src)
{
    float *v = noise_values(f, f->t->n_embd, 0);
    float *w = v && src ? source_values(f, src) : NULL;
    for (int64_t i = 0; w && i < src->n_in; i++)
        v[i] = f->norm_scale * w[i];
    free(w);
    return v;
}

/* The Q, K or V projection (src NULL: all noise): each source head's rows go to the target
 * head chosen for it (every copy of a KV head), Q and K dims where the RoPE pairing puts
 * them (qk_dim), V dims in order. */
static float *attn_in_values(inflation *f, const blade_weight *src, int64_t n_out, bool query, bool rotated)
{
    int64_t D = f->t->n_embd, d = f->hs->n_embd, hd = f->hs->head_dim, HD = f->t->head_dim;
    float *v = noise_values(f, D, n_out);
    float *w = v && src ? source_values(f, src) : NULL;
    if (!w)
        return v;
    int32_t n_heads = query ? f->hs->n_head : f->hs->n_head_kv;
    for (int32_t h = 0; h < n_heads; h++)
        for (int32_t c = 0; c < (query ? 1 : f->kv_copies); c++) {
            int64_t head = query ? target_q_head(f, h) : target_kv_head(f, h, c);
            for (int64_t i = 0; i < hd; i++)
                place(v, D, head * HD + (rotated ? f->qk_dim[i] : i), 0, w, d, h * hd + i, 0, 1, d,
                      query ? f->q_scale : 1.0f);
        }
    free(w);
    return v;
}

/* A Qwen2 target's Q, K or V bias: zero where a source head's rows went (the source has
 * no bias), noise elsewhere. */
static float *bias_values(inflation *f, bool real, int64_t n, bool query, bool rotated)
{
    float *v = noise_values(f, n, 0);
    if (!v || !real)
        return v;
    int32_t n_heads = query ? f->hs->n_head : f->hs->n_head_kv;
    for (int32_t h = 0; h < n_heads; h++)
        for (int32_t c = 0; c < (query ? 1 : f->kv_copies); c++) {
            int64_t head = query ? target_q_head(f, h) : target_kv_head(f, h, c);
            for (int32_t i = 0; i < f->hs->head_dim; i++)
                v[head * f->t->head_dim + (rotated ? f->qk_dim[i] : i)] = 0.0f;
        }
    return v;
}

static float *attn_out_values(inflation *f, const blade_weight *src)
{
    int64_t D = f->t->n_embd, d = f->hs->n_embd, hd = f->hs->head_dim;
    float *v = noise_values(f, f->q_dim, D);
    float *w = v && src ? source_values(f, src) : NULL;
    if (!w)
        return v;
    for (int32_t h = 0; h < f->hs->n_head; h++)
        place(v, f->q_dim, 0, (int64_t)target_q_head(f, h) * f->t->head_dim, w, (int64_t)f->hs->n_head * hd, 0,
              h * hd, d, hd, 1.0f);
    free(w);
    return v;
}

/* A matrix whose source (freed here; NULL: none) occupies its top-left corner: FFN,
 * embedding, classifier. */
static float *corner_values(inflation *f, float *src, int64_t n_in, int64_t n_out, int64_t src_in, int64_t src_out)
{
    float *v = noise_values(f, n_in, n_out);
    if (v && src)
        place(v, n_in, 0, 0, src, src_in, 0, 0, src_out, src_in, 1.0f);
    free(src);
    return v;
}

/* Target layer l, holding source layer L, or an identity layer when L is NULL. */
static int write_layer(inflation *f, int l, const blade_layer *L)
{
    const blade_synth_spec *t = f->t;
    const blade_hparams *hs = f->hs;
    int64_t D = t->n_embd;
    int rc = emit(f, l, "attn_norm.weight", D, 0, norm_values(f, L ? &L->attn_norm : NULL)) ||
             emit(f, l, "attn_q.weight", D, f->q_dim, attn_in_values(f, L ? &L->wq : NULL, f->q_dim, true, true)) ||
             emit(f, l, "attn_k.weight", D, f->kv_dim, attn_in_values(f, L ? &L->wk : NULL, f->kv_dim, false, true)) ||
             emit(f, l, "attn_v.weight", D, f->kv_dim,
                  attn_in_values(f, L ? &L->wv : NULL, f->kv_dim, false, false)) ||
             emit(f, l, "attn_output.weight", f->q_dim, D, attn_out_values(f, L ? &L->wo : NULL)) ||
             emit(f, l, "ffn_norm.weight", D, 0, norm_values(f, L ? &L->ffn_norm : NULL)) ||
             emit(f, l, "ffn_gate.weight", D, t->n_ff,
                  corner_values(f, L ? source_ffn_in(f, L, false) : NULL, D, t->n_ff, hs->n_embd, hs->n_ff)) ||
             emit(f, l, "ffn_up.weight", D, t->n_ff,
                  corner_values(f, L ? source_ffn_in(f, L, true) : NULL, D, t->n_ff, hs->n_embd, hs->n_ff)) ||
             emit(f, l, "ffn_down.weight", t->n_ff, D,
                  corner_values(f, L ? source_values(f, &L->ffn_down) : NULL, t->n_ff, D, hs->n_ff, hs->n_embd));
    if (!rc && t->arch == BLADE_ARCH_QWEN2)
        rc = emit(f, l, "attn_q.bias", f->q_dim, 0, bias_values(f, L, f->q_dim, true, true)) ||
             emit(f, l, "attn_k.bias", f->kv_dim, 0, bias_values(f, L, f->kv_dim, false, true)) ||
             emit(f, l, "attn_v.bias", f->kv_dim, 0, bias_values(f, L, f->kv_dim, false, false));
    return rc ? -1 : 0;
}

/* Checks that the target can hold the source and works out where everything goes. */
static int plan(inflation *f, blade_synth_spec *t, blade_error *err)
{
    const blade_hparams *hs = f->hs;
    if (hs->arch != BLADE_ARCH_LLAMA)
        return blade_error_set(err, "the source is a %s model; only llama models (no biases, no Q/K norms) can be "
                               "inflated", hs->arch_name);
    if (t->arch == BLADE_ARCH_QWEN3)
        return blade_error_set(err, "a qwen3 target normalizes each query and key head, which would change the "
                               "source's attention; choose a llama or qwen2 shape");
    if (t->n_head_kv <= 0 || t->n_head % t->n_head_kv || t->head_dim % 2)
        return blade_error_set(err, "the target's %d query heads, %d KV heads and head size %d do not make a model",
                               t->n_head, t->n_head_kv, t->head_dim);
    struct {
        const char *what;
        int32_t target, source;
    } dims[] = {
        {"hidden size", t->n_embd, hs->n_embd}, {"head size", t->head_dim, hs->head_dim},
        {"FFN size", t->n_ff, hs->n_ff},         {"layer count", t->n_layer, hs->n_layer},
        {"query head count", t->n_head, hs->n_head},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].target < dims[i].source)
            return blade_error_set(err, "the target's %s (%d) is smaller than the source's (%d)", dims[i].what,
                                   dims[i].target, dims[i].source);
    if (hs->head_dim > (int32_t)(sizeof f->qk_dim / sizeof f->qk_dim[0]))
        return blade_error_set(err, "the source's head size %d is above %zu", hs->head_dim,
                               sizeof f->qk_dim / sizeof f->qk_dim[0]);
    f->group_s = hs->n_head / hs->n_head_kv;
    f->group_t = t->n_head / t->n_head_kv;
    f->kv_copies = (f->group_s + f->group_t - 1) / f->group_t;
    if (hs->n_head_kv * f->kv_copies > t->n_head_kv)
        return blade_error_set(err, "the source's %d KV heads each serve %d query heads; a target whose KV heads "
                               "serve %d query heads each needs %d KV heads to hold them, and has %d",
                               hs->n_head_kv, f->group_s, f->group_t, hs->n_head_kv * f->kv_copies, t->n_head_kv);
    f->kv_stride = t->n_head_kv / (hs->n_head_kv * f->kv_copies);
    f->q_dim = (int64_t)t->n_head * t->head_dim;
    f->kv_dim = (int64_t)t->n_head_kv * t->head_dim;
    f->norm_scale = (float)sqrt((double)hs->n_embd / t->n_embd);
    f->q_scale = (float)sqrt((double)t->head_dim / hs->head_dim);

    double base = pow((double)hs->rope_base, (double)t->head_dim / hs->n_rot);
    bool full = hs->n_rot == hs->head_dim && base <= FLT_MAX;
    t->n_rot = full ? t->head_dim : hs->n_rot;
    t->rope_base = full ? (float)base : hs->rope_base;
    t->rope_scale = hs->rope_scale;
    t->rms_eps = (float)((double)hs->rms_eps * hs->n_embd / t->n_embd);
    bool neox = t->arch != BLADE_ARCH_LLAMA;
    for (int32_t i = 0; i < hs->head_dim; i++)
        f->qk_dim[i] = i >= hs->n_rot ? t->n_rot + (i - hs->n_rot) : neox ? i / 2 + (i % 2) * (t->n_rot / 2) : i;
    return 0;
}

static char *inflated_name(const gguf_file *src)
{
    bool present = false;
    blade_error ignored = {{0}};
    char *name = gguf_get_string(src, "general.name", &present, &ignored);
    char *out = NULL;
    if (asprintf(&out, "%s inflated by blade synth", name ? name : "model") < 0)
        out = NULL;
    free(name);
    return out;
}

int blade_synth_inflate(const blade_synth_spec *spec, const char *from_path, float noise, const char *path,
                        bool show_progress, blade_synth_inflation *info, blade_error *err)
{
    if (synth_check_types(spec, err))
        return -1;
    if (!(noise >= 0.0f && noise <= 1.0f))
        return blade_error_set(err, "noise %g is outside 0..1", noise);
    blade_model *m = blade_model_load(from_path, err);
    if (!m)
        return -1;
    blade_synth_spec t = *spec;
    t.n_vocab = m->hp.n_vocab;
    t.tied_embeddings = false;
    inflation f = {.t = &t, .hs = &m->hp, .noise = noise};
    if (plan(&f, &t, err)) {
        blade_error_prefix(err, "%s", from_path);
        blade_model_free(m);
        return -1;
    }
    if (info)
        *info = (blade_synth_inflation){m->hp, t.n_rot, t.rope_base, t.rms_eps, f.kv_copies};
    synth_init(&f.s, &t, err);
    synth_set_hparams(f.s.w, &t);
    char *name = inflated_name(m->file);
    if (name)
        gguf_writer_set_string(f.s.w, "general.name", name);
    free(name);
    gguf_writer_copy_kv_prefix(f.s.w, m->file, "tokenizer.");

    int64_t D = t.n_embd, d = m->hp.n_embd, V = t.n_vocab;
    int rc = emit(&f, -1, "token_embd.weight", D, V,
                  corner_values(&f, source_values(&f, &m->tok_embd), D, V, d, V));
    for (int l = 0, next = 0; !rc && l < t.n_layer; l++) {
        if (show_progress)
            fprintf(stderr, "\rgenerating layer %d/%d ", l + 1, t.n_layer);
        bool real = next < m->hp.n_layer && blade_synth_layer_position(next, m->hp.n_layer, t.n_layer) == l;
        rc = write_layer(&f, l, real ? &m->layers[next] : NULL);
        next += real;
    }
    if (!rc)
        rc = emit(&f, -1, "output_norm.weight", D, 0, norm_values(&f, &m->output_norm)) ||
             emit(&f, -1, "output.weight", D, V,
                  corner_values(&f, source_values(&f, &m->output), D, V, d, V));
    if (show_progress)
        fputc('\n', stderr);
    rc = synth_finish(&f.s, rc, path, show_progress);
    blade_model_free(m);
    return rc;
}

/* The reference forward pass (forward.h): one token at a time, f32 throughout, read top to
 * bottom like llama2.c's run.c. Slow on purpose: it is the oracle the batched runner's
 * logits are checked against. */

#include "blade/forward.h"

#include "blade/act_stats.h"
#include "blade/kernels.h"
#include "blade/types.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct blade_forward {
    const blade_model *m;
    int32_t n_ctx;
    int32_t n_cached;
    float *key_cache;   /* [layer][pos][kv_dim] */
    float *value_cache; /* [layer][pos][kv_dim] */
    float *x, *xb, *xb2, *q, *k, *v, *att, *hb, *hb2, *logits;
    float *row; /* one dequantized weight row */
    float *vec; /* a dequantized norm or bias vector */
    blade_act_stats *stats;
};

static void *zalloc(size_t n, size_t size, bool *ok)
{
    void *p = calloc(n ? n : 1, size);
    if (!p)
        *ok = false;
    return p;
}

blade_forward *blade_forward_new(const blade_model *m, int32_t n_ctx, blade_error *err)
{
    const blade_hparams *hp = &m->hp;
    if (n_ctx <= 0)
        n_ctx = hp->n_ctx_train;
    blade_forward *f = calloc(1, sizeof *f);
    if (!f) {
        blade_error_set(err, "out of memory");
        return NULL;
    }
    size_t kv_dim = (size_t)hp->n_head_kv * hp->head_dim;
    size_t q_dim = (size_t)hp->n_head * hp->head_dim;
    size_t widest = (size_t)hp->n_embd;
    if (q_dim > widest)
        widest = q_dim;
    if ((size_t)hp->n_ff > widest)
        widest = hp->n_ff;
    bool ok = true;
    f->m = m;
    f->n_ctx = n_ctx;
    f->key_cache = zalloc((size_t)hp->n_layer * n_ctx * kv_dim, sizeof(float), &ok);
    f->value_cache = zalloc((size_t)hp->n_layer * n_ctx * kv_dim, sizeof(float), &ok);
    f->x = zalloc(hp->n_embd, sizeof(float), &ok);
    f->xb = zalloc(widest, sizeof(float), &ok);
    f->xb2 = zalloc(hp->n_embd, sizeof(float), &ok);
    f->q = zalloc(q_dim, sizeof(float), &ok);
    f->k = zalloc(kv_dim, sizeof(float), &ok);
    f->v = zalloc(kv_dim, sizeof(float), &ok);
    f->att = zalloc(n_ctx, sizeof(float), &ok);
    f->hb = zalloc(hp->n_ff, sizeof(float), &ok);
    f->hb2 = zalloc(hp->n_ff, sizeof(float), &ok);
    f->logits = zalloc(hp->n_vocab, sizeof(float), &ok);
    f->row = zalloc(widest, sizeof(float), &ok);
    f->vec = zalloc(widest, sizeof(float), &ok);
    if (!ok) {
        blade_forward_free(f);
        blade_error_set(err, "out of memory for a %d-token context", n_ctx);
        return NULL;
    }
    return f;
}

void blade_forward_free(blade_forward *f)
{
    if (!f)
        return;
    free(f->key_cache);
    free(f->value_cache);
    free(f->x);
    free(f->xb);
    free(f->xb2);
    free(f->q);
    free(f->k);
    free(f->v);
    free(f->att);
    free(f->hb);
    free(f->hb2);
    free(f->logits);
    free(f->row);
    free(f->vec);
    free(f);
}

int32_t blade_forward_n_ctx(const blade_forward *f)
{
    return f->n_ctx;
}

int blade_forward_set_act_stats(blade_forward *f, blade_act_stats *s, blade_error *err)
{
    if (s && !blade_act_stats_fits(s, &f->m->hp))
        return blade_error_set(err, "the activation statistics were made for a model of another shape");
    f->stats = s;
    return 0;
}

/* The activation row a site's matrices are about to read joins the statistics. */
static void record(blade_forward *f, int site, const float *x)
{
    if (!f->stats)
        return;
    blade_act_stats_add(f->stats, site, x, 1, 0, 0, blade_act_stats_get(f->stats, site).width);
    blade_act_stats_count(f->stats, site, 1);
}

static const float *weight_row(const blade_weight *w, int64_t r, float *buf)
{
    blade_matmul_row_to_float(w->type, w->data, w->n_in, r, buf);
    return buf;
}

static float row_dot(const blade_weight *w, int64_t r, const float *x, float *row)
{
    const float *wr = weight_row(w, r, row);
    float sum = 0.0f;
    for (int64_t i = 0; i < w->n_in; i++)
        sum += wr[i] * x[i];
    return sum;
}

/* out[r] = W[r,:] . x for every row */
static void matvec(float *out, const blade_weight *w, const float *x, float *row)
{
    for (int64_t r = 0; r < w->n_out; r++)
        out[r] = row_dot(w, r, x, row);
}

/* The gate projection into gate and the up projection into up, from the matrix the loader
 * fused them into where it did (model.h). */
static void gate_up_matvec(float *gate, float *up, const blade_layer *L, const float *x, float *row)
{
    const blade_weight *gu = &L->ffn_gate_up;
    if (!gu->data) {
        matvec(gate, &L->ffn_gate, x, row);
        matvec(up, &L->ffn_up, x, row);
        return;
    }
    for (int64_t r = 0; r < gu->n_out; r++) {
        int64_t group = r / BLADE_GATE_UP_GROUP, i = group / 2 * BLADE_GATE_UP_GROUP + r % BLADE_GATE_UP_GROUP;
        (group % 2 ? up : gate)[i] = row_dot(gu, r, x, row);
    }
}

static void add_bias(float *x, const blade_weight *b, float *buf)
{
    if (!b->data)
        return;
    const float *bv = weight_row(b, 0, buf);
    for (int64_t i = 0; i < b->n_in; i++)
        x[i] += bv[i];
}

static void rmsnorm(float *out, const float *x, const blade_weight *w, int64_t n, float eps, float *buf)
{
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float scale = (float)(1.0 / sqrt(ss / (double)n + eps));
    const float *wv = weight_row(w, 0, buf);
    for (int64_t i = 0; i < n; i++)
        out[i] = x[i] * scale * wv[i];
}

/* Rotates the first n_rot dims of one head. Llama GGUFs pair adjacent dims (2i, 2i+1);
 * NeoX-style models pair dims half a rotation apart (i, i + n_rot/2). */
static void rope(float *head, int32_t pos, const blade_hparams *hp, const float *freq_factors)
{
    int half = hp->n_rot / 2;
    float p = (float)pos / hp->rope_scale;
    for (int i = 0; i < half; i++) {
        float inv_freq = powf(hp->rope_base, -2.0f * (float)i / (float)hp->n_rot);
        if (freq_factors)
            inv_freq /= freq_factors[i];
        float theta = p * inv_freq;
        float c = cosf(theta), s = sinf(theta);
        int a = hp->rope_neox ? i : 2 * i;
        int b = hp->rope_neox ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

static void softmax(float *x, int n)
{
    float max = x[0];
    for (int i = 1; i < n; i++)
        if (x[i] > max)
            max = x[i];
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    for (int i = 0; i < n; i++)
        x[i] = (float)(x[i] / sum);
}

static float silu(float x)
{
    return x / (1.0f + expf(-x));
}

static void attention(blade_forward *f, int layer, int32_t pos)
{
    const blade_hparams *hp = &f->m->hp;
    int hd = hp->head_dim;
    int kv_dim = hp->n_head_kv * hd;
    int group = hp->n_head / hp->n_head_kv;
    const float *keys = f->key_cache + (size_t)layer * f->n_ctx * kv_dim;
    const float *values = f->value_cache + (size_t)layer * f->n_ctx * kv_dim;
    float inv_sqrt = 1.0f / sqrtf((float)hd);
    for (int h = 0; h < hp->n_head; h++) {
        const float *q = f->q + (size_t)h * hd;
        int kvh = h / group;
        for (int t = 0; t <= pos; t++) {
            const float *k = keys + (size_t)t * kv_dim + (size_t)kvh * hd;
            float s = 0.0f;
            for (int i = 0; i < hd; i++)
                s += q[i] * k[i];
            f->att[t] = s * inv_sqrt;
        }
        softmax(f->att, pos + 1);
        float *out = f->xb + (size_t)h * hd;
        memset(out, 0, (size_t)hd * sizeof(float));
        for (int t = 0; t <= pos; t++) {
            const float *v = values + (size_t)t * kv_dim + (size_t)kvh * hd;
            float a = f->att[t];
            for (int i = 0; i < hd; i++)
                out[i] += a * v[i];
        }
    }
}

const float *blade_forward_logits(const blade_forward *f)
{
    return f->logits;
}

int blade_forward_token(blade_forward *f, int32_t token, int32_t pos, bool want_logits, blade_error *err)
{
    const blade_model *m = f->m;
    const blade_hparams *hp = &m->hp;
    if (token < 0 || token >= hp->n_vocab) {
        return blade_error_set(err, "token id %d is outside the vocabulary (0..%d)", token, hp->n_vocab - 1);
    }
    if (pos < 0 || pos >= f->n_ctx || pos > f->n_cached) {
        return blade_error_set(err, "position %d is invalid (context %d, %d positions cached)", pos,
                               f->n_ctx, f->n_cached);
    }
    int d = hp->n_embd, hd = hp->head_dim;
    int kv_dim = hp->n_head_kv * hd;

    weight_row(&m->tok_embd, token, f->x);

    for (int l = 0; l < hp->n_layer; l++) {
        const blade_layer *L = &m->layers[l];

        rmsnorm(f->xb, f->x, &L->attn_norm, d, hp->rms_eps, f->vec);
        record(f, blade_act_site(l, BLADE_ACT_ATTN_IN), f->xb);
        matvec(f->q, &L->wq, f->xb, f->row);
        matvec(f->k, &L->wk, f->xb, f->row);
        matvec(f->v, &L->wv, f->xb, f->row);
        add_bias(f->q, &L->bq, f->vec);
        add_bias(f->k, &L->bk, f->vec);
        add_bias(f->v, &L->bv, f->vec);
        for (int h = 0; h < hp->n_head; h++) {
            float *qh = f->q + (size_t)h * hd;
            if (L->q_norm.data)
                rmsnorm(qh, qh, &L->q_norm, hd, hp->rms_eps, f->vec);
            rope(qh, pos, hp, m->rope_freqs.data);
        }
        for (int h = 0; h < hp->n_head_kv; h++) {
            float *kh = f->k + (size_t)h * hd;
            if (L->k_norm.data)
                rmsnorm(kh, kh, &L->k_norm, hd, hp->rms_eps, f->vec);
            rope(kh, pos, hp, m->rope_freqs.data);
        }
        size_t slot = ((size_t)l * f->n_ctx + pos) * kv_dim;
        memcpy(f->key_cache + slot, f->k, (size_t)kv_dim * sizeof(float));
        memcpy(f->value_cache + slot, f->v, (size_t)kv_dim * sizeof(float));

        attention(f, l, pos);
        record(f, blade_act_site(l, BLADE_ACT_ATTN_OUT), f->xb);
        matvec(f->xb2, &L->wo, f->xb, f->row);
        for (int i = 0; i < d; i++)
            f->x[i] += f->xb2[i];

        rmsnorm(f->xb, f->x, &L->ffn_norm, d, hp->rms_eps, f->vec);
        record(f, blade_act_site(l, BLADE_ACT_FFN_IN), f->xb);
        gate_up_matvec(f->hb, f->hb2, L, f->xb, f->row);
        for (int i = 0; i < hp->n_ff; i++)
            f->hb[i] = silu(f->hb[i]) * f->hb2[i];
        record(f, blade_act_site(l, BLADE_ACT_FFN_ACT), f->hb);
        matvec(f->xb2, &L->ffn_down, f->hb, f->row);
        for (int i = 0; i < d; i++)
            f->x[i] += f->xb2[i];
    }
    f->n_cached = pos + 1;
    if (want_logits) {
        rmsnorm(f->x, f->x, &m->output_norm, d, hp->rms_eps, f->vec);
        record(f, blade_act_classifier_site(hp->n_layer), f->x);
        matvec(f->logits, &m->output, f->x, f->row);
    }
    return 0;
}

/* A lower-precision copy of a model's first layers, made at load for self-draft (spec.h):
 * every projection and the classifier requantized to a smaller type, in the layout the
 * kernels want, the rest (embeddings, norms, biases, tokenizer) shared with the model. A
 * speculative step then streams the copy's bytes per drafted token instead of the target's,
 * and the copy, computing nearly the target's function, agrees with it far more often than
 * a separate small model would. */

#include "blade/kernels.h"
#include "blade/model.h"
#include "blade/types.h"

#include <stdlib.h>
#include <string.h>

typedef struct lowered {
    blade_model m; /* first, so the model pointer is the copy's */
    uint8_t *weights;
} lowered;

/* Bytes of w requantized to type, in the kernels' layout, rounded up to whole lines. */
static size_t lowered_bytes(const blade_weight *w, uint32_t type)
{
    uint32_t packed = blade_matmul_repacked_type(type, w->n_in, w->n_out);
    return (blade_matmul_row_bytes(packed ? packed : type, w->n_in) * (size_t)w->n_out + 63) / 64 * 64;
}

/* Rows of w as floats, quantized to type at dst (row-major, the file layout), then
 * repacked where the kernels have a layout for the shape: row order, and with it a fused
 * gate/up matrix's alternating groups, is kept. */
static void lower(blade_weight *w, uint32_t type, uint8_t *dst, float *row)
{
    const blade_type_traits *tr = blade_type_traits_get(type);
    size_t row_bytes = blade_type_row_bytes(type, w->n_in);
    for (int64_t r = 0; r < w->n_out; r++) {
        blade_matmul_row_to_float(w->type, w->data, w->n_in, r, row);
        tr->from_float(row, dst + (size_t)r * row_bytes, w->n_in);
    }
    uint32_t packed = blade_matmul_repacked_type(type, w->n_in, w->n_out);
    if (packed)
        blade_matmul_repack(type, dst, w->n_in, w->n_out);
    w->data = dst;
    w->type = packed ? packed : type;
}

/* The weights lowered: every projection present, and the classifier, whose rows split
 * into the type's blocks; the others stay the model's. */
static int lowered_weights(blade_model *m, int64_t block, blade_weight **ws, int cap)
{
    int n = 0;
    if (m->output.n_in % block == 0)
        ws[n++] = &m->output;
    for (int l = 0; l < m->hp.n_layer; l++) {
        blade_layer *L = &m->layers[l];
        blade_weight *all[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->ffn_gate, &L->ffn_up, &L->ffn_gate_up, &L->ffn_down};
        for (size_t i = 0; i < sizeof all / sizeof all[0] && n < cap; i++)
            if (all[i]->data && all[i]->n_in % block == 0)
                ws[n++] = all[i];
    }
    return n;
}

blade_model *blade_model_lowered(const blade_model *m, int32_t n_layers, uint32_t type, blade_error *err)
{
    const blade_type_traits *tr = blade_type_traits_get(type);
    if (!tr || !tr->from_float || !blade_matmul_supported(type))
        return blade_error_set(err, "type %s cannot hold a lower-precision copy", tr ? tr->name : "?"), NULL;
    if (n_layers < 1 || n_layers > m->hp.n_layer)
        return blade_error_set(err, "a copy of %d layers of a %d-layer model", n_layers, m->hp.n_layer), NULL;
    lowered *c = calloc(1, sizeof *c);
    blade_layer *layers = calloc((size_t)n_layers, sizeof *layers);
    int cap = 1 + 8 * n_layers;
    blade_weight **ws = calloc((size_t)cap, sizeof *ws);
    float *row = NULL;
    if (!c || !layers || !ws)
        goto oom;
    c->m = *m;
    c->m.file = NULL;
    c->m.hp.n_layer = n_layers;
    memcpy(layers, m->layers, (size_t)n_layers * sizeof *layers);
    c->m.layers = layers;
    int n = lowered_weights(&c->m, tr->block_size, ws, cap);
    if (n == 0) {
        blade_error_set(err, "no weight of the model splits into %s blocks of %d", tr->name, (int)tr->block_size);
        goto fail;
    }
    size_t total = 0;
    int64_t widest = 0;
    for (int i = 0; i < n; i++) {
        total += lowered_bytes(ws[i], type);
        widest = ws[i]->n_in > widest ? ws[i]->n_in : widest;
    }
    if (!(c->weights = aligned_alloc(64, total ? total : 64)) || !(row = malloc(sizeof(float) * (size_t)widest)))
        goto oom;
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        size_t bytes = lowered_bytes(ws[i], type);
        lower(ws[i], type, c->weights + at, row);
        at += bytes;
    }
    /* a fused gate/up keeps its halves' types in step with it (model.h) */
    for (int l = 0; l < n_layers; l++)
        if (layers[l].ffn_gate_up.data)
            layers[l].ffn_gate.type = layers[l].ffn_up.type = layers[l].ffn_gate_up.type;
    c->m.weight_bytes = total;
    free(row);
    free(ws);
    return &c->m;
oom:
    blade_error_set(err, "out of memory for a %s copy of the model", tr->name);
fail:
    free(row);
    free(ws);
    free(layers);
    if (c)
        free(c->weights);
    free(c);
    return NULL;
}

void blade_model_lowered_free(blade_model *m)
{
    if (!m)
        return;
    lowered *c = (lowered *)m;
    free(c->weights);
    free(c->m.layers);
    free(c);
}

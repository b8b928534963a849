#ifndef BLADE_SYNTH_INTERNAL_H
#define BLADE_SYNTH_INTERNAL_H

/* What the random-weight writer (synth.c) and the inflating writer (synth_inflate.c) share:
 * the GGUF being built, its deterministic noise, the quantization of float values into
 * tensors and the hyperparameter keys. */

#include "blade/gguf.h"
#include "blade/quantize.h"
#include "blade/synth.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct synth {
    gguf_writer *w;
    blade_quant_scheme scheme; /* which matrix gets which type: blade quantize's recipe */
    int n_layer;
    bool tied;
    void **buffers; /* tensor data must outlive gguf_writer_write */
    size_t n_buffers;
    uint64_t rng;
    blade_error *err;
} synth;

/* 0 when every type spec names is one blade writes; else -1 with err naming the type. */
int synth_check_types(const blade_synth_spec *spec, blade_error *err);
void synth_init(synth *s, const blade_synth_spec *spec, blade_error *err);
/* Writes the file (rc == 0) and frees everything s holds; returns 0 on success. */
int synth_finish(synth *s, int rc, const char *path, bool show_progress);

/* A standard normal variate from s's stream. */
float synth_gaussian(synth *s);
/* Stores n_out rows of n_in float values under name (n_out == 0: an F32 vector) in the type
 * blade quantize's recipe gives that tensor for the spec's scheme; rows whose length the
 * type's blocks do not divide fall back as blade quantize's do. values is the caller's and
 * may be reused afterwards. */
int synth_add_values(synth *s, const char *name, int64_t n_in, int64_t n_out, const float *values);
/* The architecture and shape keys of spec (rope.dimension_count = spec->n_rot or the head
 * size, rms epsilon spec->rms_eps or 1e-6). */
void synth_set_hparams(gguf_writer *w, const blade_synth_spec *spec);

#endif

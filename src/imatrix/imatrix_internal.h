#ifndef BLADE_IMATRIX_INTERNAL_H
#define BLADE_IMATRIX_INTERNAL_H

/* What the importance-matrix files share: the model table's lookups and formatting, and
 * the fingerprint, which a loaded file's table is checked against. */

#include "blade/imatrix.h"

#include <stddef.h>

/* SHA-256 over the architecture and the (sorted) tensor table, as 64 hex digits. */
int imatrix_fingerprint(const blade_model_identity *id, char out[65], blade_error *err);
/* Index of a tensor in the sorted table, or -1. */
long imatrix_model_tensor(const blade_model_identity *id, const char *name);
/* "[64, 512]": the shape as messages show it (trailing dimensions of 1 beyond the second
 * left out). */
void imatrix_format_shape(const int64_t ne[GGUF_MAX_DIMS], char *out, size_t cap);
/* Matrices a tensor of this shape holds: ne[2] * ne[3]. */
int64_t imatrix_slices(const int64_t ne[GGUF_MAX_DIMS]);

#endif

/* An importance matrix in memory: its entries, the lookup by tensor name, and the importance
 * callback `blade quantize --imatrix` hands the quantizer. */

#include "blade/imatrix.h"

#include "imatrix/imatrix_internal.h"

#include <stdlib.h>
#include <string.h>

int64_t imatrix_slices(const int64_t ne[GGUF_MAX_DIMS])
{
    return ne[2] * ne[3];
}

void blade_imatrix_free(blade_imatrix *im)
{
    if (!im)
        return;
    for (size_t i = 0; im->entries && i < im->n_entries; i++) {
        free(im->entries[i].name);
        free(im->entries[i].mean_sq);
        free(im->entries[i].rows);
    }
    free(im->entries);
    free(im->dataset);
    blade_model_identity_free(&im->model);
    free(im);
}

const blade_imatrix_entry *blade_imatrix_find(const blade_imatrix *im, const char *tensor)
{
    for (size_t i = 0; i < im->n_entries; i++)
        if (!strcmp(im->entries[i].name, tensor))
            return &im->entries[i];
    return NULL;
}

const float *blade_imatrix_importance(void *ctx, const char *tensor, int64_t n_cols, int64_t n_slices,
                                      blade_error *err)
{
    const blade_imatrix_entry *e = blade_imatrix_find(ctx, tensor);
    if (!e)
        return NULL;
    if (e->n_cols != n_cols || e->n_slices != n_slices) {
        blade_error_set(err, "the importance matrix's entry for %s has %lld columns x %lld slices; the tensor has "
                        "%lld x %lld", tensor, (long long)e->n_cols, (long long)e->n_slices, (long long)n_cols,
                        (long long)n_slices);
        return NULL;
    }
    return e->mean_sq;
}

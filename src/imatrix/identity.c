/* The model an importance matrix belongs to: architecture and tensor table, the fingerprint
 * over them, and the comparison that names the first difference between two models. */

#include "blade/imatrix.h"

#include "imatrix/imatrix_internal.h"

#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void blade_model_identity_free(blade_model_identity *id)
{
    if (!id)
        return;
    for (size_t i = 0; id->tensor_names && i < id->n_tensors; i++)
        free(id->tensor_names[i]);
    free(id->tensor_names);
    free(id->tensor_ne);
    free(id->arch);
    free(id->name);
    memset(id, 0, sizeof *id);
}

static int by_name(const void *a, const void *b)
{
    const gguf_tensor *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

int imatrix_fingerprint(const blade_model_identity *id, char out[65], blade_error *err)
{
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    bool ok = md && EVP_DigestInit_ex(md, EVP_sha256(), NULL) == 1;
    char line[64];
    int n = snprintf(line, sizeof line, "blade-model-identity-v1\n");
    ok = ok && EVP_DigestUpdate(md, line, (size_t)n) == 1 && EVP_DigestUpdate(md, id->arch, strlen(id->arch)) == 1 &&
         EVP_DigestUpdate(md, "\n", 1) == 1;
    for (size_t i = 0; ok && i < id->n_tensors; i++) {
        const int64_t *ne = id->tensor_ne[i];
        n = snprintf(line, sizeof line, "\t%lld %lld %lld %lld\n", (long long)ne[0], (long long)ne[1], (long long)ne[2],
                     (long long)ne[3]);
        ok = EVP_DigestUpdate(md, id->tensor_names[i], strlen(id->tensor_names[i])) == 1 &&
             EVP_DigestUpdate(md, line, (size_t)n) == 1;
    }
    unsigned char digest[32];
    unsigned int len = 0;
    ok = ok && EVP_DigestFinal_ex(md, digest, &len) == 1 && len == sizeof digest;
    EVP_MD_CTX_free(md);
    if (!ok)
        return blade_error_set(err, "SHA-256 of the tensor table failed (libcrypto)");
    for (int i = 0; i < 32; i++)
        snprintf(out + 2 * i, 3, "%02x", digest[i]);
    return 0;
}

int blade_model_identity_of(const gguf_file *f, blade_model_identity *id, blade_error *err)
{
    memset(id, 0, sizeof *id);
    bool present = false;
    if (!(id->arch = gguf_get_string(f, "general.architecture", &present, err)))
        return present ? -1 : blade_error_set(err, "missing metadata key general.architecture");
    id->name = gguf_get_string(f, "general.name", &present, NULL);
    size_t n = (size_t)f->n_tensors;
    const gguf_tensor **order = malloc((n ? n : 1) * sizeof *order);
    id->tensor_names = calloc(n ? n : 1, sizeof *id->tensor_names);
    id->tensor_ne = calloc(n ? n : 1, sizeof *id->tensor_ne);
    if (!order || !id->tensor_names || !id->tensor_ne)
        goto oom;
    for (size_t i = 0; i < n; i++)
        order[i] = &f->tensors[i];
    qsort(order, n, sizeof *order, by_name);
    for (size_t i = 0; i < n; i++) {
        if (!(id->tensor_names[i] = strdup(order[i]->name)))
            goto oom;
        id->n_tensors = i + 1;
        memcpy(id->tensor_ne[i], order[i]->ne, sizeof id->tensor_ne[i]);
    }
    free(order);
    if (imatrix_fingerprint(id, id->fingerprint, err) != 0) {
        blade_model_identity_free(id);
        return -1;
    }
    return 0;
oom:
    free(order);
    blade_model_identity_free(id);
    return blade_error_set(err, "out of memory");
}

long imatrix_model_tensor(const blade_model_identity *id, const char *name)
{
    size_t lo = 0, hi = id->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(id->tensor_names[mid], name);
        if (c == 0)
            return (long)mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

void imatrix_format_shape(const int64_t ne[GGUF_MAX_DIMS], char *out, size_t cap)
{
    int dims = GGUF_MAX_DIMS;
    while (dims > 2 && ne[dims - 1] == 1)
        dims--;
    size_t used = (size_t)snprintf(out, cap, "[");
    for (int d = 0; d < dims && used < cap; d++)
        used += (size_t)snprintf(out + used, cap - used, "%s%lld", d ? ", " : "", (long long)ne[d]);
    if (used < cap)
        snprintf(out + used, cap - used, "]");
}

int blade_imatrix_check_model(const blade_imatrix *im, const gguf_file *model, const char *model_label,
                              blade_error *err)
{
    blade_model_identity id;
    if (blade_model_identity_of(model, &id, err) != 0)
        return blade_error_prefix(err, "%s", model_label);
    const blade_model_identity *made = &im->model;
    int rc = 0;
    if (strcmp(made->arch, id.arch) != 0) {
        rc = blade_error_set(err, "the importance matrix was made for a %s model; %s is a %s model", made->arch,
                             model_label, id.arch);
    } else {
        /* Both tables are sorted by name: walk them together to the first difference (the
         * fingerprints differ exactly when the tables do, but say nothing of where). */
        size_t i = 0, j = 0;
        char a[96], b[96];
        while (i < made->n_tensors || j < id.n_tensors) {
            int c = i == made->n_tensors ? 1 : j == id.n_tensors ? -1 : strcmp(made->tensor_names[i], id.tensor_names[j]);
            if (c < 0) {
                imatrix_format_shape(made->tensor_ne[i], a, sizeof a);
                rc = blade_error_set(err, "the importance matrix was made for another model: that model has tensor "
                                     "%s %s, %s has none", made->tensor_names[i], a, model_label);
                break;
            }
            if (c > 0) {
                rc = blade_error_set(err, "the importance matrix was made for another model: %s has tensor %s, "
                                     "which that model lacks", model_label, id.tensor_names[j]);
                break;
            }
            if (memcmp(made->tensor_ne[i], id.tensor_ne[j], sizeof made->tensor_ne[i]) != 0) {
                imatrix_format_shape(made->tensor_ne[i], a, sizeof a);
                imatrix_format_shape(id.tensor_ne[j], b, sizeof b);
                rc = blade_error_set(err, "the importance matrix was made for another model: its %s is %s, %s's is %s",
                                     id.tensor_names[j], a, model_label, b);
                break;
            }
            i++;
            j++;
        }
    }
    blade_model_identity_free(&id);
    return rc;
}

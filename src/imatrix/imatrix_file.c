/* Importance matrices on disk: blade's GGUF layout (README, "blade imatrix"), written
 * atomically and read back as hostile input, every field checked before it is used. */

#include "blade/imatrix.h"

#include "blade/types.h"
#include "imatrix/imatrix_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KEY_TYPE "general.type"
#define KEY_VERSION "imatrix.format_version"
#define KEY_ARCH "imatrix.model.architecture"
#define KEY_NAME "imatrix.model.name"
#define KEY_FINGERPRINT "imatrix.model.fingerprint"
#define KEY_TENSOR_NAMES "imatrix.model.tensor_names"
#define KEY_TENSOR_SHAPES "imatrix.model.tensor_shapes"
#define KEY_DATASET "imatrix.dataset"
#define KEY_CHUNKS "imatrix.chunk_count"
#define KEY_CHUNK_SIZE "imatrix.chunk_size"
#define SUFFIX_MEAN_SQ ".mean_sq"
#define SUFFIX_ROWS ".rows"
/* Sizes far beyond any model's, refused so that hostile shapes cannot overflow arithmetic. */
#define MAX_DIM ((int64_t)1 << 32)
#define MAX_ELEMENTS ((int64_t)1 << 48)

/* ---- writing ---- */

int blade_imatrix_save(const blade_imatrix *im, const char *path, blade_error *err)
{
    const blade_model_identity *id = &im->model;
    gguf_writer *w = gguf_writer_new();
    int64_t *shapes = malloc((id->n_tensors ? id->n_tensors : 1) * sizeof *id->tensor_ne);
    char **names = calloc(2 * (im->n_entries ? im->n_entries : 1), sizeof *names);
    int rc = -1;
    if (!w || !shapes || !names) {
        blade_error_set(err, "out of memory");
        goto done;
    }
    memcpy(shapes, id->tensor_ne, id->n_tensors * sizeof *id->tensor_ne);
    gguf_writer_set_string(w, KEY_TYPE, "imatrix");
    gguf_writer_set_u32(w, KEY_VERSION, BLADE_IMATRIX_FORMAT_VERSION);
    gguf_writer_set_string(w, KEY_ARCH, id->arch);
    if (id->name)
        gguf_writer_set_string(w, KEY_NAME, id->name);
    gguf_writer_set_string(w, KEY_FINGERPRINT, id->fingerprint);
    gguf_writer_set_string_array(w, KEY_TENSOR_NAMES, (const char *const *)id->tensor_names, id->n_tensors);
    gguf_writer_set_array(w, KEY_TENSOR_SHAPES, GGUF_TYPE_INT64, shapes, id->n_tensors * GGUF_MAX_DIMS);
    gguf_writer_set_string(w, KEY_DATASET, im->dataset ? im->dataset : "");
    gguf_writer_set_u32(w, KEY_CHUNKS, im->chunks);
    gguf_writer_set_u32(w, KEY_CHUNK_SIZE, im->chunk_size);
    for (size_t i = 0; i < im->n_entries; i++) {
        const blade_imatrix_entry *e = &im->entries[i];
        size_t len = strlen(e->name) + sizeof SUFFIX_MEAN_SQ;
        if (!(names[2 * i] = malloc(len)) || !(names[2 * i + 1] = malloc(len))) {
            blade_error_set(err, "out of memory");
            goto done;
        }
        snprintf(names[2 * i], len, "%s" SUFFIX_MEAN_SQ, e->name);
        snprintf(names[2 * i + 1], len, "%s" SUFFIX_ROWS, e->name);
        int64_t ne[2] = {e->n_cols, e->n_slices};
        if (gguf_writer_add_tensor(w, names[2 * i], BLADE_TYPE_F32, e->n_slices > 1 ? 2 : 1, ne, e->mean_sq,
                                   (size_t)(e->n_cols * e->n_slices) * sizeof(float), err) != 0 ||
            gguf_writer_add_tensor(w, names[2 * i + 1], BLADE_TYPE_I64, 1, &e->n_slices, e->rows,
                                   (size_t)e->n_slices * sizeof(int64_t), err) != 0)
            goto done;
    }
    rc = gguf_writer_write(w, path, false, err);
done:
    for (size_t i = 0; names && i < 2 * im->n_entries; i++)
        free(names[i]);
    free(names);
    free(shapes);
    gguf_writer_free(w);
    return rc;
}

/* ---- reading ---- */

static char *required_string(const gguf_file *f, const char *key, blade_error *err)
{
    bool present = false;
    char *s = gguf_get_string(f, key, &present, err);
    if (!s && !present)
        blade_error_set(err, "missing metadata key %s", key);
    return s;
}

static int required_u32(const gguf_file *f, const char *key, uint32_t *out, blade_error *err)
{
    bool present = false;
    if (gguf_get_u32(f, key, out, &present, err))
        return 0;
    return present ? -1 : blade_error_set(err, "missing metadata key %s", key);
}

static bool has_tensor_ending(const gguf_file *f, const char *suffix)
{
    size_t n = strlen(suffix);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        size_t len = strlen(f->tensors[i].name);
        if (len > n && !strcmp(f->tensors[i].name + len - n, suffix))
            return true;
    }
    return false;
}

/* general.type must say imatrix and the layout must be blade's: what else the file is, when
 * it is not, is said in so many words (a model passed by mistake; llama.cpp's own layout). */
static int check_kind(const gguf_file *f, blade_error *err)
{
    bool present = false;
    char *type = gguf_get_string(f, KEY_TYPE, &present, err);
    if (!type && present)
        return -1;
    bool llama_cpp = has_tensor_ending(f, ".in_sum2");
    int rc = 0;
    if (!type || strcmp(type, "imatrix") != 0) {
        if (gguf_find_kv(f, "general.architecture"))
            rc = blade_error_set(err, "this is a model (general.architecture is set), not an importance matrix: "
                                 "make one with blade imatrix");
        else if (type)
            rc = blade_error_set(err, "general.type is '%s', not 'imatrix': not an importance matrix", type);
        else
            rc = blade_error_set(err, "no general.type key: not an importance matrix");
    } else if (!gguf_find_kv(f, KEY_VERSION) && llama_cpp) {
        rc = blade_error_set(err, "an importance matrix in llama.cpp's layout (*.in_sum2 tensors), which does not "
                             "record the model it was made for; make one with blade imatrix");
    }
    free(type);
    if (rc)
        return rc;
    uint32_t version = 0;
    if (required_u32(f, KEY_VERSION, &version, err))
        return -1;
    if (version != BLADE_IMATRIX_FORMAT_VERSION)
        return blade_error_set(err, "%s is %u; this blade reads version %d", KEY_VERSION, version,
                               BLADE_IMATRIX_FORMAT_VERSION);
    return 0;
}

/* The model table: sorted, distinct names, positive dimensions, and the fingerprint that
 * covers them. */
static int read_model(const gguf_file *f, blade_model_identity *id, blade_error *err)
{
    if (!(id->arch = required_string(f, KEY_ARCH, err)))
        return -1;
    bool present = false;
    id->name = gguf_get_string(f, KEY_NAME, &present, NULL);
    char *fingerprint = required_string(f, KEY_FINGERPRINT, err);
    if (!fingerprint)
        return -1;
    size_t len = strlen(fingerprint);
    snprintf(id->fingerprint, sizeof id->fingerprint, "%s", fingerprint);
    free(fingerprint);
    if (len != 64)
        return blade_error_set(err, "%s has %zu characters, not the 64 hex digits of a SHA-256", KEY_FINGERPRINT, len);
    const gguf_kv *names = gguf_find_array(f, KEY_TENSOR_NAMES, GGUF_TYPE_STRING, &present, err);
    if (!names)
        return present ? -1 : blade_error_set(err, "missing metadata key %s", KEY_TENSOR_NAMES);
    const gguf_kv *shapes = gguf_find_array(f, KEY_TENSOR_SHAPES, GGUF_TYPE_INT64, &present, err);
    if (!shapes)
        return present ? -1 : blade_error_set(err, "missing metadata key %s", KEY_TENSOR_SHAPES);
    if (names->arr_len == 0)
        return blade_error_set(err, "%s is empty", KEY_TENSOR_NAMES);
    if (shapes->arr_len / GGUF_MAX_DIMS != names->arr_len || shapes->arr_len % GGUF_MAX_DIMS)
        return blade_error_set(err, "%s holds %llu values, not %d for each of the %llu tensors %s names",
                               KEY_TENSOR_SHAPES, (unsigned long long)shapes->arr_len, GGUF_MAX_DIMS,
                               (unsigned long long)names->arr_len, KEY_TENSOR_NAMES);
    size_t n = (size_t)names->arr_len;
    id->tensor_names = calloc(n, sizeof *id->tensor_names);
    id->tensor_ne = calloc(n, sizeof *id->tensor_ne);
    if (!id->tensor_names || !id->tensor_ne)
        return blade_error_set(err, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const gguf_string *s = &names->arr_strings[i];
        if (s->len == 0 || memchr(s->ptr, '\0', s->len))
            return blade_error_set(err, "%s[%zu] is not a tensor name", KEY_TENSOR_NAMES, i);
        if (!(id->tensor_names[i] = strndup(s->ptr, s->len)))
            return blade_error_set(err, "out of memory");
        id->n_tensors = i + 1;
        if (i > 0 && strcmp(id->tensor_names[i - 1], id->tensor_names[i]) >= 0)
            return blade_error_set(err, "%s is not sorted and distinct at [%zu] ('%s' after '%s')", KEY_TENSOR_NAMES, i,
                                   id->tensor_names[i], id->tensor_names[i - 1]);
        memcpy(id->tensor_ne[i], (const int64_t *)shapes->arr_data + i * GGUF_MAX_DIMS, sizeof id->tensor_ne[i]);
        int64_t elements = 1;
        for (int d = 0; d < GGUF_MAX_DIMS; d++) {
            int64_t ne = id->tensor_ne[i][d];
            if (ne < 1 || ne > MAX_DIM || ne > MAX_ELEMENTS / elements)
                return blade_error_set(err, "%s: %s has dimension %d of %lld, not a tensor shape", KEY_TENSOR_SHAPES,
                                       id->tensor_names[i], d, (long long)ne);
            elements *= ne;
        }
    }
    char computed[65];
    if (imatrix_fingerprint(id, computed, err))
        return -1;
    if (strcmp(computed, id->fingerprint) != 0)
        return blade_error_set(err, "%s does not match the tensor table the file records (the file was altered or "
                               "is corrupt)", KEY_FINGERPRINT);
    return 0;
}

/* name.mean_sq or name.rows: the weight's name, or NULL for any other tensor name. */
static char *entry_name(const char *tensor, bool *is_rows)
{
    size_t len = strlen(tensor);
    const char *suffixes[2] = {SUFFIX_MEAN_SQ, SUFFIX_ROWS};
    for (int k = 0; k < 2; k++) {
        size_t n = strlen(suffixes[k]);
        if (len > n && !strcmp(tensor + len - n, suffixes[k])) {
            *is_rows = k == 1;
            return strndup(tensor, len - n);
        }
    }
    return NULL;
}

static const gguf_tensor *partner(const gguf_file *f, const char *name, const char *suffix)
{
    char buf[512];
    snprintf(buf, sizeof buf, "%s%s", name, suffix);
    return gguf_find_tensor(f, buf);
}

static int read_entry(const gguf_file *f, const gguf_tensor *t, const blade_model_identity *id,
                      blade_imatrix_entry *e, blade_error *err)
{
    const gguf_tensor *rows = partner(f, e->name, SUFFIX_ROWS);
    long mi = imatrix_model_tensor(id, e->name);
    if (mi < 0)
        return blade_error_set(err, "tensor %s is the importance of %s, which the recorded model does not have",
                               t->name, e->name);
    const int64_t *model_ne = id->tensor_ne[mi];
    e->n_cols = model_ne[0];
    e->n_slices = imatrix_slices(model_ne);
    if (t->type != BLADE_TYPE_F32)
        return blade_error_set(err, "tensor %s is %s, not F32", t->name, blade_type_traits_get(t->type)->name);
    if (t->ne[0] != e->n_cols)
        return blade_error_set(err, "tensor %s has %lld columns; %s has %lld", t->name, (long long)t->ne[0], e->name,
                               (long long)e->n_cols);
    if ((int64_t)t->n_elements != e->n_cols * e->n_slices)
        return blade_error_set(err, "tensor %s holds %lld slices of %lld columns; %s has %lld", t->name,
                               (long long)((int64_t)t->n_elements / e->n_cols), (long long)e->n_cols, e->name,
                               (long long)e->n_slices);
    if (!rows)
        return blade_error_set(err, "tensor %s has no %s%s beside it (how many rows it averages)", t->name, e->name,
                               SUFFIX_ROWS);
    if (rows->type != BLADE_TYPE_I64 || (int64_t)rows->n_elements != e->n_slices)
        return blade_error_set(err, "tensor %s must be %lld I64 row count%s; it is %llu %s value%s", rows->name,
                               (long long)e->n_slices, e->n_slices == 1 ? "" : "s",
                               (unsigned long long)rows->n_elements, blade_type_traits_get(rows->type)->name,
                               rows->n_elements == 1 ? "" : "s");
    e->mean_sq = malloc((size_t)(e->n_cols * e->n_slices) * sizeof *e->mean_sq);
    e->rows = malloc((size_t)e->n_slices * sizeof *e->rows);
    if (!e->mean_sq || !e->rows)
        return blade_error_set(err, "out of memory");
    /* copied out, not read in place: a hostile file may align its data below 4 bytes */
    memcpy(e->mean_sq, t->data, t->nbytes);
    memcpy(e->rows, rows->data, rows->nbytes);
    for (int64_t s = 0; s < e->n_slices; s++)
        if (e->rows[s] < 1)
            return blade_error_set(err, "tensor %s: slice %lld averages %lld rows; a mean needs at least one",
                                   rows->name, (long long)s, (long long)e->rows[s]);
    for (int64_t i = 0; i < e->n_cols * e->n_slices; i++)
        if (!isfinite(e->mean_sq[i]) || e->mean_sq[i] < 0.0f)
            return blade_error_set(err, "tensor %s column %lld is %g; mean squares are finite and not negative",
                                   t->name, (long long)(i % e->n_cols), (double)e->mean_sq[i]);
    return 0;
}

static int read_entries(const gguf_file *f, blade_imatrix *im, blade_error *err)
{
    im->entries = calloc(f->n_tensors ? (size_t)f->n_tensors : 1, sizeof *im->entries);
    if (!im->entries)
        return blade_error_set(err, "out of memory");
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        bool is_rows = false;
        char *name = entry_name(t->name, &is_rows);
        if (!name)
            return blade_error_set(err, "unexpected tensor %s: an importance matrix holds NAME%s and NAME%s tensors",
                                   t->name, SUFFIX_MEAN_SQ, SUFFIX_ROWS);
        if (is_rows) {
            bool paired = partner(f, name, SUFFIX_MEAN_SQ) != NULL;
            free(name);
            if (!paired)
                return blade_error_set(err, "tensor %s has no mean squares beside it", t->name);
            continue;
        }
        blade_imatrix_entry *e = &im->entries[im->n_entries++];
        e->name = name;
        if (read_entry(f, t, &im->model, e, err))
            return -1;
    }
    if (im->n_entries == 0)
        return blade_error_set(err, "no importance entries");
    return 0;
}

blade_imatrix *blade_imatrix_load(const char *path, blade_error *err)
{
    gguf_file *f = gguf_open_mapped(path, err);
    if (!f)
        return NULL;
    blade_imatrix *im = calloc(1, sizeof *im);
    if (!im) {
        gguf_close(f);
        blade_error_set(err, "out of memory");
        return NULL;
    }
    if (check_kind(f, err) || read_model(f, &im->model, err) || !(im->dataset = required_string(f, KEY_DATASET, err)) ||
        required_u32(f, KEY_CHUNKS, &im->chunks, err) || required_u32(f, KEY_CHUNK_SIZE, &im->chunk_size, err) ||
        read_entries(f, im, err)) {
        blade_error_prefix(err, "%s", path);
        blade_imatrix_free(im);
        im = NULL;
    }
    gguf_close(f);
    return im;
}

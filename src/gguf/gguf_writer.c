/* Writing GGUF (gguf.h): metadata and tensors gathered in memory, then the file written in
 * one pass with the format's alignment, through a temporary file that replaces the target
 * only when complete. */

#include "gguf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define WRITE_BUFFER_BYTES ((size_t)1 << 20)
/* Tensor data is handed to stdio in pieces this big so the progress line keeps moving
 * through large tensors. */
#define WRITE_CHUNK_BYTES ((size_t)8 << 20)
#define NAME_DESC_LEN 200

typedef struct wstring {
    char *ptr; /* NUL-terminated for convenience; len is authoritative */
    uint64_t len;
} wstring;

typedef struct wkv {
    char *key;
    gguf_value_type type;
    uint8_t scalar[8]; /* the value as stored in the file: gguf_value_type_size(type) bytes */
    wstring str;
    gguf_value_type arr_type;
    uint64_t arr_len;
    void *arr_data; /* fixed-size elements, as stored in the file */
    wstring *arr_strings;
} wkv;

typedef struct wtensor {
    char *name;
    uint32_t type;
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS];
    const void *data; /* NULL for a filled tensor */
    gguf_fill_fn fill;
    void *fill_ctx;
    size_t nbytes;
    uint64_t offset; /* assigned when the file is laid out */
} wtensor;

struct gguf_writer {
    wkv *kv;
    size_t n_kv, cap_kv;
    wtensor *tensors;
    size_t n_tensors, cap_tensors;
    /* The setters cannot report errors, so the first one is kept and gguf_writer_write
     * refuses to produce a file that would silently lack a key. */
    bool failed;
    blade_error error;
};

gguf_writer *gguf_writer_new(void)
{
    return calloc(1, sizeof(gguf_writer));
}

static void free_value(wkv *v)
{
    free(v->str.ptr);
    free(v->arr_data);
    if (v->arr_strings) {
        for (uint64_t i = 0; i < v->arr_len; i++)
            free(v->arr_strings[i].ptr);
        free(v->arr_strings);
    }
}

void gguf_writer_free(gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free_value(&w->kv[i]);
        free(w->kv[i].key);
    }
    free(w->kv);
    for (size_t i = 0; i < w->n_tensors; i++)
        free(w->tensors[i].name);
    free(w->tensors);
    free(w);
}

static void fail(gguf_writer *w, const char *fmt, ...) BLADE_PRINTF(2, 3);

static void fail(gguf_writer *w, const char *fmt, ...)
{
    if (w->failed)
        return;
    w->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->error.msg, sizeof w->error.msg, fmt, ap);
    va_end(ap);
}

static const char *key_text(const char *key)
{
    return key ? key : "(null)";
}

static bool dup_bytes(wstring *dst, const char *src, uint64_t len)
{
    if (len >= SIZE_MAX || !(dst->ptr = malloc((size_t)len + 1)))
        return false;
    if (len)
        memcpy(dst->ptr, src, (size_t)len);
    dst->ptr[len] = '\0';
    dst->len = len;
    return true;
}

/* Takes ownership of val's contents: stores them under key, replacing (in place, so the
 * original position is kept) any earlier value of the same key. */
static void commit(gguf_writer *w, const char *key, wkv *val)
{
    if (!key || !*key) {
        fail(w, "gguf writer: metadata key is empty");
        free_value(val);
        return;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kv[i].key, key) == 0) {
            free_value(&w->kv[i]);
            val->key = w->kv[i].key;
            w->kv[i] = *val;
            return;
        }
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? 2 * w->cap_kv : 16;
        wkv *grown = cap <= SIZE_MAX / sizeof *grown ? realloc(w->kv, cap * sizeof *grown) : NULL;
        if (!grown) {
            fail(w, "gguf writer: key '%s': out of memory", key);
            free_value(val);
            return;
        }
        w->kv = grown;
        w->cap_kv = cap;
    }
    if (!(val->key = strdup(key))) {
        fail(w, "gguf writer: key '%s': out of memory", key);
        free_value(val);
        return;
    }
    w->kv[w->n_kv++] = *val;
}

void gguf_writer_remove_kv(gguf_writer *w, const char *key)
{
    for (size_t i = 0; w && i < w->n_kv; i++) {
        if (strcmp(w->kv[i].key, key) == 0) {
            free_value(&w->kv[i]);
            free(w->kv[i].key);
            memmove(&w->kv[i], &w->kv[i + 1], (w->n_kv - i - 1) * sizeof *w->kv);
            w->n_kv--;
            return;
        }
    }
}

static void set_scalar(gguf_writer *w, const char *key, gguf_value_type type, const void *v)
{
    if (!w)
        return;
    wkv val = {.type = type};
    memcpy(val.scalar, v, gguf_value_type_size(type));
    commit(w, key, &val);
}

void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v)
{
    set_scalar(w, key, GGUF_TYPE_UINT32, &v);
}

void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v)
{
    set_scalar(w, key, GGUF_TYPE_INT32, &v);
}

void gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v)
{
    set_scalar(w, key, GGUF_TYPE_UINT64, &v);
}

void gguf_writer_set_f32(gguf_writer *w, const char *key, float v)
{
    set_scalar(w, key, GGUF_TYPE_FLOAT32, &v);
}

void gguf_writer_set_bool(gguf_writer *w, const char *key, bool v)
{
    uint8_t b = v ? 1 : 0;
    set_scalar(w, key, GGUF_TYPE_BOOL, &b);
}

void gguf_writer_set_string(gguf_writer *w, const char *key, const char *v)
{
    if (!w)
        return;
    if (!v) {
        fail(w, "gguf writer: key '%s': string value is NULL", key_text(key));
        return;
    }
    wkv val = {.type = GGUF_TYPE_STRING};
    if (!dup_bytes(&val.str, v, strlen(v))) {
        fail(w, "gguf writer: key '%s': out of memory", key_text(key));
        return;
    }
    commit(w, key, &val);
}

/* Copies n elements of a fixed-size type; bools must be 0 or 1 as the format demands. */
static bool fill_fixed_array(gguf_writer *w, const char *key, wkv *val, const void *data)
{
    size_t esz = gguf_value_type_size(val->arr_type);
    if (val->arr_len == 0)
        return true;
    if (!data) {
        fail(w, "gguf writer: key '%s': array data is NULL", key_text(key));
        return false;
    }
    if (val->arr_len > SIZE_MAX / esz || !(val->arr_data = malloc((size_t)val->arr_len * esz))) {
        fail(w, "gguf writer: key '%s': out of memory for %" PRIu64 " array elements",
             key_text(key), val->arr_len);
        return false;
    }
    memcpy(val->arr_data, data, (size_t)val->arr_len * esz);
    if (val->arr_type == GGUF_TYPE_BOOL) {
        const uint8_t *b = val->arr_data;
        for (uint64_t i = 0; i < val->arr_len; i++) {
            if (b[i] > 1) {
                fail(w, "gguf writer: key '%s': bool array element #%" PRIu64 " is %u, not 0 or 1",
                     key_text(key), i, b[i]);
                return false;
            }
        }
    }
    return true;
}

void gguf_writer_set_array(gguf_writer *w, const char *key, gguf_value_type elem_type,
                           const void *data, uint64_t n)
{
    if (!w)
        return;
    if (gguf_value_type_size(elem_type) == 0) {
        fail(w, "gguf writer: key '%s': arrays of %s cannot be set with gguf_writer_set_array",
             key_text(key), gguf_value_type_name(elem_type));
        return;
    }
    wkv val = {.type = GGUF_TYPE_ARRAY, .arr_type = elem_type, .arr_len = n};
    if (!fill_fixed_array(w, key, &val, data)) {
        free_value(&val);
        return;
    }
    commit(w, key, &val);
}

/* Allocates val->arr_strings for val->arr_len entries, all empty. */
static bool alloc_string_array(gguf_writer *w, const char *key, wkv *val)
{
    if (val->arr_len == 0)
        return true;
    if (val->arr_len > SIZE_MAX / sizeof(wstring) ||
        !(val->arr_strings = calloc((size_t)val->arr_len, sizeof(wstring)))) {
        fail(w, "gguf writer: key '%s': out of memory for %" PRIu64 " strings", key_text(key),
             val->arr_len);
        return false;
    }
    return true;
}

void gguf_writer_set_string_array(gguf_writer *w, const char *key, const char *const *v,
                                  uint64_t n)
{
    if (!w)
        return;
    wkv val = {.type = GGUF_TYPE_ARRAY, .arr_type = GGUF_TYPE_STRING, .arr_len = n};
    if (n > 0 && !v) {
        fail(w, "gguf writer: key '%s': string array is NULL", key_text(key));
        return;
    }
    if (!alloc_string_array(w, key, &val))
        return;
    for (uint64_t i = 0; i < n; i++) {
        if (!v[i]) {
            fail(w, "gguf writer: key '%s': string array element #%" PRIu64 " is NULL",
                 key_text(key), i);
            free_value(&val);
            return;
        }
        if (!dup_bytes(&val.arr_strings[i], v[i], strlen(v[i]))) {
            fail(w, "gguf writer: key '%s': out of memory", key_text(key));
            free_value(&val);
            return;
        }
    }
    commit(w, key, &val);
}

/* The reader widened the value; narrow it back to the width the type is stored with. */
static void encode_scalar(uint8_t *dst, const gguf_kv *kv)
{
    switch (kv->type) {
    case GGUF_TYPE_UINT8: { uint8_t v = (uint8_t)kv->scalar.u64; memcpy(dst, &v, 1); break; }
    case GGUF_TYPE_INT8: { int8_t v = (int8_t)kv->scalar.i64; memcpy(dst, &v, 1); break; }
    case GGUF_TYPE_UINT16: { uint16_t v = (uint16_t)kv->scalar.u64; memcpy(dst, &v, 2); break; }
    case GGUF_TYPE_INT16: { int16_t v = (int16_t)kv->scalar.i64; memcpy(dst, &v, 2); break; }
    case GGUF_TYPE_UINT32: { uint32_t v = (uint32_t)kv->scalar.u64; memcpy(dst, &v, 4); break; }
    case GGUF_TYPE_INT32: { int32_t v = (int32_t)kv->scalar.i64; memcpy(dst, &v, 4); break; }
    case GGUF_TYPE_FLOAT32: { float v = (float)kv->scalar.f64; memcpy(dst, &v, 4); break; }
    case GGUF_TYPE_BOOL: dst[0] = kv->scalar.b ? 1 : 0; break;
    case GGUF_TYPE_UINT64: memcpy(dst, &kv->scalar.u64, 8); break;
    case GGUF_TYPE_INT64: memcpy(dst, &kv->scalar.i64, 8); break;
    case GGUF_TYPE_FLOAT64: memcpy(dst, &kv->scalar.f64, 8); break;
    default: /* strings and arrays carry no scalar */
        break;
    }
}

static bool copy_value(gguf_writer *w, const gguf_kv *kv, wkv *val)
{
    val->type = kv->type;
    if (kv->type == GGUF_TYPE_STRING) {
        if (!dup_bytes(&val->str, kv->str.ptr, kv->str.len)) {
            fail(w, "gguf writer: key '%s': out of memory", kv->key);
            return false;
        }
        return true;
    }
    if (kv->type != GGUF_TYPE_ARRAY) {
        encode_scalar(val->scalar, kv);
        return true;
    }
    val->arr_type = kv->arr_type;
    val->arr_len = kv->arr_len;
    if (kv->arr_type != GGUF_TYPE_STRING)
        return fill_fixed_array(w, kv->key, val, kv->arr_data);
    if (!alloc_string_array(w, kv->key, val))
        return false;
    for (uint64_t i = 0; i < kv->arr_len; i++) {
        if (!dup_bytes(&val->arr_strings[i], kv->arr_strings[i].ptr, kv->arr_strings[i].len)) {
            fail(w, "gguf writer: key '%s': out of memory", kv->key);
            return false;
        }
    }
    return true;
}

void gguf_writer_copy_kv(gguf_writer *w, const gguf_file *src)
{
    gguf_writer_copy_kv_prefix(w, src, "");
}

void gguf_writer_copy_kv_prefix(gguf_writer *w, const gguf_file *src, const char *prefix)
{
    if (!w || !src)
        return;
    size_t n = strlen(prefix);
    for (uint64_t i = 0; i < src->n_kv; i++) {
        if (strncmp(src->kv[i].key, prefix, n) != 0)
            continue;
        wkv val = {0};
        if (!copy_value(w, &src->kv[i], &val)) {
            free_value(&val);
            return;
        }
        commit(w, src->kv[i].key, &val);
    }
}

/* Checks a tensor's name, type and shape against nbytes and appends it. */
static int add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims, const int64_t *ne,
                      size_t nbytes, const void *data, gguf_fill_fn fill, void *fill_ctx, blade_error *err)
{
    if (!w)
        return blade_error_set(err, "gguf writer: no writer");
    if (!name || !*name)
        return blade_error_set(err, "gguf writer: tensor name is empty");
    char desc[NAME_DESC_LEN];
    gguf_describe_name(desc, sizeof desc, name, strlen(name));
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return blade_error_set(err, "gguf writer: duplicate tensor name '%s'", desc);
    const blade_type_traits *tt = blade_type_traits_get(type);
    if (!tt)
        return blade_error_set(err, "gguf writer: tensor '%s': unknown type id %" PRIu32, desc,
                               type);
    if (!ne)
        return blade_error_set(err, "gguf writer: tensor '%s': no shape given", desc);
    uint64_t n_elements;
    size_t expected;
    if (gguf_tensor_layout(tt, n_dims, ne, &n_elements, &expected, err) != 0)
        return blade_error_prefix(err, "gguf writer: tensor '%s'", desc);
    if (nbytes != expected)
        return blade_error_set(err, "gguf writer: tensor '%s': %zu bytes of data given, but %"
                               PRIu64 " %s elements take %zu", desc, nbytes, n_elements,
                               tt->name, expected);
    if (!data && !fill)
        return blade_error_set(err, "gguf writer: tensor '%s': data is NULL", desc);

    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? 2 * w->cap_tensors : 16;
        wtensor *grown = cap <= SIZE_MAX / sizeof *grown
                             ? realloc(w->tensors, cap * sizeof *grown) : NULL;
        if (!grown)
            return blade_error_set(err, "gguf writer: tensor '%s': out of memory", desc);
        w->tensors = grown;
        w->cap_tensors = cap;
    }
    wtensor *t = &w->tensors[w->n_tensors];
    if (!(t->name = strdup(name)))
        return blade_error_set(err, "gguf writer: tensor '%s': out of memory", desc);
    t->type = type;
    t->n_dims = n_dims;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = d < n_dims ? ne[d] : 1;
    t->data = data;
    t->fill = fill;
    t->fill_ctx = fill_ctx;
    t->nbytes = nbytes;
    t->offset = 0;
    w->n_tensors++;
    return 0;
}

int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                           const int64_t *ne, const void *data, size_t nbytes, blade_error *err)
{
    return add_tensor(w, name, type, n_dims, ne, nbytes, data, NULL, NULL, err);
}

int gguf_writer_add_tensor_filled(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                                  const int64_t *ne, size_t nbytes, gguf_fill_fn fill, void *fill_ctx,
                                  blade_error *err)
{
    if (!fill)
        return blade_error_set(err, "gguf writer: tensor '%s': no fill function", name ? name : "(null)");
    return add_tensor(w, name, type, n_dims, ne, nbytes, NULL, fill, fill_ctx, err);
}

/* ---- layout and output ---- */

static int writer_alignment(const gguf_writer *w, uint32_t *out, blade_error *err)
{
    *out = GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kv[i].key, "general.alignment") != 0)
            continue;
        if (w->kv[i].type != GGUF_TYPE_UINT32)
            return blade_error_set(err, "gguf writer: key 'general.alignment' has type %s, must "
                                   "be u32", gguf_value_type_name(w->kv[i].type));
        uint32_t a;
        memcpy(&a, w->kv[i].scalar, 4);
        if (a == 0 || (a & (a - 1)) != 0)
            return blade_error_set(err, "gguf writer: key 'general.alignment' is %" PRIu32
                                   ", must be a non-zero power of two", a);
        *out = a;
    }
    return 0;
}

static uint64_t kv_encoded_size(const wkv *v)
{
    uint64_t n = 8 + strlen(v->key) + 4;
    if (v->type == GGUF_TYPE_STRING)
        return n + 8 + v->str.len;
    if (v->type != GGUF_TYPE_ARRAY)
        return n + gguf_value_type_size(v->type);
    n += 4 + 8;
    if (v->arr_type != GGUF_TYPE_STRING)
        return n + v->arr_len * gguf_value_type_size(v->arr_type);
    for (uint64_t i = 0; i < v->arr_len; i++)
        n += 8 + v->arr_strings[i].len;
    return n;
}

static uint64_t align_up(uint64_t x, uint32_t a)
{
    return (x + a - 1) / a * a;
}

/* Assigns tensor offsets; returns the total file size, or 0 if it overflows. */
static uint64_t lay_out(gguf_writer *w, uint32_t alignment, uint64_t *data_start)
{
    uint64_t header = GGUF_HEADER_SIZE;
    for (size_t i = 0; i < w->n_kv; i++)
        header += kv_encoded_size(&w->kv[i]);
    for (size_t i = 0; i < w->n_tensors; i++)
        header += 8 + strlen(w->tensors[i].name) + 4 + 8ull * w->tensors[i].n_dims + 4 + 8;
    /* A tokenizer-only file has no data section to align. */
    *data_start = w->n_tensors ? align_up(header, alignment) : header;
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        w->tensors[i].offset = off;
        if (w->tensors[i].nbytes > UINT64_MAX - alignment - off)
            return 0;
        off = align_up(off + w->tensors[i].nbytes, alignment);
    }
    if (off > UINT64_MAX - *data_start)
        return 0;
    return *data_start + off;
}

typedef struct sink {
    FILE *fp;
    const char *path;
    uint64_t written, total;
    bool progress;
    uint64_t shown_mib;
    int error;           /* errno of the first failure */
    uint8_t *scratch;    /* filled tensors are produced here, one at a time */
    blade_error *err;    /* a fill function's message */
    bool fill_failed;
} sink;

static void show_progress(sink *s, bool force)
{
    if (!s->progress)
        return;
    uint64_t mib = s->written >> 20;
    if (!force && mib == s->shown_mib)
        return;
    s->shown_mib = mib;
    fprintf(stderr, "\rwriting %s: %" PRIu64 "/%" PRIu64 " MiB", s->path, mib, s->total >> 20);
    fflush(stderr);
}

static int put(sink *s, const void *p, size_t n)
{
    if (n == 0)
        return 0;
    errno = 0;
    if (fwrite(p, 1, n, s->fp) != n) {
        s->error = errno ? errno : EIO;
        return -1;
    }
    s->written += n;
    show_progress(s, false);
    return 0;
}

static int put_u32(sink *s, uint32_t v)
{
    return put(s, &v, 4);
}

static int put_u64(sink *s, uint64_t v)
{
    return put(s, &v, 8);
}

static int put_string(sink *s, const char *p, uint64_t len)
{
    return put_u64(s, len) || put(s, p, (size_t)len) ? -1 : 0;
}

static int put_zeros(sink *s, uint64_t n)
{
    static const uint8_t zeros[4096];
    while (n > 0) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        if (put(s, zeros, k) != 0)
            return -1;
        n -= k;
    }
    return 0;
}

static int put_kv(sink *s, const wkv *v)
{
    if (put_string(s, v->key, strlen(v->key)) || put_u32(s, (uint32_t)v->type))
        return -1;
    if (v->type == GGUF_TYPE_STRING)
        return put_string(s, v->str.ptr, v->str.len);
    if (v->type != GGUF_TYPE_ARRAY)
        return put(s, v->scalar, gguf_value_type_size(v->type));
    if (put_u32(s, (uint32_t)v->arr_type) || put_u64(s, v->arr_len))
        return -1;
    if (v->arr_type != GGUF_TYPE_STRING)
        return put(s, v->arr_data, (size_t)v->arr_len * gguf_value_type_size(v->arr_type));
    for (uint64_t i = 0; i < v->arr_len; i++)
        if (put_string(s, v->arr_strings[i].ptr, v->arr_strings[i].len))
            return -1;
    return 0;
}

static int put_tensor_info(sink *s, const wtensor *t)
{
    if (put_string(s, t->name, strlen(t->name)) || put_u32(s, t->n_dims))
        return -1;
    for (uint32_t d = 0; d < t->n_dims; d++)
        if (put_u64(s, (uint64_t)t->ne[d]))
            return -1;
    return put_u32(s, t->type) || put_u64(s, t->offset) ? -1 : 0;
}

static int put_file(const gguf_writer *w, sink *s, uint32_t alignment, uint64_t data_start)
{
    if (put(s, GGUF_MAGIC, 4) || put_u32(s, 3) || put_u64(s, w->n_tensors) || put_u64(s, w->n_kv))
        return -1;
    for (size_t i = 0; i < w->n_kv; i++)
        if (put_kv(s, &w->kv[i]))
            return -1;
    for (size_t i = 0; i < w->n_tensors; i++)
        if (put_tensor_info(s, &w->tensors[i]))
            return -1;
    if (put_zeros(s, data_start - s->written))
        return -1;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        const uint8_t *p = t->data;
        if (t->fill) {
            if (t->fill(t->fill_ctx, s->scratch, t->nbytes, s->err) != 0) {
                s->fill_failed = true;
                return -1;
            }
            p = s->scratch;
        }
        for (size_t done = 0; done < t->nbytes;) {
            size_t k = t->nbytes - done < WRITE_CHUNK_BYTES ? t->nbytes - done : WRITE_CHUNK_BYTES;
            if (put(s, p + done, k))
                return -1;
            done += k;
        }
        if (put_zeros(s, align_up(t->nbytes, alignment) - t->nbytes))
            return -1;
    }
    return 0;
}

/* Where the bytes go. A regular file (or a name not yet taken) is written as a temporary
 * file beside it and renamed over it once complete and synced, so the name never holds a
 * partial file, not even after a crash; a symbolic link is followed, so the file it points
 * to is the one replaced. Anything else that exists (a device such as /dev/null, a pipe) is
 * written in place. */
typedef struct target {
    char final[PATH_MAX];
    char tmp[PATH_MAX + 32]; /* empty when writing in place */
    mode_t mode;             /* of the file being replaced; 0 for a new one */
} target;

static int open_target(const char *path, target *t, FILE **fp, blade_error *err)
{
    struct stat st;
    memset(t, 0, sizeof *t);
    if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode)) {
        if (!realpath(path, t->final))
            return blade_error_set(err, "%s: cannot follow the symbolic link: %s", path, strerror(errno));
    } else if (strlen(path) >= sizeof t->final) {
        return blade_error_set(err, "%s: path too long", path);
    } else {
        strcpy(t->final, path);
    }
    bool exists = stat(t->final, &st) == 0;
    if (exists && !S_ISREG(st.st_mode)) {
        if (!(*fp = fopen(t->final, "wb")))
            return blade_error_set(err, "%s: cannot create: %s", path, strerror(errno));
        return 0;
    }
    t->mode = exists ? st.st_mode & 07777 : 0;
    /* O_EXCL with a name of our own: never clobbers anything, and the new file gets the
     * umask's permissions as any file would. */
    static _Atomic unsigned counter;
    int fd = -1;
    for (int attempt = 0; attempt < 100 && fd < 0; attempt++) {
        snprintf(t->tmp, sizeof t->tmp, "%s.tmp-%ld-%u", t->final, (long)getpid(), counter++);
        fd = open(t->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0 && errno != EEXIST)
            break;
    }
    if (fd < 0)
        return blade_error_set(err, "%s: cannot create: %s", path, strerror(errno));
    if (t->mode)
        fchmod(fd, t->mode);
    if (!(*fp = fdopen(fd, "wb"))) {
        int e = errno;
        close(fd);
        unlink(t->tmp);
        return blade_error_set(err, "%s: cannot create: %s", path, strerror(e));
    }
    return 0;
}

/* Makes the rename itself survive a crash. Best effort: some file systems refuse to sync a
 * directory, and the data is already safe. */
static void sync_directory_of(const char *path)
{
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        dir[1] = '\0';
    else if (slash)
        *slash = '\0';
    else
        strcpy(dir, ".");
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

int gguf_writer_write(gguf_writer *w, const char *path, bool show_progress_line, blade_error *err)
{
    if (!w || !path)
        return blade_error_set(err, "gguf writer: no writer or no path given");
    if (w->failed)
        return blade_error_set(err, "%s: %s", path, w->error.msg);
    uint32_t alignment;
    if (writer_alignment(w, &alignment, err) != 0)
        return blade_error_prefix(err, "%s", path);
    uint64_t data_start;
    uint64_t total = lay_out(w, alignment, &data_start);
    if (total == 0)
        return blade_error_set(err, "%s: gguf writer: total file size overflows 64 bits", path);
    size_t scratch_bytes = 0;
    for (size_t i = 0; i < w->n_tensors; i++)
        if (w->tensors[i].fill && w->tensors[i].nbytes > scratch_bytes)
            scratch_bytes = w->tensors[i].nbytes;
    uint8_t *scratch = scratch_bytes ? malloc(scratch_bytes) : NULL;
    if (scratch_bytes && !scratch)
        return blade_error_set(err, "%s: out of memory for a %zu-byte tensor", path, scratch_bytes);

    target t;
    FILE *fp;
    if (open_target(path, &t, &fp, err) != 0) {
        free(scratch);
        return -1;
    }
    bool temporary = t.tmp[0] != '\0';
    char *buf = malloc(WRITE_BUFFER_BYTES);
    if (buf)
        setvbuf(fp, buf, _IOFBF, WRITE_BUFFER_BYTES);

    blade_error fill_err = {{0}};
    sink s = {.fp = fp, .path = path, .total = total, .shown_mib = UINT64_MAX,
              .progress = show_progress_line && isatty(STDERR_FILENO), .scratch = scratch, .err = &fill_err};
    show_progress(&s, true);
    int rc = put_file(w, &s, alignment, data_start);
    if (rc == 0 && fflush(fp) != 0) {
        s.error = errno;
        rc = -1;
    }
    /* Some file systems (NFS, quotas, delayed allocation) only report a full disk when
     * the data is forced out. */
    if (rc == 0 && temporary && fsync(fileno(fp)) != 0) {
        s.error = errno;
        rc = -1;
    }
    if (fclose(fp) != 0 && rc == 0) {
        s.error = errno;
        rc = -1;
    }
    free(buf);
    free(scratch);
    if (s.progress)
        fputc('\n', stderr); /* every put already refreshed the line */
    if (rc == 0 && temporary && rename(t.tmp, t.final) != 0) {
        s.error = errno;
        rc = -1;
    }
    if (rc != 0) {
        if (temporary)
            unlink(t.tmp);
        if (s.fill_failed)
            return blade_error_set(err, "%s: %s (nothing written)", path, fill_err.msg);
        return blade_error_set(err, "%s: write failed after %" PRIu64 " of %" PRIu64 " bytes: %s%s",
                               path, s.written, total, strerror(s.error),
                               temporary ? " (partial file removed)" : "");
    }
    if (temporary)
        sync_directory_of(t.final);
    return 0;
}

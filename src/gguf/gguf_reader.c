/* Reading GGUF (gguf.h): the whole header, metadata and tensor table validated up front
 * against the file's size, every count and offset checked before it is used, errors
 * naming the field and its file offset. The weights are then copied once into 2 MiB-page
 * memory for the kernels (gguf_open), or read through the file's own mapping
 * (gguf_open_mapped). */

#include "gguf_internal.h"

#include "common/file.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The smallest possible encodings, used to reject counts that cannot fit in the file
 * before anything is allocated from them. A key/value pair: 8-byte key length, a 1-byte
 * key, 4-byte type, 1-byte value. A tensor info: 8-byte name length, a 1-byte name,
 * 4-byte n_dims, one 8-byte dimension, 4-byte type, 8-byte offset. */
#define MIN_KV_BYTES (8 + 1 + 4 + 1)
#define MIN_TENSOR_INFO_BYTES (8 + 1 + 4 + 8 + 4 + 8)
#define MIN_STRING_BYTES 8

/* Room for a described (escaped, shortened) name plus the surrounding context text. */
#define NAME_DESC_LEN 200
#define CTX_LEN 300

static const uint8_t value_type_sizes[GGUF_TYPE_COUNT] = {
    [GGUF_TYPE_UINT8] = 1,  [GGUF_TYPE_INT8] = 1,   [GGUF_TYPE_UINT16] = 2,
    [GGUF_TYPE_INT16] = 2,  [GGUF_TYPE_UINT32] = 4, [GGUF_TYPE_INT32] = 4,
    [GGUF_TYPE_FLOAT32] = 4, [GGUF_TYPE_BOOL] = 1,  [GGUF_TYPE_UINT64] = 8,
    [GGUF_TYPE_INT64] = 8,  [GGUF_TYPE_FLOAT64] = 8,
};

static const char *const value_type_names[GGUF_TYPE_COUNT] = {
    [GGUF_TYPE_UINT8] = "u8",    [GGUF_TYPE_INT8] = "i8",     [GGUF_TYPE_UINT16] = "u16",
    [GGUF_TYPE_INT16] = "i16",   [GGUF_TYPE_UINT32] = "u32",  [GGUF_TYPE_INT32] = "i32",
    [GGUF_TYPE_FLOAT32] = "f32", [GGUF_TYPE_BOOL] = "bool",   [GGUF_TYPE_STRING] = "string",
    [GGUF_TYPE_ARRAY] = "array", [GGUF_TYPE_UINT64] = "u64",  [GGUF_TYPE_INT64] = "i64",
    [GGUF_TYPE_FLOAT64] = "f64",
};

size_t gguf_value_type_size(gguf_value_type t)
{
    return (unsigned)t < GGUF_TYPE_COUNT ? value_type_sizes[t] : 0;
}

const char *gguf_value_type_name(gguf_value_type t)
{
    return (unsigned)t < GGUF_TYPE_COUNT ? value_type_names[t] : "unknown";
}

void gguf_describe_name(char *dst, size_t cap, const char *s, size_t len)
{
    /* Long enough for any real tensor or key name, short enough that two of them and the
     * rest of a message fit in a blade_error. */
    const size_t max_shown = 64;
    size_t budget = cap - 4; /* keeps room for "..." and the terminator */
    size_t o = 0, i = 0;
    for (; i < len && i < max_shown; i++) {
        unsigned char ch = (unsigned char)s[i];
        char piece[5];
        size_t n;
        if (ch >= 0x20 && ch < 0x7f && ch != '\\') {
            piece[0] = (char)ch;
            n = 1;
        } else {
            n = (size_t)snprintf(piece, sizeof piece, "\\x%02x", ch);
        }
        if (o + n > budget)
            break;
        memcpy(dst + o, piece, n);
        o += n;
    }
    if (i < len) {
        memcpy(dst + o, "...", 3);
        o += 3;
    }
    dst[o] = '\0';
}

static void format_shape(char *dst, size_t cap, uint32_t n_dims, const int64_t *ne)
{
    size_t o = (size_t)snprintf(dst, cap, "[");
    for (uint32_t d = 0; d < n_dims && d < GGUF_MAX_DIMS && o < cap; d++)
        o += (size_t)snprintf(dst + o, cap - o, "%s%" PRId64, d ? ", " : "", ne[d]);
    if (o < cap)
        snprintf(dst + o, cap - o, "]");
}

int gguf_tensor_layout(const blade_type_traits *tt, uint32_t n_dims, const int64_t *ne,
                       uint64_t *n_elements, size_t *nbytes, blade_error *err)
{
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return blade_error_set(err, "n_dims %" PRIu32 " is out of range (1..%d)", n_dims,
                               GGUF_MAX_DIMS);
    char shape[128];
    format_shape(shape, sizeof shape, n_dims, ne);
    uint64_t n = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] < 1)
            return blade_error_set(err, "dimension %" PRIu32 " of shape %s is %" PRId64
                                   ", must be at least 1", d, shape, ne[d]);
        if ((uint64_t)ne[d] > (uint64_t)INT64_MAX / n)
            return blade_error_set(err, "element count of shape %s overflows 64 bits", shape);
        n *= (uint64_t)ne[d];
    }
    if (ne[0] % tt->block_size != 0)
        return blade_error_set(err, "row length ne[0] = %" PRId64 " is not a multiple of the %s "
                               "block size %" PRId64, ne[0], tt->name, tt->block_size);
    uint64_t blocks_per_row = (uint64_t)(ne[0] / tt->block_size);
    uint64_t rows = n / (uint64_t)ne[0];
    if (blocks_per_row > UINT64_MAX / tt->block_bytes ||
        blocks_per_row * tt->block_bytes > SIZE_MAX / rows)
        return blade_error_set(err, "byte size of shape %s as %s overflows", shape, tt->name);
    *n_elements = n;
    *nbytes = (size_t)(blocks_per_row * tt->block_bytes * rows);
    return 0;
}

/* ---- cursor over the untrusted bytes ---- */

typedef struct reader {
    const uint8_t *p;
    size_t size;
    size_t pos;
    blade_error *err;
} reader;

static size_t remaining(const reader *r)
{
    return r->size - r->pos;
}

/* idx >= 0 numbers the field, for array elements and dimensions. */
static void field_name(char *dst, size_t cap, const char *field, int64_t idx)
{
    if (idx >= 0)
        snprintf(dst, cap, "%s #%" PRId64, field, idx);
    else
        snprintf(dst, cap, "%s", field);
}

/* Returns a literal -1 (not blade_error_set's) so the compiler can see that callers'
 * out-parameters are only used after success. */
static int past_end(reader *r, uint64_t n, const char *ctx, const char *field, int64_t idx)
{
    char f[64];
    field_name(f, sizeof f, field, idx);
    blade_error_set(r->err, "gguf: %s: %s at offset %zu (%" PRIu64 " bytes) extends past "
                           "end of file (size %zu)", ctx, f, r->pos, n, r->size);
    return -1;
}

static int read_u32(reader *r, uint32_t *v, const char *ctx, const char *field, int64_t idx)
{
    if (remaining(r) < 4)
        return past_end(r, 4, ctx, field, idx);
    memcpy(v, r->p + r->pos, 4);
    r->pos += 4;
    return 0;
}

static int read_u64(reader *r, uint64_t *v, const char *ctx, const char *field, int64_t idx)
{
    if (remaining(r) < 8)
        return past_end(r, 8, ctx, field, idx);
    memcpy(v, r->p + r->pos, 8);
    r->pos += 8;
    return 0;
}

static int read_string(reader *r, gguf_string *s, const char *ctx, const char *field, int64_t idx)
{
    size_t at = r->pos;
    uint64_t len;
    if (remaining(r) < MIN_STRING_BYTES) {
        char f[64];
        field_name(f, sizeof f, field, idx);
        blade_error_set(r->err, "gguf: %s: length of %s at offset %zu extends past end of file "
                        "(size %zu)", ctx, f, at, r->size);
        return -1;
    }
    memcpy(&len, r->p + at, 8);
    r->pos += 8;
    if (len > remaining(r)) {
        char f[64];
        field_name(f, sizeof f, field, idx);
        blade_error_set(r->err, "gguf: %s: %s length %" PRIu64 " at offset %zu extends past end "
                        "of file (size %zu, %zu bytes remain)", ctx, f, len, at, r->size,
                        remaining(r));
        return -1;
    }
    s->ptr = (const char *)r->p + r->pos;
    s->len = len;
    r->pos += (size_t)len;
    return 0;
}

/* Keys and tensor names become C strings, so they must be non-empty and NUL-free. */
static char *read_name(reader *r, const char *ctx, const char *field)
{
    size_t at = r->pos;
    gguf_string s;
    if (read_string(r, &s, ctx, field, -1) != 0)
        return NULL;
    if (s.len == 0) {
        blade_error_set(r->err, "gguf: %s: empty %s at offset %zu", ctx, field, at);
        return NULL;
    }
    const char *nul = memchr(s.ptr, '\0', (size_t)s.len);
    if (nul) {
        blade_error_set(r->err, "gguf: %s: %s at offset %zu contains a NUL byte at offset %zu",
                        ctx, field, at, (size_t)((const uint8_t *)nul - r->p));
        return NULL;
    }
    char *copy = malloc((size_t)s.len + 1);
    if (!copy) {
        blade_error_set(r->err, "gguf: %s: out of memory copying %s", ctx, field);
        return NULL;
    }
    memcpy(copy, s.ptr, (size_t)s.len);
    copy[s.len] = '\0';
    return copy;
}

/* ---- key/value pairs ---- */

static int read_scalar(reader *r, gguf_kv *kv, const char *ctx)
{
    size_t n = gguf_value_type_size(kv->type);
    if (remaining(r) < n)
        return past_end(r, n, ctx, "value", -1);
    const uint8_t *q = r->p + r->pos;
    switch (kv->type) {
    case GGUF_TYPE_UINT8: kv->scalar.u64 = q[0]; break;
    case GGUF_TYPE_INT8: { int8_t v; memcpy(&v, q, 1); kv->scalar.i64 = v; break; }
    case GGUF_TYPE_UINT16: { uint16_t v; memcpy(&v, q, 2); kv->scalar.u64 = v; break; }
    case GGUF_TYPE_INT16: { int16_t v; memcpy(&v, q, 2); kv->scalar.i64 = v; break; }
    case GGUF_TYPE_UINT32: { uint32_t v; memcpy(&v, q, 4); kv->scalar.u64 = v; break; }
    case GGUF_TYPE_INT32: { int32_t v; memcpy(&v, q, 4); kv->scalar.i64 = v; break; }
    case GGUF_TYPE_FLOAT32: { float v; memcpy(&v, q, 4); kv->scalar.f64 = v; break; }
    case GGUF_TYPE_UINT64: memcpy(&kv->scalar.u64, q, 8); break;
    case GGUF_TYPE_INT64: memcpy(&kv->scalar.i64, q, 8); break;
    case GGUF_TYPE_FLOAT64: memcpy(&kv->scalar.f64, q, 8); break;
    case GGUF_TYPE_BOOL:
        if (q[0] > 1)
            return blade_error_set(r->err, "gguf: %s: bool value %u at offset %zu is not 0 or 1",
                                   ctx, q[0], r->pos);
        kv->scalar.b = q[0];
        break;
    default: /* strings and arrays are parsed by their own functions */
        break;
    }
    r->pos += n;
    return 0;
}

static int read_string_array(reader *r, gguf_kv *kv, const char *ctx, size_t len_at)
{
    /* Every element costs at least its 8-byte length, which bounds the allocation by the
     * file size. */
    if (kv->arr_len > remaining(r) / MIN_STRING_BYTES)
        return blade_error_set(r->err, "gguf: %s: array of %" PRIu64 " strings (length at offset "
                               "%zu) cannot fit: each needs at least %d bytes and %zu bytes "
                               "remain in the file (size %zu)", ctx, kv->arr_len, len_at,
                               MIN_STRING_BYTES, remaining(r), r->size);
    if (kv->arr_len == 0)
        return 0;
    if (kv->arr_len > SIZE_MAX / sizeof(gguf_string) ||
        !(kv->arr_strings = malloc((size_t)kv->arr_len * sizeof(gguf_string))))
        return blade_error_set(r->err, "gguf: %s: out of memory for %" PRIu64 " strings", ctx,
                               kv->arr_len);
    for (uint64_t i = 0; i < kv->arr_len; i++)
        if (read_string(r, &kv->arr_strings[i], ctx, "array element", (int64_t)i) != 0)
            return -1;
    return 0;
}

static int read_array(reader *r, gguf_kv *kv, const char *ctx)
{
    size_t type_at = r->pos;
    uint32_t et;
    if (read_u32(r, &et, ctx, "array element type", -1) != 0)
        return -1;
    if (et >= GGUF_TYPE_COUNT)
        return blade_error_set(r->err, "gguf: %s: unknown array element type %" PRIu32
                               " at offset %zu", ctx, et, type_at);
    /* gguf_kv has no way to describe the inner arrays, and no model metadata uses them. */
    if (et == GGUF_TYPE_ARRAY)
        return blade_error_set(r->err, "gguf: %s: array of arrays at offset %zu is not supported",
                               ctx, type_at);
    kv->arr_type = (gguf_value_type)et;
    size_t len_at = r->pos;
    if (read_u64(r, &kv->arr_len, ctx, "array length", -1) != 0)
        return -1;
    if (kv->arr_type == GGUF_TYPE_STRING)
        return read_string_array(r, kv, ctx, len_at);

    size_t esz = gguf_value_type_size(kv->arr_type);
    const char *tname = gguf_value_type_name(kv->arr_type);
    if (kv->arr_len > UINT64_MAX / esz)
        return blade_error_set(r->err, "gguf: %s: array of %" PRIu64 " %s elements (length at "
                               "offset %zu): byte size overflows 64 bits", ctx, kv->arr_len,
                               tname, len_at);
    uint64_t bytes = kv->arr_len * esz;
    if (bytes > remaining(r))
        return blade_error_set(r->err, "gguf: %s: array of %" PRIu64 " %s elements (%" PRIu64
                               " bytes, length at offset %zu) extends past end of file (size "
                               "%zu, %zu bytes remain)", ctx, kv->arr_len, tname, bytes, len_at,
                               r->size, remaining(r));
    kv->arr_data = r->p + r->pos;
    if (kv->arr_type == GGUF_TYPE_BOOL) {
        const uint8_t *b = r->p + r->pos;
        for (uint64_t i = 0; i < kv->arr_len; i++)
            if (b[i] > 1)
                return blade_error_set(r->err, "gguf: %s: bool array element #%" PRIu64
                                       " at offset %zu is %u, not 0 or 1", ctx, i,
                                       r->pos + (size_t)i, b[i]);
    }
    r->pos += (size_t)bytes;
    return 0;
}

static int read_kv(reader *r, gguf_kv *kv, uint64_t index)
{
    char ctx[CTX_LEN];
    kv->file_offset = r->pos;
    snprintf(ctx, sizeof ctx, "kv #%" PRIu64 " (at offset %zu)", index, kv->file_offset);
    if (!(kv->key = read_name(r, ctx, "key")))
        return -1;
    char name[NAME_DESC_LEN];
    gguf_describe_name(name, sizeof name, kv->key, strlen(kv->key));
    snprintf(ctx, sizeof ctx, "key '%s' (kv #%" PRIu64 " at offset %zu)", name, index,
             kv->file_offset);

    size_t type_at = r->pos;
    uint32_t type;
    if (read_u32(r, &type, ctx, "value type", -1) != 0)
        return -1;
    if (type >= GGUF_TYPE_COUNT)
        return blade_error_set(r->err, "gguf: %s: unknown value type %" PRIu32 " at offset %zu",
                               ctx, type, type_at);
    kv->type = (gguf_value_type)type;
    if (kv->type == GGUF_TYPE_STRING)
        return read_string(r, &kv->str, ctx, "string value", -1);
    if (kv->type == GGUF_TYPE_ARRAY)
        return read_array(r, kv, ctx);
    return read_scalar(r, kv, ctx);
}

static int compare_kv_ptr(const void *a, const void *b)
{
    const gguf_kv *x = *(const gguf_kv *const *)a, *y = *(const gguf_kv *const *)b;
    int c = strcmp(x->key, y->key);
    if (c)
        return c;
    return (x->file_offset > y->file_offset) - (x->file_offset < y->file_offset);
}

/* Sorting keeps a hostile file with many keys from costing quadratic time. */
static int check_duplicate_keys(gguf_file *f, blade_error *err)
{
    if (f->n_kv < 2)
        return 0;
    const gguf_kv **order = malloc((size_t)f->n_kv * sizeof *order);
    if (!order)
        return blade_error_set(err, "gguf: out of memory checking %" PRIu64 " keys", f->n_kv);
    for (uint64_t i = 0; i < f->n_kv; i++)
        order[i] = &f->kv[i];
    qsort(order, (size_t)f->n_kv, sizeof *order, compare_kv_ptr);
    int rc = 0;
    for (uint64_t i = 1; i < f->n_kv; i++) {
        if (strcmp(order[i - 1]->key, order[i]->key) == 0) {
            char name[NAME_DESC_LEN];
            gguf_describe_name(name, sizeof name, order[i]->key, strlen(order[i]->key));
            rc = blade_error_set(err, "gguf: duplicate key '%s' at offsets %zu and %zu", name,
                                 order[i - 1]->file_offset, order[i]->file_offset);
            break;
        }
    }
    free(order);
    return rc;
}

static int read_alignment(gguf_file *f, blade_error *err)
{
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_kv *kv = gguf_find_kv(f, "general.alignment");
    if (!kv)
        return 0;
    if (kv->type != GGUF_TYPE_UINT32)
        return blade_error_set(err, "gguf: key 'general.alignment' (at offset %zu) has type %s, "
                               "must be u32", kv->file_offset, gguf_value_type_name(kv->type));
    uint64_t a = kv->scalar.u64;
    if (a == 0 || (a & (a - 1)) != 0)
        return blade_error_set(err, "gguf: key 'general.alignment' (at offset %zu) is %" PRIu64
                               ", must be a non-zero power of two", kv->file_offset, a);
    f->alignment = (uint32_t)a;
    return 0;
}

/* ---- tensor infos ---- */

/* Where each tensor's info and offset field sit, kept only while validating. */
typedef struct tensor_ref {
    const gguf_tensor *t;
    size_t info_at;
    size_t offset_at;
} tensor_ref;

static void tensor_ctx(char *dst, size_t cap, const tensor_ref *ref)
{
    char name[NAME_DESC_LEN];
    gguf_describe_name(name, sizeof name, ref->t->name, strlen(ref->t->name));
    snprintf(dst, cap, "tensor '%s' (info at offset %zu)", name, ref->info_at);
}

static int read_tensor_info(reader *r, gguf_tensor *t, tensor_ref *ref, uint64_t index)
{
    char ctx[CTX_LEN];
    ref->t = t;
    ref->info_at = r->pos;
    snprintf(ctx, sizeof ctx, "tensor #%" PRIu64 " (info at offset %zu)", index, ref->info_at);
    if (!(t->name = read_name(r, ctx, "tensor name")))
        return -1;
    tensor_ctx(ctx, sizeof ctx, ref);

    size_t at = r->pos;
    if (read_u32(r, &t->n_dims, ctx, "n_dims", -1) != 0)
        return -1;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return blade_error_set(r->err, "gguf: %s: n_dims %" PRIu32 " at offset %zu is out of "
                               "range (1..%d)", ctx, t->n_dims, at, GGUF_MAX_DIMS);
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d >= t->n_dims)
            continue;
        uint64_t dim;
        at = r->pos;
        if (read_u64(r, &dim, ctx, "dimension", d) != 0)
            return -1;
        if (dim == 0)
            return blade_error_set(r->err, "gguf: %s: dimension #%" PRIu32 " at offset %zu is 0",
                                   ctx, d, at);
        if (dim > (uint64_t)INT64_MAX)
            return blade_error_set(r->err, "gguf: %s: dimension #%" PRIu32 " at offset %zu is %"
                                   PRIu64 ", negative as a signed 64-bit count", ctx, d, at, dim);
        t->ne[d] = (int64_t)dim;
    }

    at = r->pos;
    if (read_u32(r, &t->type, ctx, "type", -1) != 0)
        return -1;
    const blade_type_traits *tt = blade_type_traits_get(t->type);
    if (!tt)
        return blade_error_set(r->err, "gguf: %s: unknown tensor type id %" PRIu32
                               " at offset %zu", ctx, t->type, at);
    ref->offset_at = r->pos;
    if (read_u64(r, &t->offset, ctx, "data offset", -1) != 0)
        return -1;
    if (gguf_tensor_layout(tt, t->n_dims, t->ne, &t->n_elements, &t->nbytes, r->err) != 0)
        return blade_error_prefix(r->err, "gguf: %s", ctx);
    return 0;
}

static int compare_ref_name(const void *a, const void *b)
{
    const tensor_ref *x = a, *y = b;
    int c = strcmp(x->t->name, y->t->name);
    if (c)
        return c;
    return (x->info_at > y->info_at) - (x->info_at < y->info_at);
}

static int compare_ref_offset(const void *a, const void *b)
{
    const tensor_ref *x = a, *y = b;
    if (x->t->offset != y->t->offset)
        return x->t->offset < y->t->offset ? -1 : 1;
    return (x->info_at > y->info_at) - (x->info_at < y->info_at);
}

static int check_tensor_data(gguf_file *f, tensor_ref *refs, blade_error *err)
{
    char ctx[CTX_LEN];
    uint64_t n = f->n_tensors;

    qsort(refs, (size_t)n, sizeof *refs, compare_ref_name);
    for (uint64_t i = 1; i < n; i++) {
        if (strcmp(refs[i - 1].t->name, refs[i].t->name) == 0) {
            tensor_ctx(ctx, sizeof ctx, &refs[i]);
            return blade_error_set(err, "gguf: %s: duplicate tensor name, first defined by the "
                                   "info at offset %zu", ctx, refs[i - 1].info_at);
        }
    }

    size_t avail = f->size - f->data_offset;
    for (uint64_t i = 0; i < n; i++) {
        const gguf_tensor *t = refs[i].t;
        tensor_ctx(ctx, sizeof ctx, &refs[i]);
        if (t->offset % f->alignment != 0)
            return blade_error_set(err, "gguf: %s: data offset %" PRIu64 " at offset %zu is not "
                                   "a multiple of the alignment %" PRIu32, ctx, t->offset,
                                   refs[i].offset_at, f->alignment);
        if (t->offset > avail || t->nbytes > avail - t->offset)
            return blade_error_set(err, "gguf: %s: data [offset %" PRIu64 ", +%zu bytes] extends "
                                   "past end of file (size %zu, data section starts at %zu)",
                                   ctx, t->offset, t->nbytes, f->size, f->data_offset);
    }

    /* No writer produces tensors that share bytes, so overlap means a corrupt or crafted
     * table; accepting it would let one tensor's data masquerade as another's. */
    qsort(refs, (size_t)n, sizeof *refs, compare_ref_offset);
    for (uint64_t i = 1; i < n; i++) {
        const gguf_tensor *a = refs[i - 1].t, *b = refs[i].t;
        if (a->offset + a->nbytes > b->offset) {
            char other[NAME_DESC_LEN];
            gguf_describe_name(other, sizeof other, a->name, strlen(a->name));
            tensor_ctx(ctx, sizeof ctx, &refs[i]);
            return blade_error_set(err, "gguf: %s: data [offset %" PRIu64 ", +%zu bytes] overlaps "
                                   "tensor '%s' [offset %" PRIu64 ", +%zu bytes]", ctx, b->offset,
                                   b->nbytes, other, a->offset, a->nbytes);
        }
    }
    return 0;
}

static int read_tensor_infos(gguf_file *f, reader *r, blade_error *err)
{
    if (f->n_tensors == 0)
        return 0;
    f->tensors = calloc((size_t)f->n_tensors, sizeof *f->tensors);
    tensor_ref *refs = calloc((size_t)f->n_tensors, sizeof *refs);
    int rc = 0;
    if (!f->tensors || !refs) {
        rc = blade_error_set(err, "gguf: out of memory for %" PRIu64 " tensor infos", f->n_tensors);
        goto done;
    }
    for (uint64_t i = 0; i < f->n_tensors && rc == 0; i++)
        rc = read_tensor_info(r, &f->tensors[i], &refs[i], i);
    if (rc != 0)
        goto done;

    uint64_t data_start = ((uint64_t)r->pos + f->alignment - 1) / f->alignment * f->alignment;
    if (data_start > f->size) {
        rc = blade_error_set(err, "gguf: data section would start at offset %" PRIu64 " (tensor "
                             "infos end at %zu, alignment %" PRIu32 "), past end of file (size "
                             "%zu)", data_start, r->pos, f->alignment, f->size);
        goto done;
    }
    f->data_offset = (size_t)data_start;
    rc = check_tensor_data(f, refs, err);
    for (uint64_t i = 0; i < f->n_tensors && rc == 0; i++)
        f->tensors[i].data = f->map + f->data_offset + f->tensors[i].offset;
done:
    free(refs);
    return rc;
}

/* ---- whole file ---- */

static int parse(gguf_file *f, blade_error *err)
{
    reader r = {.p = f->map, .size = f->size, .pos = 0, .err = err};
    if (f->size == 0)
        return blade_error_set(err, "gguf: file is empty");
    if (f->size < 4)
        return blade_error_set(err, "gguf: file is %zu bytes, too small to hold the 4-byte "
                               "magic", f->size);
    if (memcmp(f->map, GGUF_MAGIC, 4) != 0) {
        char found[NAME_DESC_LEN];
        gguf_describe_name(found, sizeof found, (const char *)f->map, 4);
        return blade_error_set(err, "gguf: bad magic at offset 0: expected \"GGUF\", found \"%s\"",
                               found);
    }
    r.pos = 4;
    if (read_u32(&r, &f->version, "header", "version", -1) != 0)
        return -1;
    if (f->version != 2 && f->version != 3)
        return blade_error_set(err, "gguf: header: unsupported version %" PRIu32 " at offset 4 "
                               "(blade reads versions 2 and 3)", f->version);
    uint64_t n_tensors, n_kv;
    if (read_u64(&r, &n_tensors, "header", "n_tensors", -1) != 0 ||
        read_u64(&r, &n_kv, "header", "n_kv", -1) != 0)
        return -1;

    size_t avail = remaining(&r);
    if (n_tensors > avail / MIN_TENSOR_INFO_BYTES)
        return blade_error_set(err, "gguf: header: n_tensors = %" PRIu64 " at offset 8 cannot "
                               "fit: each tensor info needs at least %d bytes and only %zu "
                               "bytes follow the header", n_tensors, MIN_TENSOR_INFO_BYTES, avail);
    if (n_kv > avail / MIN_KV_BYTES)
        return blade_error_set(err, "gguf: header: n_kv = %" PRIu64 " at offset 16 cannot fit: "
                               "each key/value pair needs at least %d bytes and only %zu bytes "
                               "follow the header", n_kv, MIN_KV_BYTES, avail);
    if (n_tensors * MIN_TENSOR_INFO_BYTES + n_kv * MIN_KV_BYTES > avail)
        return blade_error_set(err, "gguf: header: n_tensors = %" PRIu64 " and n_kv = %" PRIu64
                               " cannot fit together in the %zu bytes that follow the header",
                               n_tensors, n_kv, avail);

    if (n_kv > 0 && !(f->kv = calloc((size_t)n_kv, sizeof *f->kv)))
        return blade_error_set(err, "gguf: out of memory for %" PRIu64 " key/value pairs", n_kv);
    f->n_kv = n_kv;
    for (uint64_t i = 0; i < n_kv; i++)
        if (read_kv(&r, &f->kv[i], i) != 0)
            return -1;
    if (check_duplicate_keys(f, err) != 0 || read_alignment(f, err) != 0)
        return -1;

    f->n_tensors = n_tensors;
    if (read_tensor_infos(f, &r, err) != 0)
        return -1;
    if (n_tensors == 0) {
        /* Tokenizer-only files end right after their metadata, without padding; the empty
         * data section then starts at the end of the file rather than beyond it. */
        uint64_t start = ((uint64_t)r.pos + f->alignment - 1) / f->alignment * f->alignment;
        f->data_offset = start > f->size ? f->size : (size_t)start;
    }
    return 0;
}

gguf_file *gguf_open_memory(const void *buf, size_t size, blade_error *err)
{
    if (!buf && size > 0) {
        blade_error_set(err, "gguf: no buffer given");
        return NULL;
    }
    gguf_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup("<memory>"))) {
        free(f);
        blade_error_set(err, "gguf: out of memory");
        return NULL;
    }
    f->map = buf;
    f->size = size;
    if (parse(f, err) != 0) {
        gguf_close(f);
        return NULL;
    }
    return f;
}

/* What parse allocated, leaving the map. */
static void release_parsed(gguf_file *f)
{
    if (f->kv) {
        for (uint64_t i = 0; i < f->n_kv; i++) {
            free(f->kv[i].key);
            free(f->kv[i].arr_strings);
        }
        free(f->kv);
    }
    if (f->tensors) {
        for (uint64_t i = 0; i < f->n_tensors; i++)
            free(f->tensors[i].name);
        free(f->tensors);
    }
    f->kv = NULL;
    f->n_kv = 0;
    f->tensors = NULL;
    f->n_tensors = 0;
}

/* Weights are streamed once per decode step. Read through the file's page-cache mapping
 * they arrive in 4 KiB pages, and the GEMV measured at about 60% of the bandwidth it
 * reaches on anonymous memory the kernel backs with 2 MiB pages (one TLB entry per 2 MiB
 * instead of 512). So the file is copied once into such memory, read-only afterwards.
 * NULL (and the file mapping is used as it is) when the memory cannot be had, or when the
 * copy would take more than half of the memory available now: a model that barely fits
 * is better paged from its file than pushed out by the OOM killer. */
static uint8_t *copy_to_huge_pages(const void *map, size_t size, size_t shift, size_t *mapped_bytes)
{
    const size_t huge = (size_t)2 << 20;
    long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0 || size / (size_t)page > (size_t)pages / 2 || size > SIZE_MAX - 3 * huge)
        return NULL;
    size_t bytes = (size + shift + huge - 1) / huge * huge;
    uint8_t *raw = mmap(NULL, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    uint8_t *aligned = raw + ((huge - (uintptr_t)raw % huge) % huge);
    if (aligned > raw)
        munmap(raw, (size_t)(aligned - raw));
    if (raw + bytes + huge > aligned + bytes)
        munmap(aligned + bytes, (size_t)(raw + bytes + huge - (aligned + bytes)));
    madvise(aligned, bytes, MADV_HUGEPAGE);
    memcpy(aligned + shift, map, size);
    mprotect(aligned, bytes, PROT_READ);
    *mapped_bytes = bytes;
    return aligned;
}

/* copy_weights: into huge pages for the kernels (gguf_open), or not at all (gguf_open_mapped). */
static gguf_file *open_file(const char *path, bool copy_weights, blade_error *err)
{
    if (!path) {
        blade_error_set(err, "gguf: no path given");
        return NULL;
    }
    int fd = blade_open_regular(path, err);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        blade_error_set(err, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    if (st.st_size == 0) {
        blade_error_set(err, "%s: file is empty, not a GGUF file", path);
        close(fd);
        return NULL;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        blade_error_set(err, "%s: file of %lld bytes is too large to map", path,
                        (long long)st.st_size);
        close(fd);
        return NULL;
    }
    size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) {
        blade_error_set(err, "%s: cannot map %zu bytes: %s", path, size, strerror(map_errno));
        return NULL;
    }
    gguf_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        munmap(map, size);
        blade_error_set(err, "%s: out of memory", path);
        return NULL;
    }
    f->map = map;
    f->size = size;
    f->map_bytes = size;
    f->owns_map = true;
    if (parse(f, err) != 0) {
        blade_error_prefix(err, "%s", path);
        gguf_close(f);
        return NULL;
    }
    if (!copy_weights)
        return f;
    /* The kernels load weights 64 bytes at a time, and the format's default alignment is
     * 32: copied as it lies, a data section at 32 past a cache line splits every such load
     * across two lines (the BF16 one-token product measured about 25% slower so). The copy
     * starts the data section on a cache line, and the file is parsed again in place. */
    size_t shift = (GGUF_COPY_ALIGN - f->data_offset % GGUF_COPY_ALIGN) % GGUF_COPY_ALIGN, copy_bytes = 0;
    uint8_t *copy = copy_to_huge_pages(map, size, shift, &copy_bytes);
    if (copy) {
        release_parsed(f);
        munmap(map, size);
        f->map = copy + shift;
        f->map_shift = shift;
        f->map_bytes = copy_bytes;
        f->copied = true;
        if (parse(f, err) != 0) {
            blade_error_prefix(err, "%s", path);
            gguf_close(f);
            return NULL;
        }
    }
    return f;
}

gguf_file *gguf_open(const char *path, blade_error *err)
{
    return open_file(path, true, err);
}

gguf_file *gguf_open_mapped(const char *path, blade_error *err)
{
    return open_file(path, false, err);
}

uint8_t *gguf_set_writable(gguf_file *f, bool writable)
{
    if (!f->copied)
        return NULL;
    if (mprotect((void *)(f->map - f->map_shift), f->map_bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ) != 0 ||
        !writable)
        return NULL;
    return (uint8_t *)f->map;
}

void gguf_close(gguf_file *f)
{
    if (!f)
        return;
    release_parsed(f);
    if (f->owns_map && f->map)
        munmap((void *)(f->map - f->map_shift), f->map_bytes);
    free(f->path);
    free(f);
}

/* ---- lookups and typed getters ---- */

const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key)
{
    if (!f || !key)
        return NULL;
    for (uint64_t i = 0; i < f->n_kv; i++)
        if (strcmp(f->kv[i].key, key) == 0)
            return &f->kv[i];
    return NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name)
{
    if (!f || !name)
        return NULL;
    for (uint64_t i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0)
            return &f->tensors[i];
    return NULL;
}

static const gguf_kv *lookup(const gguf_file *f, const char *key, bool *present)
{
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (present)
        *present = kv != NULL;
    return kv;
}

static void describe_kv_type(char *dst, size_t cap, const gguf_kv *kv)
{
    if (kv->type == GGUF_TYPE_ARRAY)
        snprintf(dst, cap, "array of %s", gguf_value_type_name(kv->arr_type));
    else
        snprintf(dst, cap, "%s", gguf_value_type_name(kv->type));
}

static bool wrong_type(const gguf_file *f, const gguf_kv *kv, const char *expected,
                       blade_error *err)
{
    char name[NAME_DESC_LEN], actual[64];
    gguf_describe_name(name, sizeof name, kv->key, strlen(kv->key));
    describe_kv_type(actual, sizeof actual, kv);
    blade_error_set(err, "%s: key '%s' (at offset %zu) has type %s, expected %s", f->path, name,
                    kv->file_offset, actual, expected);
    return false;
}

typedef enum int_kind { INT_NONE, INT_UNSIGNED, INT_SIGNED } int_kind;

static int_kind integer_kind(gguf_value_type t)
{
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_UINT32: case GGUF_TYPE_UINT64:
        return INT_UNSIGNED;
    case GGUF_TYPE_INT8: case GGUF_TYPE_INT16: case GGUF_TYPE_INT32: case GGUF_TYPE_INT64:
        return INT_SIGNED;
    default:
        return INT_NONE;
    }
}

static bool out_of_range(const gguf_file *f, const gguf_kv *kv, const char *target,
                         blade_error *err)
{
    char name[NAME_DESC_LEN], value[32];
    gguf_describe_name(name, sizeof name, kv->key, strlen(kv->key));
    if (integer_kind(kv->type) == INT_SIGNED)
        snprintf(value, sizeof value, "%" PRId64, kv->scalar.i64);
    else if (integer_kind(kv->type) == INT_UNSIGNED)
        snprintf(value, sizeof value, "%" PRIu64, kv->scalar.u64);
    else
        snprintf(value, sizeof value, "%g", kv->scalar.f64);
    blade_error_set(err, "%s: key '%s' (at offset %zu): %s value %s does not fit %s", f->path,
                    name, kv->file_offset, gguf_value_type_name(kv->type), value, target);
    return false;
}

/* Finds an integer-typed value and checks it lies within [lo, hi]; NULL when absent or
 * unusable (err says which). */
static const gguf_kv *get_integer(const gguf_file *f, const char *key, bool *present,
                                  blade_error *err, int64_t lo, uint64_t hi, const char *target)
{
    const gguf_kv *kv = lookup(f, key, present);
    if (!kv)
        return NULL;
    switch (integer_kind(kv->type)) {
    case INT_UNSIGNED:
        if (kv->scalar.u64 > hi) {
            out_of_range(f, kv, target, err);
            return NULL;
        }
        return kv;
    case INT_SIGNED:
        if (kv->scalar.i64 < lo || (kv->scalar.i64 > 0 && (uint64_t)kv->scalar.i64 > hi)) {
            out_of_range(f, kv, target, err);
            return NULL;
        }
        return kv;
    case INT_NONE:
        break;
    }
    wrong_type(f, kv, "an integer", err);
    return NULL;
}

/* Exact once get_integer has checked the value against a non-negative range. */
static uint64_t int_as_u64(const gguf_kv *kv)
{
    return integer_kind(kv->type) == INT_SIGNED ? (uint64_t)kv->scalar.i64 : kv->scalar.u64;
}

/* Exact once get_integer has checked the value against a range ending at INT64_MAX. */
static int64_t int_as_i64(const gguf_kv *kv)
{
    return integer_kind(kv->type) == INT_UNSIGNED ? (int64_t)kv->scalar.u64 : kv->scalar.i64;
}

bool gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, bool *present,
                  blade_error *err)
{
    const gguf_kv *kv = get_integer(f, key, present, err, 0, UINT32_MAX, "u32");
    if (!kv)
        return false;
    *out = (uint32_t)int_as_u64(kv);
    return true;
}

bool gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out, bool *present,
                  blade_error *err)
{
    const gguf_kv *kv = get_integer(f, key, present, err, 0, UINT64_MAX, "u64");
    if (!kv)
        return false;
    *out = int_as_u64(kv);
    return true;
}

bool gguf_get_i64(const gguf_file *f, const char *key, int64_t *out, bool *present,
                  blade_error *err)
{
    const gguf_kv *kv = get_integer(f, key, present, err, INT64_MIN, INT64_MAX, "i64");
    if (!kv)
        return false;
    *out = int_as_i64(kv);
    return true;
}

bool gguf_get_f32(const gguf_file *f, const char *key, float *out, bool *present,
                  blade_error *err)
{
    const gguf_kv *kv = lookup(f, key, present);
    if (!kv)
        return false;
    if (kv->type != GGUF_TYPE_FLOAT32 && kv->type != GGUF_TYPE_FLOAT64)
        return wrong_type(f, kv, "f32 or f64", err);
    double v = kv->scalar.f64;
    /* Converting an out-of-range double to float is undefined behaviour in C. */
    if (isfinite(v) && fabs(v) > FLT_MAX)
        return out_of_range(f, kv, "f32", err);
    *out = (float)v;
    return true;
}

bool gguf_get_bool(const gguf_file *f, const char *key, bool *out, bool *present,
                   blade_error *err)
{
    const gguf_kv *kv = lookup(f, key, present);
    if (!kv)
        return false;
    if (kv->type != GGUF_TYPE_BOOL)
        return wrong_type(f, kv, "bool", err);
    *out = kv->scalar.b;
    return true;
}

char *gguf_get_string(const gguf_file *f, const char *key, bool *present, blade_error *err)
{
    const gguf_kv *kv = lookup(f, key, present);
    if (!kv)
        return NULL;
    if (kv->type != GGUF_TYPE_STRING) {
        wrong_type(f, kv, "string", err);
        return NULL;
    }
    char name[NAME_DESC_LEN];
    gguf_describe_name(name, sizeof name, kv->key, strlen(kv->key));
    /* A C string would silently cut the value short at the first NUL. */
    if (memchr(kv->str.ptr, '\0', (size_t)kv->str.len)) {
        blade_error_set(err, "%s: key '%s' (at offset %zu): string value contains a NUL byte",
                        f->path, name, kv->file_offset);
        return NULL;
    }
    char *s = malloc((size_t)kv->str.len + 1);
    if (!s) {
        blade_error_set(err, "%s: key '%s': out of memory copying a %" PRIu64 "-byte string",
                        f->path, name, kv->str.len);
        return NULL;
    }
    memcpy(s, kv->str.ptr, (size_t)kv->str.len);
    s[kv->str.len] = '\0';
    return s;
}

const gguf_kv *gguf_find_array(const gguf_file *f, const char *key, gguf_value_type elem_type,
                               bool *present, blade_error *err)
{
    const gguf_kv *kv = lookup(f, key, present);
    if (!kv)
        return NULL;
    if (kv->type != GGUF_TYPE_ARRAY || kv->arr_type != elem_type) {
        char expected[64];
        snprintf(expected, sizeof expected, "array of %s", gguf_value_type_name(elem_type));
        wrong_type(f, kv, expected, err);
        return NULL;
    }
    return kv;
}

#ifndef BLADE_GGUF_H
#define BLADE_GGUF_H

/* GGUF v2/v3 reader (mmap, every field validated before use) and writer.
 * The file is hostile until checked: gguf_open validates the whole header, metadata and
 * tensor table up front, so a successfully opened file can be used without further
 * bounds checks. Errors name the field and the file offset. */

#include "blade/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
/* Where gguf_open's in-memory copy starts the tensor data section: a cache line. */
#define GGUF_COPY_ALIGN 64
#define GGUF_MAX_DIMS 4

typedef enum gguf_value_type {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT
} gguf_value_type;

/* A string inside the mapped file: not NUL-terminated. */
typedef struct gguf_string {
    const char *ptr;
    uint64_t len;
} gguf_string;

typedef struct gguf_kv {
    char *key; /* NUL-terminated copy */
    gguf_value_type type;
    /* scalars (type != STRING/ARRAY): the value widened into the matching member */
    union {
        uint64_t u64;
        int64_t i64;
        double f64;
        bool b;
    } scalar;
    gguf_string str; /* type == STRING */
    /* type == ARRAY */
    gguf_value_type arr_type;
    uint64_t arr_len;
    /* First element in the map, for fixed-size element types. GGUF does not align
     * metadata, so this is usually NOT aligned for its element type: memcpy elements out
     * instead of casting to e.g. const uint32_t *. */
    const void *arr_data;
    gguf_string *arr_strings;  /* arr_type == STRING: arr_len entries */
    size_t file_offset;        /* where the key/value pair starts, for error messages */
} gguf_kv;

typedef struct gguf_tensor {
    char *name; /* NUL-terminated copy */
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS]; /* ne[0] is the row length (contiguous); unused dims are 1 */
    uint32_t type;             /* blade_type / ggml type id */
    uint64_t offset;           /* relative to the data section */
    uint64_t n_elements;
    size_t nbytes;
    /* Inside the map, at a multiple of the file's alignment from the start of the data
     * section (which gguf_open's copy starts on a GGUF_COPY_ALIGN boundary). */
    const void *data;
} gguf_tensor;

typedef struct gguf_file {
    char *path; /* "<memory>" for gguf_open_memory */
    const uint8_t *map;
    size_t size;
    size_t map_bytes; /* of the mapping, size rounded up when the file was copied to huge pages */
    size_t map_shift; /* the copy's file image starts this far into its mapping */
    bool owns_map;    /* false for gguf_open_memory */
    bool copied;      /* the map is gguf_open's copy in anonymous memory, not the file's pages */
    uint32_t version;
    uint64_t n_kv;
    gguf_kv *kv;
    uint64_t n_tensors;
    gguf_tensor *tensors;
    uint32_t alignment;
    size_t data_offset; /* start of the tensor data section; at most size (a file without
                         * tensors may end unpadded, before the aligned position) */
} gguf_file;

gguf_file *gguf_open(const char *path, blade_error *err);
/* The same file read through its own mapping, never copied into memory: only the pages a
 * caller touches are read. For a caller that needs no weights (a tokenizer, a chat template)
 * it costs what the metadata does, and for one pass over the weights (converting a model)
 * it saves the copy's time and memory. Validated as by gguf_open. */
gguf_file *gguf_open_mapped(const char *path, blade_error *err);
/* Parses a buffer the caller keeps alive (used by tests); same validation. */
gguf_file *gguf_open_memory(const void *buf, size_t size, blade_error *err);
void gguf_close(gguf_file *f);
/* Makes the tensor data of a file gguf_open copied into memory writable (returning the
 * map's start, to which tensor offsets apply) or read-only again (returning NULL), so a
 * loader can rearrange weights in place once. NULL for memory given to gguf_open_memory,
 * which the caller owns, for a file read through its own mapping (writing would turn its
 * page-cache pages into private memory one by one, what that mapping is kept to avoid), or
 * when the protection cannot be changed. */
uint8_t *gguf_set_writable(gguf_file *f, bool writable);

const char *gguf_value_type_name(gguf_value_type t);

const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);

/* Typed getters: return false (and leave *out untouched) when the key is absent.
 * When present with an incompatible type they set err and return false with
 * *present = true, so callers can tell "missing" from "wrong". Integer getters accept any
 * integer type whose value fits. */
bool gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, bool *present, blade_error *err);
bool gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out, bool *present, blade_error *err);
bool gguf_get_i64(const gguf_file *f, const char *key, int64_t *out, bool *present, blade_error *err);
bool gguf_get_f32(const gguf_file *f, const char *key, float *out, bool *present, blade_error *err);
bool gguf_get_bool(const gguf_file *f, const char *key, bool *out, bool *present, blade_error *err);
/* Returns a NUL-terminated malloc'd copy, or NULL. */
char *gguf_get_string(const gguf_file *f, const char *key, bool *present, blade_error *err);
/* Array accessor: kv must be of type ARRAY with the given element type. */
const gguf_kv *gguf_find_array(const gguf_file *f, const char *key, gguf_value_type elem_type,
                               bool *present, blade_error *err);

/* ---- writer ---- */

typedef struct gguf_writer gguf_writer;

gguf_writer *gguf_writer_new(void);
void gguf_writer_free(gguf_writer *w);
/* Metadata, in insertion order. Strings are copied. */
void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v);
void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v);
void gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v);
void gguf_writer_set_f32(gguf_writer *w, const char *key, float v);
void gguf_writer_set_bool(gguf_writer *w, const char *key, bool v);
void gguf_writer_set_string(gguf_writer *w, const char *key, const char *v);
void gguf_writer_set_array(gguf_writer *w, const char *key, gguf_value_type elem_type,
                           const void *data, uint64_t n);
void gguf_writer_set_string_array(gguf_writer *w, const char *key, const char *const *v, uint64_t n);
/* Copies every key/value of an opened file (used when re-writing a model). */
void gguf_writer_copy_kv(gguf_writer *w, const gguf_file *src);
/* Drops a key set or copied earlier (nothing when there is none), keeping the others' order. */
void gguf_writer_remove_kv(gguf_writer *w, const char *key);
/* Copies, with their types, the key/values whose key starts with prefix. */
void gguf_writer_copy_kv_prefix(gguf_writer *w, const gguf_file *src, const char *prefix);
/* Tensor data is referenced, not copied: it must stay valid until gguf_writer_write.
 * ne has n_dims entries. */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                           const int64_t *ne, const void *data, size_t nbytes, blade_error *err);
/* A tensor whose bytes are produced while the file is written, so a converter holds one
 * tensor at a time instead of the whole model: fill(fill_ctx, dst, nbytes, err) is called
 * once, in file order, to fill a buffer of nbytes. Returning non-zero (with err set) aborts
 * the write. */
typedef int (*gguf_fill_fn)(void *fill_ctx, void *dst, size_t nbytes, blade_error *err);
int gguf_writer_add_tensor_filled(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                                  const int64_t *ne, size_t nbytes, gguf_fill_fn fill, void *fill_ctx,
                                  blade_error *err);
/* Writes a GGUF v3 file with general.alignment (default 32). A regular file (or a new name)
 * is written to a temporary file in the same directory, synced and renamed into place, so
 * path holds either its old contents or the complete new file, never a partial one, even
 * when the write fails, a fill function aborts it or the process dies; a symbolic link is
 * followed. An existing non-regular file (a device, a pipe) is written in place. Shows
 * progress on a terminal when show_progress is set. */
int gguf_writer_write(gguf_writer *w, const char *path, bool show_progress, blade_error *err);

#endif

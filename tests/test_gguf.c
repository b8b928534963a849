/* GGUF reader and writer: a full round trip through every value type, one hand-broken
 * file per validation rule (each must be refused with its specific message), every shared
 * model file plus truncated copies of it, and byte-flip robustness. */
#include "testutil.h"

#include "blade/gguf.h"
#include "blade/types.h"

#include <glob.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- byte builder ---- */

typedef struct bb {
    uint8_t *p;
    size_t n, cap;
} bb;

static void bb_put(bb *b, const void *d, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}

static void bb_u8(bb *b, uint8_t v) { bb_put(b, &v, 1); }
static void bb_u32(bb *b, uint32_t v) { bb_put(b, &v, 4); }
static void bb_u64(bb *b, uint64_t v) { bb_put(b, &v, 8); }

static void bb_bytes_str(bb *b, const char *s, size_t len)
{
    bb_u64(b, len);
    bb_put(b, s, len);
}

static void bb_str(bb *b, const char *s) { bb_bytes_str(b, s, strlen(s)); }

static void bb_pad(bb *b, size_t align)
{
    while (b->n % align)
        bb_u8(b, 0);
}

static void set_u32(bb *b, size_t off, uint32_t v) { memcpy(b->p + off, &v, 4); }
static void set_u64(bb *b, size_t off, uint64_t v) { memcpy(b->p + off, &v, 8); }

static void header(bb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    bb_put(b, "GGUF", 4);
    bb_u32(b, version);
    bb_u64(b, n_tensors);
    bb_u64(b, n_kv);
}

static void kv_head(bb *b, const char *key, gguf_value_type t)
{
    bb_str(b, key);
    bb_u32(b, (uint32_t)t);
}

/* ---- the base file every malformed case starts from ---- */

/* Where the fields sit, so a case can break exactly one of them. */
typedef struct tensor_at {
    size_t info, name, n_dims, ne[2], type, offset;
} tensor_at;

typedef struct layout {
    size_t n_tensors, n_kv;
    size_t align_type, align_value;
    size_t name_type, name_len;
    size_t arr_elem_type, arr_count;
    tensor_at t[2];
    size_t infos_end, data_start;
} layout;

typedef void (*extra_kvs_fn)(bb *b);

/* general.alignment = 32, general.name = "tiny", test.arr = u32[3], then `extra` (n_extra
 * pairs); tensor a: F32 [8, 2] at 0, tensor b: Q4_0 [32, 1] at 64. The file ends exactly
 * where b's data ends, so losing any byte of it must be noticed. */
static void build(bb *b, layout *o, extra_kvs_fn extra, uint64_t n_extra, const char *name_a,
                  const char *name_b)
{
    memset(b, 0, sizeof *b);
    header(b, 3, 2, 3 + n_extra);
    o->n_tensors = 8;
    o->n_kv = 16;

    bb_str(b, "general.alignment");
    o->align_type = b->n;
    bb_u32(b, GGUF_TYPE_UINT32);
    o->align_value = b->n;
    bb_u32(b, 32);

    bb_str(b, "general.name");
    o->name_type = b->n;
    bb_u32(b, GGUF_TYPE_STRING);
    o->name_len = b->n;
    bb_str(b, "tiny");

    kv_head(b, "test.arr", GGUF_TYPE_ARRAY);
    o->arr_elem_type = b->n;
    bb_u32(b, GGUF_TYPE_UINT32);
    o->arr_count = b->n;
    bb_u64(b, 3);
    for (uint32_t i = 1; i <= 3; i++)
        bb_u32(b, i);

    if (extra)
        extra(b);

    const char *names[2] = {name_a, name_b};
    const uint64_t shapes[2][2] = {{8, 2}, {32, 1}};
    const uint32_t types[2] = {BLADE_TYPE_F32, BLADE_TYPE_Q4_0};
    const uint64_t offsets[2] = {0, 64};
    for (int i = 0; i < 2; i++) {
        tensor_at *t = &o->t[i];
        t->info = t->name = b->n;
        bb_str(b, names[i]);
        t->n_dims = b->n;
        bb_u32(b, 2);
        for (int d = 0; d < 2; d++) {
            t->ne[d] = b->n;
            bb_u64(b, shapes[i][d]);
        }
        t->type = b->n;
        bb_u32(b, types[i]);
        t->offset = b->n;
        bb_u64(b, offsets[i]);
    }
    o->infos_end = b->n;
    bb_pad(b, 32);
    o->data_start = b->n;
    for (int i = 0; i < 64 + 18; i++)
        bb_u8(b, (uint8_t)(i * 7 + 1));
}

static void base(bb *b, layout *o)
{
    build(b, o, NULL, 0, "a", "b");
}

/* Parses an exact-size heap copy, so the sanitizers see any read past the end. */
static gguf_file *open_copy(const void *data, size_t n, blade_error *err, void **copy)
{
    *copy = malloc(n ? n : 1);
    assert_non_null(*copy);
    if (n)
        memcpy(*copy, data, n);
    return gguf_open_memory(*copy, n, err);
}

static void expect_reject_at(const uint8_t *data, size_t n, const char *const *needles,
                             const char *file, int line)
{
    blade_error err = {{0}};
    void *copy;
    gguf_file *f = open_copy(data, n, &err, &copy);
    if (f) {
        gguf_close(f);
        free(copy);
        fail_msg("%s:%d: malformed file was accepted", file, line);
    }
    free(copy);
    for (const char *const *s = needles; *s; s++)
        if (!strstr(err.msg, *s))
            fail_msg("%s:%d: error \"%s\" lacks \"%s\"", file, line, err.msg, *s);
}

#define expect_reject(b, ...) \
    expect_reject_at((b)->p, (b)->n, (const char *const[]){__VA_ARGS__, NULL}, __FILE__, __LINE__)

static void test_base_file_is_valid(void **state)
{
    (void)state;
    bb b;
    layout o;
    base(&b, &o);
    blade_error err = {{0}};
    void *copy;
    gguf_file *f = open_copy(b.p, b.n, &err, &copy);
    if (!f)
        fail_msg("%s", err.msg);
    assert_int_equal(f->n_tensors, 2);
    assert_int_equal(f->data_offset, o.data_start);
    assert_int_equal(f->tensors[1].nbytes, 18);
    assert_ptr_equal(f->tensors[1].data, (const uint8_t *)copy + o.data_start + 64);
    gguf_close(f);
    free(copy);
    free(b.p);
}

/* ---- one malformed file per check ---- */

#define CASE(fn) static void fn(void **state)
#define BEGIN \
    (void)state; \
    bb b; \
    layout o; \
    base(&b, &o)
#define END free(b.p)

CASE(bad_magic) { BEGIN; memcpy(b.p, "GGML", 4); expect_reject(&b, "bad magic", "GGML"); END; }
CASE(version_1) { BEGIN; set_u32(&b, 4, 1); expect_reject(&b, "unsupported version 1"); END; }
CASE(version_4) { BEGIN; set_u32(&b, 4, 4); expect_reject(&b, "unsupported version 4"); END; }

CASE(empty_and_tiny_files)
{
    BEGIN;
    expect_reject_at(b.p, 0, (const char *const[]){"empty", NULL}, __FILE__, __LINE__);
    expect_reject_at(b.p, 3, (const char *const[]){"too small", NULL}, __FILE__, __LINE__);
    END;
}

CASE(truncated_header)
{
    BEGIN;
    b.n = 20;
    expect_reject(&b, "header", "n_kv at offset 16", "past end");
    END;
}

CASE(n_kv_too_large) { BEGIN; set_u64(&b, o.n_kv, 1ull << 40); expect_reject(&b, "n_kv = 1099511627776", "cannot fit"); END; }
CASE(n_tensors_too_large) { BEGIN; set_u64(&b, o.n_tensors, 1ull << 40); expect_reject(&b, "n_tensors = 1099511627776", "cannot fit"); END; }

CASE(counts_too_large_together)
{
    BEGIN;
    size_t avail = b.n - 24;
    set_u64(&b, o.n_tensors, avail / 33);
    set_u64(&b, o.n_kv, avail / 14);
    expect_reject(&b, "cannot fit together");
    END;
}

CASE(key_length_past_end)
{
    BEGIN;
    set_u64(&b, 24, 1ull << 40);
    expect_reject(&b, "kv #0", "key length 1099511627776 at offset 24", "past end");
    END;
}

static void extra_empty_key(bb *b) { kv_head(b, "", GGUF_TYPE_UINT8); bb_u8(b, 1); }
CASE(empty_key)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, extra_empty_key, 1, "a", "b");
    expect_reject(&b, "kv #3", "empty key");
    END;
}

static void extra_nul_key(bb *b)
{
    bb_bytes_str(b, "ab\0c", 4);
    bb_u32(b, GGUF_TYPE_UINT8);
    bb_u8(b, 1);
}
CASE(key_with_nul)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, extra_nul_key, 1, "a", "b");
    expect_reject(&b, "kv #3", "contains a NUL byte");
    END;
}

CASE(string_value_past_end)
{
    BEGIN;
    set_u64(&b, o.name_len, 100000);
    expect_reject(&b, "key 'general.name'", "string value length 100000", "past end");
    END;
}

CASE(array_past_end)
{
    BEGIN;
    set_u64(&b, o.arr_count, 1000);
    expect_reject(&b, "key 'test.arr'", "array of 1000 u32 elements", "past end");
    END;
}

CASE(array_size_overflow)
{
    BEGIN;
    set_u64(&b, o.arr_count, 1ull << 62);
    expect_reject(&b, "key 'test.arr'", "byte size overflows");
    END;
}

static void extra_huge_string_array(bb *b)
{
    kv_head(b, "test.strs", GGUF_TYPE_ARRAY);
    bb_u32(b, GGUF_TYPE_STRING);
    bb_u64(b, 1ull << 40);
}
CASE(string_array_count_too_large)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, extra_huge_string_array, 1, "a", "b");
    expect_reject(&b, "key 'test.strs'", "array of 1099511627776 strings", "cannot fit");
    END;
}

static void extra_bad_string_element(bb *b)
{
    kv_head(b, "test.strs", GGUF_TYPE_ARRAY);
    bb_u32(b, GGUF_TYPE_STRING);
    bb_u64(b, 2);
    bb_str(b, "ok");
    bb_u64(b, 1ull << 33);
}
CASE(string_array_element_past_end)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, extra_bad_string_element, 1, "a", "b");
    expect_reject(&b, "key 'test.strs'", "array element #1 length 8589934592", "past end");
    END;
}

CASE(unknown_value_type) { BEGIN; set_u32(&b, o.name_type, 13); expect_reject(&b, "key 'general.name'", "unknown value type 13"); END; }
CASE(unknown_array_type) { BEGIN; set_u32(&b, o.arr_elem_type, 42); expect_reject(&b, "key 'test.arr'", "unknown array element type 42"); END; }
CASE(array_of_arrays) { BEGIN; set_u32(&b, o.arr_elem_type, GGUF_TYPE_ARRAY); expect_reject(&b, "key 'test.arr'", "array of arrays"); END; }

static void extra_bool_2(bb *b) { kv_head(b, "test.flag", GGUF_TYPE_BOOL); bb_u8(b, 2); }
CASE(bool_value_2)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, extra_bool_2, 1, "a", "b");
    expect_reject(&b, "key 'test.flag'", "bool value 2", "not 0 or 1");
    END;
}

static void extra_bool_array(bb *b)
{
    kv_head(b, "test.flags", GGUF_TYPE_ARRAY);
    bb_u32(b, GGUF_TYPE_BOOL);
    bb_u64(b, 3);
    bb_u8(b, 1);
    bb_u8(b, 0);
    bb_u8(b, 3);
}
CASE(bool_array_element_3)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, extra_bool_array, 1, "a", "b");
    expect_reject(&b, "key 'test.flags'", "bool array element #2", "is 3");
    END;
}

static void extra_duplicate_key(bb *b) { kv_head(b, "general.name", GGUF_TYPE_STRING); bb_str(b, "again"); }
CASE(duplicate_key)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, extra_duplicate_key, 1, "a", "b");
    expect_reject(&b, "duplicate key 'general.name'");
    END;
}

/* A hostile name must not reach a terminal raw, nor crowd the rest out of the message. */
static void extra_long_odd_keys(bb *b)
{
    char key[101];
    memset(key, 'k', 100);
    key[1] = '\x01';
    key[100] = '\0';
    for (int i = 0; i < 2; i++) {
        kv_head(b, key, GGUF_TYPE_UINT8);
        bb_u8(b, 0);
    }
}
CASE(duplicate_long_key_is_escaped)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, extra_long_odd_keys, 2, "a", "b");
    expect_reject(&b, "duplicate key 'k\\x01kkk", "kkk...' at offsets");
    END;
}

CASE(alignment_wrong_type) { BEGIN; set_u32(&b, o.align_type, GGUF_TYPE_INT32); expect_reject(&b, "general.alignment", "has type i32, must be u32"); END; }
CASE(alignment_zero) { BEGIN; set_u32(&b, o.align_value, 0); expect_reject(&b, "general.alignment", "is 0, must be a non-zero power of two"); END; }
CASE(alignment_not_power_of_two) { BEGIN; set_u32(&b, o.align_value, 48); expect_reject(&b, "general.alignment", "is 48, must be a non-zero power of two"); END; }

CASE(n_dims_0) { BEGIN; set_u32(&b, o.t[0].n_dims, 0); expect_reject(&b, "tensor 'a'", "n_dims 0"); END; }
CASE(n_dims_5) { BEGIN; set_u32(&b, o.t[1].n_dims, 5); expect_reject(&b, "tensor 'b'", "n_dims 5"); END; }
CASE(dimension_0) { BEGIN; set_u64(&b, o.t[0].ne[1], 0); expect_reject(&b, "tensor 'a'", "dimension #1", "is 0"); END; }
CASE(dimension_negative) { BEGIN; set_u64(&b, o.t[0].ne[0], UINT64_MAX); expect_reject(&b, "tensor 'a'", "dimension #0", "negative"); END; }

CASE(element_count_overflow)
{
    BEGIN;
    set_u64(&b, o.t[0].ne[0], 1ull << 32);
    set_u64(&b, o.t[0].ne[1], 1ull << 32);
    expect_reject(&b, "tensor 'a'", "element count", "overflows");
    END;
}

CASE(byte_size_overflow)
{
    BEGIN;
    set_u64(&b, o.t[0].ne[0], 1ull << 62);
    set_u64(&b, o.t[0].ne[1], 1);
    expect_reject(&b, "tensor 'a'", "byte size", "overflows");
    END;
}

CASE(row_not_whole_blocks)
{
    BEGIN;
    set_u64(&b, o.t[1].ne[0], 33);
    expect_reject(&b, "tensor 'b'", "ne[0] = 33 is not a multiple of the Q4_0 block size 32");
    END;
}

CASE(unknown_tensor_type) { BEGIN; set_u32(&b, o.t[0].type, 99); expect_reject(&b, "tensor 'a'", "unknown tensor type id 99"); END; }
CASE(removed_tensor_type) { BEGIN; set_u32(&b, o.t[0].type, 4); expect_reject(&b, "tensor 'a'", "unknown tensor type id 4"); END; }

CASE(duplicate_tensor_name)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, NULL, 0, "a", "a");
    expect_reject(&b, "tensor 'a'", "duplicate tensor name");
    END;
}

CASE(empty_tensor_name)
{
    (void)state;
    bb b;
    layout o;
    build(&b, &o, NULL, 0, "a", "");
    expect_reject(&b, "tensor #1", "empty tensor name");
    END;
}

CASE(tensor_name_with_nul) { BEGIN; b.p[o.t[1].name + 8] = 0; expect_reject(&b, "tensor #1", "tensor name", "NUL"); END; }
CASE(misaligned_offset) { BEGIN; set_u64(&b, o.t[1].offset, 65); expect_reject(&b, "tensor 'b'", "data offset 65", "not a multiple of the alignment 32"); END; }
CASE(data_past_end) { BEGIN; set_u64(&b, o.t[1].offset, 1024); expect_reject(&b, "tensor 'b'", "data [offset 1024, +18 bytes] extends past end of file"); END; }
CASE(data_offset_wraps) { BEGIN; set_u64(&b, o.t[1].offset, UINT64_MAX - 31); expect_reject(&b, "tensor 'b'", "extends past end of file"); END; }
CASE(data_cut_short) { BEGIN; b.n--; expect_reject(&b, "tensor 'b'", "data [offset 64, +18 bytes] extends past end of file"); END; }
CASE(data_overlap) { BEGIN; set_u64(&b, o.t[1].offset, 32); expect_reject(&b, "tensor 'b'", "overlaps tensor 'a'"); END; }

CASE(truncated_tensor_info)
{
    BEGIN;
    b.n = o.t[1].type + 2;
    expect_reject(&b, "tensor 'b'", "type at offset", "past end");
    END;
}

CASE(data_section_past_end)
{
    BEGIN;
    b.n = o.infos_end;
    expect_reject(&b, "data section would start", "past end of file");
    END;
}

/* ---- robustness sweeps over the base file ---- */

static void build_all_scalars(bb *b);

static void reject_every_prefix(const bb *b)
{
    for (size_t n = 0; n < b->n; n++) {
        blade_error err = {{0}};
        void *copy;
        gguf_file *f = open_copy(b->p, n, &err, &copy);
        if (f)
            fail_msg("prefix of %zu bytes accepted", n);
        assert_true(err.msg[0] != '\0');
        free(copy);
    }
}

/* Both files end exactly at their last needed byte: the base file with its last tensor's
 * data, the scalar file (no tensors, all metadata past the plausibility bound) with a
 * value, so every cut lands in a different field. */
static void test_every_prefix_rejected(void **state)
{
    (void)state;
    bb b;
    layout o;
    base(&b, &o);
    reject_every_prefix(&b);
    free(b.p);
    build_all_scalars(&b);
    reject_every_prefix(&b);
    free(b.p);
}

static void test_byte_flips_never_crash(void **state)
{
    (void)state;
    bb b;
    layout o;
    base(&b, &o);
    static const uint8_t values[] = {0x00, 0x01, 0x02, 0x05, 0x09, 0x0d, 0x20, 0x7f, 0x80, 0xff};
    int accepted = 0;
    for (size_t i = 0; i < o.data_start; i++) {
        for (size_t v = 0; v < sizeof values; v++) {
            uint8_t saved = b.p[i];
            b.p[i] = values[v];
            blade_error err = {{0}};
            void *copy;
            gguf_file *f = open_copy(b.p, b.n, &err, &copy);
            if (f) {
                accepted++;
                for (uint64_t t = 0; t < f->n_tensors; t++)
                    assert_true((const uint8_t *)f->tensors[t].data + f->tensors[t].nbytes <=
                                (const uint8_t *)copy + b.n);
                gguf_close(f);
            } else {
                assert_true(err.msg[0] != '\0');
            }
            free(copy);
            b.p[i] = saved;
        }
    }
    assert_true(accepted > 0); /* e.g. changed name characters stay valid */
    free(b.p);
}

/* ---- writer and reader round trip ---- */

static uint8_t f32_data[15 * 4], f16_data[7 * 2], q4_data[4 * 18], q8_data[2 * 34],
    i32_data[24 * 4], bf16_data[2];

typedef struct tensor_spec {
    const char *name;
    uint32_t type;
    uint32_t n_dims;
    int64_t ne[4];
    uint8_t *data;
    size_t nbytes;
} tensor_spec;

static const tensor_spec specs[] = {
    {"tok_embd.weight", BLADE_TYPE_F32, 2, {5, 3}, f32_data, sizeof f32_data},
    {"norm", BLADE_TYPE_F16, 1, {7}, f16_data, sizeof f16_data},
    {"blk.0.q4", BLADE_TYPE_Q4_0, 2, {64, 2}, q4_data, sizeof q4_data},
    {"blk.0.q8", BLADE_TYPE_Q8_0, 3, {32, 1, 2}, q8_data, sizeof q8_data},
    {"ints", BLADE_TYPE_I32, 4, {3, 2, 2, 2}, i32_data, sizeof i32_data},
    {"one", BLADE_TYPE_BF16, 1, {1}, bf16_data, sizeof bf16_data},
};
#define N_SPECS (sizeof specs / sizeof specs[0])

static const uint8_t arr_u8[] = {1, 2, 255};
static const int8_t arr_i8[] = {-128, 0, 127};
static const uint16_t arr_u16[] = {0, 65535};
static const int16_t arr_i16[] = {-32768, 32767, 5};
static const uint32_t arr_u32[] = {7, 4000000000u};
static const int32_t arr_i32[] = {-2000000000, 1, 2, 3};
static const float arr_f32[] = {1.5f, -0.25f, 1e30f};
static const bool arr_bool[] = {true, false, true};
static const uint64_t arr_u64[] = {UINT64_MAX, 0};
static const int64_t arr_i64[] = {INT64_MIN, -1, INT64_MAX};
static const double arr_f64[] = {3.141592653589793, -1e300};
static const char *const arr_str[] = {"alpha", "", "gamma with spaces", "\xe2\x96\x81unicode"};

typedef struct array_spec {
    const char *key;
    gguf_value_type type;
    const void *data;
    uint64_t n;
    size_t esz;
} array_spec;

#define ARR(k, t, a) {k, t, a, sizeof a / sizeof a[0], sizeof a[0]}
static const array_spec arrays[] = {
    ARR("arr.u8", GGUF_TYPE_UINT8, arr_u8),     ARR("arr.i8", GGUF_TYPE_INT8, arr_i8),
    ARR("arr.u16", GGUF_TYPE_UINT16, arr_u16),  ARR("arr.i16", GGUF_TYPE_INT16, arr_i16),
    ARR("arr.u32", GGUF_TYPE_UINT32, arr_u32),  ARR("arr.i32", GGUF_TYPE_INT32, arr_i32),
    ARR("arr.f32", GGUF_TYPE_FLOAT32, arr_f32), ARR("arr.bool", GGUF_TYPE_BOOL, arr_bool),
    ARR("arr.u64", GGUF_TYPE_UINT64, arr_u64),  ARR("arr.i64", GGUF_TYPE_INT64, arr_i64),
    ARR("arr.f64", GGUF_TYPE_FLOAT64, arr_f64),
};
#define N_ARRAYS (sizeof arrays / sizeof arrays[0])

static void fill_tensor_data(void)
{
    uint32_t x = 12345;
    for (size_t i = 0; i < N_SPECS; i++) {
        for (size_t j = 0; j < specs[i].nbytes; j++) {
            x = x * 1103515245u + 12345u;
            specs[i].data[j] = (uint8_t)(x >> 16);
        }
    }
}

static gguf_writer *full_writer(void)
{
    fill_tensor_data();
    gguf_writer *w = gguf_writer_new();
    assert_non_null(w);
    gguf_writer_set_u32(w, "s.replaced", 1);
    gguf_writer_set_u32(w, "s.u32", 4000000000u);
    gguf_writer_set_i32(w, "s.i32", -123456);
    gguf_writer_set_u64(w, "s.u64", (1ull << 40) + 5);
    gguf_writer_set_f32(w, "s.f32", 3.25f);
    gguf_writer_set_bool(w, "s.bool", true);
    gguf_writer_set_string(w, "s.str", "h\xc3\xa9llo world");
    gguf_writer_set_string(w, "s.empty", "");
    gguf_writer_set_u32(w, "s.retyped", 9);
    for (size_t i = 0; i < N_ARRAYS; i++)
        gguf_writer_set_array(w, arrays[i].key, arrays[i].type, arrays[i].data, arrays[i].n);
    gguf_writer_set_array(w, "arr.empty", GGUF_TYPE_UINT32, NULL, 0);
    gguf_writer_set_string_array(w, "arr.str", arr_str, 4);
    gguf_writer_set_string_array(w, "arr.str_empty", NULL, 0);
    gguf_writer_set_u32(w, "s.replaced", 2);
    gguf_writer_set_string(w, "s.retyped", "now a string");
    blade_error err = {{0}};
    for (size_t i = 0; i < N_SPECS; i++)
        if (gguf_writer_add_tensor(w, specs[i].name, specs[i].type, specs[i].n_dims, specs[i].ne,
                                   specs[i].data, specs[i].nbytes, &err) != 0)
            fail_msg("%s", err.msg);
    return w;
}

static void check_full_file(const gguf_file *f)
{
    blade_error err = {{0}};
    bool present = false;
    assert_int_equal(f->version, 3);
    assert_int_equal(f->alignment, GGUF_DEFAULT_ALIGNMENT);
    assert_null(gguf_find_kv(f, "general.alignment")); /* only written when asked for */
    assert_int_equal(f->n_kv, 9 + N_ARRAYS + 3);

    /* Replacing keeps the first position. */
    assert_string_equal(f->kv[0].key, "s.replaced");
    assert_int_equal(f->kv[0].scalar.u64, 2);
    assert_string_equal(f->kv[8].key, "s.retyped");
    assert_int_equal(f->kv[8].type, GGUF_TYPE_STRING);

    uint32_t u32 = 0;
    uint64_t u64 = 0;
    int64_t i64 = 0;
    float f32 = 0;
    bool b = false;
    assert_true(gguf_get_u32(f, "s.u32", &u32, &present, &err));
    assert_true(present);
    assert_int_equal(u32, 4000000000u);
    assert_true(gguf_get_i64(f, "s.i32", &i64, &present, &err));
    assert_int_equal(i64, -123456);
    assert_true(gguf_get_u64(f, "s.u64", &u64, &present, &err));
    assert_true(u64 == (1ull << 40) + 5);
    assert_true(gguf_get_f32(f, "s.f32", &f32, &present, &err));
    assert_true(f32 == 3.25f);
    assert_true(gguf_get_bool(f, "s.bool", &b, &present, &err));
    assert_true(b);
    char *s = gguf_get_string(f, "s.str", &present, &err);
    assert_non_null(s);
    assert_string_equal(s, "h\xc3\xa9llo world");
    free(s);
    s = gguf_get_string(f, "s.empty", &present, &err);
    assert_non_null(s);
    assert_string_equal(s, "");
    free(s);
    s = gguf_get_string(f, "s.retyped", &present, &err);
    assert_non_null(s);
    assert_string_equal(s, "now a string");
    free(s);

    for (size_t i = 0; i < N_ARRAYS; i++) {
        const gguf_kv *kv = gguf_find_array(f, arrays[i].key, arrays[i].type, &present, &err);
        if (!kv)
            fail_msg("%s: %s", arrays[i].key, err.msg);
        assert_int_equal(kv->arr_len, arrays[i].n);
        /* arr_data points into the file and may be unaligned: compare bytes. */
        assert_memory_equal(kv->arr_data, arrays[i].data, arrays[i].n * arrays[i].esz);
    }
    const gguf_kv *kv = gguf_find_array(f, "arr.empty", GGUF_TYPE_UINT32, &present, &err);
    assert_non_null(kv);
    assert_int_equal(kv->arr_len, 0);
    kv = gguf_find_array(f, "arr.str", GGUF_TYPE_STRING, &present, &err);
    assert_non_null(kv);
    assert_int_equal(kv->arr_len, 4);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kv->arr_strings[i].len, strlen(arr_str[i]));
        assert_memory_equal(kv->arr_strings[i].ptr, arr_str[i], strlen(arr_str[i]));
    }
    kv = gguf_find_array(f, "arr.str_empty", GGUF_TYPE_STRING, &present, &err);
    assert_non_null(kv);
    assert_int_equal(kv->arr_len, 0);

    assert_int_equal(f->n_tensors, N_SPECS);
    for (size_t i = 0; i < N_SPECS; i++) {
        const gguf_tensor *t = &f->tensors[i];
        assert_string_equal(t->name, specs[i].name);
        assert_ptr_equal(gguf_find_tensor(f, specs[i].name), t);
        assert_int_equal(t->type, specs[i].type);
        assert_int_equal(t->n_dims, specs[i].n_dims);
        uint64_t n = 1;
        for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
            int64_t want = d < specs[i].n_dims ? specs[i].ne[d] : 1;
            assert_int_equal(t->ne[d], want);
            n *= (uint64_t)want;
        }
        assert_int_equal(t->n_elements, n);
        assert_int_equal(t->nbytes, specs[i].nbytes);
        assert_int_equal(t->offset % GGUF_DEFAULT_ALIGNMENT, 0);
        assert_ptr_equal(t->data, f->map + f->data_offset + t->offset);
        assert_memory_equal(t->data, specs[i].data, specs[i].nbytes);
    }
    assert_int_equal(f->data_offset % GGUF_DEFAULT_ALIGNMENT, 0);
    assert_null(gguf_find_tensor(f, "missing"));
}

static void test_round_trip(void **state)
{
    (void)state;
    gguf_writer *w = full_writer();
    char *path = temp_path("gguf_roundtrip.gguf");
    blade_error err = {{0}};
    if (gguf_writer_write(w, path, true, &err) != 0)
        fail_msg("%s", err.msg);
    gguf_writer_free(w);

    gguf_file *f = gguf_open(path, &err);
    if (!f)
        fail_msg("%s", err.msg);
    assert_string_equal(f->path, path);
    check_full_file(f);
    gguf_close(f);

    size_t len;
    char *buf = read_file(path, &len);
    assert_non_null(buf);
    f = gguf_open_memory(buf, len, &err);
    if (!f)
        fail_msg("%s", err.msg);
    check_full_file(f);
    gguf_close(f);
    free(buf);
    unlink(path);
    free(path);
}

static void test_getter_errors(void **state)
{
    (void)state;
    gguf_writer *w = full_writer();
    char *path = temp_path("gguf_getters.gguf");
    blade_error err = {{0}};
    if (gguf_writer_write(w, path, false, &err) != 0)
        fail_msg("%s", err.msg);
    gguf_writer_free(w);
    gguf_file *f = gguf_open(path, &err);
    assert_non_null(f);

    bool present = false;
    uint32_t u32 = 77;
    uint64_t u64 = 0;
    float f32 = 0;
    bool b = false;
    assert_false(gguf_get_u32(f, "no.such.key", &u32, &present, &err));
    assert_false(present);
    assert_int_equal(u32, 77);

    err.msg[0] = '\0';
    assert_false(gguf_get_u32(f, "s.i32", &u32, &present, &err));
    assert_true(present);
    assert_non_null(strstr(err.msg, "'s.i32'"));
    assert_non_null(strstr(err.msg, "i32 value -123456 does not fit u32"));
    assert_non_null(strstr(err.msg, path));
    assert_false(gguf_get_u32(f, "s.u64", &u32, &present, &err));
    assert_non_null(strstr(err.msg, "does not fit u32"));
    assert_false(gguf_get_u64(f, "s.i32", &u64, &present, &err));
    assert_non_null(strstr(err.msg, "does not fit u64"));
    assert_false(gguf_get_u32(f, "s.str", &u32, &present, &err));
    assert_true(present);
    assert_non_null(strstr(err.msg, "key 's.str'"));
    assert_non_null(strstr(err.msg, "has type string, expected an integer"));
    assert_false(gguf_get_f32(f, "s.u32", &f32, &present, &err));
    assert_non_null(strstr(err.msg, "has type u32"));
    assert_false(gguf_get_bool(f, "s.u32", &b, &present, &err));
    assert_non_null(strstr(err.msg, "expected bool"));
    assert_null(gguf_get_string(f, "arr.str", &present, &err));
    assert_true(present);
    assert_non_null(strstr(err.msg, "has type array of string, expected string"));
    assert_null(gguf_find_array(f, "arr.str", GGUF_TYPE_UINT32, &present, &err));
    assert_non_null(strstr(err.msg, "expected array of u32"));
    assert_null(gguf_find_array(f, "s.u32", GGUF_TYPE_UINT32, &present, &err));
    assert_non_null(strstr(err.msg, "has type u32, expected array of u32"));
    /* A NULL error pointer is allowed everywhere. */
    assert_false(gguf_get_u32(f, "s.str", &u32, NULL, NULL));
    gguf_close(f);
    unlink(path);
    free(path);
}

/* Scalars the writer has no setter for reach a file through copy_kv. */
static void build_all_scalars(bb *b)
{
    memset(b, 0, sizeof *b);
    header(b, 2, 0, 16);
    kv_head(b, "v.u8", GGUF_TYPE_UINT8);
    bb_u8(b, 200);
    kv_head(b, "v.i8", GGUF_TYPE_INT8);
    bb_u8(b, (uint8_t)-100);
    kv_head(b, "v.u16", GGUF_TYPE_UINT16);
    bb_put(b, &(uint16_t){60000}, 2);
    kv_head(b, "v.i16", GGUF_TYPE_INT16);
    bb_put(b, &(int16_t){-30000}, 2);
    kv_head(b, "v.u32", GGUF_TYPE_UINT32);
    bb_u32(b, 4000000000u);
    kv_head(b, "v.i32", GGUF_TYPE_INT32);
    bb_put(b, &(int32_t){-5}, 4);
    kv_head(b, "v.f32", GGUF_TYPE_FLOAT32);
    bb_put(b, &(float){-2.5f}, 4);
    kv_head(b, "v.bool", GGUF_TYPE_BOOL);
    bb_u8(b, 1);
    kv_head(b, "v.str", GGUF_TYPE_STRING);
    bb_bytes_str(b, "with\0nul", 8);
    kv_head(b, "v.u64", GGUF_TYPE_UINT64);
    bb_u64(b, UINT64_MAX);
    kv_head(b, "v.i64", GGUF_TYPE_INT64);
    bb_put(b, &(int64_t){-(1ll << 40)}, 8);
    kv_head(b, "v.f64", GGUF_TYPE_FLOAT64);
    bb_put(b, &(double){1e300}, 8);
    kv_head(b, "v.f64small", GGUF_TYPE_FLOAT64);
    bb_put(b, &(double){0.5}, 8);
    kv_head(b, "v.i16arr", GGUF_TYPE_ARRAY);
    bb_u32(b, GGUF_TYPE_INT16);
    bb_u64(b, 3);
    for (int16_t i = -1; i <= 1; i++)
        bb_put(b, &i, 2);
    kv_head(b, "v.strarr", GGUF_TYPE_ARRAY);
    bb_u32(b, GGUF_TYPE_STRING);
    bb_u64(b, 2);
    bb_str(b, "x");
    bb_str(b, "yz");
    kv_head(b, "v.i64big", GGUF_TYPE_INT64);
    bb_put(b, &(int64_t){INT64_MIN}, 8);
}

static size_t elem_size(gguf_value_type t)
{
    static const size_t sizes[GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return sizes[t];
}

static void assert_kv_equal(const gguf_kv *a, const gguf_kv *b)
{
    assert_string_equal(a->key, b->key);
    assert_int_equal(a->type, b->type);
    switch (a->type) {
    case GGUF_TYPE_STRING:
        assert_int_equal(a->str.len, b->str.len);
        assert_memory_equal(a->str.ptr, b->str.ptr, a->str.len);
        break;
    case GGUF_TYPE_ARRAY:
        assert_int_equal(a->arr_type, b->arr_type);
        assert_int_equal(a->arr_len, b->arr_len);
        if (a->arr_type == GGUF_TYPE_STRING) {
            for (uint64_t i = 0; i < a->arr_len; i++) {
                assert_int_equal(a->arr_strings[i].len, b->arr_strings[i].len);
                assert_memory_equal(a->arr_strings[i].ptr, b->arr_strings[i].ptr,
                                    a->arr_strings[i].len);
            }
        } else if (a->arr_len) {
            assert_memory_equal(a->arr_data, b->arr_data, a->arr_len * elem_size(a->arr_type));
        }
        break;
    case GGUF_TYPE_BOOL:
        assert_int_equal(a->scalar.b, b->scalar.b);
        break;
    default:
        assert_memory_equal(&a->scalar, &b->scalar, sizeof a->scalar);
        break;
    }
}

static void test_scalars_getters_and_copy_kv(void **state)
{
    (void)state;
    bb b;
    build_all_scalars(&b);
    blade_error err = {{0}};
    gguf_file *src = gguf_open_memory(b.p, b.n, &err);
    if (!src)
        fail_msg("%s", err.msg);
    assert_int_equal(src->version, 2);
    assert_int_equal(src->data_offset, b.n); /* no tensors, no padding: section is empty */

    bool present;
    uint32_t u32;
    uint64_t u64;
    int64_t i64;
    float f32;
    assert_true(gguf_get_u32(src, "v.u8", &u32, &present, &err));
    assert_int_equal(u32, 200);
    assert_true(gguf_get_i64(src, "v.i8", &i64, &present, &err));
    assert_int_equal(i64, -100);
    assert_true(gguf_get_u32(src, "v.u16", &u32, &present, &err));
    assert_int_equal(u32, 60000);
    assert_true(gguf_get_i64(src, "v.i16", &i64, &present, &err));
    assert_int_equal(i64, -30000);
    assert_false(gguf_get_u32(src, "v.i16", &u32, &present, &err));
    assert_non_null(strstr(err.msg, "i16 value -30000 does not fit u32"));
    assert_true(gguf_get_u64(src, "v.u64", &u64, &present, &err));
    assert_true(u64 == UINT64_MAX);
    assert_false(gguf_get_i64(src, "v.u64", &i64, &present, &err));
    assert_non_null(strstr(err.msg, "does not fit i64"));
    assert_true(gguf_get_i64(src, "v.i64big", &i64, &present, &err));
    assert_true(i64 == INT64_MIN);
    assert_true(gguf_get_f32(src, "v.f32", &f32, &present, &err));
    assert_true(f32 == -2.5f);
    assert_true(gguf_get_f32(src, "v.f64small", &f32, &present, &err));
    assert_true(f32 == 0.5f);
    assert_false(gguf_get_f32(src, "v.f64", &f32, &present, &err));
    assert_non_null(strstr(err.msg, "does not fit f32"));
    assert_null(gguf_get_string(src, "v.str", &present, &err));
    assert_non_null(strstr(err.msg, "NUL"));
    assert_true(present);

    gguf_writer *w = gguf_writer_new();
    gguf_writer_copy_kv(w, src);
    char *path = temp_path("gguf_copykv.gguf");
    if (gguf_writer_write(w, path, false, &err) != 0)
        fail_msg("%s", err.msg);
    gguf_writer_free(w);
    gguf_file *dst = gguf_open(path, &err);
    if (!dst)
        fail_msg("%s", err.msg);
    assert_int_equal(dst->n_kv, src->n_kv);
    assert_int_equal(dst->n_tensors, 0);
    for (uint64_t i = 0; i < src->n_kv; i++)
        assert_kv_equal(&src->kv[i], &dst->kv[i]);
    gguf_close(dst);
    gguf_close(src);
    free(b.p);
    unlink(path);
    free(path);
}

static void test_writer_alignment(void **state)
{
    (void)state;
    gguf_writer *w = full_writer();
    gguf_writer_set_u32(w, "general.alignment", 64);
    char *path = temp_path("gguf_align64.gguf");
    blade_error err = {{0}};
    if (gguf_writer_write(w, path, false, &err) != 0)
        fail_msg("%s", err.msg);
    gguf_file *f = gguf_open(path, &err);
    if (!f)
        fail_msg("%s", err.msg);
    assert_int_equal(f->alignment, 64);
    assert_int_equal(f->data_offset % 64, 0);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        assert_int_equal(f->tensors[i].offset % 64, 0);
        assert_memory_equal(f->tensors[i].data, specs[i].data, specs[i].nbytes);
    }
    gguf_close(f);

    gguf_writer_set_u32(w, "general.alignment", 48);
    assert_int_equal(gguf_writer_write(w, path, false, &err), -1);
    assert_non_null(strstr(err.msg, "general.alignment' is 48"));
    gguf_writer_set_string(w, "general.alignment", "64");
    assert_int_equal(gguf_writer_write(w, path, false, &err), -1);
    assert_non_null(strstr(err.msg, "general.alignment' has type string"));
    gguf_writer_free(w);
    unlink(path);
    free(path);
}

/* A file whose data section lies 32 bytes past a cache line (the format's default
 * alignment allows it): gguf_open's copy starts the data section on one, with the same
 * bytes, and can still be made writable and closed. */
static void test_open_copy_aligns_data(void **state)
{
    (void)state;
    gguf_writer *w = full_writer();
    char *path = temp_path("gguf_shift.gguf");
    blade_error err = {{0}};
    char pad[65] = "";
    size_t data_offset = 0;
    for (int len = 0; len < 64; len++) {
        pad[len] = 'x';
        gguf_writer_set_string(w, "test.pad", pad);
        if (gguf_writer_write(w, path, false, &err) != 0)
            fail_msg("%s", err.msg);
        size_t size;
        uint8_t *bytes = (uint8_t *)read_file(path, &size);
        gguf_file *mem = gguf_open_memory(bytes, size, &err);
        assert_non_null(mem);
        data_offset = mem->data_offset;
        gguf_close(mem);
        free(bytes);
        if (data_offset % GGUF_COPY_ALIGN == 32)
            break;
    }
    assert_int_equal(data_offset % GGUF_COPY_ALIGN, 32);
    gguf_file *f = gguf_open(path, &err);
    if (!f)
        fail_msg("%s", err.msg);
    assert_int_equal(f->data_offset, data_offset);
    if (f->copied) {
        assert_int_equal((uintptr_t)(f->map + f->data_offset) % GGUF_COPY_ALIGN, 0);
        assert_non_null(gguf_set_writable(f, true));
        assert_null(gguf_set_writable(f, false));
    }
    for (uint64_t i = 0; i < f->n_tensors; i++)
        assert_memory_equal(f->tensors[i].data, specs[i].data, specs[i].nbytes);
    assert_non_null(gguf_find_kv(f, "test.pad"));
    gguf_close(f);
    gguf_writer_free(w);
    unlink(path);
    free(path);
}

static void test_writer_rejects_bad_tensors(void **state)
{
    (void)state;
    gguf_writer *w = gguf_writer_new();
    blade_error err = {{0}};
    uint8_t data[256] = {0};
    const int64_t ne[4] = {32, 2, 1, 1};
    assert_int_equal(gguf_writer_add_tensor(w, "t", BLADE_TYPE_Q4_0, 2, ne, data, 36, &err), 0);
    assert_int_equal(gguf_writer_add_tensor(w, "t", BLADE_TYPE_Q4_0, 2, ne, data, 36, &err), -1);
    assert_non_null(strstr(err.msg, "duplicate tensor name 't'"));
    assert_int_equal(gguf_writer_add_tensor(w, "", BLADE_TYPE_F32, 1, ne, data, 128, &err), -1);
    assert_non_null(strstr(err.msg, "empty"));
    assert_int_equal(gguf_writer_add_tensor(w, "u", 99, 1, ne, data, 128, &err), -1);
    assert_non_null(strstr(err.msg, "unknown type id 99"));
    assert_int_equal(gguf_writer_add_tensor(w, "u", BLADE_TYPE_Q4_0, 2, ne, data, 35, &err), -1);
    assert_non_null(strstr(err.msg, "35 bytes of data given"));
    assert_int_equal(gguf_writer_add_tensor(w, "u", BLADE_TYPE_F32, 0, ne, data, 4, &err), -1);
    assert_non_null(strstr(err.msg, "n_dims 0"));
    assert_int_equal(gguf_writer_add_tensor(w, "u", BLADE_TYPE_F32, 5, ne, data, 4, &err), -1);
    assert_non_null(strstr(err.msg, "n_dims 5"));
    const int64_t odd[1] = {33};
    assert_int_equal(gguf_writer_add_tensor(w, "u", BLADE_TYPE_Q4_0, 1, odd, data, 18, &err), -1);
    assert_non_null(strstr(err.msg, "not a multiple of the Q4_0 block size"));
    const int64_t neg[2] = {4, -1};
    assert_int_equal(gguf_writer_add_tensor(w, "u", BLADE_TYPE_F32, 2, neg, data, 16, &err), -1);
    assert_non_null(strstr(err.msg, "dimension 1"));
    assert_int_equal(gguf_writer_add_tensor(w, "u", BLADE_TYPE_F32, 1, ne, NULL, 128, &err), -1);
    assert_non_null(strstr(err.msg, "NULL"));
    gguf_writer_free(w);
}

/* Setters cannot return errors; write must refuse instead of dropping the key. */
static void test_writer_sticky_errors(void **state)
{
    (void)state;
    char *path = temp_path("gguf_sticky.gguf");
    blade_error err = {{0}};
    struct {
        const char *needle;
        int which;
    } cases[] = {{"key is empty", 0}, {"arrays of string cannot be set", 1},
                 {"bool array element #1 is 2", 2}, {"element #1 is NULL", 3},
                 {"string value is NULL", 4}, {"array data is NULL", 5}, {"string array is NULL", 6}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        gguf_writer *w = gguf_writer_new();
        gguf_writer_set_u32(w, "fine", 1);
        const uint8_t bools[2] = {1, 2};
        const char *strs[2] = {"a", NULL};
        switch (cases[i].which) {
        case 0: gguf_writer_set_u32(w, "", 5); break;
        case 1: gguf_writer_set_array(w, "k", GGUF_TYPE_STRING, strs, 1); break;
        case 2: gguf_writer_set_array(w, "k", GGUF_TYPE_BOOL, bools, 2); break;
        case 3: gguf_writer_set_string_array(w, "k", strs, 2); break;
        case 5: gguf_writer_set_array(w, "k", GGUF_TYPE_UINT32, NULL, 2); break;
        case 6: gguf_writer_set_string_array(w, "k", NULL, 2); break;
        default: gguf_writer_set_string(w, "k", NULL); break;
        }
        gguf_writer_set_u32(w, "also.fine", 2);
        assert_int_equal(gguf_writer_write(w, path, false, &err), -1);
        if (!strstr(err.msg, cases[i].needle))
            fail_msg("\"%s\" lacks \"%s\"", err.msg, cases[i].needle);
        gguf_writer_free(w);
    }
    free(path);
}

static void test_writer_reports_disk_full(void **state)
{
    (void)state;
    if (access("/dev/full", W_OK) != 0) {
        note_skipped("/dev/full not writable here: the GGUF writer's disk-full error not tested");
        skip();
    }
    static uint8_t big[3 << 20];
    gguf_writer *w = gguf_writer_new();
    blade_error err = {{0}};
    const int64_t ne[1] = {(int64_t)sizeof big / 4};
    assert_int_equal(gguf_writer_add_tensor(w, "big", BLADE_TYPE_F32, 1, ne, big, sizeof big, &err), 0);
    assert_int_equal(gguf_writer_write(w, "/dev/full", false, &err), -1);
    assert_non_null(strstr(err.msg, "/dev/full: write failed"));
    assert_non_null(strstr(err.msg, "No space left"));
    struct stat st;
    assert_int_equal(stat("/dev/full", &st), 0); /* a device is never removed */
    assert_true(S_ISCHR(st.st_mode));

    assert_int_equal(gguf_writer_write(w, "/nonexistent-dir/x.gguf", false, &err), -1);
    assert_non_null(strstr(err.msg, "cannot create"));
    gguf_writer_free(w);
}

/* A file-size limit makes a regular file fail mid-write like a full disk would. */
static void test_writer_removes_partial_file(void **state)
{
    (void)state;
    static uint8_t big[2 << 20];
    gguf_writer *w = gguf_writer_new();
    blade_error err = {{0}};
    const int64_t ne[1] = {(int64_t)sizeof big / 4};
    assert_int_equal(gguf_writer_add_tensor(w, "big", BLADE_TYPE_F32, 1, ne, big, sizeof big, &err), 0);
    char *path = temp_path("gguf_partial.gguf");
    unlink(path);

    struct rlimit saved, small;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &saved), 0);
    small = saved;
    small.rlim_cur = 64 << 10;
    void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &small), 0);
    int rc = gguf_writer_write(w, path, false, &err);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &saved), 0);
    signal(SIGXFSZ, old_handler);

    assert_int_equal(rc, -1);
    assert_non_null(strstr(err.msg, "write failed"));
    assert_non_null(strstr(err.msg, "partial file removed"));
    assert_int_equal(access(path, F_OK), -1);
    free(path);
    gguf_writer_free(w);
}

/* Filled tensors come out exactly as tensors given their data up front. */
static int fill_pattern(void *ctx, void *dst, size_t nbytes, blade_error *err)
{
    (void)err;
    memcpy(dst, ctx, nbytes);
    return 0;
}

static int fill_fails(void *ctx, void *dst, size_t nbytes, blade_error *err)
{
    (void)ctx;
    memset(dst, 0, nbytes);
    return blade_error_set(err, "the producer gave up");
}

static gguf_writer *two_tensor_writer(const float *a, const float *b, bool filled, gguf_fill_fn fill)
{
    gguf_writer *w = gguf_writer_new();
    blade_error err = {{0}};
    const int64_t ne[2] = {8, 4};
    gguf_writer_set_string(w, "general.name", "filled");
    assert_int_equal(gguf_writer_add_tensor(w, "a", BLADE_TYPE_F32, 2, ne, a, 32 * sizeof(float), &err), 0);
    if (filled)
        assert_int_equal(gguf_writer_add_tensor_filled(w, "b", BLADE_TYPE_F32, 2, ne, 32 * sizeof(float), fill,
                                                       (void *)b, &err), 0);
    else
        assert_int_equal(gguf_writer_add_tensor(w, "b", BLADE_TYPE_F32, 2, ne, b, 32 * sizeof(float), &err), 0);
    return w;
}

static int leftover_temporaries(const char *path)
{
    char pattern[4200];
    snprintf(pattern, sizeof pattern, "%s.tmp-*", path);
    glob_t g;
    int n = glob(pattern, 0, NULL, &g) == 0 ? (int)g.gl_pathc : 0;
    globfree(&g);
    return n;
}

static void test_writer_filled_tensors(void **state)
{
    (void)state;
    float a[32], b[32];
    for (int i = 0; i < 32; i++) {
        a[i] = (float)i;
        b[i] = -0.5f * (float)i;
    }
    char *p1 = temp_path("filled-direct.gguf"), *p2 = temp_path("filled-filled.gguf");
    blade_error err = {{0}};
    gguf_writer *w1 = two_tensor_writer(a, b, false, NULL), *w2 = two_tensor_writer(a, b, true, fill_pattern);
    assert_int_equal(gguf_writer_write(w1, p1, false, &err), 0);
    assert_int_equal(gguf_writer_write(w2, p2, false, &err), 0);
    size_t n1, n2;
    char *f1 = read_file(p1, &n1), *f2 = read_file(p2, &n2);
    assert_int_equal(n1, n2);
    assert_memory_equal(f1, f2, n1);
    free(f1);
    free(f2);
    gguf_writer_free(w1);
    gguf_writer_free(w2);
    unlink(p1);
    unlink(p2);
    free(p1);
    free(p2);
}

/* A failed write never touches the file it would replace: the bytes go to a temporary
 * beside it, removed on failure. A successful one keeps the replaced file's permissions and
 * writes through a symbolic link to the file it names. */
static void test_writer_replaces_atomically(void **state)
{
    (void)state;
    float a[32] = {1}, b[32] = {2};
    char *path = temp_path("atomic.gguf"), *link_path = temp_path("atomic-link.gguf");
    blade_error err = {{0}};
    assert_int_equal(write_file(path, "old model", 9), 0);
    assert_int_equal(chmod(path, 0640), 0);

    gguf_writer *w = two_tensor_writer(a, b, true, fill_fails);
    assert_int_equal(gguf_writer_write(w, path, false, &err), -1);
    assert_non_null(strstr(err.msg, "the producer gave up (nothing written)"));
    size_t n;
    char *kept = read_file(path, &n);
    assert_int_equal(n, 9);
    assert_memory_equal(kept, "old model", 9);
    free(kept);
    assert_int_equal(leftover_temporaries(path), 0);
    gguf_writer_free(w);

    unlink(link_path);
    assert_int_equal(symlink(path, link_path), 0);
    w = two_tensor_writer(a, b, true, fill_pattern);
    assert_int_equal(gguf_writer_write(w, link_path, false, &err), 0);
    gguf_writer_free(w);
    struct stat st;
    assert_int_equal(lstat(link_path, &st), 0);
    assert_true(S_ISLNK(st.st_mode));
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 07777, 0640);
    gguf_file *f = gguf_open(path, &err);
    assert_non_null(f);
    assert_non_null(gguf_find_tensor(f, "b"));
    gguf_close(f);
    assert_int_equal(leftover_temporaries(path), 0);
    unlink(link_path);
    unlink(path);
    free(link_path);
    free(path);
}

/* gguf_open_mapped reads the same file without copying it. */
static void test_open_mapped(void **state)
{
    (void)state;
    float a[32], b[32];
    for (int i = 0; i < 32; i++)
        a[i] = b[i] = (float)i * 0.25f;
    char *path = temp_path("mapped.gguf");
    blade_error err = {{0}};
    gguf_writer *w = two_tensor_writer(a, b, false, NULL);
    assert_int_equal(gguf_writer_write(w, path, false, &err), 0);
    gguf_writer_free(w);
    gguf_file *f = gguf_open_mapped(path, &err);
    assert_non_null(f);
    assert_false(f->copied);
    assert_memory_equal(gguf_find_tensor(f, "b")->data, b, sizeof b);
    gguf_close(f);
    assert_null(gguf_open_mapped("/nonexistent/x.gguf", &err));
    assert_non_null(strstr(err.msg, "cannot open"));
    unlink(path);
    free(path);
}

static void test_open_errors(void **state)
{
    (void)state;
    blade_error err = {{0}};
    assert_null(gguf_open("/nonexistent/model.gguf", &err));
    assert_non_null(strstr(err.msg, "cannot open /nonexistent/model.gguf"));
    char *dir = temp_path("");
    assert_null(gguf_open(dir, &err));
    assert_non_null(strstr(err.msg, "not a regular file"));
    free(dir);
    char *path = temp_path("gguf_empty.gguf");
    assert_int_equal(write_file(path, "", 0), 0);
    assert_null(gguf_open(path, &err));
    assert_non_null(strstr(err.msg, "empty"));

    bb b;
    layout o;
    base(&b, &o);
    set_u32(&b, 4, 1);
    assert_int_equal(write_file(path, b.p, b.n), 0);
    assert_null(gguf_open(path, &err));
    assert_true(strncmp(err.msg, path, strlen(path)) == 0);
    assert_non_null(strstr(err.msg, "unsupported version 1"));
    assert_null(gguf_open(NULL, &err));
    assert_null(gguf_open_memory(NULL, 5, &err));
    gguf_close(NULL);
    unlink(path);
    free(path);
    free(b.p);
}

/* ---- real files ---- */

static void check_cut(const char *name, const uint8_t *data, size_t n, bool expect_ok)
{
    blade_error err = {{0}};
    void *copy;
    gguf_file *f = open_copy(data, n, &err, &copy);
    if (expect_ok && !f)
        fail_msg("%s cut to %zu bytes: rejected: %s", name, n, err.msg);
    if (!expect_ok && f)
        fail_msg("%s cut to %zu bytes: accepted", name, n);
    if (!expect_ok && err.msg[0] == '\0')
        fail_msg("%s cut to %zu bytes: no error message", name, n);
    gguf_close(f);
    free(copy);
}

static void check_shared_file(const char *path)
{
    blade_error err = {{0}};
    gguf_file *f = gguf_open(path, &err);
    if (!f)
        fail_msg("%s", err.msg);
    size_t size;
    uint8_t *data = (uint8_t *)read_file(path, &size);
    assert_non_null(data);
    assert_int_equal(size, f->size);

    /* The shortest prefix that still holds everything: the end of the last tensor's data,
     * or (tokenizer-only files) the end of the metadata, found by bisection. */
    size_t need = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        size_t end = f->data_offset + f->tensors[i].offset + f->tensors[i].nbytes;
        need = end > need ? end : need;
    }
    size_t lo = 1, hi = size;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        gguf_file *g = gguf_open_memory(data, mid, NULL);
        if (g)
            hi = mid;
        else
            lo = mid + 1;
        gguf_close(g);
    }
    if (f->n_tensors)
        assert_int_equal(lo, need);
    else
        need = lo;

    size_t cuts[] = {1, 12, 23, f->data_offset / 2, f->data_offset - 1,
                     (f->data_offset + need) / 2, need - 1, size - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++)
        if (cuts[i] > 0 && cuts[i] < size)
            check_cut(path, data, cuts[i], cuts[i] >= need);

    /* The file path must head the message when the broken copy is opened from disk. */
    char *cut_path = temp_path("gguf_cut.gguf");
    assert_int_equal(write_file(cut_path, data, need - 1), 0);
    assert_null(gguf_open(cut_path, &err));
    assert_true(strncmp(err.msg, cut_path, strlen(cut_path)) == 0);
    unlink(cut_path);
    free(cut_path);
    free(data);
    gguf_close(f);
}

static void test_shared_models(void **state)
{
    (void)state;
    char *path = require_shared("models/stories260K.gguf");
    check_shared_file(path);

    blade_error err = {{0}};
    gguf_file *f = gguf_open(path, &err);
    assert_non_null(f);
    char *arch = gguf_get_string(f, "general.architecture", NULL, &err);
    assert_non_null(arch);
    assert_string_equal(arch, "llama");
    free(arch);
    assert_int_equal(f->n_tensors, 48);
    const gguf_kv *tokens = gguf_find_array(f, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, NULL, &err);
    assert_non_null(tokens);
    assert_int_equal(tokens->arr_len, 512);
    const gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->type, BLADE_TYPE_F32);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 512);
    gguf_close(f);
    free(path);
}

static void check_shared_glob(const char *pattern_rel, size_t min_files)
{
    char *pattern = shared_path(pattern_rel);
    glob_t g;
    int rc = glob(pattern, 0, NULL, &g);
    free(pattern);
    if (rc != 0) {
        globfree(&g);
        note_skipped("no shared file matches %s", pattern_rel);
        skip();
    }
    assert_true(g.gl_pathc >= min_files);
    for (size_t i = 0; i < g.gl_pathc; i++)
        check_shared_file(g.gl_pathv[i]);
    globfree(&g);
}

static void test_shared_vocab(void **state)
{
    (void)state;
    free(require_shared("vocab/ggml-vocab-llama-spm.gguf"));
    check_shared_glob("vocab/*.gguf", 2);

    char *path = shared_path("vocab/ggml-vocab-gpt-2.gguf");
    blade_error err = {{0}};
    gguf_file *f = gguf_open(path, &err);
    assert_non_null(f);
    const gguf_kv *tokens = gguf_find_array(f, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, NULL, &err);
    assert_non_null(tokens);
    assert_int_equal(tokens->arr_len, 50257);
    assert_int_equal(f->n_tensors, 0);
    gguf_close(f);
    free(path);
}

static void test_shared_quant(void **state)
{
    (void)state;
    free(require_shared("quant/tiny256-f32.gguf"));
    check_shared_glob("quant/*.gguf", 8);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_base_file_is_valid),
        cmocka_unit_test(bad_magic),
        cmocka_unit_test(version_1),
        cmocka_unit_test(version_4),
        cmocka_unit_test(empty_and_tiny_files),
        cmocka_unit_test(truncated_header),
        cmocka_unit_test(n_kv_too_large),
        cmocka_unit_test(n_tensors_too_large),
        cmocka_unit_test(counts_too_large_together),
        cmocka_unit_test(key_length_past_end),
        cmocka_unit_test(empty_key),
        cmocka_unit_test(key_with_nul),
        cmocka_unit_test(string_value_past_end),
        cmocka_unit_test(array_past_end),
        cmocka_unit_test(array_size_overflow),
        cmocka_unit_test(string_array_count_too_large),
        cmocka_unit_test(string_array_element_past_end),
        cmocka_unit_test(unknown_value_type),
        cmocka_unit_test(unknown_array_type),
        cmocka_unit_test(array_of_arrays),
        cmocka_unit_test(bool_value_2),
        cmocka_unit_test(bool_array_element_3),
        cmocka_unit_test(duplicate_key),
        cmocka_unit_test(duplicate_long_key_is_escaped),
        cmocka_unit_test(alignment_wrong_type),
        cmocka_unit_test(alignment_zero),
        cmocka_unit_test(alignment_not_power_of_two),
        cmocka_unit_test(n_dims_0),
        cmocka_unit_test(n_dims_5),
        cmocka_unit_test(dimension_0),
        cmocka_unit_test(dimension_negative),
        cmocka_unit_test(element_count_overflow),
        cmocka_unit_test(byte_size_overflow),
        cmocka_unit_test(row_not_whole_blocks),
        cmocka_unit_test(unknown_tensor_type),
        cmocka_unit_test(removed_tensor_type),
        cmocka_unit_test(duplicate_tensor_name),
        cmocka_unit_test(empty_tensor_name),
        cmocka_unit_test(tensor_name_with_nul),
        cmocka_unit_test(misaligned_offset),
        cmocka_unit_test(data_past_end),
        cmocka_unit_test(data_offset_wraps),
        cmocka_unit_test(data_cut_short),
        cmocka_unit_test(data_overlap),
        cmocka_unit_test(truncated_tensor_info),
        cmocka_unit_test(data_section_past_end),
        cmocka_unit_test(test_every_prefix_rejected),
        cmocka_unit_test(test_byte_flips_never_crash),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_getter_errors),
        cmocka_unit_test(test_scalars_getters_and_copy_kv),
        cmocka_unit_test(test_writer_alignment),
        cmocka_unit_test(test_open_copy_aligns_data),
        cmocka_unit_test(test_writer_rejects_bad_tensors),
        cmocka_unit_test(test_writer_sticky_errors),
        cmocka_unit_test(test_writer_reports_disk_full),
        cmocka_unit_test(test_writer_removes_partial_file),
        cmocka_unit_test(test_writer_filled_tensors),
        cmocka_unit_test(test_writer_replaces_atomically),
        cmocka_unit_test(test_open_mapped),
        cmocka_unit_test(test_open_errors),
        cmocka_unit_test(test_shared_models),
        cmocka_unit_test(test_shared_vocab),
        cmocka_unit_test(test_shared_quant),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

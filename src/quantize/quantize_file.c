/* Converting a whole GGUF file: the plan (each tensor's type), then the write, where every
 * tensor is converted on all threads while the writer streams it out, one tensor in memory
 * at a time. Rows are independent, so the bytes do not depend on the thread count. */

#include "blade/quantize.h"

#include "blade/gguf.h"
#include "blade/kernels.h"

#include <fnmatch.h>
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

/* A chunk of rows is claimed at a time: large enough that claiming costs nothing, small
 * enough that threads finish a tensor together and the progress bar moves. */
#define CHUNK_VALUES 65536
#define PROGRESS_INTERVAL_S 0.2
#define PROGRESS_BAR_WIDTH 24
/* Largest magnitude an fp16 holds: beyond it a block's fp16 scale (or an F16 value) would be
 * infinite. */
#define FP16_MAX 65504.0f

typedef struct entry {
    blade_quantize_job *job;
    const gguf_tensor *src;
    blade_quant_tensor_plan *plan;
} entry;

struct blade_quantize_job {
    blade_quantize_params params;
    char *in_path;
    gguf_file *in;
    blade_quant_tensor_plan *plans;
    entry *entries;
    char **unmatched, **shadowed;
    blade_quantize_report report;

    /* the write */
    blade_threadpool *pool;
    double t0, last_shown;
    size_t tensors_done;
    uint64_t bytes_done; /* input bytes of the finished tensors */

    /* the tensor being converted */
    const entry *cur;
    uint8_t *dst;
    const float *importance;
    int64_t n_rows, rows_per_chunk, n_chunks;
    _Atomic int64_t next_chunk, rows_done;
    _Atomic bool failed;
    blade_error row_err; /* written by the thread that set failed */
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static bool is_float_type(uint32_t t)
{
    return t == BLADE_TYPE_F32 || t == BLADE_TYPE_F16 || t == BLADE_TYPE_BF16;
}

static bool is_integer_type(uint32_t t)
{
    return t == BLADE_TYPE_I8 || t == BLADE_TYPE_I16 || t == BLADE_TYPE_I32 || t == BLADE_TYPE_I64 ||
           t == BLADE_TYPE_F64;
}

/* Dimensions up to the last one above 1, as ggml counts them: a [256, 1] tensor is a vector. */
static int effective_dims(const gguf_tensor *t)
{
    int n = 1;
    for (uint32_t d = 1; d < t->n_dims; d++)
        if (t->ne[d] > 1)
            n = (int)d + 1;
    return n;
}

/* Matrices that stay in full precision however the rest is quantized: norms (some
 * architectures store them 2-D), MoE routers (small, and every token's expert choice
 * hangs on them) and RoPE frequency tables. */
static bool stays_float(const char *name)
{
    static const char *const parts[] = {"_norm", "ffn_gate_inp.", "rope_freqs", "rope_factors"};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        if (strstr(name, parts[i]))
            return true;
    return false;
}

static int model_layers(const gguf_file *f)
{
    int n = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const char *name = f->tensors[i].name;
        if (strncmp(name, "blk.", 4) != 0)
            continue;
        long layer = strtol(name + 4, NULL, 10);
        if (layer >= n && layer < 1000000)
            n = (int)layer + 1;
    }
    return n;
}

/* keep_matched[k]: --keep k matched some matrix; keep_used[k]: it was the first to match one. */
static int plan_tensor(blade_quantize_job *job, const gguf_tensor *t, blade_quant_tensor_plan *pl, int n_layer,
                       bool tied, bool *keep_matched, bool *keep_used, blade_error *err)
{
    const blade_quantize_params *p = &job->params;
    pl->name = t->name;
    pl->src_type = t->type;
    pl->n_elements = (int64_t)t->n_elements;
    pl->row_len = t->ne[0];
    pl->bytes_in = t->nbytes;
    const blade_type_traits *src = blade_type_traits_get(t->type);
    if (is_integer_type(t->type)) {
        pl->type = pl->wanted = t->type;
        pl->convert = false;
        return 0;
    }
    if (!src->to_float)
        return blade_error_set(err, "tensor '%s' is %s, which blade cannot read, so cannot convert", t->name,
                               src->name);
    bool matrix = effective_dims(t) >= 2 && !stays_float(t->name);
    if (!matrix) {
        pl->wanted = BLADE_TYPE_F32;
    } else {
        pl->wanted = blade_quant_scheme_type_for(p->scheme, t->name, n_layer, tied);
        bool taken = false;
        for (size_t k = 0; k < p->n_keep; k++) {
            if (fnmatch(p->keep[k].glob, t->name, 0) != 0)
                continue;
            keep_matched[k] = true;
            if (!taken) {
                pl->wanted = p->keep[k].type;
                keep_used[k] = taken = true;
            }
        }
    }
    uint32_t float_fallback = t->type == BLADE_TYPE_BF16 ? BLADE_TYPE_BF16 : BLADE_TYPE_F16;
    pl->type = blade_quant_fit_type(pl->wanted, pl->row_len, float_fallback);
    pl->convert = pl->type != t->type;
    pl->requantized = pl->convert && !is_float_type(t->type) && !is_float_type(pl->type);
    pl->bytes_out = blade_type_row_bytes(pl->type, pl->row_len) * (uint64_t)(pl->n_elements / pl->row_len);
    return 0;
}

blade_quantize_job *blade_quantize_prepare(const char *in_path, const blade_quantize_params *p, blade_error *err)
{
    if (!p || !p->scheme) {
        blade_error_set(err, "quantize: no target type given");
        return NULL;
    }
    blade_quantize_job *job = calloc(1, sizeof *job);
    if (!job || !(job->in_path = strdup(in_path))) {
        free(job);
        blade_error_set(err, "out of memory");
        return NULL;
    }
    job->params = *p;
    if (!(job->in = gguf_open_mapped(in_path, err)))
        goto fail;
    size_t n = (size_t)job->in->n_tensors;
    job->plans = calloc(n ? n : 1, sizeof *job->plans);
    job->entries = calloc(n ? n : 1, sizeof *job->entries);
    size_t n_keep = p->n_keep ? p->n_keep : 1;
    bool *keep_used = calloc(2 * n_keep, sizeof *keep_used), *keep_matched = keep_used + n_keep;
    job->unmatched = calloc(n_keep, sizeof *job->unmatched);
    job->shadowed = calloc(n_keep, sizeof *job->shadowed);
    if (!job->plans || !job->entries || !keep_used || !job->unmatched || !job->shadowed) {
        free(keep_used);
        blade_error_set(err, "out of memory");
        goto fail;
    }
    int n_layer = model_layers(job->in);
    bool tied = !gguf_find_tensor(job->in, "output.weight");
    blade_quantize_report *r = &job->report;
    for (size_t i = 0; i < n; i++) {
        const gguf_tensor *t = &job->in->tensors[i];
        blade_quant_tensor_plan *pl = &job->plans[i];
        if (plan_tensor(job, t, pl, n_layer, tied, keep_matched, keep_used, err) != 0) {
            free(keep_used);
            blade_error_prefix(err, "%s", in_path);
            goto fail;
        }
        job->entries[i] = (entry){job, t, pl};
        r->count_by_type[pl->type]++;
        r->bytes_in += pl->bytes_in;
        r->bytes_out += pl->convert ? pl->bytes_out : pl->bytes_in;
        r->n_elements += pl->n_elements;
        r->n_requantized += pl->requantized;
        r->n_fallbacks += pl->type != pl->wanted;
    }
    for (size_t k = 0; k < p->n_keep; k++) {
        if (!keep_matched[k])
            job->unmatched[r->n_unmatched_keeps++] = p->keep[k].glob;
        else if (!keep_used[k])
            job->shadowed[r->n_shadowed_keeps++] = p->keep[k].glob;
    }
    free(keep_used);
    r->tensors = job->plans;
    r->n_tensors = n;
    r->unmatched_keeps = (const char *const *)job->unmatched;
    r->shadowed_keeps = (const char *const *)job->shadowed;
    r->file_bytes_in = job->in->size;
    return job;
fail:
    blade_quantize_job_free(job);
    return NULL;
}

const blade_quantize_report *blade_quantize_job_report(const blade_quantize_job *job)
{
    return &job->report;
}

void blade_quantize_job_free(blade_quantize_job *job)
{
    if (!job)
        return;
    gguf_close(job->in);
    free(job->in_path);
    free(job->plans);
    free(job->entries);
    free(job->unmatched);
    free(job->shadowed);
    free(job);
}

/* ---- the write ---- */

static bool cancelled(const blade_quantize_job *job)
{
    return job->params.cancel && *job->params.cancel;
}

static void show_progress(blade_quantize_job *job, bool force)
{
    if (!job->params.progress)
        return;
    double t = now_s();
    if (!force && t - job->last_shown < PROGRESS_INTERVAL_S)
        return;
    job->last_shown = t;
    const blade_quantize_report *r = &job->report;
    double done = (double)job->bytes_done;
    if (job->cur && job->n_rows > 0)
        done += (double)job->cur->plan->bytes_in * (double)atomic_load(&job->rows_done) / (double)job->n_rows;
    double frac = r->bytes_in ? done / (double)r->bytes_in : 1.0;
    int filled = (int)(frac * PROGRESS_BAR_WIDTH);
    char bar[PROGRESS_BAR_WIDTH + 1];
    for (int i = 0; i < PROGRESS_BAR_WIDTH; i++)
        bar[i] = i < filled ? '#' : '.';
    bar[PROGRESS_BAR_WIDTH] = '\0';
    double elapsed = t - job->t0;
    double rate = elapsed > 0 ? done / elapsed / 1e6 : 0.0;
    size_t shown = job->tensors_done + (job->cur && job->tensors_done < r->n_tensors ? 1 : 0);
    fprintf(stderr, "\r[%s] %3.0f%%  tensor %zu/%zu  %7.1f MB/s  %-40.40s", bar, 100.0 * frac, shown,
            r->n_tensors, rate, job->cur ? job->cur->plan->name : "");
    fflush(stderr);
}

/* Values a conversion must not be given: not finite anywhere; beyond the fp16 range where
 * the result stores fp16 (F16 values, every block type's scales). */
static int check_row(const blade_quantize_job *job, const float *x, int64_t n, int64_t row, blade_error *err)
{
    uint32_t type = job->cur->plan->type;
    float limit = type == BLADE_TYPE_F32 || type == BLADE_TYPE_BF16 ? INFINITY : FP16_MAX;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(x[i]))
            return blade_error_set(err, "tensor '%s' row %" PRId64 " column %" PRId64 " is %g, not a finite number",
                                   job->cur->plan->name, row, i, (double)x[i]);
        if (fabsf(x[i]) > limit)
            return blade_error_set(err, "tensor '%s' row %" PRId64 " column %" PRId64 " is %g, beyond the +-65504 "
                                   "that %s's fp16 values hold", job->cur->plan->name, row, i, (double)x[i],
                                   blade_type_traits_get(type)->name);
    }
    return 0;
}

/* Importance comes from a file too (an importance matrix): weights must be finite and not
 * negative for the search to mean anything. */
static int check_importance(const char *tensor, const float *imp, int64_t n, blade_error *err)
{
    for (int64_t i = 0; imp && i < n; i++)
        if (!isfinite(imp[i]) || imp[i] < 0.0f)
            return blade_error_set(err, "importance of tensor '%s' column %" PRId64 " is %g, not a finite "
                                   "non-negative number", tensor, i, (double)imp[i]);
    return 0;
}

static void fail_rows(blade_quantize_job *job, const blade_error *e)
{
    bool expected = false;
    if (atomic_compare_exchange_strong(&job->failed, &expected, true))
        job->row_err = *e;
}

static void convert_rows(void *ctx, int ith, int nth)
{
    (void)nth;
    blade_quantize_job *job = ctx;
    const blade_quant_tensor_plan *pl = job->cur->plan;
    const blade_type_traits *src_t = blade_type_traits_get(pl->src_type);
    int64_t row_len = pl->row_len, n_rows_slice = job->cur->src->ne[1];
    size_t src_row = blade_type_row_bytes(pl->src_type, row_len), dst_row = blade_type_row_bytes(pl->type, row_len);
    const uint8_t *src = job->cur->src->data;
    float *x = malloc((size_t)row_len * sizeof *x);
    if (!x) {
        blade_error e;
        blade_error_set(&e, "out of memory for a row of tensor '%s'", pl->name);
        fail_rows(job, &e);
        return;
    }
    for (;;) {
        int64_t chunk = atomic_fetch_add(&job->next_chunk, 1);
        if (chunk >= job->n_chunks || atomic_load(&job->failed))
            break;
        if (cancelled(job)) {
            blade_error e;
            blade_error_set(&e, "interrupted");
            fail_rows(job, &e);
            break;
        }
        int64_t r0 = chunk * job->rows_per_chunk, r1 = r0 + job->rows_per_chunk;
        r1 = r1 < job->n_rows ? r1 : job->n_rows;
        for (int64_t r = r0; r < r1; r++) {
            src_t->to_float(src + (size_t)r * src_row, x, row_len);
            blade_error e;
            if (check_row(job, x, row_len, r, &e) != 0) {
                fail_rows(job, &e);
                break;
            }
            const float *imp = job->importance ? job->importance + (r / n_rows_slice) * row_len : NULL;
            blade_quantize_row(pl->type, x, job->dst + (size_t)r * dst_row, row_len, imp, !job->params.no_refine);
        }
        atomic_fetch_add(&job->rows_done, r1 - r0);
        if (ith == 0)
            show_progress(job, false);
    }
    free(x);
}

static int fill_tensor(void *ctx, void *dst, size_t nbytes, blade_error *err)
{
    entry *e = ctx;
    blade_quantize_job *job = e->job;
    blade_quant_tensor_plan *pl = e->plan;
    if (cancelled(job))
        return blade_error_set(err, "interrupted");
    job->cur = e;
    job->n_rows = pl->n_elements / pl->row_len;
    atomic_store(&job->rows_done, 0);
    if (!pl->convert) {
        memcpy(dst, e->src->data, nbytes);
    } else {
        job->importance = NULL;
        if (job->params.importance && !is_float_type(pl->type)) {
            blade_error ie = {{0}};
            job->importance = job->params.importance(job->params.importance_ctx, pl->name, pl->row_len,
                                                     job->n_rows / e->src->ne[1], &ie);
            if (!job->importance && ie.msg[0])
                return blade_error_set(err, "%s", ie.msg);
            if (check_importance(pl->name, job->importance, pl->row_len * (job->n_rows / e->src->ne[1]), err) != 0)
                return -1;
            pl->importance = job->importance != NULL;
        }
        job->dst = dst;
        job->rows_per_chunk = CHUNK_VALUES / pl->row_len > 0 ? CHUNK_VALUES / pl->row_len : 1;
        job->n_chunks = (job->n_rows + job->rows_per_chunk - 1) / job->rows_per_chunk;
        atomic_store(&job->next_chunk, 0);
        atomic_store(&job->failed, false);
        blade_threadpool_run(job->pool, convert_rows, job);
        if (atomic_load(&job->failed))
            return blade_error_set(err, "%s", job->row_err.msg);
    }
    job->tensors_done++;
    job->bytes_done += pl->bytes_in;
    atomic_store(&job->rows_done, 0); /* now counted in bytes_done */
    show_progress(job, job->tensors_done == job->report.n_tensors);
    return 0;
}

static int same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

int blade_quantize_write(blade_quantize_job *job, const char *out_path, blade_error *err)
{
    if (same_file(job->in_path, out_path))
        return blade_error_set(err, "%s is the input file: writing over the model being read is refused "
                               "(name another output)", out_path);
    gguf_writer *w = gguf_writer_new();
    if (!w)
        return blade_error_set(err, "out of memory");
    gguf_writer_copy_kv(w, job->in);
    gguf_writer_set_u32(w, "general.quantization_version", 2);
    gguf_writer_set_u32(w, "general.file_type", job->params.scheme->file_type);
    /* An input quantized with an importance matrix carries these keys; they describe this
     * conversion or none. */
    static const char *const imatrix_keys[] = {"quantize.imatrix.file", "quantize.imatrix.dataset",
                                               "quantize.imatrix.chunks_count", "quantize.imatrix.entries_count"};
    for (size_t k = 0; k < sizeof imatrix_keys / sizeof imatrix_keys[0]; k++)
        gguf_writer_remove_kv(w, imatrix_keys[k]);
    const blade_quantize_params *p = &job->params;
    if (p->importance && p->imatrix_file) {
        gguf_writer_set_string(w, imatrix_keys[0], p->imatrix_file);
        gguf_writer_set_string(w, imatrix_keys[1], p->imatrix_dataset ? p->imatrix_dataset : "");
        gguf_writer_set_i32(w, imatrix_keys[2], p->imatrix_chunks);
        gguf_writer_set_i32(w, imatrix_keys[3], p->imatrix_entries);
    }
    for (size_t i = 0; i < job->report.n_tensors; i++) {
        const gguf_tensor *t = job->entries[i].src;
        const blade_quant_tensor_plan *pl = &job->plans[i];
        size_t bytes = pl->convert ? pl->bytes_out : pl->bytes_in;
        if (gguf_writer_add_tensor_filled(w, t->name, pl->type, t->n_dims, t->ne, bytes, fill_tensor,
                                          &job->entries[i], err) != 0) {
            gguf_writer_free(w);
            return -1;
        }
    }
    job->pool = blade_threadpool_new(job->params.n_threads);
    if (!job->pool) {
        gguf_writer_free(w);
        return blade_error_set(err, "cannot start the threads");
    }
    job->report.n_threads = blade_threadpool_size(job->pool);
    job->t0 = job->last_shown = now_s();
    job->tensors_done = 0;
    job->bytes_done = 0;
    job->cur = NULL;
    show_progress(job, true);
    int rc = gguf_writer_write(w, out_path, false, err);
    if (job->params.progress)
        fputc('\n', stderr);
    job->report.seconds = now_s() - job->t0;
    blade_threadpool_free(job->pool);
    job->pool = NULL;
    gguf_writer_free(w);
    if (rc != 0)
        return -1;
    struct stat st;
    job->report.file_bytes_out = stat(out_path, &st) == 0 ? (uint64_t)st.st_size : 0;
    return 0;
}

/* The model runner (runner.h): one ragged batch per call, its tokens flattened into one
 * matrix so each weight is streamed once per step, attention per sequence through its
 * block table, logits only for the rows asked for. Batch invariance (runner.h) rests on
 * the kernels' determinism contracts: no sum a token's logits depend on is split by the
 * batch it is in or the thread count. */

#include "blade/runner.h"

#include "blade/act_stats.h"
#include "blade/attention.h"
#include "blade/types.h"
#include "common/clock.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Where one batch token comes from: its sequence, its index in that sequence's chunk and
 * its absolute position. */
typedef struct token_ref {
    int32_t seq;
    int32_t index;
    int32_t pos;
} token_ref;

struct blade_runner {
    const blade_model *m;
    blade_kv_store *kv;
    blade_threadpool *pool;
    int32_t max_tokens;
    int64_t q_dim, kv_dim, widest;
    size_t act_stride; /* bytes of one converted activation row, for the widest input */
    float *rope_inv_freq;
    float *norm_scratch; /* one row of the widest input per pool thread */
    float *rope;         /* [T][n_rot]: cos then sin of each batch token's n_rot / 2 angles */
    uint8_t *attn_scratch; /* attention working space per pool thread */
    size_t attn_scratch_bytes;
    uint8_t *input_scratch; /* per pool thread, for blade_matmul_input_hold */
    size_t input_scratch_bytes;
    float *x;      /* [T][n_embd] residual stream */
    float *delta;  /* [T][n_embd] output of attention or FFN, added to x */
    void *act;     /* [T] converted activation rows */
    void *act_ffn; /* [FUSED_ROWS] the SwiGLU output converted for the down projection */
    float *q;      /* [T][q_dim] */
    float *k;      /* [T][kv_dim] */
    float *v;      /* [T][kv_dim] */
    float *attn;   /* [T][q_dim] */
    float *ffn;    /* [T][n_ff] SwiGLU output (gate projections before it) */
    float *up;     /* [T][n_ff] up projections, or [T][2 n_ff] fused gate and up ones */
    float *logits; /* [cap_logits][n_vocab]: the rows that want logits, grown on demand */
    int32_t cap_logits;
    token_ref *refs;
    int32_t *logit_tokens; /* batch token index of every wanted logit row */
    int32_t *work;         /* (seq, kv head) attention work items */
    blade_work_share *rows_share; /* matrix products: row units between the pool's threads */
    blade_act_stats *stats; /* NULL unless a caller collects activation statistics */
    blade_stage_times *stage_times; /* NULL unless a caller times the stages */
    float *stat_rows;       /* [T][widest]: the float rows a site's matrices read, while collecting */
};

/* ---- helpers ---- */

static void *alloc_array(size_t n, size_t size, bool *ok)
{
    void *p = NULL;
    if (n && size > SIZE_MAX / n)
        *ok = false;
    else if (!(p = aligned_alloc(64, ((n * size + 63) / 64) * 64 + 64)))
        *ok = false;
    return p;
}

/* Thread ith's share of n items, rounded so that the calling thread (0) takes an item when
 * there are fewer items than threads: a decode step's single-row tasks then start at once
 * instead of after a worker wakes (about half a microsecond, measured). */
static void split(int64_t n, int ith, int nth, int64_t *begin, int64_t *end)
{
    *begin = (n * ith + nth - 1) / nth;
    *end = (n * (ith + 1) + nth - 1) / nth;
}

static size_t weight_stride(const blade_weight *w)
{
    return blade_matmul_row_bytes(w->type, w->n_in);
}

/* Steps of 2 to this many tokens (speculative verifies, a few sequences' decode) convert the
 * attention output and the SwiGLU output in the pass that computes them, each thread the
 * heads and pieces it made: a pass of the pool less for each, and each thread reads what is
 * in its own cache instead of rows the other threads wrote. On the TinyLlama-shaped Q4_0
 * target that made 2- and 3-token steps 1.8% and 2.6% faster (ten rounds taking turns,
 * MEASURED.md, stop 41). A one-token step converts on the calling thread with no pass to
 * save (fused, it measured 0.8% slower), and a longer step's passes are long enough that
 * the separate conversion costs little. */
#define FUSED_ROWS 16

static bool fused_step(int32_t n_tokens)
{
    return n_tokens >= 2 && n_tokens <= FUSED_ROWS;
}

/* Matrix products hand out rows in units of this many, a multiple of every layout's row
 * alignment (kernels.h). Which thread computes a row never changes its bits. */
#define ROW_UNIT BLADE_R16_ROWS

static int64_t row_units(const blade_weight *w)
{
    return (w->n_out + ROW_UNIT - 1) / ROW_UNIT;
}

/* Rows [begin, end) of a weight for units [ub, ue) of it. */
static void unit_rows(const blade_weight *w, int64_t ub, int64_t ue, int64_t *begin, int64_t *end)
{
    *begin = ub * ROW_UNIT;
    *end = ue * ROW_UNIT < w->n_out ? ue * ROW_UNIT : w->n_out;
}

/* ---- construction ---- */

blade_runner *blade_runner_new(const blade_model *m, blade_kv_store *kv, blade_threadpool *pool,
                               int32_t max_batch_tokens, blade_error *err)
{
    const blade_hparams *hp = &m->hp;
    if (max_batch_tokens <= 0)
        return blade_error_set(err, "max_batch_tokens must be positive"), NULL;
    /* a deeper store is allowed: an early-exit view of a model (its first layers) drafts in
     * its target's store, whose first layers already hold what the view would compute */
    if (kv->n_layer < hp->n_layer || kv->n_head_kv != hp->n_head_kv || kv->head_dim != hp->head_dim)
        return blade_error_set(err, "the KV store's shape does not match the model"), NULL;
    blade_runner *r = calloc(1, sizeof *r);
    if (!r)
        return blade_error_set(err, "out of memory"), NULL;
    r->m = m;
    r->kv = kv;
    r->pool = pool;
    r->max_tokens = max_batch_tokens;
    r->q_dim = (int64_t)hp->n_head * hp->head_dim;
    r->kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    r->widest = hp->n_embd > r->q_dim ? hp->n_embd : r->q_dim;
    if (hp->n_ff > r->widest)
        r->widest = hp->n_ff;

    /* Size the conversion buffer for the largest activation row any weight asks for. */
    size_t act = blade_act_row_bytes(m->output.type, m->output.n_in);
    for (int l = 0; l < hp->n_layer; l++) {
        const blade_layer *L = &m->layers[l];
        const blade_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->ffn_gate, &L->ffn_up, &L->ffn_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) {
            size_t b = blade_act_row_bytes(ws[i]->type, ws[i]->n_in);
            if (b > act)
                act = b;
        }
    }
    r->act_stride = (act + 63) / 64 * 64;

    size_t T = (size_t)max_batch_tokens;
    bool ok = true;
    r->rope_inv_freq = alloc_array((size_t)hp->n_rot / 2 + 1, sizeof(float), &ok);
    r->norm_scratch = alloc_array((size_t)blade_threadpool_size(pool) * (size_t)r->widest, sizeof(float), &ok);
    r->rope = alloc_array(T * (size_t)hp->n_rot, sizeof(float), &ok);
    r->attn_scratch_bytes = (blade_attention_scratch_bytes(kv, max_batch_tokens, hp->n_head) + 63) / 64 * 64;
    r->attn_scratch = alloc_array((size_t)blade_threadpool_size(pool), r->attn_scratch_bytes, &ok);
    r->input_scratch_bytes = (blade_matmul_input_scratch_bytes(r->widest, max_batch_tokens) + 63) / 64 * 64;
    r->input_scratch = alloc_array((size_t)blade_threadpool_size(pool), r->input_scratch_bytes, &ok);
    r->x = alloc_array(T * hp->n_embd, sizeof(float), &ok);
    r->delta = alloc_array(T * hp->n_embd, sizeof(float), &ok);
    r->act = alloc_array(T, r->act_stride, &ok);
    r->act_ffn = alloc_array(T < FUSED_ROWS ? T : FUSED_ROWS, r->act_stride, &ok);
    r->q = alloc_array(T * r->q_dim, sizeof(float), &ok);
    r->k = alloc_array(T * r->kv_dim, sizeof(float), &ok);
    r->v = alloc_array(T * r->kv_dim, sizeof(float), &ok);
    r->attn = alloc_array(T * r->q_dim, sizeof(float), &ok);
    r->ffn = alloc_array(T * hp->n_ff, sizeof(float), &ok);
    r->up = alloc_array(T * 2 * hp->n_ff, sizeof(float), &ok);
    r->refs = alloc_array(T, sizeof *r->refs, &ok);
    r->logit_tokens = alloc_array(T, sizeof *r->logit_tokens, &ok);
    r->rows_share = blade_work_share_new(blade_threadpool_size(pool));
    ok = ok && r->rows_share != NULL;
    r->work = alloc_array(T * hp->n_head_kv, sizeof *r->work, &ok);
    if (!ok) {
        blade_runner_free(r);
        return blade_error_set(err, "out of memory for a runner of %d batch tokens", max_batch_tokens), NULL;
    }
    const float *freq_factors = m->rope_freqs.data;
    for (int i = 0; i < hp->n_rot / 2; i++) {
        r->rope_inv_freq[i] = powf(hp->rope_base, -2.0f * (float)i / (float)hp->n_rot);
        if (freq_factors)
            r->rope_inv_freq[i] /= freq_factors[i];
    }
    return r;
}

void blade_runner_free(blade_runner *r)
{
    if (!r)
        return;
    free(r->rope_inv_freq);
    free(r->norm_scratch);
    free(r->rope);
    free(r->attn_scratch);
    free(r->input_scratch);
    free(r->x);
    free(r->delta);
    free(r->act);
    free(r->act_ffn);
    free(r->q);
    free(r->k);
    free(r->v);
    free(r->attn);
    free(r->ffn);
    free(r->up);
    free(r->logits);
    free(r->refs);
    free(r->logit_tokens);
    free(r->work);
    free(r->stat_rows);
    blade_work_share_free(r->rows_share);
    free(r);
}

int32_t blade_runner_max_batch_tokens(const blade_runner *r)
{
    return r->max_tokens;
}

int blade_runner_set_act_stats(blade_runner *r, blade_act_stats *s, blade_error *err)
{
    if (s && !blade_act_stats_fits(s, &r->m->hp))
        return blade_error_set(err, "the activation statistics were made for a model of another shape");
    if (s && !r->stat_rows) {
        bool ok = true;
        r->stat_rows = alloc_array((size_t)r->max_tokens * (size_t)r->widest, sizeof(float), &ok);
        if (!ok)
            return blade_error_set(err, "out of memory for activation statistics of %d batch tokens", r->max_tokens);
    }
    r->stats = s;
    return 0;
}

const char *blade_runner_stage_name(blade_runner_stage s)
{
    static const char *const names[BLADE_STAGE_COUNT] = {"norms", "qkv", "attention", "o", "ffn_up", "ffn_down",
                                                         "other"};
    return s >= 0 && s < BLADE_STAGE_COUNT ? names[s] : "?";
}

void blade_runner_set_stage_times(blade_runner *r, blade_stage_times *t)
{
    r->stage_times = t;
}

static double stage_start(const blade_runner *r)
{
    return r->stage_times ? blade_clock_seconds() : 0.0;
}

static void stage_end(blade_runner *r, blade_runner_stage st, double t0)
{
    if (r->stage_times)
        r->stage_times->seconds[st] += blade_clock_seconds() - t0;
}

static double stage_sum(const blade_stage_times *t)
{
    double sum = 0;
    for (int i = 0; i < BLADE_STAGE_COUNT; i++)
        sum += t->seconds[i];
    return sum;
}

/* ---- one step's shared state, handed to the pool's workers ---- */

typedef struct step {
    blade_runner *r;
    const blade_batch_seq *seqs;
    int32_t n_tokens;
    int32_t n_logit_rows;
    int32_t n_work;
    int32_t layer;
    /* the matrix product being run */
    const blade_weight *w[3];
    float *out[3];
    int n_w;
    float *in;         /* rows to normalise/convert */
    float *add_to_in;  /* when set, `in` is the residual stream and this delta joins it first */
    int64_t in_width;
    const blade_weight *norm;
    const blade_weight *in_type_of; /* the weight whose activation form to produce */
    int32_t n_rows;                 /* rows of `in`/`act` in use */
    const int32_t *row_map;         /* act row i is built from in row row_map[i] (NULL: identity) */
    int site;                       /* activation statistics site of these rows; -1: none kept */
    const void *x_act;              /* the converted rows the matrix products read */
    bool convert_heads;   /* the attention pass converts its heads' output for the O projection */
    int64_t gate_up_span; /* group pairs per work unit of the gate/up pass when it converts its
                           * output for the down projection (0: it does not) */
} step;

static const float *f32_vector(const blade_weight *w)
{
    return (const float *)w->data;
}

/* The residual add of the previous block (when given), RMSNorm (when a norm is given) and
 * the conversion into the activation form the next weight wants, one row at a time so
 * each row is read once. */
static void task_norm_convert(void *ctx, int ith, int nth)
{
    step *s = ctx;
    blade_runner *r = s->r;
    float *row = r->norm_scratch + (size_t)ith * (size_t)r->widest;
    int64_t b, e;
    split(s->n_rows, ith, nth, &b, &e);
    for (int64_t i = b; i < e; i++) {
        int64_t src = s->row_map ? s->row_map[i] : i;
        float *x = s->in + src * s->in_width;
        if (s->add_to_in) {
            const float *d = s->add_to_in + src * s->in_width;
            for (int64_t j = 0; j < s->in_width; j++)
                x[j] += d[j];
        }
        const float *y = x;
        if (s->norm) {
            blade_rmsnorm(row, x, f32_vector(s->norm), s->in_width, r->m->hp.rms_eps);
            y = row;
        }
        blade_act_convert(s->in_type_of->type, y, (uint8_t *)r->act + i * r->act_stride, s->in_width);
        if (s->site >= 0)
            memcpy(r->stat_rows + i * r->widest, y, (size_t)s->in_width * sizeof *y);
    }
}

/* The rows just converted join the statistics, each thread summing its share of the
 * columns over all rows, so every column adds its rows in order whatever the thread count. */
static void task_act_stats(void *ctx, int ith, int nth)
{
    step *s = ctx;
    int64_t b, e;
    split(s->in_width, ith, nth, &b, &e);
    blade_act_stats_add(s->r->stats, s->site, s->r->stat_rows, s->n_rows, s->r->widest, b, e);
}

/* site: where the rows count in the activation statistics, when the runner collects them
 * (-1: nowhere, for a second conversion of rows already counted). */
static void run_norm_convert(step *s, float *in, float *add_to_in, int64_t width, const blade_weight *norm,
                             const blade_weight *for_weight, int32_t n_rows, const int32_t *row_map, int site)
{
    s->in = in;
    s->add_to_in = add_to_in;
    s->in_width = width;
    s->norm = norm;
    s->in_type_of = for_weight;
    s->n_rows = n_rows;
    s->row_map = row_map;
    s->site = s->r->stats ? site : -1;
    double t0 = stage_start(s->r);
    /* One row (a decode step) is the calling thread's alone: going through the pool would
     * only add a handoff to a worker with nothing to do. */
    if (n_rows == 1)
        task_norm_convert(s, 0, 1);
    else
        blade_threadpool_run(s->r->pool, task_norm_convert, s);
    if (s->site >= 0) {
        blade_threadpool_run(s->r->pool, task_act_stats, s);
        blade_act_stats_count(s->r->stats, s->site, n_rows);
    }
    stage_end(s->r, BLADE_STAGE_NORMS, t0);
}

/* Runs a task that takes its row units from the runner's work share. */
static void run_on_row_units(step *s, void (*task)(void *ctx, int ith, int nth), int64_t units)
{
    blade_work_share_reset(s->r->rows_share, units);
    blade_threadpool_run(s->r->pool, task, s);
}

/* The step's converted activations stay as they are while a thread takes its row pieces,
 * so the kernels may keep what they derive from them across the pieces. */
static void hold_input(blade_runner *r, int ith)
{
    blade_matmul_input_hold(r->input_scratch + (size_t)ith * r->input_scratch_bytes, r->input_scratch_bytes);
}

/* Y = X W^T for up to three weights sharing one input: their row units, one after the
 * other, are the run's work share. */
static void task_matmul(void *ctx, int ith, int nth)
{
    (void)nth;
    step *s = ctx;
    int64_t ub, ue;
    hold_input(s->r, ith);
    while (blade_work_share_next(s->r->rows_share, ith, &ub, &ue)) {
        int64_t first = 0;
        for (int i = 0; i < s->n_w && ub < ue; i++) {
            const blade_weight *w = s->w[i];
            int64_t n = row_units(w);
            if (ub < first + n) {
                int64_t piece_end = ue < first + n ? ue : first + n, b, e;
                unit_rows(w, ub - first, piece_end - first, &b, &e);
                blade_matmul(w->type, w->data, weight_stride(w), s->x_act, s->r->act_stride, w->n_in, s->out[i],
                             w->n_out, s->n_rows, b, e);
                ub = piece_end;
            }
            first += n;
        }
    }
    blade_matmul_input_release();
}

static void run_matmul(step *s, int n, const blade_weight *w0, float *y0, const blade_weight *w1, float *y1,
                       const blade_weight *w2, float *y2)
{
    s->n_w = n;
    s->w[0] = w0;
    s->out[0] = y0;
    s->w[1] = w1;
    s->out[1] = y1;
    s->w[2] = w2;
    s->out[2] = y2;
    int64_t units = 0;
    for (int i = 0; i < n; i++)
        units += row_units(s->w[i]);
    run_on_row_units(s, task_matmul, units);
}

/* cos and sin of every rotated pair's angle at one position, computed once per step for
 * all layers and heads: computed per layer and work item, they took about a sixth of a
 * decode step's attention pass (thread 0's part of it: 12.1 -> 9.7-10.1 us). */
static void rope_angles(int32_t pos, const blade_hparams *hp, const float *inv_freq, float *cos_t, float *sin_t)
{
    float p = (float)pos / hp->rope_scale;
    for (int i = 0; i < hp->n_rot / 2; i++) {
        float theta = p * inv_freq[i];
        cos_t[i] = cosf(theta);
        sin_t[i] = sinf(theta);
    }
}

static void rope_head(float *head, const blade_hparams *hp, const float *cos_t, const float *sin_t)
{
    int half = hp->n_rot / 2;
    for (int i = 0; i < half; i++) {
        int a = hp->rope_neox ? i : 2 * i;
        int b = hp->rope_neox ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * cos_t[i] - x1 * sin_t[i];
        head[b] = x0 * sin_t[i] + x1 * cos_t[i];
    }
}

static void add_bias(float *x, const blade_weight *b, int64_t offset, int64_t n)
{
    if (b->data)
        for (int64_t i = 0; i < n; i++)
            x[i] += f32_vector(b)[offset + i];
}

/* One head of one token after the Q/K/V projections: bias, per-head norm, RoPE. */
static void head_post(float *head, int64_t index, const blade_weight *bias, const blade_weight *norm, bool rotate,
                      const blade_hparams *hp, const float *cos_t, const float *sin_t)
{
    int hd = hp->head_dim;
    add_bias(head, bias, index * hd, hd);
    if (norm && norm->data)
        blade_rmsnorm(head, head, f32_vector(norm), hd, hp->rms_eps);
    if (rotate)
        rope_head(head, hp, cos_t, sin_t);
}

/* Work items are (sequence, KV head) pairs; splitting by KV head keeps each head's group
 * of query heads together, so its K/V tiles are loaded once. An item first finishes its
 * heads of the sequence's new tokens (biases, Q/K norms, RoPE) and writes their K/V into
 * the paged store (RoPE fused with the KV write): nothing else reads those heads, so no
 * pass over the whole batch has to come first. */
static void task_attention(void *ctx, int ith, int nth)
{
    step *s = ctx;
    blade_runner *r = s->r;
    const blade_hparams *hp = &r->m->hp;
    const blade_layer *L = &r->m->layers[s->layer];
    int hd = hp->head_dim, group = hp->n_head / hp->n_head_kv;
    int64_t b, e;
    split(s->n_work, ith, nth, &b, &e);
    for (int64_t i = b; i < e; i++) {
        int32_t seq = r->work[i] / hp->n_head_kv, head = r->work[i] % hp->n_head_kv;
        const blade_batch_seq *sq = &s->seqs[seq];
        /* the sequence's first token in the batch */
        int64_t first = 0;
        for (int32_t j = 0; j < seq; j++)
            first += s->seqs[j].n_tokens;
        for (int64_t t = first; t < first + sq->n_tokens; t++) {
            const token_ref *ref = &r->refs[t];
            float *q = r->q + t * r->q_dim, *k = r->k + t * r->kv_dim + head * hd, *v = r->v + t * r->kv_dim + head * hd;
            const float *cos_t = r->rope + t * hp->n_rot, *sin_t = cos_t + hp->n_rot / 2;
            for (int h = head * group; h < (head + 1) * group; h++)
                head_post(q + h * hd, h, &L->bq, &L->q_norm, true, hp, cos_t, sin_t);
            head_post(k, head, &L->bk, &L->k_norm, true, hp, cos_t, sin_t);
            head_post(v, head, &L->bv, NULL, false, hp, cos_t, sin_t);
            int32_t block = sq->block_table[ref->pos / r->kv->block_size];
            blade_kv_store_write_head(r->kv, s->layer, block, ref->pos % r->kv->block_size, head, k, v);
        }
        blade_attention_args a = {
            .kv = r->kv,
            .layer = s->layer,
            .block_table = sq->block_table,
            .pos0 = sq->pos0,
            .n_q = sq->n_tokens,
            .n_head = hp->n_head,
            .q = r->q + first * r->q_dim,
            .q_stride = r->q_dim,
            .out = r->attn + first * r->q_dim,
            .out_stride = r->q_dim,
            .scale = 1.0f / sqrtf((float)hp->head_dim),
            .kv_head_begin = head,
            .kv_head_end = head + 1,
            .scratch = r->attn_scratch + (size_t)ith * r->attn_scratch_bytes,
        };
        blade_attention(&a);
        if (s->convert_heads) {
            int64_t begin = (int64_t)head * group * hd, end = begin + (int64_t)group * hd;
            for (int64_t t = first; t < first + sq->n_tokens; t++)
                blade_act_convert_part(L->wo.type, r->attn + t * r->q_dim + begin,
                                       (uint8_t *)r->act + t * r->act_stride, r->q_dim, begin, end);
        }
    }
}

/* The element ranges of a row one thread computed in a pass: the owner's pieces follow one
 * another and a thief's precede one another, so a few ranges hold them all. */
#define PIECE_RANGES 16

typedef struct piece_list {
    int64_t begin[PIECE_RANGES], end[PIECE_RANGES];
    int n;
} piece_list;

/* false when the list is full (the caller empties it) */
static bool piece_list_add(piece_list *p, int64_t begin, int64_t end)
{
    if (p->n && p->end[p->n - 1] == begin)
        p->end[p->n - 1] = end;
    else if (p->n && p->begin[p->n - 1] == end)
        p->begin[p->n - 1] = begin;
    else if (p->n < PIECE_RANGES) {
        p->begin[p->n] = begin;
        p->end[p->n++] = end;
    } else
        return false;
    return true;
}

/* The SwiGLU outputs this thread computed, converted for the down projection once its pieces
 * are done: a conversion per range rather than per piece, whose pieces shrink to single
 * units at the end of a pass. */
static void convert_ffn_pieces(step *s, piece_list *p)
{
    blade_runner *r = s->r;
    const blade_weight *down = &r->m->layers[s->layer].ffn_down;
    const int64_t n_ff = r->m->hp.n_ff;
    for (int i = 0; i < p->n; i++)
        for (int64_t t = 0; t < s->n_tokens; t++)
            blade_act_convert_part(down->type, r->ffn + t * n_ff + p->begin[i], (uint8_t *)r->act_ffn + t * r->act_stride,
                                   n_ff, p->begin[i], p->end[i]);
    p->n = 0;
}

/* Gate and up from the fused matrix (model.h), a piece of group pairs at a time: one weight
 * stream, then SiLU(gate)·up of the piece's rows while both are hot. */
static void task_gate_up(void *ctx, int ith, int nth)
{
    (void)nth;
    step *s = ctx;
    blade_runner *r = s->r;
    const blade_layer *L = &r->m->layers[s->layer];
    const blade_weight *gu = &L->ffn_gate_up;
    const int64_t G = BLADE_GATE_UP_GROUP, n_ff = r->m->hp.n_ff, span = s->gate_up_span ? s->gate_up_span : 1;
    piece_list done = {0};
    int64_t ub, ue;
    hold_input(r, ith);
    while (blade_work_share_next(r->rows_share, ith, &ub, &ue)) {
        int64_t pb = ub * span, pe = ue * span;
        blade_matmul(gu->type, gu->data, weight_stride(gu), r->act, r->act_stride, gu->n_in, r->up, gu->n_out,
                     s->n_tokens, 2 * G * pb, 2 * G * pe);
        for (int64_t t = 0; t < s->n_tokens; t++) {
            const float *y = r->up + t * 2 * n_ff + 2 * G * pb;
            blade_swiglu(y, y + G, r->ffn + t * n_ff + G * pb, pe - pb, G, 2 * G);
        }
        if (s->gate_up_span && !piece_list_add(&done, G * pb, G * pe)) {
            convert_ffn_pieces(s, &done);
            piece_list_add(&done, G * pb, G * pe);
        }
    }
    blade_matmul_input_release();
    if (s->gate_up_span)
        convert_ffn_pieces(s, &done);
}

static void task_swiglu(void *ctx, int ith, int nth)
{
    step *s = ctx;
    blade_runner *r = s->r;
    int64_t b, e;
    split((int64_t)s->n_tokens * r->m->hp.n_ff, ith, nth, &b, &e);
    blade_swiglu(r->ffn + b, r->up + b, r->ffn + b, 1, e - b, 0);
}

/* Adds the pending residual delta (when given), then normalises the residual stream once
 * per activation form (kernels.h) and multiplies every weight that reads it in one pass of
 * the pool. Files mixing types across projections share a pass where the forms agree
 * (Q4_K_M's Q6_K V projections join Q4_K's Q and K). */
static void run_projections(step *s, float *residual_delta, const blade_weight *norm, const blade_weight **ws,
                            float **outs, int n, int site, blade_runner_stage stage)
{
    blade_runner *r = s->r;
    bool done[3] = {false, false, false};
    for (int i = 0; i < n; i++) {
        if (done[i])
            continue;
        run_norm_convert(s, r->x, residual_delta, r->m->hp.n_embd, norm, ws[i], s->n_tokens, NULL, site);
        residual_delta = NULL; /* added once */
        site = -1;             /* counted once */
        const blade_weight *group[3] = {NULL, NULL, NULL};
        float *group_out[3] = {NULL, NULL, NULL};
        int k = 0;
        for (int j = i; j < n; j++)
            if (!done[j] && blade_act_form(ws[j]->type) == blade_act_form(ws[i]->type)) {
                group[k] = ws[j];
                group_out[k++] = outs[j];
                done[j] = true;
            }
        double t0 = stage_start(r);
        run_matmul(s, k, group[0], group_out[0], group[1], group_out[1], group[2], group_out[2]);
        stage_end(r, stage, t0);
    }
}

/* Whether the attention pass converts its heads' output for the O projection: each work
 * item's query heads must be whole parts of the converted row. The activation statistics
 * read the float rows in the separate pass. */
static bool heads_convert(const blade_runner *r, const blade_layer *L, int32_t n_tokens)
{
    const blade_hparams *hp = &r->m->hp;
    int64_t align = blade_act_part_align(L->wo.type), item = (int64_t)hp->n_head / hp->n_head_kv * hp->head_dim;
    return fused_step(n_tokens) && !r->stats && align > 0 && item % align == 0;
}

/* Group pairs per work unit of the gate/up pass that converts its output for the down
 * projection, so that each unit's SwiGLU outputs are whole parts of the converted row; 0
 * where that cannot be, and the separate pass converts. */
static int64_t gate_up_span(const blade_runner *r, const blade_layer *L, int32_t n_tokens)
{
    const int64_t G = BLADE_GATE_UP_GROUP;
    int64_t align = blade_act_part_align(L->ffn_down.type);
    if (!fused_step(n_tokens) || r->stats || align <= 0)
        return 0;
    int64_t span = align <= G ? 1 : align / G;
    return (span * G) % align == 0 && r->m->hp.n_ff % (span * G) == 0 ? span : 0;
}

/* Each batch token's embedding row and RoPE angles. */
static void task_embed(void *ctx, int ith, int nth)
{
    step *s = ctx;
    blade_runner *r = s->r;
    const blade_weight *emb = &r->m->tok_embd;
    const blade_type_traits *tt = blade_type_traits_get(emb->type);
    size_t stride = weight_stride(emb);
    int64_t b, e;
    split(s->n_tokens, ith, nth, &b, &e);
    for (int64_t t = b; t < e; t++) {
        const token_ref *ref = &r->refs[t];
        int32_t tok = s->seqs[ref->seq].tokens[ref->index];
        tt->to_float((const uint8_t *)emb->data + (size_t)tok * stride, r->x + t * emb->n_in, emb->n_in);
        float *cos_t = r->rope + t * r->m->hp.n_rot;
        rope_angles(ref->pos, &r->m->hp, r->rope_inv_freq, cos_t, cos_t + r->m->hp.n_rot / 2);
    }
}

/* ---- validation ---- */

static int validate(const blade_runner *r, const blade_batch_seq *seqs, int32_t n_seqs, int32_t *n_tokens,
                    int32_t *n_logits, blade_error *err)
{
    const blade_hparams *hp = &r->m->hp;
    int64_t total = 0, logits = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        const blade_batch_seq *s = &seqs[i];
        if (s->n_tokens <= 0 || !s->tokens)
            return blade_error_set(err, "sequence %d: no tokens", i);
        if (s->pos0 < 0 || (int64_t)s->pos0 + s->n_tokens > (int64_t)s->n_blocks * r->kv->block_size)
            return blade_error_set(err, "sequence %d: positions %d..%d are not covered by its %d blocks", i, s->pos0,
                                   s->pos0 + s->n_tokens - 1, s->n_blocks);
        for (int32_t b = 0; b < s->n_blocks; b++)
            if (s->block_table[b] < 0 || s->block_table[b] >= r->kv->n_blocks)
                return blade_error_set(err, "sequence %d: block %d is outside the store (%d blocks)", i,
                                       s->block_table[b], r->kv->n_blocks);
        for (int32_t t = 0; t < s->n_tokens; t++)
            if (s->tokens[t] < 0 || s->tokens[t] >= hp->n_vocab)
                return blade_error_set(err, "sequence %d: token %d is outside the vocabulary", i, s->tokens[t]);
        if (s->n_logits < 0 || s->n_logits > s->n_tokens || (s->n_logits && !s->logits))
            return blade_error_set(err, "sequence %d: bad logits request", i);
        if (s->logit_rows)
            for (int32_t j = 0; j < s->n_logits; j++)
                if (s->logit_rows[j] < 0 || s->logit_rows[j] >= s->n_tokens)
                    return blade_error_set(err, "sequence %d: logit row %d is outside its %d tokens", i,
                                           s->logit_rows[j], s->n_tokens);
        total += s->n_tokens;
        logits += s->n_logits;
    }
    if (total > r->max_tokens)
        return blade_error_set(err, "batch of %lld tokens exceeds the runner's %d", (long long)total, r->max_tokens);
    *n_tokens = (int32_t)total;
    *n_logits = (int32_t)logits;
    return 0;
}

/* ---- the forward pass ---- */

/* The rows that want their final hidden state get it: the residual stream plus the last
 * block's pending output, normalised, each row on its own (so batch invariant), without
 * touching r->x, which the classifier still reads. */
static void write_hidden(blade_runner *r, const blade_batch_seq *seqs, int32_t n_seqs, const float *pending)
{
    const int64_t d = r->m->hp.n_embd;
    int64_t t = 0;
    for (int32_t i = 0; i < n_seqs; t += seqs[i].n_tokens, i++) {
        if (!seqs[i].hidden)
            continue;
        for (int32_t j = 0; j < seqs[i].n_tokens; j++) {
            float *out = seqs[i].hidden + (size_t)j * (size_t)d;
            const float *x = r->x + (t + j) * d;
            for (int64_t k = 0; k < d; k++)
                out[k] = pending ? x[k] + pending[(t + j) * d + k] : x[k];
            blade_rmsnorm(out, out, f32_vector(&r->m->output_norm), d, r->m->hp.rms_eps);
        }
    }
}

static int forward(blade_runner *r, const blade_batch_seq *seqs, int32_t n_seqs, blade_error *err)
{
    const blade_model *m = r->m;
    const blade_hparams *hp = &m->hp;
    step s = {.r = r, .seqs = seqs, .x_act = r->act};
    if (validate(r, seqs, n_seqs, &s.n_tokens, &s.n_logit_rows, err))
        return -1;
    if (s.n_tokens == 0)
        return 0;

    int32_t t = 0, lr = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        const blade_batch_seq *sq = &seqs[i];
        for (int32_t j = 0; j < sq->n_tokens; j++, t++)
            r->refs[t] = (token_ref){i, j, sq->pos0 + j};
        for (int32_t j = 0; j < sq->n_logits; j++)
            r->logit_tokens[lr++] = t - sq->n_tokens + (sq->logit_rows ? sq->logit_rows[j] : sq->n_tokens - 1);
        for (int32_t h = 0; h < hp->n_head_kv; h++)
            r->work[s.n_work++] = i * hp->n_head_kv + h;
    }

    blade_threadpool_run(r->pool, task_embed, &s);
    /* Each block's output waits in r->delta and joins the residual stream inside the next
     * normalisation, which reads that row anyway. */
    float *pending = NULL;
    for (int l = 0; l < hp->n_layer; l++) {
        const blade_layer *L = &m->layers[l];
        s.layer = l;

        const blade_weight *qkv[3] = {&L->wq, &L->wk, &L->wv};
        float *qkv_out[3] = {r->q, r->k, r->v};
        run_projections(&s, pending, &L->attn_norm, qkv, qkv_out, 3, blade_act_site(l, BLADE_ACT_ATTN_IN),
                        BLADE_STAGE_QKV);
        s.convert_heads = heads_convert(r, L, s.n_tokens);
        double t0 = stage_start(r);
        blade_threadpool_run(r->pool, task_attention, &s);
        stage_end(r, BLADE_STAGE_ATTENTION, t0);

        if (!s.convert_heads)
            run_norm_convert(&s, r->attn, NULL, r->q_dim, NULL, &L->wo, s.n_tokens, NULL,
                             blade_act_site(l, BLADE_ACT_ATTN_OUT));
        t0 = stage_start(r);
        run_matmul(&s, 1, &L->wo, r->delta, NULL, NULL, NULL, NULL);
        stage_end(r, BLADE_STAGE_O, t0);

        if (L->ffn_gate_up.data) {
            run_norm_convert(&s, r->x, r->delta, hp->n_embd, &L->ffn_norm, &L->ffn_gate_up, s.n_tokens, NULL,
                             blade_act_site(l, BLADE_ACT_FFN_IN));
            s.gate_up_span = gate_up_span(r, L, s.n_tokens);
            t0 = stage_start(r);
            run_on_row_units(&s, task_gate_up, hp->n_ff / BLADE_GATE_UP_GROUP / (s.gate_up_span ? s.gate_up_span : 1));
            stage_end(r, BLADE_STAGE_FFN_UP, t0);
        } else {
            const blade_weight *gu[2] = {&L->ffn_gate, &L->ffn_up};
            float *gu_out[2] = {r->ffn, r->up};
            run_projections(&s, r->delta, &L->ffn_norm, gu, gu_out, 2, blade_act_site(l, BLADE_ACT_FFN_IN),
                            BLADE_STAGE_FFN_UP);
            t0 = stage_start(r);
            blade_threadpool_run(r->pool, task_swiglu, &s);
            stage_end(r, BLADE_STAGE_FFN_UP, t0);
        }
        if (s.gate_up_span)
            s.x_act = r->act_ffn;
        else
            run_norm_convert(&s, r->ffn, NULL, hp->n_ff, NULL, &L->ffn_down, s.n_tokens, NULL,
                             blade_act_site(l, BLADE_ACT_FFN_ACT));
        t0 = stage_start(r);
        run_matmul(&s, 1, &L->ffn_down, r->delta, NULL, NULL, NULL, NULL);
        stage_end(r, BLADE_STAGE_FFN_DOWN, t0);
        s.x_act = r->act;
        s.gate_up_span = 0;
        pending = r->delta;
    }

    write_hidden(r, seqs, n_seqs, pending);
    if (s.n_logit_rows == 0)
        return 0;
    if (s.n_logit_rows > r->cap_logits) {
        float *grown = realloc(r->logits, (size_t)s.n_logit_rows * hp->n_vocab * sizeof(float));
        if (!grown)
            return blade_error_set(err, "out of memory for %d rows of logits", s.n_logit_rows);
        r->logits = grown;
        r->cap_logits = s.n_logit_rows;
    }
    /* only the rows that want logits take the last block's output: no other row is read again */
    run_norm_convert(&s, r->x, pending, hp->n_embd, &m->output_norm, &m->output, s.n_logit_rows, r->logit_tokens,
                     blade_act_classifier_site(hp->n_layer));
    run_matmul(&s, 1, &m->output, r->logits, NULL, NULL, NULL, NULL);
    lr = 0;
    for (int32_t i = 0; i < n_seqs; i++)
        for (int32_t j = 0; j < seqs[i].n_logits; j++, lr++)
            memcpy(seqs[i].logits + (size_t)j * hp->n_vocab, r->logits + (size_t)lr * hp->n_vocab,
                   (size_t)hp->n_vocab * sizeof(float));
    return 0;
}

int blade_runner_forward(blade_runner *r, const blade_batch_seq *seqs, int32_t n_seqs, blade_error *err)
{
    blade_stage_times *t = r->stage_times;
    if (!t)
        return forward(r, seqs, n_seqs, err);
    double t0 = blade_clock_seconds(), staged = stage_sum(t);
    int rc = forward(r, seqs, n_seqs, err);
    t->seconds[BLADE_STAGE_OTHER] += blade_clock_seconds() - t0 - (stage_sum(t) - staged);
    t->forwards++;
    return rc;
}

/* Importance matrices: the runner's activation statistics against the reference forward pass
 * and a direct computation, logits untouched by collecting them, `blade imatrix` round trips,
 * quantize --imatrix lowering the importance-weighted error (and recording it), and every
 * malformed or mismatched importance matrix refused with its own message. */

#include "testutil.h"

#include "blade/act_stats.h"
#include "blade/forward.h"
#include "blade/gguf.h"
#include "blade/imatrix.h"
#include "blade/model.h"
#include "blade/quantize.h"
#include "blade/runner.h"
#include "blade/synth.h"
#include "blade/types.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CTX 64
#define BLOCK 16

/* The corpus, tokenized with BOS first, as blade imatrix does. */
static int32_t *corpus_tokens(const blade_model *m, size_t *n)
{
    size_t len;
    char *text = read_shared("eval/stories-corpus.txt", &len);
    int32_t *tokens = NULL;
    blade_error err = {{0}};
    assert_int_equal(blade_tokenizer_encode(m->tokenizer, text, len, true, false, &tokens, n, &err), 0);
    free(text);
    return tokens;
}

/* Chunk c of the tokens with its first token replaced by BOS. */
static void chunk_of(const blade_model *m, const int32_t *tokens, int c, int32_t *out)
{
    memcpy(out, tokens + (size_t)c * CTX, CTX * sizeof *out);
    out[0] = blade_tokenizer_bos(m->tokenizer);
}

/* Runs n_chunks chunks through the runner in pieces of `piece` tokens, every row's logits
 * wanted (written to logits, [n_chunks][CTX][n_vocab], when given), statistics into s when
 * given. */
static void run_runner(blade_model *m, int threads, int piece, const int32_t *tokens, int n_chunks, blade_act_stats *s,
                       float *logits)
{
    blade_error err = {{0}};
    blade_kv_store_config cfg = blade_model_kv_config(&m->hp, BLADE_KV_F32, BLOCK, CTX / BLOCK);
    blade_kv_store *kv = blade_kv_store_new(&cfg, &err);
    blade_threadpool *pool = blade_threadpool_new(threads);
    blade_runner *r = blade_runner_new(m, kv, pool, CTX, &err);
    if (!r)
        fail_msg("%s", err.msg);
    assert_int_equal(blade_runner_set_act_stats(r, s, &err), 0);
    int32_t blocks[CTX / BLOCK], rows[CTX], chunk[CTX];
    for (int i = 0; i < CTX / BLOCK; i++)
        blocks[i] = i;
    for (int i = 0; i < CTX; i++)
        rows[i] = i;
    float *scratch = malloc((size_t)CTX * m->hp.n_vocab * sizeof *scratch);
    for (int c = 0; c < n_chunks; c++) {
        chunk_of(m, tokens, c, chunk);
        for (int pos = 0; pos < CTX; pos += piece) {
            int n = CTX - pos < piece ? CTX - pos : piece;
            float *out = logits ? logits + ((size_t)c * CTX + pos) * m->hp.n_vocab : scratch;
            blade_batch_seq seq = {.tokens = chunk + pos, .n_tokens = n, .pos0 = pos, .block_table = blocks,
                                   .n_blocks = (pos + n + BLOCK - 1) / BLOCK, .logit_rows = rows, .n_logits = n,
                                   .logits = out};
            if (blade_runner_forward(r, &seq, 1, &err))
                fail_msg("%s", err.msg);
        }
    }
    free(scratch);
    blade_runner_free(r);
    blade_threadpool_free(pool);
    blade_kv_store_free(kv);
}

/* The same chunks through the reference forward pass: positions 0 .. n_run-1 of each,
 * logits computed from position first_logit on. */
static void run_reference(blade_model *m, const int32_t *tokens, int n_chunks, int n_run, int first_logit,
                          blade_act_stats *s)
{
    blade_error err = {{0}};
    blade_forward *fw = blade_forward_new(m, CTX, &err);
    assert_non_null(fw);
    assert_int_equal(blade_forward_set_act_stats(fw, s, &err), 0);
    int32_t chunk[CTX];
    for (int c = 0; c < n_chunks; c++) {
        chunk_of(m, tokens, c, chunk);
        for (int pos = 0; pos < n_run; pos++)
            assert_int_equal(blade_forward_token(fw, chunk[pos], pos, pos >= first_logit, &err), 0);
    }
    blade_forward_free(fw);
}

/* Largest difference of two sites' sums, relative to the largest sum of the site. */
static double site_difference(blade_act_site_stats a, blade_act_site_stats b)
{
    double worst = 0, scale = 0;
    for (int64_t j = 0; j < a.width; j++)
        scale = fmax(scale, fabs(b.sum_sq[j]));
    for (int64_t j = 0; j < a.width; j++)
        worst = fmax(worst, fabs(a.sum_sq[j] - b.sum_sq[j]) / scale);
    return worst;
}

/* ---- statistics ---- */

/* Every site's sums agree with the reference forward pass's, every row counted once, and the
 * first layer's attention input agrees with RMSNorm of the embeddings computed here. */
static void test_stats_match_reference(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    size_t n_tokens;
    int32_t *tokens = corpus_tokens(m, &n_tokens);
    blade_error err = {{0}};
    blade_act_stats *run = blade_act_stats_new(&m->hp, &err), *ref = blade_act_stats_new(&m->hp, &err);
    run_runner(m, 2, CTX, tokens, 2, run, NULL);
    run_reference(m, tokens, 2, CTX, 0, ref);
    double worst = 0;
    for (int site = 0; site < blade_act_stats_n_sites(run); site++) {
        blade_act_site_stats a = blade_act_stats_get(run, site), b = blade_act_stats_get(ref, site);
        assert_int_equal(a.width, b.width);
        assert_int_equal(a.rows, 2 * CTX);
        assert_int_equal(b.rows, 2 * CTX);
        worst = fmax(worst, site_difference(a, b));
    }
    print_message("runner vs reference statistics: largest difference %.3g of the site's largest sum\n", worst);
    assert_true(worst < 1e-5);

    /* layer 0's q/k/v input, directly: rmsnorm(embedding) * attn_norm, in double */
    int64_t d = m->hp.n_embd;
    double *direct = calloc((size_t)d, sizeof *direct);
    const float *emb = m->tok_embd.data, *norm = m->layers[0].attn_norm.data;
    int32_t chunk[CTX];
    for (int c = 0; c < 2; c++) {
        chunk_of(m, tokens, c, chunk);
        for (int t = 0; t < CTX; t++) {
            const float *x = emb + (size_t)chunk[t] * d;
            double ss = 0;
            for (int64_t j = 0; j < d; j++)
                ss += (double)x[j] * x[j];
            double scale = 1.0 / sqrt(ss / (double)d + m->hp.rms_eps);
            for (int64_t j = 0; j < d; j++) {
                double y = x[j] * scale * norm[j];
                direct[j] += y * y;
            }
        }
    }
    blade_act_site_stats a = blade_act_stats_get(run, blade_act_site(0, BLADE_ACT_ATTN_IN));
    for (int64_t j = 0; j < d; j++)
        assert_true(fabs(a.sum_sq[j] - direct[j]) <= 1e-6 * direct[j]);
    free(direct);
    blade_act_stats_free(run);
    blade_act_stats_free(ref);
    free(tokens);
    blade_model_free(m);
}

/* The sums do not depend on how a chunk is cut into batches or on the thread count: every
 * column adds its rows in order. */
static void test_stats_batch_invariant(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    size_t n_tokens;
    int32_t *tokens = corpus_tokens(m, &n_tokens);
    blade_error err = {{0}};
    blade_act_stats *whole = blade_act_stats_new(&m->hp, &err), *pieces = blade_act_stats_new(&m->hp, &err);
    run_runner(m, 1, CTX, tokens, 2, whole, NULL);
    run_runner(m, 3, 7, tokens, 2, pieces, NULL);
    for (int site = 0; site < blade_act_stats_n_sites(whole); site++) {
        blade_act_site_stats a = blade_act_stats_get(whole, site), b = blade_act_stats_get(pieces, site);
        assert_int_equal(a.rows, b.rows);
        assert_memory_equal(a.sum_sq, b.sum_sq, (size_t)a.width * sizeof *a.sum_sq);
    }
    blade_act_stats_free(whole);
    blade_act_stats_free(pieces);
    free(tokens);
    blade_model_free(m);
}

/* A random-weight llama with 256-wide rows (so every type's blocks fit) and the stories
 * vocabulary. */
static char *synth_model(const char *name, uint32_t type, uint32_t sensitive, bool tied)
{
    char *path = temp_path(name);
    char *vocab = require_shared("models/stories260K.gguf");
    blade_synth_spec spec = {
        .arch = BLADE_ARCH_LLAMA, .n_vocab = 512, .n_embd = 256, .n_layer = 2, .n_head = 8, .n_head_kv = 4,
        .head_dim = 32, .n_ff = 512, .n_ctx = 256, .rope_base = 10000.0f, .tied_embeddings = tied,
        .scheme = {.type = type, .classifier_type = sensitive, .sensitive_type = sensitive}, .seed = 7, .vocab_path = vocab,
    };
    blade_error err = {{0}};
    if (blade_synth_write(&spec, path, false, &err))
        fail_msg("%s", err.msg);
    free(vocab);
    return path;
}

/* A model whose attn_v and ffn_down are Q8_0 among Q4_K matrices: Q, K and V read two
 * activation forms, so the attention input is converted twice and must be counted once. */
static char *mixed_model(void)
{
    return synth_model("imatrix-mixed.gguf", BLADE_TYPE_Q4_K, BLADE_TYPE_Q8_0, false);
}

/* Collecting statistics changes no bit of the logits, on f32 weights and on quantized ones
 * whose projections read different activation forms. */
static void test_logits_unchanged(void **state)
{
    (void)state;
    char *mixed = mixed_model();
    blade_model *models[2] = {load_stories(), load_model(mixed)};
    for (int k = 0; k < 2; k++) {
        blade_model *m = models[k];
        size_t n_tokens;
        int32_t *tokens = corpus_tokens(m, &n_tokens);
        size_t n = (size_t)2 * CTX * m->hp.n_vocab;
        float *off = malloc(n * sizeof *off), *on = malloc(n * sizeof *on);
        blade_error err = {{0}};
        blade_act_stats *s = blade_act_stats_new(&m->hp, &err);
        run_runner(m, 2, 24, tokens, 2, NULL, off);
        run_runner(m, 2, 24, tokens, 2, s, on);
        assert_memory_equal(off, on, n * sizeof *off);
        for (int site = 0; site < blade_act_stats_n_sites(s); site++)
            assert_int_equal(blade_act_stats_get(s, site).rows, 2 * CTX);
        blade_act_stats_free(s);
        free(off);
        free(on);
        free(tokens);
        blade_model_free(m);
    }
    unlink(mixed);
    free(mixed);
}

/* Statistics of another shape are refused by the runner and the reference pass alike. */
static void test_stats_shape_refused(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    blade_hparams other = m->hp;
    other.n_ff += 32;
    blade_error err = {{0}};
    blade_act_stats *s = blade_act_stats_new(&other, &err);
    blade_kv_store_config cfg = blade_model_kv_config(&m->hp, BLADE_KV_F32, BLOCK, 4);
    blade_kv_store *kv = blade_kv_store_new(&cfg, &err);
    blade_threadpool *pool = blade_threadpool_new(1);
    blade_runner *r = blade_runner_new(m, kv, pool, 16, &err);
    assert_int_equal(blade_runner_set_act_stats(r, s, &err), -1);
    assert_non_null(strstr(err.msg, "another shape"));
    blade_forward *fw = blade_forward_new(m, 16, &err);
    assert_int_equal(blade_forward_set_act_stats(fw, s, &err), -1);
    blade_forward_free(fw);
    blade_runner_free(r);
    blade_threadpool_free(pool);
    blade_kv_store_free(kv);
    blade_act_stats_free(s);
    blade_model_free(m);
}

/* ---- blade imatrix ---- */

static blade_imatrix *collect(blade_model *m, int32_t chunks, const char *dataset)
{
    size_t len;
    char *text = read_shared("eval/stories-corpus.txt", &len);
    blade_imatrix_params p = {.text = text, .text_len = len, .dataset = dataset, .ctx = CTX, .max_chunks = chunks,
                              .n_threads = 2};
    blade_error err = {{0}};
    blade_imatrix_report rep;
    blade_imatrix *im = blade_imatrix_collect(m, &p, &rep, &err);
    if (!im)
        fail_msg("%s", err.msg);
    assert_int_equal(rep.chunks, chunks);
    free(text);
    return im;
}

static const char *const stories_matrices[] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                               "ffn_down"};

/* `blade imatrix` on 2 chunks writes what the library collects, bit for bit; loading it back
 * gives every field; each entry is the reference forward pass's mean square of its input over
 * the positions the perplexity method runs (0 .. CTX-2), the classifier's over those it
 * scores (CTX/2 .. CTX-2). */
static void test_round_trip(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf"), *corpus = require_shared("eval/stories-corpus.txt");
    char *path = temp_path("stories-2.imatrix.gguf");
    char args[2048], *out = NULL;
    snprintf(args, sizeof args, "imatrix -m '%s' -f '%s' -o '%s' -c %d --chunks 2 -t 2", model, corpus, path, CTX);
    int rc = run_blade(args, &out, 1);
    if (rc != 0)
        fail_msg("blade %s failed (%d): %s", args, rc, out);
    assert_non_null(strstr(out, "2 chunks of 64 used (128 tokens)"));
    assert_non_null(strstr(out, "36 weight matrices"));
    free(out);

    blade_error err = {{0}};
    blade_imatrix *loaded = blade_imatrix_load(path, &err);
    if (!loaded)
        fail_msg("%s", err.msg);
    blade_model *m = load_stories();
    blade_imatrix *made = collect(m, 2, corpus);
    blade_model_identity id;
    assert_int_equal(blade_model_identity_of(m->file, &id, &err), 0);
    assert_string_equal(loaded->model.fingerprint, id.fingerprint);
    assert_string_equal(loaded->model.arch, "llama");
    assert_int_equal(loaded->model.n_tensors, 48);
    assert_string_equal(loaded->dataset, corpus);
    assert_int_equal(loaded->chunks, 2);
    assert_int_equal(loaded->chunk_size, CTX);
    assert_int_equal(loaded->n_entries, 5 * 7 + 1);
    assert_int_equal(made->n_entries, loaded->n_entries);

    size_t n_tokens;
    int32_t *tokens = corpus_tokens(m, &n_tokens);
    blade_act_stats *ref = blade_act_stats_new(&m->hp, &err);
    run_reference(m, tokens, 2, CTX - 1, CTX / 2, ref);
    for (size_t i = 0; i < loaded->n_entries; i++) {
        const blade_imatrix_entry *a = &loaded->entries[i], *b = &made->entries[i];
        assert_string_equal(a->name, b->name);
        assert_int_equal(a->n_cols, b->n_cols);
        assert_int_equal(a->rows[0], b->rows[0]);
        assert_int_equal(a->rows[0], strcmp(a->name, "output.weight") ? 2 * (CTX - 1) : 2 * (CTX / 2 - 1));
        assert_memory_equal(a->mean_sq, b->mean_sq, (size_t)a->n_cols * sizeof *a->mean_sq);
        /* which site this entry's matrix reads */
        int site = blade_act_classifier_site(m->hp.n_layer);
        int layer;
        char kind[32];
        if (sscanf(a->name, "blk.%d.%31[a-z_].weight", &layer, kind) == 2) {
            static const blade_act_input input_of[] = {BLADE_ACT_ATTN_IN, BLADE_ACT_ATTN_IN, BLADE_ACT_ATTN_IN,
                                                        BLADE_ACT_ATTN_OUT, BLADE_ACT_FFN_IN, BLADE_ACT_FFN_IN,
                                                        BLADE_ACT_FFN_ACT};
            site = -1;
            for (int k = 0; k < 7; k++)
                if (!strcmp(kind, stories_matrices[k]))
                    site = blade_act_site(layer, input_of[k]);
            assert_true(site >= 0);
        } else {
            assert_string_equal(a->name, "output.weight");
        }
        blade_act_site_stats st = blade_act_stats_get(ref, site);
        assert_int_equal(st.width, a->n_cols);
        for (int64_t j = 0; j < a->n_cols; j++) {
            double want = st.sum_sq[j] / (double)st.rows;
            assert_true(fabs(a->mean_sq[j] - want) <= 1e-5 * want + 1e-12);
        }
    }
    blade_act_stats_free(ref);
    free(tokens);
    blade_model_identity_free(&id);
    blade_imatrix_free(made);
    blade_imatrix_free(loaded);
    blade_model_free(m);
    unlink(path);
    free(path);
    free(model);
    free(corpus);
}

/* The command's own refusals: a text shorter than one chunk, and an output that is the model. */
static void test_cli_refusals(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf");
    char *text = temp_path("short.txt"), *copy = temp_path("imatrix-model-copy.gguf");
    assert_int_equal(write_file(text, "Once upon a time.", 17), 0);
    char args[2048], *out = NULL;
    snprintf(args, sizeof args, "imatrix -m '%s' -f '%s' -o /dev/null -c 64", model, text);
    assert_int_equal(run_blade(args, &out, 1), 1);
    assert_non_null(strstr(out, "tokens, fewer than one chunk of 64"));
    free(out);
    size_t len;
    char *bytes = read_file(model, &len);
    assert_int_equal(write_file(copy, bytes, len), 0);
    snprintf(args, sizeof args, "imatrix -m '%s' -f '%s' -o '%s'", copy, text, copy);
    assert_int_equal(run_blade(args, &out, 1), 2);
    assert_non_null(strstr(out, "is an input file: writing over it is refused"));
    free(out);
    char *after = read_file(copy, &len);
    assert_memory_equal(after, bytes, len);
    free(after);
    free(bytes);
    unlink(text);
    unlink(copy);
    free(text);
    free(copy);
    free(model);
}

/* A cancel request (what Ctrl-C sets) stops collection with "interrupted". */
static void test_cancel(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    size_t len;
    char *text = read_shared("eval/stories-corpus.txt", &len);
    volatile sig_atomic_t cancel = 1;
    blade_imatrix_params p = {.text = text, .text_len = len, .dataset = "corpus", .ctx = CTX, .n_threads = 1,
                              .cancel = &cancel};
    blade_error err = {{0}};
    assert_null(blade_imatrix_collect(m, &p, NULL, &err));
    assert_string_equal(err.msg, "interrupted");
    free(text);
    blade_model_free(m);
}

/* ---- quantize --imatrix ---- */

/* F32 weights; tied embeddings, so the classifier's importance goes under token_embd.weight. */
static char *wide_model(void)
{
    return synth_model("imatrix-wide-f32.gguf", BLADE_TYPE_F32, 0, true);
}

static int quantize_cli(const char *in, const char *out_path, const char *type, const char *extra, char **out)
{
    char args[2048];
    snprintf(args, sizeof args, "quantize '%s' '%s' --type %s %s", in, out_path, type, extra);
    return run_blade(args, out, 1);
}

/* Sum over a tensor's rows of the importance-weighted error of its quantization. */
static double tensor_error(const gguf_tensor *src, const gguf_tensor *q, const float *importance)
{
    int64_t row = src->ne[0], n = (int64_t)src->n_elements;
    float *y = malloc((size_t)n * sizeof *y);
    blade_type_traits_get(q->type)->to_float(q->data, y, n);
    double e = 0;
    for (int64_t r = 0; r < n / row; r++)
        e += blade_quant_weighted_error(q->type, (const float *)src->data + r * row, y + r * row, row, importance);
    free(y);
    return e;
}

/* The output error a matrix's rounding causes, to first order: each value's squared error
 * times the mean square of the activation it multiplies, whatever weighting the type's
 * search uses. */
static double output_error(const gguf_tensor *src, const gguf_tensor *q, const float *importance)
{
    int64_t row = src->ne[0], n = (int64_t)src->n_elements;
    float *y = malloc((size_t)n * sizeof *y);
    blade_type_traits_get(q->type)->to_float(q->data, y, n);
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)((const float *)src->data)[i] - y[i];
        e += importance[i % row] * d * d;
    }
    free(y);
    return e;
}

/* On every type the importance-weighted error with the imatrix is lower than without, over
 * the model and on every matrix, and so is the output error, by more than 3% over the model
 * (Q4_K and Q5_K weighted by importance x sqrt(sigma2 + x^2) managed 2.1% and 2.2%);
 * the file records the importance matrix it used. */
static void test_quantize_lowers_weighted_error(void **state)
{
    (void)state;
    char *model = wide_model(), *imx_path = temp_path("wide.imatrix.gguf");
    blade_model *m = load_model(model);
    blade_imatrix *im = collect(m, 2, "stories-corpus.txt");
    blade_model_free(m);
    assert_non_null(blade_imatrix_find(im, "token_embd.weight"));
    assert_null(blade_imatrix_find(im, "output.weight"));
    blade_error err = {{0}};
    assert_int_equal(blade_imatrix_save(im, imx_path, &err), 0);

    static const char *const types[] = {"Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"};
    char *with = temp_path("wide-with.gguf"), *without = temp_path("wide-without.gguf");
    gguf_file *src = gguf_open(model, &err);
    assert_non_null(src);
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        char extra[1024], *out = NULL;
        snprintf(extra, sizeof extra, "--imatrix '%s'", imx_path);
        if (quantize_cli(model, with, types[k], extra, &out) != 0)
            fail_msg("quantize --imatrix failed: %s", out);
        assert_non_null(strstr(out, "importance  15 of 15 quantized matrices weighted by"));
        assert_null(strstr(out, "warning"));
        free(out);
        assert_int_equal(quantize_cli(model, without, types[k], "", &out), 0);
        free(out);
        gguf_file *a = gguf_open(with, &err), *b = gguf_open(without, &err);
        assert_true(a && b);
        double total_with = 0, total_without = 0, out_with = 0, out_without = 0;
        for (size_t i = 0; i < im->n_entries; i++) {
            const blade_imatrix_entry *e = &im->entries[i];
            const gguf_tensor *x = gguf_find_tensor(src, e->name), *qa = gguf_find_tensor(a, e->name),
                              *qb = gguf_find_tensor(b, e->name);
            double ea = tensor_error(x, qa, e->mean_sq), eb = tensor_error(x, qb, e->mean_sq);
            assert_true(ea < eb);
            total_with += ea;
            total_without += eb;
            out_with += output_error(x, qa, e->mean_sq);
            out_without += output_error(x, qb, e->mean_sq);
        }
        print_message("%-5s importance-weighted error: %.6g without the imatrix, %.6g with (%.3f); output error "
                      "%.3f\n", types[k], total_without, total_with, total_with / total_without,
                      out_with / out_without);
        assert_true(out_with < 0.97 * out_without);
        char *file = NULL;
        bool present = false;
        file = gguf_get_string(a, "quantize.imatrix.file", &present, &err);
        assert_string_equal(file, imx_path);
        free(file);
        char *dataset = gguf_get_string(a, "quantize.imatrix.dataset", &present, &err);
        assert_string_equal(dataset, "stories-corpus.txt");
        free(dataset);
        uint32_t v = 0;
        assert_true(gguf_get_u32(a, "quantize.imatrix.chunks_count", &v, &present, &err));
        assert_int_equal(v, 2);
        assert_true(gguf_get_u32(a, "quantize.imatrix.entries_count", &v, &present, &err));
        assert_int_equal(v, im->n_entries);
        assert_null(gguf_find_kv(b, "quantize.imatrix.file"));
        gguf_close(a);
        gguf_close(b);
    }
    /* Re-quantizing a file made with an imatrix, without one, drops the keys it carried. */
    char *out = NULL;
    assert_int_equal(quantize_cli(with, without, "Q8_0", "", &out), 0);
    free(out);
    gguf_file *re = gguf_open(without, &err);
    assert_non_null(re);
    assert_null(gguf_find_kv(re, "quantize.imatrix.file"));
    assert_null(gguf_find_kv(re, "quantize.imatrix.chunks_count"));
    gguf_close(re);
    gguf_close(src);
    blade_imatrix_free(im);
    unlink(with);
    unlink(without);
    unlink(imx_path);
    unlink(model);
    free(with);
    free(without);
    free(imx_path);
    free(model);
}

/* An importance matrix lacking some matrices: a warning names them, they get the default
 * weighting (the bytes of a run without an imatrix), the rest are weighted. */
static void test_missing_entries_warn(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    blade_imatrix *im = collect(m, 1, "corpus");
    blade_model_free(m);
    /* drop blk.1.attn_q.weight and blk.1.attn_k.weight */
    size_t kept = 0;
    for (size_t i = 0; i < im->n_entries; i++) {
        blade_imatrix_entry *e = &im->entries[i];
        if (!strcmp(e->name, "blk.1.attn_q.weight") || !strcmp(e->name, "blk.1.attn_k.weight")) {
            free(e->name);
            free(e->mean_sq);
            free(e->rows);
            continue;
        }
        im->entries[kept++] = *e;
    }
    im->n_entries = kept;
    char *imx = temp_path("missing.imatrix.gguf"), *with = temp_path("missing-with.gguf"),
         *without = temp_path("missing-without.gguf"), *model = require_shared("models/stories260K.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_imatrix_save(im, imx, &err), 0);
    char extra[1024], *out = NULL;
    snprintf(extra, sizeof extra, "--imatrix '%s'", imx);
    assert_int_equal(quantize_cli(model, with, "Q4_0", extra, &out), 0);
    char want[1024];
    snprintf(want, sizeof want, "warning: %s has no importance for blk.1.attn_q.weight blk.1.attn_k.weight: they are "
             "quantized with the default weighting", imx);
    if (!strstr(out, want))
        fail_msg("no warning '%s' in:\n%s", want, out);
    if (!strstr(out, "importance  29 of 31 quantized matrices"))
        fail_msg("%s", out);
    free(out);
    assert_int_equal(quantize_cli(model, without, "Q4_0", "", &out), 0);
    free(out);
    gguf_file *a = gguf_open(with, &err), *b = gguf_open(without, &err);
    assert_true(a && b);
    for (uint64_t i = 0; i < a->n_tensors; i++) {
        const gguf_tensor *ta = &a->tensors[i], *tb = gguf_find_tensor(b, ta->name);
        /* the classifier is Q8_0: Q4_0's Q6_K does not fit its 64-wide rows */
        bool quantized = ta->type == BLADE_TYPE_Q4_0 || ta->type == BLADE_TYPE_Q8_0;
        bool weighted = quantized && blade_imatrix_find(im, ta->name);
        assert_int_equal(memcmp(ta->data, tb->data, ta->nbytes) != 0, weighted);
    }
    gguf_close(a);
    gguf_close(b);
    blade_imatrix_free(im);
    unlink(imx);
    unlink(with);
    unlink(without);
    free(imx);
    free(with);
    free(without);
    free(model);
}

/* An importance matrix of another model: refused, naming the difference, no output written. */
static void test_other_model_refused(void **state)
{
    (void)state;
    blade_model *m = load_stories();
    blade_imatrix *im = collect(m, 1, "corpus");
    blade_model_free(m);
    char *imx = temp_path("stories.imatrix.gguf"), *out_path = temp_path("other-out.gguf");
    char *tiny = require_shared("quant/tiny256-f32.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_imatrix_save(im, imx, &err), 0);
    char extra[1024], *out = NULL;
    snprintf(extra, sizeof extra, "--imatrix '%s'", imx);
    assert_int_equal(quantize_cli(tiny, out_path, "Q4_0", extra, &out), 1);
    char want[1024];
    snprintf(want, sizeof want, "error: %s: the importance matrix was made for another model: its "
             "blk.0.attn_k.weight is [64, 32], %s's is [256, 128]", imx, tiny);
    if (!strstr(out, want))
        fail_msg("no '%s' in:\n%s", want, out);
    free(out);
    assert_int_equal(access(out_path, F_OK), -1);

    /* a tensor one model has and the other lacks; another architecture */
    free(im->model.tensor_names[0]);
    im->model.tensor_names[0] = strdup("a_tensor.weight");
    gguf_file *f = NULL;
    char *model = require_shared("models/stories260K.gguf");
    assert_non_null(f = gguf_open(model, &err));
    assert_int_equal(blade_imatrix_check_model(im, f, "MODEL", &err), -1);
    assert_string_equal(err.msg, "the importance matrix was made for another model: that model has tensor "
                                 "a_tensor.weight [64, 32], MODEL has none");
    free(im->model.arch);
    im->model.arch = strdup("qwen2");
    assert_int_equal(blade_imatrix_check_model(im, f, "MODEL", &err), -1);
    assert_string_equal(err.msg, "the importance matrix was made for a qwen2 model; MODEL is a llama model");
    gguf_close(f);
    blade_imatrix_free(im);
    unlink(imx);
    free(imx);
    free(out_path);
    free(tiny);
    free(model);
}

/* ---- malformed importance matrices ---- */

static blade_imatrix *valid_imatrix(void)
{
    blade_model *m = load_stories();
    blade_imatrix *im = collect(m, 1, "corpus");
    blade_model_free(m);
    return im;
}

/* Saves im (blade_imatrix_save does not check what it writes) and expects loading to fail
 * with a message containing want. */
static void expect_refused(const blade_imatrix *im, const char *want)
{
    char *path = temp_path("malformed.imatrix.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_imatrix_save(im, path, &err), 0);
    blade_imatrix *back = blade_imatrix_load(path, &err);
    assert_null(back);
    if (!strstr(err.msg, want))
        fail_msg("expected '%s' in '%s'", want, err.msg);
    assert_non_null(strstr(err.msg, path));
    unlink(path);
    free(path);
}

/* A copy of a valid file through the writer, with its metadata changed by `edit` and its
 * tensors by `tensor` (which may rename or drop one: returning NULL), then loaded. */
typedef void (*kv_edit)(gguf_writer *w);
typedef const char *(*tensor_edit)(const char *name, char *buf, size_t cap);

static void expect_copy_refused(kv_edit edit, tensor_edit tensor, const char *want)
{
    blade_imatrix *im = valid_imatrix();
    char *valid = temp_path("valid.imatrix.gguf"), *path = temp_path("edited.imatrix.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_imatrix_save(im, valid, &err), 0);
    blade_imatrix_free(im);
    gguf_file *f = gguf_open(valid, &err);
    assert_non_null(f);
    gguf_writer *w = gguf_writer_new();
    gguf_writer_copy_kv(w, f);
    if (edit)
        edit(w);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        char buf[256];
        const char *name = tensor ? tensor(t->name, buf, sizeof buf) : t->name;
        if (name)
            assert_int_equal(gguf_writer_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data, t->nbytes, &err), 0);
    }
    assert_int_equal(gguf_writer_write(w, path, false, &err), 0);
    gguf_writer_free(w);
    gguf_close(f);
    assert_null(blade_imatrix_load(path, &err));
    if (!strstr(err.msg, want))
        fail_msg("expected '%s' in '%s'", want, err.msg);
    unlink(valid);
    unlink(path);
    free(valid);
    free(path);
}

/* Overwrites bytes of a valid file, or cuts it short, and expects the load to fail. */
static void expect_bytes_refused(size_t at, const char *bytes, size_t keep, const char *want)
{
    blade_imatrix *im = valid_imatrix();
    char *path = temp_path("bytes.imatrix.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_imatrix_save(im, path, &err), 0);
    blade_imatrix_free(im);
    size_t len;
    char *data = read_file(path, &len);
    if (bytes)
        memcpy(data + at, bytes, strlen(bytes));
    assert_int_equal(write_file(path, data, keep ? keep : len), 0);
    assert_null(blade_imatrix_load(path, &err));
    if (!strstr(err.msg, want))
        fail_msg("expected '%s' in '%s'", want, err.msg);
    free(data);
    unlink(path);
    free(path);
}

static void test_bad_magic(void **state)
{
    (void)state;
    expect_bytes_refused(0, "GGUX", 0, "magic");
}

static void test_truncated(void **state)
{
    (void)state;
    expect_bytes_refused(0, NULL, 9000, "data [offset 1728, +688 bytes] extends past end of file (size 9000");
}

static void test_wrong_column_count(void **state)
{
    (void)state;
    blade_imatrix *im = valid_imatrix();
    im->entries[3].n_cols = 32; /* blk.0.attn_output.weight reads 64 */
    expect_refused(im, "tensor blk.0.attn_output.weight.mean_sq has 32 columns; blk.0.attn_output.weight has 64");
    blade_imatrix_free(im);
}

static void test_nan_value(void **state)
{
    (void)state;
    blade_imatrix *im = valid_imatrix();
    im->entries[0].mean_sq[5] = NAN;
    expect_refused(im, "tensor blk.0.attn_q.weight.mean_sq column 5 is nan; mean squares are finite and not negative");
    blade_imatrix_free(im);
}

static void test_negative_value(void **state)
{
    (void)state;
    blade_imatrix *im = valid_imatrix();
    im->entries[6].mean_sq[7] = -0.5f;
    expect_refused(im, "tensor blk.0.ffn_down.weight.mean_sq column 7 is -0.5; mean squares are finite and not "
                       "negative");
    blade_imatrix_free(im);
}

static void test_zero_rows(void **state)
{
    (void)state;
    blade_imatrix *im = valid_imatrix();
    im->entries[1].rows[0] = 0;
    expect_refused(im, "tensor blk.0.attn_k.weight.rows: slice 0 averages 0 rows; a mean needs at least one");
    blade_imatrix_free(im);
}

static void test_unknown_tensor_entry(void **state)
{
    (void)state;
    blade_imatrix *im = valid_imatrix();
    free(im->entries[2].name);
    im->entries[2].name = strdup("blk.7.attn_v.weight");
    expect_refused(im, "tensor blk.7.attn_v.weight.mean_sq is the importance of blk.7.attn_v.weight, which the "
                       "recorded model does not have");
    blade_imatrix_free(im);
}

static void test_no_entries(void **state)
{
    (void)state;
    blade_imatrix *im = valid_imatrix();
    size_t n = im->n_entries;
    im->n_entries = 0;
    expect_refused(im, "no importance entries");
    im->n_entries = n;
    blade_imatrix_free(im);
}

static void test_fingerprint_mismatch(void **state)
{
    (void)state;
    blade_imatrix *im = valid_imatrix();
    im->model.tensor_ne[0][0] += 1; /* the table edited, the fingerprint not */
    expect_refused(im, "imatrix.model.fingerprint does not match the tensor table the file records");
    blade_imatrix_free(im);
}

static void set_type_model(gguf_writer *w)
{
    gguf_writer_set_string(w, "general.type", "model");
}

static void test_wrong_type(void **state)
{
    (void)state;
    expect_copy_refused(set_type_model, NULL, "general.type is 'model', not 'imatrix': not an importance matrix");
}

static void test_model_given(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf");
    blade_error err = {{0}};
    assert_null(blade_imatrix_load(model, &err));
    assert_non_null(strstr(err.msg, "this is a model (general.architecture is set), not an importance matrix"));
    free(model);
}

static void set_version_2(gguf_writer *w)
{
    gguf_writer_set_u32(w, "imatrix.format_version", 2);
}

static void test_unknown_version(void **state)
{
    (void)state;
    expect_copy_refused(set_version_2, NULL, "imatrix.format_version is 2; this blade reads version 1");
}

static void drop_dataset(gguf_writer *w)
{
    gguf_writer_remove_kv(w, "imatrix.dataset");
}

static void test_missing_key(void **state)
{
    (void)state;
    expect_copy_refused(drop_dataset, NULL, "missing metadata key imatrix.dataset");
}

static void fingerprint_as_number(gguf_writer *w)
{
    gguf_writer_set_u32(w, "imatrix.model.fingerprint", 7);
}

static void test_key_of_wrong_type(void **state)
{
    (void)state;
    expect_copy_refused(fingerprint_as_number, NULL, "imatrix.model.fingerprint");
}

/* llama.cpp's layout: NAME.in_sum2 / NAME.counts tensors, no format version. */
static void drop_version(gguf_writer *w)
{
    gguf_writer_remove_kv(w, "imatrix.format_version");
}

static const char *llama_cpp_names(const char *name, char *buf, size_t cap)
{
    size_t len = strlen(name);
    if (len > 8 && !strcmp(name + len - 8, ".mean_sq"))
        snprintf(buf, cap, "%.*s.in_sum2", (int)(len - 8), name);
    else
        snprintf(buf, cap, "%.*s.counts", (int)(len - 5), name);
    return buf;
}

static void test_llama_cpp_layout(void **state)
{
    (void)state;
    expect_copy_refused(drop_version, llama_cpp_names, "an importance matrix in llama.cpp's layout (*.in_sum2 tensors)");
}

static const char *drop_first_rows(const char *name, char *buf, size_t cap)
{
    (void)buf;
    (void)cap;
    return strcmp(name, "blk.0.attn_q.weight.rows") ? name : NULL;
}

static void test_rows_missing(void **state)
{
    (void)state;
    expect_copy_refused(NULL, drop_first_rows, "tensor blk.0.attn_q.weight.mean_sq has no blk.0.attn_q.weight.rows "
                                               "beside it");
}

static const char *drop_first_mean_sq(const char *name, char *buf, size_t cap)
{
    (void)buf;
    (void)cap;
    return strcmp(name, "blk.0.attn_q.weight.mean_sq") ? name : NULL;
}

static void test_mean_sq_missing(void **state)
{
    (void)state;
    expect_copy_refused(NULL, drop_first_mean_sq, "tensor blk.0.attn_q.weight.rows has no mean squares beside it");
}

static const char *stray_name(const char *name, char *buf, size_t cap)
{
    if (strcmp(name, "blk.0.attn_q.weight.mean_sq"))
        return name;
    snprintf(buf, cap, "blk.0.attn_q.weight");
    return buf;
}

static void test_unexpected_tensor(void **state)
{
    (void)state;
    expect_copy_refused(NULL, stray_name, "unexpected tensor blk.0.attn_q.weight: an importance matrix holds "
                                          "NAME.mean_sq and NAME.rows tensors");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stats_match_reference),
        cmocka_unit_test(test_stats_batch_invariant),
        cmocka_unit_test(test_logits_unchanged),
        cmocka_unit_test(test_stats_shape_refused),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_cli_refusals),
        cmocka_unit_test(test_cancel),
        cmocka_unit_test(test_quantize_lowers_weighted_error),
        cmocka_unit_test(test_missing_entries_warn),
        cmocka_unit_test(test_other_model_refused),
        cmocka_unit_test(test_bad_magic),
        cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_wrong_column_count),
        cmocka_unit_test(test_nan_value),
        cmocka_unit_test(test_negative_value),
        cmocka_unit_test(test_zero_rows),
        cmocka_unit_test(test_unknown_tensor_entry),
        cmocka_unit_test(test_no_entries),
        cmocka_unit_test(test_fingerprint_mismatch),
        cmocka_unit_test(test_wrong_type),
        cmocka_unit_test(test_model_given),
        cmocka_unit_test(test_unknown_version),
        cmocka_unit_test(test_missing_key),
        cmocka_unit_test(test_key_of_wrong_type),
        cmocka_unit_test(test_llama_cpp_layout),
        cmocka_unit_test(test_rows_missing),
        cmocka_unit_test(test_mean_sq_missing),
        cmocka_unit_test(test_unexpected_tensor),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* End-to-end model tests: the reference greedy continuation, llama2.c conversion (the
 * perplexity figures are test_eval's), every quantized tiny256 model against its f32
 * original, the qwen2/qwen3 paths, and refusal of broken or unknown models and of files whose
 * tensors the architecture does not expect. */
#include "testutil.h"

#include "blade/convert.h"
#include "blade/forward.h"
#include "blade/gguf.h"
#include "blade/kernels.h"
#include "blade/model.h"
#include "blade/sampler.h"
#include "blade/synth.h"
#include "blade/tokenizer.h"
#include "blade/types.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Greedy-decodes from BOS + prompt for `steps` forward passes (prompt included), as
 * llama2.c's `-n steps` does, and returns the detokenized text. */
static char *greedy_text(const char *model_path, const char *prompt, int steps)
{
    blade_error err = {{0}};
    blade_model *m = blade_model_load(model_path, &err);
    if (!m)
        fail_msg("%s", err.msg);
    blade_forward *fw = blade_forward_new(m, steps, &err);
    assert_non_null(fw);
    int32_t *toks = NULL;
    size_t n = 0;
    assert_int_equal(blade_tokenizer_encode(m->tokenizer, prompt, strlen(prompt), true, false, &toks, &n, &err), 0);
    blade_detokenizer d;
    blade_detokenizer_init(&d, m->tokenizer, false);
    size_t cap = 1 << 16, len = 0;
    char *text = calloc(cap, 1);
    char piece[256];
    int32_t tok = toks[0];
    for (int pos = 0; pos < steps; pos++) {
        assert_int_equal(blade_forward_token(fw, tok, pos, true, &err), 0);
        size_t k = blade_detokenizer_push(&d, tok, piece, sizeof piece);
        memcpy(text + len, piece, k);
        len += k;
        if ((size_t)pos + 1 < n) {
            tok = toks[pos + 1];
        } else {
            const float *logits = blade_forward_logits(fw);
            tok = 0;
            for (int32_t i = 1; i < m->hp.n_vocab; i++)
                if (logits[i] > logits[tok])
                    tok = i;
        }
    }
    /* the token chosen by the last step is part of the text, as llama2.c prints it */
    size_t k = blade_detokenizer_push(&d, tok, piece, sizeof piece);
    memcpy(text + len, piece, k);
    len += k;
    len += blade_detokenizer_flush(&d, text + len, cap - len);
    text[len] = 0;
    free(toks);
    blade_forward_free(fw);
    blade_model_free(m);
    return text;
}

static char *reference_text(void)
{
    char *path = require_shared("eval/greedy-once-upon-a-time.txt");
    size_t len;
    char *ref = read_file(path, &len);
    assert_non_null(ref);
    while (len && ref[len - 1] == '\n')
        ref[--len] = 0;
    free(path);
    return ref;
}

static void test_greedy_reference_256_steps(void **state)
{
    (void)state;
    char *ref = reference_text();
    char *model = require_shared("models/stories260K.gguf");
    char *text = greedy_text(model, "Once upon a time", 256);
    assert_string_equal(text, ref);
    free(text);
    free(model);
    free(ref);
}

/* The CLI prints exactly the reference for the tokens it generates. */
static void check_cli_greedy(const char *model_path)
{
    char *ref = reference_text();
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "run -m '%s' -p 'Once upon a time' -n 200 --temp 0", model_path);
    assert_int_equal(run_blade(args, &out, 0), 0);
    size_t len = strlen(out);
    assert_true(len > 0 && out[len - 1] == '\n');
    out[--len] = 0;
    if (len < 400 || strncmp(out, ref, len) != 0)
        fail_msg("blade run printed:\n%s\nwhich is not a prefix of the reference:\n%s", out, ref);
    free(out);
    free(ref);
}

static void test_cli_run_greedy(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf");
    check_cli_greedy(model);
    free(model);
}

/* blade run with an 8-bit KV cache: the greedy story follows the f32 reference for its
 * first two sentences and more (q8_0 295 bytes, fp8 268, measured), and an unknown type
 * is refused with the list of known ones. */
static void test_cli_run_kv_types(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf");
    char *ref = reference_text();
    const char *types[] = {"q8_0", "fp8"};
    for (int t = 0; t < 2; t++) {
        char args[1024], *out = NULL;
        snprintf(args, sizeof args, "run -m '%s' --kv-type %s -p 'Once upon a time' -n 100 --temp 0", model, types[t]);
        assert_int_equal(run_blade(args, &out, 0), 0);
        if (strlen(out) < 200 || strncmp(out, ref, 200) != 0)
            fail_msg("blade run --kv-type %s printed:\n%s\nwhich leaves the reference before byte 200:\n%s", types[t],
                     out, ref);
        free(out);
    }
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "run -m '%s' --kv-type q4 -p hi -n 4", model);
    assert_int_equal(run_blade(args, &out, 1), 2);
    assert_non_null(strstr(out, "--kv-type expects f16, f32, bf16, q8_0 or fp8, got 'q4'"));
    free(out);
    free(ref);
    free(model);
}

static void test_convert_llama2c(void **state)
{
    (void)state;
    char *bin = require_shared("models/stories260K.bin");
    char *tok = require_shared("models/tok512.bin");
    char *gguf_ref = require_shared("models/stories260K.gguf");
    char *out = temp_path("stories260K-converted.gguf");
    char args[2048];
    snprintf(args, sizeof args, "convert '%s' --tokenizer '%s' -o '%s'", bin, tok, out);
    assert_int_equal(run_blade(args, NULL, 1), 0);
    check_cli_greedy(out);

    /* The embedded vocabulary matches the one llama.cpp's converter produced. */
    blade_error err = {{0}};
    blade_model *a = blade_model_load(out, &err), *b = blade_model_load(gguf_ref, &err);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(a->hp.n_vocab, b->hp.n_vocab);
    for (int32_t i = 0; i < a->hp.n_vocab; i++) {
        assert_string_equal(blade_tokenizer_token_text(a->tokenizer, i), blade_tokenizer_token_text(b->tokenizer, i));
        assert_int_equal(blade_tokenizer_attr(a->tokenizer, i), blade_tokenizer_attr(b->tokenizer, i));
    }
    assert_true(a->hp.tied_embeddings);
    assert_int_equal(a->hp.n_layer, 5);
    assert_int_equal(a->hp.n_head_kv, 4);
    blade_model_free(a);
    blade_model_free(b);

    /* The draft fine-tune converts and runs, and it is a different model. */
    char *draft = require_shared("models/stories260K-draft.bin");
    char *draft_out = temp_path("stories260K-draft.gguf");
    snprintf(args, sizeof args, "convert '%s' --tokenizer '%s' -o '%s'", draft, tok, draft_out);
    assert_int_equal(run_blade(args, NULL, 1), 0);
    char *draft_text = greedy_text(draft_out, "Once upon a time", 64);
    char *main_text = greedy_text(out, "Once upon a time", 64);
    assert_true(strlen(draft_text) > 100);
    assert_true(strncmp(draft_text, "Once upon a time", 16) == 0);
    assert_string_not_equal(draft_text, main_text);
    free(draft_text);
    free(main_text);
    free(draft);
    free(draft_out);
    free(bin);
    free(tok);
    free(gguf_ref);
    free(out);
}

static void test_convert_rejects_bad_checkpoint(void **state)
{
    (void)state;
    char *tok = require_shared("models/tok512.bin");
    char *bad = temp_path("bad-checkpoint.bin");
    int32_t header[7] = {64, 172, 5, 8, 4, 512, 512};
    assert_int_equal(write_file(bad, header, sizeof header), 0);
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "convert '%s' --tokenizer '%s' -o /dev/null", bad, tok);
    assert_int_equal(run_blade(args, &out, 1), 1);
    assert_non_null(strstr(out, "header describes"));
    free(out);
    header[3] = 7; /* dim 64 is not a multiple of 7 heads */
    assert_int_equal(write_file(bad, header, sizeof header), 0);
    assert_int_equal(run_blade(args, &out, 1), 1);
    assert_non_null(strstr(out, "n_heads"));
    free(out);
    free(bad);
    free(tok);
}

/* Logits of a fixed token sequence, every position, concatenated. */
static float *all_logits(const char *path, const int32_t *toks, int n, int32_t *n_vocab)
{
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    if (!m)
        fail_msg("%s", err.msg);
    blade_forward *fw = blade_forward_new(m, n, &err);
    *n_vocab = m->hp.n_vocab;
    float *out = malloc((size_t)n * (size_t)m->hp.n_vocab * sizeof *out);
    for (int i = 0; i < n; i++) {
        assert_int_equal(blade_forward_token(fw, toks[i], i, true, &err), 0);
        memcpy(out + (size_t)i * m->hp.n_vocab, blade_forward_logits(fw), (size_t)m->hp.n_vocab * sizeof *out);
    }
    blade_forward_free(fw);
    blade_model_free(m);
    return out;
}

/* Relative RMS error of all weight matrices of a quantized file against the f32 file. */
static double weight_error(const char *quant_path, const char *f32_path)
{
    blade_error err = {{0}};
    gguf_file *q = gguf_open(quant_path, &err), *f = gguf_open(f32_path, &err);
    assert_non_null(q);
    assert_non_null(f);
    double se = 0, ss = 0;
    for (uint64_t i = 0; i < q->n_tensors; i++) {
        const gguf_tensor *tq = &q->tensors[i], *tf = gguf_find_tensor(f, tq->name);
        assert_non_null(tf);
        if (tq->n_dims < 2)
            continue;
        float *a = malloc(tq->n_elements * sizeof(float)), *b = malloc(tq->n_elements * sizeof(float));
        blade_type_traits_get(tq->type)->to_float(tq->data, a, (int64_t)tq->n_elements);
        blade_type_traits_get(tf->type)->to_float(tf->data, b, (int64_t)tf->n_elements);
        for (uint64_t j = 0; j < tq->n_elements; j++) {
            se += (double)(a[j] - b[j]) * (a[j] - b[j]);
            ss += (double)b[j] * b[j];
        }
        free(a);
        free(b);
    }
    gguf_close(q);
    gguf_close(f);
    return sqrt(se / ss);
}

/* Each quantized tiny256 model's logits against the f32 model's, relative RMS over 32
 * positions. The expected error follows from the weights' own quantization error e_w
 * (measured here from the files): nine quantized matrices lie on every logit's path
 * (embedding, Q, K, V, O, gate, up, down, classifier), each adding an independent error of
 * relative size ~e_w, so the logits carry about sqrt(9)·e_w = 3·e_w, a little more through
 * the heavy-tailed weights' outliers. The tolerance is 5·e_w per type; measured ratios are
 * 3.7-4.1 across the types, and a wrong dequantizer or kernel shows up as an error of the
 * order of the logits themselves (ratio >> 5). */
static void test_tiny256_types_logits(void **state)
{
    (void)state;
    static const char *const types[] = {"F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0"};
    char *f32 = require_shared("quant/tiny256-f32.gguf");
    int32_t toks[32];
    toks[0] = 1;
    for (int i = 1; i < 32; i++)
        toks[i] = 3 + (i * 37) % 500;
    int32_t nv;
    float *ref = all_logits(f32, toks, 32, &nv);
    for (size_t c = 0; c < sizeof types / sizeof types[0]; c++) {
        char rel[128];
        snprintf(rel, sizeof rel, "quant/tiny256-%s.gguf", types[c]);
        char *path = require_shared(rel);
        int32_t nv2;
        float *got = all_logits(path, toks, 32, &nv2);
        assert_int_equal(nv, nv2);
        double se = 0, ss = 0;
        for (size_t i = 0; i < (size_t)32 * nv; i++) {
            se += (double)(got[i] - ref[i]) * (got[i] - ref[i]);
            ss += (double)ref[i] * ref[i];
        }
        double logit_err = sqrt(se / ss), w_err = weight_error(path, f32);
        print_message("tiny256 %-5s weights e_w %.5f, logits %.5f (%.2f x e_w, tolerance 5 x e_w)\n", types[c],
                      w_err, logit_err, logit_err / w_err);
        assert_true(w_err > 0);
        assert_true(logit_err < 5 * w_err);
        free(got);
        free(path);
    }
    free(ref);
    free(f32);
}

static blade_synth_spec small_spec(blade_arch arch)
{
    blade_synth_spec s = {
        .arch = arch, .n_vocab = 400, .n_embd = 64, .n_layer = 2, .n_head = 4, .n_head_kv = 2,
        .head_dim = 16, .n_ff = 96, .n_ctx = 64, .rope_base = 10000.0f, .tied_embeddings = false,
        .scheme = {.type = BLADE_TYPE_F32}, .seed = 7, .vocab_path = NULL,
    };
    return s;
}

/* A NeoX-rotated model equals an interleaved-rotated model whose Q/K rows are permuted
 * so that dims (i, i+half) land on (2i, 2i+1): the qwen2 path with zero biases must give
 * the llama path's logits on the permuted weights. */
static void test_neox_rope_matches_permuted_llama(void **state)
{
    (void)state;
    blade_synth_spec spec = small_spec(BLADE_ARCH_QWEN2);
    char *qwen_path = temp_path("synth-qwen2.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_synth_write(&spec, qwen_path, false, &err), 0);

    blade_model *q = blade_model_load(qwen_path, &err);
    assert_non_null(q);
    assert_true(q->hp.rope_neox);
    assert_non_null(q->layers[0].bq.data);
    /* Build the llama twin in memory: same file, biases zeroed, Q/K rows permuted. */
    size_t size;
    char *bytes = read_file(qwen_path, &size);
    gguf_file *f = gguf_open_memory(bytes, size, &err);
    assert_non_null(f);
    int hd = spec.head_dim, half = hd / 2;
    for (uint64_t t = 0; t < f->n_tensors; t++) {
        gguf_tensor *ten = &f->tensors[t];
        float *data = (float *)(bytes + (ten->data - (const void *)f->map));
        if (strstr(ten->name, ".bias"))
            memset(data, 0, ten->nbytes);
        if (strstr(ten->name, "attn_q.weight") || strstr(ten->name, "attn_k.weight")) {
            int64_t rows = ten->ne[1], cols = ten->ne[0];
            float *copy = malloc(ten->nbytes);
            memcpy(copy, data, ten->nbytes);
            for (int64_t r = 0; r < rows; r++) {
                int64_t head = r / hd, i = r % hd;
                int64_t dst = head * hd + (i < half ? 2 * i : 2 * (i - half) + 1);
                memcpy(data + dst * cols, copy + r * cols, (size_t)cols * sizeof(float));
            }
            free(copy);
        }
    }
    gguf_close(f);
    /* The zeroed-bias qwen2 file is the NeoX reference; the llama twin swaps the arch name. */
    char *neox_path = temp_path("synth-qwen2-nobias.gguf");
    char *llama_path = temp_path("synth-llama-permuted.gguf");
    char *orig = read_file(qwen_path, &size);
    f = gguf_open_memory(orig, size, &err);
    for (uint64_t t = 0; t < f->n_tensors; t++)
        if (strstr(f->tensors[t].name, ".bias"))
            memset(orig + ((const char *)f->tensors[t].data - (const char *)f->map), 0, f->tensors[t].nbytes);
    gguf_close(f);
    assert_int_equal(write_file(neox_path, orig, size), 0);
    /* "qwen2" and "llama" have the same length, so renaming keeps every offset. */
    for (size_t i = 0; i + 5 <= size; i++)
        if (!memcmp(bytes + i, "qwen2", 5))
            memcpy(bytes + i, "llama", 5);
    assert_int_equal(write_file(llama_path, bytes, size), 0);

    int32_t toks[12] = {1, 300, 301, 302, 310, 320, 330, 340, 350, 260, 270, 280};
    int32_t nv;
    float *a = all_logits(neox_path, toks, 12, &nv);
    float *b = all_logits(llama_path, toks, 12, &nv);
    for (size_t i = 0; i < (size_t)12 * nv; i++)
        assert_float_equal(a[i], b[i], 1e-4 * (1 + fabsf(a[i])));
    free(a);
    free(b);
    blade_model_free(q);
    free(bytes);
    free(orig);
    free(qwen_path);
    free(neox_path);
    free(llama_path);
}

/* qwen3's per-head Q/K norms are used: scaling a norm weight changes the logits, and the
 * model runs end to end. Tied embeddings drop output.weight. */
static void test_qwen3_and_tied(void **state)
{
    (void)state;
    blade_synth_spec spec = small_spec(BLADE_ARCH_QWEN3);
    spec.tied_embeddings = true;
    char *path = temp_path("synth-qwen3.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_synth_write(&spec, path, false, &err), 0);
    blade_model *m = blade_model_load(path, &err);
    assert_non_null(m);
    assert_true(m->hp.tied_embeddings);
    assert_non_null(m->layers[1].q_norm.data);
    assert_ptr_equal(m->output.data, m->tok_embd.data);
    blade_model_free(m);
    int32_t toks[6] = {1, 300, 310, 320, 330, 340};
    int32_t nv;
    float *a = all_logits(path, toks, 6, &nv);
    size_t size;
    char *bytes = read_file(path, &size);
    gguf_file *f = gguf_open_memory(bytes, size, &err);
    const gguf_tensor *qn = gguf_find_tensor(f, "blk.0.attn_q_norm.weight");
    float *w = (float *)(bytes + ((const char *)qn->data - (const char *)f->map));
    for (int i = 0; i < spec.head_dim; i++)
        w[i] *= 3.0f;
    gguf_close(f);
    char *path2 = temp_path("synth-qwen3-scaled.gguf");
    assert_int_equal(write_file(path2, bytes, size), 0);
    float *b = all_logits(path2, toks, 6, &nv);
    double diff = 0;
    for (size_t i = 0; i < (size_t)6 * nv; i++)
        diff += fabs(a[i] - b[i]);
    assert_true(diff > 1e-3);
    for (size_t i = 0; i < (size_t)6 * nv; i++)
        assert_true(isfinite(a[i]));
    free(a);
    free(b);
    free(bytes);
    free(path);
    free(path2);
}

/* Loaded from a file, gate and up become one matrix whose row groups alternate (model.h),
 * repacked for the kernels; read from caller memory they stay apart in the file layout.
 * Every row of the fused matrix reads back as the same row of the file. */
static void test_gate_up_fused_rows(void **state)
{
    (void)state;
    blade_synth_spec spec = small_spec(BLADE_ARCH_LLAMA);
    spec.scheme.type = BLADE_TYPE_Q4_0;
    char *path = temp_path("synth-fused.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_synth_write(&spec, path, false, &err), 0);
    blade_model *fused = blade_model_load(path, &err);
    assert_non_null(fused);
    size_t size;
    char *bytes = read_file(path, &size);
    blade_model *apart = blade_model_from_gguf(gguf_open_memory(bytes, size, &err), &err);
    assert_non_null(apart);
    int64_t n = spec.n_embd;
    float *a = malloc((size_t)n * sizeof(float)), *b = malloc((size_t)n * sizeof(float));
    for (int l = 0; l < spec.n_layer; l++) {
        const blade_weight *gu = &fused->layers[l].ffn_gate_up;
        assert_non_null(gu->data);
        assert_int_equal(gu->n_out, 2 * spec.n_ff);
        assert_int_not_equal(gu->type, BLADE_TYPE_Q4_0); /* repacked too */
        for (int64_t r = 0; r < gu->n_out; r++) {
            int64_t group = r / BLADE_GATE_UP_GROUP, row = group / 2 * BLADE_GATE_UP_GROUP + r % BLADE_GATE_UP_GROUP;
            const blade_weight *src = group % 2 ? &apart->layers[l].ffn_up : &apart->layers[l].ffn_gate;
            blade_matmul_row_to_float(gu->type, gu->data, n, r, a);
            blade_matmul_row_to_float(src->type, src->data, n, row, b);
            assert_memory_equal(a, b, (size_t)n * sizeof(float));
        }
    }
    free(a);
    free(b);
    blade_model_free(fused);
    blade_model_free(apart);
    free(bytes);
    free(path);
}

static void test_unknown_architecture_refused(void **state)
{
    (void)state;
    blade_synth_spec spec = small_spec(BLADE_ARCH_LLAMA);
    char *path = temp_path("synth-llama.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_synth_write(&spec, path, false, &err), 0);
    size_t size;
    char *bytes = read_file(path, &size);
    for (size_t i = 0; i + 5 <= size; i++)
        if (!memcmp(bytes + i, "llama", 5))
            memcpy(bytes + i, "gemma", 5);
    gguf_file *f = gguf_open_memory(bytes, size, &err);
    assert_non_null(f);
    blade_model *m = blade_model_from_gguf(f, &err);
    assert_null(m);
    assert_non_null(strstr(err.msg, "'gemma' is not supported"));
    free(bytes);
    free(path);
}

static void test_missing_tensor_and_bad_shape(void **state)
{
    (void)state;
    blade_synth_spec spec = small_spec(BLADE_ARCH_LLAMA);
    char *path = temp_path("synth-llama2.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_synth_write(&spec, path, false, &err), 0);
    size_t size;
    char *bytes = read_file(path, &size);
    char *hit = memmem(bytes, size, "blk.1.ffn_up.weight", 19);
    assert_non_null(hit);
    hit[4] = 'X';
    gguf_file *f = gguf_open_memory(bytes, size, &err);
    assert_non_null(f);
    assert_null(blade_model_from_gguf(f, &err));
    assert_non_null(strstr(err.msg, "missing tensor blk.1.ffn_up.weight"));
    free(bytes);
    free(path);
}

/* A writer holding every key and tensor of f, for a test to change and write. */
static gguf_writer *copy_of(const gguf_file *f)
{
    blade_error err = {{0}};
    gguf_writer *w = gguf_writer_new();
    gguf_writer_copy_kv(w, f);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        assert_int_equal(gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, t->nbytes, &err), 0);
    }
    return w;
}

static char *write_copy(gguf_writer *w, const char *dst_name)
{
    blade_error err = {{0}};
    char *path = temp_path(dst_name);
    if (gguf_writer_write(w, path, false, &err))
        fail_msg("%s", err.msg);
    gguf_writer_free(w);
    return path;
}

/* A copy of a model file with llama.block_count set to block_count and, when extra_name is
 * given, one more F32 vector tensor; returns the new file's path. */
static char *rewrite_model(const char *src_path, const char *dst_name, int32_t block_count, const char *extra_name,
                           const float *extra, int64_t extra_n)
{
    blade_error err = {{0}};
    gguf_file *f = gguf_open(src_path, &err);
    assert_non_null(f);
    gguf_writer *w = copy_of(f);
    gguf_writer_set_u32(w, "llama.block_count", (uint32_t)block_count);
    if (extra_name)
        assert_int_equal(gguf_writer_add_tensor(w, extra_name, BLADE_TYPE_F32, 1, &extra_n, extra,
                                                (size_t)extra_n * sizeof(float), &err),
                         0);
    char *path = write_copy(w, dst_name);
    gguf_close(f);
    return path;
}

static void expect_load_error(const char *path, const char *needle)
{
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    if (m || !strstr(err.msg, needle))
        fail_msg("loading %s: expected an error with '%s', got %s", path, needle, m ? "a model" : err.msg);
}

/* Every tensor in the file must be one the architecture binds: a block_count below the
 * layers the file holds would otherwise run a truncated model without a word, and a tensor
 * of another architecture would be ignored. Optional tensors (rope_freqs, biases, an
 * untied output) stay accepted. */
static void test_tensors_match_architecture(void **state)
{
    (void)state;
    blade_synth_spec spec = small_spec(BLADE_ARCH_LLAMA);
    spec.n_layer = 5;
    char *five = temp_path("synth-llama-5layers.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_synth_write(&spec, five, false, &err), 0);

    char *two = rewrite_model(five, "llama-5layers-says-2.gguf", 2, NULL, NULL, 0);
    expect_load_error(two, "unexpected tensor blk.2.");
    expect_load_error(two, "llama.block_count is 2");
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "run -m '%s' -p hi -n 2", two);
    assert_int_equal(run_blade(args, &out, 1), 1);
    assert_non_null(strstr(out, "unexpected tensor blk.2."));
    free(out);

    char *seven = rewrite_model(five, "llama-5layers-says-7.gguf", 7, NULL, NULL, 0);
    expect_load_error(seven, "missing tensor blk.5.attn_norm.weight");

    float bias[64] = {0};
    char *foreign = rewrite_model(five, "llama-with-output-bias.gguf", 5, "blk.0.attn_output.bias", bias, spec.n_embd);
    expect_load_error(foreign, "unexpected tensor blk.0.attn_output.bias: the llama architecture has no such tensor");

    float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    char *bad_rope = rewrite_model(five, "llama-rope-freqs-shape.gguf", 5, "rope_freqs.weight", ones, 3);
    expect_load_error(bad_rope, "tensor rope_freqs.weight has shape [3");
    float zero[8] = {1, 1, 1, 0, 1, 1, 1, 1};
    char *zero_rope = rewrite_model(five, "llama-rope-freqs-zero.gguf", 5, "rope_freqs.weight", zero, 8);
    expect_load_error(zero_rope, "rope_freqs.weight[3] = 0 is not a positive finite factor");

    free(five);
    free(two);
    free(seven);
    free(foreign);
    free(bad_rope);
    free(zero_rope);
}

/* Llama 3.1-style RoPE frequency factors (rope_freqs.weight) divide each pair's frequency.
 * Factors of 2 everywhere turn every pair half as fast, which is linear position scaling by
 * 2: both files must give the same logits bit for bit, in the reference forward pass and in
 * the engine's runner (`blade run`), and differ from the unscaled model. */
static void test_rope_freq_factors(void **state)
{
    (void)state;
    blade_synth_spec spec = small_spec(BLADE_ARCH_LLAMA);
    char *plain = temp_path("synth-llama-rope.gguf");
    blade_error err = {{0}};
    assert_int_equal(blade_synth_write(&spec, plain, false, &err), 0);
    float twos[8] = {2, 2, 2, 2, 2, 2, 2, 2};
    char *factors = rewrite_model(plain, "llama-rope-freqs-2.gguf", spec.n_layer, "rope_freqs.weight", twos,
                                  spec.head_dim / 2);

    gguf_file *f = gguf_open(plain, &err);
    assert_non_null(f);
    gguf_writer *w = copy_of(f);
    gguf_writer_set_string(w, "llama.rope.scaling.type", "linear");
    gguf_writer_set_f32(w, "llama.rope.scaling.factor", 2.0f);
    char *linear = write_copy(w, "llama-rope-linear-2.gguf");
    gguf_close(f);

    int32_t toks[12] = {1, 300, 301, 302, 310, 320, 330, 340, 350, 260, 270, 280};
    int32_t nv;
    float *a = all_logits(factors, toks, 12, &nv);
    float *b = all_logits(linear, toks, 12, &nv);
    float *c = all_logits(plain, toks, 12, &nv);
    assert_memory_equal(a, b, (size_t)12 * nv * sizeof(float));
    assert_memory_not_equal(a, c, (size_t)12 * nv * sizeof(float));
    free(a);
    free(b);
    free(c);

    char *out[3];
    const char *paths[3] = {factors, linear, plain};
    for (int i = 0; i < 3; i++) {
        char args[1024];
        snprintf(args, sizeof args, "run -m '%s' -p 'a b c d e f g h i j' -n 24 --temp 0 --kv-mem 16M -t 1", paths[i]);
        assert_int_equal(run_blade(args, &out[i], 0), 0);
    }
    assert_string_equal(out[0], out[1]);
    assert_string_not_equal(out[0], out[2]);
    for (int i = 0; i < 3; i++)
        free(out[i]);
    free(plain);
    free(factors);
    free(linear);
}

static void test_truncated_models_refused(void **state)
{
    (void)state;
    static const char *const models[] = {"models/stories260K.gguf", "quant/tiny256-Q4_K.gguf"};
    for (size_t i = 0; i < 2; i++) {
        char *path = require_shared(models[i]);
        size_t size;
        char *bytes = read_file(path, &size);
        char *cut = temp_path("truncated.gguf");
        size_t cuts[] = {size - 1, size / 2, 100, 8};
        for (size_t c = 0; c < 4; c++) {
            assert_int_equal(write_file(cut, bytes, cuts[c]), 0);
            char args[1024], *out = NULL;
            snprintf(args, sizeof args, "run -m '%s' -p hi -n 4", cut);
            assert_int_equal(run_blade(args, &out, 1), 1);
            assert_non_null(strstr(out, "error:"));
            free(out);
        }
        free(cut);
        free(bytes);
        free(path);
    }
}

static void test_kv_arithmetic(void **state)
{
    (void)state;
    blade_hparams hp = {.n_layer = 32, .n_head_kv = 32, .head_dim = 128};
    blade_kv_store_config one_token = blade_model_kv_config(&hp, BLADE_KV_F16, 1, 1);
    assert_int_equal(blade_kv_store_block_bytes(&one_token), 512 * 1024);
    char *model = require_shared("models/stories260K.gguf");
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "info '%s'", model);
    assert_int_equal(run_blade(args, &out, 0), 0);
    /* 2 x 5 layers x 4 KV heads x 8 dims x 2 bytes = 640 bytes per token; 4K x 64 seqs = 160 MiB */
    assert_non_null(strstr(out, "= 640 bytes"));
    assert_non_null(strstr(out, "160.00 MiB"));
    assert_non_null(strstr(out, "architecture:  llama"));
    /* what 1 GiB holds per --kv-type: 8-bit rows of 8 dims carry a 2-byte scale, so
     * 2 x 5 x 4 x (8 + 2) = 400 bytes a token, 1.6x the tokens of f16 */
    assert_non_null(strstr(out, "q8_0              400.0      2684352"));
    assert_non_null(strstr(out, "fp8               400.0      2684352"));
    assert_non_null(strstr(out, "1.60x"));
    free(out);
    free(model);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_reference_256_steps),
        cmocka_unit_test(test_cli_run_greedy),
        cmocka_unit_test(test_cli_run_kv_types),
        cmocka_unit_test(test_convert_llama2c),
        cmocka_unit_test(test_convert_rejects_bad_checkpoint),
        cmocka_unit_test(test_tiny256_types_logits),
        cmocka_unit_test(test_neox_rope_matches_permuted_llama),
        cmocka_unit_test(test_qwen3_and_tied),
        cmocka_unit_test(test_gate_up_fused_rows),
        cmocka_unit_test(test_unknown_architecture_refused),
        cmocka_unit_test(test_missing_tensor_and_bad_shape),
        cmocka_unit_test(test_tensors_match_architecture),
        cmocka_unit_test(test_rope_freq_factors),
        cmocka_unit_test(test_truncated_models_refused),
        cmocka_unit_test(test_kv_arithmetic),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

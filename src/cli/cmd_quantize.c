/* `blade quantize`: converts a GGUF model's weights to a smaller type, with a progress bar
 * and a summary of what each tensor became. */

#include "blade/gguf.h"
#include "blade/imatrix.h"
#include "blade/quantize.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/quantize_gate.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void print_mib(FILE *out, uint64_t bytes)
{
    if (bytes >= (1ull << 30))
        fprintf(out, "%.2f GiB", (double)bytes / (double)(1ull << 30));
    else
        fprintf(out, "%.2f MiB", (double)bytes / (double)(1ull << 20));
}

static void print_type_counts(FILE *out, const uint64_t *counts)
{
    bool first = true;
    for (uint32_t t = 0; t < BLADE_TYPE_COUNT; t++) {
        if (!counts[t])
            continue;
        fprintf(out, "%s%s x %llu", first ? "" : ", ", blade_type_traits_get(t)->name, (unsigned long long)counts[t]);
        first = false;
    }
}

static void print_warnings(const char *in, const blade_quantize_report *r)
{
    if (r->n_requantized) {
        uint64_t counts[BLADE_TYPE_COUNT] = {0};
        for (size_t i = 0; i < r->n_tensors; i++)
            if (r->tensors[i].requantized)
                counts[r->tensors[i].src_type]++;
        fprintf(stderr, "warning: re-quantizing: %s already holds quantized weights (", in);
        print_type_counts(stderr, counts);
        fprintf(stderr, "); their rounding error adds to the new type's. Quantize from the F32, F16 or BF16 "
                        "original when there is one.\n");
    }
    for (size_t k = 0; k < r->n_unmatched_keeps; k++)
        fprintf(stderr, "warning: --keep '%s' matches no weight matrix\n", r->unmatched_keeps[k]);
    for (size_t k = 0; k < r->n_shadowed_keeps; k++)
        fprintf(stderr, "warning: --keep '%s' only matches matrices an earlier --keep takes (the first match wins)\n",
                r->shadowed_keeps[k]);
}

#define FALLBACK_NAMES_SHOWN 3

/* One line per kind of fallback (row length, wanted type, type written), naming the first
 * few tensors: a model has the same shapes in every layer. */
static void print_fallbacks(const blade_quantize_report *r)
{
    bool *shown = calloc(r->n_tensors ? r->n_tensors : 1, sizeof *shown);
    if (!shown)
        return;
    for (size_t i = 0; i < r->n_tensors; i++) {
        const blade_quant_tensor_plan *t = &r->tensors[i];
        if (t->type == t->wanted || shown[i])
            continue;
        const blade_type_traits *wanted = blade_type_traits_get(t->wanted);
        size_t count = 0;
        for (size_t j = i; j < r->n_tensors; j++) {
            const blade_quant_tensor_plan *u = &r->tensors[j];
            if (u->type != u->wanted && u->row_len == t->row_len && u->wanted == t->wanted && u->type == t->type)
                count++;
        }
        printf("  fallback    %zu matri%s with rows of %lld values, not whole %s blocks of %lld, written as %s: ", count,
               count == 1 ? "x" : "ces", (long long)t->row_len, wanted->name, (long long)wanted->block_size,
               blade_type_traits_get(t->type)->name);
        size_t named = 0;
        for (size_t j = i; j < r->n_tensors; j++) {
            const blade_quant_tensor_plan *u = &r->tensors[j];
            if (u->type == u->wanted || u->row_len != t->row_len || u->wanted != t->wanted || u->type != t->type)
                continue;
            shown[j] = true;
            if (named < FALLBACK_NAMES_SHOWN)
                printf("%s%s", named ? ", " : "", u->name);
            named++;
        }
        printf("%s\n", named > FALLBACK_NAMES_SHOWN ? ", ..." : "");
    }
    free(shown);
}

/* Matrices quantized to a block type that multiply activations, and so can have importance.
 * The token embedding of a model with its own classifier is read a row at a time, never
 * multiplied, so no importance matrix has (or needs) an entry for it. */
static bool importance_applies(const blade_quantize_report *r, const blade_quant_tensor_plan *t)
{
    if (!t->convert || blade_type_traits_get(t->type)->block_size == 1)
        return false;
    if (strcmp(t->name, "token_embd.weight") != 0)
        return true;
    for (size_t i = 0; i < r->n_tensors; i++)
        if (!strcmp(r->tensors[i].name, "output.weight"))
            return false;
    return true;
}

static void warn_missing_importance(const blade_imatrix *imx, const char *imatrix_path, const blade_quantize_report *r)
{
    size_t missing = 0;
    for (size_t i = 0; i < r->n_tensors; i++) {
        const blade_quant_tensor_plan *t = &r->tensors[i];
        if (!importance_applies(r, t) || blade_imatrix_find(imx, t->name))
            continue;
        if (missing++ == 0)
            fprintf(stderr, "warning: %s has no importance for", imatrix_path);
        if (missing <= FALLBACK_NAMES_SHOWN)
            fprintf(stderr, " %s", t->name);
    }
    if (missing > FALLBACK_NAMES_SHOWN)
        fprintf(stderr, " and %zu more", missing - FALLBACK_NAMES_SHOWN);
    if (missing)
        fprintf(stderr, ": %s quantized with the default weighting\n", missing == 1 ? "it is" : "they are");
}

static void print_summary(const char *in, const char *out, const char *scheme, const blade_quantize_report *r,
                          const char *imatrix_path, const blade_imatrix *imx)
{
    printf("quantized %s -> %s (%s)\n", in, out, scheme);
    printf("  tensors     %zu: ", r->n_tensors);
    print_type_counts(stdout, r->count_by_type);
    printf("\n");
    print_fallbacks(r);
    if (imx) {
        size_t with = 0, applies = 0;
        for (size_t i = 0; i < r->n_tensors; i++) {
            with += r->tensors[i].importance;
            applies += importance_applies(r, &r->tensors[i]);
        }
        printf("  importance  %zu of %zu quantized matrices weighted by %s (%u chunk%s of %u tokens of %s)\n", with,
               applies, imatrix_path, imx->chunks, imx->chunks == 1 ? "" : "s", imx->chunk_size, imx->dataset);
    }
    printf("  size        ");
    print_mib(stdout, r->file_bytes_in);
    printf(" -> ");
    print_mib(stdout, r->file_bytes_out);
    double ratio = r->file_bytes_out ? (double)r->file_bytes_in / (double)r->file_bytes_out : 0.0;
    if (ratio >= 1.0)
        printf(" (%.2fx smaller)\n", ratio);
    else
        printf(" (%.2fx larger)\n", ratio > 0 ? 1.0 / ratio : 0.0);
    double n = r->n_elements > 0 ? (double)r->n_elements : 1.0;
    printf("  bits/weight %.2f -> %.2f\n", 8.0 * (double)r->bytes_in / n, 8.0 * (double)r->bytes_out / n);
    printf("  time        %.2f s on %d thread%s, %.1f MB/s of input\n", r->seconds, r->n_threads,
           r->n_threads == 1 ? "" : "s", r->seconds > 0 ? (double)r->bytes_in / r->seconds / 1e6 : 0.0);
}

/* The importance matrix at path, checked against the model it is to quantize. */
static blade_imatrix *load_imatrix(const char *path, const char *model_path, blade_error *err)
{
    blade_imatrix *imx = blade_imatrix_load(path, err);
    if (!imx)
        return NULL;
    gguf_file *model = gguf_open_mapped(model_path, err);
    if (!model || blade_imatrix_check_model(imx, model, model_path, err) != 0) {
        if (model)
            blade_error_prefix(err, "%s", path);
        gguf_close(model);
        blade_imatrix_free(imx);
        return NULL;
    }
    gguf_close(model);
    return imx;
}

typedef struct gated_write {
    cli_quantize_gate *gate;
    const char *in, *out, *scheme, *imatrix_path;
    const blade_imatrix *imx;
} gated_write;

/* The quantize_params accept hook: the conversion's summary, then the gate's verdict on it. */
static int judge_written(void *ctx, const char *written_path, const blade_quantize_report *report, blade_error *err)
{
    gated_write *gw = ctx;
    print_summary(gw->in, gw->out, gw->scheme, report, gw->imatrix_path, gw->imx);
    fflush(stdout);
    /* the evaluation does not stop for Ctrl-C, but its verdict then counts for nothing */
    int verdict = cli_interrupted ? -1 : cli_quantize_gate_judge(gw->gate, written_path, err);
    return cli_interrupted ? blade_error_set(err, "interrupted") : verdict;
}

typedef struct quantize_options {
    const char *in, *out, *imatrix, *gate, *eval_text;
    long long eval_ctx, eval_chunks; /* 0: not given */
    const blade_quant_scheme *scheme;
    cli_list keeps;
    long long threads;
    bool no_refine;
    bool pure;
} quantize_options;

#define O quantize_options
static const cli_flag quantize_flags[] = {
    {.name = "type", .kind = CLI_CUSTOM, CLI_AT(O, scheme), .parse = cli_parse_quant_scheme,
     .values = blade_quant_scheme_names, .metavar = "TYPE", .required = true,
     .help = "the type to write"},
    {.name = "keep", .kind = CLI_LIST, CLI_AT(O, keeps), .metavar = "GLOB=TYPE",
     .help = "matrices whose name matches the shell pattern GLOB get TYPE (repeatable; the first match wins), "
             "e.g. 'output.weight=Q8_0'"},
    {.name = "threads", .letter = 't', .kind = CLI_INT, CLI_AT(O, threads), .min = 1, .max = 1024, .metavar = "N",
     .dflt = "every core", .help = "threads"},
    {.name = "pure", .kind = CLI_BOOL, CLI_AT(O, pure),
     .help = "every weight matrix in TYPE: no Q6_K classifier for Q4_0 and the _M mixes, none of a mix's Q6_K "
             "layers (as llama.cpp's --pure)"},
    {.name = "no-refine", .kind = CLI_BOOL, CLI_AT(O, no_refine),
     .help = "the reference scale search alone: K-quant bytes as llama.cpp's quantizer writes them, faster, with "
             "higher error"},
    {.name = "imatrix", .kind = CLI_PATH, CLI_AT(O, imatrix), .metavar = "FILE",
     .help = "weight each column's rounding error by its importance, from `blade imatrix` run on this model "
             "(refused for another model; matrices it lacks keep the default weighting, with a warning)"},
    {.name = "gate", .kind = CLI_STRING, CLI_AT(O, gate), .metavar = "EXPR",
     .help = "write OUT only if the quantized model, evaluated against IN on --eval-text as `blade eval` does, "
             "meets every condition, e.g. \"kld<=0.02,ppl<=+1.5%,top1>=0.95\" (measures kld, kld_median, kld_p90, "
             "kld_p99, kld_max, ppl, top1); otherwise exit status 3, the failing conditions on stderr, and no OUT"},
    {.name = "eval-text", .kind = CLI_PATH, CLI_AT(O, eval_text), .metavar = "FILE",
     .help = "the text the gate evaluates on (required with --gate)"},
    {.name = "eval-ctx", .kind = CLI_INT, CLI_AT(O, eval_ctx), .min = 4, .max = 1 << 20, .metavar = "N",
     .dflt = "512", .help = "the gate's chunk length in tokens"},
    {.name = "eval-chunks", .kind = CLI_INT, CLI_AT(O, eval_chunks), .min = 1, .max = 1 << 30, .metavar = "N",
     .dflt = "all", .help = "the gate evaluates at most N chunks"},
    {0},
};
#undef O

static int quantize_main(int argc, char **argv);

const cli_command cli_cmd_quantize = {
    .name = "quantize",
    .summary = "convert a GGUF model's weights to Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, ...",
    .synopsis = "IN.gguf OUT.gguf --type TYPE [options]",
    .about = "Converts the weight matrices of a GGUF model (F32, F16 or BF16; an already quantized\n"
             "model is converted too, with a warning) to TYPE. Norms and other 1-D tensors become\n"
             "F32; a matrix whose rows are not whole blocks of its type falls back to the nearest\n"
             "type that fits, and the summary names it. Every metadata key is carried over. OUT is\n"
             "written beside its final name and renamed once complete: an interrupted run leaves\n"
             "no partial OUT.\n\n"
             "The _M mixes write the classifier, and attn_v / ffn_down in the first and last eighth of\n"
             "the layers and every third layer between, in Q6_K. Q4_0 writes the classifier in Q6_K,\n"
             "as llama.cpp's quantizer does; --pure writes every matrix in TYPE.\n",
    .tables = (const cli_table[]){{quantize_flags, 0}, {0}},
    .positionals = (const cli_positional[]){
        {.metavar = "IN.gguf", CLI_ARG_AT(quantize_options, in), .help = "the model to convert"},
        {.metavar = "OUT.gguf", CLI_ARG_AT(quantize_options, out), .help = "the file to write"},
        {0}},
    .opts_size = sizeof(quantize_options),
    .main = quantize_main,
};

static int quantize_main(int argc, char **argv)
{
    quantize_options o;
    int rc = cli_parse(&cli_cmd_quantize, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    blade_quant_keep keeps[CLI_LIST_MAX];
    size_t n_keeps = 0;
    blade_imatrix *imx = NULL;
    blade_error err = {{0}};
    cli_quantize_gate gate = {.expr = o.gate, .text_path = o.eval_text};
    blade_eval_config_default(&gate.cfg);
    if (o.eval_ctx)
        gate.cfg.n_ctx = (int32_t)o.eval_ctx;
    if (o.eval_chunks)
        gate.cfg.max_chunks = (int32_t)o.eval_chunks;
    if (!gate.expr && (o.eval_text || o.eval_ctx || o.eval_chunks))
        return cli_usage_error(&cli_cmd_quantize, "--eval-text, --eval-ctx and --eval-chunks only apply with --gate");
    if (gate.expr && blade_gate_parse(gate.expr, &gate.gate, &err))
        return cli_usage_error(&cli_cmd_quantize, "--gate: %s", err.msg);
    if (gate.expr && !gate.text_path)
        return cli_usage_error(&cli_cmd_quantize,
                               "--gate needs --eval-text FILE, the text to evaluate the quantized model on");
    rc = 2;
    for (int k = 0; k < o.keeps.n; k++, n_keeps++)
        if (blade_quant_keep_parse(o.keeps.items[k], &keeps[n_keeps], &err) != 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            goto done;
        }
    blade_quant_scheme chosen = *o.scheme;
    if (o.pure)
        chosen.classifier_type = chosen.sensitive_type = 0;
    const blade_quant_scheme *scheme = &chosen;
    const char *in = o.in, *out = o.out, *imatrix_path = o.imatrix;
    long long threads = o.threads;
    bool no_refine = o.no_refine;
    blade_quantize_params params = {
        .scheme = scheme, .keep = keeps, .n_keep = n_keeps, .n_threads = (int)threads, .no_refine = no_refine,
        .progress = isatty(STDERR_FILENO), .cancel = &cli_interrupted,
    };
    rc = 1;
    if (imatrix_path) {
        if (!(imx = load_imatrix(imatrix_path, in, &err))) {
            fprintf(stderr, "error: %s\n", err.msg);
            goto done;
        }
        params.importance = blade_imatrix_importance;
        params.importance_ctx = imx;
        params.imatrix_file = imatrix_path;
        params.imatrix_dataset = imx->dataset;
        params.imatrix_chunks = imx->chunks > INT32_MAX ? INT32_MAX : (int32_t)imx->chunks;
        params.imatrix_entries = (int32_t)imx->n_entries;
    }
    gated_write gw = {.gate = &gate, .in = in, .out = out, .scheme = scheme->name, .imatrix_path = imatrix_path,
                      .imx = imx};
    if (gate.expr) {
        gate.in_path = in;
        gate.out_path = out;
        gate.cfg.n_threads = (int)threads;
        if (cli_quantize_gate_open(&gate))
            goto done;
        params.accept = judge_written;
        params.accept_ctx = &gw;
    }
    blade_quantize_job *job = blade_quantize_prepare(in, &params, &err);
    if (!job) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto done;
    }
    print_warnings(in, blade_quantize_job_report(job));
    if (imx)
        warn_missing_importance(imx, imatrix_path, blade_quantize_job_report(job));

    cli_signals signals;
    cli_interrupts_catch(&signals);
    int wrc = blade_quantize_write(job, out, &err);
    cli_interrupts_restore(&signals);
    if (wrc < 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        rc = cli_interrupted ? 130 : 1;
    } else if (wrc > 0) {
        fprintf(stderr, "%s not written: the quantized model does not meet the gate\n", out);
        rc = 3;
    } else {
        if (!gate.expr)
            print_summary(in, out, scheme->name, blade_quantize_job_report(job), imatrix_path, imx);
        else
            printf("wrote %s: it meets the gate %s\n", out, gate.expr);
        rc = 0;
    }
    blade_quantize_job_free(job);
done:
    cli_quantize_gate_close(&gate);
    blade_imatrix_free(imx);
    for (size_t k = 0; k < n_keeps; k++)
        blade_quant_keep_free(&keeps[k]);
    return rc;
}

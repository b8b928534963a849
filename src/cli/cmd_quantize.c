/* `blade quantize`: converts a GGUF model's weights to a smaller type, with a progress bar
 * and a summary of what each tensor became. */

#include "blade/quantize.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t interrupted;

static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

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

static void print_summary(const char *in, const char *out, const char *scheme, const blade_quantize_report *r)
{
    printf("quantized %s -> %s (%s)\n", in, out, scheme);
    printf("  tensors     %zu: ", r->n_tensors);
    print_type_counts(stdout, r->count_by_type);
    printf("\n");
    print_fallbacks(r);
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

typedef struct quantize_options {
    const char *in, *out;
    const blade_quant_scheme *scheme;
    cli_list keeps;
    long long threads;
    bool no_refine;
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
    {.name = "no-refine", .kind = CLI_BOOL, CLI_AT(O, no_refine),
     .help = "the reference scale search alone: K-quant bytes as llama.cpp's quantizer writes them, faster, with "
             "higher error"},
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
             "the layers and every third layer between, in Q6_K.\n",
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
    blade_error err = {{0}};
    rc = 2;
    for (int k = 0; k < o.keeps.n; k++, n_keeps++)
        if (blade_quant_keep_parse(o.keeps.items[k], &keeps[n_keeps], &err) != 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            goto done;
        }
    const blade_quant_scheme *scheme = o.scheme;
    const char *in = o.in, *out = o.out;
    blade_quantize_params params = {
        .scheme = scheme, .keep = keeps, .n_keep = n_keeps, .n_threads = (int)o.threads, .no_refine = o.no_refine,
        .progress = isatty(STDERR_FILENO), .cancel = &interrupted,
    };
    rc = 1;
    blade_quantize_job *job = blade_quantize_prepare(in, &params, &err);
    if (!job) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto done;
    }
    print_warnings(in, blade_quantize_job_report(job));

    struct sigaction sa = {.sa_handler = on_signal}, old_int, old_term;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    int wrc = blade_quantize_write(job, out, &err);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (wrc != 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        rc = interrupted ? 130 : 1;
    } else {
        print_summary(in, out, scheme->name, blade_quantize_job_report(job));
        rc = 0;
    }
    blade_quantize_job_free(job);
done:
    for (size_t k = 0; k < n_keeps; k++)
        blade_quant_keep_free(&keeps[k]);
    return rc;
}

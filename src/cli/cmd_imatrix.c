/* `blade imatrix`: runs calibration text through a model and writes the importance matrix
 * `blade quantize --imatrix` reads, with a progress bar and a summary. */

#include "blade/imatrix.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/flags.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void print_summary(const char *model, const char *out, const blade_imatrix *im, const blade_imatrix_report *r)
{
    uint64_t tokens = (uint64_t)im->chunks * im->chunk_size;
    printf("imatrix %s -> %s\n", model, out);
    printf("  text        %s: %zu tokens, %u chunk%s of %u used (%llu tokens)\n", im->dataset, r->text_tokens, im->chunks,
           im->chunks == 1 ? "" : "s", im->chunk_size, (unsigned long long)tokens);
    printf("  perplexity  %.4f +/- %.4f\n", r->ppl, r->ppl_err);
    printf("  entries     %zu weight matrices (%s model, fingerprint %.16s)\n", im->n_entries, im->model.arch,
           im->model.fingerprint);
    printf("  time        %.2f s on %d thread%s, %.0f tokens/s\n", r->seconds, r->n_threads, r->n_threads == 1 ? "" : "s",
           r->seconds > 0 ? (double)tokens / r->seconds : 0.0);
}

typedef struct imatrix_options {
    const char *model, *text, *out;
    long long ctx, chunks, threads;
} imatrix_options;

static void imatrix_init(void *opts)
{
    imatrix_options *o = opts;
    o->model = cli_default_model();
    o->out = "imatrix.gguf";
    o->ctx = 512;
}

#define O imatrix_options
static const cli_flag imatrix_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(O, model), .metavar = "FILE",
     .dflt = "../shared/models/stories260K.gguf if present",
     .help = "GGUF model, best the full-precision one you will quantize"},
    {.name = "file", .letter = 'f', .kind = CLI_PATH, CLI_AT(O, text), .metavar = "FILE", .required = true,
     .help = "calibration text"},
    {.name = "output", .letter = 'o', .kind = CLI_PATH, CLI_AT(O, out), .metavar = "FILE",
     .help = "importance matrix to write"},
    {.name = "ctx-size", .letter = 'c', .kind = CLI_INT, CLI_AT(O, ctx), .min = 4, .max = 1 << 20, .metavar = "N",
     .help = "chunk length in tokens"},
    {.name = "chunks", .kind = CLI_INT, CLI_AT(O, chunks), .min = 1, .max = 1 << 30, .metavar = "N", .dflt = "all",
     .help = "run at most N chunks"},
    {.name = "threads", .letter = 't', .kind = CLI_INT, CLI_AT(O, threads), .min = 1, .max = 1024, .metavar = "N",
     .dflt = "every core", .help = "threads"},
    {0},
};
#undef O

static int imatrix_main(int argc, char **argv);

const cli_command cli_cmd_imatrix = {
    .name = "imatrix",
    .summary = "record activation importance from calibration text, for quantize --imatrix",
    .synopsis = "-m MODEL.gguf -f CALIBRATION.txt [-o IMATRIX.gguf] [options]",
    .about = "Runs the text through the model and records, for every weight matrix, the mean square of\n"
             "each input column's activations: the importance `blade quantize --imatrix` weights\n"
             "rounding errors by. The text is tokenized once with BOS first and cut into chunks of CTX\n"
             "tokens (the remainder dropped), each run from an empty context with its first token\n"
             "replaced by BOS, as blade perplexity does; the perplexity of the text is reported too.\n"
             "The output is written beside its final name and renamed once complete.\n",
    .tables = (const cli_table[]){{imatrix_flags, 0}, {0}},
    .opts_size = sizeof(imatrix_options),
    .init = imatrix_init,
    .main = imatrix_main,
};

static int imatrix_main(int argc, char **argv)
{
    imatrix_options o;
    int parsed = cli_parse(&cli_cmd_imatrix, argc, argv, &o);
    if (parsed != CLI_RUN)
        return parsed;
    const char *model_path = o.model, *text_path = o.text, *out_path = o.out;
    long long ctx = o.ctx, chunks = o.chunks, threads = o.threads;
    if (!model_path)
        return cli_usage_error(&cli_cmd_imatrix, "no model given (-m FILE)");
    if (cli_same_file(model_path, out_path) || cli_same_file(text_path, out_path)) {
        return cli_usage_error(&cli_cmd_imatrix, "%s is an input file: writing over it is refused (name another output)",
                               out_path);
    }
    size_t text_len;
    char *text = cli_read_file(text_path, &text_len);
    if (!text)
        return 1;
    blade_error err = {{0}};
    int rc = 1;
    blade_imatrix *im = NULL;
    blade_model *m = blade_model_load(model_path, &err);
    if (!m)
        goto done;
    blade_imatrix_params p = {
        .text = text, .text_len = text_len, .dataset = text_path, .ctx = (int32_t)ctx, .max_chunks = (int32_t)chunks,
        .n_threads = (int)threads, .progress = isatty(STDERR_FILENO), .cancel = &cli_interrupted,
    };
    blade_imatrix_report report;
    cli_signals signals;
    cli_interrupts_catch(&signals);
    im = blade_imatrix_collect(m, &p, &report, &err);
    cli_interrupts_restore(&signals);
    if (!im) {
        rc = cli_interrupted ? 130 : 1;
        goto done;
    }
    if (blade_imatrix_save(im, out_path, &err))
        goto done;
    print_summary(model_path, out_path, im, &report);
    rc = 0;
done:
    if (rc)
        fprintf(stderr, "error: %s\n", err.msg);
    blade_imatrix_free(im);
    blade_model_free(m);
    free(text);
    return rc;
}

/* `blade imatrix`: runs calibration text through a model and writes the importance matrix
 * `blade quantize --imatrix` reads, with a progress bar and a summary. */

#include "blade/imatrix.h"
#include "blade/model.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void imatrix_usage(FILE *out)
{
    fprintf(out,
            "usage: blade imatrix -m MODEL.gguf -f CALIBRATION.txt [-o IMATRIX.gguf] [options]\n\n"
            "Runs the text through the model and records, for every weight matrix, the mean square of\n"
            "each input column's activations: the importance `blade quantize --imatrix` weights\n"
            "rounding errors by. The text is tokenized once with BOS first and cut into chunks of CTX\n"
            "tokens (the remainder dropped), each run from an empty context with its first token\n"
            "replaced by BOS, as blade perplexity does; the perplexity of the text is reported too.\n"
            "The output is written beside its final name and renamed once complete.\n\n"
            "  -m, --model FILE     GGUF model, best the full-precision one you will quantize\n"
            "                       (default: ../shared/models/stories260K.gguf if present)\n"
            "  -f, --file FILE      calibration text\n"
            "  -o, --output FILE    importance matrix to write (default: imatrix.gguf)\n"
            "  -c, --ctx-size N     chunk length in tokens (default 512)\n"
            "      --chunks N       run at most N chunks (default: all)\n"
            "  -t, --threads N      threads (default: every core)\n"
            "  -h, --help           this help\n");
}

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

int cmd_imatrix(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},    {"file", required_argument, 0, 'f'},
        {"output", required_argument, 0, 'o'},   {"ctx-size", required_argument, 0, 'c'},
        {"chunks", required_argument, 0, 'k'},   {"threads", required_argument, 0, 't'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0},
    };
    const char *model_path = cli_default_model(), *text_path = NULL, *out_path = "imatrix.gguf";
    long long ctx = 512, chunks = 0, threads = 0;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:f:o:c:t:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'f': text_path = optarg; break;
        case 'o': out_path = optarg; break;
        case 'c':
            if (!cli_parse_int("-c", optarg, 4, 1 << 20, &ctx))
                return 2;
            break;
        case 'k':
            if (!cli_parse_int("--chunks", optarg, 1, 1 << 30, &chunks))
                return 2;
            break;
        case 't':
            if (!cli_parse_int("--threads", optarg, 1, 1024, &threads))
                return 2;
            break;
        case 'h': imatrix_usage(stdout); return 0;
        default: imatrix_usage(stderr); return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s'\n", argv[optind]);
        imatrix_usage(stderr);
        return 2;
    }
    if (!model_path || !text_path) {
        fprintf(stderr, "error: %s is required\n", !model_path ? "-m MODEL" : "-f CALIBRATION");
        imatrix_usage(stderr);
        return 2;
    }
    if (cli_same_file(model_path, out_path) || cli_same_file(text_path, out_path)) {
        fprintf(stderr, "error: %s is an input file: writing over it is refused (name another output)\n", out_path);
        return 2;
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

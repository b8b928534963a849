#include "blade/convert.h"
#include "cli/commands.h"

#include <getopt.h>
#include <stdio.h>
#include <unistd.h>

static void convert_usage(FILE *out)
{
    fprintf(out,
            "usage: blade convert CHECKPOINT.bin --tokenizer TOKENIZER.bin -o OUT.gguf [--name NAME]\n\n"
            "Imports a llama2.c checkpoint and its tokenizer into a standard `llama` GGUF file\n"
            "(F32 weights, embedded SentencePiece-style vocabulary).\n\n"
            "  -t, --tokenizer FILE  llama2.c tokenizer.bin (e.g. tok512.bin)\n"
            "  -o, --output FILE     GGUF file to write\n"
            "      --name NAME       general.name to record (default: llama2.c)\n"
            "  -h, --help            this help\n");
}

int cmd_convert(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"tokenizer", required_argument, 0, 't'}, {"output", required_argument, 0, 'o'},
        {"name", required_argument, 0, 'N'},      {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *tok = NULL, *out = NULL, *name = NULL;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "t:o:h", longopts, NULL)) != -1) {
        switch (c) {
        case 't': tok = optarg; break;
        case 'o': out = optarg; break;
        case 'N': name = optarg; break;
        case 'h': convert_usage(stdout); return 0;
        default: convert_usage(stderr); return 2;
        }
    }
    if (optind != argc - 1 || !tok || !out) {
        convert_usage(stderr);
        return 2;
    }
    blade_error err = {{0}};
    if (blade_convert_llama2c(argv[optind], tok, out, name, isatty(STDERR_FILENO), &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    fprintf(stderr, "wrote %s\n", out);
    return 0;
}

#include "blade/quantize.h"
#include "blade/synth.h"
#include "blade/types.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void synth_usage(FILE *out)
{
    fprintf(out,
            "usage: blade synth --shape NAME --type TYPE -o FILE.gguf [options]\n\n"
            "Writes a random-weight GGUF with a real model's shape and a real vocabulary (padded with\n"
            "unused filler tokens to the model's vocabulary size, so the embedding and classifier cost\n"
            "what they really cost). Other GGUF engines load the file too.\n\n"
            "  --shape NAME     %s\n"
            "  --type TYPE      F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, or the mixes Q4_K_M / Q5_K_M\n"
            "                   (classifier and the sensitive attn_v/ffn_down layers in Q6_K)\n"
            "  -o, --output F   file to write\n"
            "  --vocab FILE     vocabulary GGUF to borrow (default: the shape's, from ../shared/vocab)\n"
            "  --seed N         weight seed (default 1)\n"
            "  -h, --help       this help\n",
            blade_synth_shape_names());
}

int cmd_synth(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"shape", required_argument, 0, 's'}, {"type", required_argument, 0, 't'},
        {"output", required_argument, 0, 'o'}, {"vocab", required_argument, 0, 'v'},
        {"seed", required_argument, 0, 'S'},  {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *shape = NULL, *type = NULL, *out = NULL, *vocab = NULL;
    long long seed = 1;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "o:h", longopts, NULL)) != -1) {
        switch (c) {
        case 's': shape = optarg; break;
        case 't': type = optarg; break;
        case 'o': out = optarg; break;
        case 'v': vocab = optarg; break;
        case 'S':
            if (!cli_parse_int("--seed", optarg, 0, INT64_MAX, &seed))
                return 2;
            break;
        case 'h': synth_usage(stdout); return 0;
        default: synth_usage(stderr); return 2;
        }
    }
    if (!shape || !type || !out || optind != argc) {
        synth_usage(stderr);
        return 2;
    }
    blade_synth_spec spec = {0};
    const char *shape_vocab;
    if (blade_synth_shape(shape, &spec, &shape_vocab)) {
        fprintf(stderr, "error: unknown shape '%s' (known: %s)\n", shape, blade_synth_shape_names());
        return 2;
    }
    const blade_quant_scheme *scheme = blade_quant_scheme_find(type);
    if (!scheme) {
        fprintf(stderr, "error: type '%s' is not one blade can write (%s)\n", type, blade_quant_scheme_names());
        return 2;
    }
    spec.weight_type = scheme->type;
    spec.sensitive_type = scheme->sensitive_type;
    spec.seed = (uint64_t)seed;
    char default_vocab[512];
    if (!vocab) {
        snprintf(default_vocab, sizeof default_vocab, "../shared/%s", shape_vocab);
        vocab = default_vocab;
    }
    spec.vocab_path = vocab;
    blade_error err = {{0}};
    double t0 = cli_now();
    if (blade_synth_write(&spec, out, isatty(STDERR_FILENO), &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    fprintf(stderr, "wrote %s (%s, %s) in %.1f s\n", out, shape, type, cli_now() - t0);
    return 0;
}

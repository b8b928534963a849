/* `blade synth`: a random-weight GGUF of a real model's shape, for benchmarks without downloads. */

#include "blade/quantize.h"
#include "blade/synth.h"
#include "blade/types.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct synth_options {
    const char *shape, *out, *vocab;
    const blade_quant_scheme *scheme;
    long long seed;
} synth_options;

static void synth_init(void *opts)
{
    synth_options *o = opts;
    o->seed = 1;
}

#define O synth_options
static const cli_flag synth_flags[] = {
    {.name = "shape", .kind = CLI_STRING, CLI_AT(O, shape), .values = blade_synth_shape_names, .metavar = "NAME",
     .required = true, .help = "the model whose shape to copy"},
    {.name = "type", .kind = CLI_CUSTOM, CLI_AT(O, scheme), .parse = cli_parse_quant_scheme,
     .values = blade_quant_scheme_names, .metavar = "TYPE", .required = true,
     .help = "weight type"},
    {.name = "output", .letter = 'o', .kind = CLI_PATH, CLI_AT(O, out), .metavar = "FILE", .required = true,
     .help = "file to write"},
    {.name = "vocab", .kind = CLI_PATH, CLI_AT(O, vocab), .metavar = "FILE",
     .dflt = "the shape's, from ../shared/vocab", .help = "vocabulary GGUF to borrow"},
    {.name = "seed", .kind = CLI_INT, CLI_AT(O, seed), .min = 0, .max = INT64_MAX, .metavar = "N",
     .help = "weight seed"},
    {0},
};
#undef O

static int synth_main(int argc, char **argv);

const cli_command cli_cmd_synth = {
    .name = "synth",
    .summary = "write a random-weight GGUF of a real model's shape",
    .synopsis = "--shape NAME --type TYPE -o FILE.gguf [options]",
    .about = "Writes a random-weight GGUF with a real model's shape and a real vocabulary (padded with\n"
             "unused filler tokens to the model's vocabulary size, so the embedding and classifier cost\n"
             "what they really cost). Other GGUF engines load the file too. The _M mixes write the\n"
             "classifier and the sensitive attn_v / ffn_down layers in Q6_K, as blade quantize does.\n",
    .tables = (const cli_table[]){{synth_flags, 0}, {0}},
    .opts_size = sizeof(synth_options),
    .init = synth_init,
    .main = synth_main,
};

static int synth_main(int argc, char **argv)
{
    synth_options o;
    int rc = cli_parse(&cli_cmd_synth, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    const char *shape = o.shape, *out = o.out, *vocab = o.vocab;
    const blade_quant_scheme *scheme = o.scheme;
    blade_synth_spec spec = {0};
    const char *shape_vocab;
    if (blade_synth_shape(shape, &spec, &shape_vocab)) {
        fprintf(stderr, "error: unknown shape '%s' (known: %s)\n", shape, blade_synth_shape_names());
        return 2;
    }
    spec.weight_type = scheme->type;
    spec.sensitive_type = scheme->sensitive_type;
    spec.seed = (uint64_t)o.seed;
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
    fprintf(stderr, "wrote %s (%s, %s) in %.1f s\n", out, shape, scheme->name, cli_now() - t0);
    return 0;
}

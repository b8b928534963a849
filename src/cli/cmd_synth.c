/* `blade synth`: writes a random-weight model of a real model's shape, or inflates a small
 * real model to that shape (--from). */
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
    const char *shape, *out, *vocab, *from;
    const blade_quant_scheme *scheme;
    long long seed;
    double noise; /* < 0: not given */
} synth_options;

static void synth_init(void *opts)
{
    synth_options *o = opts;
    o->seed = 1;
    o->noise = -1.0;
}

static int inflate(const blade_synth_spec *spec, const char *shape, const char *type, const char *from, float noise,
                   const char *out)
{
    blade_error err = {{0}};
    blade_synth_inflation info;
    double t0 = cli_now();
    if (blade_synth_inflate(spec, from, noise, out, isatty(STDERR_FILENO), &info, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    const blade_hparams *s = &info.source;
    fprintf(stderr, "wrote %s (%s, %s) in %.1f s: %s's function (hidden %d, %d layers at", out, shape, type,
            cli_now() - t0, from, s->n_embd, s->n_layer);
    for (int32_t i = 0; i < s->n_layer; i++)
        fprintf(stderr, "%s%d", i ? "," : " ", blade_synth_layer_position(i, s->n_layer, spec->n_layer));
    fprintf(stderr, ", %d heads of %d, %d KV heads x %d copies, FFN %d, %d tokens); rope base %g over %d dims, "
            "rms eps %g, noise %g\n", s->n_head, s->head_dim, s->n_head_kv, info.kv_copies, s->n_ff, s->n_vocab,
            info.rope_base, info.n_rot, info.rms_eps, noise);
    return 0;
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
    {.name = "from", .kind = CLI_PATH, CLI_AT(O, from), .metavar = "FILE",
     .help = "inflate this llama GGUF to the shape instead of drawing random weights"},
    {.name = "noise", .kind = CLI_DOUBLE, CLI_AT(O, noise), .min = 0, .max = 1, .metavar = "X",
     .dflt = "0.001 with --from", .help = "with --from: standard deviation of the weights FILE does not fill (0 keeps "
                                          "FILE's logits to float rounding)"},
    {.name = "seed", .kind = CLI_INT, CLI_AT(O, seed), .min = 0, .max = CLI_INT64_MAX, .metavar = "N",
     .help = "weight seed"},
    {0},
};
#undef O

static int synth_main(int argc, char **argv);

const cli_command cli_cmd_synth = {
    .name = "synth",
    .summary = "write a random-weight GGUF of a real model's shape, or inflate a small model to it",
    .synopsis = "--shape NAME --type TYPE -o FILE.gguf [options]",
    .about = "Writes a random-weight GGUF with a real model's shape and a real vocabulary (padded with\n"
             "unused filler tokens to the model's vocabulary size, so the embedding and classifier cost\n"
             "what they really cost). Other GGUF engines load the file too. The _M mixes write the\n"
             "classifier and the sensitive attn_v / ffn_down layers in Q6_K, Q4_0 the classifier, as blade\n"
             "quantize does.\n\n"
             "With --from SMALL.gguf (a llama model) the file instead computes SMALL's function in the\n"
             "shape's layers, heads and widths: each step costs what the shape costs, and the text is\n"
             "SMALL's (vocabulary and tokenizer are SMALL's; every weight SMALL does not fill is noise).\n",
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
    if (o.from && vocab)
        return cli_usage_error(&cli_cmd_synth, "--from keeps its model's vocabulary; --vocab does not apply");
    if (!o.from && o.noise >= 0.0)
        return cli_usage_error(&cli_cmd_synth, "--noise applies to --from only");
    blade_synth_spec spec = {0};
    const char *shape_vocab;
    if (blade_synth_shape(shape, &spec, &shape_vocab)) {
        fprintf(stderr, "error: unknown shape '%s' (known: %s)\n", shape, blade_synth_shape_names());
        return 2;
    }
    spec.scheme = *scheme;
    spec.seed = (uint64_t)o.seed;
    if (o.from)
        return inflate(&spec, shape, scheme->name, o.from, o.noise >= 0.0 ? (float)o.noise : BLADE_SYNTH_DEFAULT_NOISE,
                       out);
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

/* `blade synth`: writes a random-weight model of a real model's shape, or inflates a small
 * real model to that shape (--from). */
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
            "With --from SMALL.gguf (a llama model) the file instead computes SMALL's function in the\n"
            "shape's layers, heads and widths: each step costs what the shape costs, and the text is\n"
            "SMALL's (vocabulary and tokenizer are SMALL's; every weight SMALL does not fill is noise).\n\n"
            "  --shape NAME     %s\n"
            "  --type TYPE      F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, or the mixes Q4_K_M / Q5_K_M\n"
            "                   (classifier and the sensitive attn_v/ffn_down layers in Q6_K)\n"
            "  -o, --output F   file to write\n"
            "  --vocab FILE     vocabulary GGUF to borrow (default: the shape's, from ../shared/vocab)\n"
            "  --from FILE      inflate this llama GGUF to the shape instead of drawing random weights\n"
            "  --noise X        with --from: standard deviation of the weights FILE does not fill\n"
            "                   (default %g; 0 keeps FILE's logits to float rounding)\n"
            "  --seed N         weight seed (default 1)\n"
            "  -h, --help       this help\n",
            blade_synth_shape_names(), BLADE_SYNTH_DEFAULT_NOISE);
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

int cmd_synth(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"shape", required_argument, 0, 's'}, {"type", required_argument, 0, 't'},
        {"output", required_argument, 0, 'o'}, {"vocab", required_argument, 0, 'v'},
        {"seed", required_argument, 0, 'S'},  {"from", required_argument, 0, 'f'},
        {"noise", required_argument, 0, 'n'}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *shape = NULL, *type = NULL, *out = NULL, *vocab = NULL, *from = NULL;
    long long seed = 1;
    double noise = -1.0;
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
        case 'f': from = optarg; break;
        case 'n':
            if (!cli_parse_float("--noise", optarg, 0.0, 1.0, &noise))
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
    if (from && vocab) {
        fprintf(stderr, "error: --from keeps its model's vocabulary; --vocab does not apply\n");
        return 2;
    }
    if (!from && noise >= 0.0) {
        fprintf(stderr, "error: --noise applies to --from only\n");
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
    if (from)
        return inflate(&spec, shape, type, from, noise >= 0.0 ? (float)noise : BLADE_SYNTH_DEFAULT_NOISE, out);
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

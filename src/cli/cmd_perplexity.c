#include "blade/forward.h"
#include "blade/model.h"
#include "blade/sampler.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void perplexity_usage(FILE *out)
{
    fprintf(out,
            "usage: blade perplexity -m MODEL -f TEXT [-c CTX]\n\n"
            "Perplexity by the llama.cpp method: the whole text is tokenized once with BOS first and cut\n"
            "into non-overlapping chunks of CTX tokens (the remainder dropped). Each chunk is evaluated\n"
            "from an empty context with its first token replaced by BOS, and the predictions at positions\n"
            "CTX/2 .. CTX-2 are scored against the token that follows each.\n\n"
            "  -m, --model FILE     GGUF model (default: ../shared/models/stories260K.gguf if present)\n"
            "  -f, --file FILE      text to score\n"
            "  -c, --ctx-size N     chunk length in tokens (default 512)\n"
            "      --chunks N       score at most N chunks (default: all)\n"
            "  -h, --help           this help\n");
}

int cmd_perplexity(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},   {"file", required_argument, 0, 'f'},
        {"ctx-size", required_argument, 0, 'c'}, {"chunks", required_argument, 0, 'k'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0},
    };
    const char *model_path = cli_default_model(), *text_path = NULL;
    long long n_ctx = 512, max_chunks = -1;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:f:c:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'f': text_path = optarg; break;
        case 'c':
            if (!cli_parse_int("-c", optarg, 4, 1 << 20, &n_ctx))
                return 2;
            break;
        case 'k':
            if (!cli_parse_int("--chunks", optarg, 1, 1 << 30, &max_chunks))
                return 2;
            break;
        case 'h': perplexity_usage(stdout); return 0;
        default: perplexity_usage(stderr); return 2;
        }
    }
    if (!model_path || !text_path || optind < argc) {
        perplexity_usage(stderr);
        return 2;
    }
    size_t text_len;
    char *text = cli_read_file(text_path, &text_len);
    if (!text)
        return 1;

    blade_error err = {{0}};
    int rc = 1;
    int32_t *tokens = NULL;
    size_t n_tokens = 0;
    blade_forward *fw = NULL;
    float *logprobs = NULL;
    blade_model *m = blade_model_load(model_path, &err);
    if (!m)
        goto done;
    int32_t bos = blade_tokenizer_bos(m->tokenizer);
    if (bos < 0) {
        blade_error_set(&err, "the model's vocabulary has no BOS token, which this method needs");
        goto done;
    }
    if (blade_tokenizer_encode(m->tokenizer, text, text_len, true, false, &tokens, &n_tokens, &err))
        goto done;
    size_t n_chunks = n_tokens / (size_t)n_ctx;
    if (max_chunks > 0 && n_chunks > (size_t)max_chunks)
        n_chunks = (size_t)max_chunks;
    if (n_chunks == 0) {
        blade_error_set(&err, "%s has %zu tokens, fewer than one chunk of %lld", text_path, n_tokens, n_ctx);
        goto done;
    }
    fw = blade_forward_new(m, (int32_t)n_ctx, &err);
    logprobs = malloc((size_t)m->hp.n_vocab * sizeof *logprobs);
    if (!fw || !logprobs)
        goto done;
    fprintf(stderr, "%zu tokens, %zu chunks of %lld\n", n_tokens, n_chunks, n_ctx);

    bool tty = isatty(STDERR_FILENO);
    double nll = 0.0, nll2 = 0.0;
    size_t count = 0;
    int32_t first = (int32_t)(n_ctx / 2);
    double t0 = cli_now();
    for (size_t ch = 0; ch < n_chunks; ch++) {
        const int32_t *chunk = tokens + ch * (size_t)n_ctx;
        for (int32_t j = 0; j < n_ctx - 1; j++) {
            int32_t tok = j == 0 ? bos : chunk[j];
            bool score = j >= first;
            if (blade_forward_token(fw, tok, j, score, &err))
                goto done;
            if (score) {
                blade_logits_to_logprobs(blade_forward_logits(fw), m->hp.n_vocab, logprobs);
                double v = -(double)logprobs[chunk[j + 1]];
                nll += v;
                nll2 += v * v;
                count++;
            }
        }
        if (tty)
            fprintf(stderr, "\r[%zu/%zu] running PPL = %.4f  ", ch + 1, n_chunks, exp(nll / (double)count));
    }
    if (tty)
        fputc('\n', stderr);
    double mean = nll / (double)count;
    double var = nll2 / (double)count - mean * mean;
    double stderr_ppl = exp(mean) * sqrt(var > 0 ? var / (double)(count - 1 ? count - 1 : 1) : 0);
    fprintf(stderr, "%zu predictions in %.2f s\n", count, cli_now() - t0);
    printf("PPL = %.4f +/- %.4f\n", exp(mean), stderr_ppl);
    rc = 0;
done:
    if (rc)
        fprintf(stderr, "error: %s\n", err.msg);
    free(logprobs);
    blade_forward_free(fw);
    free(tokens);
    blade_model_free(m);
    free(text);
    return rc;
}

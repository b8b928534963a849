#include "blade/forward.h"
#include "blade/model.h"
#include "blade/sampler.h"
#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void run_usage(FILE *out)
{
    fprintf(out,
            "usage: blade run -m MODEL (-p PROMPT | -f FILE) [options]\n\n"
            "Generates text from a prompt and streams it as it is produced; timing goes to stderr.\n\n"
            "  -m, --model FILE         GGUF model (default: ../shared/models/stories260K.gguf if present)\n"
            "  -p, --prompt TEXT        prompt text\n"
            "  -f, --file FILE          read the prompt from FILE\n"
            "  -n, --n-predict N        tokens to generate (default 128)\n"
            "  -c, --ctx-size N         context length (default: the model's, at most 4096)\n"
            "      --temp T             temperature; 0 = greedy (default 0.8)\n"
            "      --top-k K            keep the K most likely tokens; 0 = off (default 40)\n"
            "      --top-p P            nucleus sampling; 1 = off (default 0.95)\n"
            "      --min-p P            drop tokens below P x the top probability; 0 = off (default 0.05)\n"
            "      --repeat-penalty R   penalise recent tokens; 1 = off (default 1)\n"
            "      --repeat-last-n N    window of the repeat penalty, -1 = all (default 64)\n"
            "      --presence-penalty X OpenAI presence penalty (default 0)\n"
            "      --frequency-penalty X OpenAI frequency penalty (default 0)\n"
            "      --seed S             random seed for reproducible sampling (default: from the clock)\n"
            "      --ignore-eos         keep generating past end-of-generation tokens\n"
            "      --parse-special      treat special-token text in the prompt (e.g. <|im_start|>) as tokens\n"
            "      --no-bos             do not start the prompt with BOS\n"
            "  -h, --help               this help\n");
}

enum {
    OPT_TEMP = 256,
    OPT_TOP_K,
    OPT_TOP_P,
    OPT_MIN_P,
    OPT_REPEAT_PENALTY,
    OPT_REPEAT_LAST_N,
    OPT_PRESENCE,
    OPT_FREQUENCY,
    OPT_SEED,
    OPT_IGNORE_EOS,
    OPT_PARSE_SPECIAL,
    OPT_NO_BOS,
};

typedef struct run_options {
    const char *model;
    const char *prompt;
    const char *prompt_file;
    long long n_predict;
    long long n_ctx;
    bool ignore_eos;
    bool parse_special;
    bool no_bos;
    blade_sampling_params sampling;
} run_options;

static int parse_run_options(int argc, char **argv, run_options *o)
{
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"prompt", required_argument, 0, 'p'},
        {"file", required_argument, 0, 'f'},
        {"n-predict", required_argument, 0, 'n'},
        {"ctx-size", required_argument, 0, 'c'},
        {"temp", required_argument, 0, OPT_TEMP},
        {"top-k", required_argument, 0, OPT_TOP_K},
        {"top-p", required_argument, 0, OPT_TOP_P},
        {"min-p", required_argument, 0, OPT_MIN_P},
        {"repeat-penalty", required_argument, 0, OPT_REPEAT_PENALTY},
        {"repeat-last-n", required_argument, 0, OPT_REPEAT_LAST_N},
        {"presence-penalty", required_argument, 0, OPT_PRESENCE},
        {"frequency-penalty", required_argument, 0, OPT_FREQUENCY},
        {"seed", required_argument, 0, OPT_SEED},
        {"ignore-eos", no_argument, 0, OPT_IGNORE_EOS},
        {"parse-special", no_argument, 0, OPT_PARSE_SPECIAL},
        {"no-bos", no_argument, 0, OPT_NO_BOS},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    blade_sampling_params_default(&o->sampling);
    o->model = cli_default_model();
    o->n_predict = 128;
    o->sampling.seed = (uint64_t)time(NULL);
    double x;
    long long n;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:p:f:n:c:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'p': o->prompt = optarg; break;
        case 'f': o->prompt_file = optarg; break;
        case 'n':
            if (!cli_parse_int("-n", optarg, 0, 1 << 24, &o->n_predict))
                return 2;
            break;
        case 'c':
            if (!cli_parse_int("-c", optarg, 1, 1 << 24, &o->n_ctx))
                return 2;
            break;
        case OPT_TEMP:
            if (!cli_parse_float("--temp", optarg, 0, 100, &x))
                return 2;
            o->sampling.temperature = (float)x;
            break;
        case OPT_TOP_K:
            if (!cli_parse_int("--top-k", optarg, 0, 1 << 30, &n))
                return 2;
            o->sampling.top_k = (int32_t)n;
            break;
        case OPT_TOP_P:
            if (!cli_parse_float("--top-p", optarg, 0, 1, &x))
                return 2;
            o->sampling.top_p = (float)x;
            break;
        case OPT_MIN_P:
            if (!cli_parse_float("--min-p", optarg, 0, 1, &x))
                return 2;
            o->sampling.min_p = (float)x;
            break;
        case OPT_REPEAT_PENALTY:
            if (!cli_parse_float("--repeat-penalty", optarg, 0.01, 100, &x))
                return 2;
            o->sampling.repeat_penalty = (float)x;
            break;
        case OPT_REPEAT_LAST_N:
            if (!cli_parse_int("--repeat-last-n", optarg, -1, 1 << 24, &n))
                return 2;
            o->sampling.repeat_last_n = (int32_t)n;
            break;
        case OPT_PRESENCE:
            if (!cli_parse_float("--presence-penalty", optarg, -2, 2, &x))
                return 2;
            o->sampling.presence_penalty = (float)x;
            break;
        case OPT_FREQUENCY:
            if (!cli_parse_float("--frequency-penalty", optarg, -2, 2, &x))
                return 2;
            o->sampling.frequency_penalty = (float)x;
            break;
        case OPT_SEED:
            if (!cli_parse_int("--seed", optarg, 0, INT64_MAX, &n))
                return 2;
            o->sampling.seed = (uint64_t)n;
            break;
        case OPT_IGNORE_EOS: o->ignore_eos = true; break;
        case OPT_PARSE_SPECIAL: o->parse_special = true; break;
        case OPT_NO_BOS: o->no_bos = true; break;
        case 'h': run_usage(stdout); return 0;
        default: run_usage(stderr); return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "error: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (!o->model) {
        fprintf(stderr, "error: no model given (-m FILE) and ../shared/models/stories260K.gguf is absent\n");
        return 2;
    }
    if (!o->prompt == !o->prompt_file) {
        fprintf(stderr, "error: give exactly one of -p PROMPT or -f FILE\n");
        return 2;
    }
    return -1;
}

/* Writes a token's text as soon as it forms whole UTF-8 characters. */
static void emit(blade_detokenizer *d, int32_t id, char *buf, size_t cap)
{
    size_t n = blade_detokenizer_push(d, id, buf, cap);
    if (n) {
        fwrite(buf, 1, n, stdout);
        fflush(stdout);
    }
}

int cmd_run(int argc, char **argv)
{
    run_options o = {0};
    int rc = parse_run_options(argc, argv, &o);
    if (rc >= 0)
        return rc;

    char *file_prompt = NULL;
    size_t prompt_len;
    if (o.prompt_file) {
        file_prompt = cli_read_file(o.prompt_file, &prompt_len);
        if (!file_prompt)
            return 1;
    } else {
        prompt_len = strlen(o.prompt);
    }
    const char *prompt = file_prompt ? file_prompt : o.prompt;

    double t_load = cli_now();
    blade_error err = {{0}};
    blade_model *m = blade_model_load(o.model, &err);
    if (!m) {
        fprintf(stderr, "error: %s\n", err.msg);
        free(file_prompt);
        return 1;
    }
    int32_t n_ctx = (int32_t)(o.n_ctx ? o.n_ctx : (m->hp.n_ctx_train < 4096 ? m->hp.n_ctx_train : 4096));
    blade_forward *fw = blade_forward_new(m, n_ctx, &err);
    t_load = cli_now() - t_load;

    int32_t *tokens = NULL;
    size_t n_prompt = 0;
    blade_sampler *sampler = NULL;
    char *text = NULL;
    rc = 1;
    if (!fw)
        goto done;
    bool add_bos = !o.no_bos && blade_tokenizer_wants_bos(m->tokenizer);
    if (blade_tokenizer_encode(m->tokenizer, prompt, prompt_len, add_bos, o.parse_special, &tokens, &n_prompt,
                               &err))
        goto done;
    if (n_prompt == 0) {
        blade_error_set(&err, "the prompt is empty after tokenization");
        goto done;
    }
    if (n_prompt + (size_t)o.n_predict > (size_t)n_ctx) {
        blade_error_set(&err, "prompt (%zu tokens) + %lld to generate exceed the context of %d tokens", n_prompt,
                        o.n_predict, n_ctx);
        goto done;
    }
    if (blade_sampling_params_validate(&o.sampling, &err))
        goto done;
    sampler = blade_sampler_new(&o.sampling, m->hp.n_vocab);
    size_t cap = blade_tokenizer_max_token_bytes(m->tokenizer) + 16;
    text = malloc(cap);
    if (!sampler || !text) {
        blade_error_set(&err, "out of memory");
        goto done;
    }

    blade_detokenizer detok;
    blade_detokenizer_init(&detok, m->tokenizer, false);
    double t_prompt = cli_now();
    for (size_t i = 0; i < n_prompt; i++) {
        if (blade_forward_token(fw, tokens[i], (int32_t)i, i + 1 == n_prompt, &err))
            goto done;
        blade_sampler_accept(sampler, tokens[i], false);
        emit(&detok, tokens[i], text, cap);
    }
    t_prompt = cli_now() - t_prompt;

    double t_gen = cli_now();
    long long n_gen = 0;
    int32_t pos = (int32_t)n_prompt;
    while (n_gen < o.n_predict) {
        int32_t next = blade_sampler_sample(sampler, blade_forward_logits(fw));
        if (next < 0) {
            blade_error_set(&err, "the model produced no usable logits (all NaN or -inf) at position %d", pos);
            goto done;
        }
        n_gen++;
        if (!o.ignore_eos && blade_tokenizer_is_eog(m->tokenizer, next))
            break;
        blade_sampler_accept(sampler, next, true);
        emit(&detok, next, text, cap);
        if (n_gen == o.n_predict)
            break;
        if (blade_forward_token(fw, next, pos++, true, &err))
            goto done;
    }
    size_t tail = blade_detokenizer_flush(&detok, text, cap);
    fwrite(text, 1, tail, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    t_gen = cli_now() - t_gen;

    fprintf(stderr, "\nload: %.1f ms | prompt: %zu tokens, %.1f tokens/s | generation: %lld tokens, %.1f tokens/s\n",
            t_load * 1e3, n_prompt, n_prompt / (t_prompt > 0 ? t_prompt : 1e-9), n_gen,
            n_gen / (t_gen > 0 ? t_gen : 1e-9));
    rc = 0;
done:
    if (rc)
        fprintf(stderr, "error: %s\n", err.msg);
    free(text);
    blade_sampler_free(sampler);
    free(tokens);
    blade_forward_free(fw);
    blade_model_free(m);
    free(file_prompt);
    return rc;
}

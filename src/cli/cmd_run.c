#include "blade/engine.h"
#include "blade/model.h"
#include "blade/sampler.h"
#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"

#include <getopt.h>
#include <pthread.h>
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
            "  -h, --help               this help\n\n");
    cli_engine_usage(out);
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
    cli_engine_options engine;
    bool ignore_eos;
    bool parse_special;
    bool no_bos;
    blade_sampling_params sampling;
} run_options;

static int parse_with(int argc, char **argv, run_options *o, const struct option *longopts);

static int parse_run_options(int argc, char **argv, run_options *o)
{
    static const struct option own[] = {
        {"model", required_argument, 0, 'm'},
        {"prompt", required_argument, 0, 'p'},
        {"file", required_argument, 0, 'f'},
        {"n-predict", required_argument, 0, 'n'},
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
    };
    struct option *longopts = cli_merge_longopts(own, sizeof own / sizeof own[0]);
    int rc = parse_with(argc, argv, o, longopts);
    free(longopts);
    return rc;
}

static int parse_with(int argc, char **argv, run_options *o, const struct option *longopts)
{
    cli_engine_options_init(&o->engine);
    blade_sampling_params_default(&o->sampling);
    o->model = cli_default_model();
    o->n_predict = 128;
    o->sampling.seed = (uint64_t)time(NULL);
    double x;
    long long n;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:p:f:n:c:t:h", longopts, NULL)) != -1) {
        int handled = cli_engine_option(&o->engine, c, optarg);
        if (handled < 0)
            return 2;
        if (handled)
            continue;
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'p': o->prompt = optarg; break;
        case 'f': o->prompt_file = optarg; break;
        case 'n':
            if (!cli_parse_int("-n", optarg, 0, 1 << 24, &o->n_predict))
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

/* Streams each released piece of text the moment the engine hands it over. */
typedef struct run_state {
    pthread_mutex_t mu;
    pthread_cond_t done_cv;
    bool done;
    blade_token_event last;
    char error[512];
    double t_first, t_last;
    int32_t n_tokens;
} run_state;

static void on_token(const blade_token_event *ev)
{
    run_state *s = ev->user;
    if (ev->text_len) {
        fwrite(ev->text, 1, ev->text_len, stdout);
        fflush(stdout);
    }
    pthread_mutex_lock(&s->mu);
    if (ev->token >= 0) {
        double t = cli_now();
        if (s->n_tokens++ == 0)
            s->t_first = t;
        s->t_last = t;
    }
    if (ev->finish != BLADE_FINISH_NONE) {
        s->last = *ev;
        if (ev->error)
            snprintf(s->error, sizeof s->error, "%s", ev->error);
        s->done = true;
        pthread_cond_signal(&s->done_cv);
    }
    pthread_mutex_unlock(&s->mu);
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
    blade_engine *e = NULL;
    rc = 1;
    blade_model *m = blade_model_load(o.model, &err);
    if (!m)
        goto done;
    cli_engine_finalize(&o.engine, m);
    if (o.n_predict == 0) {
        rc = 0;
        goto done;
    }
    if (blade_sampling_params_validate(&o.sampling, &err))
        goto done;
    /* one sequence: a small KV pool covering the context is all it needs */
    blade_kv_store_config store_cfg = blade_model_kv_config(&m->hp, o.engine.cfg.kv_type, o.engine.cfg.block_size, 0);
    size_t block_bytes = blade_kv_store_block_bytes(&store_cfg);
    size_t need = ((size_t)o.engine.cfg.max_context / (size_t)o.engine.cfg.block_size + 2) * block_bytes;
    if (o.engine.cfg.kv_mem_bytes > need)
        o.engine.cfg.kv_mem_bytes = need;
    e = blade_engine_new(m, &o.engine.cfg, &err);
    if (!e)
        goto done;
    t_load = cli_now() - t_load;

    run_state st = {.mu = PTHREAD_MUTEX_INITIALIZER, .done_cv = PTHREAD_COND_INITIALIZER};
    blade_request q;
    blade_request_default(&q);
    q.prompt_text = prompt;
    q.prompt_text_len = prompt_len;
    q.add_bos = !o.no_bos;
    q.parse_special = o.parse_special;
    q.sampling = o.sampling;
    q.max_tokens = (int32_t)o.n_predict;
    q.ignore_eos = o.ignore_eos;
    q.callback = on_token;
    q.user = &st;
    fwrite(prompt, 1, prompt_len, stdout);
    fflush(stdout);
    if (!blade_engine_submit(e, &q, &err))
        goto done;
    pthread_mutex_lock(&st.mu);
    while (!st.done)
        pthread_cond_wait(&st.done_cv, &st.mu);
    pthread_mutex_unlock(&st.mu);
    fputc('\n', stdout);
    fflush(stdout);
    if (st.last.finish == BLADE_FINISH_ERROR) {
        blade_error_set(&err, "%s", st.error);
        goto done;
    }
    double prefill = st.last.ttft_seconds - st.last.queue_seconds;
    double gen = st.t_last - st.t_first;
    fprintf(stderr,
            "\nload: %.1f ms | prompt: %d tokens, %.1f tokens/s | generation: %d tokens, %.1f tokens/s | seed %llu\n",
            t_load * 1e3, st.last.prompt_tokens, st.last.prompt_tokens / (prefill > 0 ? prefill : 1e-9),
            st.last.completion_tokens, st.n_tokens > 1 ? (st.n_tokens - 1) / (gen > 0 ? gen : 1e-9) : 0.0,
            (unsigned long long)o.sampling.seed);
    cli_engine_print_spec(stderr, e);
    rc = 0;
done:
    if (rc)
        fprintf(stderr, "error: %s\n", err.msg);
    blade_engine_free(e, false);
    blade_model_free(m);
    free(file_prompt);
    return rc;
}

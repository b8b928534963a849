/* `blade run`: generates text from a prompt through the engine, streaming it. */

#include "blade/engine.h"
#include "blade/model.h"
#include "blade/sampler.h"
#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"

#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

static void run_init(void *opts)
{
    run_options *o = opts;
    o->model = cli_default_model();
    o->n_predict = 128;
    blade_sampling_params_default(&o->sampling);
    o->sampling.seed = (uint64_t)time(NULL);
    cli_engine_options_init(&o->engine);
}

#define R run_options
static const cli_flag run_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(R, model), .metavar = "FILE",
     .dflt = "../shared/models/stories260K.gguf if present", .help = "GGUF model"},
    {.name = "prompt", .letter = 'p', .kind = CLI_STRING, CLI_AT(R, prompt), .empty_ok = true, .metavar = "TEXT",
     .help = "prompt text"},
    {.name = "file", .letter = 'f', .kind = CLI_PATH, CLI_AT(R, prompt_file), .metavar = "FILE",
     .help = "read the prompt from FILE"},
    {.name = "n-predict", .letter = 'n', .kind = CLI_INT, CLI_AT(R, n_predict), .min = 0, .max = 1 << 24,
     .metavar = "N", .help = "tokens to generate"},
    {.name = "ignore-eos", .kind = CLI_BOOL, CLI_AT(R, ignore_eos),
     .help = "keep generating past end-of-generation tokens"},
    {.name = "parse-special", .kind = CLI_BOOL, CLI_AT(R, parse_special),
     .help = "treat special-token text in the prompt (e.g. <|im_start|>) as tokens"},
    {.name = "no-bos", .kind = CLI_BOOL, CLI_AT(R, no_bos), .help = "do not start the prompt with BOS"},
    CLI_SECTION("sampling"),
    {.name = "temp", .kind = CLI_DOUBLE, CLI_AT(R, sampling.temperature), .min = 0, .max = 100, .metavar = "T",
     .help = "temperature; 0 = greedy"},
    {.name = "top-k", .kind = CLI_INT, CLI_AT(R, sampling.top_k), .min = 0, .max = 1 << 30, .metavar = "K",
     .help = "keep the K most likely tokens; 0 = off"},
    {.name = "top-p", .kind = CLI_DOUBLE, CLI_AT(R, sampling.top_p), .min = 0, .max = 1, .metavar = "P",
     .help = "nucleus sampling; 1 = off"},
    {.name = "min-p", .kind = CLI_DOUBLE, CLI_AT(R, sampling.min_p), .min = 0, .max = 1, .metavar = "P",
     .help = "drop tokens below P x the top probability; 0 = off"},
    {.name = "repeat-penalty", .kind = CLI_DOUBLE, CLI_AT(R, sampling.repeat_penalty), .min = 0.01, .max = 100,
     .metavar = "R", .help = "penalise recent tokens; 1 = off"},
    {.name = "repeat-last-n", .kind = CLI_INT, CLI_AT(R, sampling.repeat_last_n), .min = -1, .max = 1 << 24,
     .metavar = "N", .help = "window of the repeat penalty; -1 = all"},
    {.name = "presence-penalty", .kind = CLI_DOUBLE, CLI_AT(R, sampling.presence_penalty), .min = -2, .max = 2,
     .metavar = "X", .help = "OpenAI presence penalty"},
    {.name = "frequency-penalty", .kind = CLI_DOUBLE, CLI_AT(R, sampling.frequency_penalty), .min = -2, .max = 2,
     .metavar = "X", .help = "OpenAI frequency penalty"},
    {.name = "seed", .kind = CLI_INT, CLI_AT(R, sampling.seed), .min = 0, .max = CLI_INT64_MAX, .metavar = "S",
     .dflt = "from the clock", .help = "random seed for reproducible sampling"},
    {0},
};
#undef R

static int run_main(int argc, char **argv);

const cli_command cli_cmd_run = {
    .name = "run",
    .summary = "generate text from a prompt, streaming it as it is produced",
    .synopsis = "-m MODEL (-p PROMPT | -f FILE) [options]",
    .about = "Generates text from a prompt and streams it as it is produced; timing goes to stderr.\n",
    .tables = (const cli_table[]){{run_flags, 0}, {cli_engine_flags, offsetof(run_options, engine)}, {0}},
    .opts_size = sizeof(run_options),
    .init = run_init,
    .main = run_main,
};

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

static int run_main(int argc, char **argv)
{
    run_options o;
    int rc = cli_parse(&cli_cmd_run, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    if (!o.model)
        return cli_usage_error(&cli_cmd_run,
                               "no model given (-m FILE) and ../shared/models/stories260K.gguf is absent");
    if (!o.prompt == !o.prompt_file)
        return cli_usage_error(&cli_cmd_run, "give exactly one of -p PROMPT or -f FILE");

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
    rc = 0;
done:
    if (rc)
        fprintf(stderr, "error: %s\n", err.msg);
    blade_engine_free(e, false);
    blade_model_free(m);
    free(file_prompt);
    return rc;
}

/* Embedding blade in a C program: load a GGUF model, start an engine, submit one greedy
 * request and print what it generates. It links only the core library (CMake target
 * blade_core, libblade.a: no HTTP server, no HTTP client) and uses only the public headers
 * under include/blade/.
 *
 *   embed MODEL.gguf PROMPT [MAX_TOKENS]
 *
 * prints the prompt followed by its continuation, as `blade run --temp 0` does. */

#include "blade/engine.h"
#include "blade/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What the request's events leave behind. The engine thread calls on_event, and
 * blade_engine_wait_idle returns after the last call, so main reads it without a lock. */
typedef struct generation {
    char *text;
    size_t len, cap;
    bool out_of_memory;
    blade_finish_reason finish;
    char error[256];
} generation;

/* Runs on the engine thread, which serves every request in turn: keep it short. */
static void on_event(const blade_token_event *ev)
{
    generation *g = ev->user;
    if (g->len + ev->text_len + 1 > g->cap) {
        size_t cap = (g->len + ev->text_len + 1) * 2;
        char *grown = realloc(g->text, cap);
        if (!grown) {
            g->out_of_memory = true;
            return;
        }
        g->text = grown;
        g->cap = cap;
    }
    memcpy(g->text + g->len, ev->text, ev->text_len);
    g->len += ev->text_len;
    g->text[g->len] = 0;
    if (ev->finish != BLADE_FINISH_NONE) {
        g->finish = ev->finish;
        if (ev->error)
            snprintf(g->error, sizeof g->error, "%s", ev->error);
    }
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPT [MAX_TOKENS]\n", argv[0]);
        return 2;
    }
    int max_tokens = argc == 4 ? atoi(argv[3]) : 64;
    if (max_tokens < 1) {
        fprintf(stderr, "MAX_TOKENS must be a positive number, got '%s'\n", argv[3]);
        return 2;
    }

    blade_error err = {{0}};
    blade_model *model = blade_model_load(argv[1], &err);
    if (!model) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    blade_engine_config cfg;
    blade_engine_config_default(&cfg);
    cfg.kv_mem_bytes = (size_t)64 << 20; /* plenty for one short request */
    blade_engine *engine = blade_engine_new(model, &cfg, &err);
    if (!engine) {
        fprintf(stderr, "%s\n", err.msg);
        blade_model_free(model);
        return 1;
    }

    generation g = {0};
    blade_request req;
    blade_request_default(&req);
    req.prompt_text = argv[2];
    req.prompt_text_len = strlen(argv[2]);
    req.max_tokens = max_tokens;
    req.sampling.temperature = 0; /* greedy */
    req.callback = on_event;
    req.user = &g;
    int status = 0;
    if (!blade_engine_submit(engine, &req, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        status = 1;
    } else {
        blade_engine_wait_idle(engine);
        if (g.out_of_memory || g.finish == BLADE_FINISH_ERROR || g.finish == BLADE_FINISH_ABORT) {
            fprintf(stderr, "generation failed: %s\n",
                    g.out_of_memory ? "out of memory" : g.error[0] ? g.error : blade_finish_reason_name(g.finish));
            status = 1;
        } else {
            printf("%s%s\n", argv[2], g.text ? g.text : "");
        }
    }
    free(g.text);
    blade_engine_free(engine, false);
    blade_model_free(model);
    return status;
}

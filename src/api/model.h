#ifndef BLADE_API_MODEL_H
#define BLADE_API_MODEL_H

/* The served model as the OpenAI protocol sees it: the names a request may use, the chat
 * template, the system fingerprint and the /v1/models objects. */

#include "blade/chat_template.h"
#include "blade/engine.h"

#include <jansson.h>
#include <stdbool.h>

typedef struct api_model {
    blade_engine *engine;
    const blade_model *model;
    blade_template *chat_template; /* NULL: chat requests are refused with chat_template_error */
    char chat_template_error[1024];
    char *names[3];                /* accepted in `model`; names[0] is the id /v1/models lists */
    int n_names;
    char fingerprint[32];          /* system_fingerprint */
    long long created;             /* when the server started, for /v1/models */
    bool batch_class;              /* every request runs in the batch traffic class */
    /* Where /v1/embeddings runs: the served model's engine unless --embed-model gave one of
     * its own (api_model_set_embedder), and how it pools. */
    blade_engine *embed_engine;
    const blade_model *embed_model;
    blade_pooling pooling;
} api_model;

/* Names the model after alias (if any), the path as given and its file name; reads the chat
 * template from template_file or, without one, from the model's tokenizer.chat_template. A
 * template file that cannot be read or parsed is an error; a model's own template that
 * cannot be parsed only disables chat (the reason is kept for the 400). */
int api_model_init(api_model *am, blade_engine *e, const char *model_path, const char *alias,
                   const char *template_file, blade_error *err);
void api_model_destroy(api_model *am);
/* Embeddings from another engine (--embed-model) than the one that generates. */
void api_model_set_embedder(api_model *am, blade_engine *e);
/* Whether `name` is one of the model's names. */
bool api_model_matches(const api_model *am, const char *name);
/* The /v1/models list, or one model object when id is non-NULL (NULL when unknown). */
json_t *api_models_json(const api_model *am, const char *id);

#endif

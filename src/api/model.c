/* The served model as the protocol presents it (model.h): the names a request may use,
 * the system fingerprint (a digest of the model's metadata and tensor table, so it changes
 * when the model does), the chat template from --chat-template or the model's metadata,
 * and the /v1/models objects. */

#include "api/model.h"

#include "common/file.h"

#include "blade/gguf.h"
#include "blade/model.h"

#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int add_name(api_model *am, const char *name)
{
    if (!name || !*name || api_model_matches(am, name))
        return 0;
    if (!(am->names[am->n_names] = strdup(name)))
        return -1;
    am->n_names++;
    return 0;
}

int api_model_init(api_model *am, blade_engine *e, const char *model_path, const char *alias,
                   const char *template_file, blade_error *err)
{
    memset(am, 0, sizeof *am);
    am->engine = e;
    am->model = blade_engine_model(e);
    api_model_set_embedder(am, e);
    am->pooling = BLADE_POOL_MODEL;
    am->created = (long long)time(NULL);
    const char *base = strrchr(model_path, '/');
    base = base ? base + 1 : model_path;
    if (add_name(am, alias) || add_name(am, base) || add_name(am, model_path)) {
        api_model_destroy(am);
        return blade_error_set(err, "out of memory");
    }

    /* The fingerprint changes with the model (its metadata and tensor table), as OpenAI's
     * changes with the backend configuration. */
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int dlen = 0;
    const gguf_file *f = am->model->file;
    EVP_Digest(f->map, f->data_offset, digest, &dlen, EVP_sha256(), NULL);
    snprintf(am->fingerprint, sizeof am->fingerprint, "fp_%02x%02x%02x%02x%02x", digest[0], digest[1], digest[2],
             digest[3], digest[4]);

    char *source;
    size_t len;
    const char *origin;
    if (template_file) {
        source = blade_read_file(template_file, &len, err);
        if (!source) {
            api_model_destroy(am);
            return blade_error_prefix(err, "--chat-template");
        }
        origin = template_file;
    } else {
        bool present = false;
        blade_error gerr = {{0}};
        source = gguf_get_string(f, "tokenizer.chat_template", &present, &gerr);
        if (!source && present) {
            snprintf(am->chat_template_error, sizeof am->chat_template_error,
                     "the model's tokenizer.chat_template is unusable (%s); start the server with "
                     "--chat-template FILE, or use /v1/completions",
                     gerr.msg);
            return 0;
        }
        if (!source) {
            snprintf(am->chat_template_error, sizeof am->chat_template_error,
                     "this model has no chat template (tokenizer.chat_template); start the server with "
                     "--chat-template FILE, or use /v1/completions");
            return 0;
        }
        len = strlen(source);
        origin = "tokenizer.chat_template";
    }
    blade_error terr = {{0}};
    am->chat_template = blade_template_parse(source, len, &terr);
    free(source);
    if (!am->chat_template) {
        if (template_file) {
            api_model_destroy(am);
            return blade_error_set(err, "--chat-template %s: %s", template_file, terr.msg);
        }
        snprintf(am->chat_template_error, sizeof am->chat_template_error,
                 "the model's chat template (%s) cannot be parsed: %s; start the server with --chat-template FILE",
                 origin, terr.msg);
    }
    return 0;
}

void api_model_destroy(api_model *am)
{
    for (int i = 0; i < am->n_names; i++)
        free(am->names[i]);
    blade_template_free(am->chat_template);
    memset(am, 0, sizeof *am);
}

bool api_model_matches(const api_model *am, const char *name)
{
    for (int i = 0; i < am->n_names; i++)
        if (!strcmp(am->names[i], name))
            return true;
    return false;
}

static json_t *model_object(const api_model *am, const char *id)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:I}", "id", id, "object", "model", "created", (json_int_t)am->created,
                     "owned_by", "blade", "max_model_len", (json_int_t)blade_engine_max_context(am->engine));
}

json_t *api_models_json(const api_model *am, const char *id)
{
    if (id)
        return api_model_matches(am, id) ? model_object(am, id) : NULL;
    json_t *data = json_array();
    json_array_append_new(data, model_object(am, am->names[0]));
    return json_pack("{s:s, s:o}", "object", "list", "data", data);
}

void api_model_set_embedder(api_model *am, blade_engine *e)
{
    am->embed_engine = e;
    am->embed_model = blade_engine_model(e);
}

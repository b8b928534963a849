/* `blade template`: renders a chat template for a conversation, as the server would. */

#include "blade/chat_template.h"
#include "blade/gguf.h"
#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "common/file.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The template, BOS and EOS texts of a model file; the token texts only when not given. */
static char *model_template(const char *path, char **bos, char **eos)
{
    blade_error err = {{0}};
    bool present = false;
    char *src = NULL;
    blade_tokenizer *tok = NULL;
    gguf_file *f = gguf_open_mapped(path, &err);
    if (!f) {
        fprintf(stderr, "error: %s\n", err.msg);
        return NULL;
    }
    src = gguf_get_string(f, "tokenizer.chat_template", &present, &err);
    if (!src) {
        if (present)
            fprintf(stderr, "error: %s: %s\n", path, err.msg);
        else
            fprintf(stderr, "error: %s has no tokenizer.chat_template\n", path);
        goto done;
    }
    if (!*bos || !*eos) {
        if (!(tok = blade_tokenizer_load(f, &err))) {
            fprintf(stderr, "error: %s: %s (give --bos-token and --eos-token to skip the tokenizer)\n", path,
                    err.msg);
            free(src);
            src = NULL;
            goto done;
        }
        int32_t ids[2] = {blade_tokenizer_bos(tok), blade_tokenizer_eos(tok)};
        char **dst[2] = {bos, eos};
        for (int i = 0; i < 2; i++)
            if (!*dst[i])
                *dst[i] = strdup(ids[i] >= 0 ? blade_tokenizer_token_text(tok, ids[i]) : "");
    }
done:
    blade_tokenizer_free(tok);
    gguf_close(f);
    return src;
}

typedef struct template_options {
    const char *model, *template_file, *messages_file, *bos, *eos;
    bool gen_prompt;
} template_options;

#define O template_options
static const cli_flag template_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(O, model), .metavar = "FILE",
     .help = "take the template from the GGUF's tokenizer.chat_template; BOS and EOS default to the model's "
             "token texts"},
    {.name = "template", .kind = CLI_PATH, CLI_AT(O, template_file), .metavar = "FILE",
     .help = "take the template from a Jinja source file"},
    {.name = "messages", .letter = 'j', .kind = CLI_PATH, CLI_AT(O, messages_file), .metavar = "FILE.json",
     .required = true,
     .help = "the conversation: a JSON array of messages, or an object whose members (messages, tools, ...) are "
             "all passed to the template"},
    {.name = "add-generation-prompt", .letter = 'g', .kind = CLI_BOOL, CLI_AT(O, gen_prompt),
     .help = "end with the prompt for the assistant's next turn"},
    {.name = "bos-token", .kind = CLI_STRING, CLI_AT(O, bos), .empty_ok = true, .metavar = "S",
     .dflt = "the model's BOS, or empty", .help = "text of bos_token"},
    {.name = "eos-token", .kind = CLI_STRING, CLI_AT(O, eos), .empty_ok = true, .metavar = "S",
     .dflt = "the model's EOS, or empty", .help = "text of eos_token"},
    {0},
};
#undef O

static int template_main(int argc, char **argv);

const cli_command cli_cmd_template = {
    .name = "template",
    .summary = "render a chat template for a conversation",
    .synopsis = "(-m MODEL | --template FILE) --messages FILE.json [options]",
    .about = "Renders a chat template for a conversation and prints the text exactly (no newline is\n"
             "added). A template error, such as raise_exception() for roles that do not alternate, is\n"
             "printed on stderr with exit status 1.\n",
    .tables = (const cli_table[]){{template_flags, 0}, {0}},
    .opts_size = sizeof(template_options),
    .main = template_main,
};

static int template_main(int argc, char **argv)
{
    template_options o;
    int status = cli_parse(&cli_cmd_template, argc, argv, &o);
    if (status != CLI_RUN)
        return status;
    if (!o.model == !o.template_file)
        return cli_usage_error(&cli_cmd_template, "give exactly one of -m MODEL and --template FILE");
    const char *model = o.model, *template_file = o.template_file, *messages_file = o.messages_file;
    bool gen_prompt = o.gen_prompt;
    /* owned copies: a model's token texts replace the ones not given */
    char *bos = o.bos ? strdup(o.bos) : NULL, *eos = o.eos ? strdup(o.eos) : NULL;
    status = 1;
    size_t len = 0;
    char *src = model ? model_template(model, &bos, &eos) : cli_read_file(template_file, &len);
    if (!src)
        goto done;
    if (model)
        len = strlen(src);
    blade_error err = {{0}};
    json_t *doc = blade_read_json(messages_file, &err);
    blade_template *t = NULL;
    char *out = NULL;
    size_t out_len = 0;
    if (!doc) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto cleanup;
    }
    if (!json_is_array(doc) && !json_is_object(doc)) {
        fprintf(stderr, "error: %s: expected a JSON array of messages or an object\n", messages_file);
        goto cleanup;
    }
    if (!(t = blade_template_parse(src, len, &err))) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto cleanup;
    }
    int rc;
    if (json_is_array(doc)) {
        rc = blade_template_render_chat(t, doc, gen_prompt, bos ? bos : "", eos ? eos : "", &out, &out_len, &err);
    } else {
        /* the request-like object is the context; the flags fill in the chat variables */
        json_object_set_new(doc, "add_generation_prompt", json_boolean(gen_prompt));
        if (bos || !json_object_get(doc, "bos_token"))
            json_object_set_new(doc, "bos_token", json_string(bos ? bos : ""));
        if (eos || !json_object_get(doc, "eos_token"))
            json_object_set_new(doc, "eos_token", json_string(eos ? eos : ""));
        rc = blade_template_render(t, doc, &out, &out_len, &err);
    }
    if (rc) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto cleanup;
    }
    status = fwrite(out, 1, out_len, stdout) == out_len && fflush(stdout) == 0 ? 0 : 1;
cleanup:
    free(out);
    blade_template_free(t);
    json_decref(doc);
    free(src);
done:
    free(bos);
    free(eos);
    return status;
}

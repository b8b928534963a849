#include "blade/chat_template.h"
#include "blade/gguf.h"
#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "common/file.h"

#include <getopt.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void template_usage(FILE *out)
{
    fprintf(out,
            "usage: blade template (-m MODEL | --template FILE) --messages FILE.json\n"
            "                      [--add-generation-prompt] [--bos-token S] [--eos-token S]\n\n"
            "Renders a chat template for a conversation and prints the text exactly (no newline is\n"
            "added). A template error, such as raise_exception() for roles that do not alternate, is\n"
            "printed on stderr with exit status 1.\n\n"
            "  -m, --model FILE             take the template from the GGUF's tokenizer.chat_template;\n"
            "                               BOS and EOS default to the model's token texts\n"
            "  -t, --template FILE          take the template from a Jinja source file\n"
            "  -j, --messages FILE.json     the conversation: a JSON array of messages, or an object\n"
            "                               whose members (messages, tools, ...) are all passed to the\n"
            "                               template\n"
            "  -g, --add-generation-prompt  end with the prompt for the assistant's next turn\n"
            "      --bos-token S            text of bos_token (default: the model's BOS, or empty)\n"
            "      --eos-token S            text of eos_token (default: the model's EOS, or empty)\n"
            "  -h, --help                   this help\n");
}

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

int cmd_template(int argc, char **argv)
{
    enum { OPT_BOS = 256, OPT_EOS };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"template", required_argument, 0, 't'},
        {"messages", required_argument, 0, 'j'},
        {"add-generation-prompt", no_argument, 0, 'g'},
        {"bos-token", required_argument, 0, OPT_BOS},
        {"eos-token", required_argument, 0, OPT_EOS},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *model = NULL, *template_file = NULL, *messages_file = NULL;
    char *bos = NULL, *eos = NULL;
    bool gen_prompt = false;
    int c, status = 2;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:t:j:gh", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 't': template_file = optarg; break;
        case 'j': messages_file = optarg; break;
        case 'g': gen_prompt = true; break;
        case OPT_BOS:
            free(bos);
            bos = strdup(optarg);
            break;
        case OPT_EOS:
            free(eos);
            eos = strdup(optarg);
            break;
        case 'h':
            template_usage(stdout);
            status = 0;
            goto done;
        default: template_usage(stderr); goto done;
        }
    }
    if (optind != argc || (!model) == (!template_file) || !messages_file) {
        if (optind != argc)
            fprintf(stderr, "blade template: unexpected argument '%s'\n", argv[optind]);
        else if (!messages_file)
            fprintf(stderr, "blade template: --messages FILE.json is required\n");
        else
            fprintf(stderr, "blade template: give exactly one of -m MODEL and --template FILE\n");
        template_usage(stderr);
        goto done;
    }

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

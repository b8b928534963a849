/* `blade tokenize`: how a model's tokenizer splits a text, read from the GGUF metadata alone. */
#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Vocabulary entries hold spaces, newlines and arbitrary bytes; escaping keeps one token per
 * line and the quotes unambiguous, while well-formed non-ASCII (▁, Ġ, CJK) stays readable. */
static void print_piece(const char *s)
{
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; u[i];) {
        unsigned char c = u[i];
        size_t n = 0;
        if (c >= 0xC2 && c <= 0xF4) {
            unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
            unsigned char hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
            n = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
            if (u[i + 1] < lo || u[i + 1] > hi)
                n = 0;
            for (size_t k = 2; k < n; k++) {
                if ((u[i + k] & 0xC0) != 0x80) {
                    n = 0;
                    break;
                }
            }
        }
        if (n) {
            fwrite(u + i, 1, n, stdout);
            i += n;
            continue;
        }
        if (c == '\\' || c == '\'')
            printf("\\%c", c);
        else if (c == '\n')
            fputs("\\n", stdout);
        else if (c == '\t')
            fputs("\\t", stdout);
        else if (c == '\r')
            fputs("\\r", stdout);
        else if (c < 0x20 || c >= 0x7F)
            printf("\\x%02X", c);
        else
            putchar(c);
        i++;
    }
}

typedef struct tokenize_options {
    const char *model_path, *prompt, *file;
    bool ids_only, no_bos, parse_special;
} tokenize_options;

#define O tokenize_options
static const cli_flag tokenize_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(O, model_path), .metavar = "FILE", .required = true,
     .help = "GGUF model or vocabulary file"},
    {.name = "prompt", .letter = 'p', .kind = CLI_STRING, CLI_AT(O, prompt), .empty_ok = true, .metavar = "TEXT",
     .help = "text to tokenize"},
    {.name = "file", .letter = 'f', .kind = CLI_PATH, CLI_AT(O, file), .metavar = "FILE",
     .help = "tokenize the contents of FILE instead"},
    {.name = "ids", .kind = CLI_BOOL, CLI_AT(O, ids_only), .help = "print only the ids, space-separated on one line"},
    {.name = "no-bos", .kind = CLI_BOOL, CLI_AT(O, no_bos),
     .help = "do not start with BOS even if the model asks for it"},
    {.name = "parse-special", .kind = CLI_BOOL, CLI_AT(O, parse_special),
     .help = "match control-token texts such as <s> as single tokens"},
    {0},
};
#undef O

static int tokenize_main(int argc, char **argv);

const cli_command cli_cmd_tokenize = {
    .name = "tokenize",
    .summary = "show how a model's tokenizer splits text",
    .synopsis = "-m MODEL (-p TEXT | -f FILE) [--ids] [--no-bos] [--parse-special]",
    .about = "Shows how the model's tokenizer splits text: one line per token, its id, a tab and the\n"
             "vocabulary entry in quotes (non-printable bytes escaped). Only the tokenizer metadata\n"
             "of the GGUF file is read; weights are never loaded.\n",
    .tables = (const cli_table[]){{tokenize_flags, 0}, {0}},
    .opts_size = sizeof(tokenize_options),
    .main = tokenize_main,
};

static int tokenize_main(int argc, char **argv)
{
    tokenize_options o;
    int rc = cli_parse(&cli_cmd_tokenize, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    if (!o.prompt == !o.file)
        return cli_usage_error(&cli_cmd_tokenize, "give exactly one of -p TEXT and -f FILE");
    const char *model_path = o.model_path, *prompt = o.prompt, *file = o.file;
    bool ids_only = o.ids_only, no_bos = o.no_bos, parse_special = o.parse_special;
    char *file_text = NULL;
    size_t len;
    if (file) {
        file_text = cli_read_file(file, &len);
        if (!file_text)
            return 1;
    } else {
        len = strlen(prompt);
    }
    const char *text = file ? file_text : prompt;

    blade_error err = {{0}};
    int status = 1;
    blade_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    if (!(tok = blade_tokenizer_load_file(model_path, &err))) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto done;
    }
    if (blade_tokenizer_encode(tok, text, len, !no_bos && blade_tokenizer_wants_bos(tok), parse_special, &ids, &n,
                               &err)) {
        fprintf(stderr, "error: %s: %s\n", model_path, err.msg);
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        if (ids_only) {
            printf(i ? " %d" : "%d", ids[i]);
        } else {
            printf("%d\t'", ids[i]);
            print_piece(blade_tokenizer_token_text(tok, ids[i]));
            fputs("'\n", stdout);
        }
    }
    if (ids_only)
        putchar('\n');
    status = fflush(stdout) == 0 ? 0 : 1;
done:
    free(ids);
    blade_tokenizer_free(tok);
    free(file_text);
    return status;
}

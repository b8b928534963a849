/* `blade tokenize`: how a model's tokenizer splits a text, read from the GGUF metadata alone. */
#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void tokenize_usage(FILE *out)
{
    fprintf(out,
            "usage: blade tokenize -m MODEL (-p TEXT | -f FILE) [--ids] [--no-bos] [--parse-special]\n\n"
            "Shows how the model's tokenizer splits text: one line per token, its id, a tab and the\n"
            "vocabulary entry in quotes (non-printable bytes escaped). Only the tokenizer metadata\n"
            "of the GGUF file is read; weights are never loaded.\n\n"
            "  -m, --model FILE      GGUF model or vocabulary file\n"
            "  -p, --prompt TEXT     text to tokenize\n"
            "  -f, --file FILE       tokenize the contents of FILE instead\n"
            "      --ids             print only the ids, space-separated on one line\n"
            "      --no-bos          do not start with BOS even if the model asks for it\n"
            "      --parse-special   match control-token texts such as <s> as single tokens\n"
            "  -h, --help            this help\n");
}

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

int cmd_tokenize(int argc, char **argv)
{
    enum { OPT_IDS = 256, OPT_NO_BOS, OPT_PARSE_SPECIAL };
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},
        {"prompt", required_argument, 0, 'p'},
        {"file", required_argument, 0, 'f'},
        {"ids", no_argument, 0, OPT_IDS},
        {"no-bos", no_argument, 0, OPT_NO_BOS},
        {"parse-special", no_argument, 0, OPT_PARSE_SPECIAL},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *model_path = NULL, *prompt = NULL, *file = NULL;
    bool ids_only = false, no_bos = false, parse_special = false;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:p:f:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'p': prompt = optarg; break;
        case 'f': file = optarg; break;
        case OPT_IDS: ids_only = true; break;
        case OPT_NO_BOS: no_bos = true; break;
        case OPT_PARSE_SPECIAL: parse_special = true; break;
        case 'h': tokenize_usage(stdout); return 0;
        default: tokenize_usage(stderr); return 2;
        }
    }
    if (optind != argc || !model_path || (!prompt) == (!file)) {
        if (optind != argc)
            fprintf(stderr, "blade tokenize: unexpected argument '%s'\n", argv[optind]);
        else if (!model_path)
            fprintf(stderr, "blade tokenize: -m MODEL is required\n");
        else
            fprintf(stderr, "blade tokenize: give exactly one of -p TEXT and -f FILE\n");
        tokenize_usage(stderr);
        return 2;
    }

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

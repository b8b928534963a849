/* `blade convert`: imports a llama2.c checkpoint into a GGUF file. */

#include "blade/convert.h"
#include "cli/commands.h"

#include <stddef.h>
#include <stdio.h>
#include <unistd.h>

typedef struct convert_options {
    const char *checkpoint, *tokenizer, *output, *name;
} convert_options;

#define O convert_options
static const cli_flag convert_flags[] = {
    {.name = "tokenizer", .kind = CLI_PATH, CLI_AT(O, tokenizer), .metavar = "FILE", .required = true,
     .help = "llama2.c tokenizer.bin (e.g. tok512.bin)"},
    {.name = "output", .letter = 'o', .kind = CLI_PATH, CLI_AT(O, output), .metavar = "FILE", .required = true,
     .help = "GGUF file to write"},
    {.name = "name", .kind = CLI_STRING, CLI_AT(O, name), .metavar = "NAME", .dflt = "llama2.c",
     .help = "general.name to record"},
    {0},
};
#undef O

static int convert_main(int argc, char **argv);

const cli_command cli_cmd_convert = {
    .name = "convert",
    .summary = "import a llama2.c checkpoint into a GGUF file",
    .synopsis = "CHECKPOINT.bin --tokenizer TOKENIZER.bin -o OUT.gguf [--name NAME]",
    .about = "Imports a llama2.c checkpoint and its tokenizer into a standard `llama` GGUF file\n"
             "(F32 weights, embedded SentencePiece-style vocabulary).\n",
    .tables = (const cli_table[]){{convert_flags, 0}, {0}},
    .positionals = (const cli_positional[]){
        {.metavar = "CHECKPOINT.bin", CLI_ARG_AT(convert_options, checkpoint),
         .help = "llama2.c checkpoint (e.g. stories260K.bin)"},
        {0}},
    .opts_size = sizeof(convert_options),
    .main = convert_main,
};

static int convert_main(int argc, char **argv)
{
    convert_options o;
    int rc = cli_parse(&cli_cmd_convert, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    blade_error err = {{0}};
    if (blade_convert_llama2c(o.checkpoint, o.tokenizer, o.output, o.name, isatty(STDERR_FILENO), &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    fprintf(stderr, "wrote %s\n", o.output);
    return 0;
}

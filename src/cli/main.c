/* `blade`: finds the subcommand argv names and hands it the rest of the command line. */

#include "cli/commands.h"

#include <stdio.h>
#include <string.h>

static void usage(FILE *out)
{
    fprintf(out, "blade: LLM inference engine\n\nusage: blade SUBCOMMAND [options]\n\nsubcommands:\n");
    for (const cli_command *const *c = cli_commands; *c; c++)
        fprintf(out, "  %-16s %s\n", (*c)->name, (*c)->summary);
    fprintf(out, "\n`blade SUBCOMMAND --help` describes every flag of a subcommand.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    int words;
    const cli_command *c = cli_find_command(argc, argv, &words);
    if (c)
        return c->main(argc - words, argv + words);
    fprintf(stderr, "blade: unknown subcommand '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}

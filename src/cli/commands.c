/* The list of subcommands (commands.h). */

#include "cli/commands.h"

#include <string.h>

const cli_command *const cli_commands[] = {
    &cli_cmd_run,
    &cli_cmd_serve,
    &cli_cmd_router,
    &cli_cmd_batch,
    &cli_cmd_info,
    &cli_cmd_tokenize,
    &cli_cmd_template,
    &cli_cmd_convert,
    &cli_cmd_quantize,
    &cli_cmd_imatrix,
    &cli_cmd_synth,
    &cli_cmd_perplexity,
    &cli_cmd_eval,
    &cli_cmd_bench,
    &cli_cmd_bench_engine,
    &cli_cmd_bench_serve,
    &cli_cmd_bench_ablation,
    &cli_cmd_bench_spec,
    &cli_cmd_bench_compare,
    &cli_cmd_bench_kv_transfer,
    &cli_cmd_bench_semcache,
    NULL,
};

/* Whether name's space-separated words are argv[1..]'s; *words: how many. */
static bool names(const char *name, int argc, char **argv, int *words)
{
    int w = 0;
    for (const char *p = name; *p; w++) {
        size_t len = strcspn(p, " ");
        if (1 + w >= argc || strlen(argv[1 + w]) != len || strncmp(argv[1 + w], p, len))
            return false;
        p += len + (p[len] == ' ');
    }
    *words = w;
    return true;
}

const cli_command *cli_find_command(int argc, char **argv, int *words)
{
    const cli_command *best = NULL;
    int best_words = 0;
    for (const cli_command *const *c = cli_commands; *c; c++) {
        int w;
        if (names((*c)->name, argc, argv, &w) && w > best_words) {
            best = *c;
            best_words = w;
        }
    }
    *words = best_words;
    return best;
}

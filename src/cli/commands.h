#ifndef BLADE_CLI_COMMANDS_H
#define BLADE_CLI_COMMANDS_H

/* Every `blade SUBCOMMAND`: its flags, help and entry point (flags.h), one per cmd_*.c. */

#include "cli/flags.h"

extern const cli_command cli_cmd_run, cli_cmd_info, cli_cmd_convert, cli_cmd_perplexity, cli_cmd_eval,
    cli_cmd_tokenize, cli_cmd_quantize, cli_cmd_synth, cli_cmd_bench, cli_cmd_bench_engine, cli_cmd_bench_serve,
    cli_cmd_bench_ablation, cli_cmd_bench_compare, cli_cmd_bench_semcache, cli_cmd_serve, cli_cmd_batch, cli_cmd_template,
    cli_cmd_imatrix, cli_cmd_bench_spec, cli_cmd_router, cli_cmd_bench_kv_transfer;

/* All of them, in the order `blade --help` lists them; ends with NULL. */
extern const cli_command *const cli_commands[];

/* The command argv[1..] names ("bench engine" takes two words); *words: how many. NULL if
 * none. */
const cli_command *cli_find_command(int argc, char **argv, int *words);

#endif

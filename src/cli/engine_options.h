#ifndef BLADE_CLI_ENGINE_OPTIONS_H
#define BLADE_CLI_ENGINE_OPTIONS_H

/* The engine flags every serving subcommand shares (run, serve, batch, bench engine, bench
 * ablation): one flag table, embedded in each command's options, so they mean the same
 * everywhere. */

#include "blade/engine.h"
#include "cli/flags.h"

#include <stdio.h>

typedef struct cli_engine_options {
    blade_engine_config cfg;
    cli_size kv_mem; /* bytes, or a fraction of the memory available when the engine starts */
    const char *pin_prefix_file;
} cli_engine_options;

/* Ends with its own sections: "engine options" and the baseline modes. */
extern const cli_flag cli_engine_flags[];

void cli_engine_options_init(cli_engine_options *o);
/* Resolves what depends on the model and the machine (memory fraction, context). */
int cli_engine_finalize(cli_engine_options *o, const blade_model *m);
/* Prints which techniques are on and the KV budget in tokens and concurrent sequences, for
 * the chosen KV type and, to compare, for every other. */
void cli_engine_describe(FILE *out, const cli_engine_options *o, blade_engine *e);
/* Token slots `bytes` of KV memory hold in blocks of block_size tokens of type t (what the
 * engine allocates); 0 for a shape the store refuses. */
int64_t cli_kv_tokens(const blade_hparams *hp, blade_kv_type t, int32_t block_size, size_t bytes);
/* Runs --pin-prefix: computes the file's text once and pins its blocks. */
int cli_engine_pin_prefix(const cli_engine_options *o, blade_engine *e);

#endif

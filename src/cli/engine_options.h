#ifndef BLADE_CLI_ENGINE_OPTIONS_H
#define BLADE_CLI_ENGINE_OPTIONS_H

/* The engine flags every serving subcommand shares (serve, batch, bench engine), parsed
 * in one place so they mean the same everywhere. */

#include "blade/engine.h"

#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>

/* getopt codes of the engine flags start here; commands keep their own below it. The
 * short forms -t and -c (threads, context) are handled as well when a command lists them. */
#define CLI_ENGINE_OPT_BASE 1000
enum cli_engine_opt {
    OPT_KV_MEM = CLI_ENGINE_OPT_BASE,
    OPT_BLOCK_SIZE,
    OPT_KV_TYPE,
    OPT_MAX_BATCH_TOKENS,
    OPT_MAX_SEQS,
    OPT_NO_PREFIX_CACHE,
    OPT_NO_CHUNKED_PREFILL,
    OPT_SCHEDULER,
    OPT_KV_ALLOC,
    OPT_PIN_PREFIX,
    OPT_CTX_SIZE,
    OPT_THREADS,
    OPT_BATCH_AGING,
};

typedef struct cli_engine_options {
    blade_engine_config cfg;
    double kv_mem_fraction; /* of available memory, when --kv-mem was a fraction */
    const char *pin_prefix_file;
} cli_engine_options;

extern const struct option cli_engine_longopts[];
extern const size_t cli_engine_longopts_count;

void cli_engine_options_init(cli_engine_options *o);
/* Handles one getopt result: 1 when it was an engine flag, 0 when not, -1 on a bad value
 * (already reported on stderr). */
int cli_engine_option(cli_engine_options *o, int code, const char *arg);
void cli_engine_usage(FILE *out);
/* Resolves what depends on the model and the machine (memory fraction, context). */
int cli_engine_finalize(cli_engine_options *o, const blade_model *m);
/* Prints which techniques are on and the KV budget in tokens and concurrent sequences, for
 * the chosen KV type and, to compare, for every other. */
void cli_engine_describe(FILE *out, const cli_engine_options *o, blade_engine *e);
/* Token slots `bytes` of KV memory hold in blocks of block_size tokens of type t (what the
 * engine allocates); 0 for a shape the store refuses. */
int64_t cli_kv_tokens(const blade_hparams *hp, blade_kv_type t, int32_t block_size, size_t bytes);
/* Builds a long-options array of the command's own options followed by the engine's;
 * malloc'd, terminated by a zero entry. */
struct option *cli_merge_longopts(const struct option *own, size_t n_own);
/* Runs --pin-prefix: computes the file's text once and pins its blocks. */
int cli_engine_pin_prefix(const cli_engine_options *o, blade_engine *e);

#endif

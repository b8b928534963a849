#ifndef BLADE_CLI_UTIL_H
#define BLADE_CLI_UTIL_H

/* Helpers shared by the subcommands: file slurping, timing, the default model, and the
 * values of flags several commands have (KV types, quantization schemes). */

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cli/flags.h"

/* Whole file, NUL-terminated, malloc'd; prints an error naming the file on failure. */
char *cli_read_file(const char *path, size_t *len);
double cli_now(void);
/* The default model: ../shared/models/stories260K.gguf relative to the working directory
 * when present, else NULL. */
const char *cli_default_model(void);
/* Whether two paths name the same file (device and inode), so that a command refuses to
 * write its output over one of its inputs. */
bool cli_same_file(const char *a, const char *b);

/* Long conversions stop between steps when Ctrl-C (or SIGTERM) sets cli_interrupted while
 * cli_interrupts_catch is in effect, and leave no output behind; cli_interrupts_restore puts
 * the previous handlers back. */
extern volatile sig_atomic_t cli_interrupted;
typedef struct cli_signals {
    struct sigaction old_int, old_term;
} cli_signals;
void cli_interrupts_catch(cli_signals *saved);
void cli_interrupts_restore(const cli_signals *saved);
/* Raises the soft limit on open files to the hard one (servers and load generators hold a
 * socket per connection); returns the limit now in force. */
long long cli_raise_fd_limit(void);

/* The KV cache types, as the choices of a --kv-type flag. */
bool cli_kv_type_choice(int i, cli_choice *out);
/* A CLI_CUSTOM parser: the quantization scheme (const blade_quant_scheme *) a name means. */
bool cli_parse_quant_scheme(const cli_flag *f, const char *value, void *dest, char *why, size_t cap);

#endif

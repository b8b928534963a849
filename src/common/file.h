#ifndef BLADE_COMMON_FILE_H
#define BLADE_COMMON_FILE_H

/* Reading a whole file (prompts, chat templates, datasets), shared by the library and the
 * command line. */

#include "blade/error.h"

#include <stddef.h>

/* The file's bytes with a terminating NUL (not counted in *len); NULL with err set when it
 * cannot be opened or read. Free with free(). */
char *blade_read_file(const char *path, size_t *len, blade_error *err);

#endif

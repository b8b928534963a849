#ifndef BLADE_COMMON_FILE_H
#define BLADE_COMMON_FILE_H

/* Opening and reading the files a user names (models, prompts, chat templates, batch
 * requests, datasets), shared by the library and the command line. Each must be a regular
 * file: a named pipe, device or directory is refused with an error naming what it is, never
 * waited on (opening a FIFO for reading blocks until something writes to it). */

#include "blade/error.h"

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>

/* A read-only descriptor (close-on-exec, blocking) on the regular file at path; -1 with err
 * set ("cannot open PATH: ..." or "PATH is a named pipe (FIFO), not a regular file"). */
int blade_open_regular(const char *path, blade_error *err);
/* The same as a stdio stream for reading. */
FILE *blade_fopen_regular(const char *path, blade_error *err);

/* The file's bytes with a terminating NUL (not counted in *len); NULL with err set when it
 * cannot be opened or read. Free with free(). */
char *blade_read_file(const char *path, size_t *len, blade_error *err);

/* The JSON document in the file; NULL with err set ("PATH:LINE:COLUMN: what") otherwise. */
json_t *blade_read_json(const char *path, blade_error *err);

#endif

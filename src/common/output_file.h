#ifndef BLADE_COMMON_OUTPUT_FILE_H
#define BLADE_COMMON_OUTPUT_FILE_H

/* An output file that appears whole or not at all. The results are written to a temporary
 * file beside the destination, synced, and renamed over it only when the writer commits:
 * a failed or interrupted run leaves no half file and never touches an existing one. A
 * symlink is followed, so the file it points to is the one replaced. A destination that
 * cannot be replaced by renaming (a FIFO, a device, /dev/stdout and the other
 * /proc/self/fd links) is written in place, as a shell redirection would.
 *
 * While a temporary exists, SIGINT, SIGTERM and SIGHUP (those not ignored) remove it before
 * the process dies of the signal. One output at a time has that cover. */

#include "blade/error.h"

#include <stdbool.h>
#include <stdio.h>
#include <sys/types.h>

typedef struct blade_output {
    char *path;   /* as given, for messages */
    char *target; /* the regular file the temporary replaces; NULL when written in place */
    char *dir;    /* target's directory, resolved */
    char *temp;   /* the temporary, from open until commit or abort */
    mode_t mode;  /* the existing file's permissions, or the umask's for a new one */
    bool exists;  /* target exists (its owner and permissions are kept) */
    uid_t uid;
    gid_t gid;
    bool covered; /* holds the signal cover for its temporary */
    FILE *f;      /* where to write, after blade_output_open */
} blade_output;

/* Works out where path leads and checks that a file can be made there; creates nothing. */
int blade_output_prepare(blade_output *o, const char *path, blade_error *err);
/* Creates the temporary (or opens an in-place destination, which for a FIFO waits for a
 * reader) and sets o->f. On failure nothing is left on disk and o stays prepared. Call it
 * before the process starts other threads: the calling thread holds SIGINT, SIGTERM and
 * SIGHUP back while it creates the temporary and covers it, which closes the gap between
 * the two only when no other thread could take the signal. */
int blade_output_open(blade_output *o, blade_error *err);
/* Flushes and syncs what was written and renames the temporary into place. On failure the
 * temporary is removed and the destination is as it was. Either way o is released. */
int blade_output_commit(blade_output *o, blade_error *err);
/* Discards what was written: the temporary is removed. Safe on a released or zeroed o. */
void blade_output_abort(blade_output *o);

#endif

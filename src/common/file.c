/* Opening user-named input files so that only regular files are read, and reading them whole. */
#include "common/file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *file_kind(mode_t mode)
{
    if (S_ISFIFO(mode))
        return "a named pipe (FIFO)";
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISCHR(mode))
        return "a character device";
    if (S_ISBLK(mode))
        return "a block device";
    if (S_ISSOCK(mode))
        return "a socket";
    return "not a plain file";
}

int blade_open_regular(const char *path, blade_error *err)
{
    /* O_NONBLOCK so that opening a FIFO without a writer returns at once, to be refused
     * below, instead of blocking; for a regular file it changes nothing and is cleared. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return blade_error_set(err, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        blade_error_set(err, "cannot stat %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        blade_error_set(err, "%s is %s, not a regular file", path, file_kind(st.st_mode));
        close(fd);
        return -1;
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        blade_error_set(err, "%s: cannot clear O_NONBLOCK: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

FILE *blade_fopen_regular(const char *path, blade_error *err)
{
    int fd = blade_open_regular(path, err);
    if (fd < 0)
        return NULL;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        blade_error_set(err, "cannot open %s: %s", path, strerror(errno));
        close(fd);
    }
    return f;
}

char *blade_read_file(const char *path, size_t *len, blade_error *err)
{
    FILE *f = blade_fopen_regular(path, err);
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0, got;
    char *buf = malloc(cap + 1);
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *bigger = cap <= (SIZE_MAX - 1) / 2 ? realloc(buf, cap * 2 + 1) : NULL;
            if (!bigger) {
                free(buf);
                fclose(f);
                return blade_error_set(err, "%s: out of memory", path), NULL;
            }
            buf = bigger;
            cap *= 2;
        }
    }
    bool failed = ferror(f) || !buf;
    fclose(f);
    if (failed) {
        free(buf);
        return blade_error_set(err, "cannot read %s", path), NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

json_t *blade_read_json(const char *path, blade_error *err)
{
    FILE *f = blade_fopen_regular(path, err);
    if (!f)
        return NULL;
    json_error_t je;
    json_t *doc = json_loadf(f, 0, &je);
    fclose(f);
    if (!doc)
        blade_error_set(err, "%s:%d:%d: %s", path, je.line, je.column, je.text);
    return doc;
}

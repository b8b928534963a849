#include "common/file.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

char *blade_read_file(const char *path, size_t *len, blade_error *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return blade_error_set(err, "cannot open %s: %s", path, strerror(errno)), NULL;
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

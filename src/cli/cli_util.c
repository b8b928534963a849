#include "cli/cli_util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

bool cli_parse_int(const char *flag, const char *s, long long min, long long max, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < min || v > max) {
        fprintf(stderr, "error: %s expects an integer in [%lld, %lld], got '%s'\n", flag, min, max, s);
        return false;
    }
    *out = v;
    return true;
}

bool cli_parse_float(const char *flag, const char *s, double min, double max, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < min || v > max) {
        fprintf(stderr, "error: %s expects a number in [%g, %g], got '%s'\n", flag, min, max, s);
        return false;
    }
    *out = v;
    return true;
}

char *cli_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "error: cannot open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0, got;
    char *buf = malloc(cap + 1);
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *bigger = realloc(buf, cap * 2 + 1);
            if (!bigger) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
    }
    bool failed = ferror(f) || !buf;
    fclose(f);
    if (failed) {
        fprintf(stderr, "error: cannot read %s\n", path);
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    if (len)
        *len = n;
    return buf;
}

double cli_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *cli_default_model(void)
{
    static const char path[] = "../shared/models/stories260K.gguf";
    return access(path, R_OK) == 0 ? path : NULL;
}

/* Error messages (blade/error.h): formatting into the caller's fixed buffer, and prefixing
 * the context (a file name, a flag) as an error travels up. */

#include "blade/error.h"

#include <stdio.h>
#include <string.h>

void blade_error_vformat(blade_error *err, const char *fmt, va_list ap)
{
    if (err)
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
}

int blade_error_prefix(blade_error *err, const char *fmt, ...)
{
    if (err) {
        char prefix[BLADE_ERROR_LEN];
        char old[BLADE_ERROR_LEN];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(prefix, sizeof prefix, fmt, ap);
        va_end(ap);
        memcpy(old, err->msg, sizeof old);
        size_t n = strlen(prefix);
        if (n > sizeof err->msg - 3)
            n = sizeof err->msg - 3;
        memcpy(err->msg, prefix, n);
        memcpy(err->msg + n, ": ", 2);
        size_t rest = sizeof err->msg - n - 3;
        size_t old_len = strnlen(old, rest);
        memcpy(err->msg + n + 2, old, old_len);
        err->msg[n + 2 + old_len] = 0;
    }
    return -1;
}

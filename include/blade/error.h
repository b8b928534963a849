#ifndef BLADE_ERROR_H
#define BLADE_ERROR_H

/* Every fallible call reports through a caller-owned blade_error so messages can name
 * exactly what was wrong (field, file offset, value) without global state. A NULL error
 * pointer is allowed everywhere and simply discards the message. */

#include <stdarg.h>
#include <stddef.h>

#define BLADE_ERROR_LEN 512

typedef struct blade_error {
    char msg[BLADE_ERROR_LEN];
} blade_error;

#if defined(__GNUC__)
#define BLADE_PRINTF(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#else
#define BLADE_PRINTF(fmt_idx, arg_idx)
#endif

void blade_error_vformat(blade_error *err, const char *fmt, va_list ap);

/* Formats into err (if non-NULL) and returns -1, so callers can `return blade_error_set(...)`.
 * Inline so the compiler sees the constant and knows failure paths never read as success. */
static inline BLADE_PRINTF(2, 3) int blade_error_set(blade_error *err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    blade_error_vformat(err, fmt, ap);
    va_end(ap);
    return -1;
}

/* Prepends "context: " to an existing message, for adding the file name or step. */
int blade_error_prefix(blade_error *err, const char *fmt, ...) BLADE_PRINTF(2, 3);

#endif

#ifndef BLADE_API_BUF_H
#define BLADE_API_BUF_H

/* A growable byte buffer for response bodies and SSE output. A failed allocation does not
 * stop the writer mid-way: the buffer marks itself failed and ignores further appends, and
 * whoever sends it checks once at the end. */

#include <stdbool.h>
#include <stddef.h>

typedef struct api_buf {
    char *data; /* NUL-terminated while len > 0 */
    size_t len, cap;
    bool failed; /* an allocation failed: the content is incomplete */
} api_buf;

void api_buf_append(api_buf *b, const void *data, size_t n);
void api_buf_free(api_buf *b);

#endif

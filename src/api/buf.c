/* The growable byte buffer of response bodies and SSE output (buf.h). */

#include "api/buf.h"

#include <stdlib.h>
#include <string.h>

void api_buf_append(api_buf *b, const void *data, size_t n)
{
    if (b->failed || n == 0)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *grown = realloc(b->data, cap);
        if (!grown) {
            b->failed = true;
            return;
        }
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, data, n);
    b->len += n;
    b->data[b->len] = 0;
}

void api_buf_free(api_buf *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

#ifndef BLADE_STOP_H
#define BLADE_STOP_H

/* Stop strings matched in the detokenized text, also across token boundaries, and never
 * emitted: text that could still be the start of a stop string is held back until the
 * next token shows whether it is. */

#include <stdbool.h>
#include <stddef.h>

typedef struct blade_stop_matcher {
    char **stops;
    size_t *lens;
    int n;
    char *pending; /* text held back */
    size_t n_pending, cap_pending;
    char *out;     /* text released by the last call */
    size_t cap_out;
} blade_stop_matcher;

/* Copies the stop strings (empty ones are ignored). Returns -1 on allocation failure. */
int blade_stop_init(blade_stop_matcher *m, const char *const *stops, int n);
void blade_stop_destroy(blade_stop_matcher *m);
/* Adds text. *out and *out_len receive the text now safe to emit (valid until the next call).
 * Returns true when a stop string matched: the text before it is released, the rest is
 * dropped, and the stream is over. Returns true with *out_len 0 and *out NULL on
 * allocation failure as well, so a caller never emits half-checked text. */
bool blade_stop_push(blade_stop_matcher *m, const char *text, size_t len, const char **out, size_t *out_len);
/* End of stream without a match: releases whatever is held back. */
void blade_stop_flush(blade_stop_matcher *m, const char **out, size_t *out_len);

#endif

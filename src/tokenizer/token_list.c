/* The growable token array an encode call fills (tokenizer_internal.h). */

#include "tokenizer/tokenizer_internal.h"

#include <stdlib.h>

int tok_list_push(tok_list *l, int32_t id, blade_error *err)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        if (cap > SIZE_MAX / sizeof *l->v)
            return blade_error_set(err, "tokenizer: too many tokens");
        int32_t *v = realloc(l->v, cap * sizeof *v);
        if (!v)
            return blade_error_set(err, "tokenizer: out of memory for %zu tokens", cap);
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = id;
    return 0;
}

/* The merge loop both tokenizers share (tokenizer_internal.h): adjacent symbol pairs wait
 * in a binary min-heap by priority, the best merges first, and a pair that a neighbouring
 * merge made stale is dropped when it comes up. */

#include "tokenizer/tokenizer_internal.h"

#include <stdlib.h>

static int mq_push(merge_queue *q, merge_cand c, blade_error *err)
{
    if (q->n == q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 256;
        if (cap > SIZE_MAX / sizeof *q->v)
            return blade_error_set(err, "tokenizer: text too long");
        merge_cand *v = realloc(q->v, cap * sizeof *v);
        if (!v)
            return blade_error_set(err, "tokenizer: out of memory for the merge queue");
        q->v = v;
        q->cap = cap;
    }
    size_t i = q->n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (q->v[parent].key <= c.key)
            break;
        q->v[i] = q->v[parent];
        i = parent;
    }
    q->v[i] = c;
    return 0;
}

static merge_cand mq_pop(merge_queue *q)
{
    merge_cand top = q->v[0];
    merge_cand last = q->v[--q->n];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= q->n)
            break;
        if (child + 1 < q->n && q->v[child + 1].key < q->v[child].key)
            child++;
        if (last.key <= q->v[child].key)
            break;
        q->v[i] = q->v[child];
        i = child;
    }
    if (q->n)
        q->v[i] = last;
    return top;
}

static int try_pair(merge_sym *sym, uint32_t left, merge_pair_fn pair, void *ctx, merge_queue *q,
                    blade_error *err)
{
    if (left == TOK_NONE || sym[left].next == TOK_NONE)
        return 0;
    uint32_t right = sym[left].next;
    uint32_t prio;
    int32_t id;
    if (!pair(ctx, &sym[left], &sym[right], &prio, &id))
        return 0;
    merge_cand c = {
        .key = (uint64_t)prio << 32 | left,
        .len = sym[left].len + sym[right].len,
        .left = left,
        .right = right,
        .id = id,
    };
    return mq_push(q, c, err);
}

int merge_run(merge_sym *sym, uint32_t n, merge_pair_fn pair, void *ctx, merge_queue *q, blade_error *err)
{
    q->n = 0;
    for (uint32_t i = 0; i + 1 < n; i++)
        if (try_pair(sym, i, pair, ctx, q, err))
            return -1;
    while (q->n) {
        merge_cand c = mq_pop(q);
        merge_sym *l = &sym[c.left], *r = &sym[c.right];
        /* A queued pair is stale once either side took part in another merge: then the two
         * are no longer neighbours, or one of them grew. */
        if (!l->len || !r->len || l->next != c.right || l->len + r->len != c.len)
            continue;
        l->len += r->len;
        l->id = c.id;
        l->next = r->next;
        if (r->next != TOK_NONE)
            sym[r->next].prev = c.left;
        r->len = 0;
        if (try_pair(sym, l->prev, pair, ctx, q, err) || try_pair(sym, c.left, pair, ctx, q, err))
            return -1;
    }
    return 0;
}

/* The scheduler (scheduler.h): the running list in priority order, a waiting queue per
 * traffic class, and each step's plan: decodes first, prefill chunks in the budget left,
 * admissions while blocks last, preemption of the lowest-priority, latest-admitted
 * sequence when they run out. It moves token counts and block numbers, never data. */

#include "blade/scheduler.h"

#include <stdlib.h>
#include <string.h>

typedef struct seq_list {
    blade_sched_seq *head, *tail;
    int32_t n;
} seq_list;

struct blade_scheduler {
    blade_sched_config cfg;
    blade_kv_cache *kv;
    int32_t total_blocks;
    seq_list running; /* sorted by (rank, admitted): highest priority first */
    seq_list waiting[2]; /* per traffic class, in arrival order (preempted ones at the front) */
    uint64_t arrivals;
    uint64_t admissions;
    uint64_t preemptions;
    uint64_t steps;
    blade_sched_item *items;
    blade_sched_seq **rejected;
    int32_t rejected_cap;
    blade_sched_seq **candidates;
    int32_t candidates_cap;
};

void blade_sched_config_default(blade_sched_config *c)
{
    /* A step's budget is the longest a prefill chunk makes the decoders wait. On two CPU
     * cores 256 tokens take about 1.7 s (tinyllama-1.1b Q4_0), a fifth of an unchunked
     * 2048-token prompt's stall; larger chunks gain little prefill speed there. */
    c->max_batch_tokens = 256;
    c->max_seqs = 64;
    c->chunked_prefill = true;
    c->mode = BLADE_SCHED_CONTINUOUS;
    c->contiguous_kv = false;
    c->batch_aging_steps = 256;
}

static void list_remove(seq_list *l, blade_sched_seq *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        l->head = s->next;
    if (s->next)
        s->next->prev = s->prev;
    else
        l->tail = s->prev;
    s->next = s->prev = NULL;
    l->n--;
}

static void list_push_back(seq_list *l, blade_sched_seq *s)
{
    s->next = NULL;
    s->prev = l->tail;
    if (l->tail)
        l->tail->next = s;
    else
        l->head = s;
    l->tail = s;
    l->n++;
}

static void list_push_front(seq_list *l, blade_sched_seq *s)
{
    s->prev = NULL;
    s->next = l->head;
    if (l->head)
        l->head->prev = s;
    else
        l->tail = s;
    l->head = s;
    l->n++;
}

static bool runs_before(const blade_sched_seq *a, const blade_sched_seq *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->admitted < b->admitted;
}

static void running_insert(blade_scheduler *s, blade_sched_seq *seq)
{
    blade_sched_seq *at = s->running.tail;
    while (at && runs_before(seq, at))
        at = at->prev;
    if (!at) {
        list_push_front(&s->running, seq);
        return;
    }
    seq->prev = at;
    seq->next = at->next;
    if (at->next)
        at->next->prev = seq;
    else
        s->running.tail = seq;
    at->next = seq;
    s->running.n++;
}

blade_scheduler *blade_scheduler_new(const blade_sched_config *cfg, blade_kv_cache *kv, blade_error *err)
{
    if (cfg->max_batch_tokens <= 0 || cfg->max_seqs <= 0)
        return blade_error_set(err, "scheduler: max_batch_tokens and max_seqs must be positive"), NULL;
    blade_scheduler *s = calloc(1, sizeof *s);
    if (!s || !(s->items = calloc((size_t)cfg->max_seqs, sizeof *s->items))) {
        free(s);
        return blade_error_set(err, "out of memory"), NULL;
    }
    s->cfg = *cfg;
    s->kv = kv;
    blade_kv_cache_stats st;
    blade_kv_cache_stats_get(kv, &st);
    s->total_blocks = st.blocks_total;
    return s;
}

void blade_scheduler_free(blade_scheduler *s)
{
    if (!s)
        return;
    free(s->items);
    free(s->rejected);
    free(s->candidates);
    free(s);
}

const blade_sched_config *blade_scheduler_config(const blade_scheduler *s)
{
    return &s->cfg;
}

void blade_scheduler_add(blade_scheduler *s, blade_sched_seq *seq)
{
    seq->state = BLADE_SEQ_WAITING;
    seq->arrival = s->arrivals++;
    seq->waited = 0;
    seq->scheduled = false;
    list_push_back(&s->waiting[seq->cls], seq);
}

void blade_scheduler_detach(blade_scheduler *s, blade_sched_seq *seq)
{
    if (seq->state == BLADE_SEQ_RUNNING)
        list_remove(&s->running, seq);
    else if (seq->state == BLADE_SEQ_WAITING)
        list_remove(&s->waiting[seq->cls], seq);
    seq->state = BLADE_SEQ_FINISHED;
}

void blade_scheduler_remove(blade_scheduler *s, blade_sched_seq *seq)
{
    blade_scheduler_detach(s, seq);
    blade_kv_cache_release(s->kv, &seq->kv);
}

static int32_t blocks_for(const blade_scheduler *s, int32_t n_tokens)
{
    int32_t bs = blade_kv_cache_block_size(s->kv);
    return (n_tokens + bs - 1) / bs;
}

/* Gives a running sequence's blocks back; it waits at the front of its queue and will be
 * recomputed from its tokens (prompt and generated alike). */
static void preempt(blade_scheduler *s, blade_sched_seq *seq, blade_sched_plan *plan)
{
    list_remove(&s->running, seq);
    blade_kv_cache_release(s->kv, &seq->kv);
    seq->n_computed = 0;
    seq->state = BLADE_SEQ_WAITING;
    seq->preemptions++;
    list_push_front(&s->waiting[seq->cls], seq);
    s->preemptions++;
    plan->n_preempted++;
}

static void reject(blade_scheduler *s, blade_sched_seq *seq, blade_sched_plan *plan)
{
    if (plan->n_rejected == s->rejected_cap) {
        int32_t cap = s->rejected_cap ? s->rejected_cap * 2 : 8;
        blade_sched_seq **grown = realloc(s->rejected, (size_t)cap * sizeof *grown);
        if (!grown)
            return; /* it stays queued and is offered again next step */
        s->rejected = grown;
        s->rejected_cap = cap;
        plan->rejected = grown;
    }
    blade_scheduler_remove(s, seq);
    plan->rejected[plan->n_rejected++] = seq;
}

/* Takes a sequence planned in this step out of the plan, giving its tokens back. */
static void unplan(blade_sched_plan *plan, blade_sched_seq *seq, int32_t *budget)
{
    int32_t i = 0;
    while (plan->items[i].seq != seq)
        i++;
    *budget += plan->items[i].n_tokens;
    plan->n_tokens -= plan->items[i].n_tokens;
    memmove(plan->items + i, plan->items + i + 1, (size_t)(plan->n_items - i - 1) * sizeof *plan->items);
    plan->n_items--;
    seq->scheduled = false;
}

/* Blocks for seq to hold n_total tokens. When the pool is exhausted the lowest-priority,
 * most recently admitted running sequence gives its blocks back, even one planned earlier
 * in this step (decodes are planned before prompt chunks, but blocks go by rank); when
 * that is seq itself, seq waits. Returns false when seq had to wait or cannot be served. */
static bool ensure_blocks(blade_scheduler *s, blade_sched_seq *seq, int32_t n_total, blade_sched_plan *plan,
                          int32_t *budget)
{
    if (blocks_for(s, n_total) > s->total_blocks) {
        reject(s, seq, plan);
        return false;
    }
    while (blade_kv_cache_allocate(s->kv, &seq->kv, n_total) != 0) {
        blade_sched_seq *victim = s->running.tail;
        if (!victim || victim == seq) {
            preempt(s, seq, plan);
            return false;
        }
        if (victim->scheduled)
            unplan(plan, victim, budget);
        preempt(s, victim, plan);
    }
    return true;
}

/* Tokens of `needed` this step can take: a chunk of what the budget leaves, or, without
 * chunked prefill, all of it or nothing (one oversized prefill may run alone). */
static int32_t chunk(const blade_scheduler *s, int32_t needed, int32_t budget, const blade_sched_plan *plan)
{
    if (s->cfg.chunked_prefill || needed == 1)
        return needed < budget ? needed : budget;
    if (needed <= budget || plan->n_items == 0)
        return needed;
    return 0;
}

static void plan_add(blade_sched_plan *plan, blade_sched_seq *seq, int32_t n)
{
    seq->scheduled = true;
    plan->items[plan->n_items++] = (blade_sched_item){seq, n, seq->n_computed + n == seq->n_tokens, 0, 0};
    plan->n_tokens += n;
}

/* Drafts ride on planned decodes with what the budget leaves after every decode has its
 * real token. A draft never costs anyone else their blocks: it gets the blocks that can be
 * had without preemption, and is trimmed to what they hold. */
static void schedule_drafts(blade_scheduler *s, blade_sched_plan *plan, int32_t *budget)
{
    int32_t bs = blade_kv_cache_block_size(s->kv);
    for (int32_t i = 0; i < plan->n_items && *budget > 0; i++) {
        blade_sched_item *it = &plan->items[i];
        blade_sched_seq *seq = it->seq;
        if (seq->n_draft <= 0 || !it->want_logits || it->n_tokens != 1)
            continue;
        int32_t d = seq->n_draft < *budget ? seq->n_draft : *budget;
        int32_t n_total = seq->n_computed + 1 + d;
        if (!s->cfg.contiguous_kv && blade_kv_cache_allocate(s->kv, &seq->kv, n_total) != 0) {
            int32_t room = seq->kv.n_blocks * bs - seq->n_computed - 1;
            d = d < room ? d : room;
        }
        if (s->cfg.contiguous_kv && n_total > seq->max_total)
            d = seq->max_total - seq->n_computed - 1;
        if (d <= 0)
            continue;
        it->n_tokens += d;
        it->n_draft = d;
        plan->n_tokens += d;
        *budget -= d;
    }
}

static void schedule_running(blade_scheduler *s, blade_sched_plan *plan, int32_t *budget, bool decodes)
{
    blade_sched_seq *seq = s->running.head;
    while (seq && plan->n_items < s->cfg.max_seqs && *budget > 0) {
        int32_t needed = seq->n_tokens - seq->n_computed;
        if (seq->scheduled || needed <= 0 || (needed == 1) != decodes) {
            seq = seq->next;
            continue;
        }
        int32_t preempted_before = plan->n_preempted + plan->n_rejected;
        int32_t n = chunk(s, needed, *budget, plan);
        int32_t n_total = s->cfg.contiguous_kv ? seq->max_total : seq->n_computed + n;
        if (n > 0 && ensure_blocks(s, seq, n_total, plan, budget)) {
            plan_add(plan, seq, n);
            *budget -= n;
        }
        /* preemption reshapes the running list; the scheduled flags make a rescan safe */
        seq = plan->n_preempted + plan->n_rejected != preempted_before ? s->running.head : seq->next;
    }
}

/* Waiting sequences in admission order: batch requests that have aged past the limit
 * first (so no load of interactive traffic can starve them), then interactive ones, then
 * the other batch requests; each queue in arrival order with preempted ones at its front. */
static int32_t admission_order(blade_scheduler *s)
{
    int32_t n = s->waiting[0].n + s->waiting[1].n;
    if (n > s->candidates_cap) {
        blade_sched_seq **grown = realloc(s->candidates, (size_t)n * sizeof *grown);
        if (!grown)
            return 0;
        s->candidates = grown;
        s->candidates_cap = n;
    }
    int32_t k = 0;
    for (blade_sched_seq *q = s->waiting[1].head; q; q = q->next)
        if (q->waited > s->cfg.batch_aging_steps)
            s->candidates[k++] = q;
    for (blade_sched_seq *q = s->waiting[0].head; q; q = q->next)
        s->candidates[k++] = q;
    for (blade_sched_seq *q = s->waiting[1].head; q; q = q->next)
        if (q->waited <= s->cfg.batch_aging_steps)
            s->candidates[k++] = q;
    return k;
}

/* ignore_budget forms a static batch: its members are admitted without being planned, and
 * since a fixed-shape batch runs every seat in each decode step, it has no more seats than
 * a step has sequences and tokens. */
static void admit_waiting(blade_scheduler *s, blade_sched_plan *plan, int32_t *budget, bool ignore_budget)
{
    int32_t n = admission_order(s);
    int32_t seats = s->cfg.max_seqs;
    if (ignore_budget && s->cfg.max_batch_tokens < seats)
        seats = s->cfg.max_batch_tokens;
    for (int32_t i = 0; i < n && (*budget > 0 || ignore_budget); i++) {
        if ((ignore_budget ? s->running.n : plan->n_items) >= seats)
            break;
        blade_sched_seq *seq = s->candidates[i];
        if (seq->kv.n_blocks == 0 && !seq->compute_all)
            seq->n_computed = blade_kv_cache_match_prefix(s->kv, &seq->kv, seq->tokens, seq->n_tokens);
        int32_t needed = seq->n_tokens - seq->n_computed;
        int32_t take = ignore_budget ? 0 : chunk(s, needed, *budget, plan);
        int32_t reserve = s->cfg.contiguous_kv ? seq->max_total : seq->n_computed + (ignore_budget ? needed : take);
        if (!ignore_budget && take == 0) {
            blade_kv_cache_release(s->kv, &seq->kv);
            seq->n_computed = 0;
            break;
        }
        if (blocks_for(s, reserve) > s->total_blocks) {
            reject(s, seq, plan);
            continue;
        }
        if (blade_kv_cache_allocate(s->kv, &seq->kv, reserve) != 0) {
            /* first come, first served: nobody overtakes the head of the queue */
            blade_kv_cache_release(s->kv, &seq->kv);
            seq->n_computed = 0;
            break;
        }
        list_remove(&s->waiting[seq->cls], seq);
        seq->state = BLADE_SEQ_RUNNING;
        seq->rank = seq->cls == BLADE_CLASS_BATCH && seq->waited > s->cfg.batch_aging_steps ? BLADE_CLASS_INTERACTIVE
                                                                                             : seq->cls;
        seq->admitted = s->admissions++;
        running_insert(s, seq);
        if (!ignore_budget) {
            plan_add(plan, seq, take);
            *budget -= take;
        }
    }
}

void blade_scheduler_schedule(blade_scheduler *s, blade_sched_plan *plan)
{
    memset(plan, 0, sizeof *plan);
    plan->items = s->items;
    plan->rejected = s->rejected;
    s->steps++;
    for (blade_sched_seq *q = s->running.head; q; q = q->next)
        q->scheduled = false;
    int32_t budget = s->cfg.max_batch_tokens;

    if (s->cfg.mode == BLADE_SCHED_STATIC) {
        /* the batch is formed only when the previous one has completely finished */
        if (s->running.n == 0)
            admit_waiting(s, plan, &budget, true);
        schedule_running(s, plan, &budget, true);
        schedule_running(s, plan, &budget, false);
    } else if (!s->cfg.chunked_prefill && s->waiting[0].n + s->waiting[1].n > 0) {
        /* without chunking, prefills run whole in steps of their own: the decodes wait */
        admit_waiting(s, plan, &budget, false);
        if (plan->n_items == 0) {
            schedule_running(s, plan, &budget, true);
            schedule_running(s, plan, &budget, false);
        }
    } else {
        schedule_running(s, plan, &budget, true);
        schedule_drafts(s, plan, &budget);
        schedule_running(s, plan, &budget, false);
        admit_waiting(s, plan, &budget, false);
    }
    for (int w = 0; w < 2; w++)
        for (blade_sched_seq *q = s->waiting[w].head; q; q = q->next)
            q->waited++;
}

void blade_scheduler_commit(blade_scheduler *s, const blade_sched_plan *plan)
{
    for (int32_t i = 0; i < plan->n_items; i++) {
        const blade_sched_item *it = &plan->items[i];
        blade_sched_seq *seq = it->seq;
        int32_t kept = it->n_accepted < it->n_draft ? it->n_accepted : it->n_draft;
        seq->n_computed += it->n_tokens - it->n_draft + (kept > 0 ? kept : 0);
        if (it->n_draft > 0 && !s->cfg.contiguous_kv)
            blade_kv_cache_truncate(s->kv, &seq->kv, seq->n_computed);
        blade_kv_cache_commit(s->kv, &seq->kv, seq->tokens, seq->n_computed);
        blade_kv_cache_sample_utilisation(s->kv, &seq->kv, seq->n_computed);
    }
}

bool blade_scheduler_idle(const blade_scheduler *s)
{
    return s->running.n == 0 && s->waiting[0].n == 0 && s->waiting[1].n == 0;
}

void blade_scheduler_stats(const blade_scheduler *s, blade_sched_stats *out)
{
    out->running = s->running.n;
    out->waiting = s->waiting[0].n + s->waiting[1].n;
    out->preemptions = s->preemptions;
    out->steps = s->steps;
}

int32_t blade_scheduler_live(const blade_scheduler *s, const blade_kv_cache_seq **out, int32_t cap)
{
    int32_t n = 0;
    for (blade_sched_seq *q = s->running.head; q && n < cap; q = q->next)
        out[n++] = &q->kv;
    for (int w = 0; w < 2; w++)
        for (blade_sched_seq *q = s->waiting[w].head; q && n < cap; q = q->next)
            if (q->kv.n_blocks)
                out[n++] = &q->kv;
    return n;
}

/* The scheduler's plans, step by step and exactly: decode-first ordering, prefill chunk
 * sizes under the token budget and the sequence cap, which sequence is preempted when KV
 * blocks run out and how it is recomputed, traffic-class priority and aging, requests the
 * pool can never hold, and each baseline mode (static batching, whole prompts without
 * chunked prefill, contiguous reservation). A small rig plays the engine's part: it commits
 * each plan, appends a token to every sequence whose chunk asked for logits, and ends a
 * sequence when it has generated its tokens. KV invariants are checked after every step. */
#include "testutil.h"

#include "blade/scheduler.h"

#include <stdio.h>
#include <string.h>

#define RIG_SEQS 16
#define SEQ_TOKENS 64

typedef struct test_seq {
    blade_sched_seq s;
    int32_t tokens[SEQ_TOKENS];
    int32_t max_new;     /* the rig ends the sequence after generating this many */
    int32_t n_generated;
    bool padding;        /* static batching: finished, but keeping its seat */
} test_seq;

typedef struct rig {
    blade_kv_cache *kv;
    blade_scheduler *sched;
    test_seq seqs[RIG_SEQS];
    int n_seqs;
    blade_sched_plan plan;
    char got[256]; /* the last plan, as plan_string writes it */
} rig;

static blade_sched_config config(int32_t max_batch_tokens, int32_t max_seqs)
{
    blade_sched_config c;
    blade_sched_config_default(&c);
    c.max_batch_tokens = max_batch_tokens;
    c.max_seqs = max_seqs;
    return c;
}

static void rig_init(rig *r, const blade_sched_config *cfg, int32_t n_blocks, int32_t block_size, bool prefix_caching)
{
    memset(r, 0, sizeof *r);
    blade_kv_cache_config kc = {.n_blocks = n_blocks, .block_size = block_size, .prefix_caching = prefix_caching};
    blade_error err = {{0}};
    r->kv = blade_kv_cache_new(&kc, &err);
    if (!r->kv)
        fail_msg("blade_kv_cache_new: %s", err.msg);
    r->sched = blade_scheduler_new(cfg, r->kv, &err);
    if (!r->sched)
        fail_msg("blade_scheduler_new: %s", err.msg);
}

static void rig_free(rig *r)
{
    for (int i = 0; i < r->n_seqs; i++) {
        if (r->seqs[i].s.state != BLADE_SEQ_FINISHED)
            blade_scheduler_remove(r->sched, &r->seqs[i].s);
        blade_kv_cache_seq_destroy(&r->seqs[i].s.kv);
    }
    blade_scheduler_free(r->sched);
    blade_kv_cache_free(r->kv);
}

/* Tokens are id * 1000 + position: no two sequences share a prefix unless a test copies one. */
static test_seq *add(rig *r, char id, blade_traffic_class cls, int32_t n_prompt, int32_t max_new)
{
    assert_true(r->n_seqs < RIG_SEQS && n_prompt + max_new <= SEQ_TOKENS);
    test_seq *t = &r->seqs[r->n_seqs++];
    for (int32_t i = 0; i < SEQ_TOKENS; i++)
        t->tokens[i] = id * 1000 + i;
    t->max_new = max_new;
    t->s.id = (uint64_t)id;
    t->s.cls = cls;
    t->s.tokens = t->tokens;
    t->s.n_tokens = t->s.n_prompt = n_prompt;
    t->s.max_total = n_prompt + max_new;
    blade_kv_cache_seq_init(&t->s.kv, r->kv, NULL, 0);
    blade_scheduler_add(r->sched, &t->s);
    return t;
}

static test_seq *add_interactive(rig *r, char id, int32_t n_prompt, int32_t max_new)
{
    return add(r, id, BLADE_CLASS_INTERACTIVE, n_prompt, max_new);
}

/* "A4@0* B1@7": per item the sequence's id, the tokens it computes, the position they start
 * at, and '*' when the chunk reaches the last token (a token will be sampled). */
static void plan_string(const blade_sched_plan *p, char *out, size_t cap)
{
    size_t n = 0;
    out[0] = 0;
    for (int32_t i = 0; i < p->n_items && n < cap; i++) {
        const blade_sched_item *it = &p->items[i];
        n += (size_t)snprintf(out + n, cap - n, "%s%c%d@%d%s", i ? " " : "", (char)it->seq->id, it->n_tokens,
                              it->seq->n_computed, it->want_logits ? "*" : "");
    }
}

static bool real_member_running(const rig *r)
{
    for (int i = 0; i < r->n_seqs; i++)
        if (r->seqs[i].s.state == BLADE_SEQ_RUNNING && !r->seqs[i].padding)
            return true;
    return false;
}

/* A sequence that generated its tokens leaves at once, except in a static batch, where it
 * keeps its seat until no member is left running (as the engine's padding seats do). */
static void emit(rig *r, test_seq *t)
{
    assert_true(t->s.n_tokens < SEQ_TOKENS);
    t->tokens[t->s.n_tokens] = (int32_t)t->s.id * 1000 + 500 + t->s.n_tokens;
    t->s.n_tokens++;
    if (t->padding || ++t->n_generated < t->max_new)
        return;
    if (blade_scheduler_config(r->sched)->mode == BLADE_SCHED_STATIC) {
        t->padding = true;
        if (real_member_running(r))
            return;
        t->padding = false;
    }
    blade_scheduler_remove(r->sched, &t->s);
}

static void check_kv(const rig *r)
{
    const blade_kv_cache_seq *live[RIG_SEQS];
    int32_t n = blade_scheduler_live(r->sched, live, RIG_SEQS);
    blade_error err = {{0}};
    if (blade_kv_cache_check(r->kv, live, n, &err) != 0)
        fail_msg("KV invariant broken: %s", err.msg);
}

/* Plans one step and checks it is exactly `want`, then runs it as the engine would. */
static void step(rig *r, const char *want)
{
    blade_scheduler_schedule(r->sched, &r->plan);
    plan_string(&r->plan, r->got, sizeof r->got);
    assert_string_equal(r->got, want);
    int32_t bs = blade_kv_cache_block_size(r->kv), sum = 0;
    for (int32_t i = 0; i < r->plan.n_items; i++) {
        const blade_sched_seq *q = r->plan.items[i].seq;
        assert_int_equal(q->state, BLADE_SEQ_RUNNING);
        assert_true(q->kv.n_blocks * bs >= q->n_computed + r->plan.items[i].n_tokens);
        sum += r->plan.items[i].n_tokens;
    }
    assert_int_equal(r->plan.n_tokens, sum);
    blade_scheduler_commit(r->sched, &r->plan);
    for (int32_t i = 0; i < r->plan.n_items; i++)
        if (r->plan.items[i].want_logits)
            emit(r, (test_seq *)r->plan.items[i].seq);
    for (int i = 0; i < r->n_seqs; i++)
        if (r->seqs[i].padding && !real_member_running(r)) {
            r->seqs[i].padding = false;
            blade_scheduler_remove(r->sched, &r->seqs[i].s);
        }
    check_kv(r);
}

static void assert_waiting_without_blocks(const test_seq *t)
{
    if (t->s.state != BLADE_SEQ_WAITING || t->s.n_computed != 0 || t->s.kv.n_blocks != 0)
        fail_msg("%c: state %d, %d tokens computed, %d blocks; want waiting with none", (char)t->s.id, t->s.state,
                 t->s.n_computed, t->s.kv.n_blocks);
}

/* ---- continuous batching ---- */

/* Running decodes get their token before any prompt chunk, whatever their rank: here a
 * batch-class decoder keeps decoding while an interactive prompt, which ranks ahead of it,
 * is prefilled with what the decode leaves of the budget. */
static void test_decode_first(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(16, 8);
    rig_init(&r, &cfg, 64, 4, false);
    add(&r, 'B', BLADE_CLASS_BATCH, 4, 10);
    step(&r, "B4@0*");
    add_interactive(&r, 'I', 40, 2);
    step(&r, "B1@4* I15@0");
    step(&r, "B1@5* I15@15");
    step(&r, "B1@6* I10@30*");
    /* among decodes the running order holds: interactive first */
    step(&r, "I1@40* B1@7*");
    assert_int_equal(r.seqs[1].s.state, BLADE_SEQ_FINISHED);
    step(&r, "B1@8*");
    rig_free(&r);
}

/* A prompt longer than the budget is cut to what the step has left after the decodes, with
 * logits only on its last chunk; --max-seqs caps the sequences of a step, so a queue of
 * short prompts waits for seats although tokens are left. */
static void test_chunk_sizes_and_caps(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(16, 3);
    rig_init(&r, &cfg, 64, 4, false);
    add_interactive(&r, 'D', 2, 50);
    add_interactive(&r, 'A', 40, 1);
    step(&r, "D2@0* A14@0");
    step(&r, "D1@2* A15@14");
    step(&r, "D1@3* A11@29*");
    assert_int_equal(r.seqs[1].s.state, BLADE_SEQ_FINISHED);
    add_interactive(&r, 'E', 3, 2);
    add_interactive(&r, 'F', 3, 2);
    add_interactive(&r, 'G', 3, 2);
    add_interactive(&r, 'H', 3, 2);
    step(&r, "D1@4* E3@0* F3@0*");
    step(&r, "D1@5* E1@3* F1@3*");
    step(&r, "D1@6* G3@0* H3@0*");
    add_interactive(&r, 'L', 50, 1);
    step(&r, "D1@7* G1@3* H1@3*");
    /* with seats free the budget binds: the prompt takes every token the decode leaves */
    step(&r, "D1@8* L15@0");
    step(&r, "D1@9* L15@15");
    blade_sched_stats st;
    blade_scheduler_stats(r.sched, &st);
    assert_int_equal(st.running, 2);
    assert_int_equal(st.waiting, 0);
    assert_int_equal(st.steps, 9);
    assert_int_equal(st.preemptions, 0);
    rig_free(&r);
}

/* When a running sequence needs a block and none is free, the lowest-ranked, most recently
 * admitted sequence not yet planned this step gives all its blocks back: a batch-class one
 * before any interactive one, even one admitted earlier. It waits at the front of its queue
 * and is recomputed from position 0, its generated tokens included. */
static void test_preemption_victims(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(64, 8);
    rig_init(&r, &cfg, 4, 4, false);
    test_seq *t = add(&r, 'T', BLADE_CLASS_BATCH, 4, 20);
    step(&r, "T4@0*");
    test_seq *a = add_interactive(&r, 'A', 4, 20);
    test_seq *c = add_interactive(&r, 'C', 4, 20);
    step(&r, "T1@4* A4@0* C4@0*");
    assert_int_equal(r.plan.n_preempted, 0);

    /* A needs a second block: T, admitted first but batch-class, is the victim */
    step(&r, "A1@4* C1@4*");
    assert_int_equal(r.plan.n_preempted, 1);
    assert_waiting_without_blocks(t);
    assert_int_equal(t->s.preemptions, 1);
    assert_int_equal(t->s.n_tokens, 6);
    step(&r, "A1@5* C1@5*");
    step(&r, "A1@6* C1@6*");
    step(&r, "A1@7* C1@7*");
    /* A needs a third block: C, the interactive one admitted last, gives way */
    step(&r, "A1@8*");
    assert_int_equal(r.plan.n_preempted, 1);
    assert_waiting_without_blocks(c);
    assert_int_equal(c->s.preemptions, 1);
    assert_int_equal(a->s.preemptions, 0);

    /* A ends: C comes back first (interactive ahead of batch) and computes its 4 prompt
     * tokens and 5 generated ones again, with logits for its next token */
    blade_scheduler_remove(r.sched, &a->s);
    step(&r, "C9@0*");
    assert_int_equal(c->s.n_computed, 9);
    for (int32_t i = 0; i < c->s.n_tokens; i++)
        assert_int_equal(c->tokens[i], 'C' * 1000 + (i < 4 ? i : 500 + i));
    step(&r, "C1@9*");
    blade_scheduler_remove(r.sched, &c->s);
    step(&r, "T6@0*");
    step(&r, "T1@6*");
    blade_sched_stats st;
    blade_scheduler_stats(r.sched, &st);
    assert_int_equal(st.preemptions, 2);
    rig_free(&r);
}

/* With no other running sequence left to take blocks from, the one that needs a block
 * gives its own back and waits at the head of its queue, where no later request overtakes
 * it; a sequence that has outgrown the whole pool is rejected. */
static void test_self_preemption_and_rejection(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(64, 8);
    rig_init(&r, &cfg, 2, 4, false);
    test_seq *a = add_interactive(&r, 'A', 3, 20);
    test_seq *b = add_interactive(&r, 'B', 4, 20);
    step(&r, "A3@0* B4@0*");
    test_seq *w = add_interactive(&r, 'W', 4, 1);
    /* B's block would do for W, but W waits behind B */
    step(&r, "A1@3*");
    assert_int_equal(r.plan.n_preempted, 1);
    assert_waiting_without_blocks(b);
    assert_waiting_without_blocks(w);
    step(&r, "A1@4*");
    blade_scheduler_remove(r.sched, &a->s);
    step(&r, "B5@0*");
    step(&r, "B1@5*");
    step(&r, "B1@6*");
    step(&r, "B1@7*");
    /* its ninth token would need a third block of a two-block pool */
    step(&r, "W4@0*");
    assert_int_equal(r.plan.n_preempted, 0);
    assert_int_equal(r.plan.n_rejected, 1);
    assert_ptr_equal(r.plan.rejected[0], &b->s);
    assert_int_equal(b->s.state, BLADE_SEQ_FINISHED);
    assert_int_equal(b->s.kv.n_blocks, 0);
    /* a prompt the pool can never hold is rejected at admission, without blocking others */
    test_seq *x = add_interactive(&r, 'X', 9, 1);
    add_interactive(&r, 'Y', 2, 1);
    step(&r, "Y2@0*");
    assert_int_equal(r.plan.n_rejected, 1);
    assert_ptr_equal(r.plan.rejected[0], &x->s);
    assert_int_equal(x->s.state, BLADE_SEQ_FINISHED);
    assert_true(blade_scheduler_idle(r.sched));
    rig_free(&r);
}

/* A decode never takes blocks from a sequence that ranks above it: when every sequence
 * below it is planned already, it gives its own blocks back, and here the interactive
 * prompt it would otherwise have preempted mid-prefill completes its chunk. */
static void test_decode_yields_to_higher_rank(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(16, 8);
    rig_init(&r, &cfg, 5, 4, false);
    test_seq *b = add(&r, 'B', BLADE_CLASS_BATCH, 3, 20);
    step(&r, "B3@0*");
    test_seq *f = add_interactive(&r, 'F', 3, 20);
    test_seq *i = add_interactive(&r, 'I', 16, 20);
    step(&r, "B1@3* F3@0* I12@0");
    /* B's fifth token needs a block; the pool is full */
    step(&r, "F1@3* I4@12*");
    assert_int_equal(r.plan.n_preempted, 1);
    assert_waiting_without_blocks(b);
    assert_int_equal(i->s.preemptions, 0);
    blade_scheduler_remove(r.sched, &f->s);
    step(&r, "I1@16*");
    blade_scheduler_remove(r.sched, &i->s);
    step(&r, "B5@0*");
    rig_free(&r);
}

/* Decodes are planned first, but blocks go by rank: an interactive prompt in mid-prefill
 * that needs a block takes it from the batch-class decode planned before it, which leaves
 * the plan, its token going back to the budget. (Were the prompt to give its own blocks
 * back instead, it would be readmitted from position 0 in every step the decode runs.) */
static void test_prefill_outranks_planned_decode(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(6, 8);
    rig_init(&r, &cfg, 6, 4, false);
    test_seq *d = add(&r, 'D', BLADE_CLASS_BATCH, 3, 20);
    step(&r, "D3@0*");
    test_seq *p = add_interactive(&r, 'P', 20, 2);
    step(&r, "D1@3* P5@0");
    step(&r, "D1@4* P5@5");
    step(&r, "D1@5* P5@10");
    add_interactive(&r, 'W', 1, 1);
    step(&r, "P5@15* W1@0*");
    assert_int_equal(r.plan.n_preempted, 1);
    assert_waiting_without_blocks(d);
    assert_int_equal(p->s.preemptions, 0);
    step(&r, "P1@20*");
    assert_int_equal(p->s.state, BLADE_SEQ_FINISHED);
    step(&r, "D6@0");
    step(&r, "D1@6*");
    rig_free(&r);
}

/* A preempted sequence's full blocks stay in the prefix cache (the preemptor takes the
 * free, unhashed block first), so its recompute starts after them. */
static void test_preempted_recompute_from_prefix_cache(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(64, 8);
    rig_init(&r, &cfg, 4, 4, true);
    test_seq *a = add_interactive(&r, 'A', 4, 20);
    test_seq *b = add_interactive(&r, 'B', 9, 20);
    step(&r, "A4@0* B9@0*");
    /* A's fifth token needs a block: B gives back its two full blocks and its partial one */
    step(&r, "A1@4*");
    assert_int_equal(r.plan.n_preempted, 1);
    assert_waiting_without_blocks(b);
    blade_kv_cache_stats ks;
    blade_kv_cache_stats_get(r.kv, &ks);
    assert_int_equal(ks.blocks_cached, 2);
    blade_scheduler_remove(r.sched, &a->s);
    /* 10 tokens: the first 8 are found cached, the last 2 are computed */
    step(&r, "B2@8*");
    assert_int_equal(b->s.kv.n_cached_tokens, 8);
    step(&r, "B1@10*");
    rig_free(&r);
}

/* Batch-class requests take only what interactive ones leave, but one that has waited more
 * than --batch-aging-steps steps is admitted ahead of them, and then ranks as interactive. */
static void test_batch_class_aging(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(64, 2);
    rig_init(&r, &cfg, 64, 4, false);
    test_seq *early = add(&r, 'b', BLADE_CLASS_BATCH, 4, 1);
    add_interactive(&r, 'i', 4, 1);
    step(&r, "i4@0* b4@0*");
    assert_int_equal(early->s.rank, BLADE_CLASS_BATCH);
    rig_free(&r);

    cfg = config(64, 1);
    cfg.batch_aging_steps = 2;
    rig_init(&r, &cfg, 64, 4, false);
    test_seq *aged = add(&r, 'B', BLADE_CLASS_BATCH, 4, 1);
    add_interactive(&r, 'a', 4, 1);
    step(&r, "a4@0*");
    add_interactive(&r, 'b', 4, 1);
    step(&r, "b4@0*");
    add_interactive(&r, 'c', 4, 1);
    step(&r, "c4@0*");
    assert_int_equal(aged->s.waited, 3);
    add_interactive(&r, 'd', 4, 1);
    step(&r, "B4@0*");
    assert_int_equal(aged->s.rank, BLADE_CLASS_INTERACTIVE);
    step(&r, "d4@0*");
    rig_free(&r);
}

/* ---- baseline modes ---- */

/* Without chunked prefill a prompt runs whole: one that does not fit in what the budget
 * leaves waits for the next step, the decodes wait while prompts run, and a prompt larger
 * than the whole budget runs alone. */
static void test_no_chunked_prefill(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(16, 8);
    cfg.chunked_prefill = false;
    rig_init(&r, &cfg, 64, 4, false);
    add_interactive(&r, 'A', 10, 3);
    add_interactive(&r, 'B', 10, 3);
    step(&r, "A10@0*");
    step(&r, "B10@0*");
    step(&r, "A1@10* B1@10*");
    add_interactive(&r, 'C', 40, 1);
    step(&r, "C40@0*");
    step(&r, "A1@11* B1@11*");
    assert_true(blade_scheduler_idle(r.sched));
    rig_free(&r);
}

/* Contiguous allocation reserves a request's whole length (prompt + max new tokens) when it
 * is admitted: the next request waits for blocks that paged allocation would have given it,
 * and a request whose reservation exceeds the pool is rejected though its prompt fits. */
static void test_contiguous_kv(void **state)
{
    (void)state;
    for (int contiguous = 0; contiguous < 2; contiguous++) {
        rig r;
        blade_sched_config cfg = config(64, 8);
        cfg.contiguous_kv = contiguous;
        rig_init(&r, &cfg, 4, 4, false);
        test_seq *a = add_interactive(&r, 'A', 4, 8);
        test_seq *b = add_interactive(&r, 'B', 4, 4);
        if (!contiguous) {
            step(&r, "A4@0* B4@0*");
            assert_int_equal(a->s.kv.n_blocks, 1);
            rig_free(&r);
            continue;
        }
        step(&r, "A4@0*");
        assert_int_equal(a->s.kv.n_blocks, 3);
        assert_waiting_without_blocks(b);
        step(&r, "A1@4*");
        assert_int_equal(a->s.kv.n_blocks, 3);
        blade_scheduler_remove(r.sched, &a->s);
        step(&r, "B4@0*");
        assert_int_equal(b->s.kv.n_blocks, 2);
        test_seq *x = add_interactive(&r, 'X', 2, 20);
        step(&r, "B1@4*");
        assert_int_equal(r.plan.n_rejected, 1);
        assert_ptr_equal(r.plan.rejected[0], &x->s);
        rig_free(&r);
    }
}

/* Static batching forms a batch only when the previous one has ended: a member that has
 * generated its tokens keeps its seat and computes on, a request arriving meanwhile waits
 * without blocks, and a member leaving early (the engine drops a padding seat it lost)
 * does not let it in either. */
static void test_static_batch(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(64, 8);
    cfg.mode = BLADE_SCHED_STATIC;
    rig_init(&r, &cfg, 64, 4, false);
    test_seq *a = add_interactive(&r, 'A', 4, 2);
    test_seq *b = add_interactive(&r, 'B', 6, 5);
    step(&r, "A4@0* B6@0*");
    test_seq *c = add_interactive(&r, 'C', 3, 1);
    step(&r, "A1@4* B1@6*");
    assert_true(a->padding);
    step(&r, "A1@5* B1@7*");
    assert_waiting_without_blocks(c);
    blade_scheduler_remove(r.sched, &a->s);
    step(&r, "B1@8*");
    step(&r, "B1@9*");
    assert_waiting_without_blocks(c);
    assert_int_equal(b->s.state, BLADE_SEQ_FINISHED);
    step(&r, "C3@0*");
    rig_free(&r);

    /* a batch whose members all finish together ends with them */
    rig_init(&r, &cfg, 64, 4, false);
    add_interactive(&r, 'A', 4, 2);
    add_interactive(&r, 'B', 5, 2);
    step(&r, "A4@0* B5@0*");
    add_interactive(&r, 'C', 3, 1);
    step(&r, "A1@4* B1@5*");
    step(&r, "C3@0*");
    rig_free(&r);
}

/* A static batch is a fixed shape whose every seat runs in each decode step, so it has at
 * most --max-seqs seats and no more than the step's token budget: requests beyond it wait
 * for the next batch instead of joining one that cannot run them. */
static void test_static_batch_size(void **state)
{
    (void)state;
    rig r;
    blade_sched_config cfg = config(64, 2);
    cfg.mode = BLADE_SCHED_STATIC;
    rig_init(&r, &cfg, 64, 4, false);
    add_interactive(&r, 'A', 4, 3);
    add_interactive(&r, 'B', 4, 1);
    test_seq *c = add_interactive(&r, 'C', 4, 1);
    step(&r, "A4@0* B4@0*");
    assert_waiting_without_blocks(c);
    step(&r, "A1@4* B1@4*");
    step(&r, "A1@5* B1@5*");
    assert_waiting_without_blocks(c);
    step(&r, "C4@0*");
    rig_free(&r);

    cfg = config(2, 8);
    cfg.mode = BLADE_SCHED_STATIC;
    rig_init(&r, &cfg, 64, 4, false);
    add_interactive(&r, 'A', 1, 2);
    add_interactive(&r, 'B', 1, 2);
    c = add_interactive(&r, 'C', 1, 2);
    step(&r, "A1@0* B1@0*");
    assert_waiting_without_blocks(c);
    step(&r, "A1@1* B1@1*");
    step(&r, "C1@0*");
    rig_free(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_first),
        cmocka_unit_test(test_chunk_sizes_and_caps),
        cmocka_unit_test(test_preemption_victims),
        cmocka_unit_test(test_self_preemption_and_rejection),
        cmocka_unit_test(test_decode_yields_to_higher_rank),
        cmocka_unit_test(test_prefill_outranks_planned_decode),
        cmocka_unit_test(test_preempted_recompute_from_prefix_cache),
        cmocka_unit_test(test_batch_class_aging),
        cmocka_unit_test(test_no_chunked_prefill),
        cmocka_unit_test(test_contiguous_kv),
        cmocka_unit_test(test_static_batch),
        cmocka_unit_test(test_static_batch_size),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

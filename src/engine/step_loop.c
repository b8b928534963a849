/* The engine thread (engine_internal.h). Each step: take what was submitted or aborted,
 * let the scheduler plan the step, build one ragged batch from the plan, run it through the
 * runner, commit the computed tokens to the schedule, and hand every row of logits to its
 * choice's output, which samples and emits the token. Everything here runs on this one
 * thread; it meets the callers only in take_incoming and publish_stats. */

#include "engine/engine_internal.h"
#include "engine/spec_verify.h"

#include "common/clock.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the live list: every choice the loop knows ---- */

/* Places an imported prefill's blocks: the leading blocks the prefix cache holds, then the
 * ones that travelled, as far as they reach without a gap; the rest of the prompt is
 * computed again. All or nothing when the pool has no room: the whole prompt is computed. */
static void place_import(blade_engine *e, request_state *r)
{
    blade_sched_seq *q = &r->seq;
    int32_t bs = e->cfg.block_size, n_prompt = q->n_prompt;
    int32_t matched = blade_kv_cache_match_prefix(e->kv, &q->kv, r->tokens, n_prompt + 1);
    int32_t computed = matched;
    if (blade_kv_cache_allocate(e->kv, &q->kv, n_prompt) == 0) {
        for (int32_t b = matched / bs, j = 0; b * bs < n_prompt; b++) {
            while (j < r->import_n_sent && r->import_sent[j] < b)
                j++;
            if (j == r->import_n_sent || r->import_sent[j] != b)
                break;
            blade_kv_store_copy_between(r->import_staging, j, e->store, q->kv.blocks[b]);
            computed = (b + 1) * bs < n_prompt ? (b + 1) * bs : n_prompt;
        }
    }
    /* Blocks past what was placed hold nothing yet: give them back so the scheduler
     * allocates as it computes. */
    if (computed == 0)
        blade_kv_cache_release(e->kv, &q->kv);
    q->n_computed = computed;
    blade_kv_cache_commit(e->kv, &q->kv, r->tokens, computed);
    blade_kv_store_free(r->import_staging);
    r->import_staging = NULL;
    r->tokens[q->n_tokens++] = r->import_first;
}

static void live_add(blade_engine *e, request_state *r)
{
    blade_kv_cache_seq_init(&r->seq.kv, e->kv, r->salt, r->salt ? strlen(r->salt) : 0);
    if (e->draft)
        spec_draft_seq_init(e->draft, &r->draft);
    spec_accept_start(&r->accept, &e->spec_traffic);
    r->prev_live = NULL;
    r->next_live = e->live;
    if (e->live)
        e->live->prev_live = r;
    e->live = r;
    if (r->importing)
        place_import(e, r);
    blade_scheduler_add(e->sched, &r->seq);
}

static void live_unlink(blade_engine *e, request_state *r)
{
    if (r->prev_live)
        r->prev_live->next_live = r->next_live;
    else
        e->live = r->next_live;
    if (r->next_live)
        r->next_live->prev_live = r->prev_live;
}

/* The other choices start once the first has its prompt in the cache (its first token),
 * so they find every full prompt block there. */
static void release_followers(blade_engine *e, request_state *r)
{
    while (r->followers) {
        request_state *f = r->followers;
        r->followers = f->next_live;
        f->out.t_submit = r->out.t_submit;
        live_add(e, f);
    }
}

/* ---- ending a choice ---- */

/* Takes a finished choice out of the step loop; a pinned prompt's blocks are pinned while
 * the sequence still holds them. */
static void retire(blade_engine *e, request_state *r)
{
    if (r->exported)
        blade_kv_cache_release(e->kv, &r->seq.kv);
    if (r->pin_prefix && r->seq.n_computed >= r->seq.n_prompt)
        blade_kv_cache_pin_prefix(e->kv, r->tokens, r->seq.n_prompt, r->salt, r->salt ? strlen(r->salt) : 0);
    if (r->seq.state != BLADE_SEQ_FINISHED)
        blade_scheduler_remove(e->sched, &r->seq);
    if (e->draft)
        spec_draft_seq_release(e->draft, &r->draft);
    live_unlink(e, r);
}

/* A fixed-shape batch sizes every seat for its longest member, so a padding seat may run
 * past its own request's length: as many more steps as the member with the most left can
 * take (what --kv-alloc contiguous then reserves for it), up to the context limit. False
 * when no member is left, the batch ending with this one, or when it cannot grow. */
static bool become_padding(blade_engine *e, request_state *r)
{
    int64_t rest = 0;
    for (const request_state *q = e->live; q; q = q->next_live)
        if (q != r && !q->padding && q->seq.state == BLADE_SEQ_RUNNING && q->seq.max_total - q->seq.n_tokens > rest)
            rest = q->seq.max_total - q->seq.n_tokens;
    int64_t total = r->seq.n_tokens + rest;
    total = total < e->max_context ? total : e->max_context;
    if (rest == 0 || total <= r->seq.n_tokens)
        return false;
    int32_t *grown = realloc(r->tokens, (size_t)total * sizeof *grown);
    if (!grown)
        return false;
    r->tokens = grown;
    r->seq.tokens = grown;
    r->cap_tokens = r->seq.max_total = (int32_t)total;
    r->padding = true;
    return true;
}

/* After a choice's last event: static batching keeps a running member's seat computing
 * until its batch ends (also when the client stopped reading: a fixed-shape batch cannot
 * drop a row); otherwise its blocks go back to the pool and its memory is freed. */
static void end_request(blade_engine *e, request_state *r, blade_finish_reason why)
{
    if (e->cfg.sched.mode == BLADE_SCHED_STATIC && why != BLADE_FINISH_ERROR && !e->quitting && !r->padding &&
        r->pooling == BLADE_POOL_NONE &&
        r->seq.state == BLADE_SEQ_RUNNING && become_padding(e, r))
        return;
    retire(e, r);
    engine_request_free(r);
}

/* Ends a choice without a token: one last event (a padding seat has had it already), then
 * end_request. */
static void finish(blade_engine *e, request_state *r, blade_finish_reason why, const char *error)
{
    if (r->padding || r->exported) {
        end_request(e, r, why);
        return;
    }
    release_followers(e, r);
    request_output_finish(&r->out, &r->seq, why, error);
    e->finished++;
    end_request(e, r, why);
}

/* ---- one row of logits ---- */

/* An export_kv request after its first token: it leaves the schedule holding its blocks,
 * and its last event describes them (what blade_kv_export promises stays valid until the
 * caller releases it). */
static void export_prefill(blade_engine *e, request_state *r, int32_t first)
{
    blade_sched_seq *q = &r->seq;
    int32_t bs = e->cfg.block_size, n_blocks = (q->n_prompt + bs - 1) / bs, n_full = q->n_prompt / bs;
    r->export_blocks = malloc((size_t)n_blocks * sizeof *r->export_blocks);
    r->export_hashes = malloc((size_t)(n_full ? n_full : 1) * sizeof *r->export_hashes);
    if (!r->export_blocks || !r->export_hashes || q->kv.n_blocks < n_blocks ||
        !blade_kv_cache_hash_chain(e->kv, &q->kv, r->tokens, n_full, r->export_hashes)) {
        finish(e, r, BLADE_FINISH_ERROR, "cannot describe the prefill's KV blocks for export (out of memory)");
        return;
    }
    memcpy(r->export_blocks, q->kv.blocks, (size_t)n_blocks * sizeof *r->export_blocks);
    blade_scheduler_detach(e->sched, q);
    r->exported = true;
    r->export = (blade_kv_export){.tokens = r->tokens, .n_tokens = q->n_prompt, .first_token = first,
                                  .blocks = r->export_blocks, .n_blocks = n_blocks,
                                  .hashes = (const uint8_t(*)[BLADE_HASH_BYTES])r->export_hashes,
                                  .n_hashes = n_full};
    e->generated_tokens++;
    e->finished++;
    request_output_export(&r->out, q, first, &r->export);
}

/* Appends a chosen token (already in the sampler's history) to the sequence and emits it.
 * Returns true when the choice is finished: r may then be gone, and no further row of it
 * may be emitted. */
static bool emit_chosen(blade_engine *e, request_state *r, int32_t id, const float *logits)
{
    if (r->padding) {
        r->tokens[r->seq.n_tokens++] = id;
        if (r->seq.n_tokens < r->seq.max_total)
            return false;
        finish(e, r, BLADE_FINISH_LENGTH, NULL); /* its fixed-shape buffer is full */
        return true;
    }
    if (r->export_kv) {
        export_prefill(e, r, id);
        return true;
    }
    release_followers(e, r);
    r->tokens[r->seq.n_tokens++] = id;
    e->generated_tokens++;
    blade_finish_reason why = request_output_token(&r->out, &e->vocab, &r->seq, id, logits);
    if (why == BLADE_FINISH_NONE)
        return false;
    e->finished++;
    end_request(e, r, why);
    return true;
}

/* The first token of an imported prefill, sampled by the engine that computed it: this
 * choice's sampler skips the draw that took it, so later draws match that engine's. */
static void emit_imported(blade_engine *e, request_state *r)
{
    int32_t id = r->tokens[r->seq.n_tokens - 1];
    r->importing = false;
    blade_sampler_skip_draws(r->out.sampler, 1);
    blade_sampler_accept(r->out.sampler, id, true);
    e->generated_tokens++;
    blade_finish_reason why = request_output_token(&r->out, &e->vocab, &r->seq, id, NULL);
    if (why != BLADE_FINISH_NONE) {
        e->finished++;
        end_request(e, r, why);
    }
}

/* ---- embeddings ---- */

/* Adds one chunk's final hidden states (rows for positions pos0..pos0+n-1) to an embedding
 * request's pooling, in position order, skipping rows a preempted sequence pools again. */
static void pool_rows(const blade_engine *e, request_state *r, const float *rows, int32_t pos0, int32_t n)
{
    const int32_t d = e->m->hp.n_embd;
    for (int32_t j = 0; j < n; j++) {
        const float *row = rows + (size_t)j * d;
        if (pos0 + j == r->seq.n_prompt - 1 && !r->pool_sum)
            memcpy(r->pool_last, row, (size_t)d * sizeof *row);
        if (!r->pool_sum || pos0 + j != r->pooled)
            continue;
        for (int32_t k = 0; k < d; k++)
            r->pool_sum[k] += row[k];
        r->pooled++;
    }
}

/* The prompt is computed: the pooled vector, L2-normalised, is the request's one event. */
static void finish_embedding(blade_engine *e, request_state *r)
{
    const int32_t d = e->m->hp.n_embd;
    float *v = r->pool_last;
    if (r->pool_sum)
        for (int32_t k = 0; k < d; k++)
            v[k] = (float)(r->pool_sum[k] / r->seq.n_prompt);
    double norm = 0;
    for (int32_t k = 0; k < d; k++)
        norm += (double)v[k] * v[k];
    norm = sqrt(norm);
    for (int32_t k = 0; k < d; k++)
        v[k] = norm > 0 ? (float)(v[k] / norm) : 0.0f;
    request_output_embedding(&r->out, &r->seq, v, d);
    e->finished++;
    end_request(e, r, BLADE_FINISH_STOP);
}

/* Room for every batch row's final hidden state, made when the first embedding runs. */
static float *hidden_rows(blade_engine *e)
{
    if (!e->hidden)
        e->hidden = malloc((size_t)e->runner_tokens * (size_t)e->m->hp.n_embd * sizeof *e->hidden);
    return e->hidden;
}

/* Samples the next token of a choice from one row of logits and emits it, as
 * emit_chosen. */
static bool emit_token(blade_engine *e, request_state *r, const float *logits)
{
    int32_t id = request_output_sample(&r->out, logits);
    if (id < 0) {
        finish(e, r, BLADE_FINISH_ERROR, "the model produced no usable logits (all NaN or -inf)");
        return true;
    }
    return emit_chosen(e, r, id, logits);
}

/* ---- speculative decoding ---- */

/* Drafts this step may carry for r: none unless it is decoding and allowed to speculate;
 * never more than the tokens it may still produce, less the one the target always adds. */
static int32_t draft_room(const blade_engine *e, const request_state *r)
{
    const blade_spec_config *sc = &e->cfg.spec;
    if (sc->mode == BLADE_SPEC_NONE || e->cfg.sched.mode == BLADE_SCHED_STATIC || !r->speculative || r->padding ||
        r->pooling != BLADE_POOL_NONE || r->export_kv ||
        r->seq.state != BLADE_SEQ_RUNNING || r->seq.n_tokens - r->seq.n_computed != 1)
        return 0;
    int32_t room = r->seq.max_total - r->seq.n_tokens;
    int32_t left = r->out.max_tokens - r->out.n_generated;
    room = (room < left ? room : left) - 1;
    return room < sc->k ? room : sc->k;
}

/* The work a step does without drafts: its decodes, and the prefill it will take up to the
 * budget (a prefill token is as useful as a decoded one). It sets what drafts cost and what
 * they must beat. */
static int32_t step_work(const blade_engine *e)
{
    int32_t decodes = 0;
    int64_t pending = 0;
    for (request_state *r = e->live; r; r = r->next_live) {
        int32_t need = r->seq.n_tokens - r->seq.n_computed;
        if (r->seq.state == BLADE_SEQ_RUNNING && need == 1)
            decodes++;
        else if (r->seq.state != BLADE_SEQ_FINISHED)
            pending += need;
    }
    int64_t budget = e->cfg.sched.max_batch_tokens, base = decodes + pending;
    return (int32_t)(base < budget ? base : budget);
}

/* What r's drafts showed teaches its own estimate and the traffic's, which new sequences
 * start from. */
static void learn_acceptance(blade_engine *e, request_state *r, int32_t drafted, int32_t accepted)
{
    spec_accept_update(&r->accept, drafted, accepted);
    spec_accept_update(&e->spec_traffic, drafted, accepted);
}

/* The policy's k for every sequence that may speculate, from its acceptance so far; one
 * that has sat out long enough tries once (spec_policy_probe). */
static void choose_k(blade_engine *e)
{
    int32_t n = 0;
    for (request_state *r = e->live; r; r = r->next_live)
        if (r->spec_k > 0 && n < e->cfg.sched.max_seqs) {
            e->cands[n] = (spec_cand){.alpha = spec_accept_rate(&r->accept), .k_max = r->spec_k};
            e->cand_owner[n++] = r;
        }
    int32_t work = step_work(e);
    spec_policy_choose(e->curve.cost, e->curve.n, work, work, e->draft_cost, e->cands, n);
    for (int32_t i = 0; i < n; i++) {
        request_state *r = e->cand_owner[i];
        if (e->cands[i].k > 0) {
            r->accept.idle = 0;
        } else if (spec_policy_probe(e->curve.cost, e->curve.n, work, e->draft_cost, ++r->accept.idle)) {
            r->spec_probe = true;
            r->accept.idle = 0;
            e->cands[i].k = 1;
        }
        r->spec_k = e->cands[i].k;
    }
}

/* Once a drafting model's drafts are made and rated: how many of each sequence's the step
 * verifies, handed out as before but by each draft's own chance of being kept (the
 * drafting itself is paid by then). */
static void trim_drafts(blade_engine *e, int32_t n_jobs)
{
    int32_t n = 0;
    for (int32_t i = 0; i < n_jobs; i++) {
        const spec_draft_job *j = &e->draft_jobs[i];
        if (j->n_out == 0)
            continue;
        e->cands[n] = (spec_cand){.gain = j->gain, .k_max = j->n_out};
        e->cand_owner[n++] = e->draft_owner[i];
    }
    int32_t work = step_work(e);
    spec_policy_choose(e->curve.cost, e->curve.n, work, work, 0, e->cands, n);
    for (int32_t i = 0; i < n; i++)
        e->cand_owner[i]->seq.n_draft = e->cands[i].k;
}

/* Drafting stops once every draft so far being kept is less likely than this: such a
 * draft is worth a tenth of a token, and on a flat verify curve (Q8_0 on AVX-512) that
 * still pays for itself and its draft-model call, so only drafts below it are never made. */
#define DRAFT_STOP_BELOW 0.1

/* The draft model drafts for all speculating sequences together: each sequence the policy
 * lets speculate drafts as far as its room, unless it stops at a doubtful draft first, and
 * trim_drafts then keeps what the drafts' ratings make worth verifying. A preempted
 * sequence gives its draft KV back: it may wait long, and others can use the room
 * meanwhile. */
static void propose_with_draft_model(blade_engine *e)
{
    int32_t n = 0, work = step_work(e);
    /* a draft must also be worth its call of the draft model */
    double stop_below = DRAFT_STOP_BELOW > 2 * e->draft_cost ? DRAFT_STOP_BELOW : 2 * e->draft_cost;
    spec_step_econ econ = {e->curve.cost, e->curve.n, work, work, e->draft_cost};
    for (request_state *r = e->live; r; r = r->next_live) {
        if (r->seq.state == BLADE_SEQ_WAITING && r->draft.kv.n_blocks)
            spec_draft_seq_release(e->draft, &r->draft);
        if (r->spec_k > 0 && n < e->cfg.sched.max_seqs) {
            e->draft_owner[n] = r;
            e->draft_jobs[n++] = (spec_draft_job){.seq = &r->draft, .target_seq = &r->seq.kv, .tokens = r->tokens,
                                                  .n_tokens = r->seq.n_tokens,
                                                  .k = e->adaptive && !r->spec_probe ? draft_room(e, r) : r->spec_k,
                                                  .stop_below = e->adaptive ? stop_below : 0,
                                                  .econ = e->adaptive ? &econ : NULL};
        }
    }
    blade_error err = {{0}};
    /* a failed draft call costs only this step's speculation; the target's step goes on */
    spec_draft_propose(e->draft, e->draft_jobs, n, &e->calib, &err);
    for (int32_t i = 0; i < n; i++) {
        request_state *r = e->draft_owner[i];
        const spec_draft_job *j = &e->draft_jobs[i];
        e->spec_draft_calls += j->n_out > 0;
        r->seq.n_draft = j->n_out;
        memcpy(r->spec_conf, j->conf, (size_t)j->n_out * sizeof *j->conf);
        memcpy(r->spec_source, j->source, (size_t)j->n_out * sizeof *j->source);
    }
    if (!e->adaptive)
        return;
    trim_drafts(e, n);
    for (int32_t i = 0; i < n; i++)
        if (e->draft_jobs[i].n_out > 0 && e->draft_owner[i]->seq.n_draft == 0)
            learn_acceptance(e, e->draft_owner[i], 1, 0);
}

/* Puts each speculating sequence's drafts after its last token, where the plan finds them. */
static void propose_drafts(blade_engine *e)
{
    const blade_spec_config *sc = &e->cfg.spec;
    for (request_state *r = e->live; r; r = r->next_live) {
        r->seq.n_draft = 0;
        r->spec_k = draft_room(e, r);
        r->spec_probe = false;
    }
    if (sc->mode == BLADE_SPEC_NONE)
        return;
    if (e->adaptive)
        choose_k(e);
    if (e->draft) {
        propose_with_draft_model(e);
        return;
    }
    for (request_state *r = e->live; r; r = r->next_live)
        if (r->spec_k > 0)
            r->seq.n_draft = blade_ngram_propose(r->tokens, r->seq.n_tokens, sc->ngram_min, sc->ngram_max, r->spec_k,
                                                 r->tokens + r->seq.n_tokens);
}

/* Decides, for every planned verify chunk, which tokens the step produces, and tells the
 * plan how many drafts each keeps (commit reads it). */
static void verify_drafts(blade_engine *e, blade_sched_plan *plan)
{
    const int32_t n_vocab = e->m->hp.n_vocab;
    for (int32_t i = 0; i < plan->n_items; i++) {
        blade_sched_item *it = &plan->items[i];
        if (it->n_draft == 0)
            continue;
        request_state *r = (request_state *)it->seq;
        int32_t row = e->item_row[i];
        const float *logits = e->logits + (size_t)row * n_vocab;
        const int32_t *draft = r->tokens + r->seq.n_tokens;
        int32_t m = spec_verify(r->out.sampler, logits, n_vocab, draft, it->n_draft, e->spec_probs,
                                e->spec_out + row, &e->item_bad[i]);
        e->item_out[i] = m;
        it->n_accepted = m > 0 ? m - 1 : 0;
        e->spec_verifies++;
        e->spec_draft_tokens += (uint64_t)it->n_draft;
        e->spec_accepted_tokens += (uint64_t)it->n_accepted;
        e->spec_accept_hist[it->n_accepted]++;
        e->spec_draft_hist[it->n_draft]++;
        learn_acceptance(e, r, it->n_draft, it->n_accepted);
        /* the drafts up to the first rejected one are what verification has judged */
        if (e->draft)
            for (int32_t d = 0; d < it->n_draft && d <= it->n_accepted; d++)
                spec_calib_update(&e->calib, (spec_source)r->spec_source[d], r->spec_conf[d], d < it->n_accepted);
    }
}

/* Emits the tokens verification chose for item i, stopping at the first that finishes the
 * choice (the rest are dropped as if rejected). */
static void emit_verified_run(blade_engine *e, const blade_sched_plan *plan, int32_t i)
{
    const int32_t n_vocab = e->m->hp.n_vocab;
    request_state *r = (request_state *)plan->items[i].seq;
    int32_t row = e->item_row[i];
    for (int32_t j = 0; j < e->item_out[i]; j++)
        if (emit_chosen(e, r, e->spec_out[row + j], e->logits + (size_t)(row + j) * n_vocab))
            return;
    if (e->item_bad[i])
        finish(e, r, BLADE_FINISH_ERROR, "the model produced no usable logits (all NaN or -inf)");
}

/* ---- the step ---- */

/* Moves submitted choices onto the live list and carries out the aborts asked for. */
static void take_incoming(blade_engine *e)
{
    pthread_mutex_lock(&e->mu);
    request_state *in = e->incoming_head;
    e->incoming_head = e->incoming_tail = NULL;
    int32_t n_aborts = e->n_aborts;
    uint64_t aborts[64];
    int32_t take = n_aborts < 64 ? n_aborts : 64;
    if (take) {
        memcpy(aborts, e->aborts, (size_t)take * sizeof *aborts);
        memmove(e->aborts, e->aborts + take, (size_t)(n_aborts - take) * sizeof *aborts);
        e->n_aborts -= take;
    }
    pthread_mutex_unlock(&e->mu);

    while (in) {
        request_state *next = in->next_live;
        live_add(e, in);
        if (in->importing)
            emit_imported(e, in);
        in = next;
    }
    /* finishing a first choice starts its followers, so rescan until none is left */
    for (int32_t i = 0; i < take; i++) {
        request_state *r = e->live;
        while (r) {
            if (r->seq.id == aborts[i] && !r->padding) {
                finish(e, r, BLADE_FINISH_ABORT, NULL);
                r = e->live;
            } else {
                r = r->next_live;
            }
        }
    }
}

/* Static batching: the batch ends when its last real member does; a padding seat that was
 * preempted is dropped at once (a request-level engine never reruns a finished request). */
static void end_padding(blade_engine *e)
{
    if (e->cfg.sched.mode != BLADE_SCHED_STATIC)
        return;
    bool members_left = false;
    for (request_state *r = e->live; r; r = r->next_live)
        members_left |= !r->padding && r->seq.state == BLADE_SEQ_RUNNING;
    for (request_state *r = e->live, *next; r; r = next) {
        next = r->next_live;
        if (r->padding && (!members_left || r->seq.state != BLADE_SEQ_RUNNING))
            finish(e, r, BLADE_FINISH_NONE, NULL);
    }
}

/* A step of one sequence alone is a point of the verify-cost curve as the machine is now:
 * the adaptive policy follows it, and a decode step (its last token and drafts) counts in
 * the statistics by its size. */
static void observe_solo_step(blade_engine *e, const blade_sched_item *it, double seconds)
{
    if (e->curve_live)
        spec_curve_observe(&e->curve, it->n_tokens, seconds * 1e3);
    if (it->want_logits && it->n_tokens == 1 + it->n_draft) {
        e->solo_decode_steps[it->n_tokens]++;
        e->solo_decode_seconds[it->n_tokens] += seconds;
    }
}

static void run_step(blade_engine *e)
{
    end_padding(e);

    /* plan */
    double t_draft = blade_clock_seconds();
    propose_drafts(e);
    e->spec_draft_seconds += blade_clock_seconds() - t_draft;
    blade_sched_plan plan;
    blade_scheduler_schedule(e->sched, &plan);
    for (int32_t i = 0; i < plan.n_rejected; i++)
        finish(e, (request_state *)plan.rejected[i], BLADE_FINISH_ERROR,
               "the request needs more KV cache blocks than the whole pool holds");
    if (plan.n_items == 0)
        return;

    /* one ragged batch: each planned sequence's next chunk, one logits row where it ends,
     * or one per row of a verify chunk (its real token and each draft) */
    const int32_t n_vocab = e->m->hp.n_vocab;
    double t = blade_clock_seconds();
    int32_t hidden_row = 0, rows = 0;
    for (int32_t i = 0; i < plan.n_items; i++) {
        blade_sched_item *it = &plan.items[i];
        request_state *r = (request_state *)it->seq;
        if (r->out.t_scheduled == 0)
            r->out.t_scheduled = t;
        float *hidden = NULL;
        if (r->pooling != BLADE_POOL_NONE) {
            if (!(hidden = hidden_rows(e))) {
                for (int32_t j = 0; j < plan.n_items; j++)
                    finish(e, (request_state *)plan.items[j].seq, BLADE_FINISH_ERROR,
                           "out of memory for the hidden states of an embedding");
                return;
            }
            hidden += (size_t)hidden_row * e->m->hp.n_embd;
        }
        hidden_row += it->n_tokens;
        int32_t n_logits = it->want_logits && r->pooling == BLADE_POOL_NONE ? 1 + it->n_draft : 0;
        e->item_row[i] = rows;
        e->batch[i] = (blade_batch_seq){
            .tokens = r->tokens + r->seq.n_computed,
            .n_tokens = it->n_tokens,
            .pos0 = r->seq.n_computed,
            .block_table = r->seq.kv.blocks,
            .n_blocks = r->seq.kv.n_blocks,
            .logit_rows = it->n_draft ? e->row_ids : NULL,
            .n_logits = n_logits,
            .logits = e->logits + (size_t)rows * n_vocab,
            .hidden = hidden,
        };
        rows += n_logits;
    }

    /* forward */
    blade_error err = {{0}};
    pthread_mutex_unlock(&e->kv_mu);
    double t0 = blade_clock_seconds();
    int failed = blade_runner_forward(e->runner, e->batch, plan.n_items, &err);
    double forward_s = blade_clock_seconds() - t0;
    if (!failed && plan.n_items == 1)
        observe_solo_step(e, &plan.items[0], forward_s);
    pthread_mutex_lock(&e->kv_mu);
    if (failed) {
        for (int32_t i = 0; i < plan.n_items; i++)
            finish(e, (request_state *)plan.items[i].seq, BLADE_FINISH_ERROR, err.msg);
        return;
    }

    /* verify drafts, commit what was kept, then sample and emit */
    verify_drafts(e, &plan);
    blade_scheduler_commit(e->sched, &plan);
    e->computed_tokens += (uint64_t)plan.n_tokens;
    if (plan.n_items > e->max_running)
        e->max_running = plan.n_items;
    for (int32_t i = 0; i < plan.n_items; i++) {
        request_state *r = (request_state *)plan.items[i].seq;
        if (r->pooling != BLADE_POOL_NONE) {
            pool_rows(e, r, e->batch[i].hidden, e->batch[i].pos0, e->batch[i].n_tokens);
            if (plan.items[i].want_logits)
                finish_embedding(e, r);
        } else if (plan.items[i].n_draft) {
            emit_verified_run(e, &plan, i);
        } else if (plan.items[i].want_logits) {
            emit_token(e, r, e->logits + (size_t)e->item_row[i] * n_vocab);
        }
    }
    end_padding(e);
}

/* ---- after the step: what the callers may read ---- */

/* What rollback promises: a running sequence holds no block wholly beyond its computed
 * tokens (rejected drafts gave theirs back) and the prefix cache knows only blocks of
 * computed tokens (never one holding a rejected draft). Continuous paged scheduling only:
 * contiguous mode reserves a request's whole length up front, and static batching a
 * member's whole prompt at admission. */
static void check_rollback(blade_engine *e)
{
    if (e->cfg.sched.contiguous_kv || e->cfg.sched.mode == BLADE_SCHED_STATIC || e->invariant_error[0])
        return;
    int32_t bs = e->cfg.block_size;
    for (const request_state *r = e->live; r; r = r->next_live) {
        const blade_sched_seq *q = &r->seq;
        if (q->state != BLADE_SEQ_RUNNING)
            continue;
        int32_t held = (q->n_computed + bs - 1) / bs;
        if (q->kv.n_blocks > held || q->kv.n_hashed * bs > q->n_computed) {
            snprintf(e->invariant_error, sizeof e->invariant_error,
                     "after step %llu: sequence %llu holds %d blocks (%d hashed) for %d computed tokens",
                     (unsigned long long)e->invariant_checks, (unsigned long long)q->id, q->kv.n_blocks,
                     q->kv.n_hashed, q->n_computed);
            return;
        }
    }
}

/* One KV cache's accounting against what the n live requests hold in it: the target's, or
 * (draft) the draft model's, whose blocks rollbacks and preemptions give back as well. */
static void check_kv(blade_engine *e, bool draft, int32_t n)
{
    int32_t i = 0;
    for (request_state *r = e->live; r; r = r->next_live)
        e->live_kv[i++] = draft ? &r->draft.kv : &r->seq.kv;
    blade_error err = {{0}};
    int rc = draft ? spec_draft_check_kv(e->draft, e->live_kv, n, &err)
                   : blade_kv_cache_check(e->kv, e->live_kv, n, &err);
    if (rc && !e->invariant_error[0])
        snprintf(e->invariant_error, sizeof e->invariant_error, "after step %llu: %s%s",
                 (unsigned long long)e->invariant_checks, draft ? "draft KV: " : "", err.msg);
}

static void check_invariants(blade_engine *e)
{
    int32_t n = 0;
    for (request_state *r = e->live; r; r = r->next_live)
        n++;
    if (n > e->cap_live_kv) {
        const blade_kv_cache_seq **grown = realloc(e->live_kv, (size_t)n * 2 * sizeof *grown);
        if (!grown)
            return;
        e->live_kv = grown;
        e->cap_live_kv = n * 2;
    }
    e->invariant_checks++;
    check_kv(e, false, n);
    if (e->draft)
        check_kv(e, true, n);
    check_rollback(e);
}

static void publish_stats(blade_engine *e)
{
    if (e->cfg.check_invariants)
        check_invariants(e);
    blade_sched_stats ss;
    blade_kv_cache_stats ks;
    blade_scheduler_stats(e->sched, &ss);
    blade_kv_cache_stats_get(e->kv, &ks);
    blade_engine_stats *s = &e->stats;
    pthread_mutex_lock(&e->mu);
    s->running = ss.running;
    s->waiting = ss.waiting;
    s->kv_blocks_total = ks.blocks_total;
    s->kv_blocks_used = ks.blocks_used;
    s->kv_blocks_cached = ks.blocks_cached;
    s->kv_blocks_free = ks.blocks_free;
    s->kv_blocks_pinned = ks.blocks_pinned;
    if (e->draft) {
        blade_kv_cache_stats ds;
        spec_draft_kv_stats(e->draft, &ds);
        s->draft_kv_blocks_total = ds.blocks_total;
        s->draft_kv_blocks_used = ds.blocks_used;
    }
    s->block_size = e->cfg.block_size;
    s->prefix_hit_tokens = ks.prefix_hit_tokens;
    s->prefix_query_tokens = ks.prefix_query_tokens;
    s->prefix_hit_rate = ks.prefix_query_tokens ? (double)ks.prefix_hit_tokens / (double)ks.prefix_query_tokens : 0;
    s->kv_utilisation =
        ks.token_slots_allocated ? (double)ks.token_slots_used / (double)ks.token_slots_allocated : 0;
    s->evictions = ks.evictions;
    s->preemptions = ss.preemptions;
    s->steps = ss.steps;
    s->computed_tokens = e->computed_tokens;
    s->generated_tokens = e->generated_tokens;
    s->requests_finished = e->finished;
    s->max_running = e->max_running;
    s->invariant_checks = e->invariant_checks;
    s->spec_verifies = e->spec_verifies;
    s->spec_draft_tokens = e->spec_draft_tokens;
    s->spec_accepted_tokens = e->spec_accepted_tokens;
    memcpy(s->spec_accept_hist, e->spec_accept_hist, sizeof s->spec_accept_hist);
    memcpy(s->spec_draft_hist, e->spec_draft_hist, sizeof s->spec_draft_hist);
    memcpy(s->solo_decode_steps, e->solo_decode_steps, sizeof s->solo_decode_steps);
    memcpy(s->solo_decode_seconds, e->solo_decode_seconds, sizeof s->solo_decode_seconds);
    s->spec_draft_seconds = e->spec_draft_seconds;
    s->spec_draft_calls = e->spec_draft_calls;
    memcpy(s->invariant_error, e->invariant_error, sizeof s->invariant_error);
    pthread_mutex_unlock(&e->mu);
}

/* ---- the loop ---- */

/* Waits for work; returns true when the loop is to end (stopping, and draining is over or
 * was not asked for). */
static bool wait_for_work(blade_engine *e, bool *abort_all)
{
    pthread_mutex_lock(&e->mu);
    for (;;) {
        bool pending = e->incoming_head || e->n_aborts;
        bool busy = pending || !blade_scheduler_idle(e->sched);
        if (!busy && !e->loop_idle) {
            e->loop_idle = true;
            pthread_cond_broadcast(&e->idle);
        }
        if (e->stopping && (!e->drain || !busy))
            break;
        if (busy)
            break;
        pthread_cond_wait(&e->work, &e->mu);
    }
    bool quit = e->stopping && (!e->drain || (!e->incoming_head && !e->n_aborts && blade_scheduler_idle(e->sched)));
    *abort_all = e->stopping && !e->drain;
    pthread_mutex_unlock(&e->mu);
    return quit;
}

void *engine_loop(void *arg)
{
    blade_engine *e = arg;
    bool abort_all;
    while (!wait_for_work(e, &abort_all)) {
        pthread_mutex_lock(&e->kv_mu);
        take_incoming(e);
        run_step(e);
        publish_stats(e);
        pthread_mutex_unlock(&e->kv_mu);
    }
    pthread_mutex_lock(&e->kv_mu);
    e->quitting = true;
    take_incoming(e);
    if (abort_all)
        while (e->live)
            finish(e, e->live, BLADE_FINISH_ABORT, NULL);
    publish_stats(e);
    pthread_mutex_unlock(&e->kv_mu);
    pthread_mutex_lock(&e->mu);
    e->loop_idle = true;
    pthread_cond_broadcast(&e->idle);
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

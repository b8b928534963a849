/* The output side of a request's choice (request_output.h): sampling, logprobs, the
 * streaming detokenizer, stop strings and finish reasons, ending in the events its
 * callback receives. It never touches KV blocks or the schedule. */

#include "engine/request_output.h"

#include "common/clock.h"

#include <stdlib.h>
#include <string.h>

const char *blade_finish_reason_name(blade_finish_reason r)
{
    static const char *const names[] = {"none", "stop", "length", "abort", "error", "exported"};
    return names[r];
}

int request_output_init(request_output *o, const output_vocab *v, const blade_request *q, int32_t choice,
                        const int32_t *prompt, int32_t n_prompt, blade_error *err)
{
    memset(o, 0, sizeof *o);
    o->choice = choice;
    o->callback = q->callback;
    o->user = q->user;
    o->max_tokens = q->max_tokens;
    o->ignore_eos = q->ignore_eos;
    o->logprobs = q->logprobs;
    o->want_logits = q->want_logits;
    blade_sampling_params sp = q->sampling;
    sp.seed += (uint64_t)choice;
    o->piece = malloc(v->piece_cap);
    o->sampler = blade_sampler_new(&sp, v->n_vocab);
    if (!o->piece || !o->sampler || blade_stop_init(&o->stop, q->stop, q->n_stop)) {
        request_output_destroy(o);
        return blade_error_set(err, "out of memory");
    }
    for (int32_t i = 0; i < n_prompt; i++)
        blade_sampler_accept(o->sampler, prompt[i], false);
    blade_detokenizer_init(&o->detok, v->tok, false);
    /* The prompt's text is not emitted, but it primes the detokenizer so the first
     * generated piece keeps its leading space. */
    o->detok.at_start = false;
    return 0;
}

void request_output_destroy(request_output *o)
{
    blade_sampler_free(o->sampler);
    blade_stop_destroy(&o->stop);
    free(o->piece);
    free(o->text);
    memset(o, 0, sizeof *o);
}

int32_t request_output_sample(request_output *o, const float *logits)
{
    int32_t id = blade_sampler_sample(o->sampler, logits);
    if (id >= 0)
        blade_sampler_accept(o->sampler, id, true);
    return id;
}

static bool append_text(request_output *o, const char *s, size_t n, size_t *len)
{
    if (*len + n + 1 > o->cap_text) {
        size_t cap = o->cap_text ? o->cap_text : 256;
        while (cap < *len + n + 1)
            cap *= 2;
        char *grown = realloc(o->text, cap);
        if (!grown)
            return false;
        o->text = grown;
        o->cap_text = cap;
    }
    memcpy(o->text + *len, s, n);
    *len += n;
    o->text[*len] = 0;
    return true;
}

/* End of the stream: the text the detokenizer and the stop matcher still hold is released
 * (a stop string that it completes still wins). Returns true when a stop string matched. */
static bool drain_text(request_output *o, size_t *len)
{
    char tail[16];
    size_t t = blade_detokenizer_flush(&o->detok, tail, sizeof tail);
    const char *out;
    size_t n;
    bool stopped = blade_stop_push(&o->stop, tail, t, &out, &n);
    append_text(o, out ? out : "", n, len);
    if (!stopped) {
        blade_stop_flush(&o->stop, &out, &n);
        append_text(o, out ? out : "", n, len);
    }
    return stopped;
}

static void fill_usage(const request_output *o, const blade_sched_seq *seq, blade_token_event *ev)
{
    ev->request_id = o->id;
    ev->choice = o->choice;
    ev->user = o->user;
    ev->prompt_tokens = seq->n_prompt;
    ev->completion_tokens = o->n_generated;
    ev->cached_tokens = seq->kv.n_cached_tokens;
    ev->queue_seconds = o->t_scheduled > 0 ? o->t_scheduled - o->t_submit : 0;
    ev->ttft_seconds = o->t_first_token > 0 ? o->t_first_token - o->t_submit : 0;
}

blade_finish_reason request_output_token(request_output *o, const output_vocab *v, const blade_sched_seq *seq,
                                         int32_t id, const float *logits)
{
    if (o->t_first_token == 0)
        o->t_first_token = blade_clock_seconds();
    o->n_generated++;

    blade_token_event ev = {0};
    ev.token = id;
    if (o->logprobs >= 0) {
        blade_logits_to_logprobs(logits, v->n_vocab, v->logprobs);
        ev.logprob = v->logprobs[id];
        ev.n_top = o->logprobs ? blade_top_logprobs(v->logprobs, v->n_vocab, o->logprobs, ev.top_ids, ev.top_logprobs)
                               : 0;
    }
    if (o->want_logits)
        ev.logits = logits;

    blade_finish_reason why = BLADE_FINISH_NONE;
    size_t len = 0;
    if (!o->ignore_eos && blade_tokenizer_is_eog(v->tok, id)) {
        drain_text(o, &len);
        why = BLADE_FINISH_STOP;
    } else {
        const char *released;
        size_t n_released;
        size_t n = blade_detokenizer_push(&o->detok, id, o->piece, v->piece_cap);
        if (blade_stop_push(&o->stop, o->piece, n, &released, &n_released))
            why = BLADE_FINISH_STOP;
        append_text(o, released ? released : "", n_released, &len);
        if (why == BLADE_FINISH_NONE && (o->n_generated >= o->max_tokens || seq->n_tokens >= seq->max_total))
            why = drain_text(o, &len) ? BLADE_FINISH_STOP : BLADE_FINISH_LENGTH;
    }
    fill_usage(o, seq, &ev);
    ev.text = o->text ? o->text : "";
    ev.text_len = len;
    ev.finish = why;
    o->callback(&ev);
    return why;
}

void request_output_finish(request_output *o, const blade_sched_seq *seq, blade_finish_reason why, const char *error)
{
    blade_token_event ev = {0};
    fill_usage(o, seq, &ev);
    ev.token = -1;
    ev.finish = why;
    ev.error = error;
    ev.text = "";
    o->callback(&ev);
}

void request_output_export(request_output *o, const blade_sched_seq *seq, int32_t id, const blade_kv_export *ex)
{
    if (o->t_first_token == 0)
        o->t_first_token = blade_clock_seconds();
    blade_token_event ev = {0};
    fill_usage(o, seq, &ev);
    ev.token = id;
    ev.completion_tokens = 1;
    ev.finish = BLADE_FINISH_EXPORTED;
    ev.kv_export = ex;
    ev.text = "";
    o->callback(&ev);
}

void request_output_embedding(request_output *o, const blade_sched_seq *seq, const float *embedding, int32_t n)
{
    if (o->t_first_token == 0)
        o->t_first_token = blade_clock_seconds();
    blade_token_event ev = {0};
    fill_usage(o, seq, &ev);
    ev.token = -1;
    ev.finish = BLADE_FINISH_STOP;
    ev.text = "";
    ev.embedding = embedding;
    ev.n_embedding = n;
    o->callback(&ev);
}

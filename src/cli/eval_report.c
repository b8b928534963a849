/* The evaluation commands' output (eval_report.h). */

#include "cli/eval_report.h"

#include <jansson.h>
#include <math.h>

#define BAR_WIDTH 30

void cli_eval_progress(const blade_eval_progress *p, void *user)
{
    (void)user;
    char bar[BAR_WIDTH + 1];
    int filled = p->n_chunks > 0 ? (int)((int64_t)BAR_WIDTH * p->chunks_done / p->n_chunks) : 0;
    for (int i = 0; i < BAR_WIDTH; i++)
        bar[i] = i < filled ? '#' : '.';
    bar[BAR_WIDTH] = '\0';
    double rate = p->seconds > 0 ? (double)p->tokens_run / p->seconds : 0.0;
    fprintf(stderr, "\r[%s] %d/%d chunks  PPL %.4f", bar, p->chunks_done, p->n_chunks, p->ppl);
    if (!isnan(p->kld))
        fprintf(stderr, "  KLD %.4g", p->kld);
    fprintf(stderr, "  %.0f tokens/s ", rate);
    fflush(stderr);
}

void cli_eval_progress_done(void)
{
    fputc('\n', stderr);
}

static double tokens_per_second(const blade_eval_result *r)
{
    return r->seconds > 0 ? (double)r->tokens_run / r->seconds : 0.0;
}

void cli_eval_print_table(FILE *out, const cli_eval_info *info, const blade_eval_result *r)
{
    fprintf(out, "base:       %s (KV %s)\n", info->base_path, blade_kv_type_name(info->base_kv));
    fprintf(out, "candidate:  %s (KV %s)\n", info->cand_path, blade_kv_type_name(info->cand_kv));
    fprintf(out, "text:       %s: %lld tokens, %d chunks of %d, %lld scored\n\n", info->text_path,
            (long long)r->n_text_tokens, r->n_chunks, r->n_ctx, (long long)r->n_scored);
    char base[64], cand[64];
    snprintf(base, sizeof base, "%.4f ± %.4f", r->ppl_base, r->ppl_base_se);
    snprintf(cand, sizeof cand, "%.4f ± %.4f", r->ppl_cand, r->ppl_cand_se);
    fprintf(out, "                   %-22s%s\n", "base", "candidate");
    /* one more byte of padding for the two-byte "±" */
    fprintf(out, "perplexity         %-23s%s\n", base, cand);
    fprintf(out, "ΔPPL               %+.4f%% ± %.4f%%\n", r->dppl_pct, r->dppl_pct_se);
    fprintf(out, "KL divergence      mean %.4g ± %.2g, median %.4g, p90 %.4g, p99 %.4g, max %.4g\n", r->kld_mean,
            r->kld_se, r->kld_median, r->kld_p90, r->kld_p99, r->kld_max);
    fprintf(out, "top-1 agreement    %.4f%% ± %.4f%%\n\n", 100.0 * r->top1, 100.0 * r->top1_se);
    fprintf(out, "chunk   PPL base   PPL cand       ΔPPL    mean KLD     max KLD     top-1\n");
    for (int32_t c = 0; c < r->n_chunks; c++) {
        const blade_eval_chunk *k = &r->chunks[c];
        fprintf(out, "%5d  %9.4f  %9.4f  %+8.3f%%  %10.4g  %10.4g  %7.2f%%\n", c + 1, k->ppl_base, k->ppl_cand,
                k->dppl_pct, k->kld_mean, k->kld_max, 100.0 * k->top1);
    }
    fprintf(out, "\n%lld tokens through the two models in %.2f s: %.0f tokens/s\n", (long long)r->tokens_run,
            r->seconds, tokens_per_second(r));
}

static json_t *model_json(const char *path, blade_kv_type kv, double ppl, double ppl_se)
{
    return json_pack("{s:s, s:s, s:f, s:f}", "model", path, "kv_type", blade_kv_type_name(kv), "ppl", ppl, "ppl_se",
                     ppl_se);
}

static json_t *gate_json(const char *expr, const blade_gate *g, const blade_eval_result *r)
{
    json_t *terms = json_array();
    for (int i = 0; i < g->n_terms; i++) {
        const blade_gate_term *t = &g->terms[i];
        char text[200];
        blade_gate_term_describe(t, r, text, sizeof text);
        json_array_append_new(terms, json_pack("{s:s, s:f, s:f, s:b, s:s}", "measure",
                                               blade_gate_metric_name(t->metric), "limit", t->limit, "value",
                                               blade_gate_measure(t->metric, r), "holds",
                                               blade_gate_term_holds(t, r), "text", text));
    }
    return json_pack("{s:s, s:b, s:o}", "expression", expr, "passed", blade_gate_failures(g, r) == 0, "terms",
                     terms);
}

int cli_eval_print_json(FILE *out, const cli_eval_info *info, const blade_eval_result *r, const char *gate_expr,
                        const blade_gate *gate)
{
    json_t *chunks = json_array();
    for (int32_t c = 0; c < r->n_chunks; c++) {
        const blade_eval_chunk *k = &r->chunks[c];
        json_array_append_new(chunks, json_pack("{s:i, s:f, s:f, s:f, s:f, s:f, s:f}", "chunk", c + 1, "ppl_base",
                                                k->ppl_base, "ppl_candidate", k->ppl_cand, "delta_ppl_pct",
                                                k->dppl_pct, "kld_mean", k->kld_mean, "kld_max", k->kld_max, "top1",
                                                k->top1));
    }
    json_t *j = json_pack(
        "{s:o, s:o, s:{s:s, s:I, s:i, s:i, s:I}, s:f, s:f, s:{s:f, s:f, s:f, s:f, s:f, s:f}, s:{s:f, s:f}, s:o, "
        "s:I, s:f, s:f}",
        "base", model_json(info->base_path, info->base_kv, r->ppl_base, r->ppl_base_se), "candidate",
        model_json(info->cand_path, info->cand_kv, r->ppl_cand, r->ppl_cand_se), "text", "file", info->text_path,
        "tokens", (json_int_t)r->n_text_tokens, "n_ctx", r->n_ctx, "chunks", r->n_chunks, "scored",
        (json_int_t)r->n_scored, "delta_ppl_pct", r->dppl_pct, "delta_ppl_pct_se", r->dppl_pct_se, "kld", "mean",
        r->kld_mean, "se", r->kld_se, "median", r->kld_median, "p90", r->kld_p90, "p99", r->kld_p99, "max",
        r->kld_max, "top1", "agreement", r->top1, "se", r->top1_se, "per_chunk", chunks, "tokens_run",
        (json_int_t)r->tokens_run, "seconds", r->seconds, "tokens_per_second", tokens_per_second(r));
    if (!j)
        return -1;
    if (gate)
        json_object_set_new(j, "gate", gate_json(gate_expr, gate, r));
    int rc = json_dumpf(j, out, JSON_INDENT(2) | JSON_REAL_PRECISION(10)) || fputc('\n', out) == EOF ? -1 : 0;
    json_decref(j);
    return rc;
}

void cli_gate_print(FILE *out, const blade_gate *g, const blade_eval_result *r, bool only_failing)
{
    for (int i = 0; i < g->n_terms; i++) {
        if (only_failing && blade_gate_term_holds(&g->terms[i], r))
            continue;
        char text[200];
        blade_gate_term_describe(&g->terms[i], r, text, sizeof text);
        fprintf(out, "  %s\n", text);
    }
}

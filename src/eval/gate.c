/* The quality gate (eval.h): "kld<=0.02,ppl<=+1.5%,top1>=0.95" parsed into terms, each a
 * measure of a comparison, a comparison operator and a limit, and checked against a
 * comparison's result. A gate that does not parse must never pass as a weaker one, so
 * every malformed term is an error that quotes it. */

#include "blade/eval.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef enum unit {
    UNIT_NATS,    /* a KL divergence: a number, never negative, never a percentage */
    UNIT_PERCENT, /* the change in perplexity: a percentage, the % required */
    UNIT_FRACTION /* top-1 agreement: a fraction in [0, 1] or a percentage in [0, 100] */
} unit;

static const struct {
    const char *name;
    const char *what; /* for messages */
    unit unit;
} metrics[BLADE_GATE_METRIC_COUNT] = {
    [BLADE_GATE_KLD] = {"kld", "mean KLD", UNIT_NATS},
    [BLADE_GATE_KLD_MEDIAN] = {"kld_median", "median KLD", UNIT_NATS},
    [BLADE_GATE_KLD_P90] = {"kld_p90", "90th percentile KLD", UNIT_NATS},
    [BLADE_GATE_KLD_P99] = {"kld_p99", "99th percentile KLD", UNIT_NATS},
    [BLADE_GATE_KLD_MAX] = {"kld_max", "largest KLD", UNIT_NATS},
    [BLADE_GATE_PPL] = {"ppl", "change in perplexity", UNIT_PERCENT},
    [BLADE_GATE_TOP1] = {"top1", "top-1 agreement", UNIT_FRACTION},
};

static const char *const op_text[] = {[BLADE_GATE_LE] = "<=", [BLADE_GATE_LT] = "<", [BLADE_GATE_GE] = ">=",
                                      [BLADE_GATE_GT] = ">"};

const char *blade_gate_metric_name(blade_gate_metric m)
{
    return (unsigned)m < BLADE_GATE_METRIC_COUNT ? metrics[m].name : "unknown";
}

static const char *skip_spaces(const char *p, const char *end)
{
    while (p < end && isspace((unsigned char)*p))
        p++;
    return p;
}

/* One term, the bytes [p, end) with the spaces around it already trimmed; `quoted` is the
 * term as messages show it. */
static int parse_term(const char *p, const char *end, const char *quoted, blade_gate_term *t, blade_error *err)
{
    const char *name = p;
    while (p < end && (isalnum((unsigned char)*p) || *p == '_'))
        p++;
    size_t name_len = (size_t)(p - name);
    if (name_len == 0)
        return blade_error_set(err, "gate term %s: it must start with a measure (kld, ppl, top1, ...)", quoted);
    int metric = -1;
    for (int m = 0; m < BLADE_GATE_METRIC_COUNT; m++)
        if (strlen(metrics[m].name) == name_len && strncasecmp(metrics[m].name, name, name_len) == 0)
            metric = m;
    if (metric < 0)
        return blade_error_set(err,
                               "gate term %s: unknown measure '%.*s' (known: kld, kld_median, kld_p90, kld_p99, "
                               "kld_max, ppl, top1)",
                               quoted, (int)name_len, name);
    t->metric = (blade_gate_metric)metric;

    p = skip_spaces(p, end);
    if (p + 1 < end && p[0] == '<' && p[1] == '=')
        t->op = BLADE_GATE_LE, p += 2;
    else if (p + 1 < end && p[0] == '>' && p[1] == '=')
        t->op = BLADE_GATE_GE, p += 2;
    else if (p < end && p[0] == '<')
        t->op = BLADE_GATE_LT, p += 1;
    else if (p < end && p[0] == '>')
        t->op = BLADE_GATE_GT, p += 1;
    else if (p < end && (p[0] == '=' || p[0] == '!'))
        return blade_error_set(err, "gate term %s: only <=, <, >= and > compare; '%c' is not one of them", quoted,
                               p[0]);
    else
        return blade_error_set(err, "gate term %s: expected <=, <, >= or > after '%.*s'", quoted, (int)name_len,
                               name);

    p = skip_spaces(p, end);
    if (p == end)
        return blade_error_set(err, "gate term %s: no number after '%s'", quoted, op_text[t->op]);
    /* strtod needs a terminated string: copy the rest of the term */
    char number[64];
    size_t rest = (size_t)(end - p);
    if (rest >= sizeof number)
        return blade_error_set(err, "gate term %s: the limit is too long to be a number", quoted);
    memcpy(number, p, rest);
    number[rest] = '\0';
    char *after;
    errno = 0;
    double v = strtod(number, &after);
    if (after == number || errno == ERANGE || !isfinite(v))
        return blade_error_set(err, "gate term %s: '%s' is not a finite number", quoted, number);
    const char *q = skip_spaces(after, number + rest);
    bool percent = *q == '%';
    if (percent)
        q = skip_spaces(q + 1, number + rest);
    if (*q)
        return blade_error_set(err, "gate term %s: unexpected '%s' after the number", quoted, q);

    switch (metrics[metric].unit) {
    case UNIT_NATS:
        if (percent)
            return blade_error_set(err, "gate term %s: a KL divergence is in nats, not a percentage", quoted);
        if (v < 0)
            return blade_error_set(err, "gate term %s: a KL divergence is never negative", quoted);
        break;
    case UNIT_PERCENT:
        if (!percent)
            return blade_error_set(err,
                                   "gate term %s: ppl limits the change in perplexity, a percentage: write e.g. "
                                   "ppl<=+1.5%%",
                                   quoted);
        break;
    case UNIT_FRACTION:
        if (percent)
            v /= 100.0;
        if (v < 0 || v > 1)
            return blade_error_set(err, "gate term %s: top-1 agreement is a fraction in [0, 1] (or 0%%..100%%)",
                                   quoted);
        break;
    }
    t->limit = v;
    return 0;
}

int blade_gate_parse(const char *expr, blade_gate *out, blade_error *err)
{
    memset(out, 0, sizeof *out);
    const char *end = expr + strlen(expr);
    if (skip_spaces(expr, end) == end)
        return blade_error_set(err, "the gate is empty: give conditions such as kld<=0.02,ppl<=+1.5%%,top1>=0.95");
    int index = 0;
    for (const char *p = expr; p <= end; index++) {
        const char *comma = memchr(p, ',', (size_t)(end - p));
        const char *term_end = comma ? comma : end;
        const char *b = skip_spaces(p, term_end), *e = term_end;
        while (e > b && isspace((unsigned char)e[-1]))
            e--;
        if (b == e)
            return blade_error_set(err, "gate term %d is empty (two commas in a row, or a comma at an end)",
                                   index + 1);
        if (out->n_terms == BLADE_GATE_MAX_TERMS)
            return blade_error_set(err, "the gate has more than %d terms", BLADE_GATE_MAX_TERMS);
        char quoted[96];
        snprintf(quoted, sizeof quoted, "%d '%.*s%s'", index + 1, e - b > 60 ? 60 : (int)(e - b), b,
                 e - b > 60 ? "..." : "");
        if (parse_term(b, e, quoted, &out->terms[out->n_terms], err))
            return -1;
        out->n_terms++;
        p = term_end + 1;
    }
    return 0;
}

double blade_gate_measure(blade_gate_metric m, const blade_eval_result *r)
{
    switch (m) {
    case BLADE_GATE_KLD: return r->kld_mean;
    case BLADE_GATE_KLD_MEDIAN: return r->kld_median;
    case BLADE_GATE_KLD_P90: return r->kld_p90;
    case BLADE_GATE_KLD_P99: return r->kld_p99;
    case BLADE_GATE_KLD_MAX: return r->kld_max;
    case BLADE_GATE_PPL: return r->dppl_pct;
    case BLADE_GATE_TOP1: return r->top1;
    }
    return NAN;
}

bool blade_gate_term_holds(const blade_gate_term *t, const blade_eval_result *r)
{
    double v = blade_gate_measure(t->metric, r);
    switch (t->op) {
    case BLADE_GATE_LE: return v <= t->limit;
    case BLADE_GATE_LT: return v < t->limit;
    case BLADE_GATE_GE: return v >= t->limit;
    case BLADE_GATE_GT: return v > t->limit;
    }
    return false;
}

int blade_gate_failures(const blade_gate *g, const blade_eval_result *r)
{
    int failed = 0;
    for (int i = 0; i < g->n_terms; i++)
        failed += !blade_gate_term_holds(&g->terms[i], r);
    return failed;
}

void blade_gate_term_describe(const blade_gate_term *t, const blade_eval_result *r, char *buf, size_t cap)
{
    const char *name = blade_gate_metric_name(t->metric), *op = op_text[t->op];
    const char *verdict = blade_gate_term_holds(t, r) ? "holds" : "FAILS";
    double v = blade_gate_measure(t->metric, r);
    switch (metrics[t->metric].unit) {
    case UNIT_NATS:
        snprintf(buf, cap, "%s %s %g: %s %.4g (%s)", name, op, t->limit, metrics[t->metric].what, v, verdict);
        break;
    case UNIT_PERCENT:
        snprintf(buf, cap, "%s %s %+g%%: %s %+.3f%% (%s)", name, op, t->limit, metrics[t->metric].what, v, verdict);
        break;
    case UNIT_FRACTION:
        snprintf(buf, cap, "%s %s %g: %s %.4f (%s)", name, op, t->limit, metrics[t->metric].what, v, verdict);
        break;
    }
}

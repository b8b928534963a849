/* Activation statistics (act_stats.h): per input site, double sums of each column's square
 * and a row count, laid out site after site in one array. */

#include "blade/act_stats.h"

#include <stdlib.h>

struct blade_act_stats {
    int n_sites;
    int64_t *width;   /* [n_sites] */
    size_t *offset;   /* [n_sites]: where the site's sums start in sum_sq */
    uint64_t *rows;   /* [n_sites] */
    double *sum_sq;
};

static int64_t site_width(const blade_hparams *hp, int site)
{
    if (site == blade_act_classifier_site(hp->n_layer))
        return hp->n_embd;
    switch ((blade_act_input)(site % BLADE_ACT_INPUTS_PER_LAYER)) {
    case BLADE_ACT_ATTN_OUT: return (int64_t)hp->n_head * hp->head_dim;
    case BLADE_ACT_FFN_ACT: return hp->n_ff;
    default: return hp->n_embd;
    }
}

blade_act_stats *blade_act_stats_new(const blade_hparams *hp, blade_error *err)
{
    blade_act_stats *s = calloc(1, sizeof *s);
    if (!s)
        goto oom;
    s->n_sites = blade_act_classifier_site(hp->n_layer) + 1;
    s->width = calloc((size_t)s->n_sites, sizeof *s->width);
    s->offset = calloc((size_t)s->n_sites, sizeof *s->offset);
    s->rows = calloc((size_t)s->n_sites, sizeof *s->rows);
    if (!s->width || !s->offset || !s->rows)
        goto oom;
    size_t total = 0;
    for (int i = 0; i < s->n_sites; i++) {
        s->width[i] = site_width(hp, i);
        s->offset[i] = total;
        total += (size_t)s->width[i];
    }
    if (!(s->sum_sq = calloc(total, sizeof *s->sum_sq)))
        goto oom;
    return s;
oom:
    blade_act_stats_free(s);
    blade_error_set(err, "out of memory for activation statistics");
    return NULL;
}

void blade_act_stats_free(blade_act_stats *s)
{
    if (!s)
        return;
    free(s->width);
    free(s->offset);
    free(s->rows);
    free(s->sum_sq);
    free(s);
}

bool blade_act_stats_fits(const blade_act_stats *s, const blade_hparams *hp)
{
    if (s->n_sites != blade_act_classifier_site(hp->n_layer) + 1)
        return false;
    for (int i = 0; i < s->n_sites; i++)
        if (s->width[i] != site_width(hp, i))
            return false;
    return true;
}

int blade_act_stats_n_sites(const blade_act_stats *s)
{
    return s->n_sites;
}

blade_act_site_stats blade_act_stats_get(const blade_act_stats *s, int site)
{
    return (blade_act_site_stats){s->sum_sq + s->offset[site], s->width[site], s->rows[site]};
}

void blade_act_stats_add(blade_act_stats *s, int site, const float *rows, int64_t n_rows, int64_t stride, int64_t c0,
                         int64_t c1)
{
    double *sum = s->sum_sq + s->offset[site];
    for (int64_t t = 0; t < n_rows; t++) {
        const float *row = rows + t * stride;
        for (int64_t j = c0; j < c1; j++)
            sum[j] += (double)row[j] * (double)row[j];
    }
}

void blade_act_stats_count(blade_act_stats *s, int site, int64_t n_rows)
{
    s->rows[site] += (uint64_t)n_rows;
}

#ifndef BLADE_ACT_STATS_H
#define BLADE_ACT_STATS_H

/* Activation statistics: for every activation row a weight matrix reads, the sum of each
 * column's square over the rows read, and how many rows. The batched runner and the
 * reference forward pass fill one when they are given it (and do nothing extra when not);
 * `blade imatrix` turns the sums into an importance matrix.
 *
 * Statistics are kept per input, not per matrix: matrices that read the same row (Q, K and
 * V; gate and up) share one site, which is what makes them the same whether or not the
 * runner fuses those products. Sums are in double; each column's rows are added in batch
 * order, so the result depends only on the rows and the order of the calls. */

#include "blade/error.h"
#include "blade/model.h"

#include <stddef.h>
#include <stdint.h>

typedef enum blade_act_input {
    BLADE_ACT_ATTN_IN,  /* the normalised residual stream: attn_q, attn_k, attn_v */
    BLADE_ACT_ATTN_OUT, /* the attention output: attn_output */
    BLADE_ACT_FFN_IN,   /* the normalised residual stream: ffn_gate, ffn_up */
    BLADE_ACT_FFN_ACT,  /* the SwiGLU output: ffn_down */
    BLADE_ACT_INPUTS_PER_LAYER
} blade_act_input;

/* Sites are numbered layer by layer; the classifier's input (the final normalised hidden
 * state) comes after the last layer's. */
static inline int blade_act_site(int layer, blade_act_input input)
{
    return layer * BLADE_ACT_INPUTS_PER_LAYER + (int)input;
}
static inline int blade_act_classifier_site(int n_layer)
{
    return n_layer * BLADE_ACT_INPUTS_PER_LAYER;
}

typedef struct blade_act_stats blade_act_stats;

/* Empty statistics for a model of these hyperparameters. */
blade_act_stats *blade_act_stats_new(const blade_hparams *hp, blade_error *err);
void blade_act_stats_free(blade_act_stats *s);
/* Whether s was made for a model of these hyperparameters: the site widths agree. */
bool blade_act_stats_fits(const blade_act_stats *s, const blade_hparams *hp);
int blade_act_stats_n_sites(const blade_act_stats *s);

/* One site: width columns, their sums of squares, and the rows added. */
typedef struct blade_act_site_stats {
    const double *sum_sq;
    int64_t width;
    uint64_t rows;
} blade_act_site_stats;

blade_act_site_stats blade_act_stats_get(const blade_act_stats *s, int site);

/* Adds columns [c0, c1) of n_rows rows (width floats each, stride floats apart) to a site's
 * sums, row after row. Different column ranges of one site may be added concurrently, so a
 * caller can split the columns between threads; the rows are then counted once, with
 * blade_act_stats_count. */
void blade_act_stats_add(blade_act_stats *s, int site, const float *rows, int64_t n_rows, int64_t stride, int64_t c0,
                         int64_t c1);
void blade_act_stats_count(blade_act_stats *s, int site, int64_t n_rows);

#endif

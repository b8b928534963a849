#ifndef BLADE_LOADGEN_HTML_H
#define BLADE_LOADGEN_HTML_H

/* The --report page of `blade bench serve`: one self-contained HTML file (inline CSS and
 * SVG drawn here, no scripts, nothing fetched) that can be mailed or attached to a ticket
 * and still open years later. */

#include "blade/error.h"
#include "loadgen/client.h"
#include "loadgen/summary.h"

#include <jansson.h>

/* config: the run's configuration as written to the JSON file, shown as a table. */
int lg_write_html(const char *path, const char *title, const json_t *config, const lg_run_result *r,
                  const lg_summary *s, blade_error *err);

#endif

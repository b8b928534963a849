/* `blade bench compare`: two `blade bench serve --json` results set side by side, failing on a
 * regression beyond a threshold. */

#include "cli/commands.h"
#include "loadgen/compare.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct compare_options {
    const char *base, *candidate;
    double threshold; /* percent */
} compare_options;

static void compare_init(void *opts)
{
    compare_options *o = opts;
    o->threshold = 5;
}

/* "5%" or "2.5": percent. */
static bool parse_percent(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    char *end;
    errno = 0;
    double v = strtod(value, &end);
    if (*end == '%')
        end++;
    if (errno || end == value || *end || !isfinite(v) || v < 0 || v > 1e6) {
        snprintf(why, cap, "--%s expects a percentage in [0, 1e6] such as 5%% or 2.5, got '%s'", f->name, value);
        return false;
    }
    *(double *)dest = v;
    return true;
}

static const cli_flag compare_flags[] = {
    {.name = "max-regression", .kind = CLI_CUSTOM, CLI_AT(compare_options, threshold), .parse = parse_percent,
     .metavar = "P", .dflt = "5%", .help = "threshold in percent, e.g. 5% or 2.5"},
    {0},
};

static int compare_main(int argc, char **argv);

const cli_command cli_cmd_bench_compare = {
    .name = "bench compare",
    .summary = "fail on a performance regression between two bench serve results",
    .synopsis = "BASE.json NEW.json [--max-regression 5%]",
    .about = "Compares two `blade bench serve --json` results of the same workload figure by figure (throughput,\n"
             "goodput, mean/median/p90/p99 of TTFT, TPOT, ITL and E2E; cost shown too) and prints each with its\n"
             "change. Exit status: 1 when a throughput figure fell, or a latency figure rose, by more than the\n"
             "threshold; 0 otherwise; 2 when a file cannot be read, is not such a result, or the two measured\n"
             "different workloads or load.\n",
    .tables = (const cli_table[]){{compare_flags, 0}, {0}},
    .positionals = (const cli_positional[]){
        {.metavar = "BASE.json", CLI_ARG_AT(compare_options, base), .help = "the result to compare against"},
        {.metavar = "NEW.json", CLI_ARG_AT(compare_options, candidate), .help = "the result to judge"},
        {0}},
    .opts_size = sizeof(compare_options),
    .init = compare_init,
    .main = compare_main,
};

static int compare_main(int argc, char **argv)
{
    compare_options o;
    int rc = cli_parse(&cli_cmd_bench_compare, argc, argv, &o);
    if (rc != CLI_RUN)
        return rc;
    return lg_compare_files(o.base, o.candidate, o.threshold, stdout, stderr);
}

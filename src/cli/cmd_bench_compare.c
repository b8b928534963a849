#include "cli/cli_util.h"
#include "cli/commands.h"
#include "loadgen/compare.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void compare_usage(FILE *out)
{
    fprintf(out,
            "usage: blade bench compare BASE.json NEW.json [--max-regression 5%%]\n\n"
            "Compares two `blade bench serve --json` results of the same workload figure by figure (throughput,\n"
            "goodput, mean/median/p90/p99 of TTFT, TPOT, ITL and E2E; cost shown too) and prints each with its\n"
            "change. Exit status: 1 when a throughput figure fell, or a latency figure rose, by more than the\n"
            "threshold; 0 otherwise; 2 when a file cannot be read, is not such a result, or the two measured\n"
            "different workloads or load.\n\n"
            "      --max-regression P   threshold in percent, e.g. 5%% or 2.5 (default 5%%)\n"
            "  -h, --help               this help\n");
}

int cmd_bench_compare(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"max-regression", required_argument, 0, 'r'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    double threshold = 5;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'r': {
            char value[64];
            snprintf(value, sizeof value, "%s", optarg);
            size_t n = strlen(value);
            if (n && value[n - 1] == '%')
                value[n - 1] = 0;
            if (!cli_parse_float("--max-regression", value, 0, 1e6, &threshold))
                return 2;
            break;
        }
        case 'h': compare_usage(stdout); return 0;
        default: compare_usage(stderr); return 2;
        }
    }
    if (argc - optind != 2) {
        compare_usage(stderr);
        return 2;
    }
    return lg_compare_files(argv[optind], argv[optind + 1], threshold, stdout, stderr);
}

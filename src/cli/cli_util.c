/* Helpers the subcommands share (cli_util.h). */

#include "cli/cli_util.h"

#include "blade/kv_type.h"
#include "blade/quantize.h"
#include "common/file.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

bool cli_kv_type_choice(int i, cli_choice *out)
{
    if (i < 0 || i >= BLADE_KV_TYPE_COUNT)
        return false;
    *out = (cli_choice){blade_kv_type_name((blade_kv_type)i), i};
    return true;
}

bool cli_parse_quant_scheme(const cli_flag *f, const char *value, void *dest, char *why, size_t cap)
{
    const blade_quant_scheme *s = blade_quant_scheme_find(value);
    if (!s) {
        snprintf(why, cap, "unknown --%s '%s' (blade writes %s)", f->name, value, blade_quant_scheme_names());
        return false;
    }
    *(const blade_quant_scheme **)dest = s;
    return true;
}

char *cli_read_file(const char *path, size_t *len)
{
    blade_error err = {{0}};
    size_t n;
    char *text = blade_read_file(path, &n, &err);
    if (!text)
        fprintf(stderr, "error: %s\n", err.msg);
    else if (len)
        *len = n;
    return text;
}

double cli_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *cli_default_model(void)
{
    static const char path[] = "../shared/models/stories260K.gguf";
    return access(path, R_OK) == 0 ? path : NULL;
}

bool cli_same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

volatile sig_atomic_t cli_interrupted;

static void on_interrupt(int sig)
{
    (void)sig;
    cli_interrupted = 1;
}

void cli_interrupts_catch(cli_signals *saved)
{
    struct sigaction sa = {.sa_handler = on_interrupt};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &saved->old_int);
    sigaction(SIGTERM, &sa, &saved->old_term);
}

void cli_interrupts_restore(const cli_signals *saved)
{
    sigaction(SIGINT, &saved->old_int, NULL);
    sigaction(SIGTERM, &saved->old_term, NULL);
}

long long cli_raise_fd_limit(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl))
        return -1;
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl))
            getrlimit(RLIMIT_NOFILE, &rl);
    }
    return rl.rlim_cur == RLIM_INFINITY ? (long long)1 << 40 : (long long)rl.rlim_cur;
}

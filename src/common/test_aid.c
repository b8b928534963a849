/* Test aids read from the environment (test_aid.h). */

#include "common/test_aid.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int blade_test_aid_ms(const char *name)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return 0;
    char *end;
    errno = 0;
    long ms = strtol(v, &end, 10);
    /* a malformed hold is no hold: a typo must not stall a server for long */
    return *end || errno || ms < 0 || ms > 600000 ? 0 : (int)ms;
}

void blade_test_aid_hold(const char *name, int ms, const char *what)
{
    if (ms <= 0)
        return;
    fprintf(stderr, "test aid %s: holding %s for %d ms\n", name, what, ms);
    fflush(stderr);
    struct timespec left = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&left, &left) != 0 && errno == EINTR)
        ;
}

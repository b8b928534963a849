#ifndef BLADE_COMMON_TEST_AID_H
#define BLADE_COMMON_TEST_AID_H

/* Test aids: holds a fault test asks for through the environment, so that a process waits
 * at the very point where the test's SIGKILL must land (a prefill worker between the
 * prefill and its KV frame, a server in the middle of its answer) every time rather than
 * by luck of timing. Each variable is named BLADE_TEST_..._MS and documented with the code
 * that reads it and in docs/cluster.md ("Fault tests"). Unset, as in any real deployment,
 * a hold is 0 and nothing waits. */

/* The hold in milliseconds that environment variable `name` asks for: a decimal number up
 * to 600000; 0 when unset, empty or anything else. */
int blade_test_aid_ms(const char *name);

/* Sleeps for ms (nothing when ms <= 0), first writing "test aid NAME: holding WHAT for MS
 * ms" on stderr: the line a test waits for before it strikes. */
void blade_test_aid_hold(const char *name, int ms, const char *what);

#endif

#ifndef BLADE_CLUSTER_NETNS_H
#define BLADE_CLUSTER_NETNS_H

/* Network namespaces for tests and benchmarks: a private network of N hosts on one
 * machine. Each host is a namespace with an eth0 (10.77.0.<i+1>/24) whose veth peer sits on a
 * bridge in a hub namespace of its own, so nothing is added to the caller's namespace and
 * two runs never see each other. Names carry a per-run prefix with the creating process's
 * id ("bladens-<pid>-<n>-..."); namespaces left by runs whose process is gone (a killed
 * test) are removed at the next creation. Needs root and iproute2's `ip`. */

#include "blade/error.h"

#include <stdbool.h>
#include <sys/types.h>

#define BLADE_NETNS_MAX_HOSTS 8
#define BLADE_NETNS_MAX_CHILDREN 32

typedef struct blade_netns {
    char prefix[40];
    int n;
    char hub[64];
    char name[BLADE_NETNS_MAX_HOSTS][64];
    char addr[BLADE_NETNS_MAX_HOSTS][16];
    pid_t children[BLADE_NETNS_MAX_CHILDREN];
    int n_children;
} blade_netns;

/* True when namespaces can be made here; otherwise false with the reason in why (not
 * root, no `ip`, the kernel refused). */
bool blade_netns_usable(blade_error *why);
/* Removes namespaces of earlier runs whose process no longer exists; returns how many. */
int blade_netns_cleanup_stale(void);
/* Creates n hosts (1..BLADE_NETNS_MAX_HOSTS) on one bridge. On failure everything made so
 * far is removed. */
int blade_netns_create(blade_netns *net, int n, blade_error *err);
/* Moves the calling thread into host i's network namespace. */
int blade_netns_enter(const blade_netns *net, int i, blade_error *err);
/* Forks a child that enters host i and returns fn(arg) as its exit status; the child is
 * killed by blade_netns_destroy if still running, and when the calling thread ends (so a
 * test that dies leaves nothing running). -1 with err set on failure. */
pid_t blade_netns_spawn(blade_netns *net, int i, int (*fn)(void *), void *arg, blade_error *err);
/* The same for a program: argv[0] is searched in PATH. stdout and stderr go to log_path
 * (appended) when given. */
pid_t blade_netns_spawn_cmd(blade_netns *net, int i, char *const argv[], const char *log_path, blade_error *err);
/* Waits up to timeout_ms for a child; its exit status, 128+signal, or -1 on timeout (the
 * child is then killed). */
int blade_netns_wait(blade_netns *net, pid_t pid, int timeout_ms);
/* Kills the children still running and deletes every namespace of the run. */
void blade_netns_destroy(blade_netns *net);

#endif

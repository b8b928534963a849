#ifndef BLADE_TEST_CLUSTER_HARNESS_H
#define BLADE_TEST_CLUSTER_HARNESS_H

/* Helpers of the tests that run blade processes in network namespaces (cluster/netns.h):
 * starting servers in a host, HTTP through curl inside a host, reading /metrics, and the
 * generated text of an OpenAI response or stream. */

#include "cluster/netns.h"

#include <stdbool.h>
#include <sys/types.h>

/* curl inside host i with args; its stdout (malloc'd, "" when it failed). */
char *ns_curl(const blade_netns *net, int i, const char *args);
/* Waits up to 30 s for http://ADDR:port/health in host i to answer 200; fails the test. */
void ns_wait_healthy(const blade_netns *net, int i, int port);
/* `blade <args>` in host i (words split at spaces), output appended to log. */
pid_t ns_blade(blade_netns *net, int i, const char *args, const char *log);
/* POST body to http://host:port/v1/completions from host `from`. */
char *ns_complete(const blade_netns *net, int from, const char *host, int port, const char *body);
/* A sample of a Prometheus text page at host:port/metrics, -1 when absent. */
long ns_metric(const blade_netns *net, int from, const char *host, int port, const char *sample);
/* The same in the background: curl's output goes to out_path; wait for the pid with
 * blade_netns_wait. */
pid_t ns_complete_bg(blade_netns *net, int from, const char *host, int port, const char *body, const char *out_path);
/* etcd in host i, a single member serving http://ADDR:2379 from data_dir (created when
 * missing), its log appended to log; waits up to 10 s until it answers, fails the test
 * otherwise. */
pid_t ns_etcd(blade_netns *net, int i, const char *data_dir, const char *log);
/* Every "text" of a response or stream joined with '|', then the first finish_reason:
 * what must match between two servers (ids and timestamps differ). malloc'd. */
char *completion_text(const char *resp);

#endif

#ifndef BLADE_ROUTER_WORKER_POOL_H
#define BLADE_ROUTER_WORKER_POOL_H

/* The workers a router knows and how it picks among them.
 *
 * Workers come from a static list or from etcd (registrations under
 * blade/<cluster>/workers/, watched); either way each worker's GET /health says its role,
 * KV fingerprint and (prefill role) KV service address, and its /metrics its load (running
 * and waiting sequences), polled every half second. A worker that does not answer, or
 * whose registration lapsed, leaves the pool.
 *
 * Choosing, per request (pool_choose):
 *   - prefix-cache aware: the prompt is cut into blocks (token ids when the request sends
 *     them, bytes of its text otherwise), each named by a hash chained from its parent, as
 *     the KV cache manager names blocks; the worker that most recently got the longest run
 *     of these leading blocks is preferred,
 *   - load aware: unless it is busier than the least loaded candidate by more than a
 *     slack, or no worker holds the prefix: then the least loaded wins;
 *   - `both` workers are candidates first; otherwise a decode worker is chosen this way and
 *     a prefill worker with the same KV fingerprint by load alone. Workers with different
 *     fingerprints are never paired. */

#include "blade/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define POOL_MAX_WORKERS 64
#define POOL_URL_MAX 256

typedef enum pool_policy { POLICY_CACHE_AWARE, POLICY_ROUND_ROBIN } pool_policy;

typedef struct pool_config {
    const char *workers;       /* "http://h:p,http://h:p" or NULL */
    const char *etcd;          /* etcd endpoints, with cluster */
    const char *cluster;
    pool_policy policy;
    int policy_choice;         /* the flag's value, as an int (cli flags) */
    int block_tokens;          /* tokens per routing block (default 16) */
    int slack;                 /* load difference the prefix preference may cost (default 4) */
} pool_config;

typedef struct pool pool;

pool *pool_new(const pool_config *cfg, blade_error *err);
void pool_free(pool *p);

/* The prompt's routing blocks, from a request body. */
typedef struct pool_key {
    uint64_t hashes[64];
    int n;
} pool_key;
void pool_key_tokens(pool_key *k, const int32_t *tokens, size_t n, int block_tokens);
void pool_key_bytes(pool_key *k, const char *text, size_t n, int block_tokens);

/* The chosen worker(s): a `both` worker, or a decode worker with the prefill worker's KV
 * address (prefill_kv non-empty). exclude: workers that failed this request already.
 * False when no worker can take it. */
typedef struct pool_choice {
    int worker;
    char url[POOL_URL_MAX];
    char prefill_kv[POOL_URL_MAX];
    int prefill;
    bool prefix_hit;          /* chosen for the prefix it held */
} pool_choice;
bool pool_choose(pool *p, const pool_key *k, const bool *exclude, pool_choice *out);
/* The request ended on the chosen workers (their in-flight count drops); failed: the worker
 * did not answer, which takes it out of the pool until its next good poll. */
void pool_done(pool *p, const pool_choice *c, bool failed);

/* Any healthy worker's URL, for GET /v1/models. */
bool pool_any(pool *p, char *url, size_t cap);
/* /health and /metrics material: workers and their state as JSON text (malloc'd), and
 * whether the etcd view is current (with the reason when not). */
char *pool_describe(pool *p);
bool pool_etcd_ok(pool *p, char *why, size_t cap);

#endif

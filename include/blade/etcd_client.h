#ifndef BLADE_ETCD_CLIENT_H
#define BLADE_ETCD_CLIENT_H

/* An etcd v3 client for cluster membership, speaking etcd's JSON gateway (/v3/kv/...,
 * /v3/lease/..., /v3/watch) over HTTP with libcurl and jansson, so no gRPC stack is needed.
 * Keys and values are bytes (base64 on the wire).
 *
 * Every call is bounded by the client's timeout: etcd down or unreachable gives an error
 * naming the endpoint, never a hang. Several endpoints (a cluster's members) are tried in
 * turn. A client may be used from several threads at once.
 *
 * Membership is built from two pieces:
 *   - a registration: a key under a lease that a thread keeps alive, re-creating lease and
 *     key when etcd lost them (restart, lapse while unreachable); when the process dies the
 *     key disappears within the lease's TTL;
 *   - a watch: a thread that lists a prefix and then streams its put/delete events to a
 *     callback, resuming after the last revision it delivered when the stream breaks (etcd
 *     restarted), or starting over with a full list when etcd compacted that history. */

#include "blade/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct blade_etcd blade_etcd;

typedef struct blade_etcd_config {
    const char *endpoints; /* "http://10.0.0.5:2379,http://10.0.0.6:2379" */
    int timeout_ms;        /* every request; <= 0: 5000 */
} blade_etcd_config;

blade_etcd *blade_etcd_new(const blade_etcd_config *cfg, blade_error *err);
/* Registrations and watches made with the client must be stopped first. */
void blade_etcd_free(blade_etcd *e);

typedef struct blade_etcd_kv {
    char *key;   /* NUL-terminated (keys with NUL bytes are refused) */
    uint8_t *value;
    size_t value_len; /* value is also NUL-terminated, not counted */
    int64_t create_revision, mod_revision, version, lease;
} blade_etcd_kv;

typedef struct blade_etcd_list {
    blade_etcd_kv *kvs;
    size_t n;
    int64_t revision; /* the store's revision the list was read at */
} blade_etcd_list;
void blade_etcd_list_free(blade_etcd_list *l);

/* lease 0: none. */
int blade_etcd_put(blade_etcd *e, const char *key, const void *value, size_t len, int64_t lease, blade_error *err);
/* The key, if present: out->n is 0 or 1. */
int blade_etcd_get(blade_etcd *e, const char *key, blade_etcd_list *out, blade_error *err);
/* Every key starting with prefix, in key order. */
int blade_etcd_list_prefix(blade_etcd *e, const char *prefix, blade_etcd_list *out, blade_error *err);
/* Deletes the key, or every key under it when prefix is true; *deleted (may be NULL) is
 * how many were. */
int blade_etcd_delete(blade_etcd *e, const char *key, bool prefix, int64_t *deleted, blade_error *err);

int blade_etcd_lease_grant(blade_etcd *e, int64_t ttl_s, int64_t *lease, int64_t *granted_ttl, blade_error *err);
/* Renews the lease; *ttl is its new TTL, 0 when etcd no longer has it (expired or
 * revoked: keys attached to it are gone). */
int blade_etcd_lease_keepalive(blade_etcd *e, int64_t lease, int64_t *ttl, blade_error *err);
/* Ends the lease now, deleting its keys. */
int blade_etcd_lease_revoke(blade_etcd *e, int64_t lease, blade_error *err);

/* ---- registration ---- */

typedef struct blade_etcd_registration blade_etcd_registration;

/* Puts key = value under a fresh lease of ttl_s seconds (>= 2) and keeps it alive from a
 * thread, renewing every ttl_s / 3. Fails (NULL) when etcd cannot be reached now. */
blade_etcd_registration *blade_etcd_register(blade_etcd *e, const char *key, const void *value, size_t len, int ttl_s,
                                             blade_error *err);
/* Replaces the value (a worker's load, say), keeping the lease. */
int blade_etcd_registration_update(blade_etcd_registration *r, const void *value, size_t len, blade_error *err);
/* True while the key is known to be in etcd; otherwise false with the last failure in
 * why (may be NULL): the thread keeps retrying every second. */
bool blade_etcd_registration_ok(blade_etcd_registration *r, blade_error *why);
/* Times the lease had to be granted again because etcd had lost it. */
int blade_etcd_registration_renewals(blade_etcd_registration *r);
/* Stops the thread and revokes the lease, removing the key (best effort: if etcd is
 * unreachable the key lapses within the TTL instead). */
void blade_etcd_unregister(blade_etcd_registration *r);

/* ---- watch ---- */

typedef enum blade_etcd_event_type {
    BLADE_ETCD_PUT,
    BLADE_ETCD_DELETE,
    /* Forget every key: the PUTs that follow are the whole prefix as listed now. Sent
     * first, and again whenever the history to resume from was compacted away. */
    BLADE_ETCD_RESET,
    /* The stream to etcd broke; the last view may be stale until RECONNECTED. */
    BLADE_ETCD_DISCONNECTED,
    BLADE_ETCD_RECONNECTED
} blade_etcd_event_type;

typedef struct blade_etcd_event {
    blade_etcd_event_type type;
    const char *key;       /* PUT and DELETE */
    const uint8_t *value;  /* PUT */
    size_t value_len;
    int64_t revision;      /* the event's mod revision (PUT, DELETE) */
    const char *reason;    /* DISCONNECTED: why */
} blade_etcd_event;

/* Called on the watch thread, one event at a time, in revision order. */
typedef void (*blade_etcd_watch_fn)(const blade_etcd_event *ev, void *user);

typedef struct blade_etcd_watch blade_etcd_watch;

/* Lists the prefix (RESET + PUTs) and then streams its changes, all from a new thread.
 * Fails (NULL) only when the thread cannot start; etcd being down is reported as
 * DISCONNECTED and retried. */
blade_etcd_watch *blade_etcd_watch_prefix(blade_etcd *e, const char *prefix, blade_etcd_watch_fn fn, void *user,
                                          blade_error *err);
/* Stops the thread promptly (it is woken from any wait) and frees the watch. */
void blade_etcd_watch_stop(blade_etcd_watch *w);

#endif

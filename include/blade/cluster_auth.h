#ifndef BLADE_CLUSTER_AUTH_H
#define BLADE_CLUSTER_AUTH_H

/* Cluster authentication: the shared secret every member of a cluster reads from
 * --cluster-key-file, and the HMAC-SHA256 that control messages and KV frames carry so a
 * peer without the secret can neither inject nor alter them.
 *
 * A digest context made without a key is plain SHA-256: the integrity checksum that KV
 * frames carry on a loopback-only setup, where no key is required. Listeners reachable
 * from other hosts must have a key (blade_cluster_check_listener). */

#include "blade/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define BLADE_CLUSTER_MAC_BYTES 32
#define BLADE_CLUSTER_NONCE_BYTES 32
/* Shorter secrets are guessable offline from one captured MAC; longer ones are not a key
 * file but something else named by mistake. */
#define BLADE_CLUSTER_KEY_MIN 16
#define BLADE_CLUSTER_KEY_MAX 4096

typedef struct blade_cluster_key {
    uint8_t bytes[BLADE_CLUSTER_KEY_MAX];
    size_t len;
} blade_cluster_key;

/* Reads the secret: the file's bytes less trailing whitespace (so `echo secret > f` and
 * `openssl rand -hex 32 > f` both work). Refused: not a regular file, readable or writable
 * by other users (every account on the host would know the secret), shorter than
 * BLADE_CLUSTER_KEY_MIN or longer than BLADE_CLUSTER_KEY_MAX bytes. Group access or an
 * owner other than the current user is allowed but described in *warning (an empty
 * message otherwise; warning may be NULL). Returns 0 or -1 with err set. */
int blade_cluster_key_load(const char *path, blade_cluster_key *key, blade_error *warning, blade_error *err);
/* Overwrites the secret so it does not linger in freed memory. */
void blade_cluster_key_wipe(blade_cluster_key *key);

/* An incremental HMAC-SHA256 (or SHA-256 when key is NULL) over data given in pieces. */
typedef struct blade_cluster_mac blade_cluster_mac;
blade_cluster_mac *blade_cluster_mac_begin(const blade_cluster_key *key, blade_error *err);
int blade_cluster_mac_update(blade_cluster_mac *m, const void *data, size_t len);
/* Writes the digest, frees m; -1 (m freed too) when libcrypto failed. */
int blade_cluster_mac_end(blade_cluster_mac *m, uint8_t out[BLADE_CLUSTER_MAC_BYTES]);
/* Frees m without a digest (an abandoned message). NULL is allowed. */
void blade_cluster_mac_abort(blade_cluster_mac *m);

/* One-shot digest of one buffer. */
int blade_cluster_sign(const blade_cluster_key *key, const void *data, size_t len, uint8_t out[BLADE_CLUSTER_MAC_BYTES]);
/* True when mac is data's digest under key; the comparison takes the same time wherever
 * the first differing byte is, so a forger learns nothing from timing. */
bool blade_cluster_verify(const blade_cluster_key *key, const void *data, size_t len,
                          const uint8_t mac[BLADE_CLUSTER_MAC_BYTES]);
bool blade_cluster_mac_equal(const uint8_t a[BLADE_CLUSTER_MAC_BYTES], const uint8_t b[BLADE_CLUSTER_MAC_BYTES]);

/* Fresh random bytes from the operating system's generator, for handshake challenges. */
int blade_cluster_nonce(uint8_t out[BLADE_CLUSTER_NONCE_BYTES]);
/* A handshake proof: the digest of the role name and both challenges. Each side answers
 * the other's fresh challenge, so a recorded proof never opens a later connection, and the
 * role names differ so a listener's proof cannot be reflected back as a connector's. */
int blade_cluster_proof(const blade_cluster_key *key, const char *role, const uint8_t listener_nonce[BLADE_CLUSTER_NONCE_BYTES],
                        const uint8_t connector_nonce[BLADE_CLUSTER_NONCE_BYTES], uint8_t out[BLADE_CLUSTER_MAC_BYTES]);

/* True for a numeric loopback address (127.0.0.0/8, ::1, ::ffff:127.x) or "localhost". A
 * wildcard ("", "0.0.0.0", "::") and every other name are not: they may be reachable from
 * other hosts. */
bool blade_cluster_host_is_loopback(const char *host);
/* Refuses (-1, err naming the address) a listener on a non-loopback address when key is
 * NULL: without a secret any host that reaches the port could feed KV or commands. */
int blade_cluster_check_listener(const char *host, const blade_cluster_key *key, blade_error *err);

#endif

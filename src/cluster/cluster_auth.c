/* Cluster authentication (cluster_auth.h): loading the shared secret with the checks a key
 * file deserves, HMAC-SHA256 / SHA-256 digests through OpenSSL's EVP interfaces, handshake
 * proofs and the loopback rule for listeners without a key. */

#include "blade/cluster_auth.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

int blade_cluster_key_load(const char *path, blade_cluster_key *key, blade_error *warning, blade_error *err)
{
    key->len = 0;
    if (warning)
        warning->msg[0] = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return blade_error_set(err, "cluster key file %s: cannot open: %s", path, strerror(errno));
    /* Checked on the open descriptor, so the file cannot be swapped between check and read. */
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return blade_error_set(err, "cluster key file %s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return blade_error_set(err, "cluster key file %s is not a regular file", path);
    }
    if (st.st_mode & (S_IROTH | S_IWOTH)) {
        close(fd);
        return blade_error_set(err,
                               "cluster key file %s is %s by every user of this host (mode %04o): "
                               "make it private with chmod 600",
                               path, (st.st_mode & S_IROTH) ? "readable" : "writable", (unsigned)(st.st_mode & 07777));
    }
    if (st.st_size > BLADE_CLUSTER_KEY_MAX + 64) {
        close(fd);
        return blade_error_set(err, "cluster key file %s has %lld bytes: a key has at most %d", path,
                               (long long)st.st_size, BLADE_CLUSTER_KEY_MAX);
    }
    uint8_t buf[BLADE_CLUSTER_KEY_MAX + 65];
    size_t n = 0;
    for (;;) {
        ssize_t got = read(fd, buf + n, sizeof buf - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            int e = errno;
            close(fd);
            OPENSSL_cleanse(buf, sizeof buf);
            return blade_error_set(err, "cluster key file %s: cannot read: %s", path, strerror(e));
        }
        if (got == 0 || (n += (size_t)got) == sizeof buf)
            break;
    }
    close(fd);
    while (n > 0 && isspace(buf[n - 1]))
        n--;
    if (n < BLADE_CLUSTER_KEY_MIN || n > BLADE_CLUSTER_KEY_MAX) {
        OPENSSL_cleanse(buf, sizeof buf);
        return blade_error_set(err, "cluster key file %s holds a %s key (%zu bytes without trailing whitespace): "
                                    "it must have %d to %d bytes, e.g. `openssl rand -hex 32`",
                               path, n < BLADE_CLUSTER_KEY_MIN ? "too short" : "too long", n, BLADE_CLUSTER_KEY_MIN,
                               BLADE_CLUSTER_KEY_MAX);
    }
    memcpy(key->bytes, buf, n);
    key->len = n;
    OPENSSL_cleanse(buf, sizeof buf);
    if (warning && (st.st_mode & (S_IRGRP | S_IWGRP)))
        blade_error_set(warning, "cluster key file %s is accessible to its group (mode %04o): chmod 600 keeps it private",
                        path, (unsigned)(st.st_mode & 07777));
    else if (warning && st.st_uid != geteuid())
        blade_error_set(warning, "cluster key file %s belongs to user id %u, not to this user (%u)", path,
                        (unsigned)st.st_uid, (unsigned)geteuid());
    return 0;
}

void blade_cluster_key_wipe(blade_cluster_key *key)
{
    OPENSSL_cleanse(key->bytes, sizeof key->bytes);
    key->len = 0;
}

/* Either an HMAC (keyed) or a plain digest: the two EVP interfaces differ, the caller
 * does not care which. */
struct blade_cluster_mac {
    EVP_MAC_CTX *mac;
    EVP_MD_CTX *md;
};

blade_cluster_mac *blade_cluster_mac_begin(const blade_cluster_key *key, blade_error *err)
{
    blade_cluster_mac *m = calloc(1, sizeof *m);
    if (!m) {
        blade_error_set(err, "digest: out of memory");
        return NULL;
    }
    int ok;
    if (key) {
        /* Fetched once: the provider lookup is the costly part, and contexts only read it. */
        static EVP_MAC *hmac;
        static int fetched;
        if (!__atomic_load_n(&fetched, __ATOMIC_ACQUIRE)) {
            EVP_MAC *h = EVP_MAC_fetch(NULL, "HMAC", NULL);
            EVP_MAC *expected = NULL;
            if (h && !__atomic_compare_exchange_n(&hmac, &expected, h, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                EVP_MAC_free(h);
            __atomic_store_n(&fetched, hmac != NULL, __ATOMIC_RELEASE);
        }
        m->mac = hmac ? EVP_MAC_CTX_new(hmac) : NULL;
        char digest[] = "SHA256";
        OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0), OSSL_PARAM_construct_end()};
        ok = m->mac && EVP_MAC_init(m->mac, key->bytes, key->len, params);
    } else {
        m->md = EVP_MD_CTX_new();
        ok = m->md && EVP_DigestInit_ex(m->md, EVP_sha256(), NULL);
    }
    if (!ok) {
        blade_cluster_mac_abort(m);
        blade_error_set(err, "digest: libcrypto cannot start %s", key ? "HMAC-SHA256" : "SHA-256");
        return NULL;
    }
    return m;
}

int blade_cluster_mac_update(blade_cluster_mac *m, const void *data, size_t len)
{
    if (len == 0)
        return 0;
    int ok = m->mac ? EVP_MAC_update(m->mac, data, len) : EVP_DigestUpdate(m->md, data, len);
    return ok ? 0 : -1;
}

int blade_cluster_mac_end(blade_cluster_mac *m, uint8_t out[BLADE_CLUSTER_MAC_BYTES])
{
    int ok;
    if (m->mac) {
        size_t n = 0;
        ok = EVP_MAC_final(m->mac, out, &n, BLADE_CLUSTER_MAC_BYTES) && n == BLADE_CLUSTER_MAC_BYTES;
    } else {
        unsigned n = 0;
        ok = EVP_DigestFinal_ex(m->md, out, &n) && n == BLADE_CLUSTER_MAC_BYTES;
    }
    blade_cluster_mac_abort(m);
    return ok ? 0 : -1;
}

void blade_cluster_mac_abort(blade_cluster_mac *m)
{
    if (!m)
        return;
    EVP_MAC_CTX_free(m->mac);
    EVP_MD_CTX_free(m->md);
    free(m);
}

int blade_cluster_sign(const blade_cluster_key *key, const void *data, size_t len, uint8_t out[BLADE_CLUSTER_MAC_BYTES])
{
    blade_cluster_mac *m = blade_cluster_mac_begin(key, NULL);
    if (!m)
        return -1;
    if (blade_cluster_mac_update(m, data, len) != 0) {
        blade_cluster_mac_abort(m);
        return -1;
    }
    return blade_cluster_mac_end(m, out);
}

bool blade_cluster_mac_equal(const uint8_t a[BLADE_CLUSTER_MAC_BYTES], const uint8_t b[BLADE_CLUSTER_MAC_BYTES])
{
    return CRYPTO_memcmp(a, b, BLADE_CLUSTER_MAC_BYTES) == 0;
}

bool blade_cluster_verify(const blade_cluster_key *key, const void *data, size_t len,
                          const uint8_t mac[BLADE_CLUSTER_MAC_BYTES])
{
    uint8_t want[BLADE_CLUSTER_MAC_BYTES];
    return blade_cluster_sign(key, data, len, want) == 0 && blade_cluster_mac_equal(want, mac);
}

int blade_cluster_nonce(uint8_t out[BLADE_CLUSTER_NONCE_BYTES])
{
    return RAND_bytes(out, BLADE_CLUSTER_NONCE_BYTES) == 1 ? 0 : -1;
}

int blade_cluster_proof(const blade_cluster_key *key, const char *role, const uint8_t listener_nonce[BLADE_CLUSTER_NONCE_BYTES],
                        const uint8_t connector_nonce[BLADE_CLUSTER_NONCE_BYTES], uint8_t out[BLADE_CLUSTER_MAC_BYTES])
{
    static const char domain[] = "blade cluster handshake v1";
    blade_cluster_mac *m = blade_cluster_mac_begin(key, NULL);
    if (!m)
        return -1;
    /* The role is length-prefixed by its NUL so "a"+"bc" and "ab"+"c" cannot collide. */
    if (blade_cluster_mac_update(m, domain, sizeof domain) || blade_cluster_mac_update(m, role, strlen(role) + 1) ||
        blade_cluster_mac_update(m, listener_nonce, BLADE_CLUSTER_NONCE_BYTES) ||
        blade_cluster_mac_update(m, connector_nonce, BLADE_CLUSTER_NONCE_BYTES)) {
        blade_cluster_mac_abort(m);
        return -1;
    }
    return blade_cluster_mac_end(m, out);
}

bool blade_cluster_host_is_loopback(const char *host)
{
    if (!host)
        return false;
    size_t n = strlen(host);
    char buf[64];
    /* "[::1]" as URLs write it. */
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']' && n - 2 < sizeof buf) {
        memcpy(buf, host + 1, n - 2);
        buf[n - 2] = 0;
        host = buf;
    }
    if (!strcasecmp(host, "localhost"))
        return true;
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1) {
        static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (!memcmp(a6.s6_addr, v4mapped, 12))
            return a6.s6_addr[12] == 127;
        return IN6_IS_ADDR_LOOPBACK(&a6);
    }
    return false;
}

int blade_cluster_check_listener(const char *host, const blade_cluster_key *key, blade_error *err)
{
    if (key || blade_cluster_host_is_loopback(host))
        return 0;
    return blade_error_set(err,
                           "refusing to listen on %s without a cluster key: any host that reaches it could "
                           "send KV blocks or commands; give --cluster-key-file or listen on 127.0.0.1",
                           host && *host ? host : "all interfaces");
}

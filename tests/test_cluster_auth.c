/* Cluster authentication: key files are refused when other users can read them or when
 * they are too short or long, HMACs match RFC 4231's test vector and reject any change,
 * handshake proofs depend on role and both challenges, and a listener beyond loopback
 * needs a key. */

#include "testutil.h"

#include "blade/cluster_auth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char *key_file(const char *name, const char *content, mode_t mode)
{
    char *path = temp_path(name);
    unlink(path);
    assert_int_equal(write_file(path, content, strlen(content)), 0);
    assert_int_equal(chmod(path, mode), 0);
    return path;
}

static void test_key_file_checks(void **state)
{
    (void)state;
    blade_cluster_key key;
    blade_error err = {0}, warning = {0};

    char *good = key_file("cluster-key-good", "0123456789abcdef0123456789abcdef\n", 0600);
    assert_int_equal(blade_cluster_key_load(good, &key, &warning, &err), 0);
    assert_int_equal(key.len, 32); /* the newline is not part of the key */
    assert_memory_equal(key.bytes, "0123456789abcdef", 16);
    assert_string_equal(warning.msg, "");

    char *group = key_file("cluster-key-group", "0123456789abcdef0123456789abcdef", 0640);
    assert_int_equal(blade_cluster_key_load(group, &key, &warning, &err), 0);
    assert_non_null(strstr(warning.msg, "accessible to its group (mode 0640)"));

    char *world = key_file("cluster-key-world", "0123456789abcdef0123456789abcdef", 0644);
    assert_int_equal(blade_cluster_key_load(world, &key, &warning, &err), -1);
    assert_non_null(strstr(err.msg, "readable by every user of this host (mode 0644)"));
    assert_int_equal(key.len, 0);

    char *short_key = key_file("cluster-key-short", "tooshort\n\n", 0600);
    assert_int_equal(blade_cluster_key_load(short_key, &key, &warning, &err), -1);
    assert_non_null(strstr(err.msg, "too short key (8 bytes"));

    char *long_text = malloc(BLADE_CLUSTER_KEY_MAX + 2);
    memset(long_text, 'k', BLADE_CLUSTER_KEY_MAX + 1);
    long_text[BLADE_CLUSTER_KEY_MAX + 1] = 0;
    char *long_key = key_file("cluster-key-long", long_text, 0600);
    assert_int_equal(blade_cluster_key_load(long_key, &key, &warning, &err), -1);
    assert_non_null(strstr(err.msg, "too long key"));

    assert_int_equal(blade_cluster_key_load(BLADE_TEST_TMPDIR, &key, &warning, &err), -1);
    assert_non_null(strstr(err.msg, "not a regular file"));
    assert_int_equal(blade_cluster_key_load("/nonexistent/key", &key, &warning, &err), -1);
    assert_non_null(strstr(err.msg, "cannot open"));

    char *paths[] = {good, group, world, short_key, long_key};
    for (size_t i = 0; i < 5; i++) {
        unlink(paths[i]);
        free(paths[i]);
    }
    free(long_text);
}

static void hex(const uint8_t *b, char *out)
{
    for (int i = 0; i < 32; i++)
        sprintf(out + 2 * i, "%02x", b[i]);
}

static void test_hmac(void **state)
{
    (void)state;
    /* RFC 4231 test case 2 (a short key, allowed here only to check the algorithm). */
    blade_cluster_key key = {.len = 4};
    memcpy(key.bytes, "Jefe", 4);
    const char *msg = "what do ya want for nothing?";
    uint8_t mac[32];
    char text[65];
    assert_int_equal(blade_cluster_sign(&key, msg, strlen(msg), mac), 0);
    hex(mac, text);
    assert_string_equal(text, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    assert_true(blade_cluster_verify(&key, msg, strlen(msg), mac));

    /* Pieces give the same digest as the whole. */
    blade_cluster_mac *m = blade_cluster_mac_begin(&key, NULL);
    assert_int_equal(blade_cluster_mac_update(m, msg, 10), 0);
    assert_int_equal(blade_cluster_mac_update(m, msg + 10, strlen(msg) - 10), 0);
    uint8_t mac2[32];
    assert_int_equal(blade_cluster_mac_end(m, mac2), 0);
    assert_true(blade_cluster_mac_equal(mac, mac2));

    for (int i = 0; i < 32; i++) {
        mac2[i] ^= 0x80;
        assert_false(blade_cluster_verify(&key, msg, strlen(msg), mac2));
        mac2[i] ^= 0x80;
    }
    assert_false(blade_cluster_verify(&key, msg, strlen(msg) - 1, mac));
    key.bytes[0] = 'j';
    assert_false(blade_cluster_verify(&key, msg, strlen(msg), mac));

    /* Without a key: SHA-256 ("abc" from FIPS 180-2). */
    assert_int_equal(blade_cluster_sign(NULL, "abc", 3, mac), 0);
    hex(mac, text);
    assert_string_equal(text, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

static void test_proofs(void **state)
{
    (void)state;
    blade_cluster_key key = {.len = 20};
    memcpy(key.bytes, "twenty bytes of key!", 20);
    uint8_t a[32], b[32], p1[32], p2[32];
    assert_int_equal(blade_cluster_nonce(a), 0);
    assert_int_equal(blade_cluster_nonce(b), 0);
    assert_memory_not_equal(a, b, 32);
    assert_int_equal(blade_cluster_proof(&key, "connector", a, b, p1), 0);
    assert_int_equal(blade_cluster_proof(&key, "listener", a, b, p2), 0);
    assert_false(blade_cluster_mac_equal(p1, p2));
    assert_int_equal(blade_cluster_proof(&key, "connector", b, a, p2), 0);
    assert_false(blade_cluster_mac_equal(p1, p2));
    assert_int_equal(blade_cluster_proof(&key, "connector", a, b, p2), 0);
    assert_true(blade_cluster_mac_equal(p1, p2));
}

static void test_listener_rule(void **state)
{
    (void)state;
    const char *loop[] = {"127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST", "::ffff:127.0.0.1"};
    for (size_t i = 0; i < sizeof loop / sizeof loop[0]; i++)
        assert_true(blade_cluster_host_is_loopback(loop[i]));
    const char *open_hosts[] = {"0.0.0.0", "", "::", "10.0.0.1", "192.168.1.5", "example.com", "::ffff:10.0.0.1",
                                "128.0.0.1", "[::]"};
    blade_error err = {0};
    blade_cluster_key key = {.len = 16};
    for (size_t i = 0; i < sizeof open_hosts / sizeof open_hosts[0]; i++) {
        assert_false(blade_cluster_host_is_loopback(open_hosts[i]));
        assert_int_equal(blade_cluster_check_listener(open_hosts[i], NULL, &err), -1);
        assert_non_null(strstr(err.msg, "without a cluster key"));
        assert_int_equal(blade_cluster_check_listener(open_hosts[i], &key, &err), 0);
    }
    assert_int_equal(blade_cluster_check_listener("0.0.0.0", NULL, &err), -1);
    assert_non_null(strstr(err.msg, "refusing to listen on 0.0.0.0"));
    assert_int_equal(blade_cluster_check_listener("127.0.0.1", NULL, &err), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key_file_checks),
        cmocka_unit_test(test_hmac),
        cmocka_unit_test(test_proofs),
        cmocka_unit_test(test_listener_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

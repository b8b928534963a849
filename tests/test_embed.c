/* Embedding blade: examples/embed.c, linked against the core library alone, generates the
 * reference greedy continuation of stories260K, and neither it nor any library it loads is
 * libmicrohttpd or libcurl, while the blade command, which links the server and the load
 * generator, loads both (so the check can see them). */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_embed_generates_the_reference(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf");
    char *ref_path = require_shared("eval/greedy-once-upon-a-time.txt");
    char *ref = read_file(ref_path, NULL);
    assert_non_null(ref);
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "exec timeout -k 2 120 '%s' '%s' 'Once upon a time' 48", BLADE_EMBED_BINARY, model);
    assert_int_equal(run_command(cmd, &out), 0);
    size_t len = strlen(out);
    assert_true(len > 0 && out[len - 1] == '\n');
    out[--len] = 0;
    /* 48 tokens of this model are well over 100 bytes of text */
    if (len < 100 || strncmp(out, ref, len) != 0)
        fail_msg("embed printed:\n%s\nwhich is not a prefix of the reference:\n%s", out, ref);
    free(out);
    free(ref);
    free(ref_path);
    free(model);
}

/* ldd lists every shared library the program loads, directly or through another one. */
static char *loaded_libraries(const char *binary)
{
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd, "exec ldd '%s'", binary);
    assert_int_equal(run_command(cmd, &out), 0);
    return out;
}

static void test_core_links_no_http(void **state)
{
    (void)state;
    char *embed = loaded_libraries(BLADE_EMBED_BINARY);
    if (strstr(embed, "libmicrohttpd") || strstr(embed, "libcurl"))
        fail_msg("a program linking only the core library loads an HTTP library:\n%s", embed);
    char *blade = loaded_libraries(BLADE_BINARY);
    if (!strstr(blade, "libmicrohttpd") || !strstr(blade, "libcurl"))
        fail_msg("the blade command should load libmicrohttpd and libcurl; ldd shows:\n%s", blade);
    free(embed);
    free(blade);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embed_generates_the_reference),
        cmocka_unit_test(test_core_links_no_http),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

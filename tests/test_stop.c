/* Stop strings: matches across token boundaries, text that may start a stop string held
 * back and released when it does not, the earliest of several matches winning, a stop at
 * the very start, multi-byte UTF-8 and NUL bytes, no stop strings at all, copies of the
 * caller's strings, and a randomized comparison with a plain reference that also pins the
 * hold-back to exactly the longest suffix that is a proper prefix of a stop string. */
#include "testutil.h"

#include "blade/stop.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Pushes text and checks what is released and whether the stream stopped. */
static void expect_push(blade_stop_matcher *m, const char *text, const char *released, bool stopped)
{
    const char *out = "unset";
    size_t n = 99;
    bool got = blade_stop_push(m, text, strlen(text), &out, &n);
    if (got != stopped || n != strlen(released) || (n && memcmp(out, released, n) != 0))
        fail_msg("push \"%s\": released \"%.*s\"%s, want \"%s\"%s", text, (int)n, n ? out : "", got ? " (stop)" : "",
                 released, stopped ? " (stop)" : "");
}

static void expect_flush(blade_stop_matcher *m, const char *released)
{
    const char *out = "unset";
    size_t n = 99;
    blade_stop_flush(m, &out, &n);
    if (n != strlen(released) || (n && memcmp(out, released, n) != 0))
        fail_msg("flush: released \"%.*s\", want \"%s\"", (int)n, n ? out : "", released);
}

static void init(blade_stop_matcher *m, const char *const *stops, int n)
{
    assert_int_equal(blade_stop_init(m, stops, n), 0);
}

static void test_no_stop_strings(void **state)
{
    (void)state;
    blade_stop_matcher m;
    /* a stream that ends before any text */
    const char *stops[] = {"x"};
    for (int n = 0; n < 2; n++) {
        init(&m, stops, n);
        expect_flush(&m, "");
        blade_stop_destroy(&m);
    }

    init(&m, NULL, 0);
    expect_push(&m, "Hello", "Hello", false);
    expect_push(&m, "", "", false);
    expect_push(&m, " world", " world", false);
    expect_flush(&m, "");
    blade_stop_destroy(&m);

    /* empty strings are ignored, not a match at every position */
    const char *empty[] = {"", ""};
    init(&m, empty, 2);
    assert_int_equal(m.n, 0);
    expect_push(&m, "abc", "abc", false);
    expect_flush(&m, "");
    blade_stop_destroy(&m);

    const char *some_empty[] = {"", "xy", ""};
    init(&m, some_empty, 3);
    assert_int_equal(m.n, 1);
    expect_push(&m, "abx", "ab", false);
    expect_push(&m, "yz", "", true);
    blade_stop_destroy(&m);
}

static void test_across_token_boundaries(void **state)
{
    (void)state;
    const char *stops[] = {"</s>"};
    blade_stop_matcher m;
    init(&m, stops, 1);
    expect_push(&m, "Hello <", "Hello ", false);
    expect_push(&m, "/", "", false);
    expect_push(&m, "s", "", false);
    expect_push(&m, "> and more", "", true);
    blade_stop_destroy(&m);

    /* the match ends inside a token: the rest of that token is dropped */
    init(&m, stops, 1);
    expect_push(&m, "a</", "a", false);
    expect_push(&m, "s>b", "", true);
    blade_stop_destroy(&m);

    /* a match wholly inside one token, text before it released */
    init(&m, stops, 1);
    expect_push(&m, "ok", "ok", false);
    expect_push(&m, "xx</s>yy", "xx", true);
    blade_stop_destroy(&m);
}

static void test_partial_match_released(void **state)
{
    (void)state;
    const char *stops[] = {"STOP"};
    blade_stop_matcher m;
    init(&m, stops, 1);
    expect_push(&m, "ab ST", "ab ", false);
    expect_push(&m, "O", "", false);
    /* "STOx" is not a stop: all of it comes out */
    expect_push(&m, "x", "STOx", false);
    expect_push(&m, "S", "", false);
    /* "SS": the first S is released, the second may still start a stop */
    expect_push(&m, "S", "S", false);
    expect_push(&m, "TOP", "", true);
    blade_stop_destroy(&m);

    /* held text comes out at the end of the stream */
    init(&m, stops, 1);
    expect_push(&m, "end ST", "end ", false);
    expect_flush(&m, "ST");
    expect_flush(&m, "");
    blade_stop_destroy(&m);

    /* overlapping candidates: "aab" in "aaab" */
    const char *aab[] = {"aab"};
    init(&m, aab, 1);
    expect_push(&m, "a", "", false);
    expect_push(&m, "a", "", false);
    expect_push(&m, "a", "a", false);
    expect_push(&m, "b", "", true);
    blade_stop_destroy(&m);
}

static void test_multiple_stop_strings(void **state)
{
    (void)state;
    blade_stop_matcher m;
    /* the earliest match wins, whatever the order of the list */
    const char *stops[] = {"world", "lo w"};
    init(&m, stops, 2);
    expect_push(&m, "hello world", "hel", true);
    blade_stop_destroy(&m);

    /* the hold-back is the longest suffix that starts any of them */
    const char *two[] = {"bcd", "abc"};
    init(&m, two, 2);
    expect_push(&m, "xab", "x", false);
    expect_push(&m, "cd", "", true);
    blade_stop_destroy(&m);

    /* one stop string inside another: the one that starts first wins */
    const char *nested[] = {"b", "abc"};
    init(&m, nested, 2);
    expect_push(&m, "xa", "x", false);
    expect_push(&m, "bc", "", true);
    blade_stop_destroy(&m);

    /* a stop string that is completed first, within one push, but starts later loses */
    const char *inner[] = {"c", "abcd"};
    init(&m, inner, 2);
    expect_push(&m, "xabcd", "x", true);
    blade_stop_destroy(&m);
}

static void test_stop_at_start(void **state)
{
    (void)state;
    const char *stops[] = {"\n\n", "User:"};
    blade_stop_matcher m;
    init(&m, stops, 2);
    expect_push(&m, "User: hi", "", true);
    blade_stop_destroy(&m);

    init(&m, stops, 2);
    expect_push(&m, "\n", "", false);
    expect_push(&m, "\n", "", true);
    blade_stop_destroy(&m);

    init(&m, stops, 2);
    expect_push(&m, "User:", "", true);
    blade_stop_destroy(&m);
}

static void test_utf8_and_nul_bytes(void **state)
{
    (void)state;
    const char *stops[] = {"世界", "é!"};
    blade_stop_matcher m;
    init(&m, stops, 2);
    expect_push(&m, "你好", "你好", false);
    expect_push(&m, "世", "", false);
    expect_push(&m, "界!", "", true);
    blade_stop_destroy(&m);

    /* a character sharing its lead byte with a stop string's first character */
    init(&m, stops, 2);
    expect_push(&m, "caf", "caf", false);
    expect_push(&m, "é", "", false);
    expect_push(&m, "è", "éè", false);
    expect_push(&m, "é", "", false);
    expect_push(&m, " ", "é ", false);
    expect_push(&m, "é!", "", true);
    blade_stop_destroy(&m);

    /* byte-fallback tokens split a character: the stop still matches */
    init(&m, stops, 2);
    expect_push(&m, "a\xe4", "a", false);
    expect_push(&m, "\xb8", "", false);
    expect_push(&m, "\x96\xe7\x95", "", false);
    expect_push(&m, "\x8c", "", true);
    blade_stop_destroy(&m);

    /* NUL bytes (a <0x00> token) are text like any other */
    const char *x[] = {"x"};
    init(&m, x, 1);
    const char *out;
    size_t n;
    assert_false(blade_stop_push(&m, "a\0b", 3, &out, &n));
    assert_int_equal(n, 3);
    assert_memory_equal(out, "a\0b", 3);
    assert_true(blade_stop_push(&m, "\0x\0", 3, &out, &n));
    assert_int_equal(n, 1);
    assert_int_equal(out[0], 0);
    blade_stop_destroy(&m);
}

/* The strings are copied: the caller's buffers may go away after init. */
static void test_copies_stop_strings(void **state)
{
    (void)state;
    char buf[] = "halt";
    const char *stops[] = {buf};
    blade_stop_matcher m;
    init(&m, stops, 1);
    memcpy(buf, "zzzz", 4);
    expect_push(&m, "zzzz ha", "zzzz ", false);
    expect_push(&m, "lt", "", true);
    blade_stop_destroy(&m);
}

/* ---- randomized comparison with a reference ---- */

static uint64_t rng_state = 0x5eed;

static uint32_t rnd(uint32_t n)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33) % n;
}

/* Whole characters of 1 to 4 bytes, and a NUL byte in the text only. */
static const char *const PIECES[] = {"a", "b", "é", "世", "🙂", " "};
#define N_PIECES (sizeof PIECES / sizeof PIECES[0])

/* Where the first occurrence of any stop string in text[0..n) starts, or n. */
static size_t ref_first_match(const char *text, size_t n, char stops[][32], int n_stops)
{
    size_t first = n;
    for (int i = 0; i < n_stops; i++) {
        size_t len = strlen(stops[i]);
        for (size_t at = 0; at + len <= n && at < first; at++)
            if (!memcmp(text + at, stops[i], len))
                first = at;
    }
    return first;
}

/* Length of the longest suffix of text[0..n) that is a proper prefix of a stop string. */
static size_t ref_hold(const char *text, size_t n, char stops[][32], int n_stops)
{
    size_t best = 0;
    for (int i = 0; i < n_stops; i++)
        for (size_t k = 1; k < strlen(stops[i]) && k <= n; k++)
            if (k > best && !memcmp(text + n - k, stops[i], k))
                best = k;
    return best;
}

static bool char_boundary(const char *text, size_t n, size_t at)
{
    return at == n || ((unsigned char)text[at] & 0xc0) != 0x80;
}

static void test_matches_reference(void **state)
{
    (void)state;
    int n_stopped = 0, n_held = 0, n_split = 0;
    for (int trial = 0; trial < 3000; trial++) {
        char stops[3][32];
        const char *stop_ptrs[3];
        int n_stops = 1 + (int)rnd(3);
        size_t max_len = 0;
        for (int i = 0; i < n_stops; i++) {
            stops[i][0] = 0;
            for (uint32_t k = 0, len = 1 + rnd(4); k < len; k++)
                strcat(stops[i], PIECES[rnd(N_PIECES - 1)]);
            stop_ptrs[i] = stops[i];
            max_len = strlen(stops[i]) > max_len ? strlen(stops[i]) : max_len;
        }
        char text[512];
        size_t n_text = 0;
        for (uint32_t k = 0, len = rnd(40); k < len; k++) {
            const char *p = rnd(20) ? PIECES[rnd(N_PIECES)] : "\0";
            size_t pl = *p ? strlen(p) : 1;
            memcpy(text + n_text, p, pl);
            n_text += pl;
        }

        blade_stop_matcher m;
        init(&m, stop_ptrs, n_stops);
        char got[512];
        size_t n_got = 0, pushed = 0;
        bool stopped = false;
        while (!stopped && pushed < n_text) {
            /* one to three whole characters, as the detokenizer emits them */
            size_t start = pushed;
            for (uint32_t k = 0, chars = 1 + rnd(3); k < chars && pushed < n_text; k++)
                do
                    pushed++;
                while (!char_boundary(text, n_text, pushed));
            const char *out;
            size_t n;
            stopped = blade_stop_push(&m, text + start, pushed - start, &out, &n);
            if (n)
                memcpy(got + n_got, out, n);
            n_got += n;
            assert_true(char_boundary(text, n_text, n_got));
            /* the stream ends in the first push that completes a stop string, at the
             * earliest start of one in the text so far */
            size_t match = ref_first_match(text, pushed, stops, n_stops);
            if (stopped) {
                assert_true(match < pushed);
                assert_int_equal(n_got, match);
                n_stopped++;
                n_split += match < start;
            } else {
                assert_int_equal(match, pushed);
                size_t hold = ref_hold(text, pushed, stops, n_stops);
                assert_true(hold < max_len);
                n_held += hold > 0;
                if (n_got != pushed - hold)
                    fail_msg("trial %d: %zu bytes released of %zu pushed, want all but %zu", trial, n_got, pushed,
                             hold);
            }
        }
        if (!stopped) {
            const char *out;
            size_t n;
            blade_stop_flush(&m, &out, &n);
            if (n)
                memcpy(got + n_got, out, n);
            n_got += n;
            assert_int_equal(n_got, n_text);
        }
        assert_memory_equal(got, text, n_got);
        blade_stop_destroy(&m);
    }
    /* the cases that matter occur often enough to be tested */
    print_message("%d of 3000 streams stopped (%d by a stop string split across pushes); %d pushes held text back\n",
                  n_stopped, n_split, n_held);
    assert_true(n_stopped > 300 && n_stopped < 2700 && n_split > 100 && n_held > 1000);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_stop_strings),
        cmocka_unit_test(test_across_token_boundaries),
        cmocka_unit_test(test_partial_match_released),
        cmocka_unit_test(test_multiple_stop_strings),
        cmocka_unit_test(test_stop_at_start),
        cmocka_unit_test(test_utf8_and_nul_bytes),
        cmocka_unit_test(test_copies_stop_strings),
        cmocka_unit_test(test_matches_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

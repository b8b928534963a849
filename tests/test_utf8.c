/* The shared UTF-8 module against an independent reference: every scalar value encodes to
 * its one spelling and decodes back; every string of up to three bytes, and every four-byte
 * string over a spread of continuation bytes, is classified as RFC 3629 says (overlongs,
 * surrogates, values past U+10FFFF, cut-short and stray bytes refused); the lead-byte table
 * the streaming detokenizer reads agrees with the whole-character check; and ill-formed
 * input decodes to U+FFFD of length 1 while a genuine U+FFFD has length 3, which is what
 * the chat template's character classes tell apart. */
#include "testutil.h"

#include "common/utf8.h"

#include <string.h>

/* The reference: the length L of the well-formed character at s, or 0. The lead byte's
 * high bits give L, the next L-1 bytes must be 10xxxxxx, and the value must be a scalar
 * value that needs exactly L bytes (else the spelling is overlong). */
static size_t ref_char_len(const unsigned char *s, size_t n, uint32_t *cp)
{
    unsigned char c = s[0];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || len > n)
        return 0;
    uint32_t v = len == 1 ? c : len == 2 ? c & 0x1Fu : len == 3 ? c & 0x0Fu : c & 0x07u;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        v = v << 6 | (s[i] & 0x3Fu);
    }
    size_t shortest = v < 0x80 ? 1 : v < 0x800 ? 2 : v < 0x10000 ? 3 : 4;
    if (shortest != len || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    *cp = v;
    return len;
}

static void check_bytes(const unsigned char *s, size_t n)
{
    uint32_t want_cp = 0, got_cp = 0;
    size_t want = ref_char_len(s, n, &want_cp);
    size_t got = blade_utf8_char_len((const char *)s, n);
    if (got != want)
        fail_msg("%02X %02X %02X %02X (n=%zu): length %zu, want %zu", s[0], n > 1 ? s[1] : 0, n > 2 ? s[2] : 0,
                 n > 3 ? s[3] : 0, n, got, want);
    size_t used = blade_utf8_decode((const char *)s, n, &got_cp);
    if (want ? (used != want || got_cp != want_cp) : (used != 1 || got_cp != BLADE_UTF8_REPLACEMENT))
        fail_msg("%02X %02X %02X %02X (n=%zu): decoded U+%04X in %zu bytes", s[0], n > 1 ? s[1] : 0,
                 n > 2 ? s[2] : 0, n > 3 ? s[3] : 0, n, got_cp, used);
}

static void test_every_scalar_value_round_trips(void **state)
{
    (void)state;
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF)
            continue;
        char buf[4];
        size_t n = blade_utf8_encode(cp, buf);
        size_t want = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
        uint32_t back = 0;
        if (n != want || blade_utf8_char_len(buf, n) != n || blade_utf8_decode(buf, n, &back) != n || back != cp)
            fail_msg("U+%04X: %zu bytes, decoded U+%04X", cp, n, back);
        /* cut short, it is no character */
        if (n > 1 && blade_utf8_char_len(buf, n - 1) != 0)
            fail_msg("U+%04X cut to %zu bytes still counts as a character", cp, n - 1);
    }
}

static void test_every_short_string_is_classified(void **state)
{
    (void)state;
    unsigned char s[4] = {0};
    for (int a = 0; a < 256; a++) {
        s[0] = (unsigned char)a;
        check_bytes(s, 1);
        for (int b = 0; b < 256; b++) {
            s[1] = (unsigned char)b;
            check_bytes(s, 2);
            for (int c = 0; c < 256; c++) {
                s[2] = (unsigned char)c;
                check_bytes(s, 3);
            }
        }
    }
    /* four bytes: every lead and second byte, the third and fourth over the boundaries of
     * the continuation range and a few bytes outside it */
    static const unsigned char tails[] = {0x00, 0x41, 0x7F, 0x80, 0x81, 0x9F, 0xA0, 0xBF, 0xC0, 0xF4, 0xFF};
    size_t nt = sizeof tails;
    for (int a = 0; a < 256; a++)
        for (int b = 0; b < 256; b++)
            for (size_t c = 0; c < nt; c++)
                for (size_t d = 0; d < nt; d++) {
                    unsigned char t[4] = {(unsigned char)a, (unsigned char)b, tails[c], tails[d]};
                    check_bytes(t, 4);
                }
}

static void test_named_ill_formed_sequences(void **state)
{
    (void)state;
    static const struct {
        const char *bytes;
        size_t n;
        const char *what;
    } bad[] = {
        {"\xC0\x80", 2, "overlong NUL"},
        {"\xC1\xBF", 2, "overlong U+007F"},
        {"\xE0\x9F\xBF", 3, "overlong U+07FF"},
        {"\xF0\x8F\xBF\xBF", 4, "overlong U+FFFF"},
        {"\xED\xA0\x80", 3, "surrogate U+D800"},
        {"\xED\xBF\xBF", 3, "surrogate U+DFFF"},
        {"\xF4\x90\x80\x80", 4, "U+110000"},
        {"\xF5\x80\x80\x80", 4, "lead F5"},
        {"\xFF", 1, "byte FF"},
        {"\x80", 1, "stray continuation"},
        {"\xE2\x82", 2, "cut short"},
        {"\xE2\x41\xAC", 3, "ASCII inside"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint32_t cp = 0;
        if (blade_utf8_char_len(bad[i].bytes, bad[i].n) != 0 || blade_utf8_decode(bad[i].bytes, bad[i].n, &cp) != 1 ||
            cp != BLADE_UTF8_REPLACEMENT)
            fail_msg("%s is taken for a character", bad[i].what);
    }
    /* a genuine U+FFFD is three bytes long: callers tell it from a bad byte by that */
    uint32_t cp = 0;
    assert_int_equal(blade_utf8_decode("\xEF\xBF\xBD", 3, &cp), 3);
    assert_int_equal(cp, 0xFFFD);
    /* decoding resumes right after a bad byte: "\xE2" then "(" */
    const char *s = "\xE2(";
    size_t n = blade_utf8_decode(s, 2, &cp);
    assert_int_equal(n, 1);
    assert_int_equal(blade_utf8_decode(s + n, 1, &cp), 1);
    assert_int_equal(cp, '(');
}

/* blade_utf8_lead is what a byte-at-a-time decoder sees: its length and second-byte range
 * must accept exactly the sequences the whole-character check accepts. */
static void test_lead_table_matches(void **state)
{
    (void)state;
    for (int a = 0; a < 256; a++) {
        unsigned char lo, hi;
        size_t need = blade_utf8_lead((unsigned char)a, &lo, &hi);
        for (int b = 0; b < 256; b++) {
            unsigned char s[4] = {(unsigned char)a, (unsigned char)b, 0x80, 0x80};
            uint32_t cp;
            size_t want = ref_char_len(s, 4, &cp);
            bool accepted = need == 1 || (need >= 2 && b >= lo && b <= hi);
            if ((want != 0) != accepted || (want && want != need))
                fail_msg("lead %02X second %02X: lead table says %zu [%02X..%02X], reference %zu", a, b, need, lo,
                         hi, want);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_scalar_value_round_trips),
        cmocka_unit_test(test_every_short_string_is_classified),
        cmocka_unit_test(test_named_ill_formed_sequences),
        cmocka_unit_test(test_lead_table_matches),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

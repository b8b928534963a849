/* The strict request-head reader of `blade serve` (src/server/http_head.c): every framing
 * ambiguity RFC 9112 names is refused with the right status, sound heads pass with their
 * framing read right, a head that cannot become valid is refused before it is complete, and
 * the first chunk size is checked against the body limit. */
#include "testutil.h"

#include "server/http_head.h"

#include <string.h>

typedef struct head_case {
    const char *head;
    enum http_scan want;
    int status;         /* for HTTP_HEAD_BAD */
    const char *needle; /* in the message, for HTTP_HEAD_BAD */
} head_case;

static void check_cases(const head_case *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        http_head h;
        api_error e = {0};
        enum http_scan r = http_head_scan(cases[i].head, strlen(cases[i].head), 16384, &h, &e);
        if (r != cases[i].want)
            fail_msg("case %zu '%s': scan %d, want %d (%d %s)", i, cases[i].head, r, cases[i].want, e.status,
                     e.message);
        if (r == HTTP_HEAD_BAD && (e.status != cases[i].status || !strstr(e.message, cases[i].needle)))
            fail_msg("case %zu '%s': %d '%s', want %d with '%s'", i, cases[i].head, e.status, e.message,
                     cases[i].status, cases[i].needle);
    }
}

static void test_refusals(void **state)
{
    (void)state;
    const head_case cases[] = {
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", HTTP_HEAD_BAD, 400,
         "more than one Content-Length"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", HTTP_HEAD_BAD, 400,
         "more than one Content-Length"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\n\r\n", HTTP_HEAD_BAD, 400, "decimal number"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", HTTP_HEAD_BAD, 400, "'-1'"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\n", HTTP_HEAD_BAD, 400, "decimal number"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5 \r\n\r\n", HTTP_HEAD_BAD, 400, "decimal number"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0x10\r\n\r\n", HTTP_HEAD_BAD, 400, "decimal number"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n", HTTP_HEAD_BAD, 400,
         "decimal number"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: \r\n\r\n", HTTP_HEAD_BAD, 400, "decimal number"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", HTTP_HEAD_BAD, 400,
         "both Content-Length and Transfer-Encoding"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", HTTP_HEAD_BAD, 400,
         "both"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", HTTP_HEAD_BAD, 501, "'gzip'"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", HTTP_HEAD_BAD, 501, "'gzip'"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n", HTTP_HEAD_BAD, 501,
         "'identity'"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked;q=1\r\n\r\n", HTTP_HEAD_BAD, 501, "chunked;q=1"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", HTTP_HEAD_BAD, 400,
         "'chunked'"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
         HTTP_HEAD_BAD, 400, "one header"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked \r\n\r\n", HTTP_HEAD_BAD, 400, "one header"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \r\n\r\n", HTTP_HEAD_BAD, 400, "one header"},
        {"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", HTTP_HEAD_BAD, 400, "HTTP/1.0"},
        {"GARBAGE\r\n\r\n", HTTP_HEAD_BAD, 400, "request line"},
        {"GET /\r\n\r\n", HTTP_HEAD_BAD, 400, "request line"},
        {"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", HTTP_HEAD_BAD, 400, "request line"},
        {"GET / HTTP/1.1 \r\nHost: x\r\n\r\n", HTTP_HEAD_BAD, 400, "request line"},
        {"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n", HTTP_HEAD_BAD, 400, "request line"},
        {"GET / http/1.1\r\nHost: x\r\n\r\n", HTTP_HEAD_BAD, 400, "request line"},
        {"GET / HTTP/2.0\r\nHost: x\r\n\r\n", HTTP_HEAD_BAD, 505, "HTTP/2.0"},
        {"GET / HTTP/0.9\r\nHost: x\r\n\r\n", HTTP_HEAD_BAD, 505, "HTTP/0.9"},
        {"G(T / HTTP/1.1\r\n", HTTP_HEAD_BAD, 400, "request line"},
        {"GET / HTTP/1.1\nHost: x\n\n", HTTP_HEAD_BAD, 400, "request line"},
        {"GET / HTTP/1.1\r\nHost: x\nX: y\r\n\r\n", HTTP_HEAD_BAD, 400, "CR or LF alone"},
        {"GET / HTTP/1.1\r\nHost: x\rX: y\r\n\r\n", HTTP_HEAD_BAD, 400, "CR or LF alone"},
        {"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", HTTP_HEAD_BAD, 400, "folding"},
        {"GET / HTTP/1.1\r\nHost : x\r\n\r\n", HTTP_HEAD_BAD, 400, "whitespace before its colon"},
        {"GET / HTTP/1.1\r\nHost: x\r\nX-A\r\n\r\n", HTTP_HEAD_BAD, 400, "no colon"},
        {"GET / HTTP/1.1\r\nHost: x\r\n: v\r\n\r\n", HTTP_HEAD_BAD, 400, "empty name"},
        {"GET / HTTP/1.1\r\nHost: x\r\nX(A): v\r\n\r\n", HTTP_HEAD_BAD, 400, "not allowed"},
        {"GET / HTTP/1.1\r\nHost: x\r\nX: a\x01" "b\r\n\r\n", HTTP_HEAD_BAD, 400, "control character"},
        {"GET / HTTP/1.1\r\nHost: x\r\nX: a\x7f\r\n\r\n", HTTP_HEAD_BAD, 400, "control character"},
        {"GET / HTTP/1.1\r\n\r\n", HTTP_HEAD_BAD, 400, "needs a Host"},
        {"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", HTTP_HEAD_BAD, 400, "more than one Host"},
    };
    check_cases(cases, sizeof cases / sizeof cases[0]);
}

static void test_sound_heads(void **state)
{
    (void)state;
    const head_case cases[] = {
        {"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", HTTP_HEAD_DONE, 0, NULL},
        {"\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n", HTTP_HEAD_DONE, 0, NULL},
        {"GET / HTTP/1.0\r\n\r\n", HTTP_HEAD_DONE, 0, NULL},
        {"GET / HTTP/1.2\r\nHost: x\r\n\r\n", HTTP_HEAD_DONE, 0, NULL},
        {"GET / HTTP/1.1\r\nHost: x\r\nX-Empty:\r\nX-Tab:\tv\t\r\nX-Latin: caf\xc3\xa9\r\n\r\n", HTTP_HEAD_DONE, 0,
         NULL},
        {"POST / HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n", HTTP_HEAD_DONE, 0, NULL},
        {"POST / HTTP/1.1\r\nHost: x\r\nTRANSFER-ENCODING:   Chunked\r\n\r\n", HTTP_HEAD_DONE, 0, NULL},
        {"GET / HTTP/1.1\r\nHost: x\r\n", HTTP_HEAD_PARTIAL, 0, NULL},
        {"GET / HTTP/1.1\r\nHost: x\r\n\r", HTTP_HEAD_PARTIAL, 0, NULL},
        {"GET / HTTP/1.1\r", HTTP_HEAD_PARTIAL, 0, NULL},
        {"GARBAGE", HTTP_HEAD_PARTIAL, 0, NULL}, /* could still become "GARBAGE / HTTP/1.1" */
        {"", HTTP_HEAD_PARTIAL, 0, NULL},
    };
    check_cases(cases, sizeof cases / sizeof cases[0]);

    http_head h;
    api_error e;
    const char *req = "POST /v1/completions?x=1 HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 42\r\n"
                      "\r\n{\"prompt\"";
    assert_int_equal(http_head_scan(req, strlen(req), 16384, &h, &e), HTTP_HEAD_DONE);
    assert_int_equal(h.len, strlen(req) - strlen("{\"prompt\""));
    assert_int_equal(h.framing.n_length, 1);
    assert_int_equal(h.framing.length, 42);
    assert_int_equal(h.framing.n_te, 0);
    assert_true(h.expect_continue);
    assert_int_equal(h.minor, 1);
    assert_int_equal(h.target_len, strlen("/v1/completions?x=1"));
    assert_false(http_head_is_probe(&h));
    const char *probe = "HEAD /health?verbose HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_int_equal(http_head_scan(probe, strlen(probe), 16384, &h, &e), HTTP_HEAD_DONE);
    assert_true(http_head_is_probe(&h));
    const char *not_probe = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_int_equal(http_head_scan(not_probe, strlen(not_probe), 16384, &h, &e), HTTP_HEAD_DONE);
    assert_false(http_head_is_probe(&h));
}

static void test_limits(void **state)
{
    (void)state;
    char buf[300];
    http_head h;
    api_error e;
    /* a request line that does not end within the limit: 414, a longer head: 431 */
    memset(buf, 'a', sizeof buf);
    memcpy(buf, "GET /", 5);
    assert_int_equal(http_head_scan(buf, 200, 200, &h, &e), HTTP_HEAD_BAD);
    assert_int_equal(e.status, 414);
    assert_int_equal(http_head_scan(buf, 150, 200, &h, &e), HTTP_HEAD_PARTIAL);
    int n = snprintf(buf, sizeof buf, "GET / HTTP/1.1\r\nHost: x\r\nX: %0100d", 0);
    assert_int_equal(http_head_scan(buf, (size_t)n, 100, &h, &e), HTTP_HEAD_BAD);
    assert_int_equal(e.status, 431);
    n = snprintf(buf, sizeof buf, "GET / HTTP/1.1\r\nHost: x\r\nX: %080d\r\n\r\n", 0);
    assert_int_equal(http_head_scan(buf, (size_t)n, (size_t)n, &h, &e), HTTP_HEAD_DONE);
    assert_int_equal(http_head_scan(buf, (size_t)n, (size_t)n - 1, &h, &e), HTTP_HEAD_BAD);
    /* more fields than libmicrohttpd's pool is sized for */
    char many[4096];
    size_t len = (size_t)snprintf(many, sizeof many, "GET / HTTP/1.1\r\nHost: x\r\n");
    for (int i = 0; i < 100; i++)
        len += (size_t)snprintf(many + len, sizeof many - len, "X%d: v\r\n", i);
    strcpy(many + len, "\r\n");
    assert_int_equal(http_head_scan(many, len + 2, 16384, &h, &e), HTTP_HEAD_BAD);
    assert_int_equal(e.status, 431);
}

static void test_chunk_size(void **state)
{
    (void)state;
    api_error e;
    struct {
        const char *line;
        enum http_scan want;
        int status;
    } cases[] = {
        {"ffffffffffffffff\r\n", HTTP_HEAD_BAD, 413},
        {"fffffffffffffffff", HTTP_HEAD_BAD, 413},
        {"1000000\r\nabc", HTTP_HEAD_BAD, 413}, /* 16 MiB, over the 8 MiB limit */
        {"1000001", HTTP_HEAD_BAD, 413},        /* already too large before its line ends */
        {"800000\r\n", HTTP_HEAD_DONE, 0},      /* exactly the limit */
        {"00000000000000000000000000010\r\n", HTTP_HEAD_DONE, 0},
        {"20;ext=1\r\n", HTTP_HEAD_DONE, 0},
        {"0\r\n\r\n", HTTP_HEAD_DONE, 0},
        {"2", HTTP_HEAD_PARTIAL, 0},
        {"20\r", HTTP_HEAD_PARTIAL, 0},
        {"", HTTP_HEAD_PARTIAL, 0},
        {"zz\r\n", HTTP_HEAD_BAD, 400},
        {"\r\n", HTTP_HEAD_BAD, 400},
        {"20\n", HTTP_HEAD_BAD, 400},
        {"20 \r\n", HTTP_HEAD_BAD, 400},
        {"-1\r\n", HTTP_HEAD_BAD, 400},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        enum http_scan r = http_chunk_size_scan(cases[i].line, strlen(cases[i].line), 8u << 20, &e);
        if (r != cases[i].want || (r == HTTP_HEAD_BAD && e.status != cases[i].status))
            fail_msg("chunk line '%s': scan %d status %d, want %d status %d", cases[i].line, r,
                     r == HTTP_HEAD_BAD ? e.status : 0, cases[i].want, cases[i].status);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_sound_heads),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_chunk_size),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

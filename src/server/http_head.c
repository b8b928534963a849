/* The strict HTTP/1.1 request-head reader of `blade serve` (see http_head.h). It must never
 * accept what libmicrohttpd would read differently: libmicrohttpd parses the same bytes again
 * after the head is handed to it, so every leniency it has (bare LF, folded lines, spaces in
 * odd places, a value cut at a NUL) is refused here, and framing fields must have exactly the
 * form it acts on. */
#include "server/http_head.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

#define MAX_FIELDS 100 /* libmicrohttpd keeps each field in its per-connection pool */

static bool is_tchar(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

static bool is_ows(char c)
{
    return c == ' ' || c == '\t';
}

static bool name_is(const char *name, size_t len, const char *want)
{
    return len == strlen(want) && !strncasecmp(name, want, len);
}

/* Quotes untrusted bytes for a message: printable ASCII kept, the rest as \xNN, at most cap-1
 * bytes out. */
static void quote(char *out, size_t cap, const char *s, size_t n)
{
    size_t o = 0;
    for (size_t i = 0; i < n && o + 5 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'')
            out[o++] = (char)c;
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
    }
    out[o] = 0;
}

static void bad(api_error *err, int status, const char *code, const char *msg)
{
    api_error_set(err, status, "invalid_request_error", code, NULL, "%s", msg);
}

void http_framing_field(http_framing *f, const char *name, size_t name_len, const char *value, size_t value_len)
{
    if (name_is(name, name_len, "Content-Length")) {
        if (f->n_length++ > 0)
            return;
        bool digits = value_len > 0 && value_len <= 19;
        uint64_t v = 0;
        for (size_t i = 0; digits && i < value_len; i++) {
            digits = value[i] >= '0' && value[i] <= '9';
            v = v * 10 + (uint64_t)(value[i] - '0');
        }
        f->length_bad = !digits;
        f->length = digits ? v : 0;
        if (!digits)
            quote(f->bad_length, sizeof f->bad_length, value, value_len < 16 ? value_len : 16);
        return;
    }
    if (!name_is(name, name_len, "Transfer-Encoding"))
        return;
    f->n_te++;
    /* libmicrohttpd takes the body as chunked only when the value is exactly "chunked" */
    f->te_exact = f->n_te == 1 && name_is(value, value_len, "chunked");
    size_t i = 0;
    while (i < value_len) {
        size_t start = i;
        while (i < value_len && value[i] != ',')
            i++;
        size_t end = i++;
        while (start < end && is_ows(value[start]))
            start++;
        while (end > start && is_ows(value[end - 1]))
            end--;
        if (start == end)
            continue;
        f->n_codings++;
        f->chunked_last = name_is(value + start, end - start, "chunked");
        if (f->chunked_last)
            f->n_chunked++;
        else if (!f->other[0])
            quote(f->other, sizeof f->other, value + start, end - start < 32 ? end - start : 32);
    }
}

int http_framing_check(const http_framing *f, int http_minor, api_error *err)
{
    if (f->n_length > 1) {
        bad(err, 400, "invalid_framing",
            "the request has more than one Content-Length header; send exactly one (RFC 9112 section 6.3)");
        return 400;
    }
    if (f->n_te && f->n_length) {
        bad(err, 400, "invalid_framing",
            "the request has both Content-Length and Transfer-Encoding; send one of them (RFC 9112 section 6.3)");
        return 400;
    }
    if (f->length_bad) {
        api_error_set(err, 400, "invalid_request_error", "invalid_framing", NULL,
                      "Content-Length must be a decimal number of bytes, got '%s'", f->bad_length);
        return 400;
    }
    if (!f->n_te)
        return 0;
    if (f->other[0]) {
        api_error_set(err, 501, "invalid_request_error", "unsupported_transfer_encoding", NULL,
                      "Transfer-Encoding '%s' is not supported; this server accepts only 'chunked' (or a "
                      "Content-Length)",
                      f->other);
        return 501;
    }
    if (http_minor == 0) {
        bad(err, 400, "invalid_framing", "an HTTP/1.0 request cannot use Transfer-Encoding");
        return 400;
    }
    if (!f->te_exact || f->n_chunked != 1 || !f->chunked_last) {
        bad(err, 400, "invalid_framing", "Transfer-Encoding must be one header with the value 'chunked'");
        return 400;
    }
    return 0;
}

enum line { LINE_DONE, LINE_PARTIAL, LINE_BAD };

/* Finds the CRLF ending the line that starts at buf[i]; a CR or LF alone is refused. */
static enum line line_end(const char *buf, size_t i, size_t n, size_t *end)
{
    for (; i < n; i++) {
        if (buf[i] == '\n')
            return LINE_BAD;
        if (buf[i] == '\r') {
            if (i + 1 == n)
                return LINE_PARTIAL;
            if (buf[i + 1] != '\n')
                return LINE_BAD;
            *end = i;
            return LINE_DONE;
        }
    }
    return LINE_PARTIAL;
}

/* The request line buf[i..e): METHOD SP TARGET SP HTTP/1.x, one space each. */
static enum http_scan request_line(const char *buf, size_t i, size_t e, http_head *h, api_error *err)
{
    size_t p = i;
    while (p < e && is_tchar((unsigned char)buf[p]))
        p++;
    size_t t = p + 1, q = t;
    while (q < e && (unsigned char)buf[q] > 0x20 && (unsigned char)buf[q] < 0x7f)
        q++;
    const char *v = buf + q + 1;
    size_t vlen = q < e ? e - q - 1 : 0;
    if (p == i || p >= e || buf[p] != ' ' || q == t || q >= e || buf[q] != ' ' || vlen != 8 ||
        strncmp(v, "HTTP/", 5) || v[5] < '0' || v[5] > '9' || v[6] != '.' || v[7] < '0' || v[7] > '9') {
        char got[64];
        quote(got, sizeof got, buf + i, e - i < 40 ? e - i : 40);
        api_error_set(err, 400, "invalid_request_error", "invalid_request_line", NULL,
                      "the request line must be 'METHOD /path HTTP/1.1', got '%s'", got);
        return HTTP_HEAD_BAD;
    }
    if (v[5] != '1') {
        api_error_set(err, 505, "invalid_request_error", "http_version_not_supported", NULL,
                      "HTTP/%c.%c is not supported; this server speaks HTTP/1.1 (and 1.0)", v[5], v[7]);
        return HTTP_HEAD_BAD;
    }
    h->method = buf + i;
    h->method_len = p - i;
    h->target = buf + t;
    h->target_len = q - t;
    h->minor = v[7] - '0';
    return HTTP_HEAD_DONE;
}

/* Refuses at once a request line that cannot become valid, so bytes that are not HTTP (a TLS
 * hello, a stray protocol) are answered without waiting for a line end that may never come. */
static bool method_prefix_ok(const char *buf, size_t i, size_t n)
{
    size_t p = i;
    while (p < n && is_tchar((unsigned char)buf[p]))
        p++;
    return p == n || (p > i && buf[p] == ' ');
}

/* One header field line buf[i..e). */
static bool field_line(const char *buf, size_t i, size_t e, http_head *h, int *n_host, api_error *err)
{
    const char *colon = memchr(buf + i, ':', e - i);
    if (!colon) {
        bad(err, 400, "invalid_header", "a header line has no colon");
        return false;
    }
    size_t name_end = (size_t)(colon - buf);
    for (size_t k = i; k < name_end; k++)
        if (!is_tchar((unsigned char)buf[k])) {
            bad(err, 400, "invalid_header",
                is_ows(buf[k]) ? "a header name is followed by whitespace before its colon (RFC 9112 section 5.1)"
                               : "a header name has a character that is not allowed in it");
            return false;
        }
    if (name_end == i) {
        bad(err, 400, "invalid_header", "a header line has an empty name");
        return false;
    }
    size_t vs = name_end + 1;
    while (vs < e && is_ows(buf[vs]))
        vs++;
    for (size_t k = vs; k < e; k++) {
        unsigned char c = (unsigned char)buf[k];
        if ((c < 0x20 && c != '\t') || c == 0x7f) {
            bad(err, 400, "invalid_header", "a header value has a control character");
            return false;
        }
    }
    const char *name = buf + i, *value = buf + vs;
    size_t name_len = name_end - i, value_len = e - vs;
    if (name_is(name, name_len, "Host"))
        (*n_host)++;
    if (name_is(name, name_len, "Expect") && name_is(value, value_len, "100-continue"))
        h->expect_continue = true;
    http_framing_field(&h->framing, name, name_len, value, value_len);
    return true;
}

static enum http_scan too_long(api_error *err, bool in_request_line, size_t max_head)
{
    if (in_request_line)
        api_error_set(err, 414, "invalid_request_error", "uri_too_long", NULL,
                      "the request line is longer than %zu bytes", max_head);
    else
        api_error_set(err, 431, "invalid_request_error", "headers_too_large", NULL,
                      "the request head is longer than %zu bytes", max_head);
    return HTTP_HEAD_BAD;
}

enum http_scan http_head_scan(const char *buf, size_t n, size_t max_head, http_head *h, api_error *err)
{
    memset(h, 0, sizeof *h);
    size_t i = 0;
    /* empty lines before a request are tolerated (RFC 9112 section 2.2) */
    while (i + 1 < n && buf[i] == '\r' && buf[i + 1] == '\n' && i < max_head)
        i += 2;
    size_t e;
    enum line l = line_end(buf, i, n, &e);
    if (l == LINE_BAD || (l == LINE_PARTIAL && !method_prefix_ok(buf, i, n))) {
        bad(err, 400, "invalid_request_line", "the request does not start with an HTTP request line");
        return HTTP_HEAD_BAD;
    }
    if (l == LINE_PARTIAL)
        return n >= max_head ? too_long(err, true, max_head) : HTTP_HEAD_PARTIAL;
    if (e + 2 > max_head)
        return too_long(err, true, max_head);
    if (request_line(buf, i, e, h, err) == HTTP_HEAD_BAD)
        return HTTP_HEAD_BAD;
    int n_host = 0, n_fields = 0;
    for (i = e + 2;; i = e + 2) {
        if (i + 1 < n && buf[i] == '\r' && buf[i + 1] == '\n')
            break;
        if (i < n && is_ows(buf[i])) {
            bad(err, 400, "invalid_header", "a header line starts with whitespace (obsolete line folding)");
            return HTTP_HEAD_BAD;
        }
        l = line_end(buf, i, n, &e);
        if (l == LINE_BAD) {
            bad(err, 400, "invalid_header", "a header line ends in a CR or LF alone; lines end in CRLF");
            return HTTP_HEAD_BAD;
        }
        if (l == LINE_PARTIAL)
            return n >= max_head ? too_long(err, false, max_head) : HTTP_HEAD_PARTIAL;
        if (e + 4 > max_head)
            return too_long(err, false, max_head);
        if (++n_fields > MAX_FIELDS) {
            api_error_set(err, 431, "invalid_request_error", "headers_too_large", NULL,
                          "the request has more than %d header fields", MAX_FIELDS);
            return HTTP_HEAD_BAD;
        }
        if (!field_line(buf, i, e, h, &n_host, err))
            return HTTP_HEAD_BAD;
    }
    h->len = i + 2;
    if (n_host > 1 || (n_host == 0 && h->minor >= 1)) {
        bad(err, 400, "invalid_header",
            n_host ? "the request has more than one Host header" : "an HTTP/1.1 request needs a Host header");
        return HTTP_HEAD_BAD;
    }
    return http_framing_check(&h->framing, h->minor, err) ? HTTP_HEAD_BAD : HTTP_HEAD_DONE;
}

enum http_scan http_chunk_size_scan(const char *buf, size_t n, size_t max_body, api_error *err)
{
    uint64_t v = 0;
    size_t i = 0;
    bool big = false;
    for (; i < n; i++) {
        char c = buf[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0)
            break;
        if (v > (UINT64_MAX >> 4))
            big = true;
        else
            v = v << 4 | (uint64_t)d;
        if (v > max_body)
            big = true;
    }
    if (big) {
        char got[48];
        quote(got, sizeof got, buf, i < 32 ? i : 32);
        api_error_set(err, 413, "invalid_request_error", "request_too_large", NULL,
                      "a chunk of the request body is announced as 0x%s bytes; the limit for the whole body is %zu "
                      "bytes (--max-body)",
                      got, max_body);
        return HTTP_HEAD_BAD;
    }
    if (i == n)
        return HTTP_HEAD_PARTIAL;
    if (i > 0 && buf[i] == ';')
        return HTTP_HEAD_DONE;
    if (i > 0 && buf[i] == '\r') {
        if (i + 1 == n)
            return HTTP_HEAD_PARTIAL;
        if (buf[i + 1] == '\n')
            return HTTP_HEAD_DONE;
    }
    bad(err, 400, "invalid_chunk", "the chunked request body does not start with a hexadecimal chunk size line");
    return HTTP_HEAD_BAD;
}

bool http_head_is_probe(const http_head *h)
{
    bool get = (h->method_len == 3 && !memcmp(h->method, "GET", 3)) || (h->method_len == 4 && !memcmp(h->method, "HEAD", 4));
    const char *paths[] = {"/health", "/metrics"};
    for (size_t k = 0; get && k < 2; k++) {
        size_t pl = strlen(paths[k]);
        if (h->target_len >= pl && !memcmp(h->target, paths[k], pl) &&
            (h->target_len == pl || h->target[pl] == '?'))
            return true;
    }
    return false;
}

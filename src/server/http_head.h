#ifndef BLADE_SERVER_HTTP_HEAD_H
#define BLADE_SERVER_HTTP_HEAD_H

/* The strict reading of an HTTP/1.1 request head (RFC 9112) that `blade serve` applies before
 * libmicrohttpd sees a request: the request line, the header fields and above all the message
 * framing (Content-Length, Transfer-Encoding, the first chunk size). Anything two parsers could
 * read differently is refused, so a request can never be framed one way by a proxy in front
 * and another way here (request smuggling): bare CR or LF, obsolete line folding, whitespace
 * before a colon, control bytes, more than one Content-Length or Host, Content-Length with
 * Transfer-Encoding, and any transfer coding but a single chunked.
 *
 * Refusals come as OpenAI-style errors with the HTTP status to send: 400 (malformed), 413
 * (a chunk larger than the body limit), 414 (request line too long), 431 (head too long),
 * 501 (transfer coding not implemented) and 505 (HTTP version). */

#include "api/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The framing a request's header fields declare, gathered one field at a time (from raw
 * bytes here, from libmicrohttpd's parsed fields in the server). */
typedef struct http_framing {
    int n_length;        /* Content-Length fields seen */
    bool length_bad;     /* a value that is not 1 to 19 decimal digits */
    char bad_length[24]; /* its first bytes, quoted */
    uint64_t length;
    int n_te;            /* Transfer-Encoding fields seen */
    bool te_exact;       /* one field, its value exactly "chunked" (any case) */
    int n_codings;       /* codings listed over all of them */
    bool chunked_last;   /* the last coding listed is chunked */
    int n_chunked;
    char other[48];      /* the first coding that is not chunked ("" if none) */
} http_framing;

void http_framing_field(http_framing *f, const char *name, size_t name_len, const char *value, size_t value_len);
/* 0 when the framing is sound (then f->n_te > 0 means chunked, else f->length bytes follow
 * if f->n_length); otherwise the status, with err set. http_minor is the request's
 * HTTP/1.x minor version. */
int http_framing_check(const http_framing *f, int http_minor, api_error *err);

typedef struct http_head {
    size_t len;            /* bytes of the head, leading empty lines and final CRLF included */
    const char *method;    /* not NUL-terminated: into the scanned buffer */
    size_t method_len;
    const char *target;
    size_t target_len;
    int minor;             /* HTTP/1.<minor> */
    http_framing framing;
    bool expect_continue;  /* Expect: 100-continue */
} http_head;

enum http_scan { HTTP_HEAD_PARTIAL, HTTP_HEAD_DONE, HTTP_HEAD_BAD };

/* Reads the request head at the start of buf[0..n). PARTIAL: more bytes are needed (a byte
 * that is already wrong is reported at once, so a malformed head is refused before it is
 * complete); BAD: err holds the refusal. A head longer than max_head bytes is refused (414
 * while still in the request line, else 431). */
enum http_scan http_head_scan(const char *buf, size_t n, size_t max_head, http_head *h, api_error *err);

/* Reads the size line of the first chunk at the start of buf[0..n) for a chunked body:
 * PARTIAL until its end is seen, BAD (413 above max_body, 400 if malformed) or DONE. */
enum http_scan http_chunk_size_scan(const char *buf, size_t n, size_t max_body, api_error *err);

/* Whether the head asks for one of the probes (GET or HEAD /health or /metrics), which may use
 * the slots kept for them when every other one is taken. */
bool http_head_is_probe(const http_head *h);

#endif

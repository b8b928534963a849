/* OpenAI's error object (error.h): set from a status, type and message, and serialized
 * even when the message quotes bytes that are not UTF-8. */

#include "api/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void error_vset(api_error *e, int status, const char *type, const char *code, const char *param,
                       const char *fmt, va_list ap)
{
    e->status = status;
    e->type = type;
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    vsnprintf(e->message, sizeof e->message, fmt, ap);
}

void api_error_set(api_error *e, int status, const char *type, const char *code, const char *param,
                   const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    error_vset(e, status, type, code, param, fmt, ap);
    va_end(ap);
}

void api_bad_request(api_error *e, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    error_vset(e, 400, "invalid_request_error", NULL, param, fmt, ap);
    va_end(ap);
}

/* Messages quote what the client sent, which may hold any bytes; a message that is not
 * valid UTF-8 would make jansson refuse the whole object, so it is cut back to the last
 * whole character. */
static json_t *message_string(const char *s)
{
    size_t n = strlen(s);
    json_t *v;
    while (!(v = json_stringn(s, n)) && n > 0)
        n--;
    return v ? v : json_string("");
}

json_t *api_error_json(const api_error *e)
{
    json_t *inner = json_object();
    json_object_set_new(inner, "message", message_string(e->message));
    json_object_set_new(inner, "type", json_string(e->type ? e->type : "invalid_request_error"));
    json_object_set_new(inner, "param", e->param[0] ? message_string(e->param) : json_null());
    json_object_set_new(inner, "code", e->code ? json_string(e->code) : json_null());
    json_t *outer = json_object();
    json_object_set_new(outer, "error", inner);
    return outer;
}

char *api_error_body(const api_error *e, size_t *len)
{
    json_t *j = api_error_json(e);
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (len)
        *len = s ? strlen(s) : 0;
    return s;
}

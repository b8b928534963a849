#ifndef BLADE_API_ERROR_H
#define BLADE_API_ERROR_H

/* What a refusal becomes on the wire: OpenAI's {"error": {message, type, param, code}}
 * with its HTTP status. */

#include "blade/error.h"

#include <jansson.h>

typedef struct api_error {
    int status;
    const char *type;
    const char *code; /* NULL: null */
    char param[64];   /* "": null */
    char message[1024];
} api_error;

void api_error_set(api_error *e, int status, const char *type, const char *code, const char *param,
                   const char *fmt, ...) BLADE_PRINTF(6, 7);
/* The usual 400 naming the offending parameter. */
void api_bad_request(api_error *e, const char *param, const char *fmt, ...) BLADE_PRINTF(3, 4);
json_t *api_error_json(const api_error *e);
/* The serialized error object, malloc'd. */
char *api_error_body(const api_error *e, size_t *len);

#endif

#ifndef BLADE_CHAT_TEMPLATE_H
#define BLADE_CHAT_TEMPLATE_H

/* Chat templates: the Jinja subset that models' tokenizer.chat_template sources use
 * (statements, expressions, filters, tests, loops with loop.*, macros, set/namespace,
 * raise_exception), configured as Hugging Face tokenizers configure Jinja: trim_blocks
 * and lstrip_blocks on, loop controls, a tojson filter that keeps non-ASCII characters,
 * and strftime_now(fmt). Values come from a JSON context (jansson).
 *
 * Templates come from downloaded model files, so parsing and rendering are bounded, each
 * limit failing with its own message: source 1 MiB; statements and expressions nested 256
 * deep; evaluation recursion 1024 levels and macro calls 64 deep (worst-case stack well
 * under 256 KiB); 20 million work units per render (about a second; typical chats use ~100
 * per message); 256 MiB of live values; 32 MiB per string and for the output; range() of
 * at most 100000 items, as Jinja's sandbox; values nested 512 deep for str(), tojson, ==.
 * A parsed template is read-only while rendering: threads may render it concurrently. */

#include "blade/error.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

typedef struct blade_template blade_template;

/* Parses a template source; syntax errors name the line and what was expected. */
blade_template *blade_template_parse(const char *source, size_t len, blade_error *err);
void blade_template_free(blade_template *t);

/* Renders with the variables of `context` (a JSON object). *out is malloc'd, NUL-terminated.
 * Errors (raise_exception, undefined operations, runaway recursion or output) return -1
 * with the message in err; rendering is bounded in time and output size. */
int blade_template_render(const blade_template *t, json_t *context, char **out, size_t *out_len, blade_error *err);

/* The usual chat context: messages, add_generation_prompt, bos_token, eos_token. */
int blade_template_render_chat(const blade_template *t, json_t *messages, bool add_generation_prompt,
                               const char *bos_token, const char *eos_token, char **out, size_t *out_len,
                               blade_error *err);

/* The date strftime_now() formats: today unless set (tests pin it). */
void blade_template_set_time(blade_template *t, long long unix_seconds);

#endif

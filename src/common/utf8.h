#ifndef BLADE_COMMON_UTF8_H
#define BLADE_COMMON_UTF8_H

/* UTF-8 encoding shared by the tokenizer (byte-level BPE alphabet) and the chat template
 * engine (string escapes, case mapping). */

#include <stddef.h>
#include <stdint.h>

/* Writes cp (<= 0x10FFFF) as 1..4 bytes to out; returns the byte count. */
size_t blade_utf8_encode(uint32_t cp, char *out);

#endif

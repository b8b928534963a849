#ifndef BLADE_COMMON_UTF8_H
#define BLADE_COMMON_UTF8_H

/* UTF-8 for every module that handles text: the tokenizer (byte-level BPE alphabet,
 * pre-tokenizer runs, the streaming detokenizer), the chat template engine (string
 * escapes, case mapping, Python's character classes) and the OpenAI protocol (JSON strings
 * of arbitrary token bytes). Well-formed means RFC 3629: no overlong forms, no UTF-16
 * surrogates (U+D800..U+DFFF), nothing past U+10FFFF, so each scalar value has exactly one
 * spelling. Every caller treats an ill-formed byte the same way: it stands alone (one
 * U+FFFD, or passed through as one byte) and decoding resumes at the next byte, so a
 * stray byte never swallows the character after it. */

#include <stddef.h>
#include <stdint.h>

#define BLADE_UTF8_REPLACEMENT 0xFFFDu

/* Writes cp (<= 0x10FFFF) as 1..4 bytes to out; returns the byte count. */
size_t blade_utf8_encode(uint32_t cp, char *out);

/* For a lead byte: the length of the sequence it starts (0 when it cannot start one: a
 * continuation byte, C0, C1 or F5..FF) and the allowed range of the second byte, which is
 * narrower than 80..BF after E0, ED, F0 and F4. For decoders that see one byte at a time. */
size_t blade_utf8_lead(unsigned char c, unsigned char *lo, unsigned char *hi);

/* Length (1..4) of the well-formed character at s, or 0 when s does not start one
 * (including one cut short by n). n >= 1. */
size_t blade_utf8_char_len(const char *s, size_t n);

/* Decodes the character at s: its code point and length (1..4), or U+FFFD and 1 when s
 * does not start a well-formed one. A genuine U+FFFD in the text has length 3. n >= 1. */
size_t blade_utf8_decode(const char *s, size_t n, uint32_t *cp);

#endif

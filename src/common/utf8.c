/* The one UTF-8 implementation (utf8.h): encoding, and decoding by the RFC 3629 table of
 * well-formed byte sequences, which rules out overlongs, surrogates and values past
 * U+10FFFF by the second byte's range alone. */

#include "common/utf8.h"

size_t blade_utf8_encode(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t blade_utf8_lead(unsigned char c, unsigned char *lo, unsigned char *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        return 2;
    if (c >= 0xE0 && c <= 0xEF) {
        if (c == 0xE0)
            *lo = 0xA0; /* overlong below U+0800 */
        else if (c == 0xED)
            *hi = 0x9F; /* UTF-16 surrogates */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (c == 0xF0)
            *lo = 0x90; /* overlong below U+10000 */
        else if (c == 0xF4)
            *hi = 0x8F; /* past U+10FFFF */
        return 4;
    }
    return 0;
}

size_t blade_utf8_char_len(const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    unsigned char lo, hi;
    size_t need = blade_utf8_lead(u[0], &lo, &hi);
    if (need <= 1)
        return need;
    if (n < need || u[1] < lo || u[1] > hi)
        return 0;
    for (size_t i = 2; i < need; i++)
        if ((u[i] & 0xC0) != 0x80)
            return 0;
    return need;
}

size_t blade_utf8_decode(const char *s, size_t n, uint32_t *cp)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t len = blade_utf8_char_len(s, n);
    if (len == 0) {
        *cp = BLADE_UTF8_REPLACEMENT;
        return 1;
    }
    /* the lead byte keeps 7, 5, 4 or 3 payload bits for lengths 1..4 */
    uint32_t v = len == 1 ? u[0] : u[0] & (0x7Fu >> len);
    for (size_t i = 1; i < len; i++)
        v = (v << 6) | (u[i] & 0x3F);
    *cp = v;
    return len;
}

#ifndef BLADE_GGUF_INTERNAL_H
#define BLADE_GGUF_INTERNAL_H

/* Pieces shared by the GGUF reader and writer, so both sides agree on value sizes and on
 * how a tensor shape turns into a byte count. */

#include "blade/gguf.h"
#include "blade/types.h"

#include <stddef.h>
#include <stdint.h>

/* Values, counts and tensor data are moved between the file and memory with plain memcpy:
 * GGUF is little-endian and so is every host blade targets. Fail the build rather than
 * silently produce byte-swapped models elsewhere. */
#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "blade's GGUF reader and writer assume a little-endian host"
#endif

#define GGUF_HEADER_SIZE 24

/* Bytes of one value of a fixed-size type; 0 for strings, arrays and unknown ids. */
size_t gguf_value_type_size(gguf_value_type t);

/* Element count and byte size of a tensor of type tt and shape ne[0..n_dims). Rejects
 * dimensions < 1, element counts or byte sizes that overflow, and rows (ne[0]) that are
 * not a whole number of blocks. The message names no file position; callers prefix it. */
int gguf_tensor_layout(const blade_type_traits *tt, uint32_t n_dims, const int64_t *ne,
                       uint64_t *n_elements, size_t *nbytes, blade_error *err);

/* A file-supplied name made safe for an error message: non-printable bytes escaped as
 * \xNN and long names shortened, so hostile input cannot garble a terminal. cap must be
 * at least 4. */
void gguf_describe_name(char *dst, size_t cap, const char *s, size_t len);

#endif

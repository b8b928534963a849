/* `blade convert` (convert.h): a llama2.c checkpoint and its tokenizer export rewritten
 * as a llama GGUF that blade, and llama.cpp, load like any other. The checkpoint's header
 * must describe exactly the weights the file holds, and the vocabulary must match its
 * size, before anything is written. */

#include "blade/convert.h"

#include "blade/gguf.h"
#include "blade/tokenizer.h"
#include "blade/types.h"
#include "common/file.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct mapped {
    const uint8_t *data;
    size_t size;
} mapped;

static int map_file(const char *path, mapped *m, blade_error *err)
{
    int fd = blade_open_regular(path, err);
    if (fd < 0)
        return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) {
        close(fd);
        return blade_error_set(err, "%s: empty or unreadable file", path);
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return blade_error_set(err, "%s: mmap failed: %s", path, strerror(errno));
    m->data = p;
    m->size = (size_t)st.st_size;
    return 0;
}

static void unmap_file(mapped *m)
{
    if (m->data)
        munmap((void *)m->data, m->size);
}

typedef struct llama2c_config {
    int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
    bool shared_classifier;
} llama2c_config;

static int read_config(const mapped *ck, const char *path, llama2c_config *c, blade_error *err)
{
    int32_t h[7];
    if (ck->size < sizeof h)
        return blade_error_set(err, "%s: file of %zu bytes is too small for the 28-byte llama2.c header",
                               path, ck->size);
    memcpy(h, ck->data, sizeof h);
    static const char *const names[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                                         "vocab_size", "seq_len"};
    for (int i = 0; i < 7; i++) {
        int64_t v = i == 5 ? llabs((long long)h[i]) : h[i];
        if (v <= 0 || v > (1 << 20) || (i == 2 && v > 4096))
            return blade_error_set(err, "%s: header field %s = %d (offset %d) is out of range", path, names[i],
                                   h[i], i * 4);
    }
    c->dim = h[0];
    c->hidden_dim = h[1];
    c->n_layers = h[2];
    c->n_heads = h[3];
    c->n_kv_heads = h[4];
    c->shared_classifier = h[5] > 0;
    c->vocab_size = h[5] > 0 ? h[5] : -h[5];
    c->seq_len = h[6];
    if (c->dim % c->n_heads != 0 || (c->dim / c->n_heads) % 2 != 0)
        return blade_error_set(err, "%s: dim %d is not an even head size times n_heads %d", path, c->dim,
                               c->n_heads);
    if (c->n_heads % c->n_kv_heads != 0)
        return blade_error_set(err, "%s: n_heads %d is not a multiple of n_kv_heads %d", path, c->n_heads,
                               c->n_kv_heads);
    return 0;
}

typedef struct vocab {
    char **tokens;
    float *scores;
    int32_t *types;
    int32_t n;
} vocab;

static void vocab_free(vocab *v)
{
    if (v->tokens)
        for (int32_t i = 0; i < v->n; i++)
            free(v->tokens[i]);
    free(v->tokens);
    free(v->scores);
    free(v->types);
}

/* llama2.c's tokenizer export wraps BOS/EOS in newlines and turns SentencePiece's U+2581
 * word marker into a plain space; both are undone so the vocabulary reads like any
 * SentencePiece GGUF. */
static char *restore_piece(const uint8_t *s, uint32_t len)
{
    if (len >= 2 && s[0] == '\n' && s[len - 1] == '\n') {
        s++;
        len -= 2;
    }
    size_t spaces = 0;
    for (uint32_t i = 0; i < len; i++)
        spaces += s[i] == ' ';
    char *out = malloc(len + spaces * 2 + 1);
    if (!out)
        return NULL;
    size_t o = 0;
    for (uint32_t i = 0; i < len; i++) {
        if (s[i] == ' ') {
            memcpy(out + o, "\xe2\x96\x81", 3);
            o += 3;
        } else {
            out[o++] = (char)s[i];
        }
    }
    out[o] = 0;
    return out;
}

static int32_t piece_type(const char *piece, int32_t id)
{
    unsigned hex;
    char tail;
    if (id == 0)
        return BLADE_TOKEN_UNKNOWN;
    if (id == 1 || id == 2)
        return BLADE_TOKEN_CONTROL;
    if (strlen(piece) == 6 && sscanf(piece, "<0x%2X%c", &hex, &tail) == 2 && tail == '>')
        return BLADE_TOKEN_BYTE;
    return BLADE_TOKEN_NORMAL;
}

static int read_vocab(const char *path, int32_t n_vocab, vocab *v, blade_error *err)
{
    mapped tk = {0};
    if (map_file(path, &tk, err))
        return -1;
    int rc = -1;
    v->n = n_vocab;
    v->tokens = calloc((size_t)n_vocab, sizeof *v->tokens);
    v->scores = calloc((size_t)n_vocab, sizeof *v->scores);
    v->types = calloc((size_t)n_vocab, sizeof *v->types);
    if (!v->tokens || !v->scores || !v->types) {
        blade_error_set(err, "out of memory");
        goto done;
    }
    size_t off = 4; /* max_token_length: not needed, lengths are checked one by one */
    if (tk.size < off) {
        blade_error_set(err, "%s: too small for a llama2.c tokenizer", path);
        goto done;
    }
    for (int32_t i = 0; i < n_vocab; i++) {
        uint32_t len;
        if (tk.size - off < 8) {
            blade_error_set(err, "%s: token %d (offset %zu): file ends before its score and length", path, i, off);
            goto done;
        }
        memcpy(&v->scores[i], tk.data + off, 4);
        memcpy(&len, tk.data + off + 4, 4);
        off += 8;
        if (len == 0 || len > 1024 || len > tk.size - off) {
            blade_error_set(err, "%s: token %d (offset %zu): length %u is zero, too long or past the end",
                            path, i, off - 4, len);
            goto done;
        }
        v->tokens[i] = restore_piece(tk.data + off, len);
        if (!v->tokens[i]) {
            blade_error_set(err, "out of memory");
            goto done;
        }
        v->types[i] = piece_type(v->tokens[i], i);
        off += len;
    }
    rc = 0;
done:
    unmap_file(&tk);
    return rc;
}

typedef struct tensor_cursor {
    const uint8_t *next;
    gguf_writer *w;
    blade_error *err;
} tensor_cursor;

/* llama2.c stores each weight class for all layers consecutively, so tensors are taken in
 * file order and named per layer. n_out == 0 marks a vector. */
static int take(tensor_cursor *c, const char *fmt, int layer, int64_t n_in, int64_t n_out)
{
    char name[96];
    snprintf(name, sizeof name, fmt, layer);
    int64_t ne[2] = {n_in, n_out};
    size_t nbytes = (size_t)n_in * (size_t)(n_out ? n_out : 1) * sizeof(float);
    int rc = gguf_writer_add_tensor(c->w, name, BLADE_TYPE_F32, n_out ? 2 : 1, ne, c->next, nbytes, c->err);
    c->next += nbytes;
    return rc;
}

static int take_per_layer(tensor_cursor *c, const char *fmt, int n_layers, int64_t n_in, int64_t n_out)
{
    for (int l = 0; l < n_layers; l++)
        if (take(c, fmt, l, n_in, n_out))
            return -1;
    return 0;
}

int blade_convert_llama2c(const char *checkpoint_path, const char *tokenizer_path, const char *out_path,
                          const char *name, bool show_progress, blade_error *err)
{
    mapped ck = {0};
    vocab v = {0};
    gguf_writer *w = NULL;
    int rc = -1;
    llama2c_config c = {0};
    if (map_file(checkpoint_path, &ck, err) || read_config(&ck, checkpoint_path, &c, err))
        goto done;

    int64_t d = c.dim, hs = c.dim / c.n_heads, kv = (int64_t)c.n_kv_heads * hs, L = c.n_layers;
    /* Each header field is at most 2^20, so the biggest product (L·d·hidden) stays below
     * 2^62 and the sum below cannot wrap. */
    uint64_t floats = (uint64_t)c.vocab_size * d + L * d * 2 + L * d * d * 2 + L * d * kv * 2 +
                      L * d * (uint64_t)c.hidden_dim * 3 + d + (uint64_t)c.seq_len * hs;
    if (!c.shared_classifier)
        floats += (uint64_t)c.vocab_size * d;
    uint64_t want = 28 + floats * 4;
    if (ck.size != want) {
        blade_error_set(err, "%s: file is %zu bytes but its header describes %llu bytes of weights", checkpoint_path,
                        ck.size, (unsigned long long)want);
        goto done;
    }
    if (read_vocab(tokenizer_path, c.vocab_size, &v, err))
        goto done;

    w = gguf_writer_new();
    gguf_writer_set_string(w, "general.architecture", "llama");
    gguf_writer_set_string(w, "general.name", name ? name : "llama2.c");
    gguf_writer_set_u32(w, "llama.context_length", (uint32_t)c.seq_len);
    gguf_writer_set_u32(w, "llama.embedding_length", (uint32_t)d);
    gguf_writer_set_u32(w, "llama.feed_forward_length", (uint32_t)c.hidden_dim);
    gguf_writer_set_u32(w, "llama.block_count", (uint32_t)L);
    gguf_writer_set_u32(w, "llama.attention.head_count", (uint32_t)c.n_heads);
    gguf_writer_set_u32(w, "llama.attention.head_count_kv", (uint32_t)c.n_kv_heads);
    gguf_writer_set_u32(w, "llama.rope.dimension_count", (uint32_t)hs);
    gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    gguf_writer_set_f32(w, "llama.rope.freq_base", 10000.0f);
    gguf_writer_set_u32(w, "general.file_type", 0);
    gguf_writer_set_string(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_string_array(w, "tokenizer.ggml.tokens", (const char *const *)v.tokens, (uint64_t)v.n);
    gguf_writer_set_array(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, v.scores, (uint64_t)v.n);
    gguf_writer_set_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, v.types, (uint64_t)v.n);
    gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    /* llama.cpp's converter states "no such token" for these (its key spells "seperator"), so
     * a model converted here and one converted there carry the same vocabulary metadata. */
    gguf_writer_set_u32(w, "tokenizer.ggml.seperator_token_id", UINT32_MAX);
    gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", UINT32_MAX);

    tensor_cursor cur = {ck.data + 28, w, err};
    if (take(&cur, "token_embd.weight", 0, d, c.vocab_size) ||
        take_per_layer(&cur, "blk.%d.attn_norm.weight", L, d, 0) ||
        take_per_layer(&cur, "blk.%d.attn_q.weight", L, d, d) ||
        take_per_layer(&cur, "blk.%d.attn_k.weight", L, d, kv) ||
        take_per_layer(&cur, "blk.%d.attn_v.weight", L, d, kv) ||
        take_per_layer(&cur, "blk.%d.attn_output.weight", L, d, d) ||
        take_per_layer(&cur, "blk.%d.ffn_norm.weight", L, d, 0) ||
        take_per_layer(&cur, "blk.%d.ffn_gate.weight", L, d, c.hidden_dim) ||
        take_per_layer(&cur, "blk.%d.ffn_down.weight", L, c.hidden_dim, d) ||
        take_per_layer(&cur, "blk.%d.ffn_up.weight", L, d, c.hidden_dim) ||
        take(&cur, "output_norm.weight", 0, d, 0))
        goto done;
    /* The precomputed RoPE tables are skipped: blade derives them from rope.freq_base. */
    cur.next += (size_t)c.seq_len * (size_t)hs * sizeof(float);
    if (!c.shared_classifier && take(&cur, "output.weight", 0, d, c.vocab_size))
        goto done;
    rc = gguf_writer_write(w, out_path, show_progress, err);
done:
    gguf_writer_free(w);
    vocab_free(&v);
    unmap_file(&ck);
    return rc;
}

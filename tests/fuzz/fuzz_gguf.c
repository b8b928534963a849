/* libFuzzer target for a GGUF file as blade meets it (README: build-fuzz/fuzz_gguf CORPUS, the
 * corpus seeded by build-fuzz/fuzz_seeds). The input is
 * parsed as a file in memory; what parses has its tokenizer built and run both ways, and a
 * model that loads and is small runs a two-token forward pass, so a tensor whose shape the
 * loader let through but the runner cannot take shows up here, not in a user's server. Any
 * crash, hang, sanitizer report or abort is a bug: a hostile file must end in an error. */

#include "blade/gguf.h"
#include "blade/kernels.h"
#include "blade/kv_store.h"
#include "blade/model.h"
#include "blade/runner.h"
#include "blade/tokenizer.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Larger models would make each run slow without reaching new code. */
#define MAX_FORWARD_WEIGHT_BYTES (4u << 20)
enum { FORWARD_BLOCK_SIZE = 16, FORWARD_BLOCKS = 4 };

static void exercise_tokenizer(const gguf_file *f)
{
    blade_tokenizer *t = blade_tokenizer_load(f, NULL);
    if (!t)
        return;
    static const char text[] = "Hello, world! <s></s><|im_start|> 12345 \xe2\x82\xac caf\xc3\xa9\n\tend \xff\xfe";
    int32_t *ids = NULL;
    size_t n = 0;
    if (blade_tokenizer_encode(t, text, sizeof text - 1, true, true, &ids, &n, NULL) == 0) {
        size_t cap = blade_tokenizer_max_token_bytes(t) + 1;
        char *out = malloc(cap);
        blade_detokenizer d;
        blade_detokenizer_init(&d, t, true);
        for (size_t i = 0; out && i < n; i++)
            blade_detokenizer_push(&d, ids[i], out, cap);
        if (out)
            blade_detokenizer_flush(&d, out, cap);
        free(out);
    }
    free(ids);
    char piece[64];
    for (int32_t id = 0; id < blade_tokenizer_n_vocab(t) && id < 64; id++)
        blade_tokenizer_token_bytes(t, id, true, piece, sizeof piece);
    blade_tokenizer_free(t);
}

static void exercise_forward(const blade_model *m)
{
    if (m->weight_bytes > MAX_FORWARD_WEIGHT_BYTES)
        return;
    blade_kv_store_config sc = blade_model_kv_config(&m->hp, BLADE_KV_F16, FORWARD_BLOCK_SIZE, 0);
    sc.n_blocks = FORWARD_BLOCKS;
    blade_kv_store *kv = blade_kv_store_new(&sc, NULL);
    blade_threadpool *pool = blade_threadpool_new(1);
    blade_runner *r = kv && pool ? blade_runner_new(m, kv, pool, 8, NULL) : NULL;
    if (r) {
        int32_t tokens[2] = {0, m->hp.n_vocab > 1 ? 1 : 0}, table[FORWARD_BLOCKS];
        for (int32_t b = 0; b < FORWARD_BLOCKS; b++)
            table[b] = b;
        float *logits = malloc(sizeof(float) * (size_t)(m->hp.n_vocab > 0 ? m->hp.n_vocab : 1) * 2);
        int32_t rows[2] = {0, 1};
        blade_batch_seq s = {.tokens = tokens, .n_tokens = 2, .pos0 = 0, .block_table = table, .n_blocks = FORWARD_BLOCKS,
                             .logit_rows = rows, .n_logits = 2, .logits = logits};
        if (logits)
            blade_runner_forward(r, &s, 1, NULL);
        free(logits);
        blade_runner_free(r);
    }
    blade_threadpool_free(pool);
    blade_kv_store_free(kv);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* gguf_open_memory wants the caller's buffer to outlive the file: libFuzzer's does. */
    gguf_file *f = gguf_open_memory(data, size, NULL);
    if (!f)
        return 0;
    for (uint64_t i = 0; i < f->n_kv; i++) {
        bool present;
        if (f->kv[i].type == GGUF_TYPE_STRING)
            free(gguf_get_string(f, f->kv[i].key, &present, NULL));
    }
    exercise_tokenizer(f);
    blade_model *m = blade_model_from_gguf(f, NULL);
    if (m) {
        exercise_forward(m);
        blade_model_free(m);
    }
    return 0;
}

/* Writes the seed corpora of fuzz_gguf, fuzz_template and fuzz_request (cmake
 * -DBLADE_FUZZ=ON): build-fuzz/fuzz_seeds GGUF_DIR TEMPLATE_DIR REQUEST_DIR, run from the
 * repository root (it reads ../shared). Tiny models of every weight type family and each
 * architecture, one with a byte-level BPE vocabulary cut down from GPT-2's; every chat
 * template of the shared cases; request bodies of each endpoint using every parameter, so
 * that each fuzzer starts from inputs that reach deep into the code. */

#include "blade/gguf.h"
#include "blade/synth.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BPE_TOKENS 600

static int fail(const char *what, const blade_error *err)
{
    fprintf(stderr, "fuzz_seeds: %s: %s\n", what, err ? err->msg : "failed");
    return 1;
}

static bool has_token(char *const *tokens, const char *text)
{
    for (int i = 0; i < BPE_TOKENS; i++)
        if (!strcmp(tokens[i], text))
            return true;
    return false;
}

/* GPT-2's first BPE_TOKENS tokens (its 256 byte tokens, then merges in order) and the
 * merges whose parts and result all remain. */
static int write_bpe_vocab(const char *path)
{
    blade_error err = {{0}};
    gguf_file *src = gguf_open_mapped("../shared/vocab/ggml-vocab-gpt-2.gguf", &err);
    if (!src)
        return fail("gpt-2 vocabulary", &err);
    const gguf_kv *tok = gguf_find_array(src, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, NULL, &err);
    const gguf_kv *mer = gguf_find_array(src, "tokenizer.ggml.merges", GGUF_TYPE_STRING, NULL, &err);
    if (!tok || !mer || tok->arr_len < BPE_TOKENS) {
        gguf_close(src);
        return fail("gpt-2 vocabulary arrays", &err);
    }
    char **merges = malloc(sizeof(char *) * mer->arr_len);
    if (!merges) {
        gguf_close(src);
        return fail("out of memory", NULL);
    }
    char *tokens[BPE_TOKENS];
    int32_t types[BPE_TOKENS];
    for (int i = 0; i < BPE_TOKENS; i++) {
        tokens[i] = strndup(tok->arr_strings[i].ptr, tok->arr_strings[i].len);
        types[i] = 1;
    }
    uint64_t n_merges = 0;
    for (uint64_t m = 0; m < mer->arr_len; m++) {
        char *s = strndup(mer->arr_strings[m].ptr, mer->arr_strings[m].len), *sp = strchr(s, ' ');
        bool keep = false;
        if (sp) {
            *sp = 0;
            char *joined = NULL;
            keep = asprintf(&joined, "%s%s", s, sp + 1) >= 0 && has_token(tokens, s) && has_token(tokens, sp + 1) &&
                   has_token(tokens, joined);
            free(joined);
            *sp = ' ';
        }
        if (keep)
            merges[n_merges++] = s;
        else
            free(s);
    }
    gguf_writer *w = gguf_writer_new();
    gguf_writer_set_string(w, "tokenizer.ggml.model", "gpt2");
    gguf_writer_set_string(w, "tokenizer.ggml.pre", "gpt-2");
    gguf_writer_set_string_array(w, "tokenizer.ggml.tokens", (const char *const *)tokens, BPE_TOKENS);
    gguf_writer_set_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, BPE_TOKENS);
    gguf_writer_set_string_array(w, "tokenizer.ggml.merges", (const char *const *)merges, n_merges);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", BPE_TOKENS - 1);
    gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", BPE_TOKENS - 1);
    int rc = gguf_writer_write(w, path, false, &err) ? fail(path, &err) : 0;
    gguf_writer_free(w);
    for (int i = 0; i < BPE_TOKENS; i++)
        free(tokens[i]);
    for (uint64_t m = 0; m < n_merges; m++)
        free(merges[m]);
    free(merges);
    gguf_close(src);
    return rc;
}

static int write_models(const char *dir)
{
    char bpe[4096], path[4096];
    snprintf(bpe, sizeof bpe, "%s/bpe-vocab.gguf", dir);
    if (write_bpe_vocab(bpe))
        return 1;
    struct {
        const char *name;
        blade_arch arch;
        uint32_t type;
        int32_t n_embd, n_ff;
        bool bpe, tied;
    } models[] = {
        {"llama-q8_0", BLADE_ARCH_LLAMA, BLADE_TYPE_Q8_0, 32, 64, false, false},
        {"llama-q4_0-tied", BLADE_ARCH_LLAMA, BLADE_TYPE_Q4_0, 32, 64, false, true},
        {"llama-f16", BLADE_ARCH_LLAMA, BLADE_TYPE_F16, 32, 48, false, false},
        {"llama-q4_k", BLADE_ARCH_LLAMA, BLADE_TYPE_Q4_K, 256, 256, false, false},
        {"qwen2-f32-bpe", BLADE_ARCH_QWEN2, BLADE_TYPE_F32, 32, 48, true, false},
        {"qwen3-bf16-bpe", BLADE_ARCH_QWEN3, BLADE_TYPE_BF16, 32, 48, true, false},
    };
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        blade_synth_spec s = {
            .arch = models[i].arch, .n_vocab = models[i].bpe ? BPE_TOKENS : 300, .n_embd = models[i].n_embd,
            .n_layer = 1, .n_head = 2, .n_head_kv = 1, .head_dim = 16, .n_ff = models[i].n_ff, .n_ctx = 64,
            .rope_base = 10000.0f, .tied_embeddings = models[i].tied, .scheme = {.type = models[i].type},
            .seed = i + 1, .vocab_path = models[i].bpe ? bpe : NULL,
        };
        blade_error err = {{0}};
        snprintf(path, sizeof path, "%s/%s.gguf", dir, models[i].name);
        if (blade_synth_write(&s, path, false, &err))
            return fail(path, &err);
    }
    return 0;
}

static int write_templates(const char *dir)
{
    json_error_t jerr;
    json_t *cases = json_load_file("../shared/chat-templates/cases.json", 0, &jerr);
    if (!json_is_array(cases)) {
        fprintf(stderr, "fuzz_seeds: ../shared/chat-templates/cases.json: %s\n", jerr.text);
        return 1;
    }
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        const char *t = json_string_value(json_object_get(c, "template"));
        char path[4096];
        snprintf(path, sizeof path, "%s/case-%03zu.jinja", dir, i);
        FILE *f = t ? fopen(path, "wb") : NULL;
        if (f) {
            fwrite(t, 1, strlen(t), f);
            fclose(f);
        }
    }
    json_decref(cases);
    return 0;
}

/* The first byte picks fuzz_request's endpoint: 0 completions, 1 chat, 2 embeddings. */
static const char *const requests[] = {
    "\x00{\"model\":\"fuzz\",\"prompt\":[\"Once upon\",\"a time\"],\"max_tokens\":8,\"n\":2,\"temperature\":0.7,"
    "\"top_p\":0.9,\"top_k\":5,\"min_p\":0.1,\"seed\":3,\"stop\":[\"\\n\",\"end\"],\"logprobs\":2,"
    "\"presence_penalty\":0.5,\"frequency_penalty\":0.2,\"repetition_penalty\":1.1,"
    "\"stream\":true,\"stream_options\":{\"include_usage\":true},\"speculative\":false,\"priority\":\"batch\","
    "\"ignore_eos\":true,\"cache_salt\":\"s\",\"user\":\"u\",\"best_of\":2}",
    "\x01{\"model\":\"fuzz\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
    "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hi\"}]},{\"role\":\"assistant\",\"content\":null,"
    "\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},"
    "{\"role\":\"tool\",\"tool_call_id\":\"c\",\"content\":\"1\"}],\"max_completion_tokens\":4,\"logprobs\":true,"
    "\"top_logprobs\":3,\"stop\":\"x\",\"n\":1,\"response_format\":{\"type\":\"text\"},\"semantic_cache\":true}",
    "\x02{\"model\":\"fuzz\",\"input\":[\"a\",\"b c\"],\"encoding_format\":\"base64\",\"dimensions\":4}",
    "\x02{\"input\":[[1,2],[3]]}",
    "\x00{\"prompt\":\"x\",\"echo\":true}",
    "\x00{\"prompt\":[[1,2,3],[4]],\"max_tokens\":1}",
};

static int write_requests(const char *dir)
{
    for (size_t i = 0; i < sizeof requests / sizeof requests[0]; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/request-%zu.json", dir, i);
        FILE *f = fopen(path, "wb");
        if (!f) {
            fprintf(stderr, "fuzz_seeds: cannot write %s\n", path);
            return 1;
        }
        /* the endpoint byte may be NUL, so not strlen of the whole */
        fwrite(requests[i], 1, 1 + strlen(requests[i] + 1), f);
        fclose(f);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: fuzz_seeds GGUF_DIR TEMPLATE_DIR REQUEST_DIR (from the repository root)\n");
        return 2;
    }
    return write_models(argv[1]) || write_templates(argv[2]) || write_requests(argv[3]);
}

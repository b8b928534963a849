#include "cli/commands.h"

#include <stdio.h>
#include <string.h>

typedef struct command {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *summary;
} command;

static const command commands[] = {
    {"run", cmd_run, "generate text from a prompt, streaming it as it is produced"},
    {"info", cmd_info, "describe a model: shapes, tensor types, parameters, KV cache arithmetic"},
    {"convert", cmd_convert, "import a llama2.c checkpoint into a GGUF file"},
    {"perplexity", cmd_perplexity, "measure perplexity on a text file (llama.cpp method)"},
    {"eval", cmd_eval, "what a quantization or KV type costs in quality: PPL, KL divergence, top-1"},
    {"tokenize", cmd_tokenize, "show how a model's tokenizer splits text"},
    {"quantize", cmd_quantize, "convert a GGUF model's weights to Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, ..."},
    {"imatrix", cmd_imatrix, "record activation importance from calibration text, for quantize --imatrix"},
    {"synth", cmd_synth, "write a random-weight GGUF of a real model's shape"},
    {"bench", cmd_bench, "measure prompt processing, generation and batched decode speed"},
    {"router", cmd_router, "the OpenAI front door of a cluster: cache- and load-aware routing to workers"},
    {"serve", cmd_serve, "serve the OpenAI API over HTTP (completions, chat, streaming, metrics)"},
    {"batch", cmd_batch, "run an OpenAI Batch API JSONL file through the engine"},
    {"template", cmd_template, "render a chat template for a conversation"},
};

static void usage(FILE *out)
{
    fprintf(out, "blade: LLM inference engine\n\nusage: blade SUBCOMMAND [options]\n\nsubcommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(out, "  %-12s %s\n", commands[i].name, commands[i].summary);
    fprintf(out, "\n`blade SUBCOMMAND --help` describes every flag of a subcommand.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name))
            return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "blade: unknown subcommand '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}

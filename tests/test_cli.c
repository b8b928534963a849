/* The command line of every subcommand, through the flag tables (src/cli/flags.h): command
 * lines parse into the values the commands read (the engine's and the load generator's
 * structs checked field by field), each kind refuses a bad value with a message naming the
 * flag, the value and what it accepts, `blade CMD --help` lists every flag of every table, and
 * the tables agree with each other: one meaning per short letter across all subcommands, each
 * destination's C type fits its kind and holds its whole range. */
#include "testutil.h"

#include "blade/kv_type.h"
#include "blade/quantize.h"
#include "blade/scheduler.h"
#include "cli/commands.h"
#include "cli/engine_options.h"
#include "cli/eval_options.h"
#include "cli/flags.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"

#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- parsing a command line in-process ---- */

typedef struct parsed {
    const cli_command *cmd;
    void *opts;
    int rc;
    char *out, *err; /* what the parser wrote: the help, the errors */
} parsed;

static const cli_command *command_named(const char *name)
{
    for (const cli_command *const *c = cli_commands; *c; c++)
        if (!strcmp((*c)->name, name))
            return *c;
    fail_msg("no command '%s'", name);
    return NULL;
}

/* argv[0] is the command's name ("bench engine"), as main hands it over. */
static parsed parse_argv(const char *name, const char **args)
{
    parsed p = {.cmd = command_named(name)};
    int argc = 1;
    while (args[argc - 1])
        argc++;
    char **argv = calloc((size_t)argc + 1, sizeof *argv);
    assert_non_null(argv);
    argv[0] = (char *)name;
    for (int i = 1; i < argc; i++)
        argv[i] = (char *)args[i - 1];
    p.opts = calloc(1, p.cmd->opts_size);
    size_t out_len, err_len;
    FILE *out = open_memstream(&p.out, &out_len), *err = open_memstream(&p.err, &err_len);
    assert_non_null(p.opts);
    assert_non_null(out);
    assert_non_null(err);
    p.rc = cli_parse_to(p.cmd, argc, argv, p.opts, out, err);
    fclose(out);
    fclose(err);
    free(argv);
    return p;
}

#define PARSE(name, ...) parse_argv(name, (const char *[]){__VA_ARGS__, NULL})
#define PARSE0(name) parse_argv(name, (const char *[]){NULL})

static void parsed_free(parsed *p)
{
    free(p->opts);
    free(p->out);
    free(p->err);
}

/* The flag called `name` in the command's tables and where its value lies in opts. */
static const cli_flag *find(const parsed *p, const char *name, void **dest)
{
    if (dest)
        *dest = NULL;
    for (const cli_table *t = p->cmd->tables; t->flags; t++)
        for (const cli_flag *f = t->flags; f->kind != CLI_END; f++)
            if (f->kind != CLI_HEADING && !strcmp(f->name, name)) {
                if (dest)
                    *dest = (char *)p->opts + t->base + f->off;
                return f;
            }
    fail_msg("%s has no flag --%s", p->cmd->name, name);
    return NULL;
}

static long long get_int(const parsed *p, const char *name)
{
    void *d = NULL;
    const cli_flag *f = find(p, name, &d);
    if (f->ctype == CLI_C_BOOL)
        return *(bool *)d;
    bool u = f->ctype == CLI_C_UNSIGNED;
    switch (f->size) {
    case 1: return u ? *(uint8_t *)d : *(int8_t *)d;
    case 2: return u ? *(uint16_t *)d : *(int16_t *)d;
    case 4: return u ? (long long)*(uint32_t *)d : *(int32_t *)d;
    default: {
        /* a struct-valued destination (e.g. bench's kv_types) may sit at a 4-byte offset */
        int64_t v;
        memcpy(&v, d, sizeof v);
        return v;
    }
    }
}

static double get_double(const parsed *p, const char *name)
{
    void *d = NULL;
    const cli_flag *f = find(p, name, &d);
    return f->ctype == CLI_C_FLOAT ? *(float *)d : *(double *)d;
}

static const char *get_str(const parsed *p, const char *name)
{
    void *d = NULL;
    find(p, name, &d);
    return *(const char **)d;
}

static bool get_bool(const parsed *p, const char *name)
{
    void *d = NULL;
    find(p, name, &d);
    return *(bool *)d;
}

static void *get_dest(const parsed *p, const char *name)
{
    void *d = NULL;
    find(p, name, &d);
    return d;
}

/* The positional argument called metavar. */
static const char *get_arg(const parsed *p, const char *metavar)
{
    for (const cli_positional *a = p->cmd->positionals; a && a->metavar; a++)
        if (!strcmp(a->metavar, metavar))
            return *(const char **)((char *)p->opts + a->off);
    fail_msg("%s has no argument %s", p->cmd->name, metavar);
    return NULL;
}

/* The struct a shared table describes, inside the command's options. */
static void *table_struct(const parsed *p, const cli_flag *table)
{
    for (const cli_table *t = p->cmd->tables; t->flags; t++)
        if (t->flags == table)
            return (char *)p->opts + t->base;
    fail_msg("%s does not include that table", p->cmd->name);
    return NULL;
}

static void assert_ok(const parsed *p)
{
    if (p->rc != CLI_RUN)
        fail_msg("blade %s: status %d, stderr:\n%s", p->cmd->name, p->rc, p->err);
    assert_string_equal(p->err, "");
}

/* A usage error: status 2, the message, and the usage line pointing at --help. */
static void assert_usage_error(const parsed *p, const char *message)
{
    if (p->rc != 2 || !strstr(p->err, message))
        fail_msg("blade %s: status %d, stderr:\n%s\nwanted status 2 and \"%s\"", p->cmd->name, p->rc, p->err,
                 message);
    char usage[256];
    snprintf(usage, sizeof usage, "\nusage: blade %s ", p->cmd->name);
    assert_non_null(strstr(p->err, usage));
    assert_non_null(strstr(p->err, "--help"));
    assert_string_equal(p->out, "");
}

#define EXPECT_ERROR(message, name, ...)                 \
    do {                                                 \
        parsed p_ = PARSE(name, __VA_ARGS__);            \
        assert_usage_error(&p_, message);                \
        parsed_free(&p_);                                \
    } while (0)

/* ---- each subcommand's command lines ---- */

static void test_run(void **state)
{
    (void)state;
    parsed p = PARSE("run", "-m", "m.gguf", "-p", "Once upon", "-n", "5", "--temp", "0.5", "--top-k", "3", "--top-p",
                     "0.9", "--min-p=0", "--repeat-penalty", "1.1", "--repeat-last-n", "-1", "--presence-penalty",
                     "-0.5", "--frequency-penalty", "2", "--seed", "9223372036854775807", "--ignore-eos",
                     "--parse-special", "--no-bos", "-t3", "-c", "64", "--kv-mem", "2G", "--kv-type", "BF16",
                     "--block-size", "32", "--max-batch-tokens", "128", "--max-seqs", "8", "--pin-prefix", "sys.txt",
                     "--batch-aging-steps", "0", "--scheduler", "static", "--no-prefix-cache",
                     "--no-chunked-prefill", "--kv-alloc", "contiguous");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "model"), "m.gguf");
    assert_string_equal(get_str(&p, "prompt"), "Once upon");
    assert_null(get_str(&p, "file"));
    assert_int_equal(get_int(&p, "n-predict"), 5);
    assert_true(get_double(&p, "temp") == 0.5f);
    assert_int_equal(get_int(&p, "top-k"), 3);
    assert_true(get_double(&p, "top-p") == 0.9f);
    assert_true(get_double(&p, "min-p") == 0.0f);
    assert_true(get_double(&p, "repeat-penalty") == 1.1f);
    assert_int_equal(get_int(&p, "repeat-last-n"), -1);
    assert_true(get_double(&p, "presence-penalty") == -0.5f);
    assert_true(get_double(&p, "frequency-penalty") == 2.0f);
    assert_true(*(uint64_t *)get_dest(&p, "seed") == INT64_MAX);
    assert_true(get_bool(&p, "ignore-eos") && get_bool(&p, "parse-special") && get_bool(&p, "no-bos"));
    /* the engine's own config, as blade_engine_new receives it */
    const cli_engine_options *e = table_struct(&p, cli_engine_flags);
    assert_int_equal(e->cfg.n_threads, 3);
    assert_int_equal(e->cfg.max_context, 64);
    assert_int_equal(e->kv_mem.bytes, (size_t)2 << 30);
    assert_true(e->kv_mem.fraction == 0);
    assert_int_equal(e->cfg.kv_type, BLADE_KV_BF16);
    assert_int_equal(e->cfg.block_size, 32);
    assert_int_equal(e->cfg.sched.max_batch_tokens, 128);
    assert_int_equal(e->cfg.sched.max_seqs, 8);
    assert_string_equal(e->pin_prefix_file, "sys.txt");
    assert_int_equal(e->cfg.sched.batch_aging_steps, 0);
    assert_int_equal(e->cfg.sched.mode, BLADE_SCHED_STATIC);
    assert_false(e->cfg.prefix_caching);
    assert_false(e->cfg.sched.chunked_prefill);
    assert_true(e->cfg.sched.contiguous_kv);
    parsed_free(&p);

    /* the defaults, as the help shows them */
    p = PARSE("run", "-f", "prompt.txt", "--kv-mem", "0.5");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "file"), "prompt.txt");
    assert_int_equal(get_int(&p, "n-predict"), 128);
    assert_true(get_double(&p, "temp") == 0.8f);
    assert_int_equal(get_int(&p, "top-k"), 40);
    e = table_struct(&p, cli_engine_flags);
    assert_true(e->kv_mem.fraction == 0.5);
    assert_int_equal(e->cfg.n_threads, 0);
    assert_int_equal(e->cfg.kv_type, BLADE_KV_F16);
    assert_int_equal(e->cfg.sched.mode, BLADE_SCHED_CONTINUOUS);
    assert_true(e->cfg.prefix_caching && e->cfg.sched.chunked_prefill && !e->cfg.sched.contiguous_kv);
    parsed_free(&p);

    /* a value that starts with '-' is a value; the last of a repeated flag wins */
    p = PARSE("run", "-p", "-- not a flag", "-n", "1", "-n", "2", "--kv-mem", "1.5GiB");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "prompt"), "-- not a flag");
    assert_int_equal(get_int(&p, "n-predict"), 2);
    e = table_struct(&p, cli_engine_flags);
    assert_int_equal(e->kv_mem.bytes, (size_t)3 << 29);
    parsed_free(&p);
}

static void test_serve_and_batch(void **state)
{
    (void)state;
    parsed p = PARSE("serve", "-m", "m.gguf", "--host", "::1", "--port", "0", "--api-key", "k", "--alias", "tiny",
                     "--chat-template", "t.jinja", "--max-body", "512K", "--max-queue", "4", "--timeout", "0",
                     "--drain-timeout", "2.5", "--max-connections", "16", "--max-connections-per-ip", "0",
                     "--limit-loopback", "--idle-timeout", "3", "--header-timeout", "0.05", "--body-timeout", "7",
                     "-t", "2");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "host"), "::1");
    assert_int_equal(get_int(&p, "port"), 0);
    assert_string_equal(get_str(&p, "api-key"), "k");
    assert_string_equal(get_str(&p, "alias"), "tiny");
    assert_string_equal(get_str(&p, "chat-template"), "t.jinja");
    assert_int_equal(*(size_t *)get_dest(&p, "max-body"), 512 * 1024);
    assert_int_equal(get_int(&p, "max-queue"), 4);
    assert_true(get_double(&p, "timeout") == 0 && get_double(&p, "drain-timeout") == 2.5);
    assert_int_equal(get_int(&p, "max-connections"), 16);
    assert_int_equal(get_int(&p, "max-connections-per-ip"), 0);
    assert_true(get_bool(&p, "limit-loopback"));
    assert_int_equal(get_int(&p, "idle-timeout"), 3);
    assert_true(get_double(&p, "header-timeout") == 0.05 && get_double(&p, "body-timeout") == 7);
    assert_int_equal(((cli_engine_options *)table_struct(&p, cli_engine_flags))->cfg.n_threads, 2);
    parsed_free(&p);

    p = PARSE0("serve");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "host"), "127.0.0.1");
    assert_int_equal(get_int(&p, "port"), 8080);
    assert_null(get_str(&p, "api-key")); /* the environment's key is read later: --help must not show it */
    assert_int_equal(*(size_t *)get_dest(&p, "max-body"), 8 << 20);
    parsed_free(&p);

    p = PARSE("batch", "-i", "in.jsonl", "--output=out.jsonl", "--max-inflight", "8", "-c", "256");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "input"), "in.jsonl");
    assert_string_equal(get_str(&p, "output"), "out.jsonl");
    assert_int_equal(get_int(&p, "max-inflight"), 8);
    assert_int_equal(((cli_engine_options *)table_struct(&p, cli_engine_flags))->cfg.max_context, 256);
    parsed_free(&p);
    EXPECT_ERROR("--output FILE is required", "batch", "-i", "in.jsonl");
    EXPECT_ERROR("--input FILE and --output FILE are required", "batch", "-m", "m.gguf");
}

static void test_bench(void **state)
{
    (void)state;
    parsed p = PARSE("bench", "-m", "m.gguf", "--n-prompt", "0", "-n", "16", "-b", "1,0,32", "-r", "2", "-t", "1",
                     "--kv-type", "f32", "--json");
    assert_ok(&p);
    assert_int_equal(get_int(&p, "n-prompt"), 0);
    assert_int_equal(get_int(&p, "n-predict"), 16);
    assert_int_equal(get_int(&p, "repetitions"), 2);
    assert_int_equal(get_int(&p, "threads"), 1);
    assert_int_equal(get_int(&p, "kv-type"), BLADE_KV_F32);
    assert_true(get_bool(&p, "json"));
    /* --batches: the sizes, 0s dropped, then their count (cmd_bench.c's struct batch_sizes) */
    const int32_t *sizes = get_dest(&p, "batches");
    assert_int_equal(sizes[0], 1);
    assert_int_equal(sizes[1], 32);
    assert_int_equal(*(const int *)(sizes + 16), 2);
    parsed_free(&p);
    p = PARSE("bench", "-m", "m.gguf");
    assert_ok(&p);
    sizes = get_dest(&p, "batches");
    assert_int_equal(*(const int *)(sizes + 16), 4);
    assert_int_equal(sizes[3], 16);
    assert_int_equal(get_int(&p, "n-prompt"), 512);
    parsed_free(&p);
    EXPECT_ERROR("--batches expects a comma-separated list of at most 16 batch sizes in [0, 256], got '1,300'", "bench",
                 "-m", "m", "-b", "1,300");
    EXPECT_ERROR("got '1,,2'", "bench", "-m", "m", "-b", "1,,2");
    EXPECT_ERROR("at most 16 batch sizes in [0, 256], got '1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17'", "bench", "-m", "m", "-b",
                 "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17");
    /* -p is the prompt text wherever it exists; bench's prompt length is --n-prompt */
    EXPECT_ERROR("unknown flag '-p'", "bench", "-m", "m", "-p", "512");

    p = PARSE("bench engine", "-m", "m.gguf", "-w", "shared-prefix", "--seed", "3", "--max-seqs", "2");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "model"), "m.gguf");
    assert_int_equal(get_int(&p, "seed"), 3);
    assert_int_equal(((cli_engine_options *)table_struct(&p, cli_engine_flags))->cfg.sched.max_seqs, 2);
    void *d = NULL;
    const cli_flag *f = find(&p, "workload", &d);
    cli_choice c;
    assert_true(cli_choice_get(f, (int)get_int(&p, "workload"), &c));
    assert_string_equal(c.name, "shared-prefix");
    parsed_free(&p);
    EXPECT_ERROR("--workload expects mixed, shared-prefix or interference, got 'bursty'", "bench engine", "-m", "m",
                 "-w", "bursty");
    EXPECT_ERROR("--workload W is required", "bench engine", "-m", "m");
}

static void test_bench_serve_and_ablation(void **state)
{
    (void)state;
    parsed p = PARSE("bench serve", "--url", "http://127.0.0.1:1", "--model", "tiny", "--tokenizer", "v.gguf",
                     "--report", "r.html", "--workload", "multi-turn", "--seed", "5", "--input-len", "8:16",
                     "--output-len", "4", "--text", "t.txt", "--turns", "3", "--num-requests", "12",
                     "--request-rate", "inf", "--burstiness", "0.5", "--max-concurrency", "2", "--timeout", "30",
                     "--no-warmup", "--prompt-format", "text", "--ignore-eos", "--api-key", "k", "--slo",
                     "ttft=100,tpot=20", "--price-per-hour", "2.5", "--json", "r.json");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "url"), "http://127.0.0.1:1");
    assert_string_equal(get_str(&p, "model"), "tiny");
    assert_string_equal(get_str(&p, "tokenizer"), "v.gguf");
    assert_string_equal(get_str(&p, "report"), "r.html");
    assert_int_equal(get_int(&p, "workload"), LG_WORKLOAD_MULTI_TURN);
    assert_int_equal(get_int(&p, "seed"), 5);
    const lg_range *in = get_dest(&p, "input-len"), *out = get_dest(&p, "output-len");
    assert_int_equal(in->lo, 8);
    assert_int_equal(in->hi, 16);
    assert_int_equal(out->lo, 4);
    assert_int_equal(out->hi, 4);
    assert_string_equal(get_str(&p, "text"), "t.txt");
    assert_int_equal(get_int(&p, "turns"), 3);
    assert_int_equal(get_int(&p, "num-requests"), 12);
    assert_true(isinf(get_double(&p, "request-rate")));
    assert_true(get_double(&p, "burstiness") == 0.5);
    assert_int_equal(get_int(&p, "max-concurrency"), 2);
    assert_true(get_double(&p, "timeout") == 30);
    assert_false(get_int(&p, "no-warmup")); /* --no-warmup clears warmup */
    assert_int_equal(get_int(&p, "prompt-format"), 1);
    assert_true(get_bool(&p, "ignore-eos"));
    assert_string_equal(get_str(&p, "api-key"), "k");
    const lg_slo *slo = get_dest(&p, "slo");
    assert_true(slo->ttft_ms == 100 && slo->tpot_ms == 20 && slo->e2e_ms == 0);
    assert_true(get_double(&p, "price-per-hour") == 2.5);
    assert_string_equal(get_str(&p, "json"), "r.json");
    parsed_free(&p);

    p = PARSE("bench serve", "--url", "u", "-w", "random", "--request-rate", "2.5");
    assert_ok(&p);
    assert_true(get_double(&p, "request-rate") == 2.5);
    assert_true(get_int(&p, "no-warmup")); /* warm-up on by default */
    assert_false(get_bool(&p, "ignore-eos"));
    parsed_free(&p);
    EXPECT_ERROR("--url URL is required", "bench serve", "-w", "random");
    EXPECT_ERROR("--input-len expects N or A:B with 1 <= A <= B", "bench serve", "--url", "u", "-w", "random",
                 "--input-len", "9:3");
    EXPECT_ERROR("--slo expects ttft=MS,tpot=MS[,e2e=MS], got 'latency=5'", "bench serve", "--url", "u", "-w",
                 "random", "--slo", "latency=5");

    /* The ablation checks the engine flags and passes them on; it varies the baseline modes. */
    p = PARSE("bench ablation", "-m", "m.gguf", "-w", "shared-prefix", "-t", "2", "--kv-mem", "1G");
    assert_ok(&p);
    assert_true(get_bool(&p, "ignore-eos")); /* every configuration generates the same tokens */
    assert_int_equal(((cli_engine_options *)table_struct(&p, cli_engine_flags))->cfg.n_threads, 2);
    parsed_free(&p);
    p = PARSE("bench ablation", "-w", "random", "--scheduler", "static");
    assert_int_equal(p.rc, 2);
    assert_non_null(strstr(p.err, "--scheduler is what the ablation varies"));
    parsed_free(&p);
    p = PARSE("bench ablation", "-w", "random", "--no-prefix-cache");
    assert_int_equal(p.rc, 2);
    assert_non_null(strstr(p.err, "--no-prefix-cache is what the ablation varies"));
    parsed_free(&p);
    EXPECT_ERROR("--threads expects an integer in [1, 1024], got '0'", "bench ablation", "-w", "random", "-t", "0");

    p = PARSE("bench compare", "base.json", "--max-regression", "2.5%", "new.json");
    assert_ok(&p);
    assert_string_equal(get_arg(&p, "BASE.json"), "base.json");
    assert_string_equal(get_arg(&p, "NEW.json"), "new.json");
    assert_true(get_double(&p, "max-regression") == 2.5);
    parsed_free(&p);
    p = PARSE("bench compare", "a", "b");
    assert_ok(&p);
    assert_true(get_double(&p, "max-regression") == 5);
    parsed_free(&p);
    EXPECT_ERROR("NEW.json is missing", "bench compare", "a");
    EXPECT_ERROR("unexpected argument 'c'", "bench compare", "a", "b", "c");
    EXPECT_ERROR("--max-regression expects a percentage", "bench compare", "a", "b", "--max-regression", "5%%");
}

static void test_model_tools(void **state)
{
    (void)state;
    parsed p = PARSE("convert", "stories.bin", "--tokenizer", "tok.bin", "-o", "out.gguf", "--name", "tiny");
    assert_ok(&p);
    assert_string_equal(get_arg(&p, "CHECKPOINT.bin"), "stories.bin");
    assert_string_equal(get_str(&p, "tokenizer"), "tok.bin");
    assert_string_equal(get_str(&p, "output"), "out.gguf");
    assert_string_equal(get_str(&p, "name"), "tiny");
    parsed_free(&p);
    /* -t is --threads everywhere: convert's tokenizer has only its long name */
    EXPECT_ERROR("unknown flag '-t'", "convert", "stories.bin", "-t", "tok.bin", "-o", "out.gguf");
    EXPECT_ERROR("CHECKPOINT.bin is missing", "convert", "--tokenizer", "tok.bin", "-o", "out.gguf");

    p = PARSE("quantize", "in.gguf", "--type", "q4_k_m", "out.gguf", "--keep", "output.weight=Q8_0", "--keep",
              "blk.*.attn_v.weight=Q6_K", "-t", "2", "--no-refine");
    assert_ok(&p);
    assert_string_equal(get_arg(&p, "IN.gguf"), "in.gguf");
    assert_string_equal(get_arg(&p, "OUT.gguf"), "out.gguf");
    const blade_quant_scheme *const *scheme = get_dest(&p, "type");
    assert_ptr_equal(*scheme, blade_quant_scheme_find("Q4_K_M"));
    const cli_list *keeps = get_dest(&p, "keep");
    assert_int_equal(keeps->n, 2);
    assert_string_equal(keeps->items[1], "blk.*.attn_v.weight=Q6_K");
    assert_int_equal(get_int(&p, "threads"), 2);
    assert_true(get_bool(&p, "no-refine"));
    parsed_free(&p);
    EXPECT_ERROR("unknown --type 'Q3_K' (blade writes Q8_0", "quantize", "a", "b", "--type", "Q3_K");
    EXPECT_ERROR("--type TYPE is required", "quantize", "a", "b");

    p = PARSE("synth", "--shape", "tinyllama-1.1b", "--type", "Q8_0", "-o", "t.gguf", "--vocab", "v.gguf", "--seed",
              "9");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "shape"), "tinyllama-1.1b");
    assert_ptr_equal(*(const blade_quant_scheme **)get_dest(&p, "type"), blade_quant_scheme_find("Q8_0"));
    assert_string_equal(get_str(&p, "output"), "t.gguf");
    assert_string_equal(get_str(&p, "vocab"), "v.gguf");
    assert_int_equal(get_int(&p, "seed"), 9);
    parsed_free(&p);

    p = PARSE("info", "m.gguf", "--tensors");
    assert_ok(&p);
    assert_string_equal(get_arg(&p, "MODEL"), "m.gguf");
    assert_null(get_str(&p, "model"));
    assert_true(get_bool(&p, "tensors"));
    parsed_free(&p);
    p = PARSE("info", "-m", "m.gguf");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "model"), "m.gguf");
    assert_null(get_arg(&p, "MODEL"));
    parsed_free(&p);

    p = PARSE("tokenize", "-m", "v.gguf", "-p", "hi there", "--ids", "--no-bos", "--parse-special");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "model"), "v.gguf");
    assert_string_equal(get_str(&p, "prompt"), "hi there");
    assert_true(get_bool(&p, "ids") && get_bool(&p, "no-bos") && get_bool(&p, "parse-special"));
    parsed_free(&p);

    /* bundled switches, the last letter taking a value; an empty BOS text is a value */
    p = PARSE("template", "--template", "t.jinja", "-gjmsgs.json", "--bos-token", "", "--eos-token=</s>");
    assert_ok(&p);
    assert_string_equal(get_str(&p, "template"), "t.jinja");
    assert_string_equal(get_str(&p, "messages"), "msgs.json");
    assert_true(get_bool(&p, "add-generation-prompt"));
    assert_string_equal(get_str(&p, "bos-token"), "");
    assert_string_equal(get_str(&p, "eos-token"), "</s>");
    parsed_free(&p);
    EXPECT_ERROR("unknown flag '-t'", "template", "-t", "t.jinja", "-j", "m.json");
}

static void test_eval_commands(void **state)
{
    (void)state;
    parsed p = PARSE("eval", "-m", "base.gguf", "--candidate", "q8.gguf", "-f", "text.txt", "-c", "128", "--chunks",
                     "2", "--kv-type", "F32", "--batch-tokens", "64", "-t", "1", "--json", "--gate", "kld<=0.1");
    assert_ok(&p);
    const cli_eval_args *a = table_struct(&p, cli_eval_flags);
    assert_string_equal(a->model_path, "base.gguf");
    assert_string_equal(a->text_path, "text.txt");
    assert_int_equal(a->cfg.n_ctx, 128);
    assert_int_equal(a->cfg.max_chunks, 2);
    assert_int_equal(a->cfg.kv_type, BLADE_KV_F32);
    assert_int_equal(a->cfg.batch_tokens, 64);
    assert_int_equal(a->cfg.n_threads, 1);
    assert_string_equal(get_str(&p, "candidate"), "q8.gguf");
    assert_true(get_bool(&p, "json"));
    assert_string_equal(get_str(&p, "gate"), "kld<=0.1");
    parsed_free(&p);
    EXPECT_ERROR("--candidate FILE is required", "eval", "-m", "b", "-f", "t");
    EXPECT_ERROR("--ctx-size expects an integer in [4, 1048576], got '3'", "eval", "-m", "b", "--candidate", "c",
                 "-f", "t", "-c", "3");

    p = PARSE("perplexity", "-f", "text.txt", "-m", "m.gguf");
    assert_ok(&p);
    a = p.opts;
    assert_string_equal(a->text_path, "text.txt");
    assert_int_equal(a->cfg.n_ctx, 512);
    assert_int_equal(a->cfg.max_chunks, 0);
    parsed_free(&p);
    EXPECT_ERROR("--file FILE is required", "perplexity", "-m", "m.gguf");
}

/* ---- what each kind refuses ---- */

static void test_errors(void **state)
{
    (void)state;
    /* integers: out of range, not a number, trailing junk, overflow */
    EXPECT_ERROR("--n-predict expects an integer in [0, 16777216], got '-5'", "run", "-p", "x", "-n", "-5");
    EXPECT_ERROR("--top-k expects an integer in [0, 1073741824], got '3x'", "run", "-p", "x", "--top-k", "3x");
    EXPECT_ERROR("--seed expects an integer in [0, 9223372036854775807], got '9223372036854775808'", "run", "-p",
                 "x", "--seed", "9223372036854775808");
    EXPECT_ERROR("--port expects an integer in [0, 65535], got ''", "serve", "--port", "");
    /* numbers: range, junk, NaN and infinities where no infinity is meant */
    EXPECT_ERROR("--top-p expects a number in [0, 1], got '1.5'", "run", "-p", "x", "--top-p", "1.5");
    EXPECT_ERROR("--temp expects a number in [0, 100], got 'warm'", "run", "-p", "x", "--temp", "warm");
    EXPECT_ERROR("--temp expects a number in [0, 100], got 'nan'", "run", "-p", "x", "--temp", "nan");
    EXPECT_ERROR("--temp expects a number in [0, 100], got 'inf'", "run", "-p", "x", "--temp", "inf");
    EXPECT_ERROR("--request-rate expects a number in [1e-06, inf], got '-inf'", "bench serve", "--url", "u", "-w",
                 "random", "--request-rate", "-inf");
    /* sizes: over the range, an unknown unit, zero, a fraction where none is meant */
    EXPECT_ERROR("--max-body expects a size from 1 to 1G bytes (e.g. 512M or 2G), got '2G'", "serve", "--max-body",
                 "2G");
    EXPECT_ERROR("--max-body expects a size", "serve", "--max-body", "8X");
    EXPECT_ERROR("--max-body expects a size", "serve", "--max-body", "8MB!");
    EXPECT_ERROR("--max-body expects a size", "serve", "--max-body", "0.5");
    EXPECT_ERROR("--kv-mem expects a size from 1 to 1P bytes (e.g. 512M or 2G) or a fraction in (0, 1), got '0'",
                 "serve", "--kv-mem", "0");
    EXPECT_ERROR("--kv-mem expects a size", "serve", "--kv-mem", "-1G");
    EXPECT_ERROR("--kv-mem expects a size", "serve", "--kv-mem", "2P5");
    /* enums: every name listed */
    EXPECT_ERROR("--kv-type expects f16, f32, bf16, q8_0 or fp8, got 'f12'", "serve", "--kv-type", "f12");
    EXPECT_ERROR("--scheduler expects continuous or static, got 'fifo'", "batch", "-i", "i", "-o", "o",
                 "--scheduler", "fifo");
    /* strings and paths are not empty unless the flag says so */
    EXPECT_ERROR("--api-key is empty", "serve", "--api-key", "");
    EXPECT_ERROR("--model is empty", "run", "-p", "x", "-m", "");
    /* lists hold CLI_LIST_MAX values */
    const char *args[CLI_LIST_MAX * 2 + 8];
    int n = 0;
    args[n++] = "a";
    args[n++] = "b";
    args[n++] = "--type";
    args[n++] = "Q8_0";
    for (int i = 0; i <= CLI_LIST_MAX; i++) {
        args[n++] = "--keep";
        args[n++] = "x=Q8_0";
    }
    args[n] = NULL;
    parsed p = parse_argv("quantize", args);
    assert_usage_error(&p, "--keep is given more than 64 times");
    parsed_free(&p);

    /* the shape of the command line */
    EXPECT_ERROR("unknown flag '--bogus'", "run", "--bogus");
    EXPECT_ERROR("unknown flag '--temperature'", "run", "--temperature=0");
    EXPECT_ERROR("unknown flag '--tem'", "run", "--tem", "0"); /* no abbreviations: a new flag breaks none */
    EXPECT_ERROR("unknown flag '-z'", "tokenize", "-m", "v", "-z");
    EXPECT_ERROR("--temp needs a value (T)", "run", "-p", "x", "--temp");
    EXPECT_ERROR("-n needs a value (N)", "run", "-p", "x", "-n");
    EXPECT_ERROR("--ignore-eos takes no value, got '1'", "run", "-p", "x", "--ignore-eos=1");
    EXPECT_ERROR("unexpected argument 'extra'", "run", "-p", "x", "extra");
    EXPECT_ERROR("--model FILE is required", "tokenize", "-p", "x");

    /* after "--" everything is an argument */
    p = PARSE("bench compare", "--", "--base.json", "-new.json");
    assert_ok(&p);
    assert_string_equal(get_arg(&p, "BASE.json"), "--base.json");
    assert_string_equal(get_arg(&p, "NEW.json"), "-new.json");
    parsed_free(&p);

    /* --help wins wherever it stands, even after a bad value */
    p = PARSE("run", "--temp", "hot", "--help");
    assert_int_equal(p.rc, 0);
    assert_string_equal(p.err, "");
    assert_non_null(strstr(p.out, "usage: blade run "));
    parsed_free(&p);
    p = PARSE("template", "-gh");
    assert_int_equal(p.rc, 0);
    parsed_free(&p);
}

/* ---- the help, and the tables against each other ---- */

static char *usage_of(const cli_command *c)
{
    char *text = NULL;
    size_t len;
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    cli_usage(c, f);
    fclose(f);
    return text;
}

/* `blade CMD --help` is the table's help, and it names every flag and argument. */
static void test_help_lists_every_flag(void **state)
{
    (void)state;
    int n_commands = 0;
    for (const cli_command *const *c = cli_commands; *c; c++, n_commands++) {
        const cli_command *cmd = *c;
        char *help = usage_of(cmd), args[128], *binary = NULL;
        char head[128];
        snprintf(head, sizeof head, "usage: blade %s %s\n", cmd->name, cmd->synopsis);
        assert_true(!strncmp(help, head, strlen(head)));
        assert_non_null(strstr(help, "  -h, --help "));
        for (const cli_table *t = cmd->tables; t->flags; t++)
            for (const cli_flag *f = t->flags; f->kind != CLI_END; f++) {
                char want[128];
                if (f->kind == CLI_HEADING)
                    snprintf(want, sizeof want, "\n%s:\n", f->help);
                else if (f->letter)
                    snprintf(want, sizeof want, "  -%c, --%s", f->letter, f->name);
                else
                    snprintf(want, sizeof want, "      --%s", f->name);
                if (!strstr(help, want))
                    fail_msg("blade %s --help lacks \"%s\":\n%s", cmd->name, want, help);
            }
        for (const cli_positional *a = cmd->positionals; a && a->metavar; a++) {
            char want[128];
            snprintf(want, sizeof want, "\n  %s ", a->metavar);
            assert_non_null(strstr(help, want));
        }
        /* no line past the width, but for a word too long to wrap */
        for (const char *line = help; *line;) {
            size_t len = strcspn(line, "\n");
            if (len > 100 && memchr(line, ' ', len))
                fail_msg("blade %s --help: a line of %zu characters: %.*s", cmd->name, len, (int)len, line);
            line += len + (line[len] == '\n');
        }
        snprintf(args, sizeof args, "%s --help", cmd->name);
        assert_int_equal(run_blade(args, &binary, 0), 0);
        assert_string_equal(binary, help);
        free(binary);
        free(help);
    }
    assert_int_equal(n_commands, 21);

    /* `blade --help` lists every subcommand */
    char *top = NULL;
    assert_int_equal(run_blade("--help", &top, 0), 0);
    for (const cli_command *const *c = cli_commands; *c; c++) {
        char want[64];
        snprintf(want, sizeof want, "\n  %s ", (*c)->name);
        assert_non_null(strstr(top, want));
    }
    free(top);
}

static bool kind_fits(const cli_flag *f)
{
    switch (f->kind) {
    case CLI_BOOL: return f->ctype == CLI_C_BOOL;
    case CLI_INT: return f->ctype == CLI_C_SIGNED || f->ctype == CLI_C_UNSIGNED;
    case CLI_DOUBLE: return f->ctype == CLI_C_FLOAT || f->ctype == CLI_C_DOUBLE;
    case CLI_SIZE: return f->ctype == CLI_C_UNSIGNED && f->size == sizeof(size_t);
    case CLI_SIZE_OR_FRACTION: return f->ctype == CLI_C_SIZE;
    case CLI_STRING:
    case CLI_PATH: return f->ctype == CLI_C_STRING;
    case CLI_ENUM: return f->ctype == CLI_C_SIGNED || f->ctype == CLI_C_UNSIGNED || f->ctype == CLI_C_BOOL;
    case CLI_LIST: return f->ctype == CLI_C_LIST;
    case CLI_CUSTOM: return f->parse != NULL;
    default: return false;
    }
}

/* The largest and smallest value an integer destination holds. */
static void int_limits(const cli_flag *f, double *lo, double *hi)
{
    double bits = 8.0 * (double)f->size;
    if (f->ctype == CLI_C_BOOL) {
        *lo = 0;
        *hi = 1;
    } else if (f->ctype == CLI_C_UNSIGNED) {
        *lo = 0;
        *hi = ldexp(1, (int)bits) - 1;
    } else {
        *lo = -ldexp(1, (int)bits - 1);
        *hi = ldexp(1, (int)bits - 1) - 1;
    }
}

static void check_flag(const cli_command *cmd, const cli_table *t, const cli_flag *f, const void *defaults)
{
    const char *c = cmd->name, *n = f->name;
    if (!n || !*n || !f->help || !*f->help)
        fail_msg("%s: a flag without a name or help", c);
    for (const char *p = n; *p; p++)
        if (!islower((unsigned char)*p) && !isdigit((unsigned char)*p) && *p != '-')
            fail_msg("%s --%s: long names are lower-case words joined by '-'", c, n);
    if (f->letter && (!isalnum((unsigned char)f->letter) || f->letter == 'h'))
        fail_msg("%s --%s: -%c cannot be a short form (-h is --help)", c, n, f->letter);
    if (!kind_fits(f))
        fail_msg("%s --%s: the destination's C type does not fit the kind", c, n);
    if (t->base + f->off + f->size > cmd->opts_size)
        fail_msg("%s --%s: the destination lies outside the options", c, n);
    if (cli_flag_takes_value(f) && f->kind != CLI_ENUM && !f->metavar)
        fail_msg("%s --%s: a flag with a value names it in the help (.metavar)", c, n);
    if (f->kind == CLI_INT || f->kind == CLI_DOUBLE || f->kind == CLI_SIZE || f->kind == CLI_SIZE_OR_FRACTION) {
        if (!(f->min < f->max))
            fail_msg("%s --%s: an empty range [%g, %g]", c, n, f->min, f->max);
    }
    if (f->kind == CLI_INT) {
        double lo, hi;
        int_limits(f, &lo, &hi);
        if (f->min != floor(f->min) || f->max != floor(f->max) || f->min < lo || f->max > hi)
            fail_msg("%s --%s: [%g, %g] does not fit a %zu-byte integer", c, n, f->min, f->max, f->size);
    }
    if (f->kind == CLI_ENUM) {
        cli_choice ch;
        int count = 0;
        bool default_named = f->required || f->dflt;
        long long v;
        const void *d = (const char *)defaults + t->base + f->off;
        if (f->ctype == CLI_C_BOOL)
            v = *(const bool *)d;
        else
            v = f->size == 1 ? *(const int8_t *)d : f->size == 2 ? *(const int16_t *)d : *(const int32_t *)d;
        for (; cli_choice_get(f, count, &ch); count++)
            default_named |= ch.value == v;
        if (count < 2 || !default_named)
            fail_msg("%s --%s: an enum needs choices, and its default among them", c, n);
    }
}

/* One meaning per letter across every subcommand, and per name within one; each destination
 * fits its kind and no two flags of a command write the same bytes. */
static void test_tables_agree(void **state)
{
    (void)state;
    const char *meaning[128] = {0};
    const char *where[128] = {0};
    int n_flags = 0;
    for (const cli_command *const *cp = cli_commands; *cp; cp++) {
        const cli_command *cmd = *cp;
        void *defaults = calloc(1, cmd->opts_size);
        assert_non_null(defaults);
        if (cmd->init)
            cmd->init(defaults);
        unsigned char *owner = calloc(cmd->opts_size, 1); /* which bytes a flag writes */
        assert_non_null(owner);
        const char *names[256];
        int n_names = 0;
        for (const cli_table *t = cmd->tables; t->flags; t++)
            for (const cli_flag *f = t->flags; f->kind != CLI_END; f++) {
                if (f->kind == CLI_HEADING) {
                    assert_non_null(f->help);
                    continue;
                }
                check_flag(cmd, t, f, defaults);
                n_flags++;
                for (int i = 0; i < n_names; i++)
                    if (!strcmp(names[i], f->name))
                        fail_msg("%s: --%s is declared twice", cmd->name, f->name);
                assert_true(n_names < 256);
                names[n_names++] = f->name;
                for (size_t b = t->base + f->off; b < t->base + f->off + f->size; b++) {
                    if (owner[b])
                        fail_msg("%s: --%s writes over another flag's value", cmd->name, f->name);
                    owner[b] = 1;
                }
                unsigned char l = (unsigned char)f->letter;
                if (!l)
                    continue;
                if (meaning[l] && strcmp(meaning[l], f->name))
                    fail_msg("-%c is --%s in blade %s but --%s in blade %s", l, meaning[l], where[l], f->name,
                             cmd->name);
                meaning[l] = f->name;
                where[l] = cmd->name;
            }
        for (const cli_positional *a = cmd->positionals; a && a->metavar; a++) {
            assert_true(a->off + sizeof(char *) <= cmd->opts_size);
            for (size_t b = a->off; b < a->off + sizeof(char *); b++) {
                if (owner[b])
                    fail_msg("%s: %s shares its place with a flag", cmd->name, a->metavar);
                owner[b] = 1;
            }
        }
        free(owner);
        free(defaults);
    }
    assert_true(n_flags > 150);
    /* the letters that meant two things before the table */
    assert_string_equal(meaning['t'], "threads");
    assert_string_equal(meaning['p'], "prompt");
    assert_string_equal(meaning['n'], "n-predict");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_run),
        cmocka_unit_test(test_serve_and_batch),
        cmocka_unit_test(test_bench),
        cmocka_unit_test(test_bench_serve_and_ablation),
        cmocka_unit_test(test_model_tools),
        cmocka_unit_test(test_eval_commands),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_help_lists_every_flag),
        cmocka_unit_test(test_tables_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

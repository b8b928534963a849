/* Every file blade reads from a path the user gives (models, prompts, chat templates,
 * messages, batch requests, pin-prefix files, llama2.c checkpoints, datasets) must be a
 * regular file: a named pipe is refused at once with an error saying so, never waited on
 * (opening a FIFO for reading blocks until a writer comes, which none will). Each command
 * runs under a time limit, so a regression fails the test instead of hanging it. */
#include "testutil.h"

#include "blade/gguf.h"
#include "common/file.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A generous bound: every case finishes in well under a second when it does not block. */
#define LIMIT_S 30

static char *make_fifo(const char *name)
{
    char *path = temp_path(name);
    unlink(path);
    assert_int_equal(mkfifo(path, 0600), 0);
    return path;
}

/* The library's readers, in this process: an alarm ends a regression that blocks. */
static void test_readers_refuse_fifo(void **state)
{
    (void)state;
    char *fifo = make_fifo("reader.fifo");
    alarm(LIMIT_S);
    blade_error err = {{0}};
    assert_int_equal(blade_open_regular(fifo, &err), -1);
    assert_non_null(strstr(err.msg, "is a named pipe (FIFO), not a regular file"));
    assert_non_null(strstr(err.msg, fifo));
    size_t len;
    err.msg[0] = 0;
    assert_null(blade_read_file(fifo, &len, &err));
    assert_non_null(strstr(err.msg, "named pipe"));
    err.msg[0] = 0;
    assert_null(blade_read_json(fifo, &err));
    assert_non_null(strstr(err.msg, "named pipe"));
    err.msg[0] = 0;
    assert_null(gguf_open(fifo, &err));
    assert_non_null(strstr(err.msg, "named pipe"));
    alarm(0);

    char *dir = temp_path("");
    assert_null(blade_read_file(dir, &len, &err));
    assert_non_null(strstr(err.msg, "is a directory, not a regular file"));
    char *json = temp_path("reader.json");
    assert_int_equal(write_file(json, "[1, 2]", 6), 0);
    json_t *doc = blade_read_json(json, &err);
    assert_int_equal(json_array_size(doc), 2);
    json_decref(doc);
    assert_int_equal(write_file(json, "[1, 2", 5), 0);
    assert_null(blade_read_json(json, &err));
    assert_non_null(strstr(err.msg, "reader.json:1:"));
    free(json);
    free(dir);
    unlink(fifo);
    free(fifo);
}

/* Replaces each {name} in fmt by its value. */
static void expand(char *out, size_t cap, const char *fmt, const char *const names[], const char *const values[],
                   size_t n)
{
    size_t o = 0;
    while (*fmt && o + 1 < cap) {
        size_t i = 0;
        for (; i < n; i++)
            if (!strncmp(fmt, names[i], strlen(names[i])))
                break;
        if (i < n) {
            o += (size_t)snprintf(out + o, cap - o, "'%s'", values[i]);
            fmt += strlen(names[i]);
        } else {
            out[o++] = *fmt++;
        }
    }
    out[o < cap ? o : cap - 1] = 0;
}

static void test_commands_refuse_fifo(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf");
    char *ckpt = require_shared("models/stories260K.bin");
    char *tok = require_shared("models/tok512.bin");
    char *fifo = make_fifo("command.fifo");
    char *msgs = temp_path("fifo-messages.json");
    const char *m = "[{\"role\":\"user\",\"content\":\"hi\"}]";
    assert_int_equal(write_file(msgs, m, strlen(m)), 0);
    char *tmpl = temp_path("fifo-template.jinja");
    const char *t = "{% for m in messages %}{{ m.content }}{% endfor %}";
    assert_int_equal(write_file(tmpl, t, strlen(t)), 0);
    char *reqs = temp_path("fifo-requests.jsonl");
    const char *r = "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"x\"}}\n";
    assert_int_equal(write_file(reqs, r, strlen(r)), 0);
    char *out = temp_path("fifo-results.jsonl");
    char *gguf_out = temp_path("fifo-converted.gguf");
    const char *names[] = {"{fifo}", "{model}", "{ckpt}", "{tok}", "{msgs}", "{tmpl}", "{reqs}", "{out}", "{gguf}"};
    const char *values[] = {fifo, model, ckpt, tok, msgs, tmpl, reqs, out, gguf_out};
    static const char *const cases[] = {
        "info {fifo}",
        "run -m {fifo} -p hi -n 1",
        "run -m {model} -f {fifo} -n 1",
        "tokenize -m {fifo} -p hi",
        "tokenize -m {model} -f {fifo}",
        "perplexity -m {model} -f {fifo}",
        "eval -m {fifo} --candidate {model} -f {model}",
        "eval -m {model} --candidate {fifo} -f {model}",
        "eval -m {model} --candidate {model} -f {fifo}",
        "bench -m {fifo} --n-prompt 8 -n 8 -b 1 -r 1",
        "template --template {fifo} --messages {msgs}",
        "template --template {tmpl} --messages {fifo}",
        "batch -m {fifo} -i {reqs} -o {out}",
        "batch -m {model} -i {fifo} -o {out}",
        "batch -m {model} -i {reqs} -o {out} --chat-template {fifo}",
        "batch -m {model} -i {reqs} -o {out} --pin-prefix {fifo}",
        "convert {fifo} --tokenizer {tok} -o {gguf}",
        "convert {ckpt} --tokenizer {fifo} -o {gguf}",
        "serve -m {fifo} --port 0",
        "serve -m {model} --port 0 --chat-template {fifo}",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[4096], *log = NULL;
        expand(args, sizeof args, cases[i], names, values, sizeof names / sizeof names[0]);
        int rc = run_blade_within(LIMIT_S, args, &log, 1);
        if (rc == 0 || rc == 124 || rc == 137 || !strstr(log, "named pipe (FIFO), not a regular file") ||
            !strstr(log, fifo))
            fail_msg("blade %s: status %d (124: still blocked after %d s), expected the FIFO refused:\n%s", cases[i],
                     rc, LIMIT_S, log);
        free(log);
    }
    assert_int_equal(access(out, F_OK), -1);
    unlink(fifo);
    free(fifo);
    free(model);
    free(ckpt);
    free(tok);
    free(msgs);
    free(tmpl);
    free(reqs);
    free(out);
    free(gguf_out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_readers_refuse_fifo),
        cmocka_unit_test(test_commands_refuse_fifo),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

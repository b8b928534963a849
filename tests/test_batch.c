/* `blade batch` on an OpenAI Batch API file mixing good completion and chat lines with
 * malformed ones: one output line per input line, each bad line named, the run never
 * stopped by one, and greedy outputs equal to `blade run`'s. The output never destroys an
 * input (same path, hard link, symlink), a repeated custom_id refuses the file, and a
 * failed or interrupted run leaves an existing output as it was and no temporary behind. */
#include "testutil.h"

#include "blade/chat_template.h"
#include "blade/model.h"
#include "blade/tokenizer.h"

#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char *g_model;

static char *chatml_template(void)
{
    char *cases_path = require_shared("chat-templates/cases.json");
    json_t *cases = json_load_file(cases_path, 0, NULL);
    free(cases_path);
    assert_non_null(cases);
    char *src = NULL;
    for (size_t i = 0; i < json_array_size(cases) && !src; i++) {
        json_t *c = json_array_get(cases, i);
        if (!strcmp(json_string_value(json_object_get(c, "name")), "teknium/OpenHermes-2.5-Mistral-7B"))
            src = strdup(json_string_value(json_object_get(c, "template")));
    }
    json_decref(cases);
    assert_non_null(src);
    return src;
}

/* What `blade run` continues a prompt with, greedily: its output minus the prompt it
 * prints first and the final newline. */
static char *run_continuation(const char *prompt_file, const char *prompt, bool chat, int n)
{
    char args[2048], *full = NULL;
    snprintf(args, sizeof args, "run -m '%s' -f '%s' %s -n %d --temp 0", g_model, prompt_file,
             chat ? "--parse-special --no-bos" : "", n);
    assert_int_equal(run_blade(args, &full, 0), 0);
    size_t pl = strlen(prompt), fl = strlen(full);
    assert_true(fl > pl && full[fl - 1] == '\n');
    assert_memory_equal(full, prompt, pl);
    full[fl - 1] = 0;
    char *cont = strdup(full + pl);
    free(full);
    return cont;
}

static json_t *find(json_t **lines, int n, const char *custom_id)
{
    for (int i = 0; i < n; i++) {
        json_t *id = json_object_get(lines[i], "custom_id");
        if (json_is_string(id) && !strcmp(json_string_value(id), custom_id))
            return lines[i];
    }
    fail_msg("no output line has custom_id %s", custom_id);
    return NULL;
}

static const char *line_text(json_t *line)
{
    json_t *resp = json_object_get(line, "response");
    assert_int_equal(json_integer_value(json_object_get(resp, "status_code")), 200);
    assert_true(json_is_null(json_object_get(line, "error")));
    json_t *c = json_array_get(json_object_get(json_object_get(resp, "body"), "choices"), 0);
    json_t *msg = json_object_get(c, "message");
    return json_string_value(json_object_get(msg ? msg : c, msg ? "content" : "text"));
}

static void expect_line_error(json_t *line, const char *code, const char *needle)
{
    assert_true(json_is_null(json_object_get(line, "response")));
    json_t *err = json_object_get(line, "error");
    const char *c = json_string_value(json_object_get(err, "code"));
    const char *m = json_string_value(json_object_get(err, "message"));
    if (!c || strcmp(c, code) || !m || !strstr(m, needle))
        fail_msg("expected error %s mentioning '%s', got %s: %s", code, needle, c ? c : "(none)", m ? m : "(none)");
}

static void test_batch_file(void **state)
{
    (void)state;
    g_model = require_shared("models/stories260K.gguf");
    char *tmpl = chatml_template();
    char *tmpl_file = temp_path("batch-chatml.jinja");
    write_file(tmpl_file, tmpl, strlen(tmpl));
    const char *system = "You tell short stories about a dog.";
    const char *lines[] = {
        "{\"custom_id\":\"c1\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"model\":\"stories260K.gguf\","
        "\"prompt\":\"Once upon a time\",\"max_tokens\":24,\"temperature\":0}}",
        "{\"custom_id\":\"bad-json\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":",
        "{\"custom_id\":\"h1\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\",\"body\":{\"messages\":[{\"role\":"
        "\"system\",\"content\":\"You tell short stories about a dog.\"},{\"role\":\"user\",\"content\":\"Go on.\"}],"
        "\"max_tokens\":16,\"temperature\":0}}",
        "{\"custom_id\":\"bad-url\",\"method\":\"POST\",\"url\":\"/v1/images/generations\",\"body\":{\"prompt\":\"x\"}}",
        "{\"custom_id\":\"e1\",\"method\":\"POST\",\"url\":\"/v1/embeddings\",\"body\":{\"input\":[\"x\",\"Tom\"]}}",
        "{\"custom_id\":\"bad-nobody\",\"method\":\"POST\",\"url\":\"/v1/completions\"}",
        "{\"custom_id\":\"bad-types\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"x\","
        "\"max_tokens\":\"many\"}}",
        "{\"custom_id\":7,\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"x\"}}",
        "{\"custom_id\":\"bad-method\",\"method\":\"GET\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"x\"}}",
        "{\"custom_id\":\"bad-model\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"model\":\"gpt-4o\","
        "\"prompt\":\"x\"}}",
        "[1,2,3]",
        "{\"custom_id\":\"c2\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"The little dog\","
        "\"max_tokens\":20,\"temperature\":0}}",
        "{\"custom_id\":\"n3\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"Tom\",\"n\":3,"
        "\"max_tokens\":8,\"seed\":9}}",
        "{\"custom_id\":\"c3\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"Once upon a time\","
        "\"max_tokens\":24,\"temperature\":0}}",
    };
    enum { N = sizeof lines / sizeof lines[0] };
    char *in = temp_path("batch-in.jsonl");
    char *out = temp_path("batch-out.jsonl");
    FILE *f = fopen(in, "w");
    for (int i = 0; i < N; i++)
        fprintf(f, "%s\n", lines[i]);
    fclose(f);

    char args[2048];
    snprintf(args, sizeof args, "batch -m '%s' -i '%s' -o '%s' --chat-template '%s' --kv-mem 64M -t 2 --max-inflight 4",
             g_model, in, out, tmpl_file);
    char *log = NULL;
    assert_int_equal(run_blade(args, &log, 1), 0);
    if (!strstr(log, "14 requests: 6 ok, 8 failed"))
        fail_msg("unexpected summary: %s", log);
    free(log);

    size_t len;
    char *text = read_file(out, &len);
    assert_non_null(text);
    json_t *got[N + 1];
    int n = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        assert_true(n < N);
        json_error_t e;
        got[n] = json_loads(line, 0, &e);
        if (!got[n])
            fail_msg("output line %d is not JSON: %s", n + 1, e.text);
        assert_true(json_is_string(json_object_get(got[n], "id")));
        n++;
    }
    free(text);
    assert_int_equal(n, N);

    expect_line_error(find(got, n, "bad-url"), "invalid_url", "/v1/images/generations");
    json_t *e1 = json_object_get(json_object_get(find(got, n, "e1"), "response"), "body");
    assert_string_equal(json_string_value(json_object_get(e1, "object")), "list");
    assert_int_equal(json_array_size(json_object_get(e1, "data")), 2);
    assert_int_equal(json_array_size(json_object_get(json_array_get(json_object_get(e1, "data"), 1), "embedding")), 64);
    expect_line_error(find(got, n, "bad-nobody"), "invalid_body", "'body'");
    expect_line_error(find(got, n, "bad-method"), "invalid_method", "POST");
    int anonymous = 0;
    for (int i = 0; i < n; i++) {
        json_t *id = json_object_get(got[i], "custom_id");
        json_t *err = json_object_get(got[i], "error");
        const char *code = json_string_value(json_object_get(err, "code"));
        if (json_is_null(id) && code && !strcmp(code, "invalid_json")) {
            anonymous++;
            assert_non_null(strstr(json_string_value(json_object_get(err, "message")), "line 2"));
        } else if (json_is_null(id)) {
            expect_line_error(got[i], "invalid_request", "JSON object");
            anonymous++;
        } else if (json_is_integer(id)) {
            expect_line_error(got[i], "invalid_custom_id", "custom_id");
        }
    }
    assert_int_equal(anonymous, 2);
    json_t *types = json_object_get(find(got, n, "bad-types"), "response");
    assert_int_equal(json_integer_value(json_object_get(types, "status_code")), 400);
    json_t *terr = json_object_get(json_object_get(types, "body"), "error");
    assert_non_null(strstr(json_string_value(json_object_get(terr, "message")), "max_tokens"));
    assert_string_equal(json_string_value(json_object_get(terr, "param")), "max_tokens");
    json_t *model = json_object_get(find(got, n, "bad-model"), "response");
    assert_int_equal(json_integer_value(json_object_get(model, "status_code")), 404);

    json_t *c1 = find(got, n, "c1");
    json_t *body = json_object_get(json_object_get(c1, "response"), "body");
    assert_string_equal(json_string_value(json_object_get(body, "object")), "text_completion");
    assert_string_equal(json_string_value(json_object_get(json_object_get(c1, "response"), "request_id")),
                        json_string_value(json_object_get(body, "id")));
    assert_int_equal(json_integer_value(json_object_get(json_object_get(body, "usage"), "completion_tokens")), 24);
    char *p1 = temp_path("batch-p1.txt");
    write_file(p1, "Once upon a time", 16);
    char *want = run_continuation(p1, "Once upon a time", false, 24);
    assert_string_equal(line_text(c1), want);
    assert_string_equal(line_text(find(got, n, "c3")), want);
    free(want);
    write_file(p1, "The little dog", 14);
    want = run_continuation(p1, "The little dog", false, 20);
    assert_string_equal(line_text(find(got, n, "c2")), want);
    free(want);

    json_t *h1 = find(got, n, "h1");
    json_t *hbody = json_object_get(json_object_get(h1, "response"), "body");
    assert_string_equal(json_string_value(json_object_get(hbody, "object")), "chat.completion");
    int h_tokens = (int)json_integer_value(json_object_get(json_object_get(hbody, "usage"), "completion_tokens"));
    blade_error err = {{0}};
    blade_model *m = blade_model_load(g_model, &err);
    blade_template *t = blade_template_parse(tmpl, strlen(tmpl), &err);
    assert_non_null(t);
    json_t *messages = json_pack("[{s:s, s:s}, {s:s, s:s}]", "role", "system", "content", system, "role", "user",
                                 "content", "Go on.");
    char *rendered = NULL;
    size_t rlen;
    const blade_tokenizer *tok = m->tokenizer;
    assert_int_equal(blade_template_render_chat(t, messages, true,
                                                blade_tokenizer_token_text(tok, blade_tokenizer_bos(tok)),
                                                blade_tokenizer_token_text(tok, blade_tokenizer_eos(tok)), &rendered,
                                                &rlen, &err),
                     0);
    write_file(p1, rendered, rlen);
    want = run_continuation(p1, rendered, true, h_tokens);
    assert_string_equal(line_text(h1), want);
    free(want);
    free(rendered);
    json_decref(messages);
    blade_template_free(t);
    blade_model_free(m);

    json_t *n3 = json_object_get(json_object_get(json_object_get(find(got, n, "n3"), "response"), "body"), "choices");
    assert_int_equal(json_array_size(n3), 3);

    for (int i = 0; i < n; i++)
        json_decref(got[i]);
    free(p1);
    free(in);
    free(out);
    free(tmpl_file);
    free(tmpl);
    free(g_model);
}

static void test_batch_usage_errors(void **state)
{
    (void)state;
    char *log = NULL;
    assert_int_equal(run_blade("batch -i /nonexistent.jsonl", &log, 1), 2);
    assert_non_null(strstr(log, "--output FILE is required"));
    free(log);
    assert_int_equal(run_blade("batch --help", &log, 1), 0);
    assert_non_null(strstr(log, "--max-inflight"));
    free(log);
}

/* ---- the output never destroys an input, and appears whole or not at all ---- */

static const char one_request[] = "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":"
                                  "{\"prompt\":\"Once upon a time\",\"max_tokens\":4,\"temperature\":0}}\n";
static const char precious[] = "results of an earlier run\n";

/* A fresh directory of its own, so that a leftover temporary is this test's. */
static char *fresh_dir(const char *name)
{
    char *dir = temp_path(name);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
    assert_int_equal(mkdir(dir, 0755), 0);
    return dir;
}

static char *in_dir(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* The names in dir that are not in keep (NULL-terminated): leftovers, one per line. */
static char *stray_files(const char *dir, const char *const keep[])
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    char *list = calloc(1, 1);
    size_t len = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        bool kept = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
        for (size_t i = 0; keep[i] && !kept; i++)
            kept = !strcmp(e->d_name, keep[i]);
        if (kept)
            continue;
        list = realloc(list, len + strlen(e->d_name) + 2);
        len += (size_t)sprintf(list + len, "%s\n", e->d_name);
    }
    closedir(d);
    return list;
}

static void expect_no_strays(const char *dir, const char *const keep[])
{
    char *stray = stray_files(dir, keep);
    if (*stray)
        fail_msg("left behind in %s:\n%s", dir, stray);
    free(stray);
}

static void expect_content(const char *path, const char *want)
{
    size_t len;
    char *got = read_file(path, &len);
    assert_non_null(got);
    if (len != strlen(want) || memcmp(got, want, len))
        fail_msg("%s changed: it holds %zu bytes: %.200s", path, len, got);
    free(got);
}

static void test_batch_refuses_input_as_output(void **state)
{
    (void)state;
    g_model = require_shared("models/stories260K.gguf");
    char *dir = fresh_dir("batch-same-file");
    char *in = in_dir(dir, "requests.jsonl"), *hard = in_dir(dir, "hard.jsonl"), *sym = in_dir(dir, "sym.jsonl");
    char *model_copy = in_dir(dir, "model.gguf"), *tmpl = in_dir(dir, "t.jinja");
    assert_int_equal(write_file(in, one_request, strlen(one_request)), 0);
    assert_int_equal(link(in, hard), 0);
    assert_int_equal(symlink("requests.jsonl", sym), 0);
    size_t model_len;
    char *model_bytes = read_file(g_model, &model_len);
    assert_int_equal(write_file(model_copy, model_bytes, model_len), 0);
    const char *t = "{{ messages[0].content }}";
    assert_int_equal(write_file(tmpl, t, strlen(t)), 0);
    struct {
        const char *in, *out, *model, *extra, *named;
    } cases[] = {
        {in, in, g_model, "", in},          /* the same path */
        {in, hard, g_model, "", in},        /* a hard link to the input */
        {in, sym, g_model, "", in},         /* a symlink to the input */
        {sym, hard, g_model, "", sym},      /* both through links */
        {in, model_copy, model_copy, "", model_copy},
        {in, tmpl, model_copy, "--chat-template", tmpl},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char args[4096], *log = NULL;
        snprintf(args, sizeof args, "batch -m '%s' -i '%s' -o '%s' --kv-mem 64M %s %s%s%s", cases[i].model,
                 cases[i].in, cases[i].out, cases[i].extra, *cases[i].extra ? "'" : "", *cases[i].extra ? tmpl : "",
                 *cases[i].extra ? "'" : "");
        int rc = run_blade(args, &log, 1);
        expect_content(in, one_request);
        expect_content(tmpl, t);
        size_t len;
        char *now = read_file(model_copy, &len);
        if (len != model_len || memcmp(now, model_bytes, len))
            fail_msg("case %zu: the model changed", i);
        free(now);
        char want[2048];
        snprintf(want, sizeof want, "refusing to write the results to %s: it is the same file as the", cases[i].out);
        if (rc != 2 || !strstr(log, want) || !strstr(log, cases[i].named))
            fail_msg("case %zu: status %d, expected 2 and a refusal naming %s and %s:\n%s", i, rc, cases[i].out,
                     cases[i].named, log);
        free(log);
    }
    const char *keep[] = {"requests.jsonl", "hard.jsonl", "sym.jsonl", "model.gguf", "t.jinja", NULL};
    expect_no_strays(dir, keep);
    free(model_bytes);
    free(in);
    free(hard);
    free(sym);
    free(model_copy);
    free(tmpl);
    free(dir);
    free(g_model);
}

/* OpenAI's Batch API refuses a file with a repeated custom_id; so does blade, before running
 * anything, and leaves the output alone. */
static void test_batch_duplicate_custom_id(void **state)
{
    (void)state;
    g_model = require_shared("models/stories260K.gguf");
    char *dir = fresh_dir("batch-duplicates");
    char *in = in_dir(dir, "requests.jsonl"), *out = in_dir(dir, "results.jsonl");
    const char *lines = "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"x\"}}\n"
                        "{\"custom_id\":\"b\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"y\"}}\n"
                        "not json\n"
                        "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"z\"}}\n"
                        "{\"custom_id\":\"b\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"w\"}}\n";
    assert_int_equal(write_file(in, lines, strlen(lines)), 0);
    char args[4096], *log = NULL;
    snprintf(args, sizeof args, "batch -m '%s' -i '%s' -o '%s' --kv-mem 64M", g_model, in, out);
    int rc = run_blade(args, &log, 1);
    if (rc != 1 || !strstr(log, "line 4 repeats custom_id \"a\" of line 1 (2 duplicate custom_ids in the file)"))
        fail_msg("status %d, expected 1 and the duplicate named: %s", rc, log);
    free(log);
    assert_int_equal(access(out, F_OK), -1);
    assert_int_equal(write_file(out, precious, strlen(precious)), 0);
    assert_int_equal(run_blade(args, &log, 1), 1);
    free(log);
    expect_content(out, precious);
    const char *keep[] = {"requests.jsonl", "results.jsonl", NULL};
    expect_no_strays(dir, keep);
    free(in);
    free(out);
    free(dir);
    free(g_model);
}

/* Runs blade with argv (argv[0] unused), stderr to log_path, its file size limited to
 * fsize bytes when fsize > 0 (writing past it then fails with EFBIG). */
static pid_t spawn_blade(char *argv[], const char *log_path, long fsize)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, STDERR_FILENO);
            dup2(fd, STDOUT_FILENO);
        }
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        if (fsize > 0) {
            signal(SIGXFSZ, SIG_IGN);
            struct rlimit rl = {(rlim_t)fsize, (rlim_t)fsize};
            setrlimit(RLIMIT_FSIZE, &rl);
        }
        argv[0] = (char *)BLADE_BINARY;
        execv(BLADE_BINARY, argv);
        _exit(127);
    }
    return pid;
}

static char *many_requests(const char *dir, int n, int max_tokens)
{
    char *in = in_dir(dir, "requests.jsonl");
    FILE *f = fopen(in, "w");
    assert_non_null(f);
    for (int i = 0; i < n; i++)
        fprintf(f,
                "{\"custom_id\":\"r%d\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":{\"prompt\":\"Once upon "
                "a time\",\"max_tokens\":%d,\"temperature\":0}}\n",
                i, max_tokens);
    assert_int_equal(fclose(f), 0);
    return in;
}

/* A directory with many requests, an earlier run's results and a log for the next run. */
typedef struct scratch {
    char *dir, *in, *out, *log;
} scratch;

static const char *const scratch_files[] = {"requests.jsonl", "results.jsonl", "log", NULL};

static scratch scratch_new(const char *name, int n_requests, int max_tokens)
{
    scratch sc = {.dir = fresh_dir(name)};
    sc.in = many_requests(sc.dir, n_requests, max_tokens);
    sc.out = in_dir(sc.dir, "results.jsonl");
    sc.log = in_dir(sc.dir, "log");
    assert_int_equal(write_file(sc.out, precious, strlen(precious)), 0);
    return sc;
}

/* The earlier results are as they were, and nothing else was left behind. */
static void scratch_check_free(scratch *sc)
{
    expect_content(sc->out, precious);
    expect_no_strays(sc->dir, scratch_files);
    free(sc->dir);
    free(sc->in);
    free(sc->out);
    free(sc->log);
}

/* A run that fails while writing (here: the file size limit) leaves the existing output as
 * it was and no temporary behind. */
static void test_batch_failed_run_keeps_output(void **state)
{
    (void)state;
    g_model = require_shared("models/stories260K.gguf");
    scratch sc = scratch_new("batch-failed", 16, 64);
    char *argv[] = {NULL, "batch", "-m", g_model, "-i", sc.in, "-o", sc.out, "--kv-mem", "64M", "-t", "1", NULL};
    pid_t pid = spawn_blade(argv, sc.log, 4096);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    expect_content(sc.out, precious);
    char *text = read_file(sc.log, NULL);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 1 || !strstr(text, "writing the results to") ||
        !strstr(text, "the output file is as it was before the run"))
        fail_msg("status %d, expected exit 1 and the write failure named:\n%s", status, text);
    free(text);
    scratch_check_free(&sc);
    free(g_model);
}

/* SIGINT or SIGTERM in the middle of a run: the process dies of the signal, the existing
 * output is as it was, and the temporary is removed. */
static void test_batch_interrupted_run_keeps_output(void **state)
{
    (void)state;
    g_model = require_shared("models/stories260K.gguf");
    static const int sigs[] = {SIGINT, SIGTERM};
    for (size_t s = 0; s < 2; s++) {
        scratch sc = scratch_new("batch-interrupted", 400, 400);
        char *argv[] = {NULL, "batch", "-m", g_model, "-i", sc.in, "-o", sc.out, "--kv-mem", "64M",
                        "--max-inflight", "1", "-t", "1", NULL};
        pid_t pid = spawn_blade(argv, sc.log, 0);
        /* Until the run is writing: its temporary exists (or, as blade once did, the output
         * itself was opened and truncated). */
        bool writing = false;
        for (int i = 0; i < 6000 && !writing; i++) {
            char *stray = stray_files(sc.dir, scratch_files);
            size_t len;
            char *now = read_file(sc.out, &len);
            writing = *stray || !now || len != strlen(precious);
            free(stray);
            free(now);
            if (!writing) {
                int status;
                assert_int_equal(waitpid(pid, &status, WNOHANG), 0);
                usleep(10000);
            }
        }
        assert_true(writing);
        assert_int_equal(kill(pid, sigs[s]), 0);
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (!WIFSIGNALED(status) || WTERMSIG(status) != sigs[s])
            fail_msg("expected death by signal %d, got status %d", sigs[s], status);
        scratch_check_free(&sc);
    }
    free(g_model);
}

/* An output that cannot be replaced by a rename is written in place, as before: /dev/stdout
 * (here a pipe) and a FIFO with a reader. */
/* An 8-bit KV cache serves the batch, and the startup lines say what the budget holds in it
 * and in every other type: stories260K's rows of 8 dims carry a 2-byte scale, so 64 MiB hold
 * 10485 blocks of 16 tokens in q8_0 (400 bytes a token) against 6553 in f16. */
static void test_batch_kv_type(void **state)
{
    (void)state;
    char *model = require_shared("models/stories260K.gguf");
    char *in = temp_path("batch-kv-in.jsonl"), *out = temp_path("batch-kv-out.jsonl");
    assert_int_equal(write_file(in, one_request, strlen(one_request)), 0);
    char args[2048], *log = NULL;
    snprintf(args, sizeof args, "batch -m '%s' -i '%s' -o '%s' --kv-mem 64M --kv-type q8_0 -t 1", model, in, out);
    assert_int_equal(run_blade(args, &log, 1), 0);
    if (!strstr(log, "KV cache: 0.06 GiB of q8_0 = 167760 tokens") ||
        !strstr(log, "f16 104848 tokens = 51 sequences (1.00x f16)") ||
        !strstr(log, "q8_0 167760 tokens = 81 sequences (1.60x f16)") || !strstr(log, "1 requests: 1 ok"))
        fail_msg("unexpected log: %s", log);
    free(log);
    free(in);
    free(out);
    free(model);
}

static void test_batch_streamed_outputs(void **state)
{
    (void)state;
    g_model = require_shared("models/stories260K.gguf");
    char *dir = fresh_dir("batch-streamed");
    char *in = in_dir(dir, "requests.jsonl"), *fifo = in_dir(dir, "results.fifo");
    assert_int_equal(write_file(in, one_request, strlen(one_request)), 0);
    char args[4096], *got = NULL;
    snprintf(args, sizeof args, "batch -m '%s' -i '%s' -o /dev/stdout --kv-mem 64M", g_model, in);
    assert_int_equal(run_blade(args, &got, 0), 0);
    assert_non_null(strstr(got, "\"custom_id\":\"a\""));
    free(got);

    assert_int_equal(mkfifo(fifo, 0600), 0);
    char *log = in_dir(dir, "log");
    char *argv[] = {NULL, "batch", "-m", g_model, "-i", in, "-o", fifo, "--kv-mem", "64M", NULL};
    pid_t pid = spawn_blade(argv, log, 0);
    got = read_file(fifo, NULL);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    assert_non_null(got);
    assert_non_null(strstr(got, "\"custom_id\":\"a\""));
    free(got);
    const char *keep[] = {"requests.jsonl", "results.fifo", "log", NULL};
    expect_no_strays(dir, keep);
    free(log);
    free(fifo);
    free(in);
    free(dir);
    free(g_model);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_file),
        cmocka_unit_test(test_batch_usage_errors),
        cmocka_unit_test(test_batch_refuses_input_as_output),
        cmocka_unit_test(test_batch_duplicate_custom_id),
        cmocka_unit_test(test_batch_failed_run_keeps_output),
        cmocka_unit_test(test_batch_interrupted_run_keeps_output),
        cmocka_unit_test(test_batch_streamed_outputs),
        cmocka_unit_test(test_batch_kv_type),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* `blade batch` on an OpenAI Batch API file mixing good completion and chat lines with
 * malformed ones: one output line per input line, each bad line named, the run never
 * stopped by one, and greedy outputs equal to `blade run`'s. */
#include "testutil.h"

#include "blade/chat_template.h"
#include "blade/model.h"
#include "blade/tokenizer.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
        "{\"custom_id\":\"bad-url\",\"method\":\"POST\",\"url\":\"/v1/embeddings\",\"body\":{\"input\":\"x\"}}",
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
    if (!strstr(log, "13 requests: 5 ok, 8 failed"))
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

    expect_line_error(find(got, n, "bad-url"), "invalid_url", "/v1/embeddings");
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
    assert_non_null(strstr(log, "-o FILE"));
    free(log);
    assert_int_equal(run_blade("batch --help", &log, 1), 0);
    assert_non_null(strstr(log, "--max-inflight"));
    free(log);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_file),
        cmocka_unit_test(test_batch_usage_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

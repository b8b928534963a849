/* Helpers of the cmocka test programs (testutil.h): paths into ../shared, reported skips,
 * files, temporary paths, a small synthetic model, and running the blade binary or any
 * command. */
#include "testutil.h"

#include "blade/synth.h"
#include "blade/types.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char *join(const char *a, const char *b)
{
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = malloc(n);
    snprintf(p, n, "%s/%s", a, b);
    return p;
}

blade_model *load_model(const char *path)
{
    blade_error err = {{0}};
    blade_model *m = blade_model_load(path, &err);
    if (!m)
        fail_msg("%s", err.msg);
    return m;
}

blade_model *load_stories(void)
{
    char *path = require_shared("models/stories260K.gguf");
    blade_model *m = load_model(path);
    free(path);
    return m;
}

char *read_shared(const char *rel, size_t *len)
{
    char *path = require_shared(rel);
    char *text = read_file(path, len);
    if (!text)
        fail_msg("cannot read %s", path);
    free(path);
    return text;
}

char *shared_path(const char *rel)
{
    const char *dir = getenv("BLADE_SHARED_DIR");
    return join(dir && *dir ? dir : BLADE_SHARED_DIR, rel);
}

char *require_shared(const char *rel)
{
    char *p = shared_path(rel);
    if (access(p, R_OK) != 0) {
        note_skipped("shared file %s not found", p);
        free(p);
        skip();
    }
    return p;
}

void note_skipped(const char *fmt, ...)
{
    static char said[64][200];
    static int n_said;
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    for (int i = 0; i < n_said; i++)
        if (!strcmp(said[i], msg))
            return;
    if (n_said < 64)
        strcpy(said[n_said++], msg);
    printf("SKIPPED: %s\n", msg);
    fflush(stdout);
}

bool isa_tested(blade_isa isa, const char *what)
{
    if (blade_isa_supported(isa))
        return true;
    static const char *const names[BLADE_ISA_COUNT] = {"scalar", "AVX2", "AVX-512"};
    note_skipped("%s not supported by this CPU: %s not tested on it", names[isa], what);
    return false;
}

char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
    }
    fclose(f);
    buf[n] = 0;
    if (len)
        *len = n;
    return buf;
}

int write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t w = fwrite(data, 1, len, f);
    return (fclose(f) == 0 && w == len) ? 0 : -1;
}

char *temp_path(const char *name)
{
    mkdir(BLADE_TEST_TMPDIR, 0755);
    return join(BLADE_TEST_TMPDIR, name);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Runs cmd through sh with its stdout captured. */
static int run_shell(const char *cmd, char **out, struct rusage *usage, double *wall_s)
{
    int fds[2];
    if (pipe(fds) != 0)
        return -1;
    double t0 = now_s();
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], STDOUT_FILENO);
        close(fds[0]);
        close(fds[1]);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    if (pid < 0) {
        close(fds[0]);
        return -1;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap + 1);
    ssize_t got;
    while ((got = read(fds[0], buf + len, cap - len)) != 0) {
        if (got < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        len += (size_t)got;
        if (len == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
    }
    close(fds[0]);
    buf[len] = 0;
    int status = 0;
    struct rusage ru;
    while (wait4(pid, &status, 0, &ru) < 0 && errno == EINTR)
        ;
    if (wall_s)
        *wall_s = now_s() - t0;
    if (usage)
        *usage = ru;
    if (out)
        *out = buf;
    else
        free(buf);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Runs `prefix blade args` through sh, whose exec makes the last command of the line the
 * child itself, so what wait4 reports is that process's alone. */
static int run_prefixed(const char *prefix, const char *args, char **out, int merge_stderr, struct rusage *usage,
                        double *wall_s)
{
    size_t n = strlen(prefix) + strlen(BLADE_BINARY) + strlen(args) + 32;
    char *cmd = malloc(n);
    snprintf(cmd, n, "exec %s'%s' %s%s", prefix, BLADE_BINARY, args, merge_stderr ? " 2>&1" : " 2>/dev/null");
    int rc = run_shell(cmd, out, usage, wall_s);
    free(cmd);
    return rc;
}

int run_command(const char *cmd, char **out)
{
    return run_shell(cmd, out, NULL, NULL);
}

int run_blade(const char *args, char **out, int merge_stderr)
{
    return run_prefixed("", args, out, merge_stderr, NULL, NULL);
}

int run_blade_usage(const char *args, char **out, int merge_stderr, struct rusage *usage, double *wall_s)
{
    return run_prefixed("", args, out, merge_stderr, usage, wall_s);
}

int run_blade_within(int seconds, const char *args, char **out, int merge_stderr)
{
    char prefix[64];
    snprintf(prefix, sizeof prefix, "timeout -k 2 %d ", seconds);
    return run_prefixed(prefix, args, out, merge_stderr, NULL, NULL);
}

char *synth_small_model(const char *name, uint64_t seed)
{
    char *path = temp_path(name);
    blade_synth_spec s = {
        .arch = BLADE_ARCH_LLAMA, .n_vocab = 400, .n_embd = 64, .n_layer = 2, .n_head = 4, .n_head_kv = 2,
        .head_dim = 16, .n_ff = 128, .n_ctx = 2048, .rope_base = 10000.0f, .scheme = {.type = BLADE_TYPE_Q8_0},
        .seed = seed,
    };
    blade_error err = {{0}};
    if (blade_synth_write(&s, path, false, &err))
        fail_msg("%s", err.msg);
    return path;
}

void test_record_init(test_record *r, int32_t cap, int32_t n_vocab)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    r->cap = cap;
    r->n_vocab = n_vocab;
    r->tokens = calloc((size_t)cap, sizeof *r->tokens);
    r->logprob = calloc((size_t)cap, sizeof *r->logprob);
    r->top_ids = calloc((size_t)cap, sizeof *r->top_ids);
    r->top_lp = calloc((size_t)cap, sizeof *r->top_lp);
    r->logits = n_vocab > 0 ? calloc((size_t)cap * (size_t)n_vocab, sizeof *r->logits) : NULL;
    assert_non_null(r->tokens);
    assert_non_null(r->logprob);
    assert_non_null(r->top_ids);
    assert_non_null(r->top_lp);
    assert_true(n_vocab <= 0 || r->logits);
}

void test_record_event(const blade_token_event *ev)
{
    test_record *r = ev->user;
    pthread_mutex_lock(&r->mu);
    if (ev->token >= 0 && r->n < r->cap) {
        r->tokens[r->n] = ev->token;
        r->logprob[r->n] = ev->logprob;
        for (int j = 0; j < ev->n_top && j < 3; j++) {
            r->top_ids[r->n][j] = ev->top_ids[j];
            r->top_lp[r->n][j] = ev->top_logprobs[j];
        }
        if (ev->logits && r->logits)
            memcpy(r->logits + (size_t)r->n * r->n_vocab, ev->logits, (size_t)r->n_vocab * sizeof(float));
        r->n++;
    }
    if (r->text_len + ev->text_len < sizeof r->text) {
        memcpy(r->text + r->text_len, ev->text, ev->text_len);
        r->text_len += ev->text_len;
        r->text[r->text_len] = 0;
    }
    if (ev->finish != BLADE_FINISH_NONE) {
        r->finish = ev->finish;
        r->cached = ev->cached_tokens;
        r->done = true;
    }
    pthread_mutex_unlock(&r->mu);
}

void test_record_free(test_record *r)
{
    free(r->tokens);
    free(r->logprob);
    free(r->top_ids);
    free(r->top_lp);
    free(r->logits);
    pthread_mutex_destroy(&r->mu);
}

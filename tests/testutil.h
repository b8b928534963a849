#ifndef BLADE_TESTUTIL_H
#define BLADE_TESTUTIL_H

/* Small helpers shared by the cmocka test programs. */

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <pthread.h>
#include <setjmp.h>
#include <cmocka.h>

#include "blade/engine.h"
#include "blade/kernels.h"
#include "blade/model.h"

/* "<shared>/rel" in a static buffer per call site is error-prone, so this returns a
 * malloc'd path; callers free it. */
char *shared_path(const char *rel);
/* Calls cmocka's skip() when the shared file is missing, so a checkout without ../shared
 * still runs every self-contained test. Returns the malloc'd path otherwise. */
char *require_shared(const char *rel);
/* Prints "SKIPPED: <message>" on stdout, once per distinct message: a test that runs but
 * leaves part of its checks out (an ISA this CPU lacks) says so, as cmocka's skip() does
 * for a whole test. ctest -V, and scripts/test.sh's summary, show these lines. */
void note_skipped(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* True when this CPU runs the ISA; otherwise notes "SKIPPED: <ISA> not supported by this
 * CPU: <what> not tested on it". For the loops that check every ISA. */
bool isa_tested(blade_isa isa, const char *what);
/* The model at path, or the test fails with the loader's message. */
blade_model *load_model(const char *path);
/* ../shared/models/stories260K.gguf (the test skipped when the file is missing). */
blade_model *load_stories(void);
/* A shared file's contents (the test skipped when it is missing, failed when unreadable). */
char *read_shared(const char *rel, size_t *len);
/* Whole file into a malloc'd, NUL-terminated buffer; NULL on failure. */
char *read_file(const char *path, size_t *len);
int write_file(const char *path, const void *data, size_t len);
/* A small synthetic llama model (400-token vocabulary, 64 wide, 2 layers, Q8_0, 2048-token
 * context) written to the temp path `name` with weight seed `seed`; the path, malloc'd. */
char *synth_small_model(const char *name, uint64_t seed);
/* A fresh path under the build's test temp directory (created on demand); malloc'd. */
char *temp_path(const char *name);
/* Runs a shell command line; returns its exit status and, if out is non-NULL, its stdout
 * as a malloc'd string. */
int run_command(const char *cmd, char **out);
/* Runs the blade binary with a shell-quoted argument string; returns its exit status
 * and, if out is non-NULL, stdout (+ stderr when merge_stderr) as a malloc'd string. */
int run_blade(const char *args, char **out, int merge_stderr);
/* The same, killed after `seconds` (status 124 then), for a command that must not block:
 * a regression then fails the test instead of hanging it. */
int run_blade_within(int seconds, const char *args, char **out, int merge_stderr);
/* run_blade that also reports what the blade process used (wait4: CPU time, peak RSS in
 * ru_maxrss) and how long it ran, in wall seconds. */
struct rusage;
int run_blade_usage(const char *args, char **out, int merge_stderr, struct rusage *usage, double *wall_s);

/* What one engine request delivered, gathered by test_record_event (the request's callback,
 * with the record as its user): each token with its logprob and top 3, a copy of each
 * token's logits when the record was made with n_vocab > 0, the text, how it finished. */
typedef struct test_record {
    int32_t *tokens;
    float *logprob;
    int32_t (*top_ids)[3];
    float (*top_lp)[3];
    int32_t n, cap;
    float *logits; /* [cap][n_vocab], or NULL */
    int32_t n_vocab;
    blade_finish_reason finish;
    int32_t cached;
    char text[8192];
    size_t text_len;
    pthread_mutex_t mu;
    bool done;
} test_record;

/* Room for cap tokens (later ones are counted out of the record but not kept). */
void test_record_init(test_record *r, int32_t cap, int32_t n_vocab);
void test_record_event(const blade_token_event *ev);
void test_record_free(test_record *r);

#endif

/* `blade bench ablation`: starts blade serve once per configuration, from the naive baseline
 * adding one technique at a time, and measures each with the same workload. */

#include "blade/tokenizer.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/engine_options.h"
#include "cli/load_options.h"
#include "cli/load_run.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

/* The techniques in the order the ablation adds them, with the serve flags that turn each
 * off (and on, for one that is not on by default): row k of the table runs with the first k
 * on and the rest off, so adding a technique is one line here. */
static const struct technique {
    const char *name;
    const char *off[3];
    const char *on[3];
} techniques[] = {
    {"continuous batching", {"--scheduler", "static"}, {NULL}},
    {"paged KV", {"--kv-alloc", "contiguous"}, {NULL}},
    {"prefix caching", {"--no-prefix-cache"}, {NULL}},
    {"chunked prefill", {"--no-chunked-prefill"}, {NULL}},
    {"8-bit KV cache (q8_0)", {"--kv-type", "f16"}, {"--kv-type", "q8_0"}},
    /* off by default; answers only what repeats (the semantic workload), costs an embedding
     * per miss everywhere else */
    {"semantic cache", {NULL}, {"--semantic-cache"}},
};
#define N_TECHNIQUES (sizeof techniques / sizeof techniques[0])
#define MAX_PASS 32
#define MAX_SERVER_ARGS (8 + 2 * MAX_PASS + 3 * N_TECHNIQUES + 1)

typedef struct pass_arg {
    char flag[40];
    const char *value; /* NULL for a switch */
} pass_arg;

typedef struct ablation_options {
    const char *model;
    cli_load_options load;
    /* the engine flags, checked here and passed on to every server */
    cli_engine_options engine;
    pass_arg pass[MAX_PASS];
    int n_pass;
} ablation_options;

static void ablation_init(void *opts)
{
    ablation_options *o = opts;
    cli_load_options_init(&o->load);
    o->load.ignore_eos = true;
    cli_engine_options_init(&o->engine);
}

static bool is_engine_flag(const cli_flag *f)
{
    for (const cli_flag *e = cli_engine_flags; e->kind != CLI_END; e++)
        if (e == f)
            return true;
    return false;
}

/* Keeps each engine flag to pass it on by its long name; refuses those the ablation varies. */
static bool pass_engine_flag(void *opts, const cli_flag *f, const char *value, FILE *err)
{
    ablation_options *o = opts;
    if (!is_engine_flag(f))
        return true;
    for (size_t t = 0; t < N_TECHNIQUES; t++)
        if (techniques[t].off[0] && !strcmp(techniques[t].off[0] + 2, f->name)) {
            fprintf(err, "error: --%s is what the ablation varies; it cannot be given\n", f->name);
            return false;
        }
    if (o->n_pass == MAX_PASS) {
        fprintf(err, "error: more than %d engine options\n", MAX_PASS);
        return false;
    }
    snprintf(o->pass[o->n_pass].flag, sizeof o->pass[o->n_pass].flag, "--%s", f->name);
    o->pass[o->n_pass++].value = value;
    return true;
}

#define O ablation_options
static const cli_flag ablation_flags[] = {
    {.name = "model", .letter = 'm', .kind = CLI_PATH, CLI_AT(O, model), .metavar = "FILE",
     .dflt = "../shared/models/stories260K.gguf if present",
     .help = "GGUF model to serve (its tokenizer builds the prompts)"},
    {0},
};
#undef O

static void ablation_epilogue(FILE *out)
{
    fprintf(out, "--json writes every configuration's figures. The engine options are passed to every server;\n"
                 "the baseline modes are what the ablation varies, and cannot be given.\n");
}

static int ablation_main(int argc, char **argv);

const cli_command cli_cmd_bench_ablation = {
    .name = "bench ablation",
    .summary = "what each serving technique buys: blade serve from the naive baseline up",
    .synopsis = "-m MODEL --workload W [options] [engine options]",
    .about =
        "Reproduces what each serving technique buys. Starts `blade serve` (this binary) on a free loopback\n"
        "port once per configuration, from the naive baseline (static batching, contiguous KV reservation, no\n"
        "prefix cache, no chunked prefill, f16 KV) adding one technique at a time (continuous batching, paged\n"
        "KV, prefix caching, chunked prefill, --kv-type q8_0, --semantic-cache: everything on), runs the same\n"
        "seeded workload against each, stops it with SIGTERM, and prints one table: throughput, TTFT and\n"
        "TPOT p50/p99, KV slot utilisation (token slots used / allocated, when /metrics exposes\n"
        "blade:kv_utilisation), cost per million tokens, and each row's ratio to the baseline.\n"
        "Requests carry ignore_eos, so every configuration generates the same tokens. Each server's output\n"
        "goes to a temporary log, kept and named if it fails.\n",
    .tables = (const cli_table[]){{ablation_flags, 0},
                                  {cli_load_flags, offsetof(ablation_options, load)},
                                  {cli_engine_flags, offsetof(ablation_options, engine)},
                                  {0}},
    .opts_size = sizeof(ablation_options),
    .init = ablation_init,
    .observe = pass_engine_flag,
    .epilogue = ablation_epilogue,
    .main = ablation_main,
};

typedef struct server_proc {
    pid_t pid;
    char url[64];
    char log_path[256];
} server_proc;

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static void print_log_tail(const char *path)
{
    size_t len;
    char *text = cli_read_file(path, &len);
    if (!text)
        return;
    const char *p = text + len;
    for (int lines = 0; p > text && lines < 20; p--)
        if (p[-1] == '\n' && p != text + len)
            lines++;
    fprintf(stderr, "--- last lines of %s ---\n%s\n", path, p);
    free(text);
}

/* The serve command line of configuration k, NULL-terminated; argv points into pass,
 * techniques and port. *flags: where the engine flags start. */
static void server_argv(const char **argv, int *flags, const char *model, const char *port, const pass_arg *pass,
                        int n_pass, size_t k)
{
    int n = 0;
    argv[n++] = "blade";
    argv[n++] = "serve";
    argv[n++] = "-m";
    argv[n++] = model;
    argv[n++] = "--host";
    argv[n++] = "127.0.0.1";
    argv[n++] = "--port";
    argv[n++] = port;
    *flags = n;
    for (int i = 0; i < n_pass; i++) {
        argv[n++] = pass[i].flag;
        if (pass[i].value)
            argv[n++] = pass[i].value;
    }
    for (size_t t = 0; t < N_TECHNIQUES; t++) {
        const char *const *flags = t < k ? techniques[t].on : techniques[t].off;
        for (int j = 0; j < 3 && flags[j]; j++)
            argv[n++] = flags[j];
    }
    argv[n] = NULL;
}

static void print_argv(FILE *out, const char *const *argv)
{
    for (int i = 0; argv[i]; i++)
        fprintf(out, "%s%s", i ? " " : "", argv[i]);
    fprintf(out, "\n");
}

/* The wait status of the stopped server. */
static int server_stop(server_proc *sp)
{
    if (sp->pid <= 0)
        return 0;
    kill(sp->pid, SIGTERM);
    int st = 0;
    pid_t got = 0;
    for (int i = 0; i < 3000 && (got = waitpid(sp->pid, &st, WNOHANG)) == 0; i++)
        usleep(20000);
    if (got == 0) {
        fprintf(stderr, "warning: blade serve (pid %d) did not stop within 60 s of SIGTERM; killing it\n",
                (int)sp->pid);
        kill(sp->pid, SIGKILL);
        waitpid(sp->pid, &st, 0);
    }
    sp->pid = 0;
    return st;
}

/* Starts blade serve on the port argv names and waits until GET /health answers 200. */
static int server_start(server_proc *sp, const char *const *argv, int port)
{
    snprintf(sp->url, sizeof sp->url, "http://127.0.0.1:%d", port);
    const char *tmp = getenv("TMPDIR");
    snprintf(sp->log_path, sizeof sp->log_path, "%s/blade-ablation-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    int log = mkstemp(sp->log_path);
    if (log < 0) {
        fprintf(stderr, "error: cannot create a server log in %s\n", tmp && *tmp ? tmp : "/tmp");
        return -1;
    }
    printf("  $ ");
    print_argv(stdout, argv);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        /* A server must not outlive an interrupted ablation. */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        dup2(log, STDOUT_FILENO);
        dup2(log, STDERR_FILENO);
        close(log);
        execv("/proc/self/exe", (char *const *)argv);
        _exit(127);
    }
    close(log);
    if (pid < 0) {
        fprintf(stderr, "error: cannot start blade serve\n");
        return -1;
    }
    sp->pid = pid;
    double deadline = cli_now() + 600;
    while (cli_now() < deadline) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            sp->pid = 0;
            fprintf(stderr, "error: blade serve exited before it was ready\n");
            print_log_tail(sp->log_path);
            return -1;
        }
        long status = 0;
        char *body = NULL;
        if (lg_http_get(sp->url, "/health", NULL, 2, &status, &body, NULL) == 0 && status == 200) {
            free(body);
            return 0;
        }
        free(body);
        usleep(100000);
    }
    fprintf(stderr, "error: blade serve was not ready after 600 s\n");
    server_stop(sp);
    print_log_tail(sp->log_path);
    return -1;
}

typedef struct ablation_row {
    char name[64];
    lg_summary sum;
    json_t *flags;
} ablation_row;

static void ratio_cell(char *buf, size_t cap, double v)
{
    if (isnan(v))
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "x%.2f", v);
}

static void print_ablation_table(FILE *out, const ablation_row *rows, size_t n, bool priced)
{
    fprintf(out, "\n%-24s %8s %10s %9s %9s %9s %9s %8s %10s %8s %8s %7s\n", "configuration", "req/s", "out tok/s",
            "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "KV util", priced ? "$/1M tok" : "h/1M tok",
            "tok/s", "cost", "failed");
    fprintf(out, "%-24s %8s %10s %9s %9s %9s %9s %8s %10s %8s %8s %7s\n", "", "", "", "(ms)", "(ms)", "(ms)", "(ms)",
            "", "(total)", "vs base", "vs base", "");
    const lg_summary *b = &rows[0].sum;
    double base_cost = priced ? b->cost_total : b->hours_total;
    for (size_t i = 0; i < n; i++) {
        const lg_summary *s = &rows[i].sum;
        char util[16] = "-", tok[16], cost[16];
        if (!isnan(s->kv_utilisation))
            snprintf(util, sizeof util, "%.1f%%", s->kv_utilisation * 100);
        double c = priced ? s->cost_total : s->hours_total;
        ratio_cell(tok, sizeof tok, s->total_throughput / b->total_throughput);
        ratio_cell(cost, sizeof cost, c / base_cost);
        fprintf(out, "%-24s %8.2f %10.1f %9.1f %9.1f %9.2f %9.2f %8s %10.4f %8s %8s %7zu\n", rows[i].name,
                s->request_throughput, s->output_throughput, s->ttft.median, s->ttft.p99, s->tpot.median, s->tpot.p99,
                util, c, tok, cost, s->failed);
    }
    if (!priced)
        fprintf(out, "(cost in instance-hours per million tokens; --price-per-hour P prices it)\n");
}

static int ablation_main(int argc, char **argv)
{
    ablation_options opts;
    int status = cli_parse(&cli_cmd_bench_ablation, argc, argv, &opts);
    if (status != CLI_RUN)
        return status;
    cli_load_options o = opts.load;
    const pass_arg *pass = opts.pass;
    int n_pass = opts.n_pass;
    const char *model = opts.model;
    if (!model && !(model = cli_default_model()))
        return cli_usage_error(&cli_cmd_bench_ablation, "no model given (-m FILE)");
    if (cli_load_finalize(&o, &cli_cmd_bench_ablation))
        return 2;

    status = 1;
    cli_raise_fd_limit();
    curl_global_init(CURL_GLOBAL_DEFAULT);
    blade_tokenizer *tok = NULL;
    ablation_row rows[N_TECHNIQUES + 1];
    size_t n_rows = 0;
    char *listed = NULL;
    server_proc sp = {0};
    blade_error err = {{0}};
    if (!(tok = blade_tokenizer_load_file(model, &err))) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto out;
    }
    const char *server_args[MAX_SERVER_ARGS];
    int32_t max_context = 0;
    for (size_t k = 0; k <= N_TECHNIQUES; k++) {
        ablation_row *row = &rows[k];
        if (k == 0)
            snprintf(row->name, sizeof row->name, "baseline");
        else
            snprintf(row->name, sizeof row->name, "+ %s", techniques[k - 1].name);
        int port = free_port(), first_flag;
        if (port < 0) {
            fprintf(stderr, "error: no free loopback port\n");
            goto out;
        }
        char port_text[16];
        snprintf(port_text, sizeof port_text, "%d", port);
        server_argv(server_args, &first_flag, model, port_text, pass, n_pass, k);
        printf("[%zu/%zu] %s\n", k + 1, N_TECHNIQUES + 1, row->name);
        fflush(stdout);
        if (server_start(&sp, server_args, port))
            goto out;
        if (k == 0 && cli_load_query_models(sp.url, o.api_key, &listed, &max_context)) {
            server_stop(&sp);
            goto out;
        }
        cli_load_target t = {.url = sp.url, .model = listed, .tokenizer_path = model, .max_context = max_context};
        lg_run_result res;
        int rc = cli_load_run(&o, &t, tok, &res, &row->sum);
        int st = server_stop(&sp);
        if (rc) {
            print_log_tail(sp.log_path);
            goto out;
        }
        lg_run_result_free(&res);
        if (WIFSIGNALED(st))
            fprintf(stderr, "warning: blade serve died of signal %d (%s) (log kept: %s)\n", WTERMSIG(st),
                    strsignal(WTERMSIG(st)), sp.log_path);
        else if (WEXITSTATUS(st) != 0)
            fprintf(stderr, "warning: blade serve exited with status %d (log kept: %s)\n", WEXITSTATUS(st),
                    sp.log_path);
        else
            unlink(sp.log_path);
        row->flags = json_array();
        for (int i = first_flag; server_args[i]; i++)
            json_array_append_new(row->flags, json_string(server_args[i]));
        n_rows++;
        printf("  %.2f requests/s, %.1f output tokens/s, TTFT p50 %.1f ms, TPOT p50 %.2f ms, %zu failed; client CPU "
               "%.1f%% of a core\n",
               row->sum.request_throughput, row->sum.output_throughput, row->sum.ttft.median, row->sum.tpot.median,
               row->sum.failed, row->sum.client_cpu_share * 100);
        fflush(stdout);
    }
    print_ablation_table(stdout, rows, n_rows, o.price_per_hour > 0);
    if (o.json_path) {
        json_t *rows_json = json_array();
        for (size_t i = 0; i < n_rows; i++) {
            json_t *r = json_pack("{s:s, s:O}", "name", rows[i].name, "serve_flags", rows[i].flags);
            lg_summary_to_json(&rows[i].sum, r);
            json_array_append_new(rows_json, r);
        }
        json_t *doc = json_pack("{s:i, s:o, s:o, s:{s:o, s:o, s:o}, s:o}", "blade_bench_ablation", 1, "date",
                                cli_json_now(), "model", lg_json_text(model), "config", "workload",
                                cli_load_workload_json(&o), "load", cli_load_json(&o), "price_per_hour",
                                o.price_per_hour > 0 ? json_real(o.price_per_hour) : json_null(), "rows", rows_json);
        int w = cli_json_write(o.json_path, doc);
        json_decref(doc);
        if (w)
            goto out;
        printf("wrote %s\n", o.json_path);
    }
    status = 0;
out:
    for (size_t i = 0; i < n_rows; i++)
        json_decref(rows[i].flags);
    blade_tokenizer_free(tok);
    free(listed);
    curl_global_cleanup();
    return status;
}

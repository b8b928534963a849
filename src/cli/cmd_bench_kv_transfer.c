/* `blade bench kv-transfer`: how long moving a request's KV cache between two workers takes
 * over the UCX transport: encoding (digest), the wire, and decoding (digest check + copy
 * into the receiver's blocks), between two network namespaces joined by a veth bridge (or
 * over loopback). The two ends are this program re-executed with a hidden --role, since
 * UCX must start fresh in each process. */

#include "blade/kv_transport.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cluster/netns.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PORT_BASE 24000

typedef struct params {
    long long tokens, reps, layers, heads, dim, block_size;
    int kv_type;
    bool copy;
    const char *key_file;
    /* the command line only */
    const char *shape, *net, *role, *peer;
    bool no_key;
} params;

static blade_kv_store *make_store(const params *p, int32_t n_blocks, bool fill)
{
    blade_kv_store_config cfg = {.n_layer = (int32_t)p->layers, .n_head_kv = (int32_t)p->heads,
                                 .head_dim = (int32_t)p->dim, .type = p->kv_type,
                                 .block_size = (int32_t)p->block_size, .n_blocks = n_blocks};
    blade_error err = {{0}};
    blade_kv_store *s = blade_kv_store_new(&cfg, &err);
    if (!s) {
        fprintf(stderr, "error: %s\n", err.msg);
        return NULL;
    }
    if (fill) {
        /* Arbitrary bytes: the transport neither knows nor cares what they mean. */
        size_t area = (size_t)s->n_layer * (size_t)s->n_blocks * s->block_stride;
        uint64_t x = 0x9e3779b97f4a7c15ull;
        for (size_t i = 0; i + 8 <= area; i += 8) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            memcpy(s->k + i, &x, 8);
            memcpy(s->v + i, &x, 8);
        }
    }
    return s;
}

static const uint8_t fingerprint[32] = "blade bench kv-transfer";

static int load_key(const params *p, blade_cluster_key *key, const blade_cluster_key **out)
{
    *out = NULL;
    if (!p->key_file)
        return 0;
    blade_error err = {{0}};
    if (blade_cluster_key_load(p->key_file, key, NULL, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return -1;
    }
    *out = key;
    return 0;
}

static int32_t blocks_of(const params *p)
{
    return (int32_t)((p->tokens + p->block_size - 1) / p->block_size);
}

/* ---- the two ends ---- */

static int receiver(const params *p, const char *host, uint16_t port)
{
    blade_cluster_key keybuf;
    const blade_cluster_key *key;
    if (load_key(p, &keybuf, &key))
        return 1;
    int32_t n_blocks = blocks_of(p);
    blade_kv_store *s = make_store(p, n_blocks, false);
    int32_t *dst = malloc((size_t)n_blocks * sizeof *dst);
    if (!s || !dst)
        return 1;
    for (int32_t i = 0; i < n_blocks; i++)
        dst[i] = n_blocks - 1 - i; /* not the sender's order: the copy must follow the table */
    blade_error err = {{0}};
    blade_kv_transport_config cfg = {.key = key, .timeout_ms = 30000, .transports = "tcp"};
    blade_kv_transport *t = blade_kv_transport_new(&cfg, &err);
    blade_kv_conn *c = NULL;
    int rc = 1;
    if (!t || blade_kv_transport_listen(t, host, port, &err) || !(c = blade_kv_transport_accept(t, 30000, &err)))
        goto out;
    blade_kv_wire_expect x = {.fingerprint = fingerprint, .key = key, .n_vocab = 1 << 30, .max_tokens = (int32_t)p->tokens};
    size_t max = blade_kv_wire_max_frame_bytes(s, (int32_t)p->tokens, n_blocks);
    for (long long r = 0; r <= p->reps; r++) {
        void *buf;
        size_t len;
        if (blade_kv_recv(c, max, &buf, &len, &err))
            goto out;
        double t0 = cli_now();
        x.transfer_id = (uint64_t)r;
        blade_kv_wire_received got;
        int d = blade_kv_wire_decode(buf, len, &x, s, dst, n_blocks, &got, &err);
        double decode = cli_now() - t0;
        free(buf);
        if (d)
            goto out;
        blade_kv_wire_received_free(&got);
        struct iovec ack = {&decode, sizeof decode};
        if (blade_kv_send(c, &ack, 1, &err))
            goto out;
    }
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "receiver: %s\n", err.msg);
    blade_kv_conn_close(c);
    blade_kv_transport_free(t);
    blade_kv_store_free(s);
    free(dst);
    return rc;
}

typedef struct stat_acc {
    double sum, sum2, best;
    int n;
} stat_acc;

static void add(stat_acc *a, double v)
{
    a->sum += v;
    a->sum2 += v * v;
    a->best = a->n == 0 || v < a->best ? v : a->best;
    a->n++;
}
static double mean(const stat_acc *a)
{
    return a->sum / a->n;
}
static double sd(const stat_acc *a)
{
    double m = mean(a), v = a->sum2 / a->n - m * m;
    return v > 0 ? sqrt(v) : 0;
}

static int sender(const params *p, const char *host, uint16_t port)
{
    blade_cluster_key keybuf;
    const blade_cluster_key *key;
    if (load_key(p, &keybuf, &key))
        return 1;
    int32_t n_blocks = blocks_of(p), n_full = (int32_t)(p->tokens / p->block_size);
    blade_kv_store *s = make_store(p, n_blocks, true);
    int32_t *blocks = malloc((size_t)n_blocks * sizeof *blocks);
    int32_t *tokens = malloc((size_t)p->tokens * sizeof *tokens);
    uint8_t(*hashes)[BLADE_HASH_BYTES] = calloc((size_t)n_full + 1, BLADE_HASH_BYTES);
    if (!s || !blocks || !tokens || !hashes)
        return 1;
    for (int32_t i = 0; i < n_blocks; i++)
        blocks[i] = i;
    for (long long i = 0; i < p->tokens; i++)
        tokens[i] = (int32_t)(i * 7919 % 32000);
    blade_error err = {{0}};
    blade_kv_transport_config cfg = {.key = key, .timeout_ms = 30000, .transports = "tcp", .copy_payload = p->copy};
    blade_kv_transport *t = blade_kv_transport_new(&cfg, &err);
    blade_kv_conn *c = NULL;
    /* The receiver may still be starting. */
    for (int attempt = 0; t && !c && attempt < 100; attempt++) {
        c = blade_kv_transport_connect(t, host, port, &err);
        if (!c)
            usleep(100 * 1000);
    }
    stat_acc enc = {0}, wire = {0}, dec = {0}, total = {0};
    size_t frame_bytes = 0;
    int rc = 1;
    if (!c)
        goto out;
    for (long long r = 0; r <= p->reps; r++) {
        blade_kv_wire_source src = {.store = s, .fingerprint = fingerprint, .transfer_id = (uint64_t)r,
                                    .tokens = tokens, .n_tokens = (int32_t)p->tokens,
                                    .hashes = (const uint8_t (*)[BLADE_HASH_BYTES])hashes, .blocks = blocks};
        blade_kv_wire_frame_out f;
        double t0 = cli_now();
        if (blade_kv_wire_encode(&src, key, &f, &err))
            goto out;
        double t1 = cli_now();
        void *ack = NULL;
        size_t len = 0;
        int sent = blade_kv_send_frame(c, &f, &err);
        if (sent == 0)
            sent = blade_kv_recv(c, sizeof(double), &ack, &len, &err);
        double t2 = cli_now();
        frame_bytes = f.frame_bytes;
        blade_kv_wire_frame_out_free(&f);
        if (sent || len != sizeof(double)) {
            free(ack);
            if (!sent)
                blade_error_set(&err, "malformed ack");
            goto out;
        }
        double decode;
        memcpy(&decode, ack, sizeof decode);
        free(ack);
        if (r == 0)
            continue; /* warm-up: connections and page faults */
        add(&enc, t1 - t0);
        add(&wire, t2 - t1 - decode);
        add(&dec, decode);
        add(&total, t2 - t0);
    }
    double per_k = 1000.0 / (double)p->tokens;
    printf("frame: %lld tokens, %d blocks, %.2f MiB (%.1f KiB a token)\n", p->tokens, n_blocks,
           frame_bytes / 1048576.0, frame_bytes / 1024.0 / (double)p->tokens);
    printf("%-8s %10s %10s %10s\n", "", "mean ms", "sd ms", "best ms");
    const char *names[] = {"encode", "wire", "decode", "total"};
    stat_acc *accs[] = {&enc, &wire, &dec, &total};
    for (int i = 0; i < 4; i++)
        printf("%-8s %10.3f %10.3f %10.3f\n", names[i], 1e3 * mean(accs[i]), 1e3 * sd(accs[i]), 1e3 * accs[i]->best);
    printf("total per 1k tokens: %.3f ms (best %.3f ms)\n", 1e3 * mean(&total) * per_k, 1e3 * total.best * per_k);
    printf("wire throughput: %.3f GB/s (best %.3f GB/s); end to end %.3f GB/s\n", frame_bytes / mean(&wire) / 1e9,
           frame_bytes / wire.best / 1e9, frame_bytes / mean(&total) / 1e9);
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "sender: %s\n", err.msg);
    blade_kv_conn_close(c);
    blade_kv_transport_free(t);
    blade_kv_store_free(s);
    free(blocks);
    free(tokens);
    free(hashes);
    return rc;
}

/* ---- the coordinator ---- */

static void cpu_name(char *out, size_t cap)
{
    snprintf(out, cap, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            snprintf(out, cap, "%s", strchr(line, ':') + 2);
            out[strcspn(out, "\n")] = 0;
            break;
        }
    if (f)
        fclose(f);
}

/* argv for one end: this program with the same options and its role. */
static char **role_argv(const params *p, const char *role, const char *host, uint16_t port, char store[][32])
{
    static char *argv[32];
    int n = 0, k = 0;
    argv[n++] = "/proc/self/exe";
    argv[n++] = "bench";
    argv[n++] = "kv-transfer";
#define ARG(fmt, ...) (snprintf(store[k], 32, fmt, __VA_ARGS__), argv[n++] = store[k++])
    argv[n++] = "--role";
    argv[n++] = (char *)role;
    argv[n++] = "--peer";
    ARG("%s:%u", host, port);
    argv[n++] = "--tokens";
    ARG("%lld", p->tokens);
    argv[n++] = "-r";
    ARG("%lld", p->reps);
    argv[n++] = "--shape";
    ARG("%lld,%lld,%lld", p->layers, p->heads, p->dim);
    argv[n++] = "--block-size";
    ARG("%lld", p->block_size);
    argv[n++] = "--kv-type";
    argv[n++] = (char *)blade_kv_type_name(p->kv_type);
#undef ARG
    if (p->copy)
        argv[n++] = "--copy";
    if (p->key_file) {
        argv[n++] = "--key-file";
        argv[n++] = (char *)p->key_file;
    }
    argv[n] = NULL;
    return argv;
}

static int coordinate(params *p, bool netns, bool keyed)
{
    char key_path[] = "/tmp/blade-kv-bench-key-XXXXXX";
    if (keyed) {
        uint8_t raw[32];
        char hex[65];
        int fd = mkstemp(key_path);
        if (fd < 0 || blade_cluster_nonce(raw)) {
            fprintf(stderr, "error: cannot make a temporary cluster key\n");
            return 1;
        }
        for (int i = 0; i < 32; i++)
            snprintf(hex + 2 * i, 3, "%02x", raw[i]);
        if (write(fd, hex, 64) != 64) {
            close(fd);
            unlink(key_path);
            return 1;
        }
        close(fd);
        p->key_file = key_path;
    }
    char cpu[128];
    cpu_name(cpu, sizeof cpu);
    printf("blade bench kv-transfer: %s, %s, %s; CPU: %s\n", blade_kv_transport_ucx_version(),
           netns ? "UCX tcp between two network namespaces (veth + bridge)" : "UCX tcp over loopback",
           keyed ? "HMAC-SHA256" : "SHA-256 checksum", cpu);
    printf("shape: %lld layers x %lld KV heads x %lld dims, %s, blocks of %lld tokens; payload sent %s\n", p->layers,
           p->heads, p->dim, blade_kv_type_name(p->kv_type), p->block_size,
           p->copy ? "after copying into one buffer" : "from the blocks in place (iovec)");
    fflush(stdout);

    blade_netns net = {0};
    blade_error err = {{0}};
    int rc = 1;
    uint16_t port = (uint16_t)(PORT_BASE + getpid() % 8000);
    const char *rx_host = "127.0.0.1";
    char store_rx[16][32], store_tx[16][32];
    if (netns) {
        if (blade_netns_create(&net, 2, &err)) {
            fprintf(stderr, "error: %s\n", err.msg);
            goto out;
        }
        rx_host = net.addr[0];
    } else {
        /* The ends still run as separate processes, here in our own namespace. */
        net.n = 2;
    }
    pid_t rx = netns ? blade_netns_spawn_cmd(&net, 0, role_argv(p, "receiver", rx_host, port, store_rx), NULL, &err)
                     : -1;
    if (!netns) {
        rx = fork();
        if (rx == 0) {
            execv("/proc/self/exe", role_argv(p, "receiver", rx_host, port, store_rx));
            _exit(127);
        }
        net.children[net.n_children++] = rx;
    }
    pid_t tx = -1;
    if (rx > 0 && netns)
        tx = blade_netns_spawn_cmd(&net, 1, role_argv(p, "sender", rx_host, port, store_tx), NULL, &err);
    else if (rx > 0) {
        fflush(stdout);
        tx = fork();
        if (tx == 0) {
            execv("/proc/self/exe", role_argv(p, "sender", rx_host, port, store_tx));
            _exit(127);
        }
        net.children[net.n_children++] = tx;
    }
    if (tx <= 0) {
        fprintf(stderr, "error: %s\n", err.msg);
        goto out;
    }
    int tx_status = blade_netns_wait(&net, tx, 600000);
    int rx_status = blade_netns_wait(&net, rx, 5000);
    rc = tx_status == 0 && rx_status == 0 ? 0 : 1;
out:
    if (netns)
        blade_netns_destroy(&net);
    if (keyed)
        unlink(key_path);
    return rc;
}

static void kv_transfer_init(void *opts)
{
    params *p = opts;
    *p = (params){.tokens = 1024, .reps = 10, .block_size = 16, .kv_type = BLADE_KV_F16, .shape = "22,4,64"};
}

static const cli_choice kv_transfer_types[] = {{"f16", BLADE_KV_F16}, {"bf16", BLADE_KV_BF16}, {"f32", BLADE_KV_F32},
                                               {NULL, 0}};

#define P params
static const cli_flag kv_transfer_flags[] = {
    {.name = "tokens", .kind = CLI_INT, CLI_AT(P, tokens), .min = 1, .max = BLADE_KV_WIRE_MAX_TOKENS, .metavar = "N",
     .help = "tokens of the request"},
    {.name = "repetitions", .letter = 'r', .kind = CLI_INT, CLI_AT(P, reps), .min = 1, .max = 10000, .metavar = "R",
     .help = "transfers measured"},
    {.name = "shape", .kind = CLI_STRING, CLI_AT(P, shape), .metavar = "L,H,D", .help = "layers, KV heads, head dim"},
    {.name = "block-size", .kind = CLI_INT, CLI_AT(P, block_size), .min = 1, .max = 4096, .metavar = "B",
     .help = "tokens per KV block"},
    {.name = "kv-type", .kind = CLI_ENUM, CLI_AT(P, kv_type), .choices = kv_transfer_types, .metavar = "T",
     .help = "KV element type"},
    {.name = "net", .kind = CLI_STRING, CLI_AT(P, net), .metavar = "MODE", .dflt = "netns when root",
     .help = "netns: two network namespaces over a veth bridge, UCX over TCP; loopback: both ends on 127.0.0.1 in "
             "this namespace"},
    {.name = "copy", .kind = CLI_BOOL, CLI_AT(P, copy),
     .help = "copy each frame into one buffer before sending (what sending from the blocks in place saves)"},
    {.name = "no-key", .kind = CLI_BOOL, CLI_AT(P, no_key),
     .help = "no cluster key: SHA-256 checksums instead of HMACs (loopback only)"},
    CLI_SECTION("internal (the two ends the command starts)"),
    {.name = "role", .kind = CLI_STRING, CLI_AT(P, role), .metavar = "END", .help = "receiver or sender"},
    {.name = "peer", .kind = CLI_STRING, CLI_AT(P, peer), .metavar = "HOST:PORT", .help = "the other end"},
    {.name = "key-file", .kind = CLI_PATH, CLI_AT(P, key_file), .metavar = "FILE", .help = "the cluster key"},
    {0},
};
#undef P

static int kv_transfer_main(int argc, char **argv);

const cli_command cli_cmd_bench_kv_transfer = {
    .name = "bench kv-transfer",
    .summary = "KV cache transfer between two workers (UCX)",
    .synopsis = "[--tokens N] [-r R] [--shape L,H,D] [--net netns|loopback] [options]",
    .about = "Moves one request's KV blocks (all layers, K and V) from a sender's paged store to a receiver's,\n"
             "R times after one warm-up, and prints per transfer (mean +- sd, and the best):\n"
             "  encode   building the frame: header, tables, HMAC-SHA256 over every byte\n"
             "  wire     from the first byte sent to the receiver holding the whole frame, plus its ack\n"
             "  decode   the receiver's checks, HMAC verification and copy into its free blocks\n"
             "  total    encode + wire + decode, also as ms per 1000 tokens, and the wire's GB/s\n"
             "The default shape is TinyLlama-1.1B's KV (22 layers x 4 KV heads x 64 dims, f16: 22.5 KiB a token).\n",
    .tables = (const cli_table[]){{kv_transfer_flags, 0}, {0}},
    .opts_size = sizeof(params),
    .init = kv_transfer_init,
    .main = kv_transfer_main,
};

static int kv_transfer_main(int argc, char **argv)
{
    params p;
    int prc = cli_parse(&cli_cmd_bench_kv_transfer, argc, argv, &p);
    if (prc != CLI_RUN)
        return prc;
    if (sscanf(p.shape, "%lld,%lld,%lld", &p.layers, &p.heads, &p.dim) != 3 || p.layers < 1 || p.heads < 1 ||
        p.dim < 1 || p.layers > 1024 || p.heads > 1024 || p.dim > 4096)
        return cli_usage_error(&cli_cmd_bench_kv_transfer, "--shape expects LAYERS,KV_HEADS,HEAD_DIM, got '%s'",
                               p.shape);
    const char *role = p.role, *peer = p.peer, *net = p.net;
    bool keyed = !p.no_key;
    if (role) {
        char host[64];
        unsigned port;
        if (!peer || sscanf(peer, "%63[^:]:%u", host, &port) != 2 || port > 65535) {
            fprintf(stderr, "error: --role needs --peer HOST:PORT\n");
            return 2;
        }
        return !strcmp(role, "receiver") ? receiver(&p, host, (uint16_t)port) : sender(&p, host, (uint16_t)port);
    }
    bool netns;
    blade_error why = {{0}};
    if (!net) {
        netns = blade_netns_usable(&why);
        if (!netns)
            fprintf(stderr, "note: %s; measuring over loopback instead\n", why.msg);
    } else if (!strcmp(net, "netns")) {
        if (!blade_netns_usable(&why)) {
            fprintf(stderr, "error: %s\n", why.msg);
            return 1;
        }
        netns = true;
    } else if (!strcmp(net, "loopback")) {
        netns = false;
    } else {
        return cli_usage_error(&cli_cmd_bench_kv_transfer, "--net expects netns or loopback, got '%s'", net);
    }
    if (!keyed && netns) {
        fprintf(stderr, "error: --no-key works over loopback only: a listener on another address needs a cluster key\n");
        return 2;
    }
    return coordinate(&p, netns, keyed);
}

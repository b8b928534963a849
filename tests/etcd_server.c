/* A private etcd per test (etcd_server.h). */

#include "etcd_server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *etcd_binary(void)
{
    static const char *const paths[] = {"/usr/bin/etcd", "/usr/local/bin/etcd"};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++)
        if (access(paths[i], X_OK) == 0)
            return paths[i];
    return NULL;
}

/* A loopback port nobody listens on now (the kernel's choice for an ephemeral bind). */
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

static bool answers(const etcd_server *s)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)s->client_port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bool ok = false;
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
        static const char req[] = "GET /health HTTP/1.0\r\n\r\n";
        char buf[512] = "";
        struct timeval tv = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        if (write(fd, req, sizeof req - 1) == (ssize_t)(sizeof req - 1)) {
            size_t n = 0;
            ssize_t got;
            while (n < sizeof buf - 1 && (got = read(fd, buf + n, sizeof buf - 1 - n)) > 0)
                n += (size_t)got;
            buf[n] = 0;
            ok = strstr(buf, "\"health\":\"true\"") != NULL;
        }
    }
    if (fd >= 0)
        close(fd);
    return ok;
}

static int spawn(etcd_server *s)
{
    char client[64], peer[64], cluster[96], data[300];
    snprintf(client, sizeof client, "http://127.0.0.1:%d", s->client_port);
    snprintf(peer, sizeof peer, "http://127.0.0.1:%d", s->peer_port);
    snprintf(cluster, sizeof cluster, "t=%s", peer);
    snprintf(data, sizeof data, "%s/data", s->dir);
    /* Short raft timers: a single member elects itself fast and leases can be short. */
    char *argv[] = {(char *)etcd_binary(), "--name", "t", "--data-dir", data, "--listen-client-urls", client,
                    "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                    peer, "--initial-cluster", cluster, "--heartbeat-interval", "50", "--election-timeout", "250",
                    "--logger", "zap", "--log-outputs", "stderr", NULL};
    fflush(stdout);
    fflush(stderr);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        /* a test that dies before its teardown must not leave etcd running */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
            _exit(125);
        int fd = open(s->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    s->pid = pid;
    for (int i = 0; i < 200; i++) {
        if (answers(s))
            return 0;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            s->pid = 0;
            fprintf(stderr, "etcd exited at start; its log: %s\n", s->log);
            return -1;
        }
        struct timespec ms50 = {0, 50 * 1000 * 1000};
        nanosleep(&ms50, NULL);
    }
    fprintf(stderr, "etcd did not answer within 10 s; its log: %s\n", s->log);
    etcd_server_kill(s);
    return -1;
}

int etcd_server_start(etcd_server *s)
{
    static int counter;
    memset(s, 0, sizeof *s);
    mkdir(BLADE_TEST_TMPDIR, 0755);
    snprintf(s->dir, sizeof s->dir, "%s/etcd-%d-%d", BLADE_TEST_TMPDIR, (int)getpid(), counter++);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", s->dir);
    if (system(cmd) != 0 || mkdir(s->dir, 0700) != 0) {
        fprintf(stderr, "cannot create %s: %s\n", s->dir, strerror(errno));
        return -1;
    }
    snprintf(s->log, sizeof s->log, "%s/etcd.log", s->dir);
    s->client_port = free_port();
    do
        s->peer_port = free_port();
    while (s->peer_port == s->client_port);
    snprintf(s->url, sizeof s->url, "http://127.0.0.1:%d", s->client_port);
    return spawn(s);
}

void etcd_server_kill(etcd_server *s)
{
    if (s->pid > 0) {
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
    }
    s->pid = 0;
}

int etcd_server_restart(etcd_server *s)
{
    etcd_server_kill(s);
    return spawn(s);
}

int etcd_server_restart_empty(etcd_server *s)
{
    etcd_server_kill(s);
    char cmd[320];
    snprintf(cmd, sizeof cmd, "rm -rf '%s/data'", s->dir);
    if (system(cmd) != 0)
        return -1;
    return spawn(s);
}

void etcd_server_stop(etcd_server *s)
{
    etcd_server_kill(s);
    if (s->dir[0]) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", s->dir);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", s->dir);
    }
}

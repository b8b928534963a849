/* Private networks of namespaces for tests and benchmarks (netns.h), made and removed
 * with iproute2's `ip` so the steps are the ones an operator would type. */

#include "cluster/netns.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NETNS_DIR "/run/netns"
#define PREFIX "bladens-"

/* Runs `ip` with the space-separated words of the formatted command; 0 on success, else
 * -1 with ip's own complaint in err. */
static int run_ip(blade_error *err, const char *fmt, ...) BLADE_PRINTF(2, 3);
static int run_ip(blade_error *err, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    char copy[512], *argv[48];
    int argc = 0;
    argv[argc++] = "ip";
    snprintf(copy, sizeof copy, "%s", line);
    for (char *save, *w = strtok_r(copy, " ", &save); w && argc < 47; w = strtok_r(NULL, " ", &save))
        argv[argc++] = w;
    argv[argc] = NULL;
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) != 0)
        return blade_error_set(err, "ip %s: pipe: %s", line, strerror(errno));
    pid_t pid = fork();
    if (pid == 0) {
        int devnull = open("/dev/null", O_RDWR);
        dup2(devnull, 0);
        dup2(devnull, 1);
        dup2(pipefd[1], 2);
        execvp("ip", argv);
        _exit(127);
    }
    close(pipefd[1]);
    char msg[256] = "";
    size_t n = 0;
    ssize_t got;
    while (pid > 0 && (got = read(pipefd[0], msg + n, sizeof msg - 1 - n)) > 0)
        n += (size_t)got;
    msg[n] = 0;
    close(pipefd[0]);
    if (pid < 0)
        return blade_error_set(err, "ip %s: fork: %s", line, strerror(errno));
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
        return 0;
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == ' '))
        msg[--n] = 0;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127)
        return blade_error_set(err, "`ip` (iproute2) not found");
    return blade_error_set(err, "ip %s: %s", line, n ? msg : "failed");
}

bool blade_netns_usable(blade_error *why)
{
    if (geteuid() != 0) {
        blade_error_set(why, "network namespaces need root (running as uid %u)", (unsigned)geteuid());
        return false;
    }
    char probe[64];
    snprintf(probe, sizeof probe, PREFIX "%d-probe", (int)getpid());
    if (run_ip(why, "netns add %s", probe))
        return false;
    run_ip(NULL, "netns del %s", probe);
    return true;
}

int blade_netns_cleanup_stale(void)
{
    DIR *d = opendir(NETNS_DIR);
    if (!d)
        return 0;
    int removed = 0;
    struct dirent *e;
    char names[256][256];
    int n = 0;
    while ((e = readdir(d)) && n < 256) {
        if (strncmp(e->d_name, PREFIX, strlen(PREFIX)))
            continue;
        long pid = strtol(e->d_name + strlen(PREFIX), NULL, 10);
        if (pid > 0 && (kill((pid_t)pid, 0) == 0 || errno != ESRCH))
            continue;
        snprintf(names[n++], sizeof names[0], "%s", e->d_name);
    }
    closedir(d);
    for (int i = 0; i < n; i++)
        removed += run_ip(NULL, "netns del %s", names[i]) == 0;
    return removed;
}

int blade_netns_create(blade_netns *net, int n, blade_error *err)
{
    static int counter;
    memset(net, 0, sizeof *net);
    if (n < 1 || n > BLADE_NETNS_MAX_HOSTS)
        return blade_error_set(err, "netns: %d hosts (1 to %d)", n, BLADE_NETNS_MAX_HOSTS);
    blade_netns_cleanup_stale();
    snprintf(net->prefix, sizeof net->prefix, PREFIX "%d-%d", (int)getpid(), __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED));
    snprintf(net->hub, sizeof net->hub, "%s-hub", net->prefix);
    if (run_ip(err, "netns add %s", net->hub))
        return -1;
    net->n = 0;
    if (run_ip(err, "-n %s link add br0 type bridge", net->hub) || run_ip(err, "-n %s link set br0 up", net->hub))
        goto fail;
    for (int i = 0; i < n; i++) {
        snprintf(net->name[i], sizeof net->name[i], "%s-h%d", net->prefix, i);
        snprintf(net->addr[i], sizeof net->addr[i], "10.77.0.%d", i + 1);
        if (run_ip(err, "netns add %s", net->name[i]))
            goto fail;
        net->n = i + 1;
        /* Both ends are created inside their namespaces: nothing ever appears in ours. */
        if (run_ip(err, "link add v%d netns %s type veth peer name eth0 netns %s", i, net->hub, net->name[i]) ||
            run_ip(err, "-n %s link set v%d master br0", net->hub, i) ||
            run_ip(err, "-n %s link set v%d up", net->hub, i) ||
            run_ip(err, "-n %s addr add %s/24 dev eth0", net->name[i], net->addr[i]) ||
            run_ip(err, "-n %s link set eth0 up", net->name[i]) || run_ip(err, "-n %s link set lo up", net->name[i]))
            goto fail;
    }
    return 0;
fail:
    blade_error_prefix(err, "creating network namespaces");
    blade_netns_destroy(net);
    return -1;
}

int blade_netns_enter(const blade_netns *net, int i, blade_error *err)
{
    char path[128];
    snprintf(path, sizeof path, NETNS_DIR "/%s", net->name[i]);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return blade_error_set(err, "netns %s: %s", path, strerror(errno));
    int rc = setns(fd, CLONE_NEWNET);
    int e = errno;
    close(fd);
    if (rc != 0)
        return blade_error_set(err, "entering netns %s: %s", net->name[i], strerror(e));
    return 0;
}

static pid_t spawn(blade_netns *net, int i, int (*fn)(void *), void *arg, char *const argv[], const char *log_path,
                   blade_error *err)
{
    if (i < 0 || i >= net->n)
        return blade_error_set(err, "netns: no host %d (of %d)", i, net->n);
    if (net->n_children == BLADE_NETNS_MAX_CHILDREN)
        return blade_error_set(err, "netns: more than %d children", BLADE_NETNS_MAX_CHILDREN);
    fflush(stdout);
    fflush(stderr);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return blade_error_set(err, "netns: fork: %s", strerror(errno));
    if (pid == 0) {
        /* A test that dies (a failed assertion, ctest's timeout) must not leave servers
         * running: they go with it. */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
            _exit(125);
        blade_error e = {{0}};
        if (blade_netns_enter(net, i, &e)) {
            fprintf(stderr, "%s\n", e.msg);
            _exit(126);
        }
        if (fn)
            _exit(fn(arg));
        if (log_path) {
            int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
            if (fd >= 0) {
                dup2(fd, 1);
                dup2(fd, 2);
            }
        }
        execvp(argv[0], argv);
        fprintf(stderr, "netns: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    net->children[net->n_children++] = pid;
    return pid;
}

pid_t blade_netns_spawn(blade_netns *net, int i, int (*fn)(void *), void *arg, blade_error *err)
{
    return spawn(net, i, fn, arg, NULL, NULL, err);
}

pid_t blade_netns_spawn_cmd(blade_netns *net, int i, char *const argv[], const char *log_path, blade_error *err)
{
    return spawn(net, i, NULL, NULL, argv, log_path, err);
}

static void forget_child(blade_netns *net, pid_t pid)
{
    for (int k = 0; k < net->n_children; k++)
        if (net->children[k] == pid) {
            net->children[k] = net->children[--net->n_children];
            return;
        }
}

int blade_netns_wait(blade_netns *net, pid_t pid, int timeout_ms)
{
    struct timespec step = {0, 10 * 1000 * 1000};
    int status;
    for (int waited = 0;; waited += 10) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            break;
        if (r < 0 && errno != EINTR) {
            forget_child(net, pid);
            return -1;
        }
        if (waited >= timeout_ms) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            forget_child(net, pid);
            return -1;
        }
        nanosleep(&step, NULL);
    }
    forget_child(net, pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void blade_netns_destroy(blade_netns *net)
{
    for (int k = 0; k < net->n_children; k++) {
        kill(net->children[k], SIGKILL);
        waitpid(net->children[k], NULL, 0);
    }
    net->n_children = 0;
    /* Deleting a namespace deletes its interfaces, and with them their veth peers. */
    for (int i = 0; i < net->n; i++)
        run_ip(NULL, "netns del %s", net->name[i]);
    if (net->hub[0])
        run_ip(NULL, "netns del %s", net->hub);
    net->n = 0;
    net->hub[0] = 0;
}

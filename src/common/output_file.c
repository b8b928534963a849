/* Output files written to a temporary and renamed into place on success (output_file.h). */
#include "common/output_file.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Symlinks followed before giving up, as the kernel's own limit. */
#define MAX_LINK_HOPS 40

/* ---- removing the temporary when a signal ends the process ---- */

static const int cover_signals[] = {SIGINT, SIGTERM, SIGHUP};
static bool cover_installed[sizeof cover_signals / sizeof cover_signals[0]];
static char cover_path[PATH_MAX];
static volatile sig_atomic_t cover_armed;

static void cover_handler(int sig)
{
    if (cover_armed)
        unlink(cover_path);
    /* SA_RESETHAND restored the default action; the signal, blocked while this runs, ends
     * the process as it would have with no handler once this returns. */
    raise(sig);
}

static bool cover_arm(const char *path)
{
    if (cover_armed || strlen(path) >= sizeof cover_path)
        return false;
    memcpy(cover_path, path, strlen(path) + 1);
    cover_armed = 1;
    for (size_t i = 0; i < sizeof cover_signals / sizeof cover_signals[0]; i++) {
        struct sigaction old;
        /* An ignored signal (nohup's SIGHUP) or one the program handles stays as it is. */
        if (sigaction(cover_signals[i], NULL, &old) != 0 || (old.sa_flags & SA_SIGINFO) ||
            old.sa_handler != SIG_DFL)
            continue;
        struct sigaction sa = {.sa_handler = cover_handler, .sa_flags = SA_RESETHAND};
        sigfillset(&sa.sa_mask);
        cover_installed[i] = sigaction(cover_signals[i], &sa, NULL) == 0;
    }
    return true;
}

static void cover_disarm(void)
{
    cover_armed = 0;
    for (size_t i = 0; i < sizeof cover_signals / sizeof cover_signals[0]; i++) {
        if (!cover_installed[i])
            continue;
        struct sigaction sa = {.sa_handler = SIG_DFL};
        sigaction(cover_signals[i], &sa, NULL);
        cover_installed[i] = false;
    }
}

/* ---- resolving the destination ---- */

static char *join_path(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s%s%s", dir, strcmp(dir, "/") ? "/" : "", name);
    return p;
}

static void release(blade_output *o)
{
    free(o->path);
    free(o->target);
    free(o->dir);
    free(o->temp);
    *o = (blade_output){0};
}

static int prepare_fail(blade_output *o, char *cur, char *dir)
{
    free(cur);
    free(dir);
    release(o);
    return -1;
}

int blade_output_prepare(blade_output *o, const char *path, blade_error *err)
{
    *o = (blade_output){0};
    char *cur = strdup(path), *dir = NULL;
    if (!(o->path = strdup(path)) || !cur) {
        blade_error_set(err, "out of memory");
        return prepare_fail(o, cur, dir);
    }
    for (int hop = 0;; hop++) {
        if (hop > MAX_LINK_HOPS) {
            blade_error_set(err, "cannot write %s: %s", path, strerror(ELOOP));
            return prepare_fail(o, cur, dir);
        }
        char *slash = strrchr(cur, '/');
        const char *base = slash ? slash + 1 : cur;
        if (!*base || !strcmp(base, ".") || !strcmp(base, "..")) {
            blade_error_set(err, "cannot write %s: it names a directory, not a file", path);
            return prepare_fail(o, cur, dir);
        }
        char *dir_part = slash ? strndup(cur, slash == cur ? 1 : (size_t)(slash - cur)) : strdup(".");
        free(dir);
        dir = dir_part ? realpath(dir_part, NULL) : NULL;
        if (!dir) {
            blade_error_set(err, "cannot write %s: directory %s: %s", path, dir_part ? dir_part : "?",
                            strerror(dir_part ? errno : ENOMEM));
            free(dir_part);
            return prepare_fail(o, cur, dir);
        }
        free(dir_part);
        /* /dev/stdout and the like lead through /proc/<pid>/fd: what they name is an open
         * descriptor, whose file a rename would take away from whoever else holds it. */
        if (!strncmp(dir, "/proc/", 6)) {
            free(cur);
            free(dir);
            return 0;
        }
        char *full = join_path(dir, base);
        if (!full) {
            blade_error_set(err, "out of memory");
            return prepare_fail(o, cur, dir);
        }
        free(cur);
        cur = full;
        struct stat st;
        if (lstat(cur, &st) != 0) {
            if (errno != ENOENT) {
                blade_error_set(err, "cannot write %s: %s: %s", path, cur, strerror(errno));
                return prepare_fail(o, cur, dir);
            }
            break;
        }
        if (S_ISLNK(st.st_mode)) {
            char link[PATH_MAX];
            ssize_t n = readlink(cur, link, sizeof link - 1);
            if (n < 0) {
                blade_error_set(err, "cannot write %s: %s: %s", path, cur, strerror(errno));
                return prepare_fail(o, cur, dir);
            }
            link[n] = 0;
            char *next = link[0] == '/' ? strdup(link) : join_path(dir, link);
            if (!next) {
                blade_error_set(err, "out of memory");
                return prepare_fail(o, cur, dir);
            }
            free(cur);
            cur = next;
            continue;
        }
        if (S_ISDIR(st.st_mode)) {
            blade_error_set(err, "cannot write %s: it is a directory", path);
            return prepare_fail(o, cur, dir);
        }
        if (!S_ISREG(st.st_mode)) {
            free(cur);
            free(dir);
            return 0;
        }
        o->exists = true;
        o->mode = st.st_mode & 07777;
        o->uid = st.st_uid;
        o->gid = st.st_gid;
        break;
    }
    if (access(dir, W_OK | X_OK) != 0) {
        blade_error_set(err, "cannot write %s: directory %s: %s", path, dir, strerror(errno));
        return prepare_fail(o, cur, dir);
    }
    if (!o->exists) {
        mode_t mask = umask(0);
        umask(mask);
        o->mode = 0666 & ~mask;
    }
    o->target = cur;
    o->dir = dir;
    return 0;
}

/* ---- writing ---- */

static void drop_temp(blade_output *o)
{
    unlink(o->temp);
    if (o->covered)
        cover_disarm();
    o->covered = false;
    free(o->temp);
    o->temp = NULL;
}

int blade_output_open(blade_output *o, blade_error *err)
{
    if (!o->target) {
        if (!(o->f = fopen(o->path, "wb")))
            return blade_error_set(err, "cannot open %s for writing: %s", o->path, strerror(errno));
        return 0;
    }
    /* Hidden, and named after the destination so that a leftover (after SIGKILL) says
     * where it came from. The name is cut to stay within NAME_MAX. */
    const char *base = strrchr(o->target, '/') + 1;
    size_t n = strlen(o->dir) + strlen(base) + 32;
    if (!(o->temp = malloc(n)))
        return blade_error_set(err, "out of memory");
    snprintf(o->temp, n, "%s/.%.200s.blade-XXXXXX", strcmp(o->dir, "/") ? o->dir : "", base);
    /* A signal between creating the file and arming the cover would leave it behind: held
     * back until both are done, then delivered to the handler. */
    sigset_t covered, old;
    sigemptyset(&covered);
    for (size_t i = 0; i < sizeof cover_signals / sizeof cover_signals[0]; i++)
        sigaddset(&covered, cover_signals[i]);
    pthread_sigmask(SIG_BLOCK, &covered, &old);
    int fd = mkostemp(o->temp, O_CLOEXEC);
    int mk_errno = errno;
    if (fd >= 0)
        o->covered = cover_arm(o->temp);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (fd < 0) {
        blade_error_set(err, "cannot create a temporary file in %s for %s: %s", o->dir, o->path, strerror(mk_errno));
        free(o->temp);
        o->temp = NULL;
        return -1;
    }
    /* Keeping another user's ownership needs privilege; without it the new file is the
     * writer's, as an editor's save would leave it. */
    if (o->exists && (o->uid != geteuid() || o->gid != getegid()) && fchown(fd, o->uid, o->gid) != 0)
        errno = 0;
    if (fchmod(fd, o->mode) != 0 || !(o->f = fdopen(fd, "wb"))) {
        blade_error_set(err, "cannot set up %s: %s", o->temp, strerror(errno));
        close(fd);
        drop_temp(o);
        return -1;
    }
    return 0;
}

static void sync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        /* The rename is done either way; this only hastens it to the disk. */
        fsync(fd);
        close(fd);
    }
}

int blade_output_commit(blade_output *o, blade_error *err)
{
    int rc = 0;
    if (fflush(o->f) != 0 || ferror(o->f))
        rc = blade_error_set(err, "writing %s failed: %s", o->path, strerror(errno ? errno : EIO));
    else if (o->temp && fsync(fileno(o->f)) != 0)
        rc = blade_error_set(err, "writing %s failed: fsync: %s", o->path, strerror(errno));
    if (fclose(o->f) != 0 && rc == 0)
        rc = blade_error_set(err, "writing %s failed: %s", o->path, strerror(errno));
    o->f = NULL;
    if (rc == 0 && o->temp && rename(o->temp, o->target) != 0)
        rc = blade_error_set(err, "cannot move the results into %s: %s", o->target, strerror(errno));
    if (rc) {
        blade_output_abort(o);
        return rc;
    }
    if (o->covered)
        cover_disarm();
    if (o->temp)
        sync_dir(o->dir);
    release(o);
    return 0;
}

void blade_output_abort(blade_output *o)
{
    if (o->f)
        fclose(o->f);
    if (o->temp)
        drop_temp(o);
    release(o);
}

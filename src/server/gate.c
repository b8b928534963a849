/* The front door of `blade serve` (see gate.h): one thread polls the listening socket, the
 * connections whose first head is still arriving and the deadlines of the connections that
 * libmicrohttpd holds.
 *
 * A held connection is only ever peeked at, never read, so libmicrohttpd later reads every
 * byte itself. To sleep until more of a head arrives rather than spin on the bytes already
 * peeked, the socket's receive low-water mark is set one past them: poll() then reports it
 * readable only when a new byte (or the end of the stream) is there. */
#include "server/gate.h"

#include "api/error.h"
#include "server/http_head.h"

#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define HEAD_MAX 16384     /* bytes of a request head; libmicrohttpd's pool holds twice that */
#define CHUNK_LINE_MAX 64  /* bytes of the first chunk size line looked at */
#define LINGER_S 2.0       /* after answering an error, unread input is drained this long */
#define LINGER_BYTES (1u << 20)
#define LINGER_MAX 128     /* connections draining at once; past that they are closed at once */
#define ACCEPT_BURST 64

enum phase {
    P_HEAD,    /* held: its first head is arriving */
    P_LINGER,  /* held: answered with an error, draining before close */
    P_HANDED,  /* given to libmicrohttpd, not started yet */
    P_NEXT,    /* libmicrohttpd's: waiting for a request head */
    P_BODY,    /* libmicrohttpd's: reading a request body */
    P_BUSY,    /* libmicrohttpd's: answering */
    P_CUT,     /* libmicrohttpd's: answered 408 by the watchdog and shut down */
};

struct gate_conn {
    int fd;
    unsigned char key[16]; /* the client address (IPv6: its /64) */
    bool capped;           /* max_per_ip applies */
    bool reserved;         /* in a probe slot */
    enum phase phase;
    double since;          /* when the phase began */
    double deadline;       /* 0: none */
    size_t seen;           /* bytes peeked so far */
    double quiet_until;    /* not polled before (after a wake-up with nothing new) */
    size_t drained;
    struct sockaddr_storage sa;
    socklen_t salen;
    gate_conn *prev, *next;
};

typedef struct peer {
    unsigned char key[16];
    int held, open;
} peer;

typedef struct conn_list {
    gate_conn *head, *tail;
    int n;
} conn_list;

struct gate {
    gate_config cfg;
    gate_hooks hooks;
    int listen_fd, wake_fd;
    pthread_t thread;
    bool running;
    char *buf;
    double listen_paused_until;
    int n_linger;
    conn_list held; /* in accept order; only the gate thread changes it */
    pthread_mutex_t mu; /* guards what follows */
    bool stopping;
    conn_list open;
    int n_reserved;
    double next_check; /* the earliest deadline among open connections; 0: none */
    peer *peers;
    int n_peers, cap_peers;
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void list_add(conn_list *l, gate_conn *c)
{
    c->next = NULL;
    c->prev = l->tail;
    if (l->tail)
        l->tail->next = c;
    else
        l->head = c;
    l->tail = c;
    l->n++;
}

static void list_del(conn_list *l, gate_conn *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        l->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        l->tail = c->prev;
    l->n--;
}

/* ---- client addresses ---- */

static void address_key(const struct sockaddr *sa, unsigned char key[16], bool *loopback)
{
    memset(key, 0, 16);
    *loopback = false;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *v4 = (const struct sockaddr_in *)sa;
        key[10] = key[11] = 0xff;
        memcpy(key + 12, &v4->sin_addr, 4);
        *loopback = key[12] == 127;
    } else if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(a)) {
            memcpy(key, a, 16);
            *loopback = key[12] == 127;
        } else {
            /* one host usually owns a whole /64, so that is what one address means */
            memcpy(key, a, 8);
            *loopback = IN6_IS_ADDR_LOOPBACK(a);
        }
    }
}

/* The peer of key, created if absent (NULL only when out of memory). Under mu. */
static peer *peer_of(gate *g, const unsigned char key[16])
{
    for (int i = 0; i < g->n_peers; i++)
        if (!memcmp(g->peers[i].key, key, 16))
            return &g->peers[i];
    if (g->n_peers == g->cap_peers) {
        int cap = g->cap_peers ? 2 * g->cap_peers : 64;
        peer *p = realloc(g->peers, (size_t)cap * sizeof *p);
        if (!p)
            return NULL;
        g->peers = p;
        g->cap_peers = cap;
    }
    peer *p = &g->peers[g->n_peers++];
    memcpy(p->key, key, 16);
    p->held = p->open = 0;
    return p;
}

/* Drops a peer with no connection left. Under mu. */
static void peer_release(gate *g, peer *p)
{
    if (p->held || p->open)
        return;
    *p = g->peers[--g->n_peers];
}

/* ---- answers ---- */

/* Writes an error answer without blocking (it is small and the socket's buffer is empty,
 * or nearly: only libmicrohttpd's "100 Continue" may precede it). */
static void write_error(int fd, const api_error *e)
{
    size_t blen = 0;
    char *body = api_error_body(e, &blen);
    char date[64];
    time_t t = time(NULL);
    struct tm tm;
    strftime(date, sizeof date, "%a, %d %b %Y %H:%M:%S GMT", gmtime_r(&t, &tm));
    char head[512];
    int hl = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nDate: %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                      "Connection: close\r\n%s\r\n",
                      e->status, MHD_get_reason_phrase_for((unsigned int)e->status), date, body ? blen : 0,
                      e->status == 503 ? "Retry-After: 1\r\n" : "");
    struct iovec iov[2] = {{head, (size_t)hl}, {body, body ? blen : 0}};
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2};
    ssize_t w = sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    (void)w;
    free(body);
}

static void set_lowat(int fd, size_t bytes)
{
    int v = bytes > (size_t)1 << 30 ? 1 << 30 : (int)bytes;
    setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);
}

/* ---- connections the gate holds ---- */

static void close_held(gate *g, gate_conn *c)
{
    list_del(&g->held, c);
    if (c->phase == P_LINGER)
        g->n_linger--;
    pthread_mutex_lock(&g->mu);
    peer *p = peer_of(g, c->key);
    if (p) {
        p->held--;
        peer_release(g, p);
    }
    pthread_mutex_unlock(&g->mu);
    close(c->fd);
    free(c);
}

/* Answers a held connection with an error, then drains what the client still sends for a
 * moment, so that closing with unread input does not reset the connection before the client
 * has read the answer. */
static void refuse(gate *g, gate_conn *c, const api_error *e)
{
    write_error(c->fd, e);
    if (g->hooks.answered)
        g->hooks.answered(g->hooks.ctx, e->status);
    if (g->n_linger >= LINGER_MAX) {
        close_held(g, c);
        return;
    }
    shutdown(c->fd, SHUT_WR);
    set_lowat(c->fd, 1);
    c->phase = P_LINGER;
    c->deadline = now() + LINGER_S;
    g->n_linger++;
}

static void drain(gate *g, gate_conn *c)
{
    for (;;) {
        ssize_t r = recv(c->fd, g->buf, HEAD_MAX, MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return;
        if (r <= 0 || (c->drained += (size_t)r) > LINGER_BYTES) {
            close_held(g, c);
            return;
        }
    }
}

/* Closes, for a newcomer, the held connection of key (or of the peer holding the most) that
 * came first, preferring one still sending its head to one draining after an answer. */
static void evict(gate *g, const unsigned char *key)
{
    unsigned char top[16];
    if (!key) {
        pthread_mutex_lock(&g->mu);
        int best = -1;
        for (int i = 0; i < g->n_peers; i++)
            if (best < 0 || g->peers[i].held > g->peers[best].held)
                best = i;
        if (best >= 0)
            memcpy(top, g->peers[best].key, 16);
        pthread_mutex_unlock(&g->mu);
        if (best < 0)
            return;
        key = top;
    }
    gate_conn *c = g->held.head;
    while (c && (memcmp(c->key, key, 16) || c->phase != P_HEAD))
        c = c->next;
    if (!c)
        for (c = g->held.head; c && memcmp(c->key, key, 16);)
            c = c->next;
    if (!c)
        return;
    if (c->phase == P_HEAD) {
        api_error e;
        api_error_set(&e, 503, "server_error", "connection_evicted", NULL,
                      "the connection was closed to make room for another: its request head was still incomplete "
                      "after %.1f s",
                      now() - c->since);
        write_error(c->fd, &e);
        if (g->hooks.answered)
            g->hooks.answered(g->hooks.ctx, 503);
    }
    close_held(g, c);
}

/* The head is complete and valid: the connection goes to libmicrohttpd, or is refused when
 * its address or the server has no slot left. */
static void hand_off(gate *g, gate_conn *c, bool probe)
{
    api_error e;
    int slots = g->cfg.max_connections;
    pthread_mutex_lock(&g->mu);
    peer *p = peer_of(g, c->key);
    bool full = g->open.n - g->n_reserved >= slots;
    if (!p || (c->capped && p->open >= g->cfg.max_per_ip && !probe)) {
        int n_open = p ? p->open : 0;
        pthread_mutex_unlock(&g->mu);
        api_error_set(&e, 503, "server_error", "too_many_connections", NULL,
                      "your address already has %d connections open (--max-connections-per-ip); close one or try "
                      "again shortly",
                      n_open);
        refuse(g, c, &e);
        return;
    }
    if (full && !(probe && g->n_reserved < GATE_PROBE_SLOTS)) {
        pthread_mutex_unlock(&g->mu);
        api_error_set(&e, 503, "server_error", "too_many_connections", NULL,
                      "the server has %d connections open (--max-connections); try again shortly", slots);
        refuse(g, c, &e);
        return;
    }
    /* a socket the library dropped without starting it (its fd is free again) */
    for (gate_conn *o = g->open.head; o; o = o->next)
        if (o->fd == c->fd && o->phase == P_HANDED) {
            list_del(&g->open, o);
            peer *q = peer_of(g, o->key);
            if (q) {
                q->open--;
                peer_release(g, q);
            }
            g->n_reserved -= o->reserved;
            free(o);
            break;
        }
    p = peer_of(g, c->key);
    list_del(&g->held, c);
    p->held--;
    p->open++;
    c->reserved = full;
    g->n_reserved += full;
    c->phase = P_HANDED;
    list_add(&g->open, c);
    pthread_mutex_unlock(&g->mu);
    set_lowat(c->fd, 1);
    if (g->hooks.hand_off(g->hooks.ctx, c->fd, (struct sockaddr *)&c->sa, c->salen))
        return;
    pthread_mutex_lock(&g->mu);
    list_del(&g->open, c);
    g->n_reserved -= c->reserved;
    p = peer_of(g, c->key);
    if (p) {
        p->open--;
        peer_release(g, p);
    }
    pthread_mutex_unlock(&g->mu);
    free(c);
}

/* Looks at what a held connection has sent so far. */
static void inspect(gate *g, gate_conn *c, short revents)
{
    if (c->phase == P_LINGER) {
        drain(g, c);
        return;
    }
    ssize_t n = recv(c->fd, g->buf, HEAD_MAX + CHUNK_LINE_MAX, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (n <= 0) {
        close_held(g, c);
        return;
    }
    bool ended = revents & (POLLRDHUP | POLLHUP | POLLERR);
    if ((size_t)n == c->seen && !ended) {
        /* the kernel may report a socket readable below its low-water mark (when its receive
         * window runs short): look again a little later rather than spin */
        c->quiet_until = now() + 0.01;
        return;
    }
    c->seen = (size_t)n;
    http_head h;
    api_error e;
    enum http_scan r = http_head_scan(g->buf, (size_t)n, HEAD_MAX, &h, &e);
    if (r == HTTP_HEAD_DONE && h.framing.n_te && !h.expect_continue) {
        /* the first chunk's size is checked too when it comes with the head (a client waiting
         * for "100 Continue" sends nothing more before it) */
        size_t rest = (size_t)n - h.len;
        r = http_chunk_size_scan(g->buf + h.len, rest, g->cfg.max_body, &e);
        if (r == HTTP_HEAD_PARTIAL && (rest >= CHUNK_LINE_MAX || ended))
            r = HTTP_HEAD_DONE;
    }
    if (r == HTTP_HEAD_PARTIAL && ended) {
        api_error_set(&e, 400, "invalid_request_error", "incomplete_request", NULL,
                      "the connection was half-closed before the request head was complete");
        r = HTTP_HEAD_BAD;
    }
    if (r == HTTP_HEAD_BAD)
        refuse(g, c, &e);
    else if (r == HTTP_HEAD_PARTIAL)
        set_lowat(c->fd, (size_t)n + 1);
    else
        hand_off(g, c, http_head_is_probe(&h));
}

static void admit(gate *g, int fd, const struct sockaddr_storage *sa, socklen_t salen)
{
    gate_conn *c = calloc(1, sizeof *c);
    if (!c) {
        close(fd);
        return;
    }
    bool loopback;
    address_key((const struct sockaddr *)sa, c->key, &loopback);
    c->capped = g->cfg.max_per_ip > 0 && (g->cfg.cap_loopback || !loopback);
    pthread_mutex_lock(&g->mu);
    peer *p = peer_of(g, c->key);
    bool over_ip = p && c->capped && p->held >= g->cfg.max_per_ip;
    pthread_mutex_unlock(&g->mu);
    if (!p) {
        free(c);
        close(fd);
        return;
    }
    if (over_ip)
        evict(g, c->key);
    else if (g->held.n - g->n_linger >= g->cfg.max_connections)
        evict(g, NULL);
    pthread_mutex_lock(&g->mu);
    p = peer_of(g, c->key);
    if (p)
        p->held++;
    pthread_mutex_unlock(&g->mu);
    if (!p) {
        free(c);
        close(fd);
        return;
    }
    c->fd = fd;
    c->sa = *sa;
    c->salen = salen;
    c->phase = P_HEAD;
    c->since = now();
    c->deadline = c->since + g->cfg.header_timeout;
    list_add(&g->held, c);
    inspect(g, c, 0);
}

static void accept_some(gate *g)
{
    for (int k = 0; k < ACCEPT_BURST; k++) {
        struct sockaddr_storage sa;
        socklen_t len = sizeof sa;
        int fd = accept4(g->listen_fd, (struct sockaddr *)&sa, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
            admit(g, fd, &sa, len);
            continue;
        }
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            /* out of descriptors: make one free and stop polling the socket for a moment,
             * else the pending connection keeps it readable and the loop spins */
            evict(g, NULL);
            g->listen_paused_until = now() + 0.1;
        }
        return;
    }
}

/* ---- the watchdog over libmicrohttpd's connections ---- */

static void cut(gate *g, gate_conn *c, double t)
{
    api_error e;
    if (c->phase == P_BODY && t - c->since < g->cfg.body_timeout)
        api_error_set(&e, 408, "invalid_request_error", "request_timeout", NULL,
                      "no bytes of the request body arrived for %g s (--idle-timeout)", g->cfg.idle_timeout);
    else if (c->phase == P_BODY)
        api_error_set(&e, 408, "invalid_request_error", "request_timeout", NULL,
                      "the request body was not complete %g s after its head (--body-timeout)",
                      g->cfg.body_timeout);
    else
        api_error_set(&e, 408, "invalid_request_error", "request_timeout", NULL,
                      "the request head was not complete in time (--header-timeout %g s)", g->cfg.header_timeout);
    write_error(c->fd, &e);
    /* libmicrohttpd's thread sees the end of the stream and closes the connection; the
     * descriptor stays valid until its close callback, which takes mu first */
    shutdown(c->fd, SHUT_RDWR);
    c->phase = P_CUT;
    c->deadline = 0;
    if (g->hooks.answered)
        g->hooks.answered(g->hooks.ctx, 408);
}

static void watch(gate *g, double t)
{
    pthread_mutex_lock(&g->mu);
    double next = 0;
    for (gate_conn *c = g->open.head; c; c = c->next) {
        /* a connection not started yet gets its deadline armed when it starts */
        if (!c->deadline || (c->phase != P_NEXT && c->phase != P_BODY))
            continue;
        if (c->deadline <= t)
            cut(g, c, t);
        else if (!next || c->deadline < next)
            next = c->deadline;
    }
    g->next_check = next;
    pthread_mutex_unlock(&g->mu);
}

/* Sets an open connection's deadline, waking the gate thread if it is now the earliest. Under mu. */
static void set_deadline(gate *g, gate_conn *c, double deadline)
{
    c->deadline = deadline;
    if (deadline && (!g->next_check || deadline < g->next_check)) {
        g->next_check = deadline;
        uint64_t one = 1;
        ssize_t w = write(g->wake_fd, &one, sizeof one);
        (void)w;
    }
}

/* ---- the thread ---- */

static void *gate_main(void *arg)
{
    gate *g = arg;
    struct pollfd *pfd = NULL;
    gate_conn **who = NULL;
    int cap = 0;
    for (;;) {
        double t = now();
        for (gate_conn *c = g->held.head, *next; c; c = next) {
            next = c->next;
            if (c->deadline > t)
                continue;
            if (c->phase == P_LINGER) {
                close_held(g, c);
                continue;
            }
            api_error e;
            api_error_set(&e, 408, "invalid_request_error", "request_timeout", NULL,
                          "the request head was not complete %g s after the connection opened (--header-timeout)",
                          g->cfg.header_timeout);
            refuse(g, c, &e);
        }
        pthread_mutex_lock(&g->mu);
        double check = g->next_check;
        bool stopping = g->stopping;
        pthread_mutex_unlock(&g->mu);
        if (stopping)
            break;
        if (check && check <= t)
            watch(g, t);

        int need = g->held.n + 2;
        if (need > cap) {
            int ncap = need * 2;
            struct pollfd *np = realloc(pfd, (size_t)ncap * sizeof *np);
            if (np)
                pfd = np;
            gate_conn **nw = realloc(who, (size_t)ncap * sizeof *nw);
            if (nw)
                who = nw;
            if (!np || !nw) {
                usleep(10000);
                continue;
            }
            cap = ncap;
        }
        double wake = check;
        int n = 0;
        pfd[n++] = (struct pollfd){.fd = g->wake_fd, .events = POLLIN};
        bool listening = g->listen_paused_until <= t;
        pfd[n++] = (struct pollfd){.fd = listening ? g->listen_fd : -1, .events = POLLIN};
        if (!listening && (!wake || g->listen_paused_until < wake))
            wake = g->listen_paused_until;
        for (gate_conn *c = g->held.head; c; c = c->next) {
            bool quiet = c->quiet_until > t;
            who[n] = c;
            pfd[n++] = (struct pollfd){.fd = quiet ? -1 : c->fd, .events = POLLIN | POLLRDHUP};
            double until = quiet && c->quiet_until < c->deadline ? c->quiet_until : c->deadline;
            if (!wake || until < wake)
                wake = until;
        }
        int ms = -1;
        if (wake) {
            double left = wake - now();
            ms = left <= 0 ? 0 : left > 3600 ? 3600 * 1000 : (int)(left * 1000) + 1;
        }
        if (poll(pfd, (nfds_t)n, ms) <= 0)
            continue;
        if (pfd[0].revents) {
            uint64_t v;
            ssize_t r = read(g->wake_fd, &v, sizeof v);
            (void)r;
        }
        for (int i = 2; i < n; i++)
            if (pfd[i].revents || (pfd[i].fd < 0 && who[i]->quiet_until <= now()))
                inspect(g, who[i], pfd[i].revents);
        if (pfd[1].revents)
            accept_some(g);
    }
    free(pfd);
    free(who);
    return NULL;
}

gate *gate_new(int listen_fd, const gate_config *cfg, const gate_hooks *hooks, blade_error *err)
{
    gate *g = calloc(1, sizeof *g);
    if (!g || !(g->buf = malloc(HEAD_MAX + CHUNK_LINE_MAX))) {
        free(g);
        close(listen_fd);
        blade_error_set(err, "out of memory");
        return NULL;
    }
    g->cfg = *cfg;
    g->hooks = *hooks;
    g->listen_fd = listen_fd;
    pthread_mutex_init(&g->mu, NULL);
    g->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (g->wake_fd < 0) {
        blade_error_set(err, "eventfd: %s", strerror(errno));
        gate_free(g);
        return NULL;
    }
    /* accept4 hands out non-blocking sockets; the listening one must not block either */
    fcntl(listen_fd, F_SETFL, fcntl(listen_fd, F_GETFL) | O_NONBLOCK);
    return g;
}

int gate_run(gate *g, blade_error *err)
{
    int rc = pthread_create(&g->thread, NULL, gate_main, g);
    if (rc)
        return blade_error_set(err, "cannot start the connection thread: %s", strerror(rc));
    g->running = true;
    return 0;
}

void gate_stop(gate *g)
{
    if (!g || !g->running)
        return;
    pthread_mutex_lock(&g->mu);
    g->stopping = true;
    pthread_mutex_unlock(&g->mu);
    uint64_t one = 1;
    ssize_t w = write(g->wake_fd, &one, sizeof one);
    (void)w;
    pthread_join(g->thread, NULL);
    g->running = false;
    while (g->held.head)
        close_held(g, g->held.head);
}

void gate_free(gate *g)
{
    if (!g)
        return;
    gate_stop(g);
    for (gate_conn *c = g->open.head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    if (g->wake_fd >= 0)
        close(g->wake_fd);
    close(g->listen_fd);
    pthread_mutex_destroy(&g->mu);
    free(g->peers);
    free(g->buf);
    free(g);
}

/* ---- the HTTP library's side ---- */

gate_conn *gate_conn_started(gate *g, int fd)
{
    pthread_mutex_lock(&g->mu);
    gate_conn *c = g->open.head;
    while (c && !(c->fd == fd && c->phase == P_HANDED))
        c = c->next;
    if (c) {
        c->phase = P_NEXT;
        set_deadline(g, c, c->deadline);
    }
    pthread_mutex_unlock(&g->mu);
    return c;
}

void gate_conn_closed(gate *g, gate_conn *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&g->mu);
    list_del(&g->open, c);
    g->n_reserved -= c->reserved;
    peer *p = peer_of(g, c->key);
    if (p) {
        p->open--;
        peer_release(g, p);
    }
    pthread_mutex_unlock(&g->mu);
    free(c);
}

bool gate_conn_reserved(const gate_conn *c)
{
    return c && c->reserved;
}

bool gate_request_head(gate *g, gate_conn *c)
{
    if (!c)
        return true;
    pthread_mutex_lock(&g->mu);
    bool ok = c->phase != P_CUT;
    if (ok) {
        double t = now();
        c->phase = P_BODY;
        c->since = t;
        double idle = t + g->cfg.idle_timeout, total = t + g->cfg.body_timeout;
        set_deadline(g, c, idle < total ? idle : total);
    }
    pthread_mutex_unlock(&g->mu);
    return ok;
}

void gate_request_progress(gate *g, gate_conn *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&g->mu);
    if (c->phase == P_BODY) {
        double idle = now() + g->cfg.idle_timeout, total = c->since + g->cfg.body_timeout;
        c->deadline = idle < total ? idle : total;
    }
    pthread_mutex_unlock(&g->mu);
}

bool gate_request_body(gate *g, gate_conn *c)
{
    if (!c)
        return true;
    pthread_mutex_lock(&g->mu);
    bool ok = c->phase != P_CUT;
    if (ok) {
        c->phase = P_BUSY;
        c->deadline = 0;
    }
    pthread_mutex_unlock(&g->mu);
    return ok;
}

bool gate_request_done(gate *g, gate_conn *c)
{
    if (!c)
        return false;
    pthread_mutex_lock(&g->mu);
    bool cut = c->phase == P_CUT;
    if (!cut) {
        double t = now();
        c->phase = P_NEXT;
        c->since = t;
        /* idle keep-alive is libmicrohttpd's to end (--idle-timeout without a byte); this bounds
         * a head that keeps arriving byte by byte */
        set_deadline(g, c, t + g->cfg.idle_timeout + g->cfg.header_timeout);
    }
    pthread_mutex_unlock(&g->mu);
    return cut;
}

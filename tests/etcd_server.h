#ifndef BLADE_TEST_ETCD_SERVER_H
#define BLADE_TEST_ETCD_SERVER_H

/* A private etcd for one test: a single member on loopback ports picked free at start, in
 * a fresh data directory under the build's test temp directory, its log beside it. Stop
 * removes the directory. */

#include <stdbool.h>
#include <sys/types.h>

typedef struct etcd_server {
    pid_t pid;
    char dir[256];
    char log[300];
    int client_port, peer_port;
    char url[64];
} etcd_server;

/* The etcd binary's path, or NULL when etcd is not installed. */
const char *etcd_binary(void);
/* Starts etcd and waits (up to 10 s) until it answers; -1 with a message on stderr. */
int etcd_server_start(etcd_server *s);
/* SIGKILLs etcd (a crash) and reaps it; the data stays. */
void etcd_server_kill(etcd_server *s);
/* Starts it again on the same ports and data. */
int etcd_server_restart(etcd_server *s);
/* Starts it again on the same ports with no data: etcd that lost its store. */
int etcd_server_restart_empty(etcd_server *s);
/* Kills etcd and removes its directory. */
void etcd_server_stop(etcd_server *s);

#endif

/* The event queue between the engine thread and a job's consumer (sink.h): a mutex-guarded
 * list plus an eventfd counter, so the consumer can sleep in poll() beside its sockets. */

#include "api/sink.h"

#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

int api_sink_init(api_sink *s, blade_error *err)
{
    memset(s, 0, sizeof *s);
    s->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->fd < 0)
        return blade_error_set(err, "cannot create an eventfd");
    pthread_mutex_init(&s->mu, NULL);
    return 0;
}

void api_sink_destroy(api_sink *s)
{
    api_event *ev = s->head;
    while (ev) {
        api_event *next = ev->next;
        api_event_free(ev);
        ev = next;
    }
    if (s->fd >= 0) {
        close(s->fd);
        pthread_mutex_destroy(&s->mu);
    }
    s->fd = -1;
}

void api_sink_push(api_sink *s, api_event *ev)
{
    ev->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->tail)
        s->tail->next = ev;
    else
        s->head = ev;
    s->tail = ev;
    pthread_mutex_unlock(&s->mu);
    uint64_t one = 1;
    /* The counter cannot overflow in practice, and a full counter is still readable, which
     * is all a consumer waits for. */
    ssize_t w = write(s->fd, &one, sizeof one);
    (void)w;
}

api_event *api_sink_take(api_sink *s)
{
    uint64_t count;
    ssize_t r = read(s->fd, &count, sizeof count);
    (void)r;
    pthread_mutex_lock(&s->mu);
    api_event *list = s->head;
    s->head = s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    return list;
}

void api_event_free(api_event *ev)
{
    if (ev && !ev->preallocated)
        free(ev);
}

/* iopool: worker threads running one pread/pwrite each, the machinery behind
 * the Threads type (threads.c), kept apart from its Python surface.
 *
 * Workers never touch a Python object: an op's Py_buffer is taken and released
 * by the calling thread with the GIL held, and the memory behind it stays valid
 * until the op is handed back by iopool_take_done or dropped by iopool_stop,
 * which joins every worker first. The mutex is a default one, initialised once:
 * locking and unlocking it cannot fail, so those calls go unchecked.
 *
 * A worker stuck in its syscall (a device that never answers) cannot be joined
 * in bounded time: iopool_stop then detaches the workers and reports the pool
 * abandoned, and its owner leaks it (and the ops still running) instead of
 * freeing memory a worker still uses. That is why the pool lives on the heap.
 */
#ifndef MEMSTRATA_IOPOOL_H
#define MEMSTRATA_IOPOOL_H

#include "native.h"

#include <pthread.h>

/* Each worker blocks in one syscall, so workers = ops in the kernel at once.
 * More than this only adds threads contending for the same queue. */
#define IOPOOL_MAX_WORKERS 16

typedef struct top {
    unsigned long long tag;
    int fd;
    int write;
    Py_buffer view;
    char *addr;
    size_t len;
    unsigned long long offset;
    long long result; /* bytes moved, or -errno */
    struct top *next;
} top_t;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work; /* pending ops, or stopping */
    pthread_cond_t done; /* an op finished */
    int sync_ok;         /* mu, work and done are initialised */
    int stopping;
    unsigned nworkers;
    unsigned nexited; /* workers that have left worker_main (under mu) */
    pthread_t *workers;
    size_t ndone; /* on the done list */
    top_t *pend_head, *pend_tail;
    top_t *done_head, *done_tail;
} iopool_t;

/* Initialise and start `count` workers; 0, or -1 with a Python error set (GIL
 * held). On failure the caller still calls iopool_stop to join what started. */
int iopool_start(iopool_t *p, unsigned count);
/* Queue one op for the workers (GIL held; takes the mutex only briefly). */
void iopool_push(iopool_t *p, top_t *op);
/* Wait (GIL released by the caller) until `target` ops are done or `ns` pass;
 * returns how many are done. */
size_t iopool_wait(iopool_t *p, size_t target, long ns);
/* Detach the done list; *count gets its length. */
top_t *iopool_take_done(iopool_t *p, size_t *count);
/* Stop the workers and return the ops that never started and the ones done;
 * ops already running finish first, for up to `timeout_ns` without a worker
 * exiting (releases the GIL meanwhile). *abandoned is set when some worker did
 * not exit in time: the workers are then detached, and the caller must leak
 * the pool (never iopool_destroy or free it). */
top_t *iopool_stop(iopool_t *p, long long timeout_ns, int *abandoned);
void iopool_destroy(iopool_t *p);
/* Release each op's buffer and free it (GIL held). */
void iopool_free_ops(top_t *op);

#endif

/* iopool: see iopool.h. */
#include "iopool.h"

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* One pread/pwrite moves at most this much; longer ops continue like short
 * transfers (Linux caps a single read/write just below 2 GiB anyway). */
#define MAX_CALL_BYTES (1u << 30)
#define MAX_RETRIES 16

static void tpush(top_t **head, top_t **tail, top_t *op)
{
    op->next = NULL;
    if (*tail)
        (*tail)->next = op;
    else
        *head = op;
    *tail = op;
}

static top_t *tpop(top_t **head, top_t **tail)
{
    top_t *op = *head;
    if (op) {
        *head = op->next;
        if (*head == NULL)
            *tail = NULL;
        op->next = NULL;
    }
    return op;
}

/* The whole transfer, continued after short ones; bytes moved or -errno.
 * A 0 return before the end (past the end of the device or file) ends it
 * short, and the façade reports that as a short transfer, as with io_uring. */
static long long transfer(const top_t *op)
{
    size_t done = 0;
    int retries = 0;
    if (op->offset > (unsigned long long)INT64_MAX - op->len)
        return -EINVAL;
    while (done < op->len) {
        size_t n = op->len - done > MAX_CALL_BYTES ? MAX_CALL_BYTES : op->len - done;
        off_t off = (off_t)(op->offset + done);
        ssize_t r = op->write ? pwrite(op->fd, op->addr + done, n, off) : pread(op->fd, op->addr + done, n, off);
        if (r < 0) {
            int err = errno;
            if ((err == EINTR || err == EAGAIN) && retries++ < MAX_RETRIES)
                continue;
            return -(long long)err;
        }
        if (r == 0)
            break;
        done += (size_t)r;
    }
    return (long long)done;
}

static void *worker_main(void *arg)
{
    iopool_t *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stopping && p->pend_head == NULL)
            pthread_cond_wait(&p->work, &p->mu);
        if (p->stopping)
            break;
        top_t *op = tpop(&p->pend_head, &p->pend_tail);
        pthread_mutex_unlock(&p->mu);
        op->result = transfer(op);
        pthread_mutex_lock(&p->mu);
        tpush(&p->done_head, &p->done_tail, op);
        p->ndone++;
        pthread_cond_broadcast(&p->done);
    }
    p->nexited++;
    pthread_cond_broadcast(&p->done); /* iopool_stop waits for every worker to get here */
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static int init_sync(iopool_t *p)
{
    pthread_condattr_t attr;
    int err = pthread_condattr_init(&attr);
    if (err == 0) {
        /* iopool_wait's timeouts must not jump with the wall clock. */
        err = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        if (err == 0 && (err = pthread_mutex_init(&p->mu, NULL)) == 0) {
            if ((err = pthread_cond_init(&p->work, &attr)) == 0) {
                if ((err = pthread_cond_init(&p->done, &attr)) == 0) {
                    pthread_condattr_destroy(&attr);
                    p->sync_ok = 1;
                    return 0;
                }
                pthread_cond_destroy(&p->work);
            }
            pthread_mutex_destroy(&p->mu);
        }
        pthread_condattr_destroy(&attr);
    }
    ms_raise_errno(err, "pthread_cond_init");
    return -1;
}

int iopool_start(iopool_t *p, unsigned count)
{
    if (init_sync(p) < 0)
        return -1;
    p->workers = PyMem_Calloc(count, sizeof(pthread_t));
    if (p->workers == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    /* Workers inherit a mask that blocks every signal: signals go to Python's
     * threads, and no worker's pread is cut short by them. */
    sigset_t all, old;
    sigfillset(&all);
    int err = pthread_sigmask(SIG_SETMASK, &all, &old);
    if (err != 0) {
        ms_raise_errno(err, "pthread_sigmask");
        return -1;
    }
    for (unsigned i = 0; i < count && err == 0; i++) {
        err = pthread_create(&p->workers[i], NULL, worker_main, p);
        if (err == 0)
            p->nworkers++;
    }
    int restore = pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0 || restore != 0) {
        ms_raise_errno(err != 0 ? err : restore, err != 0 ? "pthread_create" : "pthread_sigmask");
        return -1;
    }
    return 0;
}

void iopool_push(iopool_t *p, top_t *op)
{
    pthread_mutex_lock(&p->mu);
    tpush(&p->pend_head, &p->pend_tail, op);
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
}

/* An absolute CLOCK_MONOTONIC time `ns` from now (the clock of the condition
 * variables). clock_gettime cannot fail: a valid clock and pointer. */
static struct timespec deadline_in(long long ns)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    if (ns < 0)
        ns = 0;
    until.tv_sec += (time_t)(ns / 1000000000LL);
    until.tv_nsec += (long)(ns % 1000000000LL);
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    return until;
}

size_t iopool_wait(iopool_t *p, size_t target, long ns)
{
    struct timespec until = deadline_in(ns);
    pthread_mutex_lock(&p->mu);
    int rc = 0;
    /* timedwait returns 0 or ETIMEDOUT here: the mutex is ours and `until` is normalised. */
    while (p->ndone < target && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&p->done, &p->mu, &until);
    size_t have = p->ndone;
    pthread_mutex_unlock(&p->mu);
    return have;
}

top_t *iopool_take_done(iopool_t *p, size_t *count)
{
    pthread_mutex_lock(&p->mu);
    top_t *list = p->done_head;
    p->done_head = p->done_tail = NULL;
    *count = p->ndone;
    p->ndone = 0;
    pthread_mutex_unlock(&p->mu);
    return list;
}

top_t *iopool_stop(iopool_t *p, long long timeout_ns, int *abandoned)
{
    top_t *dropped = NULL;
    *abandoned = 0;
    if (p->sync_ok) {
        pthread_mutex_lock(&p->mu);
        dropped = p->pend_head; /* queued, never started: dropped, as Ring.close does */
        p->pend_head = p->pend_tail = NULL;
        p->stopping = 1;
        pthread_cond_broadcast(&p->work);
        if (p->nexited < p->nworkers) {
            Py_BEGIN_ALLOW_THREADS
            /* Every exit moves the deadline: only a worker that makes no progress for the
             * whole timeout (stuck in its pread/pwrite) ends the wait. */
            struct timespec until = deadline_in(timeout_ns);
            unsigned seen = p->nexited;
            while (p->nexited < p->nworkers) {
                int rc = pthread_cond_timedwait(&p->done, &p->mu, &until);
                if (p->nexited > seen) {
                    seen = p->nexited;
                    until = deadline_in(timeout_ns);
                } else if (rc == ETIMEDOUT) {
                    break;
                }
            }
            Py_END_ALLOW_THREADS
        }
        *abandoned = p->nexited < p->nworkers;
        pthread_mutex_unlock(&p->mu);
    }
    if (p->nworkers > 0) {
        int err = 0;
        Py_BEGIN_ALLOW_THREADS
        for (unsigned i = 0; i < p->nworkers; i++) {
            /* Both fail only for a thread id that is not a joinable thread of ours. */
            int rc = *abandoned ? pthread_detach(p->workers[i]) : pthread_join(p->workers[i], NULL);
            if (rc != 0 && err == 0)
                err = rc;
        }
        Py_END_ALLOW_THREADS
        if (err != 0) /* cannot happen; were it to, the threads are lost either way: say so, go on */
            PySys_WriteStderr("memstrata: I/O thread pool: %s: %s\n", *abandoned ? "pthread_detach" : "pthread_join",
                              strerror(err));
        p->nworkers = 0;
    }
    PyMem_Free(p->workers);
    p->workers = NULL;
    /* Ops that finished and were never taken go too. An abandoned pool's stuck
     * workers add theirs to its done list later: leaked with the pool. */
    if (p->sync_ok)
        pthread_mutex_lock(&p->mu);
    if (p->done_tail != NULL) {
        p->done_tail->next = dropped;
        dropped = p->done_head;
    }
    p->done_head = p->done_tail = NULL;
    p->ndone = 0;
    if (p->sync_ok)
        pthread_mutex_unlock(&p->mu);
    return dropped;
}

void iopool_destroy(iopool_t *p)
{
    if (p->sync_ok) {
        pthread_cond_destroy(&p->done);
        pthread_cond_destroy(&p->work);
        pthread_mutex_destroy(&p->mu);
        p->sync_ok = 0;
    }
}

void iopool_free_ops(top_t *op)
{
    while (op) {
        top_t *next = op->next;
        PyBuffer_Release(&op->view);
        PyMem_Free(op);
        op = next;
    }
}

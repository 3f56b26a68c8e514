/* Ring: one io_uring over a fixed set of already-opened (O_DIRECT) files.
 *
 * Ops are queued in submission order and at most `depth` are in the kernel at
 * once (the configurable queue depth); the rest wait in a FIFO and are fed in
 * as completions free slots. Each op holds a Py_buffer on its memory until it
 * completes, so Python can never free memory the kernel is still writing.
 * A short transfer is continued from where it stopped; the final result of an
 * op is the bytes moved or -errno, and the façade decides what is an error.
 *
 * Submission: io_uring_enter may take fewer SQEs than it was offered. It stops
 * at an SQE it fails to prepare (that one gets its error CQE, the ones behind it
 * stay in the SQ ring), and it refuses the whole batch when it cannot allocate
 * requests (EAGAIN, ENOMEM) or is interrupted. An SQE left in the ring is
 * offered again on every pump and every wait until the kernel takes it: a wait
 * never sleeps on a completion whose SQE the kernel does not hold (that was a
 * hang for good: waiting in io_cqring_wait for an op that was never submitted).
 *
 * Every wait is bounded: when no op completes for `timeout_s` seconds, wait and
 * close fail with ETIMEDOUT (TimeoutError) naming what is in flight, instead of
 * hanging the process. The wait sleeps in io_uring_enter with
 * IORING_ENTER_EXT_ARG's timeout (kernels 5.11+), else in poll() on the ring fd.
 */
#include "native.h"

#include <errno.h>
#include <liburing.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* One SQE moves at most this much; larger ops continue like short transfers
 * (the kernel caps a single read/write below 2 GiB anyway). */
#define MAX_SQE_BYTES (1u << 30)
#define MAX_RETRIES 16
/* While the kernel refuses SQEs (EAGAIN, ENOMEM) they are offered again this often. */
#define RESUBMIT_NS (5 * 1000000LL)

enum { WAIT_EXT_ARG, WAIT_POLL };

typedef struct op {
    unsigned long long tag;
    int file_index;
    int write;
    int buf_index; /* registered buffer holding the range, or -1 */
    int retries;
    Py_buffer view;
    char *addr;
    size_t len;
    size_t done;
    unsigned long long offset;
    long long result;
    struct op *next;
} op_t;

typedef struct {
    PyObject_HEAD
    struct io_uring ring;
    int ring_ok;
    int busy; /* set while the GIL is released inside a call */
    int wait_mode; /* WAIT_EXT_ARG or WAIT_POLL */
    int broken;    /* -errno of a submission the kernel refused for good; 0 while usable */
    int refused;   /* -errno of the latest transient refusal (EAGAIN, ENOMEM, EINTR), 0 once taken */
    unsigned depth;
    unsigned inflight; /* ops in SQEs: not yet taken by the kernel (io_uring_sq_ready) or in the kernel */
    size_t queued;     /* submitted and not yet returned by wait: pending + inflight + done */
    size_t ndone;      /* on the done list */
    long long timeout_ns;
    int nfiles;
    op_t *pend_head, *pend_tail;
    op_t *done_head, *done_tail;
    Py_buffer *bufs;
    int nbufs;
} RingObject;

static void push_back(op_t **head, op_t **tail, op_t *op)
{
    op->next = NULL;
    if (*tail)
        (*tail)->next = op;
    else
        *head = op;
    *tail = op;
}

static void push_front(op_t **head, op_t **tail, op_t *op)
{
    op->next = *head;
    *head = op;
    if (*tail == NULL)
        *tail = op;
}

static op_t *pop_front(op_t **head, op_t **tail)
{
    op_t *op = *head;
    if (op) {
        *head = op->next;
        if (*head == NULL)
            *tail = NULL;
        op->next = NULL;
    }
    return op;
}

/* SQEs prepared but not yet taken by the kernel. */
static unsigned unsubmitted(RingObject *self)
{
    return io_uring_sq_ready(&self->ring);
}

/* Offer every SQE in the ring to the kernel until it has taken them all, or
 * refuses. A short count (an SQE failed to prepare: its error CQE is posted and
 * the rest are still in the ring) is followed by another offer. A transient
 * refusal leaves the SQEs for the next pump or wait, which offer them again;
 * any other error breaks the ring for good. Runs without the GIL. 0 or -errno. */
static int flush_sq(RingObject *self)
{
    unsigned ready;
    while ((ready = unsubmitted(self)) > 0) {
        int ret = io_uring_submit(&self->ring);
        if (ret > 0) {
            self->refused = 0;
            continue;
        }
        if (ret == 0 || ret == -EAGAIN || ret == -ENOMEM || ret == -EBUSY || ret == -EINTR) {
            /* 0: nothing taken and no error (not expected with SQEs ready): treat as EAGAIN rather than spin. */
            self->refused = ret == 0 ? -EAGAIN : ret;
            return 0;
        }
        self->broken = ret;
        return ret;
    }
    return 0;
}

/* Move queued ops into the SQ up to the depth limit and offer them to the kernel.
 * Runs without the GIL: touches only C state. Returns 0 or -errno. */
static int pump(RingObject *self)
{
    if (self->broken)
        return self->broken;
    while (self->inflight < self->depth && self->pend_head) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&self->ring);
        if (sqe == NULL)
            break; /* the SQ ring is full of SQEs the kernel has not taken: flush_sq offers them */
        op_t *op = pop_front(&self->pend_head, &self->pend_tail);
        size_t left = op->len - op->done;
        unsigned n = left > MAX_SQE_BYTES ? MAX_SQE_BYTES : (unsigned)left;
        char *addr = op->addr + op->done;
        unsigned long long off = op->offset + op->done;
        if (op->write) {
            if (op->buf_index >= 0)
                io_uring_prep_write_fixed(sqe, op->file_index, addr, n, off, op->buf_index);
            else
                io_uring_prep_write(sqe, op->file_index, addr, n, off);
        } else {
            if (op->buf_index >= 0)
                io_uring_prep_read_fixed(sqe, op->file_index, addr, n, off, op->buf_index);
            else
                io_uring_prep_read(sqe, op->file_index, addr, n, off);
        }
        sqe->flags |= IOSQE_FIXED_FILE;
        io_uring_sqe_set_data(sqe, op);
        self->inflight++;
    }
    return flush_sq(self);
}

/* Account one CQE. A short transfer is re-queued at the front, so ordering
 * between ops is kept. */
static void complete(RingObject *self, op_t *op, int res)
{
    self->inflight--;
    if ((res == -EAGAIN || res == -EINTR) && op->retries < MAX_RETRIES) {
        op->retries++;
        push_front(&self->pend_head, &self->pend_tail, op);
        return;
    }
    if (res < 0) {
        op->result = res;
    } else if (res > 0 && op->done + (size_t)res < op->len) {
        op->done += (size_t)res;
        push_front(&self->pend_head, &self->pend_tail, op);
        return;
    } else {
        /* res == 0 before the end: past the end of the device or file; the
         * façade sees result < len and reports a short transfer. */
        op->done += (size_t)res;
        op->result = (long long)op->done;
    }
    push_back(&self->done_head, &self->done_tail, op);
    self->ndone++;
}

/* Account every CQE that is ready; returns how many there were. */
static unsigned reap(RingObject *self)
{
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&self->ring, head, cqe)
    {
        op_t *op = io_uring_cqe_get_data(cqe);
        if (op != NULL) /* every SQE this ring prepares carries its op */
            complete(self, op, cqe->res);
        seen++;
    }
    io_uring_cq_advance(&self->ring, seen);
    return seen;
}

/* Sleep until a CQE is ready or `ns` pass. 0: one may be ready (reap to see);
 * -ETIME: the time passed; -EINTR: a signal; other -errno: the ring failed. */
static int wait_cqe(RingObject *self, long long ns)
{
    if (ns < 0)
        ns = 0;
    if (self->wait_mode == WAIT_EXT_ARG) {
        /* wait_cqes with a timeout and IORING_FEAT_EXT_ARG: one io_uring_enter with
         * IORING_ENTER_EXT_ARG, submitting nothing (SQEs are offered by flush_sq only). */
        struct __kernel_timespec ts = {.tv_sec = ns / MS_NS_PER_S, .tv_nsec = ns % MS_NS_PER_S};
        struct io_uring_cqe *cqe;
        return io_uring_wait_cqes(&self->ring, &cqe, 1, &ts, NULL);
    }
    /* Kernels before 5.11: the ring fd polls readable when the CQ ring has entries.
     * Rounded up to whole ms, so a wait never ends before its deadline. */
    long long ms = (ns + 999999) / 1000000;
    struct pollfd pfd = {.fd = self->ring.ring_fd, .events = POLLIN};
    int ret = poll(&pfd, 1, ms > INT32_MAX ? INT32_MAX : (int)ms);
    if (ret < 0)
        return -errno;
    if (ret == 0)
        return -ETIME;
    if (pfd.revents & (POLLERR | POLLNVAL))
        return -EBADF;
    return 0;
}

/* Outcomes of drive() other than 0 and -errno. */
#define DRIVE_NOTHING_IN_FLIGHT 1

/* Wait (GIL released) until `want` ops are on the done list. Returns 0; -EINTR on
 * a signal (the caller runs Python's handlers and calls again with the same
 * deadline); -ETIMEDOUT when nothing completed before *deadline (each completion
 * moves it to timeout_ns from then); the error that broke the ring; or
 * DRIVE_NOTHING_IN_FLIGHT when `want` exceeds what could ever complete. */
static int drive(RingObject *self, size_t want, long long *deadline)
{
    for (;;) {
        int err = pump(self);
        if (err < 0)
            return err;
        if (reap(self) > 0) {
            *deadline = ms_now_ns() + self->timeout_ns;
            continue; /* completions may have freed slots for pending ops */
        }
        if (self->ndone >= want)
            return 0;
        if (self->inflight == 0)
            return DRIVE_NOTHING_IN_FLIGHT; /* nothing pending either: pump would have moved it */
        long long left = *deadline - ms_now_ns();
        if (left <= 0)
            return -ETIMEDOUT;
        unsigned waiting = unsubmitted(self);
        if (waiting == self->inflight) {
            /* The kernel holds none of them: no CQE can come. Back off, then offer them again. */
            long long ns = left < RESUBMIT_NS ? left : RESUBMIT_NS;
            struct timespec ts = {.tv_sec = ns / MS_NS_PER_S, .tv_nsec = ns % MS_NS_PER_S};
            if (nanosleep(&ts, NULL) < 0)
                return -errno; /* EINTR: a signal; EINVAL cannot happen with ns in range */
            continue;
        }
        int ret = wait_cqe(self, waiting > 0 && left > RESUBMIT_NS ? RESUBMIT_NS : left);
        if (ret < 0 && ret != -ETIME)
            return ret;
    }
}

/* Raise OSError(err, message) with a formatted message; returns NULL. */
static PyObject *raise_errno_fmt(int err, const char *fmt, ...)
{
    va_list va;
    va_start(va, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    if (msg == NULL)
        return NULL;
    PyObject *args = Py_BuildValue("(iN)", err, msg);
    if (args != NULL) {
        PyErr_SetObject(PyExc_OSError, args); /* OSError picks TimeoutError for ETIMEDOUT */
        Py_DECREF(args);
    }
    return NULL;
}

static int Ring_init(RingObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"depth", "fds", "timeout_s", "wait_mode", NULL};
    unsigned depth;
    PyObject *fds_obj, *timeout_obj = NULL;
    const char *mode = "auto";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "IO|Os", kwlist, &depth, &fds_obj, &timeout_obj, &mode))
        return -1;
    if (self->ring_ok) {
        PyErr_SetString(PyExc_RuntimeError, "Ring already initialised");
        return -1;
    }
    if (depth < 1 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "queue depth must be 1..4096, got %u", depth);
        return -1;
    }
    long long timeout_ns = MS_DEFAULT_TIMEOUT_NS;
    if (timeout_obj != NULL && timeout_obj != Py_None && ms_parse_timeout(timeout_obj, &timeout_ns) < 0)
        return -1;
    if (strcmp(mode, "auto") != 0 && strcmp(mode, "ext_arg") != 0 && strcmp(mode, "poll") != 0) {
        PyErr_Format(PyExc_ValueError, "wait_mode must be auto, ext_arg or poll, got '%s'", mode);
        return -1;
    }
    Py_ssize_t n;
    int *fds = ms_parse_fds(fds_obj, &n);
    if (fds == NULL)
        return -1;
    /* The CQ ring is twice the SQ ring, which is at least `depth`: with at most
     * `depth` ops in the kernel, each posting one CQE, it can never overflow. */
    int ret = io_uring_queue_init(depth, &self->ring, 0);
    if (ret < 0) {
        PyMem_Free(fds);
        ms_raise_errno(-ret, "io_uring_queue_init");
        return -1;
    }
    int ext_arg = (self->ring.features & IORING_FEAT_EXT_ARG) != 0;
    if (self->ring.cq.ring_entries < depth || (strcmp(mode, "ext_arg") == 0 && !ext_arg)) {
        PyMem_Free(fds);
        io_uring_queue_exit(&self->ring);
        if (!ext_arg && strcmp(mode, "ext_arg") == 0)
            PyErr_SetString(PyExc_OSError, "wait_mode='ext_arg': this kernel has no IORING_FEAT_EXT_ARG (5.11+)");
        else
            PyErr_Format(PyExc_OSError, "io_uring_queue_init: CQ ring of %u entries for depth %u",
                         self->ring.cq.ring_entries, depth);
        return -1;
    }
    ret = io_uring_register_files(&self->ring, fds, (unsigned)n);
    PyMem_Free(fds);
    if (ret < 0) {
        io_uring_queue_exit(&self->ring);
        ms_raise_errno(-ret, "io_uring_register_files");
        return -1;
    }
    self->ring_ok = 1;
    self->wait_mode = ext_arg && strcmp(mode, "poll") != 0 ? WAIT_EXT_ARG : WAIT_POLL;
    self->timeout_ns = timeout_ns;
    self->depth = depth;
    self->nfiles = (int)n;
    return 0;
}

static void release_bufs(RingObject *self)
{
    for (int i = 0; i < self->nbufs; i++)
        PyBuffer_Release(&self->bufs[i]);
    PyMem_Free(self->bufs);
    self->bufs = NULL;
    self->nbufs = 0;
}

static void free_list(op_t **head, op_t **tail)
{
    op_t *op;
    while ((op = pop_front(head, tail)) != NULL) {
        PyBuffer_Release(&op->view);
        PyMem_Free(op);
    }
}

/* Free the ops whose SQEs the kernel never took. Only for teardown: their SQEs
 * stay in the ring, which is then never offered to the kernel again. */
static void drop_unsubmitted(RingObject *self)
{
    struct io_uring_sq *sq = &self->ring.sq;
    unsigned head = io_uring_smp_load_acquire(sq->khead);
    for (unsigned i = head; i != sq->sqe_tail; i++) {
        unsigned idx = sq->array != NULL ? sq->array[i & sq->ring_mask] : (i & sq->ring_mask);
        op_t *op = (op_t *)(uintptr_t)sq->sqes[idx].user_data;
        if (op != NULL) {
            PyBuffer_Release(&op->view);
            PyMem_Free(op);
        }
        self->inflight--;
    }
}

/* Drop queued ops and wait, up to `timeout_ns` without a completion, for the
 * ones the kernel holds: their buffers must outlive its use of them. Returns how
 * many it still held at the deadline (or when the ring failed): those ops and the
 * registered buffers are leaked, never freed under the kernel. */
static unsigned shutdown_ring(RingObject *self, long long timeout_ns)
{
    if (!self->ring_ok)
        return 0;
    free_list(&self->pend_head, &self->pend_tail);
    drop_unsubmitted(self);
    long long deadline = ms_now_ns() + timeout_ns;
    while (self->inflight > 0) {
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&self->ring, head, cqe)
        {
            op_t *op = io_uring_cqe_get_data(cqe);
            if (op != NULL) {
                PyBuffer_Release(&op->view);
                PyMem_Free(op);
            }
            self->inflight--;
            seen++;
        }
        io_uring_cq_advance(&self->ring, seen);
        if (seen > 0) {
            deadline = ms_now_ns() + timeout_ns;
            continue;
        }
        long long left = deadline - ms_now_ns();
        if (left <= 0)
            break;
        int ret;
        Py_BEGIN_ALLOW_THREADS
        ret = wait_cqe(self, left);
        Py_END_ALLOW_THREADS
        if (ret < 0 && ret != -ETIME && ret != -EINTR)
            break; /* ring unusable: leak the op memory rather than free it under the kernel */
    }
    unsigned leaked = self->inflight;
    free_list(&self->done_head, &self->done_tail);
    /* Closing the ring fd is safe with ops still in the kernel: it keeps the ring
     * (and their pinned pages) until they end; only our mapping goes. */
    io_uring_queue_exit(&self->ring);
    if (leaked == 0) {
        release_bufs(self);
    } else {
        self->bufs = NULL; /* leaked with their Py_buffers: the kernel may still use them */
        self->nbufs = 0;
    }
    self->ring_ok = 0;
    self->inflight = 0;
    self->queued = 0;
    self->ndone = 0;
    return leaked;
}

static int check_usable(RingObject *self)
{
    if (!self->ring_ok) {
        PyErr_SetString(PyExc_ValueError, "I/O on a closed Ring");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is in use by another thread");
        return -1;
    }
    return 0;
}

static PyObject *Ring_register_buffers(RingObject *self, PyObject *arg)
{
    if (check_usable(self) < 0)
        return NULL;
    if (self->queued > 0) {
        PyErr_SetString(PyExc_RuntimeError, "cannot change registered buffers while I/O is queued");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "register_buffers expects a sequence of writable buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *bufs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(struct iovec));
    if (bufs == NULL || iov == NULL) {
        Py_DECREF(seq);
        PyMem_Free(bufs);
        PyMem_Free(iov);
        return PyErr_NoMemory();
    }
    Py_ssize_t got = 0;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &bufs[got], PyBUF_WRITABLE) < 0)
            break;
        iov[got].iov_base = bufs[got].buf;
        iov[got].iov_len = (size_t)bufs[got].len;
    }
    Py_DECREF(seq);
    int ret = 0;
    if (got == n) {
        if (self->nbufs > 0) {
            ret = io_uring_unregister_buffers(&self->ring);
            if (ret == 0)
                release_bufs(self);
        }
        if (ret == 0 && n > 0)
            ret = io_uring_register_buffers(&self->ring, iov, (unsigned)n);
    }
    PyMem_Free(iov);
    if (got < n || ret < 0) {
        for (Py_ssize_t i = 0; i < got; i++)
            PyBuffer_Release(&bufs[i]);
        PyMem_Free(bufs);
        return got < n ? NULL : ms_raise_errno(-ret, "io_uring_register_buffers");
    }
    self->bufs = bufs;
    self->nbufs = (int)n;
    Py_RETURN_NONE;
}

static int find_fixed(RingObject *self, const char *addr, size_t len)
{
    for (int i = 0; i < self->nbufs; i++) {
        const char *b = self->bufs[i].buf;
        if (addr >= b && addr + len <= b + self->bufs[i].len)
            return i;
    }
    return -1;
}

static PyObject *raise_broken(RingObject *self)
{
    return raise_errno_fmt(-self->broken, "io_uring_submit: %s (the kernel refused a submission; close this ring)",
                           strerror(-self->broken));
}

/* submit(write, file_index, buffer, offset, tag): queue one op. Once it is queued
 * the op belongs to the ring: a submission error is not raised here (the caller
 * would forget an op the ring still holds) but by the next wait, which reports
 * every op; a transient refusal is offered again by every later pump and wait. */
static PyObject *Ring_submit(RingObject *self, PyObject *args)
{
    int write, file_index;
    PyObject *buffer;
    unsigned long long offset, tag;
    if (!PyArg_ParseTuple(args, "piOKK", &write, &file_index, &buffer, &offset, &tag))
        return NULL;
    if (check_usable(self) < 0)
        return NULL;
    if (self->broken)
        return raise_broken(self);
    op_t *op = PyMem_Calloc(1, sizeof(op_t));
    if (op == NULL)
        return PyErr_NoMemory();
    if (ms_get_io_view(buffer, write, file_index, self->nfiles, &op->view) < 0) {
        PyMem_Free(op);
        return NULL;
    }
    op->tag = tag;
    op->write = write;
    op->file_index = file_index;
    op->addr = op->view.buf;
    op->len = (size_t)op->view.len;
    op->offset = offset;
    op->buf_index = find_fixed(self, op->addr, op->len);
    int fixed = op->buf_index >= 0; /* op may complete, and be freed by a later call, once pumped */
    push_back(&self->pend_head, &self->pend_tail, op);
    self->queued++;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    (void)pump(self); /* a failure is kept in self->broken and raised by wait */
    Py_END_ALLOW_THREADS
    self->busy = 0;
    return PyBool_FromLong(fixed);
}

static PyObject *raise_timeout(RingObject *self)
{
    char secs[32], refused[160] = "";
    PyOS_snprintf(secs, sizeof secs, "%.1f", (double)self->timeout_ns / (double)MS_NS_PER_S);
    unsigned waiting = unsubmitted(self);
    if (waiting > 0)
        PyOS_snprintf(refused, sizeof refused, "; %u of them not taken by the kernel, which refused them (%s)",
                      waiting, self->refused ? strerror(-self->refused) : "no reason given");
    return raise_errno_fmt(ETIMEDOUT, "io_uring wait: no completion in %s s with %u ops in flight%s", secs,
                           self->inflight, refused);
}

/* wait(min_complete=1) -> list of (tag, result); result is bytes moved or -errno.
 * -1 waits for every queued op. Raises TimeoutError when no op completes for
 * timeout_s, ValueError when asked for more ops than are queued. */
static PyObject *Ring_wait(RingObject *self, PyObject *args)
{
    Py_ssize_t want = 1;
    if (!PyArg_ParseTuple(args, "|n", &want))
        return NULL;
    if (check_usable(self) < 0)
        return NULL;
    size_t target = want < 0 ? self->queued : (size_t)want;
    if (target > self->queued)
        return PyErr_Format(PyExc_ValueError, "wait(%zd) with only %zu ops queued would never return", want,
                            self->queued);
    long long deadline = ms_now_ns() + self->timeout_ns;
    int err;
    for (;;) {
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        err = drive(self, target, &deadline);
        Py_END_ALLOW_THREADS
        self->busy = 0;
        if (err != -EINTR)
            break;
        /* A signal: run Python's handlers; one that raises ends the wait (completions
         * stay queued for the next), otherwise the wait goes on to the same deadline. */
        if (PyErr_CheckSignals() < 0)
            return NULL;
    }
    if (err == DRIVE_NOTHING_IN_FLIGHT)
        return PyErr_Format(PyExc_RuntimeError, "Ring.wait: %zu ops queued, %zu done and none in flight",
                            self->queued, self->ndone);
    if (err == -ETIMEDOUT)
        return raise_timeout(self);
    if (err < 0)
        return self->broken ? raise_broken(self) : ms_raise_errno(-err, "io_uring_enter (wait)");
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    op_t *op;
    while ((op = self->done_head) != NULL) {
        PyObject *item = Py_BuildValue("(KL)", op->tag, op->result);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
        pop_front(&self->done_head, &self->done_tail);
        self->ndone--;
        self->queued--;
        PyBuffer_Release(&op->view);
        PyMem_Free(op);
    }
    return out;
}

/* close(timeout_s=None): drop queued ops, wait for the ones in the kernel (up to
 * timeout_s, default the ring's, without a completion), free the ring. Ops still
 * in the kernel then are leaked, not freed, and TimeoutError says so. */
static PyObject *Ring_close(RingObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout_s", NULL};
    PyObject *timeout_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &timeout_obj))
        return NULL;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is in use by another thread");
        return NULL;
    }
    long long timeout_ns = self->timeout_ns;
    if (timeout_obj != NULL && timeout_obj != Py_None && ms_parse_timeout(timeout_obj, &timeout_ns) < 0)
        return NULL;
    unsigned leaked = shutdown_ring(self, timeout_ns);
    if (leaked > 0) {
        char secs[32];
        PyOS_snprintf(secs, sizeof secs, "%.1f", (double)timeout_ns / (double)MS_NS_PER_S);
        return raise_errno_fmt(ETIMEDOUT,
                               "io_uring close: no completion in %s s with %u ops still in the kernel; their buffers "
                               "are leaked, never freed under the kernel",
                               secs, leaked);
    }
    Py_RETURN_NONE;
}

static PyObject *Ring_get_queued(RingObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(self->queued);
}

static PyObject *Ring_get_depth(RingObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(self->depth);
}

static PyObject *Ring_get_timeout(RingObject *self, void *closure)
{
    (void)closure;
    return PyFloat_FromDouble((double)self->timeout_ns / (double)MS_NS_PER_S);
}

static PyObject *Ring_get_wait_mode(RingObject *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(self->wait_mode == WAIT_EXT_ARG ? "ext_arg" : "poll");
}

static PyObject *Ring_get_in_kernel(RingObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(self->ring_ok ? self->inflight - unsubmitted(self) : 0);
}

static void Ring_dealloc(RingObject *self)
{
    unsigned leaked = shutdown_ring(self, self->timeout_ns);
    if (leaked > 0) /* nothing can be raised from here: say it on stderr */
        PySys_WriteStderr("memstrata: an io_uring Ring was freed with %u ops still in the kernel after %lld s; "
                          "their buffers are leaked\n", leaked, self->timeout_ns / MS_NS_PER_S);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Ring_methods[] = {
    {"register_buffers", (PyCFunction)Ring_register_buffers, METH_O,
     "Register writable buffers as io_uring fixed buffers (replaces the previous set)."},
    {"submit", (PyCFunction)Ring_submit, METH_VARARGS,
     "submit(write, file_index, buffer, offset, tag) -> used_fixed_buffer"},
    {"wait", (PyCFunction)Ring_wait, METH_VARARGS,
     "wait(min_complete=1) -> [(tag, bytes_or_-errno)]; -1 waits for all; TimeoutError after timeout_s "
     "without a completion."},
    {"close", (PyCFunction)(void (*)(void))Ring_close, METH_VARARGS | METH_KEYWORDS,
     "close(timeout_s=None): drop queued ops, wait for in-flight ones (bounded), free the ring."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"queued", (getter)Ring_get_queued, NULL, "ops submitted and not yet returned by wait", NULL},
    {"depth", (getter)Ring_get_depth, NULL, "maximum ops in the kernel at once", NULL},
    {"timeout_s", (getter)Ring_get_timeout, NULL, "seconds a wait or close goes without a completion before it fails",
     NULL},
    {"wait_mode", (getter)Ring_get_wait_mode, NULL, "how waits sleep: ext_arg (io_uring_enter timeout) or poll", NULL},
    {"in_kernel", (getter)Ring_get_in_kernel, NULL, "ops whose SQEs the kernel has taken and not completed", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject Ring_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memstrata.runtime._native.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(depth, fds, timeout_s=60.0, wait_mode='auto'): io_uring over registered files with a bounded "
              "queue depth and bounded waits.",
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_init = (initproc)Ring_init,
    .tp_new = PyType_GenericNew,
};

/* Ring: one io_uring over a fixed set of already-opened (O_DIRECT) files.
 *
 * Ops are queued in submission order and at most `depth` are in the kernel at
 * once (the configurable queue depth); the rest wait in a FIFO and are fed in
 * as completions free slots. Each op holds a Py_buffer on its memory until it
 * completes, so Python can never free memory the kernel is still writing.
 * A short transfer is continued from where it stopped; the final result of an
 * op is the bytes moved or -errno, and the façade decides what is an error.
 */
#include "native.h"

#include <errno.h>
#include <liburing.h>
#include <stdint.h>
#include <string.h>

/* One SQE moves at most this much; larger ops continue like short transfers
 * (the kernel caps a single read/write below 2 GiB anyway). */
#define MAX_SQE_BYTES (1u << 30)
#define MAX_RETRIES 16

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
    unsigned depth;
    unsigned inflight;
    size_t queued; /* pending + inflight */
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

/* Move queued ops into the SQ up to the depth limit and submit them.
 * Runs without the GIL: touches only C state. Returns 0 or -errno. */
static int pump(RingObject *self)
{
    unsigned added = 0;
    while (self->inflight < self->depth && self->pend_head) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&self->ring);
        if (sqe == NULL)
            break;
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
        added++;
    }
    if (added == 0)
        return 0;
    int ret;
    do {
        ret = io_uring_submit(&self->ring);
    } while (ret == -EINTR);
    return ret < 0 ? ret : 0;
}

/* Account one CQE. A short transfer is re-queued at the front, so ordering
 * between ops is kept. */
static void complete(RingObject *self, op_t *op, int res, size_t *ndone)
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
    self->queued--;
    push_back(&self->done_head, &self->done_tail, op);
    (*ndone)++;
}

/* Wait (GIL released) until `want` ops have finished. Returns 0 or -errno. */
static int drive(RingObject *self, size_t want)
{
    size_t ndone = 0;
    int err = pump(self);
    while (err == 0 && ndone < want) {
        struct io_uring_cqe *cqe;
        int ret = io_uring_wait_cqe(&self->ring, &cqe);
        if (ret == -EINTR)
            return -EINTR; /* let Python run its signal handlers */
        if (ret < 0)
            return ret;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&self->ring, head, cqe)
        {
            complete(self, (op_t *)io_uring_cqe_get_data(cqe), cqe->res, &ndone);
            seen++;
        }
        io_uring_cq_advance(&self->ring, seen);
        err = pump(self);
    }
    return err;
}

static int Ring_init(RingObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"depth", "fds", NULL};
    unsigned depth;
    PyObject *fds_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "IO", kwlist, &depth, &fds_obj))
        return -1;
    if (self->ring_ok) {
        PyErr_SetString(PyExc_RuntimeError, "Ring already initialised");
        return -1;
    }
    if (depth < 1 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "queue depth must be 1..4096, got %u", depth);
        return -1;
    }
    Py_ssize_t n;
    int *fds = ms_parse_fds(fds_obj, &n);
    if (fds == NULL)
        return -1;
    /* CQ twice the SQ: with at most `depth` in flight it can never overflow. */
    int ret = io_uring_queue_init(depth, &self->ring, 0);
    if (ret < 0) {
        PyMem_Free(fds);
        ms_raise_errno(-ret, "io_uring_queue_init");
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

/* Waits for everything the kernel still holds: its buffers must outlive it. */
static void shutdown_ring(RingObject *self)
{
    if (!self->ring_ok)
        return;
    free_list(&self->pend_head, &self->pend_tail);
    self->queued = self->inflight;
    while (self->inflight > 0) {
        struct io_uring_cqe *cqe;
        int ret;
        Py_BEGIN_ALLOW_THREADS
        ret = io_uring_wait_cqe(&self->ring, &cqe);
        Py_END_ALLOW_THREADS
        if (ret == -EINTR)
            continue;
        if (ret < 0)
            break; /* ring unusable: leak the op memory rather than free it under the kernel */
        op_t *op = io_uring_cqe_get_data(cqe);
        io_uring_cqe_seen(&self->ring, cqe);
        self->inflight--;
        PyBuffer_Release(&op->view);
        PyMem_Free(op);
    }
    free_list(&self->done_head, &self->done_tail);
    if (self->inflight == 0) {
        io_uring_queue_exit(&self->ring);
        release_bufs(self);
    }
    self->ring_ok = 0;
    self->queued = 0;
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

/* submit(write, file_index, buffer, offset, tag): queue one op. */
static PyObject *Ring_submit(RingObject *self, PyObject *args)
{
    int write, file_index;
    PyObject *buffer;
    unsigned long long offset, tag;
    if (!PyArg_ParseTuple(args, "piOKK", &write, &file_index, &buffer, &offset, &tag))
        return NULL;
    if (check_usable(self) < 0)
        return NULL;
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
    push_back(&self->pend_head, &self->pend_tail, op);
    self->queued++;
    int err;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = pump(self);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (err < 0)
        return ms_raise_errno(-err, "io_uring_submit");
    return PyBool_FromLong(op->buf_index >= 0);
}

/* wait(min_complete=1) -> list of (tag, result); result is bytes moved or -errno. */
static PyObject *Ring_wait(RingObject *self, PyObject *args)
{
    Py_ssize_t want = 1;
    if (!PyArg_ParseTuple(args, "|n", &want))
        return NULL;
    if (check_usable(self) < 0)
        return NULL;
    size_t already = 0;
    for (op_t *op = self->done_head; op; op = op->next)
        already++;
    size_t need = want < 0 ? self->queued : (size_t)want;
    need = need > already ? need - already : 0;
    if (need > self->queued)
        need = self->queued;
    int err = 0;
    if (need > 0 || self->pend_head) {
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        err = drive(self, need);
        Py_END_ALLOW_THREADS
        self->busy = 0;
    }
    if (err == -EINTR) {
        if (PyErr_CheckSignals() < 0)
            return NULL; /* completions stay queued for the next wait */
    } else if (err < 0) {
        return ms_raise_errno(-err, "io_uring_wait_cqe");
    }
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
        PyBuffer_Release(&op->view);
        PyMem_Free(op);
    }
    return out;
}

static PyObject *Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is in use by another thread");
        return NULL;
    }
    shutdown_ring(self);
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

static void Ring_dealloc(RingObject *self)
{
    shutdown_ring(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Ring_methods[] = {
    {"register_buffers", (PyCFunction)Ring_register_buffers, METH_O,
     "Register writable buffers as io_uring fixed buffers (replaces the previous set)."},
    {"submit", (PyCFunction)Ring_submit, METH_VARARGS,
     "submit(write, file_index, buffer, offset, tag) -> used_fixed_buffer"},
    {"wait", (PyCFunction)Ring_wait, METH_VARARGS,
     "wait(min_complete=1) -> [(tag, bytes_or_-errno)]; -1 waits for all."},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "Drop queued ops, wait for in-flight ones, free the ring."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"queued", (getter)Ring_get_queued, NULL, "ops submitted and not yet returned by wait", NULL},
    {"depth", (getter)Ring_get_depth, NULL, "maximum ops in the kernel at once", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject Ring_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memstrata.runtime._native.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(depth, fds): io_uring over registered files with a bounded queue depth.",
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_init = (initproc)Ring_init,
    .tp_new = PyType_GenericNew,
};

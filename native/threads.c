/* Threads: the engine's second I/O path, for when the kernel refuses io_uring.
 *
 * containerd 2.x and Docker 25+ removed io_uring from their RuntimeDefault
 * seccomp profiles, kernel.io_uring_disabled can switch it off, and old or
 * hardened kernels lack it; the engine must still move bytes there. This type
 * has Ring's interface (submit / wait / register_buffers / close, the same
 * (tag, bytes_or_-errno) completions) over min(depth, 16) worker threads that
 * each run one pread/pwrite at a time on the already-opened O_DIRECT
 * descriptors (iopool.c), so the façade swaps one for the other and nothing
 * above it changes. Waits are bounded as Ring's are: no completion for
 * timeout_s seconds fails wait (and close) with TimeoutError.
 */
#include "iopool.h"

#include <stdint.h>
#include <stdio.h>
#include <time.h>

/* wait() wakes this often to let Python run its signal handlers (Ctrl-C). */
#define WAIT_SLICE_NS 200000000L

typedef struct {
    PyObject_HEAD
    iopool_t *pool; /* on the heap: leaked, not freed, when a stuck worker is abandoned */
    int ok;         /* open: workers running */
    int busy;       /* set while the GIL is released inside wait() */
    int *fds;
    int nfiles;
    size_t queued; /* submitted and not yet returned by wait */
    long long timeout_ns;
} ThreadsObject;

/* Stop the workers (up to timeout_ns without one finishing), then free every
 * op and the descriptor table. Safe on a half-built object. The descriptors
 * stay open: the façade owns them. Returns 1 when a worker was still stuck in
 * its syscall: the pool and its running ops are then leaked, never freed. */
static int shutdown_threads(ThreadsObject *self, long long timeout_ns)
{
    int abandoned = 0;
    if (self->pool != NULL) {
        iopool_free_ops(iopool_stop(self->pool, timeout_ns, &abandoned));
        if (abandoned)
            self->pool = NULL; /* a detached worker still uses it */
    }
    PyMem_Free(self->fds);
    self->fds = NULL;
    self->queued = 0;
    self->ok = 0;
    return abandoned;
}

/* Raise OSError(err, message): TimeoutError for ETIMEDOUT. Returns NULL. */
static PyObject *raise_errno_msg(int err, PyObject *msg)
{
    if (msg == NULL)
        return NULL;
    PyObject *args = Py_BuildValue("(iN)", err, msg);
    if (args != NULL) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static void seconds(char *buf, size_t n, long long ns)
{
    PyOS_snprintf(buf, n, "%.1f", (double)ns / (double)MS_NS_PER_S);
}

static int Threads_init(ThreadsObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"depth", "fds", "timeout_s", NULL};
    unsigned depth;
    PyObject *fds_obj, *timeout_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "IO|O", kwlist, &depth, &fds_obj, &timeout_obj))
        return -1;
    if (self->ok || self->pool != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Threads already initialised");
        return -1;
    }
    if (depth < 1 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "queue depth must be 1..4096, got %u", depth);
        return -1;
    }
    self->timeout_ns = MS_DEFAULT_TIMEOUT_NS;
    if (timeout_obj != NULL && timeout_obj != Py_None && ms_parse_timeout(timeout_obj, &self->timeout_ns) < 0)
        return -1;
    Py_ssize_t n;
    self->fds = ms_parse_fds(fds_obj, &n);
    if (self->fds == NULL)
        return -1;
    self->nfiles = (int)n;
    self->pool = PyMem_RawCalloc(1, sizeof(iopool_t));
    if (self->pool == NULL) {
        PyMem_Free(self->fds);
        self->fds = NULL;
        PyErr_NoMemory();
        return -1;
    }
    if (iopool_start(self->pool, depth < IOPOOL_MAX_WORKERS ? depth : IOPOOL_MAX_WORKERS) < 0) {
        /* Workers that started idle on an empty queue: they exit at once. Calls nothing
         * that could replace the error being raised. */
        shutdown_threads(self, self->timeout_ns);
        return -1;
    }
    self->ok = 1;
    return 0;
}

static int check_usable(ThreadsObject *self)
{
    if (!self->ok) {
        PyErr_SetString(PyExc_ValueError, "I/O on a closed Threads");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Threads is in use by another thread");
        return -1;
    }
    return 0;
}

/* Fixed buffers are an io_uring feature; here each op's pages are pinned by
 * the pread/pwrite itself. Accepted (and ignored) so the façade need not care. */
static PyObject *Threads_register_buffers(ThreadsObject *self, PyObject *arg)
{
    if (check_usable(self) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(arg, "register_buffers expects a sequence of writable buffers");
    if (seq == NULL)
        return NULL;
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* submit(write, file_index, buffer, offset, tag) -> False (never a fixed buffer). */
static PyObject *Threads_submit(ThreadsObject *self, PyObject *args)
{
    int write, file_index;
    PyObject *buffer;
    unsigned long long offset, tag;
    if (!PyArg_ParseTuple(args, "piOKK", &write, &file_index, &buffer, &offset, &tag))
        return NULL;
    if (check_usable(self) < 0)
        return NULL;
    top_t *op = PyMem_Calloc(1, sizeof(top_t));
    if (op == NULL)
        return PyErr_NoMemory();
    if (ms_get_io_view(buffer, write, file_index, self->nfiles, &op->view) < 0) {
        PyMem_Free(op);
        return NULL;
    }
    op->tag = tag;
    op->write = write;
    op->fd = self->fds[file_index];
    op->addr = op->view.buf;
    op->len = (size_t)op->view.len;
    op->offset = offset;
    self->queued++;
    iopool_push(self->pool, op); /* workers hold the mutex only to move links: brief with the GIL held */
    Py_RETURN_FALSE;
}

/* wait(min_complete=1) -> list of (tag, result); -1 waits for all. As Ring.wait:
 * result is bytes moved or -errno, completions already finished come too,
 * TimeoutError after timeout_s without a completion, ValueError when asked for
 * more ops than are queued. */
static PyObject *Threads_wait(ThreadsObject *self, PyObject *args)
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
    size_t seen = 0;
    for (;;) {
        size_t have;
        long long left = deadline - ms_now_ns();
        long slice = left < WAIT_SLICE_NS ? (long)(left > 0 ? left : 0) : WAIT_SLICE_NS;
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        have = iopool_wait(self->pool, target, slice);
        Py_END_ALLOW_THREADS
        self->busy = 0;
        if (have >= target)
            break;
        if (have > seen) { /* a completion: the timeout counts from here */
            seen = have;
            deadline = ms_now_ns() + self->timeout_ns;
        } else if (ms_now_ns() >= deadline) {
            char secs[32];
            seconds(secs, sizeof secs, self->timeout_ns);
            return raise_errno_msg(ETIMEDOUT, PyUnicode_FromFormat(
                "I/O threads wait: no completion in %s s with %zu ops in flight (%u worker threads)", secs,
                self->queued - have, self->pool->nworkers));
        }
        if (PyErr_CheckSignals() < 0)
            return NULL; /* completions stay queued for the next wait */
    }
    size_t taken;
    top_t *list = iopool_take_done(self->pool, &taken);
    self->queued -= taken;
    PyObject *out = PyList_New(0);
    for (top_t *op = list; op != NULL && out != NULL; op = op->next) {
        PyObject *item = Py_BuildValue("(KL)", op->tag, op->result);
        if (item == NULL || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    /* On an allocation failure the results are lost, as in Ring.wait: the op memory is still freed. */
    iopool_free_ops(list);
    return out;
}

/* close(timeout_s=None): drop queued ops, let running ones finish (up to timeout_s,
 * default the queue's, without one finishing), stop the workers. Workers still stuck
 * then are detached and their ops leaked, and TimeoutError says so. */
static PyObject *Threads_close(ThreadsObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout_s", NULL};
    PyObject *timeout_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &timeout_obj))
        return NULL;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Threads is in use by another thread");
        return NULL;
    }
    long long timeout_ns = self->timeout_ns;
    if (timeout_obj != NULL && timeout_obj != Py_None && ms_parse_timeout(timeout_obj, &timeout_ns) < 0)
        return NULL;
    if (self->ok && shutdown_threads(self, timeout_ns)) {
        char secs[32];
        seconds(secs, sizeof secs, timeout_ns);
        return raise_errno_msg(ETIMEDOUT, PyUnicode_FromFormat(
            "I/O threads close: a worker thread made no progress in %s s; the stuck threads are detached and "
            "their ops' buffers leaked, never freed under them", secs));
    }
    Py_RETURN_NONE;
}

static PyObject *Threads_get_queued(ThreadsObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(self->queued);
}

static PyObject *Threads_get_depth(ThreadsObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLong(self->ok ? self->pool->nworkers : 0);
}

static PyObject *Threads_get_timeout(ThreadsObject *self, void *closure)
{
    (void)closure;
    return PyFloat_FromDouble((double)self->timeout_ns / (double)MS_NS_PER_S);
}

static void Threads_dealloc(ThreadsObject *self)
{
    if (shutdown_threads(self, self->timeout_ns)) /* nothing can be raised from here: say it on stderr */
        PySys_WriteStderr("memstrata: I/O threads freed with a worker stuck in its syscall for %lld s; it is "
                          "detached and its buffers leaked\n", self->timeout_ns / MS_NS_PER_S);
    if (self->pool != NULL) {
        iopool_destroy(self->pool);
        PyMem_RawFree(self->pool);
        self->pool = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Threads_methods[] = {
    {"register_buffers", (PyCFunction)Threads_register_buffers, METH_O,
     "Accepted for Ring compatibility; the thread path has no fixed buffers."},
    {"submit", (PyCFunction)Threads_submit, METH_VARARGS,
     "submit(write, file_index, buffer, offset, tag) -> False"},
    {"wait", (PyCFunction)Threads_wait, METH_VARARGS,
     "wait(min_complete=1) -> [(tag, bytes_or_-errno)]; -1 waits for all."},
    {"close", (PyCFunction)(void (*)(void))Threads_close, METH_VARARGS | METH_KEYWORDS,
     "close(timeout_s=None): drop queued ops, finish running ones (bounded), join the workers."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Threads_getset[] = {
    {"queued", (getter)Threads_get_queued, NULL, "ops submitted and not yet returned by wait", NULL},
    {"depth", (getter)Threads_get_depth, NULL, "worker threads: ops in the kernel at once", NULL},
    {"timeout_s", (getter)Threads_get_timeout, NULL,
     "seconds a wait or close goes without a completion before it fails", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject Threads_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memstrata.runtime._native.Threads",
    .tp_basicsize = sizeof(ThreadsObject),
    .tp_dealloc = (destructor)Threads_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Threads(depth, fds, timeout_s=60.0): Ring's interface over min(depth, 16) pread/pwrite worker threads.",
    .tp_methods = Threads_methods,
    .tp_getset = Threads_getset,
    .tp_init = (initproc)Threads_init,
    .tp_new = PyType_GenericNew,
};

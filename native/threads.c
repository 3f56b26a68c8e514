/* Threads: the engine's second I/O path, for when the kernel refuses io_uring.
 *
 * containerd 2.x and Docker 25+ removed io_uring from their RuntimeDefault
 * seccomp profiles, kernel.io_uring_disabled can switch it off, and old or
 * hardened kernels lack it; the engine must still move bytes there. This type
 * has Ring's interface (submit / wait / register_buffers / close, the same
 * (tag, bytes_or_-errno) completions) over min(depth, 16) worker threads that
 * each run one pread/pwrite at a time on the already-opened O_DIRECT
 * descriptors (iopool.c), so the façade swaps one for the other and nothing
 * above it changes.
 */
#include "iopool.h"

#include <stdint.h>

/* wait() wakes this often to let Python run its signal handlers (Ctrl-C). */
#define WAIT_SLICE_NS 200000000L

typedef struct {
    PyObject_HEAD
    iopool_t pool;
    int ok;   /* open: workers running */
    int busy; /* set while the GIL is released inside wait() */
    int *fds;
    int nfiles;
    size_t queued; /* submitted and not yet returned by wait */
} ThreadsObject;

/* Join the workers, then free every op and the descriptor table. Safe on a
 * half-built object. The descriptors stay open: the façade owns them. */
static void shutdown_threads(ThreadsObject *self)
{
    iopool_free_ops(iopool_stop(&self->pool));
    PyMem_Free(self->fds);
    self->fds = NULL;
    self->queued = 0;
    self->ok = 0;
}

static int Threads_init(ThreadsObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"depth", "fds", NULL};
    unsigned depth;
    PyObject *fds_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "IO", kwlist, &depth, &fds_obj))
        return -1;
    if (self->ok || self->pool.sync_ok) {
        PyErr_SetString(PyExc_RuntimeError, "Threads already initialised");
        return -1;
    }
    if (depth < 1 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "queue depth must be 1..4096, got %u", depth);
        return -1;
    }
    Py_ssize_t n;
    self->fds = ms_parse_fds(fds_obj, &n);
    if (self->fds == NULL)
        return -1;
    self->nfiles = (int)n;
    if (iopool_start(&self->pool, depth < IOPOOL_MAX_WORKERS ? depth : IOPOOL_MAX_WORKERS) < 0) {
        shutdown_threads(self); /* calls nothing that could replace the error being raised */
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
    iopool_push(&self->pool, op); /* workers hold the mutex only to move links: brief with the GIL held */
    Py_RETURN_FALSE;
}

/* wait(min_complete=1) -> list of (tag, result); -1 waits for all. As Ring.wait:
 * result is bytes moved or -errno, and completions already finished come too. */
static PyObject *Threads_wait(ThreadsObject *self, PyObject *args)
{
    Py_ssize_t want = 1;
    if (!PyArg_ParseTuple(args, "|n", &want))
        return NULL;
    if (check_usable(self) < 0)
        return NULL;
    size_t target = want < 0 ? self->queued : (size_t)want;
    if (target > self->queued)
        target = self->queued;
    for (;;) {
        size_t have;
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        have = iopool_wait(&self->pool, target, WAIT_SLICE_NS);
        Py_END_ALLOW_THREADS
        self->busy = 0;
        if (have >= target)
            break;
        if (PyErr_CheckSignals() < 0)
            return NULL; /* completions stay queued for the next wait */
    }
    size_t taken;
    top_t *list = iopool_take_done(&self->pool, &taken);
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

static PyObject *Threads_close(ThreadsObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Threads is in use by another thread");
        return NULL;
    }
    if (self->ok)
        shutdown_threads(self);
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
    return PyLong_FromUnsignedLong(self->ok ? self->pool.nworkers : 0);
}

static void Threads_dealloc(ThreadsObject *self)
{
    shutdown_threads(self);
    iopool_destroy(&self->pool);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Threads_methods[] = {
    {"register_buffers", (PyCFunction)Threads_register_buffers, METH_O,
     "Accepted for Ring compatibility; the thread path has no fixed buffers."},
    {"submit", (PyCFunction)Threads_submit, METH_VARARGS,
     "submit(write, file_index, buffer, offset, tag) -> False"},
    {"wait", (PyCFunction)Threads_wait, METH_VARARGS,
     "wait(min_complete=1) -> [(tag, bytes_or_-errno)]; -1 waits for all."},
    {"close", (PyCFunction)Threads_close, METH_NOARGS, "Drop queued ops, finish running ones, join the workers."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Threads_getset[] = {
    {"queued", (getter)Threads_get_queued, NULL, "ops submitted and not yet returned by wait", NULL},
    {"depth", (getter)Threads_get_depth, NULL, "worker threads: ops in the kernel at once", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject Threads_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memstrata.runtime._native.Threads",
    .tp_basicsize = sizeof(ThreadsObject),
    .tp_dealloc = (destructor)Threads_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Threads(depth, fds): Ring's interface over min(depth, 16) pread/pwrite worker threads.",
    .tp_methods = Threads_methods,
    .tp_getset = Threads_getset,
    .tp_init = (initproc)Threads_init,
    .tp_new = PyType_GenericNew,
};

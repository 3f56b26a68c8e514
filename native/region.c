/* Region: one anonymous mmap that backs a NUMA arena or a pinned arena.
 *
 * Page-aligned (so O_DIRECT and cudaHostRegister accept it), exported through
 * the buffer protocol without copies, and never unmapped while a memoryview,
 * numpy array or in-flight I/O still holds it (close() refuses instead).
 * Placement: bind() applies an mbind policy before the pages are touched;
 * node_of_pages() asks the kernel (move_pages) where each page really is.
 */
#include "native.h"

#include <errno.h>
#include <numaif.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define MAX_NODES 1024
#define MASK_WORDS (MAX_NODES / (8 * sizeof(unsigned long)))

typedef struct {
    PyObject_HEAD
    char *addr;
    size_t size;
    Py_ssize_t exports;
    int locked;
} RegionObject;

static size_t page_size(void)
{
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? (size_t)p : 4096;
}

static int Region_init(RegionObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"size", NULL};
    unsigned long long size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "K", kwlist, &size))
        return -1;
    if (self->addr != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Region already initialised");
        return -1;
    }
    size_t ps = page_size();
    if (size == 0 || size % ps != 0) {
        PyErr_Format(PyExc_ValueError, "region size must be a positive multiple of %zu bytes, got %llu", ps,
                     size);
        return -1;
    }
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        ms_raise_errno(errno, "mmap");
        return -1;
    }
    self->addr = p;
    self->size = (size_t)size;
    return 0;
}

static int check_open(RegionObject *self)
{
    if (self->addr == NULL) {
        PyErr_SetString(PyExc_ValueError, "operation on a closed Region");
        return -1;
    }
    return 0;
}

/* bind(nodes, mode): mode 0 bind, 1 interleave, 2 preferred. Pages already
 * touched are moved (MPOL_MF_MOVE) and the call fails if one cannot be
 * (MPOL_MF_STRICT), so a placement is never silently ignored. */
static PyObject *Region_bind(RegionObject *self, PyObject *args)
{
    PyObject *nodes_obj;
    int mode;
    if (!PyArg_ParseTuple(args, "Oi", &nodes_obj, &mode))
        return NULL;
    if (check_open(self) < 0)
        return NULL;
    static const int modes[] = {MPOL_BIND, MPOL_INTERLEAVE, MPOL_PREFERRED};
    if (mode < 0 || mode > 2) {
        PyErr_Format(PyExc_ValueError, "unknown placement mode %d", mode);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(nodes_obj, "nodes must be a sequence of node ids");
    if (seq == NULL)
        return NULL;
    unsigned long mask[MASK_WORDS];
    memset(mask, 0, sizeof(mask));
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        long node = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (node == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        if (node < 0 || node >= MAX_NODES) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "NUMA node %ld out of range 0..%d", node, MAX_NODES - 1);
            return NULL;
        }
        mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
    }
    Py_DECREF(seq);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "nodes must not be empty");
        return NULL;
    }
    long ret;
    Py_BEGIN_ALLOW_THREADS
    ret = mbind(self->addr, self->size, modes[mode], mask, MAX_NODES + 1, MPOL_MF_STRICT | MPOL_MF_MOVE);
    Py_END_ALLOW_THREADS
    if (ret != 0)
        return ms_raise_errno(errno, "mbind");
    Py_RETURN_NONE;
}

/* populate(): fault every page in now, under the region's policy, so that
 * placement happens at setup and not in the middle of a training step. */
static PyObject *Region_populate(RegionObject *self, PyObject *Py_UNUSED(ignored))
{
    if (check_open(self) < 0)
        return NULL;
    int ret, err = 0;
    Py_BEGIN_ALLOW_THREADS
    ret = madvise(self->addr, self->size, MADV_POPULATE_WRITE);
    if (ret != 0) {
        err = errno;
        if (err == EINVAL) { /* kernel < 5.14: touch each page instead */
            size_t ps = page_size();
            for (size_t off = 0; off < self->size; off += ps)
                ((volatile char *)self->addr)[off] = ((volatile char *)self->addr)[off];
            ret = 0;
        }
    }
    Py_END_ALLOW_THREADS
    if (ret != 0)
        return ms_raise_errno(err, "madvise(MADV_POPULATE_WRITE)");
    Py_RETURN_NONE;
}

static PyObject *Region_lock(RegionObject *self, PyObject *Py_UNUSED(ignored))
{
    if (check_open(self) < 0)
        return NULL;
    if (self->locked)
        Py_RETURN_NONE;
    int ret, err = 0;
    Py_BEGIN_ALLOW_THREADS
    ret = mlock(self->addr, self->size);
    if (ret != 0)
        err = errno;
    Py_END_ALLOW_THREADS
    if (ret != 0)
        return ms_raise_errno(err, "mlock");
    self->locked = 1;
    Py_RETURN_NONE;
}

static PyObject *Region_unlock(RegionObject *self, PyObject *Py_UNUSED(ignored))
{
    if (check_open(self) < 0)
        return NULL;
    if (self->locked && munlock(self->addr, self->size) != 0)
        return ms_raise_errno(errno, "munlock");
    self->locked = 0;
    Py_RETURN_NONE;
}

/* node_of_pages(offset, length) -> list of node ids, or -errno for a page that
 * is not present (-ENOENT: never touched). */
static PyObject *Region_node_of_pages(RegionObject *self, PyObject *args)
{
    unsigned long long offset = 0, length = 0;
    if (!PyArg_ParseTuple(args, "|KK", &offset, &length))
        return NULL;
    if (check_open(self) < 0)
        return NULL;
    if (length == 0)
        length = offset < self->size ? self->size - offset : 0;
    if (offset > self->size || length > self->size - offset) {
        PyErr_Format(PyExc_ValueError, "range %llu+%llu outside region of %zu bytes", offset, length,
                     self->size);
        return NULL;
    }
    size_t ps = page_size();
    size_t first = (size_t)offset / ps * ps;
    size_t count = ((size_t)(offset + length) - first + ps - 1) / ps;
    void **pages = PyMem_Calloc(count ? count : 1, sizeof(void *));
    int *status = PyMem_Calloc(count ? count : 1, sizeof(int));
    if (pages == NULL || status == NULL) {
        PyMem_Free(pages);
        PyMem_Free(status);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < count; i++)
        pages[i] = self->addr + first + i * ps;
    long ret = 0;
    int err = 0;
    if (count > 0) {
        Py_BEGIN_ALLOW_THREADS
        ret = move_pages(0, count, pages, NULL, status, 0);
        if (ret != 0)
            err = errno;
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(pages);
    if (ret != 0) {
        PyMem_Free(status);
        return ms_raise_errno(err, "move_pages");
    }
    PyObject *out = PyList_New((Py_ssize_t)count);
    for (size_t i = 0; out != NULL && i < count; i++) {
        PyObject *v = PyLong_FromLong(status[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    PyMem_Free(status);
    return out;
}

static PyObject *Region_close(RegionObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->addr == NULL)
        Py_RETURN_NONE;
    if (self->exports > 0) {
        PyErr_Format(PyExc_BufferError, "cannot close region: %zd views of it are still alive", self->exports);
        return NULL;
    }
    if (munmap(self->addr, self->size) != 0)
        return ms_raise_errno(errno, "munmap");
    self->addr = NULL;
    self->locked = 0;
    Py_RETURN_NONE;
}

static int Region_getbuffer(RegionObject *self, Py_buffer *view, int flags)
{
    if (check_open(self) < 0) {
        view->obj = NULL;
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->addr, (Py_ssize_t)self->size, 0, flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void Region_releasebuffer(RegionObject *self, Py_buffer *view)
{
    (void)view;
    self->exports--;
}

static void Region_dealloc(RegionObject *self)
{
    /* No export can be alive here: each holds a reference to self. */
    if (self->addr != NULL)
        munmap(self->addr, self->size);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Region_get_address(RegionObject *self, void *c)
{
    (void)c;
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->addr);
}
static PyObject *Region_get_size(RegionObject *self, void *c)
{
    (void)c;
    return PyLong_FromSize_t(self->addr ? self->size : 0);
}
static PyObject *Region_get_locked(RegionObject *self, void *c)
{
    (void)c;
    return PyBool_FromLong(self->locked);
}
static PyObject *Region_get_exports(RegionObject *self, void *c)
{
    (void)c;
    return PyLong_FromSsize_t(self->exports);
}

static PyBufferProcs Region_as_buffer = {
    .bf_getbuffer = (getbufferproc)Region_getbuffer,
    .bf_releasebuffer = (releasebufferproc)Region_releasebuffer,
};

static PyMethodDef Region_methods[] = {
    {"bind", (PyCFunction)Region_bind, METH_VARARGS, "bind(nodes, mode): mbind; mode 0 bind, 1 interleave, 2 preferred."},
    {"populate", (PyCFunction)Region_populate, METH_NOARGS, "Fault in every page now."},
    {"lock", (PyCFunction)Region_lock, METH_NOARGS, "mlock the whole region."},
    {"unlock", (PyCFunction)Region_unlock, METH_NOARGS, "munlock the whole region."},
    {"node_of_pages", (PyCFunction)Region_node_of_pages, METH_VARARGS,
     "node_of_pages(offset=0, length=0) -> [node or -errno per page] (move_pages)."},
    {"close", (PyCFunction)Region_close, METH_NOARGS, "munmap; refused while views are alive."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Region_getset[] = {
    {"address", (getter)Region_get_address, NULL, "start address (page aligned)", NULL},
    {"size", (getter)Region_get_size, NULL, "bytes mapped (0 once closed)", NULL},
    {"locked", (getter)Region_get_locked, NULL, "whether mlock succeeded", NULL},
    {"exports", (getter)Region_get_exports, NULL, "live buffer views", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject Region_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memstrata.runtime._native.Region",
    .tp_basicsize = sizeof(RegionObject),
    .tp_dealloc = (destructor)Region_dealloc,
    .tp_as_buffer = &Region_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Region(size): anonymous page-aligned mapping with NUMA policy, mlock and the buffer protocol.",
    .tp_methods = Region_methods,
    .tp_getset = Region_getset,
    .tp_init = (initproc)Region_init,
    .tp_new = PyType_GenericNew,
};

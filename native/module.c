/* Module table of memstrata.runtime._native. No Python façade other than
 * nvme/numa/pinned/overflow imports this module. */
#include "native.h"

#include <string.h>
#include <unistd.h>

PyObject *ms_raise_errno(int err, const char *what)
{
    PyObject *exc = Py_BuildValue("(is)", err, what);
    if (exc == NULL)
        return NULL;
    /* OSError(errno, strerror) picks the subclass (FileNotFoundError, ...)
     * from errno; the message carries the failing call for the façade. */
    PyObject *msg = PyUnicode_FromFormat("%s: %s", what, strerror(err));
    if (msg == NULL) {
        Py_DECREF(exc);
        return NULL;
    }
    Py_SETREF(exc, Py_BuildValue("(iN)", err, msg));
    if (exc != NULL) {
        PyErr_SetObject(PyExc_OSError, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* buffer_address(obj) -> (address, nbytes, readonly): lets the façade decide
 * whether a buffer meets O_DIRECT alignment before submitting it. */
PyObject *ms_buffer_address(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *res = Py_BuildValue("(KnO)", (unsigned long long)(uintptr_t)view.buf, view.len,
                                  view.readonly ? Py_True : Py_False);
    PyBuffer_Release(&view);
    return res;
}

static PyMethodDef module_methods[] = {
    {"scan_nonfinite", ms_scan_nonfinite, METH_VARARGS,
     "scan_nonfinite(buffer, kind) -> (n_inf, n_nan); kind in f32, f16, bf16, f64. One pass, no temporaries."},
    {"buffer_address", ms_buffer_address, METH_O,
     "buffer_address(obj) -> (address, nbytes, readonly) of a C-contiguous buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "memstrata.runtime._native._core",
    "io_uring raw-NVMe ring (and its pread/pwrite thread fallback), NUMA/pinned memory regions, one-pass overflow scan.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void)
{
    if (PyType_Ready(&Ring_Type) < 0 || PyType_Ready(&Threads_Type) < 0 || PyType_Ready(&Region_Type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Ring", (PyObject *)&Ring_Type) < 0 ||
        PyModule_AddObjectRef(m, "Threads", (PyObject *)&Threads_Type) < 0 ||
        PyModule_AddObjectRef(m, "Region", (PyObject *)&Region_Type) < 0 ||
        PyModule_AddIntConstant(m, "PAGE_SIZE", sysconf(_SC_PAGESIZE)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

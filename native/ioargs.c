/* Argument checks shared by the two I/O queues (ring.c over io_uring, threads.c over
 * pread/pwrite): both take the same fds at construction and the same ops at submit,
 * and must refuse the same bad input with the same errors. */
#include "native.h"

#include <time.h>

int *ms_parse_fds(PyObject *fds_obj, Py_ssize_t *n_out)
{
    PyObject *seq = PySequence_Fast(fds_obj, "fds must be a sequence of file descriptors");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > 1024) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "fds must hold 1..1024 file descriptors");
        return NULL;
    }
    int *fds = PyMem_Calloc((size_t)n, sizeof(int));
    if (fds == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((fd == -1 && PyErr_Occurred()) || fd < 0 || fd > INT32_MAX) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "invalid file descriptor %ld", fd);
            Py_DECREF(seq);
            PyMem_Free(fds);
            return NULL;
        }
        fds[i] = (int)fd;
    }
    Py_DECREF(seq);
    *n_out = n;
    return fds;
}

int ms_get_io_view(PyObject *buffer, int write, int file_index, int nfiles, Py_buffer *view)
{
    if (file_index < 0 || file_index >= nfiles) {
        PyErr_Format(PyExc_IndexError, "file index %d out of range (ring has %d files)", file_index, nfiles);
        return -1;
    }
    /* A write reads the buffer, a read fills it. */
    if (PyObject_GetBuffer(buffer, view, write ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0)
        return -1;
    if (view->len == 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "zero-length I/O");
        return -1;
    }
    return 0;
}

/* clock_gettime fails only for an unknown clock or a bad pointer, neither possible here. */
long long ms_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * MS_NS_PER_S + ts.tv_nsec;
}

int ms_parse_timeout(PyObject *obj, long long *out_ns)
{
    double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    if (!(s >= 0.0) || s > 365.0 * 86400.0) {
        PyErr_Format(PyExc_ValueError, "timeout_s must be between 0 and a year, got %R", obj);
        return -1;
    }
    *out_ns = (long long)(s * (double)MS_NS_PER_S);
    return 0;
}

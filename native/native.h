/* memstrata.runtime._native — shared declarations.
 *
 * The extension is a thin layer: every function checks its syscall and raises
 * OSError(errno, message) on failure; the Python façades (nvme, numa, pinned,
 * overflow) turn those into memstrata's own exceptions with device, offset
 * and length attached, because only they know which tensor an op belongs to.
 */
#ifndef MEMSTRATA_NATIVE_H
#define MEMSTRATA_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyTypeObject Ring_Type;
extern PyTypeObject Threads_Type; /* Ring's interface over pread/pwrite threads (threads.c) */
extern PyTypeObject Region_Type;

/* Raise OSError(err, "<what>: <strerror>") and return NULL. */
PyObject *ms_raise_errno(int err, const char *what);

PyObject *ms_scan_nonfinite(PyObject *self, PyObject *args);
PyObject *ms_buffer_address(PyObject *self, PyObject *arg);

#endif

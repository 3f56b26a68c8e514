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

/* The `fds` argument of Ring and Threads: 1..1024 descriptors, copied into a PyMem array the caller
 * frees; NULL with an exception set on bad input. */
int *ms_parse_fds(PyObject *fds_obj, Py_ssize_t *n_out);
/* One submitted op's checks: its file index is in range, and `view` gets its buffer (writable for a
 * read), never empty; -1 with an exception set (and nothing held) otherwise. */
int ms_get_io_view(PyObject *buffer, int write, int file_index, int nfiles, Py_buffer *view);

/* Time limits of the two queues' waits and closes (ring.c, threads.c; ioargs.c). */
#define MS_NS_PER_S 1000000000LL
#define MS_DEFAULT_TIMEOUT_NS (60LL * MS_NS_PER_S) /* without a completion, a wait fails */
/* CLOCK_MONOTONIC in ns. */
long long ms_now_ns(void);
/* A `timeout_s` argument, 0 to a year of seconds, into *out_ns; -1 with ValueError set otherwise. */
int ms_parse_timeout(PyObject *obj, long long *out_ns);

PyObject *ms_scan_nonfinite(PyObject *self, PyObject *args);
PyObject *ms_buffer_address(PyObject *self, PyObject *arg);

#endif

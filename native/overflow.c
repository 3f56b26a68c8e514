/* One pass over a gradient buffer counting inf and nan, with no temporaries.
 *
 * DeepSpeed's check builds two full-size bool tensors (isinf, isnan); this
 * reads each element once and keeps two counters. The test is on the bit
 * pattern (exponent all ones: mantissa zero is inf, non-zero is nan), which
 * the compiler vectorizes; AVX2 and baseline clones are picked at load time.
 * Counters are 32-bit inside a block so the vector lanes stay narrow.
 */
#include "native.h"

#include <stdint.h>
#include <string.h>

/* Unaligned, alias-safe element types: any buffer offset is accepted. */
typedef uint16_t u16u __attribute__((aligned(1), may_alias));
typedef uint32_t u32u __attribute__((aligned(1), may_alias));
typedef uint64_t u64u __attribute__((aligned(1), may_alias));

#define BLOCK 65536

#define SCAN_FN(name, T, UT, ABS_MASK, EXP_MASK)                                                         \
    __attribute__((target_clones("avx2", "default"), optimize("O3"))) static void name(                 \
        const T *p, size_t n, uint64_t *inf, uint64_t *nan)                                              \
    {                                                                                                    \
        uint64_t ti = 0, tn = 0;                                                                         \
        for (size_t base = 0; base < n; base += BLOCK) {                                                 \
            size_t end = n - base < BLOCK ? n : base + BLOCK;                                            \
            uint32_t ci = 0, cn = 0;                                                                     \
            for (size_t i = base; i < end; i++) {                                                        \
                UT a = (UT)(p[i] & (UT)ABS_MASK);                                                        \
                ci += a == (UT)EXP_MASK;                                                                 \
                cn += a > (UT)EXP_MASK;                                                                  \
            }                                                                                            \
            ti += ci;                                                                                    \
            tn += cn;                                                                                    \
        }                                                                                                \
        *inf = ti;                                                                                       \
        *nan = tn;                                                                                       \
    }

SCAN_FN(scan_f16, u16u, uint16_t, 0x7fffu, 0x7c00u)
SCAN_FN(scan_bf16, u16u, uint16_t, 0x7fffu, 0x7f80u)
SCAN_FN(scan_f32, u32u, uint32_t, 0x7fffffffu, 0x7f800000u)
SCAN_FN(scan_f64, u64u, uint64_t, 0x7fffffffffffffffull, 0x7ff0000000000000ull)

PyObject *ms_scan_nonfinite(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *obj;
    const char *kind;
    if (!PyArg_ParseTuple(args, "Os", &obj, &kind))
        return NULL;
    size_t item;
    int which;
    if (strcmp(kind, "f16") == 0) {
        item = 2;
        which = 0;
    } else if (strcmp(kind, "bf16") == 0) {
        item = 2;
        which = 1;
    } else if (strcmp(kind, "f32") == 0) {
        item = 4;
        which = 2;
    } else if (strcmp(kind, "f64") == 0) {
        item = 8;
        which = 3;
    } else {
        PyErr_Format(PyExc_ValueError, "unsupported dtype kind %R (expected f16, bf16, f32 or f64)", PyTuple_GET_ITEM(args, 1));
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if ((size_t)view.len % item != 0) {
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is not a whole number of %s elements (%zu bytes)",
                     view.len, kind, item);
        PyBuffer_Release(&view);
        return NULL;
    }
    size_t n = (size_t)view.len / item;
    uint64_t ninf = 0, nnan = 0;
    Py_BEGIN_ALLOW_THREADS
    switch (which) {
    case 0: scan_f16(view.buf, n, &ninf, &nnan); break;
    case 1: scan_bf16(view.buf, n, &ninf, &nnan); break;
    case 2: scan_f32(view.buf, n, &ninf, &nnan); break;
    default: scan_f64(view.buf, n, &ninf, &nnan); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(KK)", (unsigned long long)ninf, (unsigned long long)nnan);
}

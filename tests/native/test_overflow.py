"""The one-pass overflow check against a pure-Python reference (and numpy's, when present)."""
from __future__ import annotations

import math
import random
import resource
import struct

import pytest

from memstrata.runtime import _native
from memstrata.runtime.strata.overflow import check_overflow, has_overflow

FORMATS = {"float16": ("e", 2), "float32": ("f", 4), "float64": ("d", 8)}


def _reference(raw: bytes, dtype: str) -> tuple[int, int]:
    if dtype == "bfloat16":  # bf16 is the top half of a float32
        values = [struct.unpack("<f", struct.pack("<I", b << 16))[0]
                  for (b,) in struct.iter_unpack("<H", raw)]
    else:
        values = [v for (v,) in struct.iter_unpack("<" + FORMATS[dtype][0], raw)]
    return sum(map(math.isinf, values)), sum(map(math.isnan, values))


def _awkward_buffer(dtype: str, n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    size = 2 if dtype == "bfloat16" else FORMATS[dtype][1]
    out = bytearray(rng.randbytes(n * size))  # random bit patterns: many nans, some infs
    return bytes(out)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("n", [1, 7, 100_003])
def test_counts_match_pure_python_reference(dtype: str, n: int) -> None:
    raw = _awkward_buffer(dtype, n, n)
    report = check_overflow(raw, dtype)
    assert (report.inf_count, report.nan_count) == _reference(raw, dtype)
    shifted = b"\0" + raw  # elements at an odd address are read correctly too
    assert check_overflow(memoryview(shifted)[1:], dtype) == report


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_finite_buffer_and_single_bad_element(dtype: str) -> None:
    fmt, size = FORMATS[dtype]
    clean = struct.pack(f"<{4099}{fmt}", *[float(i) * 1e-3 for i in range(4099)])
    assert not has_overflow(clean, dtype)
    for bad, expect in ((math.inf, (1, 0)), (-math.inf, (1, 0)), (math.nan, (0, 1))):
        buf = bytearray(clean)
        buf[4097 * size : 4098 * size] = struct.pack("<" + fmt, bad)
        r = check_overflow(bytes(buf), dtype)
        assert (r.inf_count, r.nan_count) == expect


def test_matches_numpy_on_arrays() -> None:
    np = pytest.importorskip("numpy", reason="numpy reference needs numpy (the runtime extra has it)")
    rng = np.random.default_rng(0)
    for dtype in ("float16", "float32", "float64"):
        with np.errstate(over="ignore"):
            a = (rng.standard_normal(1_000_001) * 3e4).astype(dtype)  # float16 overflows to inf
        a[::9973] = np.nan
        r = check_overflow(a)
        assert (r.inf_count, r.nan_count) == (int(np.isinf(a).sum()), int(np.isnan(a).sum()))


def test_torch_bfloat16_tensor() -> None:
    torch = pytest.importorskip("torch", reason="torch tensors need torch (the runtime extra has it)")
    t = torch.randn(70_001).to(torch.bfloat16) * 1e38
    t[5] = float("nan")
    r = check_overflow(t)
    assert (r.inf_count, r.nan_count) == (int(torch.isinf(t).sum()), int(torch.isnan(t).sum()))


def test_scan_allocates_no_full_size_temporary() -> None:
    region = _native.Region(256 << 20)
    region.populate()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = check_overflow(memoryview(region), "float32")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert r.inf_count == r.nan_count == 0
    assert grown_kib < 4096  # an isinf/isnan mask of 64 Mi elements would be 64 MiB


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        check_overflow(b"1234", "int8")
    with pytest.raises(ValueError, match="not a whole number of f32 elements"):
        check_overflow(b"123", "float32")
    with pytest.raises(TypeError, match="pass dtype="):
        check_overflow(b"1234")

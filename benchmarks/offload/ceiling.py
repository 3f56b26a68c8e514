"""What the scratch disk can do, measured first with fio (benchmarks/io's own fio invocation): sequential
read and write, 1 MiB blocks, direct I/O, a few seconds each, on a file in the scratch directory (what stock
DeepSpeed swaps to) and on a loop device with direct I/O over that same file (what memstrata swaps to).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

MiB = 1 << 20
IO_RUN = Path(__file__).resolve().parents[1] / "io" / "run.py"
QUEUE_DEPTH = 8  # the aio queue depth both engines' ds_config asks for


def _io_bench() -> Any:
    """benchmarks/io/run.py as a module (its name would clash with this directory's run.py)."""
    spec = importlib.util.spec_from_file_location("memstrata_io_bench", IO_RUN)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fio(io: Any, target: str, op: str, total: int, seconds: float) -> float:
    """Bytes per second of one fio job; time-based, so it runs `seconds` over a region of `total` bytes."""
    cmd = io.fio_command(target, op, MiB, QUEUE_DEPTH, total) + ["--time_based", f"--runtime={seconds:g}"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return float(out["jobs"][0][op]["bw_bytes"])


def measure(scratch: Path, gib: float = 1.0, seconds: float = 3.0) -> dict[str, Any]:
    """fio's sequential read and write bandwidth on the scratch disk, through the file and the loop device."""
    io = _io_bench()
    total = int(gib * (1 << 30)) // MiB * MiB
    img = scratch / "fio-ceiling.img"
    size = io.DATA_OFFSET + total
    # Written once in full, so reads read real blocks and writes pay no block allocation.
    subprocess.run(["dd", "if=/dev/zero", f"of={img}", f"bs={MiB}", f"count={-(-size // MiB)}", "oflag=direct"],
                   check=True, capture_output=True)
    loop = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(img)], check=True, capture_output=True,
                          text=True).stdout.strip()
    try:
        res = {"file": {op: _fio(io, str(img), op, total, seconds) for op in ("write", "read")},
               "loop": {op: _fio(io, loop, op, total, seconds) for op in ("write", "read")}}
    finally:
        subprocess.run(["losetup", "-d", loop], capture_output=True)
        img.unlink(missing_ok=True)
    return {"read_bytes_per_s": res["file"]["read"], "write_bytes_per_s": res["file"]["write"],
            "loop_read_bytes_per_s": res["loop"]["read"], "loop_write_bytes_per_s": res["loop"]["write"],
            "block_bytes": MiB, "queue_depth": QUEUE_DEPTH, "seconds_each": seconds, "region_bytes": total,
            "command": " ".join(io.fio_command("<target>", "<read|write>", MiB, QUEUE_DEPTH, total)
                                + ["--time_based", f"--runtime={seconds:g}"]),
            "note": "the bound uses the file's numbers: bytes are counted on the disk under the scratch directory "
                    "for both engines"}

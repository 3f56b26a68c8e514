"""py-cpuinfo answered in-process while DeepSpeed builds its engine.

DeepSpeedCPUAdam asks py-cpuinfo for the CPU's vendor (only to warn about fp16 on AMD), and py-cpuinfo answers by
starting a Python process, which starts another to time the clock for a second: 0.7 s of CPU and 1.3 s of wall
per rank at every start, measured on this project's machines. Within `cpu_info_answered()` (memstrata wraps
`deepspeed.initialize` in it) py-cpuinfo's `get_cpu_info` returns the fields DeepSpeed reads, from /proc/cpuinfo
and the platform: the vendor, the flags its op builders pick SIMD widths from, the architecture they pick
`-march` from. Outside it py-cpuinfo is untouched; where /proc/cpuinfo says too little, it is not replaced.
"""
from __future__ import annotations

import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["cpu_info", "cpu_info_answered"]

# platform.machine() -> py-cpuinfo's `arch` (its _parse_arch), for the machines DeepSpeed builds ops on.
_ARCH = {"x86_64": "X86_64", "amd64": "X86_64", "aarch64": "ARM_8", "arm64": "ARM_8", "ppc64le": "PPC_64",
         "ppc64": "PPC_64", "s390x": "S390X", "riscv64": "RISCV_64"}


def cpu_info(text: str, machine: str) -> dict[str, Any] | None:
    """py-cpuinfo's fields that DeepSpeed reads, from /proc/cpuinfo's text and platform.machine(); None when
    either leaves one of them unknown (the architecture, or any flags)."""
    arch = _ARCH.get(machine.lower())
    first: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if first:
                break  # the first processor's block says what every one does
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    flags = first.get("flags") or first.get("Features")  # x86 says flags, ARM Features
    if arch is None or not flags:
        return None
    info: dict[str, Any] = {"arch": arch, "flags": sorted(flags.split())}
    if first.get("vendor_id"):
        info["vendor_id_raw"] = first["vendor_id"]
    return info


@contextmanager
def cpu_info_answered(proc: Path = Path("/proc/cpuinfo")) -> Iterator[None]:
    """py-cpuinfo's `get_cpu_info` answered from `proc` for the duration, then restored."""
    import cpuinfo

    try:
        info = cpu_info(proc.read_text(), platform.machine())
    except OSError:
        info = None
    if info is None:
        yield
        return
    real = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = lambda: dict(info)
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = real

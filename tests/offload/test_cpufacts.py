"""DeepSpeed builds its CPU optimizer without py-cpuinfo's process (a Python that starts another to time the clock
for a second, at every rank's start): memstrata answers the vendor, flags and architecture DeepSpeed reads from
/proc/cpuinfo, only while it initializes, and leaves py-cpuinfo as it was afterwards."""
from __future__ import annotations

from pathlib import Path

import pytest

from memstrata.runtime.swap.cpufacts import cpu_info, cpu_info_answered

pytestmark = pytest.mark.usefixtures("deepspeed_ready")

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9554 64-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512bw

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu
"""
ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd sve
CPU implementer\t: 0x41
"""


def test_proc_cpuinfo_reads_as_the_fields_deepspeed_asks_for() -> None:
    assert cpu_info(X86, "x86_64") == {"arch": "X86_64", "flags": ["avx2", "avx512bw", "avx512f", "fpu", "sse2"],
                                       "vendor_id_raw": "AuthenticAMD"}
    assert cpu_info(ARM, "aarch64") == {"arch": "ARM_8", "flags": ["asimd", "fp", "sve"]}  # no vendor line
    assert cpu_info(X86, "sparc64") is None, "an architecture py-cpuinfo names otherwise: ask py-cpuinfo"
    assert cpu_info("processor\t: 0\n", "x86_64") is None, "no flags: ask py-cpuinfo"


def test_deepspeeds_cpu_adam_is_built_without_py_cpuinfos_process(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    import cpuinfo
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    real = cpuinfo.get_cpu_info

    def forked() -> str:
        raise AssertionError("py-cpuinfo's process was started")

    monkeypatch.setattr(cpuinfo.cpuinfo, "get_cpu_info_json", forked)  # what the real get_cpu_info runs
    proc = tmp_path / "cpuinfo"
    proc.write_text(X86)
    with cpu_info_answered(proc):
        adam = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
    assert adam.cpu_vendor == "authenticamd"  # the file's vendor, which DeepSpeed's fp16 warning reads
    assert cpuinfo.get_cpu_info is real
    with pytest.raises(AssertionError, match="py-cpuinfo's process"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])  # outside it, DeepSpeed asks py-cpuinfo itself
    with cpu_info_answered(tmp_path / "absent"):
        assert cpuinfo.get_cpu_info is real, "no /proc/cpuinfo to read: py-cpuinfo answers"

"""This machine as a node: GPUs come from nvidia-smi's CSV, never from torch (the CLI's
`plan` runs on the operator floor, which has no torch)."""
from __future__ import annotations

import pytest

from memstrata.node.local import parse_nvidia_smi

SMI = "0, NVIDIA H100 80GB HBM3, 81559\n1, NVIDIA H100 80GB HBM3, 81559\n2, NVIDIA H200, 143771\n"


def test_every_gpu_with_its_memory_in_bytes() -> None:
    gpus = parse_nvidia_smi(SMI, None)
    assert [(g.index, g.name, g.hbm_bytes) for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", 81559 << 20), (1, "NVIDIA H100 80GB HBM3", 81559 << 20),
        (2, "NVIDIA H200", 143771 << 20)]


@pytest.mark.parametrize(("visible", "names"), [
    ("2,0", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]),  # CUDA renumbers in the listed order
    ("", []),  # set but empty: CUDA sees no device
    ("7", []),  # an index the machine does not have: nothing visible
])
def test_cuda_visible_devices_selects_and_renumbers(visible: str, names: list[str]) -> None:
    gpus = parse_nvidia_smi(SMI, visible)
    assert [g.name for g in gpus] == names
    assert [g.index for g in gpus] == list(range(len(names)))

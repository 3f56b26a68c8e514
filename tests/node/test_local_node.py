"""This machine as a node: GPUs come from nvidia-smi's CSV, never from torch (the CLI's `plan` runs on
the operator floor, which has no torch), numbered as CUDA numbers them."""
from __future__ import annotations

import pytest

from memstrata.node.local import LocalNodeError, parse_nvidia_smi

SMI = ("0, GPU-1111aaaa-0000-0000-0000-000000000000, NVIDIA H100 80GB HBM3, 81559\n"
       "1, GPU-2222bbbb-0000-0000-0000-000000000000, NVIDIA H100 80GB HBM3, 81559\n"
       "2, GPU-3333cccc-0000-0000-0000-000000000000, NVIDIA H200, 143771\n")
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def test_every_gpu_with_its_memory_in_bytes() -> None:
    gpus = parse_nvidia_smi(SMI, None)
    assert [(g.index, g.name, g.hbm_bytes) for g in gpus] == [
        (0, H100, 81559 << 20), (1, H100, 81559 << 20), (2, H200, 143771 << 20)]


@pytest.mark.parametrize(("visible", "names"), [
    ("2,0", [H200, H100]),  # CUDA renumbers in the listed order
    ("GPU-3333cccc,GPU-1111", [H200, H100]),  # UUIDs, or unique prefixes of them
    ("", []),  # set but empty: CUDA sees no device
    ("7", []),  # an index the machine does not have: nothing visible
    ("1,MIG-abcdef,0", [H100]),  # CUDA stops at the first entry it cannot resolve
])
def test_cuda_visible_devices_selects_and_renumbers(visible: str, names: list[str]) -> None:
    gpus = parse_nvidia_smi(SMI, visible)
    assert [g.name for g in gpus] == names
    assert [g.index for g in gpus] == list(range(len(names)))


@pytest.mark.parametrize(("line", "says"), [
    ("0, GPU-1, NVIDIA A100-SXM4-40GB MIG 1g.5gb, [N/A]", "no memory size for GPU 0"),
    ("No devices were found", "cannot read the GPU line 'No devices were found'"),
])
def test_what_cannot_be_read_is_named(line: str, says: str) -> None:
    with pytest.raises(LocalNodeError, match=says):
        parse_nvidia_smi(line, None)

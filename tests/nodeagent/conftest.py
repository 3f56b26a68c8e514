"""Fixtures for the node agent: sysfs cases, and the kubelet stub as a real gRPC peer."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Helpers next to the tests (sysfs_cases, kubelet_stub) import under any import mode.
sys.path.insert(0, str(Path(__file__).parent))

from kubelet_stub import stub_binary  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native"))  # the loop-device helpers
from native_helpers import _loop_unavailable, attach_loop, run, unavailable  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "sysfs"


@pytest.fixture
def case_copy(tmp_path: Path):
    """A writable copy of tests/data/sysfs/<case> (symlinks kept as symlinks)."""
    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(DATA / name, dst, symlinks=True)
        return dst
    return copy


@pytest.fixture(scope="session")
def kubelet_stub_bin() -> Path:
    path, why = stub_binary()
    if path is None:
        pytest.skip(f"KUBELET STUB UNAVAILABLE — {why}")
    return path


@pytest.fixture(scope="session")
def grpc_code() -> None:
    """The device plugin's generated gRPC code (made at build time by build_proto.py)."""
    try:
        import grpc  # noqa: F401
        from memstrata.nodeagent.proto import deviceplugin_pb2, deviceplugin_pb2_grpc  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"DEVICE-PLUGIN gRPC CODE UNAVAILABLE — {exc}: install memstrata[operator] "
                    "and build it (`make install`, or `python3 operator/build_proto.py` by hand)")


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    """make(size) -> a fresh /dev/loopN with direct I/O over a file in the test's temp dir, detached after."""
    why = _loop_unavailable()
    if why:
        unavailable(why)
    made: list[str] = []

    def make(size: int) -> str:
        image = tmp_path / f"ns{len(made)}.img"
        image.write_bytes(b"")
        os.truncate(image, size)
        made.append(attach_loop(image, "--direct-io=on"))
        return made[-1]

    yield make
    for dev in reversed(made):
        subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=60)

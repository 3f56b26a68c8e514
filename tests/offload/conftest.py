"""Real DeepSpeed, real loop devices, real subprocesses for the swap-layer tests.

Training runs go through benchmarks/offload/harness.py in a child process
(the same code path a user's script takes), one engine per process, so a
stock run and a memstrata run never share DeepSpeed's global state.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native"))  # the loop-device helpers
from native_helpers import _loop_unavailable, attach_loop, unavailable  # noqa: E402


def _deepspeed_missing() -> str | None:
    try:
        import deepspeed  # noqa: F401
        import torch  # noqa: F401
    except Exception as exc:  # ImportError, or an op that fails to load
        return f"DeepSpeed/torch not importable by {sys.executable} ({exc}); run `make install` and use its venv"
    return None


@pytest.fixture(scope="session")
def deepspeed_ready() -> None:
    why = _deepspeed_missing()
    if why:
        pytest.skip(why)


@pytest.fixture
def loopdev(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    """make(size_bytes) -> /dev/loopN over a fresh file in tmp_path, direct I/O on, detached afterwards."""
    why = _loop_unavailable()
    if why:
        unavailable(why)
    made: list[str] = []

    def make(size: int) -> str:
        image = tmp_path / f"ns{len(made)}.img"
        with open(image, "wb") as f:
            f.truncate(size)
        made.append(attach_loop(image, "--direct-io=on"))
        return made[-1]

    yield make
    for dev in reversed(made):
        subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=60)

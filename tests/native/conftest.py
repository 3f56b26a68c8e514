"""Real loop devices, tmpfs mounts and child processes for the native engine tests.

Every loop device is created here over a file in the test's own temp dir and
detached in teardown, whatever the test did; nothing else is ever touched.
"""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from native_helpers import _loop_unavailable, attach_loop, run, unavailable

@pytest.fixture
def loopdev(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """make(size_bytes, *, backing_dir=None, partscan=False, read_only=False) -> /dev/loopN with direct I/O on."""
    why = _loop_unavailable()
    if why:
        unavailable(why)
    made: list[str] = []

    def make(size: int, *, backing_dir: Path | None = None, partscan: bool = False, read_only: bool = False) -> str:
        image = (backing_dir or tmp_path) / f"disk{len(made)}.img"
        with open(image, "wb") as f:
            f.truncate(size)
        dev = attach_loop(image, "--direct-io=on", *(["-P"] if partscan else []), *(["-r"] if read_only else []))
        made.append(dev)
        return dev

    yield make
    for dev in reversed(made):
        subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=60)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """mount(size_bytes) -> a fresh tmpfs of that size, unmounted in teardown."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        target = tmp_path / f"tmpfs{len(mounted)}"
        target.mkdir()
        run("mount", "-t", "tmpfs", "-o", f"size={size}", "memstrata-test", str(target))
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=60)


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(params=["file", pytest.param("loop", marks=pytest.mark.loopdev)])
def devices(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[int, int], list[str]]:
    """make(count, size) -> paths of `count` fresh devices of the requested kind."""
    if request.param == "loop":
        make = request.getfixturevalue("loopdev")
        return lambda count, size: [make(size) for _ in range(count)]

    def files(count: int, size: int) -> list[str]:
        out = []
        for i in range(count):
            p = tmp_path / f"f{i}.img"
            with open(p, "wb") as f:
                f.truncate(size)
            out.append(str(p))
        return out

    return files

"""Helpers shared by the native engine tests (imported by name: pytest loads every conftest as `conftest`)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _loop_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "loop-device tests need root (losetup, mount)"
    if shutil.which("losetup") is None:
        return "losetup (util-linux) is not installed"
    if not Path("/dev/loop-control").exists():
        return "/dev/loop-control is missing: this kernel has no loop driver"
    return None


def unavailable(reason: str) -> None:
    """Skip a test this machine cannot run; under CI=true fail instead, so that a CI runner
    that lost root, loop devices or a tool never passes by proving nothing."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but this test cannot run here: {reason}")
    pytest.skip(reason)


def need_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} not installed (Debian package {package}; `make deps` installs it)")
    assert path is not None
    return path


def run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def attach_loop(image: Path, *flags: str) -> str:
    """`losetup -f --show <flags> image` -> /dev/loopN, owned root:disk 0660 as a node's udev makes block devices
    (a host without udev leaves root:root 0600, which the training user and the node agent's check refuse)."""
    from e2e.realnode.hoststate import as_udev_makes_them

    dev = run("losetup", "-f", "--show", *flags, str(image)).strip()
    as_udev_makes_them(Path(dev))
    return dev


def child_env() -> dict[str, str]:
    """Environment for a child Python that imports this checkout's memstrata."""
    paths = [str(REPO / "runtime"), str(REPO / "operator"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}

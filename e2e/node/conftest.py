"""Fixtures for the kernel-level tests: one guest boot shared by the module's tests."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The launcher is a plain module next to the tests, importable under any import mode.
sys.path.insert(0, str(Path(__file__).parent))

from guest import GuestResult, missing_reason, run_in_guest  # noqa: E402

PROBE = Path(__file__).with_name("probe.py")


def require_guest() -> None:
    """Skip, loudly and with the fix, when the QEMU guest has not been built here."""
    reason = missing_reason()
    if reason:
        pytest.skip(f"QEMU GUEST UNAVAILABLE — {reason}")


@pytest.fixture
def guest_available() -> None:
    require_guest()


@pytest.fixture(scope="session")
def probe_boot() -> Iterator[GuestResult]:
    """One boot running probe.py: facts.json plus a sysfs capture, shared by all guest tests."""
    require_guest()
    result = run_in_guest(PROBE.read_text(), timeout=400)
    try:
        yield result.check()
    finally:
        shutil.rmtree(result.out_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def capture_root(probe_boot: GuestResult) -> Path:
    """The guest's sysfs capture, unpacked on the host (symlinks intact)."""
    with tarfile.open(probe_boot.out_dir / "capture.tar") as tar:
        tar.extractall(probe_boot.out_dir, filter="tar")
    return probe_boot.out_dir / "capture"


@pytest.fixture(scope="session")
def facts(probe_boot: GuestResult) -> dict:
    return json.loads(probe_boot.files["facts.json"])

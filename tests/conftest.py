"""Shared helpers for the fast tests: run the real `memstrata` CLI as a user would."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 120, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """`memstrata ARGS...` in a subprocess, with the interpreter running the tests."""
    return subprocess.run([sys.executable, "-m", "memstrata.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def repo() -> Path:
    return REPO

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


def _smollm2_dir() -> Path | None:
    """The converted SmolLM2-135M-Instruct directory `make model` builds (its path exported by make)."""
    named = os.environ.get("MEMSTRATA_SMOLLM2_DIR")
    if named:
        return Path(named) if (Path(named) / ".complete").exists() else None
    cached = sorted((Path.home() / ".cache/memstrata/models").glob("smollm2-135m-instruct-*/.complete"),
                    key=lambda p: p.stat().st_mtime)
    return cached[-1].parent if cached else None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """A real pretrained model (Llama family) as a Hugging Face directory; tests must not modify it."""
    path = _smollm2_dir()
    if path is None:
        reason = "the SmolLM2-135M-Instruct model is not built: run `make model` (make test does)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return path

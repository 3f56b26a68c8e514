"""The two floors hold: the operator floor never needs torch, DeepSpeed or the runtime.

import-linter and mypy read the code; the last two tests check what a user of the
operator and node-agent images actually gets: every module of the floor imports in
a fresh interpreter without pulling in torch, and the floor's wheel carries no
runtime module and no native extension.
"""
from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FLOOR_PACKAGES = ("api", "plan", "node", "operator", "nodeagent")


def _tool(command: str, *args: str) -> subprocess.CompletedProcess[str]:
    # The venv's console scripts sit beside its python.
    return subprocess.run([str(Path(sys.executable).parent / command), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_import_contracts_hold() -> None:
    proc = _tool("lint-imports", "--no-cache")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    declared = len(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])
    assert declared >= 9 and f"Contracts: {declared} kept, 0 broken." in proc.stdout, proc.stdout


def test_both_floors_type_check() -> None:
    # mypy's cache beside the other heavy builds: it checks every cached module against its source's hash, so a
    # fresh checkout (CI copies the tree) reuses it safely; 29 s of CPU cold, 2 s warm.
    cache = Path(os.environ.get("CACHE") or Path.home() / ".cache" / "memstrata") / "mypy"
    proc = _tool("mypy", "--cache-dir", str(cache))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Success: no issues found"), proc.stdout


def test_every_operator_floor_module_imports_without_torch() -> None:
    code = f"""
import importlib, pkgutil, sys
import memstrata.cli
names = ["memstrata.cli"]
for pkg in {FLOOR_PACKAGES!r}:
    mod = importlib.import_module("memstrata." + pkg)
    names += [m.name for m in pkgutil.walk_packages(mod.__path__, mod.__name__ + ".")]
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed", "numpy")
             or m.startswith("memstrata.runtime"))
print(len(names), bad)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    count, bad = proc.stdout.split(" ", 1)
    assert int(count) > 30 and bad.strip() == "[]", proc.stdout


def test_the_operator_wheel_carries_no_runtime(tmp_path: Path) -> None:
    # A copy, so the build leaves nothing in the checkout (build/, egg-info).
    src = tmp_path / "operator"
    shutil.copytree(REPO / "operator", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert proc.returncode == 0, proc.stderr
    wheel = next((tmp_path / "dist").glob("memstrata-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = email.message_from_bytes(zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert "memstrata/cli/__init__.py" in names and "memstrata/nodeagent/proto/deviceplugin_pb2.py" in names
    assert not [n for n in names if n.startswith("memstrata/runtime") or n.endswith(".so")], names
    requires = " ".join(meta.get_all("Requires-Dist") or [])
    assert "kopf" in requires and "torch" not in requires and "deepspeed" not in requires, requires

"""`make test` runs on xdist workers (conftest.py): the tests that share a module-scoped fixture must run on one
worker, or that fixture (often a whole training run) is made once per worker, and the real node's tests must, or
two workers start two nodes on one host. xdist 3.8 groups by a node-id suffix that pytest 9.2 no longer takes from
where xdist writes it; this runs the real pytest and xdist and checks the grouping holds."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests/runtime/test_data_masks.py"  # a module-scoped tokenizer fixture for some of its tests


def test_a_modules_shared_fixture_keeps_its_tests_on_one_worker() -> None:
    pytest.importorskip("xdist")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "-v", MODULE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    grouped = re.findall(rf"\[(gw\d)\] \[ *\d+%\] PASSED \S+@{re.escape(MODULE)}", proc.stdout)
    ungrouped = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED \S+::\w+\s*$", proc.stdout, re.M)
    assert len(grouped) >= 2, f"no test carries its module's group:\n{proc.stdout[-3000:]}"
    assert len(set(grouped)) == 1, f"the module's grouped tests ran on {sorted(set(grouped))}:\n{proc.stdout}"
    assert ungrouped, "the tests without a module fixture must stay free to go to any worker"

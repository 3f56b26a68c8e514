"""Every benchmark's committed results are drawn: `benchmarks/plots.py` redraws each results/*.json into a PNG with
the benchmark's own plot function, and each table links a PNG that is there."""
from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"

pytest.importorskip("matplotlib", reason="matplotlib is not installed: run `make install` (the dev group)")


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_every_committed_result_is_redrawn_by_its_benchmarks_plot(tmp_path: Path) -> None:
    for json_path in RESULTS.glob("*.json"):
        shutil.copy(json_path, tmp_path)
    copies = sorted(tmp_path.glob("*.json"))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plots.py"), *map(str, copies)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for json_path in copies:
        width, height = _png_size(json_path.with_suffix(".png"))
        assert width >= 600 and height >= 300, (json_path.name, width, height)


def test_each_table_shows_a_plot_that_is_committed_beside_it() -> None:
    for table in RESULTS.glob("*.md"):
        linked = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", table.read_text())
        assert linked, f"{table.name} links no plot"
        for png in linked:
            assert (RESULTS / png).is_file(), f"{table.name} links {png}, which is not in benchmarks/results"

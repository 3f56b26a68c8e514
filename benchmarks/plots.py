"""Redraw every benchmark's PNG from its JSON in benchmarks/results/, running nothing.

    python benchmarks/plots.py                                   # every benchmarks/results/*.json
    python benchmarks/plots.py benchmarks/results/longctx.json   # just these

Each `<name>.json` gets `<name>.png` beside it, drawn by its benchmark's own plot function (the one its run
passes to record.write_results); which one is the JSON's "benchmark" field, else its file name's prefix. Needs
matplotlib. Exits 1 when any JSON could not be drawn (and says why).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from record import draw  # noqa: E402

# benchmark (the JSON's "benchmark" field or its file name's prefix) -> the file holding its `plot`
PLOTTERS = {
    "io": "io/io_plot.py",
    "longctx": "longctx/longctx_plot.py",
    "operator": "operator/operator_plot.py",
    "checkpoint": "checkpoint/checkpoint_plot.py",
    "distributed": "distributed/distributed_plot.py",
    "offload-budget": "offload/budget_plot.py",
    "offload-overlap": "offload/overlap.py",
    "offload-param-reads": "offload/param_reads.py",
    "gpu-check": "gpu/report.py",
}


def load(rel: str) -> ModuleType:
    """The module at benchmarks/`rel`, under a name of its own (io/ and gpu/ both have a report.py), with its
    directory on the path for the modules beside it that it imports."""
    path = HERE / rel
    if str(path.parent) not in sys.path:
        sys.path.insert(1, str(path.parent))
    name = "plots_" + rel.removesuffix(".py").replace("/", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def plotter(json_path: Path, results: Any) -> Callable[[dict[str, Any], Path], str | None] | None:
    """The plot function for this JSON, or None when no benchmark draws it."""
    named = results.get("benchmark") if isinstance(results, dict) else None
    key = named if named in PLOTTERS else next(
        (k for k in sorted(PLOTTERS, key=len, reverse=True) if json_path.stem.startswith(k)), None)
    return load(PLOTTERS[key]).plot if key else None


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted(RESULTS.glob("*.json"))
    failed = 0
    for path in paths:
        results = json.loads(path.read_text())
        plot = plotter(path, results)
        png = path.with_suffix(".png")
        why = draw(plot, results, png) if plot else f"no plot: no benchmark draws {path.name}"
        failed += why is not None
        print(why or f"wrote {png}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

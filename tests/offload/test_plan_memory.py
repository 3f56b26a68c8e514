"""A run's host memory against its plan: each small preset, really trained, peaks within the memory limit the
operator gives its pod (the plan's DRAM bytes plus the per-process allowance, `render.memory_bytes`): past it
the kubelet would OOM-kill the job. benchmarks/plan/memory.py prints the same figures, for every small
preset, with the ratio of what the run holds above an idle process to what the plan counts."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from memstrata.api.units import format_bytes
from memstrata.operator.render import memory_bytes

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("deepspeed_ready")


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("plan_memory", REPO / "benchmarks/plan/memory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# gpt-125m: the largest preset that trains here in seconds, and one whose planned bytes (about 1 GiB) are
# not dwarfed by the allowance; gpt-tiny's 12 MiB would pass any runtime.
@pytest.mark.parametrize("preset", ["gpt-125m"])
def test_peak_host_memory_stays_within_the_pods_limit(tmp_path: Path, preset: str) -> None:
    from memstrata.api import load_job
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job

    bench = _bench()
    row = bench.measure(preset, steps=2, sequence_length=128, micro_batch=2, work=tmp_path)
    manifest = tmp_path / f"{preset}.yaml"
    plan = plan_job(load_job(manifest).spec, local_inventory(tmp_path / f"{preset}-scratch"))
    limit = memory_bytes(plan, ranks=1)
    peak, planned = row["peak_rss_bytes"], row["planned_dram_bytes"]
    assert peak <= limit, (f"{preset}: peak RSS {format_bytes(peak)} exceeds the pod's limit {format_bytes(limit)} "
                           f"(plan DRAM {format_bytes(planned)})")

"""A run's host memory against its plan: each small preset, really trained, peaks within the memory limit the
operator gives its pod (the plan's DRAM bytes plus the per-process allowance, `render.memory_bytes`): past it
the kubelet would OOM-kill the job. benchmarks/plan/memory.py prints the same figures, for every small
preset, with the ratio of what the run holds above an idle process to what the plan counts."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memstrata.api.units import format_bytes
from memstrata.operator.render import memory_bytes

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("deepspeed_ready")


def _load(name: str, path: str):  # type: ignore[no-untyped-def]
    """A benchmark's module, by file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench():  # type: ignore[no-untyped-def]
    return _load("plan_memory", "benchmarks/plan/memory.py")


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


def _memcap():  # type: ignore[no-untyped-def]
    return _load("memcap", "benchmarks/offload/memcap.py")


def _chat_job(tmp_path: Path, model: Path, sequence_length: int | None, checkpointing: bool | None) -> Path:
    """examples/finetune-chat.yaml on the real SmolLM2 model, with one grid point's settings (None: the example's
    own), no validation set (its passes are not what is measured)."""
    doc = yaml.safe_load((REPO / "examples/finetune-chat.yaml").read_text())
    training = doc["spec"]["training"]
    if sequence_length is not None:
        training.update(sequenceLength=sequence_length, activationCheckpointing=checkpointing)
    training["evalInterval"] = 0
    doc["spec"]["dataset"].pop("validationPath")
    doc["spec"]["model"]["path"] = str(model)
    doc["spec"]["dataset"]["path"] = str(REPO / doc["spec"]["dataset"]["path"])
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    return manifest


# The shipped example as it is, then sequence lengths x checkpointing: 4 x 1024 tokens without checkpointing was
# planned at 5.7 GiB of DRAM and OOM-killed in step 1 under the pod's 7,867 MiB; with checkpointing, 4 x 512 tokens
# (the checkpoints' accounting at half the tokens: 4 x 1024 with its recompute cost 73 s of CPU, the suite's
# costliest test); 64K tokens cannot fit here, with or without.
@pytest.mark.slow
@pytest.mark.parametrize(("sequence_length", "checkpointing"),
                         [(None, None), (1024, False), (512, True), (65536, False), (65536, True)])
def test_the_chat_example_runs_under_the_operators_memory_limit_or_is_refused(
        tmp_path: Path, smollm2_dir: Path, sequence_length: int | None, checkpointing: bool | None) -> None:
    """`memstrata run` in a memory cgroup capped where the operator caps the pod (render.memory_bytes of the plan):
    every point the planner accepts trains without an OOM kill; every point it refuses is refused before training,
    saying what is short."""
    from memstrata.api import load_job
    from memstrata.cli.modelshape import with_model_shape
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job

    manifest = _chat_job(tmp_path, smollm2_dir, sequence_length, checkpointing)
    scratch = tmp_path / "nvme"
    plan = plan_job(with_model_shape(load_job(manifest).spec), local_inventory(scratch))
    cap, why = _memcap().DramCap.open(f"plan-{sequence_length}-{checkpointing}", memory_bytes(plan, ranks=1))
    if cap is None:
        pytest.skip(f"no memory cgroup to cap the run with: {why}")
    try:
        run = subprocess.run([sys.executable, "-m", "memstrata.cli", "run", str(manifest), "--steps", "1",
                              "--output", str(tmp_path / "out"), "--nvme-path", str(scratch)],
                             preexec_fn=cap.preexec, capture_output=True, text=True, timeout=600, cwd=REPO)
        limit, peak, killed = cap.limit_bytes, cap.peak_bytes(), cap.oom_killed()
    finally:
        cap.close()
    if not plan.feasible:
        assert run.returncode == 2, run.stderr[-2000:]
        assert "does not fit on this machine" in run.stderr and "short by" in run.stderr, run.stderr
        assert not re.search(r"\s-\d", run.stderr), run.stderr  # no negative byte count
        return
    assert not killed and run.returncode == 0, (
        f"rc {run.returncode}, OOM-killed: {killed}, under the pod's limit {format_bytes(limit)} (plan DRAM "
        f"{format_bytes(plan.bytes_on('dram'))}, cgroup peak {format_bytes(peak or 0)}): {run.stderr[-2000:]}")

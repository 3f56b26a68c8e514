"""A job's ranks train the same model as one rank: the tiny example (fp32, same seed, same global batch) through
real DeepSpeed ZeRO-3 on gloo, on both engines, as 1 rank with gradientAccumulation 2, as one node of 2 ranks
(`memstrata run`, torch elastic) and as 2 pods of 1 rank each (two `memstrata pod` entrypoints meeting through
a c10d rendezvous on 127.0.0.1, their status patches recorded). Every step's loss agrees within 1e-3; the
pods' patches are the ones the job's status needs: global rank 0 reports the job, each pod its own
status.workers entry and nothing else.

memstrata's engine needs state on NVMe, and with 2 ranks gpt-tiny has none in any plan that fits (its 8 MiB of
state stay in DRAM rather than spill beside 2 x 6.3 MiB of staging buffers). Where the planner finds no such
plan, the ranks are handed the 1-rank job's spilling plan through the pod entrypoint (one pod of 2 ranks, or two
pods), as the operator hands them its plan: what is under test is the ranks, not the planner.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from memstrata.api.finetunejob import FineTuneJob
from memstrata.api.runtimeconfig import JobRef, RuntimeConfig
from memstrata.api.strataplan import Plan
from memstrata.node.local import local_inventory
from memstrata.plan import plan_job
from memstrata.runtime.train.launch import free_port

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune-tiny.yaml"
POD = Path(__file__).with_name("ranks_pod_worker.py")
STEPS = 3
ENGINES = {
    # Stock ZeRO-3 offloading to the CPU (no swap files), and memstrata's swap layer with state on NVMe (the
    # dramBudget is found per run: the least for which the plan fits while it spills to NVMe).
    "deepspeed": {"engine": "deepspeed", "nvmeNamespaces": 0},
    "memstrata": {"engine": "memstrata"},
}

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("deepspeed_ready")]


def _doc(name: str, engine: str, tmp: Path, *, ranks: int, nodes: int, accumulation: int,
         budget: bool = True) -> dict[str, Any]:
    doc = yaml.safe_load(TINY.read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["training"].update({"precision": "fp32", "steps": STEPS, "microBatch": 4,
                             "gradientAccumulation": accumulation})
    spec["dataset"]["validationSplit"] = 0.1  # validation before the first step and after the last
    spec["resources"] = {"gpus": 0, "nodes": nodes, "ranksPerNode": ranks}
    spec["memory"] = dict(ENGINES[engine])
    spec["output"] = {"path": str(tmp / name / "model")}
    if engine == "memstrata" and budget:
        spec["memory"]["dramBudget"] = _spilling_budget(doc, tmp)
    return doc


def _spilling_plan(doc: dict[str, Any], tmp: Path) -> tuple[str, Plan] | None:
    """The least dramBudget (whole MiB) for which the planner fits the job on this machine with state on NVMe, and
    that plan; None when there is none."""
    for mib in range(4, 65):
        spec = FineTuneJob.model_validate({**doc, "spec": {**doc["spec"], "memory": {
            **doc["spec"]["memory"], "dramBudget": f"{mib}Mi"}}}).spec
        plan = plan_job(spec, local_inventory(tmp / "plan-nvme"))
        if plan.feasible and plan.nvme_namespaces and plan.bytes_on("nvme"):
            return f"{mib}Mi", plan
    return None


def _spilling_budget(doc: dict[str, Any], tmp: Path) -> str:
    found = _spilling_plan(doc, tmp)
    assert found is not None, f"no dramBudget of 4..64 MiB spills {doc['spec']['resources']} to NVMe"
    return found[0]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "OMP_NUM_THREADS")}
    return {**env, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "runtime"), str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}


def _losses(work: Path) -> list[float]:
    """Per step, then the validation losses (before the first step, after the last), from the saved metrics."""
    lines = [json.loads(line) for line in (work / "model-metrics" / "metrics.jsonl").read_text().splitlines()]
    return [m["loss"] for m in lines if "loss" in m] + [m["validation_loss"] for m in lines if "validation_loss" in m]


def _run(tmp: Path, name: str, engine: str, *, ranks: int, accumulation: int) -> dict[str, Any]:
    """`memstrata run` of one node: its losses per step, its report, its stderr."""
    work = tmp / name
    work.mkdir(parents=True)
    (work / "job.yaml").write_text(yaml.safe_dump(_doc(name, engine, tmp, ranks=ranks, nodes=1,
                                                       accumulation=accumulation)))
    proc = subprocess.run([sys.executable, "-m", "memstrata.cli", "run", str(work / "job.yaml"), "--nvme-path",
                           str(work / "nvme"), "--report-json", str(work / "report.json")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"losses": _losses(work), "report": json.loads((work / "report.json").read_text()),
            "stderr": proc.stderr, "stdout": proc.stdout}


def _pods(tmp: Path, name: str, engine: str, *, nodes: int = 2, ranks: int = 1, plan: Plan | None = None
          ) -> dict[str, Any]:
    """`nodes` pods of `ranks` ranks each, as the operator starts them: one runtime config, PET_NODE_RANK 0, 1, ...;
    the plan the planner makes for the job, or `plan`."""
    work = tmp / name
    work.mkdir(parents=True)
    doc = _doc(name, engine, tmp, ranks=ranks, nodes=nodes, accumulation=1, budget=plan is None)
    job = FineTuneJob.model_validate(doc)
    plan = plan or plan_job(job.spec, local_inventory(work / "nvme"))
    assert plan.feasible, plan.verdict()
    config = RuntimeConfig(job=JobRef(name=name, uid=f"uid-{name}"), spec=job.spec, plan=plan, node="test-node",
                           attempt=0, report_interval_seconds=0.001)
    (work / "runtime-config.json").write_text(config.model_dump_json(by_alias=True))
    port, procs = free_port(), []
    for node in range(nodes):
        scratch = work / f"scratch{node}"
        scratch.mkdir()
        env = {**_env(), "PET_NODE_RANK": str(node), "PET_NNODES": str(nodes), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "HOSTNAME": f"{name}-{node}"}
        procs.append(subprocess.Popen(
            [sys.executable, str(POD), str(scratch), str(work / "runtime-config.json"),
             str(work / f"patches{node}.jsonl")], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    patches = [[json.loads(line) for line in (work / f"patches{n}.jsonl").read_text().splitlines()]
               for n in range(nodes)]
    return {"losses": _losses(work), "patches": patches, "pids": [p.pid for p in procs]}


@pytest.fixture(scope="module", params=list(ENGINES))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine's three runs: 1 rank, one node of 2 ranks, 2 pods of 1 rank."""
    engine: str = request.param
    tmp = tmp_path_factory.mktemp(f"ranks-{engine}")
    one = _run(tmp, f"{engine}-one", engine, ranks=1, accumulation=2)
    if engine == "memstrata" and _spilling_plan(_doc("probe", engine, tmp, ranks=2, nodes=1, accumulation=1,
                                                     budget=False), tmp) is None:
        found = _spilling_plan(_doc("probe", engine, tmp, ranks=1, nodes=1, accumulation=2, budget=False), tmp)
        assert found is not None
        return {"engine": engine, "one": one,
                "node": _pods(tmp, f"{engine}-node", engine, nodes=1, ranks=2, plan=found[1]),
                "pods": _pods(tmp, f"{engine}-pods", engine, plan=found[1])}
    return {"engine": engine, "one": one, "node": _run(tmp, f"{engine}-node", engine, ranks=2, accumulation=1),
            "pods": _pods(tmp, f"{engine}-pods", engine)}


def test_two_ranks_train_step_by_step_as_one_rank_with_twice_the_accumulation(runs: dict[str, Any]) -> None:
    one, node, pods = runs["one"], runs["node"], runs["pods"]
    assert len(one["losses"]) == STEPS + 2 and one["losses"][STEPS - 1] < one["losses"][0]
    assert node["losses"] == pytest.approx(one["losses"], rel=1e-3)
    assert pods["losses"] == pytest.approx(one["losses"], rel=1e-3)
    if "report" not in node:  # one pod of 2 ranks: its local rank 0 (global rank 0) reports for both
        assert [set(p["patch"]["status"]["workers"]) for p in node["patches"][0]] == [{"0"}] * len(node["patches"][0])
        assert node["patches"][0][-1]["patch"]["status"]["workers"]["0"]["ranks"] == 2
        return
    # The report speaks for the whole world: both ranks' tokens, the same global batch of 8 sequences.
    assert node["report"]["tokens"] == one["report"]["tokens"] == STEPS * 8 * 128
    assert node["report"]["losses"] == pytest.approx(node["losses"][:STEPS])
    # Only global rank 0 speaks: one report, one line per step.
    assert node["stdout"].count("memstrata run:") == 1
    assert sum(line.startswith(f"step {STEPS}/{STEPS}") for line in node["stderr"].splitlines()) == 1


def test_each_pod_reports_its_own_workers_entry_and_only_global_rank_0_the_job(runs: dict[str, Any]) -> None:
    pods, engine = runs["pods"], runs["engine"]
    # c10d numbers the nodes by (host, agent pid): the pod started first holds global rank 0.
    leader = pods["pids"].index(min(pods["pids"]))
    other = 1 - leader
    for n, patches in enumerate(pods["patches"]):
        assert patches, f"pod {n} sent no status patch"
        for p in patches:
            status = p["patch"]["status"]
            assert list(status["workers"]) == [str(n)]  # its own entry, never another pod's
            if n == other:
                assert set(status) == {"workers"}, status
    job_patches = [p["patch"]["status"] for p in pods["patches"][leader]]
    assert all("progress" in s for s in job_patches)
    final = job_patches[-1]
    assert final["progress"]["step"] == STEPS and final["result"]["steps"] == STEPS
    assert final["progress"]["loss"] == pytest.approx(pods["losses"][STEPS - 1], rel=1e-6)
    assert final["output"]["step"] == STEPS  # global rank 0 saved the model both ranks gathered
    for n, patches in enumerate(pods["patches"]):
        entry = patches[-1]["patch"]["status"]["workers"][str(n)]
        assert entry["pod"] == f"{engine}-pods-{n}" and entry["node"] == "test-node" and entry["ranks"] == 1
        assert entry["stage"] == "finished" and entry["step"] == STEPS and entry["attempt"] == 0
        assert entry["peakMemory"]["dram"] > 0
        training = [p["patch"]["status"]["workers"][str(n)] for p in patches
                    if p["patch"]["status"]["workers"][str(n)]["stage"] == "training"]
        assert training and all(w["tokensPerSecond"] > 0 for w in training)


def test_memstrata_run_refuses_a_job_of_several_nodes_naming_the_field(tmp_path: Path) -> None:
    doc = _doc("two-nodes", "deepspeed", tmp_path, ranks=1, nodes=2, accumulation=1)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    proc = subprocess.run([sys.executable, "-m", "memstrata.cli", "run", str(tmp_path / "job.yaml"), "--nvme-path",
                           str(tmp_path / "nvme")], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "spec.resources.nodes: 2 nodes cannot run on this one machine" in proc.stderr
    assert not (tmp_path / "nvme").exists() and not (tmp_path / "two-nodes").exists()

"""What each rank of a job trains on and reports: its share of the global micro-batches (rank r of W takes
k = start + j * W + r), the status patch a pod sends (its own workers entry; the job's fields only from global
rank 0), and the operator's env a pod reads to meet the others."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")

from memstrata.api.finetunejob import FineTuneJobSpec, Resources, Training  # noqa: E402
from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.api.jobstatus import WorkerStatus  # noqa: E402
from memstrata.api.report import RuntimeReport  # noqa: E402
from memstrata.runtime.train.data.pipeline import ByteTokenizer, build_data  # noqa: E402

TRAINING = Training.model_validate({"sequenceLength": 32, "microBatch": 2, "steps": 4, "seed": 7})


def _take(batches, n: int) -> list[list[list[int]]]:  # type: ignore[no-untyped-def]
    return [next(batches)[0].tolist() for _ in range(n)]


def _datasets(tmp_path: Path) -> list[Dataset]:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i:04d} says {i * 7}"}) + "\n" for i in range(200)))
    return [Dataset.model_validate({"synthetic": "arithmetic"}), Dataset.model_validate({"path": str(path)})]


@pytest.mark.parametrize("kind", [0, 1], ids=["synthetic", "file"])
def test_two_ranks_together_take_what_one_rank_takes_in_the_same_order(tmp_path: Path, kind: int) -> None:
    data = build_data(_datasets(tmp_path)[kind], TRAINING, ByteTokenizer())
    for start in (0, 6):  # from the beginning, and resumed after 6 global micro-batches
        one = _take(data.batches(2, start), 8)
        ranks = [_take(data.batches(2, start, rank=r, world=2), 4) for r in (0, 1)]
        # Step s, accumulation index a of rank r is global micro-batch (s * GA + a) * W + r.
        assert [b for pair in zip(*ranks) for b in pair] == one
        assert ranks[0] != ranks[1]
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        next(data.batches(2, rank=2, world=2))


def test_a_pod_without_global_rank_0_patches_only_its_own_workers_entry() -> None:
    worker = WorkerStatus(pod="job-1", node="n1", ranks=2, step=3, stage="training", tokens_per_second=10.0,
                          peak_memory={"dram": 5})
    report = RuntimeReport(stage="training", step=3, total_steps=9, loss=1.5, node_rank=1, worker=worker)
    assert report.status_patch(job=False) == {"status": {"workers": {"1": {
        "pod": "job-1", "node": "n1", "ranks": 2, "step": 3, "attempt": None, "stage": "training",
        "tokensPerSecond": 10.0, "peakMemory": {"dram": 5}}}}}
    full = report.status_patch()["status"]
    assert isinstance(full, dict) and set(full) == {"workers", "progress"} and full["progress"]["loss"] == 1.5
    # A local run (no pod) reports no workers entry at all.
    assert "workers" not in RuntimeReport(stage="training").status_patch()["status"]  # type: ignore[operator]


def test_a_pod_meets_the_others_where_the_operator_says_and_refuses_a_wrong_env() -> None:
    from memstrata.api.runtimeconfig import JobRef, RuntimeConfig
    from memstrata.api.strataplan import Plan
    from memstrata.runtime.train.pod import PodConfigError, pod_rendezvous

    cfg = RuntimeConfig.model_construct(job=JobRef(name="j", uid="u1"), attempt=2,
                                        spec=FineTuneJobSpec.model_construct(resources=Resources(gpus=0, nodes=2)),
                                        plan=Plan.model_construct())
    env = {"PET_NODE_RANK": "1", "PET_NNODES": "2", "MASTER_ADDR": "j-0.j", "MASTER_PORT": "29400"}
    r = pod_rendezvous(cfg, env)
    assert (r.nodes, r.node_rank, r.master_addr, r.master_port, r.run_id) == (2, 1, "j-0.j", 29400, "u1-2")
    for bad, why in [({"PET_NNODES": "3"}, r"^\$PET_NNODES: 3 nodes, but the runtime config's resources.nodes is 2"),
                     ({"PET_NODE_RANK": "2"}, r"^\$PET_NODE_RANK: 2 is not one of the job's 2 nodes"),
                     ({"PET_NODE_RANK": "x"}, r"^\$PET_NODE_RANK: expected an integer, got 'x'"),
                     ({"MASTER_ADDR": ""}, r"^\$MASTER_ADDR is not set")]:
        with pytest.raises(PodConfigError, match=why):
            pod_rendezvous(cfg, {**env, **bad})

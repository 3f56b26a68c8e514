"""The pure logic of the long-context benchmark (benchmarks/longctx): the job each contender runs, which NUMA
nodes count as CXL, the steady throughput, which run measures a contender, the longest length under the cap, the
ratios and the table."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from memstrata.api.finetunejob import FineTuneJob
from memstrata.api.inventory import CxlNode, NumaNode

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "longctx"
sys.path.insert(0, str(BENCH))

import sweep  # noqa: E402
from sweep_md import markdown  # noqa: E402

G = 1 << 30


def test_every_contender_trains_the_same_job_but_for_engine_and_loss() -> None:
    jobs = {c.name: sweep.manifest(c, seq=4096, steps=2, loss_chunk=1024, model_path="/m") for c in sweep.CONTENDERS}
    for name, doc in jobs.items():
        job = FineTuneJob.model_validate(doc)  # a manifest the API accepts
        t = job.spec.training
        assert (t.sequence_length, t.micro_batch, t.steps, t.activation_checkpointing) == (4096, 1, 2, True)
        assert job.spec.memory.nvme_namespaces == 0 and job.spec.resources.gpus == 0
        memstrata = name.startswith("memstrata")
        assert job.spec.memory.engine == ("memstrata" if memstrata else "deepspeed")
        assert t.loss_chunk_tokens == (1024 if memstrata else 0), name  # stock: Hugging Face's whole-logits loss
    assert jobs["stock"]["spec"]["dataset"] == jobs["memstrata"]["spec"]["dataset"]


def test_a_manifest_names_a_model_directory_or_a_preset() -> None:
    c = sweep.BY_NAME["stock"]
    assert sweep.manifest(c, seq=8, steps=1, loss_chunk=4, preset="llama3.2-1b", gpus=1)["spec"]["model"] == {
        "preset": "llama3.2-1b"}
    with pytest.raises(ValueError):
        sweep.manifest(c, seq=8, steps=1, loss_chunk=4)
    with pytest.raises(ValueError):
        sweep.manifest(c, seq=8, steps=1, loss_chunk=4, model_path="/m", preset="gpt-tiny")


def test_cxl_candidates_are_the_cxl_nodes_else_cpu_less_nodes_with_memory() -> None:
    dram = NumaNode(id=0, cpus=[0, 1], memory_bytes=16 * G)
    bare = NumaNode(id=1, kind="memory-only", cpus=[], memory_bytes=8 * G)
    empty = NumaNode(id=2, kind="memory-only", cpus=[], memory_bytes=0)
    assert sweep.cxl_candidates([dram], []) == []  # this CI host: memstrata-cxl is skipped
    assert sweep.cxl_candidates([dram, bare, empty], []) == [1]
    cxl = [CxlNode(numa_node=2, memory_bytes=8 * G), CxlNode(numa_node=3, memory_bytes=8 * G)]
    assert sweep.cxl_candidates([dram, bare], cxl) == [2, 3]


def test_steady_figures_leave_the_first_step_out_unless_it_is_alone() -> None:
    steps = [{"tokens_per_second": 10.0}, {"tokens_per_second": 40.0}, {"tokens_per_second": 50.0}]
    assert sweep.steady(steps) == 45.0
    assert sweep.steady(steps[:1]) == 10.0
    assert sweep.steady([]) is None
    cpu = [{"cpu_seconds": 30.0}, {"cpu_seconds": 8.0}, {"cpu_seconds": 6.0}]  # the first includes the setup
    assert sweep.steady(cpu, "cpu_seconds") == 7.0


def _run(contender: str, seq: int, *, capped: bool, ok: bool, oom: bool = False, tps: float = 100.0,
         rss: int = 4 * G) -> dict[str, Any]:
    return {"contender": contender, "seq": seq, "capped": capped, "ok": ok, "oom_killed": oom,
            "tokens_per_second": tps if ok else None, "peak_rss_bytes": rss, "step_tokens_per_second": [tps, tps],
            "cpu_seconds_per_step": 2000 / tps if ok else None,
            "losses": [5.0, 4.0 + (0.001 if contender == "stock" else 0.0)],  # step 1 the same: a new order only
            **({} if ok else {"error": "killed by the OOM killer under the cap" if oom else "boom"})}


def _results(runs: list[dict[str, Any]], enforced: bool = True) -> dict[str, Any]:
    return {"runs": runs, "lengths": [1024, 2048, 4096], "contenders": ["memstrata", "memstrata-cxl", "stock"],
            "skipped_contenders": {"memstrata-cxl": "skipped: no CXL node"},
            "dram_cap": {"enforced": enforced, "bytes": 6 * G, "mechanism": "cgroup v1"},
            "machine": {"cores": 2}, "model": "m", "micro_batch": 1, "precision": "bf16", "steps": 2,
            "device": "cpu", "statistic": "s", "loss_chunk_tokens": 1024, "loadavg_start": [1.0],
            "what": {"memstrata": "a", "memstrata-cxl": "b", "stock": "c"}}


RUNS = [
    _run("memstrata", 1024, capped=True, ok=True, tps=90, rss=4 * G),
    _run("stock", 1024, capped=True, ok=True, tps=100, rss=5 * G),
    _run("memstrata", 2048, capped=True, ok=True, tps=80, rss=4 * G),
    _run("stock", 2048, capped=True, ok=False, oom=True),
    _run("stock", 2048, capped=False, ok=True, tps=100, rss=8 * G),  # the rerun without the cap
    _run("memstrata", 4096, capped=True, ok=True, tps=50, rss=5 * G),
    {"contender": "stock", "seq": 4096, "capped": True, "ok": False, "skipped": True,
     "error": "not tried under the cap: OOM there at 2048"},
    _run("stock", 4096, capped=False, ok=False),
]


def test_the_capped_run_measures_a_contender_and_the_rerun_only_after_an_oom() -> None:
    assert sweep.measured(RUNS, "stock", 1024)["capped"] is True
    m = sweep.measured(RUNS, "stock", 2048)
    assert m is not None and m["capped"] is False and m["peak_rss_bytes"] == 8 * G
    assert sweep.measured(RUNS, "stock", 4096) is None
    assert [sweep.outcome(r) for r in RUNS if r["contender"] == "stock"] == [
        "completed", "OOM", "completed", "skipped", "failed"]


def test_longest_under_the_cap_stops_at_the_first_length_that_failed_there() -> None:
    assert sweep.longest_under_cap(RUNS, "memstrata", [1024, 2048, 4096]) == 4096
    assert sweep.longest_under_cap(RUNS, "stock", [1024, 2048, 4096]) == 1024
    assert sweep.longest_under_cap(RUNS, "memstrata-cxl", [1024]) is None


def test_summary_ratios_are_memstrata_over_each_contender_per_length() -> None:
    s = sweep.summarize(_results(list(RUNS)))["summary"]
    assert s["memstrata_over"]["1024"]["stock"]["tokens_per_second"] == pytest.approx(0.9)
    assert s["memstrata_over"]["1024"]["stock"]["peak_rss"] == pytest.approx(0.8)
    assert s["memstrata_over"]["1024"]["stock"]["cpu_seconds_per_step"] == pytest.approx(100 / 90)
    assert s["memstrata_over"]["2048"]["stock"]["peak_rss"] == pytest.approx(0.5)  # against the uncapped rerun
    assert s["memstrata_over"]["4096"] == {}  # stock has no measurement there
    assert s["memstrata_over"]["1024"]["stock"]["loss_max_abs_diff"] == pytest.approx(0.001)
    assert s["memstrata_over"]["1024"]["stock"]["loss_first_abs_diff"] == 0.0
    assert s["longest_under_cap"] == {"memstrata": 4096, "stock": 1024}  # memstrata-cxl was skipped
    assert sweep.summarize(_results(list(RUNS), enforced=False))["summary"]["longest_under_cap"] == {}


def test_the_table_has_a_row_per_length_and_contender_and_says_why_one_is_missing() -> None:
    md = markdown(sweep.summarize(_results(list(RUNS))))
    rows = [ln for ln in md.splitlines() if ln.startswith("| 1024 ") or ln.startswith("| 2048 ")
            or ln.startswith("| 4096 ")]
    assert len(rows) == 6
    assert all(r.count("|") == 14 for r in rows), rows  # 13 columns each
    stock_2k = next(r for r in rows if r.startswith("| 2048 | stock"))
    assert "| OOM | no cap |" in stock_2k and "0.50" in stock_2k
    stock_4k = next(r for r in rows if r.startswith("| 4096 | stock"))
    assert "| not tried (OOM there at 2048) | failed: boom |" in stock_4k
    assert "memstrata-cxl: skipped: no CXL node" in md
    assert "largest difference at step 1 0.00e+00, at any step 1.00e-03" in md
    assert "| stock | 1024 |" in md and "| memstrata | 4096 |" in md

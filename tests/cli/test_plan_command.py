"""`memstrata plan` as a user reads it: a table for people, JSON for machines."""
from __future__ import annotations

import json
import subprocess
import sys


def test_plan_table_for_the_cxl_node(cli, repo) -> None:
    out = cli("plan", "examples/finetune.yaml", "--node", "examples/node-cxl.yaml")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "llama3-8b-32k on gpu-node-01"
    assert "parameters: 8,030,261,248" in lines[1]
    moments = next(line for line in lines if line.startswith("Adam moments"))
    assert moments.split()[-5:] == ["-", "59.8", "GiB", "-", "-"]   # DRAM column only
    assert "verdict: fits" in out.stdout
    assert "requests: memstrata.dev/cxl-gib=23, nvidia.com/gpu=1" in out.stdout
    # The plan counts the job's tensors, and says what it leaves out: the rank process itself.
    assert "note: not counted above: each rank process's own DRAM beyond the job's tensors" in out.stdout
    assert "up to 2.0 GiB a rank; a job's pod asks for it on top of the plan" in out.stdout


def test_plan_json(cli) -> None:
    out = cli("plan", "examples/finetune.yaml", "--node", "examples/node-cxl.yaml", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["feasible"] is True and plan["parameters"] == 8_030_261_248
    optimizer = next(c for c in plan["categories"] if c["category"] == "optimizer")
    assert optimizer["placement"] == [{"stratum": "dram", "bytes": 64_242_089_984}]


def test_plan_for_this_machine(cli, tmp_path) -> None:
    out = cli("plan", "examples/finetune-tiny.yaml", "--nvme-path", str(tmp_path / "nvme"), "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    dram = next(s for s in plan["strata"] if s["stratum"] == "dram")
    meminfo = int(open("/proc/meminfo").readline().split()[1]) * 1024
    assert 0 < dram["capacity"] <= meminfo


def test_stdlib_operator_is_not_shadowed(repo) -> None:
    """`operator/` is a namespace-package portion: from the repo root, `import operator` is still the stdlib."""
    out = subprocess.run([sys.executable, "-c", "import operator, sys; print(operator.__file__); "
                          "print(callable(operator.itemgetter))"], cwd=repo, capture_output=True, text=True, check=True)
    path, ok = out.stdout.split()
    assert "site-packages" not in path and path.endswith("operator.py") and ok == "True"
    assert not (repo / "operator/memstrata/__init__.py").exists()
    assert not (repo / "runtime/memstrata/__init__.py").exists()


def test_plan_whose_reader_left_exits_quietly(repo) -> None:
    """`memstrata plan ... | head`: the reader is gone before the table is written."""
    proc = subprocess.Popen([sys.executable, "-m", "memstrata.cli", "plan", "examples/finetune.yaml", "--node",
                             "examples/node-cxl.yaml"], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # close the read end at once: every write the CLI makes hits a broken pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0
    assert "Traceback" not in err and err == ""


TWO_NODES = """apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {name: two-nodes}
spec:
  model: {preset: llama3-8b}
  dataset: {synthetic: copy}
  training: {sequenceLength: 4096, microBatch: 2, gradientAccumulation: 4, steps: 10}
  resources: {gpus: 1, nodes: 2}
"""


def test_plan_of_a_two_node_job_shows_the_world_and_each_rank(cli, tmp_path) -> None:
    """Adam moments of Llama-3-8B are 8 x 8,030,261,248 = 64,242,089,984 B (59.8 GiB) for the whole job;
    each of the 2 ranks, one per node, holds half: 29.9 GiB."""
    manifest = tmp_path / "two-nodes.yaml"
    manifest.write_text(TWO_NODES)
    out = cli("plan", str(manifest), "--node", "examples/node-cxl.yaml")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "world: 2 nodes x 1 rank = 2 ranks, global batch 16" in lines   # 2 x 4 x 2
    header = next(line for line in lines if line.startswith("category"))
    assert header.split()[1:5] == ["per", "rank", "per", "node"]
    moments = next(line for line in lines if line.startswith("Adam moments"))
    assert moments.split()[4:8] == ["29.9", "GiB", "29.9", "GiB"]          # per rank, per node
    assert next(line for line in lines if line.startswith("per rank "))

    wire = json.loads(cli("plan", str(manifest), "--node", "examples/node-cxl.yaml", "--json").stdout)
    assert (wire["nodes"], wire["ranks_per_node"], wire["world_size"], wire["global_batch"]) == (2, 1, 2, 16)
    optimizer = next(c for c in wire["categories"] if c["category"] == "optimizer")
    assert optimizer["bytes"] == optimizer["rank_bytes"] == 32_121_044_992
    assert wire["rank_bytes"]["dram"] == sum(c["rank_bytes"] for c in wire["categories"]
                                             for a in c["placement"] if a["stratum"] == "dram")

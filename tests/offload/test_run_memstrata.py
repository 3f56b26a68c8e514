"""`memstrata run` with `memory.engine: memstrata`: the real CLI, memstrata's swap layer in DeepSpeed's place.

The tiny example (memstrata is its engine, and the default) is run as a user would. From
outside, while it runs, the test watches the run directory: memstrata's
file-backed namespace must be there and DeepSpeed's own swap folder must stay
empty (no silent fallback to the stock path); the report must show loss
falling and the optimizer state moving through memstrata's NVMe engine.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from memstrata.runtime.swap.hostheap import thp_offered

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune-tiny.yaml"


@pytest.mark.slow
def test_tiny_example_on_the_memstrata_engine(deepspeed_ready: None, tmp_path: Path) -> None:
    doc = yaml.safe_load(TINY.read_text())
    assert doc["spec"]["memory"].get("engine", "memstrata") == "memstrata"  # the example runs what users get
    doc["spec"]["training"]["steps"] = 30
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    report_path = tmp_path / "report.json"

    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "memstrata.cli", "run", str(job), "--verbose",
                             "--nvme-path", str(nvme),
                             "--report-json", str(report_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    namespaces: set[str] = set()
    deepspeed_files: set[str] = set()
    saw_deepspeed_dir = False
    while proc.poll() is None and time.monotonic() - started < 600:
        for p in nvme.rglob("*"):
            rel = p.relative_to(nvme).parts
            if "deepspeed" in rel[1:2]:
                saw_deepspeed_dir = True
                if p.is_file():  # DeepSpeed makes an empty zero_stage_3 folder; files would mean swapping
                    deepspeed_files.add(str(p.relative_to(nvme)))
            elif p.is_file() and p.suffix == ".img":
                namespaces.add(p.name)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]

    assert saw_deepspeed_dir, "DeepSpeed's swap folder was never seen; the watch proves nothing"
    assert not deepspeed_files, f"DeepSpeed's swap folder got files (stock path in use): {sorted(deepspeed_files)}"
    assert namespaces == {"nvme0.img"}, f"memstrata's file-backed namespace not seen: {namespaces}"
    assert list(nvme.iterdir()) == [], "the run directory (namespaces included) is removed afterwards"

    r = json.loads(report_path.read_text())
    assert r["engine"] == "memstrata"
    assert r["loss"]["last_mean"] <= 0.8 * r["loss"]["first_mean"], r["loss"]
    assert r["swap_files"] == 0
    ms = r["memstrata"]
    assert ms is not None, "the report lacks memstrata's own counters"
    moved = ms["nvme"]["byKind"]
    assert moved["optimizer"]["written"] > 0 and moved["optimizer"]["read"] > 0, moved
    # The example's budget keeps the weights in DRAM (read twice a step, they come first) and half of the
    # optimizer state: only the other half moves.
    assert "param" not in moved, moved
    assert ms["nvme"]["bytesWritten"] >= moved["optimizer"]["written"]
    assert ms["dram"]["residentStateBytes"] > 0, ms["dram"]
    assert ms["dram"]["lockedBytes"] > 0
    # The run bounded its heap before its first tensor, so torch's big CPU blocks are backed by huge pages
    # (memstrata.runtime.swap.hostheap); None only where the kernel offers none.
    assert ms["dram"]["hugePageTensors"] is (True if thp_offered() else None), ms["dram"]
    # The report's nvme stratum is memstrata's engine, not block I/O guessed from outside.
    assert r["strata"]["nvme"]["bytes_written"] == ms["nvme"]["bytesWritten"]
    assert "memstrata swap layer" in out and "optimizer state written / read" in out
    # Activation checkpoints went through the activation pool, exactly the bytes the plan counts for them.
    from memstrata.api import load_job
    from memstrata.plan import category_bytes, job_shape

    planned = category_bytes(job_shape(load_job(job).spec))["checkpoints"]
    assert planned == 2 * 128 * 8 * 128 * 2  # layers x tokens x micro-batch x hidden x bf16
    act = ms["activations"]
    assert act["stratum"] == "dram" and act["livePeakBytes"] == planned, act
    assert act["offloadedBytes"] == 30 * planned  # one forward per step, every checkpoint moved
    assert "activation checkpoints, peak held" in out

"""Checkpoints of two ranks (torch elastic, gloo, real DeepSpeed on the CPU): a run killed mid-flight and resumed at
world size 2 trains exactly the steps an uninterrupted two-rank run trains (every step's loss bit-identical), even
when one rank's file of the newest checkpoint was damaged meanwhile (the ranks agree on the previous checkpoint);
a full disk on one rank costs that checkpoint on every rank alike, and training goes on; a two-rank checkpoint is
refused by a one-rank run, naming both world sizes.

Each attempt is `python -m torch.distributed.run --nproc-per-node 2 tests/offload/ranked_resume_worker.py`, its own
process tree, as a pod's is; it is killed the way a pod's end kills it: SIGKILL to the launcher and every rank.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from memstrata.api.checkpoint import file_rank, parse_step_dir

pytestmark = [pytest.mark.slow]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STEPS = 6


def job_file(tmp: Path, engine: str, checkpoints: Path, ranks: int = 2) -> Path:
    doc = yaml.safe_load((REPO / "examples" / "finetune-tiny.yaml").read_text())
    doc["metadata"]["name"] = f"ranked-{engine}"
    doc["spec"]["training"].update(steps=STEPS, precision="fp32")
    doc["spec"]["resources"] = {"gpus": 0, "ranksPerNode": ranks}
    doc["spec"]["memory"]["engine"] = engine
    doc["spec"]["checkpoint"] = {"path": str(checkpoints), "everySteps": 2, "keep": 3}
    path = tmp / f"{engine}-{checkpoints.name}-{ranks}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONHASHSEED": "0"}


def launch(job: Path, tmp: Path, losses: Path, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = tmp / f"pids-{time.monotonic_ns()}"
    pids.mkdir()
    (tmp / "nvme").mkdir(exist_ok=True)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            str(HERE / "ranked_resume_worker.py"), str(job), str(tmp / "nvme"), str(losses), str(pids), *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=tmp,
                            start_new_session=True)
    return proc, pids


def finish(proc: subprocess.Popen[str], pids: Path) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        kill_all(proc, pids)  # a hung rank must not outlive the test
        out, _ = proc.communicate()
        pytest.fail(f"the two-rank attempt did not finish in 240 s:\n{out[-4000:]}")
    return proc.returncode, out


def kill_all(proc: subprocess.Popen[str], pids: Path) -> None:
    """SIGKILL to the launcher's group and to every rank's (torch elastic starts each rank in its own session)."""
    for group in [proc.pid] + [int(p.read_text()) for p in pids.glob("rank-*")]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(job: Path, tmp: Path, losses: Path, *extra: str) -> str:
    rc, out = finish(*launch(job, tmp, losses, *extra))
    assert rc == 0, out[-4000:]
    return out


def records(losses: Path, rank: int = 0) -> tuple[dict[int, set[str]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(step -> losses, attempts, step records) of one rank."""
    steps: dict[int, set[str]] = {}
    attempts, lines = [], []
    for r in map(json.loads, losses.read_text().splitlines()):
        if r["rank"] != rank:
            continue
        if "attempt_resumed_from" in r:
            attempts.append(r)
        else:
            steps.setdefault(r["step"], set()).add(r["loss"])
            lines.append(r)
    return steps, attempts, lines


def complete(checkpoints: Path) -> list[int]:
    return sorted(s for p in checkpoints.iterdir() if (s := parse_step_dir(p.name)) is not None)


@pytest.mark.parametrize("engine", ["deepspeed", "memstrata"])
def test_two_ranks_killed_mid_run_resume_at_two_ranks_with_the_losses_of_an_uninterrupted_run(
        engine: str, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: run `make install`")
    # Uninterrupted, except that rank 1's disk is full when the step-4 checkpoint is written.
    straight, ck_straight = tmp_path / "straight.jsonl", tmp_path / "ck-straight"
    run(job_file(tmp_path, engine, ck_straight), tmp_path, straight, "--rank1-disk-full-at", "4")
    expected, _, lines = records(straight)
    assert sorted(expected) == list(range(1, STEPS + 1))
    # The full disk cost that checkpoint on both ranks, with the same error, and training went on.
    errors = {r: records(straight, r)[2][3]["checkpoint_error"] for r in (0, 1)}
    assert errors[0] == errors[1] and "No space left on device" in errors[0] and "rank-00001" in errors[0], errors
    assert complete(ck_straight) == [2, 6] and not [p for p in ck_straight.iterdir() if ".partial-" in p.name]
    # Both ranks' files are in each checkpoint, and its status counts them all.
    six = ck_straight / "step-00000006"
    assert {file_rank(p.name) for p in six.glob("rank-*")} == {0, 1}
    assert lines[5]["checkpoint"]["bytes"] == sum(p.stat().st_size for p in six.glob("rank-*"))
    assert records(straight, 1)[2][5]["checkpoint"] == lines[5]["checkpoint"]

    checkpoints = tmp_path / "ck"
    job = job_file(tmp_path, engine, checkpoints)
    losses, marker = tmp_path / "losses.jsonl", tmp_path / "marker"
    proc, pids = launch(job, tmp_path, losses, "--pause-after", "5", str(marker))
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), f"the attempt never reached step 5:\n{proc.communicate(timeout=60)[0][-4000:]}"
    assert proc.poll() is None and len(list(pids.glob("rank-*"))) == 2, "the run was over before it was killed"
    kill_all(proc, pids)
    rc, _ = finish(proc, pids)
    assert rc == -signal.SIGKILL
    done, _, _ = records(losses)
    assert sorted(done) == [1, 2, 3, 4, 5], "the kill did not land mid-run"
    assert complete(checkpoints) == [2, 4]

    # Rank 1's file of the newest checkpoint is damaged meanwhile: the ranks must agree on step 2.
    victim = sorted((checkpoints / "step-00000004").glob("rank-00001-group-*.safetensors"))[0]
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    run(job, tmp_path, losses)

    got, attempts, _ = records(losses)
    assert [a["attempt_resumed_from"] for a in attempts] == [0, 2]
    assert records(losses, 1)[1][-1]["attempt_resumed_from"] == 2
    assert "truncated" in attempts[-1]["skipped"][0] and victim.name in attempts[-1]["skipped"][0]
    for step in range(1, STEPS + 1):
        assert got[step] == expected[step], (
            f"step {step}: the killed-and-resumed run's loss(es) {sorted(float.fromhex(x) for x in got[step])} "
            f"differ from the uninterrupted run's {[float.fromhex(x) for x in expected[step]]}")
    assert complete(checkpoints) == [2, 4, 6]
    assert [p.name.split(".damaged-")[0] for p in checkpoints.iterdir() if ".damaged-" in p.name] == [".step-00000004"]

    # The same checkpoints at world size 1: refused before training, naming both world sizes.
    alone = job_file(tmp_path, engine, checkpoints, ranks=1)
    one = subprocess.run([sys.executable, str(HERE / "resume_worker.py"), str(alone), str(tmp_path / "nvme"),
                          str(tmp_path / "one.jsonl")], capture_output=True, text=True, timeout=240, env=env(),
                         cwd=tmp_path)
    assert one.returncode != 0
    assert "world size: the checkpoint was written by 2 ranks, this run has 1" in one.stderr, one.stderr[-3000:]
    assert not (tmp_path / "one.jsonl").exists()

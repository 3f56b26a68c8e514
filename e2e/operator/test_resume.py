"""A job with spec.checkpoint survives the loss of its pod: the next attempt resumes from the checkpoint.

The real control plane, the real operator process, and the real runtime training the tiny example on
this machine's CPU. kwok runs no containers, so the test plays the kubelet for each attempt pod the
operator creates: it materialises the pod's runtime-config volume from the ConfigMap the pod mounts,
runs `memstrata pod` with a token of the pod's ServiceAccount, and shows the pod Succeeded once that
process has exited 0 (kwok's e2e stage, through SUCCEED_LABEL). After the first runtime has reported a
checkpoint at step >= 4 it is killed with SIGKILL mid-training and its pod deleted (an eviction, a lost
node); the operator must start attempt 1, whose runtime resumes from that checkpoint and finishes.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.operator.harness import SUCCEED_LABEL, apply_yaml, events_of, example, ftj, wait
from e2e.operator.runtimepod import PROGRESS_LINE, Attempt, losses, past_checkpoint, running_pod

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "resumable"
STEPS = 16
EVERY = 2
KILL_AFTER = 4  # the first attempt is killed once it has reported a checkpoint at this step or later


def resumable_job(ckpt: Path) -> dict[str, Any]:
    """examples/finetune-tiny.yaml as written (CPU, state on file-backed NVMe), shorter, with checkpoints."""
    doc = example("finetune-tiny.yaml")
    doc["metadata"] = {"name": NAME}
    doc["spec"]["training"]["steps"] = STEPS
    doc["spec"]["checkpoint"] = {"path": str(ckpt), "everySteps": EVERY}
    return doc


def status(cluster: Any, ns: str) -> dict[str, Any]:
    return ftj(cluster, ns, NAME).get("status") or {}


def test_a_killed_attempt_is_resumed_from_its_checkpoint(memstrata_cluster: Any, ns: str, nodes: Any,
                                                         tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: run `make install`")
    cluster = memstrata_cluster
    nodes.add("cpu", dram_gib=64)
    ckpt = tmp_path / "ckpt"  # the job's checkpoint volume: outlives the pods
    apply_yaml(cluster, resumable_job(ckpt), ns)
    attempts: list[Attempt] = []
    try:
        # --- attempt 0: trains, checkpoints, is killed mid-training, its pod deleted ------------------------
        first = Attempt(cluster, ns, running_pod(cluster, ns, NAME, 0), tmp_path / "attempt-0").start()
        attempts.append(first)

        first.wait_output(f"a training step after a checkpoint at step >= {KILL_AFTER}", past_checkpoint(KILL_AFTER),
                          timeout=180)
        # Frozen at once, so that what the job's status says below is what it says at the kill.
        first.signal(signal.SIGSTOP)

        def checkpoint_reported() -> dict[str, Any] | None:
            s = status(cluster, ns)
            return s if (s.get("checkpoint") or {}).get("step", 0) >= KILL_AFTER else None

        before = wait(f"status.checkpoint.step >= {KILL_AFTER} (the runtime's own report)", checkpoint_reported,
                      timeout=30)
        killed_at = before["checkpoint"]["step"]
        progress = before["progress"]
        assert progress["step"] < progress["total"] == STEPS, f"not training any more when killed: {progress}"
        assert progress["attempt"] == 0 and "resumedFrom" not in progress, progress
        assert before["checkpoint"]["path"] == str(ckpt / f"step-{killed_at:08d}"), before["checkpoint"]
        assert (ckpt / f"step-{killed_at:08d}").is_dir(), sorted(p.name for p in ckpt.iterdir())
        first.signal(signal.SIGKILL)
        assert first.finish(timeout=30) == -signal.SIGKILL
        cluster.kubectl("delete", "pod", first.name, "-n", ns, "--wait=false")  # as an eviction or a lost node

        # --- attempt 1: the operator's next pod; its runtime resumes and finishes ---------------------------
        second = Attempt(cluster, ns, running_pod(cluster, ns, NAME, 1), tmp_path / "attempt-1").start()
        attempts.append(second)
        between = status(cluster, ns)
        assert between["failedPods"] == [first.name] and between["restarts"] == 1, between
        # "was deleted before it finished" or, when kwok removed it before the operator saw it terminating,
        # "disappeared before it finished": a lost pod either way, counted as a failure.
        assert between["lastFailure"]["message"].endswith(" before it finished"), between["lastFailure"]
        rc = second.finish(timeout=240)
        assert rc == 0, f"{second.name}: the runtime exited {rc}:\n{second.tail()}"
        out = "\n".join(second.lines)
        assert f"(step {killed_at} of {STEPS})" in out, f"the second runtime did not say it resumed:\n{second.tail()}"
        steps_run = [int(m[1]) for line in second.lines if (m := PROGRESS_LINE.match(line))]
        assert steps_run == list(range(killed_at + 1, STEPS + 1)), steps_run  # no step twice, none skipped
        # The steps both attempts took (after the checkpoint, before the kill) came out the same: the second
        # attempt continued from the checkpoint's weights, optimizer state and data position, not from scratch.
        lost, again = losses(first.lines), losses(second.lines)
        both = sorted(lost.keys() & again.keys())
        assert both and all(abs(lost[k] - again[k]) <= 2e-3 for k in both), \
            f"losses of the steps taken twice differ: {[(k, lost[k], again[k]) for k in both]}"

        # The kubelet's report of a container that exited 0 (kwok's stage, labelled as the test's pods are).
        cluster.kubectl("label", "pod", second.name, "-n", ns, f"{SUCCEED_LABEL}=true")
        wait(f"{NAME} Succeeded", lambda: status(cluster, ns).get("phase") == "Succeeded", timeout=60)
    finally:
        for a in attempts:
            a.kill()
            print(f"[{a.name}] runtime log: {a.work / 'runtime.log'}")
    # Each attempt's config carried spec.checkpoint as the job states it, and nothing else told it where to resume.
    for a in attempts:
        assert {k: a.config["spec"]["checkpoint"].get(k) for k in ("path", "everySteps")} == \
            {"path": str(ckpt), "everySteps": EVERY}, (a.name, a.config["spec"].get("checkpoint"))

    # --- what the job says -----------------------------------------------------------------------------
    final = status(cluster, ns)
    progress = final["progress"]
    assert (progress["step"], progress["total"]) == (STEPS, STEPS), progress
    assert progress["attempt"] == 1 and progress["resumedFrom"] == killed_at, progress
    result = final["result"]
    assert result["steps"] == STEPS and result["trainLoss"] == progress["loss"] > 0, result
    if "validationLoss" in progress:
        assert result.get("validationLoss") == progress["validationLoss"], (result, progress)
    checkpoint = final["checkpoint"]
    assert (checkpoint["step"], checkpoint["path"]) == (STEPS, str(ckpt / f"step-{STEPS:08d}")), checkpoint
    assert checkpoint["bytes"] > 0 and (ckpt / f"step-{STEPS:08d}").is_dir(), checkpoint
    assert (final["announcedCheckpoint"], final["announcedResume"]) == (STEPS, 1), final
    assert (final["restarts"], final["attempts"]) == (1, 2), final
    table = cluster.kubectl("get", "ftj", NAME, "-n", ns)
    header, row = table.splitlines()[:2]
    assert row[header.index("CHECKPOINT"):header.index("AGE")].strip() == str(STEPS), table

    # --- what the user was told: one Checkpointed per checkpoint written, one Resumed ---------------------
    written = list(range(EVERY, STEPS + 1, EVERY))  # attempt 0 up to killed_at, attempt 1 after it

    def told(reason: str) -> list[dict[str, Any]]:
        return [e for e in events_of(cluster, ns, NAME) if e["reason"] == reason]

    wait(f"a Checkpointed event for step {STEPS}",
         lambda: any(e["message"].startswith(f"step {STEPS} ") for e in told("Checkpointed")), timeout=30)
    time.sleep(1.0)  # time for any (wrong) repeat to be posted
    checkpointed = told("Checkpointed")
    steps = sorted(int(e["message"].split()[1]) for e in checkpointed)
    assert steps == written, [e["message"] for e in checkpointed]
    assert [e["count"] for e in checkpointed] == [1] * len(written), [(e["message"], e["count"]) for e in checkpointed]
    for e in checkpointed:
        step = int(e["message"].split()[1])
        assert e["type"] == "Normal" and e["message"].startswith(
            f"step {step} written to {ckpt / f'step-{step:08d}'} in "), e["message"]
    resumed = told("Resumed")
    # status.progress.attempt counts from 0; the event, for people, from 1: attempt index 1 is the 2nd attempt.
    assert [(e["message"], e["count"], e["type"]) for e in resumed] == [
        (f"attempt 2 resumed from checkpoint step {killed_at}", 1, "Normal")], resumed
    reasons = [e["reason"] for e in events_of(cluster, ns, NAME)]
    assert "PodSucceeded" in reasons, reasons

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

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from memstrata.api.runtimeconfig import ENV_RUNTIME_CONFIG
from memstrata.operator import names
from e2e.operator.harness import (
    SUCCEED_LABEL, apply_yaml, events_of, example, ftj, pods_of, token_kubeconfig, wait,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "resumable"
STEPS = 16
EVERY = 2
KILL_AFTER = 4  # the first attempt is killed once it has reported a checkpoint at this step or later
PROGRESS_LINE = re.compile(r"^step (\d+)/(\d+)\b")  # train.observe.progress.ProgressBar, off a terminal
LOSS_LINE = re.compile(r"^step (\d+)/(\d+)\s+loss ([0-9.]+)\b")
CHECKPOINT_LINE = re.compile(r"^memstrata: checkpoint at step (\d+):")


class Attempt:
    """`memstrata pod` for one attempt pod, run here as the kubelet would run its container."""

    def __init__(self, cluster: Any, ns: str, pod: dict[str, Any], work: Path) -> None:
        self.cluster, self.ns, self.pod = cluster, ns, pod
        self.name = pod["metadata"]["name"]
        self.attempt = int(pod["metadata"]["labels"][names.LABEL_ATTEMPT])
        self.work = work
        self.work.mkdir(parents=True)
        self.lines: list[str] = []
        self.config: dict[str, Any] = {}  # the runtime config it ran with
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._cond = threading.Condition()

    def config_file(self) -> Path:
        """The pod's runtime-config volume as the kubelet would mount it: the ConfigMap it names, its items
        written under a local stand-in for the mount path; returns the file $MEMSTRATA_RUNTIME_CONFIG names."""
        spec = self.pod["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env") or []}
        target = env[ENV_RUNTIME_CONFIG]
        mount = next(m for m in container["volumeMounts"] if target.startswith(m["mountPath"].rstrip("/") + "/"))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        source = volume["configMap"]

        def current() -> dict[str, Any] | None:
            # The operator applies the ConfigMap for this attempt alongside the pod: wait until it is this one's.
            data = self.cluster.get_json("configmap", source["name"], "-n", self.ns).get("data") or {}
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            if any(i["key"] not in data for i in items):
                return None
            config = json.loads(data[items[0]["key"]])
            return {"items": items, "data": data} if config.get("attempt") == self.attempt else None

        got = wait(f"ConfigMap {source['name']} to carry the runtime config of attempt {self.attempt}", current,
                   timeout=30, interval=0.5)
        root = self.work / "mount"
        for item in got["items"]:
            path = root / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(got["data"][item["key"]])
        self.config = json.loads(got["data"][got["items"][0]["key"]])
        return root / os.path.relpath(target, mount["mountPath"])

    def start(self) -> "Attempt":
        config = self.config_file()
        kubeconfig = token_kubeconfig(self.cluster, self.ns, self.pod["spec"]["serviceAccountName"],
                                      self.work / "runtime.kubeconfig")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update({"KUBECONFIG": str(kubeconfig), ENV_RUNTIME_CONFIG: str(config),
                    # An emptyDir of the pod's own for its file-backed NVMe namespaces.
                    "MEMSTRATA_SCRATCH": str(self.work / "scratch"),
                    "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                    "COLUMNS": "1000"})  # one line per message: the test reads them
        self.proc = subprocess.Popen([sys.executable, "-m", "memstrata.cli", "pod"], env=env, cwd=self.work,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, name=f"runtime-{self.name}", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.work / "runtime.log", "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                with self._cond:
                    self.lines.append(line.rstrip("\n"))
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def tail(self, n: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def wait_output(self, what: str, predicate: Any, timeout: float) -> None:
        """Until predicate(lines) holds; fails naming `what` if the runtime exits first or time runs out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.lines):
                assert self.proc is not None
                if self.proc.poll() is not None and not (self._reader and self._reader.is_alive()):
                    raise AssertionError(f"{self.name}: the runtime exited ({self.proc.returncode}) before {what}:\n"
                                         + "\n".join(self.lines[-40:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{self.name}: timed out after {timeout:.0f}s waiting for {what}:\n"
                                         + "\n".join(self.lines[-40:]))
                self._cond.wait(min(left, 0.5))

    def finish(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name}: the runtime did not finish in {timeout:.0f}s:\n{self.tail()}") from None
        if self._reader is not None:
            self._reader.join(timeout=10)
        return rc

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self._reader is not None:
            self._reader.join(timeout=10)


def losses(lines: list[str]) -> dict[int, float]:
    """step -> loss, from a runtime's progress lines."""
    return {int(m[1]): float(m[3]) for line in lines if (m := LOSS_LINE.match(line))}


def resumable_job(ckpt: Path) -> dict[str, Any]:
    """examples/finetune-tiny.yaml as written (CPU, state on file-backed NVMe), shorter, with checkpoints."""
    doc = example("finetune-tiny.yaml")
    doc["metadata"] = {"name": NAME}
    doc["spec"]["training"]["steps"] = STEPS
    doc["spec"]["checkpoint"] = {"path": str(ckpt), "everySteps": EVERY}
    return doc


def running_pod(cluster: Any, ns: str, attempt: int) -> dict[str, Any]:
    name = names.pod_name(NAME, attempt)

    def running() -> dict[str, Any] | None:
        pod = next((p for p in pods_of(cluster, ns, NAME) if p["metadata"]["name"] == name), None)
        ok = pod is not None and not pod["metadata"].get("deletionTimestamp") and \
            (pod.get("status") or {}).get("phase") == "Running"
        return pod if ok else None

    return wait(f"pod {name} Running (kwok)", running, timeout=60, interval=0.5)


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
        first = Attempt(cluster, ns, running_pod(cluster, ns, 0), tmp_path / "attempt-0").start()
        attempts.append(first)

        def past_checkpoint(lines: list[str]) -> bool:
            # A progress line after the one of a checkpoint step >= KILL_AFTER: the runtime reports a checkpoint
            # (synchronously) right after printing its step's line, so that report has been sent by now.
            ckpt_step = 0
            for line in lines:
                if m := CHECKPOINT_LINE.match(line):
                    ckpt_step = int(m[1])
                elif (m := PROGRESS_LINE.match(line)) and ckpt_step >= KILL_AFTER and int(m[1]) > ckpt_step:
                    return True
            return False

        first.wait_output(f"a training step after a checkpoint at step >= {KILL_AFTER}", past_checkpoint,
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
        second = Attempt(cluster, ns, running_pod(cluster, ns, 1), tmp_path / "attempt-1").start()
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

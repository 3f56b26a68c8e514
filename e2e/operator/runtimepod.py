"""`memstrata pod` for one attempt pod of a job, run on this machine as the kubelet would run its container (kwok
nodes run none): its runtime-config volume materialised from the ConfigMap the pod mounts, a token of the pod's
ServiceAccount, its output read line by line. Shared by the tests whose runtime must really train (test_resume,
test_kueue)."""
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

from memstrata.api.runtimeconfig import ENV_RUNTIME_CONFIG
from memstrata.operator import names
from e2e.operator.harness import pods_of, token_kubeconfig, wait

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


def past_checkpoint(at_least: int) -> Any:
    """A predicate on a runtime's lines: a training step printed after the line of a checkpoint at step >= at_least.
    The runtime reports a checkpoint (synchronously) right after printing its step's line, so by then that report
    has been sent."""
    def seen(lines: list[str]) -> bool:
        ckpt_step = 0
        for line in lines:
            if m := CHECKPOINT_LINE.match(line):
                ckpt_step = int(m[1])
            elif (m := PROGRESS_LINE.match(line)) and ckpt_step >= at_least and int(m[1]) > ckpt_step:
                return True
        return False
    return seen


def running_pod(cluster: Any, ns: str, job: str, attempt: int) -> dict[str, Any]:
    """The job's attempt pod once kwok shows it Running (and not being deleted)."""
    name = names.pod_name(job, attempt)

    def running() -> dict[str, Any] | None:
        pod = next((p for p in pods_of(cluster, ns, job) if p["metadata"]["name"] == name), None)
        ok = pod is not None and not pod["metadata"].get("deletionTimestamp") and \
            (pod.get("status") or {}).get("phase") == "Running"
        return pod if ok else None

    return wait(f"pod {name} Running (kwok)", running, timeout=60, interval=0.5)

"""What the operator's e2e tests and benchmark need on top of the control plane (e2e.cluster):
memstrata nodes as the node agent publishes them, kwok stages for the runtime pods, the
operator as a real subprocess, jobs, and a client authenticated as a job's ServiceAccount."""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.kwok import fake_node
from e2e.cluster.procs import free_port
from memstrata.api import NodeInventory, render_node

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "charts" / "memstrata" / "crds" / "finetunejob.yaml"  # the one CRD (crds/ links to it)
CHART = REPO / "charts" / "memstrata"
SUCCEED_LABEL = "user.memstrata.dev/e2e-succeed"  # a job label the operator copies onto its pods
LEASE = "memstrata-e2e"  # in namespace default
# Short, so takeovers in tests take seconds (production: 15/10/2).
LEASE_TIMING = ("--lease-duration-seconds", "6", "--renew-deadline-seconds", "4", "--retry-period-seconds", "1")


def inventory(name: str, dram_gib: int, cxl_gib: int = 0, nvme: int = 2, gpus: int = 1,
              hbm_gib: int = 80) -> NodeInventory:
    return NodeInventory.model_validate({
        "hostname": name,
        "numaNodes": [{"id": 0, "kind": "dram", "cpus": [0, 1], "memoryBytes": f"{dram_gib}Gi"}]
        + ([{"id": 1, "kind": "cxl", "memoryBytes": f"{cxl_gib}Gi"}] if cxl_gib else []),
        "cxlNodes": [{"numaNode": 1, "memoryBytes": f"{cxl_gib}Gi"}] if cxl_gib else [],
        "nvmeNamespaces": [{"name": f"nvme{i}n1", "sizeBytes": "3.84T", "free": True} for i in range(nvme)],
        "gpus": [{"index": i, "hbmBytes": f"{hbm_gib}Gi"} for i in range(gpus)],
    })


def memstrata_node(name: str, inv: NodeInventory) -> dict[str, Any]:
    """A kwok Node carrying exactly what the node agent publishes (render_node)."""
    rendered = render_node(inv)
    return fake_node(name, labels=rendered["labels"], annotations=rendered["annotations"],
                     capacity=rendered["capacity"])


def succeed_stage(delay_ms: int = 1000) -> dict[str, Any]:
    """A Stage that completes a Running pod labelled SUCCEED_LABEL (exit code 0) after delay_ms:
    the runtime finishing its steps."""
    template = """{{ $now := Now }}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  restartCount: 0
  started: false
  state:
    terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}
{{ end }}
phase: Succeeded
"""
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage",
        "metadata": {"name": "memstrata-e2e-pod-succeed"},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": [
                {"key": f'.metadata.labels["{SUCCEED_LABEL}"]', "operator": "Exists"},
                {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                {"key": ".status.phase", "operator": "In", "values": ["Running"]},
            ]},
            "delay": {"durationMilliseconds": delay_ms},
            "weight": 10000,
            "next": {"statusTemplate": template},
        },
    }


EXAMPLE_CLAIMS = ("llama3-8b-weights", "chat-data", "finetune-output")  # what examples/finetune.yaml mounts


def claims(cluster: Any, ns: str, names: tuple[str, ...] = EXAMPLE_CLAIMS) -> list[str]:
    """PersistentVolumeClaims `names` in `ns`, each bound to a PersistentVolume of its own (as a storage
    class's provisioner would bind them), so the scheduler places a pod that mounts them. Returns the
    PersistentVolumes' names (cluster-scoped: the caller deletes them)."""
    pvs = []
    for claim in names:
        pv = f"{ns}-{claim}"
        pvs.append(pv)
        cluster.create({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce", "ReadOnlyMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "hostPath": {"path": f"/srv/{claim}"}, "claimRef": {"namespace": ns, "name": claim}}})
        cluster.create({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": ns},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                     "resources": {"requests": {"storage": "1Gi"}}}})
    wait(f"claims {', '.join(names)} Bound", lambda: all(
        (c.get("status") or {}).get("phase") == "Bound" for c in cluster.get_json("pvc", "-n", ns)["items"]
        if c["metadata"]["name"] in names), timeout=60)
    return pvs


def example(name: str = "finetune.yaml") -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / name).read_text())


def job(name: str, base: str = "finetune-tiny.yaml", labels: dict[str, str] | None = None,
        run_policy: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(example(base))
    if base == "finetune-tiny.yaml":
        # One GPU, state in DRAM: the job then requests exactly one nvidia.com/gpu, which makes
        # room on a node easy to reason about (the example's own dramBudget is for a CPU-only laptop).
        doc["spec"]["resources"]["gpus"] = 1
        doc["spec"]["memory"].pop("dramBudget", None)
    doc["metadata"] = {"name": name, "labels": labels or {}}
    doc["spec"]["runPolicy"] = {**doc["spec"].get("runPolicy", {}), **(run_policy or {})}
    doc["spec"].update(spec)
    return doc


class OperatorProcess:
    """`memstrata operator` as a real process: restarts and kills are real."""

    def __init__(self, kubeconfig: Path, log: Path, name: str = "op", *extra: str) -> None:
        self.kubeconfig, self.log, self.name, self.extra = kubeconfig, log, name, extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.metrics_port = free_port()  # kept across restarts, as a pod's port is

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def identity(self) -> str:
        """This process's name in the Lease: a new one per start, as a restarted pod gets."""
        return f"{self.name}-{self.starts}"

    def start(self) -> "OperatorProcess":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO / "operator"), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "memstrata.cli", "operator", "--kubeconfig", str(self.kubeconfig),
               "--lease", LEASE, "--lease-namespace", "default", "--identity", f"{self.name}-{self.starts + 1}",
               *LEASE_TIMING, "--backoff-base-seconds", "1", "--unschedulable-retry-seconds", "5",
               "--metrics-bind-address", f"127.0.0.1:{self.metrics_port}", *self.extra]
        self.starts += 1
        with open(self.log, "ab") as out:
            out.write(f"\n===== start {self.starts}: {' '.join(cmd)}\n".encode())
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=REPO, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` (SIGSTOP freezes it, as a long GC pause or a starved node would; SIGCONT thaws it)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def peak_rss_bytes(self) -> int:
        """The kernel's high-water mark of the process's resident set (VmHWM)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(text[-lines:])


def lease_holder(cluster: Any) -> str:
    """Who holds the operators' Lease now ("" if nobody)."""
    lease = cluster.find_json("lease", LEASE, "-n", "default") or {}  # none: nobody has created it yet
    return (lease.get("spec") or {}).get("holderIdentity") or ""


def mid_transition(cluster: Any, ns: str) -> int:
    """Jobs the operator has begun on (its finalizer is on them) but not yet recorded Running."""
    return sum(1 for i in cluster.get_json("ftj", "-n", ns)["items"]
               if "memstrata.dev/cleanup" in (i["metadata"].get("finalizers") or [])
               and (i.get("status") or {}).get("phase") != "Running")


def token_kubeconfig(cluster: Any, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig that authenticates with a TokenRequest token of the ServiceAccount — exactly
    what the runtime in the job's pod holds."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=10m").strip()
    raw = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "-o", "json"))
    cl = raw["clusters"][0]["cluster"]
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "e2e", "cluster": cl}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "e2e", "user": "sa", "namespace": namespace}}],
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def kubectl_as(cluster: Any, kubeconfig: Path, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig), *args]
    return subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=60)


def wait(what: str, predicate: Any, timeout: float = 60, interval: float = 0.25) -> Any:
    """Poll until predicate() is truthy; returns its value or fails naming what was awaited."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def ftj(cluster: Any, ns: str, name: str) -> dict[str, Any]:
    return cluster.get_json("finetunejob", name, "-n", ns)


def pods_of(cluster: Any, ns: str, job: str) -> list[dict[str, Any]]:
    items = cluster.get_json("pods", "-n", ns)["items"]
    return sorted((p for p in items if any(o.get("name") == job for o in p["metadata"].get("ownerReferences", []))),
                  key=lambda p: int(p["metadata"]["labels"].get("memstrata.dev/attempt", "0")))


def events_of(cluster: Any, ns: str, job: str) -> list[dict[str, Any]]:
    items = cluster.get_json("events", "-n", ns, "--field-selector", f"involvedObject.name={job}")["items"]
    return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")


def apply_yaml(cluster: Any, doc: dict[str, Any], ns: str) -> str:
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(doc))


def one_pod_quota(cluster: Any, ns: str) -> dict[str, Any]:
    """A ResourceQuota of one pod in `ns`, in force (counted by the quota controller) when this returns; the
    object, for a test to raise it."""
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "pods"}, "spec": {"hard": {"pods": "1"}}}
    apply_yaml(cluster, quota, ns)
    # Until the quota controller has counted the namespace, admission refuses every pod.
    wait("the quota counted", lambda: (cluster.get_json("resourcequota", "pods", "-n", ns).get("status") or {})
         .get("hard"), timeout=60)
    return quota

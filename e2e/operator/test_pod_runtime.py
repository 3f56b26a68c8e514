"""`memstrata pod` against the real API server, as the job's own ServiceAccount.

The objects the operator renders for an attempt (ServiceAccount, Role,
RoleBinding, the runtime config) are applied; the runtime then trains the tiny
example for real on this machine (kwok nodes run no containers, so the pod's
process runs here) with a token of that ServiceAccount, and the FineTuneJob's
status must show its progress while it trains and the final step, loss and
per-stratum peaks when it is done. The same token must not be able to patch
another job's status.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from memstrata.api import load_job
from memstrata.operator import names
from memstrata.operator.observe import job_view
from memstrata.operator.render import gang_objects
from memstrata.plan import plan_job
from memstrata.node.local import local_inventory

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune-tiny.yaml"
STEPS = 8


def token_kubeconfig(cluster: Any, token: str, path: Path) -> Path:
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    ca = admin["clusters"][0]["cluster"]["certificate-authority"]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {"server": cluster.server, "certificate-authority": ca}}],
        "users": [{"name": "runtime", "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "runtime"}}],
        "current-context": "e2e"}))
    return path


def submit(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    doc = yaml.safe_load(TINY.read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["training"]["steps"] = STEPS
    cluster.apply(doc)
    return cluster.get_json("finetunejob", name, "-n", namespace)


def test_the_runtime_reports_into_its_jobs_status(memstrata_cluster: Any, namespace: str, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: run `make install`")
    cluster = memstrata_cluster
    body = submit(cluster, namespace, "tiny-pod")
    other = submit(cluster, namespace, "someone-else")
    job = load_job(TINY)
    plan = plan_job(job.spec, local_inventory(tmp_path / "nvme"))
    companions, _ = gang_objects(job_view(body), ("this-machine",), plan, attempt=0, report_interval_seconds=1)
    cluster.apply(*[o for o in companions if o["kind"] != "ConfigMap"], namespace=namespace)
    config = tmp_path / "runtime-config.json"
    config.write_text(next(o for o in companions if o["kind"] == "ConfigMap")["data"]["runtime-config.json"])
    # The operator writes the status before it creates the pod (the API server fills in the schema's defaults
    # then, status.restarts among them): the runtime's patches only ever add to a status that exists.
    cluster.kubectl("patch", "finetunejob", "tiny-pod", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"phase": "Created", "activePod": "tiny-pod-0"}}))
    token = cluster.kubectl("create", "token", names.runtime_account_name("tiny-pod", body["metadata"]["uid"]), "-n", namespace).strip()
    kubeconfig = token_kubeconfig(cluster, token, tmp_path / "runtime.kubeconfig")

    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "MEMSTRATA_RUNTIME_CONFIG": str(config),
           "MEMSTRATA_SCRATCH": str(tmp_path / "scratch"), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "memstrata.cli", "pod"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[int] = []
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        progress = (cluster.get_json("finetunejob", "tiny-pod", "-n", namespace).get("status") or {}).get("progress")
        if progress and (not seen or seen[-1] != progress["step"]):
            seen.append(progress["step"])
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
    out = proc.communicate()[0]
    assert proc.returncode == 0, out[-4000:]

    status = cluster.get_json("finetunejob", "tiny-pod", "-n", namespace)["status"]
    progress = status["progress"]
    assert (progress["step"], progress["total"], progress["summary"]) == (STEPS, STEPS, f"{STEPS}/{STEPS} (100%)")
    assert isinstance(progress["loss"], float) and progress["loss"] > 0
    # The attempt's own report (the operator announces a resume only for the attempt that reported it);
    # nulls for what it left unset (merge-patched away), so no key is stored as null.
    assert progress["attempt"] == 0 and "resumedFrom" not in progress and None not in progress.values()
    assert status["peakMemory"]["dram"] > 50 << 20 and status["peakMemory"]["nvme"] > 0
    # Progress arrived while it trained, not only at the end.
    assert any(0 < s < STEPS for s in seen), f"steps seen while training: {seen}"

    # The job's token patches its own job only.
    denied = subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig), "patch",
                             "finetunejob", other["metadata"]["name"], "-n", namespace, "--subresource=status",
                             "--type=merge", "-p", json.dumps({"status": {"progress": {"step": 1}}})],
                            capture_output=True, text=True, timeout=60)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr

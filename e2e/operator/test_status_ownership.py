"""A job's runtime token may write its job's progress, peak memory, saved model, checkpoint and result, and
nothing else of the status: clearing status.startTime would disable activeDeadlineSeconds, clearing
status.failedPods would retry forever. The chart's ValidatingAdmissionPolicy
(applied as the chart installs it) holds that at the API server. The test runs on a control plane no
operator watches, so that the only writers of the job are the test, as operator, and the runtime's token."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from e2e.operator.harness import job, token_kubeconfig

pytestmark = pytest.mark.cluster

kube = pytest.importorskip("kubernetes", reason="the operator's dependencies are not installed")
from memstrata.api.inventory import NodeInventory  # noqa: E402
from memstrata.operator import names  # noqa: E402
from memstrata.operator.observe import job_view  # noqa: E402
from memstrata.operator.render import gang_objects  # noqa: E402
from memstrata.plan import plan_job  # noqa: E402

START = "2026-11-23T08:00:00Z"


def _patch(cluster: Any, kubeconfig: Path, ns: str, name: str, status: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig), "patch", "finetunejob",
                           name, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status})],
                          capture_output=True, text=True, timeout=60)


def test_the_runtime_token_writes_progress_but_not_the_operators_fields(quiet_cluster: Any, tmp_path: Path) -> None:
    cluster, namespace = quiet_cluster, "status-ownership"
    cluster.create_namespace(namespace)
    doc = job("owned")
    doc["metadata"]["namespace"] = namespace
    cluster.apply(doc)
    body = cluster.get_json("finetunejob", "owned", "-n", namespace)
    # The operator's part, as it writes it: the phase, the node and when the attempt started.
    # activePod and failedPods, the operator's bookkeeping (memstrata.api.jobstatus): guarded all the same.
    cluster.kubectl("patch", "finetunejob", "owned", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"phase": "Running", "node": "n1", "startTime": START,
                                                 "activePod": "owned-1", "failedPods": ["owned-0"]}}))
    inv = NodeInventory.model_validate({"hostname": "n1", "numaNodes": [{"id": 0, "memoryBytes": "64Gi"}]})
    companions, _ = gang_objects(job_view(body), ("n1",), plan_job(job_view(body).spec, inv), attempt=0)
    cluster.apply(*[o for o in companions if o["kind"] != "ConfigMap"], namespace=namespace)
    runtime = token_kubeconfig(cluster, namespace, names.runtime_account_name("owned", body["metadata"]["uid"]), tmp_path / "runtime")

    allowed = _patch(cluster, runtime, namespace, "owned", {"progress": {"step": 3, "total": 10}, "peakMemory": {"dram": 1}})
    assert allowed.returncode == 0, allowed.stderr
    saved = {"path": "/output/m", "step": 10, "files": 3, "bytes": 4096, "validationLoss": 1.5}
    allowed = _patch(cluster, runtime, namespace, "owned", {"output": saved})  # the saved model
    assert allowed.returncode == 0, allowed.stderr
    ckpt = {"path": "/ckpt/step-00000010", "step": 10, "time": START, "bytes": 4096, "seconds": 1.5}
    result = {"steps": 10, "trainLoss": 1.75}
    allowed = _patch(cluster, runtime, namespace, "owned", {"checkpoint": ckpt, "result": result})
    assert allowed.returncode == 0, allowed.stderr
    # A job may run its own code with this token: nothing it writes is free text, so nothing it read (a mounted
    # claim, its own token) can be handed on through the status to whoever may read the job.
    for status, field in (({"progress": {"summary": "password=hunter2"}}, "status.progress.summary"),
                          ({"progress": {"eta": "hunter2"}}, "status.progress.eta"),
                          ({"peakMemory": {"hunter2": 1}}, "status.peakMemory"),
                          ({"workers": {"hunter2": {"ranks": 1}}}, "status.workers"),
                          ({"workers": {"0": {"stage": "hunter2"}}}, "status.workers.0.stage"),
                          ({"workers": {"0": {"pod": "Hunter2 secret"}}}, "status.workers.0.pod"),
                          ({"checkpoint": {**ckpt, "path": "/hunter2"}}, "status.checkpoint.path")):
        denied = _patch(cluster, runtime, namespace, "owned", status)
        assert denied.returncode != 0 and field in denied.stderr, (status, denied.stderr)
    arch = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kvHeads": 4, "vocab": 300}
    for status, field in (({"startTime": None}, "startTime"), ({"phase": "Succeeded"}, "phase"),
                          ({"node": "elsewhere"}, "node"), ({"conditions": []}, "conditions"),
                          ({"modelArchitecture": arch}, "modelArchitecture"), ({"failedPods": None}, "failedPods"),
                          ({"activePod": "owned-9"}, "activePod"),
                          ({"announcedCheckpoint": 10}, "announcedCheckpoint")):
        denied = _patch(cluster, runtime, namespace, "owned", status)
        assert denied.returncode != 0, f"the runtime's token changed status.{field}"
        assert f"status.{field} is the operator's" in denied.stderr, denied.stderr
    # Along with its own fields it may not slip in the operator's: the whole patch is refused.
    denied = _patch(cluster, runtime, namespace, "owned", {"progress": {"step": 9, "total": 10}, "restarts": 5,
                                                            "message": "fine"})
    assert denied.returncode != 0 and " are the operator's" in denied.stderr, denied.stderr
    assert "status.message" in denied.stderr and "status.restarts" in denied.stderr, denied.stderr

    status = cluster.get_json("finetunejob", "owned", "-n", namespace)["status"]
    assert (status["startTime"], status["phase"], status["node"]) == (START, "Running", "n1")
    assert (status["activePod"], status["failedPods"]) == ("owned-1", ["owned-0"])
    assert status["progress"]["step"] == 3 and status["peakMemory"] == {"dram": 1}
    assert status["checkpoint"] == ckpt and status["result"] == result
    assert status["output"] == saved and "modelArchitecture" not in status
    wide = cluster.kubectl("get", "finetunejob", "owned", "-n", namespace, "-o", "wide")
    header, row = (line.split() for line in wide.splitlines()[:2])
    assert "OUTPUT" in header and "/output/m" in row, wide
    table = cluster.kubectl("get", "finetunejob", "owned", "-n", namespace)
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "NODE", "PROGRESS", "ETA", "CHECKPOINT", "AGE"], table
    # Cells line up under their headers (an empty one is blank: this progress has no summary, no ETA).
    assert row[header.index("CHECKPOINT"):header.index("AGE")].strip() == "10", table

"""Upgrading a cluster whose jobs the previous operator (commit 269b408) runs: its CRD kept the operator's own
status fields (activePod, attempts, ...) and status.plan only as unknown fields; the new CRD declares every status
field, typed, and the API server prunes any other. A job that previous operator created and its runtime reported
into (e2e/operator/previous/, made by that commit's own code) keeps its running pod, its phase, its progress and
its plan when the new CRD is applied and the new operator takes over, and then succeeds.

On the control plane no operator watches (quiet_cluster), so that the previous operator's status is the only one
until the new operator starts: it is this test's, stopped at its end."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.conftest import FakeNodes
from e2e.operator.conftest import wait_active
from e2e.operator.harness import (
    CRD, SUCCEED_LABEL, OperatorProcess, events_of, ftj, pods_of, succeed_stage, wait,
)

pytestmark = pytest.mark.cluster

kube = pytest.importorskip("kubernetes", reason="the operator's dependencies are not installed")
from memstrata.api.jobstatus import FineTuneJobStatus  # noqa: E402
from memstrata.api.strataplan import Plan  # noqa: E402
from memstrata.operator.names import UID_SUFFIX  # noqa: E402

PREVIOUS = Path(__file__).resolve().parent / "previous"
OLD_UID = "11111111-2222-4333-8444-555555555555"  # the uid the previous objects were made for


def _install_crd(cluster: Any, path: Path) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    cluster.wait_established("finetunejobs.memstrata.dev")


def _for(uid: str, objects: Any) -> Any:
    """The previous objects for the job created here: its uid, and the names the operator derives from it."""
    text = json.dumps(objects).replace(OLD_UID, uid)
    return json.loads(text.replace(OLD_UID.replace("-", "")[:UID_SUFFIX], uid.replace("-", "")[:UID_SUFFIX]))


def _patch_status(cluster: Any, ns: str, name: str, status: dict[str, Any]) -> None:
    cluster.kubectl("patch", "finetunejob", name, "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))


def _previous_job(cluster: Any, nodes: FakeNodes, before: dict[str, Any]) -> dict[str, Any]:
    """The job, its pod Running and its status as the previous operator and runtime left them, under its CRD."""
    ns, name = before["job"]["metadata"]["namespace"], before["job"]["metadata"]["name"]
    node = before["node"]  # as that node agent published it
    nodes.create(node["metadata"]["name"], labels=node["metadata"]["labels"], capacity=node["status"]["capacity"],
                 annotations={k: v for k, v in node["metadata"]["annotations"].items() if not k.startswith("kwok")})
    cluster.create_namespace(ns)
    cluster.create(before["job"])
    uid = ftj(cluster, ns, name)["metadata"]["uid"]
    _patch_status(cluster, ns, name, before["status"])
    cluster.create(*_for(uid, before["companions"]), _for(uid, before["pod"]), namespace=ns)
    (pod,) = wait("the previous operator's pod Running", lambda: [
        p for p in pods_of(cluster, ns, name) if (p.get("status") or {}).get("phase") == "Running"])
    # Under its CRD the operator's fields are kept only as unknown ones, as that operator wrote them.
    kept = ftj(cluster, ns, name)["status"]
    assert kept["activePod"] == pod["metadata"]["name"] and kept["plan"]["feasible"] is True, kept
    return pod


def test_a_job_the_previous_operator_runs_keeps_running_after_the_upgrade(quiet_cluster: Any, tmp_path: Path) -> None:
    cluster = quiet_cluster
    before = yaml.safe_load((PREVIOUS / "job.yaml").read_text())
    ns, name = before["job"]["metadata"]["namespace"], before["job"]["metadata"]["name"]
    _install_crd(cluster, PREVIOUS / "finetunejob-crd.yaml")
    op, nodes = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", "upgrade"), FakeNodes(cluster)
    try:
        pod = _previous_job(cluster, nodes, before)
        _install_crd(cluster, CRD)  # the upgrade: the new CRD, then the new operator
        op.start()
        wait_active(cluster, op)
        # It reconciles the job at once: nothing there is for it to repair (no pod deleted or created, no warning).
        time.sleep(3)
        status = ftj(cluster, ns, name)["status"]
        typed = FineTuneJobStatus.model_validate(status)  # every field declared: none unknown, none mistyped
        assert typed.phase == "Running" and typed.active_pod == pod["metadata"]["name"] and typed.attempts == 1
        assert isinstance(typed.plan, Plan) and typed.plan == Plan.model_validate(before["status"]["plan"])
        assert status["progress"] == {k: v for k, v in before["status"]["progress"].items() if v is not None}
        assert (status["node"], status["startTime"], status["restarts"]) == (
            before["status"]["node"], before["status"]["startTime"], 0)
        assert [(p["metadata"]["uid"], p["metadata"].get("deletionTimestamp")) for p in pods_of(cluster, ns, name)] \
            == [(pod["metadata"]["uid"], None)], "the running pod was replaced or deleted"
        assert not [e for e in events_of(cluster, ns, name) if e["type"] == "Warning"], events_of(cluster, ns, name)
        # A field the schema does not declare is pruned now: nothing under status is kept unread.
        _patch_status(cluster, ns, name, {"observedBy": "someone"})
        assert "observedBy" not in ftj(cluster, ns, name)["status"]
        # The phase goes on: the pod finishes, the job succeeds.
        cluster.apply(succeed_stage())
        cluster.kubectl("label", "pod", pod["metadata"]["name"], "-n", ns, f"{SUCCEED_LABEL}=true")
        wait("the upgraded job Succeeded", lambda: ftj(cluster, ns, name)["status"].get("phase") == "Succeeded")
        done = FineTuneJobStatus.model_validate(ftj(cluster, ns, name)["status"])
        assert done.completion_time is not None and done.active_pod is None and done.plan == typed.plan
    finally:
        _remove(cluster, ns, name, op)
        nodes.delete_all()


def _remove(cluster: Any, ns: str, name: str, op: OperatorProcess) -> None:
    """The job goes while its operator runs (its finalizer), then the operator, then what the test made."""
    try:
        cluster.kubectl("delete", "finetunejob", name, "-n", ns, "--ignore-not-found", "--timeout=60s")
    finally:
        if op.alive():
            op.stop()
        print(f"\n[operator] log: {op.log}\n{op.tail(30)}")
        subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "delete",
                        "namespace", ns, "--wait=false", "--ignore-not-found"], capture_output=True, timeout=60)
        _install_crd(cluster, CRD)  # as the other tests of this control plane expect it

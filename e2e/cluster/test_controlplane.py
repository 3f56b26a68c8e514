"""The control-plane infrastructure that the operator's e2e tests rely on:
real scheduling against extended resources, pod lifecycles run by kwok, Jobs
run by the real controller-manager, and failures injected through a Stage."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster.controlplane import ControlPlane
from e2e.cluster.kwok import FAIL_LABEL, pod_failure_stage
from e2e.conftest import FakeNodes

pytestmark = pytest.mark.cluster

NVME = "memstrata.dev/nvme-ns"
GPU = "nvidia.com/gpu"


def _pod(name: str, requests: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "containers": [
                # Extended resources must be requested as limits (requests default to them).
                {"name": "main", "image": "registry.invalid/trainer:1", "resources": {"limits": requests}}
            ]
        },
    }


def _pod_json(cluster: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return cluster.get_json("pod", name, "-n", ns)


def _phase(cluster: ControlPlane, ns: str, name: str) -> str:
    return str(_pod_json(cluster, ns, name).get("status", {}).get("phase", ""))


def test_server_reports_pinned_version_and_startup_time(cluster: ControlPlane) -> None:
    mk = (Path(__file__).resolve().parents[2] / "mk" / "cluster.mk").read_text()
    want = re.search(r"^K8S_VERSION\s*:=\s*(\S+)", mk, re.M)
    assert want is not None
    server = json.loads(cluster.kubectl("get", "--raw", "/version"))
    assert server["gitVersion"] == want.group(1), server
    print(f"\n[cluster] startup took {cluster.startup_seconds:.1f} s")
    assert cluster.startup_seconds < cluster.startup_timeout_s


def test_fake_node_shows_extended_capacity_as_allocatable(cluster: ControlPlane, fake_nodes: FakeNodes) -> None:
    fake_nodes.create(
        "cap-node",
        labels={"memstrata.dev/cxl": "true"},
        capacity={NVME: "4", GPU: "2", "memory": "512Gi"},
    )
    node = cluster.get_json("node", "cap-node")
    alloc = node["status"]["allocatable"]
    assert alloc[NVME] == "4"
    assert alloc[GPU] == "2"
    assert alloc["memory"] == "512Gi"
    assert node["metadata"]["labels"]["memstrata.dev/cxl"] == "true"


def test_scheduler_places_pod_on_the_node_with_the_resource(
    cluster: ControlPlane, fake_nodes: FakeNodes, namespace: str
) -> None:
    fake_nodes.create("plain-node", capacity={GPU: "8"})
    fake_nodes.create("nvme-node", capacity={NVME: "2"})
    cluster.apply(_pod("wants-nvme", {NVME: "1"}), namespace=namespace)
    cluster.wait_for("pod Running", lambda: _phase(cluster, namespace, "wants-nvme") == "Running", timeout=60)
    pod = _pod_json(cluster, namespace, "wants-nvme")
    assert pod["spec"]["nodeName"] == "nvme-node"


def test_pod_asking_more_than_any_node_has_stays_pending_unschedulable(
    cluster: ControlPlane, fake_nodes: FakeNodes, namespace: str
) -> None:
    fake_nodes.create("small-nvme-node", capacity={NVME: "2"})
    cluster.apply(_pod("too-big", {NVME: "3"}), namespace=namespace)

    def unschedulable() -> bool:
        conds = _pod_json(cluster, namespace, "too-big").get("status", {}).get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)

    cluster.wait_for("PodScheduled=False/Unschedulable", unschedulable, timeout=60)
    time.sleep(2)  # and it stays that way
    pod = _pod_json(cluster, namespace, "too-big")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


def test_job_completes(cluster: ControlPlane, fake_nodes: FakeNodes, namespace: str) -> None:
    fake_nodes.create("job-node")
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "two-pods"},
        "spec": {
            "completions": 2,
            "parallelism": 2,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "registry.invalid/trainer:1"}],
                }
            },
        },
    }
    cluster.apply(job, namespace=namespace)

    def complete() -> bool:
        status = cluster.get_json("job", "two-pods", "-n", namespace).get("status", {})
        return any(c["type"] == "Complete" and c["status"] == "True" for c in status.get("conditions", []))

    cluster.wait_for("Job Complete", complete, timeout=90)
    assert cluster.get_json("job", "two-pods", "-n", namespace)["status"]["succeeded"] == 2


def test_failure_stage_makes_a_labelled_pod_fail(cluster: ControlPlane, fake_nodes: FakeNodes, namespace: str) -> None:
    cluster.apply(pod_failure_stage())
    fake_nodes.create("fail-node")
    cluster.apply(_pod("doomed", {}, labels={FAIL_LABEL: "3"}), namespace=namespace)
    cluster.apply(_pod("healthy", {}), namespace=namespace)
    cluster.wait_for("pod Failed", lambda: _phase(cluster, namespace, "doomed") == "Failed", timeout=60)
    terminated = _pod_json(cluster, namespace, "doomed")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3
    # The stage is selective: an unlabelled pod keeps running.
    cluster.wait_for("healthy Running", lambda: _phase(cluster, namespace, "healthy") == "Running", timeout=30)
    time.sleep(2)
    assert _phase(cluster, namespace, "healthy") == "Running"


def test_get_json_reads_what_kubectl_prints(cluster: ControlPlane, fake_nodes: FakeNodes, namespace: str) -> None:
    """The tests' polls are read in-process (e2e.cluster.reader), not by a kubectl process each: every form they
    use reads exactly what `kubectl get -o json` prints, a missing object fails as kubectl's does, and a form the
    reader does not serve still goes to kubectl."""
    from e2e.cluster.controlplane import ControlPlaneError

    fake_nodes.create("read-node", labels={"memstrata.dev/cxl": "true"}, capacity={NVME: "1"})
    cluster.create(_pod("read-me", {NVME: "1"}, labels={"app": "reader"}), namespace=namespace)
    forms = [("node", "read-node"), ("nodes", "-l", "memstrata.dev/cxl=true"), ("pods", "-n", namespace),
             ("pod", "read-me", "-n", namespace), ("po", "-n", namespace, "-l", "app=reader"),
             ("serviceaccount", "default", "-n", namespace), ("sa", "--all-namespaces"),
             ("customresourcedefinitions.apiextensions.k8s.io",)]
    for form in forms:
        for _ in range(20):  # kwok is still writing the new node's and pod's status: compare a settled object
            before, theirs = cluster.get_json(*form), json.loads(cluster.kubectl("get", *form, "-o", "json"))
            ours = cluster.get_json(*form)
            if _versions(before) == _versions(ours) == _versions(theirs):
                break
            time.sleep(0.25)
        assert json.dumps(ours, sort_keys=True) == json.dumps(theirs, sort_keys=True), form
        assert cluster._reader is not None and cluster._reader.get(form) is not None, f"{form} went to kubectl"
    assert [i["metadata"]["name"] for i in cluster.get_json("pods", "-n", namespace)["items"]] == ["read-me"]
    assert cluster.find_json("pod", "gone", "-n", namespace) is None
    with pytest.raises(ControlPlaneError, match=r"\(NotFound\)"):
        cluster.get_json("pod", "gone", "-n", namespace)
    by_kubectl = cluster.get_json("pod/read-me", "-n", namespace)  # TYPE/NAME: not the reader's form
    assert by_kubectl["metadata"]["name"] == "read-me"


def _versions(obj: dict[str, Any]) -> list[str]:
    """The resourceVersion of an object, or of each item of a List."""
    return [str((o.get("metadata") or {}).get("resourceVersion")) for o in obj.get("items", [obj])]

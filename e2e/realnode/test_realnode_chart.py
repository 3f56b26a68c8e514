"""`helm install` of the chart on the real node: the operator Deployment and the node-agent DaemonSet run
in containers from the locally built images, the node agent registers its device plugin with the real
kubelet, and the Node shows `memstrata.dev/nvme-ns` capacity and memstrata's labels — with the loop
devices named as such, so no one mistakes them for NVMe."""
from __future__ import annotations

import json

import pytest

from e2e.realnode.conftest import RELEASE_NS, RealCluster
from e2e.scrape import Samples

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]


def test_the_chart_runs_the_operator_and_node_agent_in_containers(real_cluster: RealCluster) -> None:
    rc = real_cluster
    dep = rc.cp.get_json("deployment", "memstrata-operator", "-n", RELEASE_NS)
    assert dep["status"].get("readyReplicas") == dep["spec"]["replicas"] >= 1, dep["status"]
    ops = rc.cp.get_json("pods", "-n", RELEASE_NS, "-l", "app.kubernetes.io/component=operator")["items"]
    for pod in ops:
        cs = pod["status"]["containerStatuses"][0]
        assert cs["image"].endswith(rc.images.operator.split("/", 1)[1]) and cs["ready"], cs
        assert pod["spec"]["nodeName"] == rc.node.name
    # The operator's pods meet `restricted` as the chart sets them: non-root, numeric uid.
    assert ops[0]["spec"]["securityContext"]["runAsUser"] == 65532

    agent = rc.agent_pod()
    assert agent is not None and agent["status"]["phase"] == "Running", agent and agent["status"]
    assert agent["status"]["containerStatuses"][0]["image"].endswith(rc.images.node_agent.split("/", 1)[1])


def test_the_node_shows_the_device_plugins_capacity_and_labels(real_cluster: RealCluster) -> None:
    rc = real_cluster
    node: dict = {}

    def advertised() -> bool:
        node.update(rc.node_json())
        return node["status"].get("allocatable", {}).get("memstrata.dev/nvme-ns") == str(len(rc.loops))

    rc.cp.wait_for("the kubelet to count the device plugin's namespaces", advertised, timeout=60)
    assert node["status"]["capacity"]["memstrata.dev/nvme-ns"] == str(len(rc.loops))
    labels = node["metadata"]["labels"]
    assert labels.get("memstrata.dev/managed") == "true", labels
    assert labels.get("memstrata.dev/loop-namespaces") == "true", labels
    inventory = json.loads(node["metadata"]["annotations"]["memstrata.dev/inventory"])
    names = sorted(ns["name"] for ns in inventory["nvmeNamespaces"])
    assert names == sorted(rc.loops), inventory["nvmeNamespaces"]
    # The kubelet, not a stub, took the registration.
    log = (rc.node.workdir / "kubelet.log").read_text(errors="replace")
    assert "memstrata.dev/nvme-ns" in log, "the kubelet never logged the device plugin's registration"


def test_the_charts_metrics_services_reach_the_operator_and_node_agent(real_cluster: RealCluster) -> None:
    """What a Prometheus (or a ServiceMonitor) finds through the chart's Services: the node agent's devices as
    the kubelet was told of them, and the operator replica holding the Lease saying so."""
    rc = real_cluster

    seen: list[Samples] = []

    def listed() -> bool:
        seen.append(rc.metrics("services", "memstrata-node-agent-metrics"))
        return seen[-1].value("memstrata_nodeagent_devices", resource="memstrata.dev/nvme-ns", kind="loop",
                              health="Healthy") == len(rc.loops)

    rc.cp.wait_for("the node agent's metrics to list the loop namespaces healthy", listed, timeout=60)
    m = seen[-1]
    assert m.value("memstrata_nodeagent_kubelet_registrations_total", resource="memstrata.dev/nvme-ns",
                   result="ok") >= 1
    assert m.value("memstrata_nodeagent_discovery_scans_total", result="ok") >= 1
    assert not m.has("memstrata_nodeagent_devices", kind="nvme")  # loop devices are never counted as NVMe

    holder = rc.cp.get_json("lease", "memstrata-operator", "-n", RELEASE_NS)["spec"]["holderIdentity"]
    leading = {}
    for pod in rc.cp.get_json("pods", "-n", RELEASE_NS, "-l", "app.kubernetes.io/component=operator")["items"]:
        (labels, value), = rc.metrics("pods", pod["metadata"]["name"]).series("memstrata_operator_leader")
        leading[labels["identity"]] = value
    assert leading.get(holder) == 1.0 and sum(leading.values()) == 1.0, (holder, leading)
    # The Service reaches the operators too.
    assert rc.metrics("services", "memstrata-operator-metrics").has("memstrata_operator_leader")

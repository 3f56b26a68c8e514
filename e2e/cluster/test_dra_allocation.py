"""The DRA driver's ResourceSlice against the real API server and scheduler: the slice the node agent builds
from a two-socket CXL node's discovered tree (tests/data/sysfs/two-socket-cxl) is accepted as written,
published once per change, and the scheduler allocates from it what claims ask for by size, NUMA node
and CXL bytes, sharing a CXL node between claims and refusing a claim nothing fits.

The node is a kwok node (no kubelet: nothing prepares the claims here; e2e/realnode/test_realnode_dra.py
does that on the real node). The operator's claim template (memstrata.operator.claims) is allocated here too:
the scheduler takes the first of its preferences that the node's namespaces can meet."""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster.controlplane import ControlPlane
from memstrata.api import dra
from memstrata.api.inventory import RESOURCE_NVME
from memstrata.api.strataplan import Allocation, CategoryPlan, Plan
from memstrata.nodeagent.draslice import slice_spec
from memstrata.nodeagent.drapublish import SlicePublisher, slice_name
from memstrata.operator import claims
from tests.nodeagent.sysfs_cases import inventory_of

pytestmark = pytest.mark.cluster

TREE = Path(__file__).resolve().parents[2] / "tests" / "data" / "sysfs" / "two-socket-cxl"
GIB = 1 << 30


def inventory(node: str) -> Any:
    return inventory_of(TREE, hostname=node)


def claim(name: str, *requests: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": list(requests)}}}


def nvme(min_gib: int, numa: int | None = None) -> dict[str, Any]:
    expr = f'device.capacity["{dra.DRIVER}"].{dra.SIZE}.compareTo(quantity("{min_gib}Gi")) >= 0'
    if numa is not None:
        expr += f' && device.attributes["{dra.DRIVER}"].numaNode == {numa}'
    return {"name": "ns", "exactly": {"deviceClassName": dra.NVME_CLASS, "selectors": [{"cel": {"expression": expr}}]}}


def cxl(gib: int) -> dict[str, Any]:
    return {"name": "cxl", "exactly": {"deviceClassName": dra.CXL_CLASS,
                                       "capacity": {"requests": {dra.MEMORY: f"{gib}Gi"}}}}


def pod(name: str, node: str, claim_name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "tolerations": [{"operator": "Exists"}],
        "resourceClaims": [{"name": "c", "resourceClaimName": claim_name}],
        "containers": [{"name": "c", "image": "none", "resources": {"claims": [{"name": "c"}]}}]}}


def results(cluster: ControlPlane, ns: str, name: str) -> list[dict[str, Any]]:
    status = cluster.get_json("resourceclaim", name, "-n", ns).get("status") or {}
    return ((status.get("allocation") or {}).get("devices") or {}).get("results") or []


def test_the_scheduler_allocates_published_namespaces_and_cxl_bytes(
        cluster: ControlPlane, fake_nodes: Any, namespace: str) -> None:
    node = "dra-cxl-node"
    fake_nodes.create(node)
    inv = inventory(node)
    publisher = SlicePublisher(node, str(cluster.kubeconfig))
    assert publisher.publish(partial(slice_spec, inv, node))
    written = cluster.get_json("resourceslice", slice_name(node))
    assert written["spec"]["pool"]["generation"] == 1
    assert written["metadata"]["ownerReferences"][0]["name"] == node
    # Accepted as rendered: the API server kept every device, attribute and capacity.
    assert written["spec"]["devices"] == slice_spec(inv, node, 1)["devices"]
    names = {d["attributes"]["namespace"]["string"]: d["name"] for d in written["spec"]["devices"]
             if d["attributes"]["kind"]["string"] == dra.KIND_NVME}
    assert set(names) == {ns.name for ns in inv.free_namespaces}
    # A second agent (a restart) with nothing changed writes nothing; a change bumps the generation.
    again = SlicePublisher(node, str(cluster.kubeconfig))
    assert not again.publish(partial(slice_spec, inv, node))
    assert cluster.get_json("resourceslice", slice_name(node))["metadata"]["resourceVersion"] == \
        written["metadata"]["resourceVersion"]
    for dc in dra.device_classes():
        cluster.apply(dc)

    # 150 GiB: only nvme1n1 (200 GiB, NUMA 1) has it; 20 GiB of CXL: only node 2 (32 GiB) has that.
    cluster.apply(claim("big", nvme(150), cxl(20)), claim("more-cxl", cxl(12)), claim("numa0", nvme(60, numa=0)),
                  namespace=namespace)
    for name in ("big", "more-cxl", "numa0"):
        cluster.apply(pod(name, node, name), namespace=namespace)
    cluster.wait_for("three claims allocated", lambda: all(results(cluster, namespace, n)
                                                          for n in ("big", "more-cxl", "numa0")), timeout=60)
    big = {r["request"]: r for r in results(cluster, namespace, "big")}
    assert big["ns"]["device"] == names["nvme1n1"] and big["ns"]["pool"] == node
    assert big["cxl"]["device"] == dra.cxl_device_name(2)
    assert big["cxl"]["consumedCapacity"][dra.MEMORY] in ("20Gi", str(20 * GIB)), big["cxl"]
    assert results(cluster, namespace, "more-cxl")[0]["device"] in {dra.cxl_device_name(2), dra.cxl_device_name(3)}
    assert results(cluster, namespace, "numa0")[0]["device"] == names["nvme0n1"]

    # 17 GiB would fit an empty node 2; with 20 + 12 GiB of it (or 20, and 12 of node 3's 16.5) consumed, nothing has it.
    cluster.apply(claim("too-much-cxl", cxl(17)), namespace=namespace)
    cluster.apply(pod("too-much-cxl", node, "too-much-cxl"), namespace=namespace)

    def unschedulable() -> str:
        conds = cluster.get_json("pod", "too-much-cxl", "-n", namespace)["status"].get("conditions") or []
        return next((c.get("message", "") for c in conds if c.get("reason") == "Unschedulable"), "")

    cluster.wait_for("the 17 GiB CXL claim's pod to be unschedulable", lambda: bool(unschedulable()), timeout=60)
    assert "cannot allocate all claims" in unschedulable(), unschedulable()
    assert not results(cluster, namespace, "too-much-cxl")

    # A namespace being scrubbed leaves the slice at the next publication, in a new generation.
    assert publisher.publish(partial(slice_spec, inv, node, scrubbing=frozenset({"nvme0n1"})))
    after = cluster.get_json("resourceslice", slice_name(node))
    assert after["spec"]["pool"]["generation"] == 2
    assert names["nvme0n1"] not in {d["name"] for d in after["spec"]["devices"]}


def plan_on_nvme(nvme_bytes: int, namespaces: int) -> Plan:
    return Plan(parameters=1, engine="memstrata", feasible=True, strata=[], requests={RESOURCE_NVME: namespaces},
                categories=[CategoryPlan(category="optimizer", description="", bytes=nvme_bytes,
                                         placement=[Allocation(stratum="nvme", bytes=nvme_bytes)])])


@pytest.mark.parametrize("gib,option,expect", [
    # 2 x 5 GiB: no NUMA node has two controllers' namespaces, NUMA 1 has two of one controller: "numa".
    (10, "numa", {"nvme1n1", "nvme1n2"}),
    # 2 x 50 GiB: NUMA 1's second namespace is 10 GiB; two controllers have one each: "spread".
    (100, "spread", {"nvme0n1", "nvme1n1"}),
])
def test_a_jobs_claim_template_gets_the_most_preferred_namespaces_that_fit(
        cluster: ControlPlane, fake_nodes: Any, namespace: str, gib: int, option: str, expect: set[str]) -> None:
    node = f"dra-tmpl-{gib}"
    fake_nodes.create(node)
    inv = inventory(node)
    SlicePublisher(node, str(cluster.kubeconfig)).publish(partial(slice_spec, inv, node))
    for dc in dra.device_classes():
        cluster.apply(dc)
    meta = {"name": "job-devices"}
    cluster.apply(claims.template(meta, plan_on_nvme(gib * GIB, 2)), namespace=namespace)
    body = pod("trainer", node, "unused")
    body["spec"]["resourceClaims"] = [{"name": "c", "resourceClaimTemplateName": "job-devices"}]
    cluster.apply(body, namespace=namespace)

    def allocated() -> list[dict[str, Any]]:
        status = cluster.get_json("pod", "trainer", "-n", namespace).get("status") or {}
        made = [s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []]
        return results(cluster, namespace, made[0]) if made and made[0] else []

    cluster.wait_for("the pod's claim, made from the template, allocated", lambda: bool(allocated()), timeout=60)
    got = allocated()
    by_device = {d["name"]: d["attributes"]["namespace"]["string"] for d in slice_spec(inv, node, 1)["devices"]
                 if "namespace" in d["attributes"]}
    assert {by_device[r["device"]] for r in got} == expect, got
    assert {r["request"] for r in got} == {f"namespaces/{option}"}, got


def test_a_slice_deleted_behind_the_agents_back_is_written_again(cluster: ControlPlane, fake_nodes: Any) -> None:
    """A starting kubelet wipes its node's slices: the next read-back writes ours again, in a generation above
    every one the pool had."""
    node = "dra-wiped"
    fake_nodes.create(node)
    inv = inventory(node)
    publisher = SlicePublisher(node, str(cluster.kubeconfig))
    assert publisher.publish(partial(slice_spec, inv, node))
    assert publisher.publish(partial(slice_spec, inv, node, scrubbing=frozenset({"nvme0n1"})))
    after = cluster.get_json("resourceslice", slice_name(node))
    assert after["spec"]["pool"]["generation"] == 2
    cluster.kubectl("delete", "resourceslice", slice_name(node))
    assert not publisher.publish(partial(slice_spec, inv, node, scrubbing=frozenset({"nvme0n1"})))  # not read yet
    publisher.forget()  # what the kubelet's registration call does
    assert publisher.publish(partial(slice_spec, inv, node, scrubbing=frozenset({"nvme0n1"})))
    back = cluster.get_json("resourceslice", slice_name(node))
    assert back["spec"]["devices"] == after["spec"]["devices"] and back["spec"]["pool"]["generation"] == 3
    assert back["metadata"]["uid"] != after["metadata"]["uid"]

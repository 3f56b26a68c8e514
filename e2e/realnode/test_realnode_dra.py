"""The node agent as a DRA driver on the real node: the real kubelet registers it, the real scheduler
allocates its ResourceSlice's devices to ResourceClaims, and the built containerd hands them to the
container through CDI.

The chart is switched to `nodeAgent.deviceApi=dra` for this module and back afterwards (the way the
chart README moves a node between modes, with no memstrata job on it): the agent and the operator both,
so a FineTuneJob's pod names a claim made from the operator's template.
"""
from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.conftest import _say
from e2e.realnode.conftest import CHART, RELEASE_NS, RealCluster
from e2e.realnode.jobs import JobStorage, container_env, explain, smollm2_job, wait_phase
from memstrata.api import dra
from memstrata.nodeagent.drapublish import slice_name
from memstrata.operator import names

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]

GIB = 1 << 30
DISK_GID = 6  # the chart's trainingPod.deviceGroup
# Holds every namespace of its claim as the NVMe engine does (O_EXCL) with a job's header on it, so that
# the agent sees them in use; deleting the pod leaves them dirty, for the agent to scrub.
HOLDER = """
import os, time, uuid
from memstrata.node.header import Header, State, parse_header, render_header
paths = os.environ["MEMSTRATA_NVME_DEVICES"].split(",")
for i, p in enumerate(paths):
    fd = os.open(p, os.O_RDWR | os.O_EXCL)
    size = os.lseek(fd, 0, os.SEEK_END)
    found = parse_header(os.pread(fd, 4096, 0))
    print("found", p, found.state.name if found else "no-header", flush=True)
    os.pwrite(fd, render_header(Header(owner_job="dra-e2e", generation=1, state=State.OPEN, set_id=uuid.uuid4(),
              set_index=i, set_size=len(paths), logical_block_size=512, capacity_bytes=size)), 0)
    os.fsync(fd)
    print("holding", p, oct(os.stat(p).st_mode), os.stat(p).st_gid, flush=True)
time.sleep(3600)
"""


def upgrade(rc: RealCluster, mode: str) -> None:
    rc.cp.helm("upgrade", "memstrata", str(CHART), "--namespace", RELEASE_NS, "--reuse-values",
               "--set", f"nodeAgent.deviceApi={mode}", "--wait", "--timeout", "5m", timeout=330)


def slice_devices(rc: RealCluster) -> dict[str, dict[str, Any]]:
    slices = rc.cp.get_json("resourceslices")["items"]
    ours = [s for s in slices if s["spec"]["driver"] == dra.DRIVER and s["spec"].get("nodeName") == rc.node.name]
    return {d["name"]: d for s in ours for d in s["spec"].get("devices") or []}


@pytest.fixture(scope="module")
def dra_node(real_cluster: RealCluster) -> Iterator[RealCluster]:
    rc = real_cluster
    began = time.monotonic()
    upgrade(rc, "dra")
    try:
        rc.cp.wait_for("the node's ResourceSlice to list both loop namespaces",
                       lambda: {d["attributes"]["namespace"]["string"] for d in slice_devices(rc).values()}
                       == set(rc.loops), timeout=120)
        rc.timings["dra-switch"] = time.monotonic() - began
        yield rc
    finally:
        try:
            # A pod holding a claim needs the DRA driver to unprepare it: switched back first, the kubelet keeps it
            # Terminating for good ("DRA driver ... is not registered"), with its namespaces, and every later job on
            # this node waits behind it (a failed DRA test once took four more tests down so).
            rc.cp.wait_for("every pod holding a claim gone while the DRA driver is still there",
                           lambda: not claimed_pods(rc), timeout=180)
        finally:
            upgrade(rc, "device-plugin")
            rc.cp.wait_for("the device plugin to offer the namespaces again", lambda: rc.node_json()["status"].get(
                "allocatable", {}).get("memstrata.dev/nvme-ns") == str(len(rc.loops)), timeout=180)


def claimed_pods(rc: RealCluster) -> list[str]:
    """namespace/name of every pod, in any namespace, that holds a resource claim."""
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in rc.cp.get_json("pods", "-A")["items"]
            if p["spec"].get("resourceClaims")]


def claim(name: str, count: int, min_bytes: int) -> dict[str, Any]:
    size = f'device.capacity["{dra.DRIVER}"].{dra.SIZE}.compareTo(quantity("{min_bytes}")) >= 0'
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "ns", "exactly": {
                "deviceClassName": dra.NVME_CLASS, "allocationMode": "ExactCount", "count": count,
                "selectors": [{"cel": {"expression": size}}]}}]}}}


def holder(name: str, image: str, claim_name: str) -> dict[str, Any]:
    """A pod meeting `restricted`, as a training pod does: not root, the device group supplementary."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "supplementalGroups": [DISK_GID],
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "resourceClaims": [{"name": "ns", "resourceClaimName": claim_name}],
        "containers": [{"name": "c", "image": image, "imagePullPolicy": "Never", "command": ["python3", "-c", HOLDER],
                        "resources": {"claims": [{"name": "ns"}]},
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}}


def phase(rc: RealCluster, ns: str, pod: str) -> str:
    return rc.cp.get_json("pod", pod, "-n", ns)["status"].get("phase", "")


def unschedulable(rc: RealCluster, ns: str, pod: str) -> str:
    """The scheduler's message when it cannot place `pod`, else ''."""
    conds = rc.cp.get_json("pod", pod, "-n", ns)["status"].get("conditions") or []
    return next((c.get("message", "") for c in conds
                 if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"), "")


def test_claimed_namespaces_reach_the_container_through_cdi_and_are_scrubbed_and_published_after(
        dra_node: RealCluster, job_ns: str, request: pytest.FixtureRequest) -> None:
    rc, ns = dra_node, job_ns
    devices = slice_devices(rc)
    for d in devices.values():  # what the scheduler sees of a loop namespace
        assert d["attributes"]["loop"] == {"bool": True} and d["attributes"]["blockSize"] == {"int": 512}, d
        assert d["capacity"][dra.SIZE]["value"] in (str(2 * GIB), "2Gi"), d
    agent = rc.agent_pod()
    assert agent is not None
    gauge = rc.metrics("pods", agent["metadata"]["name"])
    assert gauge.value("memstrata_nodeagent_devices", resource=dra.NVME_CLASS, kind="loop", health="Healthy") == len(
        rc.loops)
    image = rc.images.node_agent
    rc.cp.apply(claim("two", 2, GIB), claim("one", 1, GIB), claim("huge", 1, 3 * GIB), namespace=ns)
    rc.cp.apply(holder("first", image, "two"), namespace=ns)
    rc.cp.wait_for("the pod claiming both namespaces to run", lambda: phase(rc, ns, "first") == "Running", timeout=120)
    got = rc.cp.get_json("resourceclaim", "two", "-n", ns)["status"]["allocation"]["devices"]["results"]
    assert sorted(r["device"] for r in got) == sorted(devices), got
    rc.cp.wait_for("the container to open both namespaces", lambda: rc.node.container_logs(ns, "first").count(
        "holding") == 2, timeout=60)
    logs = rc.node.container_logs(ns, "first")
    for loop in rc.loops:  # the device nodes CDI made, owned by the device group, as the device plugin's are
        assert f"holding /dev/{loop} 0o60660 {DISK_GID}" in logs, logs
    # In use: out of the slice; a second claim waits, and one bigger than any device never fits.
    rc.cp.wait_for("the held namespaces to leave the slice", lambda: not slice_devices(rc), timeout=60)
    rc.cp.apply(holder("second", image, "one"), holder("too-big", image, "huge"), namespace=ns)
    rc.cp.wait_for("the second pod to be unschedulable", lambda: bool(unschedulable(rc, ns, "second")), timeout=60)
    rc.cp.wait_for("the too-big pod to be unschedulable", lambda: bool(unschedulable(rc, ns, "too-big")), timeout=60)
    assert "cannot allocate all claims" in unschedulable(rc, ns, "too-big"), unschedulable(rc, ns, "too-big")

    # Deleting the first pod unprepares its claim; the agent scrubs what it left and offers both again.
    freed = time.monotonic()
    rc.kubectl("delete", "pod", "first", "-n", ns, "--wait=true", timeout=120)
    rc.kubectl("delete", "resourceclaim", "two", "-n", ns, "--wait=true", timeout=120)
    rc.cp.wait_for("the second pod to get a scrubbed namespace and run", lambda: phase(rc, ns, "second") == "Running",
                   timeout=180)
    waited = time.monotonic() - freed
    rc.cp.wait_for("the second pod's namespace to be held", lambda: "holding" in rc.node.container_logs(ns, "second"),
                   timeout=60)
    second = rc.node.container_logs(ns, "second")
    assert not second.count("Traceback"), second
    # It got one of the two the first pod left OPEN, and found it scrubbed (the agent's SCRUBBED stamp).
    assert re.search(r"found /dev/loop\d+ SCRUBBED", second), second
    assert unschedulable(rc, ns, "too-big"), "a claim larger than every namespace was placed"
    rc.kubectl("delete", "pod", "second", "too-big", "-n", ns, "--wait=true", timeout=120)
    rc.cp.wait_for("both namespaces scrubbed and published again",
                   lambda: len(slice_devices(rc)) == len(rc.loops), timeout=180)
    _say(request, f"[realnode] DRA: a freed pair of namespaces was scrubbed and the waiting pod ran "
                  f"{waited:.1f} s after the first pod's deletion")


def test_a_restarted_kubelets_wipe_of_the_slice_is_undone(dra_node: RealCluster, request: pytest.FixtureRequest) -> None:
    """A starting kubelet deletes its node's ResourceSlices (no driver has registered yet); the agent, registered
    again, writes its own back, a new object with every free namespace."""
    rc = dra_node
    rc.cp.wait_for("the slice to list both namespaces", lambda: len(slice_devices(rc)) == len(rc.loops), timeout=180)
    before = rc.cp.get_json("resourceslice", slice_name(rc.node.name))["metadata"]["uid"]
    restarted = time.monotonic()
    rc.node.restart_kubelet()

    def rewritten() -> bool:
        found = rc.cp.get_json("resourceslices")["items"]
        return any(s["metadata"]["name"] == slice_name(rc.node.name) and s["metadata"]["uid"] != before
                   and len(s["spec"].get("devices") or []) == len(rc.loops) for s in found)

    rc.cp.wait_for("the agent to write the slice the restarted kubelet deleted", rewritten, timeout=120)
    rc.node.wait_ready(60)
    _say(request, f"[realnode] DRA: the kubelet's restart wiped the slice; it was back "
                  f"{time.monotonic() - restarted:.1f} s after the restart began")


def test_a_finetunejob_claims_two_namespaces_through_dra_and_trains_through_them(
        dra_node: RealCluster, job_ns: str, storage: JobStorage, request: pytest.FixtureRequest) -> None:
    """`kubectl apply` of a job whose plan stripes over two namespaces: the operator renders its claim template,
    the scheduler allocates both loop namespaces, the runtime trains through them; a second such job waits, with
    no pod, until they are free again, then trains on them; once the jobs are deleted the namespaces are published
    again."""
    rc, ns = dra_node, job_ns
    memory = {"memory": {"engine": "memstrata", "dramBudget": "1200Mi", "nvmeNamespaces": 2}}
    began = time.monotonic()
    rc.cp.apply(smollm2_job("dra", rc.images.runtime, steps=3, extra_spec=memory), namespace=ns)
    env: dict[str, str] = {}
    claim_names: list[str] = []

    def watch(body: dict[str, Any]) -> None:
        for p in rc.cp.get_json("pods", "-n", ns)["items"]:
            meta = p["metadata"]
            if meta.get("labels", {}).get("memstrata.dev/role") is not None or \
                    (meta.get("annotations") or {}).get(names.LABEL_JOB_NAME) != "dra":
                continue
            # Only while the pod runs: once it has finished, Kubernetes' resourceclaim controller (v1.36) deletes its
            # claim and may then make a fresh one from the template, never allocated, and name that in the finished
            # pod's status (kubernetes#141274; seen once under load as a second claim name for one pod UID).
            if p["status"].get("phase") not in ("Succeeded", "Failed"):
                claim_names.extend(s["resourceClaimName"] for s in p["status"].get("resourceClaimStatuses") or []
                                   if s.get("resourceClaimName") and s["resourceClaimName"] not in claim_names)
            if not env and (found := container_env(rc.node, p)) is not None:
                env.update(found)

    wait_phase(rc.cp, ns, "dra", {"Running", "Succeeded", "Failed"}, timeout=600, on_poll=watch)
    rc.cp.apply(smollm2_job("dra-next", rc.images.runtime, steps=2, extra_spec=memory), namespace=ns)
    waiting = wait_condition(rc, ns, "dra-next", "Scheduled", "False")
    assert "memstrata.dev/nvme-ns needs 2, 0 free" in waiting["message"], waiting
    assert not [p for p in rc.cp.get_json("pods", "-n", ns)["items"]  # waiting holds nothing: no pod, no claim
                if (p["metadata"].get("annotations") or {}).get(names.LABEL_JOB_NAME) == "dra-next"]
    body = wait_phase(rc.cp, ns, "dra", {"Succeeded", "Failed"}, timeout=1200, on_poll=watch)
    assert body["status"]["phase"] == "Succeeded", explain(rc.cp, rc.node, ns, "dra")
    trained = time.monotonic() - began
    templates = rc.cp.get_json("resourceclaimtemplates", "-n", ns)["items"]
    assert [t["metadata"]["ownerReferences"][0]["name"] for t in templates].count("dra") == 1
    assert len(claim_names) == 1, claim_names
    # The job's status names what its claim got: both loop namespaces of this node's pool.
    assert sorted(body["status"]["devices"]) == sorted(f"{rc.node.name}/{loop}" for loop in rc.loops), body["status"]
    # Both namespaces reached the container, through the claim's CDI spec (no extended resource was asked for).
    assert sorted(env.get("MEMSTRATA_NVME_DEVICES", "").split(",")) == sorted(f"/dev/{n}" for n in rc.loops), env
    peaks = body["status"]["peakMemory"]
    assert peaks.get("nvme", 0) > 100 << 20, peaks
    rc.kubectl("delete", "finetunejob", "dra", "-n", ns, "--wait=true", timeout=180)
    freed = time.monotonic()
    # It runs on the freed pair (training it to the end would only repeat the first job, on a busy machine).
    def next_trains() -> bool:
        status = rc.cp.get_json("finetunejob", "dra-next", "-n", ns).get("status") or {}
        assert status.get("phase") != "Failed", explain(rc.cp, rc.node, ns, "dra-next")
        return status.get("phase") in ("Running", "Succeeded") and (status.get("progress") or {}).get("step", 0) >= 1 \
            and sorted(status.get("devices") or []) == sorted(body["status"]["devices"])

    rc.cp.wait_for("the waiting job to train on the freed pair", next_trains, timeout=600)
    rc.kubectl("delete", "finetunejob", "dra-next", "-n", ns, "--wait=true", timeout=180)
    rc.cp.wait_for("the jobs' claims gone and both namespaces published again", lambda: len(slice_devices(rc)) == len(
        rc.loops) and not rc.cp.get_json("resourceclaims", "-n", ns)["items"], timeout=180)
    _say(request, f"[realnode] DRA: a 2-namespace FineTuneJob trained through its claim in {trained:.1f} s; the "
                  f"second, waiting, trained its first step {time.monotonic() - freed:.1f} s after the first was deleted")


def wait_condition(rc: RealCluster, ns: str, job: str, kind: str, status: str, timeout: float = 120) -> dict[str, Any]:
    """The job's condition `kind` once it has `status`."""
    found: dict[str, Any] = {}

    def has() -> bool:
        conds = (rc.cp.get_json("finetunejob", job, "-n", ns).get("status") or {}).get("conditions") or []
        found.update(next((c for c in conds if c["type"] == kind and c["status"] == status), {}))
        return bool(found)

    rc.cp.wait_for(f"{job}'s {kind} condition {status}", has, timeout=timeout)
    return found

"""A job's devices as a DRA claim (--device-api dra): the ResourceClaimTemplate the operator renders from the
plan, the pod that names it instead of requesting extended resources, and the room-now arithmetic that counts
what claims hold. The real API server, scheduler, kubelet and containerd run the same on the real node
(e2e/realnode/test_realnode_dra.py)."""
from __future__ import annotations

import json

import pytest
from ftj_factories import inventory, job_dict, node_dict

from memstrata.api import dra
from memstrata.api.inventory import RESOURCE_GPU, RESOURCE_NVME
from memstrata.api.strata import RESOURCE_CXL_GIB
from memstrata.operator import claims, names
from memstrata.operator.nodes import node_view, pod_use, usage_by_node
from memstrata.operator.observe import job_view
from memstrata.operator.render import PodSecurity, gang_objects
from memstrata.operator.scheduling import place

DRA = PodSecurity(dra=True)


def placed(dram: str = "64Gi", nvme: int = 2, cxl_gib: int = 16):
    d = job_dict("llama")
    d["spec"]["memory"] = {"dramBudget": dram, "nvmeNamespaces": nvme}
    job = job_view(d)
    node = node_view(node_dict("n1", inventory("n1", dram_gib=512, cxl_gib=cxl_gib)), claims.CLAIMED_RESOURCES)
    placement = place(job.spec, [node], {})
    assert placement.outcome == "chosen", placement.message
    return job, placement.plan


def test_the_template_asks_for_the_plans_namespaces_by_size_numa_and_controller_and_its_cxl_bytes() -> None:
    job, plan = placed()
    companions, (pod,) = gang_objects(job, ("n1",), plan, 1, security=DRA)
    (tmpl,) = [c for c in companions if c["kind"] == "ResourceClaimTemplate"]
    assert tmpl["metadata"]["name"] == names.claim_template_name(job.name, job.uid, 1)
    # A retry is planned anew and a template cannot change: the next attempt has a template of its own.
    assert names.claim_template_name(job.name, job.uid, 2) != tmpl["metadata"]["name"]
    assert tmpl["metadata"]["ownerReferences"][0]["uid"] == job.uid
    devices = tmpl["spec"]["spec"]["devices"]
    ns, cxl = devices["requests"]
    share = -(-plan.bytes_on("nvme") // 2) + claims.HEADER_AREA
    assert [o["name"] for o in ns["firstAvailable"]] == ["numa-spread", "numa", "spread", "any"]
    for option in ns["firstAvailable"]:
        assert option["deviceClassName"] == dra.NVME_CLASS and option["count"] == 2
        assert f'quantity("{share}")' in option["selectors"][0]["cel"]["expression"]
    rules = {(tuple(c["requests"]), c.get("matchAttribute"), c.get("distinctAttribute")) for c in devices["constraints"]}
    assert (("namespaces/numa-spread",), "dra.memstrata.dev/numaNode", None) in rules
    assert (("namespaces/spread",), None, "dra.memstrata.dev/controller") in rules
    assert not any(r[0] == ("namespaces/any",) for r in rules)  # the last resort takes any two
    step = dra.CXL_STEP_BYTES
    assert cxl["exactly"]["deviceClassName"] == dra.CXL_CLASS and cxl["exactly"]["count"] == 1
    assert int(cxl["exactly"]["capacity"]["requests"][dra.MEMORY]) == -(-plan.bytes_on("cxl") // step) * step

    spec = pod["spec"]
    assert spec["resourceClaims"] == [{"name": claims.CLAIM, "resourceClaimTemplateName": tmpl["metadata"]["name"]}]
    (container,) = spec["containers"]
    assert container["resources"]["claims"] == [{"name": claims.CLAIM}]
    limits = container["resources"]["limits"]
    assert RESOURCE_NVME not in limits and RESOURCE_CXL_GIB not in limits and limits[RESOURCE_GPU] == "1"
    assert json.loads(pod["metadata"]["annotations"][claims.ANNOTATION_REQUESTS]) == {
        RESOURCE_NVME: 2, RESOURCE_CXL_GIB: plan.requests[RESOURCE_CXL_GIB]}


def test_one_namespace_is_just_its_size_and_gpus_come_from_the_class_named() -> None:
    job, plan = placed(nvme=1, cxl_gib=0)
    companions, (pod,) = gang_objects(job, ("n1",), plan, 1, security=PodSecurity(dra=True,
                                                                                   gpu_device_class="gpu.nvidia.com"))
    (tmpl,) = [c for c in companions if c["kind"] == "ResourceClaimTemplate"]
    devices = tmpl["spec"]["spec"]["devices"]
    assert "constraints" not in devices
    ns, gpus = devices["requests"]
    assert ns["exactly"]["count"] == 1 and "firstAvailable" not in ns
    assert gpus == {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount",
                                                "count": 1}}
    assert RESOURCE_GPU not in pod["spec"]["containers"][0]["resources"]["limits"]


def test_the_device_plugin_mode_renders_no_claim() -> None:
    job, plan = placed()
    companions, (pod,) = gang_objects(job, ("n1",), plan, 1)
    assert not [c for c in companions if c["kind"] == "ResourceClaimTemplate"]
    assert "resourceClaims" not in pod["spec"] and pod["spec"]["containers"][0]["resources"]["limits"][RESOURCE_NVME] == "2"


def test_room_now_counts_namespaces_from_the_inventory_and_what_memstrata_pods_claim() -> None:
    job, plan = placed()
    node = node_view(node_dict("n1", inventory("n1", dram_gib=512, cxl_gib=16)), claims.CLAIMED_RESOURCES)
    assert node.allocatable[RESOURCE_NVME] == 2 and node.allocatable[RESOURCE_CXL_GIB] == 16
    _, (pod,) = gang_objects(job, ("n1",), plan, 1, security=DRA)
    pod["spec"]["nodeName"] = "n1"
    use = pod_use(pod)
    assert use is not None and use.requests[RESOURCE_NVME] == 2
    # With both namespaces claimed the next job waits for room (the scheduler would keep its pod Pending).
    second = place(job.spec, [node], usage_by_node([use]))
    assert second.outcome == "no-room" and "memstrata.dev/nvme-ns needs 2, 0 free" in second.message
    # The annotation counts only on pods a FineTuneJob owns: a label and an annotation anyone can write.
    foreign = {**pod, "metadata": {**pod["metadata"], "ownerReferences": []}}
    assert pod_use(foreign).requests[RESOURCE_NVME] == 0


@pytest.mark.parametrize("text", ["not json", '["a"]', '{"memstrata.dev/nvme-ns": -1}', '{"cpu": 4}'])
def test_an_unreadable_claim_annotation_counts_nothing(text: str) -> None:
    job, plan = placed()
    _, (pod,) = gang_objects(job, ("n1",), plan, 1, security=DRA)
    pod["spec"]["nodeName"] = "n1"
    pod["metadata"]["annotations"][claims.ANNOTATION_REQUESTS] = text
    assert sum(pod_use(pod).requests.get(r, 0) for r in claims.CLAIMED_RESOURCES) == 0


def test_the_jobs_status_says_which_devices_its_pods_claim_was_allocated() -> None:
    from ftj_factories import at, pod_dict

    from memstrata.api.jobstatus import FineTuneJobStatus
    from memstrata.operator.actions import PatchStatus
    from memstrata.operator.lifecycle import LifecyclePolicy, decide
    from memstrata.operator.observe import allocated_devices, claim_names, pod_view

    body = job_dict("llama", status={"phase": "Scheduled", "activePod": "llama-0", "attempts": 1, "node": "n1"})
    body["metadata"]["finalizers"] = ["memstrata.dev/cleanup"]
    pod = pod_dict("llama-0", 0, "Running", node="n1")
    pod["status"]["resourceClaimStatuses"] = [{"name": claims.CLAIM, "resourceClaimName": "llama-0-devices-x7k"}]
    claim = {"status": {"allocation": {"devices": {"results": [
        {"request": "namespaces/spread", "driver": dra.DRIVER, "pool": "n1", "device": "nvme0n1-3f9a2c1b"},
        {"request": "namespaces/spread", "driver": dra.DRIVER, "pool": "n1", "device": "nvme1n1-0b1c2d3e"}]}}}}
    assert claim_names(pod) == ["llama-0-devices-x7k"]
    devices = allocated_devices(claim)
    d = decide(job_view(body), [pod_view(pod, devices)], at(1), lambda spec: None, LifecyclePolicy())
    (patch,) = [a.patch for a in d.actions if isinstance(a, PatchStatus)]
    assert patch["devices"] == ["n1/nvme0n1-3f9a2c1b", "n1/nvme1n1-0b1c2d3e"]
    FineTuneJobStatus.model_validate({**body["status"], **patch})
    assert allocated_devices({"status": {}}) == ()  # not allocated yet: nothing to say


def test_a_container_without_the_namespaces_its_claim_holds_is_refused_naming_cdi() -> None:
    job, plan = placed()
    _, (pod,) = gang_objects(job, ("n1",), plan, 1, security=DRA)
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env[dra.ENV_CLAIMED_NAMESPACES] == "2"
    why = dra.namespaces_missing(env[dra.ENV_CLAIMED_NAMESPACES], 0)
    assert why is not None and "2 NVMe namespace(s)" in why and "CDI" in why and "containerd >= 2.0" in why
    assert dra.namespaces_missing("2", 2) is None
    assert dra.namespaces_missing(None, 0) is None  # the device plugin's pods, and a local `memstrata pod`

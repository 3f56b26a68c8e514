"""The DRA driver's pure parts and its gRPC service, as the kubelet calls it over its Unix sockets: what the
ResourceSlice shows of a discovered node, what a prepared claim's CDI spec gives a container, and every
prepare the driver must refuse. The real kubelet, scheduler and containerd: e2e/realnode/test_realnode_dra.py;
the real API server and scheduler over a discovered CXL node: e2e/cluster/test_dra_allocation.py."""
from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from memstrata.api import dra
from memstrata.api.inventory import ENV_NVME_DEVICES, NodeInventory, NvmeNamespace
from memstrata.nodeagent import cdi
from memstrata.nodeagent.draplugin import DraPlugin
from memstrata.nodeagent.draslice import DraDevice, offered, slice_spec
from memstrata.nodeagent.proto import dra_pb2 as pb
from memstrata.nodeagent.proto import dra_pb2_grpc as pb_grpc
from memstrata.nodeagent.proto import pluginregistration_pb2 as reg_pb
from memstrata.nodeagent.proto import pluginregistration_pb2_grpc as reg_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from helm_helpers import CHART, KUBE, run_helm  # noqa: E402
from sysfs_cases import inventory_of  # noqa: E402

TREE = Path(__file__).resolve().parents[1] / "data" / "sysfs" / "two-socket-cxl"
NODE = "n1"
LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def two_socket() -> NodeInventory:
    return inventory_of(TREE, hostname=NODE)


def test_the_slice_shows_each_free_namespace_and_cxl_node_with_what_the_scheduler_selects_by() -> None:
    inv = two_socket()
    spec = slice_spec(inv, NODE, 3)
    assert spec["driver"] == dra.DRIVER and spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    devices = {d["name"]: d for d in spec["devices"]}
    assert all(LABEL.match(n) for n in devices), list(devices)
    nvme = {d["attributes"]["namespace"]["string"]: d for d in devices.values()
            if d["attributes"]["kind"] == {"string": dra.KIND_NVME}}
    assert set(nvme) == {ns.name for ns in inv.free_namespaces}  # mounted, swapped, ext4, partitioned: not there
    for ns in inv.free_namespaces:
        d, ctrl = nvme[ns.name], next(c for c in inv.nvme_controllers if c.name == ns.controller)
        assert d["capacity"] == {dra.SIZE: {"value": str(ns.size_bytes)}}
        assert d["attributes"]["numaNode"] == {"int": ns.numa_node} and d["attributes"]["controller"] == {"string": ctrl.name}
        assert d["attributes"]["model"] == {"string": ctrl.model}
        assert d["attributes"]["blockSize"] == {"int": ns.logical_block_size} and d["attributes"]["loop"] == {"bool": False}
    cxl = {d["attributes"]["numaNode"]["int"]: d for d in devices.values() if d["attributes"]["kind"] == {"string": "cxl"}}
    assert set(cxl) == {c.numa_node for c in inv.cxl_nodes}
    for node in inv.cxl_nodes:
        d = cxl[node.numa_node]
        assert d["allowMultipleAllocations"] is True
        assert d["capacity"][dra.MEMORY]["value"] == str(node.memory_bytes)
        assert d["attributes"]["expanders"] == {"string": ",".join(m.name for m in node.memdevs)}
    assert len(cxl[2]["attributes"]["expanders"]["string"].split(",")) == 2  # the interleaved pair


def test_a_namespace_being_scrubbed_or_in_use_is_neither_in_the_slice_nor_preparable() -> None:
    inv = two_socket()
    gone = inv.free_namespaces[0].name
    names = {d["attributes"].get("namespace", {}).get("string") for d in slice_spec(inv, NODE, 1, {gone})["devices"]}
    assert gone not in names
    assert gone not in {d.namespace for d in offered(inv, {gone})}


def test_a_device_name_follows_the_namespaces_wwid_not_its_kernel_name() -> None:
    a = dra.namespace_device_name("nvme0n1", "eui.0025388b71b0c1a2")
    assert LABEL.match(a) and a.startswith("nvme0n1-")
    # The same namespace renamed by a reboot is a new device; another namespace under the old name too.
    assert dra.namespace_device_name("nvme1n1", "eui.0025388b71b0c1a2") != a
    assert dra.namespace_device_name("nvme0n1", "eui.ffff") != a
    assert dra.namespace_device_name("loop3", None) == "loop3"
    with pytest.raises(ValueError, match="nothing a device name can keep"):
        dra.dns_label("___")


def test_the_cdi_spec_gives_each_device_node_to_the_device_group_and_the_claims_whole_list() -> None:
    chosen = [DraDevice("loop3", dra.KIND_NVME, "loop3", "/dev/loop3"), DraDevice("loop4", dra.KIND_NVME, "loop4", "/dev/loop4"),
              DraDevice("cxl-node2", dra.KIND_CXL, cxl_node=2)]
    spec = cdi.spec("uid-1", chosen, device_gid=6)
    assert spec["kind"] == cdi.CDI_KIND and [d["name"] for d in spec["devices"]] == ["uid-1-loop3", "uid-1-loop4",
                                                                                       "uid-1-cxl-node2"]
    for d in spec["devices"]:
        assert d["containerEdits"]["env"] == [f"{ENV_NVME_DEVICES}=/dev/loop3,/dev/loop4", "MEMSTRATA_CXL_NODES=2"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/loop3", "permissions": "rw", "gid": 6, "fileMode": 0o660}]
    assert "deviceNodes" not in spec["devices"][2]["containerEdits"]
    assert cdi.device_id("uid-1", "loop3") == "dra.memstrata.dev/claim=uid-1-loop3"
    # A shared CXL node allocated to two requests of one claim is one CDI device (duplicates void the spec).
    twice = cdi.spec("uid-1", [chosen[2], chosen[2]])
    assert [d["name"] for d in twice["devices"]] == ["uid-1-cxl-node2"]


# --- the gRPC service ---------------------------------------------------------------------------

def allocated_claim(uid: str, *devices: str, pool: str = NODE, request: str = "ns") -> dict[str, Any]:
    return {"metadata": {"namespace": "team", "name": "c", "uid": uid},
            "status": {"allocation": {"devices": {"results": [
                {"request": request, "driver": dra.DRIVER, "pool": pool, "device": d} for d in devices]}}}}


class Claims(dict):
    """ResourceClaims by name, as the API server would return them."""

    def read(self, namespace: str, name: str) -> dict[str, Any]:
        return self[name]


@pytest.fixture
def plugin() -> Iterator[tuple[DraPlugin, Claims, list[str]]]:
    claims, unprepared, refused = Claims(), [], {"loop9": "a job left it OPEN without scrubbing it"}
    root = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))  # a Unix socket's path: at most 107 bytes
    p = DraPlugin(NODE, claims.read, kubelet_dir=root / "kubelet", cdi_dir=root / "cdi", device_gid=6,
                  vet=lambda d: refused.get(d.namespace), on_unprepare=unprepared.append)
    p.start()
    p.offer([DraDevice(n, dra.KIND_NVME, n, f"/dev/{n}") for n in ("loop3", "loop4", "loop9")])
    try:
        yield p, claims, unprepared
    finally:
        p.stop()
        shutil.rmtree(root)


def call(p: DraPlugin, method: str, *uids: str) -> Any:
    request = getattr(pb, f"{method}Request")(claims=[pb.Claim(namespace="team", name="c", uid=u) for u in uids])
    with grpc.insecure_channel(f"unix:{p.endpoint}") as channel:
        return getattr(pb_grpc.DRAPluginStub(channel), method)(request, timeout=10)


def test_the_kubelet_learns_the_driver_and_its_v1_service_from_the_registration_socket(plugin) -> None:
    p, _, _ = plugin
    assert p.registration.parent.name == "plugins_registry"
    with grpc.insecure_channel(f"unix:{p.registration}") as channel:
        info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=10)
        assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
            "DRAPlugin", dra.DRIVER, str(p.endpoint), ["v1.DRAPlugin"])
        reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            reg_pb.RegistrationStatus(plugin_registered=False, error="no"), timeout=10)
    assert p.registration_error == "no" and not p.registered.is_set()


def test_prepare_writes_the_claims_cdi_spec_and_unprepare_removes_it_and_asks_for_the_scrub(plugin) -> None:
    p, claims, unprepared = plugin
    claims["c"] = allocated_claim("u1", "loop3", "loop4")
    got = call(p, "NodePrepareResources", "u1").claims["u1"]
    assert got.error == ""
    assert [(d.device_name, d.pool_name, list(d.request_names), list(d.cdi_device_ids)) for d in got.devices] == [
        ("loop3", NODE, ["ns"], ["dra.memstrata.dev/claim=u1-loop3"]),
        ("loop4", NODE, ["ns"], ["dra.memstrata.dev/claim=u1-loop4"])]
    written = json.loads(cdi.spec_path(p.cdi_dir, "u1").read_text())
    assert written == cdi.spec("u1", [DraDevice(n, dra.KIND_NVME, n, f"/dev/{n}") for n in ("loop3", "loop4")], 6)
    # A prioritized list's subrequest is answered under its request's name: the one a container names.
    claims["c"] = allocated_claim("u3", "loop3", request="namespaces/numa")
    claims["c"]["metadata"]["uid"] = "u3"
    assert [list(d.request_names) for d in call(p, "NodePrepareResources", "u3").claims["u3"].devices] == [["namespaces"]]
    call(p, "NodeUnprepareResources", "u3")
    claims["c"] = allocated_claim("u1", "loop3", "loop4")
    # Asked again once the namespaces are in use (out of the offered list): answered from the spec on disk.
    p.offer([])
    assert call(p, "NodePrepareResources", "u1").claims["u1"].error == ""
    call(p, "NodeUnprepareResources", "u1")
    # Every namespace the claim had is marked for its scrub (its pod may have written anything), then the spec goes.
    assert not cdi.spec_path(p.cdi_dir, "u1").exists() and unprepared == [["loop3"], ["loop3", "loop4"]]
    assert call(p, "NodeUnprepareResources", "u1").claims["u1"].error == ""  # repeated: still fine, nothing to mark
    assert unprepared[-1] == []


@pytest.mark.parametrize("claim,why", [
    ({"metadata": {"namespace": "team", "name": "c", "uid": "u1"}, "status": {}}, "is not allocated"),
    (allocated_claim("u1", "loop3", pool="other-node"), "pool(s) ['other-node'], not of this node"),
    (allocated_claim("u1", "loop5"), "devices ['loop5'] are not available on this node now"),
    (allocated_claim("u1", "loop9"), "loop9: a job left it OPEN without scrubbing it"),
    (allocated_claim("u2", "loop3"), "UID u1 is gone"),
])
def test_prepare_refuses_what_this_node_cannot_honour_naming_the_claim(plugin, claim, why) -> None:
    p, claims, _ = plugin
    claims["c"] = claim
    got = call(p, "NodePrepareResources", "u1").claims["u1"]
    assert "ResourceClaim team/c" in got.error and why in got.error, got.error
    assert not got.devices and cdi.prepared_devices(p.cdi_dir, "u1") == []


def test_the_chart_ships_the_device_classes_the_driver_publishes_for(tmp_path: Path) -> None:
    proc = run_helm("template", "x", str(CHART), *KUBE, "--set", "nodeAgent.deviceApi=dra", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    shipped = [{k: d[k] for k in ("apiVersion", "kind", "spec")} | {"metadata": {"name": d["metadata"]["name"]}}
               for d in docs if d["kind"] == "DeviceClass"]
    assert shipped == dra.device_classes()
    agent = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert "--device-api=dra" in agent["containers"][0]["args"]
    mounts = {m["mountPath"] for m in agent["containers"][0]["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} <= mounts
    # auto: dra on >= 1.36 serving resource.k8s.io/v1 (helm's offline capabilities do), else the plugin.
    auto = run_helm("template", "x", str(CHART), *KUBE, tmp=tmp_path)
    assert auto.stdout.count("kind: DeviceClass") == 2 and auto.stdout.count("--device-api=dra") == 2
    older = run_helm("template", "x", str(CHART), "--kube-version", "v1.35.2", tmp=tmp_path)  # no consumable capacity
    assert "DeviceClass" not in older.stdout and older.stdout.count("--device-api=device-plugin") == 2
    plugin = run_helm("template", "x", str(CHART), *KUBE, "--set", "nodeAgent.deviceApi=device-plugin", tmp=tmp_path)
    assert "DeviceClass" not in plugin.stdout and plugin.stdout.count("--device-api=device-plugin") == 2
    assert "resourceslices" not in plugin.stdout and "resourceclaimtemplates" not in plugin.stdout


def test_a_loop_namespace_says_so_and_has_no_numa_node() -> None:
    inv = NodeInventory(nvme_namespaces=[NvmeNamespace(name="loop3", kind="loop", size_bytes=2 << 30, free=True)])
    (d,) = slice_spec(inv, NODE, 1)["devices"]
    assert d["name"] == "loop3" and d["attributes"]["loop"] == {"bool": True} and "numaNode" not in d["attributes"]

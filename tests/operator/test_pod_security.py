"""What the training pod needs to use its devices on a real node, and that it still meets PodSecurity
`restricted`: the node's disk group, a seccomp profile `restricted` admits, and no capability at all."""
from __future__ import annotations

from typing import Any

import pytest
from ftj_factories import inventory, job_dict, node_dict

from memstrata.operator.nodes import node_view
from memstrata.operator.observe import job_view
from memstrata.api.podidentity import DISK_GID, RUNTIME_UID
from memstrata.operator.render import PodSecurity, gang_objects, seccomp_profile
from memstrata.operator.scheduling import place

JOB = job_view(job_dict("llama"))
NODE = node_view(node_dict("nvme-1", inventory("nvme-1", dram_gib=64, nvme=2)))
PLACED = place(JOB.spec, [NODE], {})


def _pod(security: PodSecurity | None = None) -> dict[str, Any]:
    assert PLACED.plan is not None
    if security is None:
        return gang_objects(JOB, ("nvme-1",), PLACED.plan, 0)[1][0]
    return gang_objects(JOB, ("nvme-1",), PLACED.plan, 0, security=security)[1][0]


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The checks of PodSecurity `restricted` (v1.25+) that a pod like this one could fail."""
    spec, out = pod["spec"], []
    pod_sc = spec.get("securityContext", {})
    for c in spec["containers"]:
        sc = {**pod_sc, **c.get("securityContext", {})}
        if sc.get("privileged"):
            out.append("privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append("allowPrivilegeEscalation")
        if sc.get("runAsNonRoot") is not True or sc.get("runAsUser") == 0:
            out.append("runAsNonRoot")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append("capabilities")
        if sc.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            out.append("seccompProfile")
    if any(k in spec for k in ("hostNetwork", "hostPID", "hostIPC")) or any("hostPath" in v for v in spec["volumes"]):
        out.append("host namespaces or paths")
    return out


def test_the_pod_gets_the_nodes_disk_group_and_no_capability_and_runtime_default_seccomp() -> None:
    pod = _pod()
    assert PLACED.plan is not None and PLACED.plan.requests.get("memstrata.dev/nvme-ns")  # it is handed namespaces
    sc = pod["spec"]["securityContext"]
    # The namespaces appear in the container as the node's root:disk 0660 device nodes.
    assert (sc["runAsUser"], sc["runAsGroup"], sc["supplementalGroups"]) == (RUNTIME_UID, RUNTIME_UID, [DISK_GID])
    assert DISK_GID == 6
    assert restricted_violations(pod) == []
    (container,) = pod["spec"]["containers"]
    # IPC_LOCK would fail `restricted` and `baseline`, and never reaches a non-root process: the runtime works
    # within RLIMIT_MEMLOCK instead (tests/native/test_io_fallback.py runs that pod's process for real).
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["seccompProfile"] == pod["spec"]["securityContext"]["seccompProfile"] \
        == {"type": "RuntimeDefault"}


def test_a_localhost_profile_and_another_device_group_are_rendered_as_configured() -> None:
    pod = _pod(PodSecurity(device_gid=995, seccomp_profile="localhost/memstrata/io-uring.json"))
    sc = pod["spec"]["securityContext"]
    assert sc["supplementalGroups"] == [995]
    want = {"type": "Localhost", "localhostProfile": "memstrata/io-uring.json"}
    assert sc["seccompProfile"] == pod["spec"]["containers"][0]["securityContext"]["seccompProfile"] == want
    assert restricted_violations(pod) == []
    # Nodes whose containerd sets device_ownership_from_security_context need no group.
    assert "supplementalGroups" not in _pod(PodSecurity(device_gid=None))["spec"]["securityContext"]


@pytest.mark.parametrize("value", ["Unconfined", "localhost/", "localhost//etc/x.json", "localhost/../x.json",
                                   "localhost/a/./b.json", "runtime/default", "Localhost/x.json"])
def test_a_profile_restricted_would_refuse_or_the_kubelet_could_not_find_is_named(value: str) -> None:
    with pytest.raises(ValueError, match=rf"seccomp profile {value!r}: expected RuntimeDefault or localhost/"):
        PodSecurity(seccomp_profile=value)
    with pytest.raises(ValueError):
        seccomp_profile(value)


@pytest.mark.parametrize("gid", [0, -1, 1 << 31])
def test_a_device_group_that_is_root_or_out_of_range_is_named(gid: int) -> None:
    with pytest.raises(ValueError, match=rf"device group {gid}: expected a group id from 1 to 2147483647"):
        PodSecurity(device_gid=gid)

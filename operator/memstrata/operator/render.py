"""The Kubernetes objects of one job attempt. Pure: (job, node, plan, attempt) in, manifests out.

Every object is owned by the FineTuneJob (so the garbage collector removes what
the finalizer might miss) and labelled with the job's UID (so cleanup and the
reconciler find exactly the job's children). The pod meets PodSecurity
`restricted`: devices arrive through the device plugin, never `privileged`.
Its memory request and limit are the plan's DRAM and CXL bytes for the pod (`memory_bytes`),
so the kubelet enforces the DRAM budget the planner assumed.

What the pod needs to use its devices on a real node, and nothing more (`PodSecurity`; the chart's
README says why): the node's `disk` group as a supplemental group, because the device plugin's
namespaces appear in the container as the host's root:disk 0660 nodes and the runtime runs as
uid 1000 (only on a pod that is handed namespaces: the group opens every disk the container sees);
RuntimeDefault seccomp, under which the runtime's NVMe engine falls back from io_uring to pread/pwrite
threads (or a Localhost profile the cluster admin installed that allows io_uring); and
no capability: CAP_IPC_LOCK would break `restricted` (and `baseline`) and never reaches a non-root
process anyway, so the swap layer works within the runtime's RLIMIT_MEMLOCK, unlocked past it.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from memstrata.api import dra, strata
from memstrata.api.architecture import ModelArchitecture
from memstrata.api.finetunejob import API_VERSION, KIND, PLURAL, FineTuneJobSpec
from memstrata.api.podidentity import DISK_GID, RUNTIME_UID, checked_device_gid
from memstrata.api.inventory import LABEL_CXL, LABEL_MANAGED, RESOURCE_GPU, RESOURCE_MEMORY, RESOURCE_NVME
from memstrata.api.runtimeconfig import (
    CONFIGMAP_KEY, ENV_MASTER_ADDR, ENV_MASTER_PORT, ENV_NNODES, ENV_NODE_NAME, ENV_NODE_RANK, ENV_POD_NAME,
    ENV_RUNTIME_CONFIG, RENDEZVOUS_PORT, JobRef, RuntimeConfig,
)
from memstrata.operator import claims, names
from memstrata.operator.observe import JobView
from memstrata.api.strataplan import Plan
from memstrata.plan.accounting import RUNTIME_PROCESS_BYTES

MiB = 1 << 20


@dataclass(frozen=True)
class PodSecurity:
    """The node-specific part of the training pod: its security context, and how it gets its devices (the
    operator's flags set it).

    `device_gid`: the group that owns the NVMe namespaces' device nodes on the nodes (None: add no
    group, for nodes whose containerd sets `device_ownership_from_security_context`, which hands the
    devices to the pod's runAsUser/runAsGroup instead). `seccomp_profile`: `RuntimeDefault`, or
    `localhost/<file>` for a profile under the kubelet's seccomp directory (a profile that allows
    io_uring gives the NVMe engine its fast path back; without it the engine uses its thread path)."""

    device_gid: int | None = DISK_GID
    seccomp_profile: str = "RuntimeDefault"
    # --device-api dra: namespaces and CXL bytes come through a ResourceClaim (memstrata.operator.claims), not as
    # extended resources; `gpu_device_class`: GPUs too, from that DeviceClass (clusters publishing GPUs via DRA).
    dra: bool = False
    gpu_device_class: str | None = None

    def __post_init__(self) -> None:
        if self.device_gid is not None:
            checked_device_gid(self.device_gid)
        seccomp_profile(self.seccomp_profile)


def seccomp_profile(value: str) -> dict[str, str]:
    """The securityContext.seccompProfile for `RuntimeDefault` or `localhost/<file>`; ValueError naming
    the value otherwise. PodSecurity `restricted` admits exactly these two types."""
    if value == "RuntimeDefault":
        return {"type": "RuntimeDefault"}
    prefix = "localhost/"
    path = value[len(prefix):] if value.startswith(prefix) else ""
    if not path or posixpath.isabs(path) or ".." in path.split("/") or posixpath.normpath(path) != path:
        raise ValueError(f"seccomp profile {value!r}: expected RuntimeDefault or localhost/<file relative to the "
                         "kubelet's seccomp directory> (Unconfined is refused: PodSecurity restricted forbids it)")
    return {"type": "Localhost", "localhostProfile": path}


def memory_bytes(plan: Plan, ranks: int) -> int:
    """The training container's memory request (and limit), in whole MiB.

    = every byte the plan puts in DRAM on this node — offloaded state, page-locked
      buffers, gradients, checkpoints, and the working set when training on the CPU —
    + every byte it puts on CXL: a CXL expander is a CPU-less NUMA node of ordinary memory,
      and the memory cgroup charges its pages like any other
    + RUNTIME_PROCESS_BYTES for each of the pod's rank processes (spec.resources.ranks(): one per GPU, or
      ranksPerNode gloo processes on a CPU)."""
    host = sum(plan.bytes_on(s.name) for s in strata.registry() if s.host_memory)  # DRAM and CXL
    total = host + RUNTIME_PROCESS_BYTES * max(ranks, 1)
    return -(-total // MiB) * MiB


# Every training pod's: GPU nodes are commonly tainted so that only GPU pods land there (a Kueue Workload states it too).
TOLERATIONS = ({"key": RESOURCE_GPU, "operator": "Exists", "effect": "NoSchedule"},)


def container_requests(spec: FineTuneJobSpec, plan: Plan) -> dict[str, int]:
    """What the training container requests (and is limited to): the plan's extended resources and
    `memory_bytes`. The operator's placement fits exactly this to a node's allocatable."""
    return {**{r: n for r, n in plan.requests.items() if n},
            RESOURCE_MEMORY: memory_bytes(plan, spec.resources.ranks())}


def owner_reference(job: JobView) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job.name, "uid": job.uid,
            "controller": True, "blockOwnerDeletion": True}


def child_meta(job: JobView, name: str, extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": {**(extra_labels or {}), **names.child_labels(job.name, job.uid)},
        "ownerReferences": [owner_reference(job)],
    }


def runtime_config(job: JobView, node: str, plan: Plan, attempt: int, report_interval_seconds: float = 10.0,
                   architecture: ModelArchitecture | None = None) -> RuntimeConfig:
    """`architecture`: the shape the operator read from the model directory, for a spec that states none;
    the runtime then checks the directory against it as against a stated one."""
    spec = job.spec
    assert spec is not None  # the lifecycle never places a job whose spec it cannot read
    if architecture is not None and spec.model.known_shape() is None:
        spec = spec.with_architecture(architecture)
    return RuntimeConfig(
        job=JobRef(name=job.name, namespace=job.namespace, uid=job.uid), spec=spec, plan=plan, node=node,
        attempt=attempt,
        # Every attempt gets the same checkpoint spec: the runtime itself resumes from the latest complete
        # checkpoint under spec.checkpoint.path, so a retry needs nothing else from the operator.
        checkpoint_step=_checkpoint_step(job) if spec.checkpoint is not None else None,
        report_interval_seconds=report_interval_seconds,
    )


def _checkpoint_step(job: JobView) -> int | None:
    step = (job.status.get("checkpoint") or {}).get("step") if isinstance(job.status, Mapping) else None
    return step if isinstance(step, int) and step >= 1 else None


def user_volumes(spec: FineTuneJobSpec) -> list[dict[str, Any]]:
    """spec.volumes as the pod takes them, first in its list: the API server's error about pod field
    spec.volumes[i] is then about the job's spec.volumes[i]."""
    return [v.model_dump(mode="json", by_alias=True, exclude_none=True) for v in spec.volumes]


def user_mounts(spec: FineTuneJobSpec, read_only: bool = False) -> list[dict[str, Any]]:
    """spec.volumeMounts for a container, first in its list (so their indices are the job's too);
    `read_only` forces every one read-only (the inspection pod only reads)."""
    return [{**m.wire(), **({"readOnly": True} if read_only else {})} for m in spec.volume_mounts]


def pod_security_context(security: PodSecurity, device_group: bool = True) -> dict[str, Any]:
    """The pod-level securityContext of memstrata's pods (PodSecurity `restricted`, uid 1000)."""
    return {
        "runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID, "fsGroup": RUNTIME_UID,
        # uid 1000 may open the granted namespaces (root:disk 0660 on the node) only through their group.
        **({"supplementalGroups": [security.device_gid]} if device_group and security.device_gid is not None
           else {}),
        "seccompProfile": seccomp_profile(security.seccomp_profile),
    }


def container_security_context(security: PodSecurity) -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        # Nothing added back: IPC_LOCK is what a bigger locked pool would need, but `restricted` and
        # `baseline` refuse it and a non-root process never holds it (no ambient capabilities).
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": seccomp_profile(security.seccomp_profile),
    }


def configmap(job: JobView, config: RuntimeConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": child_meta(job, names.configmap_name(job.name, job.uid)),
        "data": {CONFIGMAP_KEY: json.dumps(config.wire(), indent=1, sort_keys=True)},
    }


def service_account(job: JobView) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": child_meta(job, names.runtime_account_name(job.name, job.uid))}


def role(job: JobView) -> dict[str, Any]:
    """May read its own job and patch its own job's status — nothing else, no other job."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": child_meta(job, names.runtime_account_name(job.name, job.uid)),
        "rules": [
            {"apiGroups": [API_VERSION.split("/")[0]], "resources": [f"{PLURAL}/status"],
             "resourceNames": [job.name], "verbs": ["get", "patch"]},
            {"apiGroups": [API_VERSION.split("/")[0]], "resources": [PLURAL],
             "resourceNames": [job.name], "verbs": ["get"]},
        ],
    }


def role_binding(job: JobView) -> dict[str, Any]:
    name = names.runtime_account_name(job.name, job.uid)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": child_meta(job, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
    }


def service(job: JobView, attempt: int) -> dict[str, Any]:
    """The headless Service of a multi-node job: it makes `<hostname>.<service>` resolve to each pod of the
    current attempt (its selector names the attempt, so a pod of an old attempt still terminating under the
    same hostname is never the one MASTER_ADDR finds). Not-ready pods are published: the rendezvous runs
    before any pod could be Ready."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": child_meta(job, names.service_name(job.name, job.uid)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {names.LABEL_JOB_UID: job.uid, names.LABEL_ATTEMPT: str(attempt)},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT,
                       "protocol": "TCP"}],
        },
    }


def master_addr(job: JobView) -> str:
    """Node rank 0's stable DNS name (in the job's namespace): the c10d rendezvous endpoint's host."""
    return f"{names.pod_hostname(job.name, 0)}.{names.service_name(job.name, job.uid)}"


def _gang_env(job: JobView, node_rank: int, nodes: int) -> list[dict[str, Any]]:
    return [{"name": ENV_MASTER_ADDR, "value": master_addr(job)},
            {"name": ENV_MASTER_PORT, "value": str(RENDEZVOUS_PORT)},
            {"name": ENV_NODE_RANK, "value": str(node_rank)},
            {"name": ENV_NNODES, "value": str(nodes)},
            {"name": ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]


def _container(job: JobView, plan: Plan, security: PodSecurity, node_rank: int) -> dict[str, Any]:
    """The training container of node rank `node_rank`'s pod."""
    spec = job.spec
    assert spec is not None
    nodes = spec.resources.nodes
    claimed = claims.claimed_resources(security.gpu_device_class) if security.dra else ()
    amounts = {r: f"{n // MiB}Mi" if r == RESOURCE_MEMORY else str(n)
               for r, n in sorted(container_requests(spec, plan).items()) if r not in claimed}
    container: dict[str, Any] = {
        "name": names.CONTAINER,
        "image": spec.image,
        # Only what the runtime reads (the job, attempt and node are in the runtime config);
        # the device plugin adds the namespaces and CXL nodes it grants.
        "env": [{"name": ENV_RUNTIME_CONFIG, "value": f"{names.CONFIG_MOUNT}/{CONFIGMAP_KEY}"},
                *(_gang_env(job, node_rank, nodes) if nodes > 1 else [])],
        # Extended resources cannot be overcommitted: requests must equal limits. Memory too, by choice:
        # the scheduler reserves the request, so a limit above it would let this job take DRAM the planner
        # counted as another job's or the node's, and the node, not this pod, would pay (eviction of a
        # neighbour). At the limit the kernel OOM-kills this container and its status says OOMKilled:
        # a plan that undercounts fails loudly, on its own job.
        "resources": {"requests": amounts, "limits": dict(amounts)},
        "volumeMounts": [*user_mounts(spec),
                         {"name": names.CONFIG_VOLUME, "mountPath": names.CONFIG_MOUNT, "readOnly": True}],
        "securityContext": container_security_context(security),
        # The runtime writes why it failed to /dev/termination-log. Not the log's tail when it could not: that is
        # the container's raw output, and the job's status, where the message goes, is readable by whoever may
        # read the job (the operator bounds and sanitises even the message: observe.container_text).
        "terminationMessagePolicy": "File",
    }
    if security.dra and claims.device_requests(plan, security.gpu_device_class)["requests"]:  # as the template
        container["resources"]["claims"] = [{"name": claims.CLAIM}]
        if namespaces := plan.requests.get(RESOURCE_NVME, 0):  # the runtime checks that CDI gave them all
            container["env"].append({"name": dra.ENV_CLAIMED_NAMESPACES, "value": str(namespaces)})
    if spec.command:
        container["command"] = list(spec.command)
    return container


def pod(job: JobView, node: str, plan: Plan, attempt: int,
        security: PodSecurity = PodSecurity(), node_rank: int = 0) -> dict[str, Any]:
    """The pod of node rank `node_rank` (of spec.resources.nodes) for this attempt, pinned to `node`."""
    spec = job.spec
    assert spec is not None
    nodes = spec.resources.nodes
    labels = {**names.user_labels(dict(job.labels)), names.LABEL_ATTEMPT: str(attempt)}
    if nodes > 1:
        labels[names.LABEL_NODE_RANK] = str(node_rank)
    node_terms = [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]},
        {"key": LABEL_MANAGED, "operator": "In", "values": ["true"]},
    ]
    if plan.cxl_nodes:
        node_terms.append({"key": LABEL_CXL, "operator": "In", "values": ["true"]})
    container = _container(job, plan, security, node_rank)
    # A stable DNS name through the job's headless Service, the same in every attempt (MASTER_ADDR).
    dns = ({"hostname": names.pod_hostname(job.name, node_rank), "subdomain": names.service_name(job.name, job.uid)}
           if nodes > 1 else {})
    claimed: dict[str, Any] = {}
    annotations = {f"{names.LABEL_JOB_NAME}": job.name, "memstrata.dev/planned-node": node}
    if "claims" in container["resources"]:
        entry, noted = claims.pod_parts(names.claim_template_name(job.name, job.uid, attempt), plan,
                                        security.gpu_device_class)
        claimed, annotations = {"resourceClaims": [entry]}, {**annotations, **noted}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            **child_meta(job, names.pod_name(job.name, attempt, node_rank, nodes), labels),
            "annotations": annotations,
        },
        "spec": {
            "restartPolicy": "Never",  # a retry is a new pod, counted against backoffLimit
            **dns,
            "serviceAccountName": names.runtime_account_name(job.name, job.uid),
            "enableServiceLinks": False,
            "securityContext": pod_security_context(security, device_group=bool(plan.requests.get(RESOURCE_NVME))),
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": node_terms}]}}},
            "tolerations": list(TOLERATIONS),
            "containers": [container],
            **claimed,
            "volumes": [*user_volumes(spec), {"name": names.CONFIG_VOLUME, "configMap": {
                "name": names.configmap_name(job.name, job.uid),
                "items": [{"key": CONFIGMAP_KEY, "path": CONFIGMAP_KEY}]}}],
        },
    }


def gang_objects(job: JobView, nodes: Sequence[str], plan: Plan, attempt: int, report_interval_seconds: float = 10.0,
                 security: PodSecurity = PodSecurity(), architecture: ModelArchitecture | None = None,
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the pods' companions, ServiceAccount first; one pod per node, by node rank). Admission rejects a pod
    whose ServiceAccount does not exist yet; the others may come alongside it. A multi-node job's companions
    include its headless Service. One ConfigMap serves every pod (its `node` is node rank 0's); only the
    pods' env tells them apart. Every node runs the same plan (scheduling.place chooses nodes alike)."""
    config = runtime_config(job, nodes[0], plan, attempt, report_interval_seconds, architecture)
    companions = [service_account(job), role(job), role_binding(job), configmap(job, config)]
    assert job.spec is not None and len(nodes) == job.spec.resources.nodes, "one node per node rank"
    if len(nodes) > 1:
        companions.append(service(job, attempt))
    if security.dra and (tmpl := claims.template(child_meta(job, names.claim_template_name(job.name, job.uid, attempt)),
                                                 plan, security.gpu_device_class)):
        companions.append(tmpl)
    return companions, [pod(job, node, plan, attempt, security, rank) for rank, node in enumerate(nodes)]

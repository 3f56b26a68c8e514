"""Learning a model's shape from its directory: the inspection pod, and what its end means. Pure.

A job with `spec.model.path` and no `spec.model.architecture` cannot be planned until someone reads the
directory's config.json, and only a pod that mounts the job's volumes can. Before any attempt, the operator
runs one short pod, `memstrata inspect-model <path>` in the job's own image with the job's volumes mounted
read-only; the command prints the shape and writes it to /dev/termination-log, so the kubelet hands it
back in the pod's status (`state.terminated.message`, at most 4 KiB — a shape is about 200 bytes) and the
operator needs no access to the volume, the pod's logs or any other API. The operator stores the shape in
`status.modelArchitecture`, deletes the pod and plans with it; a pod that fails fails the job with the
command's own message (it names the file and the problem).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from pydantic import ValidationError

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.validation import describe_validation_error
from memstrata.operator import names
from memstrata.operator.observe import JobView, PodView
from memstrata.operator.render import (
    PodSecurity, child_meta, container_security_context, pod_security_context, user_mounts, user_volumes,
)

# Reading one small JSON file: the requests keep it schedulable anywhere, the limit keeps a broken image
# from taking a node's memory. The deadline ends a pod whose container never finishes (a hung volume).
REQUESTS = {"cpu": "100m", "memory": "128Mi"}
LIMITS = {"memory": "512Mi"}
DEADLINE_SECONDS = 600
TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

Outcome = Literal["none", "running", "succeeded", "failed"]


def inspect_command(model_path: str) -> list[str]:
    return ["memstrata", "inspect-model", model_path]


def pod(job: JobView, security: PodSecurity = PodSecurity()) -> dict[str, Any]:
    """The inspection pod: the job's image and volumes (read-only), no ServiceAccount token, no devices."""
    spec = job.spec
    assert spec is not None and spec.model.path is not None
    labels = {**names.user_labels(dict(job.labels)), names.LABEL_ROLE: names.ROLE_INSPECT}
    container: dict[str, Any] = {
        "name": names.INSPECT_CONTAINER,
        "image": spec.image,
        "command": inspect_command(spec.model.path),
        # The command writes its answer (or its error) there; never the log's tail (raw output, render.pod).
        "terminationMessagePolicy": "File",
        "resources": {"requests": dict(REQUESTS), "limits": dict(LIMITS)},
        "volumeMounts": user_mounts(spec, read_only=True),
        "securityContext": container_security_context(security),
    }
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {**child_meta(job, names.inspect_pod_name(job.name, job.uid), labels),
                     "annotations": {names.LABEL_JOB_NAME: job.name}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,  # it reads a file; it never talks to the API server
            "enableServiceLinks": False,
            "activeDeadlineSeconds": DEADLINE_SECONDS,
            "securityContext": pod_security_context(security, device_group=False),
            "tolerations": TOLERATIONS,
            "containers": [container],
            "volumes": user_volumes(spec),
        },
    }


@dataclass(frozen=True)
class Inspection:
    """Where the model inspection stands, from the job's inspection pods."""

    outcome: Outcome
    pod: str = ""
    architecture: ModelArchitecture | None = None
    message: str = ""  # why it failed, or what it waits for (if anything is known)


def read(pods: list[PodView]) -> Inspection:
    """The state of the inspection from its pods (at most one is not being deleted: the name is fixed)."""
    live = [p for p in pods if not p.deleting or p.terminal]
    if not live:
        going = [p.name for p in pods]
        if going:  # its name is the new one's: wait until it is gone
            return Inspection("running", going[-1], message=f"the earlier inspection pod {going[-1]} is being deleted")
        return Inspection("none")
    p = live[-1]
    if p.phase == "Succeeded":
        try:
            arch = ModelArchitecture.model_validate_json(p.message or "")
        except ValidationError as exc:
            return Inspection("failed", p.name, message=(
                f"inspection pod {p.name} ended without a model shape in its termination message "
                f"({describe_validation_error(exc, 'architecture')}); got {p.message[:200]!r}"))  # sanitised (pod_view)
        return Inspection("succeeded", p.name, arch)
    if p.phase == "Failed":
        why = (p.message or p.reason or "no message").strip()
        code = f" with exit code {p.exit_code}" if p.exit_code is not None else ""
        return Inspection("failed", p.name, message=f"inspection pod {p.name} failed{code}: {why}")
    return Inspection("running", p.name, message=p.reason)  # e.g. why the scheduler cannot place it


def learned(status: Mapping[str, Any]) -> ModelArchitecture | None:
    """The shape stored in status.modelArchitecture, if any (a malformed one counts as none: read again)."""
    raw = status.get("modelArchitecture")
    if not isinstance(raw, dict):
        return None
    try:
        return ModelArchitecture.model_validate(raw)
    except ValidationError:
        return None


def describe(arch: ModelArchitecture) -> str:
    return (f"{arch.family}: {arch.layers} layers, hidden {arch.hidden}, intermediate {arch.intermediate}, "
            f"{arch.heads} heads of {arch.head_width} ({arch.kv_heads} key/value), vocab {arch.vocab}"
            + (", tied embeddings" if arch.tied else ""))

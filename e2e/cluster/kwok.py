"""Manifests for kwok's fake nodes and Stage objects (pure: builds dicts, no I/O).

kwok only manages nodes carrying MANAGED_ANNOTATION, so a test can tell fake
nodes from anything else in the cluster. A fake node's status (capacity,
allocatable) is taken from the object as created; kwok's node-initialize stage
keeps it and marks the node Ready.
"""

from __future__ import annotations

from typing import Any

MANAGED_ANNOTATION = "kwok.x-k8s.io/node"
MANAGED_VALUE = "fake"
# No taint by default: the cluster has no real nodes, and pods made by the
# operator under test should schedule onto fake nodes unchanged.

# Label that selects pods for the failure stage; its value is the exit code.
FAIL_LABEL = "user.memstrata.dev/e2e-fail-exit-code"  # a job label the operator copies onto its pods

_BASE_CAPACITY = {"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"}


def fake_node(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    capacity: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A Node that kwok will run; `capacity` entries add to or override the base
    (cpu 32, memory 256Gi, pods 110) and are also the node's allocatable."""
    resources = {**_BASE_CAPACITY, **(capacity or {})}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **(labels or {}),
            },
            "annotations": {MANAGED_ANNOTATION: MANAGED_VALUE, **(annotations or {})},
        },
        "spec": {"taints": taints or []},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


def pod_failure_stage(name: str = "memstrata-e2e-pod-fail") -> dict[str, Any]:
    """A Stage that turns a Running pod labelled FAIL_LABEL into phase Failed,
    its containers terminated with the label's value as exit code."""
    template = """{{ $now := Now }}
{{ $code := index .metadata.labels "%s" }}
conditions:
- {lastTransitionTime: {{ $now | Quote }}, status: "False", type: Ready}
- {lastTransitionTime: {{ $now | Quote }}, status: "False", type: ContainersReady}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  restartCount: 0
  started: false
  state:
    terminated:
      exitCode: {{ $code }}
      reason: Error
      startedAt: {{ $now | Quote }}
      finishedAt: {{ $now | Quote }}
{{ end }}
phase: Failed
""" % FAIL_LABEL
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {
                "matchExpressions": [
                    {"key": f'.metadata.labels["{FAIL_LABEL}"]', "operator": "Exists"},
                    {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                    {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                ]
            },
            # Outweighs pod-complete (weight 0) for Job pods that should fail.
            "weight": 10000,
            "next": {"statusTemplate": template},
        },
    }

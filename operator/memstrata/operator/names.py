"""Names and labels of everything the operator creates for a FineTuneJob.

One module names them so the renderer, the reconciler, the cleanup on
deletion and the tests select the same objects. Children are selected by the
job's UID, not its name: a label value is capped at 63 characters while a job
name may be 253, and a re-created job with the same name must never adopt the
pods of its predecessor.

The ServiceAccount, Role, RoleBinding and ConfigMap carry a suffix from the job's UID, so a
job can never be named to collide with an account that already exists (and run as it); an
object the operator finds under one of its names but not owned by this job is never adopted.
"""
from __future__ import annotations

from memstrata.api.finetunejob import GROUP
from memstrata.api.jobdata import OPERATOR_MOUNT_PATHS, OPERATOR_VOLUMES

FINALIZER = f"{GROUP}/cleanup"
FIELD_MANAGER = "memstrata-operator"
COMPONENT = "memstrata-operator"

LABEL_JOB_UID = f"{GROUP}/job-uid"
LABEL_JOB_NAME = f"{GROUP}/job-name"
LABEL_ATTEMPT = f"{GROUP}/attempt"
# Which node of a multi-node job (spec.resources.nodes > 1) a pod is: 0 .. nodes-1 (PET_NODE_RANK).
LABEL_NODE_RANK = f"{GROUP}/node-rank"
# Which child a pod is: the training attempt (no label) or the model inspection pod (ROLE_INSPECT).
LABEL_ROLE = f"{GROUP}/role"
ROLE_INSPECT = "inspect-model"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "memstrata-operator"

# The only labels of a job that are copied onto its pods. Any other key could be one that something else selects
# pods by: `app: web` copied would make the job's pod an endpoint of the web app's Service (or put it under that
# app's NetworkPolicy or PodDisruptionBudget), and memstrata.dev/ keys are the operator's own selectors. A key under
# this prefix is selected only by someone who means to select jobs' pods by what their submitters wrote. Kueue's
# queue labels are not: the job is queued through its Workload (memstrata.operator.kueue), and a pod carrying
# queue-name would be queued a second time, by itself, where Kueue's pod integration is on.
USER_LABEL_PREFIX = "user.memstrata.dev/"

CONTAINER = "runtime"
INSPECT_CONTAINER = "inspect-model"
CONFIG_VOLUME = OPERATOR_VOLUMES[0]  # a user volume may not take the name (FineTuneJobSpec, CRD)
CONFIG_MOUNT = OPERATOR_MOUNT_PATHS[0]

# Kubernetes object names are DNS subdomains (253); leave room for suffixes.
_MAX_BASE = 220
UID_SUFFIX = 8


def _base(job: str) -> str:
    return job[:_MAX_BASE].rstrip("-.")


def pod_name(job: str, attempt: int, node_rank: int = 0, nodes: int = 1) -> str:
    """Deterministic per attempt (and node rank, for a job on several nodes), so a re-run reconcile gets
    409 instead of a duplicate pod. A single-node job's pod is `<job>-<attempt>`."""
    return f"{_base(job)}-{attempt}" if nodes <= 1 else f"{_base(job)}-{attempt}-{node_rank}"


def attempt_of(job: str, pod: str) -> int | None:
    """The attempt a pod_name() of this job names (None for another name): a failure recorded by name
    is still known to belong to its attempt after the pod is gone."""
    prefix = f"{_base(job)}-"
    head = pod[len(prefix):].split("-")[0] if pod.startswith(prefix) else ""
    return int(head) if head.isdigit() else None


# A Service name is a DNS-1035 label and a pod's hostname a DNS-1123 label: 63 characters each.
_LABEL = 63


def _dns_label(job: str, room: int) -> str:
    """The job's name cut to `room` characters of a DNS label ('.' is not allowed in one)."""
    return job.replace(".", "-")[:room].rstrip("-")


def service_name(job: str, uid: str) -> str:
    """The headless Service that gives a multi-node job's pods their DNS names (<hostname>.<service>).
    The UID suffix keeps a re-created job of the same name from ever being served by its predecessor's;
    the leading letter is a DNS-1035 rule (a job's name may start with a digit)."""
    suffix = f"-{_uid(uid)}"
    base = _dns_label(job, _LABEL - len(suffix) - 2)
    return f"{base if base[:1].isalpha() else 'j-' + base}{suffix}"[:_LABEL]


def pod_hostname(job: str, node_rank: int) -> str:
    """The pod's spec.hostname: the same for node rank r in every attempt, so MASTER_ADDR never changes.
    Unique within the job's Service (the subdomain), which is what DNS needs."""
    suffix = f"-{node_rank}"
    return (_dns_label(job, _LABEL - len(suffix)) or "node") + suffix


def _uid(uid: str) -> str:
    return uid.replace("-", "")[:UID_SUFFIX]


def configmap_name(job: str, uid: str) -> str:
    return f"{_base(job)}-runtime-config-{_uid(uid)}"


def claim_template_name(job: str, uid: str, attempt: int) -> str:
    """An attempt's ResourceClaimTemplate (--device-api dra): each of its pods' claims is made from it. One per
    attempt: a template's spec cannot change, and a retry may be placed (and planned) anew."""
    return f"{_base(job)}-devices-{attempt}-{_uid(uid)}"


def workload_name(job: str, uid: str) -> str:
    """The job's Kueue Workload (memstrata.operator.kueue): one per job, kept across its attempts and preemptions."""
    return f"{_base(job)}-workload-{_uid(uid)}"


def inspect_pod_name(job: str, uid: str) -> str:
    """The pod that reads the model directory's config.json (one per job: it runs before any attempt)."""
    return f"{_base(job)}-inspect-{_uid(uid)}"


def runtime_account_name(job: str, uid: str) -> str:
    """The ServiceAccount, Role and RoleBinding that let the job's runtime patch its status."""
    return f"{_base(job)}-runtime-{_uid(uid)}"


def selector(uid: str) -> str:
    """Label selector for every child of the job with this UID."""
    return f"{LABEL_JOB_UID}={uid}"


def child_labels(job: str, uid: str) -> dict[str, str]:
    labels = {LABEL_JOB_UID: uid, LABEL_MANAGED_BY: MANAGED_BY}
    if len(job) <= 63:
        labels[LABEL_JOB_NAME] = job
    return labels


def user_labels(labels: dict[str, str] | None) -> dict[str, str]:
    """The job's own labels that are copied onto its pods: those under USER_LABEL_PREFIX."""
    return {k: v for k, v in (labels or {}).items() if k.startswith(USER_LABEL_PREFIX)}

"""What a reconcile asks the edge to do. Plain values: the lifecycle returns them, the reconciler applies them
in order (deletions, the new attempt, the status patch, events, the job's own deletion)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.strataplan import Plan


@dataclass(frozen=True)
class CreateAttempt:
    """Create the attempt's ServiceAccount/Role/RoleBinding/ConfigMap (and, on several nodes, its headless
    Service), then its pods: one per node of `placed`, by node rank (those of `ranks`)."""

    attempt: int
    node: str  # node rank 0's
    plan: Plan  # every node's: the placement chose nodes alike
    architecture: ModelArchitecture | None = None  # the shape read from the model directory, for the runtime
    nodes: tuple[str, ...] = ()  # a multi-node job's nodes by node rank (empty: just `node`)
    # Only these node ranks' pods (empty: all): the rest of an attempt created in part. Its existing pods are not
    # sent again: a ResourceQuota charges a create it admits even when the pod exists (409), until it recounts.
    ranks: tuple[int, ...] = ()

    @property
    def placed(self) -> tuple[str, ...]:
        return self.nodes or (self.node,)

    @property
    def creates(self) -> list[tuple[int, str]]:
        """(node rank, node) of each pod to create."""
        return [(r, n) for r, n in enumerate(self.placed) if not self.ranks or r in self.ranks]


@dataclass(frozen=True)
class CreateInspection:
    """Create the pod that reads the model directory's config.json (memstrata.operator.inspection)."""


@dataclass(frozen=True)
class DeletePods:
    names: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class PatchStatus:
    patch: dict[str, Any]  # merge patch of .status (None deletes a field)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class DeleteJob:
    why: str


@dataclass(frozen=True)
class AddFinalizer:
    """Hold the job's deletion until its children are gone (runs alongside the first attempt)."""


@dataclass(frozen=True)
class CleanupChildren:
    """Delete every child of a job being deleted; release the finalizer once no pod is left."""

    release: bool


@dataclass(frozen=True)
class CreateWorkload:
    """Create the job's Kueue Workload (memstrata.operator.kueue); one that exists already is left as it is."""

    body: dict[str, Any]


@dataclass(frozen=True)
class WorkloadWrite:
    """A merge patch of the job's Workload, or of its status (`subresource` "status")."""

    name: str
    subresource: str
    patch: dict[str, Any]


Action = Union[DeletePods, CreateAttempt, CreateInspection, PatchStatus, Event, DeleteJob, AddFinalizer,
               CleanupChildren, CreateWorkload, WorkloadWrite]


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...] = ()
    requeue_after: float | None = None  # seconds until the decision may change with no event
    waiting_for_room: bool = False  # re-place as soon as capacity frees up

    def of(self, kind: type) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]

    @property
    def destructive(self) -> bool:
        """Whether this decision ends something a user would miss: a pod deleted, the job failed or
        deleted, or a retry started. Such a decision is acted on only if a fresh read of the job
        decides it too — never on a cached copy that a user's later edit has outdated."""
        for a in self.actions:
            if isinstance(a, (DeletePods, DeleteJob)):
                return True
            if isinstance(a, CreateAttempt) and a.attempt > 0:
                return True
            if isinstance(a, PatchStatus) and a.patch.get("phase") == "Failed":
                return True
        return False

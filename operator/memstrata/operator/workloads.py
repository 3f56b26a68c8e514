"""The edge of the Kueue integration (memstrata.operator.kueue decides): reading a queued job's Workload, the
WorkloadPriorityClass its label names and its admitted ResourceFlavors, and writing what the decision asks."""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.operator import children, kueue, kueuewire, names
from memstrata.operator.actions import CreateWorkload, WorkloadWrite
from memstrata.operator.kube import Conflict, Kube, KubeError, NotFound, api_path
from memstrata.operator.nodes import NodeView
from memstrata.operator.observe import JobView
from memstrata.operator.render import container_requests
from memstrata.operator.scheduling import Placement, PlanCache, place

log = logging.getLogger("memstrata.operator")
FLAVOR_SECONDS = 30.0  # how long a ResourceFlavor's nodeLabels are trusted before they are read again

Placer = Callable[[FineTuneJobSpec], Placement]


class Workloads:
    def __init__(self, kube: Kube, nodes: Callable[[], Iterable[NodeView]], plans: PlanCache) -> None:
        self.kube = kube
        self.nodes = nodes
        self.plans = plans
        self._flavors: dict[str, tuple[dict[str, str], float]] = {}

    async def queue(self, job: JobView) -> kueue.Queue:
        """What the lifecycle needs to decide for a job queued through Kueue."""
        name = names.workload_name(job.name, job.uid)
        try:
            body = await self.kube.get(api_path(kueuewire.API_VERSION, kueuewire.PLURAL, job.namespace, name))
        except NotFound:
            body = None
        if body is not None and not children.owned_by(body, job.uid):
            raise children.NameClash(f"Workload {job.namespace}/{name} exists and is not this job's; memstrata "
                                     "never adopts an object it did not create for this job")
        workload = kueuewire.workload_view(body) if body is not None else None
        priority, error = None, ""
        wanted = job.labels.get(kueuewire.PRIORITY_LABEL)
        if workload is None and wanted:
            try:
                found = await self.kube.get(api_path(kueuewire.API_VERSION, "workloadpriorityclasses", None, wanted))
                priority = (wanted, int(found.get("value") or 0))
            except NotFound:
                error = (f"metadata.labels[{kueuewire.PRIORITY_LABEL}] names WorkloadPriorityClass {wanted!r}, which does "
                         "not exist; create it or correct the label")
        # The quota is the plan on an empty cluster: what the job's pods will ask wherever they are placed.
        quota: Placer = lambda spec: place(spec, list(self.nodes()), {}, self.plans)  # noqa: E731
        return kueue.Queue(workload, quota, priority, error)

    async def placer(self, workload: kueuewire.Workload, base: Callable[[FineTuneJobSpec, list[NodeView]], Placement]
                     ) -> Placer:
        """Placement for an admitted job: among the nodes its admission allows (kueuewire.allows)."""
        labels: dict[str, str] = {}
        for flavor in workload.flavors:
            labels.update(await self._flavor_labels(flavor))

        def placer(spec: FineTuneJobSpec) -> Placement:
            allowed = [n for n in self.nodes() if n.inventory is not None and kueuewire.allows(
                workload, labels, n.labels, container_requests(spec, self.plans(spec, n)))]
            placement = base(spec, allowed) if allowed else None
            if placement is not None and placement.outcome != "impossible":
                return placement
            # Never Failed for the flavor Kueue chose: the job waits, holding its admission, as a Job's pods would
            # (Kueue's waitForPodsReady, where on, evicts it and may admit it elsewhere).
            why = placement.message if placement is not None else (
                f"no node carries the labels of its flavor(s) {', '.join(workload.flavors) or '(none)'} "
                f"({', '.join(f'{k}={v}' for k, v in sorted(labels.items())) or 'no labels'}) and can hold the job "
                "within the admitted requests")
            return Placement("no-room", f"admitted by Kueue (ClusterQueue {workload.cluster_queue}), but {why}")
        return placer

    async def _flavor_labels(self, flavor: str) -> dict[str, str]:
        cached = self._flavors.get(flavor)
        if cached is not None and time.monotonic() - cached[1] < FLAVOR_SECONDS:
            return cached[0]
        body = await self.kube.get(api_path(kueuewire.API_VERSION, "resourceflavors", None, flavor))
        labels = {str(k): str(v) for k, v in ((body.get("spec") or {}).get("nodeLabels") or {}).items()}
        self._flavors[flavor] = (labels, time.monotonic())
        return labels

    async def apply(self, job: JobView, action: CreateWorkload | WorkloadWrite) -> bool:
        """Write what the decision asks; False when the Workload changed since it was read (the job is decided
        again on a fresh read: Kueue writes it too)."""
        if isinstance(action, CreateWorkload):
            try:
                await self.kube.create(action.body)
            except Conflict:  # created by an earlier reconcile whose status write failed: it is read next time
                return False
            return True
        path = api_path(kueuewire.API_VERSION, kueuewire.PLURAL, job.namespace, action.name, action.subresource or None)
        try:
            await self.kube.merge_patch(path, action.patch)
        except KubeError as exc:
            # Changed (409), gone (404), or no longer allowed (422: Kueue's rules, e.g. the queue of a Workload that
            # has just been admitted): the job is decided again on what the Workload is now.
            if not isinstance(exc, (Conflict, NotFound)) and exc.status != 422:
                raise
            log.info("%s/%s: Workload %s changed under us (%s); deciding again", job.namespace, job.name,
                     action.name, exc)
            return False
        return True


"""The edge that turns decisions into API calls, over a keyed work queue (memstrata.operator.workqueue).

Every trigger (a job event, one of its pods changing, capacity freeing up, a
timer) only enqueues the job's key. Each reconcile reads the job's pods with a
consistent LIST, asks the pure lifecycle what to do, and does it in a safe
order: the pod before the status that names it.

Nothing is done unless this replica leads (the `gate`, a Lease: memstrata.operator.leadership),
checked before every write; and a destructive decision (a pod deleted, the job failed, a retry)
taken on the cached copy of a job is taken again on a fresh read before it is acted on.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping

from memstrata.api.finetunejob import API_VERSION, KIND, PLURAL
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.operator import children, gang, kueuewire, names, render
from memstrata.operator.actions import (
    AddFinalizer, CleanupChildren, CreateAttempt, CreateInspection, CreateWorkload, Decision, DeleteJob, DeletePods,
    Event, PatchStatus, WorkloadWrite,
)
from memstrata.operator.kube import Kube, KubeError, NotFound, api_path, gather_ok
from memstrata.operator.leadership import AlwaysLeading
from memstrata.operator.lifecycle import LifecyclePolicy, decide, fail
from memstrata.operator.metrics import OperatorMetrics, phase_of
from memstrata.operator.nodes import NodeView, PodUse, pod_requests, usage_by_node
from memstrata.operator.observe import JobView, allocated_devices, claim_names, format_time, job_view, pod_view
from memstrata.operator.scheduling import PlanCache, Placement, place
from memstrata.operator.workloads import Workloads
from memstrata.operator.workqueue import Gate, JobKey, WorkQueue

log = logging.getLogger("memstrata.operator")
ASSUME_SECONDS = 60.0  # how long a created pod counts against its node before the watch reports it
CLAIM_CACHE = 4096  # allocated claims remembered (namespace, name) -> devices; cleared whole when full


def _rv(body: Mapping[str, Any]) -> int:
    try:
        return int((body.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def _rv_str(body: Mapping[str, Any] | None) -> str:
    return str(((body or {}).get("metadata") or {}).get("resourceVersion") or "")


class Reconciler(WorkQueue):
    def __init__(self, kube: Kube, policy: LifecyclePolicy = LifecyclePolicy(), workers: int = 16,
                 report_interval_seconds: float = 10.0, cleanup_tries: int = 60,
                 gate: Gate | None = None, pod_security: render.PodSecurity = render.PodSecurity(),
                 metrics: OperatorMetrics | None = None) -> None:
        super().__init__(gate or AlwaysLeading(), workers, metrics)
        self.kube = kube
        kube.write_gate = self.gate.leading  # every write, whichever path it comes from
        kube.observe = self.metrics.api_seconds_observer()
        self._phases: dict[JobKey, str] = {}  # every live job's phase, as last seen: the jobs gauge
        # A copy: the scrape runs on prometheus-client's thread while the event loop changes the dict.
        self.metrics.live.phases = lambda: tuple(self._phases.copy().values())
        self.pod_security = pod_security
        self.cleanup_tries = cleanup_tries
        self._cleanups: dict[JobKey, int] = {}
        self.policy = policy
        self.report_interval_seconds = report_interval_seconds
        self.plans = PlanCache()
        self.nodes: Callable[[], Iterable[NodeView]] = lambda: ()
        self.workloads = Workloads(kube, lambda: self.nodes(), self.plans)  # used when policy.kueue
        self.pod_uses: Callable[[], Iterable[PodUse]] = lambda: ()
        self._bodies: dict[JobKey, dict[str, Any]] = {}
        self._assumed: dict[str, tuple[PodUse, float]] = {}
        self._claims: dict[tuple[str, str], tuple[str, ...]] = {}  # allocated DRA claims' devices
        self._assumed_by_job: dict[JobKey, set[str]] = {}  # which job's reconcile claimed each assumed pod
        self._waiting: set[JobKey] = set()
        self._wake: asyncio.TimerHandle | None = None
        self.reconciles = 0

    # -- triggers ---------------------------------------------------------------------------------
    def observe_job(self, body: Mapping[str, Any], deleted: bool = False) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", "default"), meta.get("name", ""))
        if deleted:
            self.forget(key)
            self._phases.pop(key, None)
            return
        self._phases[key] = phase_of(body)
        known = self._bodies.get(key)
        if known is None or _rv(body) >= _rv(known) or (known.get("metadata") or {}).get("uid") != meta.get("uid"):
            self._bodies[key] = dict(body)
        self.enqueue(key)

    def resume(self) -> None:
        """This replica just became the leader: whatever it cached while standing by may be older than
        what the previous leader saw, so every known job is reconciled again from a fresh read."""
        keys = set(self._bodies) | set(self._timers) | self._waiting
        self._bodies.clear()  # (pods this replica created stay assumed until its watch shows them)
        for key in sorted(keys):
            self.enqueue(key)

    def forget(self, key: JobKey) -> None:
        self._bodies.pop(key, None)
        self._assumed_by_job.pop(key, None)
        self._waiting.discard(key)
        super().forget(key)

    def wake_waiting(self) -> None:
        """Capacity may have freed up: re-place every waiting job, coalescing bursts of events."""
        if self._wake is None and self._waiting:
            self._wake = asyncio.get_running_loop().call_later(0.2, self._wake_now)

    def _wake_now(self) -> None:
        self._wake = None
        for key in sorted(self._waiting):
            self.enqueue(key)

    # -- what the work queue leaves to its reconciler --------------------------------------------------
    def drop_cached(self, key: JobKey) -> None:
        self._bodies.pop(key, None)

    def on_error(self, key: JobKey, tries: int, delay: float, exc: Exception) -> None:
        body = self._bodies.get(key)
        if body is not None and (tries == 1 or tries % 10 == 0):  # tell the user, without flooding
            self._spawn(self.post_event(job_view(body), Event(
                "Warning", "ReconcileError", f"try {tries}, next in {delay:.0f}s: {str(exc)[:800]}")))

    # -- one reconcile ----------------------------------------------------------------------------
    async def reconcile(self, key: JobKey) -> None:
        namespace = key[0]
        self.reconciles += 1
        body = self._bodies.get(key)
        fresh = body is None
        if body is None and (body := await self._read(key)) is None:
            return
        job, decision = await self._decide(key, body)
        if decision.destructive and not fresh:
            # The cached copy may predate a user's edit (a raised deadline, suspend lifted): decide again
            # on the job as it is now, and act only on that.
            log.info("reconcile %s/%s: confirming a destructive decision on a fresh read", *key)
            if (body := await self._read(key)) is None:
                return
            job, decision = await self._decide(key, body)
        if not job.uid:
            return
        # Claim the chosen nodes before the first await, so a concurrent placement sees them.
        for create in decision.of(CreateAttempt):
            for pod_key, node in _pod_keys(namespace, job.name, create):
                self._assumed[pod_key] = (PodUse(pod_key, node, dict(create.plan.requests), True), time.monotonic())
                self._assumed_by_job.setdefault(key, set()).add(pod_key)
        try:
            await self.apply(job, decision)
        except (children.NameClash, children.PodRejected) as exc:
            # Retrying cannot help: the same object is there, the same pod is invalid. Fail the job, saying why.
            log.warning("reconcile %s/%s: %s", *key, exc)
            for create in decision.of(CreateAttempt):  # no pod holds the node's room it claimed
                for pod_key, _ in _pod_keys(namespace, job.name, create):
                    self._assumed.pop(pod_key, None)
            await self.apply(job, fail(job, datetime.now(timezone.utc), type(exc).__name__, str(exc)))
            return
        if decision.waiting_for_room:
            self._waiting.add(key)
        else:
            self._waiting.discard(key)
        if decision.requeue_after is not None:
            self.enqueue(key, max(decision.requeue_after, 0.05))

    async def _read(self, key: JobKey) -> dict[str, Any] | None:
        """GET the job (and cache it); None (and forgotten) if it is gone."""
        try:
            body = self._bodies[key] = await self.kube.get(api_path(API_VERSION, PLURAL, *key))
        except NotFound:
            self.forget(key)
            return None
        return body

    async def _decide(self, key: JobKey, body: Mapping[str, Any]) -> tuple[JobView, Decision]:
        job = job_view(body)
        if not job.uid:
            return job, Decision()
        # Always LIST, even for a job that looks untouched (no finalizer, no status): a pod may exist
        # from a reconcile whose later writes failed (a 409 on the finalizer), and deciding without it
        # would place the job a second time and point its ConfigMap at the other node.
        pods = await self.kube.list(api_path("v1", "pods", key[0]), names.selector(job.uid))
        # A label anyone may set; the owner reference says whose pod it really is.
        views = [pod_view(p, await self._claimed(key[0], p)) for p in pods if children.owned_by(p, job.uid)]
        listed = {f"{key[0]}/{p.name}" for p in views}
        for p in views:
            if p.terminal or p.deleting:
                self._assumed.pop(f"{key[0]}/{p.name}", None)
        # A pod claimed by an earlier reconcile and no longer listed is gone (lost with its node, deleted, or never
        # created): it holds nothing, and counting it until the claim expires would keep its node looking full.
        claimed = self._assumed_by_job.get(key, set())
        for pod_key in claimed - listed:
            self._assumed.pop(pod_key, None)
        claimed &= listed
        place: Callable[[FineTuneJobSpec], Placement] = self._place
        queue = None
        if self.policy.kueue and kueuewire.is_queued(job) and job.spec is not None and not job.deleting:
            try:
                queue = await self.workloads.queue(job)
            except children.NameClash as exc:  # retrying cannot help: fail the job, naming the object
                return job, fail(job, datetime.now(timezone.utc), "NameClash", str(exc))
            if queue.workload is not None and queue.workload.admitted:
                place = await self.workloads.placer(queue.workload, self._place)
        return job, decide(job, views, datetime.now(timezone.utc), place, self.policy, queue)

    async def _claimed(self, namespace: str, pod: Mapping[str, Any]) -> tuple[str, ...]:
        """The devices a pod's DRA claims were allocated (cached: an allocation does not change); () when it has
        none, or they cannot be read now (the status says so at the next reconcile)."""
        found: list[str] = []
        for name in claim_names(pod):
            if (namespace, name) not in self._claims:
                try:
                    claim = await self.kube.get(api_path("resource.k8s.io/v1", "resourceclaims", namespace, name))
                except KubeError as exc:
                    log.debug("ResourceClaim %s/%s: %s", namespace, name, exc)
                    return ()
                if not allocated_devices(claim):
                    return ()
                if len(self._claims) > CLAIM_CACHE:
                    self._claims.clear()
                self._claims[(namespace, name)] = allocated_devices(claim)
            found += self._claims[(namespace, name)]
        return tuple(found)

    def _place(self, spec: FineTuneJobSpec, nodes: list[NodeView] | None = None) -> Placement:
        """`nodes`: those the job may use (an admitted Kueue Workload's: memstrata.operator.workloads); None: all."""
        uses = list(self.pod_uses())
        seen = {u.key for u in uses}
        stale = time.monotonic() - ASSUME_SECONDS
        for key, (_, at) in list(self._assumed.items()):
            if key in seen or at < stale:
                del self._assumed[key]
        usage = usage_by_node(uses + [u for u, _ in self._assumed.values()])
        return place(spec, list(self.nodes()) if nodes is None else nodes, usage, self.plans)

    async def apply(self, job: JobView, decision: Decision) -> None:
        finalizer: asyncio.Task[str] | None = None
        try:
            for action in decision.actions:
                if isinstance(action, AddFinalizer):
                    # Off the critical path: the pod does not wait for it, the status patch does.
                    finalizer = asyncio.create_task(self._add_finalizer(job))
                elif isinstance(action, DeletePods):
                    await gather_ok(*(self.kube.delete(api_path("v1", "pods", job.namespace, n))
                                      for n in action.names))
                    for n in action.names:
                        self._assumed.pop(f"{job.namespace}/{n}", None)
                elif isinstance(action, CreateAttempt):
                    try:
                        await children.create_attempt(self.kube, job, action, self.report_interval_seconds,
                                                      self.pod_security)
                        if action.attempt == 0 and not action.ranks and job.created is not None:
                            self.metrics.create_to_pod.observe(  # never below 0, whatever the clocks' skew
                                max(0.0, (datetime.now(timezone.utc) - job.created).total_seconds()))
                    except (children.PartlyCreated, children.NothingCreated) as exc:
                        if finalizer is not None:  # the record's fresh read must see our finalizer write
                            await asyncio.wait([finalizer])
                        await self._record_unfinished(job, action, exc)
                        raise
                elif isinstance(action, CreateInspection):
                    await children.create_inspection(self.kube, job, self.pod_security)
                elif isinstance(action, PatchStatus):
                    # Compare-and-swap on the version this decision read, or on our own write of the
                    # finalizer after it: a status decided on a stale copy is refused with a 409, then re-read.
                    rv = (await finalizer) if finalizer is not None else job.resource_version
                    path = api_path(API_VERSION, PLURAL, job.namespace, job.name, "status")
                    self.observe_fresh(await self.kube.merge_patch(path, {
                        "metadata": {"resourceVersion": rv}, "status": action.patch}))
                elif isinstance(action, Event):
                    self._spawn(self.post_event(job, action))
                elif isinstance(action, DeleteJob):
                    log.info("deleting %s/%s: %s", job.namespace, job.name, action.why)
                    await self.kube.delete(api_path(API_VERSION, PLURAL, job.namespace, job.name))
                elif isinstance(action, CleanupChildren):
                    await self._cleanup(job, action.release)
                elif isinstance(action, (CreateWorkload, WorkloadWrite)):
                    if not await self.workloads.apply(job, action):
                        self.enqueue((job.namespace, job.name), 0.5)
        finally:
            if finalizer is not None:
                await finalizer

    async def _record_unfinished(self, job: JobView, create: CreateAttempt, exc: Exception) -> None:
        """Not every pod of the attempt could be created: record why the job waits, on a fresh read; and when
        some pods exist, the attempt's nodes and plan, so that the next reconcile creates its missing pods
        (gang.rest) rather than delete them all and start another that fails alike. When none does, its claim on
        the nodes goes. The error still fails the reconcile (event, backoff)."""
        partly = isinstance(exc, children.PartlyCreated)
        if not partly:
            for pod_key, _ in _pod_keys(job.namespace, job.name, create):
                self._assumed.pop(pod_key, None)
        try:
            fresh = job_view(await self.kube.get(api_path(API_VERSION, PLURAL, job.namespace, job.name)))
            if fresh.uid == job.uid:
                await self.apply(fresh, gang.unfinished(fresh, datetime.now(timezone.utc), create, str(exc), partly))
        except Exception as record:  # noqa: BLE001 - the create's error is the one to report
            log.warning("%s/%s: attempt %d not recorded: %s", job.namespace, job.name, create.attempt, record)

    async def _add_finalizer(self, job: JobView) -> str:
        """Add our finalizer; the job's resourceVersion after it."""
        # resourceVersion makes it a compare-and-swap: a concurrent writer of the list gets a 409, not lost.
        body = await self.kube.merge_patch(api_path(API_VERSION, PLURAL, job.namespace, job.name), {"metadata": {
            "finalizers": [*job.finalizers, names.FINALIZER], "resourceVersion": job.resource_version}})
        self.observe_fresh(body)
        return _rv_str(body)

    async def _cleanup(self, job: JobView, release: bool) -> None:
        key = (job.namespace, job.name)
        await children.delete_children(self.kube, job.namespace, job.uid)
        if self.policy.kueue:  # its owner reference would have the garbage collector do it, later
            await gather_ok(self.kube.delete_collection(api_path(kueuewire.API_VERSION, kueuewire.PLURAL, job.namespace),
                                                        names.selector(job.uid)))
        tries = self._cleanups[key] = self._cleanups.get(key, 0) + 1
        if not release and tries < self.cleanup_tries:
            return
        if not release:  # finite: the garbage collector still removes what the owner references cover
            self._spawn(self.post_event(job, Event("Warning", "CleanupAbandoned",
                                                   f"pods still terminating after {tries} cleanups; releasing")))
        remaining = [f for f in job.finalizers if f != names.FINALIZER]
        await self.kube.merge_patch(api_path(API_VERSION, PLURAL, job.namespace, job.name), {"metadata": {
            "finalizers": remaining or None, "resourceVersion": job.resource_version}})
        self._cleanups.pop(key, None)
        self.forget(key)

    def observe_fresh(self, body: Mapping[str, Any]) -> None:
        """Our own write's response is the newest state we know; keep it without re-enqueuing."""
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", "default"), meta.get("name", ""))
        known = self._bodies.get(key)
        if known is None or _rv(body) >= _rv(known):
            self._bodies[key] = dict(body)
            self._phases[key] = phase_of(body)

    async def post_event(self, job: JobView, event: Event) -> None:
        now = format_time(datetime.now(timezone.utc))
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{job.name[:200]}.{uuid.uuid4().hex[:16]}", "namespace": job.namespace},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": job.name,
                               "namespace": job.namespace, "uid": job.uid},
            "reason": event.reason, "message": event.message[:1024], "type": event.type,
            "source": {"component": names.COMPONENT}, "reportingComponent": names.COMPONENT,
            "reportingInstance": names.COMPONENT, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self.metrics.events.labels(event.type, event.reason).inc()
        try:
            await self.kube.create(body)
        except KubeError as exc:  # an event lost is a log line, never a failed reconcile
            log.warning("event %s for %s/%s not posted: %s", event.reason, job.namespace, job.name, exc)

def _pod_keys(namespace: str, job: str, create: CreateAttempt) -> list[tuple[str, str]]:
    """(namespace/name, node) of each pod the attempt creates."""
    return [(f"{namespace}/{names.pod_name(job, create.attempt, r, len(create.placed))}", node)
            for r, node in create.creates]


def holds_resources(pod: Mapping[str, Any]) -> bool:
    """Whether a pod's end frees anything the placement counts."""
    return any(pod_requests(pod.get("spec") or {}).values())

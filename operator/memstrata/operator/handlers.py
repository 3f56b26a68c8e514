"""Kopf registrations, kept thin: each handler only feeds the reconciler or an index.

- indices of nodes (their memstrata inventory) and of pods holding resources: Kopf
  fills them before any other handler runs, so the first placement after a restart
  already sees every pod that holds a GPU or a namespace;
- events of FineTuneJobs, of their pods and (with --kueue) of their Kueue Workloads enqueue the job; a pod
  ending or a node changing wakes the jobs waiting for room;
- deletion is the reconciler's too: its own finalizer (memstrata.dev/cleanup) is released only
  once every child is gone. Kopf's on.delete is not used, because Kopf would then also write its
  finalizer and a copy of every spec (diff-base annotation) into each job: two extra writes per job.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from memstrata.api.finetunejob import GROUP, KIND, PLURAL, VERSION
from memstrata.operator import kueuewire, names
from memstrata.operator.leadership import Elector
from memstrata.operator import claims
from memstrata.operator.nodes import NodeView, PodUse, node_view, pod_use
from memstrata.operator.reconciler import Reconciler, holds_resources
from memstrata.operator.settings import OperatorConfig, apply_settings

log = logging.getLogger("memstrata.operator")


def build_registry(reconciler: Reconciler, config: OperatorConfig,
                   elector: Elector | None = None) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    _register_lifecycle(registry, reconciler, config, elector)
    _register_indices(registry, claims.claimed_resources(config.pod_security.gpu_device_class)
                      if config.pod_security.dra else ())
    _register_events(registry, reconciler)
    if config.policy.kueue:
        _register_workloads(registry, reconciler)
    return registry


def _register_lifecycle(registry: kopf.OperatorRegistry, reconciler: Reconciler, config: OperatorConfig,
                        elector: Elector | None) -> None:
    """Startup, cleanup and login: the reconciler and the leader election start and stop with Kopf."""
    election: list[asyncio.Task[None]] = []

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        apply_settings(settings, config)
        await reconciler.start()
        if elector is not None:
            election.append(asyncio.create_task(elector.run(), name="leader-election"))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for task in election:
            task.cancel()
        await asyncio.gather(*election, return_exceptions=True)
        await reconciler.stop()
        if elector is not None:
            await elector.release()  # after the last write: the standby takes over at once
            await elector.kube.close()
        await reconciler.kube.close()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # Kopf and the reconciler must reach the same API server as the same identity.
        return kopf.ConnectionInfo(**reconciler.kube.credentials())


def _register_indices(registry: kopf.OperatorRegistry, claimed: tuple[str, ...]) -> None:
    """The node and pod indices, which Kopf fills before any other handler runs; `claimed`: the resources pods
    claim through DRA (nodes.node_view)."""
    @kopf.index("", "v1", "nodes", registry=registry, id="node_index")  # the id names the kwarg
    def node_index(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeView]:
        return {name: node_view(body, claimed)}

    @kopf.index("", "v1", "pods", registry=registry, id="pod_index")
    def pod_index(body: kopf.Body, **_: Any) -> dict[str, PodUse]:
        use = pod_use(body)
        return {use.node: use} if use else {}


def _register_events(registry: kopf.OperatorRegistry, reconciler: Reconciler) -> None:
    """Events of jobs, their pods and nodes: each enqueues a job or wakes the waiting ones."""
    def bind(kwargs: Mapping[str, Any]) -> None:
        # Kopf hands its indices over as kwargs named by the index ids; they are live views,
        # so binding them once is enough and binding again is harmless.
        node_index: kopf.Index[str, NodeView] = kwargs["node_index"]
        pod_index: kopf.Index[str, PodUse] = kwargs["pod_index"]
        reconciler.nodes = lambda: [v for store in node_index.values() for v in store]
        reconciler.pod_uses = lambda: [v for store in pod_index.values() for v in store]

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def job_event(event: kopf.RawEvent, **kwargs: Any) -> None:
        bind(kwargs)
        reconciler.observe_job(event["object"], deleted=event.get("type") == "DELETED")

    @kopf.on.event("", "v1", "pods", registry=registry)
    async def pod_event(event: kopf.RawEvent, **kwargs: Any) -> None:
        bind(kwargs)
        pod: Mapping[str, Any] = event["object"]
        meta: Mapping[str, Any] = pod.get("metadata") or {}
        if names.LABEL_JOB_UID in (meta.get("labels") or {}):
            _enqueue_owner(reconciler, meta)
        ended = event.get("type") == "DELETED" or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if ended and holds_resources(pod):
            reconciler.wake_waiting()

    @kopf.on.event("", "v1", "nodes", registry=registry)
    async def node_event(**_: Any) -> None:
        reconciler.wake_waiting()


def _register_workloads(registry: kopf.OperatorRegistry, reconciler: Reconciler) -> None:
    """Kueue's writes to a job's Workload (admitted, evicted, requeued) enqueue the job that owns it."""
    @kopf.on.event(kueuewire.GROUP, kueuewire.API_VERSION.split("/")[1], kueuewire.PLURAL, registry=registry,
                   labels={names.LABEL_JOB_UID: kopf.PRESENT})
    async def workload_event(event: kopf.RawEvent, **_: Any) -> None:
        _enqueue_owner(reconciler, event["object"].get("metadata") or {})


def _enqueue_owner(reconciler: Reconciler, meta: Mapping[str, Any]) -> None:
    """Enqueue the FineTuneJob that owns an object of one of its children (a pod, a Workload)."""
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("kind") == KIND), None)
    if owner:
        reconciler.enqueue((meta.get("namespace", "default"), owner["name"]))

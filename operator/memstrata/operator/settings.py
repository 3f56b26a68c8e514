"""The operator's settings, and how they become Kopf's.

Each Kopf default changed here answers a pitfall of Kopf's: its peering pauses
a replica's watches but not the operator's own timers (so Kopf always runs standalone, and
which replica acts is decided by a Lease: memstrata.operator.leadership); handler retries are infinite by default (so the only retried work, the cleanup of a deleted job,
is bounded); a
watch can hang silently (so an inactivity timeout restarts it); and Kopf's own
per-handler events would drown the operator's transition events (so only its
warnings are posted).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import kopf

from memstrata.api.finetunejob import GROUP
from memstrata.operator.leadership import LeaseTiming
from memstrata.operator.lifecycle import LifecyclePolicy
from memstrata.operator.render import PodSecurity


@dataclass(frozen=True)
class OperatorConfig:
    kubeconfig: str | None = None
    """A kubeconfig file; None means in-cluster, then $KUBECONFIG / ~/.kube/config."""
    namespaces: tuple[str, ...] = ()
    """Namespaces to serve; empty means the whole cluster."""
    lease: str | None = "memstrata-operator"
    """The Lease the replicas elect their leader with; None: a single replica that always acts."""
    lease_namespace: str = "default"
    """Where that Lease lives (the operator's own namespace in a cluster)."""
    identity: str = ""
    """This replica's name in the Lease (unique per process)."""
    lease_timing: LeaseTiming = LeaseTiming()
    liveness: str | None = None
    """e.g. http://0.0.0.0:8080/healthz — Kopf answers it while its watches are healthy."""
    metrics_address: tuple[str, int] | None = None
    """(host, port) to serve Prometheus metrics on; None: not served."""
    workers: int = 16
    """Concurrent reconciles (each is a few API calls; the work is I/O-bound)."""
    policy: LifecyclePolicy = LifecyclePolicy()
    report_interval_seconds: float = 10.0
    """How often the runtime in a pod reports progress (written into its RuntimeConfig)."""
    pod_security: PodSecurity = PodSecurity()
    """What the nodes need in the training pod's security context (device group, seccomp profile)."""
    cleanup_tries: int = 60
    """Cleanups (about 1 s apart) of a deleted job whose pods will not go, before its finalizer is
    released anyway — finite, because a job stuck in deletion forever is worse than a pod left to
    the garbage collector (every child has an owner reference)."""
    watch_server_timeout_seconds: int = 270
    """The API server ends each watch after this long; Kopf then resumes it."""
    watch_inactivity_timeout_seconds: float = 300.0
    """A watch with no event for this long is presumed dead and restarted."""
    request_timeout_seconds: float = 60.0


def apply_settings(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    # Kopf's finalizer stays Kopf's own (unused: no on.delete handler). Were it set to the
    # operator's, Kopf would remove it, as "no handler requires it".
    # Annotations, not status: the status belongs to the job's users and its runtime.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=f"kopf.{GROUP}")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=f"kopf.{GROUP}", key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "memstrata-operator"
    settings.watching.server_timeout = int(config.watch_server_timeout_seconds)  # the API server wants an integer
    settings.watching.client_timeout = config.watch_server_timeout_seconds + 30
    settings.watching.inactivity_timeout = config.watch_inactivity_timeout_seconds
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = config.request_timeout_seconds
    settings.networking.connect_timeout = 10
    # Every replica watches (a hot standby keeps its indices filled); only the Lease holder acts.
    settings.peering.standalone = True
    settings.peering.mandatory = False

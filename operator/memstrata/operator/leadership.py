"""Leader election on a coordination.k8s.io Lease: of all replicas, exactly one acts.

Kopf's peering was not enough: a replica Kopf pauses stops its watches but not the
operator's own timers, which then acted on a stale copy of a job (a pod deleted at a
deadline the user had already raised). Here acting is gated on holding the Lease, by
client-go's rules:

- the holder renews every `retry` seconds; a write is a compare-and-swap on the Lease's
  resourceVersion, so two candidates never both win;
- another replica takes the Lease over only after the holder's record has stood unchanged
  for the holder's leaseDurationSeconds, measured on the observer's own monotonic clock
  (clocks of two machines are never compared);
- the holder stops acting as soon as `renew_deadline` has passed since its last successful
  renewal — before anyone else may take over, as renew_deadline < lease. A process that
  was frozen (SIGSTOP, a long GC pause, a starved node) therefore finds itself no longer
  leading the moment it thaws, before any of its overdue timers can act.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

from memstrata.operator.kube import Conflict, Kube, KubeError, NotFound, api_path

log = logging.getLogger("memstrata.operator.leadership")
LEASE_API = "coordination.k8s.io/v1"


@dataclass(frozen=True)
class LeaseTiming:
    lease_seconds: float = 15.0
    """How long a holder's unrenewed record keeps the others waiting."""
    renew_deadline_seconds: float = 10.0
    """How long the holder keeps acting without a successful renewal."""
    retry_seconds: float = 2.0
    """How often the holder renews and the others try."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError(
                f"leader election needs 0 < retry ({self.retry_seconds}s) < renew deadline "
                f"({self.renew_deadline_seconds}s) < lease duration ({self.lease_seconds}s): a holder must "
                "stop acting before another replica may take over")


def _micro(now: datetime) -> str:
    # Lease times are MicroTime: RFC 3339 with microseconds.
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def claim(spec: Mapping[str, Any] | None, me: str, unchanged_for: float, now: datetime,
          timing: LeaseTiming) -> dict[str, Any] | None:
    """The Lease spec `me` should write, or None while another holder's Lease is still valid.

    `unchanged_for` is how long this replica has seen the current record stand unchanged."""
    spec = spec or {}
    holder = spec.get("holderIdentity") or ""
    stamp = _micro(now)
    transitions = int(spec.get("leaseTransitions") or 0)
    if holder == me:
        return {**spec, "renewTime": stamp, "leaseDurationSeconds": math.ceil(timing.lease_seconds)}
    held_for = float(spec.get("leaseDurationSeconds") or timing.lease_seconds)
    if holder and unchanged_for < held_for:
        return None
    return {"holderIdentity": me, "leaseDurationSeconds": math.ceil(timing.lease_seconds), "acquireTime": stamp,
            "renewTime": stamp, "leaseTransitions": transitions + (1 if holder else 0)}


class AlwaysLeading:
    """The gate of a single replica (--standalone): it always acts."""

    def leading(self) -> bool:
        return True

    async def wait_leading(self) -> None:
        return None


class Elector:
    """Holds (or waits for) one Lease; `leading()` is the gate every action passes."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str,
                 timing: LeaseTiming = LeaseTiming(), on_started: Callable[[], None] = lambda: None) -> None:
        self.kube, self.namespace, self.name, self.identity, self.timing = kube, namespace, name, identity, timing
        self.on_started = on_started
        self._renewed_at: float | None = None
        self._seen: tuple[Any, ...] | None = None
        self._seen_at = time.monotonic()
        self._became = asyncio.Event()
        self.terms = 0

    @property
    def path(self) -> str:
        return api_path(LEASE_API, "leases", self.namespace, self.name)

    def leading(self) -> bool:
        at = self._renewed_at
        return at is not None and time.monotonic() - at < self.timing.renew_deadline_seconds

    async def wait_leading(self) -> None:
        while not self.leading():
            self._became.clear()
            await self._became.wait()

    async def run(self) -> None:
        """Try to acquire, then renew, forever (cancel to stop)."""
        was = False  # what was last logged
        while True:
            await self.step()
            now = self.leading()
            if was and not now:
                log.warning("lease %s/%s lost by %s: no longer acting", self.namespace, self.name, self.identity)
            was = now
            await asyncio.sleep(self.timing.retry_seconds)

    async def step(self) -> None:
        """One try; a new term (leading after not leading, however briefly) starts the reconciler afresh,
        and waiters are woken whenever this replica leads: level-triggered, so a worker that parked in a
        lapse between two renewals is never left waiting while its replica holds the Lease."""
        lapsed = not self.leading()
        try:
            await self.try_once()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 — an unreachable API server only delays the next try
            log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
        if self.leading():
            if lapsed:
                log.info("lease %s/%s acquired by %s: acting", self.namespace, self.name, self.identity)
                self.terms += 1
                self.on_started()
            self._became.set()

    async def try_once(self) -> bool:
        """One acquire-or-renew; True if this replica holds the Lease now."""
        started = time.monotonic()  # a renewal counts from before the request, never after it
        try:
            lease = await self.kube.get(self.path)
        except NotFound:
            lease = None
        read = time.monotonic()  # a record seen changing counts from when it was seen, after the GET
        spec = (lease or {}).get("spec") or {}
        seen = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if seen != self._seen:
            if seen[0] != (self._seen or (None,))[0] and seen[0] not in (None, "", self.identity):
                log.info("lease %s/%s held by %s: %s stands by", self.namespace, self.name, seen[0], self.identity)
            self._seen, self._seen_at = seen, read
        wanted = claim(spec, self.identity, read - self._seen_at, datetime.now(timezone.utc), self.timing)
        if wanted is None:
            self._renewed_at = None
            return False
        body: dict[str, Any] = {"apiVersion": LEASE_API, "kind": "Lease",
                                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": wanted}
        try:
            if lease is None:
                await self.kube.create(body)
            else:
                body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
                await self.kube.replace(body)
        except Conflict:  # another replica wrote first: it won this round
            self._renewed_at = None
            return False
        self._renewed_at = started
        return True

    async def release(self) -> None:
        """On a graceful exit, after the last write: give the Lease up, so the standby takes over at once,
        not after a lease. Only if this replica is still the holder (a compare-and-swap on the version read)."""
        self._renewed_at = None  # stop acting first
        try:
            lease = await self.kube.get(self.path)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") == self.identity:
                lease["spec"] = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1}
                await self.kube.replace(lease)
        except KubeError as exc:
            log.warning("lease %s/%s not released: %s", self.namespace, self.name, exc)


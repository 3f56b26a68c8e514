"""The Lease gate against a real API server, in process: a replica that does not hold the Lease writes
nothing, whichever path a write comes from; a lapse between two renewals never leaves workers parked
while their replica leads; a silent holder is taken over only after its lease duration."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from e2e.cluster.controlplane import ControlPlane
from e2e.operator.harness import apply_yaml, inventory, job, memstrata_node

pytestmark = pytest.mark.cluster

pytest.importorskip("memstrata.operator.kube", reason="the operator's dependencies are not installed")
from memstrata.operator.kube import Kube, NotLeading, api_path  # noqa: E402
from memstrata.operator.leadership import Elector, LeaseTiming  # noqa: E402
from memstrata.operator.nodes import node_view  # noqa: E402
from memstrata.operator.reconciler import Reconciler  # noqa: E402

NS = "gate"
FAST = LeaseTiming(lease_seconds=3, renew_deadline_seconds=2, retry_seconds=0.5)


@pytest.fixture(scope="module")
def gate_cluster(quiet_cluster: ControlPlane) -> ControlPlane:
    quiet_cluster.create_namespace(NS)
    quiet_cluster.apply(memstrata_node("g1", inventory("g1", dram_gib=1024, gpus=2)))
    return quiet_cluster


def _elector(cp: ControlPlane, lease: str, me: str, **kw: Any) -> Elector:
    return Elector(Kube.from_config(str(cp.kubeconfig)), NS, lease, me, FAST, **kw)


def test_a_replica_without_the_lease_writes_nothing(gate_cluster: ControlPlane) -> None:
    cp = gate_cluster
    lease = f"l-{uuid.uuid4().hex[:6]}"
    apply_yaml(cp, job("gated"), NS)

    async def scenario() -> Any:
        holder, me = _elector(cp, lease, "holder"), _elector(cp, lease, "me")
        kube = Kube.from_config(str(cp.kubeconfig))
        try:
            await holder.step()
            await me.step()
            assert holder.leading() and not me.leading()
            reconciler = Reconciler(kube, gate=me)
            views = [node_view(n) for n in await kube.list(api_path("v1", "nodes"))]
            reconciler.nodes = lambda: views
            with pytest.raises(NotLeading):
                await reconciler.reconcile((NS, "gated"))
            with pytest.raises(NotLeading):  # any write through that client, not only the reconciler's
                await kube.create({"apiVersion": "v1", "kind": "ConfigMap",
                                   "metadata": {"name": "stray", "namespace": NS}})
        finally:
            for c in (holder.kube, me.kube, kube):
                await c.close()

    asyncio.run(scenario())
    body = cp.get_json("ftj", "gated", "-n", NS)
    assert not body["metadata"].get("finalizers") and not body.get("status"), body
    assert cp.get_json("pods", "-n", NS)["items"] == []
    assert not cp.kubectl("get", "configmap", "stray", "-n", NS, "--ignore-not-found").strip()


def test_a_lapse_between_renewals_wakes_parked_workers_and_starts_a_new_term(gate_cluster: ControlPlane) -> None:
    lease = f"l-{uuid.uuid4().hex[:6]}"

    async def scenario() -> tuple[int, float]:
        starts: list[float] = []
        me = _elector(gate_cluster, lease, "me", on_started=lambda: starts.append(time.monotonic()))
        try:
            await me.step()
            assert me.leading() and len(starts) == 1
            me._renewed_at = time.monotonic() - 60  # a renewal that came too late: the gate closed meanwhile
            assert not me.leading()
            parked = asyncio.create_task(me.wait_leading())
            await asyncio.sleep(0.2)
            assert not parked.done()
            began = time.monotonic()
            await me.step()  # the next renewal succeeds: the same holder, a new term
            await asyncio.wait_for(parked, timeout=2)
            return len(starts), time.monotonic() - began
        finally:
            await me.kube.close()

    terms, woke = asyncio.run(scenario())
    assert terms == 2, "the new term did not start the reconciler afresh"
    print(f"a parked worker woke {woke * 1000:.0f} ms after the renewal")


def test_a_silent_holder_is_taken_over_only_after_its_lease(gate_cluster: ControlPlane) -> None:
    lease = f"l-{uuid.uuid4().hex[:6]}"

    async def scenario() -> tuple[float, bool]:
        old, new = _elector(gate_cluster, lease, "old"), _elector(gate_cluster, lease, "new")
        try:
            await old.step()
            began = time.monotonic()
            while not new.leading():  # old falls silent: it renews no more
                await new.step()
                if not new.leading():
                    assert time.monotonic() - began < FAST.lease_seconds + 2, "never taken over"
                await asyncio.sleep(FAST.retry_seconds)
            took = time.monotonic() - began
            await old.step()  # it speaks again: it must find itself no longer the holder
            return took, old.leading()
        finally:
            await old.kube.close()
            await new.kube.close()

    took, old_still_leads = asyncio.run(scenario())
    assert took >= FAST.lease_seconds, f"taken over after {took:.1f}s, before the {FAST.lease_seconds}s lease ran out"
    assert not old_still_leads

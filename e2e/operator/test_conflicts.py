"""Stale reads must not act: one 409 must not place a job twice, and a cached copy of a job must not
kill its pod. The reconciler runs in this process against a real API server
that no operator watches, so the only other writer is the test itself: it moves the job's
resourceVersion (a label, as any user or controller may add) just before the reconciler's finalizer
patch, so the server answers that patch with a real 409 Conflict.

Before the fix, the next pass saw a job with no finalizer and no status, skipped listing its pods,
placed it again on the other node (the first one was claimed by the pod just created) and pointed
its ConfigMap at that node while the pod ran on the first.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Mapping

import pytest

from e2e.cluster.controlplane import ControlPlane
from e2e.operator.harness import apply_yaml, inventory, job, memstrata_node

pytestmark = pytest.mark.cluster

kube_mod = pytest.importorskip("memstrata.operator.kube", reason="the operator's dependencies are not installed")
from memstrata.api.finetunejob import API_VERSION, PLURAL  # noqa: E402
from memstrata.operator import names  # noqa: E402
from memstrata.operator.kube import Conflict, Kube, api_path  # noqa: E402
from memstrata.operator.nodes import node_view  # noqa: E402
from memstrata.operator.reconciler import Reconciler  # noqa: E402

NS = "conflicts"


@pytest.fixture(scope="module")
def conflict_cluster(quiet_cluster: ControlPlane) -> ControlPlane:
    quiet_cluster.create_namespace(NS)
    for name in ("n1", "n2"):
        quiet_cluster.apply(memstrata_node(name, inventory(name, dram_gib=1024, gpus=2)))
    return quiet_cluster


class ConcurrentWriter(Kube):
    """The real client; before the first finalizer patch of a job, another writer labels the job."""

    bumped = 0

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        if "finalizers" in (patch.get("metadata") or {}) and not self.bumped:
            self.bumped += 1
            await super().merge_patch(path, {"metadata": {"labels": {"example.test/touched": "yes"}}})
        return await super().merge_patch(path, patch)


async def _reconcile_until_settled(cp: ControlPlane, name: str) -> tuple[int, list[str]]:
    kube = ConcurrentWriter.from_config(str(cp.kubeconfig))
    try:
        reconciler = Reconciler(kube)
        views = [node_view(n) for n in await kube.list(api_path("v1", "nodes"))]
        reconciler.nodes = lambda: views
        key, conflicts, outcomes = (NS, name), 0, []
        for _ in range(4):
            try:
                await reconciler.reconcile(key)
                outcomes.append("ok")
            except Conflict:
                conflicts += 1
                outcomes.append("conflict")
                reconciler._bodies.pop(key, None)  # what the work loop does on a 409
            # What the watch would deliver: the job as it is now.
            reconciler.observe_job(await kube.get(api_path(API_VERSION, PLURAL, NS, name)))
        return conflicts + kube.bumped, outcomes
    finally:
        await kube.close()


def test_a_conflict_on_the_finalizer_patch_does_not_place_the_job_twice(conflict_cluster: ControlPlane) -> None:
    cp = conflict_cluster
    apply_yaml(cp, job("once"), NS)
    conflicts, outcomes = asyncio.run(_reconcile_until_settled(cp, "once"))
    assert conflicts >= 2, f"the 409 never happened, so this test proved nothing: {outcomes}"

    uid = cp.get_json("ftj", "once", "-n", NS)["metadata"]["uid"]
    pods = json.loads(cp.kubectl("get", "pods", "-n", NS, "-l", names.selector(uid), "-o", "json"))["items"]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    # The node the pod is pinned to (the scheduler may not have bound it yet).
    terms = pods[0]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (node,) = next(e["values"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]
                   if e["key"] == "kubernetes.io/hostname")
    config = json.loads(cp.get_json("configmap", names.configmap_name("once", uid), "-n", NS)["data"]["runtime-config.json"])
    status = cp.get_json("ftj", "once", "-n", NS)["status"]
    assert config["node"] == node and status["node"] == node, (config["node"], status["node"], node)


async def _reconcile_on(cp: ControlPlane, name: str, cached: dict[str, Any] | None) -> None:
    kube = Kube.from_config(str(cp.kubeconfig))
    try:
        reconciler = Reconciler(kube)
        views = [node_view(n) for n in await kube.list(api_path("v1", "nodes"))]
        reconciler.nodes = lambda: views
        if cached is not None:
            reconciler.observe_job(cached)  # what a lagging watch left in the cache
        await reconciler.reconcile((NS, name))
    finally:
        await kube.close()


def test_a_deadline_raised_after_the_cache_was_filled_does_not_kill_the_pod(conflict_cluster: ControlPlane) -> None:
    """A pod is deleted for a deadline only if the job as it is now says so: the cached copy still
    has the old deadline, the API server the raised one."""
    cp = conflict_cluster
    apply_yaml(cp, job("raised", run_policy={"activeDeadlineSeconds": 2}), NS)
    asyncio.run(_reconcile_on(cp, "raised", None))
    for _ in range(2):  # finalizer and status settle; the pod exists
        asyncio.run(_reconcile_on(cp, "raised", None))
    stale = cp.get_json("ftj", "raised", "-n", NS)
    uid = stale["metadata"]["uid"]
    assert stale["status"].get("startTime") and stale["status"]["activePod"] == "raised-0", stale["status"]
    cp.kubectl("patch", "ftj", "raised", "-n", NS, "--type=merge",
               "-p", '{"spec":{"runPolicy":{"activeDeadlineSeconds":3600}}}')
    time.sleep(3)  # the old deadline has passed
    asyncio.run(_reconcile_on(cp, "raised", stale))

    pods = json.loads(cp.kubectl("get", "pods", "-n", NS, "-l", names.selector(uid), "-o", "json"))["items"]
    assert [p["metadata"]["name"] for p in pods] == ["raised-0"]
    assert not pods[0]["metadata"].get("deletionTimestamp"), "the pod was deleted on a stale copy of the job"
    assert cp.get_json("ftj", "raised", "-n", NS)["status"]["phase"] != "Failed"

    # The same reconcile on a stale copy still acts when the job as it is now agrees: the deadline
    # is enforced (this is what makes the assertion above mean something).
    cp.kubectl("patch", "ftj", "raised", "-n", NS, "--type=merge",
               "-p", '{"spec":{"runPolicy":{"activeDeadlineSeconds":1}}}')
    asyncio.run(_reconcile_on(cp, "raised", stale))
    status = cp.get_json("ftj", "raised", "-n", NS)["status"]
    assert status["phase"] == "Failed" and "activeDeadlineSeconds" in status["message"], status

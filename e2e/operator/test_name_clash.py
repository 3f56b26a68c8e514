"""A user who may create FineTuneJobs must not get a job to run as — or delete — an object that is
not the job's own. The clashing object is made under the exact name the operator would use (its
suffix comes from the job's UID, so the job is created suspended to learn it first)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from e2e.operator.harness import apply_yaml, ftj, job, pods_of, wait
from memstrata.operator import names

pytestmark = pytest.mark.cluster


def _victim(kind: str, name: str, ns: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": ns, "labels": {"owner": "someone-else"}}
    if kind == "ServiceAccount":
        return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}


@pytest.mark.parametrize("kind", ["ServiceAccount", "Pod"])
def test_an_object_under_the_jobs_name_is_never_adopted(memstrata_cluster, operator, ns, nodes, kind):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("clash", run_policy={"suspend": True}), ns)
    uid = wait("the job's UID", lambda: ftj(cluster, ns, "clash")["metadata"].get("uid"))
    name = names.runtime_account_name("clash", uid) if kind == "ServiceAccount" else names.pod_name("clash", 0)
    cluster.kubectl("create", "-f", "-", input=json.dumps(_victim(kind, name, ns)))
    before = cluster.get_json(kind.lower(), name, "-n", ns)["metadata"]

    cluster.kubectl("patch", "ftj", "clash", "-n", ns, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":false}}}')
    status = wait("the job Failed", lambda: (s := ftj(cluster, ns, "clash").get("status") or {}).get("phase") == "Failed"
                  and s, timeout=60)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NameClash" and f"{kind} {ns}/{name}" in failed["message"], failed
    after = cluster.get_json(kind.lower(), name, "-n", ns)["metadata"]
    assert after.get("ownerReferences") is None and after["labels"] == before["labels"], after
    # No pod of the job runs with that identity (a foreign pod is not counted as the job's).
    assert [p for p in pods_of(cluster, ns, "clash")] == []

    cluster.kubectl("delete", "ftj", "clash", "-n", ns, "--wait=true", timeout=60)
    survivor = cluster.get_json(kind.lower(), name, "-n", ns)["metadata"]
    assert survivor["uid"] == before["uid"] and not survivor.get("deletionTimestamp"), "deleting the job deleted it"
    cluster.kubectl("delete", kind.lower(), name, "-n", ns, "--wait=false")

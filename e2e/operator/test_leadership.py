"""Two replicas: only the one holding the Lease acts, and none acts on an outdated copy of a job.

The defect these guard against: a replica that was not the active one still ran the operator's own
timers on its stale copy of a job, and deleted a running pod at the job's old
activeDeadlineSeconds after the user had raised it.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.operator.conftest import wait_active
from e2e.operator.harness import OperatorProcess, apply_yaml, ftj, job, lease_holder, pods_of, wait

pytestmark = pytest.mark.cluster
OLD_DEADLINE = 15


@pytest.fixture
def standby(memstrata_cluster: Any, operator: OperatorProcess, tmp_path: Path) -> Iterator[OperatorProcess]:
    """A second replica, standing by while `operator` leads; afterwards `operator` leads again."""
    cluster = memstrata_cluster
    other = OperatorProcess(cluster.kubeconfig, tmp_path / "standby.log", "standby").start()
    try:
        wait("the standby to see the leader", lambda: "stands by" in other.log.read_text(), timeout=60)
        yield other
    finally:
        if not operator.alive():
            operator.start()
        else:
            operator.signal(signal.SIGCONT)
        other.stop(signal.SIGTERM)  # a graceful exit gives the Lease up at once
        wait_active(cluster, operator)


def _running_job(cluster: Any, ns: str, name: str) -> dict[str, Any]:
    apply_yaml(cluster, job(name, run_policy={"activeDeadlineSeconds": OLD_DEADLINE}), ns)
    wait(f"{name} Running", lambda: (ftj(cluster, ns, name).get("status") or {}).get("phase") == "Running")
    return pods_of(cluster, ns, name)[0]


def _raise_deadline(cluster: Any, ns: str, name: str) -> None:
    cluster.kubectl("patch", "ftj", name, "-n", ns, "--type=merge",
                    "-p", '{"spec":{"runPolicy":{"activeDeadlineSeconds":3600}}}')


def _past_old_deadline(cluster: Any, ns: str, name: str) -> None:
    start = ftj(cluster, ns, name)["status"]["startTime"]
    started = time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    time.sleep(max(0.0, started + OLD_DEADLINE + 3 - time.time()))


def _assert_survived(cluster: Any, ns: str, name: str, pod: dict[str, Any]) -> None:
    pods = pods_of(cluster, ns, name)
    assert [p["metadata"]["uid"] for p in pods] == [pod["metadata"]["uid"]], "the pod was replaced"
    assert not pods[0]["metadata"].get("deletionTimestamp"), "the pod was deleted at the old deadline"
    status = ftj(cluster, ns, name)["status"]
    assert status["phase"] == "Running" and status["attempts"] == 1, status


def test_a_frozen_leader_that_thaws_after_the_old_deadline_does_not_act(memstrata_cluster, operator, standby, ns,
                                                                       nodes):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=2)
    pod = _running_job(cluster, ns, "frozen")
    operator.signal(signal.SIGSTOP)  # frozen with a timer set for the old deadline, as a paused replica
    _raise_deadline(cluster, ns, "frozen")
    wait("the standby to take the Lease over", lambda: lease_holder(cluster) == standby.identity, timeout=30)
    _past_old_deadline(cluster, ns, "frozen")
    operator.signal(signal.SIGCONT)  # its overdue timers fire now
    wait("the thawed replica to notice it lost the Lease", lambda: "lost by" in operator.tail(200), timeout=20)
    time.sleep(3)
    _assert_survived(cluster, ns, "frozen", pod)
    assert lease_holder(cluster) == standby.identity


def test_a_hand_over_between_raise_and_old_deadline_keeps_the_pod(memstrata_cluster, operator, standby, ns, nodes):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=2)
    pod = _running_job(cluster, ns, "handed")
    _raise_deadline(cluster, ns, "handed")
    operator.stop(signal.SIGKILL)  # the leader dies holding the Lease: the standby waits it out
    wait("the standby to take the Lease over", lambda: lease_holder(cluster) == standby.identity, timeout=30)
    _past_old_deadline(cluster, ns, "handed")
    _assert_survived(cluster, ns, "handed", pod)
    # The new leader does act: a job submitted now runs.
    apply_yaml(cluster, job("after"), ns)
    wait("after Running under the new leader",
         lambda: (ftj(cluster, ns, "after").get("status") or {}).get("phase") == "Running", timeout=60)


def test_only_the_lease_holder_writes(memstrata_cluster, operator, standby, ns, nodes):
    """Both replicas watch the same jobs, yet each job gets one pod; a graceful exit gives the Lease up,
    so the standby leads without waiting the lease out."""
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=4)
    for name in ("one", "two"):
        apply_yaml(cluster, job(name), ns)
    wait("both Running", lambda: all((ftj(cluster, ns, n).get("status") or {}).get("phase") == "Running"
                                      for n in ("one", "two")))
    began = time.monotonic()
    leader = operator.identity
    operator.stop(signal.SIGTERM)
    # It gave the Lease up on its way out (else the standby would wait the lease out).
    assert lease_holder(cluster) in ("", standby.identity), f"{leader} exited still holding the Lease"
    wait("the standby to lead", lambda: lease_holder(cluster) == standby.identity, timeout=30, interval=0.1)
    handover = time.monotonic() - began
    assert "acquired by standby" in standby.tail(200)
    apply_yaml(cluster, job("three"), ns)
    wait("three Running", lambda: (ftj(cluster, ns, "three").get("status") or {}).get("phase") == "Running")
    assert {n: [p["metadata"]["name"] for p in pods_of(cluster, ns, n)] for n in ("one", "two", "three")} == {
        "one": ["one-0"], "two": ["two-0"], "three": ["three-0"]}
    print(f"graceful hand-over took {handover:.1f}s (lease duration 6s)")

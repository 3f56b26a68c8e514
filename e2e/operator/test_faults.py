"""Cluster faults a controller must survive, each against the real control plane with the operator as
a real process: the API server restarted mid-burst, the operator's connections (watches included)
cut, the operator SIGKILLed at random points, a namespace deleted with jobs in it.

Expected of each: no duplicate pod, no lost or wedged job, every job reaches a phase. Each test
prints its figure.
"""
from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster.proxy import Relay
from e2e.operator.conftest import wait_active
from e2e.operator.harness import OperatorProcess, ftj, job, mid_transition, wait

pytestmark = pytest.mark.cluster


def _phases(cluster: Any, ns: str) -> dict[str, str | None]:
    items = cluster.get_json("ftj", "-n", ns)["items"]
    return {i["metadata"]["name"]: (i.get("status") or {}).get("phase") for i in items}


def _pods(cluster: Any, ns: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for p in cluster.get_json("pods", "-n", ns)["items"]:
        if not p["metadata"].get("deletionTimestamp"):
            out.setdefault(p["metadata"]["ownerReferences"][0]["name"], []).append(p["metadata"]["name"])
    return out


def _submit(cluster: Any, ns: str, docs: list[dict[str, Any]], check: bool = True) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
                    timeout=180, check=check)


def _all(cluster: Any, ns: str, n: int, phase: str = "Running") -> bool:
    return list(_phases(cluster, ns).values()).count(phase) == n


def _settled(cluster: Any, ns: str, n: int, operator: OperatorProcess, timeout: float) -> None:
    """Wait until all n jobs are Running; on timeout, say where each straggler stands."""
    try:
        wait(f"all {n} Running", lambda: _all(cluster, ns, n), timeout=timeout, interval=1)
    except AssertionError as exc:
        lines = []
        pods = {p["metadata"]["name"]: p for p in cluster.get_json("pods", "-n", ns)["items"]}
        for item in cluster.get_json("ftj", "-n", ns)["items"]:
            status = item.get("status") or {}
            if status.get("phase") != "Running":
                mine = [(k, v["spec"].get("nodeName"), (v.get("status") or {}).get("phase")) for k, v in pods.items()
                        if k.rsplit("-", 1)[0] == item["metadata"]["name"]]
                lines.append(f"{item['metadata']['name']}: {status.get('phase')} ({status.get('message')}); pods {mine}")
        raise AssertionError(f"{exc}\n" + "\n".join(lines[:20]) + f"\n{operator.tail(40)}") from None


def _assert_one_pod_each(cluster: Any, ns: str, names: list[str], attempt: int = 0) -> None:
    per_job = _pods(cluster, ns)
    duplicates = {j: p for j, p in per_job.items() if len(p) > 1}
    assert not duplicates, f"duplicate pods: {duplicates}"
    assert sorted(per_job) == sorted(names), f"jobs without a pod: {sorted(set(names) - set(per_job))}"
    wrong = {j: p for j, p in per_job.items() if p != [f"{j}-{attempt}"]}
    assert not wrong, f"pods of an unexpected attempt: {wrong}"


@contextmanager
def instead_of(operator: OperatorProcess, other: OperatorProcess, cluster: Any) -> Iterator[OperatorProcess]:
    """Run `other` as the only operator; the session's operator leads again afterwards."""
    operator.stop(signal.SIGTERM)  # gives the Lease up at once
    other.start()
    try:
        wait_active(cluster, other)
        yield other
    finally:
        other.stop(signal.SIGTERM)
        print(f"\n[{other.name}] log tail:\n{other.tail(15)}")
        operator.start()
        wait_active(cluster, operator)


def test_api_server_restarted_during_50_reconciling_jobs(memstrata_cluster, operator, ns, nodes):
    cluster = memstrata_cluster
    n = 50
    for i in range(-(-n // 4)):
        nodes.add(f"r{i:02d}", dram_gib=64, gpus=4)
    names = [f"r{i:02d}" for i in range(n)]
    docs = [job(name) for name in names]
    submitter = threading.Thread(target=_submit, args=(cluster, ns, docs[:25], False))
    submitter.start()  # half the burst is still arriving when the API server goes down
    wait("the first pods", lambda: _pods(cluster, ns), timeout=60, interval=0.05)
    pending = [name for name, phase in _phases(cluster, ns).items() if phase != "Running"]
    before = len(_pods(cluster, ns))
    down = cluster.restart_apiserver(down_seconds=3)
    submitter.join()
    _submit(cluster, ns, docs)  # what a user does after an error: apply again (idempotent)
    assert pending, "every job was Running before the restart: it interrupted nothing"
    began = time.monotonic()
    _settled(cluster, ns, n, operator, timeout=240)
    _assert_one_pod_each(cluster, ns, names)
    assert operator.alive(), operator.tail()
    assert all(ftj(cluster, ns, name)["status"]["attempts"] == 1 for name in names[:5])
    print(f"API server down {down:.1f}s with {before}/{n} pods created and {len(pending)} jobs not yet Running; "
          f"all {n} Running "
          f"{time.monotonic() - began:.1f}s after it came back; 0 duplicate pods, 0 lost jobs")


def test_cut_connections_lose_no_change(memstrata_cluster, operator, ns, nodes, tmp_path: Path):
    """Every connection of the operator (its watches and any request in flight) is reset while users
    change jobs: what happened while it was blind is still acted on."""
    cluster = memstrata_cluster
    nodes.add("w0", dram_gib=64, gpus=4)
    nodes.add("w1", dram_gib=64, gpus=4)
    relay = Relay(cluster.server)
    proxied = OperatorProcess(relay.kubeconfig(cluster.kubeconfig, tmp_path / "relayed.kubeconfig"),
                              tmp_path / "relayed.log", "relayed")
    names = [f"w{i}" for i in range(6)]
    try:
        with instead_of(operator, proxied, cluster):
            _submit(cluster, ns, [job(name) for name in names])
            wait("all Running", lambda: _all(cluster, ns, len(names)), timeout=90)
            cut = relay.drop()
            for name in names[:3]:  # suspended while the operator cannot see
                cluster.kubectl("patch", "ftj", name, "-n", ns, "--type=merge",
                                "-p", '{"spec":{"runPolicy":{"suspend":true}}}')
            cut += relay.drop()
            for name in names[3:]:  # their pods vanish while it cannot see: each is a failed attempt
                cluster.kubectl("delete", "pod", f"{name}-0", "-n", ns, "--grace-period=0", "--force", "--wait=false")
            cut += relay.drop()
            began = time.monotonic()
            expected = {**{n_: "Suspended" for n_ in names[:3]}, **{n_: "Running" for n_ in names[3:]}}
            seen: list[Any] = []

            def converged() -> bool:
                seen[:] = [_phases(cluster, ns), _pods(cluster, ns)]
                return seen[0] == expected and sorted(seen[1]) == names[3:]

            try:
                wait("the suspensions and the retries acted on", converged, timeout=120, interval=0.5)
            except AssertionError as exc:
                raise AssertionError(f"{exc}: phases and pods {seen}\n{proxied.tail(40)}") from None
            _assert_one_pod_each(cluster, ns, names[3:], attempt=1)
            for name in names[3:]:
                status = ftj(cluster, ns, name)["status"]
                assert status["failedPods"] == [f"{name}-0"] and status["attempts"] == 2, status
            print(f"{cut} connections reset in three cuts; converged {time.monotonic() - began:.1f}s after "
                  f"the last; 0 duplicate pods, 0 lost changes")
    finally:
        relay.close()


def test_operator_sigkilled_at_random_points_across_200_jobs(memstrata_cluster, operator, ns, nodes, tmp_path: Path):
    cluster = memstrata_cluster
    n = 200
    for i in range(n // 4):
        nodes.add(f"k{i:02d}", dram_gib=64, gpus=4)
    names = [f"k{i:03d}" for i in range(n)]
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # A short Lease so each restart waits seconds, not the production 15 s.
    victim = OperatorProcess(cluster.kubeconfig, tmp_path / "victim.log", "victim", "--lease-duration-seconds",
                             "3", "--renew-deadline-seconds", "2", "--retry-period-seconds", "0.5")
    kills = landed = 0
    with instead_of(operator, victim, cluster):
        for wave in range(10):  # 20 new jobs a wave, and a kill while they are being handled
            batch = [job(name) for name in names[wave * 20:(wave + 1) * 20]]
            submitter = threading.Thread(target=_submit, args=(cluster, ns, batch))
            submitter.start()
            time.sleep(rng.uniform(0.3, 1.5))
            victim.stop(signal.SIGKILL)
            kills += 1
            landed += mid_transition(cluster, ns) > 0
            submitter.join()
            victim.start()
            wait_active(cluster, victim)
        _settled(cluster, ns, n, victim, timeout=240)
    assert landed >= 3, f"only {landed} of {kills} kills landed mid-transition (seed {seed}): this proved little"
    _assert_one_pod_each(cluster, ns, names)
    per_node: dict[str, int] = {}
    for p in cluster.get_json("pods", "-n", ns)["items"]:
        per_node[p["spec"]["nodeName"]] = per_node.get(p["spec"]["nodeName"], 0) + 1
    assert max(per_node.values()) <= 4 and len(per_node) == n // 4, per_node  # within each node's GPUs, spread
    print(f"{kills} SIGKILLs (seed {seed}), {landed} landed mid-transition; {n}/{n} jobs Running; "
          "0 duplicate pods, 0 lost or wedged jobs")


def test_deleting_a_namespace_with_jobs_in_it(memstrata_cluster, operator, ns, nodes):
    cluster = memstrata_cluster
    nodes.add("d0", dram_gib=64, gpus=4)
    nodes.add("d1", dram_gib=64, gpus=4)
    doomed = f"{ns}-doomed"
    cluster.create_namespace(doomed)
    _submit(cluster, doomed, [job(f"d{i}") for i in range(6)])
    _submit(cluster, ns, [job("bystander")])
    wait("the doomed jobs Running", lambda: _all(cluster, doomed, 6), timeout=90)
    wait("the bystander Running", lambda: _all(cluster, ns, 1), timeout=60)
    began = time.monotonic()
    cluster.kubectl("delete", "namespace", doomed, "--wait=false")

    def gone() -> bool:
        return cluster.find_json("namespace", doomed) is None

    try:
        wait(f"namespace {doomed} gone", gone, timeout=180, interval=1)
    except AssertionError:
        left = cluster.kubectl("get", "ftj,pods", "-n", doomed, "-o", "wide", check=False)
        raise AssertionError(f"namespace {doomed} wedged; left:\n{left}\n{operator.tail(30)}") from None
    took = time.monotonic() - began
    assert _phases(cluster, ns) == {"bystander": "Running"} and _pods(cluster, ns) == {"bystander": ["bystander-0"]}
    print(f"namespace with 6 running jobs deleted in {took:.1f}s; no job wedged its deletion")

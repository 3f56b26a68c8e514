"""Fixtures for the operator against the real control plane: the CRD and the rest of the chart,
kwok stages standing in for the runtime, and `memstrata operator` running as a subprocess."""
from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster.controlplane import ControlPlane, bin_dir_from_env
from e2e.cluster.kwok import pod_failure_stage
from e2e.kueue.peer import Kueue, kueue_dir_from_env
from e2e.lifetime import until_group_ends
from e2e.operator.harness import (
    CHART, CRD, LEASE, OperatorProcess, claims, inventory, lease_holder, memstrata_node, succeed_stage,
)

try:  # the operator's own dependencies; without them it cannot run at all
    import kopf  # noqa: F401
    import kubernetes  # noqa: F401
    MISSING = ""
except ImportError as exc:  # pragma: no cover - depends on the venv
    MISSING = f"the operator's dependencies are not installed ({exc}); run `make install`"


@pytest.fixture(scope="session")
def memstrata_cluster(cluster: Any) -> Any:
    """The control plane with the FineTuneJob CRD (the chart's, as a user installs it) and the kwok
    stages that play the runtime's part."""
    if MISSING:
        pytest.skip(MISSING)
    # MEMSTRATA_E2E_CRD only for developing against a CRD not yet committed; by default the test
    # installs exactly what a user installs.
    crd = os.environ.get("MEMSTRATA_E2E_CRD", str(CRD))
    cluster.kubectl("apply", "--server-side", "-f", crd)
    cluster.wait_established("finetunejobs.memstrata.dev")
    cluster.apply(succeed_stage(), pod_failure_stage())
    install_status_policy(cluster)
    return cluster


def install_status_policy(cluster: Any) -> None:
    """The chart's admission policy on what a job's runtime may write into its status, as installed."""
    cluster.kubectl("apply", "-f", "-", input=cluster.helm(
        "template", "memstrata", str(CHART), "--namespace", "memstrata-system", "--kube-version", "v1.36.4",
        "--show-only", "templates/runtime-status-policy.yaml"))


@pytest.fixture(scope="session")
def quiet_cluster() -> Iterator[ControlPlane]:
    """A control plane of its own, with memstrata's CRD and status policy, that no operator watches:
    for tests in which the test itself (or an in-process reconciler) must be the only writer."""
    bin_dir, reason = bin_dir_from_env()
    if bin_dir is None:
        pytest.skip(f"no real control plane: {reason}")
    cp = ControlPlane(bin_dir)
    cp.start()
    stop = until_group_ends("cluster", cp.stop)
    try:
        cp.kubectl("apply", "--server-side", "-f", str(CRD))
        cp.wait_established("finetunejobs.memstrata.dev")
        install_status_policy(cp)
        yield cp
    finally:
        stop()


@pytest.fixture(scope="session")
def kueue_peer(memstrata_cluster: Any) -> Iterator[Kueue | None]:
    """Kueue's controller (e2e.kueue.peer) on the session's control plane, when it can run here: the operator then
    runs with --kueue for every test, as in a cluster that has Kueue. None without it: the operator runs without
    --kueue, and the Kueue tests are skipped (failed under CI=true, by the `kueue` fixture)."""
    kueue_dir, _ = kueue_dir_from_env()
    if kueue_dir is None:
        yield None
        return
    peer = Kueue(memstrata_cluster, kueue_dir).start()
    print(f"\n[kueue] {kueue_dir.name} serving its webhooks in {peer.startup_seconds:.1f} s (log {peer.log})")
    stop = until_group_ends("cluster", peer.stop)
    try:
        yield peer
    finally:
        stop()


@pytest.fixture
def kueue(kueue_peer: Kueue | None) -> Kueue:
    if kueue_peer is None:
        reason = f"no Kueue: {kueue_dir_from_env()[1]}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"Kueue is required under CI: {reason}")
        pytest.skip(reason)
    return kueue_peer


@pytest.fixture(scope="session")
def operator(memstrata_cluster: Any, kueue_peer: Kueue | None,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    op = OperatorProcess(memstrata_cluster.kubeconfig, log, "op", *(["--kueue"] if kueue_peer else [])).start()

    def stop() -> None:
        op.stop()
        print(f"\n[operator] log: {log}\n{op.tail(30)}")

    stop = until_group_ends("cluster", stop)
    try:
        wait_active(memstrata_cluster, op)
        yield op
    finally:
        stop()


def wait_active(cluster: Any, op: OperatorProcess, timeout: float = 60) -> None:
    """The operator acts once it holds the Lease."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not op.alive():
            raise AssertionError(f"the operator exited with {op.proc.returncode if op.proc else '?'}:\n{op.tail()}")
        if lease_holder(cluster) == op.identity:
            time.sleep(1.0)  # its indices fill as its watches start
            return
        time.sleep(0.25)
    raise AssertionError(f"the operator did not acquire Lease default/{LEASE} in {timeout:.0f}s "
                         f"(held by {lease_holder(cluster)!r}):\n{op.tail()}")


class Nodes:
    """memstrata nodes for one test (created Ready, deleted after the test's jobs are gone)."""

    def __init__(self, fake_nodes: Any) -> None:
        self._fake = fake_nodes
        self.suffix = uuid.uuid4().hex[:5]

    def add(self, name: str, **inv: Any) -> str:
        full = f"{name}-{self.suffix}"
        manifest = memstrata_node(full, inventory(full, **inv))
        meta = manifest["metadata"]
        self._fake.create(full, labels=meta["labels"], annotations={
            k: v for k, v in meta["annotations"].items() if not k.startswith("kwok")},
            capacity=manifest["status"]["capacity"])
        return full


@pytest.fixture
def nodes(fake_nodes: Any) -> Nodes:
    return Nodes(fake_nodes)


@pytest.fixture
def ns(memstrata_cluster: Any, operator: OperatorProcess, nodes: Nodes) -> Iterator[str]:
    """A fresh namespace whose jobs are deleted — and their pods gone — before the test's nodes go,
    so no test leaves capacity taken for the next."""
    cluster = memstrata_cluster
    name = f"ftj-{uuid.uuid4().hex[:8]}"
    cluster.create_namespace(name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "finetunejobs", "--all", "-n", name, "--wait=false", timeout=300)
        try:
            cluster.wait_for(f"pods of namespace {name} gone",
                             lambda: not cluster.get_json("pods", "-n", name)["items"], timeout=180)
        finally:
            cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def example_claims(memstrata_cluster: Any, ns: str) -> Iterator[list[str]]:
    """The claims examples/finetune.yaml mounts, bound, in the test's namespace."""
    pvs = claims(memstrata_cluster, ns)
    try:
        yield pvs
    finally:  # released once the namespace's claims are gone
        memstrata_cluster.kubectl("delete", "pv", "--wait=false", "--ignore-not-found", *pvs)

"""Fixtures for tests against the real control plane (marker `cluster`).

    def test_x(cluster, fake_nodes, namespace):
        fake_nodes.create("n1", labels={...}, capacity={"memstrata.dev/nvme-ns": "2"})
        cluster.apply(pod_manifest)            # in `namespace`
        cluster.get_json("pod", "p", "-n", namespace)

`cluster` is one ControlPlane for the whole session; it is skipped with the
reason when `make cluster-bins` has not been run.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.cluster.controlplane import ControlPlane, bin_dir_from_env
from e2e.cluster.kwok import fake_node
from e2e.lifetime import until_group_ends


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    bin_dir, reason = bin_dir_from_env()
    if bin_dir is None:
        pytest.skip(f"no real control plane: {reason}")
    cp = ControlPlane(bin_dir)
    cp.start()
    _say(request, f"[cluster] control plane up in {cp.startup_seconds:.1f} s at {cp.server} (work dir {cp.workdir}; phases {cp.phase_seconds})")
    def stop() -> None:
        # After a failure the component logs usually say why: show and keep them.
        failed = request.session.testsfailed > 0
        if failed:
            _say(request, f"[cluster] tests failed; component logs kept in {cp.workdir}\n{cp.logs_tail()}")
        cp.stop(keep_workdir=failed)

    stop = until_group_ends("cluster", stop)
    try:
        yield cp
    finally:
        stop()


def _say(request: pytest.FixtureRequest, line: str) -> None:
    # Straight to the terminal: pytest captures fixture output at the fd level.
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print("\n" + line, flush=True)


class FakeNodes:
    """Creates kwok-managed nodes and deletes them when the test ends."""

    def __init__(self, cluster: ControlPlane) -> None:
        self._cluster = cluster
        self.names: list[str] = []

    def create(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        capacity: dict[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
        timeout: float = 30,
    ) -> dict[str, Any]:
        """Create a fake node and wait until kwok reports it Ready; returns the Node."""
        manifest = fake_node(name, labels=labels, annotations=annotations, capacity=capacity, taints=taints)
        self._cluster.create(manifest)
        self.names.append(name)
        node: dict[str, Any] = {}

        def ready() -> bool:
            node.update(self._cluster.get_json("node", name))
            conds = node.get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        self._cluster.wait_for(f"fake node {name} Ready", ready, timeout=timeout)
        return node

    def delete_all(self) -> None:
        if self.names:
            self._cluster.kubectl("delete", "node", "--ignore-not-found", "--wait=false", *self.names)
            self.names.clear()


@pytest.fixture
def fake_nodes(cluster: ControlPlane) -> Iterator[FakeNodes]:
    nodes = FakeNodes(cluster)
    try:
        yield nodes
    finally:
        nodes.delete_all()


@pytest.fixture
def namespace(cluster: ControlPlane) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount) per test."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.create_namespace(name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false")

"""Fixtures for the real node (marker `realnode`): a control plane that advertises the host's address,
one node whose kubelet, containerd and runc run real containers, memstrata's images built here and
imported, and the chart installed with `helm install` as a user installs it.

    def test_x(real_cluster: RealCluster): real_cluster.cp.kubectl(...); real_cluster.node.restart_kubelet()

One of each per session (the kubelet's paths are fixed): tests share the node, each in its own
namespace. Missing pieces (kubelet not built, not root, no containerd) skip with the reason, and fail
under CI=true: `make test` builds them.
"""
from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster.controlplane import ControlPlane, bin_dir_from_env, cache_root, cluster_versions
from e2e.conftest import _say
from e2e.lifetime import until_group_ends
from e2e.scrape import Samples, parse
from memstrata.api.serving import METRICS_PORT
from e2e.realnode.images import ImageSet
from e2e.realnode.jobs import JobStorage
from e2e.realnode.node import NodeBins, RealNode, host_address, use_node_tools

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "memstrata"
RELEASE_NS = "memstrata-system"
LOOP_BYTES = 2 << 30  # each "namespace": sparse, so only what a job writes takes disk
LOOPS = 2


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the real node is required under CI: {reason}")
    pytest.skip(f"no real node: {reason}")


@dataclass
class RealCluster:
    cp: ControlPlane
    node: RealNode
    images: ImageSet
    loops: list[str] = field(default_factory=list)  # the loop devices the node agent offers (loopN)
    timings: dict[str, float] = field(default_factory=dict)

    def kubectl(self, *args: str, timeout: float = 60) -> str:
        return self.cp.kubectl(*args, timeout=timeout)

    def node_json(self) -> dict[str, Any]:
        return self.cp.get_json("node", self.node.name)

    def metrics(self, kind: str, name: str, port: int = METRICS_PORT) -> Samples:
        """A pod's (`kind` pods) or a Service's (`kind` services) /metrics, fetched through the API server's
        proxy as `kubectl get --raw` does, parsed as Prometheus parses it."""
        return parse(self.kubectl("get", "--raw", f"/api/v1/namespaces/{RELEASE_NS}/{kind}/{name}:{port}/proxy/metrics"))

    def agent_pod(self) -> dict[str, Any] | None:
        pods = self.cp.get_json("pods", "-n", RELEASE_NS, "-l", "app.kubernetes.io/component=node-agent")["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return live[0] if live else None


def helm_install(cp: ControlPlane, images: ImageSet, loops: list[str], *extra: str) -> None:
    """The chart, as a user installs it, with this machine's locally built images and its loop devices
    as the namespaces (the chart's test-and-development opt-in)."""
    cp.kubectl("create", "namespace", RELEASE_NS)
    # The node agent needs host /dev, /sys and hostPID (the chart's README: `privileged`).
    cp.kubectl("label", "namespace", RELEASE_NS, "pod-security.kubernetes.io/enforce=privileged")
    sets = []
    for key, ref in (("operator", images.operator), ("nodeAgent", images.node_agent)):
        repo, tag = ref.rsplit(":", 1)
        sets += ["--set", f"{key}.image.repository={repo}", "--set", f"{key}.image.tag={tag}",
                 "--set", f"{key}.image.pullPolicy=Never"]
    cp.helm("install", "memstrata", str(CHART), "--namespace", RELEASE_NS, *sets,
            "--set", f"nodeAgent.loopNamespaces={{{','.join(loops)}}}", "--set", "nodeAgent.rescanSeconds=2",
            # The device plugin's tests; test_realnode_dra.py switches the release to dra and back.
            "--set", "nodeAgent.deviceApi=device-plugin",
            "--set", "operator.reportIntervalSeconds=2",
            # This machine's runtime image, and the tests' own commands (a process that grows until OOMKilled).
            "--set", f"jobPolicy.images={{{images.runtime}}}", "--set", "jobPolicy.customCommands=true",
            *extra, "--wait", "--timeout", "5m", timeout=330)


@pytest.fixture(scope="session")
def real_cluster(request: pytest.FixtureRequest) -> Iterator[RealCluster]:
    bin_dir, reason = bin_dir_from_env()
    if bin_dir is None:
        _unavailable(reason)
    bins, reason = NodeBins.from_env()
    if bins is None:
        _unavailable(reason)
    use_node_tools(bins)
    from e2e.realnode.images import build_images, import_images, unavailable_reason

    why = unavailable_reason(cache_root())
    if why:
        _unavailable(why)
    began = time.monotonic()
    timings: dict[str, float] = {}
    images = build_images(cache_root())
    timings["images"] = time.monotonic() - began
    cp = ControlPlane(bin_dir, advertise_address=host_address())
    cp.start()
    # containerd's root (its images) per version: a 2.x store is not for an older containerd to open.
    node = RealNode(cp, bins, cache_root() / f"containerd-{cluster_versions()['CONTAINERD_VERSION']}")

    ok = False

    def stop() -> None:
        failed = not ok or request.session.testsfailed > 0
        if failed:
            _say(request, f"[realnode] logs kept in {cp.workdir}\n{node.logs_tail()}")
        try:
            node.stop()  # the loop devices too
        finally:
            cp.stop(keep_workdir=failed)

    stop = until_group_ends("realnode", stop)
    try:
        node.start_runtime(images.pause)
        t = time.monotonic()
        import_images(str(node.socket), images)
        timings["import"] = time.monotonic() - t
        t = time.monotonic()
        node.start()
        timings["node"] = time.monotonic() - t
        loops = node.loop_files.make(LOOPS, LOOP_BYTES)
        t = time.monotonic()
        helm_install(cp, images, loops)
        timings["helm"] = time.monotonic() - t
        rc = RealCluster(cp, node, images, loops, timings)
        _say(request, f"[realnode] node {node.name} up with the chart installed in {time.monotonic() - began:.1f} s "
                      f"({', '.join(f'{k} {v:.1f} s' for k, v in timings.items())})")
        ok = True
        yield rc
    finally:
        stop()


@pytest.fixture
def job_ns(real_cluster: RealCluster) -> Iterator[str]:
    """A namespace for one test's jobs, enforcing PodSecurity `restricted` (what the training pod must meet)."""
    name = f"rn-{uuid.uuid4().hex[:6]}"
    real_cluster.cp.create_namespace(name)
    real_cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")
    try:
        yield name
    finally:
        real_cluster.kubectl("delete", "finetunejobs", "--all", "-n", name, "--wait=false", timeout=120)
        real_cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory `make model` builds."""
    from tests.conftest import _smollm2_dir

    path = _smollm2_dir()
    if path is None:
        _unavailable("the SmolLM2-135M-Instruct model is not built: run `make model` (make test does)")
    assert path is not None
    return path


@pytest.fixture
def storage(real_cluster: RealCluster, job_ns: str, tmp_path: Path, smollm2_dir: Path) -> Iterator[JobStorage]:
    """One test's volumes in `job_ns`: the model (a copy of SmolLM2-135M-Instruct), the chat dataset in a
    ConfigMap (`storage.set_dataset` replaces it) and an empty output directory."""
    store = JobStorage(real_cluster.cp, job_ns, tmp_path / "volumes")
    store.create(smollm2_dir, (REPO / "examples" / "chat-skill.jsonl").read_text())
    try:
        yield store
    finally:
        store.delete()

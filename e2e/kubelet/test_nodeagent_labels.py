"""`memstrata nodeagent` labels its Node on a real kube-apiserver, and relabels it when a
namespace stops being free; the operator's `read_node` reads back exactly what was discovered."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from e2e.cluster.controlplane import ControlPlane
from e2e.conftest import FakeNodes
from memstrata.api.inventory import LABEL_NVME_FREE, read_node
from memstrata.node.discovery import dev_heads, discover

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CASE = REPO / "tests" / "data" / "sysfs" / "two-socket-cxl"
EXT4_HEAD = bytes(1024 + 56) + b"\x53\xef" + bytes(38) + (0x40).to_bytes(4, "little")


def test_node_is_labelled_and_relabelled(cluster: ControlPlane, fake_nodes: FakeNodes, tmp_path: Path) -> None:
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        pytest.skip("KUBERNETES CLIENT UNAVAILABLE — the node agent needs memstrata[operator] (make install)")
    root = tmp_path / "node"
    shutil.copytree(CASE, root, symlinks=True)
    fake_nodes.create("strata-1")
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "runtime")])}
    agent = subprocess.Popen(
        [sys.executable, "-m", "memstrata.cli", "nodeagent", "--", "--node-name", "strata-1",
         "--kubeconfig", str(cluster.kubeconfig), "--sysfs-root", str(root / "sys"), "--dev-root", str(root / "dev"),
         "--mountinfo", str(root / "proc" / "mounts"), "--swaps", str(root / "proc" / "swaps"),
         "--plugin-dir", str(plugin_dir), "--rescan-seconds", "0.5",
         "--nfd-dir", str(tmp_path / "no-nfd")],
        stderr=open(tmp_path / "agent.log", "w"), env=env)
    try:
        want = discover(root / "sys", heads=dev_heads(root / "dev"),
                        mounts_text=(root / "proc" / "mounts").read_text(),
                        swaps_text=(root / "proc" / "swaps").read_text(), hostname="strata-1")

        def labels() -> dict[str, str]:
            return cluster.get_json("node", "strata-1")["metadata"].get("labels", {})

        cluster.wait_for("node agent labels", lambda: labels().get(LABEL_NVME_FREE) == "3", timeout=30)
        assert read_node(cluster.get_json("node", "strata-1")) == want
        (root / "dev" / "nvme1n1.head").write_bytes(EXT4_HEAD.ljust(4096, b"\0"))
        cluster.wait_for("relabel after a filesystem appeared", lambda: labels().get(LABEL_NVME_FREE) == "2",
                         timeout=30)
        node = read_node(cluster.get_json("node", "strata-1"))
        assert next(n for n in node.nvme_namespaces if n.name == "nvme1n1").reason == "foreign signature: ext4"
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            agent.kill()
        shutil.rmtree(plugin_dir, ignore_errors=True)
        print((tmp_path / "agent.log").read_text()[-3000:])
    assert agent.returncode == 0

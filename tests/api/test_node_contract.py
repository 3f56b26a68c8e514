"""render_node and read_node are inverses, and the names they use are the ones users will see."""
from __future__ import annotations

import json

import pytest

from memstrata.api.manifest import load_node
from memstrata.api.inventory import (
    ANNOTATION_INVENTORY, RESOURCE_CXL_GIB, RESOURCE_NVME, NodeInventory, NodeNotManagedError, NvmeNamespace,
    read_node, render_node,
)


@pytest.fixture
def inventory(repo) -> NodeInventory:
    inv = load_node(repo / "examples/node-cxl.yaml")
    inv.nvme_namespaces.append(NvmeNamespace(name="nvme2n1", size_bytes=10**12, free=False, reason="mounted at /data"))
    return inv


def test_labels_annotation_and_capacity(inventory: NodeInventory) -> None:
    r = render_node(inventory)
    assert r["labels"] == {
        "memstrata.dev/managed": "true",
        "memstrata.dev/cxl": "true",
        "memstrata.dev/cxl-capacity-gib": "256",
        "memstrata.dev/cxl-node-count": "1",
        "memstrata.dev/nvme-free-count": "2",          # the mounted namespace is not offered
        "memstrata.dev/nvme-free-gib": "7152",         # 2 x 3.84e12 B = 7,680,000,000,000 / 2^30 = 7152.6
        "memstrata.dev/dram-gib": "512",
    }
    assert r["capacity"] == {"memstrata.dev/nvme-ns": "2", "memstrata.dev/cxl-gib": "256", "nvidia.com/gpu": "1"}
    assert RESOURCE_NVME in r["capacity"] and RESOURCE_CXL_GIB in r["capacity"]
    for key, value in r["labels"].items():      # label values must be valid Kubernetes label values
        assert len(value) <= 63 and value.replace("-", "").isalnum()


def test_read_node_inverts_render_node(inventory: NodeInventory) -> None:
    rendered = render_node(inventory)
    node = {"metadata": {"name": "gpu-node-01", "labels": rendered["labels"], "annotations": rendered["annotations"]},
            "status": {"capacity": rendered["capacity"]}}
    assert read_node(node) == inventory


def test_read_node_without_agent_names_the_node() -> None:
    with pytest.raises(NodeNotManagedError, match="node worker-7: no memstrata.dev/inventory annotation"):
        read_node({"metadata": {"name": "worker-7", "annotations": {}}})


def test_read_node_with_garbage_annotation_names_the_node() -> None:
    bad = {"metadata": {"name": "worker-8", "annotations": {ANNOTATION_INVENTORY: json.dumps({"numaNodes": 3})}}}
    with pytest.raises(NodeNotManagedError, match="node worker-8: unreadable"):
        read_node(bad)
    with pytest.raises(NodeNotManagedError, match="node worker-8: unreadable"):
        read_node({"metadata": {"name": "worker-8", "annotations": {ANNOTATION_INVENTORY: "{not json"}}})


def test_node_file_may_be_a_kubernetes_node(tmp_path, inventory: NodeInventory) -> None:
    import yaml

    rendered = render_node(inventory)
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": "n1", "labels": rendered["labels"], "annotations": rendered["annotations"]}}))
    assert load_node(path) == inventory

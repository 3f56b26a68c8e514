"""The node's labels and annotation, and a Node Feature Discovery feature file.

The names come from `memstrata.api.inventory.render_node`, the one place they are
spelt, so the operator that reads them back can never disagree. The node's
extended-resource capacity is not patched here: the kubelet sets it from the
device plugin's device lists.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from memstrata.api.inventory import OPTIONAL_LABELS, PREFIX, NodeInventory, render_node

NFD_FEATURES_DIR = Path("/etc/kubernetes/node-feature-discovery/features.d")
NFD_FILE = "memstrata"


def node_patch(inventory: NodeInventory) -> dict[str, Any]:
    """The merge patch that puts the inventory's labels and annotation on a Node.

    A label render_node sets only on some nodes is null in the patch where it is not set, which removes
    it: a node whose agent no longer advertises loop devices must stop saying it does."""
    rendered = render_node(inventory)
    labels: dict[str, str | None] = {**dict.fromkeys(OPTIONAL_LABELS), **rendered["labels"]}
    return {"metadata": {"labels": labels, "annotations": rendered["annotations"]}}


def nfd_features(inventory: NodeInventory) -> str:
    """`name=value` lines for NFD's local source.

    NFD only keeps prefixed names from namespaces it was told to allow, so the
    names are unprefixed (`memstrata-cxl=true`) and NFD publishes them as
    feature.node.kubernetes.io/memstrata-cxl; the memstrata.dev/ labels the
    agent sets itself are the ones the operator reads.
    """
    labels = render_node(inventory)["labels"]
    lines = ["# written by the memstrata node agent; rewritten on every change"]
    for key, value in sorted(labels.items()):
        lines.append(f"memstrata-{key.removeprefix(PREFIX + '/')}={value}")
    return "\n".join(lines) + "\n"


def write_atomically(path: Path, text: str) -> bool:
    """Replace `path` with `text` in one rename, so NFD never reads half a file.
    Returns False when the content was already there (nothing written)."""
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return True

"""Every optional top-level field of a FineTuneJob's spec, absent, present, added and removed, against
the real API server: nothing wedges the object (labels, finalizers and status writes keep working, the
operator gives it a phase), and immutable fields refuse a change with the message that says so.

A transition rule that reads `oldSelf.resources` fails with "no such key" when the field is absent,
and then every update of the object fails, including the operator's own finalizer and status patches.
"""
from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from e2e.operator.harness import apply_yaml, ftj, wait

pytestmark = pytest.mark.cluster

# field -> (a value a user would write, may it change after creation)
OPTIONAL: dict[str, tuple[Any, bool]] = {
    "resources": ({"gpus": 1}, False),
    "memory": ({"engine": "memstrata"}, False),
    "checkpoint": ({"path": "/ckpt", "everySteps": 2}, False),  # a retry resumes from where it says
    "image": ("registry.example/memstrata/runtime:custom", True),
    "command": (["memstrata", "pod"], True),
    "runPolicy": ({"backoffLimit": 2}, True),
}


def minimal(name: str, **fields: Any) -> dict[str, Any]:
    """The least a user can write, plus `fields`."""
    spec: dict[str, Any] = {
        "model": {"preset": "gpt-tiny"},
        "dataset": {"synthetic": "arithmetic"},
        "training": {"sequenceLength": 128, "microBatch": 8, "steps": 4},
    }
    spec.update(fields)
    return {"apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": name},
            "spec": spec}


def kubectl(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("present", [False, True], ids=["absent", "present"])
@pytest.mark.parametrize("field", list(OPTIONAL))
def test_the_job_stays_writable_and_gets_a_phase(memstrata_cluster: Any, ns: str, nodes: Any, field: str,
                                                 present: bool) -> None:
    cluster = memstrata_cluster
    nodes.add("roomy", dram_gib=64, gpus=2)
    name = f"{field.lower()}-{'present' if present else 'absent'}"
    apply_yaml(cluster, minimal(name, **({field: OPTIONAL[field][0]} if present else {})), ns)

    # A user's writes; the operator's (its finalizer, then status) are proven by the phase it sets.
    for args in (["label", "ftj", name, "team=a"],
                 ["annotate", "ftj", name, "example.test/owner=alice"],
                 ["patch", "ftj", name, "--subresource=status", "--type=merge", "-p", '{"status":{"observed":1}}']):
        proc = kubectl(cluster, "-n", ns, *args)
        assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
    wait(f"{name} to get a phase", lambda: (ftj(cluster, ns, name).get("status") or {}).get("phase"))
    obj = ftj(cluster, ns, name)
    assert obj["metadata"]["labels"]["team"] == "a" and obj["metadata"]["finalizers"], obj["metadata"]


@pytest.mark.parametrize("change", ["added", "removed"])
@pytest.mark.parametrize("field", list(OPTIONAL))
def test_adding_or_removing_follows_mutability(memstrata_cluster: Any, ns: str, field: str, change: str) -> None:
    cluster = memstrata_cluster
    value, mutable = OPTIONAL[field]
    name = f"{field.lower()}-{change}"
    # Suspended, so that the operator's own writes race nothing here; added after creation when it is
    # the field under test.
    suspended = {"runPolicy": {"suspend": True}} if field != "runPolicy" else {}
    apply_yaml(cluster, minimal(name, **suspended, **({field: value} if change == "removed" else {})), ns)
    if change == "added":
        patch = ["--type=merge", "-p", json.dumps({"spec": {field: value}})]
    else:
        patch = ["--type=json", "-p", json.dumps([{"op": "remove", "path": f"/spec/{field}"}])]
    proc = kubectl(cluster, "-n", ns, "patch", "ftj", name, *patch)
    if mutable:
        assert proc.returncode == 0, proc.stderr
        spec = ftj(cluster, ns, name)["spec"]
        if field == "image" and change == "removed":
            assert spec["image"] == "ghcr.io/memstrata/runtime:0.1.0"  # the schema's default fills it again
        else:
            got = spec.get(field)
            # The schema's defaults fill in what the user left out (runPolicy.suspend: false).
            has_value = isinstance(got, dict) and got.items() >= value.items() if isinstance(value, dict) \
                else got == value
            assert has_value == (change == "added"), spec
    else:
        assert proc.returncode != 0, f"spec.{field} {change} after creation was accepted"
        assert "immutable" in proc.stderr and f"spec.{field}" in proc.stderr, proc.stderr
        assert (field in ftj(cluster, ns, name)["spec"]) == (change == "removed")  # nothing half-applied

"""The strata registry (memstrata.api.strata) is the one list of strata: a stratum added there, and nowhere else,
shows in the plan and its table, in the Node's published resources, among the node agent's device plugins and
in what the operator fits to a node; and no other module spells the list again."""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from memstrata.api import strata
from memstrata.api.architecture import PRESETS
from memstrata.api.finetunejob import MemoryPolicy
from memstrata.api.inventory import NodeInventory, NumaNode, NvmeNamespace, render_node
from memstrata.api.strata import Bandwidth, Stratum
from memstrata.api.units import GiB
from memstrata.nodeagent.devices import grant, resources
from memstrata.operator import nodes
from memstrata.plan import JobShape, plan_for_node
from memstrata.plan.table import render_plan

REPO = Path(__file__).resolve().parents[2]
PMEM_RESOURCE = "memstrata.dev/pmem-gib"
# A persistent-memory stratum, as someone adding one would describe it: it may hold the 16-bit weights and is
# filled before CXL, DRAM and NVMe; the node has 6 GiB of it, published and served in whole GiB.
PMEM = Stratum(name="pmem", title="PMem", bandwidth=Bandwidth(read=8e9, write=3e9),
               holds=frozenset({"weights"}), preference=0, inventory_field="numa_nodes",
               facade="memstrata.runtime.strata.numa", node_bytes=lambda inv: 6 * GiB, resource=PMEM_RESOURCE,
               units=lambda inv: 6, served=True, unit_bytes=GiB, host_memory=False)
NODE = NodeInventory(numa_nodes=[NumaNode(id=0, cpus=[0, 1], memory_bytes=256 * GiB)],
                     nvme_namespaces=[NvmeNamespace(name="nvme0n1", size_bytes=1 << 40, free=True)])
JOB = JobShape(model=PRESETS["llama3-8b"], sequence_length=2048, micro_batch=1, gpus=0, engine="memstrata")
POLICY = MemoryPolicy(engine="memstrata", nvme_namespaces=1)


@pytest.fixture
def with_pmem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(strata, "REGISTRY", (*strata.REGISTRY, PMEM))


def test_the_registry_gives_todays_strata_their_order_bandwidth_and_preferences() -> None:
    assert strata.names() == ("hbm", "dram", "cxl", "nvme")
    assert set(strata.default_bandwidth()) == set(strata.names())
    assert NodeInventory().bw("nvme") == Bandwidth(read=6.5e9, write=3.5e9)
    # The placement rule of the CXL study: the optimizer's operands in DRAM; DMA-only data on CXL first.
    assert {c: strata.preferred_strata(c) for c in ("gradients", "checkpoints", "master", "optimizer", "weights")} \
        == {"gradients": ("dram",), "checkpoints": ("cxl", "dram"), "master": ("dram", "nvme"),
            "optimizer": ("dram", "nvme"), "weights": ("cxl", "dram", "nvme")}
    for s in strata.registry():
        assert s.inventory_field in NodeInventory.model_fields, s.name
    with pytest.raises(KeyError, match="known: hbm, dram, cxl, nvme"):
        strata.stratum("pmem")


def test_a_stratum_added_to_the_registry_reaches_the_plan_and_its_table(with_pmem: None) -> None:
    plan = plan_for_node(JOB, NODE, POLICY)
    assert plan.feasible, plan.verdict()
    assert [u.stratum for u in plan.strata] == ["hbm", "dram", "cxl", "nvme", "pmem"]
    assert plan.category("weights").on("pmem") == 6 * GiB  # filled first, to the brim
    assert plan.requests[PMEM_RESOURCE] == 6
    assert "pmem" in plan.rank_bytes
    header = next(line for line in render_plan(plan, "t").splitlines() if line.startswith("category"))
    assert header.split()[-1] == "PMem"
    assert strata.default_bandwidth()["pmem"] == PMEM.bandwidth


def test_a_stratum_added_to_the_registry_is_published_served_and_fitted(with_pmem: None) -> None:
    assert render_node(NODE)["capacity"][PMEM_RESOURCE] == "6"
    (pmem,) = [r for r in resources() if r.name == PMEM_RESOURCE]
    devices = pmem.devices(NODE)
    assert len(devices) == 6 and all(d.healthy for d in devices)
    assert grant(PMEM_RESOURCE, [devices[0].id], devices).envs == {}
    assert PMEM_RESOURCE in nodes.resources()  # the operator fits the pod's request to the node's allocatable


def test_without_it_none_of_them_know_it() -> None:
    plan = plan_for_node(JOB, NODE, POLICY)
    assert "pmem" not in {u.stratum for u in plan.strata}
    assert PMEM_RESOURCE not in render_node(NODE)["capacity"]
    assert PMEM_RESOURCE not in {r.name for r in resources()}
    assert PMEM_RESOURCE not in nodes.resources()


def test_a_stratum_without_a_resource_is_not_served(with_pmem: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(strata, "REGISTRY", (*strata.REGISTRY[:-1], replace(PMEM, resource=None, served=False)))
    assert PMEM_RESOURCE not in render_node(NODE)["capacity"]
    assert plan_for_node(JOB, NODE, POLICY).category("weights").on("pmem") == 6 * GiB


def _strata_lists(tree: ast.AST) -> list[int]:
    """Lines of literal tuples, lists, sets and dict keys that name three or more strata."""
    known = set(strata.names())
    found = []
    for node in ast.walk(tree):
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(
            node, (ast.Tuple, ast.List, ast.Set)) else []
        named = {i.value for i in items if isinstance(i, ast.Constant) and i.value in known}
        if len(named) >= 3:
            found.append(node.lineno)
    return found


def test_no_module_but_the_registry_lists_the_strata() -> None:
    home = REPO / "operator/memstrata/api/strata.py"
    spelled = {f"{path.relative_to(REPO)}:{line}"
               for root in ("operator/memstrata", "runtime/memstrata") for path in (REPO / root).rglob("*.py")
               if path != home for line in _strata_lists(ast.parse(path.read_text()))}
    assert spelled == set()

"""How much of each stratum a job may use on a node, and the ledger the placement keeps while it fills them.

Every registered stratum (memstrata.api.strata) gets a capacity: the strata whose room depends on the job
and its memory policy (HBM on the job's GPUs, DRAM less its reserve, CXL for memstrata's engine only, NVMe
over the namespaces the job is given) by their rule below; any other by what the node has of it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memstrata.api import strata
from memstrata.api.finetunejob import MemoryPolicy
from memstrata.api.inventory import SCRATCH_CONTROLLER, NodeInventory
from memstrata.api.namespacechoice import NamespaceCandidate, choose_namespaces
from memstrata.api.strataplan import CategoryPlan, Shortfall
from memstrata.api.units import format_bytes
from memstrata.plan.accounting import JobShape

NVME_NOTE = "NVMe namespaces"


@dataclass
class Ledger:
    """What the placement has found so far: each stratum's capacity, what is free of it, how it was
    counted, the categories placed, what is missing and why."""

    free: dict[str, int]
    detail: dict[str, str] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    categories: dict[str, CategoryPlan] = field(default_factory=dict)
    shortfalls: list[Shortfall] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hbm_per_gpu: int = 0
    cxl_nodes: list[int] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    def short(self, stratum: str, category: str, missing: int, message: str) -> None:
        self.shortfalls.append(Shortfall(stratum=stratum, category=category, missing_bytes=missing,
                                         message=message))


Rule = Callable[[JobShape, NodeInventory, MemoryPolicy, Ledger], None]
# The strata whose capacity follows the job and its policy, by name; each rule says which stratum it is for.
RULES: dict[str, Rule] = {}


def rule(name: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        RULES[name] = fn
        return fn
    return register


def capacities(job: JobShape, node: NodeInventory, policy: MemoryPolicy) -> Ledger:
    """The ledger with every registered stratum's capacity (free = capacity) on `node` for `job`."""
    ledger = Ledger(free={s.name: 0 for s in strata.registry()})
    for s in strata.registry():
        fill = RULES.get(s.name)
        if fill is not None:
            fill(job, node, policy, ledger)
        else:
            ledger.free[s.name] = s.node_bytes(node)
    ledger.capacity = dict(ledger.free)
    return ledger


@rule("hbm")
def _hbm(job: JobShape, node: NodeInventory, policy: MemoryPolicy, ledger: Ledger) -> None:
    if not job.gpus:
        return
    if len(node.gpus) < job.gpus:
        ledger.short("hbm", "working", 0, f"GPUs: needs {job.gpus}, node has {len(node.gpus)}")
    ledger.hbm_per_gpu = min((g.hbm_bytes for g in node.gpus[: job.gpus]), default=0)
    ledger.free["hbm"] = ledger.hbm_per_gpu * job.gpus
    ledger.detail["hbm"] = f"{job.gpus} x {format_bytes(ledger.hbm_per_gpu)}"


@rule("dram")
def _dram(job: JobShape, node: NodeInventory, policy: MemoryPolicy, ledger: Ledger) -> None:
    ledger.free["dram"] = int(node.dram_bytes * (1 - policy.dram_reserve_fraction))
    ledger.detail["dram"] = f"{format_bytes(node.dram_bytes)} less {policy.dram_reserve_fraction:.0%} reserve"


@rule("cxl")
def _cxl(job: JobShape, node: NodeInventory, policy: MemoryPolicy, ledger: Ledger) -> None:
    if policy.require_cxl and not node.cxl_nodes:
        ledger.short("cxl", "checkpoints", 0, "CXL: memory.requireCxl is set and the node has no CXL memory")
    if node.cxl_nodes and job.engine == "memstrata":  # stock DeepSpeed cannot place per tensor
        ledger.cxl_nodes = [c.numa_node for c in node.cxl_nodes]
        ledger.free["cxl"] = node.cxl_bytes
        ledger.detail["cxl"] = f"interleaved over NUMA nodes {','.join(map(str, ledger.cxl_nodes))}"


@rule("nvme")
def _nvme(job: JobShape, node: NodeInventory, policy: MemoryPolicy, ledger: Ledger) -> None:
    if policy.nvme_namespaces:
        ledger.namespaces, ledger.free["nvme"], ledger.detail["nvme"] = _namespaces(
            job, node, policy.nvme_namespaces, ledger)


def namespaces_wanted(requested: int, ranks: int) -> int:
    """Namespaces a node must give the job: each rank of the node stripes over its own (the runtime gives
    local rank r the namespaces i with i % ranks == r), so at least one per rank and a multiple of ranks:
    memory.nvmeNamespaces rounded up to a multiple of the ranks on the node."""
    return -(-max(requested, 1) // ranks) * ranks


def _namespaces(job: JobShape, node: NodeInventory, requested: int, ledger: Ledger) -> tuple[list[str], int, str]:
    """The namespaces the job gets on `node`, the NVMe stratum's capacity and its detail line."""
    ranks, notes = job.ranks, ledger.notes
    free = node.free_namespaces
    scratch = [ns for ns in free if ns.controller == SCRATCH_CONTROLLER]
    if scratch:
        # A local run's scratch directory: each rank creates its own file namespaces in it, so one
        # directory serves any number of ranks, bounded by its free bytes.
        if ranks > 1:
            notes.append(f"{NVME_NOTE}: each of the {ranks} ranks stripes over its own files in {scratch[0].name}")
        return [scratch[0].name], scratch[0].size_bytes, f"files in {scratch[0].name}"
    want = namespaces_wanted(requested, ranks)
    if want != requested:
        notes.append(f"{NVME_NOTE}: memory.nvmeNamespaces {requested} rounded up to {want}, a multiple of the "
                     f"{ranks} ranks on a node, so each rank stripes over {want // ranks} of its own")
    elif ranks > 1:
        notes.append(f"{NVME_NOTE}: each of the {ranks} ranks stripes over {want // ranks} of the {want}")
    candidates = {ns.name: ns for ns in free}
    if len(candidates) < want:
        why = f" (memory.nvmeNamespaces {requested} rounded up to a multiple of {ranks} ranks)" \
            if want != requested else ""
        ledger.short("nvme", "optimizer", 0,
                     f"NVMe: memory.nvmeNamespaces wants {want} free namespaces{why}, node has {len(candidates)}")
    # The device plugin's GetPreferredAllocation follows the same rule, so the pod gets these.
    picked = choose_namespaces((NamespaceCandidate(id=ns.name, name=ns.name, size_bytes=ns.size_bytes)
                                for ns in candidates.values()), want)
    chosen = [candidates[name] for name in picked]
    names = [ns.name for ns in chosen]
    # Striping spreads bytes evenly, so the smallest namespace bounds each share.
    capacity = len(chosen) * min((ns.size_bytes for ns in chosen), default=0)
    return names, capacity, f"striped over {', '.join(names)}" if names else ""

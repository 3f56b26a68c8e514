"""Where every byte of a job lives on one node. Pure: same inputs, same plan.

The rule comes from the CXL study (arXiv 2507.03305): the operands of the CPU
optimizer (gradients, fp32 master weights, Adam moments) stay in local DRAM,
because the optimizer step is latency-bound and ~4x slower on CXL; data that is
only ever moved by DMA (16-bit weights being staged, activation checkpoints) may
live on CXL, interleaved over its nodes; whatever DRAM cannot hold spills to NVMe,
streamed by sub-group. Categories are placed in that order, each into the first
stratum of its preference list that has room, splitting across strata if needed.
"""
from __future__ import annotations

from collections.abc import Callable

from memstrata.api.finetunejob import MemoryPolicy
from memstrata.api.inventory import SCRATCH_CONTROLLER, NodeInventory
from memstrata.api.namespacechoice import NamespaceCandidate, choose_namespaces
from memstrata.api.strataplan import STRATA, STRATUM_NAMES, Allocation, CategoryPlan, Plan, Shortfall, StratumUse
from memstrata.api.units import GiB, format_bytes
from memstrata.plan.accounting import (DESCRIPTIONS, STATE_BYTES_PER_ELEMENT, JobShape, big_subgroup_sizes,
                                      build_transient, category_bytes, choose_resident, pinned_buffers,
                                      streamed_subgroup_bytes, subgroup_sizes, trained_parameters, working_set)

# Placement order and each category's allowed strata, fastest first.
PREFERENCES: list[tuple[str, tuple[str, ...]]] = [
    ("gradients", ("dram",)),
    # Checkpoints cannot go to NVMe and the optimizer state can, so they claim DRAM first.
    ("checkpoints", ("cxl", "dram")),
    ("master", ("dram", "nvme")),
    ("optimizer", ("dram", "nvme")),
    ("weights", ("cxl", "dram", "nvme")),
]


# memstrata's engine: the 16-bit weights are read twice a step (forward, backward) and written once, the
# optimizer state read and written once, so a byte of weights kept in DRAM saves more I/O than a byte of state:
# the weights claim DRAM first, then the state, whose split the runtime honours sub-group by sub-group.
MEMSTRATA_PREFERENCES: list[tuple[str, tuple[str, ...]]] = [
    ("gradients", ("dram",)),
    ("checkpoints", ("cxl", "dram")),
    ("weights", ("cxl", "dram", "nvme")),
    ("master", ("dram", "nvme")),
    ("optimizer", ("dram", "nvme")),
]
# A resident sub-group keeps its fp32 master and its two moments together: 4 of every 12 bytes are master.
MASTER_SHARE = (4, STATE_BYTES_PER_ELEMENT)

NVME_NOTE = "NVMe namespaces"

ShortFn = Callable[[str, str, int, str], None]


# Categories stock DeepSpeed places together: offload_optimizer moves master and
# moments as one; offload_param moves all weights.
STOCK_GROUPS = {"master": ("master", "optimizer"), "optimizer": ("master", "optimizer"), "weights": ("weights",)}


def plan_for_node(job: JobShape, node: NodeInventory, policy: MemoryPolicy) -> Plan:
    """Assign each category of `job` to the strata of `node`, or say precisely what is missing."""
    # memstrata's update reads one sub-group ahead, at the cost of one more sub-group of locked buffers; where
    # that buffer is what stands between the job and a fit, it reads each one when it needs it instead.
    plan = _settle(job, node, policy, read_ahead=1)
    if not plan.feasible and job.engine == "memstrata":
        serial = _settle(job, node, policy, read_ahead=0)
        if serial.feasible:
            return serial
    return plan


def _settle(job: JobShape, node: NodeInventory, policy: MemoryPolicy, read_ahead: int) -> Plan:
    # Pinned buffers grow once state spills to NVMe, and (memstrata) with the largest sub-group that streams,
    # which a smaller DRAM share makes larger: grow monotonically until the placement stops changing.
    spills, streamed = (False, False), 0
    # Each pass flips a spill on or grows the streamed size to a larger sub-group: a bound that always settles.
    for _ in range(3 + len(set(subgroup_sizes(job)))):
        plan = _place(job, node, policy, *spills, read_ahead=read_ahead, streamed_bytes=streamed)
        state_dram = plan.category("optimizer").on("dram") + plan.category("master").on("dram")
        now = (plan.category("weights").on("nvme") > 0,
               plan.category("optimizer").on("nvme") + plan.category("master").on("nvme") > 0)
        biggest = streamed_subgroup_bytes(job, state_dram // job.ranks) if now[1] and job.engine == "memstrata" else 0
        if now == spills and biggest <= streamed:
            return plan
        spills, streamed = (spills[0] or now[0], spills[1] or now[1]), max(streamed, biggest)
    return plan


def _place(job: JobShape, node: NodeInventory, policy: MemoryPolicy, params_nvme: bool, optim_nvme: bool, *,
           read_ahead: int, streamed_bytes: int) -> Plan:
    shortfalls: list[Shortfall] = []
    ranks = job.ranks

    def short(stratum: str, category: str, missing: int, message: str) -> None:
        shortfalls.append(Shortfall(stratum=stratum, category=category, missing_bytes=missing, message=message))

    # --- capacities -------------------------------------------------------------------------------
    free: dict[str, int] = {s: 0 for s in STRATA}
    detail: dict[str, str] = {}
    hbm_per_gpu = 0
    if job.gpus:
        if len(node.gpus) < job.gpus:
            short("hbm", "working", 0, f"GPUs: needs {job.gpus}, node has {len(node.gpus)}")
        usable = node.gpus[: job.gpus]
        hbm_per_gpu = min((g.hbm_bytes for g in usable), default=0)
        free["hbm"] = hbm_per_gpu * job.gpus
        detail["hbm"] = f"{job.gpus} x {format_bytes(hbm_per_gpu)}"
    free["dram"] = int(node.dram_bytes * (1 - policy.dram_reserve_fraction))
    detail["dram"] = f"{format_bytes(node.dram_bytes)} less {policy.dram_reserve_fraction:.0%} reserve"

    cxl_nodes: list[int] = []
    if policy.require_cxl and not node.cxl_nodes:
        short("cxl", "checkpoints", 0, "CXL: memory.requireCxl is set and the node has no CXL memory")
    if node.cxl_nodes and job.engine == "memstrata":  # stock DeepSpeed cannot place per tensor
        cxl_nodes = [c.numa_node for c in node.cxl_nodes]
        free["cxl"] = node.cxl_bytes
        detail["cxl"] = f"interleaved over NUMA nodes {','.join(map(str, cxl_nodes))}"

    notes: list[str] = []
    namespaces: list[str] = []
    if policy.nvme_namespaces:
        namespaces, free["nvme"], detail["nvme"] = _namespaces(job, node, policy.nvme_namespaces, short, notes)
    capacity = dict(free)

    # --- the working set sits next to the compute -------------------------------------------------
    work = working_set(job)
    categories: dict[str, CategoryPlan] = {}
    compute = "hbm" if job.gpus else "dram"
    if job.gpus and work > hbm_per_gpu and node.gpus:
        short("hbm", "working", work - hbm_per_gpu,
              f"HBM: each GPU needs {format_bytes(work)} for its working set and has {format_bytes(hbm_per_gpu)} "
              f"(short by {format_bytes(work - hbm_per_gpu)}); {_smaller_working_set(job)}")
    total_work = work * ranks
    categories["working"] = _cat("working", total_work, [Allocation(stratum=compute, bytes=total_work)], ranks)
    if compute == "dram" and total_work > free["dram"]:
        over = total_work - free["dram"]
        short("dram", "working", over,
              f"DRAM: the working set (live activations, logits, gathered layers) needs {format_bytes(total_work)} "
              f"and the node has {format_bytes(free['dram'])} (short by {format_bytes(over)}); "
              f"{_smaller_working_set(job)}")
    # Each shortfall is reported once, where it arises: what follows is measured against what is left, never less
    # than nothing.
    free[compute] = max(free[compute] - total_work, 0)

    # --- building the model: a host transient, only ever in DRAM ----------------------------------
    # The checkpoint's tensors are read and converted by the CPU, so neither NVMe nor CXL can take them.
    # Claimed before memory.dramBudget applies: like the working set, it is not offloaded state.
    build, left = build_transient(job), max(free["dram"], 0)
    if build > left:
        short("dram", "build", build - left,
              f"DRAM: building the model needs {format_bytes(build)} for a moment and {format_bytes(left)} is "
              f"left beside the working set (short by {format_bytes(build - left)})")
    categories["build"] = _cat("build", build, [Allocation(stratum="dram", bytes=build)], ranks)
    free["dram"] = max(free["dram"] - build, 0)
    if policy.dram_budget is not None and free["dram"] > policy.dram_budget:
        # The budget bounds the offloaded state, not the compute itself.
        capacity["dram"] -= free["dram"] - policy.dram_budget
        free["dram"] = policy.dram_budget
        detail["dram"] += f", memory.dramBudget {format_bytes(policy.dram_budget)}"

    pinned = pinned_buffers(job, optimizer_on_nvme=optim_nvme, params_on_nvme=params_nvme, read_ahead=read_ahead,
                            streamed_bytes=streamed_bytes or None)
    if policy.pinned_memory_cap is not None and pinned > policy.pinned_memory_cap:
        short("dram", "pinned", pinned - policy.pinned_memory_cap,
              f"DRAM: page-locked buffers need {format_bytes(pinned)}, memory.pinnedMemoryCap allows "
              f"{format_bytes(policy.pinned_memory_cap)}")
    categories["pinned"] = _cat("pinned", pinned, [Allocation(stratum="dram", bytes=pinned)] if pinned else [],
                                ranks)
    offload_dram = free["dram"]
    free["dram"] -= pinned
    if free["dram"] < 0:
        short("dram", "pinned", -free["dram"],
              f"DRAM: short by {format_bytes(-free['dram'])} before any model state is placed "
              f"(page-locked buffers of {format_bytes(pinned)} exceed the {format_bytes(offload_dram)} "
              f"of DRAM left for offloaded state)")
        free["dram"] = 0

    # --- model state, in preference order ---------------------------------------------------------
    sizes = category_bytes(job)
    held = 0  # memstrata: DRAM held back for the big sub-groups' state until the weights are placed
    for name, preferred in (MEMSTRATA_PREFERENCES if job.engine == "memstrata" else PREFERENCES):
        if job.engine == "memstrata" and name == "weights":
            held = _hold_for_big_subgroups(job, max(free["dram"], 0), sizes)
            free["dram"] -= held
        elif held and name == "master":
            free["dram"], held = free["dram"] + held, 0
        allowed = preferred
        if job.engine == "deepspeed" and name in STOCK_GROUPS:
            allowed = _stock_stratum(name, preferred, sizes, categories, free)
        need, placed = sizes[name], []
        if name == "checkpoints":
            # The runtime keeps them in one pool with one NUMA placement (memstrata.runtime.swap.activations):
            # the first stratum that holds them whole, split only where none does (the pool then follows the
            # larger share).
            whole = [s for s in allowed if free[s] >= need]
            allowed = (whole[0],) if whole else allowed
        for stratum in allowed:
            take = min(need, max(free[stratum], 0))
            if take:
                placed.append(Allocation(stratum=stratum, bytes=take))
                free[stratum] -= take
                need -= take
        if need:
            where = " or ".join(STRATUM_NAMES[s] for s in preferred)
            short(allowed[-1], name, need,
                  f"{where}: short by {format_bytes(need)} for {DESCRIPTIONS[name]} "
                  f"(needs {format_bytes(sizes[name])})")
        categories[name] = _cat(name, sizes[name], placed, ranks)
    if job.engine == "memstrata":
        _split_state_as_subgroups(categories, ranks)

    strata = [
        StratumUse(stratum=s, capacity=capacity[s], used=capacity[s] - free[s], detail=detail.get(s, ""))
        for s in STRATA
    ]
    nvme_bytes = sum(c.on("nvme") for c in categories.values())
    if not nvme_bytes:
        notes = [n for n in notes if not n.startswith(NVME_NOTE)]
    requests = {"nvidia.com/gpu": job.gpus, "memstrata.dev/nvme-ns": len(namespaces) if nvme_bytes else 0,
                "memstrata.dev/cxl-gib": -(-sum(c.on("cxl") for c in categories.values()) // GiB)}
    return Plan(
        parameters=job.model.parameters(),
        trainable_parameters=trained_parameters(job) if job.adapter_tensors is not None else None,
        engine=job.engine,
        activation_checkpointing=job.activation_checkpointing,
        feasible=not any(s.missing_bytes or s.message for s in shortfalls),
        categories=list(categories.values()),
        strata=strata,
        shortfalls=shortfalls,
        nvme_namespaces=namespaces if nvme_bytes else [],
        cxl_nodes=cxl_nodes if requests["memstrata.dev/cxl-gib"] else [],
        requests={k: v for k, v in requests.items() if v},
        update_io_seconds=_update_io_seconds(categories, node, max(len(namespaces), 1)),
        optimizer_read_ahead=read_ahead if job.engine == "memstrata" and optim_nvme else 0,
        nodes=job.nodes,
        ranks_per_node=ranks,
        world_size=job.world_size,
        global_batch=job.global_batch,
        rank_bytes={s: -(-sum(c.on(s) for c in categories.values()) // ranks) for s in STRATA},
        notes=notes,
    )


def _smaller_working_set(job: JobShape) -> str:
    """What in the spec shrinks the working set, for a shortfall's message."""
    fixes = ["lower training.sequenceLength or microBatch"]
    if not job.activation_checkpointing:
        fixes.append("set training.activationCheckpointing: true")
    if not job.loss_chunk_tokens:
        fixes.append("set training.lossChunkTokens (e.g. 4096)")
    return ", or ".join(fixes)


def _hold_for_big_subgroups(job: JobShape, dram: int, sizes: dict[str, int]) -> int:
    """DRAM to keep for the optimizer state of the sub-groups a big tensor forms alone (the embedding, the LM
    head), before the weights take theirs: a big sub-group that streams needs locked buffers of its own size,
    which costs more DRAM than its state; so the ones `dram` can hold (largest first, as the runtime keeps them)
    come before the weights, and the weights spill first. 0 when nothing of the state would spill anyway."""
    if dram >= sizes["master"] + sizes["optimizer"] + sizes["weights"]:
        return 0
    big = big_subgroup_sizes(job)
    kept = choose_resident(big, dram // job.ranks)
    return sum(big[i] for i in kept) * STATE_BYTES_PER_ELEMENT * job.ranks


def _split_state_as_subgroups(categories: dict[str, CategoryPlan], ranks: int) -> None:
    """Re-split the DRAM and NVMe bytes of master + optimizer in the proportion a sub-group holds them (the
    runtime keeps whole sub-groups resident, master and moments together), keeping each stratum's total."""
    master, optimizer = categories["master"], categories["optimizer"]
    dram = master.on("dram") + optimizer.on("dram")
    nvme = master.on("nvme") + optimizer.on("nvme")
    if not dram or not nvme:
        return
    num, den = MASTER_SHARE
    master_dram = min(master.bytes, dram * num // den)
    split = {"master": (master_dram, master.bytes - master_dram),
             "optimizer": (dram - master_dram, optimizer.bytes - (dram - master_dram))}
    for name, (in_dram, on_nvme) in split.items():
        cat = categories[name]
        placed = [Allocation(stratum=s, bytes=b) for s, b in (("dram", in_dram), ("nvme", on_nvme)) if b > 0]
        categories[name] = _cat(name, cat.bytes, placed, ranks)


def _cat(name: str, size: int, placement: list[Allocation], ranks: int) -> CategoryPlan:
    # Every category of a node is `ranks` equal per-rank shares (accounting counts them so).
    return CategoryPlan(category=name, description=DESCRIPTIONS[name], bytes=size, placement=placement,
                        rank_bytes=size // ranks)


def namespaces_wanted(requested: int, ranks: int) -> int:
    """Namespaces a node must give the job: each rank of the node stripes over its own (the runtime gives
    local rank r the namespaces i with i % ranks == r), so at least one per rank and a multiple of ranks:
    memory.nvmeNamespaces rounded up to a multiple of the ranks on the node."""
    return -(-max(requested, 1) // ranks) * ranks


def _namespaces(job: JobShape, node: NodeInventory, requested: int, short: ShortFn,
                notes: list[str]) -> tuple[list[str], int, str]:
    """The namespaces the job gets on `node`, the NVMe stratum's capacity and its detail line."""
    ranks = job.ranks
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
        short("nvme", "optimizer", 0,
              f"NVMe: memory.nvmeNamespaces wants {want} free namespaces{why}, node has {len(candidates)}")
    # The device plugin's GetPreferredAllocation follows the same rule, so the pod gets these.
    picked = choose_namespaces((NamespaceCandidate(id=ns.name, name=ns.name, size_bytes=ns.size_bytes)
                                for ns in candidates.values()), want)
    chosen = [candidates[name] for name in picked]
    names = [ns.name for ns in chosen]
    # Striping spreads bytes evenly, so the smallest namespace bounds each share.
    capacity = len(chosen) * min((ns.size_bytes for ns in chosen), default=0)
    return names, capacity, f"striped over {', '.join(names)}" if names else ""


def _stock_stratum(name: str, allowed: tuple[str, ...], sizes: dict[str, int],
                   placed: dict[str, CategoryPlan], free: dict[str, int]) -> tuple[str, ...]:
    """Stock DeepSpeed offloads a whole group to one device (cpu or nvme): keep a group's
    categories together, in the first stratum that holds all of it, so the plan is honest."""
    group = STOCK_GROUPS[name]
    for sibling in group:
        if sibling in placed and placed[sibling].placement:
            return (placed[sibling].placement[0].stratum,)
    whole = sum(sizes[g] for g in group)
    return (next((s for s in allowed if free[s] >= whole), allowed[-1]),)


def _update_io_seconds(categories: dict[str, CategoryPlan], node: NodeInventory, paths: int) -> float:
    """NVMe seconds per optimizer step: state on NVMe is read and written once per update,
    16-bit weights on NVMe are read in forward and again in backward, then written."""
    bw = node.bw("nvme")
    state = categories["master"].on("nvme") + categories["optimizer"].on("nvme")
    weights = categories["weights"].on("nvme")
    read = state + 2 * weights
    write = state + weights
    return (read / bw.read + write / bw.write) / paths

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

from memstrata.api.finetunejob import MemoryPolicy
from memstrata.api.inventory import NodeInventory
from memstrata.api.layermajor import layer_major_refusal
from memstrata.api.strata import names, preferred_strata, registry, stratum, titles
from memstrata.api.strataplan import Allocation, CategoryPlan, Plan, StratumUse
from memstrata.api.units import format_bytes
from memstrata.plan.accounting import (CPU_WORKING_SET, DESCRIPTIONS, RUNTIME_NOTE, RUNTIME_PROCESS_BYTES,
                                      STATE_BYTES_PER_ELEMENT, JobShape, build_transient, category_bytes,
                                      slice_elements, subgroup_sizes, subgroup_unit, trained_parameters, working_set)
from memstrata.plan.buffers import pinned_buffers, streamed_subgroup_bytes
from memstrata.plan.capacity import NVME_NOTE, Ledger, capacities

# The order in which the model state's categories are placed; each goes to the strata that may hold it
# (memstrata.api.strata.preferred_strata), CXL before DRAM before NVMe, splitting where one has no room.
# Checkpoints cannot go to NVMe and the optimizer state can, so they claim DRAM first.
ORDER = ("gradients", "checkpoints", "master", "optimizer", "weights")
# memstrata's engine: the 16-bit weights are read twice a step (forward, backward) and written once, the
# optimizer state read and written once, so a byte of weights kept in DRAM saves more I/O than a byte of state:
# the weights claim DRAM first, then the state, whose split the runtime honours sub-group by sub-group.
MEMSTRATA_ORDER = ("gradients", "checkpoints", "weights", "master", "optimizer")
# A resident sub-group keeps its fp32 master and its two moments together: 4 of every 12 bytes are master.
MASTER_SHARE = (4, STATE_BYTES_PER_ELEMENT)

LAYER_MAJOR_NOTE = "layer-major"
DELAYED_NOTE = "training.update delayed"
# Categories stock DeepSpeed places together: offload_optimizer moves master and
# moments as one; offload_param moves all weights.
STOCK_GROUPS = {"master": ("master", "optimizer"), "optimizer": ("master", "optimizer"), "weights": ("weights",)}


# The smallest sub-group unit the planner shrinks to (elements): 4 MiB of fp32, below which per-sub-group overheads
# (an I/O batch, an Adam call per slice) outweigh the DRAM saved.
MIN_SUBGROUP_UNIT = 1 << 20
# Each smaller unit the planner tries is this fraction of the last: the update's buffers shrink by about what reading
# one ahead adds to them (2 + 1 slices' state and 2 gradients, 44 B a slice element, against 32 B without; 40 B
# against 28 B for a sub-group streamed whole), so where a unit fits only without read-ahead the next may fit with it.
UNIT_STEP = (7, 10)


def plan_for_node(job: JobShape, node: NodeInventory, policy: MemoryPolicy) -> Plan:
    """Assign each category of `job` to the strata of `node`, or say precisely what is missing. The delayed update
    is dropped where its plan does not fit or puts weights on NVMe (the runtime refuses it there, so its shadows
    would be counted for nothing): the exact plan, with a note. Layer-major (unset: on where weights go to NVMe)
    is dropped where every micro-batch's checkpoints at once break the fit."""
    if job.delayed_update:
        plan = _plan_layers(job, node, policy)
        if plan.feasible and plan.category("weights").on("nvme") == 0:
            return plan
        exact = _plan_layers(job.model_copy(update={"delayed_update": False}), node, policy)
        return exact.model_copy(update={"notes": [
            f"{DELAYED_NOTE} dropped: with their shadows the weights do not fit in host memory, and the forward's "
            "reads from NVMe cannot run beside the update's writes; each update runs in place, exact", *exact.notes]})
    return _plan_layers(job, node, policy)


def _plan_layers(job: JobShape, node: NodeInventory, policy: MemoryPolicy) -> Plan:
    plan = _plan(job, node, policy)
    if plan.feasible or job.layer_major is not None or not plan.layer_major:
        return plan
    one_at_a_time = _plan(job.model_copy(update={"layer_major": False}), node, policy)
    if not one_at_a_time.feasible:
        return plan
    return one_at_a_time.model_copy(update={"notes": [
        f"{LAYER_MAJOR_NOTE} off: the activation checkpoints of all {job.gradient_accumulation} micro-batches at once "
        "do not fit, so they run one after the other, each gathering the weights again", *one_at_a_time.notes]})


def _plan(job: JobShape, node: NodeInventory, policy: MemoryPolicy) -> Plan:
    # memstrata's update reads one sub-group ahead, at the cost of one more sub-group of locked buffers. Where those
    # buffers are what stands between the job and a fit, it streams smaller sub-groups (and slices), the unit shrunk
    # step by step down to MIN_SUBGROUP_UNIT, still reading one ahead; only where no unit fits so is each read
    # waited before its Adam, at the largest unit that fits without: the budget, not the model's layer, sets the
    # update's buffers, and the update's reads run beside its Adam wherever any unit lets them.
    plan = _settle(job, node, policy, read_ahead=1)
    if plan.feasible or job.engine != "memstrata":
        return _with_unit(plan, job)
    shapes = _smaller_units(job)
    for read_ahead, shaped in [(1, s) for s in shapes[1:]] + [(0, s) for s in shapes]:
        candidate = _settle(shaped, node, policy, read_ahead=read_ahead)
        if candidate.feasible:
            return _with_unit(candidate, shaped)
    return _with_unit(plan, job)


def _smaller_units(job: JobShape) -> list[JobShape]:
    """`job` itself, then with the sub-group unit shrunk by UNIT_STEP (whole slices) while it stays at least
    MIN_SUBGROUP_UNIT."""
    shapes, unit = [job], subgroup_unit(job)
    while (unit := slice_elements(unit * UNIT_STEP[0] // UNIT_STEP[1])) >= MIN_SUBGROUP_UNIT:
        shapes.append(job.model_copy(update={"sub_group_elements": unit}))
    return shapes


def _with_unit(plan: Plan, job: JobShape) -> Plan:
    return plan.model_copy(update={"sub_group_elements": subgroup_unit(job)}) if job.engine == "memstrata" else plan


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
        biggest = (streamed_subgroup_bytes(job, state_dram // job.ranks, read_ahead)
                   if now[1] and job.engine == "memstrata" else 0)
        if now == spills and biggest <= streamed:
            return plan
        spills, streamed = (spills[0] or now[0], spills[1] or now[1]), max(streamed, biggest)
    return plan


def layer_major(job: JobShape, params_nvme: bool) -> JobShape:
    """`job` with layer_major resolved: as the spec says, or (unset) on where weights go to NVMe, which it saves
    2 x (gradientAccumulation - 1) reads of each a step; never where memstrata.api.layermajor refuses it."""
    refused = layer_major_refusal(engine=job.engine, gradient_accumulation=job.gradient_accumulation,
                                  activation_checkpointing=job.activation_checkpointing,
                                  loss_chunk_tokens=job.loss_chunk_tokens)
    wanted = params_nvme if job.layer_major is None else job.layer_major
    return job.model_copy(update={"layer_major": bool(wanted) and refused is None})


def _place(job: JobShape, node: NodeInventory, policy: MemoryPolicy, params_nvme: bool, optim_nvme: bool, *,
           read_ahead: int, streamed_bytes: int) -> Plan:
    job = layer_major(job, params_nvme)
    ledger = capacities(job, node, policy)
    _place_working_set(job, node, ledger)
    _place_build(job, policy, ledger)
    pinned = pinned_buffers(job, optimizer_on_nvme=optim_nvme, params_on_nvme=params_nvme, read_ahead=read_ahead,
                            streamed_bytes=streamed_bytes or None)
    _place_pinned(job, policy, ledger, pinned)
    _place_state(job, ledger)
    return _assemble(job, node, ledger, read_ahead=read_ahead if job.engine == "memstrata" and optim_nvme else 0)


def _place_working_set(job: JobShape, node: NodeInventory, ledger: Ledger) -> None:
    """The working set sits next to the compute: in HBM on a GPU, else in DRAM."""
    free, work, hbm_per_gpu = ledger.free, working_set(job), ledger.hbm_per_gpu
    compute = "hbm" if job.gpus else "dram"
    if job.gpus and work > hbm_per_gpu and node.gpus:
        ledger.short("hbm", "working", work - hbm_per_gpu,
                     f"HBM: each GPU needs {format_bytes(work)} for its working set and has "
                     f"{format_bytes(hbm_per_gpu)} (short by {format_bytes(work - hbm_per_gpu)}); "
                     f"{_smaller_working_set(job)}")
    total_work = work * job.ranks
    ledger.categories["working"] = _cat("working", total_work, [Allocation(stratum=compute, bytes=total_work)],
                                        job.ranks)
    if not job.gpus:  # the same bytes, next to the CPU that computes with them
        ledger.categories["working"].description = CPU_WORKING_SET
    if compute == "dram" and total_work > free["dram"]:
        over = total_work - free["dram"]
        ledger.short("dram", "working", over,
                     f"DRAM: the working set (live activations, logits, gathered layers) needs "
                     f"{format_bytes(total_work)} and the node has {format_bytes(free['dram'])} (short by "
                     f"{format_bytes(over)}); {_smaller_working_set(job)}")
    # Each shortfall is reported once, where it arises: what follows is measured against what is left, never less
    # than nothing.
    free[compute] = max(free[compute] - total_work, 0)


def _place_build(job: JobShape, policy: MemoryPolicy, ledger: Ledger) -> None:
    """Building the model: a host transient, only ever in DRAM. The checkpoint's tensors are read and converted
    by the CPU, so neither NVMe nor CXL can take them. Claimed before memory.dramBudget applies: like the working
    set, it is not offloaded state."""
    free = ledger.free
    build, left = build_transient(job), max(free["dram"], 0)
    if build > left:
        ledger.short("dram", "build", build - left,
                     f"DRAM: building the model needs {format_bytes(build)} for a moment and {format_bytes(left)} "
                     f"is left beside the working set (short by {format_bytes(build - left)})")
    ledger.categories["build"] = _cat("build", build, [Allocation(stratum="dram", bytes=build)], job.ranks)
    free["dram"] = max(free["dram"] - build, 0)
    if policy.dram_budget is not None and free["dram"] > policy.dram_budget:
        # The budget bounds the offloaded state, not the compute itself.
        ledger.capacity["dram"] -= free["dram"] - policy.dram_budget
        free["dram"] = policy.dram_budget
        ledger.detail["dram"] += f", memory.dramBudget {format_bytes(policy.dram_budget)}"


def _place_pinned(job: JobShape, policy: MemoryPolicy, ledger: Ledger, pinned: int) -> None:
    """Page-locked buffers, in DRAM, out of what is left for offloaded state."""
    free = ledger.free
    if policy.pinned_memory_cap is not None and pinned > policy.pinned_memory_cap:
        ledger.short("dram", "pinned", pinned - policy.pinned_memory_cap,
                     f"DRAM: page-locked buffers need {format_bytes(pinned)}, memory.pinnedMemoryCap allows "
                     f"{format_bytes(policy.pinned_memory_cap)}")
    ledger.categories["pinned"] = _cat("pinned", pinned, [Allocation(stratum="dram", bytes=pinned)] if pinned
                                       else [], job.ranks)
    offload_dram = free["dram"]
    free["dram"] -= pinned
    if free["dram"] < 0:
        ledger.short("dram", "pinned", -free["dram"],
                     f"DRAM: short by {format_bytes(-free['dram'])} before any model state is placed "
                     f"(page-locked buffers of {format_bytes(pinned)} exceed the {format_bytes(offload_dram)} "
                     f"of DRAM left for offloaded state)")
        free["dram"] = 0


def _place_state(job: JobShape, ledger: Ledger) -> None:
    """The model state, category by category, each into the first stratum that may hold it and has room."""
    sizes = category_bytes(job)
    for name in (MEMSTRATA_ORDER if job.engine == "memstrata" else ORDER):
        _place_category(job, name, sizes, ledger)
    if job.engine == "memstrata":
        _split_state_as_subgroups(ledger.categories, job.ranks)


def _place_category(job: JobShape, name: str, sizes: dict[str, int], ledger: Ledger) -> None:
    free = ledger.free
    preferred = allowed = preferred_strata(name)
    if job.engine == "deepspeed" and name in STOCK_GROUPS:
        allowed = _stock_stratum(name, preferred, sizes, ledger.categories, free)
    need, placed = sizes[name], list[Allocation]()
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
        title = titles()
        ledger.short(allowed[-1], name, need,
                     f"{' or '.join(title[s] for s in preferred)}: short by {format_bytes(need)} for "
                     f"{DESCRIPTIONS[name]} (needs {format_bytes(sizes[name])})")
    ledger.categories[name] = _cat(name, sizes[name], placed, job.ranks)


def _requests(job: JobShape, ledger: Ledger) -> dict[str, int]:
    """What the pod requests of each stratum's extended resource: the job's GPUs, the namespaces it stripes
    over when anything is on NVMe, whole units of the bytes placed on any other."""
    requests: dict[str, int] = {}
    for s in registry():
        used = sum(c.on(s.name) for c in ledger.categories.values())
        if s.resource is None:
            continue
        if s.name == "hbm":
            requests[s.resource] = job.gpus
        elif s.name == "nvme":
            requests[s.resource] = len(ledger.namespaces) if used else 0
        else:
            requests[s.resource] = -(-used // s.unit_bytes) if s.unit_bytes else int(used > 0)
    return requests


def _assemble(job: JobShape, node: NodeInventory, ledger: Ledger, read_ahead: int) -> Plan:
    categories, capacity, free, ranks = ledger.categories, ledger.capacity, ledger.free, job.ranks
    nvme_bytes = sum(c.on("nvme") for c in categories.values())
    requests = _requests(job, ledger)
    cxl = stratum("cxl").resource
    return Plan(
        parameters=job.model.parameters(),
        trainable_parameters=trained_parameters(job) if job.adapter_tensors is not None else None,
        engine=job.engine,
        activation_checkpointing=job.activation_checkpointing,
        layer_major=bool(job.layer_major),
        delayed_update=job.delayed_update,
        feasible=not any(s.missing_bytes or s.message for s in ledger.shortfalls),
        categories=list(categories.values()),
        strata=[StratumUse(stratum=s, capacity=capacity[s], used=capacity[s] - free[s],
                           detail=ledger.detail.get(s, "")) for s in names()],
        shortfalls=ledger.shortfalls,
        nvme_namespaces=ledger.namespaces if nvme_bytes else [],
        cxl_nodes=ledger.cxl_nodes if cxl is not None and requests.get(cxl) else [],
        requests={k: v for k, v in requests.items() if v},
        update_io_seconds=_update_io_seconds(categories, node, max(len(ledger.namespaces), 1)),
        optimizer_read_ahead=read_ahead,
        nodes=job.nodes,
        ranks_per_node=ranks,
        world_size=job.world_size,
        global_batch=job.global_batch,
        rank_bytes={s: -(-sum(c.on(s) for c in categories.values()) // ranks) for s in names()},
        # A note on the namespaces is moot where nothing went to NVMe.
        notes=(ledger.notes if nvme_bytes else [n for n in ledger.notes if not n.startswith(NVME_NOTE)]) + ([
            f"{LAYER_MAJOR_NOTE}: the step's {job.gradient_accumulation} micro-batches pass each layer together, so "
            f"each weight is gathered (read from NVMe) once a forward and once a backward per step, not "
            f"{job.gradient_accumulation} times; the activation checkpoints are counted for all of them"]
            if job.layer_major else []) + [
            f"{RUNTIME_NOTE}: each rank process's own DRAM beyond the job's tensors (Python with torch, DeepSpeed "
            f"and transformers, their allocators): up to {format_bytes(RUNTIME_PROCESS_BYTES)} a rank; a job's pod "
            f"asks for it on top of the plan"],
    )


def _smaller_working_set(job: JobShape) -> str:
    """What in the spec shrinks the working set, for a shortfall's message."""
    fixes = ["lower training.sequenceLength or microBatch"]
    if not job.activation_checkpointing:
        fixes.append("set training.activationCheckpointing: true")
    if not job.loss_chunk_tokens:
        fixes.append("set training.lossChunkTokens (e.g. 4096)")
    return ", or ".join(fixes)


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

"""memstrata.plan: the pure planner. No I/O, no torch; same inputs, same plan.

`plan_job(spec, node)` is what the operator, the runtime and the CLI call.
"""
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.inventory import NodeInventory
from memstrata.api.lora import adapter_tensor_sizes, saved_tensor_sizes
from memstrata.plan.accounting import JobShape, build_transient, category_bytes, working_set
from memstrata.plan.buffers import pinned_buffers
from memstrata.api.strataplan import Allocation, CategoryPlan, Plan, Shortfall, StratumUse
from memstrata.plan.assignment import plan_for_node


def job_shape(spec: FineTuneJobSpec) -> JobShape:
    model, adapter = spec.model.trained_shape(), spec.training.adapter()
    return JobShape(
        model=model,
        adapter_tensors=tuple(adapter_tensor_sizes(model, adapter)) if adapter is not None else None,
        saved_elements=sum(map(sum, saved_tensor_sizes(model, adapter))) if adapter is not None else 0,
        sequence_length=spec.training.sequence_length,
        micro_batch=spec.training.micro_batch,
        precision=spec.training.precision,
        gpus=spec.resources.gpus,
        nodes=spec.resources.nodes,
        ranks_per_node=spec.resources.ranks(),
        gradient_accumulation=spec.training.gradient_accumulation,
        engine=spec.memory.engine,
        activation_checkpointing=spec.training.activation_checkpointing,
        loss_chunk_tokens=spec.training.loss_chunk_tokens,
        layer_major=spec.training.layer_major,
        delayed_update=spec.training.update == "delayed",
    )


def plan_job(spec: FineTuneJobSpec, node: NodeInventory) -> Plan:
    """The plan for `node` as ONE of the job's spec.resources.nodes nodes, running resources.ranks() ranks:
    the model state ZeRO-3 partitions over the whole world counts ranks / world_size of it; what each
    rank needs for itself (working set, pinned buffers, build, checkpoints) counts ranks times."""
    return plan_for_node(job_shape(spec), node, spec.memory)


__all__ = [
    "Allocation", "CategoryPlan", "JobShape", "Plan", "Shortfall", "StratumUse", "build_transient",
    "category_bytes", "job_shape", "pinned_buffers", "plan_for_node", "plan_job", "working_set",
]

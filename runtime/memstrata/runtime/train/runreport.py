"""What a run reports: its per-stratum counters, a step's status, this node's status.workers entry, and the
final report; and the cleanup that never hides the run's own result. For memstrata.runtime.train.local."""
from __future__ import annotations

from collections.abc import Callable

from memstrata.api.finetunejob import FineTuneJob
from memstrata.api.jobstatus import WorkerStatus
from memstrata.api.report import RuntimeReport, StratumCounters
from memstrata.api.strataplan import Plan
from memstrata.runtime.swap.status import SwapStatus
from memstrata.runtime.train.launch import node_sums
from memstrata.runtime.train.observe.device import hbm_in_use
from memstrata.runtime.train.observe.memwatch import MemWatch, dir_usage, tree_rss
from memstrata.runtime.train.observe.metrics import StepResult, TrainResult
from memstrata.runtime.train.observe.progress import LossSummary, RunReport
from memstrata.runtime.train.observe.strata import StepStrata, held_bytes, read_counters
from memstrata.runtime.train.recipe import FineTuneRecipe
from memstrata.runtime.train.schedule import describe

__all__ = ["NodeReport", "StepTrack", "build_report", "close_all", "step_status"]


def close_all(fail: Callable[[str], None], *steps: tuple[str, Callable[[], None] | None]) -> str | None:
    """Run every cleanup step whatever an earlier one raised; each failure is said in one line (after the run's
    own error, if it had one: that stays the result). The first failure's message, or None."""
    first: str | None = None
    for what, step in steps:
        if step is None:
            continue
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - one line each, and the next step still runs
            message = f"cleanup failed: {what}: {type(exc).__name__}: {exc}"
            fail(message)
            first = first or message
    return first


class NodeReport:
    """This node's status.workers entry, put into every report of the rank that was given `worker` (a node's local
    rank 0); the other ranks only take part in the per-node sums."""

    def __init__(self, recipe: FineTuneRecipe, watch: MemWatch, worker: WorkerStatus | None,
                 node_rank: int | None) -> None:
        self.recipe, self.watch, self.node_rank = recipe, watch, node_rank
        self.entry = worker

    def fill(self, report: RuntimeReport, step: StepResult | None = None) -> RuntimeReport:
        """`report` with this node's entry; with a training `step`, a collective every rank must call: the node's
        NVMe (and HBM) peaks are its ranks' summed, its DRAM peak the launcher's process tree's."""
        if step is not None:
            nvme = report.strata["nvme"].peak_bytes if "nvme" in report.strata else 0
            hbm = self.recipe.hbm_peak_bytes
            assert self.recipe.engine is not None
            nvme_node, hbm_node = node_sums(self.recipe.ranks, self.recipe.engine.device, nvme, hbm)
            if "nvme" in report.strata:  # the job's peakMemory is then node-wide throughout, like its DRAM peak
                report.strata["nvme"] = report.strata["nvme"].model_copy(update={"peak_bytes": int(nvme_node)})
            if self.entry is not None:
                ranks = self.recipe.ranks
                peak = {"dram": self.watch.peak_rss, "nvme": int(nvme_node), **({"hbm": int(hbm_node)} if hbm else {})}
                self.entry = self.entry.model_copy(update={
                    "tokens_per_second": step.tokens / step.seconds * ranks.local_world / ranks.world
                    if step.seconds else None,
                    "peak_memory": {k: v for k, v in peak.items() if v}})
        return self.stage(report)

    def stage(self, report: RuntimeReport) -> RuntimeReport:
        """`report` with this node's entry at the report's step and stage (no collective)."""
        if self.entry is None:
            return report
        self.entry = self.entry.model_copy(update={"step": report.step, "stage": report.stage})
        return report.model_copy(update={"worker": self.entry, "node_rank": self.node_rank})


def _strata(watch: MemWatch, swap: SwapStatus | None, hbm: int = 0) -> dict[str, StratumCounters]:
    """Per stratum. Stock: the process tree's block I/O and the swap folder's size, watched from outside.
    memstrata: its NVMe engine's own counters (bytes through its namespaces, state live on them), and the
    activation checkpoints' pool when the plan put them on CXL. On a GPU, `hbm`: the device memory the process
    held at its peak (memstrata.runtime.train.observe.device)."""
    on_gpu = {"hbm": StratumCounters(peak_bytes=hbm)} if hbm else {}
    return {**on_gpu, **_host_strata(watch, swap)}


def _host_strata(watch: MemWatch, swap: SwapStatus | None) -> dict[str, StratumCounters]:
    if swap is not None:
        nvme, act = swap.nvme, swap.activations
        # Activation checkpoints on CXL nodes are that stratum's use (on DRAM they are inside the RSS already).
        cxl = ({"cxl": StratumCounters(peak_bytes=act.live_peak_bytes, bytes_written=act.offloaded_bytes,
                                       bytes_read=act.returned_bytes)}
               if act is not None and act.stratum == "cxl" else {})
        return {
            "dram": StratumCounters(peak_bytes=watch.peak_rss),
            "nvme": StratumCounters(peak_bytes=nvme.bytes_live_peak, bytes_written=nvme.bytes_written,
                                    bytes_read=nvme.bytes_read),
            **cxl,
        }
    io = watch.io()
    return {
        "dram": StratumCounters(peak_bytes=watch.peak_rss),
        "nvme": StratumCounters(peak_bytes=watch.peak_swap.bytes, bytes_written=io.write_bytes,
                                bytes_read=io.read_bytes),
    }


def step_status(watch: MemWatch, swap: SwapStatus | None, s: StepResult, total: int,
            elapsed: float, validation_loss: float | None = None, hbm: int = 0) -> RuntimeReport:
    return RuntimeReport(stage="training", step=s.step, total_steps=total, loss=s.loss,
                         learning_rate=s.learning_rate, validation_loss=validation_loss,
                         tokens_per_second=s.tokens / s.seconds if s.seconds else None,
                         elapsed_seconds=elapsed, strata=_strata(watch, swap, hbm))


class StepTrack:
    """Each step's scalars for TensorBoard (memstrata.runtime.train.observe.strata): from the same per-stratum
    counters the job's status carries, read when training starts (setup's loading I/O is not a step's) and after
    every step."""

    def __init__(self, watch: MemWatch, recipe: FineTuneRecipe) -> None:
        self.watch, self.recipe = watch, recipe
        swap = recipe.memstrata_status()
        self.steps = StepStrata(read_counters(_strata(watch, swap), recipe.phases, swap))

    def step(self, s: StepResult, swap: SwapStatus | None, strata: dict[str, StratumCounters]) -> dict[str, float]:
        """`strata`: the per-stratum counters read for this step's status (read once a step, not twice)."""
        r = self.recipe
        swap_dir = r.ds_swap_dir
        held = held_bytes(tree_rss(self.watch.root_pid), hbm_in_use(r.device()), swap,
                          dir_usage(swap_dir).bytes if swap is None and swap_dir is not None else 0)
        return self.steps.step(read_counters(strata, r.phases, swap), s.seconds, held)


def build_report(job: FineTuneJob, plan: Plan, recipe: FineTuneRecipe, result: TrainResult, watch: MemWatch,
                 swap_files_after_init: int) -> RunReport:
    spec, ds = job.spec, recipe.ds
    if ds is None:
        raise RuntimeError("build_report() before the recipe was set up")
    losses = [s.loss for s in result.steps]
    tokens = sum(s.tokens for s in result.steps)
    train_seconds = sum(s.seconds for s in result.steps)
    phases = {k: v for k, v in vars(result.phases).items() if v or k != "save"}
    phases["total"] = result.phases.init + train_seconds + result.phases.save
    return RunReport(
        job=job.metadata.name,
        model=spec.model.preset or str(spec.model.path),
        model_bytes=recipe.model_dir.tensor_bytes if recipe.model_dir is not None else 0,
        validation_losses=result.validation_losses,
        output=recipe.output,
        kept_best=recipe.selection.published,
        stopped_early=result.stopped_early,
        epochs=recipe.data.epochs_done() if recipe.data is not None else {},
        parameters=plan.parameters,
        trainable_parameters=plan.trainable_parameters,
        precision=spec.training.precision,
        engine=plan.engine,
        # Where the plan put the bytes, as the init line says: memstrata's engine configures DeepSpeed's optimizer
        # device as nvme even when nothing spills (its swapper keeps the DRAM share resident).
        offload={"param": plan.offload_device("weights"), "optimizer": plan.offload_device("master", "optimizer")},
        steps=len(result.steps),
        tokens=tokens,
        tokens_per_second=tokens / train_seconds if train_seconds else 0.0,
        losses=losses,
        loss=LossSummary.of(losses) if losses else None,
        resumed_from=recipe.resumed.step if recipe.resumed is not None else None,
        learning_rates=[s.learning_rate for s in result.steps if s.learning_rate is not None],
        schedule=describe(spec.training.schedule, spec.training.steps),
        layer_major=spec.training.gradient_accumulation if recipe.layer_major is not None else 0,
        peak_rss_bytes=watch.peak_rss,
        strata=_strata(watch, recipe.swap_status, recipe.hbm_peak_bytes),
        memstrata=recipe.swap_status,
        swap_dir=str(recipe.swap_dir),
        swap_files=watch.peak_swap.files,
        swap_files_after_init=swap_files_after_init,
        phases=phases,
        deepspeed_settings=[s.model_dump(mode="json") for s in ds.settings],
    )

"""`memstrata run FILE`: fine-tune a job on this machine, no cluster.

The CLI has loaded the job, checked its paths and built a feasible plan for
this machine (or `memstrata pod` has read what the operator planned); here the
recipe runs it, with memstrata's swap layer or on stock ZeRO-Infinity, while
`MemWatch` measures the process tree from the side, and the final report is
printed (and written as JSON when asked). Errors the user can fix print one
line and return 2 with nothing left behind.

A job of several ranks (`run_job`) runs `run_local` in every rank, started by
memstrata.runtime.train.launch; global rank 0 alone shows the progress, the
messages and the report, and writes the metrics and the report JSON. Each
node's local rank 0 measures the node (the launcher's process tree: all its
ranks) for its `status.workers` entry.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from memstrata.api.finetunejob import FineTuneJob, ResultStatus, WorkerStatus
from memstrata.api.inventory import Gpu
from memstrata.api.report import RuntimeReport, StratumCounters
from memstrata.api.strataplan import Plan
from memstrata.runtime.swap.status import SwapStatus
from memstrata.runtime.train.data import DatasetError
from memstrata.runtime.train.hfmodel import ModelDirError
from memstrata.runtime.train.launch import (LaunchError, Ranks, Terminated, launch, local_rendezvous, node_sums,
                                            stop_on_sigterm, worker_setup)
from memstrata.runtime.train.memwatch import MemWatch
from memstrata.runtime.train.metrics import MetricsError, MetricsWriter, StepResult
from memstrata.runtime.train.progress import LossSummary, ProgressBar, RunReport, Sample, render_report
from memstrata.runtime.train.recipe import FineTuneRecipe, RecipeError, TrainResult
from memstrata.runtime.train.schedule import describe

EXIT_USAGE = 2
EXIT_FAILED = 1


def torch_gpus() -> list[Gpu]:
    """This machine's GPUs as CUDA sees them (CUDA_VISIBLE_DEVICES, MIG included), for `memstrata run`:
    it trains with torch anyway, and a container may have the driver but no nvidia-smi."""
    import torch

    return [Gpu(index=i, name=torch.cuda.get_device_name(i), hbm_bytes=torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]


def _check_report_path(path: Path | None) -> None:
    """Refuse an unwritable report path before training, not after minutes of work."""
    if path is not None and not path.parent.is_dir():
        raise RecipeError(f"--report-json: {path.parent}: no such directory")


def several_nodes_refusal(job: FineTuneJob) -> str | None:
    """Why `memstrata run` cannot run `job` on this machine (a job of several nodes), or None."""
    nodes = job.spec.resources.nodes
    if nodes == 1:
        return None
    return (f"spec.resources.nodes: {nodes} nodes cannot run on this one machine: `memstrata run` runs one node "
            "(set nodes: 1, with ranksPerNode for several ranks here, or run the job on a cluster)")


def run_job(job: FineTuneJob, plan: Plan, *, nvme_path: Path, report_json: Path | None = None,
            sample_prompt: str | None = None, verbose: bool = False, resume: bool = False) -> int:
    """`memstrata run`: the job's ranks on this machine (spec.resources.nodes must be 1): one runs here, several
    are started by torch elastic, each running `run_local`."""
    resources = job.spec.resources
    refusal = several_nodes_refusal(job)
    if refusal is not None:
        print(f"memstrata: error: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    kwargs: dict[str, Any] = {"nvme_path": nvme_path, "report_json": report_json, "sample_prompt": sample_prompt,
                              "verbose": verbose, "resume": resume}
    stop_on_sigterm()  # `kill`, a service manager, a batch system's time limit: an orderly stop, not a torn one
    try:
        if resources.world_size() == 1:
            return run_local(job, plan, **kwargs)
        _check_report_path(report_json)  # once, before any rank starts
        return launch(_local_rank, (job, plan, kwargs), ranks=resources.ranks(),
                      rendezvous=local_rendezvous(job.metadata.name))
    except (RecipeError, LaunchError) as exc:
        print(f"memstrata: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Terminated as stop:
        print(f"memstrata: {job.metadata.name}: stopped by SIGTERM; its scratch files are removed", file=sys.stderr)
        return int(stop.code or 1)


def _local_rank(job: FineTuneJob, plan: Plan, kwargs: dict[str, Any]) -> None:
    """One rank of `run_job` (a spawned worker): what only rank 0 does is left to rank 0."""
    ranks = Ranks.from_env()
    worker_setup(ranks.local_world)
    if not ranks.leader:
        kwargs = {**kwargs, "report_json": None, "sample_prompt": None, "verbose": False}
    rc = run_local(job, plan, **kwargs)
    if rc != 0:
        raise SystemExit(rc)


def run_local(job: FineTuneJob, plan: Plan, *, nvme_path: Path, report_json: Path | None = None,
              on_report: Callable[[RuntimeReport], None] | None = None, sample_prompt: str | None = None,
              verbose: bool = False, resume: bool = False, job_uid: str = "",
              expected_checkpoint: int | None = None, worker: WorkerStatus | None = None,
              node_rank: int | None = None, on_error: Callable[[str], None] | None = None) -> int:
    """Train `job` here, then save the model to spec.output.path; `on_report` (the pod's status patches) gets
    every step's RuntimeReport, one when initialization starts, and a final one (stage finished or failed).
    `sample_prompt`: show the model's answer to it before training and, from the saved output, after.
    `resume`: continue from the newest intact checkpoint in spec.checkpoint.path, if any (a pod always does);
    `job_uid`: the FineTuneJob's uid, which that checkpoint must have been written for; `expected_checkpoint`: the
    newest checkpoint step the job's status reported, which must still be there. `worker` (this node's
    status.workers entry: its pod, node and ranks) and `node_rank`: a node's local rank 0 fills in the rest (step,
    stage, the node's tokens/s and peak memory) in every report it gives `on_report`.
    One of several ranks (launched): only global rank 0 speaks; errors are said by the rank that has them.
    `on_error`: also gets the line that says why the run failed (a pod puts it in its termination message)."""
    report_to = on_report or (lambda _r: None)
    ranks = Ranks.from_env()
    who = f"rank {ranks.rank}: " if ranks.world > 1 else ""

    said: list[str] = []

    def fail(why: str) -> None:
        print(f"memstrata: {who}{why}", file=sys.stderr)
        if on_error is not None and not said:  # the first error says why the run failed, not a cleanup after it
            on_error(f"{who}{why}")
        said.append(why)
    try:
        _check_report_path(report_json)
        recipe = FineTuneRecipe(job, plan, nvme_path, resume=resume, job_uid=job_uid,
                                expected_checkpoint=expected_checkpoint)
        recipe.load_data()  # a bad dataset file fails here, before the swap directory exists
    except (RecipeError, DatasetError) as exc:
        fail(f"error: {exc}")
        return EXIT_USAGE
    if recipe.finished is not None:
        print(f"memstrata: {who}{job.metadata.name}: {recipe.finished.path} already holds this job's model after step "
              f"{recipe.finished.step}: nothing left to do", file=sys.stderr)
        done = RuntimeReport(stage="finished", step=job.spec.training.steps, total_steps=job.spec.training.steps,
                             output=recipe.finished)
        if worker is not None:  # this pod's own entry says so too
            done = done.model_copy(update={"node_rank": node_rank, "worker": worker.model_copy(
                update={"step": done.step, "stage": done.stage})})
        report_to(done)
        return 0
    sample = None
    if sample_prompt is not None and recipe.model_dir is not None:
        before = _answer(recipe.model_dir.path, sample_prompt)
        sample = Sample(prompt=sample_prompt, before=before) if before is not None else None

    training = job.spec.training
    # DeepSpeed's swap folder (with memstrata: must stay empty); a node's local rank 0 watches the launcher's
    # process tree, which holds all of the node's ranks.
    launched = ranks.world > 1 and "TORCHELASTIC_RUN_ID" in os.environ
    watch = MemWatch(recipe.ds_swap_dir, root_pid=os.getppid() if launched and ranks.local_rank == 0 else None).start()
    bar = ProgressBar(training.steps, quiet=not ranks.leader)
    node = _NodeReport(recipe, watch, worker, node_rank)
    last = node.fill(RuntimeReport(stage="initializing", total_steps=training.steps))
    report_to(last)
    metrics: MetricsWriter | None = None
    validation: float | None = None  # the latest validation loss measured
    try:
        bar.message(f"memstrata: {job.metadata.name}: initializing DeepSpeed ZeRO-3 with the "
                    f"{recipe.engine_name} swap layer "
                    f"(weights -> {plan.offload_device('weights')}, optimizer state -> "
                    f"{plan.offload_device('master', 'optimizer')}) in {recipe.swap_dir}")
        recipe.setup()
        resumed_from = recipe.resumed.step if recipe.resumed is not None else None
        if recipe.resumed is not None:
            for why in recipe.resumed.skipped:
                bar.message(f"memstrata: passed over a damaged checkpoint: {why}")
            bar.message(f"memstrata: resumed from {recipe.resumed.directory} (step {resumed_from} of "
                        f"{training.steps})")
            last = last.model_copy(update={"step": resumed_from, "resumed_from": resumed_from,
                                           "loss": recipe.resumed.manifest.loss,
                                           "validation_loss": recipe.resumed.manifest.validation_loss,
                                           "checkpoint": recipe.checkpointer.latest if recipe.checkpointer else None})
            report_to(last)
            validation = recipe.resumed.manifest.validation_loss
        if job.spec.output is not None and ranks.leader:  # cut back to the resumed step: those after it are replayed
            metrics = MetricsWriter(Path(job.spec.output.metrics_dir()), resume_step=resumed_from).open()
        watch.sample()
        after_init = watch.peak_swap.files
        load_peak = watch.peak_rss
        started = time.perf_counter()  # the ETA extrapolates training steps, not initialization

        def on_validation(step: int, loss: float) -> None:
            nonlocal validation
            validation = loss
            if metrics is not None:
                metrics.write_validation(step, loss)

        def on_step(s: StepResult) -> None:
            nonlocal last, validation
            validation = s.validation_loss if s.validation_loss is not None else validation
            if metrics is not None:
                metrics.write_step(s)  # flushed: a killed run keeps every step it finished
            last = node.fill(_status(watch, recipe.memstrata_status(), s, training.steps,
                                     time.perf_counter() - started, validation, recipe.hbm_peak_bytes), s)
            last.resumed_from = resumed_from
            last.checkpoint = recipe.checkpointer.latest if recipe.checkpointer is not None else None
            if s.checkpoint_error is not None:
                latest = recipe.checkpointer.latest if recipe.checkpointer is not None else None
                bar.message(f"memstrata: warning: the checkpoint after step {s.step} failed, training goes on "
                            f"(latest checkpoint: {f'step {latest.step}' if latest else 'none'}): "
                            f"{s.checkpoint_error}")
            if s.checkpoint is not None:
                bar.message(f"memstrata: checkpoint at step {s.step}: {s.checkpoint.path} "
                            f"({s.checkpoint.bytes / 2**20:.1f} MiB in {s.checkpoint.seconds:.1f}s)")
            bar.update(last)
            report_to(last)

        with bar:
            result = recipe.train(on_step, on_validation)
        if job.spec.output is not None:
            bar.message(f"memstrata: saving the fine-tuned model to {job.spec.output.path}")
            t0 = time.perf_counter()
            last_validation = result.validation_losses.get(max(result.validation_losses, default=-1))
            if last_validation is None and recipe.resumed is not None:  # resumed after the last step itself
                last_validation = recipe.resumed.manifest.validation_loss
            recipe.save(training.steps, last_validation)
            result.phases.save = time.perf_counter() - t0
            # At once, not with the final report: a model on the volume must be reported even if this
            # process dies before the end.
            last = last.model_copy(update={"output": recipe.output})
            report_to(last)
    except (RecipeError, DatasetError, ModelDirError, MetricsError) as exc:
        fail(f"error: {exc}")
        report_to(node.stage(last.model_copy(update={"stage": "failed", "message": str(exc)})))
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 — a failed run still reports what it measured, then fails
        fail(f"run failed: {type(exc).__name__}: {exc}")
        report_to(node.stage(last.model_copy(update={"stage": "failed",
                                                     "message": f"{type(exc).__name__}: {exc}"})))
        return EXIT_FAILED
    finally:  # a failure here never replaces the run's own result, nor stops the steps after it
        unclean = close_all(fail, ("removing the swap layer and scratch directory", recipe.cleanup),
                            ("stopping the memory watch", watch.stop),
                            ("closing the metrics", metrics.close if metrics is not None else None))
    if unclean is not None:  # the run itself succeeded: the cleanup's failure is its result
        report_to(node.stage(last.model_copy(update={"stage": "failed", "message": unclean})))
        return EXIT_FAILED

    if sample is not None and recipe.output is not None:
        sample.after = _answer(Path(recipe.output.path), sample.prompt)
    report = build_report(job, plan, recipe, result, watch, after_init)
    report.load_peak_rss_bytes, report.sample = load_peak, sample
    final = ResultStatus(steps=last.step, train_loss=last.loss, validation_loss=validation)
    report_to(node.stage(last.model_copy(update={"stage": "finished", "strata": report.strata,
                                                 "output": recipe.output, "result": final})))
    if not ranks.leader:
        return 0
    render_report(report, verbose=verbose)
    if report_json is not None:
        report_json.write_text(json.dumps(report.model_dump(mode="json"), indent=2) + "\n")
    return 0


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


class _NodeReport:
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


def _answer(model_dir: Path, prompt: str) -> str | None:
    """The --sample answer, or None (said once) when the model cannot produce one here: a sample is a
    courtesy, never a reason to fail or to lose the report."""
    from memstrata.runtime.train.sample import answer

    try:
        return answer(model_dir, prompt)
    except Exception as exc:  # noqa: BLE001 - out of memory, a model transformers cannot generate with, ...
        print(f"memstrata: --sample: no answer from {model_dir}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _strata(watch: MemWatch, swap: SwapStatus | None, hbm: int = 0) -> dict[str, StratumCounters]:
    """Per stratum. Stock: the process tree's block I/O and the swap folder's size, watched from outside.
    memstrata: its NVMe engine's own counters (bytes through its namespaces, state live on them), and the
    activation checkpoints' pool when the plan put them on CXL. On a GPU, `hbm`: the device memory the process
    held at its peak (memstrata.runtime.train.device)."""
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


def _status(watch: MemWatch, swap: SwapStatus | None, s: StepResult, total: int,
            elapsed: float, validation_loss: float | None = None, hbm: int = 0) -> RuntimeReport:
    return RuntimeReport(stage="training", step=s.step, total_steps=total, loss=s.loss,
                         learning_rate=s.learning_rate, validation_loss=validation_loss,
                         tokens_per_second=s.tokens / s.seconds if s.seconds else None,
                         elapsed_seconds=elapsed, strata=_strata(watch, swap, hbm))


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
        parameters=plan.parameters,
        trainable_parameters=plan.trainable_parameters,
        precision=spec.training.precision,
        engine=spec.memory.engine,
        offload={"param": ds.offload_param, "optimizer": ds.offload_optimizer},
        steps=len(result.steps),
        tokens=tokens,
        tokens_per_second=tokens / train_seconds if train_seconds else 0.0,
        losses=losses,
        loss=LossSummary.of(losses) if losses else None,
        resumed_from=recipe.resumed.step if recipe.resumed is not None else None,
        learning_rates=[s.learning_rate for s in result.steps if s.learning_rate is not None],
        schedule=describe(spec.training.schedule),
        peak_rss_bytes=watch.peak_rss,
        strata=_strata(watch, recipe.swap_status, recipe.hbm_peak_bytes),
        memstrata=recipe.swap_status,
        swap_dir=str(recipe.swap_dir),
        swap_files=watch.peak_swap.files,
        swap_files_after_init=swap_files_after_init,
        phases=phases,
        deepspeed_settings=[s.model_dump(mode="json") for s in ds.settings],
    )

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

from memstrata.api.finetunejob import FineTuneJob
from memstrata.api.jobstatus import ResultStatus, WorkerStatus
from memstrata.api.inventory import Gpu
from memstrata.api.report import RuntimeReport
from memstrata.api.strataplan import Plan
from memstrata.plan.table import render_plan
from memstrata.runtime.train.data.pipeline import DatasetError
from memstrata.runtime.train.model.export import describe_output, mark_run_complete
from memstrata.runtime.train.model.hfmodel import ModelDirError
from memstrata.runtime.train.launch import (LaunchError, Ranks, Terminated, launch, local_rendezvous, stop_on_sigterm,
                                            worker_setup)
from memstrata.runtime.train.observe.memwatch import MemWatch
from memstrata.runtime.train.observe.metrics import MetricsError, MetricsWriter, StepResult, TrainResult
from memstrata.runtime.train.observe.progress import ProgressBar, Sample, render_report
from memstrata.runtime.train.preflight import RecipeError
from memstrata.runtime.train.recipe import FineTuneRecipe
from memstrata.runtime.train.runreport import NodeReport, StepTrack, build_report, close_all, step_status

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
    run = LocalRun(job, plan, Ranks.from_env(), on_report, on_error)
    try:
        _check_report_path(report_json)
        recipe = FineTuneRecipe(job, plan, nvme_path, resume=resume, job_uid=job_uid,
                                expected_checkpoint=expected_checkpoint)
        recipe.load_data()  # a bad dataset file fails here, before the swap directory exists
    except (RecipeError, DatasetError) as exc:
        run.fail(f"error: {exc}")
        return EXIT_USAGE
    if recipe.finished is not None:
        return run.already_done(recipe, worker, node_rank)
    sample = None
    if sample_prompt is not None and recipe.model_dir is not None:
        before = _answer(recipe.model_dir.path, sample_prompt)
        sample = Sample(prompt=sample_prompt, before=before) if before is not None else None
    run.start(recipe, worker, node_rank)
    try:
        result = run.train()
    except (RecipeError, DatasetError, ModelDirError, MetricsError) as exc:
        return run.failed(f"error: {exc}", str(exc), EXIT_USAGE)
    except Exception as exc:  # noqa: BLE001 — a failed run still reports what it measured, then fails
        return run.failed(f"run failed: {type(exc).__name__}: {exc}", f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    finally:  # a failure here never replaces the run's own result, nor stops the steps after it
        unclean = run.close()
    if unclean is not None:  # the run itself succeeded: the cleanup's failure is its result
        return run.failed(None, unclean, EXIT_FAILED)
    if sample is not None and recipe.output is not None:
        sample.after = _answer(Path(recipe.output.path), sample.prompt)
    return run.finish(result, sample, report_json, verbose)


class LocalRun:
    """One `run_local`, phase by phase: what it says, reports and must clean up, whatever phase it ends in."""

    def __init__(self, job: FineTuneJob, plan: Plan, ranks: Ranks, on_report: Callable[[RuntimeReport], None] | None,
                 on_error: Callable[[str], None] | None) -> None:
        self.job, self.plan, self.ranks = job, plan, ranks
        self.report_to: Callable[[RuntimeReport], None] = on_report or (lambda _r: None)
        self.on_error = on_error
        self.who = f"rank {ranks.rank}: " if ranks.world > 1 else ""
        self.said: list[str] = []
        self.metrics: MetricsWriter | None = None
        self.track: StepTrack | None = None  # the leader's per-step strata scalars, for the metrics
        self.validation: float | None = None  # the latest validation loss measured
        self.resumed_from: int | None = None
        self.started = 0.0  # when training (not initialization) started: the ETA extrapolates training steps
        self.after_init = self.load_peak = 0

    def fail(self, why: str) -> None:
        print(f"memstrata: {self.who}{why}", file=sys.stderr)
        if self.on_error is not None and not self.said:  # the first error says why the run failed, not a cleanup
            self.on_error(f"{self.who}{why}")
        self.said.append(why)

    def already_done(self, recipe: FineTuneRecipe, worker: WorkerStatus | None, node_rank: int | None) -> int:
        """The job's model is already in its output (a rerun after the save): report it finished, train nothing."""
        assert recipe.finished is not None
        steps = self.job.spec.training.steps
        print(f"memstrata: {self.who}{self.job.metadata.name}: {recipe.finished.path} already holds this job's "
              f"model after step {recipe.finished.step}: nothing left to do", file=sys.stderr)
        done = RuntimeReport(stage="finished", step=steps, total_steps=steps, output=recipe.finished)
        if worker is not None:  # this pod's own entry says so too
            done = done.model_copy(update={"node_rank": node_rank, "worker": worker.model_copy(
                update={"step": done.step, "stage": done.stage})})
        self.report_to(done)
        return 0

    def start(self, recipe: FineTuneRecipe, worker: WorkerStatus | None, node_rank: int | None) -> None:
        """Watch and report from here on; what is started here, close() stops."""
        self.recipe = recipe
        # DeepSpeed's swap folder (with memstrata: must stay empty); a node's local rank 0 watches the launcher's
        # process tree, which holds all of the node's ranks.
        launched = self.ranks.world > 1 and "TORCHELASTIC_RUN_ID" in os.environ
        self.watch = MemWatch(recipe.ds_swap_dir, root_pid=os.getppid() if launched and self.ranks.local_rank == 0
                              else None, cgroup=worker is not None).start()  # a pod's node: its container's peak
        self.bar = ProgressBar(self.job.spec.training.steps, quiet=not self.ranks.leader)
        self.node = NodeReport(recipe, self.watch, worker, node_rank)
        output = self.job.spec.output
        self.metrics_path = output.metrics_dir() if output is not None else None
        self.last = self.node.fill(RuntimeReport(stage="initializing", total_steps=self.job.spec.training.steps,
                                                 metrics_path=self.metrics_path))
        self.report_to(self.last)

    def train(self) -> TrainResult:
        self._set_up()
        with self.bar:
            result = self.recipe.train(self._on_step, self._on_validation)
        if self.job.spec.output is not None:
            self._save(result)
        return result

    def _set_up(self) -> None:
        recipe, plan, steps = self.recipe, self.plan, self.job.spec.training.steps
        self.bar.message(f"memstrata: {self.job.metadata.name}: initializing DeepSpeed ZeRO-3 with the "
                         f"{recipe.engine_name} swap layer (weights -> {plan.offload_device('weights')}, optimizer "
                         f"state -> {plan.offload_device('master', 'optimizer')}) in {recipe.swap_dir}")
        recipe.setup()
        if recipe.data is not None:
            self.bar.message(f"memstrata: {self.job.metadata.name}: training on {recipe.data.summary}")
        resumed = recipe.resumed
        if resumed is not None:
            self.resumed_from = resumed.step
            for why in resumed.skipped:
                self.bar.message(f"memstrata: passed over a damaged checkpoint: {why}")
            self.bar.message(f"memstrata: resumed from {resumed.directory} (step {resumed.step} of {steps})")
            self.last = self.last.model_copy(update={
                "step": resumed.step, "resumed_from": resumed.step, "loss": resumed.manifest.loss,
                "validation_loss": resumed.manifest.validation_loss,
                "checkpoint": recipe.checkpointer.latest if recipe.checkpointer else None})
            self.report_to(self.last)
            self.validation = resumed.manifest.validation_loss
        output = self.job.spec.output
        if output is not None and self.ranks.leader:  # cut back to the resumed step: those after it are replayed
            self.metrics = MetricsWriter(Path(output.metrics_dir()), resume_step=self.resumed_from).open()
            if self.resumed_from is None:  # step 0's text is there already in a resumed run's event files
                self.metrics.write_text("plan", render_plan(self.plan, f"{self.job.metadata.name}: the plan"))
            self.track = StepTrack(self.watch, recipe)
        self.watch.sample()
        self.after_init, self.load_peak = self.watch.peak_swap.files, self.watch.peak_rss
        self.started = time.perf_counter()

    def _on_validation(self, step: int, loss: float) -> None:
        self.validation = loss
        self._said_sample(step, self.recipe.sample)
        if self.metrics is not None:
            self.metrics.write_validation(step, loss, self.recipe.sample)

    def _said_sample(self, step: int, sample: str | None) -> None:
        if sample is not None:
            self.bar.message(f"memstrata: sample at step {step}: {sample!r}")

    def _on_step(self, s: StepResult) -> None:
        recipe = self.recipe
        self.validation = s.validation_loss if s.validation_loss is not None else self.validation
        self._said_sample(s.step, s.sample)
        swap = recipe.memstrata_status()
        status = step_status(self.watch, swap, s, self.job.spec.training.steps, time.perf_counter() - self.started,
                             self.validation, recipe.hbm_peak_bytes)
        if self.metrics is not None:  # flushed: a killed run keeps every step it finished
            # The status's own reading of the strata: TensorBoard and the job's status say the same of each step.
            self.metrics.write_step(s, self.track.step(s, swap, status.strata) if self.track is not None else None)
        self.last = self.node.fill(status, s)
        self.last.resumed_from = self.resumed_from
        self.last.metrics_path = self.metrics_path
        latest = recipe.checkpointer.latest if recipe.checkpointer is not None else None
        self.last.checkpoint = latest
        if s.checkpoint_error is not None:
            self.bar.message(f"memstrata: warning: the checkpoint after step {s.step} failed, training goes on "
                             f"(latest checkpoint: {f'step {latest.step}' if latest else 'none'}): "
                             f"{s.checkpoint_error}")
        if s.checkpoint is not None:
            self.bar.message(f"memstrata: checkpoint at step {s.step}: {s.checkpoint.path} "
                             f"({s.checkpoint.bytes / 2**20:.1f} MiB in {s.checkpoint.seconds:.1f}s)")
        self.bar.update(self.last)
        self.report_to(self.last)

    def _save(self, result: TrainResult) -> None:
        out, steps = self.job.spec.output, self.job.spec.training.steps
        assert out is not None
        if result.stopped_early is not None:
            self.bar.message(f"memstrata: {self.job.metadata.name}: {result.stopped_early}")
        t0 = time.perf_counter()
        best = self.recipe.selection.publish(steps)
        if best is not None:
            self.bar.message(f"memstrata: the output is the model of step {best.step}, the lowest validation loss "
                             f"({best.loss:.4f}): {out.path}")
            if self.ranks.leader:
                self.recipe.output = describe_output(Path(out.path))
        else:
            self.bar.message(f"memstrata: saving the fine-tuned model to {out.path}")
            last_validation = result.validation_losses.get(max(result.validation_losses, default=-1))
            if last_validation is None and self.recipe.resumed is not None:  # resumed after the last step itself
                last_validation = self.recipe.resumed.manifest.validation_loss
            self.recipe.save(result.steps[-1].step if result.steps else steps, last_validation)
            if result.stopped_early is not None and self.ranks.leader:
                mark_run_complete(Path(out.path), steps)
        result.phases.save = time.perf_counter() - t0
        # At once, not with the final report: a model on the volume must be reported even if this
        # process dies before the end.
        self.last = self.last.model_copy(update={"output": self.recipe.output})
        self.report_to(self.last)

    def failed(self, why: str | None, message: str, rc: int) -> int:
        """Say `why` (None: said already), report the run failed with `message`, and return `rc`."""
        if why is not None:
            self.fail(why)
        self.report_to(self.node.stage(self.last.model_copy(update={"stage": "failed", "message": message})))
        return rc

    def close(self) -> str | None:
        return close_all(self.fail, ("removing the swap layer and scratch directory", self.recipe.cleanup),
                         ("stopping the memory watch", self.watch.stop),
                         ("closing the metrics", self.metrics.close if self.metrics is not None else None))

    def finish(self, result: TrainResult, sample: Sample | None, report_json: Path | None, verbose: bool) -> int:
        report = build_report(self.job, self.plan, self.recipe, result, self.watch, self.after_init)
        report.load_peak_rss_bytes, report.sample = self.load_peak, sample
        final = ResultStatus(steps=self.last.step, train_loss=self.last.loss, validation_loss=self.validation)
        self.report_to(self.node.stage(self.last.model_copy(update={
            "stage": "finished", "strata": report.strata, "output": self.recipe.output, "result": final})))
        if not self.ranks.leader:
            return 0
        render_report(report, verbose=verbose)
        if report_json is not None:
            report_json.write_text(json.dumps(report.model_dump(mode="json"), indent=2) + "\n")
        return 0


def _answer(model_dir: Path, prompt: str) -> str | None:
    """The --sample answer, or None (said once) when the model cannot produce one here: a sample is a
    courtesy, never a reason to fail or to lose the report."""
    from memstrata.runtime.train.sample import answer

    try:
        return answer(model_dir, prompt)
    except Exception as exc:  # noqa: BLE001 - out of memory, a model transformers cannot generate with, ...
        print(f"memstrata: --sample: no answer from {model_dir}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None

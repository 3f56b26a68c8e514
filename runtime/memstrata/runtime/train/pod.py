"""`memstrata pod`: the job pod's entrypoint. RuntimeConfig in, training, status patches out.

The operator mounts the RuntimeConfig (ConfigMap key `runtime-config.json`)
and points `$MEMSTRATA_RUNTIME_CONFIG` at it; the device plugin hands the
container its NVMe namespaces and CXL nodes through the environment, which
memstrata.runtime.swap.stratamap prefers over the plan. This module turns the
config back into the FineTuneJob and Plan a local run takes, runs it
(memstrata.runtime.train.local), and merge-patches the job's status subresource
with a RuntimeReport every `reportIntervalSeconds` and once at the end,
through the ServiceAccount the operator made for the job (it may patch only
this job's status). A patch that fails is logged and retried with the next
report: an API server that is away for a minute must not end hours of
training.

A job that cannot swap where the pod would send it (`memory.engine: deepspeed` with NVMe in its
plan: raw namespaces have no filesystem for DeepSpeed's swap files, and the container's root
filesystem is no place for them) fails at once with the reason in the termination message.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from memstrata.api.finetunejob import GROUP, PLURAL, VERSION, FineTuneJob
from memstrata.api.inventory import ENV_NVME_DEVICES
from memstrata.api.manifest import describe_validation_error
from memstrata.api.report import RuntimeReport
from memstrata.api.runtimeconfig import ENV_RUNTIME_CONFIG, RUNTIME_CONFIG_VERSION, JobRef, RuntimeConfig
from memstrata.api.strataplan import Plan
from memstrata.runtime.train.dsconfig import deepspeed_swap_refusal

__all__ = ["PodConfigError", "StatusReporter", "load_config", "job_and_plan", "kubernetes_patcher", "run_pod"]

log = logging.getLogger("memstrata.pod")
EXIT_USAGE = 2
TERMINATION_LOG = Path("/dev/termination-log")  # Kubernetes shows its text in the pod's status


class PodConfigError(Exception):
    """The runtime config is missing or wrong; the message names the file and the field."""


def load_config(path: str | os.PathLike[str] | None) -> RuntimeConfig:
    if not path:
        raise PodConfigError(f"${ENV_RUNTIME_CONFIG} is not set: the operator mounts the runtime config and sets "
                             "it; outside a pod, use `memstrata run FILE`")
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise PodConfigError(f"{p}: cannot read the runtime config: {exc.strerror}") from None
    except ValueError as exc:
        raise PodConfigError(f"{p}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PodConfigError(f"{p}: the runtime config must be a JSON object, got {type(data).__name__}")
    version = data.get("version")
    if version != RUNTIME_CONFIG_VERSION:
        raise PodConfigError(f"{p}: version {version!r} is not {RUNTIME_CONFIG_VERSION!r}, the one this runtime "
                             "image reads: run the runtime image that matches the operator")
    try:
        return RuntimeConfig.model_validate(data)
    except ValidationError as exc:
        raise PodConfigError(f"{p}: {describe_validation_error(exc)}") from None


def job_and_plan(cfg: RuntimeConfig) -> tuple[FineTuneJob, Plan]:
    """The FineTuneJob and Plan a local run takes, from what the operator decided."""
    try:
        job = FineTuneJob.model_validate({
            "metadata": {"name": cfg.job.name, "namespace": cfg.job.namespace},
            "spec": {"model": cfg.model.wire(), "dataset": cfg.dataset.wire(), "training": cfg.training.wire(),
                     "resources": cfg.resources.wire(), "memory": cfg.memory.wire(),
                     **({"output": cfg.output.wire()} if cfg.output is not None else {}),
                     **({"checkpoint": cfg.checkpoint.wire()} if cfg.checkpoint is not None else {})},
        })
    except ValidationError as exc:
        raise PodConfigError(f"runtime config: {describe_validation_error(exc)}") from None
    try:
        plan = cfg.plan
    except ValidationError as exc:
        raise PodConfigError(f"runtime config: {describe_validation_error(exc, 'plan')}") from None
    return job, plan


class StatusReporter:
    """Sends RuntimeReports as status patches: at most one per `interval` while training, and always the
    last one. Failed patches are counted and logged, never raised. Each says which pod `attempt` it comes from,
    so the operator never takes what an earlier attempt reported (its resumedFrom) for this one's."""

    def __init__(self, patch: Callable[[dict[str, Any]], None], interval: float,
                 clock: Callable[[], float] = time.monotonic, attempt: int | None = None) -> None:
        self.patch, self.interval, self.clock, self.attempt = patch, interval, clock, attempt
        self._last = float("-inf")
        self._output: object = None
        self._checkpoint: object = None
        self.sent = 0
        self.failed = 0

    def __call__(self, report: RuntimeReport) -> None:
        # The saved model and a new checkpoint are news that must not wait for the next interval (the pod
        # may die before it; the operator announces a checkpoint when it sees it).
        new_output = report.output is not None and report.output != self._output
        new_checkpoint = report.checkpoint is not None and report.checkpoint != self._checkpoint
        final = report.stage in ("finished", "failed") or new_output or new_checkpoint
        now = self.clock()
        if not final and now - self._last < self.interval:
            return
        self._last = now
        if self.attempt is not None:
            report = report.model_copy(update={"attempt": self.attempt})
        try:
            self.patch(report.status_patch())
            self.sent += 1
            self._output, self._checkpoint = report.output, report.checkpoint
        except Exception as exc:  # noqa: BLE001 - the API being away must not stop training
            self.failed += 1
            log.warning("memstrata: status patch failed (%d so far), retried with the next report: %s",
                        self.failed, exc)


def kubernetes_patcher(ref: JobRef) -> Callable[[dict[str, Any]], None]:
    """Merge-patch this job's status subresource, with in-cluster credentials (or a kubeconfig outside)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise PodConfigError(f"no Kubernetes credentials to report into FineTuneJob {ref.namespace}/{ref.name}: "
                                 f"no service-account token is mounted and no kubeconfig works ({exc})") from None
    api = client.CustomObjectsApi()

    def patch(body: dict[str, Any]) -> None:
        api.patch_namespaced_custom_object_status(GROUP, VERSION, ref.namespace, PLURAL, ref.name, body,
                                                  _content_type="application/merge-patch+json")

    return patch


def _say_why(message: str) -> None:
    print(f"memstrata: {message}", file=sys.stderr)
    try:
        TERMINATION_LOG.write_text(message[:4000])
    except OSError:
        pass  # not in a pod


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def on_root_filesystem(path: Path) -> bool:
    """Whether `path` (or, while it does not exist yet, its nearest existing parent) is on the filesystem of
    `/`: in a pod, the container's own writable layer rather than a volume."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.stat(p).st_dev == os.stat("/").st_dev


def run_pod(nvme_path: Path, *, config_path: str | None = None,
            patcher: Callable[[JobRef], Callable[[dict[str, Any]], None]] = kubernetes_patcher) -> int:
    from memstrata.runtime.train.local import run_local

    try:
        cfg = load_config(config_path if config_path is not None else os.environ.get(ENV_RUNTIME_CONFIG))
        job, plan = job_and_plan(cfg)
        reporter = StatusReporter(patcher(cfg.job), cfg.report_interval_seconds, attempt=cfg.attempt)
    except PodConfigError as exc:
        _say_why(f"error: {exc}")
        return EXIT_USAGE
    granted = [p.strip() for p in os.environ.get(ENV_NVME_DEVICES, "").split(",") if p.strip()]
    refusal = deepspeed_swap_refusal(plan, job.spec.memory.engine, granted=granted, swap_dir=nvme_path,
                                     swap_dir_on_root=on_root_filesystem(nvme_path))
    if refusal is not None:
        _say_why(f"error: {refusal}")
        return EXIT_USAGE
    if job.spec.checkpoint is not None and on_root_filesystem(Path(job.spec.checkpoint.path)):
        log.warning("memstrata: spec.checkpoint.path %s is on the container's own filesystem: its checkpoints "
                    "do not survive this pod (mount a persistent volume there)", job.spec.checkpoint.path)
    # The kubelet stops a pod with SIGTERM, which PID 1 would ignore for the whole grace period while the next
    # attempt starts: end now (a checkpoint being written is removed, the last complete one stays).
    signal.signal(signal.SIGTERM, _terminated)
    # Every attempt resumes from the newest intact checkpoint of this job, if there is one.
    rc = run_local(job, plan, nvme_path=nvme_path, on_report=reporter, resume=True, job_uid=cfg.job.uid,
                   expected_checkpoint=cfg.checkpoint_step)
    if rc != 0:
        _say_why(f"{job.metadata.name}: training failed (exit {rc}); the lines above say why")
    log.info("memstrata: %d status patches sent, %d failed", reporter.sent, reporter.failed)
    return rc

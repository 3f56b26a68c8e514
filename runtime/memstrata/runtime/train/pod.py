"""`memstrata pod`: the job pod's entrypoint. RuntimeConfig in, training, status patches out.

The operator mounts the RuntimeConfig (ConfigMap key `runtime-config.json`)
and points `$MEMSTRATA_RUNTIME_CONFIG` at it; the device plugin hands the
container its NVMe namespaces and CXL nodes through the environment, which
memstrata.runtime.swap.stratamap prefers over the plan. The config carries
the job's spec whole and the typed plan: this module makes them the FineTuneJob
and Plan a local run takes, runs it
(memstrata.runtime.train.local), and merge-patches the job's status subresource
with a RuntimeReport every `reportIntervalSeconds` and once at the end,
through the ServiceAccount the operator made for the job (it may patch only
this job's status). A patch that fails is logged and retried with the next
report: an API server that is away for a minute must not end hours of
training.

Ranks: a pod is one node of the job. With more than one rank in the job, this
process becomes the node's torch elastic agent (memstrata.runtime.train.launch)
and starts `resources.ranks()` workers, each running this module's `_pod_rank`;
the agents of the job's PET_NNODES pods meet at MASTER_ADDR:MASTER_PORT. Global
rank 0 patches status.progress, peakMemory, output, checkpoint and result; each
pod's local rank 0 patches its own status.workers["<PET_NODE_RANK>"] (the pod
with global rank 0 in the same patch), and nothing else.

A job that cannot swap where the pod would send it (`memory.engine: deepspeed` with NVMe in its
plan: raw namespaces have no filesystem for DeepSpeed's swap files, and the container's root
filesystem is no place for them) fails at once with the reason in the termination message.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from memstrata.api.finetunejob import GROUP, PLURAL, VERSION, FineTuneJob
from memstrata.api.jobstatus import WorkerStatus
from memstrata.api import dra
from memstrata.api.inventory import ENV_NVME_DEVICES
from memstrata.api.validation import describe_validation_error
from memstrata.api.report import RuntimeReport
from memstrata.api.runtimeconfig import (
    ENV_MASTER_ADDR, ENV_MASTER_PORT, ENV_NNODES, ENV_NODE_NAME, ENV_NODE_RANK, ENV_POD_NAME, ENV_RUNTIME_CONFIG,
    RENDEZVOUS_PORT,
    RETIRED_CONFIG_VERSIONS, RUNTIME_CONFIG_VERSION, JobRef, RuntimeConfig,
)
from memstrata.api.strataplan import Plan
from memstrata.runtime.train.dsconfig import deepspeed_swap_refusal
from memstrata.runtime.train.launch import LaunchError, Ranks, Rendezvous, launch, stop_on_sigterm, worker_setup

__all__ = ["PodConfigError", "StatusReporter", "load_config", "job_and_plan", "kubernetes_patcher", "pod_rendezvous",
           "run_pod"]

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
    if version in RETIRED_CONFIG_VERSIONS:
        raise PodConfigError(f"{p}: version {version!r} was written by an earlier memstrata operator; this runtime "
                             f"image reads {RUNTIME_CONFIG_VERSION!r} only (the operator and the runtime image come "
                             "from one chart release): upgrade the operator with the chart, then retry the job")
    if version != RUNTIME_CONFIG_VERSION:
        raise PodConfigError(f"{p}: version {version!r} is not {RUNTIME_CONFIG_VERSION!r}, the one this runtime "
                             "image reads: run the runtime image that matches the operator")
    try:
        return RuntimeConfig.model_validate(data)
    except ValidationError as exc:
        raise PodConfigError(f"{p}: {describe_validation_error(exc)}") from None


def job_and_plan(cfg: RuntimeConfig) -> tuple[FineTuneJob, Plan]:
    """The FineTuneJob and Plan a local run takes: the config's spec and plan, as the operator decided them."""
    try:
        return cfg.finetune_job(), cfg.plan
    except ValidationError as exc:
        raise PodConfigError(f"runtime config: {describe_validation_error(exc)}") from None


class StatusReporter:
    """Sends RuntimeReports as status patches: at most one per `interval` while training, and always the
    last one. Failed patches are counted and logged, never raised. Each says which pod `attempt` it comes from,
    so the operator never takes what an earlier attempt reported (its resumedFrom) for this one's. `job`: whether
    this process reports for the job (global rank 0) or only its pod's status.workers entry."""

    def __init__(self, patch: Callable[[dict[str, Any]], None], interval: float,
                 clock: Callable[[], float] = time.monotonic, attempt: int | None = None, job: bool = True) -> None:
        self.patch, self.interval, self.clock, self.attempt, self.job = patch, interval, clock, attempt, job
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
            self.patch(report.status_patch(job=self.job))
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


def _say_why(message: str, keep_reason: bool = False) -> None:
    """Print `message` and make it the pod's termination message; `keep_reason`: unless a reason is
    already there (a rank's own error, which says more than any summary)."""
    print(f"memstrata: {message}", file=sys.stderr)
    if keep_reason:
        try:
            if TERMINATION_LOG.read_text().strip():
                return
        except OSError:
            pass
    _record_reason(message)


def _forget_reason() -> None:
    """An earlier run's reason (the same file, rerun by hand) must not stand for this run's."""
    if TERMINATION_LOG.is_file():
        try:
            TERMINATION_LOG.write_text("")
        except OSError:
            pass


def _record_reason(message: str) -> None:
    """The termination message (the kubelet copies it into the pod's status, which the operator puts in the
    job's Failed condition). At most 4 KiB: Kubernetes keeps no more."""
    try:
        TERMINATION_LOG.write_text(message[:4000])
    except OSError:
        pass  # not in a pod


def on_root_filesystem(path: Path) -> bool:
    """Whether `path` (or, while it does not exist yet, its nearest existing parent) is on the filesystem of
    `/`: in a pod, the container's own writable layer rather than a volume."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.stat(p).st_dev == os.stat("/").st_dev


def pod_rendezvous(cfg: RuntimeConfig, env: Mapping[str, str]) -> Rendezvous:
    """Where this pod's agent meets the job's other pods: the operator's env (api.runtimeconfig); a one-node job
    needs none of it and meets itself on 127.0.0.1."""
    nodes = cfg.spec.resources.nodes

    def number(key: str, default: int) -> int:
        try:
            return int(env.get(key, default))
        except ValueError:
            raise PodConfigError(f"${key}: expected an integer, got {env[key]!r}") from None

    if number(ENV_NNODES, nodes) != nodes:
        raise PodConfigError(f"${ENV_NNODES}: {env[ENV_NNODES]} nodes, but the runtime config's resources.nodes is "
                             f"{nodes}")
    node_rank = number(ENV_NODE_RANK, 0)
    if not 0 <= node_rank < nodes:
        raise PodConfigError(f"${ENV_NODE_RANK}: {node_rank} is not one of the job's {nodes} nodes")
    addr = env.get(ENV_MASTER_ADDR, "")
    if nodes > 1 and not addr:
        raise PodConfigError(f"${ENV_MASTER_ADDR} is not set: a job on {nodes} nodes meets at node 0's address, which "
                             "the operator sets on every pod")
    return Rendezvous(nodes=nodes, node_rank=node_rank, master_addr=addr or "127.0.0.1",
                      master_port=number(ENV_MASTER_PORT, RENDEZVOUS_PORT),
                      run_id=f"{cfg.job.uid or cfg.job.name}-{cfg.attempt}",
                      local_addr=None if nodes > 1 else "127.0.0.1")


def run_pod(nvme_path: Path, *, config_path: str | None = None,
            patcher: Callable[[JobRef], Callable[[dict[str, Any]], None]] = kubernetes_patcher) -> int:
    """`patcher` makes the status patch function of a reporting process (in every rank that reports, so with
    several ranks it must be a module-level function, which the spawned workers import by name)."""
    _forget_reason()
    try:
        path = config_path if config_path is not None else os.environ.get(ENV_RUNTIME_CONFIG)
        cfg = load_config(path)
        job, plan = job_and_plan(cfg)
        patch = patcher(cfg.job)  # credentials are checked here, before any rank starts
        rendezvous = pod_rendezvous(cfg, os.environ) if job.spec.resources.world_size() > 1 else None
    except PodConfigError as exc:
        _say_why(f"error: {exc}")
        return EXIT_USAGE
    granted = [p.strip() for p in os.environ.get(ENV_NVME_DEVICES, "").split(",") if p.strip()]
    refusal = (dra.namespaces_missing(os.environ.get(dra.ENV_CLAIMED_NAMESPACES), len(granted))
               or deepspeed_swap_refusal(plan, granted=granted, swap_dir=nvme_path,
                                         swap_dir_on_root=on_root_filesystem(nvme_path)))
    if refusal is not None:
        _say_why(f"error: {refusal}")
        return EXIT_USAGE
    if job.spec.checkpoint is not None and on_root_filesystem(Path(job.spec.checkpoint.path)):
        log.warning("memstrata: spec.checkpoint.path %s is on the container's own filesystem: its checkpoints "
                    "do not survive this pod (mount a persistent volume there)", job.spec.checkpoint.path)
    # The kubelet stops a pod with SIGTERM, which PID 1 would ignore for the whole grace period while the next
    # attempt starts: end now (a checkpoint being written is removed, the last complete one stays). With
    # several ranks, torch elastic's agent takes SIGTERM over and passes it on to the ranks.
    stop_on_sigterm()
    if rendezvous is None:
        rc = _train(cfg, job, plan, nvme_path, Ranks(), node_rank=0, patch=patch)
    else:
        try:
            rc = launch(_pod_rank, (nvme_path, str(path), patcher, rendezvous.node_rank),
                        ranks=job.spec.resources.ranks(), rendezvous=rendezvous)
        except LaunchError as exc:
            _say_why(f"error: {exc}")
            return EXIT_USAGE
    if rc != 0:
        # Only when no rank said why: the reason, not this summary, is what the job's Failed condition shows.
        _say_why(f"{job.metadata.name}: training failed (exit {rc}); the lines above say why", keep_reason=True)
    return rc


def _pod_rank(nvme_path: Path, config_path: str, patcher: Callable[[JobRef], Callable[[dict[str, Any]], None]],
              node_rank: int) -> None:
    """One rank of a pod's job (a spawned worker)."""
    ranks = Ranks.from_env()
    cfg = load_config(config_path)
    job, plan = job_and_plan(cfg)
    worker_setup(ranks.local_world)
    # Only the ranks that report need the API: the others never open a connection to it.
    patch = patcher(cfg.job) if ranks.local_rank == 0 else None
    rc = _train(cfg, job, plan, nvme_path, ranks, node_rank=node_rank, patch=patch)
    if rc != 0:
        raise SystemExit(rc)


def _train(cfg: RuntimeConfig, job: FineTuneJob, plan: Plan, nvme_path: Path, ranks: Ranks, *, node_rank: int,
           patch: Callable[[dict[str, Any]], None] | None) -> int:
    """This rank's run: global rank 0 reports for the job, a node's local rank 0 its pod's workers entry."""
    from memstrata.runtime.train.local import run_local

    reporter = worker = None
    if patch is not None and ranks.local_rank == 0:
        reporter = StatusReporter(patch, cfg.report_interval_seconds, attempt=cfg.attempt, job=ranks.leader)
        # The config names node rank 0's node; a pod of a multi-node job learns its own from the downward API.
        worker = WorkerStatus(pod=os.environ.get(ENV_POD_NAME) or os.environ.get("HOSTNAME", ""),
                              node=os.environ.get(ENV_NODE_NAME) or cfg.node or None, ranks=ranks.local_world,
                              attempt=cfg.attempt)
    # Every attempt resumes from the newest intact checkpoint of this job, if there is one.
    rc = run_local(job, plan, nvme_path=nvme_path, on_report=reporter, resume=True, job_uid=cfg.job.uid,
                   expected_checkpoint=cfg.checkpoint_step, worker=worker, node_rank=node_rank,
                   on_error=_record_reason)
    if reporter is not None:
        log.info("memstrata: %d status patches sent, %d failed", reporter.sent, reporter.failed)
    return rc

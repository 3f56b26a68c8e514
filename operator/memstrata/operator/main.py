"""`memstrata operator`: run the FineTuneJob operator until SIGTERM/SIGINT.

    memstrata operator [--kubeconfig FILE] [--namespace NS ...] [--standalone | --lease NAME]
                       [--lease-namespace NS] [--identity ID] [--liveness http://0.0.0.0:8080/healthz]
                       [--metrics-bind-address :9090]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import uuid

from memstrata.operator.jobpolicy import RUNTIME_IMAGES, SAFE_VOLUME_TYPES, JobPolicy
from memstrata.operator.leadership import LeaseTiming
from memstrata.operator.lifecycle import LifecyclePolicy
from memstrata.api.podidentity import DISK_GID, parse_device_gid
from memstrata.api.serving import METRICS_PORT, parse_bind_address
from memstrata.operator.render import PodSecurity
from memstrata.operator.settings import OperatorConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memstrata operator", description="Run the FineTuneJob operator.")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--namespace", "-n", action="append", default=[],
                   help="serve only this namespace (repeatable; default: all namespaces)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--lease", default="memstrata-operator",
                       help="coordination.k8s.io Lease the replicas elect a leader with; only the leader "
                            "acts (default: %(default)s)")
    group.add_argument("--standalone", action="store_true",
                       help="no leader election: this must be the only replica")
    p.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE") or "default",
                   help="namespace of the Lease (default: $POD_NAMESPACE, else %(default)s)")
    p.add_argument("--identity", help="this replica's name in the Lease (default: $POD_NAME or the host name, "
                                      "plus a random suffix)")
    p.add_argument("--lease-duration-seconds", type=float, default=15.0,
                   help="how long a silent leader keeps the others waiting (default: %(default)s)")
    p.add_argument("--renew-deadline-seconds", type=float, default=10.0,
                   help="how long the leader acts without renewing (default: %(default)s)")
    p.add_argument("--retry-period-seconds", type=float, default=2.0,
                   help="how often the Lease is renewed or tried (default: %(default)s)")
    p.add_argument("--liveness", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-bind-address", default="0", metavar="HOST:PORT",
                   help=f"serve Prometheus metrics on http://HOST:PORT/metrics, e.g. :{METRICS_PORT} "
                        "(default: %(default)s, off)")
    p.add_argument("--workers", type=int, default=16, help="concurrent reconciles (default: %(default)s)")
    p.add_argument("--backoff-base-seconds", type=float, default=10.0,
                   help="delay before the 2nd attempt, doubling per failure (default: %(default)s)")
    p.add_argument("--backoff-max-seconds", type=float, default=360.0, help="cap of that delay")
    p.add_argument("--unschedulable-retry-seconds", type=float, default=30.0,
                   help="re-place waiting jobs at least this often (default: %(default)s)")
    p.add_argument("--report-interval-seconds", type=float, default=10.0,
                   help="how often runtimes report progress (default: %(default)s)")
    p.add_argument("--training-device-gid", default=str(DISK_GID),
                   help="group owning the NVMe device nodes on the nodes, added to training pods; 'none' where "
                        "containerd sets device_ownership_from_security_context (default: %(default)s, disk)")
    p.add_argument("--training-seccomp-profile", default="RuntimeDefault",
                   help="training pods' seccomp profile: RuntimeDefault or localhost/<file> (default: %(default)s)")
    p.add_argument("--device-api", choices=("device-plugin", "dra"), default="device-plugin",
                   help="how training pods get namespaces and CXL memory, as the node agents serve them: device-plugin "
                        "(extended resources) or dra (a ResourceClaimTemplate per job; Kubernetes >= 1.36) "
                        "(default: %(default)s)")
    p.add_argument("--gpu-device-class", default=None, metavar="CLASS",
                   help="with --device-api dra: claim GPUs from this DeviceClass (e.g. gpu.nvidia.com) instead of "
                        "requesting nvidia.com/gpu (default: the extended resource)")
    p.add_argument("--kueue", action="store_true",
                   help="queue jobs labelled kueue.x-k8s.io/queue-name through Kueue: a Workload per job, which "
                        "Kueue admits, preempts and requeues (needs Kueue >= 0.17 serving kueue.x-k8s.io/v1beta2)")
    p.add_argument("--allowed-volume-type", action="append", default=[], metavar="TYPE",
                   help="a volume type jobs may use beyond " + ", ".join(SAFE_VOLUME_TYPES) + " (repeatable; "
                        "e.g. nfs, csi, hostPath: each gives every job's submitter what the type reaches)")
    p.add_argument("--allowed-image", action="append", default=[], metavar="PATTERN",
                   help="an image jobs may run: a reference, or a prefix ending in * ('*' alone: any image); "
                        "repeatable (default: " + ", ".join(RUNTIME_IMAGES) + ")")
    p.add_argument("--allow-custom-commands", action="store_true",
                   help="let spec.command be anything, not only the runtime's own entrypoint")
    p.add_argument("--verbose", "-v", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    if args.workers < 1:
        raise SystemExit("memstrata operator: --workers must be at least 1")
    try:
        timing = LeaseTiming(args.lease_duration_seconds, args.renew_deadline_seconds, args.retry_period_seconds)
    except ValueError as exc:
        raise SystemExit(f"memstrata operator: --lease-duration-seconds/--renew-deadline-seconds/"
                         f"--retry-period-seconds: {exc}") from None
    try:
        security = PodSecurity(device_gid=parse_device_gid(args.training_device_gid),
                               seccomp_profile=args.training_seccomp_profile, dra=args.device_api == "dra",
                               gpu_device_class=args.gpu_device_class)
    except ValueError as exc:
        raise SystemExit(f"memstrata operator: --training-device-gid/--training-seccomp-profile: {exc}") from None
    if args.gpu_device_class and args.device_api != "dra":
        raise SystemExit("memstrata operator: --gpu-device-class needs --device-api dra")
    try:
        jobs = JobPolicy(volume_types=tuple(args.allowed_volume_type),
                         images=tuple(args.allowed_image) or RUNTIME_IMAGES,
                         custom_commands=args.allow_custom_commands)
    except ValueError as exc:
        raise SystemExit(f"memstrata operator: --allowed-volume-type/--allowed-image: {exc}") from None
    try:
        metrics_address = parse_bind_address(args.metrics_bind_address)
    except ValueError as exc:
        raise SystemExit(f"memstrata operator: --metrics-bind-address: {exc}") from None
    identity = args.identity or f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    return OperatorConfig(
        kubeconfig=args.kubeconfig,
        namespaces=tuple(args.namespace),
        lease=None if args.standalone else args.lease,
        lease_namespace=args.lease_namespace,
        identity=identity,
        lease_timing=timing,
        liveness=args.liveness,
        metrics_address=metrics_address,
        workers=args.workers,
        policy=LifecyclePolicy(backoff_base_seconds=args.backoff_base_seconds,
                               backoff_max_seconds=args.backoff_max_seconds,
                               unschedulable_retry_seconds=args.unschedulable_retry_seconds, jobs=jobs,
                               kueue=args.kueue),
        report_interval_seconds=args.report_interval_seconds,
        pod_security=security,
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    import kopf

    from memstrata.operator.handlers import build_registry
    from memstrata.operator.kube import Kube
    from memstrata.operator.leadership import AlwaysLeading, Elector
    from prometheus_client import start_http_server

    from memstrata.operator.metrics import OperatorMetrics
    from memstrata.operator.reconciler import Reconciler

    kopf.configure(verbose=args.verbose)
    if not args.verbose:
        # One "Handler succeeded" line per watch event is most of the operator's CPU under a burst.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kube = Kube.from_config(config.kubeconfig)
    # Its own connection pool: a renewal never queues behind the reconciler's requests, and its writes
    # are not subject to the gate they decide.
    elector = (Elector(Kube.from_config(config.kubeconfig), config.lease_namespace, config.lease, config.identity,
                       config.lease_timing) if config.lease else None)
    metrics = OperatorMetrics()
    metrics.live.lease, metrics.live.identity = config.lease or "", config.identity
    reconciler = Reconciler(kube, config.policy, workers=config.workers,
                            report_interval_seconds=config.report_interval_seconds,
                            cleanup_tries=config.cleanup_tries, gate=elector or AlwaysLeading(),
                            pod_security=config.pod_security, metrics=metrics)
    if elector is not None:
        elector.on_started = reconciler.resume
    registry = build_registry(reconciler, config, elector)
    try:  # before Kopf starts: a port taken is the operator's start-up error, not a silent gap in the graphs
        server = (start_http_server(config.metrics_address[1], config.metrics_address[0], metrics.registry)[0]
                  if config.metrics_address else None)
    except OSError as exc:
        raise SystemExit(f"memstrata operator: --metrics-bind-address {args.metrics_bind_address}: "
                         f"{exc.strerror or exc}") from None
    try:
        asyncio.run(kopf.operator(
            registry=registry,
            clusterwide=not config.namespaces,
            namespaces=list(config.namespaces),
            standalone=True,
            liveness_endpoint=config.liveness,
        ))
    finally:
        if server is not None:
            server.shutdown()
    return 0

"""`memstrata operator`: run the FineTuneJob operator until SIGTERM/SIGINT.

    memstrata operator [--kubeconfig FILE] [--namespace NS ...] [--standalone | --peering NAME]
                       [--priority N] [--liveness http://0.0.0.0:8080/healthz]
"""
from __future__ import annotations

import argparse
import asyncio
import logging

from memstrata.operator.lifecycle import LifecyclePolicy
from memstrata.operator.settings import OperatorConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memstrata operator", description="Run the FineTuneJob operator.")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--namespace", "-n", action="append", default=[],
                   help="serve only this namespace (repeatable; default: all namespaces)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--peering", default="memstrata",
                       help="Kopf peering name shared by replicas; one is active (default: %(default)s)")
    group.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    p.add_argument("--priority", type=int, help="peering priority (default: random, so replicas never tie)")
    p.add_argument("--liveness", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--workers", type=int, default=16, help="concurrent reconciles (default: %(default)s)")
    p.add_argument("--backoff-base-seconds", type=float, default=10.0,
                   help="delay before the 2nd attempt, doubling per failure (default: %(default)s)")
    p.add_argument("--backoff-max-seconds", type=float, default=360.0, help="cap of that delay")
    p.add_argument("--unschedulable-retry-seconds", type=float, default=30.0,
                   help="re-place waiting jobs at least this often (default: %(default)s)")
    p.add_argument("--report-interval-seconds", type=float, default=10.0,
                   help="how often runtimes report progress (default: %(default)s)")
    p.add_argument("--verbose", "-v", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    if args.workers < 1:
        raise SystemExit("memstrata operator: --workers must be at least 1")
    extra = {"priority": args.priority} if args.priority is not None else {}
    return OperatorConfig(
        kubeconfig=args.kubeconfig,
        namespaces=tuple(args.namespace),
        peering=None if args.standalone else args.peering,
        liveness=args.liveness,
        workers=args.workers,
        policy=LifecyclePolicy(backoff_base_seconds=args.backoff_base_seconds,
                               backoff_max_seconds=args.backoff_max_seconds,
                               unschedulable_retry_seconds=args.unschedulable_retry_seconds),
        report_interval_seconds=args.report_interval_seconds,
        **extra,
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    import kopf

    from memstrata.operator.handlers import build_registry
    from memstrata.operator.kube import Kube
    from memstrata.operator.reconciler import Reconciler

    kopf.configure(verbose=args.verbose)
    if not args.verbose:
        # One "Handler succeeded" line per watch event is most of the operator's CPU under a burst.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    kube = Kube.from_config(config.kubeconfig)
    reconciler = Reconciler(kube, config.policy, workers=config.workers,
                            report_interval_seconds=config.report_interval_seconds,
                            cleanup_tries=config.cleanup_tries)
    registry = build_registry(reconciler, config)
    asyncio.run(kopf.operator(
        registry=registry,
        clusterwide=not config.namespaces,
        namespaces=list(config.namespaces),
        standalone=config.peering is None,
        peering_name=config.peering,
        priority=config.priority,
        liveness_endpoint=config.liveness,
    ))
    return 0

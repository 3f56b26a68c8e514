"""Starting a job's ranks: one process alone, or torch elastic's agent with one worker per rank.

A world of one (`spec.resources` nodes 1 x 1 rank) runs in this process, exactly as before ranks existed.
Any other world is started by torch elastic (`elastic_launch`): this process becomes the node's agent,
`resources.ranks()` workers are spawned on it, and the agents of all `resources.nodes` nodes meet through a
c10d rendezvous at MASTER_ADDR:MASTER_PORT, hosted by node 0. Each worker runs the same entry function with
the same arguments; torch elastic sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT for it (memstrata.runtime.train.recipe.Ranks reads them).

Failure: `max_restarts` is 0, so one failed rank stops the node's others and the agent returns the failing
rank's exit status (its error is on stderr, where the worker printed it); across nodes, the operator restarts
the whole attempt. SIGTERM on the agent is passed on to its workers (torch elastic's own handler), each of
which then ends its run as a lone process would (`stop_on_sigterm`).

c10d numbers the nodes in the order of their agents' (host name, pid), not by PET_NODE_RANK: global rank 0
(which reports the job's progress and writes its output) is on whichever node sorts first. Each pod's
status.workers entry is keyed by its own PET_NODE_RANK all the same.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Ranks", "Rendezvous", "LaunchError", "Terminated", "launch", "local_rendezvous", "node_sums",
           "stop_on_sigterm", "threads_per_rank", "world_sum"]

log = logging.getLogger("memstrata.launch")
EXIT_FAILED = 1


class LaunchError(ValueError):
    """The ranks cannot be started as asked; the message names the field or variable."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the job's training processes, as the launcher's environment says."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    local_world: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Ranks":
        """torchrun's / torch elastic's variables; none set: one process alone."""
        env = os.environ if env is None else env
        try:
            return cls(rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
                       world=int(env.get("WORLD_SIZE", "1")),
                       local_world=int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))))
        except ValueError:
            raise LaunchError("RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE: expected integers, got "
                              f"{[env.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE')]}"
                              ) from None

    @property
    def leader(self) -> bool:
        """Global rank 0: the one that reports, writes metrics and saves."""
        return self.rank == 0


def world_sum(ranks: Ranks, device: Any, *values: float) -> list[float]:
    """`values` summed over every rank (as they are, alone); a collective: every rank must call it."""
    if ranks.world == 1:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]


def node_sums(ranks: Ranks, device: Any, *values: float) -> list[float]:
    """`values` summed over the ranks of this node (each rank's own, alone); a collective: every rank must call
    it. Torch elastic numbers ranks node by node, so this node's are rank // local_world."""
    if ranks.world == 1:
        return list(values)
    import torch
    import torch.distributed as dist

    nodes, mine = ranks.world // ranks.local_world, ranks.rank // ranks.local_world
    t = torch.zeros((nodes, len(values)), dtype=torch.float64, device=device)
    t[mine] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t[mine].tolist()]


@dataclass(frozen=True)
class Rendezvous:
    """Where this node's agent meets the others'."""

    nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    run_id: str
    local_addr: str | None = None  # this node's address as the others reach it (None: its FQDN)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_rendezvous(name: str) -> Rendezvous:
    """One node, this machine: 127.0.0.1 and a free port (`memstrata run`)."""
    return Rendezvous(nodes=1, node_rank=0, master_addr="127.0.0.1", master_port=free_port(),
                      run_id=f"{name}-{uuid.uuid4().hex[:8]}", local_addr="127.0.0.1")


def threads_per_rank(ranks: int) -> int:
    """CPU threads each of a node's `ranks` ranks computes with: the cores shared out, so the ranks of a node do not
    oversubscribe it (torch, and DeepSpeed's CPU Adam through OpenMP, would give each of them every core). On a GPU
    node too: there the CPU runs the optimizer step of every rank at once."""
    return max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
               // max(ranks, 1))


def launch(entry: Callable[..., Any], args: tuple[Any, ...], *, ranks: int, rendezvous: Rendezvous) -> int:
    """Run `entry(*args)` as `ranks` workers on this node of `rendezvous.nodes`; the exit status (0, or the first
    failed rank's). `entry` must be a module-level function (the workers are spawned, and import it by name) that
    exits nonzero (SystemExit) when its rank fails."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    r = rendezvous
    if not 0 <= r.node_rank < r.nodes:
        raise LaunchError(f"PET_NODE_RANK: {r.node_rank} is not a node of the job's {r.nodes} (PET_NNODES)")
    config = LaunchConfig(
        min_nodes=r.nodes, max_nodes=r.nodes, nproc_per_node=ranks, run_id=r.run_id,
        rdzv_backend="c10d", rdzv_endpoint=f"{r.master_addr}:{r.master_port}",
        # Node 0 hosts the rendezvous store at MASTER_ADDR:MASTER_PORT; the others connect to it.
        rdzv_configs={"is_host": r.node_rank == 0},
        max_restarts=0,  # a failed rank fails the attempt; the operator restarts all of its pods together
        monitor_interval=0.5, start_method="spawn", local_addr=r.local_addr,
    )
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        # Its per-round lines, and its own traceback of a rank that failed, would bury what the rank said.
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # The workers inherit it: OpenMP (DeepSpeed's CPU Adam) reads it when it starts, before any code of ours runs.
    inherited = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(_omp_threads(inherited, ranks))
    try:
        elastic_launch(config, entry)(*args)
    except ChildFailedError as exc:
        rank, first = min(exc.failures.items(), key=lambda kv: kv[1].timestamp)
        code = first.exitcode if first.exitcode > 0 else 128 - first.exitcode  # killed by signal n: -n
        print(f"memstrata: rank {rank} (local rank {first.local_rank}, pid {first.pid}) failed with exit status "
              f"{code}; the node's other ranks were stopped", file=sys.stderr)
        return code
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except Exception as exc:  # noqa: BLE001 - a rendezvous that never completes, workers that cannot start
        print(f"memstrata: node {r.node_rank} of {r.nodes} (PET_NODE_RANK of PET_NNODES) could not start its "
              f"{ranks} rank(s) through the rendezvous at {r.master_addr}:{r.master_port} (MASTER_ADDR:MASTER_PORT): "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if inherited is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = inherited
    return 0


def _omp_threads(value: str | None, ranks: int) -> int:
    """OMP_NUM_THREADS as the user set it (a positive number), else the rank's share of the cores."""
    try:
        threads = int(value or 0)
    except ValueError:
        threads = 0
    return threads if threads > 0 else threads_per_rank(ranks)


def worker_setup(ranks: int) -> None:
    """What every spawned worker does first: take its share of the node's cores (GPU node or not: `launch` exported
    it as OMP_NUM_THREADS, which the user may have set instead), and end on SIGTERM like a lone process (the agent
    forwards the kubelet's)."""
    import torch

    torch.set_num_threads(_omp_threads(os.environ.get("OMP_NUM_THREADS"), ranks))
    stop_on_sigterm()


class Terminated(SystemExit):
    """SIGTERM arrived: the run stops as it would on an error (every `finally`, its cleanup included, runs)
    and the process ends with 128 + SIGTERM."""


def stop_on_sigterm() -> None:
    """Make SIGTERM an orderly stop of this process: `Terminated` raised in the main thread. Its default would
    end the process at once, leaving the run's scratch directory, its swap files and a partial output behind."""
    signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, _frame: object) -> None:
    # Once: a second SIGTERM must not cut the cleanup the first one started short (SIGKILL still ends it).
    signal.signal(signum, signal.SIG_IGN)
    raise Terminated(128 + signum)

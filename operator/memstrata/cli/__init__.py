"""The `memstrata` command: crd, plan, run, pod, inspect-model, operator, nodeagent.

User errors (a bad manifest, an impossible plan, an unusable path) print one
line naming what is wrong and exit with status 2 before anything is written.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from memstrata.api.dataset import Dataset
    from memstrata.api.finetunejob import FineTuneJobSpec
    from memstrata.api.strataplan import Plan

EXIT_USAGE = 2
DEFAULT_NVME_PATH = Path(os.environ.get("MEMSTRATA_NVME_PATH", Path.home() / ".cache/memstrata/nvme-scratch"))


class UserError(Exception):
    """Raised for input the user can fix; main() prints it and exits 2."""


def _cmd_crd(args: argparse.Namespace) -> int:
    from memstrata.api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from memstrata.api import load_job, load_node
    from memstrata.cli.modelshape import with_model_shape
    from memstrata.plan import plan_job
    from memstrata.plan.table import render_plan

    job = load_job(args.file)
    job.spec = _with_shape(args.file, _overridden(args, job.spec), with_model_shape)
    if args.node:
        node, where = load_node(args.node), str(args.node)
    else:
        from memstrata.node.local import local_inventory

        node, where = local_inventory(args.nvme_path), "this machine"
    plan = plan_job(job.spec, node)
    title = f"{job.metadata.name} on {node.hostname or where}"
    if args.svg is not None:
        _write_svg(args.svg, plan, title)
    if args.json:
        print(json.dumps(plan.model_dump(mode="json"), indent=2))
    else:
        print(render_plan(plan, title))
    return 0 if plan.feasible else EXIT_USAGE


def _write_svg(path: Path, plan: "Plan", title: str) -> None:
    """The plan's picture at `path` (a plan that does not fit is drawn too: that is when it helps most)."""
    from memstrata.plan.svg import render_svg

    if path.is_dir():
        raise UserError(f"--svg {path}: is a directory; give a file name, e.g. {path / 'plan.svg'}")
    try:
        path.write_text(render_svg(plan, title))
    except OSError as exc:
        raise UserError(f"--svg {path}: cannot write it: {exc.strerror or exc}") from None
    print(f"wrote {path}", file=sys.stderr)


def _dataset_paths(dataset: "Dataset") -> list[tuple[str, str]]:
    """(field, path) of every data path a spec names."""
    named = [("dataset.path", dataset.path), ("dataset.validationPath", dataset.validation_path)]
    named += [(f"dataset.mix[{i}].path", m.path) for i, m in enumerate(dataset.mix or [])]
    return [(field, path) for field, path in named if path is not None]


def _cmd_run(args: argparse.Namespace) -> int:
    from memstrata.api import load_job
    from memstrata.api.dataset import glob_files
    from memstrata.plan import plan_job
    from memstrata.node.local import local_inventory

    job = load_job(args.file)
    spec = job.spec = _overridden(args, job.spec)
    if spec.model.path is not None and not Path(spec.model.path).is_dir():
        raise UserError(f"{args.file}: spec.model.path: {spec.model.path}: no such directory")
    for field, path in _dataset_paths(spec.dataset):
        matched = glob_files(path)
        if not (matched if matched is not None else Path(path).exists()):
            raise UserError(f"{args.file}: spec.{field}: {path}: "
                            + ("matches no file" if matched is not None else "no such file or directory"))
    from memstrata.cli.modelshape import with_model_shape

    spec = job.spec = _with_shape(args.file, spec, with_model_shape)
    created = not args.nvme_path.exists()
    rc = EXIT_USAGE
    try:
        from memstrata.runtime.train.local import run_job, several_nodes_refusal, torch_gpus

        refusal = several_nodes_refusal(job)
        if refusal is not None:
            raise UserError(f"{args.file}: {refusal}")
        node = local_inventory(args.nvme_path, gpus=torch_gpus)
        plan = plan_job(spec, node)
        if not plan.feasible:
            raise UserError(f"{args.file}: does not fit on this machine: {plan.verdict()}")

        rc = run_job(job, plan, nvme_path=args.nvme_path, report_json=args.report_json,
                     sample_prompt=args.sample, verbose=args.verbose, resume=args.resume)
        return rc
    finally:
        if created and rc == EXIT_USAGE:
            with contextlib.suppress(OSError):  # a refused job leaves nothing behind; rmdir only if empty
                args.nvme_path.rmdir()


def _overridden(args: argparse.Namespace, spec: "FineTuneJobSpec") -> "FineTuneJobSpec":
    """The spec with --model, --output, --checkpoint, --checkpoint-every and --steps applied, validated again
    as a whole."""
    from pydantic import ValidationError

    from memstrata.api.dataset import Dataset
    from memstrata.api.finetunejob import FineTuneJobSpec
    from memstrata.api.validation import describe_validation_error

    wire = spec.wire()
    if getattr(args, "model", None) is not None:
        # A different directory: its own config.json says the shape, not the manifest.
        kept = {k: v for k, v in wire["model"].items() if k not in ("preset", "path", "architecture")}
        wire["model"] = {**kept, "path": str(args.model.absolute())}  # e.g. addedTokens stay
    if getattr(args, "output", None) is not None:
        wire["output"] = {**wire.get("output", {}), "path": str(args.output.absolute())}
    if getattr(args, "steps", None) is not None:
        wire["training"]["steps"] = args.steps
        wire["training"].pop("epochs", None)  # the steps given replace the epochs
    if getattr(args, "checkpoint", None) is not None:
        wire["checkpoint"] = {**wire.get("checkpoint", {}), "path": str(args.checkpoint.absolute())}
    if getattr(args, "checkpoint_every", None) is not None:
        if "checkpoint" not in wire:
            raise UserError(f"{args.file}: --checkpoint-every needs spec.checkpoint or --checkpoint DIR")
        wire["checkpoint"]["everySteps"] = args.checkpoint_every
    try:
        return FineTuneJobSpec.model_validate(wire)
    except ValidationError as exc:
        raise UserError(f"{args.file}: with the command line's overrides: "
                        f"{describe_validation_error(exc, 'spec')}") from None


def _with_shape(file: Path, spec: "FineTuneJobSpec",
                resolve: Callable[["FineTuneJobSpec"], "FineTuneJobSpec"]) -> "FineTuneJobSpec":
    """The spec with its model's shape (read from model.path's config.json when the spec states none)."""
    from pydantic import ValidationError

    from memstrata.api.hfconfig import ModelConfigError
    from memstrata.api.validation import describe_validation_error

    try:
        return resolve(spec)
    except ModelConfigError as exc:
        raise UserError(f"{file}: {exc}") from None
    except ValidationError as exc:
        raise UserError(f"{file}: with the shape of {spec.model.path}/config.json: "
                        f"{describe_validation_error(exc, 'spec')}") from None


def _cmd_pod(args: argparse.Namespace) -> int:
    import logging

    from memstrata.runtime.train.pod import run_pod

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args.nvme_path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--nvme-path / $MEMSTRATA_SCRATCH: {args.nvme_path}: cannot create it: "
                        f"{exc.strerror or exc}") from None
    return run_pod(args.nvme_path)


def _operator(argv: list[str]) -> int:
    from memstrata.operator.main import main as operator_main

    return operator_main(argv)


def _nodeagent(argv: list[str]) -> int:
    from memstrata.nodeagent.main import main as nodeagent_main

    return nodeagent_main(argv)


LONG_RUNNING: dict[str, Callable[[list[str]], int]] = {"operator": _operator, "nodeagent": _nodeagent}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memstrata", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("crd", help="print the FineTuneJob CustomResourceDefinition")
    s.set_defaults(func=_cmd_crd)

    s = sub.add_parser("plan", help="show where every byte of a job would live")
    s.add_argument("file", type=Path, help="a FineTuneJob manifest")
    s.add_argument("--node", type=Path, help="a NodeInventory or Node YAML (default: this machine)")
    s.add_argument("--nvme-path", type=Path, default=DEFAULT_NVME_PATH,
                   help="scratch directory standing in for NVMe on this machine (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.add_argument("--svg", type=Path, metavar="FILE", help="also draw the plan: where the bytes go, per category "
                                                          "and stratum, against each stratum's capacity")
    s.add_argument("--model", type=Path, help="override spec.model: a Hugging Face model directory (its "
                                             "config.json gives the shape)")
    s.set_defaults(func=_cmd_plan)

    s = sub.add_parser("run", help="fine-tune locally, no cluster needed")
    s.add_argument("file", type=Path, help="a FineTuneJob manifest")
    s.add_argument("--nvme-path", type=Path, default=DEFAULT_NVME_PATH,
                   help="scratch directory on a disk filesystem for offloaded state (default: %(default)s)")
    s.add_argument("--steps", type=int, help="override spec.training.steps")
    s.add_argument("--model", type=Path, help="override spec.model: a Hugging Face model directory")
    s.add_argument("--output", type=Path, help="override spec.output.path: a new directory for the fine-tuned model")
    s.add_argument("--checkpoint", type=Path, metavar="DIR", help="override spec.checkpoint.path: where checkpoints "
                                                                   "are written")
    s.add_argument("--checkpoint-every", type=int, metavar="STEPS", help="override spec.checkpoint.everySteps")
    s.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint in "
                                                         "spec.checkpoint.path (from step 0 if there is none)")
    s.add_argument("--sample", metavar="PROMPT", help="show the model's answer to PROMPT before and after training")
    s.add_argument("--report-json", type=Path, help="also write the final report as JSON here")
    s.add_argument("--verbose", action="store_true", help="also report the swap layer's counters and every "
                                                          "DeepSpeed setting memstrata changed, with the reason")
    s.set_defaults(func=_cmd_run)

    s = sub.add_parser("pod", help="the job pod's entrypoint: train from $MEMSTRATA_RUNTIME_CONFIG and patch the "
                                   "FineTuneJob's status")
    s.add_argument("--nvme-path", type=Path, default=Path(os.environ.get("MEMSTRATA_SCRATCH", "/var/tmp/memstrata")),
                   help="scratch directory on a disk filesystem, for DeepSpeed's (empty) swap folder and file-backed "
                        "namespaces where the pod was given no NVMe device ($MEMSTRATA_SCRATCH; default: %(default)s)")
    s.set_defaults(func=_cmd_pod)

    from memstrata.cli.modelshape import add_parser as add_inspect_model

    add_inspect_model(sub)

    # Listed for --help; main() hands their arguments over before argparse sees them.
    sub.add_parser("operator", help="run the FineTuneJob operator (memstrata operator --help)", add_help=False)
    sub.add_parser("nodeagent", help="run the node agent: discovery, labels, device plugin", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from memstrata.api.manifest import ManifestError
    from memstrata.node.local import LocalNodeError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LONG_RUNNING:
        # Services parse their own flags (and keep a leading `--` optional).
        return LONG_RUNNING[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "steps", None) is not None and args.steps <= 0:
        print(f"memstrata: error: --steps must be a positive integer, got {args.steps}", file=sys.stderr)
        return EXIT_USAGE
    handler: Callable[[argparse.Namespace], int] = args.func
    try:
        return handler(args)
    except (ManifestError, LocalNodeError, UserError) as exc:
        print(f"memstrata: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("memstrata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `memstrata plan ... | head`: the reader left early, which is not an error; keep
        # Python from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

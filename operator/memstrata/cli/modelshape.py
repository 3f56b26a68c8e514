"""`memstrata inspect-model <dir>`, and the shape of a job whose model.path states none.

The operator runs `inspect-model` in a short pod that mounts the job's volumes (memstrata.operator.inspection):
it reads <dir>/config.json through memstrata.api.hfconfig, prints the ModelArchitecture as JSON and writes the
same line to the kubelet's termination log, which is how the answer reaches the operator. On an error it
writes the error there instead (naming the file and the problem) and exits 2. `memstrata plan` and
`memstrata run` read a local directory the same way.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.hfconfig import ModelConfigError, architecture_from_config

TERMINATION_LOG = Path("/dev/termination-log")  # the kubelet's default terminationMessagePath
EXIT_USAGE = 2


def read_model_shape(directory: Path) -> ModelArchitecture:
    """The shape <directory>/config.json describes; ModelConfigError naming the file and the problem."""
    if not directory.is_dir():
        raise ModelConfigError(f"{directory}: no such directory")
    config = directory / "config.json"
    try:
        text = config.read_text()
    except FileNotFoundError:
        raise ModelConfigError(f"{config}: no such file; model.path must be a Hugging Face model directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{config}: cannot read: {exc}") from None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{config}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") \
            from None
    return architecture_from_config(parsed, str(config))


def with_model_shape(spec: FineTuneJobSpec) -> FineTuneJobSpec:
    """The spec with its model's shape: as stated, or read from model.path's config.json on this machine.
    ModelConfigError naming spec.model.path when it cannot be read; ValueError when the shape does not
    suit the rest of the spec."""
    if spec.model.known_shape() is not None:
        return spec
    assert spec.model.path is not None  # a spec with neither a preset nor an architecture has a path
    try:
        arch = read_model_shape(Path(spec.model.path))
    except ModelConfigError as exc:
        raise ModelConfigError(f"spec.model.path: {exc} (spec.model.architecture is not set, so memstrata "
                               "reads the shape from the directory's config.json)") from None
    return spec.with_architecture(arch)


def _write_termination_log(path: Path, text: str) -> None:
    """Only where the kubelet made the file: elsewhere (a laptop, as root) /dev is no place for it."""
    if path.is_file():
        try:
            path.write_text(text)
        except OSError as exc:
            print(f"memstrata: warning: cannot write {path}: {exc}", file=sys.stderr)


def cmd_inspect_model(args: argparse.Namespace) -> int:
    log: Path = args.termination_log
    try:
        arch = read_model_shape(args.directory)
    except ModelConfigError as exc:
        message = f"memstrata: error: {exc}"
        print(message, file=sys.stderr)
        _write_termination_log(log, str(exc))
        return EXIT_USAGE
    line = arch.model_dump_json(by_alias=True)
    print(line)
    _write_termination_log(log, line)
    return 0


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    s = sub.add_parser("inspect-model", help="print the shape a Hugging Face model directory's config.json "
                                             "describes (what the operator's inspection pod runs)")
    s.add_argument("directory", type=Path, help="a Hugging Face model directory (with config.json)")
    s.add_argument("--termination-log", type=Path, default=TERMINATION_LOG,
                   help="also write the answer (or the error) here, if the file exists (default: %(default)s)")
    s.set_defaults(func=cmd_inspect_model)

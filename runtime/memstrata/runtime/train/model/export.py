"""The fine-tuned model out, as a Hugging Face directory that `from_pretrained` loads.

Weights are gathered from their ZeRO-3 partitions one module at a time and written into safetensors
shards of at most `shard_size` bytes, so the host holds one shard, never the whole model. Everything goes
to a temporary directory beside the target (`.<name>.partial-*`), which is renamed into place only when
complete: a run killed while saving leaves no half-written model under the output path (only that hidden
directory, which nothing reads).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memstrata.api.jobstatus import OutputStatus
from memstrata.runtime.train.model.hfmodel import INDEX, SINGLE
from memstrata.runtime.train.model.owner import Ownership, own, reclaim

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

__all__ = ["OutputPathError", "atomic_output", "check_output_path", "finished_output", "reclaim_partials",
           "module_tensors", "save_model", "write_hf_model", "write_run_file"]

CARD = "README.md"  # the model card, as the Hub names it
RUN_FILE = "memstrata-run.json"  # which job and step wrote the model: lets a retry recognise its own finished work


class OutputPathError(ValueError):
    """The output path cannot take the model; the message names the path and the problem."""


def check_output_path(path: Path) -> None:
    """Refuse, before training, an output that exists or whose parent cannot take a new directory."""
    if path.exists() or path.is_symlink():
        raise OutputPathError(f"spec.output.path: {path}: already exists; memstrata never overwrites a model "
                              "(choose a new path or remove it)")
    parent = path.parent
    if not parent.is_dir():
        raise OutputPathError(f"spec.output.path: {parent}: no such directory (create it; in a pod, mount a "
                              "volume there)")
    try:  # really try: permission bits say nothing about a read-only mount, or to root
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=parent))
    except OSError as exc:
        raise OutputPathError(f"spec.output.path: {parent}: cannot create a directory there: "
                              f"{exc.strerror or exc}") from None


@dataclass
class _Shard:
    tensors: dict[str, "torch.Tensor"]
    size: int = 0


def module_tensors(prefix: str, module: Any, seen: set[int],
                   persistent: set[str]) -> list[tuple[str, "torch.Tensor"]]:
    """`module`'s own parameters and persistent buffers (`persistent`: the state dict's names) under their
    state-dict names, each tensor not yet in `seen` (ids, updated): a shared tensor goes under its first name."""
    own: list[tuple[str, torch.Tensor]] = []
    for name, p in module.named_parameters(recurse=False):
        if id(p) not in seen:
            seen.add(id(p))
            own.append((f"{prefix}.{name}" if prefix else name, p))
    for name, b in module.named_buffers(recurse=False):
        full = f"{prefix}.{name}" if prefix else name
        if b is not None and full in persistent and id(b) not in seen:
            seen.add(id(b))
            own.append((full, b))
    return own


def _state(model: "PreTrainedModel") -> Iterator[tuple[Any, list[tuple[str, "torch.Tensor"]]]]:
    """(module, [(state-dict name, tensor)]) for every module that owns parameters or persistent buffers,
    each shared tensor under its first name only (as `save_pretrained` writes tied embeddings)."""
    seen: set[int] = set()
    # The state dict's names: parameters and persistent buffers (references only, nothing is copied).
    persistent = set(model.state_dict(keep_vars=True))
    for prefix, module in model.named_modules():
        own = module_tensors(prefix, module, seen, persistent)
        if own:
            yield module, own


def write_tensors(groups: Iterable[list[tuple[str, "torch.Tensor"]]], into: Path, shard_size: int) -> int:
    """Write each group's tensors (valid while the caller's iterator holds them: gathered, then released before
    the next group) into `model*.safetensors` shards of at most `shard_size` bytes, with an index when there are
    several; returns the bytes written."""
    from safetensors.torch import save_file

    current = _Shard({})
    names: dict[str, int] = {}  # tensor -> the number of its shard
    written: list[Path] = []

    def flush() -> None:
        # Under a provisional name: renamed once the number of shards is known.
        path = into / f"model-{len(written) + 1:05d}-of-XXXXX.safetensors"
        save_file(current.tensors, str(path), metadata={"format": "pt"})
        written.append(path)

    for own in groups:
        for name, tensor in own:
            size = tensor.numel() * tensor.element_size()
            if current.tensors and current.size + size > shard_size:
                flush()
                current = _Shard({})
            current.tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
            current.size += size
            names[name] = len(written) + 1
    if current.tensors or not written:
        flush()
    total = len(written)
    if total == 1:
        written[0].rename(into / SINGLE)
        return (into / SINGLE).stat().st_size
    final = {}
    for number, path in enumerate(written, 1):
        name = f"model-{number:05d}-of-{total:05d}.safetensors"
        path.rename(into / name)
        final[number] = name
    size = sum((into / n).stat().st_size for n in final.values())
    index = {"metadata": {"total_size": size}, "weight_map": {k: final[v] for k, v in sorted(names.items())}}
    (into / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return size


def _gathered(model: "PreTrainedModel") -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """Each module's own tensors (see _state), its ZeRO-3 partitions gathered whole while the caller holds them
    and released before the next module's: every rank must walk this in step (the gathers are collectives)."""
    import deepspeed
    import torch

    for _, own in _state(model):
        with deepspeed.zero.GatheredParameters([t for _, t in own if hasattr(t, "ds_id")], modifier_rank=None), \
                torch.no_grad():
            yield own


def join_save(model: "PreTrainedModel") -> None:
    """A rank other than 0 while rank 0 runs save_model: the same gathers, nothing written."""
    for _ in _gathered(model):
        pass


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def process_umask() -> int:
    """The process's umask, read without setting it (/proc/self/status; os.umask would change it, for a moment,
    under every other thread)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _finish_tree(path: Path, umask: int) -> None:
    """Every file and directory of the output given the mode mkdir(2) and open(2) give under `umask` (mkdtemp made
    the directory 0700 and safetensors writes its shards 0600, so on a shared volume no one else could read the
    model) and made durable, in one walk."""
    for f in path.iterdir():
        if f.is_dir():
            _finish_tree(f, umask)  # a LoRA output's merged model
            continue
        f.chmod(0o666 & ~umask)
        with f.open("rb") as handle:
            os.fsync(handle.fileno())
    path.chmod(0o777 & ~umask)
    fsync_dir(path)


def finished_output(path: Path, *, job: str, job_uid: str, steps: int) -> OutputStatus | None:
    """The model at `path` if this job already wrote it after its last step (an attempt that died after the save
    and before it could say so); None for anything else, which check_output_path then refuses."""
    try:
        run = json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    # runSteps: the run's last step, where the model is another step's (keepBest) or it stopped early.
    if not isinstance(run, dict) or (run.get("job"), run.get("jobUid"), run.get("runSteps", run.get("step"))) != (
            job, job_uid, steps):
        return None
    return describe_output(path)


def describe_output(path: Path) -> OutputStatus:
    """The status of a complete output directory, from its files and run file."""
    run = json.loads((path / RUN_FILE).read_text())
    files = [f for f in path.rglob("*") if f.is_file()]  # a LoRA output's merged model included
    return OutputStatus(path=str(path), step=run["step"], files=len(files),
                        bytes=sum(f.stat().st_size for f in files if f.suffix == ".safetensors"),
                        validation_loss=run.get("validationLoss"))


def mark_run_complete(path: Path, run_steps: int) -> None:
    """Say in `path`'s run file that the run which wrote it ended after step `run_steps` (replaced atomically), so
    a retry of a finished job recognises an output of another step as its own."""
    run = json.loads((path / RUN_FILE).read_text())
    tmp = path / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({**run, "runSteps": run_steps}, indent=1) + "\n")
    with tmp.open("rb") as handle:
        os.fsync(handle.fileno())
    tmp.rename(path / RUN_FILE)
    fsync_dir(path)


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """A temporary directory beside `path` to write the output into; renamed to `path` when the block completes,
    removed when it fails. `path` holds a whole output or nothing."""
    check_output_path(path)
    # A name of its own: two jobs given the same output path never write into each other's files.
    tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(path), dir=path.parent))
    owner: Ownership | None = None
    try:
        owner = own(tmp)  # if this process is killed, the next run given this path removes the partial output
        yield tmp
        _finish_tree(tmp, process_umask())
        # rename(2) would silently replace an empty directory made meanwhile: check once more, then rename
        # (atomic: the output path holds a whole model or nothing) and make the rename itself durable.
        check_output_path(path)
        tmp.rename(path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if owner is not None and not tmp.exists():  # kept while a partial is left: the next run removes it
            owner.release()


def _partial_prefix(path: Path) -> str:
    return f".{path.name}.partial-"


def reclaim_partials(path: Path, *, any_suffix: bool = False) -> list[Path]:
    """Remove the partial outputs for `path` that runs killed while saving left (never a live run's); with
    `any_suffix`, those of every output whose name begins with `path`'s (the best models' `.<name>.best-step-N`)."""
    prefix = _partial_prefix(path)
    return reclaim(path.parent, prefix.removesuffix(".partial-") if any_suffix else prefix)


def write_run_file(into: Path, *, job: str, job_uid: str, step: int, validation_loss: float | None) -> None:
    """Which job and step wrote the output (`finished_output` reads it back); written last, just before the rename."""
    (into / RUN_FILE).write_text(json.dumps({"job": job, "jobUid": job_uid, "step": step,
                                             "validationLoss": validation_loss}, indent=1) + "\n")


def write_hf_model(model: "PreTrainedModel", into: Path, *, groups: Iterable[list[tuple[str, "torch.Tensor"]]],
                   tokenizer: Any | None, shard_size: int, dtype: "torch.dtype") -> int:
    """A Hugging Face model directory in `into`: the tensors of `groups` (see write_tensors), `model`'s config and
    generation config, the tokenizer; returns the weights' bytes."""
    size = write_tensors(groups, into, shard_size)
    config = model.config
    use_cache, config.use_cache = config.use_cache, True  # training turned the KV cache off; inference wants it
    config.dtype = dtype
    try:
        config.save_pretrained(into)
    finally:
        config.use_cache = use_cache
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(into)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(into)
    return size


def save_model(model: "PreTrainedModel", path: Path, *, tokenizer: Any | None, shard_size: int, step: int,
               dtype: "torch.dtype", validation_loss: float | None = None, job: str = "",
               job_uid: str = "", card: str = "") -> OutputStatus:
    """Write `model` (ZeRO-3 partitioned or not) with its config, generation config, tokenizer and model `card` to
    `path`, atomically."""
    with atomic_output(path) as tmp:
        size = write_hf_model(model, tmp, groups=_gathered(model), tokenizer=tokenizer, shard_size=shard_size,
                              dtype=dtype)
        if card:
            (tmp / CARD).write_text(card)
        write_run_file(tmp, job=job, job_uid=job_uid, step=step, validation_loss=validation_loss)
    count = sum(1 for _ in path.iterdir())
    return OutputStatus(path=str(path), step=step, files=count, bytes=size, validation_loss=validation_loss)

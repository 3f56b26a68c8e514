"""Checkpoint directories on the volume: streamed safetensors files, the atomic finish, verification, pruning.

The layout and the manifest are memstrata.api.checkpoint's. Tensors are written
straight from the buffers they live in (no staging copy), hashed as they go;
a checkpoint becomes visible only by renaming its finished partial directory,
and older ones are pruned only after that rename. Reading back, every file's
size and sha256 are checked before a byte is used: a truncated or corrupt
checkpoint is reported and the previous complete one is taken.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from memstrata.api.checkpoint import (MANIFEST, MARKER, FileDigest, Manifest, file_rank, parse_step_dir,
                                      step_dir_name)
from memstrata.runtime.train.model.export import fsync_dir
from memstrata.runtime.train.model.tensorfile import DTYPE_NAMES

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointError", "CheckpointWriteError", "Found", "write_tensors", "write_json", "finish",
           "find_latest", "prune", "remove_partials", "verify"]

_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used; the message names the directory or file and why."""


class CheckpointWriteError(CheckpointError):
    """The checkpoint volume refused a write (full, gone, read-only); the training state is untouched."""


class _HashingFile:
    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), _CHUNK):  # hashlib and write both drop the GIL on large chunks
            part = view[i:i + _CHUNK]
            self.sha.update(part)
            self.f.write(part)
        self.size += len(view)

    def close(self) -> FileDigest:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return FileDigest(bytes=self.size, sha256=self.sha.hexdigest())


def write_tensors(path: Path, tensors: dict[str, "torch.Tensor"]) -> FileDigest:
    """Write `tensors` as one safetensors file, each straight from its own memory, and fsync it."""
    header: dict[str, object] = {}
    offset = 0
    for name, t in tensors.items():
        dtype = DTYPE_NAMES.get(str(t.dtype))
        if dtype is None:
            raise CheckpointError(f"{path}: {name}: dtype {t.dtype} has no safetensors name here")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
    import torch

    out = _HashingFile(path)
    try:
        out.write(len(raw).to_bytes(8, "little"))
        out.write(raw)
        for t in tensors.values():
            cpu = t.detach().contiguous().cpu() if t.device.type != "cpu" else t.detach().contiguous()
            if cpu.numel():
                out.write(cpu.view(-1).view(torch.uint8).numpy().data)
        return out.close()
    except BaseException:
        out.f.close()
        raise


def write_json(path: Path, obj: object) -> FileDigest:
    out = _HashingFile(path)
    out.write((json.dumps(obj, indent=1) + "\n").encode())
    return out.close()


def sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def partial_dir(root: Path, step: int) -> Path:
    """A fresh hidden directory beside the final one; never visible as a checkpoint."""
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{step_dir_name(step)}.partial-", dir=root))


def finish(partial: Path, manifest: Manifest) -> Path:
    """Write the manifest and the marker into `partial`, then rename it to its step's name: the checkpoint is
    complete exactly when that rename is durable."""
    digest = write_json(partial / MANIFEST, manifest.model_dump(mode="json", by_alias=True))
    with open(partial / MARKER, "w") as f:
        f.write(digest.sha256 + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(partial)
    final = partial.parent / step_dir_name(manifest.step)
    if final.exists():  # a run that died after this rename and was resumed from an earlier step
        shutil.rmtree(final)
    partial.rename(final)
    fsync_dir(partial.parent)
    return final


def verify(directory: Path, rank: int | None = None) -> Manifest:
    """The manifest of a complete, intact checkpoint; CheckpointError naming the first problem otherwise.
    `rank`: check only that rank's files (and the manifest): each rank of a run reads its own, in parallel."""
    marker = directory / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{directory}: no {MARKER} marker: the write was interrupted")
    try:
        expected = marker.read_text().strip()
        if sha256_file(directory / MANIFEST) != expected:
            raise CheckpointError(f"{directory / MANIFEST}: sha256 differs from the one in {MARKER}")
        manifest = Manifest.model_validate_json((directory / MANIFEST).read_text())
    except OSError as exc:
        raise CheckpointError(f"{directory}: cannot read the manifest: {exc.strerror or exc}") from None
    except ValidationError as exc:
        raise CheckpointError(f"{directory / MANIFEST}: not a memstrata checkpoint manifest: "
                              f"{exc.errors()[0]['msg']}") from None
    for name, want in manifest.files.items():
        if rank is not None and file_rank(name) != rank:
            continue
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: missing") from None
        if size != want.bytes:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {want.bytes} (truncated?)")
        try:
            digest = sha256_file(path)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read: {exc.strerror or exc}") from None
        if digest != want.sha256:
            raise CheckpointError(f"{path}: sha256 differs from the manifest's (corrupt)")
    return manifest


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every directory named like a checkpoint, newest first."""
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := parse_step_dir(p.name)) is not None and p.is_dir()]
    return sorted(found, reverse=True)


@dataclass
class Found:
    directory: Path
    manifest: Manifest
    skipped: list[str]  # the newer checkpoints passed over, each with why
    damaged: list[Path]  # their directories


def quarantine(directory: Path) -> Path:
    """Set a damaged checkpoint aside under a hidden name: kept for a post-mortem, never resumed from, never
    counted against `keep` (so pruning cannot delete an intact checkpoint in its favour)."""
    aside = directory.with_name(f".{directory.name}.damaged-{int(time.time())}")
    directory.rename(aside)
    return aside


def find_latest(root: Path, rank: int | None = None) -> Found | None:
    """The newest intact checkpoint under `root` (None when there is none at all); CheckpointError when there
    are checkpoints but none is intact, naming each and why: training is never silently restarted from 0.
    `rank`: intact as far as that rank's files go (see verify)."""
    skipped: list[str] = []
    damaged: list[Path] = []
    for _, directory in complete_steps(root):
        try:
            return Found(directory, verify(directory, rank), skipped, damaged)
        except CheckpointError as exc:
            skipped.append(str(exc))
            damaged.append(directory)
    if skipped:
        raise CheckpointError(f"{root}: no intact checkpoint: " + "; ".join(skipped))
    return None


def prune(root: Path, keep: int, newest: Path) -> list[Path]:
    """Remove all but the newest `keep` checkpoints, never `newest` (the one just written); the ones removed."""
    gone = [p for _, p in complete_steps(root)[keep:] if p != newest]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def remove_partials(root: Path) -> None:
    """Remove what interrupted writes left (one writer per job: at start nothing else is writing here)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step-") and ".partial-" in p.name:
                shutil.rmtree(p, ignore_errors=True)

"""OCI image archives from local root filesystems, for `ctr images import` (no registry, no builder).

    base = tar_layer(rootfs_dir, out / "base.tar")           # an uncompressed layer, as a file
    layer = TreeLayer.measure(entries)                       # or only its digest and size: one read of
                                                             # the files, never a copy outside containerd
    with subprocess.Popen(["ctr", ..., "images", "import", "-"], stdin=PIPE) as ctr:
        stream_archive(ctr.stdin, "memstrata.local/x:1", [base, layer], config)

Layers stay uncompressed: gzip of a multi-GiB torch layer costs minutes on two cores, and containerd
unpacks either kind. Layers are content-addressed, so images that share a layer store it once.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Protocol, Sequence, cast

LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA = "application/vnd.oci.image.index.v1+json"
_BLOCK = 512
_CHUNK = 1 << 20


class Blob(Protocol):
    """A layer an archive can carry: its digest and size are known before its bytes are written."""
    @property
    def digest(self) -> str: ...  # sha256:<hex> of the tar as stored (uncompressed: also its diff id)

    @property
    def size(self) -> int: ...

    def write_to(self, out: BinaryIO) -> None: ...


@dataclass(frozen=True)
class Layer:
    """A layer tar on disk."""
    path: Path
    digest: str
    size: int

    def write_to(self, out: BinaryIO) -> None:
        with open(self.path, "rb") as f:
            while chunk := f.read(_CHUNK):
                out.write(chunk)


@dataclass(frozen=True)
class Entry:
    """One member of a generated layer: `source` is a file or symlink on this machine to copy, or
    `data` the bytes of a regular file; with neither it is a directory."""
    name: str  # path inside the image, without a leading slash
    source: Path | None = None
    data: bytes | None = None
    mode: int | None = None  # default: the source's mode (0o755 for directories, 0o644 for data)


class _Sink:
    """Counts and hashes what passes through, on its way to `out` (or nowhere)."""

    def __init__(self, out: BinaryIO | None) -> None:
        self.out, self.size, self.hash = out, 0, hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        self.hash.update(data)
        self.size += len(data)
        if self.out is not None:
            self.out.write(data)
        return len(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self.hash.hexdigest()


def _tarinfo(entry: Entry) -> tuple[tarfile.TarInfo, Path | None]:
    """Owner root, the source's mode and mtime (kept: the .pyc files next to the sources are only
    valid while the sources' mtimes are), directories and data at mtime 0."""
    info = tarfile.TarInfo(entry.name)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.data is not None:
        info.size, info.mode, info.mtime = len(entry.data), entry.mode or 0o644, 0
        return info, None
    if entry.source is None:
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, entry.mode or 0o755, 0
        return info, None
    st = entry.source.lstat()
    info.mtime = int(st.st_mtime)
    info.mode = entry.mode if entry.mode is not None else stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(entry.source)
        return info, None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{entry.source}: only regular files, symlinks and directories go into a layer")
    info.size = st.st_size
    return info, entry.source


def write_tree_tar(entries: Iterable[Entry], out: BinaryIO) -> None:
    """A POSIX tar of `entries`, in the order given, byte-for-byte the same for the same files."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for entry in entries:
        info, source = _tarinfo(entry)
        out.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
        if entry.data is not None:
            out.write(entry.data)
        elif source is not None:
            left = info.size
            with open(source, "rb") as f:
                while left:
                    n = f.readinto(view[:min(left, _CHUNK)])
                    if not n:
                        raise RuntimeError(f"{source} shrank while it was being archived")
                    out.write(view[:n])
                    left -= n
        out.write(b"\0" * (-info.size % _BLOCK))
    out.write(b"\0" * (2 * _BLOCK))


@dataclass(frozen=True)
class TreeLayer:
    """A layer generated from files on this machine each time it is written: only its digest and
    size are stored, so a layer of several GiB costs no disk outside containerd."""
    entries: tuple[Entry, ...]
    digest: str
    size: int

    @classmethod
    def measure(cls, entries: Sequence[Entry]) -> "TreeLayer":
        sink = _Sink(None)
        write_tree_tar(entries, cast(BinaryIO, sink))
        return cls(tuple(entries), sink.digest, sink.size)

    def write_to(self, out: BinaryIO) -> None:
        sink = _Sink(out)
        write_tree_tar(self.entries, cast(BinaryIO, sink))
        if (sink.digest, sink.size) != (self.digest, self.size):
            # The archive already went out with the old digest: containerd rejects it, and this
            # says why. The files changed between measure() and now; measuring again fixes it.
            raise RuntimeError(f"layer files changed since they were measured ({self.digest} -> {sink.digest})")


@dataclass(frozen=True)
class ImageConfig:
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=lambda: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
    user: str = ""
    workdir: str = ""
    exposed_ports: list[str] = field(default_factory=list)  # "8080/tcp"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def tar_layer(root: Path, out: Path, paths: list[str] | None = None, keep_mtime: bool = False,
              exclude: Sequence[str] = ()) -> Layer:
    """Tar `root` (or only `paths` under it) with numeric owners in name order, so the same tree
    gives the same digest; mtimes are zeroed unless `keep_mtime` (a tree with .pyc files needs
    them). GNU tar: it keeps device nodes, hard links and modes."""
    cmd = ["tar", "--create", "--file", str(out), "--directory", str(root), "--numeric-owner",
           "--sort=name", "--format=posix", "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
           *([] if keep_mtime else ["--mtime=@0"]), *(f"--exclude={e}" for e in exclude), *(paths or ["."])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tar of {root} failed: {proc.stderr.strip()[-2000:]}")
    return Layer(out, sha256_file(out), out.stat().st_size)


def image_json(layers: Sequence[Blob], config: ImageConfig) -> tuple[bytes, bytes]:
    """The image's config and manifest documents, as the archive stores them."""
    run = {"Entrypoint": config.entrypoint, "Cmd": config.cmd, "Env": config.env, "User": config.user,
           "WorkingDir": config.workdir, "ExposedPorts": {p: {} for p in config.exposed_ports}}
    cfg = {
        "architecture": "amd64", "os": "linux",
        "config": {k: v for k, v in run.items() if v},
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
        "history": [{"created_by": f"memstrata local layer {i}"} for i, _ in enumerate(layers)],
    }
    cfg_bytes = json.dumps(cfg, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2, "mediaType": MANIFEST_MEDIA,
        "config": {"mediaType": CONFIG_MEDIA, "digest": _digest(cfg_bytes), "size": len(cfg_bytes)},
        "layers": [{"mediaType": LAYER_MEDIA, "digest": layer.digest, "size": layer.size} for layer in layers],
    }
    return cfg_bytes, json.dumps(manifest, sort_keys=True).encode()


def manifest_digest(layers: Sequence[Blob], config: ImageConfig) -> str:
    return _digest(image_json(layers, config)[1])


def stream_archive(out: BinaryIO, ref: str, layers: Sequence[Blob], config: ImageConfig,
                   present: frozenset[str] = frozenset()) -> str:
    """Write an OCI image layout tar naming `ref` (the annotation `ctr images import` reads) to a
    stream; returns the manifest digest. Layers whose digest is in `present` (already in the
    importing containerd's content store) are left out: the importer looks blobs up by digest."""
    cfg_bytes, man_bytes = image_json(layers, config)
    for layer in layers:
        if layer.digest not in present:
            _member(out, f"blobs/sha256/{layer.digest.split(':', 1)[1]}", layer.size, layer.write_to)
    for data in (cfg_bytes, man_bytes):
        _member(out, f"blobs/sha256/{_digest(data).split(':', 1)[1]}", len(data), _writer(data))
    index = {"schemaVersion": 2, "mediaType": INDEX_MEDIA, "manifests": [{
        "mediaType": MANIFEST_MEDIA, "digest": _digest(man_bytes), "size": len(man_bytes),
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1]},
    }]}
    # The importer reads index.json after the loop over members, so it may come last.
    for name, data in (("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), ("index.json", json.dumps(index).encode())):
        _member(out, name, len(data), _writer(data))
    out.write(b"\0" * (2 * _BLOCK))
    return _digest(man_bytes)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _writer(data: bytes) -> Callable[[BinaryIO], object]:
    return lambda out: out.write(data)


def _member(out: BinaryIO, name: str, size: int, write: Callable[[BinaryIO], object]) -> None:
    """One archive member whose bytes `write` produces; the tar header needs `size` up front, so
    a writer that produces another count would corrupt the archive: that is an error here."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    out.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
    counted = _Sink(out)
    write(cast(BinaryIO, counted))
    if counted.size != size:
        raise RuntimeError(f"{name}: wrote {counted.size} bytes, the header said {size}")
    out.write(b"\0" * (-size % _BLOCK))

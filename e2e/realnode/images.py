"""memstrata's container images, built on this machine without a registry or an image builder, and
imported into containerd.

    images = build_images(Path.home() / ".cache/memstrata")   # cached in .../images; seconds when warm
    import_images("/run/.../containerd.sock", images)         # namespace k8s.io
    images.runtime                                             # "memstrata.local/runtime:<12 hex>"

    python -m e2e.realnode.images build [--import SOCKET] [--namespace NS]

Each image is what its docker/*.Dockerfile would build, from shared content-addressed layers:

    pause       the static pause binary
    operator    base + deps(operator)   + memstrata         user 65532, `memstrata operator`
    node-agent  base + deps(node-agent) + memstrata         root,       `memstrata nodeagent`
    runtime     base + deps(runtime)    + memstrata + memstrata-runtime
                                                            user 1000,  `memstrata pod`

(layers: e2e/realnode/imagebuild.py). A layer is rebuilt only when its key changes: the base
when its recipe does, deps when the CI venv's files do, the two memstrata layers when their
sources do. A tag is the image's manifest digest, so a new tag means new content.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO, Callable, Sequence, cast

from e2e.cluster.controlplane import cache_root

from . import imagebuild
from .imagebuild import REPO, cached_layer, deps_entries, log, measure_deps
from .ociarchive import Blob, ImageConfig, manifest_digest, stream_archive

# How long ctr waits to connect (its own default, 10 s, is what a containerd busy importing 5 GiB on a loaded
# machine once missed, failing the whole real-node stage).
CONNECT_TIMEOUT = "60s"

REGISTRY = "memstrata.local"
OUR_TAG = re.compile(rf"{re.escape(REGISTRY)}/(pause|operator|node-agent|runtime):[0-9a-f]{{12}}")
DEFAULT_CACHE = cache_root()
BASE_ENV = ["PATH=/opt/memstrata/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"]
# As docker/*.Dockerfile set them.
CONFIGS = {
    "pause": ImageConfig(entrypoint=["/pause"], env=[]),
    "operator": ImageConfig(entrypoint=["memstrata"], cmd=["operator", "--liveness=http://0.0.0.0:8080/healthz"],
                            env=BASE_ENV, user="65532:65532", exposed_ports=["8080/tcp"]),
    "node-agent": ImageConfig(entrypoint=["memstrata"], cmd=["nodeagent"], env=BASE_ENV),
    "runtime": ImageConfig(entrypoint=["memstrata"], cmd=["pod"], user="1000:1000", workdir="/home/memstrata",
                           env=[*BASE_ENV, "HOME=/home/memstrata", "MEMSTRATA_SCRATCH=/var/tmp/memstrata"]),
}
# Sources of each memstrata layer: the floor's project directory (and the C sources it compiles).
APP_SOURCES = {"operator": ("operator",), "runtime": ("runtime", "native")}
_SKIP_PARTS = {"build", "__pycache__", "dist"}


@dataclass(frozen=True)
class Image:
    name: str  # operator, node-agent, runtime, pause
    ref: str  # memstrata.local/<name>:<first 12 hex of the manifest digest>
    layers: tuple[Blob, ...] = field(repr=False)
    config: ImageConfig = field(repr=False)

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)


@dataclass(frozen=True)
class ImageSet:
    """The four images' refs, and what import_images needs to import them."""
    pause: str
    operator: str
    node_agent: str
    runtime: str
    images: tuple[Image, ...] = field(repr=False, compare=False)

    @classmethod
    def of(cls, pause: Image, operator: Image, node_agent: Image, runtime: Image) -> "ImageSet":
        return cls(pause.ref, operator.ref, node_agent.ref, runtime.ref, (pause, operator, node_agent, runtime))

    def refs(self) -> dict[str, str]:
        return {image.name: image.ref for image in self.images}


def make_image(name: str, layers: Sequence[Blob]) -> Image:
    """Pure: the image `name` of these layers, tagged with its manifest digest."""
    config = CONFIGS[name]
    tag = manifest_digest(layers, config).split(":", 1)[1][:12]
    return Image(name, f"{REGISTRY}/{name}:{tag}", tuple(layers), config)


def _hash(*parts: object) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def source_key(dirs: Sequence[str], python_version: str) -> str:
    """Key of a memstrata layer: every source file's path and bytes, the build's python, and the
    code that builds and installs the wheel."""
    files = sorted(p for d in dirs for p in (REPO / d).rglob("*")
                   if p.is_file() and not _SKIP_PARTS.intersection(p.relative_to(REPO).parts)
                   and not any(x.endswith(".egg-info") for x in p.parts) and p.suffix not in (".so", ".pyc"))
    return _hash(python_version, inspect.getsource(imagebuild.build_app), inspect.getsource(imagebuild.install_wheel),
                 *[(str(p.relative_to(REPO)), p.read_bytes()) for p in files])


def deps_key(venv: Path, files: Sequence[str]) -> str:
    """Key of a deps layer: each file's path, size, mtime and mode (cheap: stat only), and the
    code that lays them out."""
    stats = []
    for rel in files:
        st = os.lstat(venv / rel)
        stats.append((rel, st.st_size, st.st_mtime_ns, st.st_mode))
    return _hash(str(venv), inspect.getsource(deps_entries), stats)


def image_files(venv: Path) -> dict[str, list[str]]:
    """Each image's third-party files, from scripts/image-contents run by the venv's own python."""
    out = subprocess.run([str(venv / "bin" / "python"), str(REPO / "scripts" / "image-contents"), "--files"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/image-contents --files with {venv}/bin/python failed:\n{out.stderr[-2000:]}")
    data = json.loads(out.stdout)
    if Path(data["prefix"]) != venv.resolve():
        raise RuntimeError(f"{venv}/bin/python reports the venv {data['prefix']}, not {venv}")
    files: dict[str, list[str]] = data["images"]
    return files


def _python_version(venv: Path) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.version)"],
                         capture_output=True, text=True, check=True)
    if not out.stdout.startswith("3.11."):
        raise RuntimeError(f"{venv}: python {out.stdout.split()[0]}; the images' Debian python is 3.11")
    return out.stdout.strip()


def unavailable_reason(cache_dir: Path) -> str | None:
    """Why build_images cannot run here (None: it can), for a caller that skips loudly instead. The
    tools are needed only for layers not yet cached."""
    need = {"debootstrap": "base", "chroot": "base", "gcc": "pause", "tar": "any", "ctr": "import"}
    cached = {p.name.split("-", 1)[0] for p in (cache_dir / "images").glob("*-*") if (p / "layer.json").is_file()}
    missing = [tool for tool, layer in need.items() if layer not in cached and not shutil.which(tool)
               and not Path("/usr/sbin", tool).exists()]
    if missing:
        return (f"{', '.join(missing)} not installed (apt-get install debootstrap gcc libc6-dev; ctr: `make node-bins` "
                "builds it with containerd)")
    if "pause" not in cached and not Path("/usr/lib/x86_64-linux-gnu/libc.a").exists():
        return "no static libc for `gcc -static` of the pause image (apt-get install libc6-dev)"
    if "base" not in cached and os.geteuid() != 0:
        return "debootstrap and chroot of the image base need root"
    return None


def build_images(cache_dir: Path, venv: Path | None = None) -> ImageSet:
    """Build (or find cached) every layer under `cache_dir`/images and return the four images.
    `venv` is the CI venv the deps are copied from and the wheels built with; by default $VENV
    (the Makefile exports it), else the running interpreter's."""
    venv = (venv or Path(os.environ.get("VENV") or sys.prefix)).resolve()
    cache_dir = (cache_dir / "images").resolve()
    t0 = time.monotonic()
    done: list[str] = []

    def note(what: str, built: bool) -> None:
        done.append(f"{what} {'built' if built else 'cached'}")

    pause, built = cached_layer(cache_dir, "pause", _hash((imagebuild.HERE / "build" / "pause.c").read_bytes(),
                                                          _gcc_version()), imagebuild.build_pause)
    note("pause", built)
    base_key = _hash(imagebuild.BASE_PACKAGES, imagebuild.USERS, imagebuild.BASE_EXCLUDE,
                     inspect.getsource(imagebuild.build_base))
    # debootstrap waits mostly on the network and dpkg: the other layers are built meanwhile.
    with ThreadPoolExecutor(max_workers=1) as pool:
        base_job = pool.submit(cached_layer, cache_dir, "base", base_key, imagebuild.build_base)
        apps, deps = _venv_layers(cache_dir, venv, note)
        base, built = base_job.result()
    note("base", built)
    images = ImageSet.of(
        pause=make_image("pause", [pause]),
        operator=make_image("operator", [base, deps["operator"], apps["operator"]]),
        node_agent=make_image("node-agent", [base, deps["node-agent"], apps["operator"]]),
        runtime=make_image("runtime", [base, deps["runtime"], apps["operator"], apps["runtime"]]),
    )
    log(f"{', '.join(done)} in {time.monotonic() - t0:.1f}s")
    return images


def _venv_layers(cache_dir: Path, venv: Path,
                 note: Callable[[str, bool], None]) -> tuple[dict[str, Blob], dict[str, Blob]]:
    """memstrata's two layers and each image's deps layer, all from `venv`."""
    pyver = _python_version(venv)
    apps: dict[str, Blob] = {}
    for project, dirs in APP_SOURCES.items():
        name = "app-memstrata" if project == "operator" else "app-memstrata-runtime"
        build = functools.partial(imagebuild.build_app, venv_python=venv / "bin" / "python", project=project)
        apps[project], built = cached_layer(cache_dir, name, source_key(dirs, pyver), build)
        note(name, built)
    files = image_files(venv)
    deps: dict[str, Blob] = {}
    for name in ("operator", "node-agent", "runtime"):
        deps[name], built = measure_deps(cache_dir, name, deps_key(venv, files[name]),
                                         deps_entries(venv, files[name]))
        note(f"deps-{name}", built)
    return apps, deps


def _gcc_version() -> str:
    try:
        return subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    except FileNotFoundError:
        raise RuntimeError("gcc not found: the pause image is built with `gcc -static` (apt-get install gcc libc6-dev)")


def ctr_command(address: str, namespace: str, *args: str) -> list[str]:
    """`ctr` against the containerd at `address`, in `namespace`, waiting CONNECT_TIMEOUT to connect."""
    return ["ctr", "--address", address, "--connect-timeout", CONNECT_TIMEOUT, "--namespace", namespace, *args]


def _ctr(address: str, namespace: str, *args: str) -> str:
    out = subprocess.run(ctr_command(address, namespace, *args), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ctr {' '.join(args)} in namespace {namespace} at {address} failed: {out.stderr.strip()}")
    return out.stdout


def import_images(ctr_address: str, images: ImageSet, namespace: str = "k8s.io", prune_old: bool = True) -> None:
    """Import each image not already in `namespace` by streaming its archive into `ctr images
    import -` (no archive file); layers the content store already holds are not sent again. With
    `prune_old`, earlier builds' images are removed afterwards (prune_images)."""
    existing = set(_ctr(ctr_address, namespace, "images", "ls", "-q").split())
    present = set(_ctr(ctr_address, namespace, "content", "ls", "-q").split())
    for image in images.images:
        if image.ref in existing:
            log(f"{image.ref}: already in {namespace}")
        else:
            t0 = time.monotonic()
            sent = sum(layer.size for layer in image.layers if layer.digest not in present)
            log(f"{image.ref}: importing into {namespace} ({sent >> 20} MiB to send)")
            try:
                _import(ctr_address, namespace, image, frozenset(present))
            except RuntimeError as e:
                if not present.intersection(layer.digest for layer in image.layers):
                    raise
                # A blob seen in `content ls` may have been collected since: send everything.
                log(f"{image.ref}: {e}; importing again with every layer")
                _import(ctr_address, namespace, image, frozenset())
            present.update(layer.digest for layer in image.layers)
            existing.add(image.ref)
            log(f"{image.ref}: imported in {time.monotonic() - t0:.0f}s")
    if prune_old:
        prune_images(ctr_address, images, namespace)


def prune_images(ctr_address: str, images: ImageSet, namespace: str = "k8s.io") -> list[str]:
    """Remove the memstrata.local images of earlier builds (tags of 12 hex digits other than
    `images`'), and the `sha256:<config>` ref the CRI plugin adds for each, which would otherwise
    keep their layers alive; then containerd's GC frees them (a running container keeps its
    snapshot). Tags written by hand are left alone. Returns the refs removed."""
    rows = [line.split() for line in _ctr(ctr_address, namespace, "images", "ls").splitlines()[1:]]
    manifests = {row[0]: row[2] for row in rows if len(row) > 2}
    current = {image.ref for image in images.images}
    stale = [ref for ref in manifests if OUR_TAG.fullmatch(ref) and ref not in current]

    def config_of(ref: str) -> str:
        manifest = json.loads(_ctr(ctr_address, namespace, "content", "get", manifests[ref]))
        return str(manifest["config"]["digest"])

    def ours(config: str) -> bool:  # ociarchive.image_json writes this history
        history = json.loads(_ctr(ctr_address, namespace, "content", "get", config)).get("history", [])
        return any(str(h.get("created_by", "")).startswith("memstrata local layer") for h in history)

    kept = {config_of(ref) for ref in manifests if ref not in stale and not ref.startswith("sha256:")}
    # Ids whose named ref is gone (removed here or by hand): only if the image is one of ours.
    ids = [ref for ref in manifests if ref.startswith("sha256:") and ref not in kept and ours(ref)]
    if not stale and not ids:
        return []
    log(f"removing {', '.join(sorted(stale)) or 'no tags'} and {len(ids)} CRI image ids from {namespace}")
    _ctr(ctr_address, namespace, "images", "rm", "--sync", *stale, *ids)
    return stale + ids


def _import(address: str, namespace: str, image: Image, present: frozenset[str]) -> None:
    cmd = ctr_command(address, namespace, "images", "import", "-")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdin is not None and proc.stdout is not None
    error = None
    try:
        out = _Progress(proc.stdin, image.ref)
        stream_archive(cast(BinaryIO, out), image.ref, image.layers, image.config, present)
    except (BrokenPipeError, RuntimeError) as e:
        error = e
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
    output = proc.stdout.read().decode(errors="replace").strip()
    if proc.wait() != 0 or error is not None:
        raise RuntimeError(f"ctr images import of {image.ref} failed: {error or ''} {output[-2000:]}".strip())


class _Progress:
    """A line every GiB sent: the runtime's deps take a minute or two to import."""
    STEP = 1 << 30

    def __init__(self, out: IO[bytes], what: str) -> None:
        self.out, self.what, self.sent = out, what, 0

    def write(self, data: bytes) -> int:
        self.out.write(data)
        before, self.sent = self.sent, self.sent + len(data)
        if before // self.STEP != self.sent // self.STEP:
            log(f"{self.what}: {self.sent / (1 << 30):.0f} GiB sent")
        return len(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.realnode.images", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build or find cached layers; print the refs as JSON")
    build.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"default {DEFAULT_CACHE}")
    build.add_argument("--venv", type=Path, default=None, help="the CI venv (default: $VENV, else this python's)")
    build.add_argument("--import", dest="address", metavar="SOCKET", help="then import into containerd at SOCKET")
    build.add_argument("--namespace", default="k8s.io")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    images = build_images(args.cache, args.venv)
    if args.address:
        import_images(args.address, images, args.namespace)
    for image in images.images:
        log(f"{image.ref}  {image.size / (1 << 20):.0f} MiB")
    print(json.dumps(images.refs()))
    log(f"done in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

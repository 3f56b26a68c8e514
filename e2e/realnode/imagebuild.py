"""The layers of memstrata's local images, each built once per content key and cached.

    base      debootstrap bookworm minbase + Debian's python3 and the native engine's shared
              libraries, an empty venv at /opt/memstrata made by that python, users 1000 and 65532
    deps      the third-party packages of one image, copied from the CI venv's site-packages (their
              closure as scripts/image-contents computes it); generated on each import, never
              stored: only its digest is cached (TreeLayer)
    app       one of memstrata's own wheels, built from this checkout and installed into the venv
    pause     a static pause binary

Every function here has side effects (debootstrap, compilers, pip); the keys they are cached
under are computed in e2e/realnode/images.py.
"""
from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

from .ociarchive import Entry, Layer, TreeLayer, tar_layer

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PREFIX = "opt/memstrata"  # the venv inside every image
SITE = f"{PREFIX}/lib/python3.11/site-packages"
PYTHON = f"/{PREFIX}/bin/python"
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
# python3 is 3.11 in bookworm, the ABI of the CI venv's extensions (torch, DeepSpeed's ops).
BASE_PACKAGES = ("python3", "python3-venv", "libaio1", "liburing2", "libnuma1", "ca-certificates", "netbase")
# (uid, name, home): the runtime's user (memstrata.api.podidentity.RUNTIME_UID) and the operator's.
USERS = ((1000, "memstrata", "/home/memstrata"), (65532, "nonroot", "/home/nonroot"))
# Left out of the base: apt's state and the docs are dead weight in an image nobody apt-gets in;
# /dev, /proc and /sys are the runtime's to mount.
BASE_EXCLUDE = ("./var/lib/apt/lists/*", "./var/cache/apt/*", "./usr/share/doc/*", "./usr/share/man/*",
                "./usr/share/info/*", "./usr/share/locale/*", "./dev/*", "./proc/*", "./sys/*",
                "./var/log/*", "./tmp/*", "./run/*")

DEPS_KEEP = 4  # measured deps layers kept per image


def log(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], what: str, **kw: object) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    except FileNotFoundError:
        raise RuntimeError(f"{what}: {cmd[0]} not found (apt-get install debootstrap gcc libc6-dev)") from None
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-3000:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd[:6])} ...\n{tail}")
    return str(proc.stdout)


def cached_layer(cache: Path, name: str, key: str, build: Callable[[Path], Layer]) -> tuple[Layer, bool]:
    """`cache/<name>-<key>/layer.tar`, built by `build(tmpdir)` when absent; older keys of `name`
    are deleted. Returns the layer and whether it was built now."""
    final = cache / f"{name}-{key}"
    meta = final / "layer.json"
    if meta.is_file():
        m = json.loads(meta.read_text())
        return Layer(final / "layer.tar", m["digest"], m["size"]), False
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
    try:
        layer = build(work)
        if layer.path != work / "layer.tar":
            raise RuntimeError(f"{name}: the build left its layer at {layer.path}, not {work / 'layer.tar'}")
        for p in work.iterdir():  # only the layer is kept
            if p.name != "layer.tar":
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        (work / "layer.json").write_text(json.dumps({"digest": layer.digest, "size": layer.size}))
        prune(cache, name, keep=final.name, working=work.name)
        try:
            work.rename(final)
        except OSError:
            if not meta.is_file():  # not another build of the same key finishing first
                raise
            m = json.loads(meta.read_text())
            return Layer(final / "layer.tar", m["digest"], m["size"]), True
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return Layer(final / "layer.tar", layer.digest, layer.size), True


def prune(cache: Path, name: str, keep: str, working: str = "") -> None:
    """Delete the cached artefacts of other keys of `name` (and interrupted builds of it, other
    than the `working` one)."""
    for p in cache.glob(f"{name}-*"):
        if p.name != keep and p.name[len(name) + 1:].split(".")[0].isalnum():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for p in cache.glob(f".{name}-*"):
        if p.name != working and "-" not in p.name[len(name) + 2:]:
            shutil.rmtree(p, ignore_errors=True)


def build_base(work: Path) -> Layer:
    """debootstrap, the venv, the users; then one tar with real mtimes (Debian's .pyc files of the
    standard library check them: zeroed, every container start would recompile it)."""
    root = work / "rootfs"
    t0 = time.monotonic()
    log(f"base: debootstrap bookworm minbase + {','.join(BASE_PACKAGES)} (about a minute)")
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    _run([debootstrap, "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", str(root), MIRROR],
         "debootstrap")
    _run(["chroot", str(root), "python3", "-m", "venv", "--without-pip", f"/{PREFIX}"], "python3 -m venv in the rootfs")
    for p in (root / PREFIX / "bin").glob("[Aa]ctivate*"):
        p.unlink()  # no shell ever activates it: PATH names /opt/memstrata/bin
    for uid, name, home in USERS:
        _run(["chroot", str(root), "groupadd", "--gid", str(uid), name], f"groupadd {name}")
        _run(["chroot", str(root), "useradd", "--uid", str(uid), "--gid", str(uid), "--create-home", "--home-dir",
              home, "--shell", "/usr/sbin/nologin", name], f"useradd {name}")
    layer = tar_layer(root, work / "layer.tar", keep_mtime=True, exclude=BASE_EXCLUDE)
    log(f"base: {layer.size >> 20} MiB in {time.monotonic() - t0:.0f}s")
    return layer


def build_pause(work: Path) -> Layer:
    tree = work / "tree"
    tree.mkdir()
    _run(["gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror", "-s", "-o", str(tree / "pause"),
          str(HERE / "build" / "pause.c")], "gcc -static pause.c (needs libc6-dev)")
    return tar_layer(tree, work / "layer.tar")


def build_app(work: Path, venv_python: Path, project: str) -> Layer:
    """`pip wheel --no-deps` of one floor (operator/ or runtime/, the latter compiles native/) from
    a copy of the checkout, installed by hand into the image's venv layout: pip would write the CI
    venv's python into the console script."""
    src = work / "src"
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so", "dist")
    for part in ("operator", "runtime", "native"):
        shutil.copytree(REPO / part, src / part, ignore=ignore)
    t0 = time.monotonic()
    log(f"app: pip wheel ./{project}")
    # No build isolation: the CI venv has the build requirements, and isolation would fetch them.
    # The temporary directory's name out of the native engine's debug info: the same sources then
    # give the same layer digest.
    env = {**os.environ, "CFLAGS": f"{os.environ.get('CFLAGS', '')} -ffile-prefix-map={src}=.".strip()}
    _run([str(venv_python), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
          "--wheel-dir", str(work / "wheels"), str(src / project)], f"pip wheel ./{project}", env=env)
    wheels = sorted((work / "wheels").glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip wheel ./{project} made {[w.name for w in wheels]}, not one wheel")
    tree = work / "tree"
    install_wheel(wheels[0], tree)
    # Hash-checked .pyc: valid whatever mtime the layer gives the sources (tar_layer zeroes them).
    _run([str(venv_python), "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash", "-d", f"/{SITE}",
          str(tree / SITE)], "compileall")
    shutil.rmtree(src)
    layer = tar_layer(tree, work / "layer.tar")
    log(f"app: {wheels[0].name}, {layer.size >> 10} KiB in {time.monotonic() - t0:.0f}s")
    return layer


def install_wheel(wheel: Path, tree: Path) -> None:
    """Unpack a wheel into `tree`/opt/memstrata the way pip would: purelib/platlib into
    site-packages, console scripts into bin with the image's python in the #! line."""
    site = tree / SITE
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data") and len(parts) > 2:
                if parts[1] not in ("purelib", "platlib"):
                    raise RuntimeError(f"{wheel.name}: {info.filename}: only purelib/platlib data is supported")
                dest = site.joinpath(*parts[2:])
            else:
                dest = site / info.filename
            if info.is_dir():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(info))
            mode = (info.external_attr >> 16) & 0o777
            dest.chmod(0o755 if mode & 0o111 else 0o644)
        eps = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        if eps:
            parser = configparser.ConfigParser(delimiters=("=",))
            parser.optionxform = str  # type: ignore[assignment,method-assign]
            parser.read_string(z.read(eps[0]).decode())
            scripts = parser["console_scripts"] if parser.has_section("console_scripts") else {}
            for name, target in scripts.items():
                module, _, func = target.strip().partition(":")
                script = tree / PREFIX / "bin" / name
                script.parent.mkdir(parents=True, exist_ok=True)
                script.write_text(f"#!{PYTHON}\nimport sys\nfrom {module} import {func}\n"
                                  f"if __name__ == '__main__':\n    sys.exit({func}())\n")
                script.chmod(0o755)
    for d in site.glob("*.dist-info"):
        (d / "INSTALLER").write_text("memstrata-images\n")


def deps_entries(venv_prefix: Path, files: list[str]) -> list[Entry]:
    """The deps layer of one image: `files` (relative to the CI venv) under /opt/memstrata, their
    directories, and console scripts whose #! names the CI venv's python rewritten to the image's."""
    shebang = f"#!{venv_prefix}/bin/python".encode()
    base_dirs = {PREFIX, f"{PREFIX}/bin", f"{PREFIX}/lib", f"{PREFIX}/lib/python3.11", SITE}
    out: dict[str, Entry] = {}
    for rel in files:
        name = f"{PREFIX}/{rel}"
        parent = os.path.dirname(name)
        while parent not in base_dirs and parent not in out:
            out[parent] = Entry(parent)
            parent = os.path.dirname(parent)
        src = venv_prefix / rel
        if rel.startswith("bin/") and not src.is_symlink():
            head = src.read_bytes()
            if head.startswith(shebang):
                line_end = head.index(b"\n")
                # `python`, `python3`, `python3.11`: all three are links to the same in the image
                out[name] = Entry(name, data=f"#!{PYTHON}".encode() + head[line_end:], mode=0o755)
                continue
        out[name] = Entry(name, source=src)
    return [out[k] for k in sorted(out)]


def measure_deps(cache: Path, image: str, key: str, entries: list[Entry]) -> tuple[TreeLayer, bool]:
    """The deps layer's digest and size, cached under its key (one full read of the files when
    not cached: 10 to 30 s for the runtime's 5 GiB, from the page cache or the disk)."""
    meta = cache / f"deps-{image}-{key}.json"
    if meta.is_file():
        m = json.loads(meta.read_text())
        meta.touch()  # recently used: kept by the pruning below
        return TreeLayer(tuple(entries), m["digest"], m["size"]), False
    t0 = time.monotonic()
    log(f"deps {image}: measuring {len(entries)} files")
    layer = TreeLayer.measure(entries)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = meta.with_suffix(".tmp")
    tmp.write_text(json.dumps({"digest": layer.digest, "size": layer.size}))
    tmp.rename(meta)
    # A few bytes each, and a switch between two venvs (the CI one, a copy of it) would otherwise
    # re-read 5 GiB every time: keep the few most recently used keys.
    older = sorted((p for p in cache.glob(f"deps-{image}-*.json") if p.stem[len(image) + 6:].isalnum()),
                   key=lambda p: p.stat().st_mtime, reverse=True)[DEPS_KEEP:]
    for p in older:
        p.unlink()
    log(f"deps {image}: {layer.size >> 20} MiB, {layer.digest[:19]} in {time.monotonic() - t0:.0f}s")
    return layer, True


__all__ = ["build_app", "build_base", "build_pause", "cached_layer", "deps_entries", "install_wheel",
           "measure_deps"]

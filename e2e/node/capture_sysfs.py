"""Capture the parts of a machine's sysfs that memstrata's discovery reads, as a tree.

Run inside the test guest (or any Linux node) as root:

    python3 e2e/node/capture_sysfs.py OUT                      # a tree
    python3 e2e/node/capture_sysfs.py --tar OUT.tar --name NAME  # a tar with NAME/ inside

OUT gets `sys/...` (regular files with their contents, symlinks as relative
symlinks that resolve inside OUT exactly as they do under /sys), `proc/mounts`,
`proc/self/mountinfo`, `proc/partitions`,
and `dev/<ns>.head`, the first 4 KiB of every visible NVMe namespace, so that
filesystem/partition-table signatures can be detected offline. Discovery code
is then tested on the host with OUT/sys as its sysfs root.

What is captured: /sys/devices/system/{node,memory}, /sys/devices/virtual/memory_tiering,
the entries of /sys/bus/cxl/devices, /sys/bus/dax/devices, /sys/class/nvme and
/sys/block with the device directories they link to (recursively) and the
plain attributes of those directories' ancestors (e.g. a PCI function's numa_node).
Unreadable, write-only and large (> 64 KiB) attributes are skipped, and so are
power/, trace/, mq/ and msi_irqs/ directories.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import tempfile
from pathlib import Path

SYS = Path("/sys")
TREES = ("devices/system/node", "devices/system/memory", "devices/virtual/memory_tiering")
LINK_DIRS = ("bus/cxl/devices", "bus/dax/devices", "class/nvme", "block")
MAX_ATTR = 64 << 10
HEAD = 4096
# Binary or side-effecting PCI attributes nothing in memstrata reads.
SKIP_NAMES = {"config", "rom", "remove", "rescan", "reset", "vpd", "label"}
# Per-device runtime-PM, tracing and per-hardware-queue directories: many files,
# nothing discovery reads.
SKIP_DIRS = {"power", "trace", "mq", "msi_irqs"}


class Capture:
    """Copies sysfs paths into `out`, each directory once.

    Walks with os.scandir and copies link text verbatim: on a TCG guest every
    syscall counts, and sysfs links are already relative to their directory.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.done: set[Path] = set()
        self.shallow_done: set[Path] = set()
        self.files = 0

    def dest(self, src: Path | str) -> Path:
        return self.out / os.path.relpath(src, "/")

    def link(self, src: str) -> None:
        text = os.readlink(src)
        # Every walked directory is a real path, so joining is resolving.
        if not os.path.normpath(os.path.join(os.path.dirname(src), text)).startswith(f"{SYS}/"):
            return
        dst = self.dest(src)
        if not os.path.lexists(dst):
            dst.symlink_to(text)

    def attr(self, entry: os.DirEntry[str]) -> None:
        if entry.name in SKIP_NAMES or entry.name.startswith("resource"):
            return
        try:
            if entry.stat(follow_symlinks=False).st_size > MAX_ATTR:
                return
            with open(entry.path, "rb") as f:
                data = f.read(MAX_ATTR + 1)
        except OSError:  # write-only, or the driver refuses: not part of the tree
            return
        if len(data) <= MAX_ATTR:
            self.dest(entry.path).write_bytes(data)
            self.files += 1

    def shallow(self, directory: Path) -> list[os.DirEntry[str]]:
        """A directory's own attributes and links; returns its real subdirectories."""
        self.dest(directory).mkdir(parents=True, exist_ok=True)
        subdirs = []
        for entry in _entries(directory):
            if entry.is_symlink():
                self.link(entry.path)
            elif entry.is_file(follow_symlinks=False):
                self.attr(entry)
            elif entry.is_dir(follow_symlinks=False) and entry.name not in SKIP_DIRS:
                subdirs.append(entry)
        return subdirs

    def tree(self, directory: Path) -> None:
        """A directory recursively, never following symlinks; once, even if reached twice."""
        if directory in self.done or any(p in self.done for p in directory.parents):
            return
        self.done.add(directory)
        self._walk(directory)

    def _walk(self, directory: Path) -> None:
        for sub in self.shallow(directory):
            self._walk(Path(sub.path))

    def linked_device(self, link: Path) -> None:
        """An entry of a /sys/class-style directory: the link, its device tree, its ancestors' attributes."""
        self.link(str(link))
        target = Path(os.path.realpath(link))
        self.tree(target)
        for parent in target.parents:
            if parent == SYS / "devices" or not parent.is_relative_to(SYS / "devices"):
                break
            if parent not in self.shallow_done and not any(p in self.done for p in (parent, *parent.parents)):
                self.shallow_done.add(parent)
                self.shallow(parent)


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []


def capture_heads(out: Path) -> list[str]:
    """First 4 KiB of every visible NVMe namespace (hidden per-path nodes have no /dev entry to read)."""
    names = []
    for block in sorted((SYS / "block").glob("nvme*")):
        hidden = block / "hidden"
        if hidden.exists() and hidden.read_text().strip() == "1":
            continue
        try:
            with open(Path("/dev") / block.name, "rb") as f:
                head = f.read(HEAD)
        except OSError:
            continue
        (out / "dev").mkdir(parents=True, exist_ok=True)
        (out / "dev" / f"{block.name}.head").write_bytes(head)
        names.append(block.name)
    return names


def capture(out: Path) -> Capture:
    cap = Capture(out)
    for tree in TREES:
        if (SYS / tree).is_dir():
            cap.tree(SYS / tree)
    for link_dir in LINK_DIRS:
        cap.dest(SYS / link_dir).mkdir(parents=True, exist_ok=True)
        for entry in _entries(SYS / link_dir):
            if entry.is_symlink():
                cap.linked_device(Path(entry.path))
    for proc in ("mounts", "self/mountinfo", "partitions"):
        (out / "proc" / proc).parent.mkdir(parents=True, exist_ok=True)
        (out / "proc" / proc).write_bytes((Path("/proc") / proc).read_bytes())
    return cap


def capture_tree(out: Path) -> str:
    """Capture into the directory `out` (absent or empty); returns a one-line summary."""
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"capture_sysfs: {out} is not empty; refusing to mix two captures")
    cap = capture(out)
    heads = capture_heads(out)
    return f"captured {cap.files} attributes, {len(cap.done)} directory trees, heads of {heads}"


def capture_tar(tar_path: Path, name: str) -> str:
    """Capture into a tar whose one top directory is `name`, built on local disk first:
    over a 9p share, hundreds of small files take minutes on a TCG guest, one file a moment."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = capture_tree(Path(tmp) / name)
        with tarfile.open(tar_path, "w") as tar:
            tar.add(Path(tmp) / name, arcname=name)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to capture into (absent or empty), or the tar file with --tar")
    parser.add_argument("--tar", action="store_true", help="write OUT as a tar archive instead of a tree")
    parser.add_argument("--name", default="capture", help="top directory inside the tar (default: capture)")
    args = parser.parse_args(argv)
    print(capture_tar(args.out, args.name) if args.tar else capture_tree(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

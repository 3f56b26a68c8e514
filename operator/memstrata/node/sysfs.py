"""Reading a sysfs tree with errors that name the file.

Discovery runs over `/sys` on a node and over captured trees in tests; both
are just directories. Every read goes through `SysfsTree` so that a missing
or garbled attribute becomes one `SysfsError` naming the file and what was
expected, instead of a bare ValueError or a KeyError deep in the parser.
Reading only: nothing here writes, so it is safe to point at the real /sys.
"""
from __future__ import annotations

import builtins
import os
import re
from pathlib import Path


class SysfsError(ValueError):
    """A sysfs tree that cannot be read as a node: names the file and the problem."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_list(text: str) -> list[int]:
    """A kernel list such as `0-3,8,10-11` (cpulist, nodelist, online, has_cpu); empty text is an empty list.

    The one parser of this format: discovery, `memstrata.node.local` and the runtime's NUMA
    façade (memstrata.runtime.strata.numa) all read node and CPU lists with it."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"expected a list like 0-3,8 but found {part!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"range {part!r} runs backwards")
        out.extend(range(lo, hi + 1))
    return out


def parse_int(text: str) -> int:
    """Decimal or 0x-prefixed hexadecimal, as sysfs prints them (CXL sizes are hex)."""
    text = text.strip()
    return int(text, 16) if text.lower().startswith("0x") else int(text, 10)


class SysfsTree:
    """A sysfs root (`/sys` or a capture) with typed, error-naming reads."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def path(self, rel: str | Path) -> Path:
        return self.root / rel

    def exists(self, rel: str | Path) -> bool:
        return self.path(rel).exists()

    def text(self, rel: str | Path, *, required: bool = True) -> str | None:
        """Stripped content of an attribute; None when absent and not required."""
        path = self.path(rel)
        try:
            return path.read_text(errors="replace").strip()
        except FileNotFoundError:
            if required:
                raise SysfsError(path, "missing (the tree is partial or the kernel too old)") from None
            return None
        except IsADirectoryError:
            raise SysfsError(path, "is a directory, expected an attribute file") from None
        except OSError as exc:
            raise SysfsError(path, f"cannot read: {exc.strerror}") from exc

    def int(self, rel: str | Path, *, required: bool = True) -> int | None:
        raw = self.text(rel, required=required)
        if raw is None:
            return None
        try:
            return parse_int(raw)
        except ValueError:
            raise SysfsError(self.path(rel), f"expected an integer, found {raw[:40]!r}") from None

    def ints(self, rel: str | Path, *, required: bool = True) -> list[builtins.int] | None:
        """A whitespace-separated row of integers (a NUMA `distance` file)."""
        raw = self.text(rel, required=required)
        if raw is None:
            return None
        try:
            return [int(x) for x in raw.split()]
        except ValueError:
            raise SysfsError(self.path(rel), f"expected integers separated by spaces, found {raw[:40]!r}") from None

    def int_list(self, rel: str | Path, *, required: bool = True) -> list[builtins.int] | None:
        raw = self.text(rel, required=required)
        if raw is None:
            return None
        try:
            return parse_list(raw)
        except ValueError as exc:
            raise SysfsError(self.path(rel), str(exc)) from None

    def entries(self, rel: str | Path, pattern: str = "*") -> list[str]:
        """Names in a directory matching a glob; an absent directory has none."""
        path = self.path(rel)
        if not path.is_dir():
            return []
        return sorted((p.name for p in path.glob(pattern)), key=_natural)

    def link_name(self, rel: str | Path) -> str | None:
        """Last component of a symlink's target (a `driver` link), without resolving it:
        a capture keeps links whose targets it did not copy."""
        path = self.path(rel)
        if not path.is_symlink():
            return None
        return os.path.basename(os.readlink(path).rstrip("/"))

    def resolve(self, rel: str | Path) -> Path:
        """Where a link leads, relative to the root (`devices/...`), so that captured
        trees and /sys give the same answer."""
        path = self.path(rel)
        real = Path(os.path.realpath(path))
        root = Path(os.path.realpath(self.root))
        try:
            return real.relative_to(root)
        except ValueError:
            raise SysfsError(path, f"links outside the sysfs root ({real})") from None


def _natural(name: str) -> tuple[object, ...]:
    """node10 after node9: sort digit runs as numbers."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))
